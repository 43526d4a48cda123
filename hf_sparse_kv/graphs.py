"""CUDA-graph decoding: capture a patched model's decode step once per selection width, then replay it.

In eager mode a decode step of a large model is bound by the host: Python launches a few hundred kernels per
token while the GPU waits (see benchmarks/RESULTS.md). Replaying a captured graph removes that cost. What a
captured step may not do, and how this module avoids it:

- change the block table: :meth:`PagedKVCache.reserve_static` allocates every block up to the maximum length first;
- read lengths from the host: the step reads ``seq_lens`` and the write position from device buffers that
  :meth:`DecodeGraphs.step` fills before each replay;
- change a selection's width: the width of a step is decided on the host by the policy's ``plan()`` (the same
  numbers its ``select()`` uses), and one graph is captured per distinct plan (a fractional budget grows its
  width by one block every ``block_size / budget`` tokens, so a long generation captures a handful of graphs).

The Python bookkeeping a captured step skipped (layer lengths, counters) is done by :meth:`DecodeGraphs.step`.
Supported: every attention layer paged (no sliding-window layers), no left padding, ``mode="block"`` or ``"auto"``
(the crossover's dense/sparse decision is part of the plan a graph is keyed on), a policy that does not free blocks.
:func:`hf_sparse_kv.patch_model` with ``cuda_graph=True`` routes every forward through :func:`captured_step`, which
owns the rule of which forwards replay a graph (:func:`step_applies`) and returns ``None`` for the others (they
run eagerly).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from .attention import auto_runs_sparse
from .cache import PagedKVCache, PagedLayer
from .patched import cache_kwarg, patch_state
from .runtime import Counters


class DecodeGraphs:
    """Captured decode steps of one ``model`` on one ``cache`` (batch fixed by the cache).

    Args:
        model: a model patched with ``mode="block"``.
        cache: its filled :class:`PagedKVCache` (after the prefill).
        max_length: tokens per sequence to reserve (prompt + new tokens).
        capture: capture CUDA graphs (``False`` runs the same static step eagerly: for tests on the CPU).
        forward: the model's forward to call (default ``model``; the patch passes the unwrapped one).
    """

    def __init__(
        self, model, cache: PagedKVCache, max_length: int, capture: bool = True, forward: Callable | None = None
    ):
        config = patch_state(model).config
        self.forward_fn = forward or model
        self.cache_name = cache_kwarg(model)
        if not all(isinstance(layer, PagedLayer) for layer in cache.layers):
            raise ValueError("CUDA-graph decoding needs every attention layer paged (no sliding-window layers)")
        if len({str(layer.device) for layer in cache.paged_layers}) > 1:
            raise ValueError("CUDA-graph decoding needs the whole cache on one device (device_map put it on several)")
        if config.mode not in ("block", "auto") or config.policy.frees_blocks:
            raise ValueError(
                "CUDA-graph decoding supports mode='block' or 'auto' with a policy that does not free blocks"
            )
        self.model, self.config = model, config
        self._cache = weakref.ref(cache)  # the cache holds this runner: no reference cycle between them
        self.capture = capture and torch.cuda.is_available()
        self.static = cache.reserve_static(max_length)
        B = len(cache.table.rows)
        device = cache.paged_layers[0].device
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(B, 1, dtype=torch.long, device=device)
        self.graphs: dict = {}  # plan key -> (graph, logits, kv bytes per step)
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.replays = 0

    @property
    def cache(self) -> PagedKVCache:
        return self._cache()

    def key(self, length: int) -> tuple | None:
        """The host plan of the step that decodes at ``length`` tokens (the width of every sparse layer; under
        ``mode="auto"``, ``("dense",)`` below the crossover, as :func:`hf_sparse_kv.attention.choose` decides)."""
        B, config = len(self.cache.table.rows), self.config
        if config.mode == "auto":
            _, Hkv, _, D = self.cache.paged_layers[0].k_pool.shape
            if not auto_runs_sparse(config, B, Hkv, D, length):
                return ("dense",)
        plan = config.policy.plan((length,) * B, self.cache.block_size)
        return None if plan is None else tuple(plan)

    def fits(self, input_ids: torch.Tensor) -> bool:
        """Whether the next step can run captured (batch, one token, room left in the reservation)."""
        return (
            input_ids.shape == self.ids.shape
            and input_ids.device == self.ids.device
            and self.cache.get_seq_length() + 1 <= self.static.max_length
        )

    def _forward(self):
        kw = {self.cache_name: self.cache, "use_cache": True}
        return self.forward_fn(input_ids=self.ids, position_ids=self.positions, **kw).logits

    def _rewind(self, before: Counters) -> None:
        """Undo the host bookkeeping of a warm-up or capture forward (the device writes are redone by the replay)."""
        self.cache.advance(-1)
        self.cache.session.restore_counters(before)
        self.cache.session.end_step()

    def _capture(self, key) -> tuple:
        session = self.cache.session
        before = session.counters.copy()
        self._forward()  # warm-up: compiles the kernels of this width, allocates workspaces
        per_step = session.counters.minus(before)
        self._rewind(before)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward()
        self._rewind(before)
        return graph, logits, per_step

    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Decode one token per sequence: ``input_ids [B, 1]`` -> logits ``[B, 1, V]`` (a fresh tensor)."""
        cache = self.cache
        length = cache.get_seq_length()  # tokens before this one
        self.static.pos0.fill_(length)
        self.static.seq_lens.fill_(length + 1)
        self.ids.copy_(input_ids)
        if position_ids is None:
            self.positions.fill_(length)
        else:
            self.positions.copy_(position_ids)
        if not self.capture:
            return self._forward().clone()
        key = self.key(length + 1)
        if key not in self.graphs:
            self.graphs[key] = self._capture(key)
        graph, logits, per_step = self.graphs[key]
        graph.replay()
        self.replays += 1
        cache.advance(1)
        cache.session.add_counters(per_step)
        cache.session.end_step()
        return logits.clone()


