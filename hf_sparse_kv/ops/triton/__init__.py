"""Triton kernels of the sparse-KV ops; each function has the signature of its twin in ``..reference``.

Each op here runs on the device of its first tensor argument: Triton launches a kernel on the *current* CUDA device,
so a layer whose pages live on ``cuda:1`` (a ``device_map``, or a whole model on a second GPU) would otherwise run its
kernels on ``cuda:0``, reading the other GPU's memory over the interconnect (or faulting without peer access), and a
CUDA graph captured on ``cuda:1`` would not contain them (:func:`on_its_device`)."""

import functools

import torch

from .block_decode import decode_blocks
from .block_scores import block_scores
from .candidate_mass import candidate_mass
from .candidates import candidate_scores
from .exact import oracle_block_scores, token_scores
from .fp8 import fp8_block_scores, fp8_write
from .linear import decode_linear
from .masked_decode import decode_masked
from .merge import merge_partials
from .paged_write import paged_write
from .product import pq_block_scores, pq_encode, pq_write
from .projected import projected_scores, projected_write
from .quant import quant_block_scores, quant_write
from .token_decode import decode_tokens
from .topk import topk_indices


def on_its_device(launcher):
    """``launcher`` run with the CUDA device of its tensors (the first one given, positionally or by name: an op's
    tensors share one device) as the current device; unchanged where it already is, and for CPU tensors (the
    interpreter)."""

    @functools.wraps(launcher)
    def run(*args, **kwargs):
        device = next(a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        if device.type != "cuda" or device.index == torch.cuda.current_device():
            return launcher(*args, **kwargs)
        with torch.cuda.device(device):
            return launcher(*args, **kwargs)

    return run


block_scores = on_its_device(block_scores)
candidate_mass = on_its_device(candidate_mass)
candidate_scores = on_its_device(candidate_scores)
decode_blocks = on_its_device(decode_blocks)
decode_linear = on_its_device(decode_linear)
decode_masked = on_its_device(decode_masked)
decode_tokens = on_its_device(decode_tokens)
fp8_block_scores = on_its_device(fp8_block_scores)
fp8_write = on_its_device(fp8_write)
merge_partials = on_its_device(merge_partials)
oracle_block_scores = on_its_device(oracle_block_scores)
paged_write = on_its_device(paged_write)
pq_block_scores = on_its_device(pq_block_scores)
pq_encode = on_its_device(pq_encode)
pq_write = on_its_device(pq_write)
projected_scores = on_its_device(projected_scores)
projected_write = on_its_device(projected_write)
quant_block_scores = on_its_device(quant_block_scores)
quant_write = on_its_device(quant_write)
token_scores = on_its_device(token_scores)
topk_indices = on_its_device(topk_indices)

__all__ = [
    "block_scores",
    "candidate_mass",
    "candidate_scores",
    "decode_blocks",
    "decode_linear",
    "decode_masked",
    "decode_tokens",
    "fp8_block_scores",
    "fp8_write",
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
