"""The decode-step matmul kernel (``ops/triton/linear.py``) against cuBLAS (``F.linear``) on a Llama-3.1-8B layer's
merged projections at batch 1 and 8: does a Triton kernel read the small weights (``o``, ``qkv``) closer to the HBM
bandwidth than cuBLAS's 60-77 % (benchmarks/RESULTS.md, "Merged projections")? One command on the GPU::

    python benchmarks/bench_linear.py --out benchmarks/results/bench_linear.csv

Method. Per batch ``B`` and projection (``qkv`` 6144 × 4096, ``o`` 4096 × 4096, ``gate_up`` 28672 × 4096, ``down``
4096 × 14336; bf16): ``--layers`` weights each on its own memory (a decode step's worth), ``common.bench`` times one
call per layer in sequence inside one CUDA graph, the L2 flushed by reads before each replay, median per layer.
Rows: ``cublas`` (``F.linear``) and every configuration ``(BN, BK, warps, stages[, "sum"])`` of the sweep (``sum``:
the one-token variant without tensor cores, at B = 1 only), each checked first
against the float32 product (relative error ≤ 1e-2, no NaN; a configuration that fails to build or to match is
reported and skipped). Columns: µs per layer, GB/s and the fraction of the copy bandwidth measured in the same run,
and for each (projection, B) the best configuration's time against cuBLAS; the last table sums a layer (the four
projections) for cuBLAS, the shipped rule (``linear.choose``: a configuration or cuBLAS) and each projection's best,
with the saving per 32-layer step.

A dry run on the CPU (tiny shapes, Triton's interpreter, wall clock)::

    python benchmarks/bench_linear.py --device cpu --tiny --layers 2 --configs 16,128,4,2 --out /tmp/bench_linear.csv
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench, cpu_dry_run, env_info, hbm_bandwidth, print_table, write_csv

STEP_LAYERS = 32
PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def parse_config(text: str) -> tuple:
    """``"BN,BK,W,S[,sum]"`` (a CSV's ``config`` cell, one of ``--configs``) -> ``decode_linear``'s ``config``."""
    return tuple(v if v == "sum" else int(v) for v in text.split(","))


def configs(spec: str | None) -> list[tuple]:
    """The sweep's ``(BN, BK, warps, stages[, "sum"])``, or those ``spec`` lists (``BN,BK,W,S;...``)."""
    if spec:
        return [parse_config(c) for c in spec.split(";")]
    dot = list(itertools.product((16, 32), (256, 512), (4, 8), (3, 4)))
    dot += list(itertools.product((64,), (128, 256), (4,), (3,)))
    return dot + [(*c, "sum") for c in itertools.product((4, 8, 16), (512, 1024), (4,), (2, 3))]


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--layers", type=int, default=STEP_LAYERS)
    p.add_argument("--configs", default=None, help="BN,BK,warps,stages;... (default: the sweep)")
    p.add_argument("--tiny", action="store_true", help="1/32 of each projection (a dry run)")
    p.add_argument("--rep", type=int, default=30)
    p.add_argument("--out", default="benchmarks/results/bench_linear.csv")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    if args.device == "cpu":
        cpu_dry_run()
    from hf_sparse_kv.ops.triton.linear import choose, decode_linear

    print(env_info(), flush=True)
    g = torch.Generator(device=args.device).manual_seed(0)
    dims = {n: ((o // 32, i // 32) if args.tiny else (o, i)) for n, (o, i) in PROJECTIONS.items()}
    weights = {
        n: [
            (torch.randn(o, i, generator=g, device=args.device) * i**-0.5).to(torch.bfloat16)
            for _ in range(args.layers)
        ]
        for n, (o, i) in dims.items()
    }
    bandwidth = hbm_bandwidth(args.device) if args.device == "cuda" else None
    sweep = configs(args.configs)
    rows, best = [], {}
    for B in map(int, args.batches.split(",")):
        for name, (o, i) in dims.items():
            x = torch.randn(B, i, generator=g, device=args.device).to(torch.bfloat16)
            ref = F.linear(x.float(), weights[name][0].float())
            nbytes = o * i * 2

            def row(label, us, err, cfg=None, B=B, name=name, nbytes=nbytes):
                gbs = nbytes / (us * 1e-6) / 1e9
                r = {"B": B, "proj": name, "row": label, "us_per_layer": us, "GBps": gbs, "rel_err": err}
                r["of_hbm"] = gbs / bandwidth if bandwidth else None
                r["config"] = cfg
                rows.append(r)
                return r

            us, _ = bench([lambda w=w, x=x: F.linear(x, w) for w in weights[name]], rep=args.rep)
            base = row("cublas", us, rel_err(F.linear(x, weights[name][0]), ref))
            print(base, flush=True)
            shipped = choose(o, i, B)
            for cfg in sweep + ([shipped] if shipped and shipped not in sweep else []):
                if cfg[4:] == ("sum",) and B != 1:
                    continue
                try:
                    err = rel_err(decode_linear(x, weights[name][0], config=cfg), ref)
                    if not err <= 1e-2:
                        print(f"B={B} {name} {cfg}: relative error {err}, skipped", flush=True)
                        continue
                    calls = [lambda w=w, x=x, cfg=cfg: decode_linear(x, w, config=cfg) for w in weights[name]]
                    us, _ = bench(calls, rep=args.rep)
                except Exception as e:  # noqa: BLE001 - a configuration that does not build (registers, shared memory)
                    print(f"B={B} {name} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                r = row("default" if cfg == shipped else "triton", us, err, ",".join(map(str, cfg)))
                print(f"B={B} {name} {r['config']}: {us:.2f} us", flush=True)
                key = (B, name)
                if key not in best or us < best[key]["us_per_layer"]:
                    best[key] = r
            b = best.get((B, name))
            if b:
                print(f"B={B} {name}: cublas {base['us_per_layer']:.1f} us, best {b['config']} {b['us_per_layer']:.1f}")
    write_csv(args.out, rows)
    summary = []
    for B in map(int, args.batches.split(",")):
        for name, (o, i) in dims.items():
            pick = [r for r in rows if r["B"] == B and r["proj"] == name]
            cub = next(r for r in pick if r["row"] == "cublas")
            dflt = next((r for r in pick if r["row"] == "default"), None)
            if choose(o, i, B) is None:  # the rule says cuBLAS
                dflt = {"us_per_layer": cub["us_per_layer"], "config": "cublas"}
            b = best.get((B, name))
            summary.append(
                {
                    "B": B,
                    "proj": name,
                    "cublas_us": cub["us_per_layer"],
                    "cublas_of_hbm": cub["of_hbm"],
                    "default": dflt and dflt["config"],
                    "default_us": dflt and dflt["us_per_layer"],
                    "best_us": b and b["us_per_layer"],
                    "best_of_hbm": b and b["of_hbm"],
                    "best_config": b and b["config"],
                }
            )
        layer = [s for s in summary if s["B"] == B]
        tot = {k: sum(s[k] or 0.0 for s in layer) for k in ("cublas_us", "best_us")}
        tot["default_us"] = None if any(s["default_us"] is None for s in layer) else sum(s["default_us"] for s in layer)

        def saved(us, cublas=tot["cublas_us"]):
            return us and f"{(cublas - us) * STEP_LAYERS / 1000:.3f}"

        summary.append(
            {
                "B": B,
                "proj": "layer",
                **tot,
                "default": f"saved/step ms: {saved(tot['default_us'])}",
                "best_config": f"saved/step ms: {saved(tot['best_us'])}",
            }
        )
    cols = ["B", "proj", "cublas_us", "cublas_of_hbm", "default", "default_us", "best_us", "best_of_hbm", "best_config"]
    title = "decode_linear against cuBLAS, Llama-3.1-8B merged projections, bf16"
    title += f", HBM {bandwidth:.0f} GB/s" if bandwidth else " (CPU dry run: wall clock)"
    print_table(summary, cols, title=title)


if __name__ == "__main__":
    main()
