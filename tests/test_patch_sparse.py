"""Sparse policies: the three modes compute the same thing; SinkWindow is transformers' sliding window; batching,
left padding, beam search and sampling behave; the pool returns its blocks."""

import pytest
import torch
from tiny_models import DEVICE, greedy, prompt, tiny_model

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.policies import BlockTopK, Dense, OracleBlockTopK, QuantBlockTopK, Quest, SinkWindow, TokenTopK

SPARSE = [
    Quest(budget=24, sink=4, window=8),
    BlockTopK(budget=0.3, sink=0, window=8),
    OracleBlockTopK(budget=24, sink=4, window=4),
    SinkWindow(sink=4, window=13),
    TokenTopK(budget=21, sink=4, window=5),
]


def _logits_per_mode(model, ids, policy, modes, **kw):
    out = {}
    for mode in modes:
        patch_model(model, policy=policy, mode=mode, dense_layers=(0,), block_size=8, **kw)
        out[mode] = greedy(model, ids, new_tokens=12)
    unpatch_model(model)
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("policy", SPARSE, ids=lambda p: type(p).__name__)
def test_one_selection_three_modes(arch, policy):
    model = tiny_model(arch)
    ids = prompt(61)
    modes = ("mask", "token") if isinstance(policy, TokenTopK) else ("mask", "token", "block")
    runs = _logits_per_mode(model, ids, policy, modes)
    ref_seqs, ref_scores = runs["mask"]
    for mode in modes[1:]:
        seqs, scores = runs[mode]
        assert torch.equal(seqs, ref_seqs), mode
        torch.testing.assert_close(scores, ref_scores, rtol=0, atol=1e-5)
    _dense_seqs, dense_scores = greedy(model, ids, new_tokens=12)
    assert not torch.allclose(ref_scores, dense_scores, atol=1e-4), "the policy should really be sparse here"


@pytest.mark.parametrize("mode", ["mask", "token", "block"])
def test_sink_window_is_transformers_sliding_window(mode):
    window = 24
    windowed = tiny_model("mistral", sliding_window=window)
    full = tiny_model("mistral", sliding_window=None)
    full.load_state_dict(windowed.state_dict())
    ids = prompt(window - 6)  # the prompt fits in the window; decoding goes past it
    ref_seqs, ref_scores = greedy(windowed, ids, new_tokens=30)
    patch_model(full, policy=SinkWindow(sink=0, window=window), mode=mode, dense_layers=(), block_size=8)
    seqs, scores = greedy(full, ids, new_tokens=30)
    assert torch.equal(seqs, ref_seqs)
    torch.testing.assert_close(scores, ref_scores, rtol=0, atol=1e-5)


def _left_pad(prompts, pad_id=0):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, device=DEVICE)
    mask = torch.zeros(len(prompts), width, dtype=torch.long, device=DEVICE)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1
    return ids, mask


@pytest.mark.parametrize(
    "policy,mode",
    [
        (Dense(), "block"),
        (Quest(budget=24, sink=4, window=8), "block"),
        (SinkWindow(sink=4, window=13), "token"),
        (TokenTopK(budget=20, sink=2, window=6), "token"),
        (QuantBlockTopK(budget=24, sink=4, window=8), "block"),
    ],
    ids=["dense", "quest", "sinkwindow", "tokentopk", "quantblocktopk"],
)
def test_left_padded_batch_gives_each_prompt_its_own_output(policy, mode):
    model = tiny_model("qwen2")
    prompts = [prompt(n, seed=n)[0] for n in (45, 29, 38)]
    ids, mask = _left_pad(prompts)
    patch_model(model, policy=policy, mode=mode, dense_layers=(), block_size=8)
    batch_seqs, batch_scores = greedy(model, ids, new_tokens=10, attention_mask=mask)
    for i, p in enumerate(prompts):
        seqs, scores = greedy(model, p[None], new_tokens=10)
        assert torch.equal(batch_seqs[i, ids.shape[1] :], seqs[0, len(p) :])
        torch.testing.assert_close(batch_scores[:, i], scores[:, 0], rtol=0, atol=1e-4)
    unpatch_model(model)


def test_beam_search_and_sampling_match_unpatched():
    model = tiny_model("llama")
    ids = prompt(30)
    with torch.no_grad():
        ref_beam = model.generate(ids, max_new_tokens=12, num_beams=3, do_sample=False, num_return_sequences=3)
        torch.manual_seed(7)
        ref_sample = model.generate(ids, max_new_tokens=12, do_sample=True, top_k=20)
        patch_model(model, policy=Dense(), mode="block", block_size=8)
        beam = model.generate(ids, max_new_tokens=12, num_beams=3, do_sample=False, num_return_sequences=3)
        torch.manual_seed(7)
        sample = model.generate(ids, max_new_tokens=12, do_sample=True, top_k=20)
    unpatch_model(model)
    assert torch.equal(beam, ref_beam)
    assert torch.equal(sample, ref_sample)


