"""A top-p selector's ranking keys from the candidates' log-sum-exps: the Triton twin of
``reference.candidate_mass``.

One program per (sequence, KV head) walks its ``C`` candidates in tiles of ``BC`` lanes, the ``G`` rows of its group
(``[BG, BC]`` a tile), twice:

1. the online softmax statistics of each row: the running max ``m`` and the sum ``l`` of ``exp(lse - m)``, rescaled
   by ``exp(m_old - m_new)`` when the max grows (a row of ``-inf`` keeps ``m = -inf``, ``l = 0``, shifted by 0 so
   that no ``-inf - -inf`` appears);
2. each candidate's mass, ``sum_g exp(lse[g] - m[g]) / l[g] / G`` (a row with ``l = 0`` adds 0), and its key:
   ``+inf`` where the candidate is a forced block (``ops/layout.py``, the formula of ``candidate_scores_kernel``'s
   ``FORCE`` branch), ``-inf`` at padding, the mass elsewhere.

What the policy did in a dozen small torch ops after ``candidate_scores`` (softmax, ``nan_to_num``, mean over the
group, the forced mask, its gather at the candidates, two ``masked_fill``) is one launch reading ``G * C`` floats
twice and writing ``2 * C`` per (sequence, KV head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import check_candidate_mass
from .forced import forced_block, forced_bounds


@triton.jit
def candidate_mass_kernel(
    lse,  # [B, H * G, C] float32
    blocks,  # [B, H, C] logical blocks, -1 padded
    seq_lens,  # [B]
    start,  # [B]
    mass,  # [B, H, C] float32 out
    key,  # [B, H, C] float32 out
    C,
    SINK,
    WINDOW,
    H: tl.constexpr,
    G: tl.constexpr,
    BS: tl.constexpr,
    BG: tl.constexpr,
    BC: tl.constexpr,
):
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    o_g = tl.arange(0, BG)
    m_g = o_g < G
    o_row = (i_b * H * G + i_h * G + o_g).to(tl.int64) * C  # [BG] the group's rows of lse
    o_blk = i_bh.to(tl.int64) * C  # this (sequence, KV head)'s row of blocks, mass and key

    # pass 1: per row, the max m and sum l of exp(lse - m) over the candidates (online: rescaled as m grows)
    b_m = tl.full([BG], float("-inf"), tl.float32)
    b_l = tl.zeros([BG], dtype=tl.float32)
    for c0 in range(0, C, BC):
        o_c = c0 + tl.arange(0, BC)
        b_lb = tl.load(blocks + o_blk + o_c, mask=o_c < C, other=-1)  # [BC]
        # [BG, BC]
        b_x = tl.load(
            lse + o_row[:, None] + o_c[None, :], mask=m_g[:, None] & (b_lb >= 0)[None, :], other=float("-inf")
        )
        b_mn = tl.maximum(b_m, tl.max(b_x, 1))
        b_ms = tl.where(b_mn > float("-inf"), b_mn, 0.0)  # a row of -inf so far: shift by 0 (exp gives 0, never NaN)
        b_l = b_l * tl.exp(b_m - b_ms) + tl.sum(tl.exp(b_x - b_ms[:, None]), 1)
        b_m = b_mn
    b_ms = tl.where(b_m > float("-inf"), b_m, 0.0)
    b_r = tl.where(b_l > 0, 1.0 / tl.maximum(b_l, 1e-30), 0.0) / G  # [BG] a row without mass adds 0

    # the forced-block rule (ops/layout.py): the sink, the window, the current block
    n = tl.load(seq_lens + i_b)
    st = tl.load(start + i_b)
    n_blk = tl.cdiv(n, BS)
    sink_end, win_start, _ = forced_bounds(n, st, SINK, WINDOW, BS)

    # pass 2: each candidate's mass (its shares averaged over the group) and key
    for c0 in range(0, C, BC):
        o_c = c0 + tl.arange(0, BC)
        m_c = o_c < C
        b_lb = tl.load(blocks + o_blk + o_c, mask=m_c, other=-1)  # [BC]
        # [BG, BC]
        b_x = tl.load(
            lse + o_row[:, None] + o_c[None, :], mask=m_g[:, None] & (b_lb >= 0)[None, :], other=float("-inf")
        )
        b_mass = tl.sum(tl.exp(b_x - b_ms[:, None]) * b_r[:, None], 0)  # [BC]
        forced = forced_block(b_lb, n_blk, sink_end, win_start, BS)
        forced = forced & (b_lb >= 0) & (b_lb < n_blk)
        b_key = tl.where(forced, float("inf"), tl.where(b_lb >= 0, b_mass, float("-inf")))
        tl.store(mass + o_blk + o_c, b_mass, mask=m_c)
        tl.store(key + o_blk + o_c, b_key, mask=m_c)


def default_block_c(C: int, G: int) -> int:
    """Candidates per tile: the whole row up to 4096 elements a tile (``[BG, BC]``), at least 16 lanes."""
    BG = triton.next_power_of_2(G)
    return max(16, min(triton.next_power_of_2(max(C, 1)), 4096 // BG))


def candidate_mass(
    lse: torch.Tensor,
    blocks: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    block_size: int,
    sink: int,
    window: int,
    block_c: int | None = None,
    *,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each candidate's share of the candidates' softmax mass (averaged over the GQA group) and the ranking key of
    a top-p selector (see the reference).

    Args:
        lse: ``[B, Hq, C]`` or ``[B, Hkv, C]`` float32 log-sum-exps (``candidate_scores``' mass forms).
        blocks: ``[B, Hkv, C]`` logical block numbers, ``-1`` padded; seq_lens, start ``[B]``.
        block_size, sink, window: the forced-block rule's arguments.
        block_c, num_warps: tuning knobs: candidates per tile (a power of two >= 16; default
            :func:`default_block_c`), warps.

    Returns:
        ``(mass, key)``, each ``[B, Hkv, C]`` float32: mass 0 at padding; key ``+inf`` at forced candidates,
        ``-inf`` at padding, the mass elsewhere.
    """
    check_candidate_mass(lse, blocks)
    B, H, C = blocks.shape
    G = lse.shape[1] // H
    assert seq_lens.shape == (B,) and start.shape == (B,), f"seq_lens {seq_lens.shape}, start {start.shape}"
    assert lse.dtype == torch.float32, f"lse must be float32, got {lse.dtype}"
    mass = torch.empty(B, H, C, dtype=torch.float32, device=lse.device)
    key = torch.empty_like(mass)
    if B * H * C == 0:
        return mass, key
    BC = block_c or default_block_c(C, G)
    assert BC & (BC - 1) == 0 and BC >= 16, f"block_c must be a power of two >= 16, got {BC}"
    candidate_mass_kernel[(B * H,)](
        lse.contiguous(), blocks.contiguous(), seq_lens.contiguous(), start.contiguous(), mass, key, C, sink, window,
        H=H, G=G, BS=block_size, BG=triton.next_power_of_2(G), BC=BC, num_warps=num_warps,
    )  # fmt: skip
    return mass, key
