"""Unit tests of the cache's storage API (BlockTable, reserve_static, declared state) and of the policy lifecycle
as the attention drives it (docs/ARCHITECTURE.md): a new policy plugs in through its methods alone."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from tiny_models import DEVICE, greedy, prompt, tiny_model

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.cache import BlockTable
from hf_sparse_kv.graphs import DecodeGraphs
from hf_sparse_kv.ops import reference
from hf_sparse_kv.ops.layout import KEY_METADATA
from hf_sparse_kv.policies import DecodeState, Quest, Selection, StateSpec
from hf_sparse_kv.policies.blocks import _BlockTopK

pytestmark = pytest.mark.usefixtures("one_thread")
BS = 8


# ---- BlockTable ------------------------------------------------------------------------------------------------


def test_block_table_free_list_and_reference_counts():
    t = BlockTable(block_size=BS)
    assert t.capacity == 0 and t.blocks_in_use == 0
    t.grow(4)
    assert t.capacity == 4 and sorted(t.free) == [0, 1, 2, 3]
    a, b = t.take(), t.take()
    assert (a, b) == (0, 1), "blocks are handed out lowest id first"
    assert t.blocks_in_use == 2 and t.refcount[a] == 1
    t.refcount[a] += 1  # shared by a second sequence (what the cache's beam reorder does)
    t.release(a)
    assert t.blocks_in_use == 2 and a not in t.free, "a shared block stays until its last holder releases it"
    t.release(a)
    t.release(b)
    assert t.blocks_in_use == 0 and sorted(t.free) == [0, 1, 2, 3]
    t.release(-1)  # an evicted hole: nothing to release
    assert t.blocks_in_use == 0
    t.grow(6)
    assert t.capacity == 6 and sorted(t.free) == list(range(6)) and len(t.refcount) == 6


def test_block_table_tensor_is_cached_per_device_until_invalidated():
    t = BlockTable(block_size=BS)
    t.grow(8)
    t.rows = [[t.take(), t.take()], [t.take()]]
    first = t.tensor(torch.device("cpu"))
    assert first.dtype == torch.int32 and first.tolist() == [[0, 1], [2, -1]]
    assert t.tensor(torch.device("cpu")) is first, "built once per device"
    t.rows[1].append(t.take())
    assert t.tensor(torch.device("cpu")) is first, "a change is seen only after invalidate()"
    t.invalidate()
    assert t.tensor(torch.device("cpu")).tolist() == [[0, 1], [2, 3]]


def test_empty_block_table_tensor_has_one_column():
    t = BlockTable(block_size=BS)
    assert t.tensor(torch.device("cpu")).shape == (0, 1)


# ---- reserve_static ---------------------------------------------------------------------------------------------


def _filled_cache(model, length, batch=1, **kw):
    cache = PagedKVCache(model.config, block_size=BS, **kw)
    with torch.no_grad():
        model(prompt(length, batch=batch), use_cache=True, **{cache_kwarg(model): cache})
    return cache


def test_reserve_static_allocates_every_block_up_to_max_length():
    model = tiny_model("llama")
    patch_model(model, policy=Quest(budget=48), block_size=BS)
    cache = _filled_cache(model, 21, batch=2)
    before = [list(r) for r in cache.table.rows]
    static = cache.reserve_static(max_length=50)
    assert [len(r) for r in cache.table.rows] == [-(-50 // BS)] * 2
    assert [r[: len(b)] for r, b in zip(cache.table.rows, before)] == before, "the prompt's blocks stay in place"
    assert static.max_length == 50 and cache.static is static
    for buf in (static.seq_lens, static.pos0, static.start, static.pads):
        assert buf.shape == (2,) and buf.dtype == torch.int32 and buf.device.type == DEVICE.type
    assert not static.start.any()
    table = cache.table.tensor(DEVICE)
    assert table.shape == (2, -(-50 // BS)) and static.table is table
    # decoding into the reservation never changes the table again (the model hook begins each static step)
    with torch.no_grad():
        for i in range(5):
            model(prompt(1, batch=2, seed=i), use_cache=True, **{cache_kwarg(model): cache})
    assert cache.table.tensor(DEVICE) is table and cache.get_seq_length() == 26
    assert static.pos0.tolist() == [25, 25] and static.seq_lens.tolist() == [26, 26]
    unpatch_model(model)


def test_reserve_static_grows_the_pool_to_the_blocks_it_holds_not_by_the_growth_factor():
    """A static reservation is final (its table never changes again): a filled cache reserved a little further
    than its prompt holds no spare blocks, where growing by ``POOL_GROWTH`` would have doubled the pool (a refilled
    slot of 8 x 32K on Qwen2.5: ~15 GB instead of ~7.6); an unreserved cache still grows by it."""
    from hf_sparse_kv.cache import POOL_GROWTH

    model = tiny_model("llama")
    patch_model(model, policy=Quest(budget=48), block_size=BS)
    cache = _filled_cache(model, 100, batch=2)  # 13 blocks a row and one spare: 28
    grown = copy.deepcopy(cache)
    assert cache.table.capacity == 28
    cache.reserve_static(max_length=130)  # 17 blocks a row
    assert cache.table.capacity == 34 == cache.table.blocks_in_use and not cache.table.free
    assert all(t.shape[0] == 34 for layer in cache.paged_layers for t in layer._tensors())
    grown.reserve(2, 130, 100)  # the same blocks, unreserved: room to grow
    assert grown.table.capacity == int(28 * POOL_GROWTH)
    unpatch_model(model)


def test_reserve_static_refuses_what_a_captured_step_cannot_follow():
    model = tiny_model("llama")
    patch_model(model, policy=Quest(budget=48), block_size=BS)
    with pytest.raises(ValueError, match="filled cache"):
        PagedKVCache(model.config, block_size=BS).reserve_static(32)  # empty
    cache = _filled_cache(model, 40)
    cache.free_blocks([[1]])  # what a policy that frees once (SnapKV) leaves: a hole the steps never select
    static = cache.reserve_static(64)
    held = sum(1 for blk in cache.table.rows[0] if blk >= 0)
    assert static.evicted == (1,) and static.held == held == len(cache.table.rows[0]) - 1
    cache = PagedKVCache(model.config, block_size=BS)
    with torch.no_grad():
        mask = torch.ones(1, 20, dtype=torch.long, device=DEVICE)
        mask[:, :3] = 0
        model(prompt(20), attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})
    static = cache.reserve_static(64)  # left padding is kept, as a device buffer
    assert static.pads.tolist() == [3] and len(cache.table.rows[0]) == -(-(64 - 3) // BS)
    unpatch_model(model)


# ---- one owner for block_size and backend ----------------------------------------------------------------------


@pytest.mark.parametrize("setting", [{"block_size": 16}, {"backend": "reference"}])
def test_a_cache_that_disagrees_with_the_patch_is_refused(setting):
    model = tiny_model("llama")
    patch_model(model, policy=Quest(budget=48), block_size=BS, backend="auto")
    name = next(iter(setting))
    cache = PagedKVCache(model.config, **{"block_size": BS, "backend": "auto", **setting})
    with pytest.raises(ValueError, match=f"{name}="), torch.no_grad():
        model(prompt(20), use_cache=True, **{cache_kwarg(model): cache})
    with pytest.raises(ValueError, match=f"{name}="):
        greedy(model, prompt(20), new_tokens=2, **{cache_kwarg(model): cache})
    assert cache.blocks_in_use == 0, "refused before anything was written"
    unpatch_model(model)


# ---- the lifecycle: a policy with its own per-token and per-block state -----------------------------------------


def _norms_refresh(state, k_pool, table, lo, hi, **_):
    """Per-token state: each stored key's squared norm (summed over D), recomputed for positions [lo, hi)."""
    BSz = k_pool.shape[2]
    for b in range(table.shape[0]):
        for p in range(int(lo[b]), int(hi[b])):
            blk, off = int(table[b, p // BSz]), p % BSz
            state[blk, :, off] = k_pool[blk, :, off].float().pow(2).sum(-1).to(state.dtype)


def _block_max_refresh(state, k_pool, table, lo, hi, **_):
    """Per-block state: the largest key entry of each block, over all its stored keys (zero-padded tail included:
    the test compares with the same rule)."""
    BSz = k_pool.shape[2]
    for b in range(table.shape[0]):
        if int(hi[b]) <= int(lo[b]):
            continue
        for lb in range(int(lo[b]) // BSz, -(-int(hi[b]) // BSz)):
            blk = int(table[b, lb])
            state[blk] = k_pool[blk].amax((1, 2)).unsqueeze(-1).to(state.dtype)


NORMS = StateSpec("norms", "token", lambda D: (), _norms_refresh, torch.float32)
BLOCK_MAX = StateSpec("block_max", "block", lambda D: (1,), _block_max_refresh)


@dataclass
class _NormTopK(_BlockTopK):
    """A test selector: blocks ranked by the largest stored key norm, read from the state it declares. It also
    records the lifecycle calls the attention makes."""

    calls: list | None = None

    def cache_state(self):
        return (NORMS, BLOCK_MAX)

    def observe_prefill(self, query, key, mask, pads, block_size, scale):
        self.calls.append(("observe", int(query.shape[2])))

    def release(self, cache, lens, observation):
        self.calls.append(("release", lens, observation.scores is None))

    def scores(self, state: DecodeState) -> torch.Tensor:
        norms = state.state["norms"]  # [NB, Hkv, BS]
        table = state.block_table.long().clamp(min=0)
        s = norms[table].amax(-1).permute(0, 2, 1).float()  # [B, Hkv, nblk]
        live = reference.live_blocks(state.block_table, state.seq_lens, state.block_size)
        forced = self.forced_blocks(state, self.sink, self.window)
        s = s.masked_fill(forced.unsqueeze(1), float("inf"))
        return s.masked_fill(~live.unsqueeze(1), float("-inf"))


def _check_state(cache: PagedKVCache):
    """Every paged layer's declared state equals a recomputation from its key pool."""
    for layer in cache.paged_layers:
        table = cache.table.tensor(layer.device)
        for b, row in enumerate(cache.table.rows):
            n = layer.length - cache.pads[b]
            for p in range(n):
                blk, off = row[p // BS], p % BS
                want = layer.k_pool[blk, :, off].float().pow(2).sum(-1)
                torch.testing.assert_close(layer.state["norms"][blk, :, off], want, rtol=1e-5, atol=1e-5)
            for lb in range(-(-n // BS)):
                blk = int(table[b, lb])
                torch.testing.assert_close(
                    layer.state["block_max"][blk, :, 0], layer.k_pool[blk].amax((1, 2)), rtol=0, atol=0
                )


def test_a_new_policy_plugs_in_through_its_lifecycle_methods():
    model = tiny_model("llama")
    policy = _NormTopK(budget=16, sink=2, window=4, calls=[])
    patch_model(model, policy=policy, block_size=BS, dense_layers=(0,))
    ids = prompt(37, batch=2)
    seqs, _ = greedy(model, ids, new_tokens=6)
    observes = [c for c in policy.calls if c[0] == "observe"]
    releases = [c for c in policy.calls if c[0] == "release"]
    assert observes == [("observe", 37)] * 3, "every paged layer of the prefill is offered the observation"
    assert len(releases) == 5, "one release per decode step (the last token is not written), before selecting"
    assert releases[0][1] == (38, 38) and all(r[2] for r in releases)
    assert seqs.shape == (2, 43)
    unpatch_model(model)


def test_declared_state_follows_writes_beam_reorder_crop_and_compaction():
    model = tiny_model("llama")
    patch_model(model, policy=_NormTopK(budget=16, sink=2, window=4, calls=[]), block_size=BS)
    cache = PagedKVCache(model.config, block_size=BS)
    with torch.no_grad():
        model(prompt(29, batch=2), use_cache=True, **{cache_kwarg(model): cache})
        _check_state(cache)
        assert all(set(layer.state) == {"norms", "block_max"} for layer in cache.paged_layers)
        for i in range(3):
            model(prompt(1, batch=2, seed=10 + i), use_cache=True, **{cache_kwarg(model): cache})
        _check_state(cache)
        cache.reorder_cache(torch.tensor([1, 1], device=DEVICE))  # beams share every block
        model(prompt(1, batch=2, seed=20), use_cache=True, **{cache_kwarg(model): cache})  # copy on write
        _check_state(cache)
        cache.crop(27)  # back into a partial block
        model(prompt(1, batch=2, seed=21), use_cache=True, **{cache_kwarg(model): cache})
        _check_state(cache)
        cache.free_blocks([[0, 1, 2], [0, 1, 2]])
        cache.compact()
        _check_state_live(cache)
    unpatch_model(model)


def _check_state_live(cache: PagedKVCache):
    for layer in cache.paged_layers:
        for row in cache.table.rows:
            for blk in row:
                if blk >= 0:
                    torch.testing.assert_close(
                        layer.state["block_max"][blk, :, 0], layer.k_pool[blk].amax((1, 2)), rtol=0, atol=0
                    )
                    want = layer.k_pool[blk].float().pow(2).sum(-1)
                    got = layer.state["norms"][blk]
                    filled = want != 0  # the unwritten tail of the last block is zero in both
                    torch.testing.assert_close(got[filled], want[filled], rtol=1e-5, atol=1e-5)


def test_a_filled_cache_adopts_a_declared_state_from_its_keys():
    """A cache filled under a policy without state gains the state of the next one, computed from the stored keys:
    equal to what the writes would have left, left padding included; its decode steps keep it up to date."""
    model = tiny_model("llama")
    patch_model(model, policy=Quest(budget=48), block_size=BS)
    cache = PagedKVCache(model.config, block_size=BS)
    ids = prompt(21, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # the second sequence left-padded by 5
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})
    assert cache.specs == () and all(not layer.state for layer in cache.paged_layers)
    patch_model(model, policy=_NormTopK(budget=48, calls=[]), block_size=BS)
    mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype, device=mask.device)], 1)
    with torch.no_grad():
        model(prompt(1, batch=2), attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})
    assert set(cache.specs) == {NORMS, BLOCK_MAX}
    _check_state(cache)
    # a cache keeping more state than a policy reads serves it, and keeps it
    patch_model(model, policy=Quest(budget=48), block_size=BS)
    mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype, device=mask.device)], 1)
    with torch.no_grad():
        model(prompt(1, batch=2), attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})
    assert set(cache.specs) == {NORMS, BLOCK_MAX}
    unpatch_model(model)


