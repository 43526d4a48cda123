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
  head over its valid positions (``reference.fp8_block_lse``). Heads of fewer than 32 channels (below an fp8
  product's depth) or blocks of fewer than 16 tokens run the reference (tensor ops, no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_sparse_kv.ops import reference
from hf_sparse_kv.ops.triton.product import tile_lse
from hf_sparse_kv.ops.triton.quant import quant_lse_mass

FP8_MAX: tl.constexpr = tl.constexpr(reference.FP8_MAX)


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
):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    b_lo = tl.load(lo + i_b).to(tl.int64)
    b_hi = tl.load(hi + i_b).to(tl.int64)
    o_p = b_lo + i_t * BT + tl.arange(0, BT)  # [BT] positions
    lb = o_p // BS
    b_phys = tl.load(block_table + i_b * MB + tl.minimum(lb, MB - 1), mask=(o_p < b_hi) & (lb < MB), other=-1)
    m_p = (o_p < b_hi) & (lb < MB) & (b_phys >= 0)
    b_phys = tl.maximum(b_phys, 0).to(tl.int64)
    o_row = (i_h * BS + o_p % BS).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    p_k = k_pool + (b_phys * s_pn + o_row * D)[:, None] + o_d[None, :]
    b_k = tl.load(p_k, mask=m_p[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BT, BD]
    amax = tl.max(tl.abs(b_k), 1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full([BT], FP8_MAX, tl.float32)), 1.0)  # [BT]
    if CODES:
        x = tl.math.div_rn(b_k, tl.broadcast_to(scale[:, None], (BT, BD)))
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
        code = x.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
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
) -> None:
    """Store one ``part`` (``"codes"``: ``state [NB, Hkv, BS, D]`` uint8; ``"scales"``: ``state [NB, Hkv, BS]``
    float32) of the float8 code of the keys at the stored positions ``lo[b] <= p < hi[b]``, in place.

    Args: k_pool ``[NB, Hkv, BS, D]`` (inner dims contiguous); block_table ``[B, MB]``; lo, hi ``[B]``; span a host
    int ``>= max(hi - lo)`` (the grid).
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
        H=H, D=D, BS=BS, BT=BT, BD=max(16, triton.next_power_of_2(D)), CODES=codes, num_warps=4,
    )  # fmt: skip


@triton.jit
def fp8_block_lse_kernel(
    q,  # [B, HQ, D]
    codes,  # [NB, H, BS, D] uint8: float8 e4m3 bytes
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
):
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
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
    q_hi = b_q.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    q_lo = (b_q - q_hi.to(tl.float32)).to(tl.float8e4nv, fp_downcast_rounding="rtne")
    # the tile's BM * BS rows addressed one by one (the probe's way): a pointer built as [BM, BS] and reshaped lost
    # the alignment the compiler needs to load each row's D bytes as 16-byte vectors (one-byte loads instead: 121 ->
    # 66 us at 1 x 128K on an H200, benchmarks/RESULTS.md, 2026-12-06; tests/compile_sm90.py --loads checks it)
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < MB
    o_r = tl.arange(0, BM * BS)
    blk = i_m * BM + o_r // BS  # [BM * BS] each row's logical block
    phys = tl.load(block_table + i_b * MB + blk, mask=blk < MB, other=-1)
    pos = blk * BS + o_r % BS
    okr = (blk < MB) & (phys >= 0) & (pos >= tl.load(start + i_b)) & (pos < tl.load(seq_lens + i_b))
    phys = tl.maximum(phys, 0).to(tl.int64)
    row = i_h * BS + o_r % BS
    b_k = tl.load(codes + phys[:, None] * s_cn + (row * D)[:, None] + o_d[None, :], mask=okr[:, None], other=0)
    b_k = b_k.to(tl.float8e4nv, bitcast=True)  # [BM * BS, D], straight into the product
    s = tl.dot(b_k, tl.trans(q_hi)) + tl.dot(b_k, tl.trans(q_lo))  # [BM * BS, GP] float32
    b_s = tl.load(kscale + phys * s_sn + row, mask=okr, other=0.0)
    s = s * b_s[:, None] * (1.0 / f)[None, :]
    ok = tl.reshape(okr, (BM, BS))
    lse = tile_lse(tl.reshape(s, (BM, BS, GP)), ok)  # [BM, GP]
    tl.store(out + qrow[None, :] * MB + o_m[:, None], lse, mask=m_m[:, None] & m_g[None, :])


BLOCKS_PER_PROGRAM = 8  # the scoring kernel's tile: 8 blocks of 16 tokens, 4 warps (benchmarks/probe_fp8_keys.py)


def fp8_block_lse(
    q: torch.Tensor,
    codes: torch.Tensor,
    kscale: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    block_m: int = BLOCKS_PER_PROGRAM,
    num_warps: int = 4,
) -> torch.Tensor:
    """``[B, Hq, MB]`` float32: ``reference.fp8_block_lse`` (each block's log-sum-exp per query head over its valid
    positions, ``-inf`` where none is) in one launch. ``block_m`` (blocks a program, a power of two) and
    ``num_warps`` are tuning knobs."""
    B, HQ, D = q.shape
    NB, H, BS, Dc = codes.shape
    MB = block_table.shape[1]
    assert Dc == D and codes.dtype == torch.uint8 and kscale.shape == (NB, H, BS), f"{codes.shape} {kscale.shape}"
    assert HQ % H == 0 and block_table.shape[0] == B and seq_lens.shape == (B,) and start.shape == (B,)
    assert codes.stride()[1:] == (BS * D, D, 1) and kscale.stride()[1:] == (BS, 1)
    assert block_m >= 1 and block_m & (block_m - 1) == 0, f"block_m must be a power of two, got {block_m}"
    out = torch.empty(B, HQ, MB, dtype=torch.float32, device=q.device)
    if B == 0 or MB == 0:
        return out
    G = HQ // H
    fp8_block_lse_kernel[(triton.cdiv(MB, block_m), B * H)](
        q.contiguous(), codes, kscale, block_table.contiguous(), seq_lens.contiguous(), start.contiguous(), out,
        codes.stride(0), kscale.stride(0), scale, MB,
        HQ=HQ, H=H, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BS=BS, BM=block_m, num_warps=num_warps,
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
) -> torch.Tensor:
    """Each block's softmax mass under the float8 keys, summed over each GQA group: ``[B, Hkv, MB]`` float32 (the
    contract of ``reference.fp8_block_scores``: with ``window`` given, forced blocks still held score ``+inf``), in
    three launches: :func:`fp8_block_lse` then ``quant_lse_mass``. Heads of fewer than 32 channels, of a width that is
    not a power of two, or blocks of fewer than 16 tokens run the reference (tensor ops, no host sync)."""
    H, BS, D = codes.shape[1], codes.shape[2], codes.shape[3]
    if BS < 16 or D < 32 or D & (D - 1):
        return reference.fp8_block_scores(q, codes, kscale, block_table, seq_lens, start, scale, sink, window)
    lse = fp8_block_lse(q, codes, kscale, block_table, seq_lens, start, scale)
    return quant_lse_mass(lse, block_table, seq_lens, start, BS, H, sink, window)
