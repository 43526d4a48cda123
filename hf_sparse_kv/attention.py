"""The attention function registered with transformers' ``AttentionInterface``: prefill dense, decode sparse.

Per layer and call:

- no cache, a sliding-window layer, or a multi-token forward: SDPA exactly as the unpatched model (on a non-empty
  cache the whole context is gathered from the pages first; a left-padded batch's first prefill runs each sequence
  unmasked, :mod:`hf_sparse_kv.prefill`, where that is SDPA's flash path);
- a single-token decode on a paged layer: plan the step once (padding starts, lengths), let the policy select
  (dense layers select everything), then execute the selection in the chosen mode:
  ``mask`` (SDPA over the whole cache with a mask), ``token`` (gather the selected positions), ``block`` (read the
  selected pages), or ``auto`` (dense or block by the crossover table). Before the first layer of a step selects,
  the policy frees what it will never read again (:meth:`~hf_sparse_kv.policies.Policy.release`);
- a single-token step on a cache reserved for static decoding: :func:`static_attention`, the same selection and
  execution with every length read from device buffers and every host decision from the step's
  :class:`StaticPlan` (made before the step by ``hf_sparse_kv.graphs.begin_static_step``), so the step compiles
  under ``fullgraph=True`` and replays from a CUDA graph; its sliding-window layers attend their ring.

The per-model settings (:class:`SparseConfig`) and the cache arrive as keyword arguments injected by the hook of
:mod:`hf_sparse_kv.patch`; what lives between layers and forwards is the cache's
:class:`~hf_sparse_kv.runtime.DecodeSession`; nothing here is module-level state. The policy is called through its
lifecycle methods only: no branch here asks what kind of policy it is (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .cache import PagedKVCache, PagedLayer, WindowRing
from .crossover import CrossoverTable, budget_fraction
from .ops.layout import cdiv, mask_allows
from .policies import DecodeState, Policy, Selection
from .policies.base import live_counts
from .prefill import prefill_by_rows, rows_apply
from .runtime import Counters, StepPlan

ATTENTION_NAME = "hf_sparse_kv"
CONFIG_KWARG = "hf_sparse_kv_config"
CACHE_KWARG = "hf_sparse_kv_cache"
MODES = ("mask", "token", "block", "auto")


@dataclass
class SparseConfig:
    """What a patched model does at decode time (one per patched model). ``block_size`` and ``backend`` are those
    of the caches the patch builds; a cache given by the user must carry the same (it owns them: see
    :func:`check_cache`)."""

    policy: Policy
    mode: str
    dense_layers: tuple[int, ...]
    block_size: int
    backend: str
    original_attn: str | dict = field(default="sdpa")
    crossover: CrossoverTable | None = None  # mode="auto" only
    compile: str | dict | None = None  # cuda_graph=True: torch.compile the static step before capturing it
    cuda_graph: bool = False  # generate()'s decode steps go through the captured-step runner (hf_sparse_kv.graphs)


def decode_row(mask: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` keys a decode query may attend, ``[B, length]`` bool, from a 2-D mask ``[B, L]`` (1 / 0,
    as a tokenizer gives) or the last query row of a 4-D one ``[B, 1, q, L]`` (bool, or additive float),
    ``L >= length``."""
    return mask[:, :length] != 0 if mask.dim() == 2 else mask_allows(mask[:, 0, -1, :length])


