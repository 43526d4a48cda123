"""SnapKV: compress the prompt's cache once, after prefill, by the attention of the prompt's last tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..ops.layout import cdiv, forced_block_set, mask_allows
from .base import DecodeState, Policy, Selection, StateSpec, budget_blocks, check_budget, check_count
from .blocks import _BlockTopK
from .checks import warn_budget_below_forced
from .tokens import TokenTopK


@dataclass
class SnapKV(Policy):
    """SnapKV-style prefill compression, optionally with a query-aware policy on the compressed cache.

    Paper: Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024
    (https://arxiv.org/abs/2404.14469). During the prefill every paged layer scores each block of the prompt, per KV
    head, by the softmax mass its last ``observe`` queries give it (summed over those queries and the head's query
    group, normalised to one per head); the scores are pooled over layers and KV heads by ``pool``: ``"max"`` (a
    block any head attends strongly is kept, the closest to the paper's per-head selection) or ``"mean"``. At the
    first decode step the sink, the blocks of the last ``window`` tokens and the best-scored blocks up to ``budget``
    tokens (sink and window included; an int is tokens, a float a fraction of the context) are kept and the other
    blocks are freed: KV memory held shrinks to the budget plus the generated tokens.
    Decode then attends every block still held, or runs ``then`` over them: a query-aware policy (``Quest``,
    ``BlockTopK``, ``OracleBlockTopK`` or ``TokenTopK``) whose budget counts tokens of the whole context as usual,
    e.g. ``SnapKV(budget=0.25, then=Quest(budget=0.0625))``.

    Differs from the paper in three ways, all forced or suggested by the paged layout: one selection per sequence
    shared by every layer and KV head (the layers share one block table, so freeing a block frees it everywhere;
    hence the pooling), block granularity (a block's score already sums its neighbours, so the paper's 1-D pooling
    is left out), and the observation window is the end of the last multi-token forward
    (the prompt, or its last chunk under chunked prefill). ``dense_layers`` attend every block still held.

    The sink and the window are always kept: an int budget below ``sink + window`` keeps what
    ``budget=sink + window`` keeps (constructing it warns); a fraction does so at contexts shorter than
    ``(sink + window) / budget``.
    """

    budget: int | float = 0.25
    sink: int = 4
    window: int = 32
    observe: int = 32
    pool: str = "max"
    then: Policy | None = None

    compresses: ClassVar[bool] = True  # observes the prefill, frees blocks at the first decode step

    def __post_init__(self) -> None:
        check_budget(self.budget)
        check_count(self.sink, "sink")
        check_count(self.window, "window")
        warn_budget_below_forced(type(self).__name__, self.budget, self.sink, self.window)
        if isinstance(self.observe, bool) or not isinstance(self.observe, int) or self.observe < 1:
            raise ValueError(
                f"observe must be a positive int (prompt queries that score the blocks), got {self.observe!r}"
            )
        if self.pool not in ("max", "mean"):
            raise ValueError(f"pool must be 'max' or 'mean' (over layers and KV heads), got {self.pool!r}")
        if self.then is not None and not isinstance(self.then, (_BlockTopK, TokenTopK)):
            raise ValueError(
                "SnapKV(then=...) takes a query-aware policy that only ranks what is still held: Quest, BlockTopK, "
                f"OracleBlockTopK or TokenTopK (or None to attend every kept block), got {self.then!r}"
            )

    @property
    def granularity(self) -> str:  # type: ignore[override]
        return self.then.granularity if self.then is not None else "block"

    @property
    def frees_blocks(self) -> bool:
        return True

    @property
    def frees_once(self) -> bool:
        return True  # the prompt's blocks at the first decode step; the table only grows after it

    @property
    def fits_to_the_batch(self) -> bool:
        return self.then is not None and self.then.fits_to_the_batch

    def release(self, cache, lens: tuple[int, ...], observation) -> None:
        """At the first decode step after the prefill: free the unkept prompt blocks (:meth:`blocks_to_free`)."""
        if observation.scores is not None:
            cache.free_blocks(self.blocks_to_free(observation.scores, lens, cache.block_size))
        elif not observation.used_before and not self.keeps_all(lens, cache.block_size):
            raise ValueError(
                f"{type(self).__name__} scores the prompt during its prefill, but this cache was filled without it "
                "(e.g. by a model patched with another policy): prefill the prompt with the model patched for "
                f"{type(self).__name__}, or use a fresh PagedKVCache."
            )

    def key_metadata(self) -> tuple[str, ...]:
        return self.then.key_metadata() if self.then is not None else ()

    def cache_state(self) -> tuple[StateSpec, ...]:
        """The state ``then`` reads (its compressed keys: float8, quantized, projected, pq codes and centres), kept
        from the prefill on; the blocks freed at the first step take theirs with them."""
        return self.then.cache_state() if self.then is not None else ()

    def plan(self, lens: tuple[int, ...], block_size: int) -> list[int] | None:
        return self.then.plan(lens, block_size) if self.then is not None else None

    def select(self, state: DecodeState) -> Selection:
        return self.then.select(state) if self.then is not None else self.dense_selection(state)

    def observe_prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        mask: torch.Tensor | None,
        pads: torch.Tensor,
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        """Score the stored blocks of one layer by the attention of the last ``observe`` queries of a forward.

        Args:
            query: ``[B, Hq, Tq, D]`` the forward's queries (after RoPE); key: ``[B, Hkv, L, D]`` the whole context
                in transformers' frame (left padding included), the queries being its last ``Tq`` positions.
            mask: the forward's attention mask ``[B, 1, Tq, L]`` (bool, or additive float), or ``None`` for plain
                causal attention.
            pads: ``[B]`` left padding of each sequence (positions of the frame that are not stored).
            block_size: tokens per block; scale: the softmax scale.

        Returns:
            ``[B, Hkv, nblk]`` float32: per KV head and stored block, the attention mass of the observed queries,
            summed over them and the head's query group and divided by their number (sums to 1 per head).
        """
        B, Hq, Tq, D = query.shape
        Hkv, L = key.shape[1], key.shape[2]
        w = min(self.observe, Tq)
        q = query[:, :, Tq - w :].reshape(B, Hkv, (Hq // Hkv) * w, D)  # a KV head's group, its queries in a row
        logits = torch.matmul(q.to(key.dtype), key.transpose(-1, -2)).float() * scale  # [B, Hkv, G * w, L]
        qpos = torch.arange(L - w, L, device=key.device)
        if mask is None:
            ok = torch.arange(L, device=key.device).view(1, -1) <= qpos.view(-1, 1)  # [w, L] causal
            ok = ok.view(1, 1, w, L)
        else:
            ok = mask_allows(mask[:, :, Tq - w :, :L])  # [B | 1, 1, w, L]
        ok = ok.repeat(1, 1, Hq // Hkv, 1)  # rows ordered (group head, query) as in q
        p = logits.masked_fill(~ok, float("-inf")).softmax(-1).nan_to_num(0.0)
        mass = p.sum(2) / ((Hq // Hkv) * w)  # [B, Hkv, L]
        stored = torch.arange(L, device=key.device).view(1, -1) - pads.view(-1, 1).long()  # [B, L]
        nblk = cdiv(L - int(pads.min()), block_size)
        out = torch.zeros(B, Hkv, nblk, device=key.device)
        index = (stored.clamp(min=0) // block_size).unsqueeze(1).expand(B, Hkv, L)
        return out.scatter_add_(2, index, mass * (stored >= 0).unsqueeze(1))

    def keeps_all(self, lens: tuple[int, ...], block_size: int) -> bool:
        """Whether every block of contexts ``lens`` is kept whatever the scores (budget, sink and window cover them):
        a prompt of one token has no prefill to observe (its forward is a decode step) and nothing to free."""
        kept = [budget_blocks(self.budget, self.sink, self.window, n, block_size) for n in lens]
        return all(keep >= nblk for keep, nblk in kept)

    def blocks_to_free(self, scores: torch.Tensor, lens: tuple[int, ...], block_size: int) -> list[list[int]]:
        """The logical blocks to free per sequence at context ``lens``, from the observed ``scores [layers, B, Hkv,
        nblk]`` (pooled over layers and KV heads by ``pool``).

        Kept: the sink's blocks, the blocks of the last ``window`` tokens and the current one, then the best-scored
        others up to ``budget`` tokens rounded down to whole blocks. Blocks without a score (written after the
        observed forward) are kept."""
        pooled = scores.amax((0, 2)) if self.pool == "max" else scores.mean((0, 2))  # [B, nblk]
        rows = pooled.tolist()  # one copy per generation
        free = []
        for n, row in zip(lens, rows):
            keep, nblk = budget_blocks(self.budget, self.sink, self.window, n, block_size)
            forced = forced_block_set(n, self.sink, self.window, block_size)
            forced |= set(range(min(len(row), nblk), nblk))  # not scored: newer than the observation
            ranked = sorted((b for b in range(nblk) if b not in forced), key=lambda b: -row[b])
            free.append(sorted(ranked[max(keep - len(forced), 0) :]))
        return free
