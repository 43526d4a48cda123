"""The device-session scripts of recipes/: every part of ``suite_gaps.sh`` is a suite the runner can plan (its
``--set`` overrides parse, its policies build, its decisive labels are its policies' labels), and ``suite_chain.sh``
runs parts in order within its time, passing the shared arguments on."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from evaluation.suite import cells_of, load_suite, plan

ROOT = Path(__file__).resolve().parents[1]
GAPS = ROOT / "recipes" / "suite_gaps.sh"
WILDCARD_MODEL = {
    "reuse_*": "reuse_qwen2.5",
    "moments_*": "moments_gemma3",
    "progressive_*": "progressive_qwen2.5",
    "pq_exact_*": "pq_exact_gemma3",
    "pq_wide_*": "pq_wide_qwen2.5",
    "pq_lib_*": "pq_lib_gemma3",
    "pq_fit_*": "pq_fit_smollm2",
    "pq_bf16_*": "pq_bf16_gemma3",
    "pq16_*": "pq16_qwen2.5",
    "pq_*": "pq_smollm2",
    "fp8_*": "fp8_qwen2.5",
}


def _parts() -> list[str]:
    names = re.findall(r"^  ([a-z0-9_.*]+)\)", GAPS.read_text(), flags=re.MULTILINE)
    return [WILDCARD_MODEL.get(n, n) for n in names if n != "*"]  # "*": the unknown-part branch


def _recorder(tmp_path: Path) -> Path:
    """A stand-in for ``python3`` that writes its arguments, one per line, to ``$ARGS_OUT``."""
    fake = tmp_path / "fake_python"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$ARGS_OUT"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return fake


def test_the_gaps_script_has_parts():
    assert len(_parts()) >= 10 and "qwen_rest_1_16" in _parts()


@pytest.mark.parametrize("part", _parts())
def test_every_gaps_part_plans_a_suite(tmp_path, part):
    out = tmp_path / "args.txt"
    assets = tmp_path / "assets"  # a part that calibrates first finds its calibration there (a stand-in)
    assets.mkdir()
    torch.save({"method": "pq", "centres": {1: torch.zeros(1, 2, 4, 4)}}, assets / f"pq_{part.split('_')[-1]}.pt")
    env = {**os.environ, "PY": str(_recorder(tmp_path)), "ARGS_OUT": str(out), "HF_SPARSE_KV_ASSETS": str(assets)}
    subprocess.run(["bash", str(GAPS), str(tmp_path / "res"), part, "77"], check=True, env=env, cwd=ROOT)
    args = out.read_text().splitlines()
    assert args[:4] == ["-m", "evaluation.cli", "suite", args[3]] and args[-2:] == ["--time-limit", "77"]
    assert args[args.index("--out") + 1] == str(tmp_path / "res")
    overrides = {}
    for i, a in enumerate(args):
        if a == "--set":
            key, _, value = args[i + 1].partition("=")
            overrides[key] = yaml.safe_load(value)
    cfg = load_suite(args[3], overrides)
    labels = {c.label for c in cells_of(cfg)}  # builds every policy of the part
    assert set(cfg["decisive"]["policies"]) <= labels, "a decisive label that names no policy of the part"
    assert plan(cfg)


def test_the_pq_lib_part_calibrates_once_then_runs_its_suite(tmp_path):
    """``pq_lib_<model>`` writes the model's pq calibration on the KJV (the longest length's tokens) into the assets
    folder when it is not there yet, then runs the suite with it; a second run finds it and only runs the suite."""
    log, assets = tmp_path / "calls.txt", tmp_path / "assets"
    assets.mkdir()
    fake = tmp_path / "fake_python"
    fake.write_text('#!/usr/bin/env bash\necho "$@" >> "$ARGS_OUT"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PY": str(fake), "ARGS_OUT": str(log), "HF_SPARSE_KV_ASSETS": str(assets)}
    run = ["bash", str(GAPS), str(tmp_path / "res"), "pq_lib_qwen2.5", "77"]
    subprocess.run(run, check=True, env=env, cwd=ROOT)
    calls = log.read_text().splitlines()
    cal = assets / "pq_qwen2.5.pt"
    assert len(calls) == 2 and calls[0].startswith("-m evaluation.cli calibrate-selector --model qwen2.5-coder-1.5b")
    assert f"--method pq --text {assets}/kjv.txt --tokens 32768 --out {cal}" in calls[0]
    assert calls[1].startswith("-m evaluation.cli suite qwen2.5") and f'calibration: "{cal}"' in calls[1]
    cal.write_bytes(b"")  # there now: not calibrated again
    log.unlink()
    subprocess.run(run, check=True, env=env, cwd=ROOT)
    calls = log.read_text().splitlines()
    assert len(calls) == 1 and calls[0].startswith("-m evaluation.cli suite qwen2.5")


def test_suite_chain_runs_parts_in_order_within_its_time(tmp_path):
    shutil.copy(ROOT / "recipes" / "suite_chain.sh", tmp_path / "suite_chain.sh")
    log = tmp_path / "calls.txt"
    (tmp_path / "suite_gaps.sh").write_text(f'#!/usr/bin/env bash\necho "$@" >> {log}\n')
    run = ["bash", str(tmp_path / "suite_chain.sh"), "RES", "400", "a", "b", "--", "--set", "static=true"]
    out = subprocess.run(run, check=True, capture_output=True, text=True).stdout
    calls = [line.split() for line in log.read_text().splitlines()]
    assert [c[:2] for c in calls] == [["RES", "a"], ["RES", "b"]]
    assert all(c[3:] == ["--set", "static=true"] for c in calls)
    assert 330 <= int(calls[1][2]) <= int(calls[0][2]) <= 340  # the time left, less a minute
    assert "== a:" in out and "== b:" in out
    log.unlink()
    out = subprocess.run(["bash", str(tmp_path / "suite_chain.sh"), "RES", "100", "a"], check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    assert "== a skipped" in out and not log.exists()


def _device_call_env(tmp_path, fake_body: str, **extra: str) -> tuple[dict, Path, Path]:
    """A fake python (``fake_body``: its bash after the shebang) and the folders ``device_call.sh`` reads and writes
    under ``tmp_path`` (the extras with both texts, the gguf wheel counted as installed): (the environment, the
    assets folder, ``$OUT``)."""
    fake = tmp_path / "fake_python"
    fake.write_text("#!/usr/bin/env bash\n" + fake_body)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    extras, site, assets, out = (tmp_path / n for n in ("extras", "site", "assets", "out"))
    extras.mkdir()
    (extras / "essays.txt").write_text("e")
    (extras / "kjv.txt").write_text("k")
    (site / "gguf").mkdir(parents=True)
    env = {
        **os.environ, "PY": str(fake), "OUT": str(out), "HF_SPARSE_KV_ASSETS": str(assets),
        "HF_SPARSE_KV_EXTRAS": str(extras), "HF_SPARSE_KV_SITE": str(site), **extra,
    }  # fmt: skip
    return env, assets, out


def test_device_call_brings_many_new_cells_back_in_parts_of_whole_lines(tmp_path):
    """Past ``HF_SPARSE_KV_PART_BYTES`` the new cells come back as ``.part00``, ``.part01``, ... of whole lines,
    each within the limit, together the cells in order (a call brings back files of at most 16 MiB); a later call
    with fewer new cells writes one file again and no stale part."""
    env, assets, out = _device_call_env(  # the fake adds N cells of ~40 bytes to the --out folder
        tmp_path,
        'while [ $# -gt 0 ]; do [ "$1" = "--out" ] && for i in $(seq 1 "$N"); do '
        'echo "{\\"cell\\": $i, \\"pad\\": \\"xxxxxxxx\\"}" >> "$2/cells.jsonl"; done; shift; done\n',
        N="20",
        HF_SPARSE_KV_PART_BYTES="200",
    )
    script = str(ROOT / "recipes" / "device_call.sh")
    seed = set((ROOT / "evaluation/results/suite_gemma3/cells.jsonl").read_text().splitlines())
    subprocess.run(["bash", script, "gemma3", "300"], check=True, env=env, cwd=ROOT)
    parts = sorted(out.glob("cells_suite_gemma3.jsonl.part*"))
    assert len(parts) > 2 and not (out / "cells_suite_gemma3.jsonl").exists()
    assert all(p.stat().st_size <= 200 and p.read_text().endswith("\n") for p in parts)
    lines = "".join(p.read_text() for p in parts).splitlines()
    assert [json.loads(x)["cell"] for x in lines] == list(range(1, 21)) and not seed & set(lines)
    (assets / "results" / "suite_gemma3" / "cells.jsonl").write_text("")  # a later call: few new cells
    subprocess.run(["bash", script, "gemma3", "300"], check=True, env={**env, "N": "2"}, cwd=ROOT)
    assert not list(out.glob("cells_suite_gemma3.jsonl.part*"))
    assert [json.loads(x)["cell"] for x in (out / "cells_suite_gemma3.jsonl").read_text().splitlines()] == [1, 2]


def test_device_call_seeds_once_runs_the_suite_and_brings_the_new_cells_back(tmp_path):
    """``device_call.sh``: the assets in place, the results folder seeded from the tree's cells once (a second call
    keeps what the first wrote), the suite (or the parts, through the chain) pointed at it, and in ``$OUT`` the cells
    the tree's file lacks (the whole file outgrew what a call brings back)."""
    args = tmp_path / "args.txt"
    env, assets, out = _device_call_env(  # the fake records its arguments and adds one cell to the --out folder
        tmp_path,
        'printf "%s\\n" "$@" >> "$ARGS_OUT"\n'
        'while [ $# -gt 0 ]; do [ "$1" = "--out" ] && echo \'{"new": 1}\' >> "$2/cells.jsonl"; shift; done\n',
        ARGS_OUT=str(args),
    )
    script = str(ROOT / "recipes" / "device_call.sh")
    subprocess.run(["bash", script, "gemma3", "300", "--", "--set", "x=1"], check=True, env=env, cwd=ROOT)
    res = assets / "results" / "suite_gemma3"
    called = args.read_text().splitlines()
    assert called == [
        "-m",
        "evaluation.cli",
        "suite",
        "gemma3",
        "--out",
        str(res),
        "--time-limit",
        "300",
        "--set",
        "x=1",
    ]
    assert (assets / "kjv.txt").read_text() == "k" and (out / "log_suite_gemma3.txt").exists()
    assert (out / "cells_suite_gemma3.jsonl").read_text() == '{"new": 1}\n'
    assert (res / "cells.jsonl").stat().st_size > 1000  # seeded: the tree's cells are there, only not sent back
    args.unlink()
    subprocess.run(["bash", script, "gemma3", "300", "gemma_grid"], check=True, env=env, cwd=ROOT)
    called = args.read_text().splitlines()
    assert called[:4] == ["-m", "evaluation.cli", "suite", "gemma3"] and called[called.index("--out") + 1] == str(res)
    assert (out / "cells_suite_gemma3.jsonl").read_text() == '{"new": 1}\n' * 2  # not seeded again


