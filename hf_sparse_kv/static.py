"""What a cache reserved for static decoding keeps beside its pages (see :meth:`PagedKVCache.reserve_static` and
:mod:`hf_sparse_kv.graphs`): :class:`StaticBuffers`, the device buffers a static step reads instead of host state,
and :class:`WindowRing`, a sliding-window layer of fixed shape. Storage, like :mod:`hf_sparse_kv.cache`; nothing
here imports the package.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from transformers.cache_utils import CacheLayerMixin


@dataclass
class StaticBuffers:
    """Device buffers of a cache reserved for static decoding (see :meth:`PagedKVCache.reserve_static`): what a
    static decode step (compiled, captured, or both: :mod:`hf_sparse_kv.graphs`) reads instead of host state.

    Attributes:
        max_length: tokens reserved per sequence (transformers' frame, left padding included).
        frame: ``[1]`` long, the position of this step's token in transformers' frame (the same for every sequence).
        seq_lens: ``[B]`` int32, the stored length after this step's token (``frame + 1 - pads``).
        pos0: ``[B]`` int32, where this step's token is stored (``frame - pads``).
        start: ``[B]`` int32 zeros (padding is never stored).
        pads: ``[B]`` int32, each sequence's left padding.
        positions: ``[B, 1]`` long, this step's position ids as ``generate()`` makes them (``frame - pads``).
        counts: ``[B]`` long, the step's planned counts per sequence (what the policy's ``plan`` keeps of each;
            unchanged by a step that plans none): a static step reads them here, not on the host, so that a
            compiled step does not specialise on each sequence's count.
        table: ``[B, MB]`` int32, the block table, fixed by the reservation.
        ops: the backend's registered ops (:func:`hf_sparse_kv.ops.library.registered_ops`).
        plan: the host plan the current step was keyed on (set by :meth:`begin_step`; see
            :func:`hf_sparse_kv.attention.static_plan`).
        filled: the host counts ``counts`` holds (``None``: none yet).
        kept: what :meth:`keep` made, by key, for as long as the reservation lives.
        evicted: per sequence, the blocks freed (their entries of ``table`` are ``-1``), on the host; ``None``: none
            was. Freed before the reservation (a policy that frees once, SnapKV, at its first decode step), or left
            out by a refill (``PagedKVCache.load_static(free=...)``); a static step frees nothing.
        held: with ``evicted``, the width of a dense selection of the blocks held (``DecodeState.held``): at least
            the most blocks any sequence's row of ``table`` holds (reserved ones included); ``None`` otherwise.
        remakes: the ``make`` of each kept entry that reads ``table``'s contents (:meth:`keep` with ``table=True``),
            by key: :meth:`reload` remakes them in place when a refill changes the table.
        frame_held: the frame :attr:`frame` holds once the work queued so far has run (``None``: not known), so
            that a step at that frame does not fill it again: :meth:`begin_step` sets it, a step that moves
            :attr:`frame` on by itself (:meth:`next_frame`, inside a captured step) tells it with :meth:`moved`.
    """

    max_length: int
    frame: torch.Tensor
    seq_lens: torch.Tensor
    pos0: torch.Tensor
    start: torch.Tensor
    pads: torch.Tensor
    positions: torch.Tensor
    counts: torch.Tensor
    table: torch.Tensor
    ops: SimpleNamespace
    plan: object = None
    filled: tuple[int, ...] | None = None
    kept: dict = field(default_factory=dict)
    evicted: tuple[int, ...] | None = None
    held: int | None = None
    remakes: dict = field(default_factory=dict)
    frame_held: int | None = None

    def begin_step(
        self,
        frame: int,
        plan,
        counts: tuple[int, ...] | None,
        positions: torch.Tensor | None = None,
        derive: bool = True,
    ) -> None:
        """Fill the buffers for the token at position ``frame`` (transformers' frame) and keep the step's plan and
        its per-sequence ``counts`` (``None``: the plan has none); runs before the step (outside a traced or captured
        region). ``positions`` ``[B, 1]``: the step's position ids when the caller has its own (default:
        ``frame - pads``, as ``generate()`` makes them). ``derive=False``: leave :attr:`pos0` and :attr:`seq_lens`
        to the step, which derives them from :attr:`frame` on the device (:meth:`derive`).

        Each device op here is a launch the host makes while the GPU waits for the step (~10 µs each on an
        H100's host): :attr:`frame` is filled only when it does not hold ``frame`` already (:attr:`frame_held`)."""
        if self.frame_held != frame:
            self.set_frame(frame)
        if derive:
            self.derive()
        if positions is None:
            torch.sub(frame, self.pads, out=self.positions.view(-1))
        else:
            self.positions.copy_(positions)
        if counts is not None and counts != self.filled:
            # fill_ with a Python number is a kernel argument: no host-to-device copy, and no sync; only the counts
            # that changed (a plan changes one sequence's count every few blocks)
            for b, c in enumerate(counts):
                if self.filled is None or self.filled[b] != c:
                    self.counts[b : b + 1].fill_(c)
            self.filled = counts
        self.plan = plan

    def set_frame(self, frame: int) -> None:
        """Fill :attr:`frame` with ``frame`` (a kernel argument: no copy, no sync), whatever it holds."""
        self.frame.fill_(frame)
        self.frame_held = frame

    def derive(self) -> None:
        """Set :attr:`pos0` (``frame - pads``) and :attr:`seq_lens` (``pos0 + 1``) from :attr:`frame`, on the device:
        two kernels, which a captured step holds (no host value read, nothing launched by the host at replay)."""
        torch.sub(self.frame, self.pads, out=self.pos0)
        torch.add(self.pos0, 1, out=self.seq_lens)

    def next_frame(self) -> None:
        """Move :attr:`frame` on by one token on the device (the last op of a captured step: the next step at the
        next frame then needs no fill); the host learns it through :meth:`moved`."""
        self.frame.add_(1)

    def moved(self, frame: int | None) -> None:
        """The work queued so far leaves :attr:`frame` at ``frame`` (``None``: not known; the next step fills it)."""
        self.frame_held = frame

    def reload(
        self,
        pads: list[int],
        table: torch.Tensor | None = None,
        evicted: tuple[int, ...] | None = None,
        held: int | None = None,
    ) -> None:
        """The cache was refilled in place with a batch padded by ``pads`` (``PagedKVCache.load_static``): the
        padding buffer takes them, and the next step fills the counts afresh. ``table`` (``[B, MB]`` int32, on the
        host or the device): the refill's block table, copied into :attr:`table` in place with its ``evicted`` and
        ``held`` (see the class); the kept entries that read the table are then remade in place (a graph reads
        them at their addresses); the others stay (they depend on their key alone)."""
        self.pads.copy_(torch.tensor(pads, dtype=self.pads.dtype))
        self.filled = None
        self.frame_held = None
        self.plan = None
        if table is not None:
            self.table.copy_(table)
            self.evicted, self.held = evicted, held
            for key, make in self.remakes.items():
                self.kept[key].copy_(make())

    def keep(self, key, make: Callable[[], object], table: bool = False) -> object:
        """``make()``, made once per ``key`` and kept for the reservation: what is the same at every step that asks
        with this key (a plan's counting rates, a device tensor of per-sequence counts, the table's block numbers).

        A static step asks from inside: the first step that asks makes it (a captured step's warm-up forward, so
        its kernels stay out of the CUDA graph); the graph then reads the kept tensor at every replay instead of
        remaking it in every layer. ``make`` must depend on ``key`` alone, or with ``table`` on ``key`` and the
        contents of :attr:`table` (a tensor, then: a refill that rewrites the table remakes it in place,
        :meth:`reload`). Under ``torch.compile`` tracing nothing is kept: the traced step computes it (inductor
        fuses it) and the reservation holds no traced values."""
        if torch.compiler.is_compiling():
            return make()
        if key not in self.kept:
            self.kept[key] = make()
            if table:
                self.remakes[key] = make
        return self.kept[key]


class WindowRing(CacheLayerMixin):
    """A sliding-window layer of a cache reserved for static decoding: keys and values ``[B, Hkv, W, D]`` in a ring,
    the token at position ``p`` of transformers' frame in slot ``p % W``, so every step has the same shapes.

    :meth:`PagedKVCache.reserve_static` builds it from transformers' sliding-window layer (which holds the last
    ``W - 1`` tokens); a single-token step writes slot ``frame % W`` and attends the slots whose position lies in
    ``(frame - W, frame]`` and after the sequence's padding (:meth:`mask`), which is transformers' window rule. Only
    static decode steps use it: anything else on a reserved cache is refused.
    """

    is_sliding = True
    is_compileable = True
    is_croppable = False

    def __init__(self, layer, length: int, static: StaticBuffers):
        keys, values = layer.keys, layer.values  # [B, Hkv, n, D], positions length - n .. length - 1
        W = layer.sliding_window
        B, H, n, D = keys.shape
        self.sliding_window, self.length, self.static = W, length, static
        self.keys = keys.new_zeros(B, H, W, D)
        self.values = values.new_zeros(B, H, W, D)
        slots = torch.arange(length - n, length, device=keys.device) % W
        self.keys[:, :, slots] = keys
        self.values[:, :, slots] = values
        self.is_initialized = True
        self.device, self.dtype = keys.device, keys.dtype

    def fits(self, layer) -> bool:
        """Whether transformers' sliding-window ``layer`` (of a cache not reserved) can be loaded here
        (:meth:`load`)."""
        keys = getattr(layer, "keys", None)
        return (
            keys is not None
            and getattr(layer, "sliding_window", None) == self.sliding_window
            and keys.shape[:2] == self.keys.shape[:2]
            and keys.shape[3] == self.keys.shape[3]
            and keys.shape[2] <= self.sliding_window
            and keys.dtype == self.dtype
            and keys.device == self.keys.device
        )

    def load(self, layer, length: int) -> None:
        """Hold ``layer``'s window (transformers' sliding-window layer, positions ``length - n .. length - 1``) in
        place of this ring's contents, every tensor at its address (see ``PagedKVCache.load_static``)."""
        keys, values = layer.keys, layer.values
        n = keys.shape[2]
        slots = torch.arange(length - n, length, device=keys.device) % self.sliding_window
        self.keys.zero_()
        self.values.zero_()
        self.keys[:, :, slots] = keys
        self.values[:, :, slots] = values
        self.length = length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write one token ``[B, Hkv, 1, D]`` at slot ``frame % W``; return the whole ring."""
        if key_states.shape[2] != 1:
            raise NotImplementedError("a cache reserved for static decoding takes one token per step")
        slot = self.static.frame % self.sliding_window  # [1]
        self.keys.index_copy_(2, slot, key_states.to(self.dtype))
        self.values.index_copy_(2, slot, value_states.to(self.dtype))
        return self.keys, self.values

    def mask(self) -> torch.Tensor:
        """``[B, 1, 1, W]`` bool: the slots this step's query attends (position in ``(frame - W, frame]``, at or after
        the sequence's padding); the position of slot ``s`` is ``frame - ((frame - s) mod W)``."""
        W = self.sliding_window
        s = torch.arange(W, device=self.device)
        frame = self.static.frame
        pos = frame - torch.remainder(frame - s, W)  # [W]
        return (pos.view(1, W) >= self.static.pads.view(-1, 1).long()).view(-1, 1, 1, W)

    def lazy_initialization(self, key_states, value_states) -> None:  # built initialised
        pass

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        return self.sliding_window, 0  # static; the attention builds its own mask (mask())

    def get_max_length(self) -> int:
        return self.sliding_window

    def reset(self) -> None:
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a sliding-window ring of a static reservation cannot be cropped")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("a sliding-window ring of a static reservation cannot be reordered")

    batch_repeat_interleave = batch_select_indices = reorder_cache
