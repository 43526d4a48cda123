"""Captured decode steps kept across the batches of one suite job (issue 12's device time).

:func:`evaluation.needle.greedy_batch` with ``static=True`` decodes each policy of a batch through
:class:`~hf_sparse_kv.graphs.DecodeGraphs` on its own copy of the shared prefill: every batch captures every
policy's graphs again (a warm-up forward and a capture per width; on the H200 most of a captured batch's decoding
time, benchmarks/RESULTS.md). A copy per policy kept for the whole job does not fit at 32K (16 policies x 7.5 GB on
Qwen2.5 at 8 x 32K), so :class:`DecodeSlots` keeps one cache, reserved for static decoding, that each policy's
turn refills in place from the batch's shared prefill (``PagedKVCache.load_static``: every tensor keeps its
address), and each policy's ``DecodeGraphs`` on it, rebound to the model patched again for that policy
(``DecodeGraphs.rebind``). A policy's graphs are then captured once per job and width, not once per batch.

A policy that frees blocks once (SnapKV: the prompt's unkept blocks, at its first decode step) decodes on the slot
too: the refill leaves those blocks out (``load_static(free=...)``: holes of the step's table), so that its cache is
what its first step would leave, and its steps, the first included, replay as the others' do.

The slot holds the state every policy of the job declares (their ``cache_state()``, recomputed from the keys at
each refill), is reserved for any left padding (``reserve_static(any_padding=True)``) and for the longest batch
seen plus ``margin`` tokens; a batch of another size, or longer than that, or a policy declaring state the slot
lacks, makes a new slot (the old one and its graphs dropped first: one slot lives at a time). The runners of a slot
capture into one CUDA-graph memory pool (they never replay at the same time).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from hf_sparse_kv import PagedKVCache
from hf_sparse_kv.graphs import DecodeGraphs
from hf_sparse_kv.policies import Policy


class DecodeSlots:
    """One reserved cache and each policy's captured steps on it, kept across batches (see the module docstring).

    Args:
        margin: tokens reserved beyond the first batch's prompt + new tokens, so that later batches of the job
            (prompts a few tokens longer) fit the same reservation.

    Attributes: ``slots_made`` (slots built so far), ``loads`` (refills), ``cache`` (the current slot or ``None``),
    ``runners`` (policy key -> its ``DecodeGraphs`` on the current slot), ``pool`` (on a GPU, the one CUDA-graph
    memory pool they all capture into: the policies decode one after the other, so each needs room for one step's
    temporaries, not a pool of its own: graph pools held 7.75 GiB of a process that ran out of memory at 16 x 32K on
    Qwen2.5 on an H100, 2026-12-05).
    """

    def __init__(self, margin: int = 256):
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        self.margin = margin
        self.cache: PagedKVCache | None = None
        self.runners: dict[Any, DecodeGraphs] = {}
        self.pool = None  # one CUDA-graph memory pool for every runner of the slot (they replay one at a time)
        self.slots_made = 0
        self.loads = 0

    def drop(self) -> None:
        """Let go of the slot and its graphs (their memory is freed with the last reference)."""
        self.runners = {}
        self.cache = None
        self.pool = None

    def _fits(self, prefix: PagedKVCache, need: int, specs: tuple) -> bool:
        slot = self.cache
        return (
            slot is not None
            and len(slot.table.rows) == len(prefix.table.rows)
            and slot.block_size == prefix.block_size
            and need <= slot.static.max_length
            and set(specs) <= set(slot.specs)
        )

    def decode(
        self, model, key: Any, prefix: PagedKVCache, need: int, policies: list[Policy], free: list | None = None
    ) -> tuple[PagedKVCache, DecodeGraphs]:
        """The slot refilled with ``prefix`` (a filled, shared prefill) and the captured steps of ``model`` as now
        patched (policy ``key``), ready for ``need`` tokens per sequence (prompt + new tokens, padding included).
        ``policies``: every policy the job decodes statically (the slot keeps the state they all declare).
        ``free``: per sequence, the blocks of ``prefix`` that the policy (one that frees once) frees at its first
        decode step, left out of the refill (``PagedKVCache.load_static``)."""
        specs = tuple(dict.fromkeys(s for p in policies for s in p.cache_state()))
        if not self._fits(prefix, need, specs):
            self.drop()
            slot = copy.deepcopy(prefix)
            slot.session.set_graphs(None)
            slot.declare_state(specs)
            slot.reserve_static(need + self.margin, any_padding=True)
            self.cache, self.slots_made = slot, self.slots_made + 1
        self.cache.load_static(prefix, free)
        self.loads += 1
        runner = self.runners.get(key)
        if runner is not None:
            try:
                runner.rebind(model)
            except ValueError:  # the key now names other settings: capture anew
                runner = None
        if runner is None:
            if self.pool is None and torch.cuda.is_available():
                self.pool = torch.cuda.graph_pool_handle()
            runner = DecodeGraphs(model, self.cache, self.cache.static.max_length, pool=self.pool)
            self.runners[key] = runner
        return self.cache, runner
