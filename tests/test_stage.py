"""Staging a file in parts for a machine without network: split, put, join, and the errors on a damaged part."""

import json
import os
import subprocess
import sys

import pytest

from evaluation.stage import StageError, commands, join, put, sha256_of, split

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _file(tmp_path, size=10_000):
    data = os.urandom(size)
    f = tmp_path / "model.gguf"
    f.write_bytes(data)
    return f, data


def test_split_put_join_round_trip(tmp_path):
    f, data = _file(tmp_path)
    m = split(f, "model.gguf", tmp_path / ".stage", part_bytes=4096)
    assert len(m.parts) == 3 and m.size == len(data) and m.sha256 == sha256_of(f)
    assert json.loads((tmp_path / ".stage" / "model.gguf" / "manifest.json").read_text())["sha256"] == m.sha256
    target = tmp_path / "device" / "model.gguf"
    for i, (p, digest) in enumerate(zip(m.parts, m.part_sha256), 1):
        put(tmp_path / p, target, i, digest)
    assert join(target, len(m.parts), m.sha256).read_bytes() == data
    assert (tmp_path / "device" / "model.gguf.ok").is_file() and not (tmp_path / "device" / "model.gguf.parts").exists()


def test_a_damaged_or_missing_part_is_named(tmp_path):
    f, _ = _file(tmp_path)
    m = split(f, "m", tmp_path / ".stage", part_bytes=4096)
    part2 = tmp_path / m.parts[1]
    part2.write_bytes(b"x" + part2.read_bytes()[1:])
    target = tmp_path / "device" / "m"
    with pytest.raises(StageError, match="part 02 .* is damaged"):
        put(part2, target, 2, m.part_sha256[1])
    put(tmp_path / m.parts[0], target, 1, m.part_sha256[0])
    with pytest.raises(StageError, match="parts missing .*02, 03"):
        join(target, 3, m.sha256)
    put(part2, target, 2)  # no digest given: accepted here, caught by the whole file's digest at the join
    put(tmp_path / m.parts[2], target, 3, m.part_sha256[2])
    with pytest.raises(StageError, match="has SHA-256 .* expected"):
        join(target, 3, m.sha256)
    assert not target.exists() and not (tmp_path / "device" / "m.ok").exists()
    (tmp_path / "device" / "m.parts" / "01").write_bytes(b"changed")
    with pytest.raises(StageError, match="part 01 .* changed since it was put"):
        join(target, 3, m.sha256)


