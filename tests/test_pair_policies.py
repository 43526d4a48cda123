"""evaluation/pair_policies.py: two policies compared on the windows and trials both ran (paired Δppl, hits lost and
gained), from a suite's cells, and its command line."""

from __future__ import annotations

import json
import math

import pytest

from evaluation.pair_policies import accuracy_pairs, main, perplexity_pairs


def _cells() -> list[dict]:
    rows = []
    for w, (na, nb) in enumerate([(2.0, 2.1), (2.2, 2.25), (1.9, 2.0), (2.05, 2.1)]):
        for policy, nll in (("a", na), ("b", nb)):
            rows.append({"task": "perplexity", "length": 64, "window": w, "policy": policy, "budget": "1/16",
                         "nll_sum": nll * 10, "n": 10, "hit_rate": 0.9 if policy == "a" else 0.8})  # fmt: skip
    rows.append(
        {"task": "perplexity", "length": 64, "window": 9, "policy": "a", "budget": "1/16", "nll_sum": 99.0, "n": 10}
    )  # fmt: skip  (b has no window 9: left out of the pairs)
    hits = {"a": [1, 1, 0, 0, 1], "b": [1, 0, 1, 0, 1]}
    for policy, hs in hits.items():
        for t, h in enumerate(hs):
            rows.append({"task": "needle", "variant": "single", "length": 64, "trial": t, "policy": policy,
                         "budget": "1/16", "correct": bool(h)})  # fmt: skip
    rows.append(
        {"task": "qa", "qa_task": "fact", "length": 64, "item": 0, "policy": "a", "budget": "1/16", "correct": True}
    )  # fmt: skip  (b has no item 0: no QA row)
    return rows


def test_perplexity_is_paired_over_the_windows_both_scored():
    (row,) = perplexity_pairs(_cells(), "a", "b")
    diffs = [-0.1, -0.05, -0.1, -0.05]
    assert row["windows"] == 4 and row["length"] == 64 and row["budget"] == "1/16"
    assert row["dppl_pct"] == pytest.approx(100 * math.expm1(sum(diffs) / 4))
    assert row["dppl_low"] < row["dppl_pct"] < row["dppl_high"] < 0
    assert (row["hit_rate_a"], row["hit_rate_b"]) == pytest.approx((0.9, 0.8))
    (swapped,) = perplexity_pairs(_cells(), "b", "a")
    assert swapped["dppl_pct"] > 0


def test_needles_count_the_hits_one_policy_loses_and_gains_against_the_other():
    (row,) = accuracy_pairs(_cells(), "a", "b")
    assert (row["task"], row["what"], row["trials"]) == ("needle", "single", 5)
    assert (row["hits_a"], row["hits_b"], row["lost"], row["gained"]) == (3, 3, 1, 1)
    assert row["mcnemar_p"] == pytest.approx(1.0)


def test_the_command_prints_both_tables_and_names_a_missing_label(tmp_path, capsys):
    (tmp_path / "cells.jsonl").write_text("\n".join(json.dumps(r) for r in _cells()) + "\n")
    main([str(tmp_path), "a", "b"])
    out = capsys.readouterr().out
    assert (
        "`a` against `b`" in out
        and "| 64 | 1/16 | 4 |" in out
        and "| needle | single | 64 | 1/16 | 5 | 3 / 3 | 1 / 1 |" in out
    )
    with pytest.raises(SystemExit, match="no cells of c"):
        main([str(tmp_path), "a", "c"])
    with pytest.raises(SystemExit, match="no results folder"):
        main([str(tmp_path / "nowhere"), "a", "b"])
