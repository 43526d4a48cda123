"""Selectors on compressed keys: every key is also stored as ``R << D`` calibrated numbers, every token is scored
from them, and only the chosen blocks (or tokens) are read.

The compressed key of ``k`` (KV head ``h`` of layer ``l``) is ``k @ P[l][h]`` with ``P [Hkv, D, R]`` from a
calibration file (:func:`load_calibration`; written by ``hf-sparse-kv calibrate-selector`` or
:func:`hf_sparse_kv.calibrate_selector.calibrate_selector`):

- ``method="channels"``: ``R`` one-hot columns, the channels with the largest ``E[q_d^2] Var(k_d)`` (the
  channels that move the ranking of keys for typical queries): Double Sparsity's label cache
  (Yang et al., https://arxiv.org/abs/2408.07092), offline channel calibration.
- ``method="pairs"``: whole RoPE channel pairs ranked the same way (a pair's 2-D product stays consistent as RoPE
  turns it with the position);
- ``method="pca"``: the top ``R`` principal directions of the keys (Loki, Singhania et al.,
  https://arxiv.org/abs/2406.02542);
- ``method="svd"``: a query-aware pair, keys by ``A``, queries by ``B`` (``calibration["qproj"]``), the rank-``R``
  bilinear form closest to ``q . k`` over the calibration's queries and keys.

The query is projected by the same ``P`` (``(q P) . (k P)`` approximates ``q . k``), or by ``B`` where the
calibration holds query projections. The compressed
keys are a per-token :class:`StateSpec` (``"ckeys"``, ``[NB, Hkv, BS, R]`` in the keys' dtype) that every write
refreshes through ``ops.projected_write`` (a Triton kernel on CUDA: vectorized, sized by the host's span, safe in a
captured step). With ``R = D / 8`` and 16-bit keys the state is 1/16 of the KV bytes and a step reads 1/8 of K's
bytes to score every token.

There is no uncalibrated default: without ``calibration`` the policy raises, naming the command that writes one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .base import DecodeState, StateSpec, Trailing, tensors_digest
from .blocks import _BlockTopK
from .tokens import TokenTopK

STATE_NAME = "ckeys"
METHODS = ("channels", "pairs", "pca", "svd")
MISSING = (
    "{cls} needs calibration=: a file written by `hf-sparse-kv calibrate-selector --model M --out sel.pt` (or the "
    "dict hf_sparse_kv.calibrate_selector.calibrate_selector(model, input_ids) returns). It holds the key "
    "channels / projection of each layer; there is no uncalibrated default."
)


def load_calibration(calibration: str | Path | dict) -> dict[str, Any]:
    """A selector calibration: ``{"method", "rank", "proj": {layer: [Hkv, D, R] float32}, ...}`` from a ``.pt`` file
    or the dict itself (checked)."""
    if isinstance(calibration, (str, Path)):
        calibration = torch.load(calibration, map_location="cpu", weights_only=True)
    if not isinstance(calibration, dict) or "proj" not in calibration or not calibration["proj"]:
        raise ValueError("a selector calibration is a dict with 'proj': {layer index: [Hkv, D, R] tensor}")
    proj = {int(k): v.float() for k, v in calibration["proj"].items()}
    qproj = {int(k): v.float() for k, v in calibration.get("qproj", {}).items()}
    ranks = {p.shape[-1] for p in [*proj.values(), *qproj.values()]}
    if any(p.dim() != 3 for p in [*proj.values(), *qproj.values()]) or len(ranks) != 1:
        raise ValueError("every projection of a selector calibration must be [Hkv, D, R] with one R")
    if qproj and (set(qproj) != set(proj) or any(qproj[i].shape != proj[i].shape for i in proj)):
        raise ValueError("a selector calibration's 'qproj' must match its 'proj' layer by layer")
    return {**calibration, "proj": proj, "qproj": qproj, "rank": ranks.pop()}


class CompressedKeys:
    """What the projected policies share: the calibration, its per-device copies, the state and its refresh.

    One instance per policy; its :class:`StateSpec` is made once, so that every ``cache_state()`` call returns the
    same spec (the cache compares them)."""

    def __init__(self, calibration, owner: str):
        if calibration is None:
            raise ValueError(MISSING.format(cls=owner))
        self.calibration = load_calibration(calibration)
        self.rank = self.calibration["rank"]
        self.on_device: dict = {}  # (layer, device) -> the keys' and the queries' [Hkv, D, R]
        rank = self.rank
        key = ("projected", tensors_digest(self.calibration["proj"]))  # the compressed keys depend on it alone
        self.spec = StateSpec(STATE_NAME, "token", Trailing(None, lead=(rank,)), self.refresh, key=key)

    def projection(self, layer: int | None, device, heads: int, dim: int, queries: bool = False) -> torch.Tensor:
        """``[Hkv, D, R]`` float32 of ``layer`` on ``device``: the keys' projection, or with ``queries`` the queries'
        (the keys' one unless the calibration has its own). Both are copied at the first call (the prefill's
        refresh), so a decode step, static or captured, copies nothing from the host."""
        if layer is None:
            raise ValueError("a projected selector needs the layer index (DecodeState.layer)")
        key = (layer, str(device))
        if key not in self.on_device:
            proj = self.calibration["proj"].get(layer)
            if proj is None:
                raise ValueError(
                    f"the selector calibration has no projection for layer {layer} (it has layers "
                    f"{sorted(self.calibration['proj'])}): calibrate this model with `hf-sparse-kv calibrate-selector`"
                )
            if proj.shape[:2] != (heads, dim):
                raise ValueError(
                    f"the selector calibration of layer {layer} is for {tuple(proj.shape[:2])} (KV heads, head dim), "
                    f"the model has ({heads}, {dim}): calibrate this model with `hf-sparse-kv calibrate-selector`"
                )
            qproj = self.calibration["qproj"].get(layer)  # same shape (load_calibration checks)
            proj = proj.to(device)
            self.on_device[key] = (proj, proj if qproj is None else qproj.to(device))
        return self.on_device[key][1 if queries else 0]

    def refresh(self, state, k_pool, block_table, lo, hi, *, layer, span, ops, states) -> None:
        """The StateSpec refresh: ``ops.projected_write`` of the positions ``[lo, hi)``."""
        proj = self.projection(layer, k_pool.device, k_pool.shape[1], k_pool.shape[3])
        ops.projected_write(state, k_pool, proj, block_table, lo, hi, span)

    def scoring_inputs(self, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(``q [B, Hq, D]``, ``qproj [Hkv, D, R]`` float32, ``ckeys [NB, Hkv, BS, R]``): the queries and their
        projection go to ``ops.projected_scores(q, ..., qproj=qproj)``, which projects them (inside the Triton
        kernel: no launch before it). A state without the cache's compressed keys (a :class:`DecodeState` built
        outside a patched model, e.g. evaluation's simulate way) gets them projected from ``k_pool`` here, in the
        keys' dtype as a write stores them."""
        D = state.q.shape[-1]
        H = state.num_kv_heads
        qproj = self.projection(state.layer, state.q.device, H, D, queries=True)
        ckeys = state.state.get(STATE_NAME)
        if ckeys is None:
            proj = self.projection(state.layer, state.q.device, H, D)
            ckeys = torch.einsum("nhtd,hdr->nhtr", state.k_pool.float(), proj).to(state.k_pool.dtype).contiguous()
        return state.q, qproj, ckeys


