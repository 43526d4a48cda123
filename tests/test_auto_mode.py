"""mode="auto": each decode step runs dense below the table's crossover and the policy from it on."""

import dataclasses
import json

import pytest
import torch
import torch.utils._python_dispatch
from tiny_models import DEVICE, greedy, prompt, tiny_model

from hf_sparse_kv import PagedKVCache, cache_kwarg, is_patched, patch_model, unpatch_model
from hf_sparse_kv import patch as patch_module
from hf_sparse_kv.crossover import CrossoverTable, budget_fraction, policy_key
from hf_sparse_kv.policies import (
    Dense,
    Fp8BlockTopK,
    QuantBlockTopK,
    Quest,
    SinkWindow,
    SnapKV,
    TokenTopK,
    TopPBlockTopK,
)


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
    assert graph.entries and "H100" in graph.device and graph.timing == "graph"
    # the suite models' head shapes are measured (a shape not in the table runs dense): Llama-3-8B, Qwen2.5-1.5B,
    # SmolLM2-135M, Gemma-3-270M's global layers, for the shipped Quest table and the two quality selectors' tables
    shapes = {(8, 128), (2, 128), (3, 64), (1, 256)}
    for policy in (
        None,
        QuantBlockTopK(budget=0.0625, bits=4),
        TopPBlockTopK(0.0625, candidates=4, p=1.0, coarse="pq", calibration="prefill"),
    ):
        table = CrossoverTable.load(timing="graph", policy=policy)
        assert table.policy == (policy_key(policy) if policy else {"name": "Quest"})
        assert {(e["num_kv_heads"], e["head_dim"]) for e in table.entries} == shapes
    # Fp8BlockTopK's captured table (2026-12-07), the same four head shapes
    fp8 = CrossoverTable.load(timing="graph", policy=Fp8BlockTopK(budget=0.0625))
    assert fp8.policy == {"name": "Fp8BlockTopK"} and "H100" in fp8.device and fp8.timing == "graph"
    assert {(e["num_kv_heads"], e["head_dim"]) for e in fp8.entries} == shapes
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


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_calibrate_times_a_captured_dense_layer_as_a_static_step_runs_it():
    """Under graph timing a dense layer is the block kernel over a selection made once (a static step keeps a dense
    layer's every-block selection with its reservation): its timed call runs the attention op and nothing else, with
    the output of the eager dense call, which makes its selection at every call (eager timing times that)."""
    from hf_sparse_kv.calibrate import cycle_calls, decode_call, dense_timed, random_state
    from hf_sparse_kv.ops.library import registered_ops

    ops = registered_ops("reference")  # a static step's ops: each one op of PyTorch's registry
    states = [random_state(2, 200, 4, 2, 16, 16, torch.float32, torch.device("cpu"), "reference", seed=i)
              for i in range(2)]  # fmt: skip
    states = [(dataclasses.replace(state, ops=ops), v_pool) for state, v_pool in states]
    graph, eager = dense_timed(states, "graph"), dense_timed(states, "eager")
    with _Ops() as rec:
        graph()
    assert rec.ops == ["hf_sparse_kv.decode_blocks"] * len(states)
    with _Ops() as rec:
        eager()
    assert len(rec.ops) > len(states) and rec.ops.count("hf_sparse_kv.decode_blocks") == len(states)
    assert eager.func is cycle_calls
    for selection, (state, v_pool) in zip(graph.args[0], states):
        torch.testing.assert_close(
            calibrate_execute(selection, state, v_pool), decode_call(Dense(), state, v_pool), rtol=0, atol=0
        )


def calibrate_execute(selection, state, v_pool):
    from hf_sparse_kv.attention import execute

    return execute(selection, "block", state, v_pool)


def _crossover_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "crossover table measured otherwise" in str(w.message)]


def test_a_table_says_what_it_timed_and_a_patch_that_differs_warns(tmp_path, recwarn, monkeypatch):
    """The shipped tables timed Quest in 16-token blocks; a patch with another selector's cost, another block size
    or another timing warns, naming each difference and the command that measures a table for it. (The GPU's name
    is left out here, so that the test reads the same on any card: the next test checks it.)"""
    monkeypatch.setattr(patch_module, "_gpu_name", lambda model: None)
    for timing in ("eager", "graph"):
        shipped = CrossoverTable.load(timing=timing)
        assert shipped.policy == {"name": "Quest"} and shipped.block_size == 16 and shipped.timing == timing
    model = tiny_model("llama")
    patch_model(model, policy=Quest(budget=0.25, sink=8, window=64), mode="auto")  # sink / window cost nothing
    patch_model(model, policy=Quest(budget=0.0625), mode="auto", block_size=16)
    patch_model(model, policy=Dense(), mode="auto", block_size=8)  # no budget: never sparse, no table to match
    assert _crossover_warnings(recwarn) == []
    patch_model(model, policy=Quest(budget=0.25), mode="auto", block_size=8)
    patch_model(model, policy=QuantBlockTopK(budget=0.25, bits=4), mode="auto")
    patch_model(model, policy=Quest(budget=0.25), mode="auto", crossover=CrossoverTable.load(timing="eager"),
                cuda_graph=True)  # fmt: skip
    unpatch_model(model)
    block, quant, timing = _crossover_warnings(recwarn)
    assert "16-token blocks, this patch uses 8" in block and "--block-size 8" in block and "Quest()" not in block
    assert "it timed Quest(), this patch runs QuantBlockTopK(bits=4)" in quant
    assert (
        "`hf-sparse-kv calibrate --policy QuantBlockTopK --policy-args '{\"bits\": 4}' --block-size 16 --out" in quant
    )
    assert "it timed eager steps, this patch runs graph steps" in timing and "--timing graph" in timing


