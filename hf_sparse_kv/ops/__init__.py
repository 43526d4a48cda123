"""The functional API of the sparse-KV ops, and the choice of backend.

Each backend is a namespace exposing the same functions with the signatures of :mod:`.reference`:
``paged_write``, ``gather_dense``, ``block_scores``, ``block_shares``, ``token_scores``, ``oracle_block_scores``,
``topk_indices``, ``blocks_to_tokens``, ``selection_to_mask``, ``decode_blocks``, ``decode_tokens``,
``decode_masked``, ``merge_partials``, and the selectors' ``projected_write``, ``projected_scores``,
``candidate_scores``, ``candidate_mass``, ``quant_write``, ``quant_block_scores``, ``fp8_write``,
``fp8_block_scores``, ``pq_encode``, ``pq_write``, ``pq_block_scores``. The reference backend (plain PyTorch, float32 inside) runs anywhere; the Triton backend runs
on CUDA tensors (or anywhere under ``TRITON_INTERPRET=1``) and falls back to the reference for the ops it does not
implement: :data:`REFERENCE_ONLY` lists them (plain PyTorch on the tensors' device: right, not fast).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from . import reference

BACKENDS = ("auto", "reference", "triton")

_OP_NAMES = (
    "paged_write",
    "gather_dense",
    "block_scores",
    "block_shares",
    "token_scores",
    "oracle_block_scores",
    "topk_indices",
    "blocks_to_tokens",
    "selection_to_mask",
    "decode_blocks",
    "decode_tokens",
    "decode_masked",
    "merge_partials",
    "projected_write",
    "projected_scores",
    "candidate_scores",
    "candidate_mass",
    "quant_write",
    "quant_block_scores",
    "fp8_write",
    "fp8_block_scores",
    "pq_encode",
    "pq_write",
    "pq_block_scores",
)


# the ops without a Triton kernel: the Triton namespace runs their reference (plain tensor code, and block_shares, the
# per-head coarse score of issue 13 measured for quality only so far)
REFERENCE_ONLY = (
    "gather_dense",
    "blocks_to_tokens",
    "selection_to_mask",
    "block_shares",
)


def triton_available() -> bool:
    """Whether the Triton backend can be imported (it needs the ``triton`` package)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Name the backend that runs on ``device``: ``"auto"`` is Triton on CUDA, the reference elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    return "triton" if torch.device(device).type == "cuda" and triton_available() else "reference"


def get_ops(backend: str, device: torch.device | str = "cpu") -> SimpleNamespace:
    """The op namespace for ``backend`` (``"auto"``, ``"reference"`` or ``"triton"``) on ``device``."""
    name = resolve_backend(backend, device)
    ops = {op: getattr(reference, op) for op in _OP_NAMES}
    if name == "triton":
        if not triton_available():
            raise ImportError("backend='triton' needs the triton package: pip install triton")
        from . import triton as triton_ops

        ops.update({op: getattr(triton_ops, op) for op in _OP_NAMES if op not in REFERENCE_ONLY})
    return SimpleNamespace(name=name, **ops)