def test_sparse_beam_search_runs_and_shares_blocks():
    model = tiny_model("llama")
    patch_model(model, policy=Quest(budget=16, sink=0, window=8), block_size=8, dense_layers=())
    cache = PagedKVCache(model.config, block_size=8)
    with torch.no_grad():
        out = model.generate(prompt(40), max_new_tokens=8, num_beams=3, do_sample=False, **{cache_kwarg(model): cache})
    assert out.shape == (1, 48)
    # 3 beams of 47 tokens: at most 3 * 6 blocks; full prompt blocks are shared, so fewer
    assert cache.blocks_in_use < 3 * 6
    unpatch_model(model)


def test_multi_token_forward_on_a_filled_cache_is_dense():
    model = tiny_model("llama")
    ids = prompt(50)
    with torch.no_grad():
        ref = model(ids).logits[:, 40:]
        patch_model(model, policy=Quest(budget=8, sink=0, window=8), block_size=8, dense_layers=())
        cache = PagedKVCache(model.config, block_size=8)
        model(ids[:, :40], **{cache_kwarg(model): cache})
        out = model(ids[:, 40:], **{cache_kwarg(model): cache}).logits
    unpatch_model(model)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def quest_prefilled(length: int = 45):
    """A tiny Llama patched with Quest (block size 8, no dense layer), a prompt of ``length`` and its filled cache."""
    model = tiny_model("llama")
    ids = prompt(length)
    patch_model(model, policy=Quest(budget=16, sink=0, window=8), block_size=8, dense_layers=())
    cache = PagedKVCache(model.config, block_size=8)
    with torch.no_grad():
        model(ids, **{cache_kwarg(model): cache})
    return model, ids, cache


def test_crop_then_continue_matches_fresh_cache():
    model, ids, cache = quest_prefilled()
    with torch.no_grad():
        cache.crop(-9)  # back to 36 tokens
        assert cache.get_seq_length() == 36 and cache.blocks_in_use == 5
        cropped = model(ids[:, 36:37], **{cache_kwarg(model): cache}).logits
        fresh = PagedKVCache(model.config, block_size=8)
        model(ids[:, :36], **{cache_kwarg(model): fresh})
        ref = model(ids[:, 36:37], **{cache_kwarg(model): fresh}).logits
    unpatch_model(model)
    torch.testing.assert_close(cropped, ref, rtol=0, atol=1e-6)


def test_crop_by_a_tensor_keeps_host_lengths():
    """Assisted decoding crops by ``candidates - n_matches``, a 0-d tensor on the model's device: the cache takes its
    int, so the lengths (and the selection's widths made of them) stay host ints (a CUDA tensor there reached the
    top-k kernel as its width and failed to compile)."""
    model, ids, cache = quest_prefilled()
    with torch.no_grad():
        cache.crop(-torch.tensor(9, device=ids.device))
        assert type(cache.get_seq_length()) is int and cache.get_seq_length() == 36
        assert all(type(layer.length) is int for layer in cache.paged_layers)
        cache.crop(torch.tensor(0, device=ids.device))  # all accepted: nothing dropped
        assert cache.get_seq_length() == 36
        out = model(ids[:, 36:37], **{cache_kwarg(model): cache}).logits
    unpatch_model(model)
    assert out.shape[1] == 1 and not out.isnan().any()


def test_assisted_decoding_matches_greedy():
    model = tiny_model("llama")
    assistant = tiny_model("llama", seed=3)
    ids = prompt(30)
    ref_seqs, _ = greedy(model, ids, new_tokens=16)
    patch_model(model, policy=Dense(), block_size=8)
    patch_model(assistant, policy=Dense(), block_size=8)
    with torch.no_grad():
        out = model.generate(ids, assistant_model=assistant, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert torch.equal(out, ref_seqs)


def test_pool_returns_blocks_and_memory_matches_tokens():
    model = tiny_model("gemma3")
    patch_model(model, policy=Quest(budget=16, sink=0, window=8), block_size=8, dense_layers=())
    cache = PagedKVCache(model.config, block_size=8)
    capacities = set()
    with torch.no_grad():
        for i in range(100):
            n = 9 + (i * 7) % 30
            model.generate(
                prompt(n, batch=1 + i % 3, seed=i), max_new_tokens=3, do_sample=False, **{cache_kwarg(model): cache}
            )
            held = n + 2
            blocks = (1 + i % 3) * -(-held // 8)
            assert cache.blocks_in_use == blocks
            per_block = sum(layer.bytes_per_block() for layer in cache.paged_layers)
            # 2 paged (global) layers, 2 heads, head dim 16, float32: K, V (8 x 16 each) and Quest's min / max (16
            # each; no mean: Quest does not read it)
            assert per_block == 2 * 2 * (2 * 8 * 16 + 2 * 16) * 4
            sliding = sum(l.keys.numel() * 4 * 2 for l in cache.layers if l.is_sliding)
            assert cache.memory_bytes() == blocks * per_block + sliding
            cache.reset()
            assert cache.blocks_in_use == 0
            capacities.add(cache.table.capacity)
    assert max(capacities) <= 64, capacities
    unpatch_model(model)