def test_what_a_table_records_round_trips_and_an_old_table_timed_quest(tmp_path):
    """``policy`` and ``block_size`` survive save / load; a JSON table written before they were recorded timed
    Quest (the only policy calibrate measured then), its block size unknown (not checked); a table made in code
    without them checks neither."""
    table = CrossoverTable(_table(40).entries, policy=policy_key(QuantBlockTopK(budget=0.1, bits=2)), block_size=32)
    table.save(tmp_path / "t.json")
    back = CrossoverTable.load(tmp_path / "t.json")
    assert back.policy == {"name": "QuantBlockTopK", "bits": 2} and back.block_size == 32
    assert back.mismatch(QuantBlockTopK(budget=0.5, bits=2, sink=0), 32, "eager") == []
    assert len(back.mismatch(QuantBlockTopK(budget=0.5, bits=4), 16, "graph")) == 3
    old = _table(40).to_json()
    del old["policy"], old["block_size"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    legacy = CrossoverTable.load(tmp_path / "old.json")
    assert legacy.policy == {"name": "Quest"} and legacy.block_size is None
    assert legacy.mismatch(Quest(budget=0.1), 64, "eager") == [] and legacy.mismatch(TokenTopK(budget=0.1), 16, "eager")
    assert _table(40).mismatch(TokenTopK(budget=0.1), 64, "eager") == []


def test_a_table_timed_on_another_gpu_says_so():
    """A table names the GPU it was timed on; used for a model on another one, ``mismatch`` says which two (the
    patch passes the model's CUDA device name, none on the CPU); an unknown device or none given is not checked."""
    table = CrossoverTable(_table(40).entries, device="NVIDIA H100 80GB HBM3")
    assert table.mismatch(Quest(budget=0.1), 16, "eager", "NVIDIA H100 80GB HBM3") == []
    assert table.mismatch(Quest(budget=0.1), 16, "eager") == []
    assert table.mismatch(Quest(budget=0.1), 16, "eager", "NVIDIA A100-SXM4-80GB") == [
        "it timed an NVIDIA H100 80GB HBM3, this model runs on an NVIDIA A100-SXM4-80GB"
    ]
    unknown = CrossoverTable(_table(40).entries)
    assert (
        unknown.device == "unknown" and unknown.mismatch(Quest(budget=0.1), 16, "eager", "NVIDIA A100-SXM4-80GB") == []
    )
    shipped = CrossoverTable.load(timing="graph", policy=Fp8BlockTopK(budget=0.0625))
    assert shipped.device == "NVIDIA H100 80GB HBM3" and shipped.mismatch(
        Fp8BlockTopK(budget=0.0625), 16, "graph", "NVIDIA GeForce RTX 3090"
    )
    model = tiny_model("llama")
    want = None if DEVICE.type == "cpu" else torch.cuda.get_device_name(DEVICE)
    assert patch_module._gpu_name(model) == want  # what patch_model passes: the model's card, none on the CPU


def test_policy_key_keeps_what_costs_and_drops_what_does_not():
    pq = TopPBlockTopK(budget=0.0625, sink=8, window=16, candidates=4, p=1.0, coarse="pq", calibration="prefill")
    assert policy_key(pq) == {"name": "TopPBlockTopK", "candidates": 4, "coarse": "pq", "p": 1.0, "pool": "heads"}
    assert policy_key(pq) != policy_key(TopPBlockTopK(budget=0.0625, candidates=8, p=1.0))
    snap = policy_key(SnapKV(budget=0.25, then=QuantBlockTopK(budget=0.1, bits=4)))
    assert snap["then"] == {"name": "QuantBlockTopK", "bits": 4}
    assert policy_key(Quest(budget=300)) == policy_key(Quest(budget=0.5, sink=0, window=0)) == {"name": "Quest"}


@pytest.mark.parametrize(
    "policy",
    [
        QuantBlockTopK(budget=0.25, sink=4, window=8, bits=4),
        TopPBlockTopK(budget=0.25, sink=4, window=8, candidates=2, p=1.0, coarse="pq", calibration="prefill"),
    ],
    ids=["quant4", "pq_prefill"],
)
def test_calibrate_prepares_the_state_a_policy_keeps_in_the_cache(policy):
    """A selector with state in the cache (codes) is timed on that state as a prefill's write leaves it: the
    selection on the prepared states equals the one the policy makes coding the keys itself, layer by layer."""
    from hf_sparse_kv.calibrate import layer_states, prepare, random_state

    args = (2, 96, 4, 2, 16, 16, torch.float32, torch.device("cpu"), "reference")
    bare = [random_state(*args, seed=i) for i in range(2)]
    prepared = prepare(policy, layer_states(args, 0, most=1) + [random_state(*args, seed=1)])
    for (s, _), (p, _) in zip(bare, prepared):
        assert not s.state and set(p.state) == {spec.name for spec in policy.cache_state()}
        a, b = policy.select(s), policy.select(p)
        assert torch.equal(a.indices, b.indices)


def test_calibrate_times_any_policy_and_records_it(tmp_path):
    from evaluation.cli import main

    out = tmp_path / "quant.json"
    main(["calibrate", "--device", "cpu", "--shapes", "4,2,16", "--batches", "1", "--contexts", "64,128",
          "--budgets", "0.25", "--reps", "1", "--policy", "quant_block_topk", "--policy-args", '{"bits": 4}',
          "--block-size", "8", "--out", str(out)])  # fmt: skip
    table = CrossoverTable.load(out)
    assert table.policy == {"name": "QuantBlockTopK", "bits": 4} and table.block_size == 8
    assert "QuantBlockTopK(bits=4), block_size 8" in table.source
    assert table.mismatch(QuantBlockTopK(budget=0.0625, bits=4), 8, "eager") == []
    assert table.mismatch(QuantBlockTopK(budget=0.0625, bits=2), 8, "eager")
    token = tmp_path / "token.json"
    main(["calibrate", "--device", "cpu", "--shapes", "4,2,16", "--batches", "1", "--contexts", "64",
          "--budgets", "0.25", "--reps", "1", "--policy", "TokenTopK", "--out", str(token)])  # fmt: skip
    assert CrossoverTable.load(token).policy == {"name": "TokenTopK"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--policy", "Nope"], "not a policy"),
        (["--policy-args", "{bits: 4"], "not JSON"),
        (["--policy-args", "[4]"], "JSON object"),
        (["--policy-args", '{"budget": 0.1}'], "must not hold 'budget'"),
        (["--policy", "dense"], "Dense has no budget"),
        (["--policy", "SnapKV"], "frees blocks"),
        (["--policy", "Quest", "--policy-args", '{"bits": 4}'], "not a valid policy"),
        # malformed numbers: one line and status 2, not a traceback (a review, 2026-12-07)
        (["--budgets", "abc"], "--budgets takes comma-separated floats"),
        (["--budgets", "0.5,2.0"], "must lie in (0, 1]"),
        (["--batches", "0"], "--batches takes positive numbers"),
        (["--contexts", "-64"], "--contexts takes positive numbers"),
        (["--shapes", "4,3,64"], "the q heads a multiple of the KV heads"),
        (["--shapes", "4,2"], "'q heads,KV heads,head dim'"),
        (["--block-size", "12"], "block_size must be a power of two"),
        (["--reps", "0"], "--reps must be at least 1"),
    ],
)
def test_calibrate_refuses_a_policy_it_cannot_time(tmp_path, capsys, argv, message):
    from hf_sparse_kv.calibrate import main

    out = tmp_path / "t.json"
    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", "--contexts", "64", "--reps", "1", "--out", str(out), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err and not out.exists()


