"""Two suite folders' cells side by side (``hf-sparse-kv suite MODEL --out DIR --compare OTHER``): how many of DIR's
needle and QA outcomes equal their twins in OTHER (the same cell key: task, length, variant or QA task, trial or item,
policy, budget; :func:`evaluation.suite_workers.cell_key`), and how far each policy's perplexity NLL sums are apart.

The check behind every "the same answers" claim of evaluation/RESULTS.md when a grid is run again on another machine,
kernel or code path: bf16 runs part at near-ties, so the counts say how often, and the relative NLL differences how
much.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .suite_workers import cell_key
from .sweep import ResultsDir


@dataclass
class Comparison:
    """``outcomes[(task, variant, length)] = [equal, differ, texts_differ]`` over DIR's retrieval cells with a twin;
    ``nll[(policy, budget, way, other_way)] = [relative |ΔNLL| ...]`` over DIR's perplexity cells with a twin;
    ``unmatched``: DIR's cells without one."""

    outcomes: dict[tuple, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0]))
    nll: dict[tuple, list[float]] = field(default_factory=lambda: defaultdict(list))
    unmatched: int = 0


def compare_rows(rows: Iterable[dict[str, Any]], others: Iterable[dict[str, Any]]) -> Comparison:
    """Each of ``rows`` against the row of ``others`` with its cell key (the last one, where a key repeats)."""
    twins = {}
    for row in others:
        key = cell_key(row)
        if key is not None:
            twins[key] = row
    out = Comparison()
    for row in rows:
        key = cell_key(row)
        if key is None:
            continue
        twin = twins.get(key)
        if twin is None:
            out.unmatched += 1
        elif row["task"] == "perplexity":
            way = (row.get("way"), twin.get("way"))
            rel = abs(row["nll_sum"] - twin["nll_sum"]) / max(abs(twin["nll_sum"]), 1e-30)
            out.nll[(row["policy"], row["budget"], *way)].append(rel)
        else:
            counts = out.outcomes[(row["task"], row.get("variant", row.get("qa_task")), row["length"])]
            counts[0 if row["correct"] == twin["correct"] else 1] += 1
            counts[2] += row.get("generated") != twin.get("generated")
    return out


def report(c: Comparison, name: str, other: str) -> str:
    """The comparison as Markdown: retrieval outcomes, then perplexity by policy and budget."""
    lines = [f"### {name} against {other}", ""]
    if c.outcomes:
        lines += [
            "| task | variant | length | equal | differ | generated text differs |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for (task, variant, length), (eq, ne, txt) in sorted(c.outcomes.items(), key=str):
            lines.append(f"| {task} | {variant} | {length} | {eq} | {ne} | {txt} |")
        lines.append("")
    if c.nll:
        lines += [
            "| policy | budget | way | other's way | windows | mean rel. ΔNLL | max |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for (policy, budget, way, other_way), rel in sorted(c.nll.items(), key=str):
            mean = sum(rel) / len(rel)
            lines.append(f"| {policy} | {budget} | {way} | {other_way} | {len(rel)} | {mean:.2e} | {max(rel):.2e} |")
        lines.append("")
    lines.append(f"cells without a twin in {other}: {c.unmatched}")
    return "\n".join(lines) + "\n"


def compare_folders(folder: str | Path, other: str | Path) -> str:
    """:func:`report` of ``folder``'s cells (every ``cells*.jsonl``, a running suite's worker files too) against
    ``other``'s; a folder without cells is an error (and is not created)."""
    for f in (folder, other):
        if not any(Path(f).glob("cells*.jsonl")):
            raise FileNotFoundError(f"no suite cells in {f} (cells*.jsonl)")
    rows, others = ResultsDir(folder).rows(), ResultsDir(other).rows()
    return report(compare_rows(rows, others), str(folder), str(other))
