"""Block-granular top-k policies: Quest, BlockTopK (mean key) and OracleBlockTopK (true attention mass)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import DecodeState, Policy, Selection, budget_blocks, check_budget, check_count
from .checks import warn_budget_below_forced


@dataclass
class _BlockTopK(Policy):
    """Shared logic: keep sink, window and current block, fill the rest of the budget with the best-scored blocks.

    The budget is rounded down to whole blocks (at least the forced ones); the selection is ``[B, Hkv, K]`` logical
    block numbers, ascending, one set per KV head from the scores pooled over its query heads.

    The sink, the window and the current block are always read, so the budget is at least ``sink + window`` tokens
    (more in whole blocks): an int budget below it reads what ``budget=sink + window`` reads, and constructing such a
    policy warns with that effective budget. A fraction of the context does the same, silently, at every context
    shorter than ``(sink + window) / budget`` tokens (e.g. 288 tokens at 1/8 with the defaults): at short contexts
    sink and window dominate.
    """

    budget: int | float = 0.125
    sink: int = 4
    window: int = 32

    granularity: ClassVar[str] = "block"

    def __post_init__(self) -> None:
        check_budget(self.budget)
        check_count(self.sink, "sink")
        check_count(self.window, "window")
        warn_budget_below_forced(type(self).__name__, self.budget, self.sink, self.window)

    def scores(self, state: DecodeState) -> torch.Tensor:  # pragma: no cover - abstract
        """``[B, Hkv, nblk]`` float32, higher is better, ``-inf`` for blocks not in use, ``+inf`` for the sink, window
        and current blocks (which the top-k must keep)."""
        raise NotImplementedError

    def plan(self, lens: tuple[int, ...], block_size: int) -> list[int] | None:
        """Blocks to keep per sequence (``None``: every sequence keeps all its blocks), decided on the host."""
        counts, dense = [], True
        for n in lens:
            keep, nblk = budget_blocks(self.budget, self.sink, self.window, n, block_size)
            counts.append(keep)
            dense = dense and keep >= nblk
        return None if dense else counts

    def select(self, state: DecodeState) -> Selection:
        counts = self.widths(state)
        if counts is None:
            return self.dense_selection(state)
        if state.evicted is not None:  # never more than the blocks still held (freed ones score -inf)
            counts = counts.at_most(state.live_blocks())
        indices = state.ops.topk_indices(self.scores(state), counts.width, counts.tensor(state.q.device))
        # nothing masked inside the blocks: an empty interval (any equal bounds), without allocating one
        return Selection("block", indices, state.start, state.start, counts.per_sequence())

    def metadata_scores(self, state: DecodeState, method: str) -> torch.Tensor:
        """:meth:`scores` from the block metadata (``"quest"``: min and max, or ``"mean"``), forced blocks set by the
        same op."""
        kmin, kmax, kmean = metadata_operands(state, method)
        return state.ops.block_scores(
            state.q, kmin, kmax, kmean, state.block_table, state.seq_lens, state.block_size, method, state.start,
            self.sink, self.window,
        )  # fmt: skip


def metadata_operands(state: DecodeState, method: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(kmin, kmax, kmean)`` for ``block_scores(..., method)``: the metadata ``method`` reads (``"quest"``: min and
    max, ``"mean"``: the mean), the op's other operands filled with one of them (it never reads those): a cache keeps
    only the metadata its policy names (:meth:`~.base.Policy.key_metadata`)."""
    if method == "quest":
        return state.kmin, state.kmax, state.kmin
    return state.kmean, state.kmean, state.kmean


@dataclass
class Quest(_BlockTopK):
    """Quest: rank blocks by the upper bound ``sum_d max(q_d min_d, q_d max_d)`` over their key min/max.

    Paper: Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024
    (https://arxiv.org/abs/2406.10774). Args: ``budget`` (tokens or fraction), ``sink``, ``window`` (tokens).
    """

    def key_metadata(self) -> tuple[str, ...]:
        return ("kmin", "kmax")

    def scores(self, state: DecodeState) -> torch.Tensor:
        return self.metadata_scores(state, "quest")


@dataclass
class BlockTopK(_BlockTopK):
    """Representative-key retrieval: rank blocks by ``q . mean key`` of the block (as in InfLLM-style methods,
    https://arxiv.org/abs/2402.04617). Args as :class:`Quest`."""

    def key_metadata(self) -> tuple[str, ...]:
        return ("kmean",)

    def scores(self, state: DecodeState) -> torch.Tensor:
        return self.metadata_scores(state, "mean")


@dataclass
class OracleBlockTopK(_BlockTopK):
    """The oracle of any block method: rank blocks by their true softmax mass (summed over the GQA group).

    Reads every key to score, so it is for evaluation (hit rates, upper bounds), never a fast path.
    """

    def key_metadata(self) -> tuple[str, ...]:
        return ()

    def mass(self, state: DecodeState) -> torch.Tensor:
        """``[B, Hkv, nblk]`` the softmax mass of each block, ``-inf`` for blocks not in use."""
        return state.ops.oracle_block_scores(
            state.q, state.k_pool, state.block_table, state.seq_lens, state.start, state.scale, state.length
        )

    def scores(self, state: DecodeState) -> torch.Tensor:
        s = self.mass(state)
        forced = self.forced_blocks(state, self.sink, self.window)  # [B, nblk]
        return s.masked_fill(forced.unsqueeze(1) & (s > float("-inf")), float("inf"))
