"""Product-quantized keys as a two-stage selector's coarse pass (``coarse="pq"`` of
:class:`~.two_stage.TwoStageBlockTopK` and :class:`~.top_p.TopPBlockTopK`).

Every key is also stored as ``m = D / d`` one-byte codes: its channels cut into pieces of ``d``, each piece the
index of the nearest of ``C <= 256`` centres (product quantization, as PQCache uses for retrieval: Zhang et al.,
https://arxiv.org/abs/2407.12820). With ``d = 8`` the codes weigh 1/16 of a 16-bit key (1/32 of the KV bytes).
The coarse score of a block is its softmax mass under the keys the codes stand for, summed over the GQA group (the
oracle's criterion, as :class:`~.quant.QuantBlockTopK` ranks by; ``ops.pq_block_scores``); the two-stage policy
keeps ``candidates x`` the budget's blocks by it and its exact pass picks the budget.

The centres are a calibration (:func:`load_calibration`; ``hf-sparse-kv calibrate-selector --method pq`` or
:func:`hf_sparse_kv.calibrate_selector.calibrate_selector` with ``method="pq"``): per layer and KV head a k-means
(:func:`fit_centres`) over post-RoPE keys of some text. RoPE turns each channel pair by an angle that grows with
the position, so the calibration's keys must span the positions the model will decode at: measured on SmolLM2
(evaluation/RESULTS.md, 2026-12-04), centres fitted on another text at the same positions rank blocks within
~0.01 of hit rate of centres fitted on the keys themselves, while centres fitted on the first half of the positions
lose 0.07 on the second half. The codes are a per-token :class:`StateSpec` (``"pqcodes"``, ``[NB, Hkv, BS, m]``
uint8) that every write refreshes through ``ops.pq_write`` (a key's code depends on that key alone).

``pq_block_scores`` has a Triton kernel (a table of ``q_piece . centre`` gathered by the codes: ``ops/triton/
product.py``; tested against the reference under the interpreter, built for sm_90, not yet run or timed on a GPU);
``pq_write`` runs its reference (``ops.REFERENCE_ONLY``: vectorized PyTorch, no host sync). There is no uncalibrated
default: without ``calibration`` the policy raises, naming the command that writes one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..ops.reference import pq_encode
from .base import DecodeState, StateSpec

STATE_NAME = "pqcodes"
METHOD = "pq"
MISSING = (
    "{cls} with coarse='pq' needs calibration=: a file written by `hf-sparse-kv calibrate-selector --method pq "
    "--model M --out pq.pt` (or the dict hf_sparse_kv.calibrate_selector.calibrate_selector(model, input_ids, "
    "method='pq') returns), over text as long as the contexts it will serve. It holds each layer's key centres; "
    "there is no uncalibrated default."
)


def fit_centres(keys: torch.Tensor, sub_dim: int, centroids: int, iters: int = 8, seed: int = 0) -> torch.Tensor:
    """k-means of ``keys [Hkv, N, D]``'s pieces of ``sub_dim`` channels, per KV head and piece: ``[Hkv, D / sub_dim,
    centroids, sub_dim]`` float32. Seeded: the first centres are ``centroids`` of the keys drawn at random; ``iters``
    rounds of nearest-centre assignment and means (a centre without keys stays)."""
    Hkv, N, D = keys.shape
    if sub_dim < 1 or D % sub_dim:
        raise ValueError(f"sub_dim must divide the head dim {D}, got {sub_dim}")
    if not 2 <= centroids <= 256:
        raise ValueError(f"centroids must lie in [2, 256] (one-byte codes), got {centroids}")
    if N < centroids:
        raise ValueError(f"fitting {centroids} centres needs at least as many keys, got {N}: calibrate on more tokens")
    m = D // sub_dim
    x = keys.float().reshape(Hkv, N, m, sub_dim).transpose(1, 2).reshape(Hkv * m, N, sub_dim)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    centres = x[:, torch.randperm(N, generator=gen)[:centroids].to(x.device)].clone()  # [Hkv * m, C, d]
    for _ in range(iters):
        dist = centres.pow(2).sum(-1).unsqueeze(1) - 2 * x @ centres.transpose(1, 2)  # [Hkv * m, N, C]
        assign = dist.argmin(-1)
        count = torch.zeros(x.shape[0], centroids, device=x.device).scatter_add_(1, assign, torch.ones_like(x[..., 0]))
        total = torch.zeros_like(centres).scatter_add_(1, assign.unsqueeze(-1).expand(-1, -1, sub_dim), x)
        centres = torch.where(count.unsqueeze(-1) > 0, total / count.clamp(min=1).unsqueeze(-1), centres)
    return centres.view(Hkv, m, centroids, sub_dim).contiguous()


def load_calibration(calibration: str | Path | dict) -> dict[str, Any]:
    """A product-quantization calibration: ``{"method": "pq", "centres": {layer: [Hkv, m, C, d] float32}, ...}`` from
    a ``.pt`` file or the dict itself (checked: one piece size and one count of centres for every layer)."""
    if isinstance(calibration, (str, Path)):
        calibration = torch.load(calibration, map_location="cpu", weights_only=True)
    if not isinstance(calibration, dict) or calibration.get("method") != METHOD or not calibration.get("centres"):
        raise ValueError(
            "a product-quantization calibration is a dict with method 'pq' and 'centres': {layer index: "
            "[Hkv, m, C, d] tensor} (`hf-sparse-kv calibrate-selector --method pq`)"
        )
    centres = {int(k): v.float() for k, v in calibration["centres"].items()}
    if any(c.dim() != 4 for c in centres.values()) or len({c.shape[2:] for c in centres.values()}) != 1:
        raise ValueError("every layer's centres must be [Hkv, m, C, d] with one C and one d")
    if next(iter(centres.values())).shape[2] > 256:
        raise ValueError("one-byte codes hold at most 256 centres a piece")
    return {**calibration, "centres": centres}


class ProductCodes:
    """What the product-quantized coarse pass keeps: the calibration, its per-device copies, the codes' state and
    its refresh. One instance per policy; its :class:`StateSpec` is made once (the cache compares them)."""

    def __init__(self, calibration, owner: str):
        if calibration is None:
            raise ValueError(MISSING.format(cls=owner))
        self.calibration = load_calibration(calibration)
        self.sub_dim = next(iter(self.calibration["centres"].values())).shape[3]
        self.on_device: dict = {}  # (layer, device) -> [Hkv, m, C, d]
        d = self.sub_dim
        self.spec = StateSpec(STATE_NAME, "token", lambda D: (D // d,), self.refresh, dtype=torch.uint8)

    def centres(self, layer: int | None, device, heads: int, dim: int) -> torch.Tensor:
        """``[Hkv, m, C, d]`` float32 of ``layer`` on ``device``, copied at the first call (the prefill's refresh), so
        that a decode step, static or captured, copies nothing from the host."""
        if layer is None:
            raise ValueError("a product-quantized coarse pass needs the layer index (DecodeState.layer)")
        key = (layer, str(device))
        if key not in self.on_device:
            c = self.calibration["centres"].get(layer)
            if c is None:
                raise ValueError(
                    f"the pq calibration has no centres for layer {layer} (it has layers "
                    f"{sorted(self.calibration['centres'])}): calibrate this model with `hf-sparse-kv "
                    "calibrate-selector --method pq`"
                )
            if c.shape[0] != heads or c.shape[1] * c.shape[3] != dim:
                raise ValueError(
                    f"the pq calibration of layer {layer} is for {c.shape[0]} KV heads of dim {c.shape[1] * c.shape[3]}, "
                    f"the model has {heads} of dim {dim}: calibrate this model with `hf-sparse-kv calibrate-selector "
                    "--method pq`"
                )
            self.on_device[key] = c.to(device)
        return self.on_device[key]

    def refresh(self, state, k_pool, block_table, lo, hi, *, layer, span, ops) -> None:
        """The StateSpec refresh: ``ops.pq_write`` of the positions ``[lo, hi)``."""
        centres = self.centres(layer, k_pool.device, k_pool.shape[1], k_pool.shape[3])
        ops.pq_write(state, k_pool, centres, block_table, lo, hi, span)

    def scores(self, state: DecodeState, sink: int, window: int) -> torch.Tensor:
        """``[B, Hkv, nblk]`` each block's mass under the coded keys (summed over the GQA group), forced blocks in
        use ``+inf``, blocks not in use ``-inf``. A state without the cache's codes (a :class:`DecodeState` built
        outside a patched model, e.g. evaluation's simulate way) gets them coded from ``k_pool`` here."""
        k_pool = state.k_pool
        centres = self.centres(state.layer, k_pool.device, k_pool.shape[1], k_pool.shape[3])
        codes = state.state.get(STATE_NAME)
        if codes is None:
            codes = pq_encode(k_pool.transpose(1, 2), centres).transpose(1, 2).contiguous()
        return state.ops.pq_block_scores(
            state.q, codes, centres, state.block_table, state.seq_lens, state.start, state.scale, sink, window
        )
