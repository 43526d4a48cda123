"""Several suite processes on one folder (evaluation.suite_workers): each job claimed once, the workers' cells merged
into cells.jsonl, the same cells as one process writes, and a stopped run resumed."""

from __future__ import annotations

import json
import threading

import pytest
from test_assets_text import make_essays
from test_suite import _tiny_cfg
from tiny_models import tiny_model

from evaluation.suite import remaining, run_suite, run_workers
from evaluation.suite_cli import main as suite_main
from evaluation.suite_workers import JobClaims, merge_worker_cells, snapshot
from evaluation.sweep import ResultsDir
from evaluation.toy import CharTokenizer


def tiny_setup() -> dict:
    """What each worker process runs the suite with (spawned: picklable by name): the tiny Llama, character
    tokens, synthetic haystacks, as test_suite's runs."""
    texts = {"essays": make_essays(400), "kjv": make_essays(500)[5000:]}
    return {"model": tiny_model("llama", max_position_embeddings=1024), "tokenizer": CharTokenizer(), "texts": texts}


def _small_cfg() -> dict:
    """The tiny suite cut to perplexity and single needles for four policies: several jobs, seconds each."""
    cfg = _tiny_cfg("qwen2.5")
    keep = {"dense", "quest", "oracle", "sink_window"}
    cfg["policies"] = [p for p in cfg["policies"] if p.get("label", p["name"]) in keep]
    cfg["decisive"] = {"policies": ["dense", "oracle", "quest"], "budgets": ["1/8"]}
    cfg["needle"] = {**cfg["needle"], "hard": {}, "start": None}
    cfg["qa"] = None
    return cfg


def _keyed(rows: list[dict]) -> dict[tuple, dict]:
    fields = ("task", "length", "window", "variant", "trial", "policy", "budget")
    out = {}
    for r in rows:
        key = tuple(r.get(f) for f in fields)
        assert key not in out, f"cell written twice: {key}"
        out[key] = r
    return out


