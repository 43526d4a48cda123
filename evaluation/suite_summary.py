"""Tables with 95% intervals and plots with error bars from a suite's raw cells (``DIR/cells.jsonl``); runs on a
CPU from the cells alone.

- perplexity: per (length, policy, budget), the pooled perplexity, Δppl against dense with the paired t interval
  over windows (:func:`evaluation.stats.delta_ppl`), KL, attention recall and block hit rate against the oracle;
- needle and QA: per (task, length, policy, budget), accuracy with its Wilson interval, and against dense on the
  same trials: hits lost, hits gained, the difference with Newcombe's paired interval, McNemar's exact p.

Writes ``summary.md``, ``summary.json`` and PNGs into ``DIR``; returns the Markdown.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from .plots import _plt, finish, heatmap
from .recipes import file_part
from .stats import delta_ppl, paired, wilson
from .sweep import ResultsDir


def _order(key: tuple, value_of: dict) -> tuple:
    """Sort: dense first, then policies by name, budgets large to small."""
    *head, policy, _ = key
    return (*head, policy != "dense", policy, -(value_of.get(key) or 2))


def cell_nll(cell: dict[str, Any]) -> float:
    """A perplexity cell's mean NLL per scored token (nats)."""
    return cell["nll_sum"] / cell["n"]


def perplexity_rows(rows: list[dict[str, Any]], oracle: str = "oracle") -> list[dict[str, Any]]:
    """Summary rows of the perplexity cells (only windows that dense also scored). Each sparse row also holds its
    perplexity against the ``oracle`` label's at the same length and budget (``vs_oracle_*``: paired over the windows
    both scored, in % of the oracle's perplexity; ``None`` without oracle cells): how far a selector is from the
    ceiling of its budget, with its interval, which two intervals against dense cannot tell."""
    cells = [r for r in rows if r.get("task") == "perplexity"]
    dense = {(r["length"], r["window"]): r for r in cells if r["budget"] == "-"}
    groups, bv = defaultdict(dict), {}
    for r in cells:
        groups[(r["length"], r["policy"], r["budget"])][r["window"]] = r
        bv[(r["length"], r["policy"], r["budget"])] = r["budget_value"]
    out = []
    for key in sorted(groups, key=lambda k: _order(k, bv)):
        length = key[0]
        ws = sorted(w for w in groups[key] if (length, w) in dense)
        if not ws:
            continue
        mine = [groups[key][w] for w in ws]
        base = [dense[(length, w)] for w in ws]
        d = delta_ppl([cell_nll(r) for r in mine], [cell_nll(r) for r in base])
        ceiling = groups.get((length, oracle, key[2]), {}) if key[1] not in ("dense", oracle) else {}
        both = [w for w in ws if w in ceiling]
        vs = (
            delta_ppl([cell_nll(groups[key][w]) for w in both], [cell_nll(ceiling[w]) for w in both])
            if len(both) > 1
            else None
        )

        def mean(k: str, rs=mine):
            vals = [r.get(k) for r in rs]
            return None if any(v is None for v in vals) else sum(vals) / len(vals)

        out.append(
            {
                "length": length,
                "policy": key[1],
                "budget": key[2],
                "budget_value": bv[key],
                "windows": len(ws),
                "ppl": math.exp(sum(r["nll_sum"] for r in mine) / sum(r["n"] for r in mine)),
                "dense_ppl": math.exp(sum(r["nll_sum"] for r in base) / sum(r["n"] for r in base)),
                "dppl_pct": d.pct,
                "dppl_low": d.low,
                "dppl_high": d.high,
                "vs_oracle_pct": vs.pct if vs else None,
                "vs_oracle_low": vs.low if vs else None,
                "vs_oracle_high": vs.high if vs else None,
                "kl_mean": mean("kl_mean"),
                "recall": mean("recall"),
                "hit_rate": mean("hit_rate"),
                "reuse": mine[0].get("reuse", 1),
            }
        )
    return out