def test_the_shipped_table_of_the_policy_is_taken_where_there_is_one(tmp_path):
    """``load()`` without a path takes the shipped table timed with the patch's policy and timing, else Quest's;
    a folder of tables stands in for the package's data here."""
    for timing, name in (("eager", "crossover_h200.json"), ("graph", "crossover_h100_graph.json")):
        (tmp_path / name).write_text(json.dumps(CrossoverTable.load(timing=timing).to_json()))
    quant = QuantBlockTopK(budget=0.0625, bits=4)
    mine = CrossoverTable(_table(40).entries, timing="graph", policy=policy_key(quant), block_size=16)
    (tmp_path / "crossover_quant4_graph.json").write_text(json.dumps(mine.to_json()))
    (tmp_path / "notes.json").write_text("not a table")  # not crossover_*.json: never read
    assert CrossoverTable.shipped("graph", quant, tmp_path).entries == mine.entries
    assert CrossoverTable.shipped("eager", quant, tmp_path).policy == {"name": "Quest"}  # no eager table for it
    other = QuantBlockTopK(budget=0.0625, bits=2)
    assert CrossoverTable.shipped("graph", other, tmp_path).policy == {"name": "Quest"}
    assert CrossoverTable.shipped("graph", None, tmp_path).policy == {"name": "Quest"}
    with pytest.raises(ValueError, match="timing"):
        CrossoverTable.shipped("wall", quant, tmp_path)
    # the package's own data (H200, 2026-12-05): captured tables of quant4 and of the pq two stages; a policy without
    # a table of its own gets Quest's, which then warns at patch time
    assert CrossoverTable.load(timing="graph", policy=quant).policy == policy_key(quant)
    assert CrossoverTable.load(timing="eager", policy=quant).policy == {"name": "Quest"}
    assert CrossoverTable.load(timing="graph", policy=other).policy == {"name": "Quest"}
    pq = TopPBlockTopK(budget=0.0625, candidates=4, p=1.0, coarse="pq", calibration="prefill")
    assert CrossoverTable.load(timing="graph", policy=pq).mismatch(pq, 16, "graph") == []


