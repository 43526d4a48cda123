"""Compressed keys for selection: the Triton twins of ``reference.projected_write`` and ``reference.projected_scores``.

A compressed key is ``k @ P[h]`` with ``P [Hkv, D, R]`` a calibrated projection (a subset of channels is the special
case of one-hot columns, Double Sparsity's label cache; a PCA basis is Loki's low-rank key). The cache keeps them
per token, ``[NB, Hkv, BS, R]``, beside the pages, and every write refreshes them.

- :func:`projected_write`: one program per (tile of ``BT`` written positions, sequence, KV head) loads the rows of
  the positions ``[lo, hi)`` from the key pool through the block table, multiplies them by ``P[h]`` in float32 and
  stores the ``R`` values. The grid is sized by ``span`` (the tokens written, known on the host), never by reading
  ``lo``/``hi``: a captured decode step replays it.
- :func:`projected_scores`: one program per (tile of ``BM`` logical blocks, sequence, KV head) loads the
  ``[BM * BS, R]`` compressed keys of its blocks and the group's projected queries ``[G, R]``, takes their
  products (one ``tl.dot``), the max over the group, and stores either every token's score or each block's max,
  with the forced positions (``ops/layout.py``, the rule ``block_scores`` transcribes) at ``+inf``. It reads
  ``R / D`` of the keys' bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    b_lo = tl.load(lo + i_b).to(tl.int64)
    b_hi = tl.load(hi + i_b).to(tl.int64)
    o_p = b_lo + i_t * BT + tl.arange(0, BT)  # [BT] positions
    m_p = o_p < b_hi
    b_phys = tl.load(block_table + i_b * MB + tl.minimum(o_p // BS, MB - 1), mask=m_p, other=0)
    b_phys = tl.maximum(b_phys, 0).to(tl.int64)
    o_row = (i_h * BS + o_p % BS).to(tl.int64)
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
def projected_scores_kernel(
    qp,  # [B, HQ, R] float32
    ckeys,  # [NB, H, BS, R]
    block_table,  # [B, MB]
    seq_lens,  # [B]
    start,  # [B]
    out,  # [B, H, MB * BS] (TOKENS) or [B, H, MB], float32
    s_cn,  # ckeys stride between blocks
    MB,
    SINK,
    WINDOW,
    H: tl.constexpr,
    G: tl.constexpr,
    R: tl.constexpr,
    BS: tl.constexpr,
    BG: tl.constexpr,
    BR: tl.constexpr,
    BM: tl.constexpr,
    TOKENS: tl.constexpr,
    FORCE: tl.constexpr,
):
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    HQ = H * G
    n = tl.load(seq_lens + i_b)
    st = tl.load(start + i_b)
    n_blk = tl.cdiv(n, BS)

    o_g, o_r = tl.arange(0, BG), tl.arange(0, BR)
    m_g, m_r = o_g < G, o_r < R
    o_n = tl.arange(0, BM * BS)  # rows: block o_n // BS of the tile, offset o_n % BS
    o_rm = i_m * BM + o_n // BS
    o_pos = o_rm * BS + o_n % BS
    m_rm = (o_rm < n_blk) & (o_rm < MB)
    b_phys = tl.load(block_table + i_b * MB + o_rm, mask=m_rm, other=-1)
    m_tok = m_rm & (b_phys >= 0) & (o_pos >= st) & (o_pos < n)

    # [BG, BR]
    b_q = tl.load(
        qp + (i_b * HQ + i_h * G + o_g)[:, None] * R + o_r[None, :], mask=m_g[:, None] & m_r[None, :], other=0.0
    )
    o_c = tl.maximum(b_phys, 0).to(tl.int64) * s_cn + (i_h * BS + o_n % BS) * R
    # [BM * BS, BR]
    b_c = tl.load(ckeys + o_c[:, None] + o_r[None, :], mask=m_tok[:, None] & m_r[None, :], other=0.0)
    b_s = tl.dot(b_q.to(tl.float32), tl.trans(b_c.to(tl.float32)), input_precision="ieee")  # [BG, BM * BS]
    b_s = tl.max(tl.where(m_g[:, None], b_s, float("-inf")), 0)  # pooled over the group: [BM * BS]
    b_s = tl.where(m_tok, b_s, float("-inf"))
    if FORCE:
        sink_end = tl.minimum(st + SINK, n)
        win_start = tl.maximum(n - tl.maximum(WINDOW, 1), sink_end)
    if TOKENS:
        if FORCE:  # forced_token_mask: the sink, and [min(window start, current block start), n)
            first = tl.minimum(win_start, (n - 1) // BS * BS)
            b_s = tl.where(m_tok & ((o_pos < sink_end) | (o_pos >= first)), float("inf"), b_s)
        tl.store(out + i_bh.to(tl.int64) * MB * BS + o_pos, b_s, mask=o_rm < MB)
    else:
        b_blk = tl.max(tl.reshape(b_s, (BM, BS)), 1)  # [BM] the max of each block's tokens
        o_m = i_m * BM + tl.arange(0, BM)
        m_m = (o_m < n_blk) & (o_m < MB)
        m_live = m_m & (tl.load(block_table + i_b * MB + o_m, mask=m_m, other=-1) >= 0)
        if FORCE:  # forced_block_mask: sink, window, current block
            forced = (o_m * BS < sink_end) | ((o_m + 1) * BS > win_start) | (o_m == n_blk - 1)
            b_blk = tl.where(forced, float("inf"), b_blk)
        b_blk = tl.where(m_live, b_blk, float("-inf"))
        tl.store(out + i_bh.to(tl.int64) * MB + o_m, b_blk, mask=o_m < MB)


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
) -> torch.Tensor:
    """Approximate ``q . k`` of every token from compressed keys, max over each GQA group (see the reference).

    Args:
        qp: ``[B, Hq, R]`` projected queries; ckeys: ``[NB, Hkv, BS, R]`` (inner dims contiguous); block_table
            ``[B, MB]``; seq_lens, start ``[B]``; reduce: ``"token"`` or ``"block"``; sink, window: forcing as
            the reference; block_m: blocks per program (a power of two; default: 256 rows per program).

    Returns:
        ``[B, Hkv, MB * BS]`` (token) or ``[B, Hkv, MB]`` (block) float32.
    """
    if reduce not in ("token", "block"):
        raise ValueError(f"reduce must be 'token' or 'block', got {reduce!r}")
    B, HQ, R = qp.shape
    _, H, BS, Rc = ckeys.shape
    assert Rc == R and HQ % H == 0 and ckeys.stride()[1:] == (BS * R, R, 1), f"{qp.shape} {ckeys.shape}"
    assert block_table.shape[0] == B and seq_lens.shape == (B,) and start.shape == (B,)
    MB = block_table.shape[1]
    tokens = reduce == "token"
    out = torch.empty(B, H, MB * BS if tokens else MB, dtype=torch.float32, device=qp.device)
    if MB == 0 or B == 0:
        return out
    BM = block_m or max(1, 256 // BS)
    assert BM & (BM - 1) == 0 and BM * BS >= 16, f"block_m must be a power of two with block_m * BS >= 16, got {BM}"
    G = HQ // H
    projected_scores_kernel[(triton.cdiv(MB, BM), B * H)](
        qp.float().contiguous(), ckeys, block_table.contiguous(), seq_lens.contiguous(), start.contiguous(), out,
        ckeys.stride(0), MB, sink, window if window is not None else 0,
        H=H, G=G, R=R, BS=BS, BG=max(16, triton.next_power_of_2(G)), BR=max(16, triton.next_power_of_2(R)), BM=BM,
        TOKENS=tokens, FORCE=window is not None, num_warps=4,
    )  # fmt: skip
    return out