def test_one_state_per_name_equal_specs_shared_unequal_ones_replaced_or_refused():
    """Specs of one name, scope, dtype and ``key`` are equal (two policy objects keeping the same state: a cache
    keeping one serves the other, a declaration lists it once); without a key a spec equals itself only. A spec of a
    kept name that is not equal to the kept one replaces it, recomputed (before, both stayed declared and every write
    refreshed both into one tensor: other codes, or a shape error); two unequal specs of one name declared together
    are refused, nothing changed."""
    from hf_sparse_kv.policies import Fp8BlockTopK, QuantBlockTopK, TopPBlockTopK
    from hf_sparse_kv.policies.base import Trailing

    assert Fp8BlockTopK(budget=48).cache_state() == Fp8BlockTopK(budget=64, sink=8).cache_state()
    q2, q4 = (QuantBlockTopK(budget=48, bits=b) for b in (2, 4))
    assert q4.cache_state() == QuantBlockTopK(budget=64, bits=4).cache_state() != q2.cache_state()
    twin = StateSpec("norms", "token", lambda D: (), _norms_refresh, torch.float32)
    assert twin != NORMS and len({twin, NORMS}) == 2  # no key: itself only
    assert copy.deepcopy(NORMS) is NORMS  # a copied cache keeps its specs (and does not copy their policy)
    with pytest.raises(ValueError, match="scope must be 'token', 'block' or 'layer'"):
        StateSpec("norms", "sequence", lambda D: (), _norms_refresh)
    layer_spec = StateSpec("centres", "layer", Trailing(1, 4, tail=(16, 4)), _norms_refresh, torch.float32)
    assert layer_spec.allocate(9, 2, 8, 64, torch.bfloat16, "cpu").shape == (2, 16, 16, 4)  # [Hkv, D / 4, 16, 4]
    assert NORMS.allocate(9, 2, 8, 64, torch.bfloat16, "cpu").shape == (9, 2, 8)
    cal = {"method": "pq", "centres": {0: torch.randn(2, 4, 8, 4), 1: torch.randn(2, 4, 8, 4)}}
    again = {**cal, "centres": {k: v.clone() for k, v in cal["centres"].items()}}
    other = {**cal, "centres": {0: cal["centres"][0], 1: cal["centres"][1] + 1}}
    codes = [TopPBlockTopK(48, coarse="pq", calibration=c).cache_state() for c in (cal, again, other)]
    assert codes[0] == codes[1] != codes[2]  # a calibration's codes: equal for equal centres
    model = tiny_model("llama")
    patch_model(model, policy=q4, block_size=BS)
    cache = PagedKVCache(model.config, block_size=BS)
    with torch.no_grad():
        model(prompt(30, batch=2), use_cache=True, **{cache_kwarg(model): cache})
    before = cache.memory_bytes()
    cache.declare_state(QuantBlockTopK(budget=64, bits=4).cache_state())  # equal: served as kept
    assert cache.specs == q4.cache_state() and cache.memory_bytes() == before
    with pytest.raises(ValueError, match="under one name \\(kcodes\\)"):
        cache.declare_state(q2.cache_state() + q4.cache_state())
    assert cache.specs == q4.cache_state()
    cache.declare_state(q2.cache_state())  # replaces the 4-bit codes: the 2-bit ones, from the stored keys
    assert cache.specs == q2.cache_state() and cache.memory_bytes() < before
    layer = cache.paged_layers[1]
    assert layer.state["kcodes"].shape[-1] == layer.k_pool.shape[-1] * 2 // 8
    unpatch_model(model)


