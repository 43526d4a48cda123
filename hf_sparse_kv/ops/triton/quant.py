"""Low-bit keys for selection: the Triton twins of ``reference.quant_write`` and ``reference.quant_block_scores``.

A key's codes are ``bits``-bit steps on its block's per-channel ``[min, max]`` grid, packed planar: byte ``i`` of a
token holds channels ``i, i + W, ...`` (``W = D * bits // 8``), so a kernel handles the ``8 // bits`` channel slices
``[j W, (j + 1) W)`` one at a time, each a ``[BS, W]`` tile, and never reshapes.

- :func:`quant_write`: one program per (logical block touched by the write, sequence, KV head) loads the block's
  filled prefix, takes each channel's min / max over it (the cache's ``kmin`` / ``kmax``), codes every slot
  (``floor((k - min) / delta + 0.5)``, IEEE divisions as the reference's) and stores the block's codes; slots past
  the prefix get 0. The grid is sized by ``span`` (``cdiv(span, BS) + 1`` blocks per sequence), a program past the
  last block written returns: a captured step replays it.
- :func:`quant_block_scores`: one program per (``TPP`` logical blocks, sequence, KV head) computes, for each of the
  group's ``G`` query heads, the log-sum-exp over each block's valid positions of ``scale * q . k_hat`` with
  ``k_hat = min + code * delta``, as ``q . min + sum_j (q_j * delta_j) . code_j`` (no dequantized key is built;
  the products are ``tl.dot``s of the group's step-scaled queries with the codes);
  a few tensor ops then turn the ``[B, Hq, MB]`` log-sum-exps into each head's softmax shares and sum them over the
  group (the reference's mass). It reads the codes (``bits / 16`` of 16-bit keys) and the block's min / max.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference


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
    b_lo = tl.load(lo + i_b).to(tl.int64)
    b_hi = tl.load(hi + i_b).to(tl.int64)
    lb = b_lo // BS + i_n
    if (b_hi <= b_lo) | (lb > (b_hi - 1) // BS) | (lb >= MB):
        return
    b_phys = tl.load(block_table + i_b * MB + lb).to(tl.int64)
    if b_phys < 0:
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
):
    """``layout="tile"``: ``BM`` blocks at once. Each slice's keys are dequantized in registers, ``[BM * BS, W]``,
    and multiplied by the group's queries in one ``[GP, W] x [W, BM * BS]`` product per slice."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    L: tl.constexpr = (1 << BITS) - 1
    PER: tl.constexpr = 8 // BITS
    n = tl.load(seq_lens + i_b)
    s0 = tl.load(start + i_b)
    o_r = tl.arange(0, BM * BS)  # rows: token t of tile block m at m * BS + t
    o_w = tl.arange(0, W)
    o_g = tl.arange(0, GP)
    m_g = o_g < G
    lb = i_m * BM + o_r // BS  # [BM * BS] logical block of each row
    m_b = lb < MB
    b_phys = tl.load(block_table + i_b * MB + lb, mask=m_b, other=-1).to(tl.int64)
    pos = lb * BS + o_r % BS
    ok = (pos < n) & (pos >= s0) & (b_phys >= 0) & m_b
    b_phys = tl.maximum(b_phys, 0)
    p_c = codes + b_phys * s_cn + i_h * BS * W + (o_r % BS) * W  # [BM * BS]
    b_c = tl.load(p_c[:, None] + o_w[None, :], mask=m_b[:, None], other=0).to(tl.int32)  # [BM * BS, W]
    p_m = b_phys * s_mn + i_h * D  # [BM * BS]
    p_q = q + (i_b * HQ + i_h * G + o_g) * D  # [GP]
    s = tl.zeros([GP, BM * BS], dtype=tl.float32)
    for j in tl.static_range(PER):
        lo_j = tl.load(kmin + p_m[:, None] + j * W + o_w[None, :], mask=m_b[:, None], other=0.0).to(tl.float32)
        hi_j = tl.load(kmax + p_m[:, None] + j * W + o_w[None, :], mask=m_b[:, None], other=0.0).to(tl.float32)
        delta = tl.math.div_rn(hi_j - lo_j, tl.full([BM * BS, W], L, tl.float32))
        k_j = lo_j + ((b_c >> (j * BITS)) & L).to(tl.float32) * delta  # [BM * BS, W] dequantized keys
        q_j = tl.load(p_q[:, None] + j * W + o_w[None, :], mask=m_g[:, None], other=0.0).to(tl.float32)  # [GP, W]
        s += tl.dot(q_j, tl.trans(k_j), input_precision="tf32")
    s = tl.where(ok[None, :], s * scale, float("-inf"))
    s3 = tl.reshape(s, (GP, BM, BS))
    mx = tl.max(s3, 2)  # [GP, BM]
    safe = tl.where(mx > float("-inf"), mx, 0.0)
    lse = tl.where(mx > float("-inf"), safe + tl.log(tl.sum(tl.exp(s3 - safe[:, :, None]), 2)), float("-inf"))
    o_m = i_m * BM + tl.arange(0, BM)
    p_o = out + (i_b * HQ + i_h * G + o_g)[:, None] * MB + o_m[None, :]
    tl.store(p_o, lse, mask=m_g[:, None] & (o_m < MB)[None, :])


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
    tpp: int = 1,
    num_warps: int = 1,
    layout: str = "slices",
) -> torch.Tensor:
    """``[B, Hq, MB]`` float32: per query head and logical block, the log-sum-exp of ``scale * q . k_hat`` over the
    block's valid positions (``start <= p < seq_len``, block held), ``-inf`` where none is. The group's queries are
    one ``[GP, D]`` tile (``GP``: ``G`` rounded up to 16, the smallest ``tl.dot``); each block is ``8 // bits``
    products ``[GP, W] x [W, BS]`` of the step-scaled queries with the codes, in TF32 on a GPU (the codes are exact
    there; the scaled queries keep 10 bits: ~1e-3 relative, enough to rank blocks). ``tpp`` blocks per program,
    ``num_warps``: the defaults are the fastest of a sweep on an H200 at 1 x 128K (``benchmarks/RESULTS.md``: 174 us
    at 2 bits against 611 with 8 blocks and 4 warps; latency-bound, far from the 16 us its bytes need).
    ``layout="tile"`` (:func:`quant_block_lse_tile_kernel`, ``tpp`` blocks a tile, a power of two): one product per
    slice over ``tpp`` blocks' dequantized keys; correct (tests), not yet timed on a GPU, so not the default."""
    B, HQ, D = q.shape
    NB, H, BS, W = codes.shape
    reference.quant_levels(bits)
    assert W == D * bits // 8 and codes.dtype == torch.uint8 and kmin.shape == kmax.shape == (NB, H, D)
    assert codes.stride()[1:] == (BS * W, W, 1) and kmin.stride()[1:] == (D, 1) and kmax.stride() == kmin.stride()
    assert HQ % H == 0 and triton.next_power_of_2(D) == D and W >= 16 and triton.next_power_of_2(W) == W
    assert BS >= 16 and triton.next_power_of_2(BS) == BS, "tl.dot needs tiles of at least 16"
    MB = block_table.shape[1]
    out = torch.empty(B, HQ, MB, dtype=torch.float32, device=q.device)
    if B == 0 or MB == 0:
        return out
    G = HQ // H
    args = (
        q.contiguous(), codes, kmin, kmax, block_table.contiguous(), seq_lens.contiguous(), start.contiguous(), out,
        codes.stride(0), kmin.stride(0), float(scale), MB,
    )  # fmt: skip
    shape = {"HQ": HQ, "H": H, "G": G, "GP": max(16, triton.next_power_of_2(G)), "D": D, "W": W, "BS": BS}
    grid = (triton.cdiv(MB, tpp), B * H)
    if layout == "tile":
        if triton.next_power_of_2(tpp) != tpp:
            raise ValueError(f"layout='tile' takes a power-of-two tpp (blocks a tile), not {tpp}")
        quant_block_lse_tile_kernel[grid](*args, **shape, BM=tpp, BITS=bits, num_warps=num_warps)
    elif layout == "slices":
        quant_block_lse_kernel[grid](*args, **shape, BITS=bits, TPP=tpp, num_warps=num_warps)
    else:
        raise ValueError(f"layout must be 'slices' or 'tile', not {layout!r}")
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
) -> torch.Tensor:
    """Each block's softmax mass under the quantized keys, summed over each GQA group: ``[B, Hkv, MB]`` float32
    (the contract of ``reference.quant_block_scores``), from :func:`quant_block_lse` and five tensor ops. Blocks
    of fewer than 16 tokens or fewer than 16 code bytes per key (``D * bits < 128``), below ``tl.dot``'s smallest
    tile, run the reference (tensor ops, no host sync)."""
    B, HQ, _ = q.shape
    H, BS, W = codes.shape[1], codes.shape[2], codes.shape[3]
    if BS < 16 or W < 16:
        return reference.quant_block_scores(q, codes, kmin, kmax, block_table, seq_lens, start, scale, bits)
    lse = quant_block_lse(q, codes, kmin, kmax, block_table, seq_lens, start, scale, bits)
    share = (lse - torch.logsumexp(lse, -1, keepdim=True)).exp().nan_to_num(0.0)  # nothing valid: 0, not NaN
    mass = share.view(B, H, HQ // H, -1).sum(2)
    return mass.masked_fill(~reference.live_blocks(block_table, seq_lens, BS).unsqueeze(1), reference.NEG_INF)