def padding_starts(mask: torch.Tensor | None, batch: int, length: int, device: torch.device) -> torch.Tensor:
    """First attended position per sequence from a decode mask ``[B, 1, 1, L]`` (bool, or additive float), ``L >=
    length``.

    Raises ``NotImplementedError`` when the mask is not left padding (holes inside the context) or is shorter than
    the context.
    """
    if mask is None:
        return torch.zeros(batch, dtype=torch.int32, device=device)
    if mask.shape[-1] < length:
        raise NotImplementedError(
            f"this attention mask covers {mask.shape[-1]} keys of a context of {length}: the attention builds its own "
            "mask from the keys and values its cache returned (as Doge's dynamic mask), and at a decode step the "
            "paged cache returns only the new token's. Not supported: call unpatch_model(model)."
        )
    ok = decode_row(mask, length)  # [B, length] bool
    start = torch.where(ok.any(-1), ok.int().argmax(-1), torch.full_like(ok[:, 0], length, dtype=torch.long))
    if not torch.equal(ok.sum(-1), length - start):
        right = bool((start == 0).all()) and bool((ok[:, :-1] >= ok[:, 1:]).all())  # every row a prefix
        raise NotImplementedError(
            "hf_sparse_kv supports left padding only (or none), fixed at prefill: "
            + (
                "this batch is padded on the right. Pad on the left (tokenizer.padding_side = 'left'), as generate() "
                "with a decoder-only model expects."
                if right
                else "this attention mask has holes inside the context. Call unpatch_model(model) for this input."
            )
        )
    return start.int()


def check_cache(cache: PagedKVCache, config: SparseConfig) -> None:
    """Refuse a cache whose block size or backend differs from the patch's (the cache owns both: its pages are laid
    out in its blocks and written by its backend's ops)."""
    for name in ("block_size", "backend"):
        have, want = getattr(cache, name), getattr(config, name)
        if have != want:
            raise ValueError(
                f"this PagedKVCache has {name}={have!r} but the model was patched with {name}={want!r}: build the "
                f"cache as PagedKVCache(model.config, {name}={want!r}), pass none (generate() and forward() build "
                f"one), or patch with {name}={have!r}"
            )


def prepare_write(
    cache: PagedKVCache,
    config: SparseConfig,
    layer_idx: int,
    mask: torch.Tensor | None,
    batch: int,
    length: int,
    device,
) -> None:
    """Before a paged layer's ``update``: ask the cache for only the new K/V (the attention reads the pages itself);
    before the cache's first write, declare each sequence's left padding (read off the prefill mask, so the pages
    store only real tokens and block boundaries do not depend on the batch a prompt is in) and the state the
    policy needs the cache to keep."""
    cache.defer_reads(layer_idx)
    if not cache.table.rows:
        cache.set_padding(padding_starts(mask, batch, length, device).tolist())
    cache.declare_state(config.policy.cache_state(), config.policy.key_metadata())


def plan_step(
    cache: PagedKVCache, mask: torch.Tensor | None, batch: int, length: int, device, policy: Policy
) -> StepPlan:
    """The step's plan on ``device``, computed by the first paged layer there and reused by the others (layers
    spread over several devices by ``device_map`` get one plan per device). The first paged layer of a step
    also lets ``policy`` free what it no longer needs (:meth:`~hf_sparse_kv.runtime.DecodeSession.release`).

    ``length`` is transformers' (padded) length; the plan holds the stored lengths, and checks that the decode
    mask pads exactly what the cache dropped at prefill."""
    session = cache.session
    lens = tuple(length - p for p in cache.pads)
    if session.enter_step(length, batch):
        session.release(policy, cache, lens)
    plan = session.plan(device)
    if plan is not None:
        return plan
    pads = cache.pads_tensor(device)
    if (mask is None and any(cache.pads)) or (
        mask is not None and not torch.equal(padding_starts(mask, batch, length, device), pads)
    ):
        raise NotImplementedError(
            "the attention mask of this decode step pads differently from the prompt's; hf_sparse_kv supports "
            "left padding fixed at prefill (as generate() does)."
        )
    plan = StepPlan((length - pads).int(), torch.zeros_like(pads), lens, cache.evicted_counts())
    session.keep_plan(device, plan)
    return plan


