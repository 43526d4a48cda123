"""Where the one-program top-k's time goes: ``topk_indices_kernel`` (``"row"``) taken apart on the GPU.

One command, a table printed last::

    python benchmarks/probe_topk.py [--shapes 8x8193x512,...] [--out probe_topk.csv]

Each part is its own kernel built from the shipped kernel's helpers (``_row_keys``, ``_select_threshold``,
``_store_selected``), one program per row, timed like ``bench_topk.py`` (a CUDA graph of 4 calls, median µs per
call, no flush) at 4, 8 and 16 warps:

- ``load``: load the row and its keys, store the row's largest key (the launch and the row's load);
- ``select``: ``load`` + the radix select with its early stop, store the threshold (the two-bit steps' share: ~10
  of the 16 on random scores);
- ``write``: ``load`` + the write of the selected indices (two block-wide prefix sums and the ``-1`` padding) from a
  threshold given as input (the k-th largest key, computed by torch beforehand);
- ``write1``: ``write`` with one prefix sum (every key ``>= t`` selected: right when no tie at ``t`` is left out);
- ``full``: the shipped kernel (``topk_indices(method="row")``), checked equal to the reference first.
The rows hold random scores with 4 ``+inf`` lanes (sink) and 3 ``-inf`` lanes (past the end), as in a decode step.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench, cpu_dry_run, env_info, print_table, write_csv

from hf_sparse_kv.ops import reference
from hf_sparse_kv.ops.triton.topk import _row_keys, _select_threshold, _store_selected, row_tiles, topk_indices

LAYERS = 4
WARPS = (4, 8, 16)
PARTS = ("load", "select", "write", "write1", "full")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run under TRITON_INTERPRET=1


@triton.jit
def probe_kernel(scores, thresholds, out, N, K, KK, BN: tl.constexpr, BK: tl.constexpr, PART: tl.constexpr):
    """One part of ``topk_indices_kernel`` on one tile of ``BN`` lanes (``PART``: 0 load, 1 select, 2 write, 3
    write with one prefix sum)."""
    i_r = tl.program_id(0).to(tl.int64)
    o_n = tl.arange(0, BN)
    b_s, b_key = _row_keys(scores + i_r * N, o_n, N)
    kk = KK + tl.zeros([], dtype=tl.int32)
    if PART == 0:
        tl.store(out + i_r * K, tl.max(b_key, 0).to(tl.int32, bitcast=True))
    elif PART == 1:
        t = _select_threshold(b_key, b_key, kk, BN, False, True)
        tl.store(out + i_r * K, t.to(tl.int32, bitcast=True))
    else:
        t = tl.load(thresholds + i_r).to(tl.uint32, bitcast=True)
        if PART == 2:
            n_gt = tl.sum((b_key > t).to(tl.int32), 0)
            _, n_sel = _store_selected(out + i_r * K, o_n, b_s, b_key, t, N, kk, n_gt, 0, 0)
        else:
            m_sel = (b_key >= t) & (b_s != float("-inf")) & (o_n < N)
            o_slot = tl.cumsum(m_sel.to(tl.int32), 0) - 1
            tl.store(out + i_r * K + o_slot, o_n.to(tl.int32), mask=m_sel)
            n_sel = tl.sum(m_sel.to(tl.int32), 0)
        for i_k in range(0, K, BK):
            o_k = i_k + tl.arange(0, BK)
            tl.store(out + i_r * K + o_k, tl.full([BK], -1, dtype=tl.int32), mask=(o_k >= n_sel) & (o_k < K))


def kth_keys(s: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest score of each row as the kernel's uint32 key, in int32 bits: ``[R]``."""
    bits = s.topk(k, dim=-1).values[:, -1].contiguous().view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) ^ -(2**31)


def part_op(part: str, s: torch.Tensor, t: torch.Tensor, k: int, warps: int):
    """``(launch, out)``: one launch of a part on scores ``s [R, N]`` (the row in one power-of-two tile) and the
    ``[R, k]`` int32 it writes (``full``: its own output)."""
    R, N = s.shape
    out = torch.empty(R, k, dtype=torch.int32, device=s.device)
    if part == "full":
        return partial(topk_indices, s, k, method="row", num_warps=warps), out
    BN = max(16, triton.next_power_of_2(N))
    grid = (R,)
    code = PARTS.index(part)
    launch = partial(
        probe_kernel[grid], s, t, out, N, k, min(k, N), BN=BN, BK=max(16, min(1024, triton.next_power_of_2(k))),
        PART=code, num_warps=warps,
    )  # fmt: skip
    return launch, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="8x8192x512,8x8193x512,8x2048x128,8x16384x1024", help="RxNxk,...")
    ap.add_argument("--out", help="write the table as CSV here")
    ap.add_argument("--rep", type=int, default=50)
    args = ap.parse_args()
    if DEVICE == "cpu":
        cpu_dry_run()
    print(env_info(), flush=True)
    rows = []
    for shape in args.shapes.split(","):
        R, N, k = (int(x) for x in shape.split("x"))
        g = torch.Generator(device=DEVICE).manual_seed(N + k)
        scores = [torch.randn(R, N, device=DEVICE, generator=g) for _ in range(LAYERS)]
        for s in scores:
            s[:, :4], s[:, -3:] = float("inf"), float("-inf")
        kth = [kth_keys(s, k) for s in scores]
        ref = reference.topk_indices(scores[0], k)
        assert torch.equal(topk_indices(scores[0], k, method="row"), ref)
        for part in ("write", "write1"):  # the parts that write indices write the reference's
            launch, out = part_op(part, scores[0], kth[0], k, 8)
            launch()
            assert torch.equal(out, ref), part
        row = {"R": R, "N": N, "k": k, "lanes": row_tiles(N)[0] + row_tiles(N)[1]}
        for part in PARTS:
            for w in WARPS:
                ops = [part_op(part, s, t, k, w)[0] for s, t in zip(scores, kth)]
                row[f"{part} w{w}"] = bench(ops, rep=args.rep, flush=False)[0]
        rows.append(row)
        print(row, flush=True)
    if args.out:
        write_csv(args.out, rows)
    columns = ["R", "N", "k"] + [f"{p} w{w}" for p in PARTS for w in WARPS]
    print_table(rows, columns, title=f"top-k parts, µs per call (median, CUDA graph of {LAYERS} calls)")


if __name__ == "__main__":
    main()
