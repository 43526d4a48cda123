"""Where the GPU time of one decode step goes: selection, attention, KV write, and the rest of the model.

Llama-3.1-8B shape (random weights, bf16), the model and caches of ``bench_e2e.py``. One command on the GPU::

    python benchmarks/bench_split.py --out benchmarks/results/bench_split.csv

Method. For each (batch, context) and row, the step is first timed by the wall clock: ``--warmup`` + ``--steps``
eager decode steps (no CUDA graph), synchronised around each one, median (``bench_e2e.time_decode``); these also
warm up the kernels. Then ``--steps`` more steps at the same positions run under ``torch.profiler`` (CPU and CUDA
activities), and every CUDA kernel (memcpy and memset included) is put into one category by its name:

- selection: ``block_scores_kernel``, ``topk_indices_kernel``
- attention: ``sparse_decode_fwd_kernel``, ``merge_partials_kernel``, and SDPA's kernels for the unpatched row
  (names containing flash, fmha, attention, sdpa, efficient or cudnn)
- write: ``paged_write_kernel``
- rest: everything else: matmuls, norms, rope, the argmax of the next token, and the small torch kernels that the
  library launches around its Triton kernels (a policy's index arithmetic, ``blocks_to_tokens`` of the token mode,
  SinkWindow's selection, the step's metadata copies): these are not told apart by name, so they count here; so
  does the unpatched row's KV write (``DynamicCache`` concatenates, a ``cat`` kernel like rope's).

Patched rows keep ``patch_model``'s default dense layers (0 and 1: no selection there), as ``bench_e2e`` does.

Columns: wall ms/step, GPU µs/step (sum of kernel time / steps), host_ms = wall - GPU (the step's time the GPU spends
idle, waiting for Python to launch), and µs and % of the GPU time per category. The kernels' names and times are
printed per row, so the classification can be checked. ``--device cpu`` is a dry run of the script: there are no
kernels, so each CPU op's self time is classified instead, by the reference function (``ops/reference.py``) or SDPA
op it runs in.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import ROWS as E2E_ROWS
from bench_e2e import build_model, fill_caches, sync, time_decode
from common import env_info, print_table, write_csv

from hf_sparse_kv import patch_model, unpatch_model

CATEGORIES = ("selection", "attention", "write", "rest")
SHORT = {"selection": "sel", "attention": "attn", "write": "write", "rest": "rest"}
KERNELS = (  # (substring of a kernel or op name, lower case; category): first match wins
    ("block_scores", "selection"),
    ("topk_indices", "selection"),
    ("sparse_decode_fwd", "attention"),
    ("merge_partials", "attention"),
    ("paged_write", "write"),
    *((s, "attention") for s in ("flash", "fmha", "attention", "sdpa", "efficient", "cudnn")),
)
REFERENCE = {  # function of ops/reference.py -> category: the CPU dry run classifies an op by the one it runs in
    "block_scores": "selection",
    "token_scores": "selection",
    "topk_indices": "selection",
    "decode_blocks": "attention",
    "decode_tokens": "attention",
    "decode_masked": "attention",
    "merge_partials": "attention",
    "paged_write": "write",
}
ROW_NAMES = ("patched Dense", "Quest 1/8 block", "Quest 1/16 block", "Quest 1/16 token", "SinkWindow 1/16 block")
ROWS = [r for r in E2E_ROWS if r[0] in ROW_NAMES]
assert len(ROWS) == len(ROW_NAMES), "a row of bench_e2e.ROWS was renamed"


def by_name(name: str) -> str | None:
    low = name.lower()
    return next((cat for s, cat in KERNELS if s in low), None)


def kernel_us(e) -> float:
    """Device time of one kernel event in µs: its interval, else ``device_time_total`` / ``cuda_time_total``
    (renamed across torch versions)."""
    if getattr(e, "time_range", None) is not None:
        return e.time_range.elapsed_us()
    return float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0))


def cpu_category(e) -> str:
    """Category of a CPU op: from its own name or an enclosing op (SDPA), or the reference function it runs in."""
    while e is not None:
        if e.is_python_function:
            hit = REFERENCE.get(e.name.rsplit("): ", 1)[-1])
        else:
            hit = by_name(e.name)
        if hit:
            return hit
        e = e.cpu_parent
    return "rest"


def split(prof, steps: int, on_gpu: bool) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """µs per step by category, and by category and kernel (or op) name, from the profiler's events."""
    per_name: dict[str, dict[str, float]] = {c: defaultdict(float) for c in CATEGORIES}
    for e in prof.events():
        if on_gpu:
            if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
                continue  # CPU ops, and GPU-side ranges of record_function (they span kernels)
            cat, us = by_name(e.name) or "rest", kernel_us(e)
        else:
            if e.is_python_function or e.device_type != DeviceType.CPU:
                continue
            cat, us = cpu_category(e), e.self_cpu_time_total
        per_name[cat][e.name] += us / steps
    return {c: sum(per_name[c].values(), 0.0) for c in CATEGORIES}, per_name


