"""Measure a crossover table on this machine: ``python -m hf_sparse_kv.calibrate`` (or ``hf-sparse-kv calibrate``).

For each batch, budget and context it times one layer's decode attention call as the patched model makes it: dense
(every block, block kernel; captured: over a selection made once, as a static step keeps it) against the policy
(selection + block kernel, or token kernel for a token policy), on random bf16 pages, with the state the policy keeps
in the cache (low-bit or product-quantized codes, compressed keys) computed from them as the cache's writes would
(``--policy``, ``--policy-args``: any policy of :data:`hf_sparse_kv.policies.POLICIES` with a budget that does not
free blocks; default ``Quest``). With ``--timing eager`` (what an eager decode step pays) each call runs from Python
with the device synchronised around it, median of ``reps``; with ``--timing graph`` (what a ``cuda_graph=True`` step
pays) ``reps`` calls are captured in one CUDA graph and the graph's replay time, divided by ``reps``, is taken (median
of 5 replays). Each timed call runs over several copies of the pages in turn (the layers of a step; together four
times the L2 cache on CUDA), so that a call does not find its metadata and pages in the L2 where the previous call
left them: a model's layers do not either, and a hot L2 flatters the selection (the first graph table put the batch-1
crossover at 32K, where the whole model was 4.6% slower sparse). The crossover of a (batch, budget) is the shortest
measured context from which the policy is faster (by more than a 2% margin) at every longer measured context (``None``
if it never is). Write the table with ``--out`` and pass it as ``patch_model(..., mode="auto", crossover=path)``; the
table records the policy (:func:`hf_sparse_kv.crossover.policy_key`), block size and timing it measured, and a patch
that differs warns.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from functools import partial

import torch

from .attention import execute
from .crossover import CrossoverTable, describe_key, policy_key
from .ops import get_ops, resolve_backend
from .ops.layout import cdiv, check_block_size
from .policies import POLICIES, DecodeState, Dense, Policy, Quest

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
    """One layer's decode attention as ``mode="auto"`` runs a sparse step: select, then the block kernel (the token
    kernel for a token policy)."""
    return execute(policy.select(state), "token" if policy.granularity == "token" else "block", state, v_pool)


def make_policy(policy_cls: type[Policy], policy_args: dict | None, budget: float) -> Policy:
    """``policy_cls(budget=budget, **policy_args)``, refused (``ValueError``) where a crossover cannot be timed: a
    policy without a budget (``Dense``), one that frees blocks (its decode reads what its prefill kept: time it in
    a model) or ``policy_args`` naming the budget (the table's budgets are its own)."""
    args = dict(policy_args or {})
    if "budget" in args:
        raise ValueError("policy_args must not hold 'budget': the table is measured at each of its budgets")
    if policy_cls is Dense:
        raise ValueError("Dense has no budget: a crossover table times a sparse policy against dense")
    try:
        policy = policy_cls(budget=budget, **args)
    except TypeError as e:
        raise ValueError(f"{policy_cls.__name__}(budget={budget}, **{args}) is not a valid policy: {e}") from e
    if policy.frees_blocks:
        raise ValueError(
            f"{type(policy).__name__} frees blocks: its decode steps read what its prefill kept, which random pages "
            "do not model. Time it in a model (benchmarks/bench_e2e.py) instead."
        )
    return policy


def prepare(policy: Policy, states: list) -> list[tuple[DecodeState, torch.Tensor]]:
    """``states`` with the per-token or per-block state ``policy`` keeps in the cache, computed from their pages as a
    prefill's write computes it (each spec's ``refresh`` over every stored position, ``layer`` the state's own; a
    policy calibrated at the prefill, ``calibration="prefill"``, fits there); ``states`` themselves are unchanged."""
    out = []
    for state, v_pool in states:
        lo = torch.zeros_like(state.seq_lens, dtype=torch.long)
        hi = state.seq_lens.long()
        NB, Hkv, BS, D = state.k_pool.shape
        kept = {}
        for spec in policy.cache_state():
            t = spec.allocate(NB, Hkv, BS, D, state.k_pool.dtype, state.k_pool.device)
            kept[spec.name] = t  # in the specs' order: a refresh may read the state refreshed before it
            spec.refresh(
                t, state.k_pool, state.block_table, lo, hi,
                layer=state.layer, span=state.length, ops=state.ops, states=kept,
            )  # fmt: skip
        out.append((dataclasses.replace(state, state=kept), v_pool))
    return out


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


def cycle_selected(selections: list, states: list) -> None:
    """The block kernel over each state's given selection in turn: a dense layer of a static step, whose every-block
    selection is made once and kept with the reservation (``StaticBuffers.keep``), so that its graph holds the
    attention alone."""
    for selection, (state, v_pool) in zip(selections, states):
        execute(selection, "block", state, v_pool)


def dense_timed(states: list, timing: str):
    """What a dense layer's step runs, to time: under ``"graph"`` (captured static steps) the block kernel over a
    selection made once here (:func:`cycle_selected`), under ``"eager"`` the selection made at every call too (an
    eager step makes it: :func:`cycle_calls`). Timing the graph's dense layers with their selection at every call
    counted a few small kernels a layer that a captured dense layer does not run, and put every crossover at the
    shortest measured context (the whole model disagreed: benchmarks/RESULTS.md, 2026-12-06)."""
    if timing == "graph":
        return partial(cycle_selected, [Dense().select(state) for state, _ in states], states)
    return partial(cycle_calls, Dense(), states)


def random_state(batch, context, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, backend, seed=0):
    """A decode state over random pages (a random block table), and its value pool; ``seed`` is also its layer."""
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
        layer=seed,
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
    policy_cls: type[Policy] = Quest,
    policy_args: dict | None = None,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
    reps: int = 20,
    margin: float = 0.02,
    timing: str = "eager",
) -> tuple[CrossoverTable, list[dict]]:
    """Measure dense vs ``policy_cls(budget=budget, **policy_args)`` per (batch, budget, context); return the table
    (which records the policy's :func:`~hf_sparse_kv.crossover.policy_key`, ``block_size`` and ``timing``) and the
    timings. Refused (``ValueError``) for a policy :func:`make_policy` refuses, before anything is timed.

    Sparse "wins" at a context only when it is faster than dense by more than ``margin`` (a fraction). ``timing``:
    ``"eager"`` or ``"graph"`` (CUDA only), see the module's docstring."""
    if timing not in ("eager", "graph"):
        raise ValueError(f"timing must be 'eager' or 'graph', got {timing!r}")
    dev = torch.device(device)
    if timing == "graph" and dev.type != "cuda":
        raise ValueError("timing='graph' captures CUDA graphs: it needs device='cuda'")
    timer = (lambda fn: time_graph(fn, reps)) if timing == "graph" else (lambda fn: time_call(fn, dev, reps))
    backend = resolve_backend(backend, dev)
    policies = {b: make_policy(policy_cls, policy_args, b) for b in budgets}  # every refusal before any timing
    rows, entries = [], []
    # on the device asked for, also when it is not the current one (captures, syncs and events use the current)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        for batch in batches:
            timings: dict[float, list[tuple[int, float, float]]] = {b: [] for b in budgets}
            for context in contexts:
                args = (batch, context, num_q_heads, num_kv_heads, head_dim, block_size, dtype, dev, backend)
                states = layer_states(args, working_set_bytes(dev))
                dense_s = timer(dense_timed(states, timing)) / len(states)
                for budget in budgets:
                    prepared = prepare(policies[budget], states)
                    sparse_s = timer(partial(cycle_calls, policies[budget], prepared)) / len(states)
                    del prepared
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
    key = policy_key(policies[budgets[0]])
    source = (
        f"hf_sparse_kv.calibrate: {describe_key(key)}, block_size {block_size}, {dtype}, backend {backend}, "
        f"timing {timing}"
    )
    table = CrossoverTable(
        entries,
        device=name,
        max_context=max(contexts),
        source=source,
        timing=timing,
        policy=key,
        block_size=block_size,
    )
    return table, rows


