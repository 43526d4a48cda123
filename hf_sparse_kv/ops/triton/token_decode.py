"""Token-sparse paged decode (split-KV, then a log-sum-exp merge): the Triton twin of ``reference.decode_tokens``.

Same structure as ``block_decode``: one program per (split, sequence, KV head) holding the group's query heads;
each tile is ``BN`` selected token positions, each mapped through the block table to its own physical page and
offset, so a tile is a gather of ``BN`` rows of ``D`` contiguous elements (scattered loads; the index costs 4 bytes
per token next to the ``4 D`` bytes of bf16 key and value it points to).
Plain-PyTorch reference: ``hf_sparse_kv.ops.reference.decode_tokens``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_decode import LOG2E, attend_tile, check_decode_args, default_block_n, default_num_splits, store_split
from .merge import merge_partials_fwd


@triton.jit
def token_rows(
    tokens,
    block_table,
    i_bh,
    i_b,
    i_h,
    i_t,
    T,
    MB,
    s_kn,
    st,
    seq_len,
    lo,
    hi,
    BS: tl.constexpr,
    BN: tl.constexpr,
    D: tl.constexpr,
):
    """Pool offsets ``[BN]`` and validity ``[BN]`` of the rows of tile ``i_t`` of a (sequence, head)'s tokens."""
    o_i = i_t * BN + tl.arange(0, BN)
    # [BN] selected positions
    b_pos = tl.load(tokens + i_bh * T + o_i, mask=o_i < T, other=-1)
    m_n = (b_pos >= 0) & (b_pos >= st) & (b_pos < seq_len) & ((b_pos < lo) | (b_pos >= hi))
    b_pc = tl.maximum(b_pos, 0)
    b_phys = tl.load(block_table + i_b * MB + tl.minimum(b_pc // BS, MB - 1))
    o_kv = tl.maximum(b_phys, 0).to(tl.int64) * s_kn + (i_h * BS + b_pc % BS) * D
    return o_kv, m_n


@triton.jit
def token_decode_fwd_kernel(
    q,  # [B, HQ, D]
    k,  # [NB, H, BS, D]
    v,  # [NB, H, BS, D]
    block_table,  # [B, MB]
    seq_lens,  # [B]
    start,  # [B]
    tokens,  # [B, H, T] logical positions, -1 padded
    ex_lo,  # [B]
    ex_hi,  # [B]
    o,  # [B, HQ, S, D] partial outputs
    lse,  # [B, HQ, S] float32 partial log-sum-exp
    qk_scale,  # softmax scale * log2(e)
    s_kn,  # pool stride between blocks (elements)
    T,
    MB,
    S,
    TILES_PER_SPLIT,
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BG: tl.constexpr,
    BD: tl.constexpr,
    BN: tl.constexpr,
    F32: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    i_s, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    HQ = H * G

    o_g = tl.arange(0, BG)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    # [BG, BD] the group's query heads
    p_q = q + (i_b * HQ + i_h * G + o_g)[:, None] * D + o_d[None, :]
    b_q = tl.load(p_q, mask=(o_g < G)[:, None] & m_d[None, :], other=0.0)

    seq_len = tl.load(seq_lens + i_b)
    st = tl.load(start + i_b)
    lo = tl.load(ex_lo + i_b)
    hi = tl.load(ex_hi + i_b)

    b_m = tl.full([BG], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BG], dtype=tl.float32)
    b_acc = tl.zeros([BG, BD], dtype=tl.float32)

    # the last split may run past the selection: those rows load index -1 and are masked
    t0 = i_s * TILES_PER_SPLIT
    o_kv, m_n = token_rows(tokens, block_table, i_bh, i_b, i_h, t0, T, MB, s_kn, st, seq_len, lo, hi, BS, BN, D)
    for i_t in range(t0, t0 + TILES_PER_SPLIT):
        if not PREFETCH:
            o_kv, m_n = token_rows(
                tokens, block_table, i_bh, i_b, i_h, i_t, T, MB, s_kn, st, seq_len, lo, hi, BS, BN, D
            )
        # [BN, BD] gathered key and value rows; masked rows are not read
        m_kv = m_n[:, None] & m_d[None, :]
        b_k = tl.load(k + o_kv[:, None] + o_d[None, :], mask=m_kv, other=0.0)
        b_v = tl.load(v + o_kv[:, None] + o_d[None, :], mask=m_kv, other=0.0)
        if PREFETCH:  # the next tile's index loads, while this tile's keys and values are in flight
            o_kv_nx, m_n_nx = token_rows(
                tokens, block_table, i_bh, i_b, i_h, i_t + 1, T, MB, s_kn, st, seq_len, lo, hi, BS, BN, D
            )
        b_m, b_l, b_acc = attend_tile(b_q, b_k, b_v, m_n, b_m, b_l, b_acc, qk_scale, F32)
        if PREFETCH:
            o_kv, m_n = o_kv_nx, m_n_nx

    store_split(o, lse, b_m, b_l, b_acc, i_b, i_h, i_s, S, HQ, G, D, BG, BD)


def decode_tokens_fwd(
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
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    prefetch: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch stage 1 (and the merge when there is more than one split); returns (out ``[B, Hq, D]``, lse ``[B, Hq]``).

    Tuning knobs as in ``block_decode.decode_blocks_fwd``.
    """
    B, HQ, H, G, D, BS, MB = check_decode_args(q, k_pool, v_pool, block_table, seq_lens, start, tokens, ex_lo, ex_hi)
    T = tokens.shape[-1]
    q, tokens, block_table = q.contiguous(), tokens.contiguous(), block_table.contiguous()
    F32 = q.dtype != k_pool.dtype or k_pool.dtype == torch.float32
    BN = block_n or default_block_n(D, 4 if F32 else k_pool.element_size())
    assert BN >= 16 and BN & (BN - 1) == 0, f"block_n must be a power of two >= 16, got {BN}"
    n_tiles = triton.cdiv(T, BN)
    S = num_splits or default_num_splits(B * H, n_tiles, q.device)
    S = max(1, min(S, max(n_tiles, 1)))
    tiles_per_split = triton.cdiv(n_tiles, S) if n_tiles else 0
    S = triton.cdiv(n_tiles, tiles_per_split) if n_tiles else 1

    out = torch.empty(B, HQ, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, HQ, dtype=torch.float32, device=q.device)
    if S == 1:
        o_part, lse_part = out, lse
    else:
        o_part = torch.empty(B, HQ, S, D, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(B, HQ, S, dtype=torch.float32, device=q.device)
    grid = (S, B * H)
    token_decode_fwd_kernel[grid](
        q, k_pool, v_pool, block_table, seq_lens.contiguous(), start.contiguous(), tokens, ex_lo.contiguous(),
        ex_hi.contiguous(), o_part, lse_part, scale * LOG2E, k_pool.stride(0), T, MB, S, tiles_per_split,
        H=H, G=G, D=D, BS=BS, BG=max(16, triton.next_power_of_2(G)), BD=max(16, triton.next_power_of_2(D)), BN=BN,
        F32=F32, PREFETCH=prefetch, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if S > 1:
        merge_partials_fwd(o_part, lse_part, out=out, lse_out=lse)
    return out, lse


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
