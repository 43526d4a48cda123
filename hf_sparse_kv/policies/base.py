"""The policy contract: a decode step's state in, a fixed-width :class:`Selection` out, and a lifecycle around it.

A policy is a ``@dataclass`` with one method to write, :meth:`Policy.select`. It sees the step's
:class:`DecodeState` (the query, one layer's paged keys, metadata and declared state, the block table) and returns
what each (sequence, KV head) may attend. Budgets count the tokens one decode query attends, sink and window
included: an ``int`` is tokens, a ``float`` in (0, 1] is a fraction of the current context; a budget at or above the
context means dense.

Around :meth:`~Policy.select`, the policy owns its lifecycle through methods with no-op defaults, which the patch and
the attention call without asking what kind of policy they hold (docs/ARCHITECTURE.md, "The life of a decode step"):
:meth:`~Policy.check_patch` (refuse settings it cannot run under), :meth:`~Policy.cache_state` (the per-token or
per-block state the cache keeps for it and how a write refreshes it), :meth:`~Policy.key_metadata` (which of the
blocks' key min / max / mean the cache keeps for it), :meth:`~Policy.observe_prefill` (score the
prompt during the prefill), :meth:`~Policy.release` (free blocks it will never read again),
:meth:`~Policy.budget_fraction` (for ``mode="auto"``) and :attr:`~Policy.frees_blocks`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import ClassVar

import torch

from ..ops import reference
from ..ops.layout import KEY_METADATA, cdiv, forced_block_count, forced_block_mask, window_positions

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
        kmin, kmax, kmean: ``[NB, Hkv, D]`` per-block key metadata (min, max, mean of each block's stored keys), or
            ``None`` where the cache does not keep it (only what :meth:`Policy.key_metadata` names is kept).
        block_table: ``[B, nblk]`` int32; seq_lens, start: ``[B]`` int32 on the device.
        lens: the same lengths on the host (each context in tokens, the current token included), so that
            selection widths are decided without reading the device.
        length: the longest context, ``max(lens)``.
        block_size: tokens per block. scale: softmax scale.
        ops: the op namespace of the backend (see :func:`hf_sparse_kv.ops.get_ops`).
        evicted: per sequence, the blocks an evicting or compressing policy freed (their table entries are -1), on
            the host; ``None`` when nothing was freed. Scores of freed blocks are ``-inf``; a selection never holds
            them.
        state: the layer's tensors of the state the policy declared (:meth:`Policy.cache_state`), by name.
        static: a static decode step (compiled or captured, see :mod:`hf_sparse_kv.graphs`): ``lens`` and
            ``length`` are then the reserved bounds, not the step's lengths (those live in ``seq_lens`` only); what
            :meth:`Policy.plan` returned for the step's lengths before the step began (the step's key) reaches it as
            ``planned`` (host ints that do not depend on each sequence) and ``planned_counts`` (per sequence, on the
            device); :meth:`Policy.widths` reads them.
        planned: a static step's host widths, :meth:`Policy.static_widths` of the plan (the selection's width
            first); ``None``: the plan selects everything.
        planned_counts: ``[B]`` long, a static step's planned counts per sequence on the device
            (:attr:`hf_sparse_kv.cache.StaticBuffers.counts`, filled before the step): a compiled step that read
            them on the host would specialise on each sequence's count (a recompile whenever one changes).
        layer: the model's index of the layer (``None`` where unknown): a policy calibrated per layer reads its
            calibration by it.
        keep: a static step's ``keep(key, make)`` (:meth:`hf_sparse_kv.cache.StaticBuffers.keep`): ``make()`` once
            per reservation for what depends on ``key`` alone (``None`` outside static steps). Index tensors that are
            the same in every layer and at every step (:meth:`Policy.dense_selection`) go through it, so that a
            captured step does not rebuild them in every layer.
        held: a static step on a table with freed blocks (a policy that :attr:`~Policy.frees_once` released them
            before the reservation, or a refill left them out: ``PagedKVCache.load_static(free=...)``): the width of
            the dense selection of the blocks held, at least the most blocks any sequence's row holds (the reserved
            ones included); ``None``: no block was freed.
    """

    q: torch.Tensor
    k_pool: torch.Tensor
    kmin: torch.Tensor | None
    kmax: torch.Tensor | None
    kmean: torch.Tensor | None
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    start: torch.Tensor
    lens: tuple[int, ...]
    length: int
    block_size: int
    scale: float
    ops: SimpleNamespace
    evicted: tuple[int, ...] | None = None
    state: dict = field(default_factory=dict)
    static: bool = False
    planned: tuple[int, ...] | None = None
    planned_counts: torch.Tensor | None = None
    layer: int | None = None
    keep: Callable | None = None
    held: int | None = None

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
        return live_counts(self.lens, self.evicted, self.block_size, "block")

    def live_tokens(self) -> tuple[int, ...]:
        """Tokens each sequence still holds (freed blocks are always full ones)."""
        return live_counts(self.lens, self.evicted, self.block_size, "token")


