"""Top-k indices of each row of scores (the selection's last step): the Triton twin of ``reference.topk_indices``.

Two methods, one contract (ascending indices, ties at the threshold to the lowest indices, ``-1`` for ``-inf``),
chosen from the shape alone (:func:`topk_method`; a CUDA graph replays the choice):

``"row"``: one program per row holds the whole row in registers: a radix select finds the ``k``-th largest score,
two bits of its key per step (16 steps, one block-wide reduction each), then a prefix sum writes the selected indices
in ascending order. (4 bits per step, 8 steps of 16-bin counts, was measured 1.2-1.6x slower on an H200: the
per-element work grew more than the reductions saved; benchmarks/RESULTS.md.) The row is held as one tile of ``BN``
lanes, or two (``BN`` + ``BN2``) when that wastes fewer lanes than rounding the row up to a power of two: a row of
8193 blocks (a 128K prompt in 16-token blocks, plus the decoded tokens) is 8192 + 16 lanes instead of 16384.
Fast for many rows; few long rows leave most SMs idle behind 16 sequential reductions.

``"chunks"``: a row is cut into ``C`` chunks of ``BLOCK`` lanes, one program per (row, chunk), and the ``k``-th key
is found 11 + 11 + 10 bits at a time in four launches with no grid-wide sync (the grid depends on the shape only):
pass 0 adds each chunk's histogram of the top 11 bits into the row's histogram (integer atomics: the sums, hence the
result, do not depend on their order); pass 1 has every program reduce that histogram to the bin of the ``k``-th key
(2048 loads, a scan) and add the histogram of the next 11 bits of its keys in that bin; pass 2 likewise for the last
10 bits, and keeps each chunk's count of keys above the 22-bit prefix and, for chunks holding keys with the prefix,
their suffix counts of the last 10 bits; the write pass finds the last digit, then the chunks before it (three loads
each) give each chunk its first output slot and its share of the ties. Any row length; a chunk with few keys in the
bin adds them one atomic each instead of a block-wide histogram, one with none skips it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layout import cdiv

TOPK_MAX_N = 24576  # the longest row "row" holds in registers (16384 + 8192 lanes); longer rows go to "chunks"
DEFAULT_SMS = 132  # an H100 / H200, for the heuristic off CUDA

# "chunks": the key's digits (11 + 11 + 10 bits), the histograms' bins, and a row's histograms in the workspace
_B1: tl.constexpr = tl.constexpr(2048)
_B2: tl.constexpr = tl.constexpr(2048)
_B3: tl.constexpr = tl.constexpr(1024)
HIST_ROW = 2048 + 2048 + 1024
_HIST_ROW: tl.constexpr = tl.constexpr(HIST_ROW)
_NEGINF_HI: tl.constexpr = tl.constexpr(0x1FFF)  # the key of -inf is 0x007FFFFF: its top 22 bits ...
_NEGINF_LO: tl.constexpr = tl.constexpr(0x3FF)  # ... and its last 10


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
def _row_k(KK, counts, i_r, rows_per_seq, HAS_COUNTS: tl.constexpr):
    """The number of entries row ``i_r`` keeps: ``KK = min(k, N)``, or ``min(KK, max(counts[b], 0))`` for the
    sequence ``b = i_r // rows_per_seq`` of per-sequence ``counts [B]``. An int32 scalar."""
    kk = KK + tl.zeros([], dtype=tl.int32)
    if HAS_COUNTS:
        kk = tl.minimum(kk, tl.maximum(tl.load(counts + i_r // rows_per_seq), 0)).to(tl.int32)
    return kk


@triton.jit
def _counts_ge3(b_key, t, one):
    """2 bits per step: the counts of keys ``>= t + j one`` for j = 1, 2, 3 (``one = 2^shift``, uint32), packed in
    21-bit fields of one block-wide int64 sum."""
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
def _select_threshold(b_key, b_key2, kk, lanes, TWO: tl.constexpr, EARLY: tl.constexpr):
    """Radix select over the keys of one tile, or two (``b_key2`` only if ``TWO``; ``lanes`` lanes in all): the
    largest ``t`` with ``count(key >= t) >= kk`` (the kk-th largest key), two bits at a time from the top. A uint32
    scalar; ``kk = 0`` ends at ``t = 2^32 - 1`` (nothing).

    A step counts the keys ``>= t + j 2^shift`` for j = 1, 2, 3 in one block-wide reduction; the two bits taken are
    the number of j whose count reaches kk (the counts fall with j). ``EARLY``: stop as soon as exactly kk keys are
    ``>= t`` (n_t): those are the kk largest, a set the remaining steps would not change (they would raise t to the
    kk-th key, with no tie at it left out), so the selection is the same; continuous scores separate the kk-th key
    from the next within ~20 of the 32 bits."""
    t = tl.zeros([], dtype=tl.uint32)
    n_t = lanes + tl.zeros([], dtype=tl.int32)  # count(key >= 0): every lane
    shift = 30 + tl.zeros([], dtype=tl.int32)
    n_stop = kk if EARLY else kk - kk - 1  # -1: never
    while (shift >= 0) & (n_t != n_stop):
        one = tl.full([], 1, tl.uint32) << shift.to(tl.uint32)
        n_ge = _counts_ge3(b_key, t, one)
        if TWO:
            n_ge += _counts_ge3(b_key2, t, one)
        c1, c2, c3 = (n_ge & 0x1FFFFF).to(tl.int32), ((n_ge >> 21) & 0x1FFFFF).to(tl.int32), (n_ge >> 42).to(tl.int32)
        inc = (c1 >= kk).to(tl.uint32) + (c2 >= kk).to(tl.uint32) + (c3 >= kk).to(tl.uint32)
        n_t = tl.where(inc == 3, c3, tl.where(inc == 2, c2, tl.where(inc == 1, c1, n_t)))
        t += inc << shift.to(tl.uint32)
        shift -= 2
    return t


@triton.jit
def topk_indices_kernel(
    scores,  # [R, N] float32
    counts,  # [B] int64, rows_per_seq rows per sequence (read only if HAS_COUNTS)
    out,  # [R, K] int32
    N,
    K,
    KK,  # min(K, N)
    rows_per_seq,
    HAS_COUNTS: tl.constexpr,
    BN: tl.constexpr,  # lanes of the first tile
    BN2: tl.constexpr,  # lanes of the second tile (0: none)
    BK: tl.constexpr,
    EARLY: tl.constexpr,  # stop the radix select once exactly kk keys are above its threshold (same result)
):
    i_r = tl.program_id(0).to(tl.int64)
    kk = _row_k(KK, counts, i_r, rows_per_seq, HAS_COUNTS)
    row = scores + i_r * N
    o_n = tl.arange(0, BN)
    b_s, b_key = _row_keys(row, o_n, N)
    b_s2, b_key2 = b_s, b_key  # (unused unless BN2 > 0)
    if BN2 > 0:
        o_n2 = BN + tl.arange(0, BN2)
        b_s2, b_key2 = _row_keys(row, o_n2, N)
    t = _select_threshold(b_key, b_key2, kk, BN + BN2, BN2 > 0, EARLY)
    # everything above t, then the first (by index) of the ties at t, never a -inf score; the second tile continues
    # both ranks (ties, selected) where the first ends
    n_gt = tl.sum((b_key > t).to(tl.int32), 0)
    if BN2 > 0:
        n_gt += tl.sum((b_key2 > t).to(tl.int32), 0)
    n_eq, n_sel = _store_selected(out + i_r * K, o_n, b_s, b_key, t, N, kk, n_gt, 0, 0)
    if BN2 > 0:
        _, n_sel2 = _store_selected(out + i_r * K, o_n2, b_s2, b_key2, t, N, kk, n_gt, n_eq, n_sel)
        n_sel += n_sel2
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        tl.store(out + i_r * K + o_k, tl.full([BK], -1, dtype=tl.int32), mask=(o_k >= n_sel) & (o_k < K))


# ------------------------------------------------------------------------------ "chunks": several programs per row


@triton.jit
def _find_bin(p_hist, kk, BINS: tl.constexpr):
    """The bin of a histogram ``[BINS]`` that holds its ``kk``-th largest key (0 < kk <= total, or kk = 0: the last
    bin), and the number of keys in the bins above it."""
    o_b = tl.arange(0, BINS)
    b_h = tl.load(p_hist + o_b)  # [BINS]
    b_ge = tl.sum(b_h, 0) - tl.cumsum(b_h, 0) + b_h  # keys in bins >= o_b (falls with o_b)
    b = tl.max(tl.where(b_ge >= kk, o_b, 0), 0)
    return b, tl.sum(tl.where(o_b > b, b_h, 0), 0)


@triton.jit
def _add_histogram(p_hist, b_digit, m_in, BINS: tl.constexpr, BLOCK: tl.constexpr):
    """Add the histogram of ``b_digit [BLOCK]`` (values in ``[0, BINS)``) where ``m_in`` to ``p_hist [BINS]``: a
    block-wide histogram and one atomic per non-empty bin, or, for few lanes, one atomic per lane (the sums, hence
    the result, do not depend on the order of the atomics)."""
    n_in = tl.sum(m_in.to(tl.int32), 0)
    if n_in > BLOCK // 8:
        b_h = tl.histogram(b_digit, BINS, mask=m_in)
        tl.atomic_add(p_hist + tl.arange(0, BINS), b_h, mask=b_h > 0, sem="relaxed")
    elif n_in > 0:
        tl.atomic_add(p_hist + b_digit, m_in.to(tl.int32), mask=m_in, sem="relaxed")


@triton.jit
def topk_radix_pass_kernel(
    scores,  # [R, N] float32
    counts,  # [B] int64 (read only if HAS_COUNTS, in pass 1)
    hist,  # [R, HIST_ROW] int32, zeroed: the row's histograms of digits 1 (2048), 2 (2048), 3 (1024)
    state,  # [R, 4] int32: after pass 1 (top 11 bits of the k-th key, rank left), after pass 2 (top 22 bits, rank)
    above,  # [R, C, 2] int32: pass 2 writes each chunk's count of keys above the 22-bit prefix, and with it
    suffix,  # [R, C, 1024] int32: pass 2 writes a chunk's count of keys with the prefix and last 10 bits >= d
    N,
    C,
    KK,  # min(k, N)
    rows_per_seq,
    PASS: tl.constexpr,  # 0, 1 or 2
    HAS_COUNTS: tl.constexpr,
    BLOCK: tl.constexpr,  # lanes of a chunk
):
    i_p = tl.program_id(0)
    i_r, i_c = (i_p // C).to(tl.int64), i_p % C
    o_n = i_c * BLOCK + tl.arange(0, BLOCK)
    m_n = o_n < N
    # [BLOCK]
    _, b_key = _row_keys(scores + i_r * N, o_n, N)
    p_hist = hist + i_r * _HIST_ROW
    if PASS == 0:  # histogram of the top 11 bits
        _add_histogram(p_hist, (b_key >> 21).to(tl.int32), m_n, _B1, BLOCK)
    elif PASS == 1:  # the k-th key's top 11 bits, then a histogram of the next 11 among the keys that have them
        kk = _row_k(KK, counts, i_r, rows_per_seq, HAS_COUNTS)
        b1, n_gt = _find_bin(p_hist, kk, _B1)
        kk -= n_gt  # the k-th key's rank among the keys in bin b1
        tl.store(state + i_r * 4 + tl.arange(0, 2), tl.where(tl.arange(0, 2) == 0, b1, kk), mask=i_c == 0)
        m_in = m_n & ((b_key >> 21).to(tl.int32) == b1)
        _add_histogram(p_hist + _B1, ((b_key >> 10) & 0x7FF).to(tl.int32), m_in, _B2, BLOCK)
    else:  # the k-th key's top 22 bits, then the last 10 bits' histogram among the keys that have them
        hi1, kk = tl.load(state + i_r * 4), tl.load(state + i_r * 4 + 1)
        b2, n_gt = _find_bin(p_hist + _B1, kk, _B2)
        hi2, kk = (hi1 << 11) | b2, kk - n_gt
        tl.store(state + i_r * 4 + 2 + tl.arange(0, 2), tl.where(tl.arange(0, 2) == 0, hi2, kk), mask=i_c == 0)
        b_hi = (b_key >> 10).to(tl.int32)
        m_in = m_n & (b_hi == hi2)
        n_in = tl.sum(m_in.to(tl.int32), 0)
        n_above = tl.sum((m_n & (b_hi > hi2)).to(tl.int32), 0)
        tl.store(above + (i_r * C + i_c) * 2 + tl.arange(0, 2), tl.where(tl.arange(0, 2) == 0, n_above, n_in))
        if n_in > 0:  # most chunks have no key with the prefix: their suffix counts are never written nor read
            b_h = tl.histogram((b_key & 0x3FF).to(tl.int32), _B3, mask=m_in)
            tl.atomic_add(p_hist + _B1 + _B2 + tl.arange(0, _B3), b_h, mask=b_h > 0, sem="relaxed")
            # this chunk's keys with the prefix and last 10 bits >= d, for the write pass's prefix over chunks
            b_ge = n_in - tl.cumsum(b_h, 0) + b_h
            tl.store(suffix + (i_r * C + i_c) * _B3 + tl.arange(0, _B3), b_ge)


@triton.jit
def topk_radix_write_kernel(
    scores,  # [R, N] float32
    hist,  # [R, HIST_ROW] int32, after pass 2
    state,  # [R, 4] int32
    above,  # [R, C, 2] int32
    suffix,  # [R, C, 1024] int32 (rows of chunks without a key with the prefix are never written)
    out,  # [R, K] int32
    N,
    C,
    K,
    SPAN,  # cdiv(K, C): the output slots a chunk pads with -1
    BLOCK: tl.constexpr,
    BC: tl.constexpr,  # next_power_of_2(C)
    BK: tl.constexpr,
):
    i_p = tl.program_id(0)
    i_r, i_c = (i_p // C).to(tl.int64), i_p % C
    hi2, kk = tl.load(state + i_r * 4 + 2), tl.load(state + i_r * 4 + 3)
    b3, n_gt3 = _find_bin(hist + i_r * _HIST_ROW + _B1 + _B2, kk, _B3)
    t = (hi2.to(tl.uint32) << 10) | b3.to(tl.uint32)  # the k-th largest key
    # ties at t the row takes (the first by index); none when t is the key of -inf (never select a -inf score)
    quota = tl.where((hi2 == _NEGINF_HI) & (b3 == _NEGINF_LO), 0, kk - n_gt3)
    # per chunk: keys above t (above the 22-bit prefix, or with it and a larger last digit) and ties at t
    o_c = tl.arange(0, BC)
    m_c = o_c < C
    p_suf = suffix + (i_r * C + o_c) * _B3
    # [BC]
    b_gt = tl.load(above + (i_r * C + o_c) * 2, mask=m_c, other=0)
    m_in = m_c & (tl.load(above + (i_r * C + o_c) * 2 + 1, mask=m_c, other=0) > 0)
    b_ge = tl.load(p_suf + b3, mask=m_in, other=0)
    b_gt_last = tl.load(p_suf + b3 + 1, mask=m_in & (b3 + 1 < _B3), other=0)
    b_eq = b_ge - b_gt_last
    b_gt += b_gt_last
    m_before = o_c < i_c
    eq_before = tl.sum(tl.where(m_before, b_eq, 0), 0)
    sel_before = tl.sum(tl.where(m_before, b_gt, 0), 0) + tl.minimum(eq_before, quota)
    n_sel = tl.sum(b_gt, 0) + quota
    o_n = i_c * BLOCK + tl.arange(0, BLOCK)
    # [BLOCK]
    b_s, b_key = _row_keys(scores + i_r * N, o_n, N)
    _store_selected(out + i_r * K, o_n, b_s, b_key, t, N, quota, 0, eq_before, sel_before)
    for i_k in range(0, SPAN, BK):  # this chunk's share of the slots past the last selected one
        o_k = i_k + tl.arange(0, BK)
        o_slot = i_c * SPAN + o_k
        m_k = (o_k < SPAN) & (o_slot >= n_sel) & (o_slot < K)
        tl.store(out + i_r * K + o_slot, tl.full([BK], -1, dtype=tl.int32), mask=m_k)


# ----------------------------------------------------------------------------------------------------- launchers


def row_tiles(N: int, split: bool = True) -> tuple[int, int]:
    """Lanes ``(BN, BN2)`` that hold a row of ``N``: one power-of-two tile, or two when that wastes fewer lanes (and
    ``split``)."""
    one = max(16, triton.next_power_of_2(N))
    if not split or N <= 16 or N == one:
        return one, 0
    first = one // 2
    second = max(16, triton.next_power_of_2(N - first))
    return (first, second) if first + second < one else (one, 0)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a cached host property, no sync); ``DEFAULT_SMS`` off CUDA."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS


def topk_method(N: int) -> str:
    """``"chunks"`` for rows too long to hold in registers (``N > TOPK_MAX_N``), ``"row"`` otherwise. Shapes only:
    a captured step replays the same choice. (Measured on an H200, benchmarks/RESULTS.md: at 8 rows x 8193 blocks
    "chunks" took 22.4-23.0 us in isolation against 24.6 for "row", and a Quest selection in the per-layer graph
    with the L2 flushed took 49.7 us against 38.4 with "row"; at 32 and 64 rows "row" is 1.4-1.8x faster. Past
    24576 lanes "chunks" is 1.2-3.9x faster than ``torch.topk``, which those rows used before.)"""
    return "chunks" if N > TOPK_MAX_N else "row"


def chunk_tiles(R: int, N: int, sms: int = DEFAULT_SMS, chunks: int | None = None) -> tuple[int, int]:
    """Lanes per chunk and chunks per row ``(BLOCK, C)`` of ``"chunks"``: about ``chunks`` per row (default: enough
    for two programs per SM), each a power-of-two tile of 256 to 2048 lanes (16 to 8192 when ``chunks`` is given)."""
    lo, hi = (256, 2048) if chunks is None else (16, 8192)
    chunks = chunks or cdiv(2 * sms, R)
    block = min(hi, max(lo, triton.next_power_of_2(cdiv(N, max(1, chunks)))))
    return block, cdiv(N, block)


def _topk_chunks(x, out, k, counts, rows_per_seq, chunks, sms, num_warps):
    """``"chunks"`` on ``x [R, N]`` float32 into ``out [R, k]``: four launches over (row, chunk) programs."""
    R, N = x.shape
    BLOCK, C = chunk_tiles(R, N, sms, chunks)
    hist = torch.zeros(R, HIST_ROW, dtype=torch.int32, device=x.device)
    state = torch.empty(R, 4, dtype=torch.int32, device=x.device)
    above = torch.empty(R, C, 2, dtype=torch.int32, device=x.device)
    suffix = torch.empty(R, C, 1024, dtype=torch.int32, device=x.device)
    warps = num_warps or (4 if BLOCK <= 2048 else 8)
    has = counts is not None
    for p in range(3):
        topk_radix_pass_kernel[(R * C,)](
            x, counts if has else x, hist, state, above, suffix, N, C, min(k, N), rows_per_seq,
            PASS=p, HAS_COUNTS=has, BLOCK=BLOCK, num_warps=warps,
        )  # fmt: skip
    span = cdiv(k, C)
    topk_radix_write_kernel[(R * C,)](
        x, hist, state, above, suffix, out, N, C, k, span, BLOCK=BLOCK, BC=max(2, triton.next_power_of_2(C)),
        BK=max(16, min(1024, triton.next_power_of_2(span))), num_warps=warps,
    )  # fmt: skip


def topk_indices(
    scores: torch.Tensor,
    k: int,
    counts: torch.Tensor | None = None,
    num_warps: int | None = None,
    split: bool = True,
    method: str = "auto",
    chunks: int | None = None,
    early: bool = True,
) -> torch.Tensor:
    """Top-``k`` indices along the last dim, ascending, ``-1`` where the score is ``-inf``: ``[..., N] -> [..., k]``.

    Ties at the threshold go to the lowest indices (``torch.topk`` leaves that order unspecified). ``k`` may exceed
    ``N`` (the extra slots are ``-1``). ``counts [B]`` (``B`` the leading dim, e.g. ``[B, H, N]`` scores): the rows
    of sequence ``b`` keep ``min(k, counts[b])`` entries, read on the device (no host sync). ``method``: ``"auto"``
    (:func:`topk_method` on the shape), ``"row"`` (one program per row, ``N <= TOPK_MAX_N``) or ``"chunks"`` (about
    ``chunks`` programs per row, :func:`chunk_tiles`). Tuning knobs (the benchmark's): ``num_warps``, ``split``
    (``"row"``: False = one power-of-two tile per row), ``chunks``, ``early`` (``"row"``: False = all 16 steps of
    the radix select, the kernel before the early stop; the same result).
    """
    *lead, N = scores.shape
    if N == 0 or k == 0:
        return torch.full((*lead, k), -1, dtype=torch.int32, device=scores.device)
    R = 1
    for n in lead:
        R *= n
    out = torch.empty(*lead, k, dtype=torch.int32, device=scores.device)
    if R == 0:
        return out
    rows_per_seq = 1
    if counts is not None:
        if not lead or counts.shape != (lead[0],):
            raise ValueError(f"counts must be [{lead[0] if lead else ''}] for scores {tuple(scores.shape)}")
        counts, rows_per_seq = counts.to(scores.device), R // lead[0]
    x = scores.reshape(R, N).float().contiguous()
    if method == "auto":
        method = topk_method(N)
    if method == "chunks":
        _topk_chunks(x, out.view(R, k), k, counts, rows_per_seq, chunks, num_sms(scores.device), num_warps)
        return out
    if method != "row":
        raise ValueError(f"method must be 'auto', 'row' or 'chunks', not {method!r}")
    if N > TOPK_MAX_N:
        raise ValueError(f"method='row' holds rows of at most {TOPK_MAX_N} entries, not {N}: use 'chunks'")
    BN, BN2 = row_tiles(N, split)
    # warps: 4 up to 2048 lanes, 8 from 4096 (H200: 8 beat 16 by 10-20 % from 8192 lanes since the early stop;
    # benchmarks/RESULTS.md, "The top-k taken apart")
    topk_indices_kernel[(R,)](
        x, counts if counts is not None else x, out, N, k, min(k, N), rows_per_seq, HAS_COUNTS=counts is not None,
        BN=BN, BN2=BN2, BK=max(16, min(1024, triton.next_power_of_2(k))), EARLY=early,
        num_warps=num_warps or max(4, min(8, (BN + BN2) // 512)),
    )  # fmt: skip
    return out
