"""Per-block selection scores from key metadata, pooled over each GQA group: the twin of ``reference.block_scores``.

One program per (``TPP`` tiles of ``BM`` logical blocks, sequence, KV head), one pass over the metadata of the blocks
in use (blocks past ``seq_lens`` are not read and score ``-inf``); with ``num_stages > 1`` the loop over the tiles is
software-pipelined (the next tile's block-table entries and metadata load while one tile is scored).

Quest's bound ``sum_d max(q_d lo_d, q_d hi_d)`` is computed as two matrix products: for ``q_d >= 0`` the max is
``q_d max(lo_d, hi_d)``, for ``q_d < 0`` it is ``q_d min(lo_d, hi_d)``, so the bound is
``q+ . max(lo, hi) + q- . min(lo, hi)`` with ``q+ = max(q, 0)`` and ``q- = min(q, 0)`` (exact for any lo, hi).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .forced import forced_block, forced_bounds

METHODS = ("quest", "mean")


@triton.jit
def block_scores_kernel(
    q,  # [B, HQ, D]
    kmin,  # [NB, H, D]
    kmax,  # [NB, H, D]
    kmean,  # [NB, H, D]
    block_table,  # [B, MB]
    seq_lens,  # [B]
    start,  # [B] first valid position (the sink starts there)
    out,  # [B, H, MB] float32
    s_mn,  # metadata stride between blocks (elements)
    MB,
    SINK,  # tokens of the sink (when FORCE)
    WINDOW,  # tokens of the window (when FORCE)
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BG: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    QUEST: tl.constexpr,
    FORCE: tl.constexpr,
    F32: tl.constexpr,
    TPP: tl.constexpr,  # tiles of BM blocks a program
    STAGES: tl.constexpr,  # software-pipelining stages of the loop over the tiles
):
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    HQ = H * G

    o_g = tl.arange(0, BG)
    o_d = tl.arange(0, BD)
    m_g = o_g < G
    m_d = o_d < D
    n = tl.load(seq_lens + i_b)
    n_blk = tl.cdiv(n, BS)
    # [BG, BD]
    b_q = tl.load(
        q + (i_b * HQ + i_h * G + o_g)[:, None] * D + o_d[None, :], mask=m_g[:, None] & m_d[None, :], other=0.0
    )
    if F32:
        b_q = b_q.to(tl.float32)
    zero = tl.zeros_like(b_q)
    b_qp = tl.where(b_q > 0, b_q, zero)
    b_qn = tl.where(b_q < 0, b_q, zero)
    if FORCE:
        sink_end, win_start, _ = forced_bounds(n, tl.load(start + i_b), SINK, WINDOW, BS)
    for t in tl.range(0, TPP, num_stages=STAGES):  # TPP tiles of BM blocks, the next tile's loads in flight
        o_m = (i_m * TPP + t) * BM + tl.arange(0, BM)
        m_m = (o_m < n_blk) & (o_m < MB)
        b_phys = tl.load(block_table + i_b * MB + o_m, mask=m_m, other=-1)
        m_live = m_m & (b_phys >= 0)  # evicted blocks (table entry -1) are not read, and score -inf
        o_meta = tl.maximum(b_phys, 0).to(tl.int64) * s_mn + i_h * D  # [BM]
        p_meta = o_meta[:, None] + o_d[None, :]
        m_meta = m_live[:, None] & m_d[None, :]
        if QUEST:
            # [BM, BD]
            b_lo = tl.load(kmin + p_meta, mask=m_meta, other=0.0)
            b_hi = tl.load(kmax + p_meta, mask=m_meta, other=0.0)
            if F32:
                b_lo, b_hi = b_lo.to(tl.float32), b_hi.to(tl.float32)
            b_top = tl.maximum(b_lo, b_hi).to(b_lo.dtype)  # (maximum promotes bf16 to float32; the cast is exact)
            b_bot = tl.minimum(b_lo, b_hi).to(b_lo.dtype)
            if F32:
                b_s = tl.dot(b_qp, tl.trans(b_top), input_precision="ieee")  # [BG, BM]
                b_s += tl.dot(b_qn, tl.trans(b_bot), input_precision="ieee")
            else:
                b_s = tl.dot(b_qp, tl.trans(b_top)) + tl.dot(b_qn, tl.trans(b_bot))
        else:
            # [BM, BD]
            b_mean = tl.load(kmean + p_meta, mask=m_meta, other=0.0)
            if F32:
                b_s = tl.dot(b_q, tl.trans(b_mean.to(tl.float32)), input_precision="ieee")
            else:
                b_s = tl.dot(b_q, tl.trans(b_mean))
        # pool over the group: max over its query heads, -inf past the sequence's last block
        b_s = tl.max(tl.where(m_g[:, None], b_s, float("-inf")), 0)  # [BM]
        if FORCE:  # sink, window and current block: +inf, so that a top-k keeps them
            b_s = tl.where(forced_block(o_m, n_blk, sink_end, win_start, BS), float("inf"), b_s)
        b_s = tl.where(m_live, b_s, float("-inf"))
        tl.store(out + i_bh.to(tl.int64) * MB + o_m, b_s, mask=o_m < MB)


def default_block_m(MB: int) -> int:
    """Blocks scored per program for a table of ``MB`` blocks: 32 (fewer for short tables), with 4 warps.

    Within 4% of the best of 12 settings on average over the targets' shapes (H200, 2026-11-29; 64 blocks, the former
    default, was 13% over: benchmarks/RESULTS.md).
    """
    return max(16, min(32, triton.next_power_of_2(MB)))


def block_scores(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    kmean: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    method: str,
    start: torch.Tensor | None = None,
    sink: int = 0,
    window: int | None = None,
    block_m: int | None = None,
    num_warps: int = 4,
    tiles_per_program: int = 2,
    num_stages: int = 2,
) -> torch.Tensor:
    """Score every block of every sequence from its key metadata, pooled over each GQA group.

    Args:
        q: ``[B, Hq, D]`` decode queries (unscaled).
        kmin, kmax, kmean: ``[NB, Hkv, D]`` (inner dims contiguous).
        block_table: ``[B, MB]``; seq_lens: ``[B]``; block_size: ``BS``.
        method: ``"quest"`` for ``sum_d max(q_d min_d, q_d max_d)``, ``"mean"`` for ``q . mean``.
        start, sink, window: with ``window`` given, the sink (from ``start [B]``), window and current block score
            ``+inf`` (computed in the kernel: no extra launches).
        block_m, num_warps, tiles_per_program, num_stages: tuning knobs (blocks per tile, a power of two >= 16;
            warps per program; tiles a program walks, the next tile's loads issued while one is scored when
            ``num_stages > 1``). The defaults (32 blocks a tile from 32 blocks on, 4 warps, 2 tiles, 2 stages) from
            the H200 (2026-12-04, ``bench_decode.py --tune-quest``, Quest at block size 16, Llama-3-8B layer): 13.9 /
            22.9 us at 1 x 128K / 8 x 32K against 16.3 / 28.9 for one tile a program, within 0.1 us of the best of
            72 points.

    Returns:
        ``[B, Hkv, MB]`` float32, the max over the group's query heads; ``-inf`` past each sequence's last block and
        for evicted blocks (table entry -1), ``+inf`` for forced blocks still held.
    """
    if method not in METHODS:
        raise ValueError(f"method must be 'quest' or 'mean', got {method!r}")
    B, HQ, D = q.shape
    _, H, Dm = kmin.shape
    assert Dm == D and kmax.shape == kmin.shape and kmean.shape == kmin.shape, "metadata must be [NB, Hkv, D]"
    assert HQ % H == 0, f"query heads {HQ} not a multiple of KV heads {H}"
    meta = (kmin, kmax) if method == "quest" else (kmean,)
    for t in meta:
        assert t.stride()[1:] == (D, 1) and t.stride(0) == meta[0].stride(0), f"metadata strides {t.stride()}"
        assert t.dtype == meta[0].dtype, "kmin and kmax must share a dtype"
    assert block_table.dim() == 2 and block_table.shape[0] == B and seq_lens.shape == (B,)
    assert block_size & (block_size - 1) == 0, f"block size must be a power of two, got {block_size}"
    MB = block_table.shape[1]
    out = torch.empty(B, H, MB, dtype=torch.float32, device=q.device)
    if MB == 0:
        return out
    F32 = q.dtype != meta[0].dtype or q.dtype == torch.float32
    BD = max(16, triton.next_power_of_2(D))
    BM = block_m or default_block_m(MB)
    assert BM >= 16 and BM & (BM - 1) == 0, f"block_m must be a power of two >= 16, got {BM}"
    TPP = max(1, min(tiles_per_program, triton.cdiv(MB, BM)))
    grid = (triton.cdiv(MB, BM * TPP), B * H)
    force = window is not None
    if start is None:  # read only when forcing
        start = torch.zeros_like(seq_lens) if force else seq_lens
    block_scores_kernel[grid](
        q.contiguous(), kmin, kmax, kmean, block_table.contiguous(), seq_lens.contiguous(), start.contiguous(), out,
        meta[0].stride(0), MB, sink, window if force else 0,
        H=H, G=HQ // H, D=D, BS=block_size, BG=max(16, triton.next_power_of_2(HQ // H)), BD=BD, BM=BM,
        QUEST=method == "quest", FORCE=force, F32=F32, TPP=TPP, STAGES=num_stages, num_warps=num_warps,
    )  # fmt: skip
    return out
