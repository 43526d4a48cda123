"""Where a suite grid's device time goes, on a random-weight model of a suite model's shape (no model file needed):
the simulated perplexity of one window under every cell of the grid (the suite's ``perplexity.compressed:
simulate`` way, fidelity on as in the suite), then needle-like batches decoded under every cell as the suite's
``one_pass`` jobs do (left-padded, one shared prefill, static steps kept across batches in a
:class:`~evaluation.slots.DecodeSlots`), with the GPU's peak memory after each part. Timings do not depend on the
weights' values (every cell decodes a fixed number of tokens); answers are meaningless and not reported.

    python benchmarks/profile_grid.py --shape qwen2.5 --length 32768 --batch 8 --batches 3 --profile quest@1/16 \
        --out benchmarks/results/profile_grid_qwen2.5.csv
    python benchmarks/profile_grid.py --shape tiny --length 512 --batch 2 --batches 2 --device cpu   # a dry run

Rows: ``perplexity`` (the window's dense prefill, then each cell's :meth:`~evaluation.simulate.SimulateSession.run`),
``needle`` (each batch's phases from :class:`~evaluation.needle.PhaseClock`, and per cell its own seconds and the
graphs it captured). ``--profile CELLS`` (``label@budget``, comma-separated) prints the costliest operators (by
host and by device time) of one more simulate run of each under :mod:`torch.profiler`. ``--grid`` picks the policies: ``issue12`` (the eight of
``recipes/suite_gaps.sh``'s ``grid_one_pass`` parts) or ``suite`` (the suite config's own list).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from contextlib import contextmanager

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import env_info, print_table, write_csv
from shapes import SHAPES, random_model

from evaluation.needle import PhaseClock, greedy_batch
from evaluation.simulate import SimulateSession
from evaluation.slots import DecodeSlots
from evaluation.suite import cells_of, load_suite
from evaluation.sweep import budget_label

ISSUE12 = [
    {"name": "dense"},
    {"name": "oracle_block_topk", "label": "oracle", "sink": 4, "window": 32},
    {"name": "quest", "sink": 4, "window": 32},
    {"name": "token_topk", "label": "token_topk", "sink": 4, "window": 32},
    {"name": "block_topk", "sink": 4, "window": 32},
    {"name": "sink_window", "sink": 4},
    {"name": "snapkv", "sink": 4, "window": 32, "observe": 32},
    {
        "name": "snapkv", "label": "snapkv1/4+quest", "budget": "1/4", "sink": 4, "window": 32, "observe": 32,
        "then": {"name": "quest", "sink": 4, "window": 32},
    },
]  # fmt: skip


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def peak_gib(device: str) -> float | None:
    """The device's peak allocated memory since the last reset, GiB (None on the CPU)."""
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.device(device).type == "cuda" else None


