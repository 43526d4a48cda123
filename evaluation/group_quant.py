"""Issue 13, an experiment on the CPU: low-bit keys whose scales a scoring kernel can share across many tokens.

``QuantBlockTopK(bits=4)`` ranks blocks as the oracle does within noise on every model measured, but its scoring
kernel runs at ~12 % of the bandwidth (benchmarks/RESULTS.md, "Low-bit keys"): each 16-token block has its own
per-channel grid (``k_hat = min_c + code * delta_c``), so ``q . k_hat = q . min + (q * delta) . code`` needs a
differently scaled query for every block, and a block's 16 tokens are too few for a tensor-core product (the
kernel stacks the tile's blocks' scaled queries and keeps the block diagonal of a larger product). Two grids that
let one query operand serve hundreds of tokens:

- ``scheme="channel"``, ``group_blocks = g``: each channel's ``[min, max]`` over ``g`` consecutive blocks (``g * BS``
  tokens share one scaled query ``q * delta``); ``g = 1`` is ``QuantBlockTopK``'s grid.
- ``scheme="fp8"``: no grid at all: every key in float8 e4m3 (3 mantissa bits) after dividing each channel by one
  scale per (sequence, KV head, channel), ``max |k| / 448`` over the valid keys (``bits`` is not used). Twice the
  bytes of 4-bit codes, but ``q . k_hat = (q * scale) . k8``: one query operand for every token, and codes that an
  fp8 tensor-core product takes as they are (no unpacking), where the 4-bit scorer is bound by the instructions that
  unpack its codes (benchmarks/RESULTS.md, Nsight Compute, 2026-12-06).
- ``scheme="fp8_token"``: the same float8 keys, each key over its own scale ``max_c |k_c| / 448`` (the layout of
  :class:`~hf_sparse_kv.policies.Fp8BlockTopK`: ``reference.fp8_code``).
- ``scheme="token"``: the block's per-channel ``min`` as the zero point (the cache's ``kmin``, which Quest keeps
  anyway) and one step per token, ``s_t = max_c (k_tc - min_c) / levels``: ``q . k_hat = q . min + s_t (q . code_t)``,
  one plain product of the query with every token's codes, the per-token step applied to its result.

Then the oracle's mass and top-k, as ``QuantBlockTopK``. This module is the PyTorch reference only, for the
``simulate`` screen of :mod:`evaluation.coarse_pool` (codes made from the full keys at each step, as the cache's
write would re-code a group's filled prefix): no Triton kernel, not registered as a policy of the library.

    python -m evaluation.group_quant --out evaluation/results/group_quant_cpu --windows 8 --scored 128 --only ...
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_sparse_kv.ops.reference import (
    decoded_block_mass,
    dequantize_keys,
    fp8_code,
    fp8_decode,
    fp8_encode,
    fp8_scale,
    held_positions,
    quant_levels,
    quantize_keys,
)
from hf_sparse_kv.policies import QuantBlockTopK
from hf_sparse_kv.policies.base import DecodeState

SCHEMES = ("channel", "token", "fp8", "fp8_token")


def group_quant_keys(keys: torch.Tensor, ok: torch.Tensor, bits: int, scheme: str, group_blocks: int = 1):
    """The dequantized copies of ``keys [B, MB, H, BS, D]`` (float32; ``ok [B, MB, BS]`` the valid positions, whose
    min / max alone set the grids) under ``scheme`` (module docstring); positions not valid come back as they were
    (the mass masks them)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, not {scheme!r}")
    L = quant_levels(bits)
    B, MB, H, BS, D = keys.shape
    m = ok[:, :, None, :, None]  # [B, MB, 1, BS, 1]
    if scheme == "fp8_token":
        return torch.where(m, fp8_decode(*fp8_code(keys)), keys)
    if scheme == "fp8":
        amax = keys.abs().masked_fill(~m, 0.0).amax(dim=(1, 3), keepdim=True)  # [B, 1, H, 1, D]
        scale = fp8_scale(amax)
        approx = fp8_encode(keys, scale).view(torch.float8_e4m3fn).float() * scale
        return torch.where(m, approx, keys)
    if scheme == "channel":
        g = group_blocks
        pad = (-MB) % g
        if pad:
            keys = torch.cat([keys, keys.new_zeros(B, pad, H, BS, D)], 1)
            m = torch.cat([m, m.new_zeros(B, pad, 1, BS, 1)], 1)
        n = keys.shape[1] // g
        # [B, n, H, g * BS, D]: a group's tokens side by side, one grid per (group, head, channel) over them
        kg = keys.view(B, n, g, H, BS, D).transpose(2, 3).reshape(B, n, H, g * BS, D)
        mg = m.view(B, n, g, 1, BS, 1).transpose(2, 3).reshape(B, n, 1, g * BS, 1)
        lo = kg.masked_fill(~mg, float("inf")).amin(3)  # [B, n, H, D]
        hi = kg.masked_fill(~mg, float("-inf")).amax(3)
        lo = torch.where(lo.isfinite(), lo, 0.0)
        hi = torch.where(hi.isfinite(), hi, 0.0)
        approx = dequantize_keys(quantize_keys(kg, lo, hi, bits), lo, hi, bits)  # QuantBlockTopK's grid arithmetic
        out = torch.where(mg, approx, kg).view(B, n, H, g, BS, D).transpose(2, 3).reshape(B, n * g, H, BS, D)
        return out[:, :MB]
    lo = keys.masked_fill(~m, float("inf")).amin(3, keepdim=True)  # [B, MB, H, 1, D] the block's channel minima
    lo = torch.where(lo.isfinite(), lo, 0.0)
    step = (keys - lo).masked_fill(~m, 0.0).amax(-1, keepdim=True) / L  # [B, MB, H, BS, 1] one step per token
    code = torch.where(step > 0, torch.floor((keys - lo) / step.clamp(min=1e-30) + 0.5).clamp(0, L), 0.0)
    return torch.where(m, lo + code * step, keys)