def kv_bytes(selection: Selection, mode: str, layer: PagedLayer, length: int) -> int:
    """K/V bytes a decode call reads for ``selection`` in ``mode`` (indices excluded), counted on the host."""
    Hkv, BS, D = layer.k_pool.shape[1], layer.k_pool.shape[2], layer.k_pool.shape[3]
    per_token = 2 * D * layer.k_pool.element_size()
    if mode == "mask":
        return len(selection.counts) * Hkv * length * per_token
    return sum(selection.counts) * Hkv * per_token * (BS if selection.kind == "block" else 1)


def execute(selection: Selection, mode: str, state: DecodeState, v_pool: torch.Tensor) -> torch.Tensor:
    """Run one decode attention for ``selection`` in ``mode``: ``state.q [B, Hq, D]`` -> ``[B, Hq, D]``; the keys
    are ``state.k_pool``, the values ``v_pool`` ``[NB, Hkv, BS, D]``."""
    q, ops, scale = state.q, state.ops, state.scale
    table, BS = state.block_table, state.block_size
    args = (q, state.k_pool, v_pool, table, state.seq_lens, state.start)
    if mode == "block":
        if selection.kind != "block":
            raise ValueError("a token selection cannot run in block mode")
        return ops.decode_blocks(*args, selection.indices, selection.ex_lo, selection.ex_hi, scale)
    if mode == "token" and selection.dense:  # every block: the token kernel would read the same rows, in order
        return ops.decode_blocks(*args, selection.indices, selection.ex_lo, selection.ex_hi, scale)
    if mode == "token":
        tokens = ops.blocks_to_tokens(selection.indices, BS) if selection.kind == "block" else selection.indices
        return ops.decode_tokens(*args, tokens, selection.ex_lo, selection.ex_hi, scale)
    mask = ops.selection_to_mask(
        selection.indices,
        selection.kind,
        BS,
        state.length,
        state.seq_lens,
        state.start,
        selection.ex_lo,
        selection.ex_hi,
    )
    return ops.decode_masked(q, state.k_pool, v_pool, table, state.seq_lens, mask, scale)


def auto_runs_sparse(config: SparseConfig, batch: int, num_kv_heads: int, head_dim: int, length: int) -> bool:
    """``mode="auto"``: whether a decode step at ``length`` tokens runs the policy (the crossover table's decision
    for its budget, the batch and the head shape); decided on the host."""
    fraction = budget_fraction(config.policy, length)
    return fraction is not None and config.crossover.use_sparse(fraction, batch, num_kv_heads, head_dim, length)


def choose(
    config: SparseConfig, state: DecodeState, layer_idx: int, cache: PagedKVCache, sparse: bool | None = None
) -> tuple[Selection, str]:
    """The selection of this layer and step, and the mode that executes it.

    Dense layers select everything. ``mode="auto"`` runs the step dense (every block, block kernel) below the
    crossover context of the table for this budget, batch and head shape, and the policy at or above it (block
    mode, or token mode for a token policy); it counts its choices in the session's counters. A static step passes
    the decision its plan holds (``sparse``) and counts nothing (its counts are made before it, by
    :func:`static_counters`).
    """
    policy = config.policy
    if config.mode != "auto":
        dense = layer_idx in config.dense_layers
        return (Policy.dense_selection(state) if dense else policy.select(state)), config.mode
    if layer_idx in config.dense_layers:
        return Policy.dense_selection(state), "block"
    if sparse is None:
        sparse = auto_runs_sparse(config, state.q.shape[0], state.num_kv_heads, state.q.shape[-1], state.length)
        cache.session.count_auto(sparse)
    if not sparse:
        return Policy.dense_selection(state), "block"
    return policy.select(state), "token" if policy.granularity == "token" else "block"


