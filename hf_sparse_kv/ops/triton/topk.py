"""Top-k indices of each row of scores (the selection's last step): the Triton twin of ``reference.topk_indices``.

One program per row holds the whole row in registers: a radix select finds the ``k``-th largest score, two bits of
its key per step (16 steps, one block-wide reduction each), then a prefix sum writes the selected indices in
ascending order. (4 bits per step, 8 steps of 16-bin counts, was measured 1.2-1.6x slower on an H200: the per-element
work grew more than the reductions saved; benchmarks/RESULTS.md.)

The row is held as one tile of ``BN`` lanes, or two (``BN`` + ``BN2``) when that wastes fewer lanes than rounding the
row up to a power of two: a row of 8193 blocks (a 128K prompt in 16-token blocks, plus the decoded tokens) is
8192 + 16 lanes instead of 16384, which would double the work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference

TOPK_MAX_N = 24576  # the longest row held in registers (16384 + 8192 lanes); longer rows go to torch.topk


@triton.jit
def _row_keys(scores, o_n, N):
    """Load lanes ``o_n`` of a row (``-inf`` past ``N``) and their order-preserving unsigned keys: ``[BN]`` each."""
    b_s = tl.load(scores + o_n, mask=o_n < N, other=float("-inf"))
    b_bits = b_s.to(tl.int32, bitcast=True)
    # negative floats have their magnitude bits flipped, then the sign bit is flipped: unsigned order = float order
    b_key = tl.where(b_bits < 0, b_bits ^ 0x7FFFFFFF, b_bits).to(tl.uint32, bitcast=True)
    b_key = b_key ^ tl.full([], 2147483648, tl.uint32)
    return b_s, b_key


@triton.jit
def _counts_ge3(b_key, t, shift):
    """2 bits per step: the counts of keys ``>= t + j 2^shift`` for j = 1, 2, 3, packed in 21-bit fields of one
    block-wide int64 sum."""
    one = tl.full([], 1 << shift, tl.uint32)
    return tl.sum(
        (b_key >= t + one).to(tl.int64)
        + ((b_key >= t + 2 * one).to(tl.int64) << 21)
        + ((b_key >= t + 3 * one).to(tl.int64) << 42),
        0,
    )


@triton.jit
def _store_selected(out_row, o_n, b_s, b_key, t, N, KK, n_gt, eq_before, sel_before):
    """Write one tile's selected lane indices ``o_n`` to ``out_row`` in ascending order: every key above the
    threshold ``t`` (``n_gt`` of them in the whole row), then the ties at ``t`` by index until ``KK``; never a ``-inf``
    score. ``eq_before``/``sel_before``: ties and selected lanes of the tiles before. Returns this tile's (ties,
    selected)."""
    m_gt, m_eq = b_key > t, b_key == t
    rank_eq = eq_before + tl.cumsum(m_eq.to(tl.int32), 0)  # inclusive rank among the row's ties
    m_sel = (m_gt | (m_eq & (rank_eq <= KK - n_gt))) & (b_s != float("-inf")) & (o_n < N)
    o_slot = sel_before + tl.cumsum(m_sel.to(tl.int32), 0) - 1  # slot = selected lanes before this one
    tl.store(out_row + o_slot, o_n.to(tl.int32), mask=m_sel)
    return tl.sum(m_eq.to(tl.int32), 0), tl.sum(m_sel.to(tl.int32), 0)


@triton.jit
def topk_indices_kernel(
    scores,  # [R, N] float32
    out,  # [R, K] int32
    N,
    K,
    KK,  # min(K, N)
    BN: tl.constexpr,  # lanes of the first tile
    BN2: tl.constexpr,  # lanes of the second tile (0: none)
    BK: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    row = scores + i_r * N
    o_n = tl.arange(0, BN)
    b_s, b_key = _row_keys(row, o_n, N)
    if BN2 > 0:
        o_n2 = BN + tl.arange(0, BN2)
        b_s2, b_key2 = _row_keys(row, o_n2, N)
    # radix select: the largest t with count(key >= t) >= KK (the KK-th largest key), two bits at a time from the
    # top. A step counts the keys >= t + j 2^shift for j = 1, 2, 3 in one block-wide reduction; the two bits taken
    # are the number of j whose count reaches KK (the counts fall with j).
    t = tl.zeros([], dtype=tl.uint32)
    for step in tl.static_range(16):
        shift = 30 - 2 * step  # a compile-time constant (the loop is unrolled)
        n_ge = _counts_ge3(b_key, t, shift)
        if BN2 > 0:
            n_ge += _counts_ge3(b_key2, t, shift)
        inc = ((n_ge & 0x1FFFFF) >= KK).to(tl.uint32) + (((n_ge >> 21) & 0x1FFFFF) >= KK).to(tl.uint32)
        inc += ((n_ge >> 42) >= KK).to(tl.uint32)
        t += inc << shift
    # everything above t, then the first (by index) of the ties at t, never a -inf score; the second tile continues
    # both ranks (ties, selected) where the first ends
    n_gt = tl.sum((b_key > t).to(tl.int32), 0)
    if BN2 > 0:
        n_gt += tl.sum((b_key2 > t).to(tl.int32), 0)
    n_eq, n_sel = _store_selected(out + i_r * K, o_n, b_s, b_key, t, N, KK, n_gt, 0, 0)
    if BN2 > 0:
        _, n_sel2 = _store_selected(out + i_r * K, o_n2, b_s2, b_key2, t, N, KK, n_gt, n_eq, n_sel)
        n_sel += n_sel2
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        tl.store(out + i_r * K + o_k, tl.full([BK], -1, dtype=tl.int32), mask=(o_k >= n_sel) & (o_k < K))


def row_tiles(N: int, split: bool = True) -> tuple[int, int]:
    """Lanes ``(BN, BN2)`` that hold a row of ``N``: one power-of-two tile, or two when that wastes fewer lanes (and
    ``split``)."""
    one = max(16, triton.next_power_of_2(N))
    if not split or N <= 16 or N == one:
        return one, 0
    first = one // 2
    second = max(16, triton.next_power_of_2(N - first))
    return (first, second) if first + second < one else (one, 0)


def topk_indices(
    scores: torch.Tensor,
    k: int,
    counts: torch.Tensor | None = None,
    num_warps: int | None = None,
    split: bool = True,
) -> torch.Tensor:
    """Top-``k`` indices along the last dim, ascending, ``-1`` where the score is ``-inf``: ``[..., N] -> [..., k]``.

    Ties at the threshold go to the lowest indices (``torch.topk`` leaves that order unspecified). ``k`` may exceed
    ``N`` (the extra slots are ``-1``). Rows longer than ``TOPK_MAX_N``, and per-sequence ``counts [B]`` below ``k``
    (left-padded batches), use the reference (``torch.topk``). Tuning knobs (the benchmark's): ``num_warps``,
    ``split`` (False: one power-of-two tile per row).
    """
    *lead, N = scores.shape
    varying = counts is not None and bool((counts.to(scores.device) < min(k, N)).any())
    if N > TOPK_MAX_N or N == 0 or k == 0 or varying:
        return reference.topk_indices(scores, k, counts)
    R = 1
    for n in lead:
        R *= n
    out = torch.empty(*lead, k, dtype=torch.int32, device=scores.device)
    if R == 0:
        return out
    BN, BN2 = row_tiles(N, split)
    topk_indices_kernel[(R,)](
        scores.reshape(R, N).float().contiguous(), out, N, k, min(k, N), BN=BN, BN2=BN2,
        BK=max(16, min(1024, triton.next_power_of_2(k))),
        num_warps=num_warps or max(4, min(16, (BN + BN2) // 512)),
    )  # fmt: skip
    return out
