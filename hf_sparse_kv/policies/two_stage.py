"""Two-stage selectors: a cheap coarse pass keeps ``candidates x budget`` blocks, exact ``q . k`` over only their keys
picks the budget.

The coarse pass is Quest's bound over the block min/max (``coarse="quest"``: the max of the bounds over the GQA
group, ``ops.block_scores``; ``"quest_heads"``: each query head's bounds turned into its estimated shares of the
softmax mass, averaged over the group as the oracle sums the true shares; ``"quest_heads_max"``: those shares' max
over the group; ``ops.block_shares``, no Triton kernel yet; none needs extra state), the compressed keys of
:mod:`.projected` (``coarse="projected"``, with a ``calibration``) or the product-quantized keys of :mod:`.product`
(``coarse="pq"``, with a ``calibration`` of centres: each block's mass under the coded keys, ``ops.pq_block_scores``);
the forced blocks (sink, window, current) score ``+inf`` there, so they are always candidates. The exact pass
(``ops.candidate_scores``) reads the candidates' keys, ``candidates x budget x D`` elements per (sequence, KV head),
and

- :class:`TwoStageBlockTopK` ranks the candidate blocks by the max of their tokens' exact scores (max over the GQA
  group) and keeps the budget's blocks;
- :class:`TwoStageTokenTopK` keeps the budget's best tokens among the candidates' (plus sink and window).

The coarse pass then only has to put the right blocks among ``c x`` as many; the exact pass costs ``c x budget`` of
the keys' bytes on top of the attention's read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..ops.layout import cdiv, forced_block_bound, forced_block_count, forced_block_mask, window_positions
from .base import Counts, DecodeState, Selection, StateSpec, int_max, int_min
from .blocks import _BlockTopK, metadata_operands
from .product import ProductCodes
from .projected import CompressedKeys
from .tokens import TokenTopK

COARSE = ("quest", "quest_heads", "quest_heads_max", "projected", "pq")
SHARE_POOL = {"quest_heads": "mean", "quest_heads_max": "max"}  # coarse -> ops.block_shares' pool


class CoarsePass:
    """The first stage: per (sequence, KV head) the ``cand_counts[b]`` best blocks by the coarse score."""

    def __init__(self, coarse: str, candidates: float, calibration, owner: str):
        if coarse not in COARSE:
            raise ValueError(f"coarse must be one of {COARSE}, got {coarse!r}")
        if isinstance(candidates, bool) or not isinstance(candidates, (int, float)) or candidates < 1:
            raise ValueError(
                f"candidates must be a number >= 1 (candidate blocks per budget block), got {candidates!r}"
            )
        self.coarse, self.candidates = coarse, candidates
        self.keys = CompressedKeys(calibration, owner) if coarse == "projected" else None
        self.codes = ProductCodes(calibration, owner) if coarse == "pq" else None

    def cache_state(self) -> tuple[StateSpec, ...]:
        specs = (self.keys.spec,) if self.keys is not None else ()
        return specs + (self.codes.specs if self.codes is not None else ())

    def key_metadata(self) -> tuple[str, ...]:
        """The blocks' min / max for Quest's bound and the pooled shares, nothing for compressed keys and codes."""
        return () if self.keys is not None or self.codes is not None else ("kmin", "kmax")

    def scores(self, state: DecodeState, sink: int, window: int) -> torch.Tensor:
        """``[B, Hkv, nblk]`` float32, forced blocks ``+inf``, blocks not in use ``-inf``."""
        if self.coarse in SHARE_POOL:
            return state.ops.block_shares(
                state.q, state.kmin, state.kmax, state.block_table, state.seq_lens, state.block_size, state.scale,
                SHARE_POOL[self.coarse], state.start, sink, window,
            )  # fmt: skip
        if self.codes is not None:
            return self.codes.scores(state, sink, window)
        if self.keys is None:
            return state.ops.block_scores(
                state.q, *metadata_operands(state, "quest"), state.block_table, state.seq_lens, state.block_size,
                "quest", state.start, sink, window,
            )  # fmt: skip
        q, qproj, ckeys = self.keys.scoring_inputs(state)
        return state.ops.projected_scores(
            q, ckeys, state.block_table, state.seq_lens, state.start, "block", sink, window, qproj=qproj
        )

    def width(self, blocks: int) -> int:
        """``ceil(candidates x blocks)``: the candidates a sequence wants for a selection of ``blocks`` blocks (on the
        host; before the floor of its forced blocks). An int ``candidates`` multiplies ints only (a symbolic
        ``blocks`` stays symbolic under ``torch.compile``, where a float product would specialise it)."""
        if type(self.candidates) is int:
            return self.candidates * blocks
        return math.ceil(self.candidates * blocks)

    def device_width(self, blocks: torch.Tensor) -> torch.Tensor:
        """:meth:`width` on the device: ``blocks [B]`` long -> ``[B]`` long. A float ``candidates`` in float64, so
        that it is what the host computes: Python multiplies the float by the int in float64 and ``math.ceil``
        rounds that product up (exact for every count below 2**53)."""
        if type(self.candidates) is int:
            return blocks * self.candidates
        return torch.ceil(blocks.double() * self.candidates).long()

    def counts(
        self,
        state: DecodeState,
        blocks: Counts,
        sink: int,
        window: int,
        planned: int | None = None,
        covers_forced: bool = False,
    ) -> tuple[int, torch.Tensor | None]:
        """Candidate blocks per sequence: ``candidates x blocks[b]`` (:meth:`width`), at least its forced blocks
        (which the coarse scores hold at ``+inf``: all of them must be candidates), at most those it holds. Returns
        the width ``C`` of the candidates and the counts for ``topk_indices`` (``None``: ``C`` each).

        The eager step counts on the host from its lengths. A static step has the counts on the device only
        (``blocks.device``: :meth:`device_width` of them) and on the host the reserved bounds (``state.lens``) and
        ``planned``, :meth:`width` of ``blocks.width`` (the most any sequence wants: :meth:`width` does not
        decrease). It takes as width that, at least a bound of the forced blocks (``forced_block_bound``; what topk
        adds past a sequence's blocks is ``-1``, since scores past them are ``-inf``), and counts the forced blocks on
        the device unless ``covers_forced`` says that every ``blocks[b]`` holds them already (a block policy's plan
        keeps its forced blocks)."""
        BS = state.block_size
        if blocks.host is not None:
            want = [self.width(k) for k in blocks.host]
            floor = [forced_block_count(n, sink, window, BS) for n in state.lens]
            counts = Counts.of([min(live, max(f, w)) for w, f, live in zip(want, floor, state.live_blocks())])
            return counts.width, counts.tensor(state.q.device)
        width = int_min(state.num_blocks, int_max(planned, forced_block_bound(sink, window, BS)))
        want = self.device_width(blocks.device)  # [B]
        if covers_forced:
            return width, want
        forced = forced_block_mask(state.seq_lens, state.start, sink, window, BS, state.num_blocks).sum(-1)  # [B]
        return width, torch.maximum(forced, want)

    def select(
        self, state: DecodeState, blocks: Counts, sink: int, window: int, planned: int | None, covers_forced: bool
    ) -> torch.Tensor:
        """``[B, Hkv, C]`` candidate logical blocks for a selection of ``blocks`` blocks (:meth:`counts`),
        ascending, ``-1`` padded."""
        scores = self.scores(state, sink, window)
        width, counts = self.counts(state, blocks, sink, window, planned, covers_forced)
        return state.ops.topk_indices(scores, width, counts)


def pick(ops, scores: torch.Tensor, items: torch.Tensor, counts: Counts, state: DecodeState) -> torch.Tensor:
    """The ``counts`` best ``items [B, Hkv, N]`` by ``scores [B, Hkv, N]``, ascending (items ascend), ``-1``
    padded: ``[B, Hkv, counts.width]`` int32."""
    slots = ops.topk_indices(scores, counts.width, counts.tensor(state.q.device)).long()
    picked = items.long().gather(-1, slots.clamp(min=0))
    return torch.where(slots >= 0, picked, -1).int()


@dataclass
class _TwoStage:
    """What both two-stage policies add to their base: the ``candidates``, ``coarse`` and ``calibration``
    arguments, the :class:`CoarsePass` they make, and its state (a mixin: listed before the policy base)."""

    candidates: float = 4
    coarse: str = "quest"
    calibration: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._coarse = CoarsePass(self.coarse, self.candidates, self.calibration, type(self).__name__)

    def cache_state(self) -> tuple[StateSpec, ...]:
        return self._coarse.cache_state()

    def key_metadata(self) -> tuple[str, ...]:
        return self._coarse.key_metadata()

    @property
    def fits_to_the_batch(self) -> bool:
        """Product-quantized coarse codes whose centres are fitted at the prefill fit them on the whole batch."""
        return self._coarse.codes is not None and bool(self._coarse.codes.fit_sizes)

    def coarse_blocks(self, width: int, block_size: int) -> int:  # pragma: no cover - abstract
        """The blocks the coarse pass sizes its candidates by, for a selection ``width`` wide."""
        raise NotImplementedError

    def static_widths(self, counts: list[int], block_size: int) -> tuple[int, ...]:
        """The selection's width (the base policy's, :meth:`Policy.static_widths`) and, with a float ``candidates``,
        the coarse pass's (:meth:`CoarsePass.width` of :meth:`coarse_blocks`): see :meth:`candidates_of`."""
        (width,) = super().static_widths(counts, block_size)
        if type(self.candidates) is int:
            return (width,)
        return width, self._coarse.width(self.coarse_blocks(width, block_size))

    def candidates_of(self, state: DecodeState, blocks: Counts, covers_forced: bool) -> torch.Tensor:
        """The coarse pass's ``[B, Hkv, C]`` candidates for selections of ``blocks`` blocks.

        A static step's candidates' width comes from its plan's width: with an int ``candidates``, derived here
        (integer arithmetic: under ``torch.compile`` it turns dynamic with the width); with a float one, made on the
        host before the step (:meth:`static_widths`), since a compiled step would specialise on a width multiplied
        by a float (a recompile at every change): it is then a second plan int, which turns dynamic when it first
        changes (with the width, or later for a token policy, whose candidates change every ``block_size`` tokens
        of its width: one more compile)."""
        planned = None
        if state.static:
            planned = self._coarse.width(blocks.width) if type(self.candidates) is int else state.planned[1]
        return self._coarse.select(state, blocks, self.sink, self.window, planned, covers_forced)