@dataclass
class GroupQuantBlockTopK(QuantBlockTopK):
    """``QuantBlockTopK`` on the grids of the module docstring (``scheme``, ``group_blocks``). Reference ops only (an
    experiment)."""

    bits: int = 4
    scheme: str = "channel"
    group_blocks: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, not {self.scheme!r}")
        if self.group_blocks < 1:
            raise ValueError(f"group_blocks must be >= 1, not {self.group_blocks}")

    def scores(self, state: DecodeState) -> torch.Tensor:
        """``[B, Hkv, nblk]`` the approximate mass per block, ``+inf`` for the forced blocks, ``-inf`` off use."""
        table = state.block_table
        keys = state.k_pool[table.long().clamp(min=0)].float()  # [B, MB, Hkv, BS, D]
        ok = held_positions(table, state.seq_lens, state.start, state.block_size)
        approx = group_quant_keys(keys, ok, self.bits, self.scheme, self.group_blocks)
        return decoded_block_mass(
            state.q, approx, table, state.seq_lens, state.start, state.scale, self.sink, self.window
        )


def extra_cells(budget: float, sink: int, window: int) -> dict:
    """The screen's cells: ``gq<bits>_<g>`` (channel grids over ``g`` blocks), ``tq<bits>`` (per-token steps) and
    ``fp8`` / ``fp8t`` (float8 keys, one scale a channel / a key)."""
    out = {}
    for bits in (4, 2):
        for g in (1, 4, 16):
            out[f"gq{bits}_{g}"] = GroupQuantBlockTopK(
                budget=budget, sink=sink, window=window, bits=bits, scheme="channel", group_blocks=g
            )
        out[f"tq{bits}"] = GroupQuantBlockTopK(budget=budget, sink=sink, window=window, bits=bits, scheme="token")
    out["fp8"] = GroupQuantBlockTopK(budget=budget, sink=sink, window=window, scheme="fp8")
    out["fp8t"] = GroupQuantBlockTopK(budget=budget, sink=sink, window=window, scheme="fp8_token")
    return out


if __name__ == "__main__":
    from .coarse_pool import main

    main(extra_cells=extra_cells)
