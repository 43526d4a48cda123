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
  both pools). With candidates covering every block and ``p = 1`` it selects what the oracle selects.

Per (sequence, KV head) the forced blocks come first, then the blocks by decreasing mass while the mass of those
ranked above stays below ``p``; at most the budget's blocks. Heads whose attention is concentrated read a few
blocks, flat heads read up to the budget.

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
    scores maxed over the GQA group) or ``"heads"`` (each query head's mass, averaged over the group: the oracle's
    criterion on the candidates).
    """

    p: float = 0.9
    pool: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.p, bool) or not isinstance(self.p, (int, float)) or not 0 < self.p <= 1:
            raise ValueError(f"p must lie in (0, 1] (the attention mass to cover), got {self.p!r}")
        if self.pool not in POOLS:
            raise ValueError(
                f"pool must be one of {POOLS} (the mass of the group's max score, or each query head's mass averaged "
                f"over the group), got {self.pool!r}"
            )

    def mass(self, state: DecodeState, cand: torch.Tensor) -> torch.Tensor:
        """Each candidate block's share of the candidates' softmax mass: ``cand [B, Hkv, C]`` -> ``[B, Hkv, C]``
        float32, summing to 1 per (sequence, KV head) (0 for padding slots and blocks without a valid token; a row
        without any valid token is all 0)."""
        B, H, C = cand.shape
        args = (state.q, state.k_pool, state.block_table, state.seq_lens, state.start, cand)
        if self.pool == "max":
            # [B, Hkv, C] each candidate's log-sum-exp of its tokens' scaled scores (-inf: padding, no valid token)
            lse = state.ops.candidate_scores(*args, reduce="mass", scale=state.scale)
            return lse.softmax(-1).nan_to_num(0.0)
        # [B, Hq, C] the same per query head; each head's shares, averaged over the group's G heads
        lse = state.ops.candidate_scores(*args, reduce="head_mass", scale=state.scale)
        return lse.softmax(-1).nan_to_num(0.0).view(B, H, lse.shape[1] // H, C).mean(2)

    def select(self, state: DecodeState) -> Selection:
        found = self.candidate_blocks(state)
        if found is None:
            return self.dense_selection(state)
        counts, cand = found
        B, H, C = cand.shape
        mass = self.mass(state, cand)  # [B, Hkv, C]
        forced = self.forced_blocks(state, self.sink, self.window)  # [B, nblk]
        f = forced.gather(1, cand.long().clamp(min=0).view(B, -1)).view(B, H, C) & (cand >= 0)
        key = mass.masked_fill(f, float("inf")).masked_fill(cand < 0, float("-inf"))
        if self.p < 1:
            order = key.argsort(-1, descending=True)
            ranked = mass.gather(-1, order)
            above = ranked.cumsum(-1) - ranked  # the mass of the blocks ranked above each one
            keep = (above < self.p) | f.gather(-1, order)
            keep = torch.zeros_like(keep).scatter(-1, order, keep)
            key = key.masked_fill(~keep, float("-inf"))
        blocks = pick(state.ops, key, cand, counts, state)
        return Selection("block", blocks, state.start, state.start, tuple(counts))
