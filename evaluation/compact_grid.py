"""Issue 13, an experiment on the CPU: low-bit keys on a per-block grid whose bytes fit in 1/8 of K's.

:class:`~hf_sparse_kv.policies.QuantBlockTopK` codes each key on its block's per-channel min / max; scoring reads the
codes (``bits / 16`` of 16-bit keys) and the min / max (two 16-bit values per channel a 16-token block: another 1/8),
so at 2 bits 1/4 of K's bytes, twice issue 13's "scoring traffic per step <= 1/8 of K". One grid per channel for the
whole sequence (:mod:`evaluation.global_grid`) removed the min / max and lost the ranking: the per-block range
carries it. This module keeps a per-group range and spends fewer bits on everything else, so that the scoring
bytes per token are ``bits / 16 + meta_bytes / group`` of K's (:func:`scoring_fraction`):

- ``bits`` 1, 2 or 4: the codes' width (1 bit: each channel of a key is its group's min or max, whichever is nearer);
- ``group``: the tokens sharing one min / max per channel, a multiple of the block size (16: the block's own, as
  ``QuantBlockTopK``; 32: two consecutive logical blocks of a sequence share one);
- ``meta``: how the min / max are stored: ``"bf16"``, ``"fp8"`` (``float8_e4m3fn``, round to nearest, saturated at
  +-448; keys outside the rounded range take the end code) or ``"exact"`` (float32: the reference for tests).

At 1/8 of K's bytes: 1 bit with fp8 min / max per 16 tokens (1/16 + 1/16), or 1 bit with bf16 min / max per 32 tokens
(1/16 + 2/32). Blocks are ranked like :class:`~hf_sparse_kv.policies.OracleBlockTopK` (each query head's softmax
mass, summed over the GQA group) on the dequantized keys. The grid here is computed at each step from the valid keys
(a cache would refresh a group's min / max as its blocks fill, like ``QuantBlockTopK``'s codes). PyTorch reference
only (``name: "evaluation.compact_grid:CompactGridBlockTopK"`` in a suite, or ``python -m evaluation.compact_grid``):
no cache state, no kernel, not a policy of the library.

Below 2 bits the ranking goes (1 bit: Quest's hit rate), and 2 bits of every key cost 1/8 of K's bytes before their
grid. :class:`ProgressiveGridBlockTopK` stores a 2-bit code as two bit planes and reads the second only where it
matters: the top plane of every key ranks the blocks and keeps ``candidates x`` the budget's, then the full codes of
those blocks pick the budget (:func:`progressive_fraction`: at budget 1/16, 4 candidates a block and fp8 min / max per
32 tokens, 1/16 + 1/32 + 1/64 = 7/64 of K's bytes).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import torch

from hf_sparse_kv.ops.reference import held_positions, oracle_block_scores
from hf_sparse_kv.policies.base import DecodeState
from hf_sparse_kv.policies.blocks import OracleBlockTopK

BITS = (1, 2, 4)
METAS = {"bf16": 2, "fp8": 1, "exact": 4}  # bytes a stored min or max takes
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def scoring_fraction(bits: int, group: int, meta: str) -> Fraction:
    """What scoring reads per token, as a fraction of a 16-bit key's bytes: ``bits / 16`` for the codes plus the
    group's min and max (``2 * meta_bytes`` per channel) spread over its ``group`` tokens (``meta_bytes / group``)."""
    return Fraction(bits, 16) + Fraction(METAS[meta], group)


def stored(x: torch.Tensor, meta: str) -> torch.Tensor:
    """``x`` rounded to how ``meta`` stores a min / max (returned as float32)."""
    if meta == "bf16":
        return x.to(torch.bfloat16).float()
    if meta == "fp8":
        return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return x.float()


