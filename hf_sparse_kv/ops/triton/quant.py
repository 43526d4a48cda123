"""Low-bit keys for selection: the Triton twins of ``reference.quant_write`` and ``reference.quant_block_scores``.

A key's codes are ``bits``-bit steps on its block's per-channel ``[min, max]`` grid, packed planar: byte ``i`` of a
token holds channels ``i, i + W, ...`` (``W = D * bits // 8``), so a kernel handles the ``8 // bits`` channel slices
``[j W, (j + 1) W)`` one at a time, each a ``[BS, W]`` tile a block, and never unpacks across bytes.

- :func:`quant_write`: one program per (logical block touched by the write, sequence, KV head) loads the block's
  filled prefix, takes each channel's min / max over it (the cache's ``kmin`` / ``kmax``), codes every slot
  (``floor((k - min) / delta + 0.5)``, IEEE divisions as the reference's) and stores the block's codes; slots past
  the prefix get 0. The grid is sized by ``span`` (``cdiv(span, BS) + 1`` blocks per sequence), a program past the
  last block written returns: a captured step replays it.
- :func:`quant_block_scores`: :func:`quant_block_lse`, then :func:`quant_lse_mass`. The scoring kernel computes, per
  (logical block, sequence, KV head) and for each of the group's ``G`` query heads, the log-sum-exp over the block's
  valid positions of ``scale * q . k_hat`` with ``k_hat = min + code * delta`` (``reference.quant_block_lse``), in
  one of four layouts (:data:`LAYOUTS`, defaults in :data:`LSE_DEFAULTS`): ``"slices"`` (a block at a time,
  ``q . min + sum_j (q_j * delta_j) . code_j``, no dequantized key, ``tl.dot``s of the group's step-scaled queries
  with the codes), ``"tile"`` (a tile of blocks' keys dequantized in registers, one ``tl.dot`` a slice),
  ``"wide"`` (the same tile unpacked to every channel, one ``tl.dot`` of depth ``D``; 2026-12-01 sweep on an H200:
  wide 4 / 4 127.6 us at 2 bits, 131.4 at 4 bits at 1 x 128K, 8.1x / 5.6x the time of their bytes) and ``"diag"``
  (slices' algebra over a tile: the step-scaled queries of every block of the tile stacked as one operand's rows,
  the codes as exact 16-bit floats the other, the block-diagonal of each slice's product kept; ``"diag_kq"`` the
  same product transposed, the default: 2026-12-03 sweep on an H200, diag_kq 4 / 4 104.9 us at 2 bits, 102.1 at
  4 bits at 1 x 128K, against wide's 127.9 / 132.0 in the same run).
  A fourth form, the tile with the dot products as float32 FMAs, was timed 3-9x slower on an H200 and removed; a
  pipelined multi-tile loop layout (a few programs a row, each walking a range of tiles) was timed slower than
  wide at every point and removed too (benchmarks/RESULTS.md). It reads the codes (``bits / 16`` of 16-bit keys) and
  the blocks' min / max. The tail turns the ``[B, Hq, MB]`` log-sum-exps into each head's softmax shares summed over
  the group (the reference's mass), with the forced blocks at ``+inf``, in two launches over chunks of blocks
  (:func:`quant_lse_stats_kernel`, :func:`quant_mass_kernel`). ``dot="bf16"`` (tile, wide) rounds the ``tl.dot``
  operands to bf16 instead of TF32: a timing probe only (wide's untimed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .forced import forced_block, forced_bounds
from .written import written_block


@triton.jit
def quant_write_kernel(
    codes,  # [NB, H, BS, W] uint8
    k_pool,  # [NB, H, BS, D]
    block_table,  # [B, MB]
    lo,  # [B]
    hi,  # [B]
    s_pn,  # key pool stride between blocks
    s_cn,  # codes stride between blocks
    MB,
    H: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    BS: tl.constexpr,
    BITS: tl.constexpr,
):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    _, b_hi, lb, b_phys, ok = written_block(lo, hi, block_table, i_b, i_n, MB, BS)
    if not ok:
        return
    fill = tl.minimum(b_hi - lb * BS, BS)
    L: tl.constexpr = (1 << BITS) - 1
    PER: tl.constexpr = 8 // BITS
    o_t = tl.arange(0, BS)
    o_w = tl.arange(0, W)
    m_t = o_t < fill
    base = b_phys * s_pn + i_h * BS * D
    packed = tl.zeros([BS, W], dtype=tl.int32)
    for j in tl.static_range(PER):
        b_k = tl.load(k_pool + base + o_t[:, None] * D + j * W + o_w[None, :], mask=m_t[:, None], other=0.0)
        b_k = b_k.to(tl.float32)  # [BS, W]
        b_min = tl.min(tl.where(m_t[:, None], b_k, float("inf")), 0)  # [W]
        b_max = tl.max(tl.where(m_t[:, None], b_k, float("-inf")), 0)
        delta = tl.math.div_rn(b_max - b_min, tl.full([W], L, tl.float32))
        step = tl.where(delta > 0, delta, 1.0)
        c = tl.math.floor(tl.math.div_rn(b_k - b_min[None, :], step[None, :]) + 0.5)
        c = tl.minimum(tl.maximum(c, 0.0), L * 1.0)
        c = tl.where((delta > 0)[None, :] & m_t[:, None], c, 0.0).to(tl.int32)
        packed = packed | (c << (j * BITS))
    p_c = codes + b_phys * s_cn + i_h * BS * W + o_t[:, None] * W + o_w[None, :]
    tl.store(p_c, packed.to(tl.uint8))


def quant_write(
    codes: torch.Tensor,
    k_pool: torch.Tensor,
    block_table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    span: int,
    bits: int,
) -> None:
    """Re-code, in place, every token of the blocks holding the stored positions ``lo[b] <= p < hi[b]`` (the contract
    of ``reference.quant_write``).

    Args:
        codes: ``[NB, Hkv, BS, D * bits // 8]`` uint8 (inner dims contiguous); k_pool: ``[NB, Hkv, BS, D]`` (inner
        dims contiguous); block_table: ``[B, MB]``; lo, hi: ``[B]``; span: a host int ``>= max(hi - lo)``; bits: 2
        or 4.
    """
    NB, H, BS, D = k_pool.shape
    reference.quant_levels(bits)
    W = D * bits // 8
    assert codes.shape == (NB, H, BS, W) and codes.dtype == torch.uint8, f"{codes.shape} {codes.dtype} {k_pool.shape}"
    assert k_pool.stride()[1:] == (BS * D, D, 1) and codes.stride()[1:] == (BS * W, W, 1)
    assert triton.next_power_of_2(W) == W and triton.next_power_of_2(BS) == BS, "power-of-two tiles"
    B = block_table.shape[0]
    assert lo.shape == (B,) and hi.shape == (B,)
    if span <= 0 or B == 0:
        return
    quant_write_kernel[(triton.cdiv(span, BS) + 1, B * H)](
        codes, k_pool, block_table.contiguous(), lo.contiguous(), hi.contiguous(), k_pool.stride(0), codes.stride(0),
        block_table.shape[1], H=H, D=D, W=W, BS=BS, BITS=bits, num_warps=4,
    )  # fmt: skip


@triton.jit
def quant_block_lse_kernel(
    q,  # [B, HQ, D]
    codes,  # [NB, H, BS, W] uint8
    kmin,  # [NB, H, D]
    kmax,  # [NB, H, D]
    block_table,  # [B, MB]
    seq_lens,  # [B]
    start,  # [B]
    out,  # [B, HQ, MB] float32
    s_cn,
    s_mn,
    scale,
    MB,
    HQ: tl.constexpr,
    H: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    BS: tl.constexpr,
    BITS: tl.constexpr,
    TPP: tl.constexpr,
):
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    L: tl.constexpr = (1 << BITS) - 1
    PER: tl.constexpr = 8 // BITS
    n = tl.load(seq_lens + i_b)
    s0 = tl.load(start + i_b)
    o_t = tl.arange(0, BS)
    o_w = tl.arange(0, W)
    o_d = tl.arange(0, D)
    o_g = tl.arange(0, GP)
    m_g = o_g < G
    p_q = q + (i_b * HQ + i_h * G + o_g) * D  # [GP] rows of the group's queries
    b_q = tl.load(p_q[:, None] + o_d[None, :], mask=m_g[:, None], other=0.0).to(tl.float32)  # [GP, D]
    for i in range(TPP):
        lb = i_m * TPP + i
        if lb < MB:
            b_phys = tl.load(block_table + i_b * MB + lb).to(tl.int64)
            pos = lb * BS + o_t
            ok = (pos < n) & (pos >= s0) & (b_phys >= 0)
            b_phys = tl.maximum(b_phys, 0)
            p_m = b_phys * s_mn + i_h * D
            b_c = tl.load(codes + b_phys * s_cn + i_h * BS * W + o_t[:, None] * W + o_w[None, :]).to(tl.int32)
            b_lo = tl.load(kmin + p_m + o_d).to(tl.float32)  # [D]
            s = tl.sum(b_q * b_lo[None, :], 1)[:, None] + tl.zeros([GP, BS], dtype=tl.float32)  # q . min
            for j in tl.static_range(PER):
                q_j = tl.load(p_q[:, None] + j * W + o_w[None, :], mask=m_g[:, None], other=0.0).to(tl.float32)
                lo_j = tl.load(kmin + p_m + j * W + o_w).to(tl.float32)
                hi_j = tl.load(kmax + p_m + j * W + o_w).to(tl.float32)
                qd = q_j * tl.math.div_rn(hi_j - lo_j, tl.full([W], L, tl.float32))[None, :]  # [GP, W]
                c_j = ((b_c >> (j * BITS)) & L).to(tl.float32)  # [BS, W]
                s += tl.dot(qd, tl.trans(c_j), input_precision="tf32")  # [GP, BS]
            s = tl.where(ok[None, :], s * scale, float("-inf"))
            mx = tl.max(s, 1)  # [GP]
            safe = tl.where(mx > float("-inf"), mx, 0.0)
            lse = tl.where(mx > float("-inf"), safe + tl.log(tl.sum(tl.exp(s - safe[:, None]), 1)), float("-inf"))
            tl.store(out + (i_b * HQ + i_h * G + o_g) * MB + lb, lse, mask=m_g)


@triton.jit
def _tile_codes(
    codes, block_table, n, s0, s_cn, s_mn, i_m, i_b, i_h, MB,
    D: tl.constexpr, W: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr,
):  # fmt: skip
    """The codes of tile ``i_m`` (``BM`` logical blocks ``i_m * BM ...``) of sequence ``i_b`` (length ``n``, first
    valid position ``s0``): ``(o_m [BM] the blocks, m_live [BM] held and in the table, ok [BM, BS] the valid
    positions, b_c [BM, BS, W] int32 the packed codes, p_m [BM] each block's offset into kmin / kmax)``. Blocks not
    held load nothing (codes 0, every position invalid)."""
    o_m = i_m * BM + tl.arange(0, BM)
    b_phys = tl.load(block_table + i_b * MB + o_m, mask=o_m < MB, other=-1).to(tl.int64)
    m_live = b_phys >= 0
    o_t = tl.arange(0, BS)
    o_w = tl.arange(0, W)
    pos = o_m[:, None] * BS + o_t[None, :]  # [BM, BS]
    ok = (pos < n) & (pos >= s0) & m_live[:, None]
    b_phys = tl.maximum(b_phys, 0)
    p_c = codes + (b_phys * s_cn + i_h * BS * W)[:, None, None] + o_t[None, :, None] * W + o_w[None, None, :]
    # [BM, BS, W]
    b_c = tl.load(p_c, mask=m_live[:, None, None], other=0).to(tl.int32)
    return o_m, m_live, ok, b_c, b_phys * s_mn + i_h * D


@triton.jit
def _dequant_slice(
    kmin, kmax, p_m, m_live, b_c, j: tl.constexpr, W: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr,
    BITS: tl.constexpr,
):  # fmt: skip
    """Slice ``j`` (channels ``[j W, (j + 1) W)``) of the tile's dequantized keys, ``[BM * BS, W]`` float32:
    ``min + code * (max - min) / L`` with each block's ``[W]`` min / max loaded once and broadcast over its ``BS``
    rows, ``1 / L`` a multiplication (within an ulp of the reference's division: this only ranks blocks)."""
    L: tl.constexpr = (1 << BITS) - 1
    o_w = tl.arange(0, W)
    p = p_m[:, None] + j * W + o_w[None, :]
    b_lo = tl.load(kmin + p, mask=m_live[:, None], other=0.0).to(tl.float32)  # [BM, W]
    b_hi = tl.load(kmax + p, mask=m_live[:, None], other=0.0).to(tl.float32)
    b_d = (b_hi - b_lo) * (1.0 / L)
    b_k = b_lo[:, None, :] + ((b_c >> (j * BITS)) & L).to(tl.float32) * b_d[:, None, :]  # [BM, BS, W]
    return tl.reshape(b_k, (BM * BS, W))


@triton.jit
def _store_tile_lse(out, s, ok, scale, o_m, o_g, m_g, row0, MB, GP: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr):
    """Store a tile's per-block log-sum-exps: ``s [GP, BM * BS]`` unscaled logits of the group's heads (rows
    ``row0 + o_g`` of ``out [B, HQ, MB]``, ``m_g`` the real ones), ``ok [BM, BS]`` the valid positions, ``o_m [BM]``
    the blocks. A block with no valid position gets ``-inf`` (shifted by 0 there: never ``-inf - -inf``)."""
    s3 = tl.where(ok[None, :, :], tl.reshape(s, (GP, BM, BS)) * scale, float("-inf"))
    mx = tl.max(s3, 2)  # [GP, BM]
    safe = tl.where(mx > float("-inf"), mx, 0.0)
    lse = tl.where(mx > float("-inf"), safe + tl.log(tl.sum(tl.exp(s3 - safe[:, :, None]), 2)), float("-inf"))
    tl.store(out + (row0 + o_g)[:, None] * MB + o_m[None, :], lse, mask=m_g[:, None] & (o_m < MB)[None, :])


@triton.jit
def _dot(a, b, BF16: tl.constexpr):
    """``a [M, K] x b [K, N]`` float32, the precision the ``dot`` knob names: TF32 on a GPU, or with ``BF16`` both
    operands rounded to bf16 first (float32 accumulate: a timing probe, ~4e-3 relative on the logits)."""
    if BF16:
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), out_dtype=tl.float32)
    else:
        out = tl.dot(a, b, input_precision="tf32")
    return out


