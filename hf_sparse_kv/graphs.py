"""Static decoding: a decode step whose host decisions are made before it, so that it can be compiled
(``torch.compile(fullgraph=True)``), captured as a CUDA graph, or both.

In eager mode a decode step of a large model is bound by the host: Python launches a few hundred kernels per
token while the GPU waits (see benchmarks/RESULTS.md). A *static step* removes every reason for the step to read
or change host state:

- the block table never changes: :meth:`PagedKVCache.reserve_static` allocates every block up to the maximum length
  first, and turns each sliding-window layer into a fixed-shape ring (:class:`~hf_sparse_kv.cache.WindowRing`);
- lengths, write positions, position ids and each sequence's left padding live in device buffers
  (:class:`~hf_sparse_kv.cache.StaticBuffers`) that :func:`begin_static_step` fills before the step;
- the selections' counts per sequence and their widths, and ``mode="auto"``'s dense/sparse decision, are the
  step's :class:`~hf_sparse_kv.attention.StaticPlan`, decided on the host from the lengths by the policy's
  ``plan()``. The step reads the counts from a device buffer that :func:`begin_static_step` fills, and only the
  widths (and the dense/sparse decision) on the host: two steps whose plans agree on those (``StaticPlan.key``) run
  the same graph, so a compiled step recompiles, and a captured one is captured again, when a width changes, not
  whenever one sequence's count does (a fractional budget grows the widest selection by one block every
  ``block_size / budget`` tokens; the plan's width is rounded up, :func:`~hf_sparse_kv.policies.base.static_width`,
  so that a long generation makes a handful of graphs, a left-padded batch no more);
- the ops are PyTorch custom ops (:mod:`hf_sparse_kv.ops.library`), opaque to dynamo, free of host syncs;
- the host bookkeeping of the step (layer lengths, counters) is done by :func:`end_static_step` (from
  :func:`begin_static_step`, or after a replay), not by the step.

Every mode (mask, token, block, auto), left-padded batches and sliding-window layers run statically; a policy that
frees blocks at every step does not (its table changes), one that frees them once (SnapKV, at its first decode step)
does from its second step on: its table keeps the freed blocks as holes that the static steps never select. Two ways
in:

- :class:`DecodeGraphs` (what ``patch_model(cuda_graph=True)`` uses for ``generate()``): it captures one CUDA graph
  per plan key and replays it; with ``compile=`` it compiles the step first (``fullgraph=True``)
  and captures the compiled step, so inductor's fusion of the model's own small kernels (norms, rotary, SiLU)
  and the removal of launch overhead add up. ``capture=False`` runs the same static step without a graph (the CPU
  tests do).
- a user's own ``model.forward = torch.compile(model.forward, fullgraph=True)`` on a cache reserved with
  ``cache.reserve_static(max_length)`` after the prefill, or ``generate(compile_config=...)`` (the patch then builds
  a ``PagedKVCache(static=True)``, reserved at its first decode step): the patch's model pre-hook, which runs
  outside the compiled forward (``torch.compiler.disable``: transformers compiles ``model.__call__``), calls
  :func:`begin_static_step` (and passes the step's position ids).

Why the home-made capture stays beside ``torch.compile(mode="reduce-overhead")``'s CUDA graphs (which also work on
a reservation: its tensors are marked as static addresses): cudagraph trees are tied to a compile (minutes per plan
on an 8B model; a captured step needs none), skip a graph whenever an input they cannot prove static is mutated,
re-record when a guard fails, and give no place for the step's host bookkeeping; capturing the (optionally
compiled) step here keys the graphs on the plan the step already has.
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Callable

import torch

from .attention import StaticPlan, decode_row, static_counters, static_plan
from .cache import PagedKVCache, PagedLayer, WindowRing
from .patched import cache_kwarg, patch_state

FREEZING_ERROR = (
    "inductor's freezing cannot compile a static decode step of hf_sparse_kv: it makes every tensor marked as a static "
    "address a constant of the compiled step, and the paged cache's pools and the step's device buffers are such "
    "tensors, written at every step (the logits go wrong from the second step on). Turn it off "
    "(torch._inductor.config.freezing = False; no 'freezing' in compile's options)."
)


def refuse_freezing(compile: str | dict | None) -> None:
    """Raise :data:`FREEZING_ERROR` (``ValueError``) when ``compile`` (``patch_model``'s / :class:`DecodeGraphs`'
    argument) asks inductor for ``freezing``; :func:`begin_static_step` refuses the global flag itself."""
    if isinstance(compile, dict) and dict(compile.get("options") or {}).get("freezing"):
        raise ValueError(FREEZING_ERROR)


def _inductor_freezing() -> bool:
    """Whether inductor's global ``freezing`` flag is on (inductor's config is not imported for the question)."""
    config = sys.modules.get("torch._inductor.config")
    return bool(getattr(config, "freezing", False))


def begin_static_step(
    config,
    cache: PagedKVCache,
    positions: torch.Tensor | None = None,
    compiled: bool = True,
    derive: bool = True,
    finish: bool = True,
) -> StaticPlan:
    """The host part of a static decode step on a reserved ``cache``, before the step runs: plan it at its lengths,
    fill the device buffers (``positions`` ``[B, 1]``: the step's position ids, default ``generate()``'s), move the
    layers' lengths on by the new token and count the step (as the eager step would). Returns the step's plan (the
    key of its graph). ``compiled``: whether the step may run compiled (``False`` only for a :class:`DecodeGraphs`
    without ``compile``); such a step refuses to run (``RuntimeError``, before anything changes) while inductor's
    global ``freezing`` flag is on: a frozen compile of the step would read the cache as constants. ``derive=False``:
    the step derives its lengths from the frame on the device (:meth:`StaticBuffers.derive`, as
    :class:`DecodeGraphs`' steps do), two launches fewer on the host. ``finish=False``: leave the lengths and the
    counters to :func:`end_static_step` (a replay reads no host state: :class:`DecodeGraphs` does them after it)."""
    if compiled and _inductor_freezing():
        raise RuntimeError(FREEZING_ERROR)
    static = cache.static
    frame = cache.get_seq_length()  # tokens before this one, in transformers' frame
    if frame + 1 > static.max_length:
        raise ValueError(
            f"this PagedKVCache is reserved for {static.max_length} tokens per sequence and holds {frame}: reserve "
            "more (reserve_static / generate's max_length), or reset() it"
        )
    lens = tuple(frame + 1 - p for p in cache.pads)
    plan = static_plan(config, cache, lens)
    static.begin_step(frame, plan, plan.counts, positions, derive=derive)
    if finish:
        end_static_step(config, cache, plan, frame)
    return plan


def end_static_step(config, cache: PagedKVCache, plan: StaticPlan, frame: int) -> None:
    """The host bookkeeping of the static step at ``frame`` (transformers' frame, the tokens before it): every layer's
    length moved on by the token and the step counted as the eager step would count it. Before a step that runs the
    model's Python (an uncaptured step, a capture's warm-up forward, a compile: they may read the lengths), after a
    replay, which reads none: the host does it while the GPU runs the step instead of before launching it (~7 µs a
    step of Python on a 2-core CPU, ~3× that on a cold host; benchmarks/RESULTS.md, 2026-12-06)."""
    cache.advance(1)
    lens = tuple(frame + 1 - p for p in cache.pads)
    cache.session.add_counters(static_counters(config, cache, plan, lens))


def graph_pool(device: torch.device | int | None = None) -> torch.cuda.MemPool:
    """A CUDA-graph memory pool on ``device`` (default: the current one) for :class:`DecodeGraphs` (``pool=``; the
    runners' device) that stays usable while the returned object lives: a ``torch.cuda.MemPool`` holds a reference on
    its pool, so every graph captured into it may be freed and new ones captured into it again. A bare
    ``torch.cuda.graph_pool_handle()`` is only the pool's id: once its last graph is freed (a runner dropped with its
    slot, graphs cleared) while memory it handed out lives on, a new capture into it fails inside the caching
    allocator (``INTERNAL ASSERT FAILED ... use_count > 0``)."""
    with torch.cuda.device(device):
        return torch.cuda.MemPool()


class DecodeGraphs:
    """Static decode steps of one ``model`` on one ``cache`` (batch fixed by the cache), captured per plan key.

    Args:
        model: a patched model (any mode; a policy that frees no blocks, or one that frees them once, after its
            first decode step ran eagerly).
        cache: its filled :class:`PagedKVCache` (after the prefill).
        max_length: tokens per sequence to reserve (prompt + new tokens, left padding included).
        capture: capture CUDA graphs (``False`` runs the same static step without a graph: for tests on the CPU; a
            cache of the ``"reference"`` backend, whose ops sync with the host, never captures).
        forward: the model's forward to call (default: the class's forward, without the patch's model hook).
        compile: ``None``, a ``torch.compile`` backend name, or a dict of ``torch.compile`` keyword arguments:
            compile the step with ``fullgraph=True`` (then capture the compiled step).
        pool: a :func:`graph_pool` to capture into, shared with other runners (default: one of its own); the runner
            keeps a reference to it. Runners sharing a pool must never replay at the same time: a step's temporaries
            may lie where another runner's were; each step returns a copy of its logits, so nothing of one replay is
            read after the next.

    Attributes (what the steps cost, for benchmarks): ``graphs`` (``StaticPlan.key`` -> captured graph and its
    logits), ``replays`` (steps replayed from a graph), ``capture_seconds`` (wall time of the captures: each a
    warm-up forward and the capture, synchronised).
    """

    def __init__(
        self,
        model,
        cache: PagedKVCache,
        max_length: int,
        capture: bool = True,
        forward: Callable | None = None,
        compile: str | dict | None = None,
        pool=None,
    ):
        refuse_freezing(compile)
        config = patch_state(model).config
        self.cache_name = cache_kwarg(model)
        if len({str(layer.device) for layer in cache.paged_layers}) > 1:
            raise ValueError("static decoding needs the whole cache on one device (device_map put it on several)")
        if config.policy.frees_blocks and not (config.policy.frees_once and released(cache)):
            raise ValueError(
                "static decoding needs a block table that no longer changes: a policy that frees blocks at every "
                "step cannot decode statically, and one that frees them once (SnapKV) only after its first decode "
                "step, which frees them, ran eagerly"
            )
        self.model, self.config, self.state = model, config, patch_state(model)
        self.weights = weight_addresses(model)  # what the graphs read besides the cache (see rebind)
        self._cache = weakref.ref(cache)  # the cache holds this runner: no reference cycle between them
        # the reference ops sync with the host (data-dependent masks): their steps run uncaptured; so does a cache on
        # the CPU on a machine with a GPU (a graph would capture none of its ops and its replays would do nothing)
        where = cache.static_device
        on_cuda = where is not None and where.type == "cuda"
        self.capture = capture and on_cuda and torch.cuda.is_available() and cache.backend != "reference"
        if self.capture and pool is not None and not isinstance(pool, torch.cuda.MemPool):
            raise TypeError(
                f"pool must be a hf_sparse_kv.graphs.graph_pool() (a torch.cuda.MemPool), got {type(pool).__name__}: "
                "a bare torch.cuda.graph_pool_handle() cannot be captured into again once its graphs were freed"
            )
        # the state this policy reads, computed from the stored keys where the cache lacks it (a cache filled under
        # another policy), before the reservation: a static step never declares it, and a reserved cache refuses it
        cache.declare_state(config.policy.cache_state(), config.policy.key_metadata())
        self.static = cache.reserve_static(max_length)
        cache.session.set_graphs(self)  # the patch's model hook leaves this cache's steps to this runner
        fn = forward or type(model).forward.__get__(model)
        self.compiled = compile is not None
        if compile is not None:
            options = {"backend": compile} if isinstance(compile, str) else dict(compile)
            fn = torch.compile(fn, fullgraph=True, **options)
        self.forward_fn = fn
        B = self.static.pads.shape[0]
        device = self.static.pads.device
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=device)
        # every layer takes its lengths from the reservation (paged layers) or masks its own ring: a 4-D mask given
        # to the forward, which no layer reads, keeps transformers from building one of the reserved length at every
        # step (a reserved cache is "compileable", so transformers builds it even for one token: a few kernels)
        ignored = all(isinstance(layer, (PagedLayer, WindowRing)) for layer in cache.layers)
        self.mask = torch.ones(B, 1, 1, 1, dtype=torch.bool, device=device) if ignored else None
        self.given = None  # position ids of the model's own shape (see _positions); None: the reservation's [B, 1]
        self.graphs: dict = {}  # StaticPlan.key -> (graph, logits)
        # a capture runs on the reservation's device (a model on cuda:1 while cuda:0 is current included), on a
        # stream of the runner's own: torch.cuda.graph's default capture stream is made once, on the device current
        # at its first use
        self.pool = (pool if pool is not None else graph_pool(device)) if self.capture else None
        self.stream = torch.cuda.Stream(device) if self.capture else None
        self.replays = 0
        self.capture_seconds = 0.0  # wall time of the captures (each warm-up forward and capture), synchronised

    @property
    def cache(self) -> PagedKVCache:
        return self._cache()

    def rebind(self, model) -> None:
        """Serve ``model`` patched again with the same settings: these steps become the cache's again and
        :meth:`step` accepts the new patch. For a caller that patches its policies in turn on one model and keeps
        each policy's steps across batches (its cache refilled by ``PagedKVCache.load_static``): a replay reads
        the settings and weights it was captured with, so they must be the same. Raises ``ValueError`` (nothing
        changed) when ``model`` is another model, unpatched, patched with other settings, patched with merged
        projections (each patch makes new merged weights), or when any of its parameters or buffers moved."""
        state = patch_state(model)
        why = ""
        if model is not self.model or state is None:
            why = "another model, or an unpatched one"
        elif state.merged or self.state.merged:
            why = "merged projections (each patch makes new merged weights)"
        elif not same_settings(state.config, self.config):
            why = "other settings"
        elif weight_addresses(model) != self.weights:
            why = "weights or buffers at other addresses"
        if why:
            raise ValueError(f"these static steps cannot serve this model: {why}; make a new DecodeGraphs")
        self.state = state
        self.cache.session.set_graphs(self)

    def plan(self, length: int) -> StaticPlan:
        """The plan of the step that decodes at ``length`` tokens of transformers' frame (the current one included);
        its graph is captured under ``plan.key``."""
        return static_plan(self.config, self.cache, tuple(length - p for p in self.cache.pads))

    def fits(self, input_ids: torch.Tensor) -> bool:
        """Whether the next step can run statically (batch, one token, room left in the reservation)."""
        return (
            input_ids.shape == self.ids.shape
            and input_ids.device == self.ids.device
            and self.cache.get_seq_length() + 1 <= self.static.max_length
        )

    def _forward(self):
        """The step itself (what a graph captures): the lengths derived from the frame, the forward, the frame
        moved on to the next token's (so that the host fills nothing at the next step, :meth:`step`)."""
        kw = {self.cache_name: self.cache, "use_cache": True}
        if self.mask is not None:
            kw["attention_mask"] = self.mask
        positions = self.static.positions if self.given is None else self.given
        self.static.derive()
        logits = self.forward_fn(input_ids=self.ids, position_ids=positions, **kw).logits
        self.static.next_frame()
        return logits

    def _positions(self, position_ids: torch.Tensor | None) -> torch.Tensor | None:
        """The step's ``position_ids`` for the reservation's ``[B, 1]`` buffer, or ``None`` where they have another
        shape: a model with multimodal rotary positions (Qwen2-VL / Qwen2.5-VL: ``[3 or 4, B, 1]``, the text axis
        shifted by the images) gets them as ``generate()`` made them, through this runner's own buffer of their
        shape; a buffer of a new shape drops the steps captured reading the old one."""
        if position_ids is None or position_ids.shape == self.static.positions.shape:
            if self.given is not None:  # back to the reservation's buffer
                self.given = None
                self.graphs.clear()
            return position_ids
        if self.given is None or self.given.shape != position_ids.shape or self.given.dtype != position_ids.dtype:
            self.given = torch.empty_like(position_ids, device=self.ids.device)
            self.graphs.clear()
        self.given.copy_(position_ids)
        return None

    def _capture(self) -> tuple:
        # warm-up (compiles the kernels of this plan, allocates workspaces): it writes this step's token, which the
        # replay writes again, to the same place; both on the reservation's device (a replay sets it itself)
        with torch.cuda.device(self.ids.device):
            self._forward()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool.id, stream=self.stream):
                logits = self._forward()
        return graph, logits

    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Decode one token per sequence: ``input_ids [B, 1]`` -> logits ``[B, 1, V]`` (a fresh tensor).

        Raises ``RuntimeError`` (before anything changes) when the model was patched again or unpatched since these
        steps were set up: their graphs would read the old settings and weights' addresses."""
        if patch_state(self.model) is not self.state:
            raise RuntimeError(
                "the model was patched again (or unpatched) after this cache's static steps were set up: they would "
                "replay its old settings and weights. Call cache.reset() and prefill again."
            )
        static, cache = self.static, self.cache
        plan = begin_static_step(
            self.config, cache, self._positions(position_ids), compiled=self.compiled, derive=False, finish=False
        )
        frame = static.frame_held  # the step's frame, in static.frame now
        self.ids.copy_(input_ids)
        static.moved(None)  # until the step has run: an error in it leaves the frame unknown
        if self.capture and plan.key in self.graphs:
            logits = self._replay(plan.key)
            end_static_step(self.config, cache, plan, frame)  # the host's bookkeeping while the GPU runs the step
        else:  # the model's Python runs (eagerly, or a capture's warm-up): the lengths moved on first
            end_static_step(self.config, cache, plan, frame)
            if self.capture:  # a new width (or mode="auto"'s decision), not a new per-sequence count
                t0 = time.perf_counter()
                self.graphs[plan.key] = self._capture()  # its warm-up ran the step: the frame moved on
                static.set_frame(frame)
                if self.ids.device.type == "cuda":
                    torch.cuda.synchronize(self.ids.device)
                self.capture_seconds += time.perf_counter() - t0
                logits = self._replay(plan.key)
            else:
                logits = self._forward().clone()
        static.moved(frame + 1)
        return logits

    def _replay(self, key) -> torch.Tensor:
        """Launch the graph captured under ``key``; a copy of its logits (the next replay overwrites them)."""
        graph, logits = self.graphs[key]
        graph.replay()
        self.replays += 1
        return logits.clone()


