"""Block-sparse paged decode (split-KV, then a log-sum-exp merge): the Triton twin of ``reference.decode_blocks``.

Stage 1, :func:`sparse_decode_fwd_kernel`: one program per (split, sequence, KV head). The program holds the ``G``
query heads of its GQA group as one ``[BG, D]`` tile, walks its share of the selected blocks ``BN`` positions at a
time (a tile spans ``BN // BS`` blocks, or part of one block when ``BS > BN``), maps each selected logical block
through the block table to its physical page, loads the contiguous ``[BS, D]`` key and value rows of that
(page, head), masks them by the validity rule and folds them into an online softmax. It writes one partial output
(normalised over its split) and one log-sum-exp per split. Stage 2 merges the splits (``merge.merge_partials``);
with a single split stage 1 writes the final output directly.

One kernel, :func:`sparse_decode_fwd_kernel`, serves the block and the token modes: only the mapping of a tile's
rows to pool offsets differs (:func:`block_rows`, :func:`token_rows`), chosen at compile time; ``token_decode``
is its token-mode entry point.
Plain-PyTorch reference: ``hf_sparse_kv.ops.reference.decode_blocks``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .merge import merge_partials_fwd

LOG2E = 1.4426950408889634


# ------------------------------------------------------------------------------------------------ shared helpers


@triton.jit
def attend_tile(b_q, b_k, b_v, m_n, b_m, b_l, b_acc, qk_scale, F32: tl.constexpr):
    """Fold one tile of keys/values into the running softmax of a query group.

    b_q ``[BG, BD]``; b_k, b_v ``[BN, BD]``; m_n ``[BN]`` valid positions; b_m, b_l ``[BG]`` running max (log2
    domain) and sum; b_acc ``[BG, BD]`` running un-normalised output. Returns the updated (b_m, b_l, b_acc).
    """
    if F32:
        # [BG, BN] exact float32 products (no tf32), as the reference computes
        b_s = tl.dot(b_q.to(tl.float32), tl.trans(b_k.to(tl.float32)), input_precision="ieee")
    else:
        b_s = tl.dot(b_q, tl.trans(b_k))
    b_s = tl.where(m_n[None, :], b_s * qk_scale, float("-inf"))
    # online softmax: the new running max covers the old one and this tile; a row that has seen no valid position
    # keeps max -inf, so exponents are taken against a finite stand-in (0) to avoid -inf - -inf = NaN
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
    b_m_ref = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    # rescale what was accumulated under the old max: alpha = 2^(m_old - m_new) (0 when nothing was accumulated)
    b_alpha = tl.exp2(b_m - b_m_ref)
    b_p = tl.exp2(b_s - b_m_ref[:, None])  # [BG, BN], 0 at masked positions
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    if F32:
        b_pv = tl.dot(b_p, b_v.to(tl.float32), input_precision="ieee")
    else:
        b_pv = tl.dot(b_p.to(b_v.dtype), b_v)
    b_acc = b_acc * b_alpha[:, None] + b_pv
    return b_m_new, b_l, b_acc


@triton.jit
def store_split(
    o,
    lse,
    b_m,
    b_l,
    b_acc,
    i_b,
    i_h,
    i_s,
    S,
    HQ: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BG: tl.constexpr,
    BD: tl.constexpr,
):
    """Normalise a split's accumulator and store it at ``o[b, h*G + g, s, :]`` and its log-sum-exp at ``lse[b, ., s]``.

    ``o`` is ``[B, HQ, S, D]`` (any float dtype, cast on store), ``lse`` ``[B, HQ, S]`` float32. An empty split
    (sum 0) stores output 0 and log-sum-exp -inf.
    """
    o_g = tl.arange(0, BG)
    o_d = tl.arange(0, BD)
    m_g = o_g < G
    m_d = o_d < D
    m_any = b_l > 0
    b_o = b_acc / tl.where(m_any, b_l, 1.0)[:, None]
    # back from log2 to natural log: lse = (m + log2 l) * ln 2
    b_lse = tl.where(m_any, (b_m + tl.log2(tl.where(m_any, b_l, 1.0))) * 0.6931471805599453, float("-inf"))
    o_row = (i_b * HQ + i_h * G + o_g).to(tl.int64) * S + i_s  # [BG]
    p_o = o + o_row[:, None] * D + o_d[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_g[:, None] & m_d[None, :])
    tl.store(lse + o_row, b_lse, mask=m_g)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few splits, so that the merge path runs in CPU tests too


def default_block_n(D: int, elem_size: int) -> int:
    """Positions per tile: a ``[BN, D]`` tile of 32 KB (128 rows of bf16 at D=128), between 16 and 128.

    Measured on an H200 (bf16, D=128, 2026-11-29, benchmarks/RESULTS.md): 128 rows with 2 pipeline stages were the
    fastest or within 1% at batch 8 x 32K (1/8), and within 4% of the best (3 stages, fewer splits) at batch 1 x 128K.
    """
    BD = max(16, triton.next_power_of_2(D))
    return max(16, min(128, 32768 // (BD * elem_size)))


def default_num_splits(n_programs: int, n_tiles: int, device: torch.device, waves: int = 2, min_tiles: int = 2) -> int:
    """Splits per (sequence, KV head): enough programs for ``waves`` per multiprocessor, at least ``min_tiles`` each."""
    want = triton.cdiv(waves * _sm_count(device), n_programs)
    return max(1, min(want, triton.cdiv(n_tiles, min_tiles)))


def check_decode_args(q, k_pool, v_pool, block_table, seq_lens, start, sel, ex_lo, ex_hi):
    """Shape and stride checks shared by the decode launchers; returns (B, HQ, H, G, D, BS, MB)."""
    B, HQ, D = q.shape
    _, H, BS, Dk = k_pool.shape
    assert Dk == D and v_pool.shape == k_pool.shape, f"pools {tuple(k_pool.shape)}/{tuple(v_pool.shape)} vs D={D}"
    assert HQ % H == 0, f"query heads {HQ} not a multiple of KV heads {H}"
    assert k_pool.dtype == v_pool.dtype, "k_pool and v_pool must share a dtype"
    for pool in (k_pool, v_pool):  # one (block, head) must be one contiguous [BS, D] tile
        assert pool.stride()[1:] == (BS * D, D, 1), f"pool inner dims must be contiguous, strides {pool.stride()}"
        assert pool.stride(0) == k_pool.stride(0), "k_pool and v_pool must share the block stride"
    assert BS & (BS - 1) == 0, f"block size must be a power of two, got {BS}"
    assert block_table.dim() == 2 and block_table.shape[0] == B, f"block_table {tuple(block_table.shape)}, B={B}"
    assert sel.dim() == 3 and sel.shape[:2] == (B, H), f"selection {tuple(sel.shape)} vs (B, Hkv) = ({B}, {H})"
    for t in (seq_lens, start, ex_lo, ex_hi):
        assert t.shape == (B,), f"per-sequence tensors must be [B]={B}, got {tuple(t.shape)}"
    assert q.device == k_pool.device == block_table.device == sel.device, "all tensors must share a device"
    return B, HQ, H, HQ // H, D, BS, block_table.shape[1]


# ------------------------------------------------------------------------------------------------------- kernel


@triton.jit
def block_rows(
    blocks,
    block_table,
    i_bh,
    i_b,
    i_h,
    i_t,
    K,
    MB,
    s_kn,
    st,
    seq_len,
    lo,
    hi,
    BS: tl.constexpr,
    BN: tl.constexpr,
    D: tl.constexpr,
):
    """Pool offsets ``[BN]`` and validity ``[BN]`` of the rows of tile ``i_t`` of a (sequence, head)'s selection.

    Row n of the tile is flat position f = i_t*BN + n of the selection: selected block f // BS, offset f % BS.
    """
    o_f = i_t * BN + tl.arange(0, BN)
    o_k = o_f // BS
    o_t = o_f % BS
    # [BN] logical block of each row (the same value repeats BS times; the repeats hit the cache)
    b_lb = tl.load(blocks + i_bh * K + o_k, mask=o_k < K, other=-1)
    o_pos = b_lb * BS + o_t
    m_n = (b_lb >= 0) & (o_pos >= st) & (o_pos < seq_len) & ((o_pos < lo) | (o_pos >= hi))
    b_phys = tl.load(block_table + i_b * MB + tl.minimum(tl.maximum(b_lb, 0), MB - 1))
    o_kv = tl.maximum(b_phys, 0).to(tl.int64) * s_kn + (i_h * BS + o_t) * D
    return o_kv, m_n


@triton.jit
def token_rows(
    tokens,
    block_table,
    i_bh,
    i_b,
    i_h,
    i_t,
    T,
    MB,
    s_kn,
    st,
    seq_len,
    lo,
    hi,
    BS: tl.constexpr,
    BN: tl.constexpr,
    D: tl.constexpr,
):
    """Pool offsets ``[BN]`` and validity ``[BN]`` of the rows of tile ``i_t`` of a (sequence, head)'s tokens."""
    o_i = i_t * BN + tl.arange(0, BN)
    # [BN] selected positions
    b_pos = tl.load(tokens + i_bh * T + o_i, mask=o_i < T, other=-1)
    m_n = (b_pos >= 0) & (b_pos >= st) & (b_pos < seq_len) & ((b_pos < lo) | (b_pos >= hi))
    b_pc = tl.maximum(b_pos, 0)
    b_phys = tl.load(block_table + i_b * MB + tl.minimum(b_pc // BS, MB - 1))
    o_kv = tl.maximum(b_phys, 0).to(tl.int64) * s_kn + (i_h * BS + b_pc % BS) * D
    return o_kv, m_n


@triton.jit
def selected_rows(
    sel, block_table, i_bh, i_b, i_h, i_t, NSEL, MB, s_kn, st, seq_len, lo, hi,
    BS: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, TOKENS: tl.constexpr,
):  # fmt: skip
    """Tile ``i_t``'s pool offsets and validity: of token positions (``TOKENS``) or of whole selected blocks."""
    if TOKENS:
        o_kv, m_n = token_rows(sel, block_table, i_bh, i_b, i_h, i_t, NSEL, MB, s_kn, st, seq_len, lo, hi, BS, BN, D)
    else:
        o_kv, m_n = block_rows(sel, block_table, i_bh, i_b, i_h, i_t, NSEL, MB, s_kn, st, seq_len, lo, hi, BS, BN, D)
    return o_kv, m_n


@triton.jit
def sparse_decode_fwd_kernel(
    q,  # [B, HQ, D]
    k,  # [NB, H, BS, D]
    v,  # [NB, H, BS, D]
    block_table,  # [B, MB]
    seq_lens,  # [B]
    start,  # [B]
    sel,  # [B, H, NSEL] logical block numbers (or token positions if TOKENS), -1 padded
    ex_lo,  # [B]
    ex_hi,  # [B]
    o,  # [B, HQ, S, D] partial outputs
    lse,  # [B, HQ, S] float32 partial log-sum-exp
    qk_scale,  # softmax scale * log2(e)
    s_kn,  # pool stride between blocks (elements)
    NSEL,
    MB,
    S,
    TILES_PER_SPLIT,
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BG: tl.constexpr,
    BD: tl.constexpr,
    BN: tl.constexpr,
    F32: tl.constexpr,
    PREFETCH: tl.constexpr,
    TOKENS: tl.constexpr,
):
    i_s, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    HQ = H * G

    o_g = tl.arange(0, BG)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    # [BG, BD] the group's query heads
    p_q = q + (i_b * HQ + i_h * G + o_g)[:, None] * D + o_d[None, :]
    b_q = tl.load(p_q, mask=(o_g < G)[:, None] & m_d[None, :], other=0.0)

    seq_len = tl.load(seq_lens + i_b)
    st = tl.load(start + i_b)
    lo = tl.load(ex_lo + i_b)
    hi = tl.load(ex_hi + i_b)

    b_m = tl.full([BG], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BG], dtype=tl.float32)
    b_acc = tl.zeros([BG, BD], dtype=tl.float32)

    # the last split may run past the selection: those rows load index -1 and are masked
    t0 = i_s * TILES_PER_SPLIT
    o_kv, m_n = selected_rows(
        sel, block_table, i_bh, i_b, i_h, t0, NSEL, MB, s_kn, st, seq_len, lo, hi, BS, BN, D, TOKENS
    )
    for i_t in range(t0, t0 + TILES_PER_SPLIT):
        if not PREFETCH:
            o_kv, m_n = selected_rows(
                sel, block_table, i_bh, i_b, i_h, i_t, NSEL, MB, s_kn, st, seq_len, lo, hi, BS, BN, D, TOKENS
            )
        # [BN, BD] keys and values of the selected rows; masked rows are not read
        m_kv = m_n[:, None] & m_d[None, :]
        b_k = tl.load(k + o_kv[:, None] + o_d[None, :], mask=m_kv, other=0.0)
        b_v = tl.load(v + o_kv[:, None] + o_d[None, :], mask=m_kv, other=0.0)
        if PREFETCH:
            # the next tile's two dependent index loads (selection, then block table), issued while this tile's keys
            # and values are in flight, so that each tile waits for one memory round trip instead of three
            o_kv_nx, m_n_nx = selected_rows(
                sel, block_table, i_bh, i_b, i_h, i_t + 1, NSEL, MB, s_kn, st, seq_len, lo, hi, BS, BN, D, TOKENS
            )
        b_m, b_l, b_acc = attend_tile(b_q, b_k, b_v, m_n, b_m, b_l, b_acc, qk_scale, F32)
        if PREFETCH:
            o_kv, m_n = o_kv_nx, m_n_nx

    store_split(o, lse, b_m, b_l, b_acc, i_b, i_h, i_s, S, HQ, G, D, BG, BD)


# ----------------------------------------------------------------------------------------------------- launcher


def sparse_decode_fwd(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    sel: torch.Tensor,
    ex_lo: torch.Tensor,
    ex_hi: torch.Tensor,
    scale: float,
    tokens: bool = False,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    prefetch: bool = True,
    merge: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch stage 1 (and the merge when there is more than one split); returns (out ``[B, Hq, D]``, lse ``[B, Hq]``).

    ``merge=False`` (for timing stage 1 alone) returns the partials ``[B, Hq, S, D]`` float32 and ``[B, Hq, S]`` when
    there is more than one split.

    ``sel [B, Hkv, NSEL]`` holds logical block numbers, or token positions when ``tokens`` (one kernel serves both:
    only the mapping of a tile's rows to pool offsets differs).

    ``block_n`` (positions per tile, a power of two >= 16), ``num_splits``, ``num_warps``, ``num_stages`` and
    ``prefetch`` (load the next tile's indices early) are tuning knobs; the defaults come from
    :func:`default_block_n` and :func:`default_num_splits`.
    """
    B, HQ, H, G, D, BS, MB = check_decode_args(q, k_pool, v_pool, block_table, seq_lens, start, sel, ex_lo, ex_hi)
    NSEL = sel.shape[-1]
    q, sel, block_table = q.contiguous(), sel.contiguous(), block_table.contiguous()
    F32 = q.dtype != k_pool.dtype or k_pool.dtype == torch.float32
    BN = block_n or default_block_n(D, 4 if F32 else k_pool.element_size())
    assert BN >= 16 and BN & (BN - 1) == 0, f"block_n must be a power of two >= 16, got {BN}"
    n_tiles = triton.cdiv(NSEL * (1 if tokens else BS), BN)
    S = num_splits or default_num_splits(B * H, n_tiles, q.device)
    S = max(1, min(S, max(n_tiles, 1)))
    tiles_per_split = triton.cdiv(n_tiles, S) if n_tiles else 0
    S = triton.cdiv(n_tiles, tiles_per_split) if n_tiles else 1  # no split left without a tile

    out = torch.empty(B, HQ, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, HQ, dtype=torch.float32, device=q.device)
    if S == 1:  # a single split is already the answer: store it in place
        o_part, lse_part = out, lse
    else:
        o_part = torch.empty(B, HQ, S, D, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(B, HQ, S, dtype=torch.float32, device=q.device)
    grid = (S, B * H)
    sparse_decode_fwd_kernel[grid](
        q, k_pool, v_pool, block_table, seq_lens.contiguous(), start.contiguous(), sel, ex_lo.contiguous(),
        ex_hi.contiguous(), o_part, lse_part, scale * LOG2E, k_pool.stride(0), NSEL, MB, S, tiles_per_split,
        H=H, G=G, D=D, BS=BS, BG=max(16, triton.next_power_of_2(G)), BD=max(16, triton.next_power_of_2(D)), BN=BN,
        F32=F32, PREFETCH=prefetch, TOKENS=tokens, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if S > 1 and not merge:
        return o_part, lse_part
    if S > 1:
        merge_partials_fwd(o_part, lse_part, out=out, lse_out=lse)
    return out, lse


def decode_blocks_fwd(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sparse_decode_fwd` over selected blocks (``sel`` = logical block numbers); the same tuning knobs."""
    return sparse_decode_fwd(*args, tokens=False, **kwargs)


def decode_blocks(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    blocks: torch.Tensor,
    ex_lo: torch.Tensor,
    ex_hi: torch.Tensor,
    scale: float,
    return_lse: bool = False,
):
    """Block-sparse paged decode: read only the selected pages, whole, and mask inside them by the validity rule.

    Args:
        q: ``[B, Hq, D]``; k_pool, v_pool: ``[NB, Hkv, BS, D]`` (inner dims contiguous); block_table ``[B, MB]``;
            seq_lens, start, ex_lo, ex_hi ``[B]`` (the validity rule, see ``reference``).
        blocks: ``[B, Hkv, K]`` logical block numbers, ``-1`` padded anywhere.
        scale: softmax scale.

    Returns:
        ``[B, Hq, D]`` in ``q.dtype`` (and the log-sum-exp ``[B, Hq]`` float32 if ``return_lse``); a head with
        nothing to attend gives 0 and ``-inf``.
    """
    out, lse = decode_blocks_fwd(q, k_pool, v_pool, block_table, seq_lens, start, blocks, ex_lo, ex_hi, scale)
    return (out, lse) if return_lse else out