def perplexity_rows(
    model, cells, cfg, length: int, device: str, profile: tuple[str, ...] = (), windows: int = 1
) -> list[dict]:
    """The simulated perplexity of ``windows`` random windows of ``length`` tokens scored together (one
    :class:`SimulateSession`, as the suite's ``simulate_batch``): their prefill, then each cell's run; ``seconds``
    per window (the run's divided by ``windows``)."""
    p = {"scored": 256, "chunk": 64, "fidelity": True, **(cfg.get("perplexity") or {})}
    scored = min(int(p["scored"]), length // 2)
    ids = torch.randint(0, model.config.vocab_size, (windows, length), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    _sync(device)
    t0 = time.perf_counter()
    session = SimulateSession(model, ids, scored, cfg["block_size"], int(p["chunk"]))
    _sync(device)
    rows = [{"part": "perplexity", "cell": "prefill", "seconds": f"{(time.perf_counter() - t0) / windows:.3f}"}]
    session.run_windows(cells[0].policy, cfg["dense_layers"])  # warms the kernels every run uses (untimed)
    for cell in cells:
        want = bool(p["fidelity"]) and cell.budget is not None and not cell.policy.compresses
        name = f"{cell.label}@{budget_label(cell.budget)}"
        _sync(device)
        t0 = time.perf_counter()
        session.run_windows(cell.policy, cfg["dense_layers"], fidelity=want, reuse=cell.reuse)
        _sync(device)
        sec = f"{(time.perf_counter() - t0) / windows:.3f}"
        rows.append({"part": "perplexity", "cell": name, "seconds": sec, "fidelity": want})
        if name in profile:  # one more run under the profiler
            with profiled(device, True, f"profile of {name}"):
                session.run_windows(cell.policy, cfg["dense_layers"], fidelity=want, reuse=cell.reuse)
    rows.append({"part": "perplexity", "cell": "peak", "peak_gib": peak_gib(device)})
    return rows


def allocator_counts(device: str) -> dict[str, int]:
    """The CUDA caching allocator's running counts: ``mallocs`` / ``frees`` (cudaMalloc / cudaFree calls) and
    ``retries`` (allocations that failed, freed every cached block and tried again); empty on the CPU."""
    if torch.device(device).type != "cuda":
        return {}
    stats = torch.cuda.memory_stats()
    names = {"mallocs": "num_device_alloc", "frees": "num_device_free", "retries": "num_alloc_retries"}
    return {k: int(stats.get(v, 0)) for k, v in names.items()}


@contextmanager
def profiled(device: str, on: bool, title: str):
    """When ``on``: the block under :mod:`torch.profiler` (synchronised at its end), then under ``title`` the 15
    operators and runtime calls of most host time (cudaMalloc, cudaFree, graph instantiation and synchronisations
    show there) and the 10 of most device time."""
    if not on:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        yield
        _sync(device)
    table = prof.key_averages()
    print(f"\n{title}, by self host time:")
    print(table.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    if cuda:
        print(f"\n{title}, by device time:")
        print(table.table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=60))


def needle_rows(
    model,
    cells,
    cfg,
    length: int,
    batch: int,
    batches: int,
    new_tokens: int,
    device: str,
    profile: bool = False,
    prefill: str = "batch",
    whole_refills: bool = False,
) -> list[dict]:
    """``batches`` left-padded batches of ``batch`` random prompts of about ``length`` tokens, each decoded under
    every cell (``new_tokens`` each) as a ``one_pass`` suite job does: static steps kept across batches. One row per
    batch (its phases and, on a GPU, the allocator's cudaMalloc / cudaFree calls and retries during it), then one per
    cell (its own seconds in the first batch, with its captures, and in the last one not profiled). ``profile``: the last batch under
    :func:`profiled`. ``prefill``: ``greedy_batch``'s (``"rows"``: each prompt prefilled alone, the caches stacked).
    ``whole_refills``: the kept slot refilled whole at every turn (``DecodeSlots(whole_refills=True)``)."""
    rng = random.Random(2)
    slots = DecodeSlots(whole_refills=whole_refills)
    policies = {c.key: c.policy for c in cells}
    rows, first, last = [], {}, {}
    for b in range(batches):
        prompts = [
            [rng.randrange(3, model.config.vocab_size) for _ in range(length - rng.randrange(0, 64))]
            for _ in range(batch)
        ]
        clock = PhaseClock(device)
        before = allocator_counts(device)
        with profiled(device, profile and b == batches - 1, "needle batch"):
            greedy_batch(
                model, prompts, policies, new_tokens, cfg["dense_layers"], cfg["block_size"], cfg.get("mode", "block"),
                clock=clock, static=True, slots=slots, prefill=prefill,
            )  # fmt: skip
        after = allocator_counts(device)
        phases = {k: f"{v:.3f}" for k, v in clock.seconds.items()}
        counts = {k: after[k] - before[k] for k in after}
        rows.append({"part": "needle", "cell": f"batch {b}", **phases, "peak_gib": peak_gib(device), **counts})
        if b == 0:
            first = dict(clock.per_key)
        if not (profile and b == batches - 1 and b > 0):  # a profiled batch's seconds are the profiler's too
            last = dict(clock.per_key)
    for c in cells:
        one, end = first.get(str(c.key), {}), last.get(str(c.key), {})
        rows.append(
            {
                "part": "needle", "cell": f"{c.label}@{budget_label(c.budget)}",
                "first": f"{one.get('phases', 0.0):.3f}", "graphs": int(one.get("graphs", 0)),
                "capture": f"{one.get('capture', 0.0):.3f}", "last": f"{end.get('phases', 0.0):.3f}",
                "last_decode": f"{end.get('decode', 0.0):.3f}", "last_graphs": int(end.get("graphs", 0)),
            }
        )  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5")
    ap.add_argument("--grid", choices=("issue12", "suite"), default="issue12")
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=3, help="needle batches (0: none)")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--no-perplexity", action="store_true")
    ap.add_argument("--windows", type=int, default=1, help="perplexity windows scored together (simulate_batch)")
    ap.add_argument("--profile", default="", help="cells label@budget to profile (simulate way), comma-separated")
    ap.add_argument("--profile-needle", action="store_true", help="the last needle batch under torch.profiler")
    ap.add_argument("--prefill", choices=("batch", "rows"), default="batch", help="needle batches' prefill")
    ap.add_argument("--whole-refills", action="store_true", help="refill the kept slot whole at every turn")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="CSV of every row")
    args = ap.parse_args(argv)
    if args.length < 2 or args.batch < 1 or args.batches < 0 or args.new_tokens < 1 or args.windows < 1:
        raise SystemExit("--length >= 2, --batch >= 1, --batches >= 0, --new-tokens >= 1 and --windows >= 1")
    overrides = {"policies": ISSUE12} if args.grid == "issue12" else {}
    cfg = load_suite(SHAPES[args.shape]["suite"], overrides)
    cells = cells_of(cfg)
    model = random_model(args.shape, getattr(torch, args.dtype), args.device)
    print({**env_info(), "shape": args.shape, "length": args.length, "batch": args.batch, "cells": len(cells)})
    rows = []
    if not args.no_perplexity:
        profile = tuple(filter(None, args.profile.split(",")))
        rows += perplexity_rows(model, cells, cfg, args.length, args.device, profile, args.windows)
        print_table([r for r in rows if r["part"] == "perplexity"], ["cell", "seconds", "fidelity", "peak_gib"])
    if args.batches:
        if torch.device(args.device).type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        needle = needle_rows(
            model, cells, cfg, args.length, args.batch, args.batches, args.new_tokens, args.device, args.profile_needle,
            args.prefill, args.whole_refills,
        )  # fmt: skip
        rows += needle
        print_table(
            [r for r in needle if "first" not in r],
            ["cell", "prefill", "copy", "decode", "peak_gib", "mallocs", "frees", "retries"],
        )
        cols = ["cell", "first", "graphs", "capture", "last", "last_decode", "last_graphs"]
        print_table([r for r in needle if "first" in r], cols)
    if args.out:
        write_csv(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