@triton.jit
def _tile_logits(
    q, kmin, kmax, p_m, m_live, b_c, row0, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
    BS: tl.constexpr, BM: tl.constexpr, BITS: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """``[GP, BM * BS]`` float32 unscaled logits of the group's query heads (rows ``row0 + g`` of ``q [B, HQ, D]``,
    ``G`` real ones, zeros up to ``GP``) with a tile's keys: per slice ``j`` the keys dequantized in registers
    (:func:`_dequant_slice`) and one ``[GP, W] x [W, BM * BS]`` product (:func:`_dot`)."""
    PER: tl.constexpr = 8 // BITS
    o_w = tl.arange(0, W)
    o_g = tl.arange(0, GP)
    p_q = q + (row0 + o_g) * D  # [GP]
    s = tl.zeros([GP, BM * BS], dtype=tl.float32)
    for j in tl.static_range(PER):
        b_k = _dequant_slice(kmin, kmax, p_m, m_live, b_c, j, W, BS, BM, BITS)  # [BM * BS, W]
        # [GP, W]
        b_q = tl.load(p_q[:, None] + j * W + o_w[None, :], mask=(o_g < G)[:, None], other=0.0).to(tl.float32)
        s += _dot(b_q, tl.trans(b_k), BF16)
    return s


@triton.jit
def quant_block_lse_tile_kernel(
    q,  # [B, HQ, D]
    codes,  # [NB, H, BS, W] uint8
    kmin,  # [NB, H, D]
    kmax,  # [NB, H, D]
    block_table,  # [B, MB]
    seq_lens,  # [B]
    start,  # [B]
    out,  # [B, HQ, MB] float32
    s_cn,
    s_mn,
    scale,
    MB,
    HQ: tl.constexpr,
    H: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    BS: tl.constexpr,
    BM: tl.constexpr,
    BITS: tl.constexpr,
    BF16: tl.constexpr,
):
    """``layout="tile"``: ``BM`` blocks a program. Each slice's keys are dequantized in registers, ``[BM * BS, W]``
    (:func:`_dequant_slice`), and multiplied by the group's queries in one ``[GP, W] x [W, BM * BS]`` ``tl.dot``
    (:func:`_tile_logits`)."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    n, s0 = tl.load(seq_lens + i_b), tl.load(start + i_b)
    o_m, m_live, ok, b_c, p_m = _tile_codes(codes, block_table, n, s0, s_cn, s_mn, i_m, i_b, i_h, MB, D, W, BS, BM)
    o_g = tl.arange(0, GP)
    row0 = i_b * HQ + i_h * G
    s = _tile_logits(q, kmin, kmax, p_m, m_live, b_c, row0, G, GP, D, W, BS, BM, BITS, BF16)
    _store_tile_lse(out, s, ok, scale, o_m, o_g, o_g < G, row0, MB, GP, BM, BS)


@triton.jit
def quant_block_lse_wide_kernel(
    q,  # [B, HQ, D]
    codes,  # [NB, H, BS, W] uint8
    kmin,  # [NB, H, D]
    kmax,  # [NB, H, D]
    block_table,  # [B, MB]
    seq_lens,  # [B]
    start,  # [B]
    out,  # [B, HQ, MB] float32
    s_cn,
    s_mn,
    scale,
    MB,
    HQ: tl.constexpr,
    H: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    BS: tl.constexpr,
    BM: tl.constexpr,
    BITS: tl.constexpr,
    BF16: tl.constexpr,
):
    """``layout="wide"``: ``BM`` blocks a program, every channel at once. The packed codes ``[BM, BS, W]`` are
    unpacked to ``[BM, BS, PER, W]`` (byte ``w`` holds channels ``w, w + W, ...``: the reshape to ``[BM, BS, D]`` is
    the channels' own order), dequantized on each block's ``[D]`` min / max (one load each) and multiplied by the
    group's queries in a single ``[GP, D] x [D, BM * BS]`` ``tl.dot`` (``tile`` takes ``PER`` products of depth
    ``W``), in the precision of :func:`_dot` (bf16 untimed here)."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    L: tl.constexpr = (1 << BITS) - 1
    PER: tl.constexpr = 8 // BITS
    n, s0 = tl.load(seq_lens + i_b), tl.load(start + i_b)
    o_m, m_live, ok, b_c, p_m = _tile_codes(codes, block_table, n, s0, s_cn, s_mn, i_m, i_b, i_h, MB, D, W, BS, BM)
    o_j = tl.arange(0, PER)
    o_d = tl.arange(0, D)
    # [BM, BS, D]: channel j * W + w is bits [j * BITS, (j + 1) * BITS) of byte w
    b_u = tl.reshape((b_c[:, :, None, :] >> (o_j * BITS)[None, None, :, None]) & L, (BM, BS, D))
    p = p_m[:, None] + o_d[None, :]
    b_lo = tl.load(kmin + p, mask=m_live[:, None], other=0.0).to(tl.float32)  # [BM, D]
    b_hi = tl.load(kmax + p, mask=m_live[:, None], other=0.0).to(tl.float32)
    b_k = b_lo[:, None, :] + b_u.to(tl.float32) * ((b_hi - b_lo) * (1.0 / L))[:, None, :]  # [BM, BS, D]
    o_g = tl.arange(0, GP)
    m_g = o_g < G
    p_q = q + (i_b * HQ + i_h * G + o_g) * D  # [GP]
    b_q = tl.load(p_q[:, None] + o_d[None, :], mask=m_g[:, None], other=0.0).to(tl.float32)  # [GP, D]
    s = _dot(b_q, tl.trans(tl.reshape(b_k, (BM * BS, D))), BF16)  # [GP, BM * BS]
    _store_tile_lse(out, s, ok, scale, o_m, o_g, m_g, i_b * HQ + i_h * G, MB, GP, BM, BS)


@triton.jit
def _diag_slice_operand(
    q, kmin, kmax, q_row, p_mr, m_r, j: tl.constexpr, scale, W: tl.constexpr, BITS: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    """Slice ``j`` (channels ``[j W, (j + 1) W)``) of the ``diag`` layout's left operand: row ``r`` (block ``b``,
    query head ``g``) holds ``scale * q_g * delta_b`` (``delta = (max - min) / L``, float32), as ``(hi, lo)``: with
    ``SPLIT`` two bf16 tensors whose sum keeps ~16 bits (bf16's range: no overflow), else ``hi`` in fp16 (11 bits,
    finite only while ``|scale * q * delta| < 65504``) and ``lo`` unused. Also the slice's share of the row's
    offset ``scale * q_g . min_b`` ``[R]`` float32."""
    L: tl.constexpr = (1 << BITS) - 1
    o_w = tl.arange(0, W)
    b_q = tl.load(q_row[:, None] + j * W + o_w[None, :], mask=m_r[:, None], other=0.0).to(tl.float32) * scale
    p = p_mr[:, None] + j * W + o_w[None, :]
    b_lo = tl.load(kmin + p, mask=m_r[:, None], other=0.0).to(tl.float32)  # [R, W]
    b_hi = tl.load(kmax + p, mask=m_r[:, None], other=0.0).to(tl.float32)
    a = b_q * ((b_hi - b_lo) * (1.0 / L))
    off = tl.sum(b_q * b_lo, 1)
    if SPLIT:
        a_hi = a.to(tl.bfloat16)
        a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
    else:
        a_hi = a.to(tl.float16)
        a_lo = a_hi
    return a_hi, a_lo, off


@triton.jit
def quant_block_lse_diag_kernel(
    q,  # [B, HQ, D]
    codes,  # [NB, H, BS, W] uint8
    kmin,  # [NB, H, D]
    kmax,  # [NB, H, D]
    block_table,  # [B, MB]
    seq_lens,  # [B]
    start,  # [B]
    out,  # [B, HQ, MB] float32
    s_cn,
    s_mn,
    scale,
    MB,
    HQ: tl.constexpr,
    H: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    BS: tl.constexpr,
    BM: tl.constexpr,
    BITS: tl.constexpr,
    SPLIT: tl.constexpr,
    KQ: tl.constexpr,
):
    """``layout="diag"``: ``BM`` blocks a program, the group's heads of every block stacked as the rows of one
    operand. Row ``r = b * GP + g`` is query head ``g``'s queries scaled by block ``b``'s step (``q * delta_b``,
    :func:`_diag_slice_operand`), column ``c = b' * BS + t`` is token ``t`` of block ``b'``'s codes as exact small
    integers (no dequantized key): per slice one ``[BM * GP, W] x [W, BM * BS]`` ``tl.dot``, float32 accumulate, of
    which the block-diagonal entries (``b == b'``) are the logits less ``q . min_b``, added per row. ``GP`` is ``G``
    rounded up to a power of two (not to 16: the blocks fill the dot's rows, ``BM * GP >= 16``)."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    L: tl.constexpr = (1 << BITS) - 1
    PER: tl.constexpr = 8 // BITS
    R: tl.constexpr = BM * GP
    C: tl.constexpr = BM * BS
    n, s0 = tl.load(seq_lens + i_b), tl.load(start + i_b)
    # rows: block i_m * BM + r // GP, query head r % GP of the group
    o_r = tl.arange(0, R)
    lb_r = i_m * BM + o_r // GP
    g_r = o_r % GP
    bt_r = tl.load(block_table + i_b * MB + lb_r, mask=lb_r < MB, other=-1).to(tl.int64)
    m_r = (bt_r >= 0) & (g_r < G)
    p_mr = tl.maximum(bt_r, 0) * s_mn + i_h * D
    q_row = q + (i_b * HQ + i_h * G + g_r) * D
    # columns: token c % BS of block i_m * BM + c // BS
    o_c = tl.arange(0, C)
    lb_c = i_m * BM + o_c // BS
    bt_c = tl.load(block_table + i_b * MB + lb_c, mask=lb_c < MB, other=-1).to(tl.int64)
    pos = i_m * C + o_c
    ok_c = (pos < n) & (pos >= s0) & (bt_c >= 0)
    o_w = tl.arange(0, W)
    p_c = codes + (tl.maximum(bt_c, 0) * s_cn + i_h * BS * W + (o_c % BS) * W)[:, None] + o_w[None, :]
    b_c = tl.load(p_c, mask=(bt_c >= 0)[:, None], other=0).to(tl.int32)  # [C, W]
    if KQ:
        s = tl.zeros([C, R], dtype=tl.float32)  # the codes the first operand (M = C rows)
    else:
        s = tl.zeros([R, C], dtype=tl.float32)
    off = tl.zeros([R], dtype=tl.float32)
    # a code c as the 16-bit float MAGIC + c (exact: the low mantissa bits), no int-to-float conversion; the
    # products' MAGIC * a are taken off each row through off (float32: error ~1e-6 of the logits)
    MAGIC: tl.constexpr = 0x4300 if SPLIT else 0x6400  # 128.0 in bf16, 1024.0 in fp16
    BIAS: tl.constexpr = 128.0 if SPLIT else 1024.0
    for j in tl.static_range(PER):
        a_hi, a_lo, o_j = _diag_slice_operand(q, kmin, kmax, q_row, p_mr, m_r, j, scale, W, BITS, SPLIT)
        c_j = (((b_c >> (j * BITS)) & L) | MAGIC).to(tl.int16)  # [C, W]
        if SPLIT:
            c_j = c_j.to(tl.bfloat16, bitcast=True)
            a_sum = a_hi.to(tl.float32) + a_lo.to(tl.float32)
        else:
            c_j = c_j.to(tl.float16, bitcast=True)
            a_sum = a_hi.to(tl.float32)
        off += o_j - BIAS * tl.sum(a_sum, 1)
        if KQ:
            s += tl.dot(c_j, tl.trans(a_hi), out_dtype=tl.float32)
            if SPLIT:
                s += tl.dot(c_j, tl.trans(a_lo), out_dtype=tl.float32)
        else:
            s += tl.dot(a_hi, tl.trans(c_j), out_dtype=tl.float32)
            if SPLIT:
                s += tl.dot(a_lo, tl.trans(c_j), out_dtype=tl.float32)
    if KQ:
        s = tl.trans(s)
    keep = ((o_r // GP)[:, None] == (o_c // BS)[None, :]) & ok_c[None, :]
    s = tl.where(keep, s + off[:, None], float("-inf"))
    mx = tl.max(s, 1)  # [R]
    safe = tl.where(mx > float("-inf"), mx, 0.0)
    lse = tl.where(mx > float("-inf"), safe + tl.log(tl.sum(tl.exp(s - safe[:, None]), 1)), float("-inf"))
    tl.store(out + (i_b * HQ + i_h * G + g_r) * MB + lb_r, lse, mask=(g_r < G) & (lb_r < MB))


@triton.jit(do_not_specialize=["MB", "NC"])  # the same code (reduction order) at every table width
def quant_lse_stats_kernel(
    lse,  # [B, H * G, MB] float32
    part_m,  # [B, H * G, NC] float32 out
    part_l,  # [B, H * G, NC] float32 out
    MB,
    NC,
    G: tl.constexpr,
    BG: tl.constexpr,
    BC: tl.constexpr,
):
    """Pass 1 of the tail: per chunk ``i_c`` of ``BC`` blocks and query head of the group, the max ``m`` of its
    log-sum-exps and the sum ``l`` of ``exp(lse - m)`` (a chunk of ``-inf``: ``m = -inf``, ``l = 0``)."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    o_g = tl.arange(0, BG)
    m_g = o_g < G
    o_row = (i_bh * G + o_g).to(tl.int64)  # [BG] the group's query heads (HQ = H * G: rows i_bh * G + g)
    o_c = i_c * BC + tl.arange(0, BC)
    m_x = m_g[:, None] & (o_c < MB)[None, :]
    b_x = tl.load(lse + o_row[:, None] * MB + o_c[None, :], mask=m_x, other=float("-inf"))  # [BG, BC]
    b_m = tl.max(b_x, 1)
    b_ms = tl.where(b_m > float("-inf"), b_m, 0.0)  # shift a row of -inf by 0: exp gives 0, never NaN
    b_l = tl.sum(tl.exp(b_x - b_ms[:, None]), 1)
    tl.store(part_m + o_row * NC + i_c, b_m, mask=m_g)
    tl.store(part_l + o_row * NC + i_c, b_l, mask=m_g)


@triton.jit(do_not_specialize=["MB", "NC", "SINK", "WINDOW"])  # likewise (quant_lse_mass)
def quant_mass_kernel(
    lse,  # [B, H * G, MB] float32
    part_m,  # [B, H * G, NC] float32
    part_l,  # [B, H * G, NC] float32
    block_table,  # [B, MB]
    seq_lens,  # [B]
    start,  # [B]
    out,  # [B, H, MB] float32
    MB,
    NC,
    SINK,
    WINDOW,
    H: tl.constexpr,
    G: tl.constexpr,
    BG: tl.constexpr,
    BC: tl.constexpr,
    BN: tl.constexpr,
    BS: tl.constexpr,
    FORCE: tl.constexpr,
):
    """Pass 2 of the tail: each program merges the ``NC`` partial ``(m, l)`` of its group's heads into each head's
    log-sum-exp over every block (``M = max m``, ``l = sum l exp(m - M)``): ``BN`` chunks at a time, each tile's own
    ``(max, sum)`` folded into the running pair in chunk order, so that chunks past the last block in use (``m =
    -inf``, ``l = 0``) change nothing, bit for bit: a table reserved wider (a static step's) scores as the eager
    step's table does (a tile of ``next_power_of_2(NC)`` columns, as before 2026-12-02, reduced in another order
    when ``NC`` crossed a power of two). Neither tail kernel is specialised on ``MB`` or ``NC`` (Triton would compile
    another load layout, so another reduction order, where one of them is a multiple of 16: ``quant_mass_kernel``
    differed at 2047 / 2049 blocks on the H200, G = 6). Then it writes its chunk's scores:
    ``sum_g exp(lse[g] - M[g]) / l[g]`` (a head with ``l = 0`` adds 0), ``+inf`` at forced blocks still held (with
    ``FORCE``, ``ops/layout.py``'s rule), ``-inf`` at blocks not in use (past the end, evicted)."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b = i_bh // H
    o_g = tl.arange(0, BG)
    m_g = o_g < G
    o_row = (i_bh * G + o_g).to(tl.int64)  # [BG]
    b_M = tl.full([BG], float("-inf"), tl.float32)  # the running max and sum of exp(m - M) of each head
    b_l = tl.zeros([BG], dtype=tl.float32)
    for n0 in range(0, NC, BN):
        o_n = n0 + tl.arange(0, BN)
        m_n = m_g[:, None] & (o_n < NC)[None, :]
        t_pm = tl.load(part_m + o_row[:, None] * NC + o_n[None, :], mask=m_n, other=float("-inf"))  # [BG, BN]
        t_pl = tl.load(part_l + o_row[:, None] * NC + o_n[None, :], mask=m_n, other=0.0)
        t_M = tl.max(t_pm, 1)
        t_Ms = tl.where(t_M > float("-inf"), t_M, 0.0)
        t_l = tl.sum(t_pl * tl.exp(t_pm - t_Ms[:, None]), 1)  # [BG]
        n_M = tl.maximum(b_M, t_M)
        n_Ms = tl.where(n_M > float("-inf"), n_M, 0.0)
        b_Ms = tl.where(b_M > float("-inf"), b_M, 0.0)
        # a side without mass adds exactly 0 (never 0 * inf); a side at the new max is multiplied by exactly 1
        b_l = tl.where(b_l > 0, b_l * tl.exp(b_Ms - n_Ms), 0.0) + tl.where(t_l > 0, t_l * tl.exp(t_Ms - n_Ms), 0.0)
        b_M = n_M
    b_Ms = tl.where(b_M > float("-inf"), b_M, 0.0)
    b_r = tl.where(b_l > 0, 1.0 / tl.maximum(b_l, 1e-30), 0.0)  # a head without mass adds 0

    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < MB
    # [BG, BC]
    b_x = tl.load(lse + o_row[:, None] * MB + o_c[None, :], mask=m_g[:, None] & m_c[None, :], other=float("-inf"))
    b_mass = tl.sum(tl.exp(b_x - b_Ms[:, None]) * b_r[:, None], 0)  # [BC]
    n = tl.load(seq_lens + i_b)
    n_blk = tl.cdiv(n, BS)
    b_t = tl.load(block_table + i_b * MB + o_c, mask=m_c, other=-1)
    live = (o_c < n_blk) & (b_t >= 0)
    if FORCE:
        sink_end, win_start, _ = forced_bounds(n, tl.load(start + i_b), SINK, WINDOW, BS)
        b_mass = tl.where(forced_block(o_c, n_blk, sink_end, win_start, BS), float("inf"), b_mass)
    tl.store(out + i_bh.to(tl.int64) * MB + o_c, tl.where(live, b_mass, float("-inf")), mask=m_c)


LAYOUTS = ("slices", "tile", "wide", "diag", "diag_kq")
# Each layout's ``tl.dot`` precisions (``dot=``), its default first. "tf32" and "bf16x2" keep ~1e-3 of the logits or
# better and are what the sweep may make a default (:data:`DEFAULT_DOTS`); "bf16" (tile, wide: operands rounded to
# bf16) and "fp16" (diag: the scaled queries in fp16, which overflow past 65504) are timing probes.
DOTS = {"slices": ("tf32",), "tile": ("tf32", "bf16"), "wide": ("tf32", "bf16")}
DOTS.update({"diag": ("bf16x2", "fp16"), "diag_kq": ("bf16x2", "fp16")})
DEFAULT_DOTS = ("tf32", "bf16x2")

# The scoring kernel's default knobs per code width (``quant_block_lse``): set from the sweep in benchmarks/RESULTS.md
# (``python benchmarks/check_quant_keys.py --sweep``), the one place a launcher reads them. ``layout``: one of
# :data:`LAYOUTS`; ``tpp``: blocks per program (a power of two for "tile" and "wide"); ``num_warps``.
# ``python benchmarks/check_quant_keys.py --sweep --apply`` rewrites this literal.
LSE_DEFAULTS = {  # 2026-12-03 sweep (--apply, H200): least whole-scoring time over 1 x 128K + 8 x 32K
    2: {"layout": "diag_kq", "tpp": 4, "num_warps": 4},
    4: {"layout": "diag_kq", "tpp": 4, "num_warps": 4},
}
TAIL_TILE = 1024  # the tail's elements per program (``[BG, BC]`` log-sum-exps): BC = TAIL_TILE // BG blocks
TAIL_CHUNKS = 32  # the chunks' partial (max, sum) merged per tile by the tail's second pass (quant_mass_kernel)


def quant_block_lse(
    q: torch.Tensor,
    codes: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    bits: int,
    tpp: int | None = None,
    num_warps: int | None = None,
    layout: str | None = None,
    *,
    dot: str | None = None,
) -> torch.Tensor:
    """``[B, Hq, MB]`` float32: per query head and logical block, the log-sum-exp of ``scale * q . k_hat`` over the
    block's valid positions (``start <= p < seq_len``, block held), ``-inf`` where none is (``reference.
    quant_block_lse``).

    Layouts (knobs ``None``: :data:`LSE_DEFAULTS` for ``bits``):

    - ``"slices"`` (:func:`quant_block_lse_kernel`, ``tpp`` blocks a program, one after the other): the group's
      queries one ``[GP, D]`` tile (``GP``: ``G`` rounded up to 16, the smallest ``tl.dot``); each block is
      ``8 // bits`` products ``[GP, W] x [W, BS]`` of the step-scaled queries with the codes, in TF32 on a GPU (the
      codes are exact there; the scaled queries keep 10 bits: ~1e-3 relative, enough to rank blocks).
    - ``"tile"`` (:func:`quant_block_lse_tile_kernel`): ``tpp`` blocks' keys dequantized in registers, one
      ``tl.dot`` a slice for all of them (TF32 on a GPU).
    - ``"wide"`` (:func:`quant_block_lse_wide_kernel`, the default until 2026-12-03): the same tile unpacked to
      all ``D`` channels, one ``tl.dot`` of depth ``D`` (TF32).
    - ``"diag"`` (:func:`quant_block_lse_diag_kernel`): no dequantized key; the codes of ``tpp`` blocks (at least
      ``16 // GP``, ``GP`` the group rounded up to a power of two) are one operand as exact small integers, the
      group's queries scaled by each block's step the other (``tpp * GP`` rows), one product a slice of which the
      block-diagonal entries are kept. ``"diag_kq"``: the same product transposed (the codes the first operand,
      ``tpp * BS`` rows: on a Hopper GPU Triton may then take warp-group MMAs; the default, 4 blocks and 4 warps).

    ``dot`` (:data:`DOTS`; ``None``: the layout's first): ``"tf32"`` (slices, tile, wide: what every quality figure
    used), ``"bf16"`` (tile, wide: the dequantized keys and the queries rounded to bf16 before ``tl.dot``, float32
    accumulate; a timing probe, ~4e-3 relative on the logits against ~1e-3 for TF32), ``"bf16x2"`` (diag: the scaled
    queries as the sum of two bf16 tensors, ~16 bits, against exact integer codes: two products) and ``"fp16"``
    (diag, one product; a probe: 11 bits, and a scaled query past fp16's 65504 would overflow).

    2026-12-03 sweep on an H200 (benchmarks/RESULTS.md): at 1 x 128K, 2 / 4 bits, diag_kq 4 / 4 104.9 / 102.1 us,
    diag 4 / 4 110.5 / 104.0, wide 4 / 4 127.9 / 132.0, tile 4 / 4 215.3 / 152.9; the fp16 probe diag 4 / 4 94.1 /
    86.2 (not a default: it can overflow); 8 x 32K at 4 bits: diag_kq 196.3, wide 257.1. A pipelined multi-tile loop
    layout (a few programs a row, each walking a range of tiles, partials merged by the tail) was timed slower than
    wide at every point of its sweep and removed.
    """
    reference.quant_levels(bits)  # raises for a width other than 2 or 4
    knobs = LSE_DEFAULTS[bits]
    layout = knobs["layout"] if layout is None else layout
    tpp = knobs["tpp"] if tpp is None else tpp
    num_warps = knobs["num_warps"] if num_warps is None else num_warps
    B, HQ, D = q.shape
    NB, H, BS, W = codes.shape
    assert W == D * bits // 8 and codes.dtype == torch.uint8 and kmin.shape == kmax.shape == (NB, H, D)
    assert codes.stride()[1:] == (BS * W, W, 1) and kmin.stride()[1:] == (D, 1) and kmax.stride() == kmin.stride()
    assert HQ % H == 0 and triton.next_power_of_2(D) == D and W >= 16 and triton.next_power_of_2(W) == W
    assert BS >= 16 and triton.next_power_of_2(BS) == BS, "tl.dot needs tiles of at least 16"
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    if layout != "slices" and triton.next_power_of_2(tpp) != tpp:
        raise ValueError(f"layout={layout!r} takes a power-of-two tpp (blocks a tile), not {tpp}")
    dot = DOTS[layout][0] if dot is None else dot
    if dot not in DOTS[layout]:
        raise ValueError(f"layout={layout!r} takes dot in {DOTS[layout]}, not {dot!r}")
    MB = block_table.shape[1]
    out = torch.empty(B, HQ, MB, dtype=torch.float32, device=q.device)
    if B == 0 or MB == 0:
        return out
    G = HQ // H
    args = (
        q.contiguous(), codes, kmin, kmax, block_table.contiguous(), seq_lens.contiguous(), start.contiguous(), out,
        codes.stride(0), kmin.stride(0), float(scale), MB,
    )  # fmt: skip
    shape = {"HQ": HQ, "H": H, "G": G, "D": D, "W": W, "BS": BS, "BITS": bits}
    grid = (triton.cdiv(MB, tpp), B * H)
    GP = max(16, triton.next_power_of_2(G))  # tl.dot's smallest tile
    if layout.startswith("diag"):
        GD = triton.next_power_of_2(G)
        BM = max(tpp, 16 // min(GD, 16))  # tpp * GD rows: at least tl.dot's 16
        grid = (triton.cdiv(MB, BM), B * H)
        quant_block_lse_diag_kernel[grid](
            *args, **shape, GP=GD, BM=BM, SPLIT=dot == "bf16x2", KQ=layout == "diag_kq", num_warps=num_warps
        )
    elif layout == "tile":
        quant_block_lse_tile_kernel[grid](*args, **shape, GP=GP, BM=tpp, BF16=dot == "bf16", num_warps=num_warps)
    elif layout == "wide":
        quant_block_lse_wide_kernel[grid](*args, **shape, GP=GP, BM=tpp, BF16=dot == "bf16", num_warps=num_warps)
    else:
        quant_block_lse_kernel[grid](*args, **shape, GP=GP, TPP=tpp, num_warps=num_warps)
    return out


def quant_lse_mass(
    lse: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    block_size: int,
    num_kv_heads: int,
    sink: int = 0,
    window: int | None = None,
    block_c: int | None = None,
) -> torch.Tensor:
    """The tail of :func:`quant_block_scores` in two launches (the Triton twin of ``reference.lse_block_mass``):
    ``lse [B, Hq, MB]`` -> ``[B, Hkv, MB]`` float32, each block's softmax share summed over the GQA group, ``+inf``
    at forced blocks still held when ``window`` is given, ``-inf`` at blocks not in use.

    The per-head normalisation is a reduction over all ``MB`` blocks, split in chunks of ``block_c`` (default
    ``TAIL_TILE // G``, ``G`` rounded up to a power of two; not ``MB``'s: a wider table only adds chunks):
    :func:`quant_lse_stats_kernel` takes each chunk's ``(max, sum of exp)`` per head, :func:`quant_mass_kernel`
    (grid: chunk x (sequence, KV head)) merges them, :data:`TAIL_CHUNKS` at a time, and writes its chunk.
    """
    B, HQ, MB = lse.shape
    H = num_kv_heads
    assert HQ % H == 0 and lse.dtype == torch.float32 and block_table.shape == (B, MB), f"{lse.shape} {H}"
    assert seq_lens.shape == (B,) and start.shape == (B,), f"seq_lens {seq_lens.shape}, start {start.shape}"
    out = torch.empty(B, H, MB, dtype=torch.float32, device=lse.device)
    if B == 0 or MB == 0:
        return out
    G = HQ // H
    BG = triton.next_power_of_2(G)
    # the chunks do not depend on MB: a wider table (a static step's reservation) only adds chunks of unused blocks
    BC = block_c or max(16, TAIL_TILE // BG)
    assert triton.next_power_of_2(BC) == BC and BC >= 16, f"block_c must be a power of two >= 16, got {BC}"
    NC = triton.cdiv(MB, BC)
    lse = lse.contiguous()
    part_m = torch.empty(B, HQ, NC, dtype=torch.float32, device=lse.device)
    part_l = torch.empty_like(part_m)
    quant_lse_stats_kernel[(NC, B * H)](lse, part_m, part_l, MB, NC, G=G, BG=BG, BC=BC, num_warps=4)
    quant_mass_kernel[(NC, B * H)](
        lse, part_m, part_l, block_table.contiguous(), seq_lens.contiguous(), start.contiguous(), out, MB, NC,
        sink, 0 if window is None else window, H=H, G=G, BG=BG, BC=BC, BN=TAIL_CHUNKS, BS=block_size,
        FORCE=window is not None, num_warps=4,
    )  # fmt: skip
    return out


def quant_block_scores(
    q: torch.Tensor,
    codes: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    bits: int,
    sink: int = 0,
    window: int | None = None,
    *,
    layout: str | None = None,
    tpp: int | None = None,
    num_warps: int | None = None,
    dot: str | None = None,
    block_c: int | None = None,
) -> torch.Tensor:
    """Each block's softmax mass under the quantized keys, summed over each GQA group: ``[B, Hkv, MB]`` float32
    (the contract of ``reference.quant_block_scores``: with ``window`` given, forced blocks still held score
    ``+inf``), in three launches: :func:`quant_block_lse` then :func:`quant_lse_mass`. ``layout``, ``tpp``,
    ``num_warps`` (the scoring kernel's, default :data:`LSE_DEFAULTS`), ``dot`` (its products' precision) and
    ``block_c`` (the tail's) are tuning knobs. Blocks of fewer than 16 tokens or fewer than 16 code bytes per key
    (``D * bits < 128``), below ``tl.dot``'s smallest tile, run the reference (tensor ops, no host sync)."""
    H, BS, W = codes.shape[1], codes.shape[2], codes.shape[3]
    if BS < 16 or W < 16:
        return reference.quant_block_scores(
            q, codes, kmin, kmax, block_table, seq_lens, start, scale, bits, sink, window
        )
    lse = quant_block_lse(
        q, codes, kmin, kmax, block_table, seq_lens, start, scale, bits, tpp, num_warps, layout, dot=dot
    )
    return quant_lse_mass(lse, block_table, seq_lens, start, BS, H, sink, window, block_c)