@dataclass(frozen=True)
class StaticPlan:
    """The host decisions of one static decode step, made before it from its lengths. A step's graph is captured
    under :attr:`key` (``sparse`` and ``widths``): two steps whose plans differ only in the per-sequence ``counts``
    replay the same graph, which reads the counts from the device buffer filled before each step.

    Attributes:
        sparse: ``mode="auto"``'s decision for the sparse layers (``True`` in the other modes).
        counts: what :meth:`Policy.plan` returns at the step's stored lengths (``None``: everything). The step reads
            them on the device (``StaticBuffers.counts``, filled before it), never on the host.
        widths: :meth:`Policy.static_widths` of ``counts`` (the selection's width first; ``None`` with them): the
            only host ints of the plan the step reads, so that a compiled step recompiles when a width first
            changes (then it is dynamic), not whenever one sequence's count does.
        held: the reservation's width of a dense selection of the blocks held (``StaticBuffers.held``: a table with
            freed blocks), which the dense layers read on the host; ``None``: every block. Fixed for a reservation
            unless a refill leaves other blocks out (``PagedKVCache.load_static(free=...)``).
    """

    sparse: bool
    counts: tuple[int, ...] | None
    widths: tuple[int, ...] | None
    held: int | None = None

    @property
    def key(self) -> tuple[bool, tuple[int, ...] | None, int | None]:
        """What the step reads of this plan on the host (``sparse``, ``widths``, ``held``): the key of its captured
        graph."""
        return self.sparse, self.widths, self.held


def freed_before(cache: PagedKVCache) -> tuple[int, ...] | None:
    """Blocks freed per sequence of a cache reserved for static steps (``StaticBuffers.evicted``: before the
    reservation, or left out by its last refill; fixed between refills), or, on a cache not reserved, now (``None``:
    none)."""
    return cache.static.evicted if cache.static is not None else cache.evicted_counts()


def static_plan(config: SparseConfig, cache: PagedKVCache, lens: tuple[int, ...]) -> StaticPlan:
    """The :class:`StaticPlan` of a step at stored lengths ``lens`` (the current token included), decided on the
    host as the eager step decides (:func:`choose`, :meth:`Policy.plan`), with the widths the policy's static
    selection reads (:meth:`Policy.static_widths`)."""
    sparse = True
    if config.mode == "auto" and cache.paged_layers:
        _, Hkv, _, D = cache.paged_layers[0].k_pool.shape
        sparse = auto_runs_sparse(config, len(lens), Hkv, D, max(lens))
    counts = config.policy.plan(lens, cache.block_size) if sparse else None
    held = cache.static.held if cache.static is not None else None
    if counts is None:
        return StaticPlan(sparse, None, None, held)
    evicted = freed_before(cache)
    if evicted is not None:  # never more than a sequence still holds, as the eager step's select (Counts.at_most)
        unit = "token" if config.policy.granularity == "token" else "block"
        live = live_counts(lens, evicted, cache.block_size, unit)
        counts = [min(c, n) for c, n in zip(counts, live)]
    return StaticPlan(sparse, tuple(counts), tuple(config.policy.static_widths(counts, cache.block_size)), held)


@dataclass(frozen=True)
class CountingRates:
    """What a static step at one plan adds to the counters, as rates over its lengths (``lens``, stored tokens per
    sequence): K/V bytes ``= per_block * sum(cdiv(n, BS)) + per_planned * sum(plan.counts) + per_token * B *
    max(lens)`` (dense layers read every block, sparse layers the plan's widths, ``mode="mask"`` layers the longest
    context in every sequence), and the layers ``mode="auto"`` ran dense or sparse. The eager step's per-layer rule
    (:func:`kv_bytes`), summed over the layers once per plan (:func:`counting_rates`) instead of at every step."""

    per_block: int
    per_planned: int
    per_token: int
    auto: tuple[tuple[str, int], ...]

    def counters(
        self, plan: StaticPlan, lens: tuple[int, ...], block_size: int, evicted: tuple[int, ...] | None = None
    ) -> Counters:
        """The counters of one step at ``lens`` (the current token included); ``evicted``: blocks freed per sequence,
        which a dense layer does not read."""
        blocks = sum(cdiv(n, block_size) for n in lens) - sum(evicted or ())
        planned = sum(plan.counts) if plan.counts is not None else 0
        nbytes = self.per_block * blocks + self.per_planned * planned + self.per_token * len(lens) * max(lens)
        return Counters(nbytes, 1, dict(self.auto))


