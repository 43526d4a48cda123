"""The policy contract: a decode step's state in, a fixed-width :class:`Selection` out.

A policy is a ``@dataclass`` with one method, :meth:`Policy.select`. It sees the step's :class:`DecodeState` (the
query, one layer's paged keys and metadata, the block table) and returns what each (sequence, KV head) may attend.
Budgets count the tokens one decode query attends, sink and window included: an ``int`` is tokens, a ``float`` in
(0, 1] is a fraction of the current context; a budget at or above the context means dense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import torch

from ..ops import reference

NEG_INF = float("-inf")


@dataclass
class Selection:
    """What each (sequence, KV head) attends in one decode step.

    Attributes:
        kind: ``"block"`` (``indices`` are logical block numbers) or ``"token"`` (token positions).
        indices: ``[B, Hkv, K]`` int32, padded with -1.
        ex_lo, ex_hi: ``[B]`` int, positions ``ex_lo <= p < ex_hi`` are masked even inside a selected block (keeps a
            block-granular read token-exact; empty when equal).
        counts: per sequence, the entries of ``indices`` that are set (the same for every head), on the host.
        dense: the selection is the whole context (every mode then runs its dense equivalent).
    """

    kind: str
    indices: torch.Tensor
    ex_lo: torch.Tensor
    ex_hi: torch.Tensor
    counts: tuple[int, ...]
    dense: bool = False


@dataclass
class DecodeState:
    """One layer's view of a decode step (what a policy may look at).

    Attributes:
        q: ``[B, Hq, D]`` the decode queries (after RoPE), unscaled.
        k_pool: ``[NB, Hkv, BS, D]`` the layer's key pool.
        kmin, kmax, kmean: ``[NB, Hkv, D]`` per-block key metadata.
        block_table: ``[B, nblk]`` int32; seq_lens, start: ``[B]`` int32 on the device.
        lens: the same lengths on the host (each context in tokens, the current token included), so that
            selection widths are decided without reading the device.
        length: the longest context, ``max(lens)``.
        block_size: tokens per block. scale: softmax scale. mode: ``"mask"``, ``"token"`` or ``"block"``.
        ops: the op namespace of the backend (see :func:`hf_sparse_kv.ops.get_ops`).
        evicted: per sequence, the blocks an evicting or compressing policy freed (their table entries are -1), on
            the host; ``None`` when nothing was freed. Scores of freed blocks are ``-inf``; a selection never holds
            them.
    """

    q: torch.Tensor
    k_pool: torch.Tensor
    kmin: torch.Tensor
    kmax: torch.Tensor
    kmean: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    start: torch.Tensor
    lens: tuple[int, ...]
    length: int
    block_size: int
    scale: float
    mode: str
    ops: SimpleNamespace
    evicted: tuple[int, ...] | None = None

    @property
    def num_kv_heads(self) -> int:
        return self.k_pool.shape[1]

    @property
    def num_blocks(self) -> int:
        """Width of the block table: the blocks of the longest sequence (or, in a cache reserved for CUDA-graph
        decoding, of its maximum length). Device-side selection works over this width."""
        return self.block_table.shape[1]

    def live_blocks(self) -> tuple[int, ...]:
        """Blocks each sequence still holds (on the host)."""
        held = [-(-n // self.block_size) for n in self.lens]
        return tuple(h - e for h, e in zip(held, self.evicted or (0,) * len(held)))

    def live_tokens(self) -> tuple[int, ...]:
        """Tokens each sequence still holds (freed blocks are always full ones)."""
        return tuple(n - e * self.block_size for n, e in zip(self.lens, self.evicted or (0,) * len(self.lens)))


def check_budget(budget: float | None, name: str = "budget", required: bool = True) -> None:
    """Raise a ``ValueError``/``TypeError`` naming ``name`` unless it is a positive int or a float in (0, 1]."""
    if budget is None:
        if required:
            raise ValueError(f"{name} is required: an int (tokens) or a float in (0, 1] (fraction of the context)")
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"{name} must be an int (tokens) or a float in (0, 1], got {type(budget).__name__}")
    if isinstance(budget, int) and budget <= 0:
        raise ValueError(f"{name} must be a positive number of tokens, got {budget}")
    if isinstance(budget, float) and not (0.0 < budget <= 1.0):
        raise ValueError(f"{name} as a float is a fraction of the context and must lie in (0, 1], got {budget}")


def check_count(value: int, name: str) -> None:
    """Raise unless ``value`` is a non-negative int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def budget_tokens(budget: float, length: int) -> int:
    """Tokens one query may attend at context ``length`` (a fraction rounds up, at least 1)."""
    if isinstance(budget, float):
        return max(1, math.ceil(budget * length))
    return budget


