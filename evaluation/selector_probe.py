"""Issue 13, a fast screen: how well a selector's approximate keys keep the oracle's blocks (hit rate, attention
recall), measured on captured queries and keys, without scoring perplexity.

The ``simulate`` way (:mod:`evaluation.simulate`) rebuilds each scored step's paged state and calls the policy on it;
a reference selector that dequantizes every key then does so once per scored query (on 2 CPU cores ~150 s per
window and cell at SmolLM2 4K). Here one dense forward of a window records, on every sparse layer, the post-RoPE
queries of the last ``scored`` positions and every key (:func:`capture`); a *key variant* maps all keys to what a
selector would see (:data:`VARIANTS`: the library's min / max grids, the 1-bit two-level code below, bit planes,
product quantization, codes of each key on its own, a share of each key's rotary pairs) once per layer, and every
scored query ranks blocks by its GQA group's softmax mass under those keys
(:func:`fidelity`), with the oracle's budget, forced blocks and counts (``OracleBlockTopK.plan`` at each query's
length, ``forced_block_mask``) and the ``simulate`` way's hit rate and recall. Two-stage variants keep ``c x`` the
count on a coarse variant's ranking, then the fine variant picks among them (:class:`Progressive`).

One approximation: a variant's per-group statistics are taken over the group's keys in the window, so the group
holding a query's own position sees up to ``group - 1`` later keys. That group lies inside the query's forced window
(sink 4, window >= group: the blocks a query must read anyway), so rankings of the other blocks are untouched; only
the softmax normalisation (how the GQA group's heads are weighted) moves slightly. Figures from here screen
variants; a decision still needs the suite's perplexity and retrieval.

    python -m evaluation.selector_probe --model smollm2 --length 4096 --windows 16 --scored 128 \\
        --variants quant4 pg2_g32_fp8_c4 lloyd1_g32_fp8 --out evaluation/results/selector_probe_cpu/smollm2_4k.csv

The 1-bit two-level code (``lloyd1``): each channel of a group of ``group`` tokens is split at its mean, and a key's
channel is read back as the mean of the keys on its side (the best two levels for that split); stored: 1 bit a
channel and the two levels (``meta``) a channel a group, ``1/16 + meta_bytes / group`` of K's bytes, as a 1-bit
min / max grid. ``lloyd2`` splits each side again at its own mean (4 levels, ``2/16 + 2 meta_bytes / group``).
"""

from __future__ import annotations

import argparse
import csv
import math
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_sparse_kv.ops.layout import cdiv, forced_block_mask
from hf_sparse_kv.ops.reference import fp8_code, fp8_decode
from hf_sparse_kv.policies import OracleBlockTopK

from .compact_grid import METAS, dequantized_pool, group_grid, stored
from .simulate import attention_routed, full_attention_layers

ATTENTION_NAME = "hf_sparse_kv_selector_probe"
CAPTURE_KWARG = "hf_sparse_kv_selector_probe_capture"


# ------------------------------------------------------------------------------------------------- key variants


@dataclass(frozen=True)
class MinMax:
    """``bits``-bit codes on a per-``group`` min / max grid stored as ``meta`` (:mod:`evaluation.compact_grid`;
    ``bits=4, group=16, meta="bf16"`` is ``QuantBlockTopK(bits=4)``'s grid), only the top ``known`` bits read."""

    bits: int
    group: int
    meta: str
    known: int | None = None

    def __call__(self, k: torch.Tensor, block_size: int) -> torch.Tensor:
        """``k [T, Hkv, D]`` -> the keys as the codes hold them, ``[T, Hkv, D]`` float32."""
        T, H, D = k.shape
        pool = _padded(k, block_size).transpose(1, 2)  # [NB, Hkv, BS, D]
        nb = pool.shape[0]
        table = torch.arange(nb, dtype=torch.int32, device=k.device).view(1, nb)
        lens = torch.tensor([T], dtype=torch.int32, device=k.device)
        lo, hi = group_grid(pool, table, lens, torch.zeros_like(lens), self.group)
        out = dequantized_pool(pool, table, stored(lo, self.meta), stored(hi, self.meta), self.bits, self.known)
        return out.transpose(1, 2).reshape(nb * block_size, H, D)[:T]

    def fraction(self) -> Fraction:
        """Bytes read per key, as a fraction of a 16-bit key's."""
        return Fraction(self.known or self.bits, 16) + Fraction(METAS[self.meta], self.group)


