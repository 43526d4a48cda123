"""The benchmarks' CPU dry runs of Triton kernels (``benchmarks/common.py: cpu_dry_run``): they run under Triton's
interpreter with the tests' fixes to it (``tests/interpreter_shims.py``), and without ``TRITON_INTERPRET`` they stop
with one clear line instead of failing inside Triton. Each runs in a fresh process (the variable is read when
``triton`` is imported). No speed is checked here."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], interpret: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, *args]
    return subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_dry_run_without_the_interpreter_stops_with_a_clear_line():
    out = _run(["benchmarks/check_quant_keys.py", "--device", "cpu", "--blocks", "16"], interpret=False)
    assert out.returncode != 0
    assert "TRITON_INTERPRET=1" in out.stderr.strip().splitlines()[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="bench_topk.py times the GPU when there is one")
def test_topk_dry_run_checks_and_writes_its_rows(tmp_path):
    """``bench_topk.py`` on the CPU: the kernel's indices checked against the reference (it raises otherwise), one
    row per shape written; this failed inside the interpreter under NumPy >= 2.4 before the shims were applied."""
    path = tmp_path / "topk.csv"
    out = _run(
        ["benchmarks/bench_topk.py", "--shapes", "2x100x8", "--no-sweep", "--rep", "1", "--out", str(path)],
        interpret=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = list(csv.DictReader(path.open()))
    assert [(r["R"], r["N"], r["k"]) for r in rows] == [("2", "100", "8")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="probe_pq.py times the GPU when there is one")
def test_pq_probe_dry_run_checks_its_variants_against_the_library(tmp_path):
    """``probe_pq.py --smoke`` on the CPU: every variant of the scoring kernel runs, the ones that must give the
    library's scores do (the script asserts it), the bf16 table within its rounding, and each row says how many of
    each query head's top 4/16 blocks it keeps (all of them where the scores are the library's)."""
    path = tmp_path / "probe.csv"
    out = _run(["benchmarks/probe_pq.py", "--device", "cpu", "--smoke", "--out", str(path)], interpret=True)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = list(csv.DictReader(path.open()))
    assert {r["what"] for r in rows} >= {"library", "copy", "bf16", "no_gather", "codes_first"}
    assert {r["shape"] for r in rows} == {"1x192", "2x80"}
    exact = [r for r in rows if r["what"] in ("library", "copy", "ca", "evict_last", "codes_cg", "codes_first")]
    assert len(exact) == 12 and all(float(r["top4_shared"]) == 1.0 and float(r["rel_err"]) < 1e-5 for r in exact)
    assert all(float(r["rel_err"]) < 2e-2 for r in rows if r["what"].startswith("bf16"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="check_pq.py times the GPU when there is one")
def test_pq_check_dry_run_finds_every_point_right(tmp_path):
    """``check_pq.py --smoke`` on the CPU: each grid point's scores against the float32 reference (relative error,
    the reference's top blocks shared, the ``+-inf`` pattern) written per shape, beside the rows it times: the
    prefill fit (the reference's assignment: the kernel's is too slow under the interpreter), ``pq_encode``'s kernel
    with its codes against the reference's."""
    path = tmp_path / "pq.csv"
    out = _run(["benchmarks/check_pq.py", "--device", "cpu", "--smoke", "--out", str(path)], interpret=True)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = list(csv.DictReader(path.open()))
    points = [r for r in rows if r["tpp"]]
    assert {r["shape"] for r in points} == {"1x192", "2x80"} and len(points) == 4
    assert all(float(r["rel_err"]) < 1e-5 and float(r["shared"]) == 1.0 and r["inf_ok"] == "True" for r in points)
    assert {"table", "quest scores + top-k 1/16", "pq scores + top-k 4/16"} <= {r["what"] for r in rows}
    assert {"pq_write, one token (Triton)", "pq_write, one token (reference)"} <= {r["what"] for r in rows}
    fits = [r for r in rows if r["what"] == "prefill fit, one layer (reference codes)"]
    assert len(fits) == 2 and all(float(r["us"]) > 0 for r in fits)
    encodes = [r for r in rows if r["what"].startswith("pq_encode")]
    assert len(encodes) == 2 and all(float(r["shared"]) >= 0.99 for r in encodes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="probe_fp8_keys.py times the GPU when there is one")
def test_fp8_keys_probe_dry_run_checks_every_configuration(tmp_path):
    """``probe_fp8_keys.py`` on the CPU: the fp8 scoring kernel at each dry-run configuration, and the library's at
    two, equal the float32 reference on the same fp8 keys (the script exits otherwise): within 2e-3 with the two-part
    query, within its 3-bit rounding with one part, the same ``-inf`` pattern and no NaN; one row per configuration
    and shape."""
    path = tmp_path / "fp8.csv"
    out = _run(["benchmarks/probe_fp8_keys.py", "--device", "cpu", "--out", str(path)], interpret=True)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = list(csv.DictReader(path.open()))
    probe = [r for r in rows if r["kernel"] == "probe"]
    assert {(r["shape"], r["BM"], r["two"]) for r in probe} == {
        (s, bm, two) for s in ("1x24", "2x9") for bm, two in (("4", "True"), ("8", "True"), ("8", "False"))
    }
    # the library's kernel at one tile a program and at two pipelined, checked against reference.fp8_block_lse
    library = {(r["shape"], r["BM"], r["tiles"], r["stages"]) for r in rows if r["kernel"] == "library"}
    assert library == {(s, "8", t, st) for s in ("1x24", "2x9") for t, st in (("1", "1"), ("2", "2"))}
    assert all(r["inf_ok"] == "True" and r["nan"] == "0" for r in rows)
    assert all(float(r["rel_err"]) < 2e-3 for r in rows if r["two"] == "True")
    assert all(float(r["shared"]) == 1.0 for r in rows if r["two"] == "True")


@pytest.mark.skipif(torch.cuda.is_available(), reason="probe_overlap.py times the GPU when there is one")
def test_overlap_probe_dry_run_times_its_chain():
    """``probe_overlap.py`` on the CPU: Quest's states as ``bench_decode.py`` builds them, the layer's chain (selection,
    attention, ``o_proj``) and the step's write run through the interpreter and are timed; the GPU-only variants (side
    streams, inline PTX prefetches) are skipped."""
    out = _run(["benchmarks/probe_overlap.py"], interpret=True)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("B=1 L=256:"))
    assert all(f"{name} " in line for name in ("mm", "attend", "chain", "write", "write+attend"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="probe_read_floor.py times the GPU when there is one")
def test_read_floor_probe_dry_run_checks_its_reads():
    """``probe_read_floor.py`` on the CPU: its bare reads (contiguous min / max, the selected K / V tiles through the
    block table) are checked against torch's sums of the same bytes before each row (it raises otherwise), and every
    row runs through the interpreter."""
    out = _run(["benchmarks/probe_read_floor.py"], interpret=True)
    assert out.returncode == 0, out.stderr[-2000:]
    names = ("read x2", "sum (torch)", "scores (library)", "topk (library)", "gather x1 splits", "attention (library)")
    assert all(f"  {name} " in out.stdout for name in names), out.stdout
