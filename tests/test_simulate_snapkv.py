"""SnapKV (alone, and with a query-aware policy on what it keeps) scored the ``simulate`` way: the prefix's
observation replayed from the queries the session keeps, the blocks its first decode step frees left out of every
scored query's table. Checked against token-by-token decoding through the patched model (the ``decode`` way)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import prompt, tiny_model

from evaluation.perplexity import decode_logprobs, nll_of
from evaluation.simulate import OBSERVED, SimulateSession
from hf_sparse_kv import PagedKVCache, cache_kwarg, is_patched, patch_model, unpatch_model
from hf_sparse_kv.policies import Dense, OracleBlockTopK, Quest, SnapKV, TokenTopK

CASES = [
    (SnapKV(budget=0.25, sink=4, window=8, observe=8), "block"),
    (SnapKV(budget=48, sink=4, window=8, observe=16, pool="mean"), "block"),
    (SnapKV(budget=0.5, sink=4, window=8, observe=8, then=Quest(budget=0.25, sink=4, window=8)), "block"),
    (SnapKV(budget=0.5, sink=4, window=8, observe=8, then=OracleBlockTopK(budget=0.25, sink=4, window=8)), "block"),
    (SnapKV(budget=0.5, sink=2, window=8, observe=8, then=TokenTopK(budget=0.2, sink=2, window=8)), "token"),
]


def _freed_by_decode(model, ids, n, policy, block_size, mode):
    """The logical blocks the patched model's first decode step frees (``-1`` in the table after it)."""
    split = ids.shape[1] - n - 1
    patch_model(model, policy=policy, mode=mode, dense_layers=(0,), block_size=block_size)
    try:
        cache = PagedKVCache(model.config, block_size=block_size)
        kw = {cache_kwarg(model): cache, "use_cache": True}
        with torch.no_grad():
            model(ids[:, :split], **kw, logits_to_keep=1)
            model(ids[:, split : split + 1], **kw)
        rows = cache.table.rows  # none when no layer is paged
        return frozenset(i for i, blk in enumerate(rows[0]) if blk < 0) if rows else frozenset()
    finally:
        unpatch_model(model)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=["alone", "mean_int", "quest", "oracle", "token_topk"])
def test_snapkv_simulated_equals_decoded(arch, case):
    policy, mode = CASES[case]
    if arch == "gemma3":
        mode = "mask" if mode == "block" else mode  # the global layers sparse, the sliding ones untouched
    model = tiny_model(arch)
    ids = prompt(160)
    n = 24
    session = SimulateSession(model, ids, n, block_size=8, chunk=6)
    freed = session.freed(policy)
    assert freed == _freed_by_decode(model, ids, n, policy, 8, mode)
    assert freed  # the prompt was compressed: the agreement below is not vacuous
    exact = nll_of(decode_logprobs(model, ids, n, policy, dense_layers=(0,), block_size=8, mode=mode), ids)
    fast = session.nll(session.run(policy, dense_layers=(0,))[0])
    assert torch.allclose(exact, fast, atol=1e-4, rtol=0), (exact - fast).abs().max()
    dense = session.nll(session.run(Dense(), dense_layers=(0,))[0])
    assert (fast - dense).abs().max() > 1e-4  # what SnapKV freed changed the scores
    assert not is_patched(model)


def test_snapkv_simulated_on_a_model_whose_layers_all_slide():
    """Mistral with a window on every layer pages nothing, so SnapKV frees nothing: both ways give dense's scores."""
    model = tiny_model("mistral")
    ids = prompt(120)
    policy = SnapKV(budget=0.25, sink=4, window=8, observe=8)
    session = SimulateSession(model, ids, 16, block_size=8, chunk=6)
    with pytest.warns(UserWarning, match="no layer of MistralForCausalLM runs SnapKV"):
        freed_by_decode = _freed_by_decode(model, ids, 16, policy, 8, "block")
    assert session.freed(policy) == frozenset() == freed_by_decode
    with pytest.warns(UserWarning, match="no layer"):
        lp = decode_logprobs(model, ids, 16, policy, dense_layers=(0,), block_size=8, mode="block")
    exact = nll_of(lp, ids)
    fast = session.nll(session.run(policy, dense_layers=(0,))[0])
    dense = session.nll(session.run(Dense(), dense_layers=(0,))[0])
    assert torch.allclose(exact, fast, atol=1e-4, rtol=0) and torch.allclose(fast, dense, atol=1e-5, rtol=0)


def test_snapkv_simulate_refuses_what_it_cannot_replay():
    model = tiny_model("llama")
    session = SimulateSession(model, prompt(128), 16, block_size=8)
    snap = SnapKV(budget=0.25, sink=4, window=8, observe=8)
    with pytest.raises(ValueError, match="fidelity"):
        session.run(snap, dense_layers=(0,), fidelity=True)
    with pytest.raises(ValueError, match="reuse"):
        session.run(snap, dense_layers=(0,), reuse=4)
    with pytest.raises(ValueError, match="way: decode"):
        session.run(SnapKV(budget=0.25, observe=OBSERVED + 1), dense_layers=(0,))
    # the session is unchanged by the refusals: a policy run after them gives what it gives on a fresh session
    again = session.nll(session.run(snap, dense_layers=(0,))[0])
    fresh = SimulateSession(model, prompt(128), 16, block_size=8)
    assert torch.equal(again, fresh.nll(fresh.run(snap, dense_layers=(0,))[0]))
