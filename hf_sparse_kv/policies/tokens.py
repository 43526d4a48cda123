"""TokenTopK: exact per-token top-k, the sparse-index method (and the token-level oracle)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..ops.layout import forced_token_count, forced_token_mask
from .base import DecodeState, Policy, Selection, budget_tokens, check_budget, check_count
from .checks import warn_budget_below_forced


@dataclass
class TokenTopK(Policy):
    """Keep the ``budget`` tokens with the largest ``q . k`` (max over the GQA group), plus sink and window.

    Scores every key (like a sparse indexer, e.g. DeepSeek's DSA, https://arxiv.org/abs/2512.02556), then reads
    only the chosen tokens. Runs in ``"token"`` and ``"mask"`` modes; in ``"block"`` mode it would read whole blocks
    and change its meaning, so patching refuses that combination.

    The sink, the window and the current block are always kept: an int budget below ``sink + window`` reads what
    ``budget=sink + window`` reads (constructing it warns); a fraction does so at contexts shorter than
    ``(sink + window) / budget``.
    """

    budget: int | float = 0.125
    sink: int = 4
    window: int = 32

    granularity: ClassVar[str] = "token"

    def __post_init__(self) -> None:
        check_budget(self.budget)
        check_count(self.sink, "sink")
        check_count(self.window, "window")
        warn_budget_below_forced(type(self).__name__, self.budget, self.sink, self.window)

    def key_metadata(self) -> tuple[str, ...]:
        return ()

    def plan(self, lens: tuple[int, ...], block_size: int) -> list[int] | None:
        """Tokens to keep per sequence (``None``: every sequence keeps everything), decided on the host."""
        counts = []
        for n in lens:
            tokens = budget_tokens(self.budget, n)
            forced = forced_token_count(n, self.sink, self.window, block_size)
            counts.append(n if tokens >= n else min(max(tokens, forced), n))
        return None if all(c >= n for c, n in zip(counts, lens)) else counts

    def token_scores(self, state: DecodeState) -> torch.Tensor:
        """``[B, Hkv, N]`` float32 per position (``N >= max(lens)``): ``-inf`` where invalid, ``+inf`` for the forced
        positions (sink, window, current block), else the exact ``q . k`` (max over the GQA group)."""
        s = state.ops.token_scores(state.q, state.k_pool, state.block_table, state.seq_lens, state.start, state.length)
        forced = forced_token_mask(state.seq_lens, state.start, self.sink, self.window, state.block_size, s.shape[-1])
        return s.masked_fill(forced.unsqueeze(1) & (s > float("-inf")), float("inf"))

    def select(self, state: DecodeState) -> Selection:
        counts = self.widths(state)
        if counts is None:
            return self.dense_selection(state)
        if state.evicted is not None:  # never more than the tokens still held (freed ones score -inf)
            counts = counts.at_most(state.live_tokens())
        s = self.token_scores(state)
        indices = state.ops.topk_indices(s, counts.width, counts.tensor(state.q.device))
        return Selection("token", indices, state.start, state.start, counts.per_sequence())  # an empty masked interval