def test_the_calibrate_command_a_warning_gives_measures_that_policy(tmp_path):
    """The command in the warning, run as it is (on the CPU, small), writes a table that matches the patch."""
    import shlex

    from evaluation.cli import main
    from hf_sparse_kv.crossover import calibrate_command

    pq = TopPBlockTopK(budget=0.25, sink=4, window=8, candidates=2, p=1.0, coarse="pq", calibration="prefill")
    command = calibrate_command(pq, 8, "eager")
    assert command.startswith("hf-sparse-kv calibrate --policy TopPBlockTopK --policy-args '{")
    argv = shlex.split(command)[1:]
    argv[argv.index("--out") + 1] = str(tmp_path / "mine.json")
    main([*argv, "--device", "cpu", "--shapes", "4,2,16", "--batches", "1", "--contexts", "64", "--budgets", "0.25",
          "--reps", "1"])  # fmt: skip
    table = CrossoverTable.load(tmp_path / "mine.json")
    assert table.mismatch(pq, 8, "eager") == [] and table.policy["coarse"] == "pq"
    assert "--timing graph" in calibrate_command(Quest(budget=0.1), 16, "graph")


def _dense_forever_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "will run every decode step" in str(w.message)]


def test_a_table_without_the_models_heads_warns_that_auto_stays_dense(recwarn):
    """A table with no entry for the model's head shape (and no fallback) decides no step sparse: patch_model says so,
    with the calibrate command for those heads (which calibrate's parser takes), and patches the model anyway."""
    other = CrossoverTable(
        [{"budget": 0.25, "batch": 1, "num_kv_heads": 8, "head_dim": 128, "crossover": 2048}], device="hand-made"
    )
    assert other.holds(8, 128) and not other.holds(2, 16) and not other.holds(8, 16)
    assert dataclasses.replace(other, fallback=4096).holds(2, 16)
    model = tiny_model("llama")  # 4 query heads, 2 KV heads of 16 channels
    ids = prompt(48)
    unpatched = greedy(model, ids, 4)[0]
    patch_model(model, policy=Quest(budget=0.25), mode="auto", crossover=_table(40))  # holds (2, 16)
    patch_model(model, policy=Quest(budget=0.25), mode="auto", crossover=dataclasses.replace(other, fallback=40))
    patch_model(model, policy=Dense(), mode="auto", crossover=other)  # no budget: never sparse anyway
    patch_model(model, policy=Quest(budget=0.25), mode="block")  # no table
    assert _dense_forever_warnings(recwarn) == []
    patch_model(model, policy=Quest(budget=0.25), mode="auto", crossover=other)
    (message,) = _dense_forever_warnings(recwarn)
    assert "LlamaForCausalLM" in message and "hand-made, eager steps" in message
    assert "no entry for 2 KV heads of 16 channels" in message
    command = message.split("`")[1]
    assert command == "hf-sparse-kv calibrate --policy Quest --block-size 16 --shapes 4,2,16 --out mine.json"
    assert is_patched(model)
    assert torch.equal(greedy(model, ids, 4)[0], unpatched)  # every step dense: the unpatched model's tokens
    unpatch_model(model)

    from hf_sparse_kv.calibrate import main

    seen = {}

    def fake_calibrate(hq, hkv, d, **kwargs):  # what calibrate's parser hands on, without timing anything
        seen["shape"] = (hq, hkv, d)
        raise SystemExit(0)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("hf_sparse_kv.calibrate.calibrate", fake_calibrate)
        with pytest.raises(SystemExit):
            main(command.removeprefix("hf-sparse-kv calibrate ").split() + ["--device", "cpu"])
    assert seen["shape"] == (4, 2, 16)