def parse_policy(name: str, args_json: str) -> tuple[type[Policy], dict]:
    """``--policy`` (a class name of :mod:`hf_sparse_kv.policies` or a :data:`~hf_sparse_kv.policies.POLICIES` key)
    and ``--policy-args`` (a JSON object) as ``(class, kwargs)``; ``ValueError`` (``TypeError`` for JSON that is
    not an object) naming what is wrong."""
    by_class = {cls.__name__: cls for cls in POLICIES.values()}
    policy_cls = POLICIES.get(name) or by_class.get(name)
    if policy_cls is None:
        raise ValueError(f"--policy {name!r} is not a policy; one of {sorted(by_class)} (or {sorted(POLICIES)})")
    try:
        kwargs = json.loads(args_json)
    except json.JSONDecodeError as e:
        raise ValueError(f"--policy-args is not JSON ({e}): {args_json!r}") from e
    if not isinstance(kwargs, dict):
        raise TypeError(f"--policy-args must be a JSON object of settings, got {args_json!r}")
    return policy_cls, kwargs


def _numbers(text: str, kind: type, flag: str) -> tuple:
    """``text``'s comma-separated numbers as ``kind``, each positive (``ValueError`` naming ``flag`` otherwise)."""
    try:
        values = tuple(kind(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated {kind.__name__}s, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise ValueError(f"{flag} takes positive numbers, got {text!r}")
    return values


def _shape(text: str) -> tuple[int, int, int]:
    """``"q heads,KV heads,head dim"`` as three positive ints, the query heads a multiple of the KV heads."""
    values = _numbers(text, int, "--shapes")
    if len(values) != 3 or values[0] % values[1]:
        raise ValueError(
            f"--shapes takes 'q heads,KV heads,head dim' (the q heads a multiple of the KV heads), got {text!r}"
        )
    return values


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="32,8,128", help="q heads,KV heads,head dim; several separated by ';'")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--budgets", default="0.125,0.0625,0.03125")
    p.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--policy", default="Quest", help="a policy's class (Quest) or registry name (quest)")
    p.add_argument(
        "--policy-args",
        default="{}",
        help="its settings but the budget, as a JSON object, e.g. "
        '\'{"candidates": 4, "p": 1.0, "coarse": "pq", "calibration": "prefill"}\'',
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--timing", choices=["eager", "graph"], default="eager", help="eager steps or CUDA-graph steps")
    p.add_argument("--out", default="crossover.json")
    args = p.parse_args(argv)
    try:  # every refusal before anything is timed: one line and exit status 2 (argparse's), no traceback
        budgets = _numbers(args.budgets, float, "--budgets")
        batches, contexts = _numbers(args.batches, int, "--batches"), _numbers(args.contexts, int, "--contexts")
        shapes = [_shape(shape) for shape in args.shapes.split(";")]
        check_block_size(args.block_size)
        if args.reps < 1:
            raise ValueError(f"--reps must be at least 1, got {args.reps}")
        policy_cls, policy_args = parse_policy(args.policy, args.policy_args)
        for budget in budgets:
            make_policy(policy_cls, policy_args, budget)
    except (TypeError, ValueError) as e:
        p.error(str(e))
    tables, all_rows = [], []
    for shape, (hq, hkv, d) in zip(args.shapes.split(";"), shapes):
        table, rows = calibrate(
            hq, hkv, d,
            batches=batches,
            budgets=budgets,
            contexts=contexts,
            block_size=args.block_size,
            policy_cls=policy_cls,
            policy_args=policy_args,
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
        policy=tables[0].policy,
        block_size=tables[0].block_size,
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