def reuse_plot(ppl: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Perplexity against the oracle (fresh, same budget) as a function of ``reuse`` (decode steps per selection),
    one line per (policy, budget): a cell labelled ``<base>_r<r>`` is ``<base>`` reusing its selection ``r`` steps,
    drawn at ``r`` beside ``<base>`` itself at 1 (the oracle at 1: 0). ``None`` (no file) without reused cells."""
    reused = [r for r in ppl if r.get("reuse", 1) > 1 and r["vs_oracle_pct"] is not None]
    if not reused:
        return None
    by = {(r["policy"], r["budget"]): r for r in ppl}
    lines = defaultdict(list)
    for r in reused:
        base = r["policy"].removesuffix(f"_r{r['reuse']}")
        lines[(base, r["budget"])].append((r["reuse"], r["vs_oracle_pct"], r["vs_oracle_low"], r["vs_oracle_high"]))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.0, 4.2))
    for i, ((base, budget), pts) in enumerate(sorted(lines.items())):
        fresh = by.get((base, budget))
        if fresh is not None and fresh["reuse"] == 1:
            v = fresh["vs_oracle_pct"]
            pts.append((1, 0.0, 0.0, 0.0) if v is None else (1, v, fresh["vs_oracle_low"], fresh["vs_oracle_high"]))
        pts.sort()
        shift = 2 ** (0.04 * (i - (len(lines) - 1) / 2))
        ax.errorbar(
            [p[0] * shift for p in pts],
            [p[1] for p in pts],
            yerr=[[max(0.0, p[1] - p[2]) for p in pts], [max(0.0, p[3] - p[1]) for p in pts]],
            marker="o",
            capsize=3,
            label=f"{base} @ {budget}",
        )
    ax.axhline(0.0, linestyle="--", color="gray", linewidth=1)
    ax.set_xscale("log", base=2)
    ylabel = "Δppl vs the fresh oracle, % (95% CI)"
    return finish(fig, ax, path, "decode steps per selection (reuse)", ylabel, title, title_size=9)


def accuracy_rows(rows: list[dict[str, Any]], task: str) -> list[dict[str, Any]]:
    """Summary rows of needle (``task="needle"``, grouped by variant) or QA cells (grouped by QA task)."""
    cells = [r for r in rows if r.get("task") == task]
    kind = "variant" if task == "needle" else "qa_task"
    unit = "trial" if task == "needle" else "item"

    def trial_key(r):
        return r[kind], r["length"], r[unit]

    dense = {trial_key(r): r["correct"] for r in cells if r["budget"] == "-"}
    groups, bv = defaultdict(list), {}
    for r in cells:
        for length in (r["length"], "all"):
            groups[(r[kind], length, r["policy"], r["budget"])].append(r)
            bv[(r[kind], length, r["policy"], r["budget"])] = r["budget_value"]
    out = []
    for key in sorted(groups, key=lambda k: (str(k[1]), *_order(k, bv))):
        rs = [r for r in groups[key] if trial_key(r) in dense]
        if not rs:
            continue
        hits = [bool(r["correct"]) for r in rs]
        pr = paired(hits, [dense[trial_key(r)] for r in rs])
        lo, hi = wilson(sum(hits), len(hits))
        dlo, dhi = pr.interval()
        out.append(
            {
                kind: key[0],
                "length": key[1],
                "policy": key[2],
                "budget": key[3],
                "budget_value": bv[key],
                "trials": len(rs),
                "accuracy": sum(hits) / len(hits),
                "acc_low": lo,
                "acc_high": hi,
                "dense_accuracy": (pr.both + pr.lost) / pr.n,
                "lost": pr.lost,
                "gained": pr.gained,
                "diff": pr.difference,
                "diff_low": dlo,
                "diff_high": dhi,
                "mcnemar_p": pr.p_value,
            }
        )
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def _table(rows: list[dict[str, Any]], cols: list[tuple[str, Any]]) -> str:
    head = "| " + " | ".join(c for c, _ in cols) + " |\n| " + " | ".join("---" for _ in cols) + " |\n"
    return head + "".join("| " + " | ".join(f(r) for _, f in cols) + " |\n" for r in rows)


def _interval(v: str, lo: str, hi: str, scale: float = 1.0, unit: str = ""):
    def f(r):
        if r[v] is None or (isinstance(r[lo], float) and math.isnan(r[lo])):
            return _fmt(r[v] * scale if r[v] is not None else None) + unit
        return f"{r[v] * scale:.3g}{unit} [{r[lo] * scale:.3g}, {r[hi] * scale:.3g}]"

    return f


GRID_POLICIES = (
    "dense", "oracle", "token_topk", "quant4", "quest", "block_topk", "sink_window", "snapkv", "snapkv1/4+quest",
)  # fmt: skip
"""Issue 12's policies (and ``quant4``, issue 13's most faithful selector), in the order of the grid tables."""


def _budget_key(b: str) -> float:
    """``"1/8"`` -> 0.125 (``"-"``: dense, first); budgets large to small."""
    if b == "-":
        return -1.0
    num, _, den = b.partition("/")
    return -float(num) / float(den or 1)


def _grid_columns(rows: list[dict[str, Any]]) -> list[tuple[Any, str]]:
    """The ``(length, budget)`` pairs of ``rows`` but dense's, by length, budgets large to small."""
    return sorted(
        {(r["length"], r["budget"]) for r in rows if r["budget"] != "-"}, key=lambda c: (c[0], _budget_key(c[1]))
    )


