"""What a patched model carries, readable without importing the patch: its patch state and its cache keyword.

:func:`hf_sparse_kv.patch.patch_model` stores a :class:`PatchState` on the model under :data:`STATE_ATTR`; the
captured-graph decoder (:mod:`hf_sparse_kv.graphs`) reads it through :func:`patch_state`. Keeping these here lets
``patch`` import ``graphs`` and ``graphs`` read a patched model with no import circle.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

STATE_ATTR = "_hf_sparse_kv"


@dataclass
class PatchState:
    """What unpatching needs, and what the decode side reads: the model's :class:`SparseConfig`, the hooks to
    remove and the merged projections to unmerge."""

    config: object  # hf_sparse_kv.attention.SparseConfig
    handles: list
    merged: list = field(default_factory=list)  # hf_sparse_kv.merge.MergedGroup, merge_projections=True
    # the methods the instance itself held before the first patch (``forward``, ``_prepare_cache_for_generation``:
    # e.g. accelerate's hook wrapper, or a user's compiled forward): the patch calls them, unpatching restores them
    instance: dict = field(default_factory=dict)


def patch_state(model: torch.nn.Module) -> PatchState | None:
    """The patch state of ``model`` (``None`` if it is not patched)."""
    return getattr(model, STATE_ATTR, None)


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name under which ``model.forward``/``generate`` take a cache: ``"cache"`` in recent transformers 5.x,
    ``"past_key_values"`` before (e.g. 5.17). ``model(ids, **{cache_kwarg(model): cache})`` works on both.

    Read from the parameter names of the function ``forward`` wraps (its code object), as ``inspect.signature``
    would report them: every decode step asks, and building a ``Signature`` was the largest item of a captured
    step's host part in a cProfile on the H200 (96-109 µs a step under the profiler, of a host part of 130-200 µs
    unprofiled; benchmarks/probe_host_step.py, benchmarks/RESULTS.md)."""
    return "cache" if "cache" in forward_parameters(type(model).forward) else "past_key_values"


def forward_parameters(fn) -> frozenset[str]:
    """The names of ``fn``'s parameters, those ``inspect.signature(fn)`` lists, for a plain function or one wrapped
    by ``functools.wraps`` decorators (followed to the innermost, unless one declares a ``__signature__``); anything
    else goes through ``inspect.signature``."""
    inner = inspect.unwrap(fn, stop=lambda f: hasattr(f, "__signature__"))
    if hasattr(inner, "__signature__") or not inspect.isfunction(inner):
        return frozenset(inspect.signature(fn).parameters)
    code = inner.__code__
    flags = code.co_flags
    star = int(bool(flags & inspect.CO_VARARGS)) + int(bool(flags & inspect.CO_VARKEYWORDS))  # *args, **kwargs
    return frozenset(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount + star])
