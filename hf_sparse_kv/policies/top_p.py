"""Budget by attention mass (Twilight-style top-p) over a two-stage selector's exact candidate scores.

Twilight (Lin et al., https://arxiv.org/abs/2502.02770) keeps, per head, the fewest tokens whose estimated
attention weights reach ``p``, with the selector's budget as a cap. Here the estimate is exact on the candidates:
the coarse pass of :class:`~.two_stage.TwoStageBlockTopK` keeps ``candidates x budget`` blocks, and the softmax of
the candidates' tokens' exact scores gives each candidate block's share of their mass. How the GQA group's query
heads share one KV head's selection is ``pool``:

- ``"max"``: each token's score is the max over the group of ``scale * q . k``; ``candidate_scores(reduce="mass")``
  gives each candidate's log-sum-exp over its tokens in one launch (the per-token scores never reach memory), and
  their softmax over the candidates is the block's share;
- ``"heads"``: the oracle's criterion (:class:`~.blocks.OracleBlockTopK`, ``oracle_block_scores``) restricted to the
  candidates: ``candidate_scores(reduce="head_mass")`` gives the log-sum-exp per query head (``[B, Hq, C]``), the
  softmax over the candidates per query head is that head's share, and a block's mass is the mean of its shares over
  the group's ``G`` heads (the oracle's sum over the group, divided by ``G`` so that ``p`` is the same fraction in
  both pools). With candidates covering every block and ``p = 1`` it selects what the oracle selects. The default:
  measured (evaluation/RESULTS.md, 2026-11-30) ``candidates=8, p=1`` with it is within 0.15 % of the oracle's
  perplexity on SmolLM2 4K / 8K and Qwen2.5-1.5B 32K and within 1 % on Gemma-3 32K, where ``"max"`` is 0.4 / 0.05 /
  0.7 % and 27 % from it, for ~4 % more selection time.

Per (sequence, KV head) the forced blocks come first, then the blocks by decreasing mass while the mass of those
ranked above stays below ``p``; at most the budget's blocks. Heads whose attention is concentrated read a few
blocks, flat heads read up to the budget.

What runs per layer and step: the coarse pass (``block_scores`` or ``projected_scores``, ``topk_indices``: the
candidates), ``candidate_scores`` (the candidates' log-sum-exps), ``candidate_mass`` (one launch: the softmax over
the candidates per row, averaged over the group, and the ranking key, ``+inf`` at the forced blocks by
``ops/layout.py``'s rule and ``-inf`` at padding), then ``topk_indices`` on the key and a gather of the picked
blocks (:func:`~.two_stage.pick`). With ``p < 1``, between the last two, a sort of the key, the cumulative mass in
that order and a mask (a handful of torch ops).

The selection's width is the budget's (planned on the host, as every policy's); the blocks top-p leaves out are
``-1`` entries, which the kernels skip, so ``Selection.counts`` (and the bytes the attention counts from it) is an
upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import DecodeState, Selection
from .two_stage import TwoStageBlockTopK, pick

POOLS = ("max", "heads")


@dataclass
class TopPBlockTopK(TwoStageBlockTopK):
    """:class:`TwoStageBlockTopK` whose budget is a cap: per KV head, the forced blocks and then the candidate
    blocks by decreasing mass until the blocks ranked above hold ``p`` of the candidates' mass.

    Args: as :class:`TwoStageBlockTopK`, ``p`` in (0, 1] (``p = 1``: the budget's blocks, ranked by their mass
    where :class:`TwoStageBlockTopK` ranks by their best token) and ``pool``: ``"max"`` (the mass of the tokens'
    scores maxed over the GQA group) or ``"heads"`` (the default: each query head's mass, averaged over the group, the
    oracle's criterion on the candidates).
    """

    p: float = 0.9
    pool: str = "heads"

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.p, bool) or not isinstance(self.p, (int, float)) or not 0 < self.p <= 1:
            raise ValueError(f"p must lie in (0, 1] (the attention mass to cover), got {self.p!r}")
        if self.pool not in POOLS:
            raise ValueError(
                f"pool must be one of {POOLS} (the mass of the group's max score, or each query head's mass averaged "
                f"over the group), got {self.pool!r}"
            )

    def lse(self, state: DecodeState, cand: torch.Tensor) -> torch.Tensor:
        """The candidates' log-sum-exps, one launch: ``cand [B, Hkv, C]`` -> ``[B, Hkv, C]`` (``pool="max"``: of
        the tokens' scores maxed over the group) or ``[B, Hq, C]`` (``"heads"``: per query head) float32, ``-inf``
        for padding slots and blocks without a valid token."""
        reduce = "mass" if self.pool == "max" else "head_mass"
        args = (state.q, state.k_pool, state.block_table, state.seq_lens, state.start, cand)
        return state.ops.candidate_scores(*args, reduce=reduce, scale=state.scale)

    def mass_and_key(self, state: DecodeState, cand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cand [B, Hkv, C]`` -> ``(mass, key)``, each ``[B, Hkv, C]`` float32 (``ops.candidate_mass``): each
        candidate block's share of the candidates' softmax mass, summing to 1 per (sequence, KV head) (0 for
        padding slots and blocks without a valid token; a row without any valid token is all 0), and the ranking
        key: ``+inf`` for the forced blocks, ``-inf`` for padding slots, the mass elsewhere."""
        lse = self.lse(state, cand)
        return state.ops.candidate_mass(
            lse, cand, state.seq_lens, state.start, state.block_size, self.sink, self.window
        )

    def select(self, state: DecodeState) -> Selection:
        found = self.candidate_blocks(state)
        if found is None:
            return self.dense_selection(state)
        counts, cand = found
        mass, key = self.mass_and_key(state, cand)  # [B, Hkv, C] each
        if self.p < 1:
            forced = key == float("inf")
            order = key.argsort(-1, descending=True)
            ranked = mass.gather(-1, order)
            above = ranked.cumsum(-1) - ranked  # the mass of the blocks ranked above each one
            keep = torch.zeros_like(forced).scatter(-1, order, above < self.p) | forced
            key = key.masked_fill(~keep, float("-inf"))
        blocks = pick(state.ops, key, cand, counts, state)
        return Selection("block", blocks, state.start, state.start, counts.per_sequence())