def test_claims_give_each_job_to_one_caller(tmp_path):
    a, b = JobClaims(tmp_path / "c"), JobClaims(tmp_path / "c")
    assert a(3) and not b(3) and not a(3) and b(4)
    won: list[int] = []

    def grab(claims):
        won.extend(i for i in range(200) if claims(i))

    threads = [threading.Thread(target=grab, args=(JobClaims(tmp_path / "d"),)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(won) == list(range(200))


def test_merge_appends_each_workers_complete_lines_and_removes_its_file(tmp_path):
    (tmp_path / "cells.jsonl").write_text('{"a": 0}\n')
    (tmp_path / "cells.w10.jsonl").write_text('{"a": 10}\n')
    (tmp_path / "cells.w1.jsonl").write_text('{"a": 1}\n{"a": 2}\n{"a": ')  # the last line cut by a kill
    assert merge_worker_cells(tmp_path) == 3
    assert [json.loads(line)["a"] for line in (tmp_path / "cells.jsonl").read_text().splitlines()] == [0, 1, 2, 10]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["cells.jsonl"]
    assert merge_worker_cells(tmp_path) == 0
    cell = {"task": "needle", "length": 64, "variant": "single", "trial": 0, "policy": "dense", "budget": "-"}
    with (tmp_path / "cells.jsonl").open("a") as f:
        f.write(json.dumps(cell) + '\n{"a": ')  # a cut last line
    (tmp_path / "cells.w0.jsonl").write_text(json.dumps({**cell, "x": 1}) + "\n" + json.dumps({**cell, "trial": 1}))
    before = (tmp_path / "cells.jsonl").read_text()
    assert snapshot(tmp_path, tmp_path / "copy.jsonl") == 1  # what the merge will write, the folder untouched
    assert (tmp_path / "cells.jsonl").read_text() == before and (tmp_path / "cells.w0.jsonl").exists()
    assert merge_worker_cells(tmp_path) == 1  # the cell already there is not written twice
    assert (tmp_path / "copy.jsonl").read_text() == (tmp_path / "cells.jsonl").read_text()
    rows = ResultsDir(tmp_path).rows()
    assert [r.get("trial") for r in rows] == [None, None, None, None, 0, 1] and "x" not in rows[-2]


def test_results_files_must_be_read_back(tmp_path):
    with pytest.raises(ValueError, match=r"cells\*\.jsonl"):
        ResultsDir(tmp_path, name="out.jsonl")


def test_two_workers_write_the_cells_one_process_writes(tmp_path):
    cfg = _small_cfg()
    one = tmp_path / "one"
    assert run_suite(cfg, one, **tiny_setup())["finished"]
    ref = _keyed(ResultsDir(one).rows())

    two = tmp_path / "two"
    status = run_workers(cfg, two, None, 2, setup=tiny_setup)
    assert status["finished"] and status["exitcodes"] == [0, 0] and status["jobs_done"] == status["jobs"]
    assert sorted(f.name for f in two.glob("cells*.jsonl")) == ["cells.jsonl"]
    got = _keyed(ResultsDir(two).rows())
    assert got.keys() == ref.keys()
    for key, r in ref.items():
        if r["task"] == "perplexity":
            assert got[key]["nll_sum"] == pytest.approx(r["nll_sum"], rel=1e-5)
        else:
            assert got[key]["generated"] == r["generated"]


def test_workers_resume_a_stopped_folder_and_stop_at_the_time_limit(tmp_path):
    cfg = _small_cfg()
    jobs, _ = remaining(cfg, [])
    claims = JobClaims(tmp_path / "claims")
    claims(len(jobs) - 1)  # another process holds the last job (the 1/4 needles): this one runs the rest
    part = run_suite(cfg, tmp_path / "r", **tiny_setup(), claim=claims, cells_file="cells.w0.jsonl")
    assert part["jobs_done"] == len(jobs) - 1 and not (tmp_path / "r" / "cells.jsonl").exists()
    _, todo = remaining(cfg, ResultsDir(tmp_path / "r").rows())
    assert todo == [jobs[-1]]  # the worker's file counts as done
    stopped = run_workers(cfg, tmp_path / "r", 0, 2, setup=tiny_setup)  # a limit already passed: no new job
    assert not stopped["finished"] and stopped["jobs_done"] == len(jobs) - 1
    assert sorted(f.name for f in (tmp_path / "r").glob("cells*.jsonl")) == ["cells.jsonl"]  # merged
    done = run_workers(cfg, tmp_path / "r", None, 2, setup=tiny_setup)
    assert done["finished"]


def test_workers_flag_refuses_a_count_below_one(tmp_path, capsys):
    with pytest.raises(SystemExit):
        suite_main(["smollm2", "--out", str(tmp_path), "--workers", "0"])
    assert "positive" in capsys.readouterr().err
    with pytest.raises(ValueError, match="positive int"):
        run_workers(_small_cfg(), tmp_path, None, 0)


def test_a_folder_refuses_perplexity_windows_other_than_its_cells(tmp_path):
    """Window w of n starts where n puts it: cells of 4 windows are not those of 16 under the same index."""
    cfg = _small_cfg()  # 3 windows x 16 scored tokens
    older = tmp_path / "older"  # a folder from before the record: its cells' window indices decide
    older.mkdir()
    row = {"task": "perplexity", "length": 640, "window": 5, "policy": "dense", "budget": "-", "nll_sum": 1.0}
    (older / "cells.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="up to window 5"):
        run_suite(cfg, older, **tiny_setup())
    assert sorted(f.name for f in older.iterdir()) == ["cells.jsonl"]  # nothing written
    out = tmp_path / "r"
    assert run_suite(cfg, out, **tiny_setup())["finished"]
    assert json.loads((out / "perplexity.json").read_text()) == {"windows": 3, "scored": 16}
    for change in ({"windows": 4}, {"scored": 8}):
        other = {**cfg, "perplexity": {**cfg["perplexity"], **change}}
        with pytest.raises(ValueError, match="another --out"):
            run_suite(other, out, **tiny_setup())
        with pytest.raises(ValueError, match="another --out"):
            run_workers(other, out, None, 2, setup=tiny_setup)
    no_ppl = {**cfg, "perplexity": {"windows": 0}}  # leaving perplexity out is always fine
    assert run_suite(no_ppl, out, **tiny_setup())["finished"]