@dataclass
class TwoStageBlockTopK(_TwoStage, _BlockTopK):
    """Coarse pass to ``candidates x`` the budget's blocks, then the blocks with the largest exact token score.

    Args: ``budget`` (tokens or a fraction), ``sink``, ``window`` (tokens), ``candidates`` (``c >= 1``),
    ``coarse`` (``"quest"``, ``"quest_heads"``, ``"quest_heads_max"``, ``"projected"`` or ``"pq"``),
    ``calibration`` (for ``coarse="projected"`` or ``"pq"``; ``"pq"`` also takes ``"prefill"``: centres fitted on
    each prompt's keys, :mod:`.product`).
    """

    def coarse_blocks(self, width: int, block_size: int) -> int:
        return width

    def candidate_blocks(self, state: DecodeState) -> tuple[Counts, torch.Tensor] | None:
        """The step's counts (``None``: dense) and its candidate blocks ``[B, Hkv, C]`` (coarse pass; the plan's
        counts hold the forced blocks already)."""
        counts = self.widths(state)
        if counts is None:
            return None
        if state.evicted is not None:
            counts = counts.at_most(state.live_blocks())
        return counts, self.candidates_of(state, counts, covers_forced=True)

    def select(self, state: DecodeState) -> Selection:
        found = self.candidate_blocks(state)
        if found is None:
            return self.dense_selection(state)
        counts, cand = found
        # [B, Hkv, C] a candidate's best token, forced blocks +inf, padding slots -inf: one op
        best = state.ops.candidate_scores(
            state.q, state.k_pool, state.block_table, state.seq_lens, state.start, cand,
            reduce="block", sink=self.sink, window=self.window,
        )  # fmt: skip
        blocks = pick(state.ops, best, cand, counts, state)
        return Selection("block", blocks, state.start, state.start, counts.per_sequence())


