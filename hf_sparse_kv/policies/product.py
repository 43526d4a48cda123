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

Or the centres come from the prompt itself: ``calibration="prefill"`` (8-channel pieces, 256 centres) or
``{"method": "pq", "fit": "prefill", "sub_dim": d, "centroids": C}`` fits each layer's centres at the write that
starts its cache (a write at position 0 of every sequence: the prefill, a reset cache's next one, a filled cache's
state adopted, caches stacked into a batch), on the keys stored then (at most :data:`PREFILL_SAMPLE` of them, drawn
seeded; fewer keys than centres are repeated, and k-means then leaves nearly every key a centre of its own), and
codes them with these; later writes (decode tokens, further chunks) code with the same centres. The centres are the
cache's, not the policy's: a per-layer :class:`StateSpec` (``"pqcentres"``, ``[Hkv, m, C, d]`` float32, ``"layer"``
scope), fitted in place (captured decode steps read the new ones) and copied by a refill, so a conversation
continued from its cache after other prompts went through the same patched model codes with its own prompt's
centres. The fit reads the write's lengths on the host, so that write cannot run inside a compiled graph or a
CUDA-graph capture (it raises there; decode steps are unaffected). Where a state carries no codes (evaluation's
simulate way) the centres are fitted on the state's stored keys at every call.

The scoring table holds each ``scale * q_piece . centre`` term in bfloat16 (summed in float32), unless a calibration
dict names ``"table": "float32"`` (e.g. ``{"method": "pq", "fit": "prefill", "table": "float32"}``). Measured on the
H200 (evaluation/RESULTS.md, 2026-12-04): on SmolLM2 4K / 8K, Gemma-3 32K and Qwen2.5 32K at 1/16 the bfloat16 table
changed none of 1000 needle outcomes and moved perplexity by -0.02 to +0.18 % (every interval across 0) against
the float32 table, and took 30-34 % off the scoring kernel (benchmarks/RESULTS.md).

``pq_block_scores`` has a Triton kernel (a table of ``q_piece . centre`` gathered by the codes: ``ops/triton/
product.py``; tested against the reference, built for sm_90, timed on the H200: benchmarks/RESULTS.md); so has
``pq_encode``, the nearest-centre assignment each k-means round of a prefill fit runs (its distances stay in
registers), and ``pq_write``, which computes the same codes for the written positions and stores them in place.
There is no uncalibrated default: without ``calibration`` the policy raises, naming the command that writes one and
``"prefill"``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..ops.reference import pq_encode, pq_table_dtype
from .base import DecodeState, StateSpec, Trailing, tensors_digest

STATE_NAME = "pqcodes"
CENTRES_NAME = "pqcentres"  # a prefill fit's centres, kept by the cache per layer
METHOD = "pq"
PREFILL = "prefill"
PREFILL_SAMPLE = 16384  # keys a prefill fit draws at most per layer
TABLE = "bfloat16"  # the scoring table's dtype unless a calibration dict names another ("table")
MISSING = (
    "{cls} with coarse='pq' needs calibration=: a file written by `hf-sparse-kv calibrate-selector --method pq "
    "--model M --out pq.pt` (or the dict hf_sparse_kv.calibrate_selector.calibrate_selector(model, input_ids, "
    "method='pq') returns), over text as long as the contexts it will serve, or calibration='prefill' (centres "
    "fitted on each prompt's keys at its prefill). There is no uncalibrated default."
)


