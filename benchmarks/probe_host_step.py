"""Where a captured decode step's wall time goes besides the GPU's work (issue 14): the host's part before the graph
is launched, the launch, and the GPU's time, per step, for patched Dense and Quest 1/16 with ``cuda_graph=True``.

The Llama-3.1-8B shape (random bf16 weights, ``--layers``), a filled :class:`PagedKVCache` of ``--batch`` x
``--length``, the decode loop of ``bench_e2e.time_decode`` (a forward, the argmax, a sync) with the host's clock
read at each stage and CUDA events around the step: per step, ``host_us`` (the call until ``graph.replay()`` is
entered), ``replay_us`` (the call to ``replay()``), ``after_us`` (from its return to the end of the forward:
``logits.clone()``), ``wall_us`` (the loop's step, synchronised) and ``gpu_us`` (events before the forward and
after the argmax). Then a cProfile of ``--profile`` steps: the 40 costliest functions by cumulative time, in
µs a step (cProfile's own overhead included). Medians; one
table last::

    python benchmarks/probe_host_step.py                  # H200: 32 layers, 1 x 8192
    python benchmarks/probe_host_step.py --signature --profile 0   # also each row with the old cache_kwarg
    python benchmarks/probe_host_step.py --device cpu --layers 2 --length 256 --steps 4   # a dry run (no graphs)
    python benchmarks/probe_host_step.py --generate 64    # also a real generate(): its median step (generate_us)
    python benchmarks/probe_host_step.py --stamps --profile 0     # the host part by stage; single device ops' cost

``--generate N``: after the filled-cache steps, each row runs a greedy ``generate()`` of ``N`` tokens after a real
prefill of ``--length`` (an all-ones attention mask), its steps timed by bench_e2e's ``StepClock`` (a logits
processor reading the host clock after a sync; ``generate_us``, the median step), and with ``--profile`` a cProfile of a second such call: what a user's decode
step costs beyond the model's forward (transformers' own per-step work, the patch's checks of the mask).
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LogitsProcessorList

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_e2e import StepClock, build_model, fill_caches, llama8b_config, sync, tiny_config

from hf_sparse_kv import cache_kwarg, patch_model, patched, unpatch_model
from hf_sparse_kv import graphs as hf_graphs
from hf_sparse_kv import patch as hf_patch
from hf_sparse_kv.graphs import DecodeGraphs
from hf_sparse_kv.policies import Dense, Quest
from hf_sparse_kv.static import StaticBuffers


class Clock:
    """Host clock readings around ``DecodeGraphs.step``'s replay (patched onto ``torch.cuda.CUDAGraph.replay``) and,
    with ``stamps``, at the entry (and exit) of the host part's stages: ``captured_step`` (the patch's forward has
    found the cache), ``begin_static_step`` and its ``StaticBuffers.begin_step`` (the buffers' device ops)."""

    STAGES = ("captured", "plan", "fill", "filled", "planned")

    def __init__(self, stamps: bool = False):
        self.enter = self.leave = 0.0
        self.at: dict[str, float] = {}
        self._replay = torch.cuda.CUDAGraph.replay
        self._saved = []

        def replay(graph):
            self.enter = time.perf_counter()
            self._replay(graph)
            self.leave = time.perf_counter()

        torch.cuda.CUDAGraph.replay = replay
        if stamps:
            self._wrap(hf_patch, "captured_step", "captured", None)
            self._wrap(hf_graphs, "begin_static_step", "plan", "planned")
            self._wrap(StaticBuffers, "begin_step", "fill", "filled")

    def _wrap(self, owner, name: str, enter: str, leave: str | None) -> None:
        inner = getattr(owner, name)
        self._saved.append((owner, name, inner))

        def stamped(*args, **kwargs):
            self.at[enter] = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if leave:
                    self.at[leave] = time.perf_counter()

        setattr(owner, name, stamped)

    def close(self):
        torch.cuda.CUDAGraph.replay = self._replay
        for owner, name, inner in reversed(self._saved):
            setattr(owner, name, inner)

    def stages(self, t0: float) -> dict[str, float]:
        """µs of each stage of the host part, from the step's start to the replay's entry."""
        at = self.at
        if not all(k in at for k in self.STAGES):
            return {}
        return {
            "hook_us": 1e6 * (at["captured"] - t0),  # the model's pre-hook, the patch's forward up to captured_step
            "checks_us": 1e6 * (at["plan"] - at["captured"]),  # step_applies, fits, the patch-state check
            "plan_us": 1e6 * (at["fill"] - at["plan"] + at["planned"] - at["filled"]),  # plan, advance, counters
            "fill_us": 1e6 * (at["filled"] - at["fill"]),  # the buffers' device ops
            "launch_us": 1e6 * (self.enter - at["planned"]),  # the token's copy, the graph's lookup
        }


def launch_costs(device: torch.device, n: int = 1000) -> dict[str, float]:
    """Host µs of one small device op, as the host part launches them: the mean of ``n`` back to back, and the median
    of single ones each after a sync (the GPU idle, as at the start of a decode step)."""
    pads = torch.zeros(1, dtype=torch.int32, device=device)
    frame = torch.zeros(1, dtype=torch.long, device=device)
    pos0 = torch.zeros(1, dtype=torch.int32, device=device)
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    src = torch.ones(1, 1, dtype=torch.long, device=device)
    ops = {
        "fill_": lambda: frame.fill_(7),
        "sub(int, t, out)": lambda: torch.sub(7, pads, out=pos0),
        "copy_": lambda: ids.copy_(src),
    }
    out = {}
    for name, op in ops.items():
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            op()
        out[f"{name} back to back"] = 1e6 * (time.perf_counter() - t0) / n
        sync(device)
        single = []
        for _ in range(100):
            sync(device)
            t0 = time.perf_counter()
            op()
            single.append(1e6 * (time.perf_counter() - t0))
        out[f"{name} after a sync"] = statistics.median(single)
    sync(device)
    return out


def time_steps(model, cache, batch, length, steps, warmup, device, stamps: bool = False) -> list[dict]:
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
    kw = {cache_kwarg(model): cache, "use_cache": True}
    clock = Clock(stamps) if device.type == "cuda" else None
    rows = []
    try:
        with torch.no_grad():
            for i in range(warmup + steps):
                pos = torch.full((batch, 1), length + i, device=device)
                sync(device)
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if clock else None
                t0 = time.perf_counter()
                if ev:
                    ev[0].record()
                logits = model(ids, position_ids=pos, **kw).logits
                t1 = time.perf_counter()
                ids = logits[:, -1:].argmax(-1)
                if ev:
                    ev[1].record()
                sync(device)
                t2 = time.perf_counter()
                if i < warmup:
                    continue
                row = {"wall_us": 1e6 * (t2 - t0), "forward_us": 1e6 * (t1 - t0)}
                if clock:
                    row |= {"host_us": 1e6 * (clock.enter - t0), "replay_us": 1e6 * (clock.leave - clock.enter),
                            "after_us": 1e6 * (t1 - clock.leave), "gpu_us": 1000 * ev[0].elapsed_time(ev[1])}  # fmt: skip
                    row |= clock.stages(t0)
                rows.append(row)
    finally:
        if clock:
            clock.close()
    return rows


def profile_steps(model, cache, batch, length, steps, device) -> str:
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
    kw = {cache_kwarg(model): cache, "use_cache": True}
    prof = cProfile.Profile()
    with torch.no_grad():
        for i in range(steps):
            pos = torch.full((batch, 1), length + i, device=device)
            sync(device)
            prof.enable()
            ids = model(ids, position_ids=pos, **kw).logits[:, -1:].argmax(-1)
            prof.disable()
    return profile_table(prof, steps)


def time_generate(model, batch, length, new_tokens, device, profile: bool) -> tuple[list[float], str]:
    """One greedy ``generate()`` of ``new_tokens`` after a real prefill of ``batch x length`` random tokens (an
    all-ones attention mask, as a tokenizer gives): each step's wall time in us (the first two dropped: the prefill's
    token and the capture; ``bench_e2e.StepClock``: a synchronised reading each token), and with ``profile`` a cProfile
    of a second such call (µs a step)."""
    ids = torch.randint(0, model.config.vocab_size, (batch, length), device=device)
    kw = {"attention_mask": torch.ones_like(ids), "max_new_tokens": new_tokens, "min_new_tokens": new_tokens,
          "do_sample": False, "pad_token_id": 0}  # fmt: skip
    clock = StepClock(device)
    with torch.no_grad():
        model.generate(ids, logits_processor=LogitsProcessorList([clock]), **kw)
    steps = [1e6 * (b - a) for a, b in zip(clock.times[2:], clock.times[3:])]
    if not profile:
        return steps, ""
    prof = cProfile.Profile()
    with torch.no_grad():
        prof.enable()
        model.generate(ids, **kw)
        prof.disable()
    return steps, profile_table(prof, new_tokens)


def profile_table(prof: cProfile.Profile, steps: int) -> str:
    """The 40 costliest functions of ``prof`` by cumulative time, in µs a step over ``steps``."""
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][3])[:40]
    out = io.StringIO()
    out.write(f"{'cum us/step':>12} {'own us/step':>12} {'calls/step':>10}  function\n")
    for (path, line, name), (calls, _, own, cum, _) in rows:
        where = "/".join(Path(path).parts[-2:]) if path != "~" else ""
        out.write(
            f"{1e6 * cum / steps:12.1f} {1e6 * own / steps:12.1f} {calls / steps:10.1f}  {where}:{line}({name})\n"
        )
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--profile", type=int, default=20, help="steps under cProfile (0: none)")
    ap.add_argument(
        "--signature",
        action="store_true",
        help="also time each row with cache_kwarg through inspect.signature (the library before 27ebed3)",
    )
    ap.add_argument(
        "--generate",
        type=int,
        default=0,
        help="also time each row's greedy generate() of this many tokens after a real prefill of --length (and, "
        "with --profile, a cProfile of a second one)",
    )
    ap.add_argument(
        "--stamps",
        action="store_true",
        help="also split the host part into stages (host clock at each stage's entry; a CUDA device only) and time "
        "single small device ops",
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.stamps and device.type == "cuda":
        print("host µs of one small device op (back to back: the mean of 1000; after a sync: the median of 100)")
        for name, us in launch_costs(device).items():
            print(f"  {name:<32} {us:8.1f}")
    config = llama8b_config(args.layers) if device.type == "cuda" else tiny_config()
    config.num_hidden_layers = args.layers
    model = build_model(args.layers, args.device, config)
    summary = []
    rows_to_run = [(name, policy, False) for name, policy in (("Dense", Dense()), ("Quest 1/16", Quest(budget=0.0625)))]
    if args.signature:
        rows_to_run += [(f"{name} (sig)", policy, True) for name, policy, _ in rows_to_run]
    fast = patched.forward_parameters
    for name, policy, signature in rows_to_run:
        _, paged = fill_caches(model, args.batch, args.length, 16, args.device, dense=False)
        patch_model(model, policy=policy, mode="block", block_size=16, cuda_graph=True)
        if signature:  # cache_kwarg as it was: a Signature built at every call
            patched.forward_parameters = lambda fn: frozenset(inspect.signature(fn).parameters)
        try:
            rows = time_steps(model, paged, args.batch, args.length, args.steps, args.warmup, device, args.stamps)
            runner = paged.session.graphs
            replays = runner.replays if isinstance(runner, DecodeGraphs) else 0
            med = {k: statistics.median(r[k] for r in rows if k in r) for k in rows[0]}
            if args.generate:
                steps, table = time_generate(model, args.batch, args.length, args.generate, device, args.profile > 0)
                med["generate_us"] = statistics.median(steps)
                if table:
                    print(f"== {name}: cProfile of generate(), {args.generate} tokens")
                    print(table)
            summary.append((name, med, replays))
            if args.profile:
                print(f"== {name}: cProfile of {args.profile} steps (own time)")
                print(
                    profile_steps(
                        model, paged, args.batch, args.length + args.steps + args.warmup, args.profile, device
                    )
                )
        finally:
            patched.forward_parameters = fast
            unpatch_model(model)
        del paged
    print(f"{args.layers} layers, {args.batch} x {args.length}, median of {args.steps} steps after {args.warmup} (us)")
    keys = list(summary[0][1])
    print(" row               replays  " + "  ".join(f"{k:>10}" for k in keys))
    for name, med, replays in summary:
        print(f" {name:<17} {replays:>7}  " + "  ".join(f"{med[k]:>10.1f}" for k in keys))


if __name__ == "__main__":
    main()
