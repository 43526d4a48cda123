"""The crossover figure: decode ms/token against context length for every row of a bench_e2e CSV.

python benchmarks/plot_crossover.py benchmarks/results/bench_e2e_graph2.csv --out benchmarks/crossover.png
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--out", default="benchmarks/crossover.png")
    args = p.parse_args()
    series: dict = defaultdict(lambda: defaultdict(list))  # batch -> row -> [(context, ms)]
    with open(args.csv) as f:
        for r in csv.DictReader(f):
            if r.get("ms_per_token"):
                series[int(r["batch"])][r["row"]].append((int(r["context"]), float(r["ms_per_token"])))
    batches = sorted(series)
    fig, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 4.8), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for row, points in sorted(series[batch].items()):
            points.sort()
            style = "-" if row.startswith("graph") else "--"
            ax.plot([c for c, _ in points], [m for _, m in points], style, marker="o", label=row)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode ms/token (median)")
        ax.set_title(f"Llama-3.1-8B shape, bf16, H200, batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