@pytest.mark.parametrize("how", ["runner", "static cache"])
def test_static_steps_of_a_cache_filled_under_another_policy_keep_the_new_state(how):
    """A cache prefilled under a policy without state, decoded statically under one with state (a ``DecodeGraphs``
    built by hand, or a cache built for static decoding, reserved by the model hook at its first decode step): the
    runner / the hook adopts the state from the stored keys before the reservation, and the static steps keep it up
    to date. Before, no static step declared it and the policy ran without it (``Fp8BlockTopK`` re-coded the whole
    pool every step, 2026-12-06)."""
    model = tiny_model("llama")
    patch_model(model, policy=Quest(budget=48), block_size=BS)
    kw = {"static": True, "max_length": 48} if how == "static cache" else {}
    cache = _filled_cache(model, 37, batch=2, **kw)
    assert cache.specs == () and cache.static is None
    patch_model(model, policy=_NormTopK(budget=48, calls=[]), block_size=BS)
    ids = prompt(1, batch=2)
    with torch.no_grad():
        if how == "runner":
            runner = DecodeGraphs(model, cache, 48, capture=False)
            for _ in range(3):
                ids = runner.step(ids).argmax(-1)
        else:
            for _ in range(3):
                ids = model(ids, use_cache=True, **{cache_kwarg(model): cache}).logits[:, -1:].argmax(-1)
            assert cache.static is not None, "the steps ran statically"
    assert set(cache.specs) == {NORMS, BLOCK_MAX}
    _check_state(cache)
    unpatch_model(model)


