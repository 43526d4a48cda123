"""Issue 13, an experiment on the CPU: low-bit keys on one grid per channel for the whole sequence.

:class:`~hf_sparse_kv.policies.QuantBlockTopK` codes each key on its *block's* per-channel min / max, so scoring
reads the codes and the block's min / max: at 2 bits 1/8 + 1/8 = 1/4 of K's bytes (issue 13 asks for at most 1/8),
and its kernel dequantizes every block on its own grid. Keys' outliers sit in fixed channels (KIVI's reason for
quantizing keys per channel), so one range per (sequence, KV head, channel) may do: then scoring reads only the codes
(``bits / 16`` of K's bytes: 1/8 at 2 bits), and since a query head's softmax mass does not change when all its
logits shift by the same amount, ``q . (lo + delta * code)`` ranks like ``(q * delta) . code``: a plain product of a
pre-scaled query with small integers, no per-block metadata at all.

``grid``:

- ``"gauss"``: ``mean +- r * std`` of the channel over the sequence's valid keys, ``r`` the range of the uniform
  ``2 ** bits``-level quantizer that is near-optimal for a Gaussian (1 bit: 0.798, i.e. the levels ``mean +- 0.798
  std``; 2 bits: 1.51; 4 bits: 2.73); keys outside are clamped to the end levels;
- ``"minmax"``: the channel's min and max over the sequence.

Blocks are then ranked like :class:`~hf_sparse_kv.policies.OracleBlockTopK` (each query head's softmax mass, summed
over the GQA group) on the dequantized keys. The grid here is computed at each step from every valid key (a cache
would fix it after the prefill and clamp later keys: a few hundred decode tokens against thousands of prompt keys).
PyTorch reference only (``name: "evaluation.global_grid:GlobalGridBlockTopK"`` in a suite, or
``python -m evaluation.global_grid``): no cache state, no kernel, not a policy of the library.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_sparse_kv.ops.reference import held_positions, oracle_block_scores
from hf_sparse_kv.policies.base import DecodeState
from hf_sparse_kv.policies.blocks import OracleBlockTopK

GRIDS = ("gauss", "minmax")
GAUSS_RANGE = {1: 0.798, 2: 1.51, 3: 2.15, 4: 2.73}  # half-range / std of a near-optimal uniform quantizer


def sequence_grid(
    k_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    bits: int,
    grid: str = "gauss",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)``, each ``[B, Hkv, D]`` float32: per sequence, KV head and channel, the grid's two end levels
    over the valid keys (``start <= p < seq_len`` in a held block; module docstring for ``grid``).

    Args: ``k_pool [NB, Hkv, BS, D]``; ``block_table [B, MB]`` int (``-1``: not held); ``seq_lens``, ``start`` ``[B]``.
    """
    if grid not in GRIDS:
        raise ValueError(f"grid must be one of {GRIDS}, not {grid!r}")
    if bits not in GAUSS_RANGE:
        raise ValueError(f"bits must be one of {tuple(GAUSS_RANGE)}, not {bits!r}")
    keys = k_pool[block_table.long().clamp(min=0)].float()  # [B, MB, Hkv, BS, D]
    w = held_positions(block_table, seq_lens, start, k_pool.shape[2])[:, :, None, :, None]  # [B, MB, 1, BS, 1]
    if grid == "minmax":
        big = torch.finfo(torch.float32).max
        lo = keys.masked_fill(~w, big).amin(dim=(1, 3))
        hi = keys.masked_fill(~w, -big).amax(dim=(1, 3))
        return lo, hi
    wf = w.float()
    n = wf.sum(dim=(1, 3)).clamp(min=1)  # [B, 1, 1]
    mean = (keys * wf).sum(dim=(1, 3)) / n  # [B, Hkv, D]
    var = ((keys - mean[:, None, :, None]) ** 2 * wf).sum(dim=(1, 3)) / n
    r = GAUSS_RANGE[bits] * var.sqrt()
    return mean - r, mean + r


def dequantized_pool(
    k_pool: torch.Tensor, block_table: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int
) -> torch.Tensor:
    """``[NB, Hkv, BS, D]`` float32: every held block's keys rounded to the nearest of ``2 ** bits`` uniform levels
    from its sequence's ``lo`` to ``hi`` (``[B, Hkv, D]``; clamped to the ends); blocks no sequence holds are 0."""
    levels = 2**bits - 1
    out = torch.zeros(k_pool.shape, dtype=torch.float32, device=k_pool.device)
    for b in range(block_table.shape[0]):
        blocks = block_table[b][block_table[b] >= 0].long()
        l, h = lo[b][None, :, None, :], hi[b][None, :, None, :]  # [1, Hkv, 1, D]
        delta = (h - l) / levels
        safe = torch.where(delta > 0, delta, torch.ones_like(delta))
        code = torch.floor((k_pool[blocks].float() - l) / safe + 0.5).clamp(0, levels)
        out[blocks] = torch.where(delta > 0, l + code * delta, l)
    return out


@dataclass
class GlobalGridBlockTopK(OracleBlockTopK):
    """Blocks ranked by their softmax mass under ``bits``-bit keys on one grid per (sequence, KV head, channel),
    summed over the GQA group (module docstring). Args as :class:`~hf_sparse_kv.policies.Quest`, plus ``bits``
    (1-4) and ``grid`` (one of :data:`GRIDS`). Reference ops only (an experiment)."""

    bits: int = 2
    grid: str = "gauss"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.grid not in GRIDS:
            raise ValueError(f"grid must be one of {GRIDS}, not {self.grid!r}")
        if self.bits not in GAUSS_RANGE:
            raise ValueError(f"bits must be one of {tuple(GAUSS_RANGE)}, not {self.bits!r}")

    def mass(self, state: DecodeState) -> torch.Tensor:
        """``[B, Hkv, nblk]`` each block's mass under the quantized keys, ``-inf`` for blocks not in use."""
        lo, hi = sequence_grid(state.k_pool, state.block_table, state.seq_lens, state.start, self.bits, self.grid)
        keys = dequantized_pool(state.k_pool, state.block_table, lo, hi, self.bits).to(state.k_pool.dtype)
        return oracle_block_scores(
            state.q, keys, state.block_table, state.seq_lens, state.start, state.scale, state.length
        )


def main(argv: list[str] | None = None) -> None:
    """Perplexity and fidelity of the global-grid cells beside :mod:`evaluation.coarse_pool`'s (its CLI and rows
    file: dense, the oracle and ``quant<b>`` rows of an earlier run in the same ``--out`` are reused, same windows).

        python -m evaluation.global_grid --out DIR --cells 2:gauss 1:gauss 2:minmax [coarse_pool args]
    """
    from . import coarse_pool

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cells", nargs="+", default=["2:gauss"], help="'bits:grid' per cell (label gg<bits>_<grid>)")
    args, rest = ap.parse_known_args(argv)
    specs = [(int(c.split(":")[0]), c.split(":")[1]) for c in args.cells]

    def extra(budget: float, sink: int, window: int) -> dict:
        return {
            f"gg{bits}_{grid}": GlobalGridBlockTopK(budget=budget, sink=sink, window=window, bits=bits, grid=grid)
            for bits, grid in specs
        }

    coarse_pool.main(["--out", str(args.out), *rest], extra_cells=extra)


if __name__ == "__main__":
    main()
