"""CUDA-graph decoding: the static decode step (blocks reserved, lengths in device buffers, widths planned on the
host) computes exactly what the eager step computes. On the CPU the static step runs eagerly; on CUDA it is
captured and replayed."""

import pytest
import torch
from tiny_models import DEVICE, greedy, prompt, tiny_model

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.attention import StaticPlan
from hf_sparse_kv.crossover import CrossoverTable
from hf_sparse_kv.graphs import DecodeGraphs
from hf_sparse_kv.policies import Dense, Quest, SinkWindow

POLICIES = [
    Dense(),
    Quest(budget=16, sink=4, window=8),
    Quest(budget=0.25, sink=0, window=8),
    SinkWindow(sink=4, budget=0.3),
]


def _eager_steps(model, ids, n):
    cache = PagedKVCache(model.config, block_size=8)
    kw = {cache_kwarg(model): cache}
    out = []
    with torch.no_grad():
        logits = model(ids, **kw).logits[:, -1:]
        for _ in range(n):
            token = logits.argmax(-1)
            logits = model(token, **kw).logits
            out.append(logits)
    return torch.cat(out, 1)


def _static_steps(model, ids, n):
    """Prefill ``ids``, then ``n`` greedy steps through :class:`DecodeGraphs` (captured on CUDA): the cache, the
    runner and the logits ``[B, n, V]``."""
    cache = PagedKVCache(model.config, block_size=8)
    out = []
    with torch.no_grad():
        logits = model(ids, **{cache_kwarg(model): cache}).logits[:, -1:]
        runner = DecodeGraphs(model, cache, max_length=ids.shape[1] + n, capture=DEVICE.type == "cuda")
        for _ in range(n):
            logits = runner.step(logits.argmax(-1))
            out.append(logits)
    return cache, runner, torch.cat(out, 1)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{type(p).__name__}-{getattr(p, 'budget', '')}")
def test_static_step_equals_eager(policy):
    model = tiny_model("llama")
    ids = prompt(37, batch=2)
    patch_model(model, policy=policy, mode="block", block_size=8, dense_layers=(0,))
    ref = _eager_steps(model, ids, 24)
    cache, _, out = _static_steps(model, ids, 24)
    unpatch_model(model)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert cache.get_seq_length() == 37 + 24 and cache.blocks_in_use == 2 * 8  # reserved up front
    assert cache.decode_steps == 24


def test_static_auto_step_switches_at_the_crossover_like_eager():
    model = tiny_model("llama")
    ids = prompt(37, batch=2)
    entry = {"budget": 0.25, "batch": 1, "num_kv_heads": 2, "head_dim": 16, "crossover": 50}
    table = CrossoverTable([entry], max_context=1 << 20)
    policy = Quest(budget=0.25, sink=4, window=8)
    patch_model(model, policy=policy, mode="auto", crossover=table, block_size=8, dense_layers=(0,))
    ref = _eager_steps(model, ids, 24)
    cache, runner, out = _static_steps(model, ids, 24)
    unpatch_model(model)
    # the graph key holds the crossover's decision: one graph below 50 tokens, the policy's widths from there
    assert runner.key(49) == StaticPlan(False, None)
    assert runner.key(50) == StaticPlan(True, tuple(policy.plan((50, 50), 8)))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    # two sparse layers per step; steps at 38..49 tokens dense, 50..61 sparse
    assert cache.auto_steps == {"dense": 2 * 12, "sparse": 2 * 12}


def test_generate_with_cuda_graph_flag_matches_eager():
    model = tiny_model("llama")
    ids = prompt(30)
    policy = Quest(budget=0.25, sink=0, window=8)
    patch_model(model, policy=policy, mode="block", block_size=8)
    ref_seqs, ref_scores = greedy(model, ids, new_tokens=20)
    patch_model(model, policy=policy, mode="block", block_size=8, cuda_graph=True)
    seqs, scores = greedy(model, ids, new_tokens=20)
    unpatch_model(model)
    assert "forward" not in model.__dict__
    assert torch.equal(seqs, ref_seqs)
    torch.testing.assert_close(scores, ref_scores, rtol=0, atol=1e-5)


def test_cuda_graph_needs_block_mode_and_full_attention_layers():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="mode='block' or 'auto'"):
        patch_model(model, policy=Dense(), mode="token", cuda_graph=True)
    gemma = tiny_model("gemma3")
    patch_model(gemma, policy=Dense(), mode="block", block_size=8)
    cache = PagedKVCache(gemma.config, block_size=8)
    with torch.no_grad():
        gemma(prompt(20), **{cache_kwarg(gemma): cache})
    with pytest.raises(ValueError, match="sliding"):
        DecodeGraphs(gemma, cache, max_length=40, capture=False)
    unpatch_model(gemma)
