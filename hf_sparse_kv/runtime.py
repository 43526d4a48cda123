"""The decode-side runtime of a paged cache: what the attention keeps between layers and between forwards.

A :class:`~hf_sparse_kv.cache.PagedKVCache` is storage. What decoding needs beyond storage lives here, in objects
whose fields only this module's methods write (docs/ARCHITECTURE.md, "The life of a decode step"):

- :class:`DecodeStep`, one per decode forward: its key ``(length, batch, forward)`` and the :class:`StepPlan` of
  each device (lengths and padding starts, planned by the first paged layer on that device, reused by the others);
- :class:`DecodeSession`, one per cache (reset with its contents; the counters go on, as a cache's counters always
  did): the current step, the forward counter, prefill observations waiting for the first decode step, the
  captured-graph runner, the verdict on the current prefill mask and the :class:`Counters`.

Nothing here imports the cache, the patch or a policy class: the session calls the policy's lifecycle methods and
the cache's documented methods, so the import graph stays one-way (ops -> cache, policies -> runtime -> attention).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Counters:
    """What sparse decoding did with a cache: K/V bytes read by decode attention, decode steps, and the layer-steps
    ``mode="auto"`` ran dense or sparse."""

    kv_bytes_read: int = 0
    decode_steps: int = 0
    auto_steps: dict = field(default_factory=lambda: {"dense": 0, "sparse": 0})

    def copy(self) -> Counters:
        return Counters(self.kv_bytes_read, self.decode_steps, dict(self.auto_steps))

    def minus(self, before: Counters) -> Counters:
        """What was counted since ``before``."""
        auto = {k: n - before.auto_steps.get(k, 0) for k, n in self.auto_steps.items()}
        return Counters(self.kv_bytes_read - before.kv_bytes_read, self.decode_steps - before.decode_steps, auto)


@dataclass
class StepPlan:
    """Metadata shared by every paged layer of one decode step on one device (planned once, used per layer)."""

    seq_lens: torch.Tensor  # [B] int32, tokens stored per sequence
    start: torch.Tensor  # [B] int32, first valid stored position (0: padding is never stored)
    lens: tuple[int, ...]  # seq_lens on the host
    evicted: tuple[int, ...] | None  # blocks freed per sequence, on the host (None: none)


@dataclass
class DecodeStep:
    """One decode forward: ``key = (length, batch, forward number)`` and the plan of each device (by name)."""

    key: tuple
    plans: dict = field(default_factory=dict)


@dataclass
class Observation:
    """What a policy observed during the prefill, handed back to it at a decode step.

    Attributes:
        scores: ``[layers, B, Hkv, nblk]`` float32 (layers in index order; shorter rows padded with zeros), the
            observations made since the last decode step; ``None`` when there are none.
        used_before: an earlier decode step of this cache already consumed an observation.
    """

    scores: torch.Tensor | None
    used_before: bool


class DecodeSession:
    """The decoding state of one cache's contents (see the module docstring). Read its fields; change them through
    its methods."""

    def __init__(self):
        self.counters = Counters()
        self.forwards = 0  # model forwards seen by the patch's hook: a decode step's plans live for one forward
        self.step: DecodeStep | None = None
        self.observed: dict[int, torch.Tensor] = {}  # layer -> [B, Hkv, nblk] prefill scores of a policy
        self.observation_used = False
        self.graphs = None  # the captured-graph runner (hf_sparse_kv.graphs); False: this cache cannot use one
        self._mask_verdicts: dict = {}  # tag -> (weak reference to a prefill mask, (its version, pads), verdict)

    def __getstate__(self) -> dict:
        """For pickling: without the captured-graph runner (it holds the model and device graphs; a loaded copy
        captures anew) and the mask verdicts (weak references)."""
        return {**self.__dict__, "graphs": False if self.graphs is False else None, "_mask_verdicts": {}}

    def reset(self) -> None:
        """The cache's contents were reset: forget the step, the observations and the captured steps (they belong
        to one generation); the counters and the forward count go on."""
        self.step = None
        self.observed = {}
        self.observation_used = False
        self.graphs = None

    def reload(self, released: bool = False) -> None:
        """The cache's contents were replaced in place (``PagedKVCache.load_static``): forget the step and the
        observations; the captured steps stay (they read the new contents through the same tensors), and so do the
        counters. ``released``: the new contents are what a policy that frees once holds after its first step (the
        refill left its freed blocks out): its observation counts as handed over."""
        self.step = None
        self.observed = {}
        self.observation_used = released

    # ---- forwards and steps --------------------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """A model forward starts: a decode step in it is planned afresh."""
        self.forwards += 1

    def enter_step(self, length: int, batch: int) -> bool:
        """Make the step of this forward at ``length`` (transformers' padded length) and ``batch`` current; return
        whether it is new (the first paged layer of the step then frees blocks and counts it)."""
        key = (length, batch, self.forwards)
        if self.step is not None and self.step.key == key:
            return False
        self.step = DecodeStep(key)
        self.counters.decode_steps += 1
        return True

    def end_step(self) -> None:
        """Forget the current step's plans: the next paged layer starts a new step."""
        self.step = None

    def plan(self, device) -> StepPlan | None:
        return self.step.plans.get(str(device)) if self.step is not None else None

    def keep_plan(self, device, plan: StepPlan) -> None:
        self.step.plans[str(device)] = plan

    # ---- the prefill ----------------------------------------------------------------------------------------------

    def mask_verdict(
        self, mask: torch.Tensor, pads: list[int], check: Callable[[torch.Tensor, list[int]], bool], tag=None
    ):
        """``check(mask, pads)``, computed once per mask: the layers of one forward share their mask tensor, so the
        first of them checks it and the others reuse the verdict while that tensor lives, unchanged (its version),
        with the same ``pads``. ``tag`` names the check (a layer's sliding window): one verdict is kept per tag, so
        that a model whose full and sliding-window layers alternate (two masks) checks each mask once."""
        memo = self._mask_verdicts.get(tag)
        key = (mask._version, tuple(pads))
        if memo is not None and memo[0]() is mask and memo[1] == key:
            return memo[2]
        verdict = check(mask, pads)
        self._mask_verdicts[tag] = (weakref.ref(mask), key, verdict)
        return verdict

    # ---- the policy's lifecycle ------------------------------------------------------------------------------------

    def observe(self, layer_idx: int, scores: torch.Tensor) -> None:
        """Keep a layer's prefill observation (``[B, Hkv, nblk]``) for the first decode step."""
        self.observed[layer_idx] = scores

    def peek_observation(self) -> torch.Tensor | None:
        """The pending observations as :meth:`take_observation` stacks them (``[layers, B, Hkv, nblk]`` float32 on
        the CPU), left pending; ``None`` when there is none."""
        if not self.observed:
            return None
        scores = [self.observed[i].float().cpu() for i in sorted(self.observed)]
        width = max(s.shape[-1] for s in scores)
        return torch.stack([torch.nn.functional.pad(s, (0, width - s.shape[-1])) for s in scores])

    def take_observation(self) -> Observation:
        """The pending observations as one stacked tensor (moved to the CPU: layers may sit on several devices), and
        whether an earlier step used one; the pending ones are consumed."""
        if not self.observed:
            return Observation(None, self.observation_used)
        stacked = self.peek_observation()
        self.observed = {}
        used, self.observation_used = self.observation_used, True
        return Observation(stacked, used)

    def release(self, policy, cache, lens: tuple[int, ...]) -> None:
        """At the first paged layer of a step: let ``policy`` free what it will never read again at context ``lens``
        (its :meth:`~hf_sparse_kv.policies.Policy.release` decides), then give the memory back if most of the pool
        is free."""
        policy.release(cache, lens, self.take_observation())
        cache.compact_if_mostly_free()

    def select_rows(self, sources: list[int]) -> None:
        """Beam search or batch selection: sequence ``i`` becomes old sequence ``sources[i]``."""
        self.observed = {i: v[torch.as_tensor(sources, device=v.device)] for i, v in self.observed.items()}

    # ---- counters and graphs ---------------------------------------------------------------------------------------

    def count_read(self, nbytes: int) -> None:
        self.counters.kv_bytes_read += nbytes

    def count_auto(self, sparse: bool) -> None:
        self.counters.auto_steps["sparse" if sparse else "dense"] += 1

    def restore_counters(self, counters: Counters) -> None:
        """Set the counters back (a warm-up or capture forward is not a step)."""
        self.counters = counters.copy()

    def add_counters(self, delta: Counters) -> None:
        """Count a replayed step (``delta`` as measured when it was captured)."""
        c = self.counters
        c.kv_bytes_read += delta.kv_bytes_read
        c.decode_steps += delta.decode_steps
        for k, n in delta.auto_steps.items():
            c.auto_steps[k] = c.auto_steps.get(k, 0) + n

    def set_graphs(self, runner) -> None:
        """The captured-graph runner of this cache, or ``False`` when it cannot use one."""
        self.graphs = runner