@dataclass(frozen=True)
class TwoLevel:
    """``bits`` (1 or 2) levels-per-split codes: each channel of a ``group`` of tokens split at its mean, read back
    as the mean of its side (``bits=2``: each side split again at its own mean, read back as its quarter's mean);
    levels stored as ``meta``; ``known=1`` of 2 bits: only the first split read (its two half means)."""

    bits: int
    group: int
    meta: str
    known: int | None = None

    def __call__(self, k: torch.Tensor, block_size: int) -> torch.Tensor:
        """``k [T, Hkv, D]`` -> ``[T, Hkv, D]`` float32 (the last group may be partial)."""
        T, H, D = k.shape
        x = _padded(k, self.group)  # [n, g, Hkv, D]
        n, g = x.shape[:2]
        valid = (torch.arange(n * g, device=k.device) < T).view(n, g, 1, 1)
        upper, lo, hi = _split(x, valid)
        if self.bits == 1 or self.known == 1:
            out = torch.where(upper, stored(hi, self.meta), stored(lo, self.meta))
        else:
            out = torch.empty_like(x)
            for side in (False, True):
                here = valid & (upper == side)
                up2, lo2, hi2 = _split(x, here)
                val = torch.where(up2, stored(hi2, self.meta), stored(lo2, self.meta))
                out = torch.where(upper == side, val, out)
        return out.reshape(n * g, H, D)[:T]

    def fraction(self) -> Fraction:
        levels = 2 ** (self.known or self.bits)
        return Fraction(self.known or self.bits, 16) + Fraction(levels * METAS[self.meta], 2 * self.group)


def _padded(k: torch.Tensor, size: int) -> torch.Tensor:
    """``k [T, Hkv, D]`` in runs of ``size`` tokens, the last one zero-padded: ``[cdiv(T, size), size, Hkv, D]``
    float32."""
    T, H, D = k.shape
    n = cdiv(T, size)
    out = torch.zeros(n * size, H, D, dtype=torch.float32, device=k.device)
    out[:T] = k.float()
    return out.view(n, size, H, D)