@dataclass
class _CompressedKeyScores:
    """What both projected policies add to their base: the ``calibration`` argument, the :class:`CompressedKeys` it
    makes, and their state (a mixin: listed before the policy base, whose ``__post_init__`` runs first)."""

    calibration: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._keys = CompressedKeys(self.calibration, type(self).__name__)

    def cache_state(self) -> tuple[StateSpec, ...]:
        return (self._keys.spec,)

    def key_metadata(self) -> tuple[str, ...]:
        return ()


@dataclass
class ProjectedBlockTopK(_CompressedKeyScores, _BlockTopK):
    """Blocks ranked by the max of their tokens' compressed-key scores (max over the GQA group), top ``budget``.

    Args: ``budget`` (tokens or a fraction), ``sink``, ``window`` (tokens), ``calibration`` (a path or dict from
    ``hf-sparse-kv calibrate-selector``; required). State: ``ckeys [NB, Hkv, BS, R]`` (module docstring).
    """

    def scores(self, state: DecodeState) -> torch.Tensor:
        q, qproj, ckeys = self._keys.scoring_inputs(state)
        return state.ops.projected_scores(
            q, ckeys, state.block_table, state.seq_lens, state.start, "block", self.sink, self.window, qproj=qproj
        )


@dataclass
class ProjectedTokenTopK(_CompressedKeyScores, TokenTopK):
    """Tokens ranked by their compressed-key scores (max over the GQA group), top ``budget``, sink and window kept:
    :class:`TokenTopK` with approximate scores (Double Sparsity's token selection). Args as
    :class:`ProjectedBlockTopK`; runs in ``"token"`` and ``"mask"`` modes."""

    def token_scores(self, state: DecodeState) -> torch.Tensor:
        q, qproj, ckeys = self._keys.scoring_inputs(state)
        return state.ops.projected_scores(
            q, ckeys, state.block_table, state.seq_lens, state.start, "token", self.sink, self.window, qproj=qproj
        )
