"""A patched model under Dense() (or any full budget) is the unpatched model; unpatching is exact."""

import pytest
import torch
from tiny_models import ARCHS, greedy, prompt, tiny_model

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.policies import BlockTopK, Dense, OracleBlockTopK, Quest, SinkWindow, TokenTopK

MODES = ("mask", "token", "block")


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request):
    model = tiny_model(request.param)
    ids = prompt(37)
    seqs, scores = greedy(model, ids)
    return request.param, model, ids, seqs, scores


@pytest.mark.parametrize("mode", MODES)
def test_dense_policy_reproduces_unpatched(arch_model, mode):
    _, model, ids, ref_seqs, ref_scores = arch_model
    patch_model(model, policy=Dense(), mode=mode, block_size=8)
    try:
        seqs, scores = greedy(model, ids)
    finally:
        unpatch_model(model)
    assert torch.equal(seqs, ref_seqs)
    torch.testing.assert_close(scores, ref_scores, rtol=0, atol=1e-5)


FULL_BUDGET = [
    Quest(budget=1.0),
    BlockTopK(budget=4096),
    OracleBlockTopK(budget=1.0),
    SinkWindow(sink=4, window=4096),
    TokenTopK(budget=4096),
]


@pytest.mark.parametrize("policy", FULL_BUDGET, ids=lambda p: type(p).__name__)
def test_full_budget_equals_dense(arch_model, policy):
    _, model, ids, ref_seqs, ref_scores = arch_model
    mode = "token" if isinstance(policy, TokenTopK) else "block"
    patch_model(model, policy=policy, mode=mode, dense_layers=(), block_size=8)
    try:
        seqs, scores = greedy(model, ids)
    finally:
        unpatch_model(model)
    assert torch.equal(seqs, ref_seqs)
    torch.testing.assert_close(scores, ref_scores, rtol=0, atol=1e-5)


def test_unpatch_restores_bit_for_bit_and_repatch_replaces_policy():
    model = tiny_model("llama")
    ids = prompt(40)
    ref_seqs, ref_scores = greedy(model, ids)
    patch_model(model, policy=Quest(budget=16, sink=0, window=8), block_size=8, dense_layers=())
    _sparse_seqs, sparse_scores = greedy(model, ids)
    patch_model(model, policy=Dense(), block_size=8)  # patching twice replaces the policy
    _dense_seqs, dense_scores = greedy(model, ids)
    torch.testing.assert_close(dense_scores, ref_scores, rtol=0, atol=1e-5)
    assert not torch.allclose(sparse_scores, ref_scores, atol=1e-3), "the sparse policy should change the logits"
    unpatch_model(model)
    unpatch_model(model)  # no-op
    seqs, scores = greedy(model, ids)
    assert torch.equal(seqs, ref_seqs) and torch.equal(scores, ref_scores)
    assert model.config._attn_implementation == "sdpa"
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_generate_builds_a_paged_cache_and_uses_a_given_one():
    model = tiny_model("llama")
    ids = prompt(20)
    patch_model(model, policy=Dense(), block_size=8)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        assert isinstance(out.cache if hasattr(out, "cache") else out.past_key_values, PagedKVCache)
        mine = PagedKVCache(model.config, block_size=8)
        model.generate(ids, max_new_tokens=4, do_sample=False, **{cache_kwarg(model): mine})
    assert mine.get_seq_length() == 20 + 3 and mine.blocks_in_use == 3
    unpatch_model(model)
