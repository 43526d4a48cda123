"""mode="auto": each decode step runs dense below the table's crossover and the policy from it on."""

import json

import pytest
import torch
from tiny_models import greedy, prompt, tiny_model

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.crossover import CrossoverTable, budget_fraction
from hf_sparse_kv.policies import Dense, Quest, SinkWindow, TokenTopK


def _table(crossover, heads=2, head_dim=16):
    return CrossoverTable(
        [{"budget": 0.25, "batch": 1, "num_kv_heads": heads, "head_dim": head_dim, "crossover": crossover}],
        device="hand-made",
        max_context=4096,
    )


def test_table_lookup_rules():
    table = CrossoverTable(
        [
            {"budget": 0.125, "batch": 1, "num_kv_heads": 8, "head_dim": 128, "crossover": 16384},
            {"budget": 0.0625, "batch": 1, "num_kv_heads": 8, "head_dim": 128, "crossover": 8192},
            {"budget": 0.125, "batch": 8, "num_kv_heads": 8, "head_dim": 128, "crossover": 4096},
            {"budget": 0.125, "batch": 8, "num_kv_heads": 3, "head_dim": 64, "crossover": None},
        ],
        fallback=32768,
    )
    assert table.crossover(0.125, 1, 8, 128) == 16384
    assert table.crossover(0.05, 1, 8, 128) == 8192  # nearest budget in log scale
    assert table.crossover(0.125, 4, 8, 128) == 16384  # largest measured batch not above 4
    assert table.crossover(0.125, 16, 8, 128) == 4096
    assert table.crossover(0.125, 8, 3, 64) is None and not table.use_sparse(0.125, 8, 3, 64, 10**6)
    assert table.crossover(0.125, 1, 4, 64) == 32768  # unknown head shape: fallback
    assert table.use_sparse(0.125, 1, 8, 128, 16384) and not table.use_sparse(0.125, 1, 8, 128, 16383)


def test_budget_fraction():
    assert budget_fraction(Quest(budget=0.25), 100) == 0.25
    assert budget_fraction(Quest(budget=50), 200) == 0.25
    assert budget_fraction(SinkWindow(sink=4, window=46), 100) == 0.5
    assert budget_fraction(Dense(), 100) is None


def test_table_round_trip_and_shipped_default(tmp_path):
    table = _table(40)
    table.save(tmp_path / "t.json")
    assert CrossoverTable.load(tmp_path / "t.json").entries == table.entries
    shipped = CrossoverTable.load()
    assert shipped.entries and "H200" in shipped.device and shipped.timing == "eager"
    graph = CrossoverTable.load(timing="graph")  # for cuda_graph=True: captured steps
    assert graph.entries and "H200" in graph.device and graph.timing == "graph"
    with pytest.raises(ValueError, match="budget"):
        CrossoverTable([{"budget": 2.0, "batch": 1, "num_kv_heads": 1, "head_dim": 1, "crossover": 1}])


def test_auto_switches_from_dense_to_sparse_at_the_crossover():
    model = tiny_model("llama")
    ids = prompt(30)  # decode contexts 31..50; the table switches at 40
    policy = Quest(budget=0.25, sink=0, window=8)
    dense_seqs, dense_scores = greedy(model, ids, new_tokens=20)
    patch_model(model, policy=policy, mode="block", block_size=8, dense_layers=(0,))
    _, block_scores = greedy(model, ids, new_tokens=20)
    patch_model(model, policy=policy, mode="auto", block_size=8, dense_layers=(0,), crossover=_table(40))
    cache = PagedKVCache(model.config, block_size=8)
    auto_seqs, auto_scores = greedy(model, ids, new_tokens=20, **{cache_kwarg(model): cache})
    unpatch_model(model)
    # step i decodes at context 31 + i: steps 0..8 run dense, then sparse; scores[i] is the logits before step i
    torch.testing.assert_close(auto_scores[:10], dense_scores[:10], rtol=0, atol=1e-5)
    assert torch.equal(auto_seqs[:, :40], dense_seqs[:, :40])
    assert not torch.allclose(auto_scores[10], dense_scores[10], atol=1e-4), "from context 40 on, the policy runs"
    assert not torch.allclose(block_scores[1:10], dense_scores[1:10], atol=1e-4), "block mode alone is sparse earlier"
    # 19 decode steps x 2 sparse-capable layers: 9 contexts below 40 and 10 at or above
    assert cache.auto_steps == {"dense": 9 * 2, "sparse": 10 * 2}


def test_auto_never_sparse_and_token_policy(tmp_path):
    model = tiny_model("qwen2")
    ids = prompt(30)
    _, ref_scores = greedy(model, ids, new_tokens=8)
    path = tmp_path / "never.json"
    path.write_text(json.dumps(_table(None).to_json()))
    patch_model(model, policy=TokenTopK(budget=0.25, sink=0, window=4), mode="auto", crossover=str(path))
    _, scores = greedy(model, ids, new_tokens=8)
    unpatch_model(model)
    torch.testing.assert_close(scores, ref_scores, rtol=0, atol=1e-5)


def test_crossover_only_with_auto():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="auto"):
        patch_model(model, policy=Quest(budget=0.25), mode="block", crossover=_table(40))


def test_calibrate_command_writes_a_table(tmp_path):
    from evaluation.cli import main

    out = tmp_path / "table.json"
    main(["calibrate", "--device", "cpu", "--shapes", "4,2,16", "--batches", "1", "--contexts", "64,256",
          "--budgets", "0.25", "--reps", "1", "--out", str(out)])  # fmt: skip
    table = CrossoverTable.load(out)
    assert table.device == "cpu" and table.max_context == 256 and table.timing == "eager"
    assert [(e["batch"], e["budget"], e["num_kv_heads"], e["head_dim"]) for e in table.entries] == [(1, 0.25, 2, 16)]


def test_calibrate_graph_timing_needs_cuda():
    from hf_sparse_kv.calibrate import calibrate

    with pytest.raises(ValueError, match="timing"):
        calibrate(4, 2, 16, device="cpu", timing="wall")
    with pytest.raises(ValueError, match="needs device='cuda'"):
        calibrate(4, 2, 16, device="cpu", timing="graph")