def test_a_cache_reserved_for_static_steps_refuses_a_state_it_lacks():
    """Reserved (its steps captured with the state it had), a cache cannot take a new state: the next step under a
    policy that needs one says so, and a runner built on it too, instead of running without it."""
    model = tiny_model("llama")
    patch_model(model, policy=Quest(budget=48), block_size=BS)
    cache = _filled_cache(model, 37)
    cache.reserve_static(48)
    patch_model(model, policy=_NormTopK(budget=48, calls=[]), block_size=BS)
    with pytest.raises(ValueError, match="reserved for static steps"), torch.no_grad():
        model(prompt(1), use_cache=True, **{cache_kwarg(model): cache})
    with pytest.raises(ValueError, match="reserved for static steps"):
        DecodeGraphs(model, cache, 48, capture=False)
    assert cache.specs == () and all(not layer.state for layer in cache.paged_layers)  # nothing half-changed
    unpatch_model(model)


def test_a_cache_that_cannot_compute_a_state_refuses_it_with_advice():
    """After an eviction the keys of freed blocks are gone: no state can be computed for them."""
    model = tiny_model("llama")
    patch_model(model, policy=Quest(budget=48), block_size=BS)
    cache = _filled_cache(model, 40)
    assert cache.free_blocks([[0]]) == 1
    patch_model(model, policy=_NormTopK(budget=48, calls=[]), block_size=BS)
    with pytest.raises(ValueError, match="fresh PagedKVCache"), torch.no_grad():
        model(prompt(1), use_cache=True, **{cache_kwarg(model): cache})
    assert cache.specs == () and all(not layer.state for layer in cache.paged_layers)  # nothing half-changed
    cache.reset()
    with torch.no_grad():  # after a reset the same cache takes the new state
        model(prompt(20), use_cache=True, **{cache_kwarg(model): cache})
    _check_state(cache)
    unpatch_model(model)


