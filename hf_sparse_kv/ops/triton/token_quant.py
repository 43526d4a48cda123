"""Low-bit keys with one step per token, scored: the Triton twin of ``reference.token_quant_block_lse``.

A key's codes (``reference.token_quantize_keys``) sit on the grid ``lo + code * step_t``: ``lo`` the block's
per-channel minimum (the cache's ``kmin``), ``step_t`` one float per token. So ``q . k_hat = q . lo + step_t *
(q . code_t)``: the query is the same operand for every token, and a tile of ``BM`` blocks (``BM * BS`` tokens) is one
``[GP, W] x [W, BM * BS]`` product per packed slice of channels (byte ``i`` holds channels ``i, i + W, ...``), the
codes exact small integers in the query's dtype, float32 accumulation; then each token's step, each block's
``q . lo`` (one ``[GP, D] x [D, BM]`` product) and the log-sum-exp over each block's valid positions.

One program per (``TPP`` tiles of ``BM`` logical blocks, sequence, KV head); with ``num_stages > 1`` the loop over
the tiles is software-pipelined. Output as ``quant.quant_block_lse``: ``[B, Hq, MB]`` float32, then
``quant.quant_lse_mass`` turns it into each block's softmax mass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .quant import quant_lse_mass
from .written import written_block


@triton.jit
def _offsets(b_k, m_t):
    """``b_k [BS, W]`` keys (``m_t [BS]`` the filled slots) less their channels' minima over the filled slots, the
    minima rounded to the keys' dtype as the cache's ``kmin`` stores them (exact: a minimum is one of the keys):
    ``[BS, W]`` float32."""
    b_f = b_k.to(tl.float32)
    b_min = tl.min(tl.where(m_t[:, None], b_f, float("inf")), 0).to(b_k.dtype).to(tl.float32)
    return b_f - b_min[None, :]


@triton.jit
def token_quant_write_kernel(
    codes,  # [NB, H, BS, W] uint8 (strided)
    steps,  # [NB, H, BS] float32 (strided)
    k_pool,  # [NB, H, BS, D]
    block_table,  # [B, MB]
    lo,  # [B]
    hi,  # [B]
    s_pn,  # key pool stride between blocks
    s_cn,  # codes strides: blocks, heads, tokens
    s_ch,
    s_ct,
    s_sn,  # steps strides: blocks, heads, tokens
    s_sh,
    s_st,
    MB,
    H: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    BS: tl.constexpr,
    BITS: tl.constexpr,
):
    """One program per (logical block the write touches, sequence, KV head): the block's filled prefix, its channel
    minima, each token's step (its largest offset from them over ``levels``) and codes, two passes over the ``8 //
    BITS`` channel slices (the minima and steps, then the codes)."""
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
    top = tl.zeros([BS], dtype=tl.float32)
    for j in tl.static_range(PER):  # each token's largest offset from the block's minima
        b_k = tl.load(k_pool + base + o_t[:, None] * D + j * W + o_w[None, :], mask=m_t[:, None], other=0.0)
        off = _offsets(b_k, m_t)
        top = tl.maximum(top, tl.max(tl.where(m_t[:, None], off, 0.0), 1))
    step = tl.where(m_t, tl.math.div_rn(top, tl.full([BS], L, tl.float32)), 0.0)  # [BS]
    safe = tl.where(step > 0, step, 1.0)
    packed = tl.zeros([BS, W], dtype=tl.int32)
    for j in tl.static_range(PER):
        b_k = tl.load(k_pool + base + o_t[:, None] * D + j * W + o_w[None, :], mask=m_t[:, None], other=0.0)
        off = _offsets(b_k, m_t)
        c = tl.math.floor(tl.math.div_rn(off, safe[:, None]) + 0.5)
        c = tl.minimum(tl.maximum(c, 0.0), L * 1.0)
        c = tl.where((step > 0)[:, None], c, 0.0).to(tl.int32)
        packed = packed | (c << (j * BITS))
    p_c = codes + b_phys * s_cn + i_h * s_ch + o_t[:, None] * s_ct + o_w[None, :]
    tl.store(p_c, packed.to(tl.uint8))
    tl.store(steps + b_phys * s_sn + i_h * s_sh + o_t * s_st, step)


def token_quant_write(
    rows: torch.Tensor,
    k_pool: torch.Tensor,
    block_table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    span: int,
    bits: int,
) -> None:
    """Re-code, in place, every token of the blocks holding the stored positions ``lo[b] <= p < hi[b]`` (the contract
    of ``reference.token_quant_write``).

    Args: ``rows [NB, Hkv, BS, D * bits // 8 + 4]`` uint8 (``reference.token_rows``: a token's codes, then its
    float32 step; inner dims contiguous); ``k_pool [NB, Hkv, BS, D]`` (inner dims contiguous); ``block_table [B,
    MB]``; ``lo``, ``hi`` ``[B]``; ``span`` a host int ``>= max(hi - lo)``; ``bits``.
    """
    codes, steps = reference.split_token_rows(rows)
    NB, H, BS, D = k_pool.shape
    reference.quant_levels(bits)
    W = D * bits // 8
    assert codes.shape == (NB, H, BS, W) and codes.dtype == torch.uint8 and codes.stride(3) == 1, "codes"
    assert steps.shape == (NB, H, BS) and steps.dtype == torch.float32, "steps must be [NB, Hkv, BS] float32"
    assert k_pool.stride()[1:] == (BS * D, D, 1)
    assert triton.next_power_of_2(W) == W and triton.next_power_of_2(BS) == BS, "power-of-two tiles"
    B = block_table.shape[0]
    assert lo.shape == (B,) and hi.shape == (B,)
    if span <= 0 or B == 0:
        return
    token_quant_write_kernel[(triton.cdiv(span, BS) + 1, B * H)](
        codes, steps, k_pool, block_table.contiguous(), lo.contiguous(), hi.contiguous(), k_pool.stride(0),
        *codes.stride()[:3], *steps.stride(), block_table.shape[1], H=H, D=D, W=W, BS=BS, BITS=bits, num_warps=4,
    )  # fmt: skip


@triton.jit
def token_quant_lse_kernel(
    q,  # [B, HQ, D]
    codes,  # [NB, H, BS, W] uint8
    steps,  # [NB, H, BS]
    kmin,  # [NB, H, D]
    block_table,  # [B, MB]
    seq_lens,  # [B]
    start,  # [B]
    out,  # [B, HQ, MB] float32
    s_cn,  # codes strides: between blocks, heads, tokens (bytes within a token contiguous)
    s_ch,
    s_ct,
    s_sn,  # steps strides: between blocks, heads, tokens
    s_sh,
    s_st,
    s_mn,  # kmin stride between blocks
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
    TPP: tl.constexpr,
    STAGES: tl.constexpr,
    F32: tl.constexpr,
):
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    L: tl.constexpr = (1 << BITS) - 1
    PER: tl.constexpr = 8 // BITS
    n, s0 = tl.load(seq_lens + i_b), tl.load(start + i_b)
    o_g = tl.arange(0, GP)
    m_g = o_g < G
    o_d = tl.arange(0, D)
    o_w = tl.arange(0, W)
    o_t = tl.arange(0, BS)
    row0 = i_b * HQ + i_h * G
    p_q = q + (row0 + o_g) * D  # [GP]
    b_q = tl.load(p_q[:, None] + o_d[None, :], mask=m_g[:, None], other=0.0)  # [GP, D]
    for t in tl.range(0, TPP, num_stages=STAGES):
        o_m = (i_m * TPP + t) * BM + tl.arange(0, BM)
        b_phys = tl.load(block_table + i_b * MB + o_m, mask=o_m < MB, other=-1).to(tl.int64)
        m_live = b_phys >= 0
        pos = o_m[:, None] * BS + o_t[None, :]  # [BM, BS]
        ok = (pos < n) & (pos >= s0) & m_live[:, None]
        b_phys = tl.maximum(b_phys, 0)
        p_c = codes + (b_phys * s_cn + i_h * s_ch)[:, None, None] + o_t[None, :, None] * s_ct + o_w[None, None, :]
        b_c = tl.reshape(tl.load(p_c, mask=m_live[:, None, None], other=0), (BM * BS, W)).to(tl.int32)
        p_s = steps + (b_phys * s_sn + i_h * s_sh)[:, None] + o_t[None, :] * s_st
        b_st = tl.load(p_s, mask=m_live[:, None], other=0.0)
        b_lo = tl.load(kmin + (b_phys * s_mn + i_h * D)[:, None] + o_d[None, :], mask=m_live[:, None], other=0.0)
        s = tl.zeros([GP, BM * BS], dtype=tl.float32)
        for j in tl.static_range(PER):
            # [BM * BS, W]: exact small integers (through float32: the interpreter's int -> bf16 cast is wrong)
            c_j = ((b_c >> (j * BITS)) & L).to(tl.float32).to(b_q.dtype)
            q_j = tl.load(p_q[:, None] + j * W + o_w[None, :], mask=m_g[:, None], other=0.0)  # [GP, W]
            if F32:
                s += tl.dot(q_j, tl.trans(c_j), input_precision="ieee")
            else:
                s += tl.dot(q_j, tl.trans(c_j))
        if F32:
            qlo = tl.dot(b_q, tl.trans(b_lo.to(b_q.dtype)), input_precision="ieee")  # [GP, BM]
        else:
            qlo = tl.dot(b_q, tl.trans(b_lo.to(b_q.dtype)))
        s3 = tl.reshape(s, (GP, BM, BS)) * b_st.to(tl.float32)[None, :, :] + qlo[:, :, None]
        s3 = tl.where(ok[None, :, :], s3 * scale, float("-inf"))
        mx = tl.max(s3, 2)  # [GP, BM]
        safe = tl.where(mx > float("-inf"), mx, 0.0)
        lse = tl.where(mx > float("-inf"), safe + tl.log(tl.sum(tl.exp(s3 - safe[:, :, None]), 2)), float("-inf"))
        tl.store(out + (row0 + o_g)[:, None] * MB + o_m[None, :], lse, mask=m_g[:, None] & (o_m < MB)[None, :])


def token_quant_block_lse(
    q: torch.Tensor,
    codes: torch.Tensor,
    steps: torch.Tensor,
    kmin: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    bits: int,
    block_m: int = 16,
    tiles_per_program: int = 2,
    num_stages: int = 2,
    num_warps: int = 4,
) -> torch.Tensor:
    """``[B, Hq, MB]`` float32 (``reference.token_quant_block_lse``): per query head and logical block, the
    log-sum-exp of ``scale * q . k_hat`` over the block's valid positions, ``-inf`` where none is.

    Args: ``q [B, Hq, D]`` (bf16 / fp16: the codes meet it in its own dtype, float32 accumulation, exact products;
    float32: IEEE products); ``codes [NB, Hkv, BS, D * bits // 8]`` uint8 (a token's bytes contiguous, any other
    strides: e.g. a slice of a wider row that holds the token's step too); ``steps [NB, Hkv, BS]`` (any strides); ``kmin [NB, Hkv,
    D]``; ``block_table [B, MB]``; ``seq_lens``, ``start`` ``[B]``; knobs: ``block_m`` blocks a tile (a power of two ``>= 16``: the ``q . lo``
    product's smallest tile), ``tiles_per_program``, ``num_stages``, ``num_warps``.
    """
    reference.quant_levels(bits)
    B, HQ, D = q.shape
    NB, H, BS, W = codes.shape
    assert W == D * bits // 8 and codes.dtype == torch.uint8, "codes must be [NB, Hkv, BS, D * bits // 8] uint8"
    assert steps.shape == (NB, H, BS) and kmin.shape == (NB, H, D), "steps [NB, Hkv, BS], kmin [NB, Hkv, D]"
    assert codes.stride(3) == 1 and kmin.stride()[1:] == (D, 1), "a token's codes and a block's minima contiguous"
    assert HQ % H == 0 and triton.next_power_of_2(D) == D and W >= 16 and triton.next_power_of_2(W) == W
    assert triton.next_power_of_2(BS) == BS and block_m >= 16 and triton.next_power_of_2(block_m) == block_m
    MB = block_table.shape[1]
    out = torch.empty(B, HQ, MB, dtype=torch.float32, device=q.device)
    if B == 0 or MB == 0:
        return out
    G = HQ // H
    tpp = max(1, min(tiles_per_program, triton.cdiv(MB, block_m)))
    grid = (triton.cdiv(MB, block_m * tpp), B * H)
    token_quant_lse_kernel[grid](
        q.contiguous(), codes, steps, kmin, block_table.contiguous(), seq_lens.contiguous(), start.contiguous(), out,
        *codes.stride()[:3], *steps.stride(), kmin.stride(0), float(scale), MB,
        HQ=HQ, H=H, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, W=W, BS=BS, BM=block_m, BITS=bits, TPP=tpp,
        STAGES=num_stages, F32=q.dtype == torch.float32, num_warps=num_warps,
    )  # fmt: skip
    return out


def token_quant_block_scores(
    q: torch.Tensor,
    rows: torch.Tensor,
    kmin: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    bits: int,
    sink: int = 0,
    window: int | None = None,
    **knobs,
) -> torch.Tensor:
    """``reference.token_quant_block_scores`` on ``rows [NB, Hkv, BS, W + 4]`` (``reference.token_rows``):
    :func:`token_quant_block_lse` of its codes and steps (``knobs`` go to it), then ``quant.quant_lse_mass``'s
    two-launch tail (each head's softmax shares summed over the group, the forced blocks ``+inf`` when ``window`` is
    given). ``[B, Hkv, MB]`` float32."""
    codes, steps = reference.split_token_rows(rows)
    lse = token_quant_block_lse(q, codes, steps, kmin, block_table, seq_lens, start, scale, bits, **knobs)
    return quant_lse_mass(lse, block_table, seq_lens, start, codes.shape[2], codes.shape[1], sink, window)