def _grid(cols: list[tuple[Any, str]], cell) -> str:
    """A :func:`_table` of :data:`GRID_POLICIES` (those with a cell) against ``cols``; ``cell(policy, length,
    budget)`` -> its text, ``None`` where not measured (shown ``·``)."""
    rows = [pol for pol in GRID_POLICIES if any(cell(pol, n, b) is not None for n, b in cols)]
    spec = [("policy", lambda pol: pol)]
    spec += [(f"{n} @ {b}", lambda pol, n=n, b=b: cell(pol, n, b) or "·") for n, b in cols]
    return _table(rows, spec)


def grid_tables(ppl: list[dict[str, Any]], acc: dict[str, list[dict[str, Any]]]) -> str:
    """Markdown: the suite's grid at a glance, :data:`GRID_POLICIES` as rows, (length, budget) as columns.

    - Perplexity: Δppl % against dense [paired 95 %] (dense's row: its perplexity), from ``ppl``
      (:func:`perplexity_rows`, ``reuse == 1`` only).
    - Each needle variant and QA task (``acc``: section name -> :func:`accuracy_rows`, per length, not ``"all"``):
      ``hits / trials (lost / gained against dense on the same trials)``; dense's row: ``hits / trials``.

    Cells not measured are ``·``; columns with no cell are left out. The full rows, other policies included, are in
    the sections below it."""
    out = []
    mine = [r for r in ppl if r["reuse"] == 1 and r["policy"] in GRID_POLICIES]
    cols = _grid_columns(mine)
    if cols:
        by = {(r["policy"], r["length"], r["budget"]): r for r in mine}

        def ppl_cell(pol, n, b):
            r = by.get((pol, n, "-" if pol == "dense" else b))
            if r is None:
                return None
            return _fmt(r["ppl"]) if pol == "dense" else _interval("dppl_pct", "dppl_low", "dppl_high")(r)

        out.append("\n### Perplexity: Δppl % against dense [paired 95 %] (dense: its perplexity)\n\n")
        out.append(_grid(cols, ppl_cell))
    for section, rows in acc.items():
        kind = "variant" if rows and "variant" in rows[0] else "qa_task"
        rows = [r for r in rows if r["length"] != "all" and r["policy"] in GRID_POLICIES]
        for what in sorted({r[kind] for r in rows}):
            theirs = [r for r in rows if r[kind] == what]
            cols = _grid_columns(theirs)
            if not cols:
                continue
            by = {(r["policy"], r["length"], r["budget"]): r for r in theirs}

            def hits_cell(pol, n, b, by=by):
                r = by.get((pol, n, "-" if pol == "dense" else b))
                if r is None:
                    return None
                hits = f"{round(r['accuracy'] * r['trials'])} / {r['trials']}"
                return hits if pol == "dense" else f"{hits} ({r['lost']} / {r['gained']})"

            out.append(
                f"\n### {section} {what}: hits / trials (lost / gained against dense on the same trials; dense: its own "
                "hits over all its trials)\n\n"
            )
            out.append(_grid(cols, hits_cell))
    return "".join(out)


