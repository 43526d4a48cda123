"""Why SnapKV 1/4 + Quest 1/16 is not faster than Quest 1/16 at 1 x 128K (benchmarks/RESULTS.md, 2026-12-05): Quest's
selection over a block table three quarters freed (``-1``, as SnapKV leaves it) against a full one.

    python benchmarks/probe_holes.py [--context 131072] [--freed 0.75] [--out probe_holes.csv]

Llama-3-8B layer (8 KV heads, 32 query heads, D 128), bf16, blocks of 16, batch 1; per layer (a CUDA graph of 4 calls,
each on its own cache, the L2 flushed by reads; ``common.bench``): ``scores`` (``block_scores``, quest, the sink and
window forced), ``topk`` (``topk_indices`` of those scores at the static width of 1/16 of the context, the count on
the device), both on the full table and on the freed one (the freed blocks drawn at random, the first and the last
blocks kept), on the freed table with its freed slots read as the pool's first block (the loads of the scoring
kernel before it masked them by the table entry: the top-k of those finite scores is not the freed table's), and on a
table compacted to the held blocks (a quarter of the width: what scoring and top-k would cost
if the freed slots were dropped from the table). The freed rows' selections are checked to hold no freed block. A
table printed last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench, env_info, print_table, write_csv

from hf_sparse_kv.ops import get_ops
from hf_sparse_kv.policies.base import static_width

LAYERS = 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--freed", type=float, default=0.75, help="share of the blocks freed")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="benchmarks/results/probe_holes.csv")
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ops = get_ops("auto", device)
    BS, Hkv, Hq, D = 16, 8, 32, 128
    nblk = a.context // BS
    g = torch.Generator().manual_seed(0)
    k = static_width(nblk // 16)
    seq_lens = torch.tensor([a.context], dtype=torch.int32, device=device)
    start = torch.zeros(1, dtype=torch.int32, device=device)
    counts = torch.tensor([nblk // 16], dtype=torch.long, device=device)
    full = torch.randperm(nblk, generator=g).int().view(1, -1).to(device)  # a block table: a permutation of the pool
    freed = full.clone()
    drop = torch.randperm(nblk - 8, generator=g)[: int(a.freed * nblk)] + 4  # keep the first and the last blocks
    freed[0, drop.to(device)] = -1
    layers = []
    for _ in range(LAYERS):
        q = torch.randn(1, Hq, D, generator=g).to(device, dtype)
        kmin = torch.randn(nblk, Hkv, D, generator=g).to(device, dtype)
        kmax = kmin + torch.rand(nblk, Hkv, D, generator=g).to(device, dtype)
        layers.append((q, kmin, kmax, kmax))
    # the freed slots pointing at the pool's first block: the metadata reads of the scoring kernel before its loads
    # were masked by the table entry (every freed slot read block 0's min/max, one hot line for the whole grid)
    block0 = freed.clamp(min=0)
    held_ids = freed[freed >= 0].view(1, -1)  # what a table compacted to the held blocks would hold
    compact_lens = torch.tensor([held_ids.shape[1] * BS], dtype=torch.int32, device=device)
    rows = []
    for name, table, lens in (
        ("full", full, seq_lens),
        ("freed", freed, seq_lens),
        ("freed read as block 0", block0, seq_lens),
        ("compact", held_ids, compact_lens),
    ):

        def scores(layer, table=table, lens=lens):
            q, kmin, kmax, kmean = layer
            return ops.block_scores(q, kmin, kmax, kmean, table, lens, BS, "quest", start, 4, 32)

        s = [scores(layer) for layer in layers]
        picked = ops.topk_indices(s[0], k, counts)
        if name == "freed":
            held = (freed[0] >= 0).cpu()
            got = picked[picked >= 0].long().cpu()
            assert bool(held[got].all()), "a freed block was selected"
        us_scores, how = bench([lambda layer=layer: scores(layer) for layer in layers])
        us_topk, _ = bench([lambda x=x: ops.topk_indices(x, k, counts) for x in s])
        finite = float(torch.isfinite(s[0]).float().mean())
        rows.append({"table": name, "width": table.shape[1], "finite_share": round(finite, 3), "k": k,
                     "scores_us": round(us_scores, 1), "topk_us": round(us_topk, 1), "timed": how})  # fmt: skip
        print(rows[-1], flush=True)
    write_csv(a.out, rows)
    print(env_info())
    print_table(rows, list(rows[0]))


if __name__ == "__main__":
    main()
