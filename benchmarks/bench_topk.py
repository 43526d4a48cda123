"""The top-k of block selection alone: ``topk_indices_kernel`` (Triton radix select) and its knobs against ``torch.topk``.

One command on the GPU, a table printed last::

    python benchmarks/bench_topk.py

Rows are (rows R = batch × KV heads, blocks N per row, k): the shapes a Llama-3-8B layer selects from (8 KV heads;
batch 1 and 8; 32K-256K tokens in blocks of 16 or 64; budgets 1/8 and 1/16), and rows just above a power of two
(8200, 16400: a prompt plus decoded tokens). Providers: the kernel as shipped (a row held in one or two tiles), the same
with one power-of-two tile, with forced warps, and the reference (``torch.topk`` + sort, what ``backend="reference"`` runs). Each result is checked
against the reference first (same indices). Times: ``common.bench``, a CUDA graph of 4 calls (one per layer, each
on its own scores), median per call in µs, L2 not flushed (in a decode step the scores were just written by the
scoring kernel). Launch overhead is what a captured decode step pays, not Python's.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench, env_info, print_table

from hf_sparse_kv.ops import reference
from hf_sparse_kv.ops.triton.topk import row_tiles, topk_indices

SHAPES = [(8, 2048, 128), (8, 2048, 256), (8, 8192, 512), (8, 8192, 1024), (8, 16384, 1024), (64, 2048, 128)]
SHAPES += [(64, 8192, 512), (64, 512, 32), (8, 8200, 512), (8, 16400, 1024), (64, 8200, 512)]
LAYERS = 4


def main() -> None:
    print(env_info(), flush=True)
    rows = []
    variants = {
        "kernel": {},
        "one_tile": {"split": False},
        **{f"w{w}": {"num_warps": w} for w in (4, 8, 16)},
    }
    for R, N, k in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(N + k)
        scores = [torch.randn(R, N, device="cuda", generator=g) for _ in range(LAYERS)]
        for s in scores:
            s[:, :4] = float("inf")  # forced blocks (sink)
            s[:, -3:] = float("-inf")  # past the end
        ref = reference.topk_indices(scores[0], k)
        row = {"R": R, "N": N, "k": k, "tiles": "+".join(str(t) for t in row_tiles(N) if t)}
        ops = {name: partial(topk_indices, **kw) for name, kw in variants.items()}
        ops["torch"] = reference.topk_indices
        for name, op in ops.items():
            assert torch.equal(op(scores[0], k), ref), (name, R, N, k)
            row[name] = bench([partial(op, s, k) for s in scores], rep=50, flush=False)[0]
        row["torch/kernel"] = row["torch"] / row["kernel"]
        rows.append(row)
        print(row, flush=True)
    print_table(
        rows,
        ["R", "N", "k", "tiles", "kernel", "one_tile", "w4", "w8", "w16", "torch", "torch/kernel"],
        title=f"top-k, µs per call (median, CUDA graph of {LAYERS} calls)",
    )


if __name__ == "__main__":
    main()
