"""benchmarks/bench_linear.py runs on the CPU at a tiny shape (a dry run of the GPU command, Triton's interpreter):
rows for cuBLAS, the sweep and ``linear.choose``'s configuration per projection and batch, the one-token variant only
at B = 1; and probe_linear_e2e.py reads the sweep's fastest tile per shape, cuBLAS unless a tile wins by 3 %. No
speed is checked here."""

import csv
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_linear
import probe_linear_e2e

from hf_sparse_kv.ops.triton import linear


@pytest.mark.skipif(
    not os.environ.get("TRITON_INTERPRET"),
    reason="a CPU dry run through Triton's interpreter (conftest sets it without CUDA)",
)
def test_dry_run_writes_a_row_per_configuration_and_the_rules_choice(monkeypatch, tmp_path):
    out = tmp_path / "l.csv"
    argv = ["bench_linear.py", "--device", "cpu", "--tiny", "--layers", "1", "--rep", "1", "--batches", "1,2"]
    monkeypatch.setattr(sys, "argv", [*argv, "--configs", "32,128,2,2;8,128,2,2,sum", "--out", str(out)])
    bench_linear.main()
    with open(out) as f:
        rows = list(csv.DictReader(f))
    projections = list(bench_linear.PROJECTIONS)
    for B in ("1", "2"):
        for name in projections:
            pick = {r["row"] + ":" + r["config"] for r in rows if r["B"] == B and r["proj"] == name}
            o, i = (d // 32 for d in bench_linear.PROJECTIONS[name])
            shipped = ",".join(map(str, linear.choose(o, i, int(B))))  # the tiny shapes: the rule picks a tile
            tried = {"triton:32,128,2,2"} | ({"triton:8,128,2,2,sum"} if B == "1" else set())
            assert pick == {"cublas:", f"default:{shipped}"} | tried
    assert all(float(r["rel_err"]) <= 1e-2 for r in rows)


def test_the_probe_takes_a_tile_only_where_it_beats_cublas_by_3_percent(tmp_path):
    path = tmp_path / "sweep.csv"
    cols = ["B", "proj", "row", "us_per_layer", "config"]
    rows = [
        (1, "o", "cublas", 15.0, ""),
        (1, "o", "triton", 14.0, "4,512,4,2,sum"),
        (1, "o", "triton", 14.5, "32,256,4,4"),
        (1, "gate_up", "cublas", 77.0, ""),
        (1, "gate_up", "triton", 76.0, "4,512,4,2,sum"),  # 1.3 % faster: not enough
    ]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        w.writerows(rows)
    table = probe_linear_e2e.tiles(str(path))
    assert table == {(4096, 4096, 1): (4, 512, 4, 2, "sum"), (28672, 4096, 1): None}
