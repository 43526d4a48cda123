"""The top-k of selection alone: ``topk_indices``'s two methods (one program per row, a row spread over chunks)
against each other, against what the launcher ran before (the one-program kernel, ``torch.topk`` past 24576 entries)
and against ``torch.topk``.

One command on the GPU, a table printed last::

    python benchmarks/bench_topk.py [--out results.csv] [--shapes 8x8193x512,...] [--knobs] [--no-sweep]

Rows are (rows R = batch × KV heads, entries N per row, k): the shapes a Llama-3-8B layer selects from (8 KV heads):
1 × 128K in 16-token blocks at 1/16 (8 × 8193, 8193 = the prompt's blocks plus the decoded tokens; 8209 further on),
batch 8 and 4 of the same (64, 32 rows), 1 × 32K (8 × 2048 blocks), token-mode selection over 128K positions at
1/16 (8 × 131073, k 8192) and batch 8 × 32K tokens (64 × 32769, k 2048). Providers: ``row`` (one program per row;
``n/a`` past 24576 entries), ``row_all_steps`` (the same without the early stop of its radix select: all 16 steps,
the kernel before it), ``chunks`` (the multi-program select at its default chunking), ``b256`` ... ``b2048``
(the same with that many lanes per chunk), ``auto`` (what the launcher picks from the shape, as shipped), ``torch``
(``torch.topk`` + sort: ``reference.topk_indices``), ``old`` (what the launcher ran before ``chunks``: ``row`` up to
24576 entries, ``torch`` past). ``--knobs`` adds the one-program kernel's knobs (one tile, 4 / 8 / 16 warps).

Checked first, on every shape, for every provider: the same indices as the reference on random scores (with forced
``+inf`` and past-the-end ``-inf`` entries); on integer scores (ties everywhere) the same as the reference on those
scores with ties broken by index (the kernels give ties at the threshold to the lowest indices); and ``auto`` with
per-sequence counts (2 or 8 rows a sequence; counts 0, below k, k, above k) as the reference. Times: ``common.bench``, a
CUDA graph of 4 calls (one per layer, each on its own scores), median per call in µs, L2 not flushed (in a decode
step the scores were just written by the scoring kernel). Launch overhead is what a captured decode step pays, not
Python's.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench, cpu_dry_run, env_info, print_table, write_csv

from hf_sparse_kv.ops import reference
from hf_sparse_kv.ops.layout import cdiv
from hf_sparse_kv.ops.triton.topk import TOPK_MAX_N, chunk_tiles, num_sms, topk_indices, topk_method

SHAPES = "8x8193x512,8x8209x512,64x8193x512,8x2048x128,8x131073x8192,64x32769x2048,32x8193x512"
LAYERS = 4
LANES = (256, 512, 1024, 2048)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of tiny --shapes under TRITON_INTERPRET=1


def by_index(s: torch.Tensor) -> torch.Tensor:
    """Integer-valued scores with ties broken toward the lower index (``+inf`` above every finite score)."""
    d = s.double().masked_fill(s == float("inf"), 1e9)
    return d - torch.arange(s.shape[-1], dtype=torch.float64, device=s.device) * 1e-7


def providers(N: int, knobs: bool, sweep: bool) -> dict:
    """name -> ``op(scores, k)``."""
    ops = {}
    if N <= TOPK_MAX_N:
        ops["row"] = partial(topk_indices, method="row")
        ops["row_all_steps"] = partial(topk_indices, method="row", early=False)  # before the early stop
    ops["chunks"] = partial(topk_indices, method="chunks")
    for lanes in LANES if sweep else ():
        ops[f"b{lanes}"] = partial(topk_indices, method="chunks", chunks=cdiv(N, lanes))
    ops["auto"] = topk_indices
    if knobs and N <= TOPK_MAX_N:
        ops["one_tile"] = partial(topk_indices, method="row", split=False)
        ops.update({f"w{w}": partial(topk_indices, method="row", num_warps=w) for w in (4, 8, 16)})
    ops["torch"] = reference.topk_indices
    return ops


def check(ops: dict, R: int, N: int, k: int, g: torch.Generator) -> None:
    """Every provider against the reference: random scores, integer scores (ties), per-sequence counts."""
    s = torch.randn(R, N, device=DEVICE, generator=g)
    s[:, :4], s[:, -3:] = float("inf"), float("-inf")
    ties = torch.randint(-20, 21, (R, N), device=DEVICE, generator=g).float()
    ties[:, -3:] = float("-inf")
    ref, ref_ties = reference.topk_indices(s, k), reference.topk_indices(by_index(ties), k)
    for name, op in ops.items():
        assert torch.equal(op(s, k), ref), (name, R, N, k)
        if name != "torch":  # torch.topk's order of ties is unspecified
            assert torch.equal(op(ties, k), ref_ties), (name, "ties", R, N, k)
    s3 = s.view(-1, 2 if R <= 8 else 8, N)  # [B, H, N]
    counts = torch.tensor([(0, k // 3, k, k + 5)[b % 4] for b in range(s3.shape[0])], device=DEVICE)
    assert torch.equal(topk_indices(s3, k, counts), reference.topk_indices(s3, k, counts)), ("counts", R, N, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="RxNxk,... (rows, entries per row, k)")
    ap.add_argument("--out", help="write the table as CSV here")
    ap.add_argument("--knobs", action="store_true", help="also the one-program kernel's knobs (one tile, warps)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the lanes-per-chunk sweep (b256 ... b2048)")
    ap.add_argument("--rep", type=int, default=50)
    args = ap.parse_args()
    if DEVICE == "cpu":
        cpu_dry_run()
    print(env_info(), flush=True)
    sms = num_sms(torch.device(DEVICE))
    rows = []
    for shape in args.shapes.split(","):
        R, N, k = (int(x) for x in shape.split("x"))
        g = torch.Generator(device=DEVICE).manual_seed(N + k)
        ops = providers(N, args.knobs, not args.no_sweep)
        check(ops, R, N, k, g)
        scores = [torch.randn(R, N, device=DEVICE, generator=g) for _ in range(LAYERS)]
        for s in scores:
            s[:, :4] = float("inf")  # forced blocks (sink)
            s[:, -3:] = float("-inf")  # past the end
        block, C = chunk_tiles(R, N, sms)
        row = {"R": R, "N": N, "k": k, "auto is": topk_method(N), "chunks of": f"{C}x{block}"}
        for name, op in ops.items():
            row[name] = bench([partial(op, s, k) for s in scores], rep=args.rep, flush=False)[0]
        row["old"] = row.get("row", row["torch"])
        row["old/auto"] = row["old"] / row["auto"]
        row["torch/auto"] = row["torch"] / row["auto"]
        rows.append(row)
        print(row, flush=True)
    if args.out:
        write_csv(args.out, rows)
    columns = ["R", "N", "k", "auto is", "chunks of", "row", "chunks"]
    columns += [] if args.no_sweep else [f"b{lanes}" for lanes in LANES]
    columns += ["one_tile", "w4", "w8", "w16"] if args.knobs else []
    columns += ["auto", "torch", "old", "old/auto", "torch/auto"]
    print_table(rows, columns, title=f"top-k, µs per call (median, CUDA graph of {LAYERS} calls), checked first")


if __name__ == "__main__":
    main()
