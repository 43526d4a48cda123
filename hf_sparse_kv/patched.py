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


def patch_state(model: torch.nn.Module) -> PatchState | None:
    """The patch state of ``model`` (``None`` if it is not patched)."""
    return getattr(model, STATE_ATTR, None)


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name under which ``model.forward``/``generate`` take a cache: ``"cache"`` in recent transformers 5.x,
    ``"past_key_values"`` before (e.g. 5.17). ``model(ids, **{cache_kwarg(model): cache})`` works on both."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