def fit_centres(
    keys: torch.Tensor, sub_dim: int, centroids: int, iters: int = 8, seed: int = 0, encode: Callable | None = None
) -> torch.Tensor:
    """k-means of ``keys [Hkv, N, D]``'s pieces of ``sub_dim`` channels, per KV head and piece: ``[Hkv, D / sub_dim,
    centroids, sub_dim]`` float32. Seeded: the first centres are ``centroids`` of the keys drawn at random; ``iters``
    rounds of nearest-centre assignment and means (a centre without keys stays). The assignment is ``encode`` (a
    backend's ``pq_encode``; default the reference's, which holds ``[chunk, Hkv, m, C]`` distances at a time). The
    means are summed in 64-bit fixed point, so a fit is the same run after run on any device (float sums by
    ``scatter_add_`` on CUDA differed by up to 2.3e-7 relative from run to run on the H200: its atomics add in any
    order)."""
    Hkv, N, D = keys.shape
    if sub_dim < 1 or D % sub_dim:
        raise ValueError(f"sub_dim must divide the head dim {D}, got {sub_dim}")
    if not 2 <= centroids <= 256:
        raise ValueError(f"centroids must lie in [2, 256] (one-byte codes), got {centroids}")
    if N < centroids:
        raise ValueError(f"fitting {centroids} centres needs at least as many keys, got {N}: calibrate on more tokens")
    encode = encode or pq_encode
    m = D // sub_dim
    x = keys.float()
    pieces = x.view(Hkv, N, m, sub_dim).transpose(1, 2)  # [Hkv, m, N, d]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    centres = pieces[:, :, torch.randperm(N, generator=gen)[:centroids].to(x.device)].contiguous()  # [Hkv, m, C, d]
    tokens = x.transpose(0, 1)  # [N, Hkv, D]: the layout pq_encode codes
    # the means' sums in 64-bit fixed point: the pieces scaled by a power of two that keeps any sum of N of them
    # below 2^62 (exact in float32, rounded below 2^-shift), added as integers, which give the same total in any
    # order: a fit is bit for bit the same on every run, where scatter_add_ of floats on CUDA adds with atomics
    top = float(x.abs().amax())  # a host read: a fit runs eagerly (ProductCodes.fit)
    if not math.isfinite(top):
        raise ValueError("the keys to fit product-quantization centres on hold NaN or inf")
    shift = min(100, math.floor(62 - math.log2(N)) - (math.ceil(math.log2(top)) if top > 0 else 0))
    fixed = (pieces * 2.0**shift).round().long()  # [Hkv, m, N, d]
    ones = torch.ones(1, 1, 1, dtype=torch.long, device=x.device).expand(Hkv, m, N)
    for _ in range(iters):
        assign = encode(tokens, centres).long().permute(1, 2, 0)  # [Hkv, m, N]
        count = torch.zeros(Hkv, m, centroids, dtype=torch.long, device=x.device).scatter_add_(2, assign, ones)
        total = torch.zeros(Hkv, m, centroids, sub_dim, dtype=torch.long, device=x.device)
        total.scatter_add_(2, assign.unsqueeze(-1).expand(-1, -1, -1, sub_dim), fixed)
        mean = (total.double() * 2.0**-shift / count.clamp(min=1).unsqueeze(-1)).float()
        centres = torch.where(count.unsqueeze(-1) > 0, mean, centres)
    return centres.contiguous()


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


def prefill_fit(calibration) -> tuple[int, int] | None:
    """``(sub_dim, centroids)`` when ``calibration`` asks for centres fitted at the prefill (``"prefill"``: 8, 256;
    or ``{"method": "pq", "fit": "prefill", "sub_dim": d, "centroids": C}``), else ``None`` (checked)."""
    if isinstance(calibration, str) and calibration == PREFILL:
        return 8, 256
    if isinstance(calibration, dict) and calibration.get("fit") == PREFILL:
        if calibration.get("method") != METHOD:
            raise ValueError(
                "a prefill-fitted calibration is {'method': 'pq', 'fit': 'prefill', 'sub_dim', 'centroids'}"
            )
        d, C = int(calibration.get("sub_dim", 8)), int(calibration.get("centroids", 256))
        if d < 1 or not 2 <= C <= 256:
            raise ValueError(f"sub_dim must be >= 1 and centroids in [2, 256] (one-byte codes), got {d}, {C}")
        return d, C
    return None


def table_dtype(calibration) -> str:
    """The dtype of the scoring table (``ops.pq_block_scores``' ``table_dtype``) a calibration asks for: its dict's
    ``"table"``, ``"bfloat16"`` (the default) or ``"float32"`` (checked); a file or ``"prefill"``: the default."""
    name = calibration.get("table", TABLE) if isinstance(calibration, dict) else TABLE
    pq_table_dtype(name)  # raises for another name
    return name


def _eager_only(t: torch.Tensor) -> None:
    """Raise where a host read of ``t`` cannot run: inside a compiled graph or a CUDA-graph capture."""
    if torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing()):
        raise RuntimeError(
            "calibration='prefill' fits the centres at the write that starts a cache, which reads the write's "
            "lengths on the host: prefill eagerly (compile or capture the decode steps only)"
        )


def prefill_draw(n: int, seed: int) -> torch.Tensor | None:
    """Which of ``n`` stored keys a prefill fit keeps: ``[PREFILL_SAMPLE]`` int64 indices drawn without replacement
    (seeded by ``seed``, the layer's index), or ``None`` when ``n <= PREFILL_SAMPLE`` (all of them)."""
    if n <= PREFILL_SAMPLE:
        return None
    return torch.randperm(n, generator=torch.Generator(device="cpu").manual_seed(seed))[:PREFILL_SAMPLE]


