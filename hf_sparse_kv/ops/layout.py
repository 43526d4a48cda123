"""The paged layout's arithmetic: ceiling division, the one rule for the positions every policy keeps, and what an
attention mask allows.

The forced rule (docs/ARCHITECTURE.md, "Invariants"): every sparse decode query attends, on top of what its policy
selects, the *sink* (the first ``sink`` stored tokens), the *window* (the last ``window`` tokens, at least the
current one, never starting before the sink ends) and, in block granularity, the current (partial) block. For a
context of ``n`` stored tokens starting at ``s`` (``s = 0`` unless positions before it are invalid):

- ``sink_end = min(s + sink, n)`` and ``win_start = max(n - max(window, 1), sink_end)``;
- forced blocks: ``b * BS < sink_end`` or ``(b + 1) * BS > win_start`` or ``b`` the last block;
- forced tokens (token granularity): ``p < sink_end`` or ``p >= min(win_start, start of the current block)``.

This module states the rule twice, once on the host (Python ints, for the widths a policy plans without reading
the device) and once on the device (``[B]`` tensors, so a captured step stays right as lengths move); the tests
check the two agree. The Triton kernels that force blocks (``block_scores``, ``projected_scores``,
``candidate_scores``, ``candidate_mass``) transcribe the block form; their tests compare them with
:func:`forced_block_mask` / :func:`forced_blocks_at`. Nothing here imports a model, a cache or a policy.
"""

from __future__ import annotations

import torch

# The per-block key metadata a paged layer can keep beside its pools, ``[NB, Hkv, D]`` each: the min, max and mean of
# each block's stored keys (``reference.paged_write``), by their attribute names on a paged layer and on a policy's
# ``DecodeState``. A cache keeps the ones its policy reads (``Policy.key_metadata``): each costs 1/16 of the keys'
# bytes at 16-token blocks.
KEY_METADATA: tuple[str, ...] = ("kmin", "kmax", "kmean")


def check_block_size(block_size: int) -> None:
    """Raise a ``ValueError`` unless ``block_size`` is a power of two between 8 and 256."""
    ok = isinstance(block_size, int) and not isinstance(block_size, bool) and 8 <= block_size <= 256
    if not ok or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two between 8 and 256, got {block_size!r}")


