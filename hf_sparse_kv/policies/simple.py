"""Position-only policies: Dense (everything) and SinkWindow (StreamingLLM's sink + recent window)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import DecodeState, Policy, Selection, budget_tokens, check_budget, check_count


@dataclass
class Dense(Policy):
    """Attend to the whole context: a patched model under ``Dense()`` reproduces the unpatched model."""

    granularity: ClassVar[None] = None

    def select(self, state: DecodeState) -> Selection:
        return self.dense_selection(state)


@dataclass
class SinkWindow(Policy):
    """StreamingLLM: the first ``sink`` tokens and the most recent ``window`` tokens, token-exact in every mode.

    Paper: Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024
    (https://arxiv.org/abs/2309.17453). Give ``window`` (tokens) or ``budget`` (tokens or a fraction; then
    ``window = budget - sink``). The blocks holding the sink and the window are read whole and masked inside, so the
    block and token modes attend exactly the same tokens as the mask mode.
    """

    sink: int = 4
    window: int | None = None
    budget: int | float | None = None

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

    def window_tokens(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """``[B]`` long: the window of each sequence."""
        if self.window is not None:
            return torch.full_like(seq_lens, self.window, dtype=torch.long)
        return (budget_tokens(self.budget, seq_lens) - self.sink).clamp(min=1)

    def select(self, state: DecodeState) -> Selection:
        window = self.window_tokens(state.seq_lens)
        if bool((self.sink + window >= state.seq_lens).all()):
            return self.dense_selection(state)
        forced = self.forced_blocks(state, self.sink, window)  # [B, nblk]
        counts = forced.sum(-1)
        # the forced blocks as ascending ids: score them 1, the rest -inf, keep them all
        scores = forced.float().masked_fill(~forced, float("-inf")).unsqueeze(1).expand(-1, state.num_kv_heads, -1)
        sink_end, win_start = self.forced_positions(state, self.sink, window)
        indices = state.ops.topk_indices(scores.contiguous(), int(counts.max()), counts)
        return Selection("block", indices, sink_end.int(), win_start.int())