def step_applies(cache, ids, kwargs: dict) -> bool:
    """Whether a forward may replay a captured decode step: one new token per sequence of a CUDA batch, on a
    filled :class:`PagedKVCache` reserved up to a maximum length, without left padding or a mask with holes, and
    asking for nothing a captured step does not return (hidden states, embeddings as input)."""
    mask = kwargs.get("attention_mask")
    return (
        isinstance(cache, PagedKVCache)
        and isinstance(ids, torch.Tensor)
        and ids.is_cuda
        and ids.dim() == 2
        and ids.shape[1] == 1
        and cache.get_seq_length() > 0
        and cache.max_length is not None
        and not any(cache.pads)
        and cache.session.graphs is not False
        and kwargs.get("inputs_embeds") is None
        and not kwargs.get("output_hidden_states")
        and (mask is None or bool(mask.all()))
    )


def captured_step(model, forward: Callable, cache, ids, kwargs: dict) -> torch.Tensor | None:
    """The logits ``[B, 1, V]`` of a decode step replayed from a captured graph, or ``None`` when this forward
    must run eagerly (:func:`step_applies` says no, the cache cannot be captured, or its reservation is full). The
    cache's first eligible step builds its :class:`DecodeGraphs` (``forward``: the model's unwrapped forward)."""
    if not step_applies(cache, ids, kwargs):
        return None
    runner = cache.session.graphs
    if runner is None:
        try:
            runner = DecodeGraphs(model, cache, cache.max_length, forward=forward)
        except ValueError:
            cache.session.set_graphs(False)  # this cache cannot decode from graphs: eager from now on
            return None
        cache.session.set_graphs(runner)
    if not runner.fits(ids):
        return None
    return runner.step(ids, kwargs.get("position_ids"))
