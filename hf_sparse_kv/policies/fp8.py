"""A selector on float8 keys: every key is also stored in float8 e4m3 over its own scale, and blocks are ranked by
the softmax mass those keys give them (the oracle's criterion).

A key ``k [D]`` is kept as ``k8 = e4m3(k / s)`` with ``s = max_c |k_c| / 448`` (``reference.fp8_code``): 3 bits of
mantissa on every channel, with no grid shared with other tokens (a write codes only its own positions). Its scoring
state is ``D + 4`` bytes a key, 0.52 of a bf16 key at ``D = 128``: more than ``QuantBlockTopK(bits=4)``'s codes
(1/4, plus the min / max the cache keeps for Quest), but a kernel scores it with one query operand for every token,
the fp8 rows going into the tensor-core product as they are loaded (``ops.fp8_block_scores``), where the 4-bit
codes' per-block grids need a differently scaled query for each 16-token block and instructions to unpack them
(benchmarks/RESULTS.md, 2026-12-06). The mass is :class:`~.blocks.OracleBlockTopK`'s with every key replaced by its
float8 copy: each query head's softmax over every valid position, summed over the block and over the GQA group.

State: two per-token :class:`StateSpec`, ``"k8"`` (``[NB, Hkv, BS, D]`` uint8, the e4m3 bytes) and ``"k8scale"``
(``[NB, Hkv, BS]`` float32), each refreshed by every write (``ops.fp8_write``). No calibration. Below CUDA compute
capability 8.9 (A100, RTX 30xx: no float8 instructions) the kernels write the same bytes by integer rounding and
score them widened to float16 (``ops/triton/fp8.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..ops.reference import fp8_code
from .base import DecodeState, StateSpec, Trailing
from .blocks import _BlockTopK

CODES, SCALES = "k8", "k8scale"


@dataclass
class Fp8BlockTopK(_BlockTopK):
    """Blocks ranked by their softmax mass under float8 keys (summed over the GQA group), top ``budget``.

    Args: ``budget`` (tokens or a fraction), ``sink``, ``window`` (tokens).
    State: ``k8 [NB, Hkv, BS, D]`` uint8 and ``k8scale [NB, Hkv, BS]`` float32 (module docstring). No calibration.
    """

    _specs: tuple[StateSpec, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        key = ("fp8",) if type(self) is Fp8BlockTopK else None  # every instance keeps the same (a subclass: its own)
        self._specs = (
            StateSpec(CODES, "token", Trailing(), self._refresh_codes, dtype=torch.uint8, key=key),  # [D]
            StateSpec(SCALES, "token", Trailing(None), self._refresh_scales, dtype=torch.float32, key=key),  # []
        )

    def cache_state(self) -> tuple[StateSpec, ...]:
        return self._specs

    def key_metadata(self) -> tuple[str, ...]:
        return ()

    @staticmethod
    def _refresh_codes(state, k_pool, block_table, lo, hi, *, layer, span, ops, states) -> None:
        """The codes' StateSpec refresh: ``ops.fp8_write`` of the positions ``[lo, hi)``."""
        ops.fp8_write(state, k_pool, block_table, lo, hi, span, "codes")

    @staticmethod
    def _refresh_scales(state, k_pool, block_table, lo, hi, *, layer, span, ops, states) -> None:
        """The scales' StateSpec refresh: ``ops.fp8_write`` of the positions ``[lo, hi)``."""
        ops.fp8_write(state, k_pool, block_table, lo, hi, span, "scales")

    @staticmethod
    def keys(state: DecodeState) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes [NB, Hkv, BS, D] uint8, scales [NB, Hkv, BS] float32)`` the cache's float8 keys; a state built
        outside a patched model (evaluation's simulate way) gets them coded here from ``k_pool``."""
        codes, scales = state.state.get(CODES), state.state.get(SCALES)
        if codes is None or scales is None:
            codes, scales = fp8_code(state.k_pool)
        return codes, scales

    def scores(self, state: DecodeState) -> torch.Tensor:
        """``[B, Hkv, nblk]`` each block's mass under the float8 keys, ``-inf`` for blocks not in use, the forced
        blocks in use at ``+inf`` (set by the op itself: on the Triton backend in its tail kernel)."""
        codes, scales = self.keys(state)
        return state.ops.fp8_block_scores(
            state.q, codes, scales, state.block_table, state.seq_lens, state.start, state.scale, self.sink,
            self.window,
        )  # fmt: skip
