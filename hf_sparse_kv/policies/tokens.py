"""TokenTopK: exact per-token top-k, the sparse-index method (and the token-level oracle)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import DecodeState, Policy, Selection, budget_tokens, check_budget, check_count


@dataclass
class TokenTopK(Policy):
    """Keep the ``budget`` tokens with the largest ``q . k`` (max over the GQA group), plus sink and window.

    Scores every key (like a sparse indexer, e.g. DeepSeek's DSA, https://arxiv.org/abs/2512.02556), then reads
    only the chosen tokens. Runs in ``"token"`` and ``"mask"`` modes; in ``"block"`` mode it would read whole blocks
    and change its meaning, so patching refuses that combination.
    """

    budget: int | float = 0.125
    sink: int = 4
    window: int = 32

    granularity: ClassVar[str] = "token"

    def __post_init__(self) -> None:
        check_budget(self.budget)
        check_count(self.sink, "sink")
        check_count(self.window, "window")

    def select(self, state: DecodeState) -> Selection:
        tokens = budget_tokens(self.budget, state.length)
        if tokens >= state.length:
            return self.dense_selection(state)
        s = state.ops.token_scores(state.q, state.k_pool, state.block_table, state.seq_lens, state.start)
        pos = torch.arange(state.length, device=s.device).view(1, -1)
        sink_end, win_start = self.forced_positions(state, self.sink, self.window)
        forced = ((pos >= state.start.view(-1, 1)) & (pos < sink_end.view(-1, 1))) | (pos >= win_start.view(-1, 1))
        forced = forced | (pos >= (state.length - 1) // state.block_size * state.block_size)  # current block
        s = s.masked_fill(forced.unsqueeze(1) & (s > float("-inf")), float("inf"))
        k = max(tokens, int(forced.sum(-1).max()))
        lo, hi = self.empty_interval(state)
        return Selection("token", state.ops.topk_indices(s, k), lo, hi)
