"""The forced-selection rule of ``ops/layout.py`` (``window_positions``, ``forced_block_mask``,
``forced_token_mask``) inside Triton kernels: one ``@triton.jit`` form that the scoring kernels (``block_scores``,
``candidate_scores``, ``projected_scores``) and ``candidate_mass`` inline, so the rule has one form on each side of
the reference/kernel line."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def forced_bounds(n, st, SINK, WINDOW, BS: tl.constexpr):
    """A sequence's forced positions from its length ``n`` and first valid position ``st``: ``(sink_end, win_start,
    first)``: the sink is ``[st, sink_end)``, the window ``[win_start, n)`` (at least the current token), and the
    token form forces ``[first, n)``, ``first = min(win_start, start of the current block)``."""
    sink_end = tl.minimum(st + SINK, n)
    win_start = tl.maximum(n - tl.maximum(WINDOW, 1), sink_end)
    first = tl.minimum(win_start, (n - 1) // BS * BS)
    return sink_end, win_start, first


@triton.jit
def forced_block(blk, n_blk, sink_end, win_start, BS: tl.constexpr):
    """Whether logical blocks ``blk`` (any shape) are forced: they overlap the sink or the window, or are the current
    block ``n_blk - 1`` (validity, ``0 <= blk < n_blk``, is the caller's)."""
    return (blk * BS < sink_end) | ((blk + 1) * BS > win_start) | (blk == n_blk - 1)
