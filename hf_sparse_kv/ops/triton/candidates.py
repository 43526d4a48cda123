"""Exact scores of the candidate blocks' tokens (a two-stage selector's second pass): the Triton twin of
``reference.candidate_scores``.

One program per (``tiles_per_program`` tiles of ``BC`` candidates, sequence, KV head). Per tile it maps each
candidate's logical block through the block table, loads the ``BC`` contiguous ``[BS, D]`` key runs whole
(``[BC, BS * D]``, a warp reads whole runs; viewed as ``[BC * BS, D]``), multiplies them by the group's queries
``[G, D]`` (one ``tl.dot``), takes the max over the group per token, and stores

- ``reduce="token"``: every token's score, ``[B, Hkv, C, BS]``, ``-inf`` where the position is not valid (padding
  slot ``-1``, past the end, before ``start``, evicted);
- ``reduce="block"``: each candidate block's max over its tokens, ``[B, Hkv, C]``: what a block top-k ranks, in
  one launch instead of the per-token scores, their max and the masks of the forced and padding slots;
- ``reduce="mass"``: each candidate block's log-sum-exp over its tokens of ``scale`` times their score,
  ``[B, Hkv, C]``: the softmax of these over the candidates is each block's share of the candidates' softmax mass
  (what top-p ranks), so the per-token scores are never written (``BS`` times fewer bytes out);
- ``reduce="head_mass"``: the same per query head, without the max over the group: the ``[BG, BC * BS]`` product
  viewed as ``[BG, BC, BS]`` and reduced over ``BS``, the group's ``G`` real heads stored, ``[B, Hq, C]``;

with ``window`` given, the forced positions (``ops/layout.py``: tokens in token form, blocks in block form) at
``+inf``, as ``projected_scores`` forces them. While a tile is scored, the next tile's candidate numbers and
block-table entries load (two dependent round trips that would otherwise come before each tile's keys). It reads
only the candidates' keys: ``C * BS * D`` elements per (sequence, KV head).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..reference import check_candidate_reduce
from .forced import forced_block, forced_bounds


@triton.jit
def candidate_rows(blocks, block_table, i_bh, i_b, o_c, C, MB):
    """``[BC]`` logical blocks of the candidate slots ``o_c`` (``-1`` for padding and slots past ``C``), and their
    physical blocks (``-1`` where the logical block is not in the table or was evicted)."""
    b_lb = tl.load(blocks + i_bh.to(tl.int64) * C + o_c, mask=o_c < C, other=-1)
    m_lb = (b_lb >= 0) & (b_lb < MB)
    b_phys = tl.load(block_table + i_b * MB + b_lb, mask=m_lb, other=-1)
    return tl.where(m_lb, b_lb, -1), b_phys


@triton.jit
def block_lse(b_x, AXIS: tl.constexpr):
    """Natural log-sum-exp of ``b_x`` along ``AXIS``, its scores in base 2 (``scale * log2(e) * q . k``), ``-inf``
    at invalid positions. The sum is >= 1 where a row has a valid token (its max contributes exp2(0)); without one
    the max is -inf: shifted by 0 instead, the sum is 0 and the row -inf, with no NaN or log2(0) on the way."""
    b_m = tl.max(b_x, AXIS)
    b_m = tl.where(b_m > float("-inf"), b_m, 0.0)
    b_l = tl.sum(tl.exp2(b_x - tl.expand_dims(b_m, AXIS)), AXIS)
    b_lse = (b_m + tl.log2(tl.maximum(b_l, 1.0))) * 0.6931471805599453  # ln(2)
    return tl.where(b_l > 0, b_lse, float("-inf"))


@triton.jit
def candidate_scores_kernel(
    q,  # [B, HQ, D]
    k_pool,  # [NB, H, BS, D]
    block_table,  # [B, MB]
    seq_lens,  # [B]
    start,  # [B]
    blocks,  # [B, H, C] logical blocks, -1 padded
    out,  # [B, H, C, BS] (TOKENS), [B, HQ, C] (HEADS) or [B, H, C], float32
    s_pn,  # key pool stride between blocks
    SCALE2,  # MASS, HEADS: the softmax scale times log2(e)
    C,
    MB,
    SINK,
    WINDOW,
    TPP,  # tiles per program
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BG: tl.constexpr,
    BD: tl.constexpr,
    BC: tl.constexpr,
    F32: tl.constexpr,
    TOKENS: tl.constexpr,
    MASS: tl.constexpr,
    HEADS: tl.constexpr,
    FORCE: tl.constexpr,
):
    i_s, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    HQ = H * G
    o_c = i_s * TPP * BC + tl.arange(0, BC)  # [BC] candidate slots of the first tile
    b_lb, b_phys = candidate_rows(blocks, block_table, i_bh, i_b, o_c, C, MB)
    n = tl.load(seq_lens + i_b)
    st = tl.load(start + i_b)
    n_blk = tl.cdiv(n, BS)
    if FORCE:  # ops/layout.py: the sink, the window, the current block
        sink_end, win_start, first = forced_bounds(n, st, SINK, WINDOW, BS)  # token form: [first, n)

    o_g, o_t, o_d = tl.arange(0, BG), tl.arange(0, BS), tl.arange(0, BD)
    o_col = tl.arange(0, BS * BD)
    m_g = o_g < G
    # [BG, BD]
    b_q = tl.load(
        q + (i_b * HQ + i_h * G + o_g)[:, None] * D + o_d[None, :], mask=m_g[:, None] & (o_d < D)[None, :], other=0.0
    )
    for _ in range(TPP):
        m_blk = b_phys >= 0  # [BC]
        # a (block, head)'s [BS, D] keys are contiguous: BC runs of BS * D elements, loaded whole
        o_k = tl.maximum(b_phys, 0).to(tl.int64) * s_pn + i_h * BS * D  # [BC]
        if BD == D:
            p_k = k_pool + o_k[:, None] + o_col[None, :]
            m_k = m_blk[:, None]
        else:
            p_k = k_pool + o_k[:, None] + ((o_col // BD) * D + o_col % BD)[None, :]
            m_k = m_blk[:, None] & (o_col % BD < D)[None, :]
        # [BC, BS * BD] -> [BC * BS, BD]
        b_k = tl.reshape(tl.load(p_k, mask=m_k, other=0.0), (BC * BS, BD))
        # the next tile's candidates and block-table entries, in flight while this tile is scored
        o_c_nx = o_c + BC
        b_lb_nx, b_phys_nx = candidate_rows(blocks, block_table, i_bh, i_b, o_c_nx, C, MB)
        if F32:
            b_s = tl.dot(b_q.to(tl.float32), tl.trans(b_k.to(tl.float32)), input_precision="ieee")  # [BG, BC * BS]
        else:
            b_s = tl.dot(b_q, tl.trans(b_k))
        o_pos = b_lb[:, None] * BS + o_t[None, :]  # [BC, BS]
        m_tok = m_blk[:, None] & (o_pos >= st) & (o_pos < n)
        if HEADS:  # per query head: [BG, BC, BS] -> each (head, candidate)'s log-sum-exp, G heads stored
            b_x = tl.where(m_tok[None, :, :], tl.reshape(b_s, (BG, BC, BS)) * SCALE2, float("-inf"))
            b_lse = block_lse(b_x, 2)  # [BG, BC]
            o_out = (i_b * HQ + i_h * G + o_g).to(tl.int64)[:, None] * C + o_c[None, :]
            tl.store(out + o_out, b_lse, mask=m_g[:, None] & (o_c < C)[None, :])
        else:
            b_s = tl.max(tl.where(m_g[:, None], b_s, float("-inf")), 0)  # pooled over the group: [BC * BS]
            b_s = tl.where(m_tok, tl.reshape(b_s, (BC, BS)), float("-inf"))
            if TOKENS:
                if FORCE:
                    b_s = tl.where(m_tok & ((o_pos < sink_end) | (o_pos >= first)), float("inf"), b_s)
                tl.store(out + (i_bh.to(tl.int64) * C + o_c[:, None]) * BS + o_t[None, :], b_s, mask=(o_c < C)[:, None])
            elif MASS:  # a candidate's log-sum-exp over its tokens (base 2 inside, natural out): [BC]
                tl.store(out + i_bh.to(tl.int64) * C + o_c, block_lse(b_s * SCALE2, 1), mask=o_c < C)
            else:
                b_blk = tl.max(b_s, 1)  # [BC] a candidate's best token
                if FORCE:  # forced_block_mask at the candidate's block (evicted or not, as the policies gather it)
                    forced = forced_block(b_lb, n_blk, sink_end, win_start, BS)
                    b_blk = tl.where((b_lb >= 0) & (b_lb < n_blk) & forced, float("inf"), b_blk)
                tl.store(out + i_bh.to(tl.int64) * C + o_c, b_blk, mask=o_c < C)
        o_c, b_lb, b_phys = o_c_nx, b_lb_nx, b_phys_nx


def default_block_c(BS: int, D: int) -> int:
    """Candidates per tile: 64 key rows (16 KB at ``D = 128`` in bf16), at least one block. The best of
    ``benchmarks/bench_decode.py --tune-selectors`` on an H200 (2026-11-30; 4 candidates of 16 at D = 128, 4 warps,
    one tile per program, 2 stages: 13.2 / 21.3 us at c = 2 / 4, 1 x 128K, against 14.7 / 23.8 for 8 candidates)."""
    rows = max(16, min(64, 8192 // triton.next_power_of_2(D)))
    return max(1, rows // BS)


def candidate_scores(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    blocks: torch.Tensor,
    block_c: int | None = None,
    *,
    reduce: str = "token",
    sink: int = 0,
    window: int | None = None,
    scale: float | None = None,
    tiles_per_program: int = 1,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Exact ``q . k`` (unscaled) of every token of the candidate blocks, max over each GQA group but in
    ``"head_mass"`` (see the reference).

    Args:
        q: ``[B, Hq, D]``; k_pool: ``[NB, Hkv, BS, D]`` (inner dims contiguous); block_table ``[B, MB]``;
            seq_lens, start ``[B]``; blocks: ``[B, Hkv, C]`` logical block numbers, ``-1`` padded.
        reduce: ``"token"`` (every token's score), ``"block"`` (each candidate's best token), ``"mass"`` (each
            candidate's log-sum-exp over its tokens of ``scale * score``) or ``"head_mass"`` (the same per query
            head, no max over the group).
        sink, window: with ``window`` given, the forced tokens (token) or blocks (block) score ``+inf`` (not with
            the mass forms).
        scale: the softmax scale (the mass forms only, required there).
        block_c, tiles_per_program, num_warps, num_stages: tuning knobs: candidates per tile (a power of two,
            ``block_c * BS >= 16``; default :func:`default_block_c`), tiles each program scores one after the other,
            warps, pipeline stages.

    Returns:
        ``[B, Hkv, C, BS]`` (token), ``[B, Hkv, C]`` (block, mass) or ``[B, Hq, C]`` (head_mass) float32, ``-inf``
        where invalid.
    """
    check_candidate_reduce(reduce, window, scale)
    B, HQ, D = q.shape
    _, H, BS, Dk = k_pool.shape
    assert Dk == D and HQ % H == 0 and k_pool.stride()[1:] == (BS * D, D, 1), f"{q.shape} {k_pool.shape}"
    assert BS & (BS - 1) == 0, f"block size must be a power of two, got {BS}"
    assert blocks.dim() == 3 and blocks.shape[:2] == (B, H), f"blocks {blocks.shape}"
    assert block_table.shape[0] == B and seq_lens.shape == (B,) and start.shape == (B,)
    C = blocks.shape[-1]
    tokens = reduce == "token"
    rows = HQ if reduce == "head_mass" else H
    out = torch.empty(B, rows, C, *((BS,) if tokens else ()), dtype=torch.float32, device=q.device)
    if C == 0 or B == 0:
        return out
    BC = block_c or default_block_c(BS, D)
    assert BC & (BC - 1) == 0 and BC * BS >= 16, f"block_c must be a power of two with block_c * BS >= 16, got {BC}"
    n_tiles = triton.cdiv(C, BC)
    TPP = max(1, min(tiles_per_program, n_tiles))
    candidate_scores_kernel[(triton.cdiv(n_tiles, TPP), B * H)](
        q.contiguous(), k_pool, block_table.contiguous(), seq_lens.contiguous(), start.contiguous(),
        blocks.contiguous(), out, k_pool.stride(0), (scale or 0.0) * math.log2(math.e), C, block_table.shape[1], sink,
        window if window is not None else 0,
        TPP, H=H, G=HQ // H, D=D, BS=BS, BG=max(16, triton.next_power_of_2(HQ // H)),
        BD=max(16, triton.next_power_of_2(D)), BC=BC, F32=q.dtype == torch.float32 or q.dtype != k_pool.dtype,
        TOKENS=tokens, MASS=reduce == "mass", HEADS=reduce == "head_mass", FORCE=window is not None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
