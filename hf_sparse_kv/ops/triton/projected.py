"""Compressed keys for selection: the Triton twins of ``reference.projected_write`` and ``reference.projected_scores``.

A compressed key is ``k @ P[h]`` with ``P [Hkv, D, R]`` a calibrated projection (a subset of channels is the special
case of one-hot columns, Double Sparsity's label cache; a PCA basis is Loki's low-rank key). The cache keeps them
per token, ``[NB, Hkv, BS, R]``, beside the pages, and every write refreshes them.

- :func:`projected_write`: one program per (tile of ``BT`` written positions, sequence, KV head) loads the rows of
  the positions ``[lo, hi)`` from the key pool through the block table, multiplies them by ``P[h]`` in float32 and
  stores the ``R`` values. The grid is sized by ``span`` (the tokens written, known on the host), never by reading
  ``lo``/``hi``: a captured decode step replays it.
- :func:`projected_scores`: one program per (``tiles_per_program`` tiles of ``BM`` logical blocks, sequence, KV
  head). A (block, head)'s ``[BS, R]`` compressed keys are one contiguous run, so a tile is ``BM`` runs loaded
  whole as ``[BM, BS * R]`` (a warp reads whole runs) and viewed as ``[BM, BS, R]``; each of the group's ``G``
  projected queries is multiplied in and summed over ``R`` in registers (no ``tl.dot``: ``G`` and ``R`` are too
  small for one, its operands would be padded to 16 and pass through shared memory), and the max over the group
  is stored per token, or its max over each block's tokens per block, with the forced positions
  (``ops/layout.py``, the rule ``block_scores`` transcribes) at ``+inf``. It reads ``R / D`` of the keys' bytes,
  once. Given ``qproj``, the kernel projects the raw queries itself (``G x D x R`` multiply-adds per program), so
  the selector launches nothing before it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .forced import forced_block, forced_bounds
from .written import written_positions


@triton.jit
def projected_write_kernel(
    ckeys,  # [NB, H, BS, R]
    k_pool,  # [NB, H, BS, D]
    proj,  # [H, D, R] float32
    block_table,  # [B, MB]
    lo,  # [B]
    hi,  # [B]
    s_pn,  # key pool stride between blocks
    s_cn,  # ckeys stride between blocks
    MB,
    H: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    BS: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    BR: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    b_phys, off, m_p = written_positions(lo, hi, block_table, i_b, i_t, MB, BS, BT)  # [BT] each
    o_row = (i_h * BS + off).to(tl.int64)
    o_d = tl.arange(0, BD)
    o_r = tl.arange(0, BR)
    m_d, m_r = o_d < D, o_r < R
    # [BT, BD]
    b_k = tl.load(
        k_pool + (b_phys * s_pn + o_row * D)[:, None] + o_d[None, :], mask=m_p[:, None] & m_d[None, :], other=0.0
    ).to(tl.float32)
    # [BD, BR]
    b_p = tl.load(proj + i_h * D * R + o_d[:, None] * R + o_r[None, :], mask=m_d[:, None] & m_r[None, :], other=0.0)
    b_c = tl.dot(b_k, b_p.to(tl.float32), input_precision="ieee")  # [BT, BR]
    p_c = ckeys + (b_phys * s_cn + o_row * R)[:, None] + o_r[None, :]
    tl.store(p_c, b_c.to(ckeys.dtype.element_ty), mask=m_p[:, None] & m_r[None, :])


def projected_write(
    ckeys: torch.Tensor,
    k_pool: torch.Tensor,
    proj: torch.Tensor,
    block_table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    span: int,
) -> None:
    """Store the projected keys ``k @ proj[h]`` of the stored positions ``lo[b] <= p < hi[b]``, in place.

    Args:
        ckeys: ``[NB, Hkv, BS, R]`` (inner dims contiguous); k_pool: ``[NB, Hkv, BS, D]`` (inner dims contiguous);
        proj: ``[Hkv, D, R]``; block_table: ``[B, MB]``; lo, hi: ``[B]``; span: a host int ``>= max(hi - lo)``.
    """
    NB, H, BS, D = k_pool.shape
    R = ckeys.shape[-1]
    assert ckeys.shape[:3] == (NB, H, BS) and proj.shape == (H, D, R), f"{ckeys.shape} {proj.shape} {k_pool.shape}"
    assert k_pool.stride()[1:] == (BS * D, D, 1) and ckeys.stride()[1:] == (BS * R, R, 1)
    B = block_table.shape[0]
    assert lo.shape == (B,) and hi.shape == (B,)
    if span <= 0 or B == 0:
        return
    BT = max(16, min(64, triton.next_power_of_2(span)))
    projected_write_kernel[(triton.cdiv(span, BT), B * H)](
        ckeys, k_pool, proj.float().contiguous(), block_table.contiguous(), lo.contiguous(), hi.contiguous(),
        k_pool.stride(0), ckeys.stride(0), block_table.shape[1],
        H=H, D=D, R=R, BS=BS, BT=BT, BD=max(16, triton.next_power_of_2(D)), BR=max(16, triton.next_power_of_2(R)),
        num_warps=4,
    )  # fmt: skip


@triton.jit
def group_queries(
    q, qproj, i_b, i_h,
    HQ: tl.constexpr, G: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
    BR: tl.constexpr, BD: tl.constexpr, PROJ: tl.constexpr,
):  # fmt: skip
    """The projected queries of KV head ``i_h``'s group: a tuple of ``G`` float32 ``[BR]`` vectors.

    ``PROJ``: ``q`` holds the queries ``[B, HQ, D]`` and each is multiplied by ``qproj[i_h] [D, R]`` here (loaded
    transposed, ``[BR, BD]``, so that the sum over ``D`` stays within a warp); otherwise ``q`` holds them
    projected, ``[B, HQ, R]``. Every load is issued before the first product.
    """
    o_r = tl.arange(0, BR)
    m_r = o_r < R
    rows = ()
    if PROJ:
        o_d = tl.arange(0, BD)
        m_d = o_d < D
        # [BR, BD]
        b_pt = tl.load(qproj + i_h * D * R + o_d[None, :] * R + o_r[:, None], mask=m_r[:, None] & m_d[None, :])
        for g in tl.static_range(G):
            rows = rows + (tl.load(q + (i_b * HQ + i_h * G + g) * D + o_d, mask=m_d, other=0.0),)  # [BD]
        qs = ()
        for g in tl.static_range(G):
            qs = qs + (tl.sum(rows[g].to(tl.float32)[None, :] * b_pt, 1),)
    else:
        for g in tl.static_range(G):
            rows = rows + (tl.load(q + (i_b * HQ + i_h * G + g) * R + o_r, mask=m_r, other=0.0).to(tl.float32),)
        qs = rows
    return qs


@triton.jit
def projected_scores_kernel(
    q,  # [B, HQ, R] projected queries, or [B, HQ, D] queries (PROJ)
    qproj,  # [H, D, R] float32 (PROJ only)
    ckeys,  # [NB, H, BS, R]
    block_table,  # [B, MB]
    seq_lens,  # [B]
    start,  # [B]
    out,  # [B, H, MB * BS] (TOKENS) or [B, H, MB], float32
    s_cn,  # ckeys stride between blocks
    MB,
    SINK,
    WINDOW,
    TPP,  # tiles per program
    H: tl.constexpr,
    G: tl.constexpr,
    R: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BR: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    TOKENS: tl.constexpr,
    FORCE: tl.constexpr,
    PROJ: tl.constexpr,
):
    i_s, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    n = tl.load(seq_lens + i_b)
    st = tl.load(start + i_b)
    n_blk = tl.cdiv(n, BS)
    if FORCE:  # ops/layout.py: the sink, the window, the current block
        sink_end, win_start, first = forced_bounds(n, st, SINK, WINDOW, BS)  # token form: [first, n)

    # the block table of the first tile, read without waiting for seq_lens (entries past the end are masked below)
    # and before the queries' prologue, so that both round trips overlap
    o_m = i_s * TPP * BM + tl.arange(0, BM)
    b_phys = tl.load(block_table + i_b * MB + o_m, mask=o_m < MB, other=-1)
    o_t, o_col = tl.arange(0, BS), tl.arange(0, BS * BR)
    for _ in range(TPP):
        m_m = (o_m < n_blk) & (o_m < MB)
        m_live = m_m & (b_phys >= 0)
        # a (block, head)'s [BS, R] compressed keys are contiguous: the tile is BM rows of BS * R elements, each
        # loaded whole (positions before start or past the end inside a live block are read, then masked)
        o_c = tl.maximum(b_phys, 0).to(tl.int64) * s_cn + i_h * BS * R  # [BM]
        if BR == R:
            p_c = ckeys + o_c[:, None] + o_col[None, :]
            m_c = m_live[:, None]
        else:
            p_c = ckeys + o_c[:, None] + ((o_col // BR) * R + o_col % BR)[None, :]
            m_c = m_live[:, None] & (o_col % BR < R)[None, :]
        # [BM, BS * BR] -> [BM, BS, BR]
        b_c = tl.reshape(tl.load(p_c, mask=m_c, other=0.0).to(tl.float32), (BM, BS, BR))
        # the queries after the tile's load is issued, so that their round trip (and the projection) overlap it
        qs = group_queries(q, qproj, i_b, i_h, H * G, G, R, D, BR, BD, PROJ)  # G x [BR]
        # the next tile's block table, in flight while this tile is scored
        o_m_nx = o_m + BM
        b_phys_nx = tl.load(block_table + i_b * MB + o_m_nx, mask=o_m_nx < MB, other=-1)
        # q . k of each query head of the group (a multiply and a sum over R: no tl.dot, whose operands would be
        # padded to 16 heads and pass through shared memory), max over the group: [BM, BS]
        b_s = tl.full([BM, BS], float("-inf"), dtype=tl.float32)
        for g in tl.static_range(G):
            b_s = tl.maximum(b_s, tl.sum(b_c * qs[g][None, None, :], 2))
        o_pos = o_m[:, None] * BS + o_t[None, :]  # [BM, BS]
        m_tok = m_live[:, None] & (o_pos >= st) & (o_pos < n)
        b_s = tl.where(m_tok, b_s, float("-inf"))
        if TOKENS:
            if FORCE:
                b_s = tl.where(m_tok & ((o_pos < sink_end) | (o_pos >= first)), float("inf"), b_s)
            tl.store(out + i_bh.to(tl.int64) * MB * BS + o_pos, b_s, mask=(o_m < MB)[:, None])
        else:
            b_blk = tl.max(b_s, 1)  # [BM] the max of each block's tokens
            if FORCE:
                forced = forced_block(o_m, n_blk, sink_end, win_start, BS)
                b_blk = tl.where(forced, float("inf"), b_blk)
            b_blk = tl.where(m_live, b_blk, float("-inf"))
            tl.store(out + i_bh.to(tl.int64) * MB + o_m, b_blk, mask=o_m < MB)
        o_m, b_phys = o_m_nx, b_phys_nx


def default_block_m(BS: int, R: int) -> int:
    """Blocks per tile: 1024 compressed-key rows (32 KB at ``R = 16`` in bf16), fewer for a wider ``R``. The best of
    ``benchmarks/bench_decode.py --tune-selectors`` on an H200 (2026-11-30; 64 blocks of 16 at R = 16, 4 warps, one
    tile per program: 21.1 us at 1 x 128K, 35.8 at 8 x 32K, against 21.6 and 37.9 for 32 blocks)."""
    rows = min(1024, 16384 // triton.next_power_of_2(R))
    return max(1, rows // BS)


def projected_scores(
    qp: torch.Tensor,
    ckeys: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    reduce: str,
    sink: int = 0,
    window: int | None = None,
    block_m: int | None = None,
    *,
    qproj: torch.Tensor | None = None,
    tiles_per_program: int = 1,
    num_warps: int = 4,
) -> torch.Tensor:
    """Approximate ``q . k`` of every token from compressed keys, max over each GQA group (see the reference).

    Args:
        qp: ``[B, Hq, R]`` projected queries, or with ``qproj`` the queries ``[B, Hq, D]`` (projected in the
            kernel's prologue: no launch before it); ckeys: ``[NB, Hkv, BS, R]`` (inner dims contiguous);
            block_table ``[B, MB]``; seq_lens, start ``[B]``; reduce: ``"token"`` or ``"block"``; sink, window:
            forcing as the reference.
        qproj: ``[Hkv, D, R]`` the queries' projection (float32), or ``None``.
        block_m, tiles_per_program, num_warps: tuning knobs: blocks per tile (a power of two; default
            :func:`default_block_m`), tiles each program scores one after the other (the next tile's block-table
            entries load while a tile is scored; the query projection is made once per program), warps.

    Returns:
        ``[B, Hkv, MB * BS]`` (token) or ``[B, Hkv, MB]`` (block) float32.
    """
    if reduce not in ("token", "block"):
        raise ValueError(f"reduce must be 'token' or 'block', got {reduce!r}")
    B, HQ, DQ = qp.shape
    _, H, BS, R = ckeys.shape
    assert HQ % H == 0 and ckeys.stride()[1:] == (BS * R, R, 1), f"{qp.shape} {ckeys.shape}"
    assert block_table.shape[0] == B and seq_lens.shape == (B,) and start.shape == (B,)
    assert BS & (BS - 1) == 0, f"block size must be a power of two, got {BS}"
    project = qproj is not None
    if project:
        assert qproj.shape == (H, DQ, R), f"qproj {tuple(qproj.shape)} vs queries {tuple(qp.shape)}, R={R}"
        qproj = qproj.float().contiguous()
    else:
        assert DQ == R, f"projected queries {tuple(qp.shape)} vs compressed keys {tuple(ckeys.shape)}"
    MB = block_table.shape[1]
    tokens = reduce == "token"
    out = torch.empty(B, H, MB * BS if tokens else MB, dtype=torch.float32, device=qp.device)
    if MB == 0 or B == 0:
        return out
    BM = block_m or default_block_m(BS, R)
    assert BM >= 1 and BM & (BM - 1) == 0, f"block_m must be a power of two, got {BM}"
    n_tiles = triton.cdiv(MB, BM)
    TPP = max(1, min(tiles_per_program, n_tiles))
    projected_scores_kernel[(triton.cdiv(n_tiles, TPP), B * H)](
        qp.contiguous(), qproj if project else qp, ckeys, block_table.contiguous(), seq_lens.contiguous(),
        start.contiguous(), out, ckeys.stride(0), MB, sink, window if window is not None else 0, TPP,
        H=H, G=HQ // H, R=R, D=DQ, BS=BS, BR=triton.next_power_of_2(R), BD=triton.next_power_of_2(DQ), BM=BM,
        TOKENS=tokens, FORCE=window is not None, PROJ=project, num_warps=num_warps,
    )  # fmt: skip
    return out
