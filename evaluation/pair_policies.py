"""Two policies of one suite compared on the same windows and trials (``DIR/cells.jsonl``): how far policy ``a`` is
from policy ``b`` where the suite's summary compares each policy only with dense and the oracle. Runs on a CPU::

    python -m evaluation.pair_policies evaluation/results/suite_gemma3 pq8_c4_prefill_bf16 pq8_c4_prefill

- perplexity, per (length, budget): Δppl of ``a`` against ``b`` with the paired t interval over the windows both
  scored (:func:`evaluation.stats.delta_ppl`), and each one's mean block hit rate against the oracle;
- needle and QA, per (variant or QA task, length, budget): each one's hits on the trials both ran, the hits of
  ``b`` that ``a`` loses and those it gains, McNemar's exact p.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path
from typing import Any

from .stats import delta_ppl, paired
from .suite_summary import cell_nll
from .sweep import ResultsDir


def _mean(cells: list[dict[str, Any]], key: str) -> float | None:
    vals = [c.get(key) for c in cells]
    return None if not vals or any(v is None for v in vals) else sum(vals) / len(vals)


def perplexity_pairs(rows: list[dict[str, Any]], a: str, b: str) -> list[dict[str, Any]]:
    """Per (length, budget) where both scored at least two windows: ``a``'s perplexity against ``b``'s, paired."""
    cells: dict[tuple, dict[str, dict]] = defaultdict(lambda: {a: {}, b: {}})
    for r in rows:
        if r.get("task") == "perplexity" and r["policy"] in (a, b):
            cells[(r["length"], r["budget"])][r["policy"]][r["window"]] = r
    out = []
    for (length, budget), by in sorted(cells.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        ws = sorted(set(by[a]) & set(by[b]))
        if len(ws) < 2:
            continue
        ca, cb = [by[a][w] for w in ws], [by[b][w] for w in ws]
        d = delta_ppl([cell_nll(r) for r in ca], [cell_nll(r) for r in cb])
        out.append({"length": length, "budget": budget, "windows": len(ws), "dppl_pct": d.pct, "dppl_low": d.low,
                    "dppl_high": d.high, "hit_rate_a": _mean(ca, "hit_rate"), "hit_rate_b": _mean(cb, "hit_rate")})  # fmt: skip
    return out


def accuracy_pairs(rows: list[dict[str, Any]], a: str, b: str) -> list[dict[str, Any]]:
    """Per (task, variant or QA task, length, budget) with trials both ran: hits, and ``b``'s hits ``a`` loses /
    gains on the same trials."""
    cells: dict[tuple, dict[str, dict]] = defaultdict(lambda: {a: {}, b: {}})
    for r in rows:
        if r.get("task") in ("needle", "qa") and r["policy"] in (a, b):
            kind, unit = ("variant", "trial") if r["task"] == "needle" else ("qa_task", "item")
            cells[(r["task"], r[kind], r["length"], r["budget"])][r["policy"]][r[unit]] = bool(r["correct"])
    out = []
    for (task, what, length, budget), by in sorted(cells.items(), key=lambda kv: tuple(map(str, kv[0]))):
        ts = sorted(set(by[a]) & set(by[b]))
        if not ts:
            continue
        pr = paired([by[a][t] for t in ts], [by[b][t] for t in ts])
        out.append({"task": task, "what": what, "length": length, "budget": budget, "trials": len(ts),
                    "hits_a": pr.both + pr.gained, "hits_b": pr.both + pr.lost, "lost": pr.lost, "gained": pr.gained,
                    "mcnemar_p": pr.p_value})  # fmt: skip
    return out


def report(rows: list[dict[str, Any]], a: str, b: str) -> str:
    """Markdown: the two tables of ``a`` against ``b``."""

    def f(v, spec):
        return "·" if v is None else format(v, spec)

    lines = [f"### `{a}` against `{b}` (same windows and trials)", "",
             "| length | budget | windows | Δppl % [paired 95 %] | hit rate a / b |", "| - | - | - | - | - |"]  # fmt: skip
    for p in perplexity_pairs(rows, a, b):
        lines.append(
            f"| {p['length']} | {p['budget']} | {p['windows']} | {p['dppl_pct']:+.3f} [{p['dppl_low']:+.3f}, "
            f"{p['dppl_high']:+.3f}] | {f(p['hit_rate_a'], '.4f')} / {f(p['hit_rate_b'], '.4f')} |"
        )
    lines += ["", "| task | variant / QA task | length | budget | trials | hits a / b | lost / gained | McNemar p |",
              "| - | - | - | - | - | - | - | - |"]  # fmt: skip
    for p in accuracy_pairs(rows, a, b):
        lines.append(
            f"| {p['task']} | {p['what']} | {p['length']} | {p['budget']} | {p['trials']} | {p['hits_a']} / "
            f"{p['hits_b']} | {p['lost']} / {p['gained']} | {p['mcnemar_p']:.3g} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="a suite's results folder (its cells.jsonl)")
    ap.add_argument("a", help="the policy label compared")
    ap.add_argument("b", help="the policy label it is compared with")
    args = ap.parse_args(argv)
    if not Path(args.dir).is_dir():
        raise SystemExit(f"no results folder {args.dir}")
    rows = ResultsDir(args.dir).rows()
    labels = {r.get("policy") for r in rows}
    missing = [p for p in (args.a, args.b) if p not in labels]
    if missing:
        raise SystemExit(
            f"no cells of {', '.join(missing)} in {args.dir} (labels: {', '.join(sorted(map(str, labels)))})"
        )
    print(report(rows, args.a, args.b), end="")


if __name__ == "__main__":
    main()
