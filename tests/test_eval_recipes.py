"""Evaluation recipes on tiny random models (nothing downloaded): the two perplexity ways agree, needle trials put
the needle where asked, QA items are answerable, a recipe runs end to end and resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_assets_text import WordTokenizer, make_essays
from tiny_models import prompt, tiny_model

from evaluation.needle import needle_trial, score_trial
from evaluation.perplexity import decode_logprobs, nll_of
from evaluation.qa import TASKS, first_answer, make_item, score_item
from evaluation.recipes import file_part, run_recipe
from evaluation.simulate import SimulateSession
from evaluation.sweep import ResultsDir, parse_budget, policy_grid
from evaluation.toy import CharTokenizer
from hf_sparse_kv import is_patched
from hf_sparse_kv.policies import Dense, OracleBlockTopK, Quest, SinkWindow, TokenTopK

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def essays() -> str:
    return make_essays(2000)


CASES = {
    "llama": [
        (Dense(), "block"),
        (Quest(budget=0.25, sink=4, window=16), "block"),
        (SinkWindow(sink=4, budget=40), "block"),
        (TokenTopK(budget=0.2, sink=2, window=8), "token"),
    ],
    "gemma3": [(Dense(), "block"), (Quest(budget=48, sink=4, window=8), "mask")],
}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_decode_and_simulate_agree(arch):
    model = tiny_model(arch)
    ids = prompt(120)
    session = SimulateSession(model, ids, 16, block_size=8, chunk=6)
    dense = None
    for policy, mode in CASES[arch]:
        exact = nll_of(decode_logprobs(model, ids, 16, policy, dense_layers=(0,), block_size=8, mode=mode), ids)
        fast = session.nll(session.run(policy, dense_layers=(0,))[0])
        assert torch.allclose(exact, fast, atol=1e-4, rtol=0), (type(policy).__name__, (exact - fast).abs().max())
        dense = fast if dense is None else dense
        if not isinstance(policy, Dense):
            assert (fast - dense).abs().max() > 1e-4  # the policy changed something: the agreement is not vacuous
    assert not is_patched(model)


def test_simulate_fidelity_of_the_oracle_is_perfect():
    model = tiny_model("llama")
    session = SimulateSession(model, prompt(128), 16, block_size=8)
    _, fid = session.run(OracleBlockTopK(budget=0.25, window=8), dense_layers=(0,), fidelity=True)
    assert fid.hit_rate == pytest.approx(1.0)
    _, fid = session.run(Quest(budget=0.25, window=8), dense_layers=(0,), fidelity=True)
    assert 0 < fid.recall < 1 and 0 < fid.hit_rate <= 1


@pytest.mark.parametrize("variant", ["single", "multi_key", "multi_value"])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.75, 1.0])
def test_needle_trial_at_asked_depth(variant, depth, essays):
    tok = WordTokenizer(bos=True)
    t = needle_trial(tok, 600, depth, variant, seed=3, n_needles=3, essays=essays)
    ids = tok.encode(t["text"])
    assert abs(len(ids) - 600) <= 8 and t["n_tokens"] == len(ids)
    first = tok.decode(ids[t["needle_token_pos"] : t["needle_token_pos"] + 12])
    assert first.startswith("The pass key" if variant != "multi_value" else "One of the special")
    assert t["answers"][0] in first
    assert abs(t["needle_token_pos"] / len(ids) - depth) < 0.1  # sentence boundaries are within a few words
    answer = " " + " and ".join(t["answers"]) + "."
    assert score_trial(answer, t)
    assert not score_trial(" 1" + answer.strip(), t)
    if variant == "multi_value":
        assert not score_trial(" " + t["answers"][0] + ".", t)  # one value of several is not enough


@pytest.mark.parametrize("task", TASKS)
def test_qa_items_answerable(task, essays):
    tok = WordTokenizer()
    for seed in range(3):
        item = make_item(task, tok, 500, seed, essays=essays)
        text = item["prompt"]
        assert abs(item["n_tokens"] - 500) <= 30
        if task == "variable_tracking":  # follow the chain in the text to its end
            assigns = dict(__import__("re").findall(r"VAR (\w+) = (VAR \w+|\d+)\.", text))
            var = text.rsplit("VAR ", 1)[1].split()[0]
            while not assigns[var].isdigit():
                var = assigns[var].split()[1]
            assert assigns[var] == item["gold"]
        elif task == "fact":
            name = text.rsplit("Answer: ", 1)[1].split()[0]
            assert f"{name} lives in {item['gold']}." in text and text.count(" lives in") == 2
        else:
            words = [line.split(". ", 1)[1] for line in text.split("\n") if line[:1].isdigit()]
            counts = {w: words.count(w) for w in set(words)}
            assert max(counts, key=counts.get) == item["gold"]
            top, second = sorted(counts.values(), reverse=True)[:2]
            assert top > second
        assert score_item(f" {item['gold']}.", item)
        assert not score_item(" nothing", item)
    assert first_answer(" is 12345, then", "number") == "12345"


def test_policy_grid_and_budgets():
    cells = policy_grid([{"name": "dense"}, {"name": "quest", "window": 16}, "sink_window"], ["1/8", 0.25, 512])
    assert [c.key for c in cells][:4] == [("dense", "-"), ("quest", "1/8"), ("quest", "1/4"), ("quest", "512")]
    assert parse_budget("1/16") == 0.0625 and parse_budget(2048.0) == 2048
    with pytest.raises(ValueError):
        policy_grid([{"name": "nope"}], [0.1])


def test_policy_grid_takes_a_policy_class_from_another_module():
    (cell,) = policy_grid(
        [{"name": "evaluation.channel_quant:ChannelQuantBlockTopK", "channels": 32, "rest": "block"}], ["1/16"]
    )
    assert cell.key == ("ChannelQuantBlockTopK", "1/16") and type(cell.policy).__name__ == "ChannelQuantBlockTopK"
    assert cell.policy.channels == 32 and cell.policy.rest == "block" and cell.policy.budget == 0.0625
    plain, named = policy_grid(
        [{"name": "hf_sparse_kv.policies:Quest"}, {"name": "hf_sparse_kv.policies:Quest", "label": "q"}], ["1/8"]
    )
    assert plain.key == ("quest", "1/8") and named.key == ("q", "1/8")  # a library class keeps its registry name
    for bad, match in (
        ("evaluation.channel_quant:Nope", "cannot import"),
        ("no_such_module_xyz:Thing", "cannot import"),
        ("evaluation.channel_quant:channel_mask", "not a hf_sparse_kv Policy"),
    ):
        with pytest.raises(ValueError, match=match):
            policy_grid([{"name": bad}], ["1/16"])


def test_policy_grid_nests_a_query_aware_policy_under_snapkv():
    alone, composed = policy_grid(
        [
            {"name": "snapkv", "window": 16},
            {"name": "snapkv", "label": "snap+quest", "budget": "1/4", "then": {"name": "quest"}},
        ],
        ["1/16"],
    )
    assert alone.policy.budget == 0.0625 and alone.policy.then is None
    assert composed.key == ("snap+quest", "1/16")
    assert composed.policy.budget == 0.25 and composed.policy.then.budget == 0.0625
    (fixed_inner,) = policy_grid([{"name": "snapkv", "then": {"name": "quest", "budget": 64}}], ["1/8"])
    assert fixed_inner.policy.budget == 0.125 and fixed_inner.policy.then.budget == 64
    with pytest.raises(ValueError, match="needs a budget"):
        policy_grid([{"name": "snapkv", "then": {"name": "quest"}}], ["1/8"])
    assert file_part("snapkv1/4+quest") == "snapkv1over4_quest" and file_part("1/16") == "1over16"  # plot names


def test_perplexity_recipe_scores_snapkv_the_decode_way(tmp_path, essays):
    model, tok = tiny_model("llama", max_position_embeddings=2048), CharTokenizer()
    cfg = _tiny_cfg(
        "perplexity",
        tmp_path,
        policies=[{"name": "dense"}, {"name": "quest", "window": 16}, {"name": "snapkv", "window": 16}],
        perplexity={"windows": 1, "scored": 8},
    )
    run_recipe(cfg, model=model, tokenizer=tok, text=essays)
    ways = {r["policy"]: r["way"] for r in ResultsDir(tmp_path).rows()}
    assert ways == {"dense": "simulate", "quest": "simulate", "snapkv": "decode"}


@pytest.mark.parametrize("recipe", ["perplexity", "needle", "qa"])
def test_reused_cells_only_in_the_simulate_way(tmp_path, essays, recipe):
    """A spec with ``reuse`` scores in the perplexity recipe's simulate way; the decode way, needles and QA refuse
    it before writing anything."""
    model, tok = tiny_model("llama", max_position_embeddings=2048), CharTokenizer()
    policies = [{"name": "dense"}, {"name": "quest", "window": 16, "reuse": 2}]
    if recipe == "perplexity":
        cfg = _tiny_cfg(recipe, tmp_path / "sim", policies=policies, perplexity={"windows": 1, "scored": 8})
        run_recipe(cfg, model=model, tokenizer=tok, text=essays)
        assert {r["policy"]: r.get("reuse") for r in ResultsDir(tmp_path / "sim").rows()} == {
            "dense": None,
            "quest_r2": 2,
        }
        extra = {"perplexity": {"windows": 1, "scored": 8, "way": "decode"}}
    else:
        extra = {"needle": {"trials": 1}} if recipe == "needle" else {"qa": {"items": 1}}
    out = tmp_path / "decoded"
    with pytest.raises(ValueError, match="simulate way"):
        run_recipe(_tiny_cfg(recipe, out, policies=policies, **extra), model=model, tokenizer=tok, text=essays)
    assert ResultsDir(out).rows() == []


def _tiny_cfg(recipe: str, out: Path, **extra) -> dict:
    return {
        "recipe": recipe,
        "model": "tiny-llama",
        "lengths": [240],
        "budgets": ["1/4"],
        "block_size": 8,
        "dense_layers": [0],
        "policies": [{"name": "dense"}, {"name": "quest", "window": 16}],
        "output": str(out),
        **extra,
    }


def test_recipes_end_to_end_and_resume(tmp_path, essays):
    model, tok = tiny_model("llama", max_position_embeddings=2048), CharTokenizer()
    specs = {
        "perplexity": {"perplexity": {"windows": 2, "scored": 16, "fidelity": True}},
        "needle": {"needle": {"depths": [0.5], "trials": 1, "new_tokens": 6}, "lengths": [400]},
        "qa": {"qa": {"tasks": ["fact"], "items": 1, "new_tokens": 4}, "lengths": [400]},
    }
    for recipe, extra in specs.items():
        out = tmp_path / recipe
        rows = run_recipe(_tiny_cfg(recipe, out, **extra), model=model, tokenizer=tok, text=essays)
        assert rows and (out / "summary.json").exists() and (out / "summary.csv").exists()
        assert list(out.glob("*.png")), recipe
        summary = json.loads((out / "summary.json").read_text())
        assert summary["rows"] == json.loads(json.dumps(rows))
        cells = ResultsDir(out).rows()
        # resume: a second run does nothing new (and would fail if it touched the model)
        rows2 = run_recipe(
            _tiny_cfg(recipe, out, **extra), model=None if False else _Untouchable(), tokenizer=tok, text=essays
        )
        assert ResultsDir(out).rows() == cells and rows2 == rows
    ppl = json.loads((tmp_path / "perplexity" / "summary.json").read_text())["rows"]
    quest = next(r for r in ppl if r["policy"] == "quest")
    assert quest["windows"] == 2 and quest["hit_rate"] is not None and quest["ppl_change_pct"] is not None
    assert {p.name for p in (tmp_path / "needle").glob("*.png")} >= {
        "accuracy_vs_budget.png",
        "needle_quest_1over4.png",
    }


def test_resume_runs_only_missing_cells(tmp_path, essays):
    model, tok = tiny_model("llama", max_position_embeddings=2048), CharTokenizer()
    extra = {"perplexity": {"windows": 1, "scored": 8}}
    run_recipe(_tiny_cfg("perplexity", tmp_path, **extra), model=model, tokenizer=tok, text=essays)
    before = ResultsDir(tmp_path).rows()
    cfg = _tiny_cfg("perplexity", tmp_path, budgets=["1/4", "1/8"], **extra)
    run_recipe(cfg, model=model, tokenizer=tok, text=essays)
    after = ResultsDir(tmp_path).rows()
    assert after[: len(before)] == before
    assert [(r["policy"], r["budget"]) for r in after[len(before) :]] == [("quest", "1/8")]


class _Untouchable(torch.nn.Module):
    """A stand-in model for a resumed run: any forward means a done cell was redone."""

    device = torch.device("cpu")
    config = None

    def forward(self, *a, **k):  # pragma: no cover - failing is the point
        raise AssertionError("a done cell was recomputed")


@pytest.mark.slow
def test_accelerate_two_processes_shard_trials(tmp_path, essays):
    """``accelerate launch`` with two CPU processes: each takes half the trials; together they cover the grid."""
    (tmp_path / "essays.txt").write_text(essays)
    cfg = _tiny_cfg(
        "needle",
        tmp_path / "out",
        needle={"depths": [0.25, 0.75], "trials": 1, "new_tokens": 4},
        lengths=[300],
        text=str(tmp_path / "essays.txt"),
    )
    import yaml

    (tmp_path / "r.yaml").write_text(yaml.safe_dump(cfg))
    script = (
        "import sys; sys.path.insert(0, 'tests');"
        "from tiny_models import tiny_model; from evaluation.toy import CharTokenizer;"
        "from evaluation.recipes import run_recipe;"
        f"run_recipe({str(tmp_path / 'r.yaml')!r}, model=tiny_model('llama', max_position_embeddings=2048),"
        " tokenizer=CharTokenizer())"
    )
    (tmp_path / "go.py").write_text(script)
    # the repository on the path (the package need not be installed: the GPU machine runs the tree as it is), and
    # the two processes on the CPU wherever the test runs (two of them on one GPU is not what this test is about)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}
    env["HF_SPARSE_KV_TEST_DEVICE"] = "cpu"
    # --multi_gpu is what makes accelerate start two torchrun processes; on a CPU-only machine they use gloo
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(tmp_path / "go.py"),
    ]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    assert {f.name for f in out.glob("cells.rank*.jsonl")} == {"cells.rank0.jsonl", "cells.rank1.jsonl"}
    rows = ResultsDir(out).rows()
    assert sorted((r["depth"], r["policy"]) for r in rows) == sorted(
        (d, p) for d in (0.25, 0.75) for p in ("dense", "quest")
    )
    assert (out / "summary.json").exists()