def errorbar_plot(rows, metric, low, high, group, path: Path, ylabel: str, title: str, scale: float = 1.0) -> Path:
    """``metric`` against the budget, one line per ``group(row)``, with error bars from ``low``/``high``; dense (no
    budget) as a dashed line per group."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    lines, dense = defaultdict(list), {}
    for r in rows:
        if r.get(metric) is None:
            continue
        if r["budget"] == "-":
            dense[group(r, dense=True)] = r[metric] * scale
        else:
            lines[group(r)].append(r)
    for i, (name, rs) in enumerate(sorted(lines.items())):
        rs.sort(key=lambda r: r["budget_value"])
        shift = 2 ** (0.03 * (i - (len(lines) - 1) / 2))  # a small offset per line so the error bars do not overlap
        x = [r["budget_value"] * shift for r in rs]
        y = [r[metric] * scale for r in rs]
        err = [
            [max(0.0, (r[metric] - r[low]) * scale) if not math.isnan(r[low]) else 0.0 for r in rs],
            [max(0.0, (r[high] - r[metric]) * scale) if not math.isnan(r[high]) else 0.0 for r in rs],
        ]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=name)
    for name, v in sorted(dense.items()):
        ax.axhline(v, linestyle="--", color="gray", linewidth=1)
        ax.annotate(name, (1.0, v), xycoords=("axes fraction", "data"), ha="right", va="bottom", fontsize=7)
    if lines:
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=6, ncol=2)
    return finish(fig, ax, path, "budget (fraction of the context)", ylabel, title, title_size=9, legend=False)


def summarize(out: str | Path, title: str = "") -> str:
    """Write ``summary.md``, ``summary.json`` and the plots of the suite in ``out``; return the Markdown."""
    results = ResultsDir(out)
    rows = results.rows()
    ppl = perplexity_rows(rows)
    needle = accuracy_rows(rows, "needle")
    qa = accuracy_rows(rows, "qa")
    md = [f"# Suite summary: {title}\n", f"{len(rows)} cells from `{Path(out) / 'cells.jsonl'}`.\n"]
    grid = grid_tables(ppl, {"Needle": needle, "QA": qa})
    if grid:
        md.append("\n## The grid (issue 12's policies and `quant4`; every row and policy in the sections below)\n")
        md.append(grid)
    if ppl:
        md.append(
            "\n## Perplexity (Δ against dense, and against the oracle at the same budget: paired 95% t intervals "
            "over windows)\n\n"
        )
        md.append(
            _table(
                ppl,
                [
                    ("length", lambda r: str(r["length"])),
                    ("policy", lambda r: r["policy"]),
                    ("budget", lambda r: r["budget"]),
                    ("windows", lambda r: str(r["windows"])),
                    ("ppl", lambda r: f"{r['ppl']:.4g}"),
                    ("Δppl % [95% CI]", _interval("dppl_pct", "dppl_low", "dppl_high")),
                    ("vs oracle % [95% CI]", _interval("vs_oracle_pct", "vs_oracle_low", "vs_oracle_high")),
                    ("KL", lambda r: _fmt(r["kl_mean"])),
                    ("recall", lambda r: _fmt(r["recall"])),
                    ("hit rate vs oracle", lambda r: _fmt(r["hit_rate"])),
                ],
            )
        )
        for length in sorted({r["length"] for r in ppl}):
            mine = [r for r in ppl if r["length"] == length and r["reuse"] == 1]
            reuse_plot(
                [r for r in ppl if r["length"] == length],
                results.path / f"reuse_{length}.png",
                f"{title} · a selection reused for r decode steps, at {length}",
            )
            errorbar_plot(
                mine,
                "dppl_pct",
                "dppl_low",
                "dppl_high",
                lambda r, dense=False: "dense" if dense else r["policy"],
                results.path / f"dppl_vs_budget_{length}.png",
                "Δppl vs dense, % (95% CI)",
                f"{title} · perplexity at {length}",
            )
    for name, acc, kind in (("Needle", needle, "variant"), ("QA", qa, "qa_task")):
        if not acc:
            continue
        md.append(f"\n## {name} (accuracy: Wilson 95%; against dense on the same trials: Newcombe 95%, McNemar)\n\n")
        md.append(
            _table(
                acc,
                [
                    (kind, lambda r, k=kind: r[k]),
                    ("length", lambda r: str(r["length"])),
                    ("policy", lambda r: r["policy"]),
                    ("budget", lambda r: r["budget"]),
                    ("trials", lambda r: str(r["trials"])),
                    ("accuracy [95% CI]", _interval("accuracy", "acc_low", "acc_high")),
                    ("dense", lambda r: f"{r['dense_accuracy']:.3g}"),
                    ("lost", lambda r: str(r["lost"])),
                    ("gained", lambda r: str(r["gained"])),
                    ("Δ vs dense [95% CI]", _interval("diff", "diff_low", "diff_high")),
                    ("McNemar p", lambda r: f"{r['mcnemar_p']:.3g}"),
                ],
            )
        )
        for what in sorted({r[kind] for r in acc}):
            for length in sorted({r["length"] for r in acc if r[kind] == what}, key=str):
                mine = [r for r in acc if r[kind] == what and r["length"] == length]
                errorbar_plot(
                    mine,
                    "accuracy",
                    "acc_low",
                    "acc_high",
                    lambda r, dense=False: "dense" if dense else r["policy"],
                    results.path / f"{name.lower()}_{file_part(what)}_{length}_vs_budget.png",
                    "accuracy (Wilson 95%)",
                    f"{title} · {name.lower()} {what} at {length}",
                )
    singles = [r for r in rows if r.get("task") == "needle" and r["variant"] in ("single", "single_start")]
    by_cell = defaultdict(lambda: defaultdict(list))
    for r in singles:
        by_cell[(r["policy"], r["budget"])][(r["length"], r["depth"])].append(bool(r["correct"]))
    for (policy, budget), grid in by_cell.items():
        heatmap(
            {k: sum(v) / len(v) for k, v in grid.items()},
            results.path / f"needle_depth_{file_part(policy)}_{file_part(budget)}.png",
            f"{title}\n{policy} {budget} ({sum(len(v) for v in grid.values())} trials)",
        )
    text = "".join(md)
    (results.path / "summary.md").write_text(text)
    (results.path / "summary.json").write_text(json.dumps({"perplexity": ppl, "needle": needle, "qa": qa}, indent=1))
    return text
