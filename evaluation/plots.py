"""PNG plots of the recipes' summaries (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish(
    fig, ax, path: Path, xlabel: str, ylabel: str, title: str, title_size: int = 10, legend: bool = True
) -> Path:
    """Label ``ax``, add its legend (``legend``) and grid, write ``fig`` to ``path`` (PNG, 110 dpi), close it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=title_size)
    if legend:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def _budget_x(row: dict[str, Any]) -> float:
    return float(row["budget_value"])


def metric_vs_budget(
    rows: list[dict[str, Any]],
    metric: str,
    path: Path,
    ylabel: str,
    title: str,
    dense_metric: str | None = None,
    log_x: bool = True,
) -> Path:
    """One line per (policy, length) of ``metric`` against the budget; dense as a dashed line per length."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    lines = defaultdict(list)
    dense = {}
    for r in rows:
        if r.get(metric) is None:
            continue
        if r["budget"] == "-":
            dense[r["length"]] = r[metric]
        else:
            lines[(r["policy"], r["length"])].append((_budget_x(r), r[metric]))
    for (policy, length), pts in sorted(lines.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{policy} @ {length}")
    for length, value in sorted(dense.items()):
        ax.axhline(value, linestyle="--", color="gray", linewidth=1)
        ax.annotate(
            f"dense @ {length}",
            (1.0, value),
            xycoords=("axes fraction", "data"),
            ha="right",
            va="bottom",
            fontsize=7,
            color="gray",
        )
    if log_x and lines:
        ax.set_xscale("log", base=2)
    return finish(fig, ax, path, "budget (fraction of the context)", ylabel, title, legend=bool(lines))


def heatmap(grid: dict[tuple[int, float], float], path: Path, title: str) -> Path:
    """Accuracy by context length (rows) × needle depth (columns), 0..1."""
    plt = _plt()
    lengths = sorted({k[0] for k in grid})
    depths = sorted({k[1] for k in grid})
    data = [[grid.get((length, d), float("nan")) for d in depths] for length in lengths]
    fig, ax = plt.subplots(figsize=(1.2 + 0.8 * len(depths), 1.2 + 0.6 * len(lengths)))
    im = ax.imshow(data, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    for i, row in enumerate(data):
        for j, v in enumerate(row):
            if not math.isnan(v):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xlabel("needle depth")
    ax.set_ylabel("context tokens")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.05)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
