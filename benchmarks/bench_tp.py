"""Tensor parallelism: decode speed and KV memory per rank of a Llama-3.1-8B-shaped model at 1 x 128K, on two GPUs
(transformers' ``tp_plan="auto"``) against one. One command, a table printed last, a CSV written::

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_tp.py --out benchmarks/results/bench_tp.csv
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_tp.py --tiny --device cpu --out /tmp/bench_tp.csv

(the second is a dry run of the script on the CPU: gloo ranks, a tiny model of 4 layers, ~15 s on 2 cores).

Method. Rank 0 builds the model with random bf16 weights (``bench_e2e.build_model``: 32 layers, 32 query / 8 KV
heads, head dim 128, hidden 4096, FFN 14336) and saves it to a temporary folder. It first times the model on its own
GPU (the other ranks wait), then every rank loads the folder with ``DistributedConfig(tp_plan="auto")``: each holds
half of every layer's heads, so half of the KV cache. On each setup the caches are filled with random keys and values
of the context (``bench_e2e.fill_caches``: a ``DynamicCache`` for the unpatched model, a ``PagedKVCache`` for the
patched rows; a rank fills its share of the KV heads) and each row decodes ``--steps`` tokens after ``--warmup``
(``bench_e2e.time_decode``: device-synchronised steps, median). Rows: unpatched SDPA, patched Dense and
Quest(budget=1/16) (``mode="block"``), eager and with ``cuda_graph=True``. A graph row says whether its steps replayed
a captured graph (``captured``); a row that raised says why (``note``).

Columns: ms/token (median; under TP the slowest rank), speedup of two GPUs over one (same row), KV MB held per rank,
KV MB read per decode step per rank, peak GB per rank (the largest), captured, note.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import build_model, fill_caches, llama8b_config, peak_gb, reset_peak, time_decode
from common import env_info, print_table, write_csv

from hf_sparse_kv import cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.policies import Dense, Quest

ROWS = [  # (name, policy: None = unpatched, cuda_graph); graph rows last: a failed capture leaves nothing behind
    ("unpatched sdpa", None, False),
    ("Dense", Dense(), False),
    ("Quest 1/16", Quest(budget=0.0625), False),
    ("graph: Dense", Dense(), True),
    ("graph: Quest 1/16", Quest(budget=0.0625), True),
]


def tiny_config():
    """The 8B shape's ratios at a size the CPU runs in seconds (8 query / 4 KV heads: two ranks get two each)."""
    cfg = llama8b_config(4)
    cfg.update({"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8})
    cfg.update({"num_key_value_heads": 4, "head_dim": 32})
    return cfg


def captured(model, cache, context: int) -> bool:
    """Whether a decode step at ``context`` replays a captured graph (one extra step, cropped back after)."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    with torch.no_grad():
        model(ids, position_ids=torch.full((1, 1), context, device=model.device), **{cache_kwarg(model): cache})
    runner = cache.session.graphs  # the captured-graph runner, False or None when the step ran eagerly
    cache.crop(context - cache.get_seq_length())
    return bool(runner) and runner.capture and runner.replays > 0


def run_rows(model, setup: str, args, kv_heads: int, world: int) -> list[dict]:
    """Every row of :data:`ROWS` on ``model`` (one rank's share under TP) at 1 x ``args.context``."""
    device = str(model.device)
    dense, paged = fill_caches(model, 1, args.context, args.block_size, device, kv_heads)
    dense_bytes = sum(t.numel() * t.element_size() for k, v, *_ in dense for t in (k, v))
    rows = []
    for name, policy, graph in [r for r in ROWS if not args.rows or r[0] in args.rows.split(",")]:
        row = {"setup": setup, "ranks": world, "row": name, "context": args.context, "note": ""}
        cache = dense if policy is None else paged
        if policy is not None:
            patch_model(model, policy=policy, mode="block", block_size=args.block_size, cuda_graph=graph)
        torch.manual_seed(0)  # the same input ids on every rank
        reset_peak()
        read0, steps0 = int(getattr(cache, "kv_bytes_read", 0)), getattr(cache, "decode_steps", 0)
        try:
            times = time_decode(model, cache, 1, args.context, args.steps, args.warmup)
            row["ms_per_token"] = 1000 * statistics.median(times)
            if policy is not None:
                read = (int(paged.kv_bytes_read) - read0) / max(paged.decode_steps - steps0, 1)
                row["kv_mb_read_per_step_per_rank"] = read / 1e6
            if graph:
                row["captured"] = captured(model, paged, args.context)
        except Exception as e:  # noqa: BLE001 - a row that cannot run says why; the others still run
            row["note"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        finally:
            unpatch_model(model)
        row["kv_mb_per_rank"] = (dense_bytes if policy is None else paged.memory_bytes()) / 1e6
        row["peak_gb_per_rank"] = peak_gb()
        rows.append(row)
        print(f"[{setup}, rank {dist.get_rank()}] {row}", flush=True)
    return rows


def merge(per_rank: list[list[dict]]) -> list[dict]:
    """One row per (setup, row): the slowest rank's time, the largest peak, rank 0's other columns."""
    merged = []
    for rows in zip(*per_rank):
        row = dict(rows[0])
        times = [r.get("ms_per_token") for r in rows]
        row["ms_per_token"] = None if None in times else max(times)
        peaks = [r.get("peak_gb_per_rank") for r in rows]
        row["peak_gb_per_rank"] = None if None in peaks else max(peaks)
        row["note"] = "; ".join(dict.fromkeys(r["note"] for r in rows if r["note"]))
        merged.append(row)
    return merged


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=None, help="tokens in the cache (default 131072; --tiny: 2048)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rows", default="", help="comma-separated row names to keep (default: all)")
    p.add_argument("--tiny", action="store_true", help="a tiny model of the same ratios (a dry run, e.g. on the CPU)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tmpdir", default=None, help="where rank 0 saves the random model (16 GB for the 8B shape)")
    p.add_argument("--out", default="benchmarks/results/bench_tp.csv")
    args = p.parse_args()
    args.context = args.context or (2048 if args.tiny else 131072)
    from transformers import AutoModelForCausalLM, DistributedConfig

    cuda = args.device == "cuda"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    # rank 0 times one GPU while the others wait: a long wait must not time the group out
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=30))
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    folder = [tempfile.mkdtemp(prefix="bench_tp_", dir=args.tmpdir) if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    single: list[dict] = []
    if rank == 0:
        print(env_info(), flush=True)
        model = build_model(2, device, tiny_config() if args.tiny else llama8b_config(32))
        model.save_pretrained(folder[0])
        kv = model.config.num_key_value_heads
        single = run_rows(model, "1 GPU" if cuda else "1 process", args, kv, 1)
        del model
        if cuda:
            torch.cuda.empty_cache()
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(
        folder[0], distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.bfloat16
    ).eval()
    kv = model.config.num_key_value_heads // world
    setup = f"{world} GPUs TP" if cuda else f"{world} processes TP"
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, run_rows(model, setup, args, kv, world))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder[0], ignore_errors=True)
        tp = merge(per_rank)
        base = {r["row"]: r.get("ms_per_token") for r in single}
        for r in tp:
            one = base.get(r["row"])
            r["speedup_vs_1"] = one / r["ms_per_token"] if one and r["ms_per_token"] else None
        rows = single + tp
        write_csv(args.out, rows)
        cols = ["setup", "row", "ms_per_token", "speedup_vs_1", "kv_mb_per_rank", "kv_mb_read_per_step_per_rank"]
        cols += ["peak_gb_per_rank", "captured", "note"]
        shape = "tiny Llama (4 layers, 8/4 heads, head dim 32)" if args.tiny else "Llama-3.1-8B shape (32 layers)"
        print_table(rows, cols, title=f"{shape}, bf16, 1 x {args.context} tokens, block_size {args.block_size}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