def test_printed_commands_run_as_shell_commands(tmp_path):
    f, data = _file(tmp_path, 9000)
    stage = tmp_path / "repo" / ".stage"
    m = split(f, "w.bin", stage, part_bytes=4096)
    calls = commands(m, device_dir=str(tmp_path / "dev"), python=sys.executable)
    assert [c["carry"] for c in calls] == [[p] for p in m.parts] and "join" in calls[-1]["command"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    for c in calls:
        subprocess.run(c["command"], shell=True, check=True, cwd=tmp_path / "repo", env=env)
    assert (tmp_path / "dev" / "w.bin").read_bytes() == data
    again = subprocess.run(calls[0]["command"], check=False, shell=True, cwd=tmp_path / "repo", env=env)  # .ok: skipped
    assert again.returncode == 0
    bad = calls[0]["command"].replace(m.part_sha256[0], "0" * 64).replace(f"[ -f {tmp_path}/dev/w.bin.ok ] || ", "")
    out = subprocess.run(bad, check=False, shell=True, cwd=tmp_path / "repo", env=env, capture_output=True, text=True)
    assert out.returncode == 1 and "part 01" in out.stderr and "damaged" in out.stderr


def test_staged_assets_are_found_through_the_environment(tmp_path, monkeypatch):
    from evaluation.assets import ASSETS_ENV, STAGED, staged_path
    from evaluation.suite import suite_text

    monkeypatch.setenv(ASSETS_ENV, str(tmp_path))
    assert staged_path("qwen2.5-coder-1.5b") is None  # not staged: load_model would fetch from PyPI
    (tmp_path / STAGED["qwen2.5-coder-1.5b"]).write_bytes(b"GGUF")
    assert staged_path("qwen2.5-coder-1.5b") == (tmp_path, "qwen2.5-coder-1.5b.gguf")
    (tmp_path / "kjv.txt").write_text("In the beginning.", encoding="utf-8")
    assert suite_text("kjv") == "In the beginning."


def test_suite_call_carries_the_extras_and_runs_device_call():
    from evaluation.stage import suite_call

    call = suite_call("qwen2.5-coder-1.5b")
    assert call["carry"] == [".stage/extras"] and len(call["command"]) < 2000
    assert "HF_SPARSE_KV_ASSETS=/root/hfsk_assets" in call["command"]
    assert call["command"].endswith("bash recipes/device_call.sh qwen2.5 450")


def test_suite_call_resumes_outside_the_tree_and_returns_the_new_cells(tmp_path):
    """The call's bash, run twice on one machine: the first starts the device-side results from the tree's cells, the
    second keeps what the first wrote even though the tree's copy was reset in between, and each returns the cells
    the tree's file lacks (python3 stubbed out)."""
    import shutil

    from evaluation.stage import suite_call

    tree, dev, out, site = tmp_path / "tree", tmp_path / "dev", tmp_path / "out", tmp_path / "site"
    for d in (tree / "evaluation/results/suite_smollm2", tree / ".stage/extras", tree / "bin", tree / "recipes", out):
        d.mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "recipes", "device_call.sh"), tree / "recipes" / "device_call.sh")
    (tree / ".stage/extras/essays.txt").write_text("text", encoding="utf-8")
    # a stand-in for python3: pip does nothing, the suite appends a cell to --out, anything else fails
    stub = tree / "bin/python3"
    stub.write_text(
        '#!/usr/bin/env bash\n[ "$2" = pip ] && exit 0\n[ "$2" = evaluation.cli ] || exit 1\n'
        'while [ $# -gt 0 ] && [ "$1" != --out ]; do shift; done\necho run >> "$2/cells.jsonl"\n',
        encoding="utf-8",
    )
    stub.chmod(0o755)
    cmd = suite_call("smollm2", device_dir=str(dev))["command"]
    env = {"PATH": f"{tree / 'bin'}:/usr/bin:/bin", "OUT": str(out), "HF_SPARSE_KV_SITE": str(site)}
    for _ in range(2):
        (tree / "evaluation/results/suite_smollm2/cells.jsonl").write_text("tree\n", encoding="utf-8")  # the copy
        subprocess.run(["bash", "-c", cmd], cwd=tree, env=env, check=True, timeout=60)
    assert (dev / "results/suite_smollm2/cells.jsonl").read_text(encoding="utf-8") == "tree\nrun\nrun\n"
    assert (out / "cells_suite_smollm2.jsonl").read_text(encoding="utf-8") == "run\nrun\n"
    assert (dev / "essays.txt").read_text(encoding="utf-8") == "text"


def test_default_part_size_fits_beside_the_checkout(tmp_path):
    from evaluation.stage import CAP_MIB, MARGIN_MIB, PART_MIB, checkout_bytes, default_part_mib

    assert checkout_bytes(tmp_path) is None and default_part_mib(tmp_path) == PART_MIB  # not a git checkout
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("big/\n")
    (tmp_path / "small.txt").write_bytes(b"x" * 1000)
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "ignored.bin").write_bytes(b"0" * (3 << 20))  # ignored: not carried, not counted
    assert checkout_bytes(tmp_path) == 1000 + len("big/\n")
    assert default_part_mib(tmp_path) == PART_MIB  # a tiny checkout: the usual 56 MiB
    (tmp_path / "data.bin").write_bytes(b"1" * (20 << 20))  # untracked, not ignored: carried, counted
    assert default_part_mib(tmp_path) == CAP_MIB - MARGIN_MIB - 21  # 20 MiB + the small files, rounded up
    assert default_part_mib(tmp_path, cap_mib=24) == 1
    with pytest.raises(StageError, match="no room for a part"):
        default_part_mib(tmp_path, cap_mib=23)
