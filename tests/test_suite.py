"""The per-model suite end to end on a tiny random model (nothing downloaded): every task and policy runs, a time
limit stops it cleanly, a rerun resumes without redoing cells, and the summary has intervals and plots."""

from __future__ import annotations

import json
import math
import statistics
import time

import pytest
from test_assets_text import make_essays
from tiny_models import DEVICE, tiny_model

from evaluation import suite as suite_module
from evaluation.suite import SUITES, _needle_params, _qa_params, cells_of, device_name, load_suite, plan, run_suite
from evaluation.suite_summary import perplexity_rows, summarize
from evaluation.toy import CharTokenizer


def _tiny_cfg(name: str) -> dict:
    """A real suite config cut down to seconds: one short length, two windows, two trials, two budgets."""
    cfg = load_suite(name)
    cfg.update(
        lengths=[640],
        budgets=["1/4", "1/8"],
        block_size=8,
        dense_layers=[0],
        dtype="float32",
        perplexity={"windows": 3, "scored": 16, "chunk": 8, "fidelity": True, "batch": 2},
        decisive={"policies": ["dense", "oracle", "quest"], "budgets": ["1/8"]},
    )
    selectors = ("two_stage_block_topk", "top_p_block_topk", "quant_block_topk")  # issue 13's: tested elsewhere
    cfg["policies"] = [
        dict(p, sink=2, window=8) if p["name"] not in ("dense", "sink_window") else p
        for p in cfg["policies"]
        if p["name"] not in selectors
    ]
    assert cfg["policies"][-1]["label"] == "snapkv1/4+quest"
    cfg["policies"][-1]["then"] = {"name": "quest", "sink": 2, "window": 8}
    cfg["needle"] = {
        "trials": 3, "depths": [0.1, 0.6], "new_tokens": 3, "max_offset": 200, "batch": {640: 2},
        "hard": {"variants": ["multi_key", "multi_value"], "trials": 1, "n_needles": 2, "multi_value": {"new_tokens": 4}},
        "start": {"depths": [0.0], "trials": 1},
    }  # fmt: skip
    cfg["qa"] = {"tasks": ["fact", "variable_tracking"], "items": 1, "new_tokens": 3, "max_offset": 200, "batch": 2}
    return cfg


