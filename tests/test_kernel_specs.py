"""evaluation.kernel_specs: recorded Triton specializations, read back, built ahead and found by a later launch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from evaluation import kernel_specs
from evaluation.kernel_specs import Prebuild, ahead, kernel, read_specs, record

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_specs_sm90.py")


def spec(name: str = "hf_sparse_kv.ops.triton.topk.topk_indices_kernel", key: str = "k1") -> str:
    return json.dumps({"name": name, "signature": {}, "key": key})


def post_compile(s: str):
    """Call Triton's post-compile hook as a first launch of a kernel would."""
    from triton import knobs

    return knobs.runtime.jit_post_compile_hook(
        key=s, repr="", fn=None, compile={"specialization_data": s}, is_manual_warmup=False, already_compiled=False
    )


def test_read_specs_keeps_the_first_of_each_in_order(tmp_path):
    p = tmp_path / "specs.jsonl"
    assert read_specs(p) == []  # no file yet
    a, b = spec(key="a"), spec(key="b")
    p.write_text(f"{a}\n\n{b}\n{a}\n")
    assert read_specs(p) == [a, b]


@pytest.mark.parametrize(
    "line, words",
    [
        ("not json", "not a Triton specialization"),
        ('{"key": 1}', "not a Triton specialization"),
        (spec("os.system"), "not one of"),
    ],
)
def test_read_specs_names_a_bad_line(tmp_path, line, words):
    p = tmp_path / "specs.jsonl"
    p.write_text(f"{spec()}\n{line}\n")
    with pytest.raises(ValueError, match=r"specs.jsonl:2: ") as e:
        read_specs(p)
    assert words in str(e.value)


def test_kernel_resolves_this_package_only():
    from hf_sparse_kv.ops.triton.topk import topk_indices_kernel

    assert kernel("hf_sparse_kv.ops.triton.topk.topk_indices_kernel") is topk_indices_kernel
    with pytest.raises(ValueError, match="not one of hf_sparse_kv's"):
        kernel("os.system")


def test_record_appends_new_specializations_of_this_package_and_restores_the_hook(tmp_path):
    from triton import knobs

    p = tmp_path / "sub" / "specs.jsonl"
    calls = []

    def before(**kw):
        calls.append(kw["key"])

    knobs.runtime.jit_post_compile_hook = before
    try:
        with record(p):
            post_compile(spec(key="a"))
            post_compile(spec(key="a"))  # a second process-first launch of the same one: written once
            post_compile(spec("triton.other.kernel", key="x"))  # another package's kernel: not written
        assert knobs.runtime.jit_post_compile_hook is before
        with record(p):
            post_compile(spec(key="a"))  # already in the file
            post_compile(spec(key="b"))
    finally:
        knobs.runtime.jit_post_compile_hook = None
    assert read_specs(p) == [spec(key="a"), spec(key="b")]
    assert len(p.read_text().splitlines()) == 2
    assert len(calls) == 5  # the hook set before is called for every launch


def test_ahead_does_nothing_without_a_path_or_where_nothing_compiles(tmp_path, monkeypatch):
    p = tmp_path / "specs.jsonl"
    p.write_text(spec() + "\n")
    with ahead(None) as pre:
        assert pre is None
    monkeypatch.setattr(kernel_specs, "builds_kernels", lambda: False)  # this CPU: the interpreter compiles nothing
    with ahead(p) as pre:
        assert pre is None
    assert read_specs(p) == [spec()]


def test_prebuild_needs_a_worker():
    with pytest.raises(ValueError, match="at least 1"):
        Prebuild([spec()], workers=0, target=("cuda", 90, 32))