def test_selection_reads_the_declared_state():
    """The test selector's choice follows its state: blocks whose keys are scaled up get selected."""
    model = tiny_model("llama")
    patch_model(model, policy=_NormTopK(budget=24, sink=1, window=1, calls=[]), block_size=BS, dense_layers=())
    cache = _filled_cache(model, 64)
    layer = cache.paged_layers[0]
    row = cache.table.rows[0]
    layer.state["norms"][row[2]] += 1e6  # block 2 now scores highest everywhere
    state = DecodeState(
        q=torch.randn(1, 4, 16, device=DEVICE), k_pool=layer.k_pool, kmin=layer.kmin, kmax=layer.kmax,
        kmean=layer.kmean, block_table=cache.table.tensor(DEVICE), seq_lens=torch.tensor([64], dtype=torch.int32, device=DEVICE),
        start=torch.zeros(1, dtype=torch.int32, device=DEVICE), lens=(64,), length=64, block_size=BS, scale=0.25,
        ops=cache.ops(DEVICE), state=layer.state,
    )  # fmt: skip
    sel: Selection = model._hf_sparse_kv.config.policy.select(state)
    assert 2 in sel.indices[0, 0].tolist() and 2 in sel.indices[0, 1].tolist()
    unpatch_model(model)


# ---- a cache's memory goes when its last reference does ---------------------------------------------------------