def profile_decode(model, cache, batch: int, length: int, steps: int) -> tuple[dict, dict]:
    """Profile ``steps`` decode steps (already warmed up) and split their time; the cache is cropped back after."""
    on_gpu = model.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    sync(model.device)
    with profile(activities=activities, with_stack=not on_gpu) as prof:  # python frames: for the CPU dry run
        time_decode(model, cache, batch, length, steps, warmup=0)
    return split(prof, steps, on_gpu)


def row_result(shape: tuple[int, int], name: str, wall_s: list[float], parts: tuple[dict, dict], gpu: bool) -> dict:
    """One table row; prints the row and its largest kernels per category."""
    (batch, length), (cats, per_name) = shape, parts
    wall_ms, total = 1000 * statistics.median(wall_s), sum(cats.values())
    out = {"batch": batch, "context": length, "row": name, "wall_ms": wall_ms, "gpu_us": total}
    out["host_ms"] = wall_ms - total / 1000 if gpu else None  # CPU op self times do not add up to a wall time
    for c in CATEGORIES:
        out[f"{SHORT[c]}_us"], out[f"{SHORT[c]}_%"] = cats[c], 100 * cats[c] / total if total else 0.0
    print(out, flush=True)
    for c in CATEGORIES:
        top = sorted(per_name[c].items(), key=lambda kv: -kv[1])[:4]
        print(f"  {c:9s} " + "; ".join(f"{k[:70]} {v:.1f}" for k, v in top), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1x32768,1x131072,8x32768", help="BxL,...")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/bench_split.csv")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script")
    args = p.parse_args()
    device = args.device
    print(env_info(), flush=True)
    model = build_model(args.layers, device)
    print(f"model built: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters", flush=True)
    results = []

    for shape in args.shapes.split(","):
        batch, length = map(int, shape.split("x"))
        dense_cache, paged = fill_caches(model, batch, length, args.block_size, device)
        wall = time_decode(model, dense_cache, batch, length, args.steps, args.warmup)
        parts = profile_decode(model, dense_cache, batch, length, args.steps)
        results.append(row_result((batch, length), "unpatched sdpa", wall, parts, device == "cuda"))
        del dense_cache
        if device == "cuda":
            torch.cuda.empty_cache()
        for name, policy, mode, graph in ROWS:
            patch_model(model, policy=policy, mode=mode, block_size=args.block_size, cuda_graph=graph)
            wall = time_decode(model, paged, batch, length, args.steps, args.warmup)
            parts = profile_decode(model, paged, batch, length, args.steps)
            results.append(row_result((batch, length), name, wall, parts, device == "cuda"))
            unpatch_model(model)
        del paged
        if device == "cuda":
            torch.cuda.empty_cache()

    write_csv(args.out, results)
    cols = ["batch", "context", "row", "wall_ms", "gpu_us", "host_ms"]
    cols += [f"{SHORT[c]}_{u}" for c in CATEGORIES for u in ("us", "%")]
    title = f"Llama-3.1-8B shape, {args.layers} layers, bf16, block_size {args.block_size}: GPU time per decode step"
    if device != "cuda":
        title += " (CPU dry run: gpu_us is the CPU ops' self time, classified by the reference function they run in)"
    print_table(results, cols, title=title)


if __name__ == "__main__":
    main()
