"""Issue 13: does pooling the coarse pass over the GQA group like the oracle keep the oracle's blocks among fewer
candidates?

Scores, with the ``simulate`` way on the CPU (:class:`~evaluation.simulate.SimulateSession`, fidelity against
:class:`~hf_sparse_kv.policies.OracleBlockTopK` at the same budget), the last ``--scored`` tokens of ``--windows``
windows of ``--length`` tokens of the essays under: dense, the oracle, Quest, and
``TopPBlockTopK(p=1, pool="heads")`` with each coarse pass (``quest``: the group's max of Quest's bounds;
``quest_heads``: the mean over the group of each query head's softmax over the blocks of its scaled bounds;
``quest_heads_max``: their max) at each of ``--candidates``.

Rows (one per window and cell: nll sum, tokens, recall, hit rate, seconds) go to ``<out>/rows.jsonl`` as they come
(a rerun skips the rows it holds); the table (perplexity, its paired change against dense and the oracle with 95% t
intervals over the windows, recall, hit rate) to ``<out>/table.md`` and ``<out>/table.csv``, and each per-head cell
paired against Quest's coarse pass at the same candidates and at 8 (``<out>/paired.csv``, also in ``table.md``).

    python -m evaluation.coarse_pool --out evaluation/results/coarse_pool_cpu --windows 4 --scored 128
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import time
from fractions import Fraction
from pathlib import Path

import torch

from hf_sparse_kv.policies import Dense, OracleBlockTopK, QuantBlockTopK, Quest, TopPBlockTopK

from .assets import load_essays, load_model
from .channel_quant import ChannelQuantBlockTopK
from .perplexity import nll_of
from .simulate import SimulateSession
from .stats import delta_ppl, t_interval
from .text import essay_tokens

COARSE = ("quest", "quest_heads", "quest_heads_max")


def cells(
    budget: float,
    sink: int,
    window: int,
    candidates: list[float],
    coarse: list[str],
    bits: tuple[int, ...] = (),
    channels: tuple[str, ...] = (),
) -> dict:
    """label -> policy: dense, oracle, quest, then ``<coarse>_c<c>`` for every coarse pass and candidate factor, then
    ``quant<b>`` (:class:`QuantBlockTopK`: the oracle's mass under ``b``-bit keys) for every width in ``bits``, then
    ``quant4_r<r>_<rest>[_g<group>]`` (:class:`~evaluation.channel_quant.ChannelQuantBlockTopK`) for every
    ``"r:rest[:group]"`` of ``channels``."""
    out = {
        "dense": Dense(),
        "oracle": OracleBlockTopK(budget=budget, sink=sink, window=window),
        "quest": Quest(budget=budget, sink=sink, window=window),
    }
    for name in coarse:
        for c in candidates:
            out[f"{name}_c{c:g}"] = TopPBlockTopK(
                budget=budget, sink=sink, window=window, candidates=c, coarse=name, p=1.0, pool="heads"
            )
    for b in bits:
        out[f"quant{b}"] = QuantBlockTopK(budget=budget, sink=sink, window=window, bits=b)
    for spec in channels:
        r, rest, group = (spec.split(":") + ["", ""])[:3]
        policy = ChannelQuantBlockTopK(
            budget=budget, sink=sink, window=window, channels=int(r), rest=rest or "mean", group=int(group or 1)
        )
        suffix = f"_g{policy.group}" if policy.group > 1 else ""
        out[f"quant4_r{int(r)}_{policy.rest}{suffix}"] = policy
    return out


def summarize(rows: list[dict], labels: list[str]) -> list[dict]:
    """Per cell: perplexity over every scored token of every window; its paired change against dense and against the
    oracle (%, :func:`~evaluation.stats.delta_ppl`: the t interval over windows, 95%); recall and oracle hit rate
    (means over the windows, each window's a mean over scored query x sparse layer x KV head)."""
    by = {(r["window"], r["policy"]): r for r in rows}
    windows = sorted({r["window"] for r in rows})

    def mean_nll(label, w):
        return by[w, label]["nll_sum"] / by[w, label]["tokens"]

    table = []
    for label in labels:
        ws = [w for w in windows if (w, label) in by and (w, "dense") in by and (w, "oracle") in by]
        if not ws:
            continue
        nll = [mean_nll(label, w) for w in ws]
        vs_dense = delta_ppl(nll, [mean_nll("dense", w) for w in ws])
        vs_oracle = delta_ppl(nll, [mean_nll("oracle", w) for w in ws])
        fid = [by[w, label] for w in ws if by[w, label]["recall"] is not None]
        table.append(
            {
                "policy": label,
                "windows": len(ws),
                "ppl": round(math.exp(sum(nll) / len(nll)), 4),
                "d_dense_pct": round(vs_dense.pct, 2),
                "d_dense_ci": f"[{vs_dense.low:.2f}, {vs_dense.high:.2f}]",
                "d_oracle_pct": round(vs_oracle.pct, 2),
                "d_oracle_ci": f"[{vs_oracle.low:.2f}, {vs_oracle.high:.2f}]",
                "recall": round(sum(r["recall"] for r in fid) / len(fid), 4) if fid else None,
                "hit_rate": round(sum(r["hit_rate"] for r in fid) / len(fid), 4) if fid else None,
                "s_per_window": round(sum(by[w, label]["seconds"] for w in ws) / len(ws), 1),
            }
        )
    return table


def pairs(rows: list[dict], labels: list[str]) -> list[dict]:
    """Each per-head cell (``quest_heads*_c<c>``) against ``quest_c<c>`` (the same candidates) and ``quest_c8``, paired
    over windows: the change in perplexity (%) and the change in hit rate, each with its 95% t interval."""
    by = {(r["window"], r["policy"]): r for r in rows}
    windows = sorted({r["window"] for r in rows})
    out = []
    for label in labels:
        if not label.startswith("quest_heads"):
            continue
        c = label.rsplit("_c", 1)[1]
        for base in dict.fromkeys([f"quest_c{c}", "quest_c8"]):
            ws = [w for w in windows if (w, label) in by and (w, base) in by]
            if not ws:
                continue
            d = delta_ppl(
                [by[w, label]["nll_sum"] / by[w, label]["tokens"] for w in ws],
                [by[w, base]["nll_sum"] / by[w, base]["tokens"] for w in ws],
            )
            h, lo, hi = t_interval([by[w, label]["hit_rate"] - by[w, base]["hit_rate"] for w in ws])
            out.append(
                {
                    "policy": label,
                    "against": base,
                    "windows": len(ws),
                    "d_ppl_pct": round(d.pct, 2),
                    "d_ppl_ci": f"[{d.low:.2f}, {d.high:.2f}]",
                    "d_hit_rate": round(h, 4),
                    "d_hit_ci": f"[{lo:.4f}, {hi:.4f}]",
                }
            )
    return out


def write_table(table: list[dict], paired: list[dict], out: Path, header: str) -> None:
    with open(out / "table.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    if paired:
        with open(out / "paired.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(paired[0]))
            w.writeheader()
            w.writerows(paired)
    lines = [header, ""]
    for rows in (table, paired):
        if not rows:
            continue
        cols = list(rows[0])
        lines += ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
        lines += ["| " + " | ".join("-" if r[c] is None else str(r[c]) for c in cols) + " |" for r in rows]
        lines.append("")
    (out / "table.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main(argv: list[str] | None = None, extra_cells=None) -> None:
    """The CLI (module docstring); ``extra_cells(budget, sink, window) -> {label: policy}`` adds a caller's cells
    (an experiment of its own module) after the built-in ones."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--scored", type=int, default=128)
    ap.add_argument("--budget", default="1/16")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dense-layers", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--candidates", type=float, nargs="+", default=[2, 4, 8])
    ap.add_argument("--coarse", nargs="+", default=list(COARSE), choices=COARSE)
    ap.add_argument("--bits", type=int, nargs="*", default=[], help="QuantBlockTopK cells (quant<b>) at these widths")
    ap.add_argument(
        "--channels",
        nargs="*",
        default=[],
        help="ChannelQuantBlockTopK cells, each 'r:rest[:group]' (rest: mean, block, none)",
    )
    ap.add_argument("--only", nargs="*", default=None, help="run only these cell labels (dense and oracle always)")
    ap.add_argument("--chunk", type=int, default=64)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    budget = float(Fraction(args.budget))
    grid = cells(budget, args.sink, args.window, args.candidates, args.coarse, tuple(args.bits), tuple(args.channels))
    if extra_cells is not None:
        grid.update(extra_cells(budget, args.sink, args.window))
    if args.only:
        grid = {k: v for k, v in grid.items() if k in {"dense", "oracle", *args.only}}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "rows.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    done = {(r["window"], r["policy"]) for r in rows}
    model, tok = load_model(args.model)
    ids_all = torch.tensor(essay_tokens(tok, args.windows * args.length, essays=load_essays()))
    for w in range(args.windows):
        todo = [k for k in grid if (w, k) not in done]
        if not todo:
            continue
        ids = ids_all[w * args.length : (w + 1) * args.length].view(1, -1)
        session = SimulateSession(model, ids, args.scored, args.block_size, args.chunk)
        for label in todo:
            t0 = time.perf_counter()
            lp, fid = session.run(grid[label], tuple(args.dense_layers), fidelity=label != "dense")
            nll = nll_of(lp, ids)
            row = {
                "window": w,
                "policy": label,
                "nll_sum": float(nll.sum()),
                "tokens": nll.numel(),
                "recall": None if fid is None else fid.recall,
                "hit_rate": None if fid is None else fid.hit_rate,
                "seconds": round(time.perf_counter() - t0, 2),
            }
            rows.append(row)
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    header = (
        f"{args.model}, {args.windows} windows x {args.scored} scored tokens at {args.length}, budget {args.budget}, "
        f"block {args.block_size}, sink {args.sink}, window {args.window}, dense layers {args.dense_layers}, "
        "simulate way, reference ops, CPU float32; recall / hit_rate on the sparse layers against OracleBlockTopK"
    )
    write_table(summarize(rows, list(grid)), pairs(rows, list(grid)), args.out, header)


if __name__ == "__main__":
    main()
