"""PagedKVCache: a transformers ``Cache`` whose full-attention layers keep K/V in a shared block pool.

Layout (docs/ARCHITECTURE.md): each paged layer owns pools ``[NB, Hkv, BS, D]`` for keys and values, per-block
key metadata ``[NB, Hkv, D]`` (min, max, mean) and whatever per-token, per-block or per-layer state the policy
declared (:meth:`PagedKVCache.declare_state`); all layers share one block table ``[B, max_blocks]`` int32, one free
list and one reference count per block, so a block id means the same slot in every layer. Full blocks are shared between
sequences after a beam reorder and copied before a write (copy on write). Sliding-window layers (Gemma3, Mistral
with ``sliding_window``) keep transformers' own layer and its window semantics.

The cache is storage: it holds no policy and plans no step. Beside its storage it keeps one
:class:`~hf_sparse_kv.runtime.DecodeSession` (the decode side's state of these contents), which it resets with
its contents, reorders with its rows and tells when its table is cut, and never reads otherwise.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from .ops import BACKENDS, get_ops, reference, resolve_backend
from .ops.layout import KEY_METADATA, cdiv, check_block_size
from .ops.library import registered_ops
from .runtime import DecodeSession
from .static import StaticBuffers, WindowRing

POOL_GROWTH = 2.0
MIN_POOL_BLOCKS = 16


def host_ints_on(made: dict, device, lists: tuple[list[int], ...]) -> tuple[torch.Tensor, ...]:
    """``lists`` of host ints as ``[len(list)]`` long tensors on ``device``, made with one host-to-device copy the
    first time a device is asked for and kept in ``made`` (per device) for the layers after it."""
    key = str(device)
    if key not in made:
        flat = torch.tensor([x for xs in lists for x in xs], dtype=torch.long).to(device)
        made[key] = flat.split([len(xs) for xs in lists])
    return made[key]


class BlockTable:
    """The shared bookkeeping of a paged cache: free list, reference counts and the per-sequence block table."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.capacity = 0
        self.free: list[int] = []
        self.refcount: list[int] = []
        self.rows: list[list[int]] = []  # logical block -> physical block (-1: evicted), per sequence
        self._tensors: dict[str, torch.Tensor] = {}  # device -> the table (layers may sit on several devices)

    @property
    def blocks_in_use(self) -> int:
        return sum(1 for r in self.refcount if r > 0)

    def grow(self, capacity: int) -> None:
        self.free.extend(range(capacity - 1, self.capacity - 1, -1))
        self.refcount.extend([0] * (capacity - self.capacity))
        self.capacity = capacity

    def take(self) -> int:
        blk = self.free.pop()
        self.refcount[blk] = 1
        return blk

    def release(self, blk: int) -> None:
        if blk < 0:  # an evicted block's hole
            return
        self.refcount[blk] -= 1
        if self.refcount[blk] == 0:
            self.free.append(blk)

    def invalidate(self) -> None:
        self._tensors = {}

    def tensor(self, device: torch.device) -> torch.Tensor:
        """``[B, max_blocks]`` int32 on ``device``, -1 past each sequence's blocks (cached per device until the next
        change)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one table
            device = torch.device("cuda", torch.cuda.current_device())
        key = str(device)
        if key not in self._tensors:
            width = max([len(r) for r in self.rows] + [1])
            t = torch.full((len(self.rows), width), -1, dtype=torch.int32)
            for b, row in enumerate(self.rows):
                t[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
            self._tensors[key] = t.to(device)
        return self._tensors[key]


class PagedLayer(DynamicLayer):
    """One full-attention layer of a :class:`PagedKVCache`: its pools and metadata, indexed by the shared table."""

    is_sliding = False

    def __init__(self, cache: PagedKVCache, index: int):
        super().__init__()
        self.attach(cache)
        self.index = index  # the model's layer index (a policy calibrated per layer refreshes its state by it)
        self.length = 0
        self.k_pool = self.v_pool = self.kmin = self.kmax = self.kmean = None
        self._empty: tuple | None = None  # a placeholder per metadata not kept, for the write (see write_metadata)
        self._given = None  # weak references to what the last unreserved update() returned (see gave)
        self.writes = 0  # unreserved writes into the pools so far (update, copy_block, load): in PagedKVCache's stamp
        self.state: dict[str, torch.Tensor] = {}  # the policy-declared state (see PagedKVCache.declare_state)

    def attach(self, cache: PagedKVCache) -> None:
        """Belong to ``cache``, held weakly: a cache and its layers form no reference cycle, so dropping the last
        reference to a cache frees its device memory at once (not at the next cyclic garbage collection)."""
        self._cache = weakref.ref(cache)

    @property
    def cache(self) -> PagedKVCache:
        return self._cache()

    def __getstate__(self) -> dict:
        """For pickling: without the weak references (the cache it belongs to attaches it again on loading; what the
        last update returned is forgotten)."""
        return {**self.__dict__, "_cache": None, "_given": None}

    # transformers reads ``keys``/``values`` in a few generic places: give them the dense view (slow but correct)
    @property
    def keys(self) -> torch.Tensor | None:
        return self.dense_kv()[0] if self.is_initialized and self.length else None

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError("PagedLayer keys live in the block pool; write them with update()")

    @property
    def values(self) -> torch.Tensor | None:
        return self.dense_kv()[1] if self.is_initialized and self.length else None

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("PagedLayer values live in the block pool; write them with update()")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the pools for keys and values ``[B, H, T, D]`` (``NotImplementedError`` for values of another
        shape: the pools, metadata and kernels hold both at one width)."""
        _, H, _, D = key_states.shape
        if value_states.shape != key_states.shape:
            raise NotImplementedError(
                f"this attention writes values of shape {tuple(value_states.shape)} beside keys of shape "
                f"{tuple(key_states.shape)} into its cache: hf_sparse_kv's pages hold keys and values of one shape. "
                "Call unpatch_model(model) for this model."
            )
        self.device, self.dtype = key_states.device, key_states.dtype
        NB, BS = self.cache.table.capacity, self.cache.block_size
        self.k_pool = torch.zeros(NB, H, BS, D, dtype=self.dtype, device=self.device)
        self.v_pool = torch.zeros(NB, H, BS, D, dtype=value_states.dtype, device=self.device)
        self.is_initialized = True
        self.allocate_state()

    def allocate_state(self) -> None:
        """Allocate the key metadata the cache keeps (:attr:`PagedKVCache.metadata`; the others ``None``) and the
        declared state beside pools that exist (zeroed; the next writes fill them)."""
        if self.is_initialized:
            NB, H, BS, D = self.k_pool.shape
            for name in KEY_METADATA:
                kept = name in self.cache.metadata
                setattr(self, name, torch.zeros(NB, H, D, dtype=self.dtype, device=self.device) if kept else None)
            specs = self.cache.specs
            self.state = {s.name: s.allocate(NB, H, BS, D, self.dtype, self.device) for s in specs}

    def kept_metadata(self) -> tuple[str, ...]:
        """The key metadata this layer holds (names of :data:`~hf_sparse_kv.ops.layout.KEY_METADATA`, in its
        order)."""
        return tuple(name for name in KEY_METADATA if getattr(self, name) is not None)

    def write_metadata(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(kmin, kmax, kmean)`` for ``paged_write``: each kept one, or a one-element placeholder the write leaves
        alone (not ``[NB, Hkv, D]``; an allocation of its own, never a null pointer for a kernel; made once per device:
        a captured step replays the same tensors)."""
        if self._empty is None or self._empty[0].device != self.k_pool.device:
            self._empty = tuple(self.k_pool.new_zeros(1) for _ in KEY_METADATA)
        return tuple(
            empty if getattr(self, name) is None else getattr(self, name)
            for name, empty in zip(KEY_METADATA, self._empty)
        )

    def adopt_metadata(self, names: tuple[str, ...]) -> None:
        """Allocate the key metadata ``names`` (not kept yet) and compute it from the stored keys: what the writes
        would have left, for every block still held (``reference.refresh_blocks`` over each one's filled slots; a
        freed block is skipped). A layer not written yet allocates it at its first write."""
        if not self.is_initialized or not names:
            return
        NB, H, _, D = self.k_pool.shape
        made = {name: torch.zeros(NB, H, D, dtype=self.dtype, device=self.device) for name in names}
        self.compute_metadata(made)
        for name, t in made.items():
            setattr(self, name, t)

    def compute_metadata(self, meta: dict[str, torch.Tensor]) -> None:
        """Write into ``meta`` (names of :data:`~hf_sparse_kv.ops.layout.KEY_METADATA` to ``[NB, Hkv, D]`` tensors)
        the metadata of every stored block still held, from the key pool: ``reference.refresh_blocks`` over each
        one's filled slots (the cache's rows, padding and this layer's length, read on the host; a freed block is
        skipped)."""
        BS = self.k_pool.shape[2]
        blocks, fill = [], []
        for row, pad in zip(self.cache.table.rows, self.cache.pads or [0] * len(self.cache.table.rows)):
            stored = max(self.length - pad, 0)
            for j, blk in enumerate(row[: cdiv(stored, BS)]):
                if blk >= 0:
                    blocks.append(blk)
                    fill.append(min(BS, stored - j * BS))
        if blocks:
            idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
            n = torch.tensor(fill, dtype=torch.long, device=self.device)
            reference.refresh_blocks(self.k_pool, meta.get("kmin"), meta.get("kmax"), meta.get("kmean"), idx, n)

    def adopt_state(self, specs: tuple) -> None:
        """Allocate the state ``specs`` (not kept yet) and compute it from the stored keys: :meth:`refresh_state` of
        every stored position ``[0, length - pads[b])``, what the writes would have left (a refresh depends on the
        key pool alone). A layer not written yet allocates it at its first write."""
        if not self.is_initialized:
            return
        NB, H, BS, D = self.k_pool.shape
        for spec in specs:
            self.state[spec.name] = spec.allocate(NB, H, BS, D, self.dtype, self.device)
        self.refresh_all(specs)

    def refresh_all(self, specs: tuple | None = None) -> None:
        """:meth:`refresh_state` of every stored position ``[0, length - pads[b])`` as a write that starts every
        sequence (``"layer"`` scope state fitted again): what a first prefill of these contents leaves."""
        lens = [max(self.length - p, 0) for p in self.cache.pads] or [0]
        hi = torch.tensor(lens, dtype=torch.long, device=self.device)
        self.refresh_state(torch.zeros_like(hi), hi, max(lens), specs=specs, starts=True)

    def free_pools(self) -> None:
        """Let go of the pools, metadata and declared state (their memory is freed with the last reference); the
        layer's next write allocates them again. For :meth:`PagedKVCache.stacked` with ``consume``."""
        self.k_pool = self.v_pool = self.kmin = self.kmax = self.kmean = None
        self.state = {}
        self.is_initialized = False

    def layer_scoped(self) -> list[str]:
        """Names of the declared state of ``"layer"`` scope (one tensor for the layer, not indexed by block)."""
        return [spec.name for spec in self.cache.specs if spec.scope == "layer" and spec.name in self.state]

    def layer_state(self) -> list[torch.Tensor]:
        """The declared state of ``"layer"`` scope."""
        return [self.state[name] for name in self.layer_scoped()]

    def _tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by physical block: pools, the metadata kept, declared state (not of layer scope)."""
        meta = [getattr(self, name) for name in self.kept_metadata()]
        whole = self.layer_scoped()
        return [self.k_pool, self.v_pool, *meta, *(t for name, t in self.state.items() if name not in whole)]

    def _replace(self, tensors: list[torch.Tensor], metadata: tuple[str, ...] | None = None) -> None:
        """Take ``tensors`` in :meth:`_tensors`' order: the pools, the metadata ``metadata`` (default: the kept
        metadata), the declared state indexed by block (state of layer scope kept as it is)."""
        names = self.kept_metadata() if metadata is None else metadata
        self.k_pool, self.v_pool = tensors[:2]
        for name in KEY_METADATA:
            setattr(self, name, None)
        for name, t in zip(names, tensors[2 : 2 + len(names)]):
            setattr(self, name, t)
        whole = self.layer_scoped()
        per_block = iter(tensors[2 + len(names) :])
        self.state = {name: t if name in whole else next(per_block) for name, t in self.state.items()}

    def refresh_state(
        self,
        lo: torch.Tensor,
        hi: torch.Tensor,
        span: int,
        table: torch.Tensor | None = None,
        ops: SimpleNamespace | None = None,
        specs: tuple | None = None,
        starts: bool = False,
    ) -> None:
        """Recompute the declared state of stored positions ``[lo[b], hi[b])`` from the key pool (``[B]`` tensors;
        ``span >= max(hi - lo)``, on the host; ``table``: the block table to use, default the cache's; ``ops``: the
        op namespace, default the cache's backend on this device; a static step passes its registered ops;
        ``specs``: the state to recompute, default all the cache declared). ``starts``: the write starts every
        sequence (``lo`` all 0, known on the host): state of ``"layer"`` scope is refreshed (fitted) first; without
        it that state is left as it is."""
        if self.state:
            table = self.cache.table.tensor(self.device) if table is None else table
            ops = self.cache.ops(self.device) if ops is None else ops
            for spec in self.cache.specs if specs is None else specs:
                if spec.scope == "layer" and not starts:
                    continue
                spec.refresh(
                    self.state[spec.name], self.k_pool, table, lo, hi,
                    layer=self.index, span=span, ops=ops, states=self.state,
                )  # fmt: skip

    def grow(self, capacity: int) -> None:
        """Extend the pools to ``capacity`` blocks (existing block ids keep their slots)."""
        if not self.is_initialized:
            return
        extra = capacity - self.k_pool.shape[0]
        self._replace([torch.cat([t, t.new_zeros((extra, *t.shape[1:]))]) for t in self._tensors()])

    def repack(self, blocks: list[int], capacity: int) -> None:
        """New pools of ``capacity`` blocks holding ``blocks`` (old ids) at ids ``0..len(blocks)-1``."""
        if not self.is_initialized:
            return
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        self._replace(
            [torch.cat([t[idx], t.new_zeros((capacity - len(blocks), *t.shape[1:]))]) for t in self._tensors()]
        )

    def load(
        self, source: PagedLayer, length: int, dst: torch.Tensor, src: torch.Tensor, zero: torch.Tensor | None = None
    ) -> None:
        """Hold ``source``'s blocks ``src`` (its physical ids, ``[N]`` long on this layer's device) at this layer's
        blocks ``dst`` (``[N]`` long) and its ``length``, every tensor in place: the pools and metadata zeroed and
        copied, the declared state zeroed (the cache recomputes it). ``zero`` (``[Z]`` long): zero only those blocks
        (and the state of those and of ``dst``), the others left as they are: a refill of what changed since the
        last one (``PagedKVCache.load_static``). For ``PagedKVCache.load_static``, which builds the index tensors
        once per device for all layers (from host lists of every sequence's blocks: ~1 ms each at 8 x 32K, which
        per layer was most of a refill's host time)."""
        for name in ("k_pool", "v_pool", *self.kept_metadata()):
            t, s = getattr(self, name), getattr(source, name)
            if zero is None:
                t.zero_()
            elif zero.numel():
                t.index_fill_(0, zero, 0)
            if dst.numel() and s is not None:  # metadata the source lacks: computed from the copied keys (load_static)
                t.index_copy_(0, dst, s.index_select(0, src))
        whole = self.layer_scoped()
        for name, t in self.state.items():
            if name in whole:  # the source's (load_static fits it where the source has none of this shape)
                s = source.state.get(name)
                if _same_shape(s, t):
                    t.copy_(s)
            elif zero is None:
                t.zero_()
            else:
                t.index_fill_(0, torch.cat([zero, dst]), 0)
        self.length = length
        self.writes += 1

    def copy_block(self, src: int, dst: int) -> None:
        if self.is_initialized:
            for t in self._tensors():
                t[dst] = t[src]
            self.writes += 1

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``[B, Hkv, T, D]`` new keys/values into the pages.

        Returns the new keys/values themselves when the patched attention asked to read the pages itself (or when
        the cache was empty, where they are the whole context); otherwise a dense copy of the whole context, so the
        cache stays correct under any attention function.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, _, T, _ = key_states.shape
        static = self.cache.static
        if static is not None:  # a static step: blocks reserved, positions in device buffers, lengths kept outside
            if T != 1:
                raise NotImplementedError("a cache reserved for static decoding takes one token per step")
            pools = (self.k_pool, self.v_pool, *self.write_metadata())
            static.ops.paged_write(*pools, static.table, static.pos0, key_states, value_states)
            if self.state:
                self.refresh_state(static.pos0, static.pos0 + 1, 1, static.table, static.ops)
            return key_states, value_states
        frame0 = self.length
        self.writes += 1  # not on the static path above: a compiled step would guard on the count (a reserved cache
        # is no refill's source; its steps count in the session's decode steps, which the stamp holds too)
        self.cache.reserve(B, frame0 + T, frame0)
        pos0 = frame0 - self.cache.pads_tensor(self.device)  # [B]; negative at a left-padded prefill
        table = self.cache.table.tensor(self.device)
        # padding is dropped on the way in by the reference; the kernels take pos0 >= 0
        ops = self.cache.ops(self.device, "reference" if frame0 < max(self.cache.pads) else None)
        ops.paged_write(self.k_pool, self.v_pool, *self.write_metadata(), table, pos0, key_states, value_states)
        if self.state:  # a write that starts every sequence (none has a stored position yet) fits layer-scope state
            starts = all(frame0 <= p for p in self.cache.pads or [0])
            self.refresh_state(pos0.clamp(min=0), pos0 + T, T, starts=starts)
        self.length = frame0 + T
        deferred = self.cache.pop_deferred(self)  # taken on every write: a flag left by a first write would hand the
        # next forward's attention (one not patched any more) only the new K/V
        if frame0 == 0 or deferred:
            return self._give(key_states, value_states)
        return self._give(*self.dense_kv())

    def _give(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(keys, values)`` from :meth:`update`, remembered weakly (nothing kept alive) for :meth:`gave`."""
        self._given = (weakref.ref(keys), weakref.ref(values))
        return keys, values

    def gave(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether ``keys`` and ``values`` are the tensors this layer's last (unreserved) :meth:`update` returned, or
        equal to them: what an attention given anything else would compute (the pages hold what was written, not
        what the model made of it after ``update``) is not what the model asked for."""
        if self._given is None:
            return False
        k, v = self._given[0](), self._given[1]()
        if k is keys and v is values:
            return True
        return all(
            a is not None and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
            for a, b in ((k, keys), (v, values))
        )

    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole context in transformers' frame (left padding restored as zeros): two ``[B, Hkv, L, D]`` copies."""
        if self.cache.evicted:
            raise NotImplementedError(
                "this PagedKVCache has freed blocks (SinkWindow(evict=True) or SnapKV): a forward of several tokens, "
                "or an attention that reads the whole cache, cannot run on it. Decode one token per step, or use a "
                "policy that keeps every block."
            )
        table = self.cache.table.tensor(self.device)
        pads = self.cache.pads_tensor(self.device)
        real = torch.arange(self.length, device=self.device).view(1, -1) - pads.view(-1, 1)  # [B, L]
        phys, off = reference.physical_slots(table, real, self.k_pool.shape[2])
        pad = (real < 0).view(*real.shape, 1, 1)
        keys = self.k_pool[phys, :, off].masked_fill(pad, 0).transpose(1, 2)  # [B, L, H, D] -> [B, H, L, D]
        values = self.v_pool[phys, :, off].masked_fill(pad, 0).transpose(1, 2)
        return keys, values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        if self.cache.static is not None:  # a static step's mask has the reserved length (the attention ignores it)
            return self.cache.static.max_length, 0
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:  # the cache crops every layer at once
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:  # the cache reorders the shared table
        pass

    def batch_repeat_interleave(self, repeats: int) -> None:
        pass

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        pass

    def bytes_per_block(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(t[0].numel() * t.element_size() for t in self._tensors())


def _same_shape(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and a.shape == b.shape


@dataclass(frozen=True)
class _Refill:
    """What :meth:`PagedKVCache.load_static` last loaded: its source (weakly), the source's stamp, the reservation
    and its layout then, and the holes left per sequence."""

    source: weakref.ref
    stamp: tuple
    static: StaticBuffers
    mine: tuple
    holes: tuple


class PagedKVCache(DynamicCache):
    """A block-paged KV cache for a patched model (works with ``generate()``, beam search, ``crop()``).

    Args:
        config: the model's config (or the model): its layer types decide which layers are paged (full attention)
            and which keep transformers' sliding-window layer.
        block_size: tokens per block, a power of two between 8 and 256.
        backend: ``"auto"`` (Triton on CUDA, the PyTorch reference elsewhere), ``"reference"`` or ``"triton"``.
        max_length: tokens per sequence to reserve room for at the first write (``generate()`` passes its maximum
            length), so the pool is allocated once instead of grown by copies.
        static: decode in static steps (:mod:`hf_sparse_kv.graphs`): the first single-token forward after the prefill
            calls :meth:`reserve_static` with ``max_length`` (required); the cache then tells transformers it is
            compileable (``generate(compile_config=...)`` compiles its decode steps).

    ``block_size`` and ``backend`` are owned here: a model patched with other values refuses this cache.
    ``memory_bytes()`` is what the cache holds; ``blocks_in_use`` the blocks referenced by some sequence;
    ``kv_bytes_read``, ``decode_steps`` and ``auto_steps`` read the decode session's counters (see
    :mod:`hf_sparse_kv.runtime`).
    """

    def __init__(
        self, config, block_size: int = 16, backend: str = "auto", max_length: int | None = None, static: bool = False
    ):
        check_block_size(block_size)
        if static and not max_length:
            raise ValueError("PagedKVCache(static=True) needs max_length: the tokens per sequence to reserve")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of 'auto', 'reference', 'triton', got {backend!r}")
        config = getattr(config, "config", config)  # a model is accepted too
        super().__init__(config=config)
        self.block_size = block_size
        self.backend = backend
        self.max_length = max_length
        self.static_decoding = static
        self.table = BlockTable(block_size)
        self._deferred: set[int] = set()  # layers whose next update() returns only the new K/V (defer_reads)
        self.pads: list[int] = []  # left padding per sequence, dropped from the pages
        self._pads_on: dict = {}  # device -> pads as a tensor
        self._ops: dict = {}  # (backend, device) -> op namespace
        self.specs: tuple = ()  # per-token / per-block state a policy declared (declare_state)
        # the key metadata every paged layer keeps (declare_state: what the policy reads; all of it until then)
        self.metadata: tuple[str, ...] = KEY_METADATA
        self.evicted = False  # some blocks were freed by an evicting policy (their positions stay counted)
        self.static: StaticBuffers | None = None  # set by reserve_static() for static decoding
        self._sliding: dict = {}  # layer index -> transformers' sliding-window layer a WindowRing replaced
        self._evicted_to: list[int] = []  # per sequence, logical blocks below this were already considered
        self.session = DecodeSession()  # the decode side's state of these contents (hf_sparse_kv.runtime)
        self._refill: _Refill | None = None  # what the last load_static held (a refill from the same contents redoes
        # only what changed since)
        self.layers = [
            PagedLayer(self, i) if type(layer) is DynamicLayer else layer for i, layer in enumerate(self.layers)
        ]
        if not self.layers:
            raise ValueError("PagedKVCache needs a config that names its layers (num_hidden_layers)")

    def __getstate__(self) -> dict:
        """For pickling (``torch.save(past_key_values)``): the contents, table, padding, declared state and session;
        not what a refill remembers of its source (held weakly: the next refill of a loaded copy is whole) nor the
        op namespaces (looked up again)."""
        return {**self.__dict__, "_refill": None, "_ops": {}}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        for layer in self.paged_layers:
            layer.attach(self)

    def __deepcopy__(self, memo: dict) -> PagedKVCache:
        """A copy that owns copies of everything (pools, table, session); its layers belong to the copy. Not copied:
        the session's captured-graph runner (it holds the model: the copy captures its own)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        for layer in new.paged_layers:
            layer.attach(new)
        return new

    @classmethod
    def stacked(cls, config, rows: list[PagedKVCache], pads: list[int], consume: bool = False) -> PagedKVCache:
        """One cache of ``len(rows)`` sequences holding ``rows[b]``'s contents as sequence ``b``, left-padded by
        ``pads[b]``: what a first prefill of the left-padded batch would hold (up to block numbering), made from
        prefills of one sequence each (no padding, no ``[B, 1, L, L]`` mask, a sequence's activations at a time).

        ``rows``: filled caches of one sequence each (no padding), of ``config``'s layer layout with every layer
        paged, one block size and backend, the same declared state, nothing evicted, not reserved, no observation
        pending; their lengths plus ``pads`` must agree (the batch's frame). Raises ``ValueError`` otherwise, before
        anything is made. The new pools hold the rows' blocks one after the other and one spare block a sequence.
        ``consume``: each row's layer lets go of its pools once copied and the rows end reset (empty, as after
        :meth:`reset`), so the rows and the new cache never hold two copies of the whole batch at once."""
        why = ""
        first = rows[0] if rows else None
        frame = {r.get_seq_length() + p for r, p in zip(rows, pads)}
        if not rows or len(pads) != len(rows):
            why = f"{len(rows)} caches and {len(pads)} paddings"
        elif any(len(r.table.rows) != 1 or any(r.pads) for r in rows):
            why = "each cache must hold one sequence without padding"
        elif any(not r.paged_layers or len(r.paged_layers) != len(r.layers) for r in rows):
            why = "every layer must be paged (a sliding-window layer holds its padded window: prefill the batch)"
        elif len({(r.block_size, r.backend, len(r.layers), r.specs, r.metadata) for r in rows}) > 1:
            why = "the caches differ in block size, backend, layers, declared state or key metadata"
        elif any(r.evicted or r.static is not None or r.session.peek_observation() is not None for r in rows):
            why = "a cache has evicted blocks, a static reservation or a pending observation"
        elif len(frame) != 1 or min(pads) < 0 or 0 in {r.get_seq_length() for r in rows}:
            why = f"lengths {[r.get_seq_length() for r in rows]} and paddings {pads} do not make one frame"
        if why:
            raise ValueError(f"PagedKVCache.stacked: {why}")
        length = frame.pop()
        new = cls(config, block_size=first.block_size, backend=first.backend)
        if len(new.layers) != len(first.layers) or len(new.paged_layers) != len(new.layers):
            raise ValueError("PagedKVCache.stacked: config's layer layout is not the caches'")
        counts = [len(r.table.rows[0]) for r in rows]
        capacity = sum(counts) + len(rows)  # one spare block a sequence, as a first write reserves
        new.table.grow(capacity)
        new.table.rows = [[new.table.take() for _ in range(n)] for n in counts]
        new.table.invalidate()
        new.pads, new.specs, new.metadata = list(pads), first.specs, first.metadata
        made: dict = {}  # per device: each row's blocks (one copy to it)
        for i, layer in enumerate(new.layers):
            parts = [r.layers[i] for r in rows]
            index = host_ints_on(made, parts[0].device, tuple(r.table.rows[0] for r in rows))
            tensors = []
            for same in zip(*(part._tensors() for part in parts)):  # one tensor kind (K, V, a metadata, a state)
                held = torch.cat([t.index_select(0, idx) for t, idx in zip(same, index)])
                tensors.append(torch.cat([held, held.new_zeros((len(rows), *held.shape[1:]))]))
            layer.device, layer.dtype = parts[0].device, parts[0].dtype
            whole = parts[0].layer_scoped()  # the state by block is replaced below (the stacked tensors)
            layer.state = {name: t.clone() if name in whole else None for name, t in parts[0].state.items()}
            layer._replace(tensors, parts[0].kept_metadata())
            layer.is_initialized = True
            layer.length = length
            if layer.layer_scoped():  # each row's was fitted on its own keys: fitted on the batch's, state recomputed
                layer.refresh_all()
            if consume:
                for part in parts:
                    part.free_pools()
        if consume:
            for r in rows:
                r.reset()
        new.table.invalidate()
        return new

    @property
    def is_compileable(self) -> bool:
        """Whether transformers may compile a decode step on this cache: a cache that decodes in static steps, unless
        the patch's captured graphs run them (``cuda_graph=True``: the graphs hold their own compiled step, and
        ``generate()`` would otherwise build every step's full ``[B, 1, 1, L]`` mask for a forward that replays a
        graph and never reads it)."""
        return self.static_decoding or (self.static is not None and not self.session.graphs)

    @property
    def paged_layers(self) -> list[PagedLayer]:
        return [layer for layer in self.layers if isinstance(layer, PagedLayer)]

    @property
    def static_device(self) -> torch.device | None:
        """Where a static reservation's buffers live (:meth:`reserve_static`) and its captured steps run: the first
        paged layer's device, else the first layer's (``None`` before the first write)."""
        layers = self.paged_layers or self.layers
        device = getattr(layers[0], "device", None) if layers else None
        return None if device is None else torch.device(device)

    @property
    def blocks_in_use(self) -> int:
        return self.table.blocks_in_use

    # the decode session's counters and pending observations, read-only (hf_sparse_kv.runtime writes them)
    @property
    def kv_bytes_read(self) -> int:
        return self.session.counters.kv_bytes_read

    @property
    def decode_steps(self) -> int:
        return self.session.counters.decode_steps

    @property
    def auto_steps(self) -> dict:
        return dict(self.session.counters.auto_steps)

    @property
    def observed(self) -> dict:
        return dict(self.session.observed)

    def pads_tensor(self, device) -> torch.Tensor:
        """``[B]`` int32: left padding of each sequence (tokens of transformers' frame not stored); made once per
        device and batch, so a decode step copies nothing from the host."""
        pads = tuple(self.pads)
        key = (str(device), pads)
        if key not in self._pads_on:
            self._pads_on = {k: v for k, v in self._pads_on.items() if k[1] == pads}  # other devices, same batch
            self._pads_on[key] = torch.tensor(self.pads, dtype=torch.int32, device=device)
        return self._pads_on[key]

    def ops(self, device, backend: str | None = None) -> SimpleNamespace:
        """The op namespace of this cache's backend (or ``backend``) on ``device`` (looked up once)."""
        backend = backend or self.backend
        key = (backend, str(device))
        if key not in self._ops:
            self._ops[key] = get_ops(backend, device)
        return self._ops[key]

    def set_padding(self, pads: list[int]) -> None:
        """Declare each sequence's left padding before the first write (the patched attention reads it from the
        prefill mask); the padded positions are never stored."""
        if self.table.rows:
            raise ValueError("left padding can only be declared before the first write of a PagedKVCache")
        self.pads = list(pads)

    def declare_state(self, specs: tuple, metadata: tuple[str, ...] | None = None) -> None:
        """Declare the per-token, per-block or per-layer state (``StateSpec``s, see
        :class:`hf_sparse_kv.policies.StateSpec`) and the key metadata (names of
        :data:`~hf_sparse_kv.ops.layout.KEY_METADATA`; ``None``: as kept now) every paged layer keeps beside its keys
        and refreshes at every write: what the patched policy reads
        (``cache_state()``, ``key_metadata()``). Before the first write it replaces what was declared (a new cache
        keeps all three metadata until then; state specs that cover the new ones are kept); what the cache keeps
        already is served as it is; a filled cache adopts what it lacks, computed from its stored keys
        (:meth:`PagedLayer.adopt_state`, :meth:`PagedLayer.adopt_metadata`: a cache prefilled once serves a policy
        that reads more; key metadata for the blocks still held), unless the cache is reserved for static steps
        (captured with what it had) or, for state specs, a block was evicted (its keys are gone): then a
        ``ValueError`` with advice, nothing changed. One state per name: a spec of a kept name that is not equal to
        the kept one replaces it (adopted as above), and unequal specs of one name declared together are refused
        (``ValueError``)."""
        specs = tuple(dict.fromkeys(specs))  # equal specs (two policies keeping the same state) once
        names = [s.name for s in specs]
        clash = sorted({n for n in names if names.count(n) > 1})
        if clash:
            raise ValueError(
                f"different state is declared under one name ({', '.join(clash)}): the policies keep other contents "
                "under it (e.g. other codes); decode them on separate caches"
            )
        wanted = self.metadata if metadata is None else tuple(metadata)
        unknown = [name for name in wanted if name not in KEY_METADATA]
        if unknown:
            raise ValueError(f"key metadata must be among {KEY_METADATA}, got {unknown}")
        if "kmin" in wanted or "kmax" in wanted:  # a write computes both at once: kept together
            wanted = (*wanted, "kmin", "kmax")
        wanted = tuple(name for name in KEY_METADATA if name in wanted)
        if not self.table.rows:  # before the first write: the metadata replaced, state specs kept if they cover
            specs = self.specs if set(specs) <= set(self.specs) else specs
            if (specs, wanted) != (self.specs, self.metadata):
                self.specs, self.metadata = specs, wanted
                for layer in self.paged_layers:  # pools kept from before a reset() get the new state beside them
                    layer.allocate_state()
            return
        if set(specs) <= set(self.specs) and set(wanted) <= set(self.metadata):  # kept already (a cache may keep
            return  # more than a policy reads)
        new = tuple(s for s in specs if s not in self.specs)
        new_meta = tuple(name for name in wanted if name not in self.metadata)
        # a block's metadata comes from its own keys (computed for the blocks still held); per-token state of
        # freed positions is gone
        why = "a block was evicted" if self.evicted and new else ""
        why = why or ("it is reserved for static steps" if self.static is not None else "")
        if why:
            names = ", ".join([s.name for s in specs] + list(wanted)) or "none"
            kept = ", ".join([s.name for s in self.specs] + list(self.metadata)) or "none"
            raise ValueError(
                f"this PagedKVCache keeps state ({kept}) other than what the patched policy needs ({names}) and "
                f"cannot compute it now ({why}): use a fresh PagedKVCache, or cache.reset() it"
            )
        replaced = {s.name for s in new}  # a kept name under another spec: the new one's state replaces it
        self.specs = tuple(s for s in self.specs if s.name not in replaced) + new
        self.metadata = tuple(name for name in KEY_METADATA if name in self.metadata or name in new_meta)
        for layer in self.paged_layers:
            layer.adopt_state(new)
            layer.adopt_metadata(new_meta)

    def memory_bytes(self) -> int:
        """Bytes the cache holds: blocks in use times the per-block bytes of every paged layer (K, V, metadata, state
        by token or block), its state of layer scope, plus the sliding-window layers' tensors. The pool's unused
        capacity is not counted."""
        paged = self.blocks_in_use * sum(layer.bytes_per_block() for layer in self.paged_layers)
        paged += sum(t.numel() * t.element_size() for layer in self.paged_layers for t in layer.layer_state())
        sliding = 0
        for layer in self.layers:
            if not isinstance(layer, PagedLayer) and getattr(layer, "keys", None) is not None:
                sliding += layer.keys.numel() * layer.keys.element_size() * 2
        return paged + sliding

    def capacity_bytes(self) -> int:
        """Bytes reserved by the pools, free blocks included."""
        return self.table.capacity * sum(layer.bytes_per_block() for layer in self.paged_layers)

    # ---- handshake with the patched attention --------------------------------------------------------------------

    def defer_reads(self, layer_idx: int) -> None:
        """Called by the patched attention before ``update``: the next ``update`` of this layer returns only the new
        K/V (the attention reads the pages itself) instead of a dense copy of the whole context."""
        self._deferred.add(layer_idx)

    def advance(self, tokens: int) -> None:
        """Move every paged layer's (and sliding-window ring's) length by ``tokens`` without writing: a static step
        writes on the device only, and its host bookkeeping runs before it."""
        for layer in self.layers:
            if isinstance(layer, (PagedLayer, WindowRing)):
                layer.length += tokens

    def pop_deferred(self, layer: PagedLayer) -> bool:
        idx = self.layers.index(layer)
        if idx in self._deferred:
            self._deferred.discard(idx)
            return True
        return False

    # ---- block management --------------------------------------------------------------------------------------

    def _ensure_free(self, n: int, exact: bool = False) -> None:
        """Make ``n`` blocks free: grow the pools to ``POOL_GROWTH`` times their capacity (or to what is needed, if
        more), or with ``exact`` to what is needed only (a reservation that never grows again)."""
        if len(self.table.free) >= n:
            return
        needed = self.table.capacity - len(self.table.free) + n
        grown = needed if exact else int(self.table.capacity * POOL_GROWTH)
        capacity = max(MIN_POOL_BLOCKS, grown, needed)
        self.table.grow(capacity)
        for layer in self.paged_layers:
            layer.grow(capacity)
        self.table.invalidate()

    def check_batch(self, batch_size: int) -> None:
        """Raise a ``ValueError`` if the cache holds sequences and not ``batch_size`` of them (a batch of another size
        needs a reset or a new cache). The patch checks before any layer runs: transformers' sliding-window layers
        (Gemma-3) would otherwise fail first in a ``torch.cat``."""
        rows = len(self.table.rows)
        if rows and rows != batch_size:
            raise ValueError(
                f"PagedKVCache holds {rows} sequences but got a batch of {batch_size}: call cache.reset() "
                "before reusing it for another batch, or make a new PagedKVCache"
            )

    def reserve(self, batch_size: int, length: int, write_from: int, exact: bool = False) -> None:
        """Make every sequence's table cover ``length`` tokens of transformers' frame and make the blocks written
        from ``write_from`` on private to their sequence (copy on write). ``exact``: the pools grow to the blocks
        needed only (:meth:`reserve_static`'s final reservation), not by ``POOL_GROWTH``."""
        t = self.table
        if not t.rows:
            t.rows = [[] for _ in range(batch_size)]
            self.pads = self.pads if len(self.pads) == batch_size else [0] * batch_size
            if self.max_length:
                self._ensure_free(batch_size * cdiv(self.max_length, self.block_size))
            else:  # the prompt and one spare block per sequence: the first decode steps do not double the pool
                self._ensure_free(sum(cdiv(length - p, self.block_size) + 1 for p in self.pads))
        else:
            self.check_batch(batch_size)
        need = [cdiv(length - p, self.block_size) for p in self.pads]
        first = [max(write_from - p, 0) // self.block_size for p in self.pads]
        shared = [
            (b, lb)
            for b, row in enumerate(t.rows)
            for lb in range(first[b], len(row))
            if row[lb] >= 0 and t.refcount[row[lb]] > 1
        ]
        missing = sum(max(0, n - len(row)) for n, row in zip(need, t.rows))
        if not shared and not missing:
            return
        self._ensure_free(missing + len(shared), exact)
        for b, lb in shared:
            old = t.rows[b][lb]
            new = t.take()
            for layer in self.paged_layers:
                layer.copy_block(old, new)
            t.release(old)
            t.rows[b][lb] = new
        for n, row in zip(need, t.rows):
            while len(row) < n:
                row.append(t.take())
        t.invalidate()

    def reserve_static(self, max_length: int, any_padding: bool = False) -> StaticBuffers:
        """Prepare for static decoding (compiled or CUDA-graph steps): allocate every block up to ``max_length``
        tokens (transformers' frame) now, so the block table never changes again, keep the step's positions in
        device buffers that a static step reads, and turn each sliding-window layer into a :class:`WindowRing` of
        fixed shape. Left padding is kept (its starts become a device buffer).

        Call after the prefill. From then on every forward on this cache is a single-token static step whose
        buffers :meth:`StaticBuffers.begin_step` fills first (``hf_sparse_kv.graphs.begin_static_step`` does it);
        :meth:`reset` ends the reservation. A cache whose blocks a policy that frees once (SnapKV) already freed
        can be reserved: its table keeps the holes (``-1``), which static steps never select and never free more
        (a static step does not call the policy's ``release``); a policy that frees at every step is not supported
        (the graphs refuse it: its table changes).

        ``any_padding``: give every sequence blocks for ``max_length`` stored tokens (not ``max_length`` less its
        padding), so that :meth:`load_static` can later refill the reservation with a batch padded otherwise."""
        if not self.table.rows and not any(isinstance(layer, DynamicSlidingWindowLayer) for layer in self.layers):
            raise ValueError("reserve_static needs a filled cache (call it after the prefill)")
        if self.static is not None:
            return self.static
        length = self.get_seq_length()
        if max_length <= length:
            raise ValueError(f"reserve_static: max_length={max_length} leaves no room after {length} tokens")
        device = self.static_device
        B = len(self.table.rows) or self.layers[0].keys.shape[0]
        pads = self.pads if len(self.pads) == B else [0] * B
        if self.table.rows:
            # exact: the table never changes again, so room to grow would only hold memory (a refilled slot of 8 x 32K
            # on Qwen2.5 doubled to ~15 GB instead of ~7.6)
            self.reserve(B, max_length + (max(pads) if any_padding else 0), length, exact=True)
        zeros = torch.zeros(B, dtype=torch.int32, device=device)
        table = self.table.tensor(device) if self.table.rows else zeros.view(B, 1)
        backend = resolve_backend(self.backend, device)
        pads_t = torch.tensor(pads, dtype=torch.int32, device=device)
        frame = torch.zeros(1, dtype=torch.long, device=device)
        positions = torch.zeros(B, 1, dtype=torch.long, device=device)
        ops = registered_ops(backend)
        counts = torch.zeros(B, dtype=torch.long, device=device)
        self.static = StaticBuffers(
            max_length, frame, zeros.clone(), zeros.clone(), zeros, pads_t, positions, counts, table, ops
        )
        if self.evicted:  # freed blocks stay holes of the fixed table: what each row holds, reserved blocks included
            self.static.evicted = self.evicted_counts()
            self.static.held = max(sum(1 for blk in row if blk >= 0) for row in self.table.rows)
        self.pads = pads
        for i, layer in enumerate(self.layers):
            if isinstance(layer, DynamicSlidingWindowLayer):
                self._sliding[i] = layer
                self.layers[i] = WindowRing(layer, length, self.static)
        self._mark_static()
        return self.static

    def load_static(self, source: PagedKVCache, free: list | None = None, whole: bool = False) -> None:
        """Refill this cache, reserved for static decoding (:meth:`reserve_static`), with the contents of ``source``
        (a filled cache of as many sequences, not reserved, nothing evicted: e.g. a shared prefill) in place: every
        tensor a static step reads keeps its address, so the steps captured on this cache
        (:class:`~hf_sparse_kv.graphs.DecodeGraphs`) replay on the new contents instead of being captured again.

        ``free``: per sequence, logical blocks of ``source`` to leave out, as a policy that frees once (SnapKV)
        frees them at its first decode step (its ``blocks_to_free`` of ``source``'s observation at that step's
        lengths; full blocks of the stored context only). They are not copied and become holes (``-1``) of the
        step's table (:attr:`StaticBuffers.table`, rewritten in place, with :attr:`StaticBuffers.evicted` and
        ``held``), which the steps never select: the refill is what that policy's cache holds after its first step,
        and its static steps decode from the first one (the decode session counts the observation as handed over).
        The blocks stay this reservation's; the next refill without ``free`` gives the table all of them back.

        Each paged layer's pools, metadata and declared state are zeroed and ``source``'s blocks copied into this
        cache's blocks of the same sequence and position (the declared state, and key metadata this reservation keeps
        and ``source`` does not, recomputed from the copied keys: what a reservation of ``source`` itself would hold,
        up to block numbering). A refill from the same, unchanged
        contents as the last one (the same ``source`` object, nothing written into it or its table changed since,
        this reservation only decoded in static steps since) rewrites only what differs: each sequence's blocks
        from its context's last partial block on (where the steps wrote), and the blocks whose hole status
        changed; every tensor ends as a whole refill leaves it (a suite batch's 22 turns on the slot refill it whole
        twice, once per shared prefill, instead of 22 times: ~27 ms each on an H100 at 8 x 32K on Qwen2.5).
        ``whole``: refill whole anyway (what the partial refill saves can then be timed). Sliding-window rings take
        ``source``'s window; lengths and left padding (host and device) become ``source``'s; the decode session
        forgets its step and observations and keeps its captured steps and counters. Raises ``ValueError``, before
        anything changes, when ``source`` does not fit: another batch size, block size or layer layout, no room
        left for a step, or a sequence with less padding than the reservation's rows allow (reserve with
        ``any_padding=True``)."""
        holes = self._check_load(source, free)
        B, BS = len(self.table.rows), self.block_size
        length = source.get_seq_length()
        pads = list(source.pads) if len(source.pads) == B else [0] * B
        stored = [max(length - p, 0) for p in pads]
        stamp = source._stamp()
        last = self._refill
        fit = any(  # state of layer scope the source lacks (of this shape): fitted on the copied keys (a whole refill)
            not _same_shape(getattr(theirs, "state", {}).get(name), mine.state[name])
            for mine, theirs in zip(self.paged_layers, source.paged_layers)
            for name in mine.layer_scoped()
        )
        partial = (
            not whole
            and not fit
            and last is not None
            and last.source() is source
            and last.stamp == stamp
            and last.static is self.static
            and last.mine == self._layout()
            and (not self.specs or last.holes == tuple(map(frozenset, holes)))
        )
        if partial:  # the same contents as the last refill: only what the steps since wrote, and the holes that moved
            dst, src, zero = self._changed_blocks(source, stored, last.holes, holes)
        else:
            need = [cdiv(n, BS) for n in stored]
            kept = [[j for j in range(need[b]) if j not in holes[b]] for b in range(B)]
            dst = [self.table.rows[b][j] for b in range(B) for j in kept[b]]
            src = [source.table.rows[b][j] for b in range(B) for j in kept[b]]
            zero = None
        index: dict = {}  # per device, made once for all its layers
        for mine, theirs in zip(self.layers, source.layers):
            if isinstance(mine, PagedLayer):
                d, s, z = host_ints_on(index, mine.device, (dst, src, zero or []))
                mine.load(theirs, length, d, s, z if zero is not None else None)
            elif isinstance(mine, WindowRing):
                mine.load(theirs, length)
        self.pads = pads
        self._pads_on = {}
        self.static.reload(pads, *self._holed_table(holes))
        self._deferred.clear()
        self.session.reload(released=free is not None)
        lo = [(n // BS) * BS if partial else 0 for n in stored]  # a partial refill: from the first block it rewrote
        bounds: dict = {}  # per device: lo, hi
        for layer in self.paged_layers:
            if layer.state:
                lo_t, hi_t = host_ints_on(bounds, layer.device, (lo, stored))
                span = max(1, *(h - low for h, low in zip(stored, lo)))
                layer.refresh_state(lo_t, hi_t, span, starts=fit)
        for mine, theirs in zip(self.paged_layers, source.paged_layers):  # key metadata the source does not keep
            lacks = {name: getattr(mine, name) for name in mine.kept_metadata() if getattr(theirs, name) is None}
            if lacks:  # from the keys just copied, every stored block (a partial refill zeroes blocks before its
                mine.compute_metadata(lacks)  # first rewritten one too: those whose hole status changed)
        self._refill = _Refill(weakref.ref(source), stamp, self.static, self._layout(), tuple(map(frozenset, holes)))

    def _stamp(self) -> tuple:
        """What identifies these contents for a refill from them (:meth:`load_static`): the decode steps run on
        them, each paged layer's writes, length and pools, the padding and the table. Any write
        (:meth:`PagedLayer.update`, a block copied, a refill) or change of the table, padding or pools gives another
        stamp."""
        paged = self.paged_layers
        return (
            self.session.counters.decode_steps,
            tuple(layer.writes for layer in paged),
            tuple(layer.length for layer in paged),
            tuple(layer.k_pool.data_ptr() if layer.is_initialized else 0 for layer in paged),
            tuple(self.pads),
            tuple(map(tuple, self.table.rows)),
            self.evicted,
        )

    def _layout(self) -> tuple:
        """What a refill of this reservation (:meth:`load_static`) leaves as it was: its table, the addresses of every
        tensor and the declared state. Static steps change none of it; a reorder, a crop or new state change some (a
        reset forgets the refill, a new reservation is another :attr:`static`)."""
        ptrs = tuple(t.data_ptr() for layer in self.paged_layers if layer.is_initialized for t in layer._tensors())
        return (tuple(map(tuple, self.table.rows)), ptrs, self.specs, self.metadata)

    def _changed_blocks(
        self, source: PagedKVCache, stored: list[int], before: tuple, holes: list[set[int]]
    ) -> tuple[list[int], list[int], list[int]]:
        """The blocks a refill from the contents of the last one must rewrite (:meth:`load_static`): ``(dst, src,
        zero)``, this reservation's blocks to copy ``source``'s blocks ``src`` into and those to zero. Static steps
        since wrote only from each sequence's first partial block of ``source``'s context on (``stored[b] //
        block_size``), so those blocks, and every block after them, are rewritten as a whole refill would leave them
        (copied up to the context, zeroed past it); blocks that were holes of the last refill and are not now are
        copied, those that are now and were not are zeroed (holes lie in the stored context's full blocks)."""
        BS, dst, src, zero = self.block_size, [], [], []
        for b, (row, theirs, n) in enumerate(zip(self.table.rows, source.table.rows, stored)):
            need = cdiv(n, BS)
            for j in range(n // BS, len(row)):
                if j < need and j not in holes[b]:
                    dst.append(row[j])
                    src.append(theirs[j])
                else:
                    zero.append(row[j])
            for j in sorted(before[b] - holes[b]):
                dst.append(row[j])
                src.append(theirs[j])
            zero.extend(row[j] for j in sorted(holes[b] - before[b]))
        return dst, src, zero

    def _holed_table(self, holes: list[set[int]]) -> tuple[torch.Tensor | None, tuple[int, ...] | None, int | None]:
        """The step's table of a refill leaving ``holes[b]`` (logical blocks) of each sequence out, with its freed
        counts and the width of a dense selection of the blocks held, the table's (``StaticBuffers.reload``'s
        arguments); the table is a host tensor of the reserved table's shape, ``None`` where the table already holds
        every block and keeps doing so."""
        rows, table = self.table.rows, self.static.table
        if not any(holes) and self.static.evicted is None:
            return None, None, None  # the table holds every block and keeps doing so
        host = torch.full(tuple(table.shape), -1, dtype=table.dtype)
        for b, row in enumerate(rows):
            host[b, : len(row)] = torch.tensor([-1 if j in holes[b] else blk for j, blk in enumerate(row)])
        if not any(holes):
            return host, None, None
        # the dense selection of the blocks held as wide as the table (the entries past a row's blocks are -1): what
        # a refill holds varies with its padding and its policy, and a width that varied would key a new captured
        # step at every refill
        return host, tuple(len(h) for h in holes), table.shape[1]

    def _check_load(self, source: PagedKVCache, free: list | None = None) -> list[set[int]]:
        """Why ``source`` (and ``free``) cannot be loaded into this reservation (``ValueError``), or the blocks of
        each sequence to leave out (see :meth:`load_static`)."""
        if self.static is None:
            raise ValueError("load_static needs a cache reserved for static steps (call reserve_static first)")
        if not isinstance(source, PagedKVCache) or source.static is not None or source.evicted:
            raise ValueError("load_static takes a filled PagedKVCache that is not reserved and has no evicted block")
        if self.evicted:
            raise ValueError(
                "load_static cannot refill a reservation made after blocks were freed (its steps select the blocks "
                "its table held when reserved): reserve a cache without freed blocks"
            )
        B = len(self.table.rows)
        if (
            len(source.table.rows) != B
            or source.block_size != self.block_size
            or len(source.layers) != len(self.layers)
        ):
            raise ValueError(
                f"load_static: the source holds {len(source.table.rows)} sequences in blocks of {source.block_size} "
                f"over {len(source.layers)} layers; this reservation {B} in blocks of {self.block_size} over "
                f"{len(self.layers)}"
            )
        for i, (mine, theirs) in enumerate(zip(self.layers, source.layers)):
            if isinstance(mine, PagedLayer):
                ok = isinstance(theirs, PagedLayer) and theirs.is_initialized and mine.is_initialized
                ok = ok and theirs.k_pool.shape[1:] == mine.k_pool.shape[1:] and theirs.dtype == mine.dtype
                ok = ok and theirs.k_pool.device == mine.k_pool.device
            elif isinstance(mine, WindowRing):
                ok = isinstance(theirs, DynamicSlidingWindowLayer) and mine.fits(theirs)
            else:
                ok = False
            if not ok:
                raise ValueError(f"load_static: layer {i} of the source is not laid out as this reservation's")
        length = source.get_seq_length()
        if not 0 < length < self.static.max_length:
            raise ValueError(
                f"load_static: the source holds {length} tokens per sequence; this reservation takes 1 to "
                f"{self.static.max_length - 1} (and room for a step)"
            )
        pads = list(source.pads) if len(source.pads) == B else [0] * B
        short = [
            b for b, p in enumerate(pads) if cdiv(self.static.max_length - p, self.block_size) > len(self.table.rows[b])
        ]
        if short:
            raise ValueError(
                f"load_static: sequences {short} are padded less than this reservation's rows allow for its "
                f"{self.static.max_length} tokens: reserve_static(max_length, any_padding=True)"
            )
        if free is None:
            return [set() for _ in range(B)]
        full = [max(length - p, 0) // self.block_size for p in pads]  # whole blocks of each stored context
        if len(free) != B:
            raise ValueError(f"load_static: free names blocks of {len(free)} sequences; the source holds {B}")
        holes = [set(blocks) for blocks in free]
        wrong = {b: sorted(h - set(range(n))) for b, (h, n) in enumerate(zip(holes, full)) if h - set(range(n))}
        if wrong:
            raise ValueError(
                f"load_static: free may name only whole blocks of each stored context (0 to its length // "
                f"{self.block_size} - 1); got {wrong} (sequence: blocks)"
            )
        return holes

    def _mark_static(self) -> None:
        """Tell ``torch.compile`` that every tensor a static step reads or writes keeps its address (the pools are
        never regrown from here on), as transformers' ``StaticCache`` does: ``mode="reduce-overhead"``'s CUDA graphs
        then replay steps that write the pools in place instead of skipping them."""
        s = self.static
        tensors = [s.frame, s.seq_lens, s.pos0, s.start, s.pads, s.positions, s.counts, s.table]
        for layer in self.layers:
            if isinstance(layer, PagedLayer) and layer.is_initialized:
                tensors += layer._tensors() + layer.layer_state()  # the steps read the fitted centres too
            elif isinstance(layer, WindowRing):
                tensors += [layer.keys, layer.values]
        for t in tensors:
            torch._dynamo.mark_static_address(t)

    def evict(self, spans: list[tuple[int, int]]) -> int:
        """Free the blocks lying wholly inside ``spans[b] = (lo, hi)`` (stored positions) of each sequence.

        Their table entries become holes (-1): positions keep counting (RoPE was applied before caching), and a
        policy that evicts must never select them again. Returns the number of blocks freed."""
        t, BS = self.table, self.block_size
        if len(self._evicted_to) != len(t.rows):
            self._evicted_to = [0] * len(t.rows)
        blocks = []
        for b, (row, (lo, hi)) in enumerate(zip(t.rows, spans)):
            end = min(hi // BS, len(row))
            blocks.append(range(max(cdiv(lo, BS), self._evicted_to[b]), end))  # spans only grow: skip what was seen
            self._evicted_to[b] = max(self._evicted_to[b], end)
        return self.free_blocks(blocks)

    def free_blocks(self, blocks: list) -> int:
        """Free the logical blocks ``blocks[b]`` (an iterable of block numbers) of each sequence ``b``; their table
        entries become holes (-1), positions keep counting. Returns the number of blocks freed."""
        t, freed = self.table, 0
        for row, numbers in zip(t.rows, blocks):
            for lb in numbers:
                if 0 <= lb < len(row) and row[lb] >= 0:
                    t.release(row[lb])
                    row[lb] = -1
                    freed += 1
        if freed:
            self.evicted = True
            t.invalidate()
        return freed

    def compact(self) -> int:
        """Give freed pool memory back: move the blocks in use to the lowest ids and shrink every paged layer's pools
        to them plus some room to grow (``MIN_POOL_BLOCKS`` at least). Returns the new capacity in blocks.

        Called after a compressing or evicting policy freed most of the pool; needs no CUDA-graph reservation."""
        if self.static is not None:
            raise ValueError("a cache reserved for CUDA-graph decoding cannot be compacted")
        t = self.table
        live = [b for b in range(t.capacity) if t.refcount[b] > 0]
        capacity = max(MIN_POOL_BLOCKS, len(live) + len(live) // 4 + len(t.rows))
        if capacity >= t.capacity:
            return t.capacity
        new_id = {old: new for new, old in enumerate(live)}
        for layer in self.paged_layers:
            layer.repack(live, capacity)
        t.rows = [[new_id.get(b, -1) for b in row] for row in t.rows]
        t.refcount = [t.refcount[b] for b in live] + [0] * (capacity - len(live))
        t.free = list(range(capacity - 1, len(live) - 1, -1))
        t.capacity = capacity
        t.invalidate()
        return capacity

    def compact_if_mostly_free(self) -> None:
        """After blocks were freed: compact the pool when more than half of it is free (the memory goes back)."""
        if self.evicted and len(self.table.free) > self.table.capacity // 2:
            self.compact()

    def evicted_counts(self) -> tuple[int, ...] | None:
        """Blocks freed per sequence (``None`` when none was)."""
        return tuple(row.count(-1) for row in self.table.rows) if self.evicted else None

    def reset(self) -> None:
        """Return every block to the free list (the pools keep their capacity for the next sequence)."""
        for row in self.table.rows:
            for blk in row:
                self.table.release(blk)
        self.table.rows = []
        self.table.invalidate()
        self.pads = []
        self._refill = None
        self.evicted = False
        self._evicted_to = []
        self.static = None
        for i, layer in self._sliding.items():  # the rings of a static reservation give their layers back
            self.layers[i] = layer
        self._sliding = {}
        self.session.reset()  # plans, observations and captured steps belong to one generation (counters go on)
        self._deferred.clear()
        for layer in self.layers:
            layer.reset()
            if not isinstance(layer, PagedLayer):  # transformers < 5.2x zeroes them; the next batch may differ
                layer.keys = layer.values = None
                layer.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: sequence ``i`` becomes old sequence ``beam_idx[i]``; blocks are shared, not copied."""
        self._select_rows(beam_idx.tolist())
        for layer in self.layers:
            if not isinstance(layer, PagedLayer):
                layer.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([b for b in range(len(self.table.rows)) for _ in range(repeats)])
        for layer in self.layers:
            if not isinstance(layer, PagedLayer):
                layer.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(torch.as_tensor(indices).tolist())
        for layer in self.layers:
            if not isinstance(layer, PagedLayer):
                layer.batch_select_indices(indices)

    def _select_rows(self, sources: list[int]) -> None:
        t = self.table
        if not t.rows:
            return
        if self.static is not None:  # beam search shares blocks (copy on write): static steps cannot follow
            if self._sliding:
                raise NotImplementedError(
                    "a cache reserved for static decoding with sliding-window layers cannot be reordered"
                )
            self.static = None
            self.session.set_graphs(False)  # eager from now on
        new_rows = [list(t.rows[s]) for s in sources]
        for row in new_rows:
            for blk in row:
                if blk >= 0:
                    t.refcount[blk] += 1
        for row in t.rows:
            for blk in row:
                t.release(blk)
        t.rows = new_rows
        self.pads = [self.pads[s] for s in sources]
        self._evicted_to = [self._evicted_to[s] for s in sources] if self._evicted_to else []
        self.session.select_rows(sources)
        t.invalidate()

    def crop(self, max_length: int) -> None:
        """Keep the first tokens: ``max_length > 0`` is the length to keep, a negative value the tokens to drop,
        ``0`` drops nothing (transformers >= 5.2x calls ``crop(-n)`` with ``n`` the rejected candidate tokens of
        assisted or prompt-lookup decoding, ``n = 0`` when all were accepted; earlier versions pass the length to
        keep, which is never 0 there: ``reset()`` empties a cache). A 0-d tensor is read as its int (assisted
        decoding passes ``candidates - n_matches`` with ``n_matches`` on the model's device): the lengths stay host
        ints, which the selection's widths are made of."""
        max_length = int(max_length)
        length = self.get_seq_length()
        if max_length == 0:
            for layer in self.layers:  # transformers 5.2x: a sliding layer recording past states shrinks back to its
                if getattr(layer, "record_past", False):  # window on crop(0) (earlier layers have no record_past)
                    layer.crop(0)
            return
        keep = length + max_length if max_length < 0 else min(max_length, length)
        keep = max(keep, 0)
        if keep == length:
            return
        if self._sliding:
            raise NotImplementedError(
                "a cache reserved for static decoding with sliding-window layers cannot be cropped"
            )
        for layer in self.layers:  # transformers' own layers first: one that cannot crop (a sliding-window layer
            if not isinstance(layer, PagedLayer):  # past its window) raises before the pages or the table change
                layer.crop(keep - length)
        self.static = None  # the reservation and captured steps assumed the old table
        self.session.set_graphs(None)
        t = self.table
        for row, pad in zip(t.rows, self.pads):
            need = cdiv(max(keep - pad, 0), self.block_size)
            while len(row) > need:
                t.release(row.pop())
        t.invalidate()
        BS = self.block_size
        his = [max(keep - p, 0) for p in self.pads]  # stored tokens kept per sequence
        # each sequence's last (now partial) block and its filled slots, from the host: no read back per layer
        last = [(row[(h - 1) // BS], h - (h - 1) // BS * BS) for row, h in zip(t.rows, his) if h > 0]
        last = [(blk, n) for blk, n in last if blk >= 0]
        lists = ([b for b, _ in last], [n for _, n in last], [max(h - 1, 0) for h in his], his)
        made: dict = {}  # per device: blocks, fill, lo, hi
        for layer in self.paged_layers:
            layer.length = min(layer.length, keep)
            if layer.is_initialized and t.rows:
                blocks, fill, lo, hi = host_ints_on(made, layer.device, lists)
                if len(last):
                    reference.refresh_blocks(layer.k_pool, layer.kmin, layer.kmax, layer.kmean, blocks, fill)
                layer.refresh_state(lo, hi, 1)
