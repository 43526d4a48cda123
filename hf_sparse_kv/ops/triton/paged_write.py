"""Append tokens to the paged pool and refresh the touched blocks' key metadata: the twin of ``reference.paged_write``.

One launch. One program per (touched block ``j`` of a sequence, sequence, KV head): it loads the block's ``[BS, D]``
tile, taking the rows below ``pos0`` from the pool and the rows in ``[pos0, pos0 + T)`` from the new tokens (cast
to the pool dtype, as the pool stores them), writes the new key and value rows, and recomputes the block's min / max
/ mean over its filled prefix ``[0, fill)`` in float32 from that tile, so nothing is read back after the write.
Distinct programs own distinct (block, head) tiles, so there are no races. ``D`` is walked in chunks of ``BD``.
Metadata the cache does not keep comes as a placeholder (a tensor that is not ``[NB, Hkv, D]``) and is neither
computed nor stored (``MINMAX``, ``MEAN``); with none kept the block's old rows are not loaded either.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def paged_write_kernel(
    k_pool,  # [NB, H, BS, D]
    v_pool,  # [NB, H, BS, D]
    kmin,  # [NB, H, D]
    kmax,  # [NB, H, D]
    kmean,  # [NB, H, D]
    block_table,  # [B, MB]
    pos0,  # [B]
    k_new,  # [B, H, T, D], last dim contiguous
    v_new,  # [B, H, T, D], last dim contiguous
    s_pn,  # pool stride between blocks
    s_mn,  # metadata stride between blocks
    s_kb,
    s_kh,
    s_kt,
    s_vb,
    s_vh,
    s_vt,
    T,
    MB,
    H: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
    MINMAX: tl.constexpr,  # kmin and kmax kept
    MEAN: tl.constexpr,  # kmean kept
):
    i_j, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H

    p0 = tl.load(pos0 + i_b).to(tl.int64)
    end = p0 + T
    lb = p0 // BS + i_j  # the logical block this program owns
    touched = lb * BS < end
    fill = tl.minimum(end - lb * BS, BS)
    phys = tl.maximum(tl.load(block_table + i_b * MB + tl.minimum(lb, MB - 1)), 0).to(tl.int64)

    o_t = tl.arange(0, BS)
    o_pos = lb * BS + o_t
    m_new = touched & (o_pos >= p0) & (o_pos < end)  # [BS] rows written now
    m_old = touched & (o_pos < p0)  # rows already in the block
    m_fill = touched & (o_pos < end)  # the filled prefix [0, fill)
    o_src = tl.maximum(o_pos - p0, 0)  # row of k_new / v_new
    o_tile = phys * s_pn + (i_h * BS + o_t) * D  # [BS]

    for i_d in range(0, D, BD):
        o_d = i_d + tl.arange(0, BD)
        m_d = o_d < D
        p_pool = o_tile[:, None] + o_d[None, :]
        # [BS, BD] the new rows from k_new (in the pool dtype)
        p_k = k_new + i_b * s_kb + i_h * s_kh + o_src[:, None] * s_kt + o_d[None, :]
        b_new = tl.load(p_k, mask=m_new[:, None] & m_d[None, :], other=0.0).to(k_pool.dtype.element_ty)
        tl.store(k_pool + p_pool, b_new, mask=m_new[:, None] & m_d[None, :])
        # [BS, BD]
        p_v = v_new + i_b * s_vb + i_h * s_vh + o_src[:, None] * s_vt + o_d[None, :]
        b_v = tl.load(p_v, mask=m_new[:, None] & m_d[None, :], other=0.0).to(v_pool.dtype.element_ty)
        tl.store(v_pool + p_pool, b_v, mask=m_new[:, None] & m_d[None, :])

        if MINMAX or MEAN:
            # [BS, BD] the block's rows: old ones from the pool, new ones as written
            b_old = tl.load(k_pool + p_pool, mask=m_old[:, None] & m_d[None, :], other=0.0)
            b_k = tl.where(m_new[:, None], b_new, b_old).to(tl.float32)
            m_f = m_fill[:, None]
            p_meta = phys * s_mn + i_h * D + o_d
            m_meta = touched & m_d
            if MINMAX:
                b_min = tl.min(tl.where(m_f, b_k, float("inf")), 0)  # [BD]
                b_max = tl.max(tl.where(m_f, b_k, float("-inf")), 0)
                tl.store(kmin + p_meta, b_min.to(kmin.dtype.element_ty), mask=m_meta)
                tl.store(kmax + p_meta, b_max.to(kmax.dtype.element_ty), mask=m_meta)
            if MEAN:
                b_mean = tl.sum(tl.where(m_f, b_k, 0.0), 0) / tl.maximum(fill, 1).to(tl.float32)
                tl.store(kmean + p_meta, b_mean.to(kmean.dtype.element_ty), mask=m_meta)


def paged_write(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    kmean: torch.Tensor,
    block_table: torch.Tensor,
    pos0: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
) -> None:
    """Append ``T`` new tokens per sequence into the pool and refresh the touched blocks' key metadata, in place.

    Args:
        k_pool, v_pool: ``[NB, Hkv, BS, D]`` (inner dims contiguous).
        kmin, kmax, kmean: ``[NB, Hkv, D]`` per-block min / max / mean of the keys written so far; a placeholder
            (not 3-D) for one the cache does not keep (min and max are kept together or not at all).
        block_table: ``[B, MB]``; must already map every block the new tokens land in.
        pos0: ``[B]`` logical position of each sequence's first new token.
        k_new, v_new: ``[B, Hkv, T, D]``.

    A touched block's metadata is recomputed (float32, then cast) from its filled prefix ``[0, fill)``.
    """
    B, H, T, D = k_new.shape
    NB, Hp, BS, Dp = k_pool.shape
    assert (Hp, Dp) == (H, D) and v_new.shape == k_new.shape and v_pool.shape == k_pool.shape
    for pool in (k_pool, v_pool):
        assert pool.stride()[1:] == (BS * D, D, 1) and pool.stride(0) == k_pool.stride(0), f"pool {pool.stride()}"
    minmax, mean = kmin.dim() == 3, kmean.dim() == 3
    assert minmax == (kmax.dim() == 3), "kmin and kmax are kept together"
    kept = [m for m, on in ((kmin, minmax), (kmax, minmax), (kmean, mean)) if on]
    for meta in kept:
        assert meta.shape == (NB, H, D) and meta.stride()[1:] == (D, 1) and meta.stride(0) == kept[0].stride(0)
    assert BS & (BS - 1) == 0, f"block size must be a power of two, got {BS}"
    assert block_table.dim() == 2 and block_table.shape[0] == B and pos0.shape == (B,)
    if T == 0 or B == 0:
        return
    k_new = k_new if k_new.stride(-1) == 1 else k_new.contiguous()
    v_new = v_new if v_new.stride(-1) == 1 else v_new.contiguous()
    BD = min(max(16, triton.next_power_of_2(D)), max(16, 4096 // BS))
    n_j = (T + BS - 2) // BS + 1  # most blocks T tokens can touch, whatever pos0 % BS
    paged_write_kernel[(n_j, B * H)](
        k_pool, v_pool, kmin, kmax, kmean, block_table.contiguous(), pos0.contiguous(), k_new, v_new,
        k_pool.stride(0), kept[0].stride(0) if kept else 0, *k_new.stride()[:3], *v_new.stride()[:3], T,
        block_table.shape[1], H=H, D=D, BS=BS, BD=BD, MINMAX=minmax, MEAN=mean, num_warps=4,
    )  # fmt: skip
