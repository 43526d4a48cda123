"""Exact scores of the candidate blocks' tokens (a two-stage selector's second pass): the Triton twin of
``reference.candidate_scores``.

One program per (tile of ``BC`` candidate blocks, sequence, KV head): it maps each candidate's logical block through
the block table, loads its ``[BS, D]`` key rows (``BC * BS`` rows, each ``D`` contiguous elements), multiplies them
by the group's queries ``[G, D]`` (one ``tl.dot``) and stores the max over the group per token, ``-inf`` where the
position is not valid (padding slot ``-1``, past the end, before ``start``, evicted). It reads only the candidates'
keys: ``C * BS * D`` elements per (sequence, KV head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def candidate_scores_kernel(
    q,  # [B, HQ, D]
    k_pool,  # [NB, H, BS, D]
    block_table,  # [B, MB]
    seq_lens,  # [B]
    start,  # [B]
    blocks,  # [B, H, C] logical blocks, -1 padded
    out,  # [B, H, C, BS] float32
    s_pn,
    C,
    MB,
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BG: tl.constexpr,
    BD: tl.constexpr,
    BC: tl.constexpr,
    F32: tl.constexpr,
):
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    HQ = H * G
    n = tl.load(seq_lens + i_b)
    st = tl.load(start + i_b)

    o_n = tl.arange(0, BC * BS)  # rows: candidate o_n // BS of the tile, offset o_n % BS
    o_c = i_c * BC + o_n // BS
    m_c = o_c < C
    b_lb = tl.load(blocks + i_bh.to(tl.int64) * C + o_c, mask=m_c, other=-1)
    m_lb = m_c & (b_lb >= 0) & (b_lb < MB)
    b_phys = tl.load(block_table + i_b * MB + b_lb, mask=m_lb, other=-1)
    o_pos = b_lb * BS + o_n % BS
    m_tok = m_lb & (b_phys >= 0) & (o_pos >= st) & (o_pos < n)

    o_g, o_d = tl.arange(0, BG), tl.arange(0, BD)
    m_g, m_d = o_g < G, o_d < D
    # [BG, BD]
    b_q = tl.load(
        q + (i_b * HQ + i_h * G + o_g)[:, None] * D + o_d[None, :], mask=m_g[:, None] & m_d[None, :], other=0.0
    )
    o_k = tl.maximum(b_phys, 0).to(tl.int64) * s_pn + (i_h * BS + o_n % BS) * D
    # [BC * BS, BD]
    b_k = tl.load(k_pool + o_k[:, None] + o_d[None, :], mask=m_tok[:, None] & m_d[None, :], other=0.0)
    if F32:
        b_s = tl.dot(b_q.to(tl.float32), tl.trans(b_k.to(tl.float32)), input_precision="ieee")  # [BG, BC * BS]
    else:
        b_s = tl.dot(b_q, tl.trans(b_k))
    b_s = tl.max(tl.where(m_g[:, None], b_s, float("-inf")), 0)  # pooled over the group
    b_s = tl.where(m_tok, b_s, float("-inf"))
    tl.store(out + (i_bh.to(tl.int64) * C + i_c * BC) * BS + o_n, b_s, mask=m_c)


def candidate_scores(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    blocks: torch.Tensor,
    block_c: int | None = None,
) -> torch.Tensor:
    """Exact ``q . k`` (unscaled) of every token of the candidate blocks, max over each GQA group.

    Args:
        q: ``[B, Hq, D]``; k_pool: ``[NB, Hkv, BS, D]`` (inner dims contiguous); block_table ``[B, MB]``;
            seq_lens, start ``[B]``; blocks: ``[B, Hkv, C]`` logical block numbers, ``-1`` padded;
            block_c: candidates per program (a power of two; default: 64 rows per program).

    Returns:
        ``[B, Hkv, C, BS]`` float32, ``-inf`` at invalid positions.
    """
    B, HQ, D = q.shape
    _, H, BS, Dk = k_pool.shape
    assert Dk == D and HQ % H == 0 and k_pool.stride()[1:] == (BS * D, D, 1), f"{q.shape} {k_pool.shape}"
    assert blocks.dim() == 3 and blocks.shape[:2] == (B, H), f"blocks {blocks.shape}"
    C = blocks.shape[-1]
    out = torch.empty(B, H, C, BS, dtype=torch.float32, device=q.device)
    if C == 0 or B == 0:
        return out
    BC = block_c or max(1, 64 // BS)
    assert BC & (BC - 1) == 0 and BC * BS >= 16, f"block_c must be a power of two with block_c * BS >= 16, got {BC}"
    G = HQ // H
    candidate_scores_kernel[(triton.cdiv(C, BC), B * H)](
        q.contiguous(), k_pool, block_table.contiguous(), seq_lens.contiguous(), start.contiguous(),
        blocks.contiguous(), out, k_pool.stride(0), C, block_table.shape[1],
        H=H, G=G, D=D, BS=BS, BG=max(16, triton.next_power_of_2(G)), BD=max(16, triton.next_power_of_2(D)), BC=BC,
        F32=q.dtype == torch.float32 or q.dtype != k_pool.dtype, num_warps=4,
    )  # fmt: skip
    return out
