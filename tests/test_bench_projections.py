"""benchmarks/bench_projections.py runs on the CPU at a tiny shape (a dry run of the GPU command): every row at each
batch, the merged outputs equal to the separate projections', the weights' bytes of each row, the saving paired with
the right row. No speed is checked here."""

import csv
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_projections as bp


def test_merged_outputs_are_the_separate_projections():
    g = torch.Generator().manual_seed(0)
    w = bp.layer_weights(bp.shapes(tiny=True), "cpu", g)
    x = torch.randn(3, w["q"].shape[1], generator=g).to(torch.bfloat16)
    qkv = bp.merged(x, w, "qkv")
    assert [t.shape[-1] for t in qkv] == [w[n].shape[0] for n in ("q", "k", "v")]
    for a, b in zip(qkv + bp.merged(x, w, "gate_up"), bp.separate(x, w, ("q", "k", "v", "gate", "up"))):
        torch.testing.assert_close(a, b)
    assert bp.check(x, w) < 1e-2


def test_dry_run_writes_every_row_paired(monkeypatch, tmp_path):
    out = tmp_path / "p.csv"
    argv = ["bench_projections.py", "--device", "cpu", "--tiny", "--layers", "2", "--rep", "2", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    bp.main()
    with open(out) as f:
        rows = list(csv.DictReader(f))
    names = ["q", "k", "o", "gate", "down", "q+k+v", "qkv", "gate+up", "gate_up", "layer: separate", "layer: merged"]
    assert [(r["B"], r["row"]) for r in rows] == [(b, n) for b in ("1", "8") for n in names]
    by = {(r["B"], r["row"]): r for r in rows}
    dims = bp.shapes(tiny=True)
    qkv_mb = sum(dims[n][0] * dims[n][1] * 2 for n in ("q", "k", "v")) / 1e6
    assert abs(float(by[("1", "qkv")]["weight_mb"]) - qkv_mb) < 1e-9
    assert by[("1", "layer: merged")]["weight_mb"] == by[("1", "layer: separate")]["weight_mb"]
    for b in ("1", "8"):
        for merged_row, separate_row in bp.PAIRS.items():
            saved = float(by[(b, merged_row)]["saved_ms_per_step"])
            expect = (float(by[(b, separate_row)]["us_per_layer"]) - float(by[(b, merged_row)]["us_per_layer"])) * 32
            assert abs(saved - expect / 1000) < 1e-9
            assert by[(b, separate_row)]["saved_ms_per_step"] == ""
