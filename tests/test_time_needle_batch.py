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


def test_divergences_name_the_first_step_where_two_decodings_part_and_their_margins():
    """Made-up answers and logits: one (prompt, policy) differs, from its second step; its row gives both tokens
    there and both margins (top-1 minus top-2); equal decodings give no row."""
    import torch

    answers = [{"dense": [5, 6, 7], "quest": [1, 2, 3]}, {"dense": [4, 4, 4], "quest": [9, 8, 7]}]
    ref = [{"dense": [5, 6, 7], "quest": [1, 2, 3]}, {"dense": [4, 4, 4], "quest": [9, 3, 7]}]

    def top2(tokens, gap):  # [B, steps, 2] values and ids: each step's token first, the runner-up 0.5 or gap below
        values = torch.tensor([[[10.0, 10.0 - gap if (i, s) == (1, 1) else 9.5] for s in range(3)] for i in range(2)])
        ids = torch.tensor([[[t, t + 100] for t in ans] for ans in tokens])
        return values, ids

    mine = {k: top2([a[k] for a in answers], 0.125) for k in ("dense", "quest")}
    theirs = {k: top2([r[k] for r in ref], 2.0) for k in ("dense", "quest")}
    rows = time_needle_batch.divergences("padded, static", answers, ref, mine, theirs, torch.bfloat16)
    assert rows == [
        {
            "variant": "padded, static", "policy": "quest", "prompt": 1, "step": 1, "token": 8, "margin": 0.125,
            "ref_token": 3, "ref_margin": 2.0, "ref_second": 103, "ref_top_logit": 10.0, "tie": False,
        }
    ]  # fmt: skip
    assert time_needle_batch.divergences("x", ref, ref, theirs, theirs, torch.bfloat16) == []


def test_a_tie_is_two_units_in_the_last_place_of_the_logits_dtype():
    """bf16 holds 8 bits of mantissa: between 8 and 16 a unit is 0.0625, between 16 and 32 0.125; a tie is both
    margins within two units; float32's units are far smaller, so the same margins are no tie there."""
    import torch

    tie = time_needle_batch.is_tie
    assert tie(0.0, 0.125, 13.25, torch.bfloat16) and not tie(0.0, 0.1875, 13.25, torch.bfloat16)
    assert tie(0.25, 0.0, 21.6, torch.bfloat16) and not tie(0.375, 0.0, 21.6, torch.bfloat16)
    assert tie(0.0, 0.0, 0.0, torch.bfloat16) and not tie(0.0, 0.125, 13.25, torch.float32)