def _run_tiny(cfg: dict, out) -> list[dict]:
    """Run ``cfg`` to the end on a tiny random Llama (character tokens, synthetic haystacks); the cells written."""
    model, tok = tiny_model("llama", max_position_embeddings=1024), CharTokenizer()
    texts = {"essays": make_essays(400), "kjv": make_essays(500)[5000:]}
    assert run_suite(cfg, out, model=model, tokenizer=tok, texts=texts)["finished"]
    return [json.loads(line) for line in (out / "cells.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", sorted(SUITES))
def test_every_suite_recipe_builds_its_policies(name):
    """Each shipped suite's policy specs build (unknown keys or bad values raise in the policies' checks) and its
    decisive policies are among its labels."""
    cfg = load_suite(name)
    labels = {c.label for c in cells_of(cfg)}
    assert set(cfg.get("decisive", {}).get("policies", [])) <= labels
    assert plan(cfg)


def test_plan_runs_the_decisive_cells_first():
    cfg = load_suite("qwen2.5")
    jobs = plan(cfg)
    first = [j for j in jobs if j.labels == tuple(cfg["decisive"]["policies"])]
    assert jobs[: len(first)] == first and all(j.budgets == ("1/16",) for j in first)
    assert {j.task for j in first} == {"perplexity", "needle", "qa"} and jobs[-1].labels[1:] == (
        "snapkv",
        "snapkv1/4+quest",
    )
    assert {j.length for j in first} == {8192, 16384, 32768}


def test_plan_holds_each_job_once():
    cfg = load_suite("qwen2.5")
    labels = [c.label for c in cells_of(cfg)]
    cfg.update(budgets=["1/16"], decisive={"policies": list(dict.fromkeys(labels)), "budgets": ["1/16"]})
    jobs = plan(cfg)
    assert jobs and all(a != b for i, a in enumerate(jobs) for b in jobs[:i])  # the two 1/16 tiers are one


def _job_prompts(cfg: dict, variant: str | None = None, done: frozenset = frozenset()) -> int:
    """(job, prompt) pairs of the plan's needle jobs (of ``variant``; all where ``None``) with cells left, each
    (unit, cell) counted in its first job and those in ``done`` not at all: the prefills the estimate charges."""
    from evaluation.suite import _units

    cells, counted, n = cells_of(cfg), set(done), 0
    for j in plan(cfg):
        if j.task == "needle" and variant in (None, j.params["variant"]):
            left = [u for u in _units(cfg, j, cells) if u not in counted]
            counted.update(left)
            n += len({u[:4] for u in left})
    return n


def test_one_pass_plan_holds_every_cell_of_the_tiers_once():
    """``one_pass: true``: one job per task, length and variant with every policy at every budget (a part's own
    budgets kept), SnapKV's decode-way perplexity still last; the same (unit, cell) pairs as the tiers, none in two
    jobs. A value that is not a bool is refused."""
    from evaluation.suite import _units

    cfg = load_suite("qwen2.5")
    cfg["qa"]["budgets"] = ["1/8", "1/16"]  # a part's own budgets are kept in one pass
    cells = cells_of(cfg)
    tiers, one = plan(cfg), plan({**cfg, "one_pass": True})
    kinds = [(j.task, j.length, j.params.get("variant"), j.labels[1:2]) for j in one]
    assert len(kinds) == len(set(kinds)) < len(tiers)
    labels = tuple(dict.fromkeys(c.label for c in cells))
    for j in one[:-3]:
        assert j.budgets == {"qa": ("1/8", "1/16")}.get(j.task, ("1/8", "1/16", "1/32"))
        assert j.labels == (labels if j.task != "perplexity" else tuple(lb for lb in labels if "snapkv" not in lb))
    assert all(j.task == "perplexity" and j.labels == ("dense", "snapkv", "snapkv1/4+quest") for j in one[-3:])
    units = [u for j in one for u in _units(cfg, j, cells)]
    assert len(units) == len(set(units))
    assert set(units) == {u for j in tiers for u in _units(cfg, j, cells)}
    with pytest.raises(TypeError, match="one_pass must be true or false"):
        plan({**cfg, "one_pass": "false"})


def test_one_pass_prefills_each_batch_once_and_writes_the_tiers_cells(tmp_path, capsys):
    """A tiny suite run in one pass writes the cells the tiers write, with the same answers and perplexities, from
    fewer needle / QA batches (each prefilled once for every cell, not once per tier)."""
    cfg = _tiny_cfg("qwen2.5")
    cfg["needle"]["hard"] = {}
    cfg["needle"]["start"] = None

    def run(one_pass: bool, out) -> tuple[dict, int]:
        capsys.readouterr()
        rows = _run_tiny({**cfg, "one_pass": one_pass}, out)
        batches = sum(" prompts x " in line for line in capsys.readouterr().out.splitlines())
        by = {}
        for r in rows:
            unit = (r.get("trial"), r.get("item"), r.get("window"), r.get("qa_task"))
            by[(r["task"], r["length"], unit, r["policy"], r["budget"])] = r
        return by, batches

    tiers, n_tiers = run(False, tmp_path / "tiers")
    one, n_one = run(True, tmp_path / "one")
    assert one.keys() == tiers.keys()
    for k, r in one.items():
        if r["task"] == "perplexity":
            assert r["nll_sum"] == pytest.approx(tiers[k]["nll_sum"], rel=1e-5)
        else:
            assert r["generated"] == tiers[k]["generated"]
    trials, qa = cfg["needle"]["trials"], len(cfg["qa"]["tasks"]) * cfg["qa"]["items"]
    assert n_one == -(-trials // 2) + -(-qa // 2) < n_tiers  # batches of 2 prompts, once each


def test_estimate_prices_one_pass_below_the_tiers_by_their_extra_prefills():
    """From the same finished cells (carrying their batch's phases), a fresh one-pass run is priced below the
    tiered one by the prefills the tiers repeat: each needle prompt's once-for-all part per extra job."""
    from evaluation.suite import _units
    from evaluation.suite_estimate import estimate

    cfg = _tiny_cfg("qwen2.5")
    cells = cells_of(cfg)
    units = {u for j in plan(cfg) if j.task == "needle" for u in _units(cfg, j, cells)}
    rows = [
        {"task": "needle", "length": u[1], "variant": u[2], "trial": u[3], "policy": u[4], "budget": u[5],
         "seconds": 0.25, "batch": 2, "phases": {"build": 0.5, "prefill": 1.5, "decode": 2.0}}
        for u in units if u[3] == 0
    ]  # fmt: skip

    def needles(c):
        return sum(s for j, s, m in estimate(c, rows=rows, fresh=True) if j.task == "needle")

    one = {**cfg, "one_pass": True}
    assert _job_prompts(cfg) > _job_prompts(one)
    assert needles(cfg) - needles(one) == pytest.approx((_job_prompts(cfg) - _job_prompts(one)) * 2.0 / 2)


def test_tiny_suite_end_to_end_resumes_and_summarizes(tmp_path, monkeypatch):
    cfg = _tiny_cfg("qwen2.5")
    model, tok = tiny_model("llama", max_position_embeddings=1024), CharTokenizer()
    texts = {"essays": make_essays(400), "kjv": make_essays(500)[5000:]}
    stopped = run_suite(cfg, tmp_path, time_limit=0, model=model, tokenizer=tok, texts=texts)
    assert not stopped["finished"] and not (tmp_path / "cells.jsonl").exists()
    status = run_suite(cfg, tmp_path, model=model, tokenizer=tok, texts=texts)
    assert status["finished"]
    rows = [json.loads(line) for line in (tmp_path / "cells.jsonl").read_text().splitlines()]
    tasks = {r["task"] for r in rows}
    assert tasks == {"perplexity", "needle", "qa"}
    labels = {r["policy"] for r in rows if r["task"] == "perplexity"}
    assert labels == {
        "dense",
        "oracle",
        "quest",
        "token_topk",
        "block_topk",
        "sink_window",
        "snapkv",
        "snapkv1/4+quest",
    }
    assert {r["variant"] for r in rows if r["task"] == "needle"} == {
        "single",
        "multi_key",
        "multi_value",
        "single_start",
    }
    assert {r["text"] for r in rows if r["task"] == "needle"} == {"essays", "kjv"}
    for r in rows:  # every needle and QA cell carries where its batch's time went
        if r["task"] != "perplexity":
            assert set(r["phases"]) >= {"build", "prefill", "decode"} and min(r["phases"].values()) >= 0
            assert r["own"]["phases"] >= r["own"]["decode"] > 0  # and where its own cell's went
    assert any(r["hit_rate"] is not None for r in rows if r["task"] == "perplexity")
    today = time.strftime("%Y-%m-%d")  # every cell says where and when it ran
    where = device_name(model)  # "cpu", or the GPU's name under HF_SPARSE_KV_TEST_DEVICE=cuda
    assert {(r["device"], r["date"]) for r in rows} <= {(where, today), (where, time.strftime("%Y-%m-%d"))}
    n = len(rows)
    again = run_suite(cfg, tmp_path, model=model, tokenizer=tok, texts=texts)
    assert again["finished"] and len((tmp_path / "cells.jsonl").read_text().splitlines()) == n  # nothing redone

    def no_load(*args, **kwargs):
        raise AssertionError("a finished suite loaded its model")

    monkeypatch.setattr("evaluation.assets.load_model", no_load)
    monkeypatch.setattr("evaluation.suite.suite_text", no_load)
    assert run_suite(cfg, tmp_path)["finished"]  # every unit done: nothing loads
    md = summarize(tmp_path, "tiny")
    assert "Δppl % [95% CI]" in md and "McNemar p" in md and "accuracy [95% CI]" in md
    summary = json.loads((tmp_path / "summary.json").read_text())
    quest = next(r for r in summary["perplexity"] if r["policy"] == "quest" and r["budget"] == "1/8")
    assert quest["windows"] == 3 and quest["dppl_low"] <= quest["dppl_pct"] <= quest["dppl_high"]
    assert list(tmp_path.glob("dppl_vs_budget_640.png")) and list(tmp_path.glob("needle_single_640_vs_budget.png"))
    assert list(tmp_path.glob("needle_depth_quest_1over8.png"))


def test_summary_compares_each_selector_with_the_oracle_on_the_same_windows():
    """``vs_oracle_*``: the policy's perplexity against the oracle's at the same length and budget, paired over the
    windows both scored (here the policy's NLL is the oracle's + 0.01 nats on every window but one, so the ratio is
    known and its interval narrow); dense and the oracle have none, nor a budget the oracle did not run."""
    rows = []
    for w in range(5):
        for policy, budget, nll in (
            ("dense", "-", 2.0),
            ("oracle", "1/16", 2.1),
            ("mass", "1/16", 2.11 + (w == 4) * 1e-3),
        ):
            rows.append({"task": "perplexity", "length": 64, "window": w, "policy": policy, "budget": budget,
                         "budget_value": None if budget == "-" else 1 / 16, "nll_sum": nll * 10, "n": 10})  # fmt: skip
    rows.append({"task": "perplexity", "length": 64, "window": 0, "policy": "mass", "budget": "1/8",
                 "budget_value": 1 / 8, "nll_sum": 20.5, "n": 10})  # fmt: skip
    out = {(r["policy"], r["budget"]): r for r in perplexity_rows(rows)}
    mass = out[("mass", "1/16")]
    expected = 100 * math.expm1(0.01 + 1e-3 / 5)
    assert mass["vs_oracle_pct"] == pytest.approx(expected, rel=1e-6)
    assert mass["vs_oracle_low"] < mass["vs_oracle_pct"] < mass["vs_oracle_high"] < expected + 0.1
    for key in (("dense", "-"), ("oracle", "1/16"), ("mass", "1/8")):
        assert out[key]["vs_oracle_pct"] is None


def test_suite_runs_a_policy_named_by_module_and_class(tmp_path):
    """A policy outside the library's registry (``module:Class``, here issue 13's channel experiment) runs every
    task of the suite: perplexity with fidelity the ``simulate`` way, needles through ``patch_model``."""
    cfg = _tiny_cfg("qwen2.5")
    cfg.update(budgets=["1/8"], decisive={"policies": ["dense", "chq"], "budgets": ["1/8"]}, qa=None)
    cfg["policies"] = [
        {"name": "dense"},
        {"name": "evaluation.channel_quant:ChannelQuantBlockTopK", "label": "chq", "sink": 2, "window": 8,
         "channels": 8, "rest": "block", "group": 4},
    ]  # fmt: skip
    cfg["perplexity"] = {**cfg["perplexity"], "windows": 1}
    cfg["needle"] = {**cfg["needle"], "trials": 2, "hard": {}, "start": None}
    rows = _run_tiny(cfg, tmp_path)
    mine = [r for r in rows if r["policy"] == "chq"]
    assert {r["task"] for r in mine} == {"perplexity", "needle"} and len(mine) == 3
    assert all(0.0 <= r["hit_rate"] <= 1.0 for r in mine if r["task"] == "perplexity")


def test_suite_scores_reused_selections_by_perplexity_only_and_plots_them(tmp_path):
    """A spec with ``reuse`` runs its perplexity cells (the simulate way) and no needle; the summary carries the
    reuse and draws it against the oracle (``reuse_<length>.png``), the budget plot leaves it out."""
    cfg = _tiny_cfg("qwen2.5")
    cfg.update(budgets=["1/8"], decisive={"policies": ["dense"], "budgets": ["1/8"]}, qa=None)
    q = {"name": "quest", "sink": 2, "window": 8}
    cfg["policies"] = [
        {"name": "dense"}, {"name": "oracle_block_topk", "label": "oracle", "sink": 2, "window": 8}, q,
        {**q, "reuse": 2}, {**q, "reuse": 4},
    ]  # fmt: skip
    cfg["perplexity"] = {**cfg["perplexity"], "windows": 2}
    cfg["needle"] = {**cfg["needle"], "trials": 1, "hard": {}, "start": None}
    rows = _run_tiny(cfg, tmp_path)
    reused = [r for r in rows if r["policy"] in ("quest_r2", "quest_r4")]
    assert {r["task"] for r in reused} == {"perplexity"} and len(reused) == 4
    assert {r["reuse"] for r in reused} == {2, 4} and all(r["way"] == "simulate" for r in reused)
    assert {r["policy"] for r in rows if r["task"] == "needle"} == {"dense", "oracle", "quest"}
    summarize(tmp_path, "tiny")
    summary = json.loads((tmp_path / "summary.json").read_text())
    by = {r["policy"]: r for r in summary["perplexity"]}
    assert by["quest_r4"]["reuse"] == 4 and by["quest"]["reuse"] == 1 and by["quest_r4"]["vs_oracle_pct"] is not None
    assert (tmp_path / "reuse_640.png").is_file() and (tmp_path / "dppl_vs_budget_640.png").is_file()


def test_estimate_counts_what_is_left_and_prices_it_from_finished_cells():
    """The estimate counts each (unit, cell) once across the plan's tiers, skips the finished ones, and prices a kind
    of unit from the finished cells' median seconds when there are some: each cell at its share of its batch's
    decoding, each prompt of a job with cells left once at its batch's prefill."""
    from evaluation.suite import _units
    from evaluation.suite_estimate import estimate

    cfg = _tiny_cfg("qwen2.5")
    cells = cells_of(cfg)
    fresh = estimate(cfg)
    assert all(not measured for *_, measured in fresh) and sum(s for _, s, _ in fresh) > 0
    jobs = plan(cfg)
    unique = {u for job in jobs for u in _units(cfg, job, cells)}
    single = next(j for j in jobs if j.task == "needle" and j.params["variant"] == "single")
    first = _units(cfg, single, cells)
    price = {c.label: 1.0 + i for i, c in enumerate(cells)}  # each policy's own seconds a trial
    rows = [  # the first trial of every cell of that job finished
        {"task": "needle", "length": u[1], "variant": u[2], "trial": u[3], "policy": u[4], "budget": u[5],
         "seconds": price[u[4]], "batch": 2, "phases": {"prefill": 1.0, "copy": 0.5, "decode": 2.5}}
        for u in first if u[3] == 0
    ]  # fmt: skip
    est = estimate(cfg, rows=rows)
    same = [(s, m) for job, s, m in est if job.task == "needle" and job.params["variant"] == "single"]
    assert all(m for _, m in same)
    single_units = {u for j in jobs if j.task == "needle" for u in _units(cfg, j, cells) if u[2] == "single"}
    finished = {("needle", r["length"], r["variant"], r["trial"], r["policy"], r["budget"]) for r in rows}
    seen = {r["policy"] for r in rows}  # a policy without finished cells: the median of all of them, plus a prompt's
    fallback = statistics.median(r["seconds"] for r in rows)  # share of the prefill (1.0 s for 2) if it prefills alone
    compressing = {c.label for c in cells if c.policy.compresses}
    prompts = _job_prompts(cfg, "single", frozenset(finished))  # each job's prompts with cells left, once each
    decoding = 3.0 / 4.0  # of a cell's seconds: copy + decode over all its batch's phases
    want = 0.5 * prompts + sum(  # the batch's prefill: 1.0 s for 2 prompts
        decoding * (price[u[4]] if u[4] in seen else fallback) + 0.5 * (u[4] in compressing and u[4] not in seen)
        for u in single_units - finished
    )
    assert prompts > len({u[:4] for u in single_units - finished})  # the tiers prefill a trial more than once
    assert sum(s for s, _ in same) == pytest.approx(want)

    def multi_key(estimates):  # a kind of unit without finished cells: the model, as without rows
        return sum(s for job, s, m in estimates if job.task == "needle" and job.params["variant"] == "multi_key")

    assert multi_key(fresh) > 0 and multi_key(est) == pytest.approx(multi_key(fresh))
    assert len(unique) < sum(len(_units(cfg, j, cells)) for j in jobs)  # the tiers repeat cells: counted once
    # fresh=True: the whole suite again from an empty folder, priced from the same rows: the finished units count
    # again, at their policies' own seconds
    again = [(s, m) for job, s, m in estimate(cfg, rows=rows, fresh=True) if job.task == "needle"]
    again_single = sum(
        s for (s, m), job in zip(again, [j for j in jobs if j.task == "needle"]) if job.params["variant"] == "single"
    )
    fresh_prompts = _job_prompts(cfg, "single")
    again_want = want + decoding * sum(price[u[4]] for u in finished) + 0.5 * (fresh_prompts - prompts)
    assert again_single == pytest.approx(again_want)


def test_estimates_model_prices_captured_steps_at_their_own_rate_and_snapkv_prefills_only_with_sliding_layers(
    monkeypatch,
):
    """Without finished cells (the model): a config decoding statically prices its needle jobs at the captured
    step's rate (equal to the eager one's: equal prices; below it: cheaper), and SnapKV's cells add one prefill a
    batch per observation window only on a model with sliding-window layers (elsewhere they share the prefill), and
    one eager step a batch unless a kept slot (``reuse_graphs``) steps them statically from the first."""
    from evaluation import suite, suite_estimate
    from evaluation.suite_estimate import estimate

    cfg = {**_tiny_cfg("qwen2.5"), "one_pass": True}  # one tier: every job's units all its own

    def needles(c, **kw):
        return sum(s for j, s, m in estimate(c, **kw) if j.task == "needle")

    static = {**cfg, "static": True}
    assert needles(static, static_step_ms_per_layer=1.6) == pytest.approx(needles(cfg))
    assert needles(static) < needles(cfg)
    gemma = {**cfg, "model": "gemma3-270m"}
    without = needles(gemma)
    monkeypatch.setattr(suite_estimate, "SLIDING", frozenset())
    assert needles(gemma) < without
    layers, params = suite_estimate.SHAPES["gemma3-270m"]
    one_prefill = 2 * params * 2 * 640 / 150e12 + layers * 0.002  # a batch of 2 prompts of 640 tokens
    cells = cells_of(cfg)
    batches = sum(  # every needle job with a SnapKV cell: its batches of 2 (one observation window: 32)
        -(-int(suite._needle_params(cfg, j.params["variant"])["trials"]) // 2)
        for j in plan(cfg)
        if j.task == "needle" and any(c.policy.compresses for c in suite._select(cells, j))
    )
    assert batches > 0 and without - needles(gemma) == pytest.approx(batches * one_prefill)
    # on a kept slot (reuse_graphs) SnapKV's first step is static too: one eager step a batch less
    eager_firsts = sum(  # SnapKV cells times batches (of 2) of every needle job
        -(-int(suite._needle_params(cfg, j.params["variant"])["trials"]) // 2)
        * sum(c.policy.compresses for c in suite._select(cells, j) if c.budget is not None)
        for j in plan(cfg)
        if j.task == "needle"
    )
    step = suite_estimate.SHAPES[cfg["model"]][0] * 1.6 / 1000
    assert eager_firsts > batches
    assert needles(static) - needles({**static, "reuse_graphs": True}) == pytest.approx(eager_firsts * step)


def test_estimate_prices_needle_cells_from_those_decoded_the_way_the_config_decodes():
    """Finished cells decoded through captured steps and eagerly price a needle job each for the config that decodes
    that way: with ``static: true`` the static cells' seconds (SnapKV's too: it frees blocks once, then decodes
    statically), without it the eager ones; a policy with cells of the other way only is priced from them."""
    from evaluation.suite import _units
    from evaluation.suite_estimate import estimate

    cfg = _tiny_cfg("qwen2.5")
    cells = cells_of(cfg)
    single = next(j for j in plan(cfg) if j.task == "needle" and j.params["variant"] == "single")
    # every unit of the single-needle jobs of every tier, once (fresh=True prices them all)
    units = {u for j in plan(cfg) if j.task == "needle" and j.params == single.params for u in _units(cfg, j, cells)}
    first = [u for u in units if u[3] == 0]
    sec = {"static": 1.0, "eager": 5.0}

    def row(u, way):
        return {"task": "needle", "length": u[1], "variant": u[2], "trial": u[3], "policy": u[4], "budget": u[5],
                "seconds": sec[way] * (1 + (u[4] == "snapkv")), "decode": way}  # fmt: skip

    # trial 0 of every cell twice, once each way, and one more eager-only cell: TokenTopK's (priced from it either way)
    rows = [row(u, w) for u in first for w in ("static", "eager") if u[4] != "token_topk"]
    rows += [row(u, "eager") for u in first if u[4] == "token_topk"]

    def priced(static: bool) -> float:
        est = estimate({**cfg, "static": static}, rows=rows, fresh=True)
        return sum(s for job, s, m in est if job is not None and job.task == "needle" and job.params == single.params)

    expect = {  # TokenTopK has no static cell: its eager ones price it either way
        True: sum(2.0 if u[4] == "snapkv" else 5.0 if u[4] == "token_topk" else 1.0 for u in units),
        False: sum(10.0 if u[4] == "snapkv" else 5.0 for u in units),
    }
    assert priced(True) == pytest.approx(expect[True]) and priced(False) == pytest.approx(expect[False])


def test_estimate_counts_the_cpus_cells_as_done_and_prices_nothing_from_them():
    """Cells recorded on the CPU are done (not priced again) but do not price the GPU estimate: the same cells
    stamped with a GPU price their kind, stamped ``cpu`` leave it to the model."""
    from evaluation.suite import _units
    from evaluation.suite_estimate import estimate

    cfg = _tiny_cfg("qwen2.5")
    cells = cells_of(cfg)
    single = next(j for j in plan(cfg) if j.task == "needle" and j.params["variant"] == "single")
    rows = [
        {"task": "needle", "length": u[1], "variant": u[2], "trial": u[3], "policy": u[4], "budget": u[5],
         "seconds": 1000.0, "device": "cpu"}
        for u in _units(cfg, single, cells) if u[3] == 0
    ]  # fmt: skip

    def single_jobs(estimates):
        return [(s, m) for job, s, m in estimates if job.task == "needle" and job.params["variant"] == "single"]

    fresh, on_cpu = single_jobs(estimate(cfg)), single_jobs(estimate(cfg, rows=rows))
    gpu = single_jobs(estimate(cfg, rows=[dict(r, device="NVIDIA H200") for r in rows]))
    assert not any(m for _, m in on_cpu) and all(m for _, m in gpu)  # the CPU's seconds price nothing
    assert sum(s for s, _ in on_cpu) < sum(s for s, _ in fresh)  # their cells are done: fewer left to price
    assert sum(s for s, _ in gpu) > 100 * sum(s for s, _ in on_cpu)  # 1000 s a cell, had they been the GPU's


def test_estimate_adds_a_measured_prefill_to_a_compressing_policy_without_cells_of_its_own():
    """A policy that prefills on its own (SnapKV) with no finished cells of a kind is priced at the kind's median
    plus a prompt's share of the measured prefill; a policy that shares the prefill, at the kind's median."""
    from evaluation.suite import _units
    from evaluation.suite_estimate import estimate

    cfg = _tiny_cfg("qwen2.5")
    cells = cells_of(cfg)
    compressing = {c.label for c in cells if c.policy.compresses}
    assert compressing  # the suite's SnapKV rows
    jobs = [j for j in plan(cfg) if j.task == "needle" and j.params["variant"] == "single"]
    single = next(j for j in jobs if any(u[4] in compressing for u in _units(cfg, j, cells)))
    units = _units(cfg, single, cells)
    rows = [  # the first trial of the job's other policies finished, its SnapKV rows not
        {"task": "needle", "length": u[1], "variant": u[2], "trial": u[3], "policy": u[4], "budget": u[5],
         "seconds": 0.5, "batch": 2, "phases": {"build": 0.1, "prefill": 3.0, "decode": 0.4}}
        for u in units if u[3] == 0 and u[4] not in compressing
    ]  # fmt: skip
    finished = {("needle", r["length"], r["variant"], r["trial"], r["policy"], r["budget"]) for r in rows}
    earlier = {u for j in jobs[: jobs.index(single)] for u in _units(cfg, j, cells)}  # counted by an earlier tier
    left = [u for u in units if u not in finished and u not in earlier]
    # a cell: its share of the batch's decoding (0.4 of 3.5 s of phases); a prompt with cells left: its batch's
    # build and prefill (3.1 s for 2) once; SnapKV's cells: a prompt's share of a prefill (3.0 s for 2) more
    want = sum(0.5 * 0.4 / 3.5 + (3.0 / 2 if u[4] in compressing else 0.0) for u in left)
    want += 3.1 / 2 * len({u[:4] for u in left})
    est = [(s, m) for job, s, m in estimate(cfg, rows=rows) if job == single]
    assert est == [(pytest.approx(want), True)]
    assert any(u[4] in compressing for u in left) and any(u[4] not in compressing for u in left)


def test_estimate_adds_the_dense_pass_no_perplexity_row_carries():
    """A perplexity window reruns its dense pass before its policies (the KL's reference and, the simulate way, the
    shared session), timed in no row once the window's dense cell is done: the estimate adds the dense cell's median
    once per window with cells left and its dense cell not among them; the decode way decodes dense beside every
    batch, in no row: one more cell of the kind per window."""
    from evaluation.suite import _select, _units
    from evaluation.suite_estimate import estimate

    cfg = _tiny_cfg("qwen2.5")
    cells = cells_of(cfg)
    job = next(j for j in plan(cfg) if j.task == "perplexity" and "dense" in j.labels and len(j.labels) > 1)
    units = _units(cfg, job, cells)
    assert {u[-2] for u in units} > {"dense"} and len({u[2] for u in units}) >= 2
    w0 = units[0][2]
    rows = [  # window w0 finished for every cell, dense finished in every window
        {"task": "perplexity", "length": u[1], "window": u[2], "policy": u[3], "budget": u[4], "way": "simulate",
         "seconds": 3.0 if u[3] == "dense" else 1.0}
        for u in units if u[2] == w0 or u[3] == "dense"
    ]  # fmt: skip
    finished = {("perplexity", r["length"], r["window"], r["policy"], r["budget"]) for r in rows}
    left = [u for u in units if u not in finished]
    windows = {u[2] for u in left}
    assert windows and "dense" not in {u[3] for u in left}
    est = [(s, m) for j, s, m in estimate(cfg, rows=rows) if j == job]
    assert est == [(pytest.approx(len(left) * 1.0 + len(windows) * 3.0), True)]
    # the other windows' dense cells not finished: each window's dense pass is its own unit, priced once
    fewer = [r for r in rows if r["window"] == w0]
    done2 = {("perplexity", r["length"], r["window"], r["policy"], r["budget"]) for r in fewer}
    want2 = sum(3.0 if u[3] == "dense" else 1.0 for u in units if u not in done2)
    assert [(s, m) for j, s, m in estimate(cfg, rows=fewer) if j == job] == [(pytest.approx(want2), True)]

    # the decode way (SnapKV) decodes dense beside every batch and writes no dense row: one more cell per window
    snap = next(j for j in plan(cfg) if j.task == "perplexity" and any(c.policy.compresses for c in _select(cells, j)))
    units = _units(cfg, snap, cells)
    assert "dense" not in {u[3] for u in units}
    w0 = units[0][2]
    rows = [
        {"task": "perplexity", "length": u[1], "window": u[2], "policy": u[3], "budget": u[4], "way": "decode",
         "seconds": 2.0}
        for u in units if u[2] == w0
    ]  # fmt: skip
    left = [u for u in units if u[2] != w0]
    want = len(left) * 2.0 + len({u[2] for u in left}) * 2.0
    assert [(s, m) for j, s, m in estimate(cfg, rows=rows) if j == snap] == [(pytest.approx(want), True)]


def test_build_all_keeps_order_and_pairs():
    """Prompts built in threads come back in the order of their keys, each with its own record; the first key is
    built before any thread starts."""
    from evaluation.suite import _build_all

    seen = []

    def build(k):
        seen.append(k)
        time.sleep(0.01 * (5 - k))  # later keys finish first
        return (k, f"r{k}"), [k] * k

    records, prompts = _build_all(build, [0, 1, 2, 3, 4])
    assert records == [(k, f"r{k}") for k in range(5)] and prompts == [[k] * k for k in range(5)]
    assert seen[0] == 0 and sorted(seen) == list(range(5))
    assert _build_all(build, []) == ([], [])


def test_prefetched_builds_the_next_batch_while_the_caller_works():
    """Batches come back in order, each as :func:`_build_all` would build it; while the caller holds batch i, batch
    i + 1 is being built (its first key starts before the caller lets go); a build's error reaches the caller at its
    batch; closing the generator early leaves no thread behind."""
    import threading

    from evaluation.suite import _build_all, _prefetched

    started = {k: threading.Event() for k in range(7)}

    def build(k):
        started[k].set()
        if k == 6:
            raise ValueError("bad key 6")
        return (k, f"r{k}"), [k] * k

    batches = [[0, 1], [2, 3, 4], [5]]
    got = []
    for i, (records, prompts, waited) in enumerate(_prefetched(build, batches)):
        if i + 1 < len(batches):  # the next batch's first key is built while this one is held
            assert started[batches[i + 1][0]].wait(timeout=10)
        got.append((records, prompts))
        assert waited >= 0
    assert got == [_build_all(build, b) for b in batches]
    assert list(_prefetched(build, [])) == []
    gen = _prefetched(build, [[0], [6]])
    assert next(gen)[0] == [(0, "r0")]
    with pytest.raises(ValueError, match="bad key 6"):
        next(gen)
    before = threading.active_count()
    gen = _prefetched(build, [[0], [1], [2]])
    next(gen)
    gen.close()  # waits for the batch built ahead, then its thread ends
    assert threading.active_count() <= before


def test_estimate_command_prints_its_table_and_what_it_leaves_out(tmp_path, capsys):
    """``hf-sparse-kv suite MODEL --out DIR --estimate`` loads no model: one line per job of the plan, then the line
    saying what the figures leave out (the model's load and the first compiles)."""
    from evaluation.suite_cli import main
    from evaluation.suite_estimate import ESTIMATE_NOT_COUNTED

    main(["smollm2", "--out", str(tmp_path), "--estimate"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == ESTIMATE_NOT_COUNTED
    assert len(lines) > 1 and all(" min  (cumulative " in line for line in lines[:-1])
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_task_block_static_key_overrides_the_configs():
    """``static`` defaults to the config's key; a needle or QA block's own ``static`` wins over it."""
    assert _needle_params({"static": True, "needle": {}}, "single")["static"] is True
    assert _needle_params({"static": True, "needle": {"static": False}}, "multi_key")["static"] is False
    assert _needle_params({"needle": {"static": True}}, "single_start")["static"] is True
    assert _needle_params({}, "single")["static"] is False
    assert _qa_params({"static": True, "qa": {}})["static"] is True
    assert _qa_params({"static": True, "qa": {"static": False}})["static"] is False
    assert _qa_params({"qa": {"static": True}})["static"] is True


def test_static_decode_in_the_suite_gives_the_eager_answers(tmp_path):
    """``static: true`` (the config's, for needles and QA; a task's block may set its own) decodes through static
    steps: every cell's generated text is the eager run's, and each cell says how it was decoded (SnapKV, which frees
    blocks once, too: its first step eagerly, the others statically)."""
    cfg = _tiny_cfg("qwen2.5")
    cfg["perplexity"] = dict(cfg["perplexity"], windows=0)
    cfg["needle"] = dict(cfg["needle"], trials=2, hard={"variants": []}, start=None)
    cfg["qa"] = dict(cfg["qa"], tasks=["fact"])
    eager = _run_tiny(cfg, tmp_path / "eager")
    static = _run_tiny(dict(cfg, static=True), tmp_path / "static")  # the config's key reaches needles and QA

    def answers(rows):
        return {
            (r["task"], r.get("trial", r.get("item")), r["policy"], r["budget"]): r["generated"]
            for r in rows
            if r["task"] != "perplexity"
        }

    assert answers(static) == answers(eager) and len(answers(eager)) > 20
    assert {r["decode"] for r in eager if r["task"] != "perplexity"} == {"eager"}
    ways = {r["policy"]: r["decode"] for r in static if r["task"] != "perplexity"}
    assert ways["snapkv"] == ways["quest"] == ways["dense"] == ways["oracle"] == "static"


def test_a_suite_run_keeps_one_set_of_decode_slots_for_all_its_jobs(tmp_path, monkeypatch):
    """With ``static`` and ``reuse_graphs`` the run's needle and QA jobs share one ``DecodeSlots``: a job finds the
    slot of its batch size (and its captured steps) that an earlier job made, so fewer slots are made than jobs run;
    every answer is the eager run's."""
    from evaluation import suite as suite_module

    made = []

    class Recording(suite_module.DecodeSlots):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(suite_module, "DecodeSlots", Recording)
    cfg = _tiny_cfg("qwen2.5")
    cfg["perplexity"] = dict(cfg["perplexity"], windows=0)
    cfg["needle"] = dict(cfg["needle"], trials=2, start=None)
    cfg["qa"] = dict(cfg["qa"], tasks=["fact"], items=2)
    eager = _run_tiny(cfg, tmp_path / "eager")
    assert not made
    kept = _run_tiny(dict(cfg, static=True, reuse_graphs=True), tmp_path / "kept")
    jobs = {(r["task"], r.get("variant")) for r in kept}
    assert len(made) == 1 and len(jobs) >= 4 and made[0].slots_made < len(jobs)

    def answers(rows):
        return {(r["task"], r.get("variant"), r.get("trial", r.get("item")), r["policy"], r["budget"]): r["generated"]
                for r in rows}  # fmt: skip

    assert answers(kept) == answers(eager) and len(answers(eager)) > 40


def test_static_decode_way_perplexity_equals_the_eager_one(tmp_path, monkeypatch):
    """SnapKV's perplexity (the ``decode`` way) with ``static: true``: its first step eager (it frees the prompt's
    blocks), the others static steps, and dense beside it static throughout: the eager run's NLL and KL, each cell
    saying how it was decoded."""
    cfg = _tiny_cfg("qwen2.5")
    cfg["policies"] = [p for p in cfg["policies"] if p["name"] in ("dense", "snapkv")]
    cfg.update(decisive={"policies": ["dense"], "budgets": ["1/8"]}, qa=None)
    cfg["perplexity"] = dict(cfg["perplexity"], windows=2)
    cfg["needle"] = dict(cfg["needle"], trials=0, hard={"variants": []}, start=None)
    from hf_sparse_kv import graphs

    steps = []
    original = graphs.DecodeGraphs.step
    monkeypatch.setattr(graphs.DecodeGraphs, "step", lambda self, *a, **k: steps.append(1) or original(self, *a, **k))
    eager = _run_tiny(cfg, tmp_path / "eager")
    assert not steps
    static = _run_tiny(dict(cfg, static=True), tmp_path / "static")
    scored = cfg["perplexity"]["scored"]  # one batch of both windows: dense's steps, then each SnapKV cell's but one
    assert len(steps) == scored + 4 * (scored - 1)

    def decoded(rows):
        return {(r["window"], r["policy"], r["budget"]): r for r in rows if r.get("way") == "decode"}

    e, st = decoded(eager), decoded(static)
    assert e.keys() == st.keys() and len(e) == 2 * 2 * 2  # windows x budgets x two SnapKV specs
    assert {r["decode"] for r in e.values()} == {"eager"} and {r["decode"] for r in st.values()} == {"static"}
    for k, r in st.items():
        assert r["nll_sum"] == pytest.approx(e[k]["nll_sum"], rel=1e-5)
        assert r["kl_mean"] == pytest.approx(e[k]["kl_mean"], rel=1e-3, abs=1e-6)


def test_grid_tables_put_issue_12s_policies_against_length_and_budget():
    """The summary's grid: the known policies as rows in their order, (length, budget) columns large budgets first,
    Δppl with its interval, hits / trials with lost / gained, dense's own figure, ``·`` where a cell is missing, and
    neither a column without cells nor a policy outside the grid."""
    from evaluation.suite_summary import grid_tables

    def p(policy, length, budget, d=1.0):
        return {"policy": policy, "length": length, "budget": budget, "reuse": 1, "ppl": 10.0 * (1 + d / 100),
                "dppl_pct": d, "dppl_low": d - 0.5, "dppl_high": d + 0.5}  # fmt: skip

    ppl = [p("dense", 4096, "-", 0.0), p("quest", 4096, "1/16", 7.0), p("oracle", 4096, "1/8", 2.0),
           p("oracle", 4096, "1/16", 3.0), p("mass_c8", 4096, "1/16", 9.0)]  # fmt: skip

    def a(policy, budget, hits, lost=0, gained=0, length=4096):
        return {"variant": "single", "length": length, "policy": policy, "budget": budget, "trials": 10,
                "accuracy": hits / 10, "lost": lost, "gained": gained}  # fmt: skip

    needle = [a("dense", "-", 6), a("dense", "-", 6, length="all"), a("quest", "1/16", 3, 4, 1)]
    md = grid_tables(ppl, {"Needle": needle})
    lines = md.splitlines()
    head = next(line for line in lines if line.startswith("| policy | 4096"))
    assert head == "| policy | 4096 @ 1/8 | 4096 @ 1/16 |"  # 1/8 before 1/16, no dense column
    rows = [line for line in lines if line.startswith("| ") and not line.startswith(("| policy", "| ---"))]
    assert rows[:3] == [
        "| dense | 10 | 10 |",
        "| oracle | 2 [1.5, 2.5] | 3 [2.5, 3.5] |",
        "| quest | · | 7 [6.5, 7.5] |",
    ]
    assert not any("mass_c8" in line for line in lines)
    assert "| policy | 4096 @ 1/16 |" in md  # the needle table: only the budget measured, "all" left out
    assert "| dense | 6 / 10 |" in md and "| quest | 3 / 10 (4 / 1) |" in md
    assert grid_tables([], {"Needle": []}) == ""


def test_compressed_perplexity_simulated_equals_the_decode_way(tmp_path):
    """``perplexity: {compressed: simulate}``: SnapKV's cells scored in the simulate jobs beside the others (no
    trailing decode job), with the decode way's NLL and KL and no fidelity; another value is refused."""
    cfg = _tiny_cfg("qwen2.5")
    cfg["policies"] = [p for p in cfg["policies"] if p["name"] in ("dense", "quest", "snapkv")]
    cfg.update(decisive={"policies": ["dense"], "budgets": ["1/8"]}, qa=None, one_pass=True)
    cfg["perplexity"] = dict(cfg["perplexity"], windows=2)
    cfg["needle"] = dict(cfg["needle"], trials=0, hard={"variants": []}, start=None)
    sim = dict(cfg, perplexity=dict(cfg["perplexity"], compressed="simulate"))
    assert [j.labels for j in plan(cfg) if j.task == "perplexity"][-1] == ("dense", "snapkv", "snapkv1/4+quest")
    jobs = [j for j in plan(sim) if j.task == "perplexity"]
    assert len(jobs) == 1 and {"snapkv", "snapkv1/4+quest", "quest"} <= set(jobs[0].labels)
    decode = {
        (r["window"], r["policy"], r["budget"]): r for r in _run_tiny(cfg, tmp_path / "d") if r.get("way") == "decode"
    }
    rows = _run_tiny(sim, tmp_path / "s")
    assert not any(r.get("way") == "decode" for r in rows)
    simulated = {(r["window"], r["policy"], r["budget"]): r for r in rows if r["policy"].startswith("snapkv")}
    assert simulated.keys() == decode.keys() and len(decode) == 2 * 2 * 2  # windows x budgets x two SnapKV specs
    for k, r in simulated.items():
        assert r["way"] == "simulate" and r.get("recall") is None and r.get("hit_rate") is None
        assert r["nll_sum"] == pytest.approx(decode[k]["nll_sum"], rel=1e-5)
        assert r["kl_mean"] == pytest.approx(decode[k]["kl_mean"], rel=1e-3, abs=1e-6)
    quest = [r for r in rows if r["policy"] == "quest" and r["task"] == "perplexity"]
    assert quest and all(r.get("hit_rate") is not None for r in quest)  # the others keep their fidelity
    with pytest.raises(ValueError, match="compressed"):
        plan(dict(cfg, perplexity=dict(cfg["perplexity"], compressed="exact")))


def test_perplexity_windows_scored_together_give_each_window_its_own_cells(tmp_path):
    """``perplexity.simulate_batch``: consecutive windows with the same cells left are scored through one simulate
    session (SnapKV's freed blocks per window, fidelity per window): every window's NLL, KL, recall and hit rate are
    those it gets alone; a window whose cells differ (a resumed run) starts a batch of its own."""
    cfg = _tiny_cfg("qwen2.5")
    cfg["policies"] = [p for p in cfg["policies"] if p["name"] in ("dense", "quest", "oracle", "snapkv")]
    cfg.update(decisive={"policies": ["dense"], "budgets": ["1/8"]}, qa=None, one_pass=True)
    cfg["perplexity"] = dict(cfg["perplexity"], compressed="simulate")
    cfg["needle"] = dict(cfg["needle"], trials=0, hard={"variants": []}, start=None)
    alone = {(r["window"], r["policy"], r["budget"]): r for r in _run_tiny(cfg, tmp_path / "one")}
    sizes = []
    real = suite_module.SimulateSession

    def counted(model, ids, *a, **k):
        sizes.append(ids.shape[0])
        return real(model, ids, *a, **k)

    together = dict(cfg, perplexity=dict(cfg["perplexity"], simulate_batch={640: 2}))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(suite_module, "SimulateSession", counted)
        rows = {(r["window"], r["policy"], r["budget"]): r for r in _run_tiny(together, tmp_path / "two")}
        assert sizes == [2, 1]  # windows 0 and 1, then 2
        assert rows.keys() == alone.keys() and any(k[1] == "snapkv" for k in rows)
        # alone and together the model's matmuls see other batch shapes: float32 rounding apart (KL, a difference of
        # close log-probabilities, by ~1e-5 of itself on the CPU; on an H100 cuBLAS picks other kernels for the two
        # shapes: 6.5e-8 apart on a KL of 3.9e-5, 2026-12-06)
        kl_abs = 1e-8 if DEVICE.type == "cpu" else 2e-7
        tolerance = {"nll_sum": (1e-6, 0.0), "kl_mean": (1e-3, kl_abs), "recall": (1e-6, 0.0), "hit_rate": (1e-6, 0.0)}
        for k, r in rows.items():
            for field, (rel, abs_) in tolerance.items():
                want = alone[k].get(field)
                assert (r.get(field) is None) == (want is None), (k, field)
                if want is not None:
                    assert r[field] == pytest.approx(want, rel=rel, abs=abs_), (k, field)
        # resumed with window 0's cells done but Quest's: window 0 is a batch of its own, then windows 1 and 2
        lines = [json.loads(line) for line in (tmp_path / "two" / "cells.jsonl").read_text().splitlines()]
        keep = [r for r in lines if r["window"] == 0 and r["policy"] != "quest"]
        (tmp_path / "three").mkdir()
        (tmp_path / "three" / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in keep))
        del sizes[:]
        resumed = {(r["window"], r["policy"], r["budget"]): r for r in _run_tiny(together, tmp_path / "three")}
        assert sizes == [1, 2]
    assert resumed.keys() == alone.keys()
    for k, r in resumed.items():
        assert r["nll_sum"] == pytest.approx(alone[k]["nll_sum"], rel=1e-6), k
    # a policy that fits its state on the whole batch (centres fitted at the prefill): its windows one at a time
    pq = {"name": "top_p_block_topk", "label": "pq", "sink": 2, "window": 8, "candidates": 4, "p": 1.0}
    pq.update(coarse="pq", calibration="prefill")
    apart = dict(together, policies=together["policies"] + [pq])
    with pytest.MonkeyPatch.context() as m:
        m.setattr(suite_module, "SimulateSession", counted)
        del sizes[:]
        rows = _run_tiny(apart, tmp_path / "four")
    assert sizes == [1, 1, 1] and any(r["policy"] == "pq" for r in rows)


def test_a_dotted_override_sets_one_key_of_a_block():
    base = load_suite("smollm2")
    cfg = load_suite("smollm2", {"perplexity.compressed": "simulate", "one_pass": True})
    assert cfg["perplexity"] == {**base["perplexity"], "compressed": "simulate"} and cfg["one_pass"] is True
    assert "compressed" not in load_suite("smollm2")["perplexity"]  # the recipe itself is untouched
    assert load_suite("smollm2", {"qa.items": 5})["qa"] == {"items": 5}  # a block the recipe lacks (null) is made
    with pytest.raises(TypeError, match="block"):
        load_suite("smollm2", {"dtype.x": 1})