def test_a_dropped_cache_is_freed_without_the_cyclic_garbage_collector():
    """A cache and its layers form no reference cycle: the device memory of a generation's cache is given back when
    the caller drops it, not at some later garbage collection (a batch of long prompts per call ran a GPU out of
    memory when each cache waited for ``gc``)."""
    import gc
    import weakref

    model = tiny_model("llama")
    patch_model(model, policy=Quest(budget=48), block_size=BS)
    gc.disable()
    try:
        cache = _filled_cache(model, 40)
        ref = weakref.ref(cache)
        del cache
        assert ref() is None
        out = model.generate(prompt(40), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        ref = weakref.ref(out[cache_kwarg(model)] if cache_kwarg(model) in out else out["past_key_values"])
        del out
        assert ref() is None
    finally:
        gc.enable()
        unpatch_model(model)


def test_a_deep_copy_decodes_on_its_own_pages():
    model = tiny_model("llama")
    patch_model(model, policy=Quest(budget=48), block_size=BS)
    cache = _filled_cache(model, 45, batch=2)
    twin = copy.deepcopy(cache)
    assert all(layer.cache is twin for layer in twin.paged_layers)
    assert all(layer.cache is cache for layer in cache.paged_layers)
    with torch.no_grad():
        a = model(prompt(1, batch=2, seed=5), use_cache=True, **{cache_kwarg(model): cache}).logits
        b = model(prompt(1, batch=2, seed=5), use_cache=True, **{cache_kwarg(model): twin}).logits
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        model(prompt(1, batch=2, seed=6), use_cache=True, **{cache_kwarg(model): twin})
        assert cache.get_seq_length() == 46 and twin.get_seq_length() == 47
        again = model(prompt(1, batch=2, seed=7), use_cache=True, **{cache_kwarg(model): copy.deepcopy(cache)}).logits
        ref = model(prompt(1, batch=2, seed=7), use_cache=True, **{cache_kwarg(model): cache}).logits
        torch.testing.assert_close(again, ref, rtol=0, atol=0)
    unpatch_model(model)


# ---- what a paged layer's update gives the attention ---------------------------------------------------------------


def test_a_paged_layer_knows_whether_the_attention_got_what_its_update_returned():
    cache = PagedKVCache(tiny_model("llama").config, block_size=BS)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 5, 16, generator=g), torch.randn(1, 2, 5, 16, generator=g)
    assert not layer.gave(k, v), "nothing was returned yet"
    keys, values = layer.update(k, v)
    assert layer.gave(keys, values)
    assert layer.gave(keys.clone(), values.clone()), "an equal copy (e.g. made contiguous) is what was returned"
    assert not layer.gave(keys, values * 2), "values changed after update (DiffLlama's halves) are not"
    assert not layer.gave(keys.repeat(1, 2, 1, 1), values.repeat(1, 2, 1, 1)), "nor heads tiled (JetMoe)"
    keys, values = layer.update(k[:, :, :1], v[:, :, :1])  # the next token: the pages hold 6
    assert layer.gave(keys, values)
    assert not layer.gave(k, v), "the previous update's tensors are not this one's"