def _split(x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [N, g, H, D]`` over the ``valid [N, g, 1|H, 1|D]`` entries of each group: ``(upper [N, g, H, D]`` (above
    the group's per-channel mean), ``lo``, ``hi [N, 1, H, D]`` (the means below / above; the mean where a side is
    empty))."""
    w = valid.expand_as(x).float()
    cnt = w.sum(1, keepdim=True)
    mean = (x * w).sum(1, keepdim=True) / cnt.clamp(min=1)
    upper = x > mean
    wu = w * upper
    wl = w - wu
    hi = torch.where(wu.sum(1, keepdim=True) > 0, (x * wu).sum(1, keepdim=True) / wu.sum(1, keepdim=True), mean)
    lo = torch.where(wl.sum(1, keepdim=True) > 0, (x * wl).sum(1, keepdim=True) / wl.sum(1, keepdim=True), mean)
    return upper, lo.nan_to_num(0.0), hi.nan_to_num(0.0)


def leading(k: torch.Tensor, share: float) -> torch.Tensor:
    """The first ``ceil(share x T)`` (at least one) of ``k [T, ...]``: the keys a prompt would have held when a cache
    fitted its statistics on it."""
    return k[: max(1, math.ceil(share * k.shape[0]))]


@dataclass(frozen=True)
class ProductQuantized:
    """Product quantization (as PQCache does for retrieval): each key's ``D`` channels cut into ``D / sub_dim``
    pieces, each piece stored as the index of the nearest of ``centroids`` centres (k-means on the window's keys,
    per KV head and piece, ``iters`` rounds, seeded): ``log2(centroids) / (8 * 2 * sub_dim)`` of K's bytes (1/16 at
    256 centres and 8 channels a piece); the centres (``centroids x D`` a head) are not counted. ``sample``: fit on
    at most that many keys (a seeded random subset; ``None``: all), every key still coded. ``prefix``: fit on the
    first ``ceil(prefix x T)`` keys only (``None``: all), as a cache that fits its centres once on the prompt
    would code the keys written after it."""

    sub_dim: int = 8
    centroids: int = 256
    iters: int = 8
    seed: int = 0
    sample: int | None = None
    prefix: float | None = None

    def __post_init__(self) -> None:
        if self.prefix is not None and not 0 < self.prefix <= 1:
            raise ValueError(f"prefix must be a fraction in (0, 1], not {self.prefix!r}")

    def fit(self, k: torch.Tensor) -> torch.Tensor:
        """The centres of ``k [T, Hkv, D]``'s pieces: ``[Hkv * D / sub_dim, min(centroids, T), sub_dim]``."""
        T, _, D = k.shape
        if D % self.sub_dim:
            raise ValueError(f"sub_dim {self.sub_dim} does not divide the head dim {D}")
        gen = torch.Generator(device="cpu").manual_seed(self.seed)
        if self.prefix is not None:
            k = leading(k, self.prefix)
            T = k.shape[0]
        if self.sample is not None and T > self.sample:
            k = k[torch.randperm(T, generator=gen)[: self.sample].to(k.device)]
            T = self.sample
        x = self._pieces(k)  # [H*m, T, d]
        c = min(self.centroids, T)
        centres = x[:, torch.randperm(T, generator=gen)[:c].to(x.device)].clone()  # [H*m, c, d]
        for _ in range(self.iters):
            assign = torch.cdist(x, centres).argmin(-1)  # [H*m, T]
            count = torch.zeros(x.shape[0], c, device=x.device).scatter_add_(1, assign, torch.ones_like(x[..., 0]))
            idx = assign.unsqueeze(-1).expand(-1, -1, self.sub_dim)
            total = torch.zeros_like(centres).scatter_add_(1, idx, x)  # [H*m, c, d]
            centres = torch.where(count.unsqueeze(-1) > 0, total / count.clamp(min=1).unsqueeze(-1), centres)
        return centres

    def apply(self, k: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
        """``k [T, Hkv, D]`` with every piece replaced by its nearest of ``centres`` (:meth:`fit`), float32."""
        T, H, D = k.shape
        x = self._pieces(k)
        assign = torch.cdist(x, centres).argmin(-1)
        out = torch.gather(centres, 1, assign.unsqueeze(-1).expand(-1, -1, self.sub_dim))  # [H*m, T, d]
        return out.transpose(0, 1).reshape(T, H, D)

    def _pieces(self, k: torch.Tensor) -> torch.Tensor:
        T, H, D = k.shape
        return k.float().reshape(T, H * (D // self.sub_dim), self.sub_dim).transpose(0, 1)

    def __call__(self, k: torch.Tensor, block_size: int) -> torch.Tensor:
        """``k [T, Hkv, D]`` -> every key's pieces replaced by their centres (fitted on ``k``), float32."""
        return self.apply(k, self.fit(k))

    def fraction(self) -> Fraction:
        return Fraction(math.ceil(math.log2(self.centroids)), 16 * self.sub_dim)


@dataclass(frozen=True, eq=False)
class Calibrated:
    """Product quantization whose centres were fitted on other keys (:func:`bind`: the same layer of another window,
    of the other text, at the same positions), as an offline calibration file would give them; unbound it refuses."""

    pq: ProductQuantized
    centres: torch.Tensor | None = None  # [Hkv * D / sub_dim, centroids, sub_dim] once bound

    def __call__(self, k: torch.Tensor, block_size: int) -> torch.Tensor:
        if self.centres is None:
            raise ValueError("a Calibrated variant codes keys with centres fitted elsewhere: bind() it first")
        return self.pq.apply(k, self.centres)

    def fraction(self) -> Fraction:
        return self.pq.fraction()


def bind(variant: object, keys: torch.Tensor, queries: torch.Tensor | None = None) -> object:
    """``variant`` with every :class:`Calibrated` part's centres fitted on ``keys [T, Hkv, D]`` and every
    :class:`Pairs` chosen by the queries weighted on ``queries [H, S, D]`` and the keys; others unchanged."""
    if isinstance(variant, Calibrated):
        return Calibrated(variant.pq, variant.pq.fit(keys))
    if isinstance(variant, Pairs) and variant.by_query:
        if queries is None:
            raise ValueError("binding a Pairs variant chosen by the queries needs calibration queries")
        return replace(variant, weight=pair_weight(keys, queries))
    if isinstance(variant, Progressive):
        return Progressive(bind(variant.coarse, keys, queries), bind(variant.fine, keys, queries), variant.candidates)
    return variant


def calibrated(variant: object) -> bool:
    """Whether ``variant`` has a :class:`Calibrated` part or a :class:`Pairs` chosen by the queries (it needs
    :func:`bind` per layer)."""
    if isinstance(variant, Progressive):
        return calibrated(variant.coarse) or calibrated(variant.fine)
    return isinstance(variant, Calibrated) or (isinstance(variant, Pairs) and variant.by_query)


@dataclass(frozen=True)
class Residual:
    """Two stages of codes, the second on what the first leaves (residual product quantization): ``first(k) +
    second(k - first(k))``; bytes: both."""

    first: object
    second: object

    def __call__(self, k: torch.Tensor, block_size: int) -> torch.Tensor:
        one = self.first(k, block_size)
        return one + self.second(k.float() - one, block_size)

    def fraction(self) -> Fraction:
        return self.first.fraction() + self.second.fraction()


@dataclass(frozen=True)
class Exact:
    """The keys themselves (the oracle's ranking: hit rate 1)."""

    def __call__(self, k: torch.Tensor, block_size: int) -> torch.Tensor:
        return k.float()

    def fraction(self) -> Fraction:
        return Fraction(1)


def hadamard(d: int) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix ``[d, d]`` float32 (``d`` a power of two), its columns' signs
    flipped by a fixed pattern (a randomized Hadamard transform, seed 0): ``H @ H.T = I``, so ``q . k = (H q) . (H k)``."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two width, not {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(0)).float() * 2 - 1
    return h * signs[None, :] / math.sqrt(d)


FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of a float4 e2m1 code
PER_KEY_CODES = ("fp8", "int4", "uint4", "fp4")


@dataclass(frozen=True)
class PerKey:
    """Each key coded on its own, with no grid shared with other tokens (as ``Fp8BlockTopK``'s float8 copy), so a
    kernel scores every token of a tile with one query operand (``q . k = s (q . c)``, plus ``min x sum(q)`` for
    ``"uint4"``). ``code``: ``"fp8"`` (e4m3 over ``max |k| / 448``: ``reference.fp8_code``), ``"int4"`` (``-7..7``
    over ``max |k| / 7``), ``"uint4"`` (16 levels from the key's min to its max) or ``"fp4"`` (e2m1 over
    ``max |k| / 6``); the 4-bit codes' scales, mins and steps stored in bfloat16; over the whole key or each run of
    ``group`` channels; after a randomized Hadamard rotation of the channels when ``rotate`` (the query rotated
    alike: the logits keep their meaning, and an outlier channel's range spreads over all of them); after dividing
    each channel by its largest ``|k|`` over the first ``channels`` of the keys when that is given. Read back in the
    keys' own basis. Bytes: the codes and ``meta`` bytes a key or group, over a 16-bit key's."""

    code: str
    rotate: bool = False
    meta: int = 2
    channels: float | None = None
    group: int | None = None

    def __post_init__(self) -> None:
        if self.code not in PER_KEY_CODES:
            raise ValueError(f"code must be one of {PER_KEY_CODES}, not {self.code!r}")
        if self.group is not None and self.group < 1:
            raise ValueError(f"group must be a positive number of channels, not {self.group!r}")
        if self.channels is not None and not 0 < self.channels <= 1:
            raise ValueError(f"channels must be a fraction in (0, 1], not {self.channels!r}")

    def __call__(self, k: torch.Tensor, block_size: int) -> torch.Tensor:
        """``k [T, Hkv, D]`` -> ``[T, Hkv, D]`` float32."""
        if self.group is not None and k.shape[-1] % self.group:
            raise ValueError(f"group {self.group} does not divide the head dim {k.shape[-1]}")
        x = k.float()
        sigma = None
        if self.channels is not None:
            # one scale per KV head and channel, the largest |k| over the first ``channels`` of the keys (a cache
            # would take it from the prompt): k / sigma, coded per key, read back times sigma
            sigma = leading(x, self.channels).abs().amax(0).clamp(min=1e-6)  # [Hkv, D]
            x = x / sigma
        h = hadamard(x.shape[-1]).to(x.device) if self.rotate else None
        if h is not None:
            x = x @ h.T
        shape = x.shape
        if self.group is not None:  # each run of ``group`` channels coded with its own scale (or min and step)
            x = x.reshape(*shape[:-1], shape[-1] // self.group, self.group)
        amax = x.abs().amax(-1, keepdim=True)
        if self.code == "fp8":
            codes, scale = fp8_code(x)
            out = fp8_decode(codes, scale)
        elif self.code == "int4":
            s = stored(torch.where(amax > 0, amax / 7, 1.0), "bf16")
            out = (x / s).round().clamp(-7, 7) * s
        elif self.code == "uint4":
            lo, hi = stored(x.amin(-1, keepdim=True), "bf16"), x.amax(-1, keepdim=True)
            step = stored(torch.where(hi > lo, (hi - lo) / 15, 1.0), "bf16")
            out = lo + ((x - lo) / step).round().clamp(0, 15) * step
        else:  # "fp4"
            s = stored(torch.where(amax > 0, amax / 6, 1.0), "bf16")
            grid = torch.tensor(FP4_E2M1, device=x.device)
            mag = (x.abs() / s).unsqueeze(-1)
            out = grid[(mag - grid).abs().argmin(-1)] * x.sign() * s
        out = out.reshape(shape)
        out = out @ h if h is not None else out
        return out * sigma if sigma is not None else out

    def fraction(self) -> Fraction:
        """The codes' bits and the ``meta`` bytes a key (a group) over a 16-bit key's, counted at ``D = 128``."""
        bits = 8 if self.code == "fp8" else 4
        return Fraction(bits, 16) + Fraction(self.meta, 2 * (self.group or 128))


def pair_norm(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` -> ``[..., D / 2]``: the norm of each rotary pair ``(x_i, x_{i + D / 2})``."""
    D = x.shape[-1]
    x = x.float()
    return (x[..., : D // 2] ** 2 + x[..., D // 2 :] ** 2).sqrt()


def pair_weight(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Each KV head's expected ``|q_pair| |k_pair|`` (a bound on the pair's share of ``q . k``) on calibration
    queries ``[H, S, D]`` and keys ``[T, Hkv, D]``, the group's heads averaged: ``[Hkv, D / 2]``."""
    Hkv = keys.shape[1]
    qn = pair_norm(queries).mean(1)  # [H, D / 2]
    return qn.view(Hkv, -1, qn.shape[-1]).mean(1) * pair_norm(keys).mean(0)


@dataclass(frozen=True, eq=False)
class Pairs:
    """Only the share ``keep`` of each KV head's rotary pairs (channels ``i`` and ``i + D / 2``, transformers'
    ``rotate_half`` layout), the others read as zero, the kept ones coded by ``inner`` (a :class:`PerKey`: its scale
    over the kept channels only; or :class:`Exact`). Kept: the pairs of the largest mean norm
    ``sqrt(k_i^2 + k_{i+D/2}^2)`` over the first ``channels`` of the keys (a cache would choose them from the prompt;
    a pair's norm does not turn with the position, one channel's does), or with ``by_query`` those of the largest
    :func:`pair_weight` on calibration queries and keys given to :func:`bind` (unbound it refuses). Bytes:
    ``inner``'s codes times ``keep``, plus its meta bytes a key, at ``D = 128``."""

    inner: object
    keep: float
    channels: float = 0.5
    by_query: bool = False
    weight: torch.Tensor | None = None  # [Hkv, D / 2] once bound (``by_query``)

    def __post_init__(self) -> None:
        if not 0 < self.keep <= 1:
            raise ValueError(f"keep must be a fraction of the pairs in (0, 1], not {self.keep!r}")
        if not 0 < self.channels <= 1:
            raise ValueError(f"channels must be a fraction in (0, 1], not {self.channels!r}")

    def mask(self, k: torch.Tensor) -> torch.Tensor:
        """``k [T, Hkv, D]`` -> ``[Hkv, D]`` bool: the kept channels (whole pairs)."""
        _, Hkv, D = k.shape
        if D % 2:
            raise ValueError(f"rotary pairs need an even head dim, not {D}")
        if self.by_query:
            if self.weight is None:
                raise ValueError("a Pairs variant chosen by the queries needs bind(variant, keys, queries) first")
            norm = self.weight.to(k.device)
        else:
            norm = pair_norm(leading(k, self.channels)).mean(0)  # [Hkv, D / 2]
        n = max(1, round(self.keep * D / 2))
        top = torch.zeros(Hkv, D // 2, dtype=torch.bool, device=k.device)
        top.scatter_(1, norm.topk(n, dim=1).indices, True)
        return torch.cat([top, top], dim=1)

    def __call__(self, k: torch.Tensor, block_size: int) -> torch.Tensor:
        """``k [T, Hkv, D]`` -> ``[T, Hkv, D]`` float32, zero outside the kept pairs."""
        m = self.mask(k)
        return self.inner(k.float() * m, block_size) * m

    def fraction(self) -> Fraction:
        """The kept channels' codes, and the inner code's meta bytes a key, over a 16-bit key's at ``D = 128``."""
        meta = Fraction(self.inner.meta, 2 * 128) if isinstance(self.inner, PerKey) else Fraction(0)
        keep = Fraction(max(1, round(self.keep * 64)), 64)
        return (self.inner.fraction() - meta) * keep + meta


@dataclass(frozen=True)
class Progressive:
    """``coarse`` ranks the blocks and keeps ``ceil(candidates x count)`` (forced first); ``fine`` picks the count
    among them. Bytes: the coarse variant's for every key, the fine one's extra bits for the candidates'."""

    coarse: object
    fine: object
    candidates: float


def fine_extra(p: Progressive, budget: float) -> Fraction:
    """What :class:`Progressive` reads per key, as a fraction of K's bytes (the fine stage on ``c x budget``)."""
    extra = p.fine.fraction() - p.coarse.fraction()
    c = Fraction(p.candidates).limit_denominator(1000) * Fraction(budget).limit_denominator(1 << 20)
    return p.coarse.fraction() + min(Fraction(1), c) * max(extra, Fraction(0))


VARIANTS: dict[str, object] = {
    "exact": Exact(),
    "quant4": MinMax(4, 16, "bf16"),
    "quant2": MinMax(2, 16, "bf16"),
    "cg2_g16_fp8": MinMax(2, 16, "fp8"),
    "cg1_g16_fp8": MinMax(1, 16, "fp8"),
    "pg2_g32_fp8_c4": Progressive(MinMax(2, 32, "fp8", known=1), MinMax(2, 32, "fp8"), 4),
    "pg2_g32_fp8_c8": Progressive(MinMax(2, 32, "fp8", known=1), MinMax(2, 32, "fp8"), 8),
    "lloyd1_g16_fp8": TwoLevel(1, 16, "fp8"),
    "lloyd1_g32_fp8": TwoLevel(1, 32, "fp8"),
    "lloyd1_g32_bf16": TwoLevel(1, 32, "bf16"),
    "lloyd2_g32_fp8": TwoLevel(2, 32, "fp8"),
    "pl2_g32_fp8_c4": Progressive(TwoLevel(2, 32, "fp8", known=1), TwoLevel(2, 32, "fp8"), 4),
    "pl2_g32_fp8_c8": Progressive(TwoLevel(2, 32, "fp8", known=1), TwoLevel(2, 32, "fp8"), 8),
    "lloyd1_c4_quant4": Progressive(TwoLevel(1, 32, "fp8"), MinMax(4, 16, "bf16"), 4),
    "pq8": ProductQuantized(8),  # 1/16 of K's bytes
    "pq4": ProductQuantized(4),  # 1/8
    "pq16": ProductQuantized(16),  # 1/32
    "pq8_c4_quant4": Progressive(ProductQuantized(8), MinMax(4, 16, "bf16"), 4),
    "pq8_c2_quant4": Progressive(ProductQuantized(8), MinMax(4, 16, "bf16"), 2),
    "pq16_c2_quant4": Progressive(ProductQuantized(16), MinMax(4, 16, "bf16"), 2),
    "pq8_c2_quant2": Progressive(ProductQuantized(8), MinMax(2, 16, "bf16"), 2),
    # the candidates' own keys as the fine stage: no scoring state but the codes (1/16 of K); the fine stage reads
    # c x the budget's keys, of which the budget's are read again by the attention
    "pq8_c2_exact": Progressive(ProductQuantized(8), Exact(), 2),
    "pq8_c1.5_exact": Progressive(ProductQuantized(8), Exact(), 1.5),
    "pq8_c4_exact": Progressive(ProductQuantized(8), Exact(), 4),
    "pq4_c2_exact": Progressive(ProductQuantized(4), Exact(), 2),
    "pq4_c2_quant4": Progressive(ProductQuantized(4), MinMax(4, 16, "bf16"), 2),
    # centres fitted on the window's first half / eighth only (a cache fitting once on the prompt codes later keys
    # with them): does the coarse pass hold on keys the fit never saw?
    "pq8_c4_exact_fit1/2": Progressive(ProductQuantized(8, prefix=0.5), Exact(), 4),
    "pq8_c4_exact_fit1/8": Progressive(ProductQuantized(8, prefix=0.125), Exact(), 4),
    "pq4_c2_exact_fit1/2": Progressive(ProductQuantized(4, prefix=0.5), Exact(), 2),
    "pq4_c2_exact_fit1/8": Progressive(ProductQuantized(4, prefix=0.125), Exact(), 2),
    # centres fitted on the previous window (the other text, the same positions), as a calibration file would be
    "pq8_c4_exact_cal": Progressive(Calibrated(ProductQuantized(8)), Exact(), 4),
    "pq4_c2_exact_cal": Progressive(Calibrated(ProductQuantized(4)), Exact(), 2),
    "rvq8x2": Residual(ProductQuantized(8), ProductQuantized(8, seed=1)),  # 1/8
    # coarse passes a scoring kernel could run without gathers: 16 centres a piece (4-bit codes, a 16-entry table a
    # piece: one-hot codes times the table on tensor cores), or fewer, larger pieces (half the lookups)
    "pq16_c4_exact": Progressive(ProductQuantized(16), Exact(), 4),
    "pq8x16_c4_exact": Progressive(ProductQuantized(8, centroids=16), Exact(), 4),
    "pq4x16_c4_exact": Progressive(ProductQuantized(4, centroids=16), Exact(), 4),
    "pq4x16_c2_exact": Progressive(ProductQuantized(4, centroids=16), Exact(), 2),
    "pq8_c2_rvq8x2": Progressive(ProductQuantized(8), Residual(ProductQuantized(8), ProductQuantized(8, seed=1)), 2),
    # one code a key, one scale (or min and step) a key, rotated or not: what a kernel can score with one query operand
    # for every token (q . k = s (q . c), plus min x sum(q) for "uint4"), as Fp8BlockTopK does at 8 bits
    "fp8_key": PerKey("fp8", meta=4),
    "int4_key": PerKey("int4"),
    "uint4_key": PerKey("uint4", meta=4),
    "fp4_key": PerKey("fp4"),
    "h_int4_key": PerKey("int4", rotate=True),
    "h_uint4_key": PerKey("uint4", rotate=True, meta=4),
    "h_fp4_key": PerKey("fp4", rotate=True),
    # each channel first divided by its largest |k| over the first half of the window's keys (a prompt's), then coded
    "c_int4_key": PerKey("int4", channels=0.5),
    "c_uint4_key": PerKey("uint4", meta=4, channels=0.5),
    "ch_int4_key": PerKey("int4", rotate=True, channels=0.5),
    "ch_uint4_key": PerKey("uint4", rotate=True, meta=4, channels=0.5),
    # rotated, each run of 32 (64) channels with its own scale or min and step
    "h_int4_g32": PerKey("int4", rotate=True, group=32),
    "h_uint4_g32": PerKey("uint4", rotate=True, meta=4, group=32),
    "h_int4_g64": PerKey("int4", rotate=True, group=64),
    "int4_g32": PerKey("int4", group=32),
    # float8 keys on only the rotary pairs of the largest norm over the first half of the window's keys (a prompt's)
    "fp8_pairs1/2": Pairs(PerKey("fp8", meta=2), 1 / 2),
    "fp8_pairs3/8": Pairs(PerKey("fp8", meta=2), 3 / 8),
    "fp8_pairs1/4": Pairs(PerKey("fp8", meta=2), 1 / 4),
    "exact_pairs1/2": Pairs(Exact(), 1 / 2),
    "exact_pairs1/4": Pairs(Exact(), 1 / 4),
    # the pairs of the largest expected |q_pair| |k_pair| on the previous window (the other text, same positions), as a
    # calibration file would choose them (Double Sparsity's offline channels, by whole rotary pairs)
    "fp8_qpairs1/2": Pairs(PerKey("fp8", meta=2), 1 / 2, by_query=True),
    "fp8_qpairs3/8": Pairs(PerKey("fp8", meta=2), 3 / 8, by_query=True),
    "fp8_qpairs1/4": Pairs(PerKey("fp8", meta=2), 1 / 4, by_query=True),
    "exact_qpairs1/2": Pairs(Exact(), 1 / 2, by_query=True),
}


def variant_fraction(v: object, budget: float) -> Fraction:
    """Bytes a variant reads per key at ``budget``, as a fraction of K's."""
    return fine_extra(v, budget) if isinstance(v, Progressive) else v.fraction()


# --------------------------------------------------------------------------------------------------- capture


def _capture_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA, recording ``(query, key, scaling)`` of the layers the capture asks for."""
    box = kwargs.pop(CAPTURE_KWARG, None)
    if box is not None and module.layer_idx in box["layers"]:
        box["out"][module.layer_idx] = (query[0, :, -box["scored"] :].float(), key[0].float(), float(scaling))
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def capture(model, ids: torch.Tensor, scored: int, dense_layers=(0, 1)) -> dict[int, tuple]:
    """One dense forward of ``ids [1, W]`` without its last token: per sparse full-attention layer, ``(q [H, S, D],
    k [Hkv, W - 1, D], scale)`` float32, ``q`` at positions ``W - 1 - S .. W - 2`` (the decode steps whose next
    tokens the ``simulate`` way scores)."""
    layers = full_attention_layers(model.config) - set(dense_layers)
    box = {"layers": layers, "scored": scored, "out": {}}
    with torch.no_grad(), attention_routed(model, ATTENTION_NAME, _capture_forward, CAPTURE_KWARG, box):
        model(ids[:, :-1], use_cache=False, logits_to_keep=1)
    return box["out"]


# ------------------------------------------------------------------------------------------------- fidelity


def _head_mass(q: torch.Tensor, k: torch.Tensor, scale: float, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """``q [H, S, D]``, ``k [Hkv, T, D]``: each query head's softmax mass in each block, ``[S, Hkv, G, NB]`` (``H =
    Hkv x G``), keys after each query's position ``pos [S]`` masked out, ``-inf`` for blocks past it."""
    H, S, _ = q.shape
    Hkv, T, _ = k.shape
    G = H // Hkv
    logits = torch.einsum("hgsd,htd->shgt", q.view(Hkv, G, S, -1), k) * scale  # [S, Hkv, G, T]
    causal = torch.arange(T, device=q.device).view(1, -1) <= pos.view(-1, 1)  # [S, T]
    p = logits.masked_fill(~causal.view(S, 1, 1, T), float("-inf")).softmax(-1)
    nb = cdiv(T, block_size)
    mass = torch.nn.functional.pad(p, (0, nb * block_size - T)).view(S, Hkv, G, nb, block_size).sum(-1)
    return mass.masked_fill(~_in_use(pos, nb, block_size).view(S, 1, 1, nb), float("-inf"))


def _in_use(pos: torch.Tensor, nb: int, block_size: int) -> torch.Tensor:
    return torch.arange(nb, device=pos.device).view(1, -1) <= (pos // block_size).view(-1, 1)  # [S, NB]


def _pick(scores: torch.Tensor, keep: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """``[S, Hkv, NB]`` bool: per query the forced blocks and the best others by ``scores``, ``keep [S]`` in all."""
    s = scores.masked_fill(forced.unsqueeze(1), float("inf"))
    rank = s.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    return (rank < keep.view(-1, 1, 1)) & (scores > float("-inf"))


def fidelity(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    variants: dict[str, object],
    budget: float,
    block_size: int = 16,
    sink: int = 4,
    window: int = 32,
) -> dict[str, tuple[float, float, int]]:
    """Per variant ``(hit-rate sum, recall sum, count)`` over the scored queries and KV heads of one layer: hit rate
    = the share of the oracle's blocks (forced ones included, as the ``simulate`` way counts) a variant also picks;
    recall = the dense softmax mass inside its blocks, averaged over each GQA group's heads.

    ``q [H, S, D]`` at the last ``S`` of ``T`` positions, ``k [Hkv, T, D]``."""
    S, T = q.shape[1], k.shape[1]
    pos = torch.arange(T - S, T, device=q.device)
    nb = cdiv(T, block_size)
    oracle = OracleBlockTopK(budget=budget, sink=sink, window=window)
    lens = tuple(int(p) + 1 for p in pos)
    counts = oracle.plan(lens, block_size)
    keep = torch.tensor(counts if counts is not None else [cdiv(n, block_size) for n in lens], device=q.device)
    seq_lens = (pos + 1).int()
    forced = forced_block_mask(seq_lens, torch.zeros_like(seq_lens), sink, window, block_size, nb)
    head_mass = _head_mass(q, k, scale, pos, block_size)  # [S, Hkv, G, NB]
    exact = head_mass.sum(2)  # the GQA group's mass: the oracle's ranking
    o_set = _pick(exact, keep, forced)
    out = {}
    cache: dict[object, torch.Tensor] = {}

    def mass_of(v) -> torch.Tensor:
        if v not in cache:
            approx = v(k.transpose(0, 1), block_size).transpose(0, 1)  # [Hkv, T, D]
            cache[v] = _head_mass(q, approx, scale, pos, block_size).sum(2)
        return cache[v]

    for name, v in variants.items():
        if isinstance(v, Progressive):
            cand = _pick(mass_of(v.coarse), torch.ceil(v.candidates * keep.float()).long(), forced)
            fine = mass_of(v.fine).masked_fill(~cand, -torch.finfo(torch.float32).max)
            fine = fine.masked_fill(exact == float("-inf"), float("-inf"))
            sel = _pick(fine, keep, forced)
        else:
            sel = _pick(mass_of(v), keep, forced)
        hit = (sel & o_set).sum(-1).float() / o_set.sum(-1).clamp(min=1)  # [S, Hkv]
        recall = (head_mass.clamp(min=0) * sel.unsqueeze(2)).sum(-1).mean(2)  # [S, Hkv]
        out[name] = (float(hit.sum()), float(recall.sum()), hit.numel())
    return out


# ------------------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    """Hit rate and recall of ``--variants`` on ``--windows`` windows (the suite's: essays and KJV alternating) of
    ``--length`` tokens, the last ``--scored`` queries of every sparse layer; one CSV row per window and variant
    (``--out``), a table with 95 % t intervals over windows on stdout."""
    from .assets import load_model
    from .stats import t_interval
    from .suite import suite_text, windows_of

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--scored", type=int, default=128)
    ap.add_argument("--budget", default="1/16")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dense-layers", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--variants", nargs="+", default=["exact", "quant4", "pg2_g32_fp8_c4", "lloyd1_g32_fp8"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    unknown = [v for v in a.variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    budget = float(Fraction(a.budget))
    variants = {v: VARIANTS[v] for v in a.variants}
    model, tok = load_model(a.model, dtype=getattr(torch, a.dtype))
    texts = {name: suite_text(name) for name in ("essays", "kjv")}
    windows = windows_of(tok, texts, a.length, a.windows, {})
    a.out.parent.mkdir(parents=True, exist_ok=True)
    per: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    with a.out.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "length", "budget", "window", "text", "variant", "bytes_of_k", "hit_rate", "recall", "n"])
        # a calibrated variant's centres come from the window before (window 0's from the last one)
        prev = None
        if any(calibrated(v) for v in variants.values()):
            prev = capture(model, torch.tensor([windows[-1][1]]), a.scored, a.dense_layers)
        for i, (text, window) in enumerate(windows):
            got = capture(model, torch.tensor([window]), a.scored, a.dense_layers)
            sums = {v: [0.0, 0.0, 0] for v in variants}
            for layer, (q, k, scale) in got.items():
                bound = (
                    variants
                    if prev is None
                    else {v: bind(x, prev[layer][1].transpose(0, 1), prev[layer][0]) for v, x in variants.items()}
                )
                for v, (h, r, n) in fidelity(q, k, scale, bound, budget, a.block_size).items():
                    sums[v][0] += h
                    sums[v][1] += r
                    sums[v][2] += n
            for v, (h, r, n) in sums.items():
                frac = variant_fraction(variants[v], budget)
                w.writerow([a.model, a.length, a.budget, i, text, v, str(frac), h / n, r / n, n])
                per[v].append((h / n, r / n))
            f.flush()
            print(f"window {i} ({text}): " + ", ".join(f"{v} {per[v][-1][0]:.3f}" for v in variants), flush=True)
            prev = got if prev is not None else None
    print(f"\n| variant | bytes of K | hit rate [95 %] | recall [95 %] |  ({a.model} {a.length}, {a.windows} windows)")
    print("| --- | --- | --- | --- |")
    for v, rows in per.items():
        hit, rec = t_interval([h for h, _ in rows]), t_interval([r for _, r in rows])
        print(f"| {v} | {variant_fraction(variants[v], budget)} | {_fmt(hit)} | {_fmt(rec)} |")


def _fmt(ci) -> str:
    mean, lo, hi = ci
    return f"{mean:.3f} [{lo:.3f}, {hi:.3f}]" if not math.isnan(lo) else f"{mean:.3f}"


if __name__ == "__main__":
    main()
