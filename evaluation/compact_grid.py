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
"""

from __future__ import annotations

import argparse
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
    k_pool: torch.Tensor, block_table: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int
) -> torch.Tensor:
    """``[NB, Hkv, BS, D]`` float32: every held block's keys rounded to the nearest of ``2 ** bits`` uniform levels
    from its ``lo`` to ``hi`` (``[B, MB, Hkv, D]``, the block's grid as stored; clamped to the end levels); blocks no
    sequence holds are 0 (a block two sequences hold takes the later one's grid)."""
    levels = 2**bits - 1
    phys = block_table.long()
    held = phys >= 0
    l, h = lo[held][:, :, None, :], hi[held][:, :, None, :]  # [N, Hkv, 1, D]
    keys = k_pool[phys[held]].float()  # [N, Hkv, BS, D]
    delta = (h - l) / levels
    safe = torch.where(delta > 0, delta, torch.ones_like(delta))
    code = torch.floor((keys - l) / safe + 0.5).clamp(0, levels)
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

    def mass(self, state: DecodeState) -> torch.Tensor:
        """``[B, Hkv, nblk]`` each block's mass under the quantized keys, ``-inf`` for blocks not in use."""
        lo, hi = group_grid(state.k_pool, state.block_table, state.seq_lens, state.start, self.group)
        lo, hi = stored(lo, self.meta), stored(hi, self.meta)
        keys = dequantized_pool(state.k_pool, state.block_table, lo, hi, self.bits).to(state.k_pool.dtype)
        return oracle_block_scores(
            state.q, keys, state.block_table, state.seq_lens, state.start, state.scale, state.length
        )


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

        python -m evaluation.compact_grid --out DIR --cells 1:16:fp8 1:32:bf16 [coarse_pool args]
    """
    from . import coarse_pool

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cells", nargs="+", default=["1:16:fp8"], help="'bits:group:meta' per cell (module docstring)")
    args, rest = ap.parse_known_args(argv)
    try:
        specs = [parse_cell(c) for c in args.cells]
        for bits, group, meta in specs:  # refuse a bad cell before the model loads
            CompactGridBlockTopK(budget=16, bits=bits, group=group, meta=meta)
    except ValueError as e:
        ap.error(str(e))
    for spec in specs:
        print(f"{label(*spec)}: scoring reads {scoring_fraction(*spec)} of K's bytes")

    def extra(budget: float, sink: int, window: int) -> dict:
        return {
            label(bits, group, meta): CompactGridBlockTopK(
                budget=budget, sink=sink, window=window, bits=bits, group=group, meta=meta
            )
            for bits, group, meta in specs
        }

    coarse_pool.main(["--out", str(args.out), *rest], extra_cells=extra)


if __name__ == "__main__":
    main()