def live_counts(lens: tuple[int, ...], evicted: tuple[int, ...] | None, block_size: int, unit: str) -> tuple[int, ...]:
    """What each sequence of ``lens`` tokens still holds after ``evicted`` blocks were freed (``None``: none), in
    blocks (``unit="block"``) or tokens (``"token"``; freed blocks are always full ones), on the host."""
    freed = evicted or (0,) * len(lens)
    if unit == "token":
        return tuple(n - e * block_size for n, e in zip(lens, freed))
    return tuple(cdiv(n, block_size) - e for n, e in zip(lens, freed))


def held_blocks(table: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, width]`` int32: per sequence, the logical numbers of the blocks its row of ``table [B, nblk]`` holds
    (entry ``>= 0``), in order, then ``-1``: the freed blocks (``-1`` entries) are left out, and so are the entries
    past a shorter row's end. On the device, without a host sync (a static step builds it)."""
    nblk = table.shape[1]
    at = torch.arange(nblk, device=table.device).view(1, -1)
    order = torch.where(table >= 0, at, nblk).sort(dim=1).values[:, :width]  # held first, in order
    return torch.where(order < nblk, order, -1).int()


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


def budget_blocks(budget: float, sink: int, window: int, length: int, block_size: int) -> tuple[int, int]:
    """``(keep, nblk)``: the blocks a block-granular budget keeps at context ``length`` out of its ``nblk``: all of
    them where the budget covers the context, else the budget in whole blocks, at least the forced ones (sink,
    window, current block), at most all."""
    nblk, tokens = cdiv(length, block_size), budget_tokens(budget, length)
    forced = forced_block_count(length, sink, window, block_size)
    return (nblk if tokens >= length else min(max(tokens // block_size, forced), nblk)), nblk


@dataclass(frozen=True, eq=False)
class StateSpec:
    """Per-token, per-block or per-layer state a policy asks every paged layer of the cache to keep beside its keys.

    Attributes:
        name: the key of the state in :attr:`DecodeState.state`.
        scope: ``"token"`` (a tensor ``[NB, Hkv, BS, *shape(D)]``), ``"block"`` (``[NB, Hkv, *shape(D)]``) or
            ``"layer"`` (``[Hkv, *shape(D)]``: one for the layer's whole contents, e.g. product-quantization centres
            fitted on a prefill's keys, which the per-token state is then computed with).
        shape: the trailing dims as a function of the head dim ``D``.
        refresh: ``refresh(state, k_pool, block_table, lo, hi, *, layer, span, ops, states)`` recomputes, in place,
            the entries of the stored positions ``lo[b] <= p < hi[b]`` (``[B]`` long tensors; for ``"block"`` scope,
            the blocks holding them, from all their stored keys) from ``k_pool [NB, Hkv, BS, D]`` through
            ``block_table [B, MB]``. ``layer`` is the model's layer index, ``span`` a host int ``>= max(hi - lo)``
            (the tokens written: a refresh sizes its work by it instead of reading ``lo``/``hi`` on the host),
            ``ops`` the cache's op namespace on this device and ``states`` the layer's declared state by name (a
            per-token refresh may read a per-layer state: specs refresh in their declared order). A per-token or
            per-block refresh runs inside every write, captured CUDA-graph decode steps included: on the device,
            vectorized, without host syncs. The cache calls it after every write and after a crop; copies, reorders,
            growth and compaction move the state with its block. A ``"layer"`` refresh runs only at a write that
            starts every sequence (``lo`` all 0: a first prefill, a reset cache's, the state adopted by a filled
            cache, caches stacked into a batch), eagerly, before the others; a refill copies it from its source.
        dtype: the state's dtype (``None``: the keys' dtype).
        key: what the state holds, where two specs (of two policy objects) hold the same for the same keys: specs of
            one ``name``, ``scope``, ``dtype`` and ``key`` are equal, so a cache keeping one serves the other (a policy
            patched again, jobs of several budgets sharing one cache). ``None`` (the default): equal to itself only.
            A cache holds one state per ``name``: a spec of a kept name that is not equal to the kept one replaces
            it (recomputed), and two unequal specs of one name cannot be declared together.
    """

    name: str
    scope: str
    shape: Callable[[int], tuple[int, ...]]
    refresh: Callable[..., None]
    dtype: torch.dtype | None = None
    key: Hashable | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StateSpec):
            return NotImplemented
        if self.key is None or other.key is None:
            return self is other
        return (self.name, self.scope, self.dtype, self.key) == (other.name, other.scope, other.dtype, other.key)

    def __hash__(self) -> int:
        return id(self) if self.key is None else hash((self.name, self.scope, self.dtype, self.key))

    def __deepcopy__(self, memo: dict) -> StateSpec:
        """Itself: a spec is an immutable description (a copied cache keeps its policy's specs, equal to them, and does
        not copy the policy its ``refresh`` belongs to)."""
        return self

    def __post_init__(self) -> None:
        if self.scope not in ("token", "block", "layer"):
            raise ValueError(f"StateSpec scope must be 'token', 'block' or 'layer', got {self.scope!r}")

    def allocate(self, NB: int, H: int, BS: int, D: int, dtype: torch.dtype, device) -> torch.Tensor:
        """The zeroed state of a pool of ``NB`` blocks (of the layer, for ``"layer"`` scope)."""
        lead = () if self.scope == "layer" else (NB,)
        per_block = (BS,) if self.scope == "token" else ()
        return torch.zeros(*lead, H, *per_block, *self.shape(D), dtype=self.dtype or dtype, device=device)


@dataclass(frozen=True)
class Trailing:
    """A :attr:`StateSpec.shape`: the trailing dims ``(*lead, D * num // den, *tail)`` for head dim ``D``, or
    ``(*lead, *tail)`` without ``num`` (a picklable callable, where a lambda made a patched model unpicklable)."""

    num: int | None = 1
    den: int = 1
    lead: tuple[int, ...] = ()
    tail: tuple[int, ...] = ()

    def __call__(self, D: int) -> tuple[int, ...]:
        mid = () if self.num is None else (D * self.num // self.den,)
        return (*self.lead, *mid, *self.tail)


def tensors_digest(tensors: dict) -> str:
    """A content digest of ``{layer: tensor}`` (a calibration's projections or centres; SHA-1 of each layer's index,
    shape, dtype and bytes, by layer): a :attr:`StateSpec.key` for state computed from them."""
    h = hashlib.sha1()
    for layer in sorted(tensors):
        t = tensors[layer].detach().cpu().contiguous()
        h.update(f"{layer}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def static_width(width: int) -> int:
    """The width a static step gives a selection of at most ``width`` entries per sequence: ``width`` rounded up to a
    multiple of ``quantum``, the largest power of two at most ``width / 32`` (1 below 64), so at most ``quantum - 1``
    (~3 %) more slots. The slots past each sequence's count are ``-1`` (the step's top-k reads the counts on the
    device), so the step selects what an eager step at ``width`` selects; a fractional budget's width grows by one every
    ``block_size / budget`` tokens, and a step keyed on it (a captured graph) is made again only when the rounded
    width changes: ``quantum`` times less often (1/16 of a 128K prompt in 16-token blocks: 513 -> 528 slots,
    quantum 16, a new graph every 4096 tokens instead of every 256)."""
    quantum = 1 << max(0, (width // 32).bit_length() - 1) if width >= 64 else 1
    return cdiv(width, quantum) * quantum


def int_max(a: int, b: int) -> int:
    """``max(a, b)`` of two ints, plain or symbolic: ``torch.sym_max`` for a symbolic one (no guard on which is
    larger under ``torch.compile``), ``max`` for two plain ints (dynamo in torch 2.11 refuses ``torch.sym_max`` of
    plain ints: a graph break, which ``fullgraph=True`` turns into an error; 2.13 folds it)."""
    return max(a, b) if type(a) is int and type(b) is int else torch.sym_max(a, b)


def int_min(a: int, b: int) -> int:
    """``min(a, b)`` of two ints, plain or symbolic (as :func:`int_max`)."""
    return min(a, b) if type(a) is int and type(b) is int else torch.sym_min(a, b)


@dataclass
class Counts:
    """What a selection keeps per sequence in one decode step, and its width.

    An eager step knows the counts on the host. A static step's host knows only its plan's width: the counts reach
    it on the device, filled before the step (:attr:`DecodeState.planned_counts`), so that a compiled step does not
    specialise on each sequence's count (a left-padded batch, whose sequences change counts at different steps,
    recompiled once per sequence).

    Attributes:
        width: the selection's width, on the host: the most any sequence keeps (an eager step), or the plan's width
            (a static step: that rounded up by :func:`static_width`; under ``torch.compile`` a symbolic int once it
            changed).
        host: the counts per sequence on the host (an eager step), or ``None`` (a static step).
        device: ``[B]`` long, the counts per sequence on the device (a static step), or ``None`` (an eager step).
    """

    width: int
    host: tuple[int, ...] | None = None
    device: torch.Tensor | None = None

    @staticmethod
    def of(counts) -> Counts:
        """An eager step's counts (host ints per sequence)."""
        return Counts(max(counts), tuple(counts))

    def tensor(self, device) -> torch.Tensor | None:
        """The per-sequence counts for ``topk_indices``: ``None`` when every sequence keeps ``width`` (an eager step
        whose counts are all equal, or of a batch of one), else ``[B]`` long on ``device``: a static step's own
        (always: its width may exceed every count), an eager step's copied from the host."""
        if self.host is None:
            return self.device
        if len(self.host) == 1 or all(c == self.width for c in self.host):
            return None
        return torch.tensor(self.host, dtype=torch.long).to(device, non_blocking=True)

    def per_sequence(self) -> tuple[int, ...]:
        """:attr:`Selection.counts`: the host counts, or in a static step the width for every sequence (an upper
        bound: its host does not know the counts; it counts what the step reads before the step)."""
        return self.host if self.host is not None else (self.width,) * self.device.shape[0]

    def at_most(self, live) -> Counts:
        """An eager step's counts, each at most ``live[b]`` (what the sequence still holds after an eviction)."""
        return Counts.of([min(c, n) for c, n in zip(self.host, live)])

    def map(self, fn: Callable) -> Counts:
        """The counts through ``fn``, a non-decreasing function of an int that applies elementwise to a long tensor
        too (e.g. ``lambda k: cdiv(k, BS)``): applied to ``width``, to each host count and to ``device``; the width
        of the result is ``fn(width)``."""
        return Counts(
            fn(self.width),
            None if self.host is None else tuple(fn(c) for c in self.host),
            None if self.device is None else fn(self.device),
        )


@dataclass
class Policy:
    """Base of every policy: a dataclass whose :meth:`select` returns a :class:`Selection`.

    Subclasses set ``granularity`` (``"block"``, ``"token"`` or ``None`` for dense) and implement :meth:`select` and
    :meth:`plan`; the lifecycle methods below have no-op defaults.
    """

    granularity: ClassVar[str | None] = None
    compresses: ClassVar[bool] = False  # says so for callers (evaluation): it scores the prompt at its prefill

    # ---- lifecycle (no-op defaults; the patch and the attention call these and branch on nothing else) ----------

    @property
    def frees_blocks(self) -> bool:
        """Whether the policy frees blocks (eviction or compression): the block table then changes while decoding
        (no CUDA graphs unless :attr:`frees_once`), and the pool is not reserved up to ``generate()``'s maximum
        length (unless :attr:`frees_once` under ``cuda_graph=True``: its captured steps need the reservation)."""
        return False

    @property
    def frees_once(self) -> bool:
        """Whether a policy that frees blocks frees them only at its first decode step (a prompt compressed once,
        SnapKV): after that step its block table only grows, so static decoding (captured or compiled steps) can
        take over from the second step on, over a table with holes (``-1`` at the freed blocks). ``False`` for a
        policy that frees at every step (``SinkWindow(evict=True)``) and for one that frees nothing."""
        return False

    @property
    def fits_to_the_batch(self) -> bool:
        """Whether what it selects for one sequence depends on the batch's other sequences: state fitted on all
        their stored keys at once (product-quantization centres fitted at the prefill, ``calibration="prefill"``).
        For callers that batch separate texts and want each scored as alone (evaluation's simulate way scores such a
        policy's windows one at a time)."""
        return False

    def check_patch(self, mode: str, dense_layers: tuple[int, ...]) -> None:
        """Raise a ``ValueError`` if the policy cannot run with this patch's ``mode`` and ``dense_layers``."""
        if self.granularity == "token" and mode == "block":
            raise ValueError(
                f"{type(self).__name__} selects single tokens: mode='block' would read whole blocks and change what "
                "it attends. Use mode='token' (physically sparse) or mode='mask'."
            )

    def cache_state(self) -> tuple[StateSpec, ...]:
        """The per-token or per-block state the cache must keep for :meth:`select` (none by default; the blocks' key
        min / max / mean are :meth:`key_metadata`)."""
        return ()

    def key_metadata(self) -> tuple[str, ...]:
        """Which per-block key metadata (:data:`KEY_METADATA`: ``"kmin"``, ``"kmax"``, ``"kmean"``, ``[NB, Hkv, D]``
        each, the model's dtype) :meth:`select` reads off the :class:`DecodeState`; the cache keeps only those
        (each is ``D`` values a block: 1/16 of the keys' bytes at 16-token blocks), refreshed by every write. The
        default, all three, serves a policy written outside the library that may read any of them; the library's
        policies name what they read (``Dense``, the exact and the float8 selectors: none; ``Quest``: min and max)."""
        return KEY_METADATA

    def observe_prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        mask: torch.Tensor | None,
        pads: torch.Tensor,
        block_size: int,
        scale: float,
    ) -> torch.Tensor | None:
        """Called by every paged layer's multi-token forward (prefill) with its queries ``[B, Hq, Tq, D]`` and whole
        context ``[B, Hkv, L, D]``; a returned ``[B, Hkv, nblk]`` observation reaches :meth:`release` at the next
        decode step. Default: observe nothing."""
        return None

    def release(self, cache, lens: tuple[int, ...], observation) -> None:
        """Called once per decode step, before the first layer selects, at context ``lens`` (stored tokens per
        sequence): free what the policy will never read again through the cache's ``free_blocks(blocks)`` or
        ``evict(spans)``. ``observation`` (:class:`hf_sparse_kv.runtime.Observation`) holds the prefill
        observations made since the last step. Default: free nothing."""

    def budget_fraction(self, context: int) -> float | None:
        """The fraction of ``context`` the policy reads (``None``: no budget, e.g. Dense), for ``mode="auto"``."""
        budget = getattr(self, "budget", None)
        if budget is None:
            return None
        return budget if isinstance(budget, float) else min(1.0, budget / max(context, 1))

    def select(self, state: DecodeState) -> Selection:  # pragma: no cover - abstract
        raise NotImplementedError

    def plan(self, lens: tuple[int, ...], block_size: int) -> list[int] | None:  # pragma: no cover - abstract
        """What :meth:`select` will keep per sequence at these lengths (``None``: everything), on the host only:
        a CUDA-graph decoder keys its captured steps on it."""
        raise NotImplementedError

    # ---- helpers shared by the policies -----------------------------------------------------------------------

    def widths(self, state: DecodeState) -> Counts | None:
        """:meth:`plan` at the step's lengths (``None``: everything): computed from ``state.lens``, or, in a static
        step, the plan the step was keyed on: its width on the host (``state.planned``) and its counts on the device
        (``state.planned_counts``), so that nothing in the step depends on each sequence's count on the host."""
        if state.static:
            return None if state.planned is None else Counts(state.planned[0], device=state.planned_counts)
        counts = self.plan(state.lens, state.block_size)
        return None if counts is None else Counts.of(counts)

    def static_widths(self, counts: list[int], block_size: int) -> tuple[int, ...]:
        """The host ints a static step's :meth:`select` reads, from the counts :meth:`plan` returned (called on the
        host before the step: :func:`hf_sparse_kv.attention.static_plan`): the selection's width, ``max(counts)``
        rounded up by :func:`static_width`, first, then any width the policy derives from it
        (``DecodeState.planned``). Nothing else of the plan is on the host in a static step, so that a compiled
        step recompiles (and a captured one is captured again) when a width changes, not when a sequence's count
        does."""
        return (static_width(max(counts)),)

    @staticmethod
    def dense_selection(state: DecodeState) -> Selection:
        """Every block of every sequence (``-1`` past a shorter sequence's last block); after an eviction, every block
        still held. Nothing is masked inside the blocks (``state.start`` as both bounds: an empty interval).

        A static step selects every block of the table's width, ``[B, Hkv, nblk]``, made once per reservation
        (``state.keep``): the blocks past a sequence's length hold no position below its ``seq_lens``, which every
        mode masks (no kernel reads their keys), and the same tensor serves every layer and step."""
        B, H = state.q.shape[0], state.num_kv_heads
        counts = state.live_blocks()
        if state.keep is not None and state.held is not None:  # a static step over a table with freed blocks
            nblk, width, device = state.num_blocks, state.held, state.q.device
            table = state.block_table
            indices = state.keep(
                ("blocks held", str(device), B, H, nblk, width),
                lambda: held_blocks(table, width).unsqueeze(1).expand(B, H, width).contiguous(),
                table=True,  # a refill that leaves other blocks out rewrites the table: remade then
            )
            return Selection("block", indices, state.start, state.start, (width,) * B)
        if state.keep is not None and not (state.evicted is not None and any(state.evicted)):
            nblk, device = state.num_blocks, state.q.device
            indices = state.keep(
                ("every block", str(device), B, H, nblk),
                lambda: torch.arange(nblk, dtype=torch.int32, device=device).expand(B, H, nblk).contiguous(),
            )
            return Selection("block", indices, state.start, state.start, counts, dense=True)
        if state.evicted is not None and any(state.evicted):
            live = reference.live_blocks(state.block_table, state.seq_lens, state.block_size)  # [B, nblk]
            scores = torch.zeros(live.shape, device=live.device).masked_fill(~live, float("-inf"))
            scores = scores.unsqueeze(1).expand(B, H, -1).contiguous()  # topk keeps every finite score
            held = Counts.of(counts)
            indices = state.ops.topk_indices(scores, held.width, held.tensor(state.q.device))
            return Selection("block", indices, state.start, state.start, counts)
        idx = torch.arange(state.num_blocks, device=state.q.device).view(1, -1)
        idx = torch.where(idx < reference.num_blocks(state.seq_lens, state.block_size).view(-1, 1), idx, -1).int()
        indices = idx.unsqueeze(1).expand(B, H, -1).contiguous()
        return Selection("block", indices, state.start, state.start, counts, dense=True)

    @staticmethod
    def forced_positions(state: DecodeState, sink: int, window) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sequence, the end of the sink and the start of the window (the rule of
        :mod:`hf_sparse_kv.ops.layout`): two ``[B]`` long tensors computed on the device from ``state.seq_lens`` (so
        a captured decode step stays right as the lengths move). ``window`` is an int or a ``[B]`` tensor."""
        return window_positions(state.seq_lens, state.start, sink, window)

    @staticmethod
    def forced_blocks(state: DecodeState, sink: int, window) -> torch.Tensor:
        """``[B, nblk]`` bool: the blocks holding the sink, the window and the current (partial) block."""
        return forced_block_mask(state.seq_lens, state.start, sink, window, state.block_size, state.num_blocks)
