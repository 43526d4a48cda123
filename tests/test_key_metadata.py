"""The blocks' key metadata (min / max / mean, ``[NB, Hkv, D]`` each) is kept only where the patched policy reads it
(``Policy.key_metadata``): a cache under ``Dense`` or the float8 selector holds K and V (and the selector's state)
only, Quest's min and max, BlockTopK's mean. A filled cache that meets a policy reading more computes it from its
stored keys (the blocks still held), a refill from a source without it computes it; a reserved cache refuses it."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import DEVICE, prompt, tiny_model

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.ops import reference
from hf_sparse_kv.ops.layout import KEY_METADATA
from hf_sparse_kv.policies import (
    BlockTopK,
    Dense,
    Fp8BlockTopK,
    OracleBlockTopK,
    QuantBlockTopK,
    Quest,
    SinkWindow,
    SnapKV,
    TokenTopK,
    TopPBlockTopK,
    TwoStageBlockTopK,
)

BS = 8
MINMAX = ("kmin", "kmax")

POLICIES = [
    (Dense(), "block", ()),
    (Quest(budget=24, sink=4, window=8), "block", MINMAX),
    (BlockTopK(budget=24, sink=4, window=8), "block", ("kmean",)),
    (OracleBlockTopK(budget=24, sink=4, window=8), "block", ()),
    (Fp8BlockTopK(budget=24, sink=4, window=8), "block", ()),
    (QuantBlockTopK(budget=24, sink=4, window=8, bits=4), "block", MINMAX),
    (TwoStageBlockTopK(budget=24, sink=4, window=8), "block", MINMAX),
    (TopPBlockTopK(budget=24, sink=4, window=8, coarse="quest_heads"), "block", MINMAX),
    (TokenTopK(budget=24, sink=4, window=8), "token", ()),
    (SinkWindow(sink=4, window=16), "block", ()),
    (SnapKV(budget=0.5, sink=4, window=8), "block", ()),
    (SnapKV(budget=0.5, sink=4, window=8, then=Quest(budget=24, sink=4, window=8)), "block", MINMAX),
]


def _prefill(model, cache, length=45, batch=2):
    with torch.no_grad():
        return model(prompt(length, batch=batch), use_cache=True, **{cache_kwarg(model): cache}).logits


def _step(model, cache, batch=2, seed=7):
    with torch.no_grad():
        return model(prompt(1, batch=batch, seed=seed), use_cache=True, **{cache_kwarg(model): cache}).logits


@pytest.mark.parametrize(
    "policy,mode,kept", POLICIES, ids=lambda x: type(x).__name__ if not isinstance(x, (str, tuple)) else str(x)
)
def test_a_cache_keeps_the_metadata_its_policy_reads(policy, mode, kept):
    """Per policy: the metadata it names, and nothing else, in every paged layer; its bytes per block are K, V, the
    kept metadata and its declared state; two decode steps run (the metadata kept up to date by the write)."""
    assert policy.key_metadata() == kept
    model = tiny_model("llama")
    patch_model(model, policy=policy, mode=mode, block_size=BS, dense_layers=())
    cache = PagedKVCache(model.config, block_size=BS)
    _prefill(model, cache)
    _step(model, cache)
    _step(model, cache, seed=8)
    assert cache.metadata == kept
    for layer in cache.paged_layers:
        assert layer.kept_metadata() == kept
        assert all((getattr(layer, name) is None) == (name not in kept) for name in KEY_METADATA)
        H, D = layer.k_pool.shape[1], layer.k_pool.shape[3]
        per_block = 2 * H * BS * D + len(kept) * H * D
        per_block *= layer.k_pool.element_size()
        per_block += sum(t[0].numel() * t.element_size() for t in layer.state.values())
        assert layer.bytes_per_block() == per_block
        if kept:  # what the last write left: each held block's metadata over its filled slots
            for row in cache.table.rows:
                stored = cache.get_seq_length()
                for j, blk in enumerate(row[: -(-stored // BS)]):
                    if blk < 0:
                        continue
                    keys = layer.k_pool[blk, :, : min(BS, stored - j * BS)].float()
                    want = {"kmin": keys.amin(1), "kmax": keys.amax(1), "kmean": keys.mean(1)}
                    for name in kept:
                        torch.testing.assert_close(getattr(layer, name)[blk].float(), want[name], rtol=1e-6, atol=1e-6)
    unpatch_model(model)


def test_a_dense_cache_holds_keys_and_values_only():
    """Under Dense the cache holds 3/16 fewer bytes a block than with all three metadata (16-token blocks): the
    memory it reports is K and V."""
    model = tiny_model("llama")
    patch_model(model, policy=Dense(), block_size=16)
    cache = PagedKVCache(model.config, block_size=16)
    _prefill(model, cache, length=64)
    layer = cache.paged_layers[0]
    assert cache.metadata == () and layer.bytes_per_block() == 2 * layer.k_pool[0].numel() * layer.k_pool.element_size()
    cache.declare_state((), KEY_METADATA)  # the same cache keeping all three: 3 / (2 x 16) more
    assert layer.bytes_per_block() == layer.k_pool[0].numel() * layer.k_pool.element_size() * (2 + 3 / 16)
    unpatch_model(model)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_cache_filled_under_dense_serves_quest_as_a_quest_prefill_does(backend):
    """Prefilled under Dense (no metadata), then decoded under Quest: the cache computes min / max from its stored
    keys (left padding included) equal to what a prefill under Quest leaves, and the decode steps give the same
    logits as that prefill's."""
    model = tiny_model("llama")
    ids = prompt(45, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    caches = []
    for first in (Dense(), Quest(budget=24, sink=4, window=8)):
        patch_model(model, policy=first, block_size=BS, backend=backend)
        cache = PagedKVCache(model.config, block_size=BS, backend=backend)
        with torch.no_grad():
            model(ids, attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})
        caches.append(cache)
    adopted, native = caches
    assert adopted.metadata == () and native.metadata == MINMAX
    patch_model(model, policy=Quest(budget=24, sink=4, window=8), block_size=BS, backend=backend)
    step_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype, device=mask.device)], 1)
    with torch.no_grad():
        out = [
            model(
                prompt(1, batch=2, seed=3), attention_mask=step_mask, use_cache=True, **{cache_kwarg(model): c}
            ).logits
            for c in caches
        ]
    assert adopted.metadata == MINMAX
    for a, b in zip(adopted.paged_layers, native.paged_layers):
        assert a.kept_metadata() == b.kept_metadata() == MINMAX
        for ra, rb in zip(adopted.table.rows, native.table.rows):
            for name in MINMAX:
                torch.testing.assert_close(getattr(a, name)[ra], getattr(b, name)[rb], rtol=0, atol=1e-6)
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=1e-5)
    unpatch_model(model)


