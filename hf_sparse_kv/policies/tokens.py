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
        lens = state.seq_lens.long()
        tokens = budget_tokens(self.budget, lens)  # [B]
        if bool((tokens >= lens).all()):
            return self.dense_selection(state)
        s = state.ops.token_scores(state.q, state.k_pool, state.block_table, state.seq_lens, state.start)
        pos = torch.arange(s.shape[-1], device=s.device).view(1, -1)
        sink_end, win_start = self.forced_positions(state, self.sink, self.window)
        current = (lens - 1) // state.block_size * state.block_size  # start of the current block
        forced = ((pos >= state.start.view(-1, 1)) & (pos < sink_end.view(-1, 1))) | (
            pos >= torch.minimum(win_start, current).view(-1, 1)
        )
        s = s.masked_fill(forced.unsqueeze(1) & (s > float("-inf")), float("inf"))
        k = torch.where(tokens >= lens, lens, torch.maximum(tokens, (forced & (pos < lens.view(-1, 1))).sum(-1)))
        lo, hi = self.empty_interval(state)
        return Selection("token", state.ops.topk_indices(s, int(k.max()), k), lo, hi)
