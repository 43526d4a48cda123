"""Plain-PyTorch reference of every sparse-KV op: the CPU backend and the oracle of the Triton kernels.

Everything computes in float32 and casts the result back to the input dtype. Shapes use these names:

- ``B`` sequences, ``Hq`` query heads, ``Hkv`` KV heads, ``G = Hq // Hkv`` query heads per KV head, ``D`` head dim
- ``NB`` blocks in the pool, ``BS`` tokens per block, ``MB`` block-table width, ``K`` selected blocks,
  ``T`` selected tokens, ``L`` context length (the largest ``seq_lens``)

The paged layout (docs/ARCHITECTURE.md): a layer's keys and values live in pools ``[NB, Hkv, BS, D]``; sequence ``b``'s
token at logical position ``p`` sits in physical block ``block_table[b, p // BS]`` at offset ``p % BS``.

The token-validity rule shared by every attention op: position ``p`` of sequence ``b`` may be attended iff
``start[b] <= p < seq_lens[b]`` (``start`` skips left padding) and not ``ex_lo[b] <= p < ex_hi[b]`` (the
exclusion interval lets a block-granular selection stay token-exact, e.g. SinkWindow's gap between sink and window).
Selections hold *logical* block numbers or token positions, padded with -1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .layout import cdiv, forced_block_mask, forced_blocks_at, forced_token_mask, num_blocks

NEG_INF = float("-inf")


def valid_positions(
    pos: torch.Tensor, seq_lens: torch.Tensor, start: torch.Tensor, ex_lo: torch.Tensor, ex_hi: torch.Tensor
) -> torch.Tensor:
    """The validity rule: ``pos [B, ...]`` int positions -> bool of the same shape (``-1`` is never valid)."""
    shape = (-1,) + (1,) * (pos.dim() - 1)
    lens, st, lo, hi = (t.view(shape) for t in (seq_lens, start, ex_lo, ex_hi))
    return (pos >= st) & (pos < lens) & ~((pos >= lo) & (pos < hi)) & (pos >= 0)


def held_positions(
    block_table: torch.Tensor, seq_lens: torch.Tensor, start: torch.Tensor, block_size: int
) -> torch.Tensor:
    """``[B, MB, BS]`` bool: logical position ``m * BS + t`` of each sequence is valid (``start <= p < seq_len``)
    and its block held (table entry ``>= 0``). ``block_table [B, MB]``; ``seq_lens``, ``start`` ``[B]``."""
    MB = block_table.shape[1]
    pos = torch.arange(MB * block_size, device=block_table.device).view(MB, block_size)
    return (pos < seq_lens.view(-1, 1, 1)) & (pos >= start.view(-1, 1, 1)) & (block_table >= 0).unsqueeze(-1)


def physical_slots(block_table: torch.Tensor, pos: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Map logical positions ``pos [B, ...]`` (any value; invalid ones are clamped) to (physical block, offset)."""
    B, MB = block_table.shape
    p = pos.clamp(min=0)
    logical = (p // block_size).clamp(max=MB - 1)
    phys = torch.gather(block_table.long(), 1, logical.reshape(B, -1)).reshape(pos.shape).clamp(min=0)
    return phys, p % block_size


# ----------------------------------------------------------------------------------------------------------- write


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
        k_pool, v_pool: ``[NB, Hkv, BS, D]``.
        kmin, kmax, kmean: ``[NB, Hkv, D]`` per-block elementwise min / max / mean of the keys written so far; a
            placeholder (``None``, or any tensor that is not 3-D: the cache passes a one-element one) for one the
            cache does not keep (left alone).
        block_table: ``[B, MB]`` int32; must already map every block the new tokens land in.
        pos0: ``[B]`` int, logical position of each sequence's first new token. It may be negative: token ``t`` goes
            to position ``pos0 + t`` and positions below 0 are skipped (left padding dropped on the way in).
        k_new, v_new: ``[B, Hkv, T, D]``.

    The metadata of a touched block is recomputed from its filled prefix ``[0, fill)`` (``fill`` = tokens of the
    block below ``pos0 + T``), so a block is always described by exactly the tokens it holds.
    """
    B, _H, T, _D = k_new.shape
    BS = k_pool.shape[2]
    pos = pos0.long().view(B, 1) + torch.arange(T, device=k_new.device).view(1, T)  # [B, T]
    keep = pos >= 0
    phys, off = physical_slots(block_table, pos, BS)
    phys, off = phys[keep], off[keep]
    k_pool[phys, :, off] = k_new.permute(0, 2, 1, 3)[keep].to(k_pool.dtype)  # [N, H, D]
    v_pool[phys, :, off] = v_new.permute(0, 2, 1, 3)[keep].to(v_pool.dtype)
    refresh_metadata(k_pool, kmin, kmax, kmean, block_table, pos0.long().clamp(min=0), pos0.long() + T)


def refresh_metadata(
    k_pool: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    kmean: torch.Tensor,
    block_table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
) -> None:
    """Recompute min / max / mean of the blocks holding positions ``[lo[b], hi[b])`` of each sequence, in place,
    each over its filled prefix (positions below ``hi[b]``); a placeholder (:func:`metadata_kept`) is skipped."""
    if not any(metadata_kept(t) for t in (kmin, kmax, kmean)):
        return
    BS = k_pool.shape[2]
    for b in range(block_table.shape[0]):
        l, h = int(lo[b]), int(hi[b])
        if h <= l:
            continue
        lbs = torch.arange(l // BS, (h - 1) // BS + 1, device=k_pool.device)
        refresh_blocks(k_pool, kmin, kmax, kmean, block_table[b, lbs].long(), (h - lbs * BS).clamp(max=BS))


def refresh_blocks(
    k_pool: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    kmean: torch.Tensor,
    blocks: torch.Tensor,
    fill: torch.Tensor,
) -> None:
    """Recompute min / max / mean of the physical blocks ``blocks [n]`` (long) over their first ``fill [n]`` slots,
    in place: :func:`refresh_metadata`'s work for blocks already found, with no host read (a crop passes every
    sequence's last block at once). A placeholder (:func:`metadata_kept`) is skipped."""
    if not any(metadata_kept(t) for t in (kmin, kmax, kmean)):
        return
    keys, ok, lo_, hi_ = _prefix_range(k_pool[blocks], fill)
    if metadata_kept(kmin):
        kmin[blocks] = lo_.to(kmin.dtype)
    if metadata_kept(kmax):
        kmax[blocks] = hi_.to(kmax.dtype)
    if metadata_kept(kmean):
        kmean[blocks] = (keys.masked_fill(~ok, 0.0).sum(2) / fill.view(-1, 1, 1)).to(kmean.dtype)


def metadata_kept(meta: torch.Tensor | None) -> bool:
    """Whether a key metadata operand is one a cache keeps (``[NB, Hkv, D]``), not ``None`` nor the placeholder a
    write is given for metadata the cache does not keep."""
    return meta is not None and meta.dim() == 3


def _prefix_range(
    blocks: torch.Tensor, fill: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``blocks [n, H, BS, D]`` filled up to ``fill [n]`` slots: (the blocks in float32, the filled slots
    ``[n, 1, BS, 1]``, each channel's min and max over them ``[n, H, D]`` float32)."""
    keys = blocks.float()
    BS = keys.shape[2]
    ok = (torch.arange(BS, device=keys.device).view(1, BS) < fill.view(-1, 1)).view(-1, 1, BS, 1)
    return keys, ok, keys.masked_fill(~ok, float("inf")).amin(2), keys.masked_fill(~ok, float("-inf")).amax(2)


def gather_dense(pool: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Contiguous copy of the first ``length`` positions: ``pool [NB, H, BS, D]`` -> ``[B, H, length, D]``."""
    BS = pool.shape[2]
    nblk = cdiv(length, BS)
    blocks = pool[block_table[:, :nblk].long().clamp(min=0)]  # [B, nblk, H, BS, D]
    B, _, H, _, D = blocks.shape
    return blocks.permute(0, 2, 1, 3, 4).reshape(B, H, nblk * BS, D)[:, :, :length]


# ---------------------------------------------------------------------------------------------------------- scores


def _group_q(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    B, Hq, D = q.shape
    return q.float().view(B, num_kv_heads, Hq // num_kv_heads, D)  # [B, Hkv, G, D]


def _pool_groups(through_pool: bool | int, rows: int, pool: int) -> int:
    """The groups of a ``through_pool`` argument: ``True`` (or 1) one, an int ``n > 1`` that many, each of
    ``rows / n`` consecutive rows reading only its ``pool / n`` consecutive blocks of the pool (several sequences'
    scored queries, each sequence's slice of the pool its own: the ``simulate`` way's windows scored together)."""
    groups = int(through_pool)
    if groups < 1 or rows % groups or pool % groups:
        raise ValueError(f"through_pool={through_pool!r}: {rows} rows and {pool} pool blocks in equal groups")
    return groups


def _in_group(block_table: torch.Tensor, groups: int, per_group: int) -> torch.Tensor:
    """``block_table`` (``[B, MB]``, -1 for none) as indices into each row's group's slice of the pool (``groups``
    consecutive slices of ``per_group`` blocks); ``-1`` entries read the slice's first block (to be masked)."""
    B = block_table.shape[0]
    first = (torch.arange(B, device=block_table.device) // (B // groups) * per_group).view(-1, 1)
    table = block_table.long()
    return torch.where(table >= 0, table - first, 0)


def live_blocks(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[B, MB]`` bool: the block exists (before the sequence's end) and was not evicted (table entry ``>= 0``)."""
    MB = block_table.shape[1]
    before_end = torch.arange(MB, device=block_table.device).view(1, -1) < num_blocks(seq_lens, block_size).view(-1, 1)
    return before_end & (block_table >= 0)


def _forced_and_live(
    s: torch.Tensor,
    live: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor | None,
    sink: int,
    window: int | None,
    block_size: int,
) -> torch.Tensor:
    """Block scores ``s [B, Hkv, MB]`` with the rule every block scorer ends on: with ``window`` given, the blocks
    of :func:`forced_block_mask` among the ``live [B, MB]`` ones at ``+inf`` (``start`` ``None``: 0); blocks not
    live at ``-inf``."""
    if window is not None:
        start = torch.zeros_like(seq_lens) if start is None else start
        forced = forced_block_mask(seq_lens, start, sink, window, block_size, s.shape[-1]) & live
        s = s.masked_fill(forced.unsqueeze(1), float("inf"))
    return s.masked_fill(~live.unsqueeze(1), NEG_INF)


def block_scores(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    kmean: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    method: str,
    start: torch.Tensor | None = None,
    sink: int = 0,
    window: int | None = None,
    through_pool: bool | int = False,
) -> torch.Tensor:
    """Score every block of every sequence from its key metadata, pooled over each GQA group.

    Args:
        q: ``[B, Hq, D]`` decode queries (unscaled: the scale does not change a ranking).
        kmin, kmax, kmean: ``[NB, Hkv, D]``.
        block_table: ``[B, MB]``; seq_lens: ``[B]``.
        method: ``"quest"`` for the bound ``sum_d max(q_d min_d, q_d max_d)`` (Quest), ``"mean"`` for ``q . mean``.
        start, sink, window: with ``window`` given, the blocks of :func:`forced_block_mask` (sink from ``start [B]``,
            window, current block) score ``+inf`` (a top-k then always keeps them).
        through_pool: score every block of the pool and pick each row's through its table (rows sharing one pool:
            the ``simulate`` way's scored queries), Quest's bound as ``q+ . max + q- . min``: the same scores up to
            float32 rounding, without the ``[B, MB, Hkv, G, D]`` products. An int ``n > 1``: the rows are ``n`` equal
            groups, each sharing its own of ``n`` equal consecutive slices of the pool (scored against it only).

    Returns:
        ``[B, Hkv, MB]`` float32, the max over the group's query heads; ``-inf`` past each sequence's last block and
        for evicted blocks (table entry -1), ``+inf`` for forced blocks still held.
    """
    Hkv = kmin.shape[1]
    qg = _group_q(q, Hkv)  # [B, Hkv, G, D]
    phys = block_table.long().clamp(min=0)  # [B, MB]
    if method not in ("quest", "mean"):
        raise ValueError(f"method must be 'quest' or 'mean', got {method!r}")
    if through_pool:
        B, MB = phys.shape
        groups = _pool_groups(through_pool, B, kmin.shape[0])
        if groups == 1:
            if method == "quest":  # max(q lo, q hi) = q+ hi + q- lo, as lo <= hi
                pooled = torch.einsum("bhgd,nhd->bnhg", qg.clamp(min=0), kmax.float())
                pooled = pooled + torch.einsum("bhgd,nhd->bnhg", qg.clamp(max=0), kmin.float())
            else:
                pooled = torch.einsum("bhgd,nhd->bnhg", qg, kmean.float())  # [B, NB, Hkv, G]
        else:  # each group of rows against its slice of the pool only
            n = kmin.shape[0] // groups
            qw = qg.view(groups, B // groups, *qg.shape[1:])

            def per_group(x: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
                return torch.einsum("wbhgd,wnhd->wbnhg", x, meta.float().view(groups, n, *meta.shape[1:])).flatten(0, 1)

            if method == "quest":
                pooled = per_group(qw.clamp(min=0), kmax) + per_group(qw.clamp(max=0), kmin)
            else:
                pooled = per_group(qw, kmean)  # [B, n, Hkv, G]
            phys = _in_group(block_table, groups, n)
        s = pooled.amax(-1).gather(1, phys.view(B, MB, 1).expand(B, MB, Hkv))  # [B, MB, Hkv]
    elif method == "quest":
        lo, hi = kmin[phys].float(), kmax[phys].float()  # [B, MB, Hkv, D]
        qe = qg.unsqueeze(1)  # [B, 1, Hkv, G, D]
        s = torch.maximum(qe * lo.unsqueeze(3), qe * hi.unsqueeze(3)).sum(-1).amax(-1)  # [B, MB, Hkv]
    else:
        s = torch.einsum("bhgd,bmhd->bmhg", qg, kmean[phys].float()).amax(-1)
    s = s.permute(0, 2, 1)  # [B, Hkv, MB]
    live = live_blocks(block_table, seq_lens, block_size)
    return _forced_and_live(s, live, seq_lens, start, sink, window, block_size).contiguous()


SHARE_POOLS = ("mean", "max")


def block_shares(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    pool: str = "mean",
    start: torch.Tensor | None = None,
    sink: int = 0,
    window: int | None = None,
) -> torch.Tensor:
    """Quest's bound per query head as that head's estimated share of the blocks' softmax mass, pooled over each
    GQA group like the oracle (:func:`oracle_block_scores`) pools the true shares.

    Per sequence ``b``, query head ``h`` (of KV head ``h // G``) and block ``m`` in use (before the sequence's end, not
    evicted): ``u[b, h, m] = scale * sum_d max(q[b, h, d] kmin[m, d], q[b, h, d] kmax[m, d])`` (Quest's bound on the
    block's best logit), and ``share[b, h, m] = softmax over the blocks in use of u[b, h, :]`` (every block in use,
    forced ones included, as the oracle's softmax covers every key). The bound stands in for a block's log-mass: each
    query head's shares sum to 1, so no head outweighs the others by the norm of its query, as it does in
    :func:`block_scores`' max of the raw bounds.

    Args:
        q: ``[B, Hq, D]`` decode queries (unscaled); kmin, kmax: ``[NB, Hkv, D]``; block_table: ``[B, MB]``;
            seq_lens: ``[B]``; block_size: ``BS``; scale: the softmax scale (> 0: it sets how peaked the shares are).
        pool: ``"mean"``: ``mean_g share[b, k G + g, m]`` (the oracle's sum over the group, divided by ``G``);
            ``"max"``: ``max_g share[b, k G + g, m]`` (each head normalized, then the group's best).
        start, sink, window: with ``window`` given, the blocks of :func:`forced_block_mask` score ``+inf``.

    Returns:
        ``[B, Hkv, MB]`` float32 in ``[0, 1]``; ``-inf`` past each sequence's last block and for evicted blocks,
        ``+inf`` for forced blocks still held. A sequence without a block in use is all ``-inf``.
    """
    if pool not in SHARE_POOLS:
        raise ValueError(f"pool must be one of {SHARE_POOLS}, got {pool!r}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")
    B, Hkv, MB = q.shape[0], kmin.shape[1], block_table.shape[1]
    phys = block_table.long().clamp(min=0)  # [B, MB]
    lo, hi = kmin[phys].float(), kmax[phys].float()  # [B, MB, Hkv, D]
    qe = _group_q(q, Hkv).unsqueeze(1)  # [B, 1, Hkv, G, D]
    u = torch.maximum(qe * lo.unsqueeze(3), qe * hi.unsqueeze(3)).sum(-1) * scale  # [B, MB, Hkv, G]
    live = live_blocks(block_table, seq_lens, block_size)  # [B, MB]
    u = u.permute(0, 2, 3, 1).masked_fill(~live.view(B, 1, 1, MB), NEG_INF)  # [B, Hkv, G, MB]
    share = u.softmax(-1).nan_to_num(0.0)  # a sequence without a block in use: NaN -> 0 (masked below)
    s = share.mean(2) if pool == "mean" else share.amax(2)  # [B, Hkv, MB]
    return _forced_and_live(s, live, seq_lens, start, sink, window, block_size).contiguous()


def pool_logits(
    q: torch.Tensor, k_pool: torch.Tensor, block_table: torch.Tensor, length: int, through_pool: bool | int = True
) -> torch.Tensor:
    """``q . k`` (unscaled, float32) of every query head with the first ``length`` positions of its sequence:
    ``[B, Hkv, G, length]``, computed against every block of the pool and then picked through the table (an
    evicted block's entry ``-1`` reads block 0: mask it). Costs ``B x pool`` scores instead of :func:`gather_dense`'s
    ``B x length x D`` copied keys: for rows that share most of one pool (the ``simulate`` way's scored queries of one
    sequence), not for a batch of separate sequences. ``through_pool`` an int ``n > 1``: the rows are ``n`` equal
    groups, each against its own of ``n`` equal consecutive slices of the pool (several sequences' scored queries)."""
    Hkv, BS = k_pool.shape[1], k_pool.shape[2]
    groups = _pool_groups(through_pool, q.shape[0], k_pool.shape[0])
    nblk = cdiv(length, BS)
    qg = _group_q(q, Hkv)  # [B, Hkv, G, D]
    B, _, G, D = qg.shape
    if groups == 1:
        s = torch.einsum("bhgd,nhsd->bhgns", qg, k_pool.float())  # [B, Hkv, G, NB, BS]
        table = block_table[:, :nblk].long().clamp(min=0)
    else:
        n = k_pool.shape[0] // groups
        pool = k_pool.float().view(groups, n, Hkv, BS, D)
        s = torch.einsum("wbhgd,wnhsd->wbhgns", qg.view(groups, B // groups, Hkv, G, D), pool).flatten(0, 1)
        table = _in_group(block_table[:, :nblk], groups, n)
    idx = table.view(B, 1, 1, nblk, 1).expand(B, Hkv, G, nblk, BS)
    return s.gather(3, idx).reshape(B, Hkv, G, nblk * BS)[..., :length]


def token_scores(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    length: int | None = None,
    through_pool: bool | int = False,
) -> torch.Tensor:
    """Exact ``q . k`` of every token, max over each GQA group: ``[B, Hkv, L]`` float32, ``-inf`` where invalid
    (padding, past the end, in an evicted block). ``L`` is ``length`` (at most the table's ``MB * BS``), by default
    ``max(seq_lens)`` (read from the device). ``through_pool``: the products by :func:`pool_logits` (rows sharing
    one pool, or with an int ``n > 1`` ``n`` groups of rows each sharing its slice of it, as in :func:`block_scores`)
    instead of gathered keys; the same scores up to float32 rounding."""
    L = int(seq_lens.max()) if length is None else length
    if through_pool:
        s = pool_logits(q, k_pool, block_table, L, through_pool).amax(2)
    else:
        keys = gather_dense(k_pool, block_table, L).float()  # [B, Hkv, L, D]
        s = torch.einsum("bhgd,bhld->bhgl", _group_q(q, k_pool.shape[1]), keys).amax(2)
    pos = torch.arange(L, device=q.device).expand(q.shape[0], L)
    zero = torch.zeros_like(seq_lens)
    ok = valid_positions(pos, seq_lens, start, zero, zero) & _live_positions(block_table, k_pool.shape[2], L)
    return s.masked_fill(~ok.unsqueeze(1), NEG_INF)


def _live_positions(block_table: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """``[B, length]`` bool: the position's block was not evicted (its table entry is not -1)."""
    nblk = cdiv(length, block_size)
    live = block_table[:, :nblk] >= 0
    return live.repeat_interleave(block_size, dim=1)[:, :length]


def oracle_block_scores(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    length: int | None = None,
    through_pool: bool | int = False,
) -> torch.Tensor:
    """True softmax mass of each block, summed over each GQA group's query heads: ``[B, Hkv, MB]`` float32.

    Reads every key (an oracle: the Triton backend's twin, ``ops/triton/exact.py``, reads them once through the
    candidate kernel) up to ``length`` positions (default ``max(seq_lens)``,
    read from the device). Blocks past the sequence or evicted get ``-inf``. ``through_pool``: the products by
    :func:`pool_logits` (rows sharing one pool), as in :func:`token_scores`.
    """
    BS = k_pool.shape[2]
    L = int(seq_lens.max()) if length is None else length
    if through_pool:
        logits = pool_logits(q, k_pool, block_table, L, through_pool) * scale
    else:
        keys = gather_dense(k_pool, block_table, L).float()
        logits = torch.einsum("bhgd,bhld->bhgl", _group_q(q, k_pool.shape[1]), keys) * scale
    pos = torch.arange(L, device=q.device).expand(q.shape[0], L)
    zero = torch.zeros_like(seq_lens)
    ok = valid_positions(pos, seq_lens, start, zero, zero) & _live_positions(block_table, BS, L)
    # a sequence with nothing valid has no mass (0), not NaN
    p = logits.masked_fill(~ok.view(ok.shape[0], 1, 1, L), NEG_INF).softmax(-1).nan_to_num(0.0).sum(2)  # [B, Hkv, L]
    nblk = cdiv(L, BS)
    return held_block_mass(F.pad(p, (0, nblk * BS - L)).view(*p.shape[:2], nblk, BS).sum(-1), block_table, seq_lens, BS)


def held_block_mass(mass: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int):
    """``mass [B, Hkv, nblk]`` of the first ``nblk`` logical blocks as the oracle's ``[B, Hkv, MB]`` scores: ``-inf``
    past them, past each sequence's end and at evicted blocks (:func:`live_blocks`). Shared with the Triton twin of
    :func:`oracle_block_scores`."""
    B, H, nblk = mass.shape
    out = torch.full((B, H, block_table.shape[1]), NEG_INF, device=mass.device)
    out[..., :nblk] = mass
    return out.masked_fill(~live_blocks(block_table, seq_lens, block_size).unsqueeze(1), NEG_INF)


# ------------------------------------------------------------------------------------------------------- selection


def topk_indices(scores: torch.Tensor, k: int, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Top indices along the last dim, ascending, ``-1``-padded: ``[B, H, N] -> [B, H, k]`` int32.

    Keeps ``counts[b]`` entries for sequence ``b`` (default ``k``) and never an index whose score is ``-inf``;
    ``k`` may exceed ``N``. Ascending order keeps a kernel's reads in pool order.
    """
    N = scores.shape[-1]
    kk = min(k, N)
    val, idx = scores.topk(kk, dim=-1)  # descending
    drop = val == NEG_INF
    if counts is not None:
        rank = torch.arange(kk, device=scores.device).view(1, 1, kk)
        drop = drop | (rank >= counts.to(scores.device).view(-1, 1, 1))
    big = torch.iinfo(torch.int32).max
    idx = torch.where(drop, torch.full_like(idx, big), idx).sort(-1).values
    idx = torch.where(idx == big, torch.full_like(idx, -1), idx)
    if kk < k:
        idx = F.pad(idx, (0, k - kk), value=-1)
    return idx.to(torch.int32)


def blocks_to_tokens(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """Expand logical block numbers ``[B, Hkv, K]`` to token positions ``[B, Hkv, K * BS]`` (``-1`` stays ``-1``)."""
    tok = blocks.long().unsqueeze(-1) * block_size + torch.arange(block_size, device=blocks.device)
    tok = torch.where(blocks.unsqueeze(-1) < 0, torch.full_like(tok, -1), tok)
    return tok.flatten(-2).to(torch.int32)


def selection_to_mask(
    indices: torch.Tensor,
    kind: str,
    block_size: int,
    length: int,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    ex_lo: torch.Tensor,
    ex_hi: torch.Tensor,
) -> torch.Tensor:
    """Dense boolean mask ``[B, Hkv, length]`` of what a selection lets a decode query attend (the ``mask`` mode)."""
    tok = blocks_to_tokens(indices, block_size) if kind == "block" else indices
    B, H, _ = tok.shape
    mask = torch.zeros(B, H, length + 1, dtype=torch.bool, device=tok.device)
    t = tok.long().clamp(max=length)
    mask.scatter_(2, torch.where(t < 0, torch.full_like(t, length), t), True)
    mask = mask[..., :length]
    pos = torch.arange(length, device=tok.device).expand(B, length)
    return mask & valid_positions(pos, seq_lens, start, ex_lo, ex_hi).unsqueeze(1)


# ------------------------------------------------------------------------------------------------------- attention


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ok: torch.Tensor, scale: float):
    """Grouped attention in float32. q ``[B, Hkv, G, D]``, keys/values ``[B, Hkv, N, D]``, ok ``[B, Hkv, N]``.

    Returns (out ``[B, Hkv, G, D]``, lse ``[B, Hkv, G]``); a row with nothing to attend gives 0 and ``-inf``.
    """
    logits = torch.einsum("bhgd,bhnd->bhgn", q, keys.float()) * scale
    logits = logits.masked_fill(~ok.unsqueeze(2), NEG_INF)
    lse = torch.logsumexp(logits, -1)  # [B, Hkv, G]
    p = torch.exp(logits - lse.unsqueeze(-1).clamp(min=-1e30)).nan_to_num(0.0)
    return torch.einsum("bhgn,bhnd->bhgd", p, values.float()), lse


def decode_tokens(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    tokens: torch.Tensor,
    ex_lo: torch.Tensor,
    ex_hi: torch.Tensor,
    scale: float,
    return_lse: bool = False,
):
    """Token-sparse decode: gather only the selected positions of the paged cache and attend to them.

    Args:
        q: ``[B, Hq, D]``; k_pool, v_pool: ``[NB, Hkv, BS, D]``; block_table ``[B, MB]``; seq_lens, start ``[B]``.
        tokens: ``[B, Hkv, T]`` int32 logical positions, ``-1`` padded (a position listed twice counts twice).
        ex_lo, ex_hi: ``[B]`` the exclusion interval of the validity rule.
        scale: softmax scale.

    Returns:
        ``[B, Hq, D]`` in ``q.dtype`` (and the log-sum-exp ``[B, Hq]`` float32 if ``return_lse``).
    """
    B, Hq, D = q.shape
    Hkv, BS = k_pool.shape[1], k_pool.shape[2]
    phys, off = physical_slots(block_table, tokens.long(), BS)  # [B, Hkv, T]
    head = torch.arange(Hkv, device=q.device).view(1, Hkv, 1)
    keys, values = k_pool[phys, head, off], v_pool[phys, head, off]  # [B, Hkv, T, D]
    ok = valid_positions(tokens.long(), seq_lens, start, ex_lo, ex_hi)
    out, lse = _attend(_group_q(q, Hkv), keys, values, ok, scale)
    out = out.reshape(B, Hq, D).to(q.dtype)
    return (out, lse.reshape(B, Hq)) if return_lse else out


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

    Same as :func:`decode_tokens` but ``blocks [B, Hkv, K]`` holds logical block numbers (``-1`` padded): each
    selected block contributes its ``BS`` positions.
    """
    B, Hq, D = q.shape
    Hkv, BS = k_pool.shape[1], k_pool.shape[2]
    K = blocks.shape[-1]
    lb = blocks.long()
    # a block number past the table is invalid anyway (its positions lie past seq_lens): clamp it for the gather
    lb_safe = lb.clamp(min=0, max=block_table.shape[1] - 1)
    phys = torch.gather(block_table.long(), 1, lb_safe.view(B, -1)).view(B, Hkv, K).clamp(min=0)
    head = torch.arange(Hkv, device=q.device).view(1, Hkv, 1)
    keys = k_pool[phys, head].reshape(B, Hkv, K * BS, D)  # [B, Hkv, K, BS, D] -> flat
    values = v_pool[phys, head].reshape(B, Hkv, K * BS, D)
    ok = valid_positions(blocks_to_tokens(blocks, BS).long(), seq_lens, start, ex_lo, ex_hi)
    out, lse = _attend(_group_q(q, Hkv), keys, values, ok, scale)
    out = out.reshape(B, Hq, D).to(q.dtype)
    return (out, lse.reshape(B, Hq)) if return_lse else out


def decode_masked(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The ``mask`` mode: dense attention over the whole cache with unselected positions at ``-inf``.

    ``mask [B, Hkv, L]`` bool with ``L = max(seq_lens)``. Reads every K/V: it expresses sparsity, it saves nothing.
    """
    B, Hq, D = q.shape
    Hkv = k_pool.shape[1]
    L = mask.shape[-1]
    keys, values = gather_dense(k_pool, block_table, L), gather_dense(v_pool, block_table, L)
    out, _ = _attend(_group_q(q, Hkv), keys, values, mask, scale)
    return out.reshape(B, Hq, D).to(q.dtype)


def merge_partials(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge split-KV partial results by their log-sum-exp.

    Args:
        o: ``[..., S, D]`` partial outputs, each normalised over its own split.
        lse: ``[..., S]`` their log-sum-exp (``-inf`` for an empty split).

    Returns:
        (``[..., D]`` merged output in ``o.dtype``, ``[...]`` merged log-sum-exp float32).
    """
    lse = lse.float()
    total = torch.logsumexp(lse, -1)  # [...]
    w = torch.exp(lse - total.unsqueeze(-1).clamp(min=-1e30)).nan_to_num(0.0)  # [..., S]
    return (w.unsqueeze(-1) * o.float()).sum(-2).to(o.dtype), total


# ------------------------------------------------------------------------------------------ compressed-key selectors


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
        ckeys: ``[NB, Hkv, BS, R]`` the compressed keys (a projection, or a subset of channels: one-hot columns).
        k_pool: ``[NB, Hkv, BS, D]``; proj: ``[Hkv, D, R]`` (float32); block_table: ``[B, MB]``.
        lo, hi: ``[B]`` the positions written; span: a host int ``>= max(hi - lo)``.

    Vectorized (:func:`store_written`): no host read of ``lo``/``hi``.
    """
    store_written(ckeys, k_pool, block_table, lo, hi, span, lambda k: torch.einsum("bthd,hdr->bthr", k, proj.float()))


def store_written(state, k_pool, block_table, lo, hi, span: int, code) -> None:
    """Store ``code`` of the keys at the stored positions ``lo[b] <= p < hi[b]`` into the per-token ``state [NB, Hkv,
    BS, ...]``, in place (the writes of :func:`projected_write`, :func:`fp8_write` and :func:`pq_write`). ``code``:
    keys ``[B, span, Hkv, D]`` float32 -> ``[B, span, Hkv, ...]``, cast to ``state``'s dtype. A position past the
    table or in a freed block (its entry ``-1``) is not written, as the kernels skip it (it has no page of its own).

    Vectorized over (sequence, position) without reading ``lo``/``hi`` on the host: each sequence computes ``span``
    positions; every entry that writes nothing (past ``hi``, outside the table, in a freed block) is pointed at the
    first entry that does and stores that entry's value again (one slot, one value: the stores do not race), or,
    when no entry writes anything, each stores back what its slot holds.
    """
    B, BS = block_table.shape[0], k_pool.shape[2]
    if span <= 0 or B == 0:
        return
    MB = block_table.shape[1]
    lo, hi = lo.long().view(B, 1), hi.long().view(B, 1)
    pos = lo + torch.arange(span, device=k_pool.device).view(1, span)  # [B, span]
    logical = pos // BS
    entry = torch.gather(block_table.long(), 1, logical.clamp(0, MB - 1))
    ok = ((pos >= 0) & (pos < hi) & (logical < MB) & (entry >= 0)).flatten()  # [B * span]
    idx = torch.where(ok, torch.arange(ok.numel(), device=ok.device), ok.int().argmax())  # the first ok, or 0
    # physical_slots' mapping, from the entries already gathered
    phys, off = entry.clamp(min=0).flatten()[idx], (pos.clamp(min=0) % BS).flatten()[idx]
    new = code(k_pool[phys, :, off].float().unsqueeze(0)).squeeze(0).to(state.dtype)  # [B * span, Hkv, ...]
    state[phys, :, off] = torch.where(ok.any(), new, state[phys, :, off])


def projected_scores(
    qp: torch.Tensor,
    ckeys: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    reduce: str,
    sink: int = 0,
    window: int | None = None,
    *,
    qproj: torch.Tensor | None = None,
) -> torch.Tensor:
    """Approximate ``q . k`` of every token from compressed keys, max over each GQA group.

    Args:
        qp: ``[B, Hq, R]`` the projected queries, or with ``qproj`` the queries ``[B, Hq, D]``; ckeys:
            ``[NB, Hkv, BS, R]``; block_table ``[B, MB]``; seq_lens, start ``[B]``.
        reduce: ``"token"`` (a score per position) or ``"block"`` (the max of each block's token scores).
        sink, window: with ``window`` given, the forced positions (``forced_token_mask``) or blocks
            (``forced_block_mask``) score ``+inf``.
        qproj: ``[Hkv, D, R]`` the queries' projection: query head ``h * G + g`` is multiplied by ``qproj[h]``
            first (the Triton kernel does it in its prologue, without a launch of its own).

    Returns:
        ``[B, Hkv, MB * BS]`` (token) or ``[B, Hkv, MB]`` (block) float32, ``-inf`` where invalid (padding, past the
        end, evicted; a block with no valid token).
    """
    _, Hkv, BS, R = ckeys.shape
    if qproj is not None:
        B, Hq, D = qp.shape
        qp = torch.einsum("bhgd,hdr->bhgr", qp.float().view(B, Hkv, Hq // Hkv, D), qproj.float()).reshape(B, Hq, R)
    B, Hq, _ = qp.shape
    MB = block_table.shape[1]
    c = ckeys[block_table.long().clamp(min=0)].float()  # [B, MB, Hkv, BS, R]
    s = torch.einsum("bhgr,bmhtr->bhmtg", qp.float().view(B, Hkv, Hq // Hkv, R), c).amax(-1)  # [B, Hkv, MB, BS]
    pos = torch.arange(MB * BS, device=qp.device).expand(B, MB * BS)
    zero = torch.zeros_like(seq_lens)
    live = (block_table >= 0).repeat_interleave(BS, dim=1)
    ok = (valid_positions(pos, seq_lens, start, zero, zero) & live).view(B, 1, MB, BS)
    s = s.masked_fill(~ok, NEG_INF)
    if reduce == "token":
        s = s.reshape(B, Hkv, MB * BS)
        if window is not None:
            forced = forced_token_mask(seq_lens, start, sink, window, BS, MB * BS)
            s = s.masked_fill(forced.unsqueeze(1) & (s > NEG_INF), float("inf"))
        return s.contiguous()
    if reduce != "block":
        raise ValueError(f"reduce must be 'token' or 'block', got {reduce!r}")
    s = s.amax(-1)  # [B, Hkv, MB]
    alive = live_blocks(block_table, seq_lens, BS)
    return _forced_and_live(s, alive, seq_lens, start, sink, window, BS).contiguous()


QUANT_BITS = (2, 4)


def quant_levels(bits: int) -> int:
    """The largest code of ``bits``-bit keys (``2 ** bits - 1``); raises for a width other than 2 or 4."""
    if bits not in QUANT_BITS:
        raise ValueError(f"bits must be one of {QUANT_BITS}, got {bits!r}")
    return 2**bits - 1


def quantize_keys(keys: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of ``keys [..., BS, D]`` on the uniform grid of ``2 ** bits`` levels from ``lo`` to ``hi`` (``[..., D]``,
    each channel its own range): ``round((k - lo) / delta)`` clamped to the levels, ``delta = (hi - lo) / levels``
    (code 0 where ``hi == lo``), packed planar into ``[..., BS, D * bits // 8]`` uint8: byte ``i`` holds the codes of
    channels ``i, i + W, i + 2W, ...`` (``W = D * bits // 8``) from its low bits up."""
    L = quant_levels(bits)
    D = keys.shape[-1]
    per = 8 // bits
    if D % per:
        raise ValueError(f"{bits}-bit keys pack {per} channels per byte: the head dim {D} is not a multiple of {per}")
    lo, hi = lo.float().unsqueeze(-2), hi.float().unsqueeze(-2)
    delta = (hi - lo) / L
    code = torch.where(delta > 0, torch.floor((keys.float() - lo) / delta + 0.5), torch.zeros_like(delta))
    code = code.clamp(0, L).to(torch.int32)
    W = D // per
    packed = torch.zeros(*code.shape[:-1], W, dtype=torch.int32, device=keys.device)
    for j in range(per):
        packed |= code[..., j * W : (j + 1) * W] << (j * bits)
    return packed.to(torch.uint8)


def dequantize_keys(codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """The keys ``lo + code * (hi - lo) / levels`` of :func:`quantize_keys`' codes: ``[..., BS, W] -> [..., BS, D]``
    float32."""
    L = quant_levels(bits)
    c = codes.to(torch.int32)
    code = torch.cat([(c >> (j * bits)) & L for j in range(8 // bits)], dim=-1).float()
    lo, hi = lo.float().unsqueeze(-2), hi.float().unsqueeze(-2)
    return lo + code * ((hi - lo) / L)


def quant_write(
    codes: torch.Tensor,
    k_pool: torch.Tensor,
    block_table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    span: int,
    bits: int,
) -> None:
    """Re-quantize, in place, every token of the blocks holding the stored positions ``lo[b] <= p < hi[b]``.

    A block's grid is the min / max of each channel over its filled prefix (positions below ``hi[b]``: the cache's
    ``kmin`` / ``kmax`` of :func:`refresh_metadata`), so a token written into a partly filled block re-codes the
    tokens before it; slots past the prefix get code 0.

    Args:
        codes: ``[NB, Hkv, BS, D * bits // 8]`` uint8 (:func:`quantize_keys`); k_pool: ``[NB, Hkv, BS, D]``;
        block_table: ``[B, MB]``; lo, hi: ``[B]`` the positions written; span: a host int ``>= max(hi - lo)``
        (the Triton kernel's grid; unused here); bits: 2 or 4.

    Reads ``lo``/``hi`` on the host, one sequence at a time (as :func:`refresh_metadata`); the Triton kernel does not.
    Blocks not held (table entry ``-1``) are skipped.
    """
    BS = k_pool.shape[2]
    quant_levels(bits)
    for b in range(block_table.shape[0]):
        l, h = int(lo[b]), int(hi[b])
        if h <= l:
            continue
        lbs = torch.arange(l // BS, (h - 1) // BS + 1, device=k_pool.device)
        lbs = lbs[lbs < block_table.shape[1]]
        lbs = lbs[block_table[b, lbs] >= 0]
        blk = block_table[b, lbs].long()
        keys, ok, lo_, hi_ = _prefix_range(k_pool[blk], (h - lbs * BS).clamp(max=BS))
        lo_, hi_ = lo_.to(k_pool.dtype), hi_.to(k_pool.dtype)  # the grid refresh_metadata stores
        codes[blk] = quantize_keys(keys.masked_fill(~ok, 0.0), lo_, hi_, bits).masked_fill(~ok, 0)


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
    sink: int = 0,
    window: int | None = None,
) -> torch.Tensor:
    """Each block's softmax mass under the quantized keys, summed over each GQA group: :func:`oracle_block_scores`
    with every key replaced by its ``bits``-bit copy, dequantized on the grid of the block's ``kmin`` / ``kmax``.

    Args:
        q: ``[B, Hq, D]`` decode queries (unscaled); codes: ``[NB, Hkv, BS, D * bits // 8]`` uint8
            (:func:`quant_write`); kmin, kmax: ``[NB, Hkv, D]``; block_table: ``[B, MB]``; seq_lens, start: ``[B]``;
            scale: softmax scale.
        sink, window: with ``window`` given, the blocks of :func:`forced_block_mask` still held score ``+inf``.

    Returns:
        ``[B, Hkv, MB]`` float32; ``-inf`` past each sequence's last block and for evicted blocks.
    """
    phys = block_table.long().clamp(min=0)  # the table's blocks only, dequantized once each
    keys = dequantize_keys(codes[phys], kmin[phys], kmax[phys], bits)  # [B, MB, Hkv, BS, D]
    return decoded_block_mass(q, keys, block_table, seq_lens, start, scale, sink, window)


def decoded_block_mass(
    q: torch.Tensor,
    keys: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    sink: int = 0,
    window: int | None = None,
) -> torch.Tensor:
    """:func:`oracle_block_scores` over approximate keys ``keys [B, MB, Hkv, BS, D]``, the table's blocks decoded in
    its order (the tail of :func:`quant_block_scores`, :func:`fp8_block_scores` and :func:`pq_block_scores`):
    ``[B, Hkv, MB]`` float32, the forced blocks still held ``+inf`` when ``window`` is given, ``-inf`` for blocks not
    in use."""
    B, MB = block_table.shape
    BS = keys.shape[3]
    table = torch.arange(B * MB, device=q.device).view(B, MB).masked_fill(block_table < 0, -1)
    s = oracle_block_scores(
        q, keys.flatten(0, 1), table.int(), seq_lens, start, scale, length=MB * BS
    )  # -inf: not live
    return _forced_and_live(s, live_blocks(block_table, seq_lens, BS), seq_lens, start, sink, window, BS)


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
) -> torch.Tensor:
    """``[B, Hq, MB]`` float32: per query head and logical block, the log-sum-exp of ``scale * q . k_hat`` over the
    block's valid positions (``start <= p < seq_len``, block held; ``k_hat`` the dequantized keys), ``-inf`` where
    none is. The Triton scoring kernel's output: :func:`lse_block_mass` of it is :func:`quant_block_scores`.

    Args: as :func:`quant_block_scores` (no sink / window: nothing is forced here).
    """
    phys = block_table.long().clamp(min=0)
    keys = dequantize_keys(codes[phys], kmin[phys], kmax[phys], bits)  # [B, MB, Hkv, BS, D]
    return decoded_block_lse(q, keys, block_table, seq_lens, start, scale)


def decoded_block_lse(
    q: torch.Tensor,
    keys: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``[B, Hq, MB]`` float32: per query head and logical block, the log-sum-exp of ``scale * q . k`` over the
    block's valid positions, for approximate keys ``keys [B, MB, Hkv, BS, D]`` (the table's blocks decoded in its
    order: the scoring kernels' output of :func:`quant_block_lse` and :func:`fp8_block_lse`), ``-inf`` where none
    is."""
    s = torch.einsum("bhgd,bmhtd->bhgmt", _group_q(q, keys.shape[2]), keys) * scale  # [B, Hkv, G, MB, BS]
    return held_block_lse(s, block_table, seq_lens, start)


def held_block_lse(
    s: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, start: torch.Tensor
) -> torch.Tensor:
    """Per-token scores ``s [B, Hkv, G, MB, BS]`` -> ``[B, Hkv * G, MB]`` float32: each block's log-sum-exp over its
    valid positions (``start <= p < seq_len``, block held), ``-inf`` where none is."""
    B, _, _, MB, BS = s.shape
    ok = held_positions(block_table, seq_lens, start, BS)
    return s.masked_fill(~ok.view(B, 1, 1, MB, BS), NEG_INF).logsumexp(-1).flatten(1, 2)


def lse_block_mass(
    lse: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    block_size: int,
    num_kv_heads: int,
    sink: int = 0,
    window: int | None = None,
) -> torch.Tensor:
    """Blocks' log-sum-exps per query head ``lse [B, Hq, MB]`` (``-inf``: nothing valid) -> ``[B, Hkv, MB]`` float32:
    each block's share of its head's softmax over all blocks, summed over the GQA group (a head without a valid
    block adds 0); ``+inf`` for the forced blocks still held when ``window`` is given; ``-inf`` for blocks not in use.
    The tail of the Triton ``quant_block_scores`` (its scoring kernel gives the log-sum-exps)."""
    B, Hq, MB = lse.shape
    share = (lse.float() - torch.logsumexp(lse.float(), -1, keepdim=True)).exp().nan_to_num(0.0)
    s = share.view(B, num_kv_heads, Hq // num_kv_heads, MB).sum(2)
    return _forced_and_live(
        s, live_blocks(block_table, seq_lens, block_size), seq_lens, start, sink, window, block_size
    )


# ------------------------------------------------------------------------------------------------ float8 keys


FP8_MAX = 448.0  # the largest finite float8 e4m3 (``torch.float8_e4m3fn``)
FP8_PARTS = ("codes", "scales")  # what one ``fp8_write`` stores: the keys' e4m3 bytes, or their scales


def fp8_code(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys [..., D]`` -> (``codes [..., D]`` uint8: the bytes of ``keys / scale`` in float8 e4m3, rounded to
    nearest even; ``scale [...]`` float32: ``max |k| / 448`` over the key's channels, 1 for an all-zero key). The
    largest channel of each key is exact up to e4m3's 3-bit mantissa, the others keep it down to ``2^-6`` of
    the scale (e4m3's subnormals below)."""
    scale = fp8_scale(keys.float().abs().amax(-1))
    return fp8_encode(keys, scale[..., None]), scale


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The float8 scale of values whose largest magnitude is ``amax`` (any shape, float32): ``amax / 448`` rounded
    once, 1 where ``amax`` is 0. The divisor is a tensor: PyTorch divides a CUDA tensor by a Python number as a
    product with its reciprocal (an ulp off the quotient at times), by a tensor as an IEEE division, as the CPU and
    the Triton write do."""
    return torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), 1.0)


def fp8_encode(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The bytes (uint8, ``x``'s shape) of ``x / scale`` in float8 e4m3, clamped to ``[-448, 448]`` and rounded to
    nearest even; ``scale`` broadcasts against ``x`` (one per key in :func:`fp8_code`; one per channel in
    evaluation's screen)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def fp8_decode(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 keys ``[..., D]`` that ``codes [..., D]`` uint8 and ``scale [...]`` stand for."""
    return codes.view(torch.float8_e4m3fn).float() * scale[..., None]


def fp8_write(
    state: torch.Tensor,
    k_pool: torch.Tensor,
    block_table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    span: int,
    part: str,
) -> None:
    """Store one ``part`` of :func:`fp8_code` of the keys at the stored positions ``lo[b] <= p < hi[b]``, in place:
    ``"codes"`` into ``state [NB, Hkv, BS, D]`` uint8, ``"scales"`` into ``state [NB, Hkv, BS]`` float32. Each key is
    coded on its own (no grid shared with other tokens), so a write touches only its own positions.

    Args: k_pool ``[NB, Hkv, BS, D]``; block_table ``[B, MB]``; lo, hi ``[B]``; span a host int ``>= max(hi - lo)``.
    Vectorized (:func:`store_written`): no host read of ``lo``/``hi``.
    """
    if part not in FP8_PARTS:
        raise ValueError(f"part must be one of {FP8_PARTS}, got {part!r}")
    which = 0 if part == "codes" else 1
    store_written(state, k_pool, block_table, lo, hi, span, lambda k: fp8_code(k)[which])


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
    """Each block's softmax mass under the float8 keys, summed over each GQA group: :func:`oracle_block_scores`
    with every key replaced by :func:`fp8_decode` of its codes.

    Args:
        q: ``[B, Hq, D]`` decode queries (unscaled); codes: ``[NB, Hkv, BS, D]`` uint8 and kscale ``[NB, Hkv, BS]``
            float32 (:func:`fp8_write`); block_table ``[B, MB]``; seq_lens, start ``[B]``; scale: softmax scale.
        sink, window: with ``window`` given, the blocks of :func:`forced_block_mask` still held score ``+inf``.

    Returns:
        ``[B, Hkv, MB]`` float32; ``-inf`` past each sequence's last block and for evicted blocks.
    """
    phys = block_table.long().clamp(min=0)
    keys = fp8_decode(codes[phys], kscale[phys])  # [B, MB, Hkv, BS, D]
    return decoded_block_mass(q, keys, block_table, seq_lens, start, scale, sink, window)


def fp8_block_lse(
    q: torch.Tensor,
    codes: torch.Tensor,
    kscale: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``[B, Hq, MB]`` float32: per query head and logical block, the log-sum-exp of ``scale * q . k_hat`` over the
    block's valid positions (``k_hat`` the float8 keys decoded), ``-inf`` where none is: the Triton scoring kernel's
    output; :func:`lse_block_mass` of it is :func:`fp8_block_scores`."""
    phys = block_table.long().clamp(min=0)
    keys = fp8_decode(codes[phys], kscale[phys])  # [B, MB, Hkv, BS, D]
    return decoded_block_lse(q, keys, block_table, seq_lens, start, scale)


# ---------------------------------------------------------------------------------- product-quantized keys


PQ_CHUNK = 4096  # keys the reference codes at once (their distances are [chunk, Hkv, m, C] float32)


def pq_encode_sizes(keys: torch.Tensor, centres: torch.Tensor) -> tuple[int, int, int, int]:
    """``(Hkv, m, C, d)`` of ``centres [Hkv, m, C, d]``, checked against ``keys [..., Hkv, m * d]`` and the uint8
    codes' 256 centres (:func:`pq_encode`'s and its kernel's inputs)."""
    Hkv, m, C, d = centres.shape
    if keys.shape[-2:] != (Hkv, m * d):
        raise ValueError(f"keys [..., {Hkv}, {m * d}] expected for these centres, got {tuple(keys.shape)}")
    if C > 256:
        raise ValueError(f"uint8 codes hold at most 256 centres a piece, got {C}")
    return Hkv, m, C, d


def pq_encode(keys: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """Product-quantization codes of ``keys [..., Hkv, D]``: each key's ``m = D / d`` pieces of ``d`` channels as the
    index of the nearest of their ``C`` centres (``centres [Hkv, m, C, d]``, ``C <= 256``): ``[..., Hkv, m]`` uint8.
    Nearest by squared distance, computed as ``|c|^2 - 2 k . c`` in float32 (ties to the lower index)."""
    Hkv, m, _, d = pq_encode_sizes(keys, centres)
    lead = keys.shape[:-2]
    x = keys.float().reshape(-1, Hkv, m, d)
    c = centres.float()
    norms = c.pow(2).sum(-1)  # [Hkv, m, C]
    out = torch.empty(x.shape[:-1], dtype=torch.uint8, device=keys.device)
    for i in range(0, x.shape[0], PQ_CHUNK):  # a host loop over static sizes: no sync
        part = x[i : i + PQ_CHUNK]
        dist = norms - 2 * torch.einsum("nhmd,hmcd->nhmc", part, c)
        out[i : i + PQ_CHUNK] = dist.argmin(-1).to(torch.uint8)
    return out.reshape(*lead, Hkv, m)


def pq_decode(codes: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """The keys :func:`pq_encode`'s codes stand for: ``codes [..., Hkv, X, m]`` (``X``: a block's tokens) ->
    ``[..., Hkv, X, m * d]`` float32, each piece replaced by its centre (``centres [Hkv, m, C, d]``)."""
    Hkv, m = centres.shape[:2]
    h = torch.arange(Hkv, device=codes.device).view(Hkv, 1, 1)
    j = torch.arange(m, device=codes.device).view(1, 1, m)
    return centres.float()[h, j, codes.long()].flatten(-2)


def pq_write(
    codes: torch.Tensor,
    k_pool: torch.Tensor,
    centres: torch.Tensor,
    block_table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    span: int,
) -> None:
    """Store the product-quantization codes (:func:`pq_encode`) of the stored positions ``lo[b] <= p < hi[b]``, in
    place. A key's code depends on that key alone (the centres are fixed: a calibration), so only the written
    positions are coded.

    Args:
        codes: ``[NB, Hkv, BS, m]`` uint8; k_pool: ``[NB, Hkv, BS, D]``; centres: ``[Hkv, m, C, d]`` float32;
        block_table: ``[B, MB]``; lo, hi: ``[B]`` the positions written; span: a host int ``>= max(hi - lo)``.

    Vectorized (:func:`store_written`): no host read of ``lo``/``hi``.
    """
    store_written(codes, k_pool, block_table, lo, hi, span, lambda k: pq_encode(k, centres))


def pq_block_scores(
    q: torch.Tensor,
    codes: torch.Tensor,
    centres: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    sink: int = 0,
    window: int | None = None,
    table_dtype: str = "float32",
) -> torch.Tensor:
    """Each block's softmax mass under the product-quantized keys, summed over each GQA group:
    :func:`oracle_block_scores` with every key replaced by its centres (:func:`pq_decode`), as
    :func:`quant_block_scores` does with low-bit keys.

    Args:
        q: ``[B, Hq, D]`` decode queries (unscaled); codes: ``[NB, Hkv, BS, m]`` uint8 (:func:`pq_write`);
            centres: ``[Hkv, m, C, d]``; block_table: ``[B, MB]``; seq_lens, start: ``[B]``; scale: softmax scale.
        sink, window: with ``window`` given, the blocks of :func:`forced_block_mask` still held score ``+inf``.
        table_dtype: ``"float32"``, or ``"bfloat16"``: each piece's term ``scale * q_piece . centre`` rounded to
            bfloat16 before the float32 sum over the pieces (:func:`pq_block_lse`), as the Triton kernel's table
            in bfloat16 holds them.

    Returns:
        ``[B, Hkv, MB]`` float32; ``-inf`` past each sequence's last block and for evicted blocks.
    """
    if pq_table_dtype(table_dtype) != torch.float32:
        lse = pq_block_lse(q, codes, centres, block_table, seq_lens, start, scale, table_dtype)
        return lse_block_mass(lse, block_table, seq_lens, start, codes.shape[2], codes.shape[1], sink, window)
    keys = pq_decode(codes[block_table.long().clamp(min=0)], centres)  # [B, MB, Hkv, BS, D]
    return decoded_block_mass(q, keys, block_table, seq_lens, start, scale, sink, window)


PQ_TABLE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def pq_table_dtype(name: str) -> torch.dtype:
    """The dtype a product-quantized scoring table is held in: ``"float32"`` or ``"bfloat16"`` (checked)."""
    if name not in PQ_TABLE_DTYPES:
        raise ValueError(f"a product-quantized scoring table is one of {sorted(PQ_TABLE_DTYPES)}, got {name!r}")
    return PQ_TABLE_DTYPES[name]


def pq_table(q: torch.Tensor, centres: torch.Tensor, scale: float, table_dtype: str = "float32") -> torch.Tensor:
    """``[B, Hkv, G, m, C]`` float32: ``scale * q_g[piece j] . centres[h, j, c]`` for query head ``g`` of KV head
    ``h`` (``q [B, Hq, D]``, ``centres [Hkv, m, C, d]``), each entry rounded to ``table_dtype`` (and back)."""
    B, Hq, _ = q.shape
    Hkv, m, _, d = centres.shape
    qg = q.float().view(B, Hkv, Hq // Hkv, m, d)
    table = torch.einsum("bhgjd,hjcd->bhgjc", qg, centres.float()) * scale
    return table.to(pq_table_dtype(table_dtype)).float()


def pq_block_lse(
    q: torch.Tensor,
    codes: torch.Tensor,
    centres: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    table_dtype: str = "float32",
) -> torch.Tensor:
    """``[B, Hq, MB]`` float32: per query head and logical block, the log-sum-exp over the block's valid positions of
    each token's score ``sum_j T[g, j, code_j]`` (``T``: :func:`pq_table` in ``table_dtype``; the pieces summed in
    float32), ``-inf`` where none is valid. The output of the Triton ``pq_block_lse``. Args: as
    :func:`pq_block_scores`."""
    return pq_table_lse(pq_table(q, centres, scale, table_dtype), codes, block_table, seq_lens, start)


def pq_table_lse(
    table: torch.Tensor, codes: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, start: torch.Tensor
) -> torch.Tensor:
    """:func:`pq_block_lse` on a given table ``[B, Hkv, G, m, C]`` (:func:`pq_table`'s layout; its values are used
    as they are, in float32): ``[B, Hkv * G, MB]`` float32."""
    B, MB = block_table.shape
    Hkv, BS, m = codes.shape[1], codes.shape[2], codes.shape[3]
    table = table.float()
    G = table.shape[2]
    c = codes[block_table.long().clamp(min=0)].long()  # [B, MB, Hkv, BS, m]
    idx = c.permute(0, 2, 4, 1, 3).reshape(B, Hkv, 1, m, MB * BS).expand(B, Hkv, G, m, MB * BS)
    s = table.gather(4, idx).sum(3).view(B, Hkv, G, MB, BS)  # [B, Hkv, G, MB, BS]
    return held_block_lse(s, block_table, seq_lens, start)


def candidate_scores(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    blocks: torch.Tensor,
    *,
    reduce: str = "token",
    sink: int = 0,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact ``q . k`` (unscaled) of every token of the candidate blocks, max over each GQA group (but
    ``"head_mass"``).

    Args:
        q: ``[B, Hq, D]``; k_pool: ``[NB, Hkv, BS, D]``; block_table ``[B, MB]``; seq_lens, start ``[B]``.
        blocks: ``[B, Hkv, C]`` logical block numbers, ``-1`` padded.
        reduce: ``"token"`` (a score per token), ``"block"`` (each candidate's best token: what a two-stage block
            selector ranks), ``"mass"`` (each candidate's log-sum-exp over its tokens of ``scale`` times the
            token score: ``softmax`` of it over the candidates is each block's share of the softmax mass of the
            candidates' tokens, what a top-p selector ranks, without the per-token scores) or ``"head_mass"``
            (the same per query head, no max over the group: ``[B, Hq, C]``, query head ``h`` scoring the
            candidates of KV head ``h // G``; its softmax over the candidates summed over a group's heads is the
            oracle's criterion, ``oracle_block_scores``, restricted to the candidates).
        sink, window: with ``window`` given, the valid forced tokens (``forced_token_mask``; token) or the
            candidates that are forced blocks, evicted or not (``forced_block_mask``; block) score ``+inf``. The
            mass forms take no ``window``: a forced block's mass counts towards top-p's ``p``.
        scale: the softmax scale (``"mass"`` and ``"head_mass"`` only, required there).

    Returns:
        ``[B, Hkv, C, BS]`` (token), ``[B, Hkv, C]`` (block, mass) or ``[B, Hq, C]`` (head_mass) float32, ``-inf``
        at invalid positions (padding slots, past the end, before ``start``, evicted) and for candidates without a
        valid token (unless forced).
    """
    check_candidate_reduce(reduce, window, scale)
    B = q.shape[0]
    Hkv, BS = k_pool.shape[1], k_pool.shape[2]
    C = blocks.shape[-1]
    MB = block_table.shape[1]
    lb = blocks.long()
    slot = (lb >= 0) & (lb < MB)  # [B, Hkv, C]
    safe = lb.clamp(min=0, max=MB - 1)
    phys_raw = torch.gather(block_table.long(), 1, safe.view(B, -1)).view(B, Hkv, C)
    head = torch.arange(Hkv, device=q.device).view(1, Hkv, 1)
    keys = k_pool[phys_raw.clamp(min=0), head].float()  # [B, Hkv, C, BS, D]
    per_head = torch.einsum("bhgd,bhctd->bhgct", _group_q(q, Hkv), keys)  # [B, Hkv, G, C, BS]
    pos = blocks_to_tokens(blocks, BS).long()  # [B, Hkv, C * BS]
    zero = torch.zeros_like(seq_lens)
    ok = valid_positions(pos, seq_lens, start, zero, zero).view(B, Hkv, C, BS)
    ok = ok & (phys_raw >= 0).unsqueeze(-1) & slot.unsqueeze(-1)
    if reduce == "head_mass":  # logsumexp of a row of -inf is -inf; query head h = kv * G + g
        lse = torch.logsumexp(per_head.masked_fill(~ok.unsqueeze(2), NEG_INF) * scale, -1)  # [B, Hkv, G, C]
        return lse.masked_fill(~slot.unsqueeze(2), NEG_INF).reshape(B, q.shape[1], C).contiguous()
    s = per_head.amax(2).masked_fill(~ok, NEG_INF)  # [B, Hkv, C, BS]
    if reduce == "token":
        if window is not None:
            forced = forced_token_mask(seq_lens, start, sink, window, BS, MB * BS)  # [B, MB * BS]
            forced = forced.gather(1, pos.clamp(0, MB * BS - 1).view(B, -1)).view(B, Hkv, C, BS)
            s = s.masked_fill(forced & ok, float("inf"))
        return s.contiguous()
    if reduce == "mass":  # logsumexp of a row of -inf is -inf
        return torch.logsumexp(s * scale, -1).masked_fill(~slot, NEG_INF).contiguous()
    s = s.amax(-1)  # [B, Hkv, C]
    if window is not None:
        forced = forced_block_mask(seq_lens, start, sink, window, BS, MB)  # [B, MB]
        s = s.masked_fill(forced.gather(1, safe.view(B, -1)).view(B, Hkv, C) & slot, float("inf"))
    return s.masked_fill(~slot, NEG_INF).contiguous()


def check_candidate_reduce(reduce: str, window: int | None, scale: float | None) -> None:
    """``candidate_scores``' argument rule, shared by the reference and the Triton launcher."""
    if reduce not in ("token", "block", "mass", "head_mass"):
        raise ValueError(f"reduce must be 'token', 'block', 'mass' or 'head_mass', got {reduce!r}")
    if reduce in ("mass", "head_mass") and (scale is None or not scale > 0 or window is not None):
        raise ValueError(
            f"reduce={reduce!r} needs a softmax scale > 0 and takes no window (a forced block's mass counts towards "
            f"p), got scale={scale!r}, window={window!r}"
        )


def candidate_mass(
    lse: torch.Tensor,
    blocks: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    block_size: int,
    sink: int,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each candidate block's share of the candidates' softmax mass, and the key a top-p selector ranks by.

    Args:
        lse: ``[B, Hq, C]`` (``candidate_scores(reduce="head_mass")``, query head ``h`` scoring KV head ``h // G``'s
            candidates) or ``[B, Hkv, C]`` (``reduce="mass"``: ``G = 1``) float32 log-sum-exps, ``-inf`` where a
            candidate has no valid token.
        blocks: ``[B, Hkv, C]`` the candidates' logical block numbers, ``-1`` padded; seq_lens, start ``[B]``.
        block_size, sink, window: the forced-block rule's arguments (``ops/layout.py``, :func:`forced_blocks_at`).

    Returns:
        ``mass``: ``[B, Hkv, C]`` float32: per row of ``lse`` the softmax over its candidates (padding slots left
        out; a row without a finite value gives 0, never NaN), averaged over the ``G`` rows of each KV head's group,
        so each KV head's row sums to 1 where it has mass; 0 at padding.
        ``key``: ``[B, Hkv, C]`` float32: ``+inf`` at the candidates that are forced blocks (sink, window, current
        block: whether evicted or not), ``-inf`` at padding slots, ``mass`` elsewhere.
    """
    check_candidate_mass(lse, blocks)
    B, H, C = blocks.shape
    pad = blocks < 0  # [B, Hkv, C]
    G = lse.shape[1] // H
    x = lse.float().view(B, H, G, C).masked_fill(pad.unsqueeze(2), NEG_INF)
    mass = x.softmax(-1).nan_to_num(0.0).mean(2)  # a row of -inf: softmax NaN -> 0
    forced = forced_blocks_at(blocks, seq_lens, start, sink, window, block_size)
    return mass, mass.masked_fill(forced, float("inf")).masked_fill(pad, NEG_INF)


def check_candidate_mass(lse: torch.Tensor, blocks: torch.Tensor) -> None:
    """``candidate_mass``' shape rule, shared by the reference, the Triton launcher and the fake implementation."""
    if blocks.dim() != 3 or lse.dim() != 3:
        raise ValueError(
            f"candidate_mass takes lse [B, Hq or Hkv, C] and blocks [B, Hkv, C], got {tuple(lse.shape)}, "
            f"{tuple(blocks.shape)}"
        )
    B, H, C = blocks.shape
    if lse.shape[0] != B or lse.shape[2] != C or H == 0 or lse.shape[1] % H:
        raise ValueError(
            f"candidate_mass: lse {tuple(lse.shape)} must be [B, G * Hkv, C] for blocks {tuple(blocks.shape)} "
            "= [B, Hkv, C] (one row per query head, or per KV head)"
        )


DECODE_LINEAR_ROWS = 16  # rows of x the Triton twin takes: the tokens are its tensor-core product's 16 columns
DECODE_LINEAR_DTYPES = (torch.bfloat16, torch.float16)  # the dtypes the Triton twin computes in


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's weight matmul: ``F.linear(x, weight, bias)``, ``x [..., K]``, ``weight [N, K]`` -> ``[..., N]``
    (the reference of ``triton.linear.decode_linear``)."""
    return F.linear(x, weight, bias)