def window_bounds(length: int, sink: int, window: int) -> tuple[int, int]:
    """(end of the sink ``[0, sink)``, start of the window ``[length - window, length)``); the window never starts
    before the sink ends and holds at least the current token."""
    sink_end = min(sink, length)
    return sink_end, max(length - max(window, 1), sink_end)


def forced_block_count(length: int, sink: int, window: int, block_size: int) -> int:
    """Blocks holding the sink, the window and the current block of a context of ``length`` tokens."""
    sink_end, win_start = window_bounds(length, sink, window)
    nblk = -(-length // block_size)
    in_sink = -(-sink_end // block_size)  # blocks [0, in_sink)
    first_window = win_start // block_size  # blocks [first_window, nblk), the current one included
    return in_sink + (nblk - first_window) - max(0, in_sink - first_window)


@dataclass
class Policy:
    """Base of every policy: a dataclass whose :meth:`select` returns a :class:`Selection`.

    Subclasses set ``granularity`` (``"block"``, ``"token"`` or ``None`` for dense) and implement :meth:`select`.
    """

    granularity: ClassVar[str | None] = None
    compresses: ClassVar[bool] = False  # scores the prompt at prefill and frees blocks at the first decode step

    @property
    def frees_blocks(self) -> bool:
        """Whether the policy frees blocks (eviction or compression): the block table then changes while decoding
        (no CUDA graphs), and the pool is not reserved up to ``generate()``'s maximum length."""
        return self.compresses or bool(getattr(self, "evict", False))

    def select(self, state: DecodeState) -> Selection:  # pragma: no cover - abstract
        raise NotImplementedError

    def plan(self, lens: tuple[int, ...], block_size: int) -> list[int] | None:  # pragma: no cover - abstract
        """What :meth:`select` will keep per sequence at these lengths (``None``: everything), on the host only:
        a CUDA-graph decoder keys its captured steps on it."""
        raise NotImplementedError

    # ---- helpers shared by the policies -----------------------------------------------------------------------

    @staticmethod
    def counts_tensor(state: DecodeState, counts: list[int], width: int) -> torch.Tensor | None:
        """Per-sequence counts for ``topk_indices``: ``None`` when every sequence keeps ``width`` (no copy)."""
        if all(c == width for c in counts):
            return None
        return torch.tensor(counts, dtype=torch.long).to(state.q.device, non_blocking=True)

    @staticmethod
    def dense_selection(state: DecodeState) -> Selection:
        """Every block of every sequence (``-1`` past a shorter sequence's last block); after an eviction, every block
        still held. Nothing is masked inside the blocks (``state.start`` as both bounds: an empty interval)."""
        B, H = state.q.shape[0], state.num_kv_heads
        counts = state.live_blocks()
        if state.evicted is not None and any(state.evicted):
            live = reference.live_blocks(state.block_table, state.seq_lens, state.block_size)  # [B, nblk]
            scores = torch.zeros(live.shape, device=live.device).masked_fill(~live, float("-inf"))
            scores = scores.unsqueeze(1).expand(B, H, -1).contiguous()  # topk keeps every finite score
            width = max(counts)
            indices = state.ops.topk_indices(scores, width, Policy.counts_tensor(state, list(counts), width))
            return Selection("block", indices, state.start, state.start, counts)
        idx = torch.arange(state.num_blocks, device=state.q.device).view(1, -1)
        idx = torch.where(idx < reference.num_blocks(state.seq_lens, state.block_size).view(-1, 1), idx, -1).int()
        indices = idx.unsqueeze(1).expand(B, H, -1).contiguous()
        return Selection("block", indices, state.start, state.start, counts, dense=True)

    @staticmethod
    def forced_positions(state: DecodeState, sink: int, window) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sequence, the end of the sink and the start of the window (see :func:`window_bounds`): two ``[B]``
        long tensors computed on the device from ``state.seq_lens`` (so a captured decode step stays right as the
        lengths move). ``window`` is an int or a ``[B]`` tensor."""
        return reference.window_positions(state.seq_lens, state.start, sink, window)

    @staticmethod
    def forced_blocks(state: DecodeState, sink: int, window) -> torch.Tensor:
        """``[B, nblk]`` bool: the blocks holding the sink, the window and the current (partial) block."""
        return reference.forced_block_mask(
            state.seq_lens, state.start, sink, window, state.block_size, state.num_blocks
        )
