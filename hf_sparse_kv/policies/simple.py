"""Position-only policies: Dense (everything) and SinkWindow (StreamingLLM's sink + recent window)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..ops.layout import forced_block_count, window_bounds
from .base import DecodeState, Policy, Selection, budget_tokens, check_budget, check_count
from .checks import warn_budget_below_forced


@dataclass
class Dense(Policy):
    """Attend to the whole context: a patched model under ``Dense()`` reproduces the unpatched model."""

    granularity: ClassVar[None] = None

    def key_metadata(self) -> tuple[str, ...]:
        return ()

    def plan(self, lens: tuple[int, ...], block_size: int) -> None:
        return None

    def select(self, state: DecodeState) -> Selection:
        return self.dense_selection(state)


@dataclass
class SinkWindow(Policy):
    """StreamingLLM: the first ``sink`` tokens and the most recent ``window`` tokens, token-exact in every mode.

    Paper: Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024
    (https://arxiv.org/abs/2309.17453). Give ``window`` (tokens) or ``budget`` (tokens or a fraction; then
    ``window = budget - sink``). The blocks holding the sink and the window are read whole and masked inside, so the
    block and token modes attend exactly the same tokens as the mask mode. With ``evict=True`` the blocks that
    leave the window are freed (StreamingLLM proper): KV memory stays flat however long the generation runs; every
    layer must then be sparse (``dense_layers=()``), as a dense layer would need the freed tokens.

    The window holds at least the current token: an int ``budget`` below ``sink + 1`` reads what ``budget=sink + 1``
    reads (constructing it warns); a fraction does so at contexts shorter than ``(sink + 1) / budget``.
    """

    sink: int = 4
    window: int | None = None
    budget: int | float | None = None
    evict: bool = False

    granularity: ClassVar[str] = "block"

    def __post_init__(self) -> None:
        check_count(self.sink, "sink")
        if (self.window is None) == (self.budget is None):
            raise ValueError("SinkWindow needs exactly one of window (tokens) or budget (tokens or a fraction)")
        if self.window is not None:
            if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
                raise ValueError(f"window must be a positive int (tokens), got {self.window!r}")
        else:
            check_budget(self.budget)
            warn_budget_below_forced(type(self).__name__, self.budget, self.sink, 1)

    @property
    def frees_blocks(self) -> bool:
        return self.evict

    def key_metadata(self) -> tuple[str, ...]:
        return ()

    def check_patch(self, mode: str, dense_layers: tuple[int, ...]) -> None:
        super().check_patch(mode, dense_layers)
        if self.evict and dense_layers:
            raise ValueError(
                "SinkWindow(evict=True) frees the tokens that leave the window, which a dense layer still needs: "
                "pass dense_layers=() with it (or use evict=False)."
            )

    def release(self, cache, lens: tuple[int, ...], observation) -> None:
        """With ``evict=True``: free the blocks behind the window (:meth:`evictable`)."""
        if self.evict:
            cache.evict(self.evictable(lens, cache.block_size))

    def budget_fraction(self, context: int) -> float | None:
        if self.window is not None:
            return min(1.0, (self.sink + self.window) / max(context, 1))
        return super().budget_fraction(context)

    def evictable(self, lens: tuple[int, ...], block_size: int) -> list[tuple[int, int]]:
        """Per sequence, the span ``[sink end, window start)`` no later step will attend (the window only moves
        forward, also for a fractional budget: its start ``n - ceil(f n) + sink`` never decreases);
        :meth:`PagedKVCache.evict` frees the blocks wholly inside it."""
        return [window_bounds(n, self.sink, self.window_tokens(n)) for n in lens]

    def window_tensor(self, state: DecodeState) -> torch.Tensor | int:
        """The window of each sequence computed on the device from ``state.seq_lens`` (as :meth:`window_tokens`)."""
        if self.window is not None:
            return self.window
        if isinstance(self.budget, float):
            tokens = torch.ceil(self.budget * state.seq_lens.double()).long().clamp(min=1)
        else:
            tokens = torch.full_like(state.seq_lens, self.budget, dtype=torch.long)
        return (tokens - self.sink).clamp(min=1)

    def window_tokens(self, length: int) -> int:
        """The window at context ``length``."""
        if self.window is not None:
            return self.window
        return max(1, budget_tokens(self.budget, length) - self.sink)

    def plan(self, lens: tuple[int, ...], block_size: int) -> list[int] | None:
        """Blocks read per sequence (``None``: sink and window cover every sequence), decided on the host."""
        windows = [self.window_tokens(n) for n in lens]
        if all(self.sink + w >= n for n, w in zip(lens, windows)):
            return None
        return [forced_block_count(n, self.sink, w, block_size) for n, w in zip(lens, windows)]

    def select(self, state: DecodeState) -> Selection:
        counts = self.widths(state)
        if counts is None:
            return self.dense_selection(state)
        forced = self.forced_blocks(state, self.sink, self.window_tensor(state))  # [B, nblk]
        # the forced blocks as ascending ids: score them 1, the rest -inf, keep them all
        scores = forced.float().masked_fill(~forced, float("-inf")).unsqueeze(1).expand(-1, state.num_kv_heads, -1)
        sink_end, win_start = self.forced_positions(state, self.sink, self.window_tensor(state))
        indices = state.ops.topk_indices(scores.contiguous(), counts.width, counts.tensor(state.q.device))
        return Selection("block", indices, sink_end.int(), win_start.int(), counts.per_sequence())