def counting_rates(config: SparseConfig, cache: PagedKVCache, plan: StaticPlan) -> CountingRates:
    """The :class:`CountingRates` of static steps at ``plan``: per paged layer, the mode and selection kind the eager
    step would use (:func:`choose`), and :func:`kv_bytes` of one unit of what that layer reads."""
    rates, auto = {"block": 0, "planned": 0, "token": 0}, {"dense": 0, "sparse": 0}
    policy = config.policy
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, PagedLayer):
            continue
        dense = i in config.dense_layers or plan.counts is None
        mode = config.mode
        if mode == "auto":
            if i not in config.dense_layers:
                auto["sparse" if plan.sparse else "dense"] += 1
            sparse = not dense and plan.sparse
            mode = "token" if sparse and policy.granularity == "token" else "block"
        kind = "token" if not dense and policy.granularity == "token" else "block"
        if mode == "mask":  # every sequence reads the longest context: per sequence and token
            rates["token"] += kv_bytes(Selection(kind, None, None, None, (0,)), mode, layer, 1)
        else:  # one entry of the selection (a block, or a token of a token selection)
            rates["block" if dense else "planned"] += kv_bytes(Selection(kind, None, None, None, (1,)), mode, layer, 0)
    return CountingRates(rates["block"], rates["planned"], rates["token"], tuple(auto.items()))


def static_counters(config: SparseConfig, cache: PagedKVCache, plan: StaticPlan, lens: tuple[int, ...]) -> Counters:
    """What the eager step at ``lens`` would add to the session's counters (one step, its K/V bytes, its auto
    choices): a static step counts on the host before it runs. The rates of a plan are worked out once per
    reservation (:meth:`~hf_sparse_kv.cache.StaticBuffers.keep`, keyed by the plan and the settings they depend on);
    a step then costs a few additions, whatever the number of layers."""
    key = ("counting rates", plan, config.mode, tuple(config.dense_layers), config.policy.granularity)
    rates = cache.static.keep(key, lambda: counting_rates(config, cache, plan))
    return rates.counters(plan, lens, cache.block_size, cache.static.evicted)


def layer_state(
    query: torch.Tensor,
    layer: PagedLayer,
    layer_idx: int,
    cache: PagedKVCache,
    scale: float,
    ops,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    lens: tuple[int, ...],
    **step,
) -> DecodeState:
    """What a policy sees of one paged layer in a decode step (query ``[B, Hq, 1, D]``): the layer's pools, metadata
    and declared state beside the step's table and lengths (``step``: ``evicted``, or a static step's ``static``,
    ``planned``, ``planned_counts`` and ``keep``). The eager and the static step both build it here."""
    return DecodeState(
        q=query[:, :, 0],
        k_pool=layer.k_pool,
        kmin=layer.kmin,
        kmax=layer.kmax,
        kmean=layer.kmean,
        block_table=block_table,
        seq_lens=seq_lens,
        start=start,
        lens=lens,
        length=max(lens),
        block_size=cache.block_size,
        scale=scale,
        ops=ops,
        state=layer.state,
        layer=layer_idx,
        **step,
    )