def test_device_call_records_kernel_specs_in_the_assets_and_brings_them_back(tmp_path):
    """The suite gets ``$HF_SPARSE_KV_KERNEL_SPECS`` (default: a file in the assets folder, kept across calls) and
    the call brings the file back in ``$OUT``."""
    env, assets, out = _device_call_env(  # the fake appends a line to the file the suite was pointed at
        tmp_path, 'echo "{\\"name\\": \\"hf_sparse_kv.k\\"}" >> "$HF_SPARSE_KV_KERNEL_SPECS"\n'
    )
    script = str(ROOT / "recipes" / "device_call.sh")
    subprocess.run(["bash", script, "gemma3", "300"], check=True, env=env, cwd=ROOT)
    subprocess.run(["bash", script, "gemma3", "300"], check=True, env=env, cwd=ROOT)
    kept = assets / "kernel_specs_gemma3.jsonl"
    assert kept.read_text() == '{"name": "hf_sparse_kv.k"}\n' * 2
    assert (out / "kernel_specs_gemma3.jsonl").read_text() == kept.read_text()


def test_device_call_detached_runs_one_suite_across_calls(tmp_path):
    """``HF_SPARSE_KV_DETACH=TOTAL``: the first call starts the suite in its own process session with TOTAL as its
    time limit and returns after its SECONDS while the suite runs on (status 0, "still running"); the next call finds
    it and waits instead of starting another, and returns the run's status and every cell; a run that ended between
    two calls is reported by the next one, which starts none; after that the next call starts afresh."""
    starts, go = tmp_path / "starts.txt", tmp_path / "go"
    env, assets, out = _device_call_env(  # the fake writes 2 cells, waits for $GO, writes 2 more, exits with status 3
        tmp_path,
        'while [ $# -gt 0 ]; do [ "$1" = "--out" ] && O=$2; [ "$1" = "--time-limit" ] && L=$2; shift; done\n'
        'echo "$L" >> "$STARTS"\n'
        'for i in 1 2 3 4; do [ $i = 3 ] && while [ ! -e "$GO" ]; do sleep 0.1; done\n'
        '  echo "{\\"cell\\": $i}" >> "$O/cells.jsonl"; done\n'
        "exit 3\n",
        STARTS=str(starts), GO=str(go), HF_SPARSE_KV_DETACH="900", HF_SPARSE_KV_COPY_EVERY="1",
    )  # fmt: skip
    script = str(ROOT / "recipes" / "device_call.sh")
    seed = set((ROOT / "evaluation/results/suite_gemma3/cells.jsonl").read_text().splitlines())
    run_dir = assets / "results" / "suite_gemma3.run"
    argv = ["bash", script, "gemma3"]

    def call(seconds: str) -> subprocess.CompletedProcess:
        return subprocess.run([*argv, seconds], check=False, env=env, cwd=ROOT, capture_output=True, text=True)

    def cells() -> list[int]:
        lines = (out / "cells_suite_gemma3.jsonl").read_text().splitlines()
        assert not seed & set(lines)
        return [json.loads(x)["cell"] for x in lines]

    def ended() -> None:  # or ended and collected by the call that started it
        for _ in range(300):
            if (run_dir / "rc").exists() or not run_dir.exists():
                return
            time.sleep(0.1)
        raise AssertionError("the detached run did not end")

    first = call("1")  # the run waits for $GO: still running when the call returns
    assert first.returncode == 0 and "still running" in first.stdout
    assert starts.read_text().split() == ["900"] and (run_dir / "pid").exists() and not (run_dir / "rc").exists()
    assert cells() == [1, 2]
    plain = {k: v for k, v in env.items() if k != "HF_SPARSE_KV_DETACH"}  # a call that would start a second suite
    refused = subprocess.run([*argv, "5"], check=False, env=plain, cwd=ROOT, capture_output=True, text=True)
    assert refused.returncode == 75 and "is still running" in refused.stdout
    assert starts.read_text().split() == ["900"]
    second = subprocess.Popen([*argv, "60"], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    time.sleep(1)
    go.touch()  # the run goes on while the second call waits for it
    said, _ = second.communicate(timeout=60)
    assert second.returncode == 3 and "ended with status 3" in said
    assert cells() == [1, 2, 3, 4] and starts.read_text().split() == ["900"] and not run_dir.exists()

    (assets / "results" / "suite_gemma3" / "cells.jsonl").write_text("")
    go.unlink()
    assert call("0").returncode == 0 and starts.read_text().split() == ["900", "900"]  # afresh
    go.touch()
    ended()  # between two calls
    later = call("60")
    assert later.returncode == 3 and cells() == [1, 2, 3, 4] and starts.read_text().split() == ["900", "900"]
    call("0")  # seen ended: the next call starts afresh
    assert len(starts.read_text().split()) == 3
    ended()


def test_profile_levers_runs_its_six_parts_and_goes_on_after_a_failure(tmp_path):
    """``profile_levers.sh``: six ``profile_grid.py`` runs (the batch and stacked prefills, twice the batch stacked,
    one and several perplexity windows, the stacked one again with whole refills of the kept slot), each with its CSV under ``$OUT`` and its section of one log (a device call
    brings back at most eight files); a part that fails (as an out-of-memory batch would) says so in its section and
    the others still run. The runs are stood in for by a python that
    records its arguments (``profile_grid``'s options themselves: tests/test_profile_grid.py)."""
    log = tmp_path / "calls.txt"
    fake = tmp_path / "fake_python"
    fake.write_text(f'#!/usr/bin/env bash\necho "$@" >> {log}\n[[ " $* " == *" --windows 4 "* ]] && exit 3\nexit 0\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PY": str(fake)}
    script = str(ROOT / "recipes" / "profile_levers.sh")
    subprocess.run(["bash", script, "qwen2.5", "32768", "8192", "8", "4", "60", "--x"], check=True, env=env, cwd=ROOT,
                   capture_output=True)  # fmt: skip
    calls = [line.split() for line in log.read_text().splitlines()]
    assert len(calls) == 6 and all(c[0] == "benchmarks/profile_grid.py" and c[-1] == "--x" for c in calls)
    opts = [
        {a: (b if not b.startswith("--") else True) for a, b in zip(c[1:], [*c[2:], "--"]) if a.startswith("--")}
        for c in calls
    ]  # option -> its value (True for a flag)
    assert [o.get("--prefill") for o in opts] == ["batch", "rows", "rows", None, None, "rows"]
    assert [o.get("--batch") for o in opts[:3]] == ["8", "8", "16"] and [o["--windows"] for o in opts[3:5]] == [
        "1",
        "4",
    ]
    assert {o["--length"] for o in opts[:3] + opts[5:]} == {"32768"} and {o["--length"] for o in opts[3:5]} == {"8192"}
    assert [bool(o.get("--whole-refills")) for o in opts] == [False] * 5 + [True] and opts[5]["--batch"] == "8"
    names = ["batch", "rows", "rows_x2", "ppl_w1", "ppl_w4", "rows_whole"]
    assert [Path(o["--out"]).name for o in opts] == [f"levers_{n}.csv" for n in names]
    parts = (tmp_path / "out" / "levers.txt").read_text().split("== part ")[1:]  # one log, a section per part
    texts = {part.split("\n", 1)[0]: part for part in parts}
    assert list(texts) == names and sorted(p.name for p in (tmp_path / "out").iterdir()) == ["levers.txt"]
    assert "ended with status 3" in texts["ppl_w4"] and not any("ended" in texts[n] for n in names if n != "ppl_w4")