@dataclass
class TwoStageTokenTopK(_TwoStage, TokenTopK):
    """Coarse pass to ``candidates x`` the budget's blocks, then the budget's tokens by exact score among theirs (sink
    and window kept). Args as :class:`TwoStageBlockTopK`; runs in ``"token"`` and ``"mask"`` modes."""

    def coarse_blocks(self, width: int, block_size: int) -> int:
        return cdiv(width, block_size)

    def select(self, state: DecodeState) -> Selection:
        BS = state.block_size
        counts = self.widths(state)
        if counts is None:
            return self.dense_selection(state)
        if state.evicted is not None:
            counts = counts.at_most(state.live_tokens())
        blocks = counts.map(lambda k: cdiv(k, BS))  # may hold fewer than the forced
        cand = self.candidates_of(state, blocks, covers_forced=False)  # [B, Hkv, C]
        exact = state.ops.candidate_scores(state.q, state.k_pool, state.block_table, state.seq_lens, state.start, cand)
        pos = state.ops.blocks_to_tokens(cand, BS).long()  # [B, Hkv, C * BS]
        s = exact.flatten(-2)
        # forced tokens (ops/layout.py): the sink, and [min(window start, current block start), n)
        sink_end, win_start = window_positions(state.seq_lens, state.start, self.sink, self.window)
        first = torch.minimum(win_start, (state.seq_lens.long() - 1) // BS * BS)
        forced = (pos < sink_end.view(-1, 1, 1)) | (pos >= first.view(-1, 1, 1))
        s = s.masked_fill(forced & (s > float("-inf")), float("inf"))
        tokens = pick(state.ops, s, pos, counts, state)
        return Selection("token", tokens, state.start, state.start, counts.per_sequence())
