"""benchmarks/probe_holes.py on the CPU (the reference ops): it runs, checks that no freed block is selected, and
writes one row per table. No speed is checked here."""

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import probe_holes


def test_probe_holes_dry_run_writes_the_full_freed_and_compacted_tables(monkeypatch, tmp_path):
    out = tmp_path / "holes.csv"
    argv = ["probe_holes.py", "--device", "cpu", "--context", "2048", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    probe_holes.main()
    rows = {r["table"]: r for r in csv.DictReader(out.open())}
    assert set(rows) == {"full", "freed", "freed read as block 0", "compact"}
    assert float(rows["freed"]["finite_share"]) < 0.3 < float(rows["full"]["finite_share"])
    assert (
        int(rows["compact"]["width"]) < int(rows["full"]["width"]) / 3 and float(rows["compact"]["finite_share"]) > 0.9
    )
    assert all(int(r["k"]) == 8 and float(r["topk_us"]) > 0 for r in rows.values())
