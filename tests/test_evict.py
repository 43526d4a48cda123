"""SinkWindow(evict=True): blocks leaving the window are freed, memory stays flat, outputs do not change."""

import pytest
import torch
from tiny_models import greedy, prompt, tiny_model

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.policies import SinkWindow


@pytest.mark.parametrize("mode", ["mask", "token", "block"])
@pytest.mark.parametrize("window", [24, 0.25])
def test_evicting_equals_keeping_and_memory_stays_flat(mode, window):
    model = tiny_model("llama")
    ids = prompt(40, batch=2)
    kw = {"window": window} if isinstance(window, int) else {"budget": window}
    patch_model(model, policy=SinkWindow(sink=4, **kw), mode=mode, dense_layers=(), block_size=8)
    kept = PagedKVCache(model.config, block_size=8)
    ref_seqs, ref_scores = greedy(model, ids, new_tokens=60, **{cache_kwarg(model): kept})
    patch_model(model, policy=SinkWindow(sink=4, evict=True, **kw), mode=mode, dense_layers=(), block_size=8)
    cache = PagedKVCache(model.config, block_size=8)
    seqs, scores = greedy(model, ids, new_tokens=60, **{cache_kwarg(model): cache})
    unpatch_model(model)
    assert torch.equal(seqs, ref_seqs)
    torch.testing.assert_close(scores, ref_scores, rtol=0, atol=1e-6)
    assert kept.blocks_in_use == 2 * 13  # 99 tokens per sequence, all kept
    if isinstance(window, int):  # sink block + window (24 tokens: up to 4 blocks) + the current one
        assert cache.blocks_in_use <= 2 * (1 + 4 + 1)
    else:  # a quarter of 99 tokens: up to 1 + 5 blocks per sequence
        assert cache.blocks_in_use <= 2 * (1 + 5)
    assert cache.memory_bytes() < kept.memory_bytes() / 2


def test_evicting_matches_transformers_sliding_window_over_a_long_generation():
    window = 16
    windowed = tiny_model("mistral", sliding_window=window)
    full = tiny_model("mistral", sliding_window=None)
    full.load_state_dict(windowed.state_dict())
    ids = prompt(10)
    ref_seqs, ref_scores = greedy(windowed, ids, new_tokens=120)
    patch_model(full, policy=SinkWindow(sink=0, window=window, evict=True), mode="block", dense_layers=(), block_size=8)
    cache = PagedKVCache(full.config, block_size=8)
    held = []
    cache_kw = {cache_kwarg(full): cache}
    with torch.no_grad():
        out = full.generate(
            ids,
            max_new_tokens=120,
            min_new_tokens=120,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            **cache_kw,
        )
        held.append(cache.blocks_in_use)
    unpatch_model(full)
    assert torch.equal(out.sequences, ref_seqs)
    torch.testing.assert_close(torch.stack(out.scores), ref_scores, rtol=0, atol=1e-5)
    assert held[-1] <= 16 // 8 + 2
    assert cache.table.capacity == 16  # the pool never grew past its minimum: 130 tokens in at most 16 blocks


def test_evict_needs_every_layer_sparse_and_single_token_steps():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="dense_layers=()"):
        patch_model(model, policy=SinkWindow(sink=4, window=8, evict=True))
    patch_model(model, policy=SinkWindow(sink=4, window=8, evict=True), dense_layers=(), block_size=8)
    cache = PagedKVCache(model.config, block_size=8)
    kw = {cache_kwarg(model): cache}
    with torch.no_grad():
        model.generate(prompt(30), max_new_tokens=20, do_sample=False, **kw)
        assert cache.evicted
        with pytest.raises(NotImplementedError, match="evict"):
            model(prompt(3), **kw)
    cache.reset()
    assert not cache.evicted and cache.blocks_in_use == 0
    unpatch_model(model)


def test_a_thousand_token_generation_holds_flat_memory():
    """StreamingLLM proper over a long generation: blocks held and the pool's allocation stay flat at every step."""
    model = tiny_model("llama")
    patch_model(model, policy=SinkWindow(sink=4, window=32, evict=True), dense_layers=(), block_size=8)
    cache = PagedKVCache(model.config, block_size=8)
    held, allocated = [], []

    def record(input_ids, scores):  # a logits processor: called once per generated token
        held.append(cache.memory_bytes())
        allocated.append(cache.capacity_bytes())
        return scores

    with torch.no_grad():
        model.generate(
            prompt(40), max_new_tokens=1000, min_new_tokens=1000, do_sample=False, logits_processor=[record],
            **{cache_kwarg(model): cache},
        )  # fmt: skip
    unpatch_model(model)
    per_block = cache.memory_bytes() // cache.blocks_in_use
    assert len(held) == 1000 and max(held[1:]) <= (1 + 32 // 8 + 2) * per_block  # sink, window, current block
    assert max(allocated) == allocated[0] == 16 * per_block  # the pool never grows (1040 tokens would need 130)
