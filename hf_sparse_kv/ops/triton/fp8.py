"""Float8 keys for selection: the Triton twins of ``reference.fp8_write`` and ``reference.fp8_block_scores``.

Every key is also kept as float8 e4m3 over its own scale (``max_c |k_c| / 448``: ``reference.fp8_code``), so
``q . k = s_t (q . k8_t)``: one query operand serves every token of a tile, and the tile's fp8 rows go into a
tensor-core product as they are loaded, with no unpacking (the 4-bit codes of ``QuantBlockTopK`` are bound by the
instructions that unpack them: benchmarks/RESULTS.md, Nsight Compute, 2026-12-06).

- :func:`fp8_write`: one program per (``BT`` written positions, sequence, KV head) loads their keys and stores one
  part of their code: the e4m3 bytes (``"codes"``) or the scales (``"scales"``); IEEE divisions, round to nearest even,
  as the reference. Positions outside ``[lo, hi)`` are left as they are.
- :func:`fp8_block_scores`: :func:`fp8_block_lse`, then ``quant.quant_lse_mass`` (the tail ``QuantBlockTopK`` uses).
  The scoring kernel, per (tile of ``BM`` logical blocks, sequence, KV head), brings the group's scaled queries
  (``scale * q``, times a power of two that puts each head's largest entry in ``[112, 224]``) into fp8 as two parts
  (the rounding, then what it left: ~7 bits of mantissa), multiplies the tile's ``[BM * BS, D]`` fp8 keys by both,
  scales each token's row by its ``s_t`` and the power of two back, and stores each block's log-sum-exp per query
  head over its valid positions (``reference.fp8_block_lse``). A program may walk several tiles one after the other
  (``tiles``), the query converted once and the next tiles' loads in flight (``num_stages``: cp.async on sm_90).
  Heads of fewer than 32 channels (below an fp8 product's depth) or blocks of fewer than 16 tokens run the reference
  (tensor ops, no host sync).

GPUs without float8 (CUDA compute capability below 8.9: A100, RTX 30xx; :func:`fp8_native`) cannot convert to e4m3
nor multiply it (Triton refuses to build either), so both kernels take a second form there, chosen at compile time
(``NATIVE``): the write rounds each value to its e4m3 byte with integer and float32 operations (the same bytes,
round to nearest even), and the scorer widens each loaded byte to the float16 of ``value * 2^-8`` (two masks and
two shifts: e4m3's exponent and mantissa fields sit inside float16's, subnormals included, so the widening is exact)
and multiplies it by the query in float16 (one part: 11 bits of each entry, more than the two fp8 parts' ~7).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .product import tile_lse
from .quant import quant_lse_mass
from .written import written_positions

FP8_MAX: tl.constexpr = tl.constexpr(reference.FP8_MAX)


def fp8_native(device: torch.device) -> bool:
    """Whether ``device`` converts to float8 e4m3 and multiplies it on its tensor cores: CUDA compute capability 8.9
    and up (Ada, Hopper, Blackwell; a cached host property, no sync); True off CUDA (Triton's interpreter)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (props.major, props.minor) >= (8, 9)
    return True


@triton.jit
def e4m3_byte(x):
    """``x`` float32 with ``|x| <= 448`` -> its float8 e4m3 byte (uint8), rounded to nearest even: what
    ``x.to(tl.float8e4nv, fp_downcast_rounding="rtne")`` stores, without float8 instructions."""
    bits = x.to(tl.uint32, bitcast=True)
    a = tl.abs(x)
    ab = a.to(tl.uint32, bitcast=True)
    # from 2^-6 (e4m3's smallest normal): 3 of float32's 23 mantissa bits, rounded to nearest even (a carry moves
    # into the exponent), the exponent rebiased from 127 to 7
    normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - (120 << 3)
    # below it: multiples of 2^-9, which adding 2^14 rounds a float32 to (nearest even); 8 is 2^-6, the byte 0x08
    sub = (((a + 16384.0) - 16384.0) * 512.0).to(tl.uint32)
    return (tl.where(a >= 0.015625, normal, sub) | ((bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def e4m3_as_f16(c):
    """e4m3 bytes ``c`` (uint8) -> float16 ``value * 2^-8``, exactly: the sign to bit 15, exponent and mantissa to bits
    13..7 (float16's exponent field is then ``0eeee``, its bias 15 against e4m3's 7; subnormals map to subnormals)."""
    c16 = c.to(tl.uint16)
    return (((c16 & 0x80) << 8) | ((c16 & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def fp8_write_kernel(
    state,  # [NB, H, BS, D] uint8 (CODES) or [NB, H, BS] float32
    k_pool,  # [NB, H, BS, D]
    block_table,  # [B, MB]
    lo,  # [B]
    hi,  # [B]
    s_pn,  # key pool stride between blocks
    s_sn,  # state stride between blocks
    MB,
    H: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    CODES: tl.constexpr,
    NATIVE: tl.constexpr,  # the float8 conversion instruction (compute capability >= 8.9), else e4m3_byte
):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    b_phys, off, m_p = written_positions(lo, hi, block_table, i_b, i_t, MB, BS, BT)  # [BT] each
    o_row = (i_h * BS + off).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    p_k = k_pool + (b_phys * s_pn + o_row * D)[:, None] + o_d[None, :]
    b_k = tl.load(p_k, mask=m_p[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BT, BD]
    amax = tl.max(tl.abs(b_k), 1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full([BT], FP8_MAX, tl.float32)), 1.0)  # [BT]
    if CODES:
        x = tl.math.div_rn(b_k, tl.broadcast_to(scale[:, None], (BT, BD)))
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
        if NATIVE:
            code = x.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        else:
            code = e4m3_byte(x)
        p_c = state + (b_phys * s_sn + o_row * D)[:, None] + o_d[None, :]
        tl.store(p_c, code, mask=m_p[:, None] & m_d[None, :])
    else:
        tl.store(state + b_phys * s_sn + o_row, scale, mask=m_p)


def fp8_write(
    state: torch.Tensor,
    k_pool: torch.Tensor,
    block_table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    span: int,
    part: str,
    native: bool | None = None,
) -> None:
    """Store one ``part`` (``"codes"``: ``state [NB, Hkv, BS, D]`` uint8; ``"scales"``: ``state [NB, Hkv, BS]``
    float32) of the float8 code of the keys at the stored positions ``lo[b] <= p < hi[b]``, in place.

    Args: k_pool ``[NB, Hkv, BS, D]`` (inner dims contiguous); block_table ``[B, MB]``; lo, hi ``[B]``; span a host
    int ``>= max(hi - lo)`` (the grid); native: round with the float8 instruction (default: :func:`fp8_native` of
    the pool's device) or with integer operations (the same bytes).
    """
    if part not in reference.FP8_PARTS:
        raise ValueError(f"part must be one of {reference.FP8_PARTS}, got {part!r}")
    NB, H, BS, D = k_pool.shape
    codes = part == "codes"
    want = (NB, H, BS, D) if codes else (NB, H, BS)
    assert tuple(state.shape) == want, f"{part} state {tuple(state.shape)}, expected {want}"
    assert state.dtype == (torch.uint8 if codes else torch.float32), f"{part} state dtype {state.dtype}"
    assert k_pool.stride()[1:] == (BS * D, D, 1) and state.stride()[1:] == state.contiguous().stride()[1:]
    B = block_table.shape[0]
    assert lo.shape == (B,) and hi.shape == (B,)
    if span <= 0 or B == 0:
        return
    BT = max(16, min(64, triton.next_power_of_2(span)))
    fp8_write_kernel[(triton.cdiv(span, BT), B * H)](
        state, k_pool, block_table.contiguous(), lo.contiguous(), hi.contiguous(), k_pool.stride(0),
        state.stride(0), block_table.shape[1],
        H=H, D=D, BS=BS, BT=BT, BD=max(16, triton.next_power_of_2(D)), CODES=codes,
        NATIVE=fp8_native(k_pool.device) if native is None else native, num_warps=4,
    )  # fmt: skip


@triton.jit
def fp8_block_lse_kernel(
    q,  # [B, HQ, D]
    codes,  # [NB, H, BS, D] float8 e4m3 (the uint8 codes viewed as float8_e4m3fn); uint8 unless NATIVE
    kscale,  # [NB, H, BS] float32
    block_table,  # [B, MB]
    seq_lens,  # [B]
    start,  # [B]
    out,  # [B, HQ, MB] float32
    s_cn,  # codes stride between blocks
    s_sn,  # kscale stride between blocks
    scale,  # softmax scale
    MB,
    HQ: tl.constexpr,
    H: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BM: tl.constexpr,
    TILES: tl.constexpr,  # tiles of BM blocks a program, one after the other
    STAGES: tl.constexpr,  # the loop's software pipeline (loads of later tiles in flight)
    NATIVE: tl.constexpr,  # float8 products (compute capability >= 8.9), else the codes widened to float16
):
    i_p, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_g = tl.arange(0, GP)
    o_d = tl.arange(0, D)
    m_g = o_g < G
    qrow = (i_b * HQ + i_h * G + o_g).to(tl.int64)
    b_q = tl.load(q + qrow[:, None] * D + o_d[None, :], mask=m_g[:, None], other=0.0).to(tl.float32) * scale
    # a power of two per head puts its largest entry in [112, 224]: the two fp8 parts keep ~7 bits of each entry
    top = tl.max(tl.abs(b_q), 1)
    f = tl.where(top > 0, tl.exp2(tl.floor(tl.log2(224.0 / tl.maximum(top, 1e-30)))), 1.0)  # [GP]
    b_q = b_q * f[:, None]
    if NATIVE:
        q_hi = b_q.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        q_lo = (b_q - q_hi.to(tl.float32)).to(tl.float8e4nv, fp_downcast_rounding="rtne")
    else:
        q_16 = b_q.to(tl.float16)
    lo, hi = tl.load(start + i_b), tl.load(seq_lens + i_b)
    o_r = tl.arange(0, BM * BS)
    row = i_h * BS + o_r % BS
    for i_t in tl.range(0, TILES, num_stages=STAGES):
        i_m = i_p * TILES + i_t
        # the tile's BM * BS rows addressed one by one (the probe's way): a pointer built as [BM, BS] and reshaped
        # lost the alignment the compiler needs to load each row's D bytes as 16-byte vectors (one-byte loads
        # instead: 121 -> 66 us at 1 x 128K on an H200, benchmarks/RESULTS.md, 2026-12-06; tests/compile_sm90.py
        # --loads checks it)
        o_m = i_m * BM + tl.arange(0, BM)
        blk = i_m * BM + o_r // BS  # [BM * BS] each row's logical block
        phys = tl.load(block_table + i_b * MB + blk, mask=blk < MB, other=-1)
        pos = blk * BS + o_r % BS
        okr = (blk < MB) & (phys >= 0) & (pos >= lo) & (pos < hi)
        phys = tl.maximum(phys, 0).to(tl.int64)
        # [BM * BS, D] float8 (the codes passed as a float8 view), straight into the product: loaded as uint8 and
        # bitcast, the tile took 93 registers a thread instead of 65 (ptxas, sm_90a), fewer programs a multiprocessor
        p_k = codes + phys[:, None] * s_cn + (row * D)[:, None] + o_d[None, :]
        if NATIVE:
            b_k = tl.load(p_k, mask=okr[:, None], other=0.0)
            s = tl.dot(b_k, tl.trans(q_hi)) + tl.dot(b_k, tl.trans(q_lo))  # [BM * BS, GP] float32
        else:  # the codes as uint8, widened to float16 (value * 2^-8, exactly)
            b_k = e4m3_as_f16(tl.load(p_k, mask=okr[:, None], other=0))
            s = tl.dot(b_k, tl.trans(q_16)) * 256.0
        b_s = tl.load(kscale + phys * s_sn + row, mask=okr, other=0.0)
        s = s * b_s[:, None] * (1.0 / f)[None, :]
        ok = tl.reshape(okr, (BM, BS))
        lse = tile_lse(tl.reshape(s, (BM, BS, GP)), ok)  # [BM, GP]
        tl.store(out + qrow[None, :] * MB + o_m[:, None], lse, mask=(o_m < MB)[:, None] & m_g[None, :])


# the scoring kernel's defaults: tiles of 8 blocks of 16 tokens, 4 warps (benchmarks/probe_fp8_keys.py), 4 tiles a
# program with 2 stages in flight: 17-19 % faster than one tile a program on an H100 (58.8 against 71.0 us at
# 1 x 128K, 107.7 against 132.9 at 8 x 32K; 0.77 / 0.85 of the copy bandwidth; the best of 8 configurations of
# tiles, stages, block_m and warps: benchmarks/RESULTS.md, 2026-12-07)
BLOCKS_PER_PROGRAM = 8
WARPS = 4
TILES_PER_PROGRAM = 4
STAGES = 2


def fp8_block_lse(
    q: torch.Tensor,
    codes: torch.Tensor,
    kscale: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    block_m: int = BLOCKS_PER_PROGRAM,
    num_warps: int = WARPS,
    tiles: int = TILES_PER_PROGRAM,
    num_stages: int = STAGES,
    native: bool | None = None,
) -> torch.Tensor:
    """``[B, Hq, MB]`` float32: ``reference.fp8_block_lse`` (each block's log-sum-exp per query head over its valid
    positions, ``-inf`` where none is) in one launch. Tuning knobs: ``block_m`` (blocks a tile, a power of two),
    ``tiles`` (tiles a program, one after the other), ``num_stages`` (that loop's software pipeline), ``num_warps``;
    ``native``: float8 products (default: :func:`fp8_native` of the query's device) or the codes widened to float16."""
    B, HQ, D = q.shape
    NB, H, BS, Dc = codes.shape
    MB = block_table.shape[1]
    assert Dc == D and codes.dtype == torch.uint8 and kscale.shape == (NB, H, BS), f"{codes.shape} {kscale.shape}"
    assert HQ % H == 0 and block_table.shape[0] == B and seq_lens.shape == (B,) and start.shape == (B,)
    assert codes.stride()[1:] == (BS * D, D, 1) and kscale.stride()[1:] == (BS, 1)
    assert block_m >= 1 and block_m & (block_m - 1) == 0, f"block_m must be a power of two, got {block_m}"
    assert tiles >= 1 and num_stages >= 1, f"tiles {tiles}, num_stages {num_stages}"
    out = torch.empty(B, HQ, MB, dtype=torch.float32, device=q.device)
    if B == 0 or MB == 0:
        return out
    G = HQ // H
    native = fp8_native(q.device) if native is None else native
    fp8_block_lse_kernel[(triton.cdiv(MB, block_m * tiles), B * H)](
        q.contiguous(), codes.view(torch.float8_e4m3fn) if native else codes, kscale, block_table.contiguous(),
        seq_lens.contiguous(), start.contiguous(), out, codes.stride(0), kscale.stride(0), scale, MB,
        HQ=HQ, H=H, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BS=BS, BM=block_m, TILES=tiles,
        STAGES=num_stages, NATIVE=native, num_warps=num_warps,
    )  # fmt: skip
    return out


def fp8_block_scores(
    q: torch.Tensor,
    codes: torch.Tensor,
    kscale: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    sink: int = 0,
    window: int | None = None,
    native: bool | None = None,
) -> torch.Tensor:
    """Each block's softmax mass under the float8 keys, summed over each GQA group: ``[B, Hkv, MB]`` float32 (the
    contract of ``reference.fp8_block_scores``: with ``window`` given, forced blocks still held score ``+inf``), in
    three launches: :func:`fp8_block_lse` (``native`` its product's form) then ``quant_lse_mass``. Heads of fewer
    than 32 channels, of a width that is not a power of two, or blocks of fewer than 16 tokens run the reference
    (tensor ops, no host sync)."""
    H, BS, D = codes.shape[1], codes.shape[2], codes.shape[3]
    if BS < 16 or D < 32 or D & (D - 1):
        return reference.fp8_block_scores(q, codes, kscale, block_table, seq_lens, start, scale, sink, window)
    lse = fp8_block_lse(q, codes, kscale, block_table, seq_lens, start, scale, native=native)
    return quant_lse_mass(lse, block_table, seq_lens, start, BS, H, sink, window)