def test_metadata_of_an_evicted_cache_comes_from_the_blocks_still_held():
    """A cache whose blocks were freed (SnapKV) gains min / max for the blocks it still holds, each from its own
    keys; the freed ones are skipped (their keys are gone); per-token state it lacks is still refused."""
    model = tiny_model("llama")
    patch_model(model, policy=SnapKV(budget=0.25, sink=4, window=8), block_size=BS, dense_layers=())
    cache = PagedKVCache(model.config, block_size=BS)
    _prefill(model, cache, length=80, batch=1)
    _step(model, cache, batch=1)
    assert cache.evicted and cache.metadata == ()
    cache.declare_state((), MINMAX)
    assert cache.metadata == MINMAX
    stored = cache.get_seq_length()
    row = cache.table.rows[0]
    assert -1 in row[: -(-stored // BS)]
    for layer in cache.paged_layers:
        for j, blk in enumerate(row[: -(-stored // BS)]):
            if blk >= 0:
                keys = layer.k_pool[blk, :, : min(BS, stored - j * BS)].float()
                torch.testing.assert_close(layer.kmin[blk].float(), keys.amin(1), rtol=0, atol=0)
                torch.testing.assert_close(layer.kmax[blk].float(), keys.amax(1), rtol=0, atol=0)
    with pytest.raises(ValueError, match="a block was evicted"):
        cache.declare_state(Fp8BlockTopK(budget=24).cache_state())
    unpatch_model(model)


def test_a_reserved_cache_refuses_metadata_it_lacks_and_keeps_what_it_had():
    """Reserved for static steps (captured without it), a cache cannot take metadata it lacks: a clear error, and
    the cache keeps what it had."""
    model = tiny_model("llama")
    patch_model(model, policy=Dense(), block_size=BS)
    cache = PagedKVCache(model.config, block_size=BS)
    _prefill(model, cache)
    cache.reserve_static(64)
    patch_model(model, policy=Quest(budget=24, sink=4, window=8), block_size=BS)
    with pytest.raises(ValueError, match="reserved for static steps"):
        _step(model, cache)
    assert cache.metadata == () and all(layer.kept_metadata() == () for layer in cache.paged_layers)
    unpatch_model(model)


def test_a_refill_computes_the_metadata_its_source_does_not_keep():
    """``load_static`` from a source without the reservation's metadata (a prompt prefilled under Dense refilling a
    Quest slot) computes it from the keys it copied: what a refill from a source keeping it holds, and the source is
    left as it was."""
    model = tiny_model("llama")
    patch_model(model, policy=Quest(budget=24, sink=4, window=8), block_size=BS)
    slots = []
    for _ in range(2):
        slot = PagedKVCache(model.config, block_size=BS)
        _prefill(model, slot)
        slot.reserve_static(80, any_padding=True)
        slots.append(slot)
    patch_model(model, policy=Dense(), block_size=BS)
    source = PagedKVCache(model.config, block_size=BS)
    _prefill(model, source, length=40)
    keeping = copy.deepcopy(source)
    keeping.declare_state((), MINMAX)
    slots[0].load_static(source)
    slots[1].load_static(keeping)
    assert source.metadata == () and all(layer.kept_metadata() == () for layer in source.paged_layers)
    for a, b in zip(slots[0].paged_layers, slots[1].paged_layers):
        for ra, rb in zip(slots[0].table.rows, slots[1].table.rows):
            for name in MINMAX:
                assert torch.equal(getattr(a, name)[ra], getattr(b, name)[rb]), name
    unpatch_model(model)


def test_unknown_metadata_is_refused():
    cache = PagedKVCache(tiny_model("llama").config, block_size=BS)
    with pytest.raises(ValueError, match="key metadata must be among"):
        cache.declare_state((), ("kmin", "kvar"))
    assert cache.metadata == KEY_METADATA


def test_min_and_max_are_kept_together():
    """A write computes min and max at once: a policy naming one keeps both."""
    cache = PagedKVCache(tiny_model("llama").config, block_size=BS)
    cache.declare_state((), ("kmax",))
    assert cache.metadata == MINMAX


def test_reference_refresh_skips_metadata_not_kept():
    """``reference.refresh_blocks`` with ``None`` / empty metadata computes only the kept ones."""
    g = torch.Generator().manual_seed(0)
    k_pool = torch.randn(4, 2, BS, 16, generator=g).to(DEVICE)
    kmean = torch.zeros(4, 2, 16, device=DEVICE)
    reference.refresh_blocks(k_pool, None, k_pool.new_empty(0), kmean, torch.tensor([1, 3], device=DEVICE),
                             torch.tensor([BS, 3], device=DEVICE))  # fmt: skip
    torch.testing.assert_close(kmean[1], k_pool[1].mean(1))
    torch.testing.assert_close(kmean[3], k_pool[3, :, :3].mean(1))
    assert kmean[0].abs().sum() == 0
