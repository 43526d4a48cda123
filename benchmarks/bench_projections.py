"""What merging a layer's projections would buy at decode: the weights' matmuls of one Llama-3.1-8B layer at batch 1
and 8, each projection on its own (what transformers' Llama runs) against q / k / v merged into one matmul and gate /
up into one. ``bench_split.py --rows`` found the matmuls of a compiled step at 79 % of the HBM bandwidth, 0.9 ms of
a 6.8 ms step above their bytes (benchmarks/RESULTS.md, 2026-12-01); this measures how much of that merging takes
back before anything in the library merges them. One command on the GPU::

    python benchmarks/bench_projections.py --out benchmarks/results/bench_projections.csv

Method. Per batch ``B`` (``--batches``): an input ``x [B, 4096]`` (and ``[B, 14336]`` for ``down``), bf16; each
layer's weights on their own memory, ``--layers`` layers (32: a decode step's worth), and the merged weights of
each layer as separate tensors (``cat`` of q, k, v and of gate, up). ``common.bench`` times one call per layer in
sequence inside one CUDA graph, the L2 flushed by reads before each replay, and returns the median per layer. Rows:
``q+k+v`` (three ``F.linear``) against ``qkv`` (one, its output split as views), ``gate+up`` against ``gate_up``, each of ``q``, ``k``, ``o``, ``gate``, ``down`` alone (where the bandwidth
is lost), and
the whole layer, ``layer: separate`` (q, k, v, o, gate, up, down: 7 matmuls) against ``layer: merged`` (qkv, o,
gate_up, down: 4). Checked first: the merged outputs equal the separate ones within bf16 rounding. Columns: µs per
layer, the weights' bytes, GB/s and the fraction of the copy bandwidth measured in the same run (``common.
hbm_bandwidth``), and ``saved_ms_per_step``: (separate - merged) x 32 layers, against the row it pairs with.

A dry run on the CPU (tiny shapes, wall clock)::

    python benchmarks/bench_projections.py --device cpu --tiny --layers 2 --out /tmp/bench_projections.csv
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench, env_info, hbm_bandwidth, print_table, write_csv

HIDDEN, KV, FFN = 4096, 1024, 14336  # Llama-3.1-8B: 32 query heads and 8 KV heads of 128, FFN 14336
GROUPS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}  # merged weight -> the projections it holds, in order
STEP_LAYERS = 32  # the 8B model's layers: a step's saving is the per-layer saving times this


def shapes(tiny: bool) -> dict[str, tuple[int, int]]:
    """``name -> (out, in)`` of one layer's projections (the 8B shape, or 1/32 of it with ``tiny``)."""
    h, kv, f = (HIDDEN // 32, KV // 32, FFN // 32) if tiny else (HIDDEN, KV, FFN)
    return {"q": (h, h), "k": (kv, h), "v": (kv, h), "o": (h, h), "gate": (f, h), "up": (f, h), "down": (h, f)}


def layer_weights(dims: dict[str, tuple[int, int]], device: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One layer's weights ``[out, in]`` bf16 (scaled by ``in ** -0.5``), with the merged ones as their own tensors."""
    w = {n: (torch.randn(o, i, generator=g, device=device) * i**-0.5).to(torch.bfloat16) for n, (o, i) in dims.items()}
    w.update({m: torch.cat([w[n] for n in parts]) for m, parts in GROUPS.items()})
    return w


def separate(x: torch.Tensor, w: dict, names) -> list[torch.Tensor]:
    return [F.linear(x, w[n]) for n in names]


def merged(x: torch.Tensor, w: dict, name: str) -> list[torch.Tensor]:
    """The merged matmul's output split back into its projections' (views, no copy)."""
    sizes = [w[n].shape[0] for n in GROUPS[name]]
    return list(F.linear(x, w[name]).split(sizes, dim=-1))


def check(x: torch.Tensor, w: dict) -> float:
    """Largest relative difference between each merged output and its separate projections (bf16 rounding only)."""
    worst = 0.0
    for name, parts in GROUPS.items():
        for a, b in zip(merged(x, w, name), separate(x, w, parts)):
            assert not torch.isnan(a).any(), f"NaN in the merged {name}"
            worst = max(worst, ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item())
    return worst


def rows_for(x: torch.Tensor, xf: torch.Tensor, w: dict) -> dict[str, tuple]:
    """``row -> (function of one layer, weight names it reads)``; ``xf`` is the down projection's input."""
    alone = {n: (lambda n=n: F.linear(xf if n == "down" else x, w[n]), (n,)) for n in ("q", "k", "o", "gate", "down")}
    return {
        **alone,
        "q+k+v": (lambda: separate(x, w, GROUPS["qkv"]), GROUPS["qkv"]),
        "qkv": (lambda: merged(x, w, "qkv"), ("qkv",)),
        "gate+up": (lambda: separate(x, w, GROUPS["gate_up"]), GROUPS["gate_up"]),
        "gate_up": (lambda: merged(x, w, "gate_up"), ("gate_up",)),
        "layer: separate": (
            lambda: [*separate(x, w, ("q", "k", "v", "o", "gate", "up")), F.linear(xf, w["down"])],
            ("q", "k", "v", "o", "gate", "up", "down"),
        ),
        "layer: merged": (
            lambda: [*merged(x, w, "qkv"), F.linear(x, w["o"]), *merged(x, w, "gate_up"), F.linear(xf, w["down"])],
            ("qkv", "o", "gate_up", "down"),
        ),
    }


PAIRS = {"qkv": "q+k+v", "gate_up": "gate+up", "layer: merged": "layer: separate"}  # merged row -> separate row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8", help="decode batch sizes")
    p.add_argument("--layers", type=int, default=STEP_LAYERS, help="layers' weights, each on its own memory")
    p.add_argument("--tiny", action="store_true", help="1/32 of the 8B shape (a dry run, e.g. on the CPU)")
    p.add_argument("--rep", type=int, default=30)
    p.add_argument("--out", default="benchmarks/results/bench_projections.csv")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script")
    args = p.parse_args()
    print(env_info(), flush=True)
    dims = shapes(args.tiny)
    g = torch.Generator(device=args.device).manual_seed(0)
    layers = [layer_weights(dims, args.device, g) for _ in range(args.layers)]
    bandwidth = hbm_bandwidth(args.device) if args.device == "cuda" else None
    results = []
    for B in map(int, args.batches.split(",")):
        x = torch.randn(B, dims["q"][1], generator=g, device=args.device).to(torch.bfloat16)
        xf = torch.randn(B, dims["down"][1], generator=g, device=args.device).to(torch.bfloat16)
        err = check(x, layers[0])
        timed = {}
        per_layer = [rows_for(x, xf, w) for w in layers]
        for row, (_, names) in per_layer[0].items():
            us, mode = bench([rows[row][0] for rows in per_layer], rep=args.rep)
            nbytes = sum(layers[0][n].numel() * 2 for n in names)
            gbs = nbytes / (us * 1e-6) / 1e9
            timed[row] = us
            out = {"B": B, "row": row, "us_per_layer": us, "weight_mb": nbytes / 1e6, "GBps": gbs, "timing": mode}
            out["of_hbm"] = gbs / bandwidth if bandwidth else None
            out["saved_ms_per_step"] = (timed[PAIRS[row]] - us) * STEP_LAYERS / 1000 if row in PAIRS else None
            out["rel_err"] = err
            print(out, flush=True)
            results.append(out)
    write_csv(args.out, results)
    title = "Llama-3.1-8B layer projections, bf16" + (" (tiny)" if args.tiny else "")
    title += f", HBM {bandwidth:.0f} GB/s" if bandwidth else " (CPU dry run: wall clock)"
    cols = ["B", "row", "us_per_layer", "weight_mb", "GBps", "of_hbm", "saved_ms_per_step", "rel_err", "timing"]
    print_table(results, cols, title=title)


if __name__ == "__main__":
    main()
