"""A selector on low-bit keys: every key is also stored as ``bits``-bit codes on its block's min / max grid, and
blocks are ranked by the softmax mass those approximate keys give them (the oracle's criterion).

Per block and channel the grid spans the block's ``kmin`` / ``kmax`` (the metadata the cache keeps for Quest), so the
codes need no scale of their own: at 2 bits a key costs ``D / 4`` bytes (1/8 of a 16-bit key), and the scoring state
(codes plus the min / max the cache holds anyway) is 1/4 of K's bytes, 1/8 of the KV cache's, at block size 16. The
mass is :class:`~.blocks.OracleBlockTopK`'s with every key replaced by its dequantized copy: each query head's
softmax over every valid position, summed over the block and over the GQA group (``ops.quant_block_scores``). The
codes are a per-token :class:`StateSpec` (``"kcodes"``, ``[NB, Hkv, BS, D * bits // 8]`` uint8) that every write
refreshes (``ops.quant_write`` re-codes the blocks it touched: a block's grid grows while it fills).

Uniform per-channel quantization of keys over groups of tokens is KIVI's key layout (Liu et al.,
https://arxiv.org/abs/2402.02750); here the codes only rank blocks, the attention reads the full-precision keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..ops.reference import quant_levels, quantize_keys
from .base import DecodeState, StateSpec, Trailing
from .blocks import _BlockTopK

STATE_NAME = "kcodes"


@dataclass
class QuantBlockTopK(_BlockTopK):
    """Blocks ranked by their softmax mass under ``bits``-bit keys (summed over the GQA group), top ``budget``.

    Args: ``budget`` (tokens or a fraction), ``sink``, ``window`` (tokens), ``bits`` (2 or 4: the codes' width).
    State: ``kcodes [NB, Hkv, BS, D * bits // 8]`` uint8 (module docstring). No calibration.
    """

    bits: int = 2
    _spec: StateSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        quant_levels(self.bits)  # raises for a width other than 2 or 4
        bits = self.bits
        key = ("kcodes", bits) if type(self) is QuantBlockTopK else None  # a subclass (other codes): its own
        self._spec = StateSpec(STATE_NAME, "token", Trailing(bits, 8), self._refresh, dtype=torch.uint8, key=key)

    def key_metadata(self) -> tuple[str, ...]:
        return ("kmin", "kmax")

    def cache_state(self) -> tuple[StateSpec, ...]:
        return (self._spec,)

    def _refresh(self, state, k_pool, block_table, lo, hi, *, layer, span, ops, states) -> None:
        """The StateSpec refresh: ``ops.quant_write`` of the blocks holding the positions ``[lo, hi)``."""
        ops.quant_write(state, k_pool, block_table, lo, hi, span, self.bits)

    def codes(self, state: DecodeState) -> torch.Tensor:
        """``[NB, Hkv, BS, D * bits // 8]`` the cache's codes; a state built outside a patched model (evaluation's
        simulate way) gets them quantized here from ``k_pool`` on its ``kmin`` / ``kmax``."""
        codes = state.state.get(STATE_NAME)
        if codes is None:
            codes = quantize_keys(state.k_pool, state.kmin, state.kmax, self.bits)
        return codes

    def scores(self, state: DecodeState) -> torch.Tensor:
        """``[B, Hkv, nblk]`` each block's mass under the quantized keys, ``-inf`` for blocks not in use, the forced
        blocks in use at ``+inf`` (set by the op itself: on the Triton backend in its tail kernel)."""
        return state.ops.quant_block_scores(
            state.q, self.codes(state), state.kmin, state.kmax, state.block_table, state.seq_lens, state.start,
            state.scale, self.bits, self.sink, self.window,
        )  # fmt: skip
