"""Budget by attention mass (Twilight-style top-p) over a two-stage selector's exact candidate scores.

Twilight (Lin et al., https://arxiv.org/abs/2502.02770) keeps, per head, the fewest tokens whose estimated
attention weights reach ``p``, with the selector's budget as a cap. Here the estimate is exact on the candidates:
the coarse pass of :class:`~.two_stage.TwoStageBlockTopK` keeps ``candidates x budget`` blocks, and the softmax of
the candidates' tokens' exact scores (``scale * q . k``, max over the GQA group) gives each candidate block's share of
their mass. ``candidate_scores(reduce="mass")`` gives each candidate's log-sum-exp over its tokens in one launch (the
per-token scores never reach memory); their softmax over the candidates is that share. Per (sequence, KV head) the
forced blocks come first, then the blocks by decreasing mass while the mass of those ranked above stays below ``p``;
at most the budget's blocks. Heads whose attention is concentrated read a few blocks, flat heads read up to the
budget.

The selection's width is the budget's (planned on the host, as every policy's); the blocks top-p leaves out are
``-1`` entries, which the kernels skip, so ``Selection.counts`` (and the bytes the attention counts from it) is an
upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import DecodeState, Selection
from .two_stage import TwoStageBlockTopK, pick


@dataclass
class TopPBlockTopK(TwoStageBlockTopK):
    """:class:`TwoStageBlockTopK` whose budget is a cap: per KV head, the forced blocks and then the candidate
    blocks by decreasing mass until the blocks ranked above hold ``p`` of the candidates' mass.

    Args: as :class:`TwoStageBlockTopK`, and ``p`` in (0, 1] (``p = 1``: the budget's blocks, ranked by their mass
    where :class:`TwoStageBlockTopK` ranks by their best token).
    """

    p: float = 0.9

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.p, bool) or not isinstance(self.p, (int, float)) or not 0 < self.p <= 1:
            raise ValueError(f"p must lie in (0, 1] (the attention mass to cover), got {self.p!r}")

    def select(self, state: DecodeState) -> Selection:
        found = self.candidate_blocks(state)
        if found is None:
            return self.dense_selection(state)
        counts, cand = found
        B, H, C = cand.shape
        # [B, Hkv, C] each candidate's log-sum-exp of its tokens' scaled scores (-inf: padding, no valid token)
        lse = state.ops.candidate_scores(
            state.q, state.k_pool, state.block_table, state.seq_lens, state.start, cand,
            reduce="mass", scale=state.scale,
        )  # fmt: skip
        # each candidate block's share of the candidates' softmax mass: [B, Hkv, C] (0 for padding)
        mass = lse.softmax(-1).nan_to_num(0.0)
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
