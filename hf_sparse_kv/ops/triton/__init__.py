"""Triton kernels of the sparse-KV ops; each function has the signature of its twin in ``..reference``."""

from .block_decode import decode_blocks
from .block_scores import block_scores
from .candidate_mass import candidate_mass
from .candidates import candidate_scores
from .exact import oracle_block_scores, token_scores
from .masked_decode import decode_masked
from .merge import merge_partials
from .paged_write import paged_write
from .product import pq_block_scores, pq_encode, pq_write
from .projected import projected_scores, projected_write
from .quant import quant_block_scores, quant_write
from .token_decode import decode_tokens
from .topk import topk_indices

__all__ = [
    "block_scores",
    "candidate_mass",
    "candidate_scores",
    "decode_blocks",
    "decode_masked",
    "decode_tokens",
    "merge_partials",
    "oracle_block_scores",
    "paged_write",
    "pq_block_scores",
    "pq_encode",
    "pq_write",
    "projected_scores",
    "projected_write",
    "quant_block_scores",
    "quant_write",
    "token_scores",
    "topk_indices",
]
