"""benchmarks/time_needle_batch.py: its per-policy rows from a clock's notes (made-up notes: no model, no speed)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import time_needle_batch

from evaluation.needle import PhaseClock


def test_policy_rows_split_each_policys_decoding():
    """An eager policy's ms a step is its decode over the new tokens; a static one's leaves out its captures."""
    clock = PhaseClock("cpu")
    clock.note("dense", decode=0.4, graphs=0, capture=0.0)
    clock.note("quest", decode=1.0, graphs=2, capture=0.6)
    clock.note("quest", decode=0.5, graphs=1, capture=0.2)  # a second call adds to the first
    rows = {r["policy"]: r for r in time_needle_batch.policy_rows("padded, static", clock, new_tokens=8)}
    assert rows["dense"] == {
        "variant": "padded, static", "policy": "dense", "decode_s": 0.4, "graphs": 0, "capture_s": 0.0,
        "rest_ms_step": 50.0,
    }  # fmt: skip
    assert (rows["quest"]["decode_s"], rows["quest"]["graphs"], rows["quest"]["capture_s"]) == (1.5, 3, 0.8)
    assert rows["quest"]["rest_ms_step"] == 87.5  # (1.5 - 0.8) s over 8 tokens
