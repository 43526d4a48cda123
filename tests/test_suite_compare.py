"""`hf-sparse-kv suite MODEL --out DIR --compare OTHER`: retrieval outcomes and perplexity NLL against their twins."""

from __future__ import annotations

import json

import pytest

from evaluation.suite_cli import main as suite_main
from evaluation.suite_compare import compare_rows, report


def _needle(trial, policy, correct, generated="x", variant="single", length=4096):
    return {
        "task": "needle", "variant": variant, "length": length, "trial": trial, "policy": policy,
        "budget": "-" if policy == "dense" else "1/16", "correct": correct, "generated": generated,
    }  # fmt: skip


def _ppl(window, policy, nll, way="simulate"):
    budget = "-" if policy == "dense" else "1/16"
    return {
        "task": "perplexity",
        "length": 4096,
        "window": window,
        "policy": policy,
        "budget": budget,
        "nll_sum": nll,
        "way": way,
    }


def _qa(item, correct, generated):
    return {
        "task": "qa", "qa_task": "fact", "length": 8192, "item": item, "policy": "quest", "budget": "1/16",
        "correct": correct, "generated": generated,
    }  # fmt: skip


def test_outcomes_texts_and_nll_are_counted_against_twins():
    rows = [
        _needle(0, "dense", True, "a"),
        _needle(1, "dense", False, "b"),
        _needle(0, "quest", True, "c"),  # same outcome, another text
        _needle(2, "quest", True),  # no twin
        _qa(0, False, "z"),
        _ppl(0, "dense", 100.0),
        _ppl(1, "dense", 200.0),
        _ppl(0, "quest", 110.0, way="simulate"),
        {"task": "other"},  # no suite cell: ignored
    ]
    others = [
        _needle(0, "dense", True, "a"),
        _needle(1, "dense", True, "b"),
        _needle(0, "quest", True, "d"),
        _qa(0, True, "y"),
        _ppl(0, "dense", 100.0),
        _ppl(1, "dense", 201.0),
        _ppl(0, "quest", 99.0, way="decode"),
        _ppl(0, "quest", 100.0, way="decode"),  # a repeated key: the last row is the twin
    ]
    c = compare_rows(rows, others)
    assert dict(c.outcomes) == {("needle", "single", 4096): [2, 1, 1], ("qa", "fact", 8192): [0, 1, 1]}
    assert c.unmatched == 1
    assert c.nll[("dense", "-", "simulate", "simulate")] == pytest.approx([0.0, 1 / 201])
    assert c.nll[("quest", "1/16", "simulate", "decode")] == pytest.approx([0.1])
    text = report(c, "A", "B")
    assert "| needle | single | 4096 | 2 | 1 | 1 |" in text
    assert "| quest | 1/16 | simulate | decode | 1 | 1.00e-01 | 1.00e-01 |" in text
    assert text.rstrip().endswith("cells without a twin in B: 1")


def test_the_suite_command_compares_two_folders_and_refuses_an_empty_one(tmp_path, capsys):
    a, b, empty = tmp_path / "a", tmp_path / "b", tmp_path / "empty"
    for folder, correct in ((a, True), (b, False)):
        folder.mkdir()
        (folder / "cells.jsonl").write_text(json.dumps(_needle(0, "dense", correct)) + "\n")
    empty.mkdir()
    suite_main(["smollm2", "--out", str(a), "--compare", str(b)])
    assert "| needle | single | 4096 | 0 | 1 | 0 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        suite_main(["smollm2", "--out", str(a), "--compare", str(empty)])
    assert "no suite cells in" in capsys.readouterr().err
