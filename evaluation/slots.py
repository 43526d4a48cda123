"""Captured decode steps kept across the batches and jobs of a suite run (issue 12's device time).

:func:`evaluation.needle.greedy_batch` with ``static=True`` decodes each policy of a batch through
:class:`~hf_sparse_kv.graphs.DecodeGraphs` on its own copy of the shared prefill: every batch captures every
policy's graphs again (a warm-up forward and a capture per width; on the H200 most of a captured batch's decoding
time, benchmarks/RESULTS.md). A copy per policy kept across batches does not fit at 32K (16 policies x 7.5 GB on
Qwen2.5 at 8 x 32K), so :class:`DecodeSlots` keeps one cache, reserved for static decoding, that each policy's
turn refills in place from the batch's shared prefill (``PagedKVCache.load_static``: every tensor keeps its
address), and each policy's ``DecodeGraphs`` on it, rebound to the model patched again for that policy
(``DecodeGraphs.rebind``). A policy's graphs are then captured once per batch size and width while that size's slot
is kept, not once per batch.

A policy that frees blocks once (SnapKV: the prompt's unkept blocks, at its first decode step) decodes on the slot
too: the refill leaves those blocks out (``load_static(free=...)``: holes of the step's table), so that its cache is
what its first step would leave, and its steps, the first included, replay as the others' do.

The slot holds the state every policy of the job declares (their ``cache_state()``, recomputed from the keys at
each refill), is reserved for any left padding (``reserve_static(any_padding=True)``) and for the longest batch
seen plus ``margin`` tokens; a batch longer than that, or a policy declaring state the slot lacks, makes a new slot
of that batch size (the old one and its graphs dropped first). Slots are kept per batch size, up to ``keep`` of them
(the least recently used dropped first), so that a job's last, smaller batch and the next job of the same batch size
and no longer prompts (a suite run keeps one ``DecodeSlots`` for all its needle and QA jobs) find their slot and
captured steps: on Qwen2.5's grid on an H100 (2026-12-05) each job captured every policy's steps again in its first
and its last batch, ~2-8 s each, ~40 s of the grid at least. Every runner of every slot captures into one CUDA-graph
memory pool (they never replay at the same time).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_sparse_kv import PagedKVCache
from hf_sparse_kv.graphs import DecodeGraphs, graph_pool
from hf_sparse_kv.ops.layout import KEY_METADATA
from hf_sparse_kv.patched import patch_state
from hf_sparse_kv.policies import Policy


def job_state(current: Policy, policies: list[Policy], held: tuple = ()) -> tuple:
    """The state a slot keeps for a job's ``policies`` while ``current`` decodes: ``current``'s, then for every other
    name a policy keeps state under, the spec ``held`` (the kept slot's) has of it if a policy declares that one, else
    the first policy's (equal specs once). A cache holds one state per name: of two policies keeping other contents
    under one name (2- and 4-bit codes) the one decoding now has its own and the other gets a new slot at its turn,
    while a policy that reads neither keeps the slot it finds."""
    declared = list(dict.fromkeys(s for p in policies for s in p.cache_state()))
    specs = list(dict.fromkeys(current.cache_state()))
    for spec in [s for s in held if s in declared] + declared:
        if spec.name not in {s.name for s in specs}:
            specs.append(spec)
    return tuple(specs)


@dataclass
class _Slot:
    """One reserved cache and each policy's captured steps on it (policy key -> ``DecodeGraphs``)."""

    cache: PagedKVCache
    runners: dict[Any, DecodeGraphs] = field(default_factory=dict)


class DecodeSlots:
    """Reserved caches, one per batch size, and each policy's captured steps on them, kept across batches and jobs
    (see the module docstring).

    Args:
        margin: tokens reserved beyond the first batch's prompt + new tokens, so that later batches (prompts a few
            tokens longer) fit the same reservation.
        keep: slots kept at most (one per batch size; the least recently used is dropped for a new one).
        whole_refills: refill a slot whole at every turn (``PagedKVCache.load_static(whole=True)``), not only what
            changed since its last refill: to time what the partial refill saves.

    Attributes: ``slots_made`` (slots built so far), ``loads`` (refills), ``cache`` and ``runners`` (the slot used
    last and its policy key -> ``DecodeGraphs``; ``None`` and ``{}`` before any), ``kept`` (batch size -> slot, least
    recently used first), ``pool`` (on a GPU, the one CUDA-graph memory pool, a ``graphs.graph_pool()``, every
    runner captures into: the policies decode one after the other, so each needs room for one step's temporaries, not
    a pool of its own: graph pools held 7.75 GiB of a process that ran out of memory at 16 x 32K on Qwen2.5 on an
    H100, 2026-12-05).
    """

    def __init__(self, margin: int = 256, keep: int = 3, whole_refills: bool = False):
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.margin, self.keep, self.whole_refills = margin, keep, whole_refills
        self.kept: dict[int, _Slot] = {}  # batch size -> slot, least recently used first
        self.current: _Slot | None = None
        self.pool = None  # one CUDA-graph memory pool for every runner (they replay one at a time)
        self.slots_made = 0
        self.loads = 0

    @property
    def cache(self) -> PagedKVCache | None:
        return self.current.cache if self.current is not None else None

    @property
    def runners(self) -> dict[Any, DecodeGraphs]:
        return self.current.runners if self.current is not None else {}

    def drop(self) -> None:
        """Let go of every slot and its graphs (their memory is freed with the last reference)."""
        self.kept = {}
        self.current = None
        self.pool = None

    def _fits(self, slot: PagedKVCache, prefix: PagedKVCache, need: int, specs: tuple) -> bool:
        return (
            len(slot.table.rows) == len(prefix.table.rows)
            and slot.block_size == prefix.block_size
            and need <= slot.static.max_length
            and set(specs) <= set(slot.specs)
        )

    def _slot(self, prefix: PagedKVCache, need: int, specs: tuple) -> _Slot:
        """The kept slot of ``prefix``'s batch size if it fits, else a new one (made after the one it replaces, or
        the least recently used beyond ``keep``, is dropped); it becomes the most recently used."""
        B = len(prefix.table.rows)
        slot = self.kept.pop(B, None)
        if slot is not None and not self._fits(slot.cache, prefix, need, specs):
            slot = None
        if slot is None:
            self.current = None  # the replaced slot's memory goes before the new one takes its own
            while len(self.kept) >= self.keep:
                self.kept.pop(next(iter(self.kept)))
            cache = copy.deepcopy(prefix)
            cache.session.set_graphs(None)
            # it serves the jobs of a whole run, whose policies read different key metadata: it keeps all of it
            # (a refill computes from the copied keys what the prefix's prefill did not keep)
            cache.declare_state(specs, KEY_METADATA)
            cache.reserve_static(need + self.margin, any_padding=True)
            slot = _Slot(cache)
            self.slots_made += 1
        self.kept[B] = self.current = slot
        return slot

    def decode(
        self, model, key: Any, prefix: PagedKVCache, need: int, policies: list[Policy], free: list | None = None
    ) -> tuple[PagedKVCache, DecodeGraphs]:
        """The slot of ``prefix``'s batch size refilled with ``prefix`` (a filled, shared prefill) and the captured
        steps of ``model`` as now patched (policy ``key``), ready for ``need`` tokens per sequence (prompt + new
        tokens, padding included). ``policies``: every policy the job decodes statically (the slot keeps the state
        they all declare). ``free``: per sequence, the blocks of ``prefix`` that the policy (one that frees once)
        frees at its first decode step, left out of the refill (``PagedKVCache.load_static``)."""
        kept = self.kept.get(len(prefix.table.rows))
        specs = job_state(patch_state(model).config.policy, policies, kept.cache.specs if kept else ())
        slot = self._slot(prefix, need, specs)
        slot.cache.load_static(prefix, free, whole=self.whole_refills)
        self.loads += 1
        runner = slot.runners.get(key)
        if runner is not None:
            try:
                runner.rebind(model)
            except ValueError:  # the key now names other settings: capture anew
                runner = None
        if runner is None:
            if self.pool is None and torch.cuda.is_available():
                device = slot.cache.static_device  # a CPU cache's runners capture nothing: any device's pool
                self.pool = graph_pool(device if device.type == "cuda" else None)
            runner = DecodeGraphs(model, slot.cache, slot.cache.static.max_length, pool=self.pool)
            slot.runners[key] = runner
        return slot.cache, runner