def run_step(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)
    proc = subprocess.run(
        [sys.executable, SCRIPT, *args], check=False, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def entries(cache: Path) -> set[str]:
    return {p.name for p in cache.iterdir()} if cache.exists() else set()


def test_specializations_built_ahead_are_what_a_later_launch_finds(tmp_path):
    """Recorded while launching two ops (cache A), built ahead in two worker processes into an empty cache B: the same
    launches then add nothing to B (every kernel found built), where in an empty cache C they build (the control)."""
    specs = tmp_path / "specs.jsonl"
    run_step(tmp_path / "A", "record", str(specs))
    names = [json.loads(s)["name"] for s in read_specs(specs)]
    assert sorted(n.rsplit(".", 1)[1] for n in names) == ["paged_write_kernel", "topk_indices_kernel"], names
    out = run_step(tmp_path / "B", "prebuild", str(specs)).stdout
    assert re.search(r"2 of 2 built in \d+\.\d s", out), out
    built = entries(tmp_path / "B")
    assert len(built) >= 2
    run_step(tmp_path / "B", "launch")
    assert entries(tmp_path / "B") == built
    run_step(tmp_path / "C", "launch")
    assert len(entries(tmp_path / "C")) >= 2


def test_ahead_builds_the_file_and_records_what_is_new_within(tmp_path, monkeypatch):
    from triton import knobs

    p = tmp_path / "specs.jsonl"
    p.write_text(spec(key="a") + "\n")
    made = []

    class FakePrebuild:
        def __init__(self, specs, workers, target=None):
            made.append((specs, workers))
            self.closed = False

        def summary(self):
            return "1 of 1 built"

        def close(self):
            self.closed = True

    monkeypatch.setattr(kernel_specs, "builds_kernels", lambda: True)
    monkeypatch.setattr(kernel_specs, "Prebuild", FakePrebuild)
    lines = []
    with ahead(p, workers=3, log=lines.append) as pre:
        assert made == [([spec(key="a")], 3)]
        post_compile(spec(key="b"))
    assert pre.closed and knobs.runtime.jit_post_compile_hook is None
    assert read_specs(p) == [spec(key="a"), spec(key="b")]
    assert lines[0] == "[kernels] building 1 recorded specializations ahead in 3 processes"
    assert lines[1:] == ["[kernels] ahead: 1 of 1 built", f"[kernels] 1 new specializations recorded in {p}"]


def test_run_suite_builds_ahead_only_with_work_to_do(tmp_path, monkeypatch):
    """The suite hands its --kernel-specs file to :func:`ahead` around the model's load and the jobs; a finished
    suite, which loads nothing, does not."""
    from contextlib import contextmanager

    from evaluation import suite

    seen = []

    @contextmanager
    def fake(path, *a, **k):
        seen.append(path)
        yield None

    monkeypatch.setattr(suite, "ahead", fake)
    cfg = suite.load_suite("smollm2")
    specs = tmp_path / "specs.jsonl"
    status = suite.run_suite(
        cfg, tmp_path / "r", time_limit=0, model=torch.nn.Linear(1, 1), tokenizer=None, texts={}, kernel_specs=specs
    )
    assert not status["finished"] and seen == [specs]
    monkeypatch.setattr(suite, "remaining", lambda cfg, rows: (suite.plan(cfg), []))  # as if every job were done
    assert suite.run_suite(cfg, tmp_path / "r", kernel_specs=specs)["finished"] and seen == [specs, None]


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "recipes").glob("kernel_specs_*.jsonl")))
def test_recorded_specs_in_the_tree_fit_the_kernels(path):
    """Each specialization the tree keeps names a kernel that still exists, with the parameters it was recorded
    with (a renamed kernel or changed parameters: record the file again, or `preload` skips them)."""
    specs = read_specs(path)
    assert specs
    for s in specs:
        obj = json.loads(s)
        assert list(obj["signature"]) == kernel(obj["name"]).arg_names, obj["name"]


def test_summary_times_the_builds_not_the_run():
    """Once every build ended, the summary gives the time to the last one's end, not the time it is asked at (a run
    summarises at its end: 2026-12-06's grid said "1129.8 s" of builds that took ~17); pending builds say so."""
    from concurrent.futures import Future

    pre = kernel_specs.Prebuild.__new__(kernel_specs.Prebuild)
    pre.futures = [Future() for _ in range(3)]
    pre.t0, pre.ended = 100.0, []
    pre.futures[0].set_result(("a", 1.0, None))
    pre.ended.append(104.0)
    assert re.fullmatch(r"1 of 3 built, 2 pending after \d+\.\d s", pre.summary()), pre.summary()
    pre.futures[1].set_result(("b", 1.0, "ValueError: gone"))
    pre.futures[2].set_result(("c", 1.0, None))
    pre.ended += [112.5, 109.0]
    assert pre.summary() == "2 of 3 built (1 failed, first: ValueError: gone) in 12.5 s"
