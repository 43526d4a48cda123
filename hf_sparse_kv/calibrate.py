"""Measure a crossover table on this machine: ``python -m hf_sparse_kv.calibrate`` (or ``hf-sparse-kv calibrate``).

For each batch, budget and context it times one layer's decode attention call as the patched model makes it:
dense (every block, block kernel) against the policy (selection + block kernel), on random bf16 pages. With
``--timing eager`` (what an eager decode step pays) each call runs from Python with the device synchronised around
it, median of ``reps``; with ``--timing graph`` (what a ``cuda_graph=True`` step pays) ``reps`` calls are captured in
one CUDA graph and the graph's replay time, divided by ``reps``, is taken (median of 5 replays). Each timed call
runs over several copies of the pages in turn (the layers of a step; together four times the L2 cache on CUDA),
so that a call does not find its metadata and pages in the L2 where the previous call left them: a model's layers
do not either, and a hot L2 flatters the selection (the first graph table put the batch-1 crossover at 32K, where
the whole model was 4.6% slower sparse). The crossover of a (batch, budget) is the shortest measured
context from which the policy is faster (by more than a 2% margin) at every longer measured context (``None``
if it never is). Write the
table with ``--out`` and pass it as ``patch_model(..., mode="auto", crossover=path)``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from .attention import execute
from .crossover import CrossoverTable
from .ops import get_ops, resolve_backend
from .ops.layout import cdiv
from .policies import DecodeState, Dense, Policy, Quest

DEFAULT_CONTEXTS = (2048, 4096, 8192, 16384, 32768, 65536, 131072)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_call(fn, device: torch.device, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` with the device synchronised around each call."""
    times = []
    for i in range(warmup + reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_graph(fn, reps: int = 20, replays: int = 5) -> float:
    """Median seconds of ``fn()`` inside a CUDA graph: ``reps`` calls captured in one graph, replayed ``replays``
    times (CUDA events), each replay divided by ``reps``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up off the capture: compiles the kernels
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(replays + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(times[1:])


def decode_call(policy: Policy, state: DecodeState, v_pool: torch.Tensor) -> torch.Tensor:
    """One layer's decode attention as the patched model runs it: select, then the block kernel."""
    return execute(policy.select(state), "block", state, v_pool)


def working_set_bytes(device: torch.device) -> int:
    """Bytes of pages to cycle through so that a call does not find the previous call's pages in the L2 cache (as
    a layer of a model does not): four times the L2 (256 MB when unknown)."""
    if device.type != "cuda":
        return 0
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    return 4 * l2 if l2 else 256 * 2**20


def layer_states(args: tuple, min_bytes: int, most: int = 16) -> list[tuple[DecodeState, torch.Tensor]]:
    """Enough :func:`random_state` copies (like a model's layers) to hold ``min_bytes`` of pages, 1 to ``most``."""
    first = random_state(*args)
    per = sum(t.numel() * t.element_size() for t in (first[0].k_pool, first[1], first[0].kmin, first[0].kmax))
    copies = max(1, min(most, cdiv(min_bytes, per)))
    return [first] + [random_state(*args, seed=i) for i in range(1, copies)]


def cycle_calls(policy: Policy, states: list) -> None:
    """One decode call per state in turn (the layers of one step)."""
    for state, v_pool in states:
        decode_call(policy, state, v_pool)


def random_state(batch, context, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, backend, seed=0):
    """A decode state over random pages (a random block table), and its value pool."""
    g = torch.Generator(device=device).manual_seed(context + batch + 1000003 * seed)
    nblk = cdiv(context, block_size)
    NB = batch * nblk
    k_pool = torch.randn(NB, num_kv_heads, block_size, head_dim, generator=g, device=device).to(dtype)
    v_pool = torch.randn(NB, num_kv_heads, block_size, head_dim, generator=g, device=device).to(dtype)
    table = torch.randperm(NB, generator=g, device=device).view(batch, nblk).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    state = DecodeState(
        q=torch.randn(batch, num_q_heads, head_dim, generator=g, device=device).to(dtype),
        k_pool=k_pool,
        kmin=k_pool.amin(2),
        kmax=k_pool.amax(2),
        kmean=k_pool.float().mean(2).to(dtype),
        block_table=table,
        seq_lens=lens,
        start=torch.zeros_like(lens),
        lens=(context,) * batch,
        length=context,
        block_size=block_size,
        scale=head_dim**-0.5,
        ops=get_ops(backend, device),
    )
    return state, v_pool


def calibrate(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    batches=(1, 8),
    budgets=(0.125, 0.0625, 0.03125),
    contexts=DEFAULT_CONTEXTS,
    block_size: int = 16,
    policy_cls=Quest,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
    reps: int = 20,
    margin: float = 0.02,
    timing: str = "eager",
) -> tuple[CrossoverTable, list[dict]]:
    """Measure dense vs ``policy_cls(budget)`` per (batch, budget, context); return the table and the timings.

    Sparse "wins" at a context only when it is faster than dense by more than ``margin`` (a fraction). ``timing``:
    ``"eager"`` or ``"graph"`` (CUDA only), see the module's docstring."""
    if timing not in ("eager", "graph"):
        raise ValueError(f"timing must be 'eager' or 'graph', got {timing!r}")
    dev = torch.device(device)
    if timing == "graph" and dev.type != "cuda":
        raise ValueError("timing='graph' captures CUDA graphs: it needs device='cuda'")
    timer = (lambda fn: time_graph(fn, reps)) if timing == "graph" else (lambda fn: time_call(fn, dev, reps))
    backend = resolve_backend(backend, dev)
    rows, entries = [], []
    for batch in batches:
        timings: dict[float, list[tuple[int, float, float]]] = {b: [] for b in budgets}
        for context in contexts:
            args = (batch, context, num_q_heads, num_kv_heads, head_dim, block_size, dtype, dev, backend)
            states = layer_states(args, working_set_bytes(dev))
            dense_s = timer(partial(cycle_calls, Dense(), states)) / len(states)
            for budget in budgets:
                sparse_s = timer(partial(cycle_calls, policy_cls(budget=budget), states)) / len(states)
                timings[budget].append((context, dense_s, sparse_s))
                rows.append(
                    {
                        "batch": batch,
                        "budget": budget,
                        "context": context,
                        "dense_us": 1e6 * dense_s,
                        "sparse_us": 1e6 * sparse_s,
                        "speedup": dense_s / sparse_s,
                    }
                )
            del states
        for budget, points in timings.items():
            cross = None
            for context, dense_s, sparse_s in reversed(points):  # longest first
                if sparse_s >= (1 - margin) * dense_s:
                    break
                cross = context
            entries.append(
                {
                    "budget": budget,
                    "batch": batch,
                    "num_kv_heads": num_kv_heads,
                    "head_dim": head_dim,
                    "crossover": cross,
                }
            )
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    source = (
        f"hf_sparse_kv.calibrate: {policy_cls.__name__}, block_size {block_size}, {dtype}, backend {backend}, "
        f"timing {timing}"
    )
    table = CrossoverTable(entries, device=name, max_context=max(contexts), source=source, timing=timing)
    return table, rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="32,8,128", help="q heads,KV heads,head dim; several separated by ';'")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--budgets", default="0.125,0.0625,0.03125")
    p.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--timing", choices=["eager", "graph"], default="eager", help="eager steps or CUDA-graph steps")
    p.add_argument("--out", default="crossover.json")
    args = p.parse_args(argv)
    tables, all_rows = [], []
    for shape in args.shapes.split(";"):
        hq, hkv, d = map(int, shape.split(","))
        table, rows = calibrate(
            hq, hkv, d,
            batches=tuple(map(int, args.batches.split(","))),
            budgets=tuple(map(float, args.budgets.split(","))),
            contexts=tuple(map(int, args.contexts.split(","))),
            block_size=args.block_size,
            device=args.device,
            reps=args.reps,
            timing=args.timing,
        )  # fmt: skip
        tables.append(table)
        all_rows += [{"shape": shape, **r} for r in rows]
    merged = CrossoverTable(
        [e for t in tables for e in t.entries],
        tables[0].device,
        tables[0].max_context,
        None,
        tables[0].source,
        timing=args.timing,
    )
    merged.save(args.out)
    print(f"{'shape':>10} {'batch':>5} {'budget':>8} {'context':>8} {'dense us':>9} {'sparse us':>9} {'x':>5}")
    for r in all_rows:
        print(
            f"{r['shape']:>10} {r['batch']:>5} {r['budget']:>8.4f} {r['context']:>8} {r['dense_us']:>9.1f} "
            f"{r['sparse_us']:>9.1f} {r['speedup']:>5.2f}"
        )
    print("crossovers:", [(e["batch"], e["budget"], e["num_kv_heads"], e["crossover"]) for e in merged.entries])
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
