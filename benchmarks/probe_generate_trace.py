"""What a real ``generate()`` step does besides replaying its captured graph (issue 14): a torch.profiler trace of
``--active`` decode steps of a greedy ``generate()`` after a real prefill, per step in µs: the GPU's busy time inside
and outside the graph's kernels, the GPU idle time, the CPU ops (self time) and the CUDA runtime calls (``cudaMemcpy``,
``cudaStreamSynchronize``, ``cudaGraphLaunch``), the 25 costliest each. A step's wall time beyond its graph's kernels
is what the host and the ops outside the graph cost; what grows with the context shows by running two lengths. Each
row then traces the same number of steps on a cache filled with random K/V (``bench_e2e``'s filled-cache step; skip
with ``--no-filled``): the two "every kernel" tables side by side say whether the graph's own kernels take longer
in ``generate()`` (the prompt's keys, the cache's layout) or the time goes around them.
"Inside the graph" means a kernel carrying a graph launch's correlation id: on the H200 (torch 2.11) the profiler
left some replayed kernels without it (the model's own matmuls appeared "outside", ~3 a step), so that split is a
lower bound on the graph's share, not an exact one.

    python benchmarks/probe_generate_trace.py --length 131072          # H200: Llama-3.1-8B shape, 32 layers
    python benchmarks/probe_generate_trace.py --device cpu --tiny --length 256 --new-tokens 12 --wait 4 --active 4

The profiler starts after ``--wait`` decode steps (the captures done) and records ``--active`` steps, each step cut at
the logits processor's call (after the forward, before transformers' argmax and stopping checks of that token).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
from transformers import LogitsProcessor, LogitsProcessorList

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_e2e import build_model, fill_caches, time_decode, tiny_config
from bench_split import kernel_us

from hf_sparse_kv import patch_model, unpatch_model
from hf_sparse_kv.policies import Dense, Quest


class ProfilerStep(LogitsProcessor):
    """Steps the profiler's schedule once per generated token (after the token's forward)."""

    def __init__(self, prof):
        self.prof = prof

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.prof.step()
        return scores


def summarize(events, steps: int, on_gpu: bool) -> str:
    """Per step: GPU busy / idle (first to last kernel), kernels outside CUDA graphs, CPU ops by self time, runtime
    calls; the 25 costliest of each."""
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    launches = {e.id for e in events if e.device_type == DeviceType.CPU and "GraphLaunch" in e.name}
    out = []
    if on_gpu and kernels:
        kernels.sort(key=lambda e: e.time_range.start)
        busy = sum(kernel_us(e) for e in kernels)
        span = kernels[-1].time_range.end - kernels[0].time_range.start
        in_graph = sum(kernel_us(e) for e in kernels if e.id in launches)
        out.append(
            f"GPU per step: span {span / steps:.1f} us, busy {busy / steps:.1f} (graph kernels {in_graph / steps:.1f},"
            f" others {(busy - in_graph) / steps:.1f}), idle {(span - busy) / steps:.1f}"
        )
        outside = defaultdict(lambda: [0.0, 0])
        for e in kernels:
            if e.id not in launches:
                outside[e.name[:90]][0] += kernel_us(e)
                outside[e.name[:90]][1] += 1
        every = defaultdict(lambda: [0.0, 0])
        for e in kernels:
            every[e.name[:90]][0] += kernel_us(e)
            every[e.name[:90]][1] += 1
        out.append("every kernel by GPU time (us a step, calls a step):")
        for name, (us, n) in sorted(every.items(), key=lambda kv: -kv[1][0])[:25]:
            out.append(f"  {us / steps:9.1f} {n / steps:6.1f}  {name}")
        out.append("kernels outside the graphs (us a step, calls a step):")
        for name, (us, n) in sorted(outside.items(), key=lambda kv: -kv[1][0])[:25]:
            out.append(f"  {us / steps:9.1f} {n / steps:6.1f}  {name}")
    cpu = defaultdict(lambda: [0.0, 0])
    runtime = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.device_type != DeviceType.CPU or e.name.startswith("ProfilerStep"):
            continue
        table = runtime if e.name.startswith("cuda") else cpu
        table[e.name[:90]][0] += e.self_cpu_time_total
        table[e.name[:90]][1] += 1
    for title, table in (("CPU ops by self time", cpu), ("CUDA runtime calls", runtime)):
        out.append(f"{title} (us a step, calls a step):")
        for name, (us, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[:25]:
            out.append(f"  {us / steps:9.1f} {n / steps:6.1f}  {name}")
    return "\n".join(out)


def filled_steps(model, args, activities) -> list:
    """The profiler's events of ``--active`` decode steps (after ``--wait`` + 1 untraced ones) on a cache filled with
    random K/V (``bench_e2e.fill_caches``), run by ``bench_e2e.time_decode`` as its filled-cache rows run them (a
    forward, the argmax, a sync): beside a ``generate()`` trace, what differs is the prompt's keys and
    ``generate()``'s own work."""
    _, paged = fill_caches(model, 1, args.length, 16, args.device, dense=False)
    warm = args.wait + 1
    time_decode(model, paged, 1, args.length, 0, warm, crop=False)  # the captures, outside the trace
    with torch.profiler.profile(activities=activities) as prof:
        time_decode(model, paged, 1, args.length + warm, args.active, 0, crop=False)
    del paged
    return list(prof.events())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny model of the same ratios (a dry run)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--wait", type=int, default=24, help="decode steps before the profiler records")
    ap.add_argument("--active", type=int, default=8, help="decode steps recorded")
    ap.add_argument("--rows", default="Quest 1/16,Dense")
    ap.add_argument(
        "--no-filled", action="store_true", help="skip the same row's steps on a cache filled with random K/V"
    )
    args = ap.parse_args()
    if args.wait + args.active + 2 > args.new_tokens:
        raise SystemExit("--new-tokens must exceed --wait + --active + 1")
    model = build_model(args.layers, args.device, tiny_config() if args.tiny else None)
    on_gpu = args.device.startswith("cuda")
    policies = {"Quest 1/16": Quest(budget=0.0625), "Dense": Dense()}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (1, args.length), generator=g).to(model.device)
    kw = {"attention_mask": torch.ones_like(ids), "max_new_tokens": args.new_tokens,
          "min_new_tokens": args.new_tokens, "do_sample": False, "pad_token_id": 0}  # fmt: skip
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    for name in [r.strip() for r in args.rows.split(",") if r.strip()]:
        patch_model(model, policy=policies[name], mode="block", block_size=16, cuda_graph=True)
        try:
            # +1: the prefill's token is the processor's first call
            schedule = torch.profiler.schedule(wait=args.wait + 1, warmup=1, active=args.active, repeat=1)
            with torch.profiler.profile(activities=activities, schedule=schedule) as prof, torch.no_grad():
                model.generate(ids, logits_processor=LogitsProcessorList([ProfilerStep(prof)]), **kw)
            print(f"== {name}, 1 x {args.length}, {args.active} generate() steps after {args.wait}")
            print(summarize(list(prof.events()), args.active, on_gpu))
            if not args.no_filled:
                print(f"== {name}, 1 x {args.length}, {args.active} steps on a filled cache after {args.wait}")
                print(summarize(filled_steps(model, args, activities), args.active, on_gpu))
        finally:
            unpatch_model(model)


if __name__ == "__main__":
    main()
