"""KV memory held and peak GPU memory of generate() on a Llama-3.1-8B-shaped model: does eviction shrink memory?

One command on the GPU, a table printed last, a CSV written::

    python benchmarks/bench_memory.py --out benchmarks/results/bench_memory.csv

Method. The model of ``bench_e2e.py`` (32 layers, 32/8 heads, head dim 128, random weights, bf16). For each prompt
length, each row calls ``generate()`` on a random prompt for ``--new`` tokens (greedy, EOS ignored) and reads,
after the call: the KV bytes the cache holds (blocks in use, metadata included, or the DynamicCache's tensors for
the unpatched model), the bytes its pools have allocated (free blocks included), and the peak GPU memory of the
call above the weights. Rows: unpatched ``sdpa``; patched ``Dense()`` and ``Quest`` 1/16 (selection only: they keep
every block); ``SnapKV`` at 1/4 and 1/8 (compressed at the first decode step, then the pool is compacted);
``SnapKV`` 1/4 with ``Quest`` 1/16 on top; ``SinkWindow(evict=True)`` at 1/8 of the context and with a fixed
512-token window (every layer sparse). Random weights say
nothing about quality (the evaluation recipes measure it); memory depends only on the shapes and the policy.

``--device cpu`` runs the same on the CPU (reference backend, no peak column): the bytes held and allocated do not
depend on the device, so a few layers and a long generation show how memory evolves where the GPU is not at hand.

The peak of a long prompt is set by its prefill (every policy holds the whole prompt until the first decode
step); what eviction buys is the memory held while decoding, which is what lets a server keep more sequences.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import build_model, sync
from common import env_info, print_table, write_csv

from hf_sparse_kv import PagedKVCache, patch_model, unpatch_model
from hf_sparse_kv.policies import Dense, Quest, SinkWindow, SnapKV

GB = 1e9

ROWS = [  # (name, policy, dense_layers); None: the unpatched model
    ("unpatched sdpa", None, ()),
    ("patched Dense", Dense(), (0, 1)),
    ("Quest 1/16", Quest(budget=0.0625), (0, 1)),
    ("SnapKV 1/4", SnapKV(budget=0.25), (0, 1)),
    ("SnapKV 1/8", SnapKV(budget=0.125), (0, 1)),
    ("SnapKV 1/4 + Quest 1/16", SnapKV(budget=0.25, then=Quest(budget=0.0625)), (0, 1)),
    ("SinkWindow 1/8 evict", SinkWindow(sink=4, budget=0.125, evict=True), ()),
    ("SinkWindow 4+512 evict", SinkWindow(sink=4, window=512, evict=True), ()),  # a fixed window: flat memory
]


def cache_bytes(cache) -> tuple[float, float]:
    """(bytes held, bytes allocated) of a generate() cache."""
    if isinstance(cache, PagedKVCache):
        return cache.memory_bytes(), cache.capacity_bytes()  # Llama has no sliding-window layers
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return held, held


def run_row(model, policy, dense_layers, batch: int, length: int, new: int, device) -> dict:
    if policy is not None:
        patch_model(model, policy=policy, mode="block", dense_layers=dense_layers)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), device=device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, return_dict_in_generate=True
        )  # fmt: skip
    sync(device)
    seconds = time.perf_counter() - t0
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    held, allocated = cache_bytes(cache)
    row = {
        "held_GB": held / GB,
        "allocated_GB": allocated / GB,
        "peak_GB": (torch.cuda.max_memory_allocated() - base) / GB if cuda else None,
        "generate_s": seconds,
    }
    if isinstance(cache, PagedKVCache):
        row["blocks"] = cache.blocks_in_use
    del out, cache
    if policy is not None:
        unpatch_model(model)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1x32768,1x131072", help="BxL prompt shapes")
    p.add_argument("--new", type=int, default=128, help="tokens generated per call")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--rows", default="", help="comma-separated row names to keep (default: all)")
    p.add_argument("--out", default="benchmarks/results/bench_memory.csv")
    p.add_argument("--device", default="cuda", help="cuda, or cpu (no peak: the held and allocated bytes only)")
    args = p.parse_args()
    print(env_info())
    device = torch.device(args.device)
    model = build_model(args.layers, args.device)
    keep = {r.strip() for r in args.rows.split(",") if r.strip()}
    rows = []
    for shape in args.shapes.split(","):
        batch, length = (int(x) for x in shape.split("x"))
        for name, policy, dense_layers in ROWS:
            if keep and name not in keep:
                continue
            row = {"batch": batch, "prompt": length, "new": args.new, "row": name}
            row.update(run_row(model, policy, dense_layers, batch, length, args.new, device))
            rows.append(row)
            print(row, flush=True)
    dense = {(r["batch"], r["prompt"]): r["held_GB"] for r in rows if r["row"] == "unpatched sdpa"}
    for r in rows:
        ref = dense.get((r["batch"], r["prompt"]))
        r["held_pct"] = 100 * r["held_GB"] / ref if ref else None
    write_csv(args.out, rows)
    columns = ["batch", "prompt", "row", "held_GB", "allocated_GB", "peak_GB", "held_pct", "generate_s"]
    print_table(rows, columns, title=f"KV memory after generate() of {args.new} tokens ({args.layers} layers, bf16)")


if __name__ == "__main__":
    main()