def stored_keys(
    k_pool: torch.Tensor, block_table: torch.Tensor, hi: torch.Tensor, draw_seed: int | None = None
) -> torch.Tensor:
    """The keys the table's sequences hold at positions ``[0, hi[b])``, each stored slot once: ``[Hkv, N, D]``
    (``k_pool [NB, Hkv, BS, D]``, ``block_table [B, MB]`` (-1: no block), ``hi [B]``), in logical order: sequence by
    sequence, position by position, whatever physical blocks hold them (so a fit on them does not depend on the
    block numbering: a reset cache's recycled blocks, a stacked batch's, a refilled reservation's). A block several
    rows share (evaluation's simulate way, beams) counts once, where its first row holds it, up to the longest of their
    lengths in it. With ``draw_seed``, only the keys :func:`prefill_draw` keeps of them (the same keys, in the same
    order, as drawing from all ``N``), gathered alone: a long prompt's fit never copies all its keys. Reads ``hi`` and
    the slots on the host, so not inside a compiled graph or a CUDA-graph capture."""
    _eager_only(hi)
    NB, _, BS, _ = k_pool.shape
    n = int(hi.max()) if hi.numel() else 0
    nblk = min(-(-n // BS), block_table.shape[1])
    dev = k_pool.device
    blocks = block_table[:, :nblk].long().to(dev)  # [B, nblk]
    start = torch.arange(nblk, device=dev).view(1, -1) * BS
    filled = (hi.to(dev).view(-1, 1) - start).clamp(0, BS)  # [B, nblk] slots each row reads
    filled = torch.where(blocks >= 0, filled, 0)
    count = torch.zeros(NB + 1, dtype=filled.dtype, device=dev)
    count.scatter_reduce_(0, torch.where(blocks >= 0, blocks, NB).flatten(), filled.flatten(), "amax")
    # each held block once, at its first (row, logical block) entry, with the most slots any row reads of it
    entry = torch.arange(blocks.numel(), device=dev)
    first = torch.full((NB + 1,), blocks.numel(), dtype=torch.long, device=dev)
    first.scatter_reduce_(0, torch.where(blocks >= 0, blocks, NB).flatten(), entry, "amin")
    held = (blocks.flatten() >= 0) & (first[blocks.flatten().clamp(min=0)] == entry)  # [B * nblk]
    order = blocks.flatten()[held]  # physical blocks in logical order
    ok = torch.arange(BS, device=dev).view(1, BS) < count[order].view(-1, 1)  # [n_held, BS]
    slots = (order.view(-1, 1) * BS + torch.arange(BS, device=dev).view(1, BS))[ok]  # [N] block * BS + slot
    drawn = prefill_draw(slots.numel(), draw_seed) if draw_seed is not None else None
    if drawn is not None:
        slots = slots[drawn.to(slots.device)]
    return k_pool[slots // BS, :, slots % BS].transpose(0, 1).contiguous()  # [N, Hkv, D] -> [Hkv, N, D]


class ProductCodes:
    """What the product-quantized coarse pass keeps: the calibration (or the prefill fit's sizes), a calibration's
    per-device centres, the codes' state and its refresh; with a prefill fit, the centres' state too (per layer of
    each cache: a cache's codes are made with its own prefill's centres, whatever other prompts the policy
    prefilled since). One instance per policy; its :class:`StateSpec` objects are made once (the cache compares
    them)."""

    def __init__(self, calibration, owner: str):
        if calibration is None:
            raise ValueError(MISSING.format(cls=owner))
        self.fit_sizes = prefill_fit(calibration)
        self.calibration = None if self.fit_sizes else load_calibration(calibration)
        self.table_dtype = table_dtype(self.calibration or calibration)
        if self.fit_sizes:
            self.sub_dim = self.fit_sizes[0]
        else:
            self.sub_dim = next(iter(self.calibration["centres"].values())).shape[3]
        self.on_device: dict = {}  # (layer, device) -> a calibration's [Hkv, m, C, d]
        d = self.sub_dim
        # codes made with a prefill fit of given sizes are the same whichever policy made them; a calibration's are its
        # centres' (the same file loaded twice: equal)
        key = ("prefill", *self.fit_sizes) if self.fit_sizes else ("pq", tensors_digest(self.calibration["centres"]))
        codes = StateSpec(STATE_NAME, "token", Trailing(1, d), self.refresh, dtype=torch.uint8, key=key)  # [D // d]
        if self.fit_sizes:
            C = self.fit_sizes[1]
            fitted = StateSpec(
                CENTRES_NAME, "layer", Trailing(1, d, tail=(C, d)), self.refit, dtype=torch.float32, key=key
            )
            self.specs: tuple[StateSpec, ...] = (fitted, codes)  # the centres first: the codes' refresh reads them
        else:
            self.specs = (codes,)

    @staticmethod
    def _key(layer: int | None, device) -> tuple[int, str]:
        """The key of ``layer``'s centres on ``device`` in :attr:`on_device` (a layer index is needed)."""
        if layer is None:
            raise ValueError("a product-quantized coarse pass needs the layer index (DecodeState.layer)")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" names the current device: one key for both
            device = torch.device("cuda", torch.cuda.current_device())
        return layer, str(device)

    def fit(self, layer: int, keys: torch.Tensor, encode: Callable | None = None) -> torch.Tensor:
        """``[Hkv, m, C, d]`` float32 centres of ``layer`` fitted on ``keys [Hkv, N, D]`` (the prefill's; at most
        :data:`PREFILL_SAMPLE` drawn, seeded by the layer; fewer than the centres repeated), on the keys' device;
        ``encode``: the nearest-centre assignment (a backend's ``pq_encode``, :func:`fit_centres`)."""
        d, C = self.fit_sizes
        _, N, D = keys.shape
        if D % d:
            raise ValueError(
                f"calibration='prefill' with {d}-channel pieces needs a head dim divisible by {d}, got {D}"
            )
        if N == 0:
            raise ValueError(f"no stored keys to fit layer {layer}'s product-quantization centres on")
        drawn = prefill_draw(N, layer)
        if drawn is not None:
            keys = keys[:, drawn.to(keys.device)]
        elif N < C:
            keys = keys.repeat(1, -(-C // N), 1)
        return fit_centres(keys, d, C, encode=encode)

    def centres(self, layer: int | None, device, heads: int, dim: int) -> torch.Tensor:
        """``[Hkv, m, C, d]`` float32 of the calibration's ``layer`` on ``device``, copied at the first call (the
        prefill's refresh), so that a decode step, static or captured, copies nothing from the host. A prefill fit
        has none: each cache keeps its own (its ``"pqcentres"`` state)."""
        if self.fit_sizes:
            raise ValueError(
                "calibration='prefill' keeps the centres each cache's prefill fitted in that cache (its "
                f"{CENTRES_NAME!r} state), not in the policy: read them from the cache's layers"
            )
        key = self._key(layer, device)
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
                    f"the pq calibration of layer {layer} is for {c.shape[0]} KV heads of dim "
                    f"{c.shape[1] * c.shape[3]}, "
                    f"the model has {heads} of dim {dim}: calibrate this model with `hf-sparse-kv calibrate-selector "
                    "--method pq`"
                )
            self.on_device[key] = c.to(device)
        return self.on_device[key]

    def refit(self, state, k_pool, block_table, lo, hi, *, layer, span, ops, states) -> None:
        """The centres' StateSpec refresh (layer scope: at a write that starts every sequence): ``state [Hkv, m, C,
        d]`` fitted in place on the keys stored at positions ``[0, hi)`` (a host read of ``hi``: eager only)."""
        state.copy_(self.fit(layer, stored_keys(k_pool, block_table, hi, draw_seed=layer), ops.pq_encode))

    def refresh(self, state, k_pool, block_table, lo, hi, *, layer, span, ops, states) -> None:
        """The codes' StateSpec refresh: ``ops.pq_write`` of the positions ``[lo, hi)`` with the calibration's
        centres, or with a prefill fit the layer's fitted ones (``states``)."""
        if self.fit_sizes:
            centres = states[CENTRES_NAME]
        else:
            centres = self.centres(layer, k_pool.device, k_pool.shape[1], k_pool.shape[3])
        ops.pq_write(state, k_pool, centres, block_table, lo, hi, span)

    def scores(self, state: DecodeState, sink: int, window: int) -> torch.Tensor:
        """``[B, Hkv, nblk]`` each block's mass under the coded keys (summed over the GQA group), forced blocks in
        use ``+inf``, blocks not in use ``-inf``. A state without the cache's codes (a :class:`DecodeState` built
        outside a patched model, e.g. evaluation's simulate way) gets them coded from ``k_pool`` here."""
        k_pool = state.k_pool
        codes = state.state.get(STATE_NAME)
        if not self.fit_sizes:
            centres = self.centres(state.layer, k_pool.device, k_pool.shape[1], k_pool.shape[3])
        elif codes is None:  # no cache behind the state: fitted on its stored keys, these codes made with them
            keys = stored_keys(k_pool, state.block_table, state.seq_lens, draw_seed=state.layer)
            centres = self.fit(state.layer, keys, state.ops.pq_encode)
        else:
            centres = state.state.get(CENTRES_NAME)
            if centres is None:
                raise ValueError(
                    f"this state holds product-quantization codes but not the centres they were made with "
                    f"({CENTRES_NAME!r}): calibration='prefill' keeps both in the cache; prefill it through the "
                    "patched model"
                )
        if codes is None:
            codes = state.ops.pq_encode(k_pool.transpose(1, 2), centres).transpose(1, 2).contiguous()
        return state.ops.pq_block_scores(
            state.q,
            codes,
            centres,
            state.block_table,
            state.seq_lens,
            state.start,
            state.scale,
            sink,
            window,
            self.table_dtype,
        )