def group_grid(
    k_pool: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, start: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)``, each ``[B, MB, Hkv, D]`` float32: per sequence, logical block, KV head and channel, the min / max
    over the valid keys (``start <= p < seq_len`` in a held block) of the ``group // BS`` consecutive logical blocks
    that block belongs to (blocks ``[j * g, (j + 1) * g)``); 0 / 0 where the group holds no valid key.

    Args: ``k_pool [NB, Hkv, BS, D]``; ``block_table [B, MB]`` int (``-1``: not held); ``seq_lens``, ``start`` ``[B]``.
    """
    BS = k_pool.shape[2]
    if group <= 0 or group % BS:
        raise ValueError(f"group must be a positive multiple of the block size {BS}, not {group!r}")
    g = group // BS
    B, MB = block_table.shape
    keys = k_pool[block_table.long().clamp(min=0)].float()  # [B, MB, Hkv, BS, D]
    w = held_positions(block_table, seq_lens, start, BS)[:, :, None, :, None]  # [B, MB, 1, BS, 1]
    pad = -MB % g
    if pad:
        keys = torch.cat([keys, keys.new_zeros(B, pad, *keys.shape[2:])], dim=1)
        w = torch.cat([w, w.new_zeros(B, pad, *w.shape[2:])], dim=1)
    NG = keys.shape[1] // g
    keys = keys.reshape(B, NG, g, *keys.shape[2:])  # [B, NG, g, Hkv, BS, D]
    w = w.reshape(B, NG, g, *w.shape[2:])
    big = torch.finfo(torch.float32).max
    lo = keys.masked_fill(~w, big).amin(dim=(2, 4))  # [B, NG, Hkv, D]
    hi = keys.masked_fill(~w, -big).amax(dim=(2, 4))
    empty = ~w.any(dim=4).any(dim=2)  # [B, NG, 1, 1]
    lo = lo.masked_fill(empty, 0.0)
    hi = hi.masked_fill(empty, 0.0)
    return lo.repeat_interleave(g, dim=1)[:, :MB], hi.repeat_interleave(g, dim=1)[:, :MB]


def dequantized_pool(
    k_pool: torch.Tensor,
    block_table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    bits: int,
    known: int | None = None,
) -> torch.Tensor:
    """``[NB, Hkv, BS, D]`` float32: every held block's keys rounded to the nearest of ``2 ** bits`` uniform levels
    from its ``lo`` to ``hi`` (``[B, MB, Hkv, D]``, the block's grid as stored; clamped to the end levels); blocks no
    sequence holds are 0 (a block two sequences hold takes the later one's grid).

    ``known``: only the code's top ``known`` bits are read (its bit planes stored apart, the low ones not read): the
    key is the middle of the levels those bits leave (``known=1`` of 2 bits: level 0.5 or 2.5); ``None``: all."""
    levels = 2**bits - 1
    unknown = 0 if known is None else bits - known
    if not 0 <= unknown < bits:
        raise ValueError(f"known must be 1 to {bits} code bits, not {known!r}")
    phys = block_table.long()
    held = phys >= 0
    l, h = lo[held][:, :, None, :], hi[held][:, :, None, :]  # [N, Hkv, 1, D]
    keys = k_pool[phys[held]].float()  # [N, Hkv, BS, D]
    delta = (h - l) / levels
    safe = torch.where(delta > 0, delta, torch.ones_like(delta))
    code = torch.floor((keys - l) / safe + 0.5).clamp(0, levels)
    if unknown:  # the levels sharing the top bits, and their middle
        code = torch.div(code, 2**unknown, rounding_mode="floor") * 2**unknown + (2**unknown - 1) / 2
    out = torch.zeros(k_pool.shape, dtype=torch.float32, device=k_pool.device)
    out[phys[held]] = torch.where(delta > 0, l + code * delta, l)
    return out


@dataclass
class CompactGridBlockTopK(OracleBlockTopK):
    """Blocks ranked by their softmax mass under ``bits``-bit keys on a per-``group`` min / max grid stored as
    ``meta``, summed over the GQA group (module docstring). Args as :class:`~hf_sparse_kv.policies.Quest`, plus
    ``bits`` (one of :data:`BITS`), ``group`` (tokens, a multiple of the block size) and ``meta`` (one of
    :data:`METAS`). Reference ops only (an experiment)."""

    bits: int = 1
    group: int = 16
    meta: str = "fp8"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, not {self.bits!r}")
        if self.meta not in METAS:
            raise ValueError(f"meta must be one of {tuple(METAS)}, not {self.meta!r}")
        if not isinstance(self.group, int) or self.group <= 0:
            raise ValueError(f"group must be a positive number of tokens, not {self.group!r}")

    def grid(self, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lo, hi)``, each ``[B, MB, Hkv, D]``: the step's per-``group`` min / max as ``meta`` stores them."""
        lo, hi = group_grid(state.k_pool, state.block_table, state.seq_lens, state.start, self.group)
        return stored(lo, self.meta), stored(hi, self.meta)

    def mass_on(self, state: DecodeState, lo: torch.Tensor, hi: torch.Tensor, known: int | None = None) -> torch.Tensor:
        """``[B, Hkv, nblk]`` each block's mass under its keys' codes on the grid ``(lo, hi)`` (their top ``known``
        bits only: :func:`dequantized_pool`), ``-inf`` for blocks not in use."""
        keys = dequantized_pool(state.k_pool, state.block_table, lo, hi, self.bits, known).to(state.k_pool.dtype)
        return oracle_block_scores(
            state.q, keys, state.block_table, state.seq_lens, state.start, state.scale, state.length
        )

    def mass(self, state: DecodeState) -> torch.Tensor:
        """``[B, Hkv, nblk]`` each block's mass under the quantized keys, ``-inf`` for blocks not in use."""
        return self.mass_on(state, *self.grid(state))


@dataclass
class ProgressiveGridBlockTopK(CompactGridBlockTopK):
    """Two stages on one ``bits``-bit grid whose codes are stored as bit planes: every key's top bit plane ranks the
    blocks (each key the middle of the levels its top bit leaves, :func:`dequantized_pool`'s ``known=1``) and keeps
    ``candidates x`` the budget's blocks (the forced ones first), then the full codes of only those blocks rank them
    by mass (module docstring) and the budget's best are kept. Scoring reads the top plane and the grid of every
    key, and the other planes of the candidates (:func:`progressive_fraction`). Args as
    :class:`CompactGridBlockTopK` (``bits`` 2 or 4), plus ``candidates`` (``c >= 1``). Reference ops only."""

    bits: int = 2
    candidates: float = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bits < 2:
            raise ValueError(f"a progressive grid needs bits >= 2 (a top plane and more), not {self.bits!r}")
        c = self.candidates
        if isinstance(c, bool) or not isinstance(c, (int, float)) or c < 1:
            raise ValueError(f"candidates must be a number >= 1 (candidate blocks per budget block), not {c!r}")

    def stage_masses(self, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor]:
        """``(coarse, fine)``, each ``[B, Hkv, nblk]``: every block's mass under its keys' top bit plane and under
        the full codes; ``-inf`` for blocks not in use."""
        lo, hi = self.grid(state)
        return self.mass_on(state, lo, hi, known=1), self.mass_on(state, lo, hi)

    def scores(self, state: DecodeState) -> torch.Tensor:
        """The fine mass on the candidates (forced blocks ``+inf``), below every candidate elsewhere in use
        (``-finfo.max``), ``-inf`` for blocks not in use; called by ``select`` only when the step is sparse."""
        coarse, fine = self.stage_masses(state)
        forced = self.forced_blocks(state, self.sink, self.window).unsqueeze(1)  # [B, 1, nblk]
        live = coarse > float("-inf")
        coarse = coarse.masked_fill(forced & live, float("inf"))
        counts = self.widths(state).per_sequence()
        keep = torch.tensor([math.ceil(self.candidates * k) for k in counts], device=coarse.device)  # [B]
        rank = coarse.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)  # [B, Hkv, nblk]
        candidate = rank < keep[:, None, None]
        fine = fine.masked_fill(forced & live, float("inf"))
        low = torch.full_like(fine, -torch.finfo(fine.dtype).max).masked_fill(~live, float("-inf"))
        return torch.where(candidate & live, fine, low)


def progressive_fraction(bits: int, group: int, meta: str, candidates: float, budget: float) -> Fraction:
    """What :class:`ProgressiveGridBlockTopK` reads per token, as a fraction of a 16-bit key's bytes: the top plane
    (``1 / 16``) and the grid of every key (:func:`scoring_fraction`'s ``meta_bytes / group``), and the other
    ``bits - 1`` planes of ``candidates x budget`` of the keys."""
    c, b = Fraction(candidates).limit_denominator(1000), Fraction(budget).limit_denominator(1 << 20)
    return scoring_fraction(1, group, meta) + min(Fraction(1), c * b) * Fraction(bits - 1, 16)


def parse_progressive(text: str) -> tuple[int, int, str, float]:
    """``"bits:group:meta:candidates"`` (e.g. ``"2:32:fp8:4"``) -> ``(bits, group, meta, candidates)``."""
    parts = text.split(":")
    try:
        if len(parts) != 4:
            raise ValueError
        return (*parse_cell(":".join(parts[:3])), float(parts[3]))
    except ValueError:
        raise ValueError(f"a progressive cell is 'bits:group:meta:candidates' (e.g. '2:32:fp8:4'), not {text!r}")


def progressive_label(bits: int, group: int, meta: str, candidates: float) -> str:
    """The progressive cell's label: ``pg<bits>_g<group>_<meta>_c<candidates>``."""
    return f"pg{bits}_g{group}_{meta}_c{candidates:g}"


def parse_cell(text: str) -> tuple[int, int, str]:
    """``"bits:group:meta"`` (e.g. ``"1:16:fp8"``) -> ``(bits, group, meta)``; raises ``ValueError`` with the form."""
    parts = text.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
        raise ValueError(f"a cell is 'bits:group:meta' (e.g. '1:16:fp8'), not {text!r}")
    return int(parts[0]), int(parts[1]), parts[2]


def label(bits: int, group: int, meta: str) -> str:
    """The cell's label in the rows and table: ``cg<bits>_g<group>_<meta>``."""
    return f"cg{bits}_g{group}_{meta}"


def main(argv: list[str] | None = None) -> None:
    """Perplexity and fidelity of the compact-grid cells beside :mod:`evaluation.coarse_pool`'s (its CLI and rows
    file: dense, the oracle and ``quant<b>`` rows of an earlier run in the same ``--out`` are reused, same windows).

        python -m evaluation.compact_grid --out DIR --cells 1:16:fp8 1:32:bf16 \\
            --progressive 2:32:fp8:4 [coarse_pool args]
    """
    from . import coarse_pool

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cells", nargs="*", default=["1:16:fp8"], help="'bits:group:meta' per cell (module docstring)")
    ap.add_argument(
        "--progressive",
        nargs="*",
        default=[],
        help="'bits:group:meta:candidates' per ProgressiveGridBlockTopK cell (top bit plane, then the candidates')",
    )
    ap.add_argument("--budget", default="1/16")
    args, rest = ap.parse_known_args(argv)
    try:
        budget = float(Fraction(args.budget))
        specs = [parse_cell(c) for c in args.cells]
        for bits, group, meta in specs:  # refuse a bad cell before the model loads
            CompactGridBlockTopK(budget=16, bits=bits, group=group, meta=meta)
        steps = [parse_progressive(c) for c in args.progressive]
        for bits, group, meta, c in steps:
            ProgressiveGridBlockTopK(budget=16, bits=bits, group=group, meta=meta, candidates=c)
    except (ValueError, ZeroDivisionError) as e:
        ap.error(str(e))
    for spec in specs:
        print(f"{label(*spec)}: scoring reads {scoring_fraction(*spec)} of K's bytes")
    for spec in steps:
        print(f"{progressive_label(*spec)}: scoring reads {progressive_fraction(*spec, budget)} of K's bytes")

    def extra(budget: float, sink: int, window: int) -> dict:
        cells = {
            label(bits, group, meta): CompactGridBlockTopK(
                budget=budget, sink=sink, window=window, bits=bits, group=group, meta=meta
            )
            for bits, group, meta in specs
        }
        for bits, group, meta, c in steps:
            cells[progressive_label(bits, group, meta, c)] = ProgressiveGridBlockTopK(
                budget=budget, sink=sink, window=window, bits=bits, group=group, meta=meta, candidates=c
            )
        return cells

    coarse_pool.main(["--out", str(args.out), "--budget", args.budget, *rest], extra_cells=extra)


if __name__ == "__main__":
    main()