def static_attention(
    config: SparseConfig, cache: PagedKVCache, module: torch.nn.Module, query: torch.Tensor, scale: float, **kwargs
) -> torch.Tensor:
    """A static decode step's attention (``query [B, Hq, 1, D]`` -> ``[B, 1, Hq, D]``): what the eager step does,
    with every length read from the cache's :class:`~hf_sparse_kv.cache.StaticBuffers` and every host decision
    from its plan, so that nothing here depends on host state that changes between steps (the step traces under
    ``torch.compile(fullgraph=True)`` and replays from a CUDA graph). The step's bookkeeping (lengths, counters)
    runs before it, in ``hf_sparse_kv.graphs.begin_static_step``."""
    static, layer_idx = cache.static, module.layer_idx
    layer = cache.layers[layer_idx]
    B = query.shape[0]
    length = static.table.shape[1] * cache.block_size  # the reserved width stands in for the step's lengths
    state = layer_state(
        query, layer, layer_idx, cache, scale, static.ops, static.table, static.seq_lens, static.start,
        (length,) * B, static=True, planned=static.plan.widths, planned_counts=static.counts, keep=static.keep,
        held=static.held,
    )  # fmt: skip
    selection, mode = choose(config, state, layer_idx, cache, sparse=static.plan.sparse)
    return execute(selection, mode, state, layer.v_pool).unsqueeze(1)


def sparse_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The registered attention: query ``[B, Hq, Tq, D]``, key/value ``[B, Hkv, Tk, D]`` -> ``([B, Tq, Hq, D],
    None)``."""
    config: SparseConfig | None = kwargs.pop(CONFIG_KWARG, None)
    cache = kwargs.pop(CACHE_KWARG, None)
    layer_idx = getattr(module, "layer_idx", None)
    layer = cache.layers[layer_idx] if isinstance(cache, PagedKVCache) and layer_idx is not None else None
    if config is None or not isinstance(layer, (PagedLayer, WindowRing)):
        if (  # a sliding-window layer kept as transformers' own, prefilling a left-padded batch: by rows, windowed
            config is not None
            and isinstance(cache, PagedKVCache)
            and query.shape[2] > 1
            and rows_apply(module, query, key, attention_mask, cache.pads, cache.session, **kwargs)
        ):
            return prefill_by_rows(module, query, key, value, cache.pads, dropout=dropout, scaling=scaling, **kwargs)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )

    B, _Hq, Tq, D = query.shape
    if isinstance(layer, WindowRing):  # a static step's sliding-window layer: its own mask over the ring
        return sdpa_attention_forward(
            module, query, key, value, layer.mask(), dropout=dropout, scaling=scaling, **kwargs
        )
    if cache.static is not None and isinstance(layer, PagedLayer):
        return static_attention(config, cache, module, query, scaling if scaling is not None else D**-0.5), None
    if not layer.gave(key, value):
        raise NotImplementedError(
            f"{type(module).__name__} gives its attention other keys or values than its cache returned (it changes "
            "them after cache.update, or reads another layer's cache): the patched attention reads keys and values "
            "from the cache's pages, so it would compute something else than the model asks for. Not supported: "
            "call unpatch_model(model)."
        )
    if Tq > 1:  # prefill, chunked prefill, assisted decoding: dense over the whole context
        if layer.length > key.shape[2]:
            key, value = layer.dense_kv()
        scale = scaling if scaling is not None else D**-0.5
        pads = cache.pads_tensor(query.device)
        observed = config.policy.observe_prefill(query, key, attention_mask, pads, cache.block_size, scale)
        if observed is not None:  # the last multi-token forward is the observation
            cache.session.observe(layer_idx, observed)
        if rows_apply(module, query, key, attention_mask, cache.pads, cache.session, **kwargs):  # left-padded batch
            return prefill_by_rows(module, query, key, value, cache.pads, dropout=dropout, scaling=scaling, **kwargs)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )

    scale = scaling if scaling is not None else D**-0.5
    ops = cache.ops(query.device)
    plan = plan_step(cache, attention_mask, B, layer.length, query.device, config.policy)
    table = cache.table.tensor(query.device)
    state = layer_state(
        query, layer, layer_idx, cache, scale, ops, table, plan.seq_lens, plan.start, plan.lens, evicted=plan.evicted
    )
    selection, mode = choose(config, state, layer_idx, cache)
    out = execute(selection, mode, state, layer.v_pool)  # [B, Hq, D]
    cache.session.count_read(kv_bytes(selection, mode, layer, state.length))
    return out.unsqueeze(1), None