def weight_addresses(model: torch.nn.Module) -> tuple[int, ...]:
    """The data addresses of ``model``'s parameters and buffers, in order (what a captured step reads besides its
    cache and buffers)."""
    return tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))


def same_settings(a, b) -> bool:
    """Whether two patch settings (:class:`~hf_sparse_kv.attention.SparseConfig`) are equal; settings that cannot be
    compared (a field holding tensors) are equal only when they are one object."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):
        return False


def pads_match(cache: PagedKVCache, mask: torch.Tensor | None, length: int) -> bool:
    """Whether a decode mask (2-D ``[B, length]`` of 1 / 0, or 4-D ``[B, 1, q, length]``, bool or additive) pads
    exactly as the cache's prompt did (left padding only, fixed at prefill): every position from each sequence's
    padding on allowed, none before it.

    One comparison on the device and one read of its answer (``generate()`` calls this at every step): the mask's
    last row against ``position >= pads``, not the padding worked out and compared on the host."""
    B = len(cache.table.rows) or len(cache.pads)
    pads = cache.pads or [0] * B
    if mask is None:
        return not any(pads)
    if mask.shape[-1] < length or mask.shape[0] != B:
        return False
    row = decode_row(mask, length)  # [B, length] bool
    if not any(pads):
        return bool(row.all())
    at = torch.arange(length, device=row.device)
    return torch.equal(row, at >= cache.pads_tensor(row.device).view(-1, 1))


def step_applies(cache, ids, kwargs: dict) -> bool:
    """Whether a forward may replay a captured decode step: a CUDA batch whose step is static
    (:func:`static_step_applies`)."""
    return isinstance(ids, torch.Tensor) and ids.is_cuda and static_step_applies(cache, ids, kwargs)


def static_step_applies(cache, ids: torch.Tensor, kwargs: dict) -> bool:
    """Whether a forward is a static decode step, whatever the device: one new token per sequence, on a filled
    :class:`PagedKVCache` reserved up to a maximum length, a mask that pads as the prompt did (left padding only),
    and asking for nothing a captured step does not return (hidden states, embeddings as input)."""
    return (
        isinstance(cache, PagedKVCache)
        and ids.dim() == 2
        and ids.shape[1] == 1
        and cache.get_seq_length() > 0
        and cache.max_length is not None
        and cache.session.graphs is not False
        and kwargs.get("inputs_embeds") is None
        and not kwargs.get("output_hidden_states")
        and pads_match(cache, kwargs.get("attention_mask"), cache.get_seq_length() + 1)
    )


def released(cache: PagedKVCache) -> bool:
    """Whether a decode step of ``cache`` already handed its prefill's observations to the policy (which freed what a
    policy that frees once frees then), or the cache has no paged layer (nothing to observe, nothing ever freed)."""
    return cache.session.observation_used or not cache.paged_layers


def captured_step(model, forward: Callable, cache, ids, kwargs: dict) -> torch.Tensor | None:
    """The logits ``[B, 1, V]`` of a decode step replayed from a captured graph, or ``None`` when this forward
    must run eagerly (:func:`step_applies` says no, the cache cannot be captured, or the step is the first of a
    policy that frees blocks once: that step frees them, eagerly). The cache's first eligible step builds its
    :class:`DecodeGraphs` (``forward``: the model's unwrapped forward)."""
    if not step_applies(cache, ids, kwargs):
        return None
    runner = cache.session.graphs
    if runner is None:
        config = patch_state(model).config
        if config.policy.frees_blocks and config.policy.frees_once and not released(cache):
            return None  # the first decode step frees the prompt's blocks; the next one reserves and captures
        try:
            runner = DecodeGraphs(model, cache, cache.max_length, forward=forward, compile=config.compile)
        except ValueError:
            cache.session.set_graphs(False)  # this cache cannot decode from graphs: eager from now on
            return None
    if not runner.fits(ids):
        raise ValueError(
            f"this PagedKVCache is reserved for static decoding of {tuple(runner.ids.shape)} token ids up to "
            f"{runner.static.max_length} tokens; got {tuple(ids.shape)} at {cache.get_seq_length()}: reset() it first"
        )
    return runner.step(ids, kwargs.get("position_ids"))
