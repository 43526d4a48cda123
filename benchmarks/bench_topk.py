"""The top-k of block selection alone: ``topk_indices_kernel`` (Triton radix select) against ``torch.topk``.

One command on the GPU, a table printed last::

    python benchmarks/bench_topk.py

Rows are (rows R = batch × KV heads, blocks N per row, k): the shapes a Llama-3-8B layer selects from (8 KV heads;
batch 1 and 8; 32K-256K tokens in blocks of 16 or 64; budgets 1/8 and 1/16). Providers: the kernel (one program
per row, 2-bit radix select: 16 block-wide reductions) and the reference (``torch.topk`` + sort, what
``backend="reference"`` runs). Each result is checked against the reference first (same indices). Times:
``triton.testing.do_bench``, median, µs. Rows with N just above a power of two (8200) show the cost of the
power-of-two tile (the kernel holds the row in one tile of ``next_power_of_2(N)`` lanes).
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import env_info, print_table

from hf_sparse_kv.ops import reference
from hf_sparse_kv.ops.triton.block_scores import topk_indices

SHAPES = [(8, 2048, 128), (8, 2048, 256), (8, 8192, 512), (8, 8192, 1024), (8, 16384, 1024), (64, 2048, 128)]
SHAPES += [(64, 8192, 512), (64, 512, 32), (8, 8200, 512)]


def main() -> None:
    print(env_info(), flush=True)
    rows = []
    for R, N, k in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(N + k)
        s = torch.randn(R, N, device="cuda", generator=g)
        s[:, :4] = float("inf")  # forced blocks (sink)
        s[:, -3:] = float("-inf")  # past the end
        ref = reference.topk_indices(s, k)
        row = {"R": R, "N": N, "k": k}
        for name, op in {"kernel_us": topk_indices, "torch_us": reference.topk_indices}.items():
            fn = partial(op, s, k)
            assert torch.equal(fn(), ref), (name, R, N, k)
            row[name] = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median") * 1000
        row["torch/kernel"] = row["torch_us"] / row["kernel_us"]
        for warps in (4, 8, 16, 32):  # the launch heuristic's choice against the others
            row[f"w{warps}_us"] = (
                triton.testing.do_bench(
                    partial(topk_indices, s, k, num_warps=warps), warmup=50, rep=200, return_mode="median"
                )
                * 1000
            )
        rows.append(row)
        print(row, flush=True)
    print_table(
        rows,
        ["R", "N", "k", "kernel_us", "torch_us", "torch/kernel", "w4_us", "w8_us", "w16_us", "w32_us"],
        title="top-k, µs (median)",
    )


if __name__ == "__main__":
    main()