def test_values_of_another_shape_than_the_keys_are_refused_before_the_layer_keeps_anything():
    cache = PagedKVCache(tiny_model("llama").config, block_size=BS)
    layer = cache.layers[0]
    k = torch.randn(1, 2, 5, 16)
    with pytest.raises(NotImplementedError, match="one shape"):
        layer.update(k, k[..., :8])
    assert not layer.is_initialized and layer.k_pool is None and layer.length == 0
    assert not layer.gave(k, k[..., :8])


@pytest.mark.parametrize("keep", [37, 40, 26, 18])
def test_crop_leaves_each_held_blocks_metadata_over_its_filled_slots(keep):
    """After a crop of a left-padded batch (into a partial block, onto a block's end, past a sequence's padding)
    every held block's min / max / mean is that of its filled slots' keys, and a sequence cropped to nothing is
    left alone; the refresh reads no host value per layer (each sequence's last block found from the host rows)."""
    model = tiny_model("llama")
    patch_model(model, policy=Quest(budget=16, sink=2, window=4), block_size=BS, dense_layers=(0,))
    ids = prompt(45, batch=3)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # padded by 9 and by 20: 36 and 25 stored tokens
    mask[2, :20] = 0
    cache = PagedKVCache(model.config, block_size=BS)
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), **{cache_kwarg(model): cache})
    unpatch_model(model)
    assert cache.metadata == ("kmin", "kmax")  # Quest's; the mean computed now from the stored keys
    cache.declare_state((), KEY_METADATA)
    for layer in cache.paged_layers:  # stale metadata everywhere: a crop must rewrite what it refreshes
        for t in (layer.kmin, layer.kmax, layer.kmean):
            t.fill_(7.0)
    cache.crop(keep)
    for layer in cache.paged_layers:
        for row, pad in zip(cache.table.rows, cache.pads):
            stored = max(keep - pad, 0)
            assert len(row) == -(-stored // BS)
            if stored:
                j = (stored - 1) // BS  # the last block: refreshed; the others keep what they held
                n = stored - j * BS
                keys = layer.k_pool[row[j], :, :n].float()  # [H, n, D]
                torch.testing.assert_close(layer.kmin[row[j]].float(), keys.amin(1), rtol=0, atol=0)
                torch.testing.assert_close(layer.kmax[row[j]].float(), keys.amax(1), rtol=0, atol=0)
                torch.testing.assert_close(layer.kmean[row[j]].float(), keys.mean(1), rtol=1e-6, atol=1e-6)
                assert all((layer.kmin[blk] == 7.0).all() for blk in row[:j])
