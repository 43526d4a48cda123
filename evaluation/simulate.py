"""The ``simulate`` way: score many decode steps in one forward, each query attending exactly what its policy
would select at that step.

A patched model runs its policy only on single-token decode steps. To score ``N`` tokens of decode quality without
``N`` forwards, :class:`SimulateSession` prefills the context once (dense, as the patched model does; several windows
of one length at once if given: each op then serves them all, each window's queries seeing only its own blocks), then
runs the ``N`` scored tokens in one forward through an attention function registered under :data:`ATTENTION_NAME`. On
each full-attention layer that function rebuilds, for every scored query at position ``t``, the paged state a decode
step at ``t`` would see: the blocks filled so far with their key min/max/mean (the current block described by its
filled prefix ``[block start, t]``), ``seq_len = t + 1`` (so a fractional budget resolves against ``t + 1``), the
same sink/window/current-block forcing. It calls the policy's own ``select()`` on that state (queries batched as
sequences; the exact scorers through the shared pool, :func:`simulate_ops`), turns the selection into a mask with the reference ops and attends in float32, as the reference decode
does. ``dense_layers`` attend everything; sliding-window layers run SDPA with the model's own mask, as in decode.

A policy that compresses the prompt once (:class:`~hf_sparse_kv.policies.SnapKV`, alone or with ``then``) is replayed
the same way: the prefix's prefill keeps the last :data:`OBSERVED` queries of every paged layer, :meth:`SimulateSession.run`
scores the prompt's blocks from them with the policy's own ``observe_prefill`` and picks what its first decode step frees
with its own ``blocks_to_free`` (at the first step's length), and every scored query then sees a table whose freed
blocks are ``-1`` (``DecodeState.evicted`` set): the dense layers attend only the blocks held, the sparse ones select
among them.

Optionally it measures fidelity on the sparse layers (:class:`Fidelity`): attention recall (share of the dense
softmax mass inside the selection) and block hit rate against :class:`~hf_sparse_kv.policies.OracleBlockTopK` at
the same budget, sink and window.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hf_sparse_kv import cache_kwarg, is_patched
from hf_sparse_kv.ops import get_ops
from hf_sparse_kv.ops.layout import cdiv
from hf_sparse_kv.policies import DecodeState, Dense, OracleBlockTopK, Policy, SinkWindow

ATTENTION_NAME = "hf_sparse_kv_simulate"
OBSERVED = 256  # the prefix's last queries a session keeps per paged layer: a compressing policy observes at most these
CONTEXT_KWARG = "hf_sparse_kv_simulate_context"


@dataclass
class Fidelity:
    """Running sums of the fidelity metrics over (scored query, sparse layer, KV head). The sums may be float64
    device tensors (the simulate attention adds each layer's there, so that no layer waits for the GPU); the
    properties read them as floats."""

    recall_sum: float | torch.Tensor = 0.0
    hit_sum: float | torch.Tensor = 0.0
    count: int = 0
    hit_count: int = 0

    @property
    def recall(self) -> float | None:
        return float(self.recall_sum) / self.count if self.count else None

    @property
    def hit_rate(self) -> float | None:
        return float(self.hit_sum) / self.hit_count if self.hit_count else None

    def windows(self, n: int) -> list[Fidelity]:
        """The sums of a forward over ``n`` windows at once (each sum a ``[n]`` tensor, the counts per window) as one
        :class:`Fidelity` per window (its sums views of those tensors: still nothing read to the host)."""

        def each(total):
            return [total[w] for w in range(n)] if isinstance(total, torch.Tensor) else [total] * n

        return [Fidelity(r, h, self.count, self.hit_count) for r, h in zip(each(self.recall_sum), each(self.hit_sum))]


@dataclass
class SimulateContext:
    """What the simulate attention does in one forward (passed to it as a keyword argument, never global)."""

    policy: Policy
    dense_layers: tuple[int, ...]
    paged_layers: frozenset[int]
    block_size: int = 16
    active: bool = False  # False: plain SDPA (the dense prefill)
    chunk: int = 64
    fidelity: Fidelity | None = None
    oracle: Policy | None = None
    mode: str = "block"
    extra: dict = field(default_factory=dict)
    reuse: int = 1  # the policy selects at every reuse-th decode step; the steps between reuse it (_reused)
    # per window, the logical blocks a compressing policy freed at the first decode step (() : none anywhere)
    freed: tuple[frozenset[int], ...] = ()
    queries: dict | None = None  # prefill only: layer -> (its last OBSERVED queries [B, Hq, w, D], its scaling)
    judge: Policy | None = None  # fidelity: the oracle's rule on given scores (_GivenScores), made once a forward
    ops: SimpleNamespace | None = None  # active: the scored queries' ops (simulate_ops), made once a forward


def oracle_for(policy: Policy) -> Policy | None:
    """The :class:`OracleBlockTopK` with ``policy``'s budget, sink and window (None for :class:`Dense`)."""
    if isinstance(policy, Dense):
        return None
    if isinstance(policy, SinkWindow):
        budget = policy.budget if policy.budget is not None else policy.sink + policy.window
        return OracleBlockTopK(budget=budget, sink=policy.sink)
    return OracleBlockTopK(budget=policy.budget, sink=policy.sink, window=policy.window)


class _GivenScores(OracleBlockTopK):
    """OracleBlockTopK's selection rule on scores computed beforehand (the dense softmax mass per block)."""

    given: torch.Tensor | None = None

    def mass(self, state: DecodeState) -> torch.Tensor:
        return self.given


def remembering_plans(policy: Policy) -> Policy:
    """A shallow copy of ``policy`` whose ``plan`` keeps its last answers: a simulated forward asks it at every layer
    for the same lengths (one per scored query: ~1 ms of Python a call at 256 queries), and it depends on nothing
    else. Each answer is handed out as a new list. For one forward (:meth:`SimulateSession.run`); ``policy`` itself is
    left as it is."""
    twin = copy.copy(policy)
    plan = functools.lru_cache(maxsize=8)(policy.plan)

    def remembered(lens, block_size: int):
        counts = plan(tuple(lens), block_size)
        return None if counts is None else list(counts)

    twin.plan = remembered
    return twin


def check_reuse(reuse) -> None:
    """Raise a ``ValueError`` unless ``reuse`` (decode steps per selection) is a positive int."""
    if isinstance(reuse, bool) or not isinstance(reuse, int) or reuse < 1:
        raise ValueError(f"reuse (decode steps per selection) must be a positive int, got {reuse!r}")


def full_attention_layers(config) -> frozenset[int]:
    """Indices of the layers a :class:`~hf_sparse_kv.PagedKVCache` pages (full attention, not sliding)."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = DynamicCache(config=config).layers
    return frozenset(i for i, layer in enumerate(layers) if type(layer) is DynamicLayer)


def _block_metadata(keys: torch.Tensor, block_size: int, positions: torch.Tensor):
    """Pool and metadata a decode step at each of ``positions`` would see, in each of ``B`` windows.

    keys ``[B, Hkv, L, D]``; positions ``[Q]`` (the same in every window). Returns (blocks ``[B, NB, Hkv, BS, D]``;
    full-block min/max/mean ``[B, NB, Hkv, D]`` each; for each window and query its current block's keys
    ``[B, Q, Hkv, BS, D]`` (zero past ``t``) and min/max/mean over the filled prefix ``[B, Q, Hkv, D]``)."""
    B, H, L, D = keys.shape
    BS = block_size
    nb = cdiv(L, BS)
    k = torch.nn.functional.pad(keys, (0, 0, 0, nb * BS - L)).view(B, H, nb, BS, D).permute(0, 2, 1, 3, 4)
    kmin, kmax, kmean = k.amin(3), k.amax(3), k.mean(3)  # right only for full blocks; the current one is below
    b, o = positions // BS, positions % BS
    cur = k[:, b]  # [B, Q, H, BS, D]
    filled = (torch.arange(BS, device=keys.device).view(1, BS) <= o.view(-1, 1)).view(1, -1, 1, BS, 1)
    cmin = cur.masked_fill(~filled, float("inf")).amin(3)
    cmax = cur.masked_fill(~filled, float("-inf")).amax(3)
    cmean = cur.masked_fill(~filled, 0.0).sum(3) / (o + 1).view(1, -1, 1, 1).to(cur.dtype)
    return k, (kmin, kmax, kmean), cur.masked_fill(~filled, 0.0), (cmin, cmax, cmean)


def _decode_state(**fields) -> DecodeState:
    """A :class:`DecodeState` from the fields this version of the library declares (``lens`` is recent)."""
    names = {f.name for f in dataclasses.fields(DecodeState)}
    return DecodeState(**{k: v for k, v in fields.items() if k in names})


def _state_at(
    ctx: SimulateContext, q_all, idx, positions, pooled, scale, layer_idx, ops, host_pos: list[int]
) -> DecodeState:
    """The :class:`DecodeState` of the decode steps of the scored queries ``idx [Q]`` (increasing indices into
    ``q_all [B, Tq, Hq, D]``'s rows and ``positions [Tq]``) in each of its ``B`` windows, batched as ``B * Q``
    sequences, window by window: each sees its window's blocks filled before its position and its own current block
    (``pooled``: :func:`_block_metadata`'s output). The pool holds each window's slice in turn, its ``NB`` blocks then
    its ``Q`` current blocks (the ops score each window's queries against its slice only: :func:`simulate_ops`).
    ``host_pos``: the queries' positions as host ints, which the state's host fields (lengths, widths) are made of:
    nothing is read back from the device, so the host queues a whole forward's layers ahead of the GPU."""
    blocks, meta, cur, cmeta = pooled
    B, nb = blocks.shape[:2]
    BS = ctx.block_size
    pos = positions[idx]
    Q = idx.shape[0]
    seq_lens = (pos + 1).int().repeat(B)
    b = (pos // BS).repeat(B).view(-1, 1)
    MB = host_pos[-1] // BS + 1  # positions increase
    col = torch.arange(MB, device=pos.device).view(1, -1)
    first = (torch.arange(B, device=pos.device) * (nb + Q)).repeat_interleave(Q).view(-1, 1)  # each window's slice
    own = first + nb + torch.arange(Q, device=pos.device).repeat(B).view(-1, 1)
    table = torch.where(col < b, col + first, torch.where(col == b, own, -1)).int()
    evicted = None
    if any(ctx.freed):  # freed blocks lie below every scored query's current block (the first step's is kept), so < MB
        gone = torch.zeros(B, MB, dtype=torch.bool)
        for w, freed in enumerate(ctx.freed):
            gone[w, sorted(freed)] = True
        gone = gone.to(pos.device, non_blocking=True).repeat_interleave(Q, 0)
        table = table.masked_fill(gone, -1)
        evicted = tuple(len(f) for f in ctx.freed for _ in range(Q))

    def pool(full: torch.Tensor, current: torch.Tensor) -> torch.Tensor:  # each window's blocks, then its queries'
        return torch.cat([full, current[:, idx]], 1).flatten(0, 1)

    return _decode_state(
        q=q_all[:, idx].flatten(0, 1),
        k_pool=pool(blocks, cur),
        kmin=pool(meta[0], cmeta[0]),
        kmax=pool(meta[1], cmeta[1]),
        kmean=pool(meta[2], cmeta[2]),
        block_table=table,
        seq_lens=seq_lens,
        start=torch.zeros_like(seq_lens),
        lens=tuple(p + 1 for p in host_pos) * B,
        length=host_pos[-1] + 1,
        block_size=BS,
        scale=scale,
        mode=ctx.mode,
        ops=ops,
        layer=layer_idx,
        evicted=evicted,
    )


def _selection_mask(ops, selection, state: DecodeState) -> torch.Tensor:
    """``[Q, Hkv, state.length]`` bool: what ``selection`` lets each query of ``state`` attend."""
    return ops.selection_to_mask(
        selection.indices, selection.kind, state.block_size, state.length, state.seq_lens, state.start,
        selection.ex_lo, selection.ex_hi,
    )  # fmt: skip


def _reused(ctx: SimulateContext, state: DecodeState, q_all, idx, positions, pooled, scale, layer_idx, ops):
    """The masks ``[B * Q, Hkv, L]`` and blocks ``[B * Q, Hkv, nb]`` of the queries ``idx`` (``state``'s: consecutive;
    its sequences window by window) when the policy selects only every ``ctx.reuse``-th decode step (the anchors:
    scored queries ``0, r, 2r, ...`` of each window) and the steps in between reuse their anchor's selection: the
    anchor at position ``t0`` selects from what it sees, and a step at ``t`` attends that plus every position in
    ``(t0, t]`` (the tokens decoded since, which a block-granular reuse reads as its current block). Also returns the
    anchors' selection (for ``dense``)."""
    r, B, Q = ctx.reuse, q_all.shape[0], idx.shape[0]
    anchors = idx[::r]
    hosted = [n - 1 for n in state.lens[:Q:r]]  # the anchors' positions, on the host (``lens`` are positions + 1)
    a_state = _state_at(ctx, q_all, anchors, positions, pooled, scale, layer_idx, ops, hosted)
    a_sel = ctx.policy.select(a_state)
    a_mask = _selection_mask(ops, a_sel, a_state)  # [B * Qa, Hkv, a_len]
    rank = torch.arange(Q, device=idx.device) // r  # each query's anchor within its window
    which = (torch.arange(B, device=idx.device).view(-1, 1) * anchors.shape[0] + rank).flatten()  # [B * Q]
    t0, t = positions[anchors][rank].repeat(B), positions[idx].repeat(B)
    L, BS = state.length, state.block_size
    col = torch.arange(L, device=idx.device).view(1, -1)
    fresh = (col > t0.view(-1, 1)) & (col <= t.view(-1, 1))  # [B * Q, L]
    mask = torch.nn.functional.pad(a_mask, (0, L - a_mask.shape[-1]))[which] | fresh.unsqueeze(1)
    nb = cdiv(L, BS)
    fresh_blocks = torch.nn.functional.pad(fresh, (0, nb * BS - L)).view(-1, nb, BS).any(-1)  # [B * Q, nb]
    blocks = _block_set(a_sel.indices, a_sel.kind, BS, nb)[which] | fresh_blocks.unsqueeze(1)
    return mask, blocks, a_sel


def simulate_ops(windows: int = 1) -> SimpleNamespace:
    """The reference ops a scored query's policy selects with, its scorers (``token_scores``, ``oracle_block_scores``,
    ``block_scores``) computed through the pool (``through_pool``): the scored queries of one sequence share
    its pool but for their current blocks, so scoring each against the pool and picking through its table costs
    ``Q x pool`` products instead of gathering ``Q x L x D`` keys (8.6 GB a layer at 256 queries of Qwen2.5 at 32K)
    or Quest's ``Q x MB x Hq x D`` bounds. The same scores up to float32 rounding. ``windows``: the queries of that
    many windows, each against its own slice of the pool (:func:`_state_at`'s layout)."""
    ref = get_ops("reference")
    return SimpleNamespace(
        **{
            **vars(ref),
            "token_scores": functools.partial(ref.token_scores, through_pool=windows),
            "oracle_block_scores": functools.partial(ref.oracle_block_scores, through_pool=windows),
            "block_scores": functools.partial(ref.block_scores, through_pool=windows),
        }
    )


def _sparse_rows(ctx: SimulateContext, module, query, key, value, scaling) -> torch.Tensor:
    """query ``[B, Hq, Tq, D]`` at the last ``Tq`` positions of key/value ``[B, Hkv, L, D]`` (``B`` windows of one
    length) -> ``[B, Tq, Hq, D]``."""
    B, Hq, Tq, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    G, BS = Hq // Hkv, ctx.block_size
    scale = scaling if scaling is not None else D**-0.5
    ops = ctx.ops
    layer_idx = module.layer_idx
    sparse = layer_idx not in ctx.dense_layers
    positions = torch.arange(L - Tq, L, device=query.device)
    k, v = key.float(), value.float()  # [B, Hkv, L, D]
    pooled = _block_metadata(key, BS, positions)
    q_all = query.transpose(1, 2)  # [B, Tq, Hq, D]
    out = torch.empty(B, Tq, Hq, D, dtype=torch.float32, device=query.device)
    r = ctx.reuse
    step = ctx.chunk if r == 1 else max(r, ctx.chunk // r * r)  # a chunk holds whole runs of one anchor
    for i0 in range(0, Tq, step):
        rows = range(i0, min(i0 + step, Tq))
        idx = torch.arange(rows.start, rows.stop, device=query.device)
        Q = idx.shape[0]
        state = _state_at(ctx, q_all, idx, positions, pooled, scale, layer_idx, ops, [L - Tq + i for i in rows])
        length = state.length
        q = state.q
        blocks = None
        if not sparse:
            selection = Policy.dense_selection(state)
        elif r > 1:
            mask, blocks, selection = _reused(ctx, state, q_all, idx, positions, pooled, scale, layer_idx, ops)
        else:
            selection = ctx.policy.select(state)
        if blocks is None:
            mask = _selection_mask(ops, selection, state)
        # [B * Q, Hkv, G, L] float32 (0.4 GB a layer at 256 queries of Qwen2.5 at 32K, per window): scaled and masked
        # in place where nothing reads them after, the same values as new tensors would hold
        logits = torch.einsum("bqhgd,bhld->bqhgl", q.float().view(B, Q, Hkv, G, D), k[:, :, :length])
        logits = logits.reshape(B * Q, Hkv, G, length).mul_(scale)  # a view for one window, a copy for several
        measure = sparse and ctx.fidelity is not None and not selection.dense
        hidden = ~mask.unsqueeze(2)
        p = logits.masked_fill(hidden, float("-inf")) if measure else logits.masked_fill_(hidden, float("-inf"))
        p = p.softmax(-1)
        out[:, idx] = torch.einsum("bqhgl,bhld->bqhgd", p.view(B, Q, Hkv, G, length), v[:, :, :length]).reshape(
            B, Q, Hq, D
        )
        del p
        if measure:
            if blocks is None:
                blocks = _block_set(selection.indices, selection.kind, BS, cdiv(length, BS))
            _measure(ctx, state, blocks, mask, logits, B)
    return out.to(query.dtype)


def _measure(ctx: SimulateContext, state: DecodeState, s_blocks, mask, logits, windows: int = 1) -> None:
    """Add this chunk's attention recall and oracle block hit rate to ``ctx.fidelity``, per window (its sums ``[B]``
    tensors, ``B = windows``, its counts per window); ``s_blocks [B * Q, Hkv, nb]`` the blocks the policy's queries
    read, ``mask [B * Q, Hkv, L]`` the positions they attend (sequences window by window). Uses up ``logits`` (masked
    in place)."""
    Q, Hkv, _G, length = logits.shape
    BS = state.block_size
    pos = torch.arange(length, device=logits.device).view(1, -1)
    causal = pos < state.seq_lens.view(-1, 1).long()  # [Q, length]
    p = logits.masked_fill_(~causal.view(Q, 1, 1, length), float("-inf")).softmax(-1)  # dense softmax
    heads_mass = p.sum(2) if ctx.oracle is not None else None  # [Q, Hkv, L], before p is masked below
    recall = p.masked_fill_(~mask.unsqueeze(2), 0.0).sum(-1).mean(2)  # [Q, Hkv]: the mass the policy attends
    fid = ctx.fidelity
    # on the device: read once, at the end of the forward
    fid.recall_sum = fid.recall_sum + recall.view(windows, -1).sum(1).double()
    fid.count += recall.numel() // windows
    if ctx.oracle is None:
        return
    nb = cdiv(length, BS)
    mass = torch.nn.functional.pad(heads_mass, (0, nb * BS - length)).view(Q, Hkv, nb, BS).sum(-1)
    in_use = torch.arange(nb, device=p.device).view(1, -1) < ((state.seq_lens.long() + BS - 1) // BS).view(-1, 1)
    oracle = ctx.judge or _GivenScores(budget=ctx.oracle.budget, sink=ctx.oracle.sink, window=ctx.oracle.window)
    oracle.given = mass.masked_fill(~in_use.unsqueeze(1), float("-inf"))
    o_sel = oracle.select(state)
    o_blocks = _block_set(o_sel.indices, o_sel.kind, BS, nb)
    hit = (o_blocks & s_blocks).sum(-1).float() / o_blocks.sum(-1).clamp(min=1)
    fid.hit_sum = fid.hit_sum + hit.view(windows, -1).sum(1).double()
    fid.hit_count += hit.numel() // windows


def _block_set(indices: torch.Tensor, kind: str, block_size: int, nb: int) -> torch.Tensor:
    """``[Q, Hkv, nb]`` bool: the blocks a selection touches (a token selection touches its tokens' blocks)."""
    idx = indices.long()
    if kind == "token":
        idx = torch.where(idx >= 0, idx // block_size, idx)
    out = torch.zeros(*idx.shape[:2], nb + 1, dtype=torch.bool, device=idx.device)
    out.scatter_(2, torch.where(idx < 0, nb, idx.clamp(max=nb)), True)
    return out[..., :nb]


def simulate_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The registered attention: SDPA unless the context is active on a full-attention layer."""
    ctx: SimulateContext | None = kwargs.pop(CONTEXT_KWARG, None)
    if ctx is not None and ctx.queries is not None and module.layer_idx in ctx.paged_layers:  # the prefix's prefill
        ctx.queries[module.layer_idx] = (query[:, :, -OBSERVED:].detach().clone(), scaling)
    if ctx is None or not ctx.active or module.layer_idx not in ctx.paged_layers:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return _sparse_rows(ctx, module, query, key, value, scaling), None


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int)
    ]


@contextlib.contextmanager
def attention_routed(model: torch.nn.Module, name: str, forward, kwarg: str, value):
    """Scoped: ``model``'s attention through ``forward`` (registered as ``name``, with SDPA's mask), every attention
    module called with ``kwarg=value``; the hooks removed and the model's attention restored after."""
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    original = model.config._attn_implementation

    def hook(module, args, kwargs):
        kwargs[kwarg] = value
        return args, kwargs

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in _attention_modules(model)]
    model.set_attn_implementation(name)
    try:
        yield value
    finally:
        for h in handles:
            h.remove()
        model.set_attn_implementation(original)


@contextlib.contextmanager
def simulating(model: torch.nn.Module, ctx: SimulateContext):
    """Scoped: route ``model``'s attention through :func:`simulate_attention_forward` with ``ctx``; restore after."""
    if is_patched(model):
        raise ValueError("simulate needs an unpatched model (call unpatch_model first)")
    with attention_routed(model, ATTENTION_NAME, simulate_attention_forward, CONTEXT_KWARG, ctx):
        yield ctx


class SimulateSession:
    """Windows ``ids [B, W]`` (``B`` windows of one length, scored together: each op of a forward serves them all)
    with their last ``n_scored`` tokens scored: the dense prefix is prefilled once and every :meth:`run_windows` (one
    policy) only forwards the scored part. ``chunk``: scored queries of each window attended at once (the float32
    logits of a chunk are ``B * chunk * Hq * W`` floats).

    Scored token ``j`` (position ``W - N + j``) is predicted by the decode step of the token before it, so every
    score comes from a step that ran the policy. :meth:`run_windows` returns the log-probabilities ``[B, N, V]`` of
    the scored positions and each window's fidelity (or None); :meth:`run`, for one window, ``[N, V]`` and its
    fidelity. Each window is scored as it would be alone (tested).
    """

    def __init__(self, model, ids: torch.Tensor, n_scored: int, block_size: int = 16, chunk: int = 64):
        if not 0 < n_scored < ids.shape[1]:
            raise ValueError(f"n_scored must lie in (0, {ids.shape[1]}), got {n_scored}")
        self.model, self.ids, self.n, self.block_size, self.chunk = model, ids, n_scored, block_size, chunk
        self.paged = full_attention_layers(model.config)
        split = ids.shape[1] - n_scored - 1  # the prefix prefilled dense; tokens split.. W-2 are decode steps
        self.targets = ids[:, split + 1 :]  # [B, N]
        ctx = SimulateContext(Dense(), (), self.paged, block_size, queries={})
        self.cache = DynamicCache(config=model.config)
        with torch.no_grad(), simulating(model, ctx):
            # the prefix's logits are not needed: at 32K x a 262K vocabulary they would take 34 GB
            model(ids[:, :split], **{cache_kwarg(model): self.cache}, use_cache=True, logits_to_keep=1)
        self.split = split
        self.queries = ctx.queries  # for a compressing policy's observation (freed)

    def freed(self, policy: Policy) -> frozenset[int]:
        """:meth:`freed_windows` of a session of one window: its blocks."""
        self._one_window("freed")
        return self.freed_windows(policy)[0]

    def freed_windows(self, policy: Policy) -> tuple[frozenset[int], ...]:
        """Per window, the logical blocks ``policy`` (one that :attr:`~hf_sparse_kv.policies.Policy.compresses`) frees
        at the first decode step: its ``observe_prefill`` of each paged layer's last queries against the layer's
        prefix keys (the patched prefill's observation, in layer order), then its ``blocks_to_free`` at the first
        step's length (the prefix and the step's token)."""
        if getattr(policy, "observe", 0) > OBSERVED:
            raise ValueError(
                f"the simulate way keeps the prefix's last {OBSERVED} queries, and {type(policy).__name__} observes "
                f"{policy.observe}: score it with way: decode"
            )
        B = self.ids.shape[0]
        if not self.paged:  # every layer slides (Mistral with a window): no block table, nothing is freed
            return (frozenset(),) * B
        scores = []
        for i in sorted(self.paged):
            query, scaling = self.queries[i]
            key = self.cache.layers[i].keys
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            pads = torch.zeros(B, dtype=torch.long, device=key.device)
            scores.append(policy.observe_prefill(query, key, None, pads, self.block_size, scale).float().cpu())
        freed = policy.blocks_to_free(torch.stack(scores), (self.split + 1,) * B, self.block_size)
        return tuple(frozenset(f) for f in freed)

    def _one_window(self, what: str) -> None:
        if self.ids.shape[0] != 1:
            raise ValueError(f"{what} scores one window; this session holds {self.ids.shape[0]}: use {what}_windows")

    def run(
        self, policy: Policy, dense_layers=(0, 1), fidelity: bool = False, reuse: int = 1
    ) -> tuple[torch.Tensor, Fidelity | None]:
        """:meth:`run_windows` of a session of one window: its log-probabilities ``[N, V]`` and fidelity."""
        self._one_window("run")
        logprobs, fids = self.run_windows(policy, dense_layers, fidelity, reuse)
        return logprobs[0], fids[0]

    def run_windows(
        self, policy: Policy, dense_layers=(0, 1), fidelity: bool = False, reuse: int = 1
    ) -> tuple[torch.Tensor, list[Fidelity | None]]:
        """Score the windows under ``policy``: log-probabilities ``[B, N, V]`` and each window's fidelity (``None``
        each without ``fidelity``). With ``reuse = r > 1`` the policy selects only at every ``r``-th decode step
        (the first scored one, then every ``r``) and each step in between attends its anchor's selection plus the
        tokens decoded since (:func:`_reused`): what a selection computed once per ``r`` steps would cost in quality.
        A policy that compresses the prompt (SnapKV) runs on the blocks its first decode step keeps in each window
        (:meth:`freed_windows`), with ``reuse=1`` and without fidelity (refused otherwise)."""
        check_reuse(reuse)
        B = self.ids.shape[0]
        if B > 1 and policy.fits_to_the_batch:
            raise ValueError(
                f"{type(policy).__name__} fits its state on every sequence's keys together (fits_to_the_batch): "
                "windows scored together would share it; score its windows one session each"
            )
        freed = ()
        if policy.compresses:
            if reuse > 1 or fidelity:
                raise ValueError(
                    f"{type(policy).__name__} frees prompt blocks at its first decode step: the simulate way replays "
                    "it with reuse=1 and without fidelity (whose oracle would read the freed blocks)"
                )
            freed = self.freed_windows(policy)
        fid = Fidelity() if fidelity else None
        oracle = oracle_for(policy) if fidelity else None
        judge = None
        if oracle is not None:
            judge = remembering_plans(_GivenScores(budget=oracle.budget, sink=oracle.sink, window=oracle.window))
        ctx = SimulateContext(
            remembering_plans(policy),
            tuple(dense_layers),
            self.paged,
            self.block_size,
            True,
            self.chunk,
            fid,
            oracle,
            reuse=reuse,
            freed=freed,
            judge=judge,
            ops=simulate_ops(B),
        )
        cache = copy.deepcopy(self.cache)
        with torch.no_grad(), simulating(self.model, ctx):
            logits = self.model(self.ids[:, self.split : -1], **{cache_kwarg(self.model): cache}, use_cache=True).logits
        return torch.log_softmax(logits.float(), -1), fid.windows(B) if fid is not None else [None] * B

    def nll(self, logprobs: torch.Tensor) -> torch.Tensor:
        """Negative log-likelihood of the scored tokens: ``[N]`` from one window's ``[N, V]`` (the first window's
        targets), ``[B, N]`` from :meth:`run_windows`' ``[B, N, V]``."""
        if logprobs.dim() == 2:
            return -logprobs.gather(1, self.targets[0].view(-1, 1)).squeeze(1)
        return -logprobs.gather(2, self.targets.unsqueeze(-1)).squeeze(-1)
