"""Token-sparse paged decode (split-KV, then a log-sum-exp merge): the Triton twin of ``reference.decode_tokens``.

The kernel is ``block_decode``'s (one program per (split, sequence, KV head) holding the group's query heads), in
its token mode: each tile is ``BN`` selected token positions, each mapped through the block table to its own
physical page and offset, so a tile is a gather of ``BN`` rows of ``D`` contiguous elements (scattered loads; the
index costs 4 bytes per token next to the ``4 D`` bytes of bf16 key and value it points to).
Plain-PyTorch reference: ``hf_sparse_kv.ops.reference.decode_tokens``.
"""

from __future__ import annotations

import torch

from .block_decode import sparse_decode_fwd


def decode_tokens_fwd(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_decode.sparse_decode_fwd` over selected token positions; the same tuning knobs."""
    return sparse_decode_fwd(*args, tokens=True, **kwargs)


def decode_tokens(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    tokens: torch.Tensor,
    ex_lo: torch.Tensor,
    ex_hi: torch.Tensor,
    scale: float,
    return_lse: bool = False,
):
    """Token-sparse decode: gather only the selected positions of the paged cache and attend to them.

    Args:
        q: ``[B, Hq, D]``; k_pool, v_pool: ``[NB, Hkv, BS, D]`` (inner dims contiguous); block_table ``[B, MB]``;
            seq_lens, start, ex_lo, ex_hi ``[B]`` (the validity rule, see ``reference``).
        tokens: ``[B, Hkv, T]`` logical positions, ``-1`` padded (a position listed twice counts twice).
        scale: softmax scale.

    Returns:
        ``[B, Hq, D]`` in ``q.dtype`` (and the log-sum-exp ``[B, Hq]`` float32 if ``return_lse``).
    """
    out, lse = decode_tokens_fwd(q, k_pool, v_pool, block_table, seq_lens, start, tokens, ex_lo, ex_hi, scale)
    return (out, lse) if return_lse else out