def cdiv(a, b):
    """Ceiling division ``ceil(a / b)`` for ints (or integer tensors) with ``b > 0``."""
    return -(-a // b)


def mask_allows(mask: torch.Tensor) -> torch.Tensor:
    """Where an attention mask as transformers builds it (bool, or additive float: 0 or the dtype's minimum) lets a
    query attend a key: a bool tensor of ``mask``'s shape."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


# ---- host form (ints) ----------------------------------------------------------------------------------------------


def window_bounds(length: int, sink: int, window: int) -> tuple[int, int]:
    """(end of the sink ``[0, sink)``, start of the window ``[length - window, length)``); the window never starts
    before the sink ends and holds at least the current token."""
    sink_end = min(sink, length)
    return sink_end, max(length - max(window, 1), sink_end)


def forced_block_range(length: int, sink: int, window: int, block_size: int) -> tuple[int, int, int]:
    """``(in_sink, first_window, nblk)``: the forced blocks of a context of ``length`` tokens are ``[0, in_sink)``
    (the sink) and ``[first_window, nblk)`` (the window and the current block)."""
    sink_end, win_start = window_bounds(length, sink, window)
    return cdiv(sink_end, block_size), win_start // block_size, cdiv(length, block_size)


def forced_block_count(length: int, sink: int, window: int, block_size: int) -> int:
    """Blocks holding the sink, the window and the current block of a context of ``length`` tokens."""
    in_sink, first_window, nblk = forced_block_range(length, sink, window, block_size)
    return in_sink + (nblk - first_window) - max(0, in_sink - first_window)


def forced_block_bound(sink: int, window: int, block_size: int) -> int:
    """The most blocks :func:`forced_block_count` gives at any length (a context stored from position 0, as the
    cache stores each sequence): the sink's blocks and the blocks that ``max(window, 1)`` consecutive tokens can
    touch (the current block is one of them). A static step sizes by it what it cannot size by each length."""
    return cdiv(sink, block_size) + cdiv(max(window, 1) - 1, block_size) + 1


def forced_block_set(length: int, sink: int, window: int, block_size: int) -> set[int]:
    """The forced blocks of a context of ``length`` tokens, as a set of logical block numbers."""
    in_sink, first_window, nblk = forced_block_range(length, sink, window, block_size)
    return {*range(in_sink), *range(first_window, nblk)}


def forced_token_count(length: int, sink: int, window: int, block_size: int) -> int:
    """Tokens a token-granular policy must keep: the sink and ``[min(window start, current block start), length)``."""
    sink_end, win_start = window_bounds(length, sink, window)
    lo = min(win_start, (length - 1) // block_size * block_size)
    return sink_end + (length - lo) - max(0, sink_end - lo)


# ---- device form ([B] tensors) -------------------------------------------------------------------------------------


def num_blocks(seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Blocks in use per sequence: ``[B]`` -> ``[B]`` long."""
    return cdiv(seq_lens.long(), block_size)


def window_positions(
    seq_lens: torch.Tensor, start: torch.Tensor, sink: int, window: int | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, the end of the sink ``[start, start + sink)`` and the start of the window (the last ``window``
    tokens, at least one, never before the sink's end): two ``[B]`` long tensors. ``window`` is an int or ``[B]``."""
    lens = seq_lens.long()
    sink_end = torch.minimum(start.long() + sink, lens)
    window = max(window, 1) if isinstance(window, int) else window.clamp(min=1)  # no host->device copy
    return sink_end, torch.maximum(lens - window, sink_end)


def forced_block_mask(
    seq_lens: torch.Tensor, start: torch.Tensor, sink: int, window: int | torch.Tensor, block_size: int, width: int
) -> torch.Tensor:
    """``[B, width]`` bool: the blocks holding the sink, the window and the current (partial) block."""
    blk = torch.arange(width, device=seq_lens.device).view(1, -1)
    return forced_blocks_at(blk, seq_lens, start, sink, window, block_size)


def forced_blocks_at(
    blocks: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    sink: int,
    window: int | torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Whether each of ``blocks [B, ...]`` (logical block numbers, ``-1`` padded; a leading dim of 1 broadcasts
    over the batch) is a forced block of its sequence: bool, ``blocks``' shape broadcast with ``[B]``. Padding and
    blocks past a sequence's end are not forced. :func:`forced_block_mask` is this rule at blocks ``0 .. width-1``."""
    sink_end, win_start = window_positions(seq_lens, start, sink, window)
    per_seq = (-1,) + (1,) * (blocks.dim() - 1)
    blk = blocks.long()
    nblk = num_blocks(seq_lens, block_size).view(per_seq)
    in_sink = blk * block_size < sink_end.view(per_seq)
    in_window = (blk + 1) * block_size > win_start.view(per_seq)
    return (in_sink | in_window | (blk == nblk - 1)) & (blk >= 0) & (blk < nblk)


def forced_token_mask(
    seq_lens: torch.Tensor, start: torch.Tensor, sink: int, window: int | torch.Tensor, block_size: int, width: int
) -> torch.Tensor:
    """``[B, width]`` bool: the positions a token-granular policy must keep (see the module's rule)."""
    sink_end, win_start = window_positions(seq_lens, start, sink, window)
    current = (seq_lens.long() - 1) // block_size * block_size  # start of the current block
    pos = torch.arange(width, device=seq_lens.device).view(1, -1)
    return (pos < sink_end.view(-1, 1)) | (pos >= torch.minimum(win_start, current).view(-1, 1))
