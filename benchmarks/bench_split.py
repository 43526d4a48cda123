"""Where the GPU time of one decode step goes: selection, attention, KV write, the weights' matmuls, inductor's fused
kernels and the rest; eager steps, and the captured and compiled steps that ``bench_e2e.py`` times.

Llama-3.1-8B shape (random weights, bf16), the model, caches and rows of ``bench_e2e.py``. The eager rows on the GPU::

    python benchmarks/bench_split.py --out benchmarks/results/bench_split.csv

The captured and the compiled-and-captured steps at 1 x 128K (each ``graph+compile:`` row compiles first, about 30 s
on the 8B shape)::

    python benchmarks/bench_split.py --shapes 1x131072 --rows "graph: Quest 1/16 block,\
graph+compile: patched Dense,graph+compile: Quest 1/16 block" --out benchmarks/results/bench_split_graph.csv

Rows. ``--rows`` names them: ``unpatched sdpa`` (the model on a ``DynamicCache``) and any row of ``bench_e2e.ROWS``
(eager ``...`` and captured ``graph: ...``) or ``bench_e2e.COMPILED_ROWS`` (``graph+compile: ...``, the captured step
compiled by inductor; ``reduce-overhead: ...``, the user's compiled forward on a reserved cache), patched as
``bench_e2e`` patches them (``bench_e2e.patched``). The default is the eager rows: unpatched sdpa, patched Dense,
Quest 1/8 and 1/16 block, Quest 1/16 token, SinkWindow 1/16 block. Patched rows keep ``patch_model``'s default dense
layers (0 and 1: no selection there). At each shape the unpatched row runs first, then the others in the given order.

Method. For each (batch, context) and row, the step is first timed by the wall clock: ``--warmup`` + ``--steps``
decode steps, synchronised around each one, median (``bench_e2e.time_decode``); the warm-up steps capture the CUDA
graphs and compile. Then ``--steps`` more steps (the next positions: no capture and no compile is left) run under
``torch.profiler`` (CPU and CUDA activities), and every GPU activity (kernels, memcpy, memset) is put into one
category by its name (``category``), case-insensitive, the first rule that matches:

- fused: inductor's generated kernels (names starting with ``triton_``: ``triton_poi_``, ``triton_red_``,
  ``triton_per_``), except its GEMM templates (``triton_tem_``), which are matmul; first, because inductor names a
  fused kernel after the ops it feeds, ours included (``..._cos_mul_neg_paged_write_1``: the rotary before the write)
- selection, attention, write: our Triton kernels (``OURS``, substrings of the kernel names of
  ``hf_sparse_kv/ops/triton/*.py``; a test checks that every kernel there is listed): the scoring
  (``block_scores_kernel``, ``projected_scores_kernel``, ``candidate_*_kernel``, ``quant_block_lse*_kernel``,
  ``quant_lse_stats_kernel``, ``quant_mass_kernel``, ``pq_block_lse_kernel``) and the top-k (``topk_indices_kernel``, ``topk_radix_*_kernel``)
  are selection; ``sparse_decode_fwd_kernel`` and ``merge_partials_kernel`` attention; ``paged_write_kernel`` and the
  declared state's refresh (``projected_write_kernel``, ``quant_write_kernel``, ``pq_write_kernel``, and
  ``pq_encode_kernel`` of a prefill fit) write
- attention: SDPA's kernels in the unpatched row (names containing flash, fmha, attention, sdpa, efficient, cudnn)
- matmul: cuBLAS / CUTLASS kernels (names containing gemm, gemv, cublas, cutlass, nvjet, xmma): the weights
- rest: everything else: the norms, rope, SiLU and residual adds of the eager steps, the argmax of the next token, the
  small torch kernels that the library launches around its Triton kernels (a policy's index arithmetic,
  ``blocks_to_tokens`` of the token mode, SinkWindow's selection, the step's metadata copies, a static step's
  buffer copies), and the unpatched row's KV write (``DynamicCache`` concatenates, a ``cat`` kernel like rope's).

Captured steps. Whether the profiler sees the kernels a CUDA graph replays depends on the CUDA / CUPTI version (the
script calls ``torch.profiler._utils._init_for_cuda_graphs`` before any capture, which some versions need). A kernel
of a replay carries the correlation id of its ``cudaGraphLaunch``; a graph row whose launches show no kernel (and
none of the matmuls or attention, which only run inside the graph) says so in its ``note`` and reports no split
rather than the zeros of what it did not see. A row that should replay and shows no graph launch says that too.

Columns: wall ms/step; ``kernels``: GPU activities per step (the launches a step costs); ``gpu_us``: their time per
step; ``gap_us`` = wall - gpu_us: the step's time the GPU spends idle (eager steps: waiting for Python to launch;
captured steps: the host part before the replay, the launch, and the idle between the replayed kernels);
``bubble_us``: the last of these alone, the GPU idle between the first and last kernel of each replay; µs per
category (the CSV also has % of gpu_us); ``mm_gb_s``: the model's weight bytes per step (``bench_e2e.weight_bytes``)
over the matmul µs (compare with the copy bandwidth in the title). The largest kernels of each category are printed
per row with µs per step, so the classification can be checked.

``--device cpu`` is a dry run of the script (``--tiny``: the tiny model of ``bench_e2e``): there are no kernels, so
each CPU op's self time is classified instead, by our op or reference function (``ops/reference.py``) or the SDPA op
it runs in, else by its own name (``aten::mm``: matmul); ``kernels`` counts ops (nested ones too). The ``graph:`` and
``graph+compile:`` rows run their steps eagerly there (a captured step needs a CUDA batch); the
``reduce-overhead:`` rows compile with ``aot_eager``::

    python benchmarks/bench_split.py --device cpu --tiny --shapes 1x256 --steps 2 --warmup 1 --out /tmp/split.csv \
        --rows "unpatched sdpa,patched Dense,graph: Quest 1/16 block,graph+compile: Quest 1/16 block"
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from torch.profiler._utils import _init_for_cuda_graphs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import (
    COMPILED_ROWS,
    DECODE_ROOM,
    ROWS,
    build_model,
    empty_cache,
    fill_caches,
    patched,
    sync,
    time_decode,
    tiny_config,
    weight_bytes,
)
from common import env_info, hbm_bandwidth, print_table, write_csv

CATEGORIES = ("selection", "attention", "write", "matmul", "fused", "rest")
SHORT = {"selection": "sel", "attention": "attn", "write": "write", "matmul": "mm", "fused": "fused", "rest": "rest"}
OURS = (  # (substring, category): our Triton kernels (ops/triton/*.py), and for the CPU dry run our ops and the
    # reference functions (ops/reference.py) they run; first match wins
    ("decode_linear", "matmul"),  # decode_linear=True: the weights' products through our Triton matmul
    ("paged_write", "write"),
    ("projected_write", "write"),
    ("quant_write", "write"),
    ("pq_write", "write"),
    ("pq_encode", "write"),  # a prefill fit's k-means rounds (the write that starts a cache)
    ("fp8_write", "write"),
    ("sparse_decode_fwd", "attention"),
    ("merge_partials", "attention"),
    ("decode_blocks", "attention"),
    ("decode_tokens", "attention"),
    ("decode_masked", "attention"),
    ("block_scores", "selection"),  # also oracle_ and quant_block_scores (CPU)
    ("block_shares", "selection"),
    ("token_scores", "selection"),
    ("projected_scores", "selection"),
    ("candidate_scores", "selection"),
    ("candidate_mass", "selection"),
    ("quant_block_lse", "selection"),
    ("quant_lse_stats", "selection"),
    ("quant_mass", "selection"),
    ("fp8_block", "selection"),  # fp8_block_lse_kernel, and fp8_block_scores (CPU)
    ("pq_group", "selection"),  # pq_group_table_kernel, pq_group_lse_kernel
    ("lse_block_mass", "selection"),
    ("topk_indices", "selection"),
    ("topk_radix", "selection"),
)
SDPA = ("flash", "fmha", "attention", "sdpa", "efficient", "cudnn")
MATMUL = ("gemm", "gemv", "cublas", "cutlass", "nvjet", "xmma", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")
UNPATCHED = "unpatched sdpa"
PATCHED = {r[0]: (r, None) for r in ROWS}  # name -> ((name, policy, mode, cuda_graph), compiled) for bench_e2e.patched
PATCHED |= {name: ((name, policy, mode, how != "reduce-overhead"), how) for name, policy, mode, how in COMPILED_ROWS}
DEFAULT_ROWS = (UNPATCHED, "patched Dense", "Quest 1/8 block", "Quest 1/16 block", "Quest 1/16 token")
DEFAULT_ROWS += ("SinkWindow 1/16 block",)


def ours(name: str) -> str | None:
    """The category of one of our kernels, ops or reference functions by its name; ``None`` for any other name."""
    low = name.lower()
    return next((cat for s, cat in OURS if s in low), None)


def category(name: str) -> str:
    """The category of a kernel (or, in the CPU dry run, an op) by its name."""
    low = name.lower()
    # inductor first: triton_poi_ / triton_red_ / triton_per_ (triton_tem_ is a GEMM template); its fused kernels are
    # named after the ops they feed, ours included (the rotary before paged_write: "..._cos_mul_neg_paged_write_1")
    if low.startswith("triton_"):
        return "matmul" if low.startswith("triton_tem") else "fused"
    hit = ours(name)
    if hit:
        return hit
    if any(s in low for s in SDPA):
        return "attention"
    return "matmul" if any(s in low for s in MATMUL) else "rest"


def kernel_us(e) -> float:
    """Device time of one kernel event in µs: its interval, else ``device_time_total`` / ``cuda_time_total``
    (renamed across torch versions)."""
    if getattr(e, "time_range", None) is not None:
        return e.time_range.elapsed_us()
    return float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0))


def is_python(e) -> bool:
    """Whether a profiler event is a Python function (``with_stack``): ``FunctionEvent.is_python_function`` where torch
    has it (2.13), else its name's form ``file.py(line): name`` (torch 2.11 has no such attribute)."""
    flag = getattr(e, "is_python_function", None)
    if flag is not None:
        return bool(flag)
    return e.name.startswith("<built-in ") or re.match(r"^.+?\(\d+\): ", e.name) is not None


def cpu_category(e) -> str:
    """Category of a CPU op: selection, attention or write from itself or an enclosing op (ours, SDPA) or Python
    function (ours, a reference function; not a module: ``LlamaAttention`` holds the projections), else from its own
    name (matmul or rest). Where the profiler gives no Python functions as parents (torch 2.11 gives none as
    events), the op's own recorded stack (``FunctionEvent.stack``, ``file(line): name`` frames) stands in."""
    own, stack = category(e.name), list(getattr(e, "stack", None) or [])
    while e is not None:
        hit = ours(e.name.rsplit("): ", 1)[-1]) if is_python(e) else category(e.name)
        if hit in ("selection", "attention", "write"):
            return hit
        e = e.cpu_parent
    for frame in stack:
        hit = ours(frame.rsplit("): ", 1)[-1])
        if hit in ("selection", "attention", "write"):
            return hit
    return own


def split(events, steps: int, on_gpu: bool) -> dict:
    """Per step, from the profiler's events: µs by category and name (``per_name``), GPU activities (``kernels``; the
    CPU dry run: ops), CUDA graph launches, the kernels that carry a launch's correlation id (``graph_kernels``) and
    the GPU idle between the first and last kernel of each replay (``bubble_us``; ``None`` without such kernels)."""
    per_name: dict[str, dict[str, float]] = {c: defaultdict(float) for c in CATEGORIES}
    count, launches, replays = 0, set(), defaultdict(list)
    for e in events:
        if on_gpu and e.device_type == DeviceType.CPU and "GraphLaunch" in e.name:
            launches.add(e.id)  # the runtime call cudaGraphLaunch: its kernels carry its correlation id
        if on_gpu:
            if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
                continue  # CPU ops, and GPU-side ranges of record_function (they span kernels)
            cat, us = category(e.name), kernel_us(e)
            replays[e.id].append(e)
        else:
            if is_python(e) or e.device_type != DeviceType.CPU:
                continue
            cat, us = cpu_category(e), e.self_cpu_time_total
        per_name[cat][e.name] += us / steps
        count += 1
    graph = [ks for i, ks in replays.items() if i in launches]
    span = sum(max(k.time_range.end for k in ks) - min(k.time_range.start for k in ks) for ks in graph)
    busy = sum(kernel_us(k) for ks in graph for k in ks)
    return {"per_name": per_name, "kernels": count / steps, "launches": len(launches) / steps,
            "graph_kernels": sum(map(len, graph)) / steps, "bubble_us": (span - busy) / steps if graph else None}  # fmt: skip


def trace_note(parts: dict, on_gpu: bool, graph: bool) -> tuple[bool, str | None]:
    """Whether a row's split was measured, and a note on how its CUDA graphs were seen (``None``: nothing to say)."""
    if not graph:
        return True, None
    if not on_gpu:
        return True, "CPU: no CUDA graph (graph rows run eagerly, reduce-overhead rows compiled by aot_eager)"
    if not parts["launches"]:
        return True, "no CUDA graph launch in the profile: the steps ran eagerly"
    if parts["graph_kernels"]:
        return True, None
    if parts["per_name"]["matmul"] or parts["per_name"]["attention"]:  # these run inside the graph only
        return True, "replayed kernels seen without their launch's correlation id: no bubble_us"
    return False, (
        f"no kernel of the {parts['launches']:g} graph launches per step in the profile (this CUDA/CUPTI does not "
        f"trace graph replays); only the {parts['kernels']:g} kernels per step launched outside the graph: no split"
    )


def profile_decode(model, cache, batch: int, start: int, steps: int) -> dict:
    """Profile ``steps`` decode steps from position ``start`` (warmed up: nothing is captured or compiled here)."""
    on_gpu = model.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    sync(model.device)
    with profile(activities=activities, with_stack=not on_gpu) as prof:  # python frames: for the CPU dry run
        time_decode(model, cache, batch, start, steps, warmup=0, crop=False)
    return split(prof.events(), steps, on_gpu)


def measure(model, cache, shape: tuple[int, int], name: str, args, graph: bool) -> dict:
    """Time then profile one row on the filled ``cache`` (cropped back to the context after); its table row."""
    batch, length = shape
    wall = time_decode(model, cache, batch, length, args.steps, args.warmup, crop=False)  # captures, compiles
    parts = profile_decode(model, cache, batch, length + args.warmup + args.steps, args.steps)
    cache.crop(length - cache.get_seq_length())  # negative: tokens to drop
    on_gpu = model.device.type == "cuda"
    return row_result(shape, name, wall, parts, (on_gpu, graph), weight_bytes(model, batch))


def row_result(shape: tuple[int, int], name: str, wall_s: list[float], parts: dict, kind, weights: int) -> dict:
    """One table row (``kind``: on the GPU, a row that replays CUDA graphs); prints it and its largest kernels per
    category."""
    (batch, length), per_name, (on_gpu, graph) = shape, parts["per_name"], kind
    measured, note = trace_note(parts, on_gpu, graph)
    cats = {c: sum(per_name[c].values(), 0.0) for c in CATEGORIES}
    total, wall_ms = sum(cats.values()), 1000 * statistics.median(wall_s)
    out = {"batch": batch, "context": length, "row": name, "wall_ms": wall_ms, "kernels": parts["kernels"],
           "gpu_us": total, "gap_us": 1000 * wall_ms - total if on_gpu else None, "bubble_us": parts["bubble_us"],
           "graph_kernels": parts["graph_kernels"] if graph else None}  # fmt: skip
    for c in CATEGORIES:
        out[f"{SHORT[c]}_us"], out[f"{SHORT[c]}_%"] = cats[c], 100 * cats[c] / total if total else 0.0
    out["mm_gb_s"] = weights / cats["matmul"] / 1e3 if on_gpu and cats["matmul"] else None
    if not measured:  # what was seen is not the step: say so rather than report it
        out |= dict.fromkeys([k for k in out if k.endswith(("_us", "_%", "_gb_s")) or k == "kernels"])
    out["note"] = note
    print(out, flush=True)
    for c in CATEGORIES:
        top = sorted(per_name[c].items(), key=lambda kv: -kv[1])[:4]
        print(f"  {c:9s} " + "; ".join(f"{k[:70]} {v:.1f}" for k, v in top), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1x32768,1x131072,8x32768", help="BxL,...")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="comma-separated row names (default: the eager rows)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tiny", action="store_true", help="a tiny model of the same ratios (a dry run, e.g. on the CPU)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/bench_split.csv")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script")
    p.add_argument("--crossover", default=None, help="crossover table for the auto rows (default: the shipped one)")
    args = p.parse_args()
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if set(rows) - {UNPATCHED, *PATCHED}:
        raise SystemExit(
            f"--rows: unknown {sorted(set(rows) - {UNPATCHED, *PATCHED})}; rows are {[UNPATCHED, *PATCHED]}"
        )
    if args.warmup + 2 * args.steps >= DECODE_ROOM:
        raise SystemExit(f"--warmup + 2 --steps must stay below {DECODE_ROOM} (the room the caches have)")
    device = args.device
    print(env_info(), flush=True)
    if device == "cuda":
        _init_for_cuda_graphs()  # before any capture: some CUPTI versions trace a graph's kernels only then
    model = build_model(args.layers, device, tiny_config() if args.tiny else None)
    print(f"model built: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters", flush=True)
    results = []

    def add(row: dict) -> None:  # the CSV rewritten after each row: a run stopped by a time limit keeps them
        results.append(row)
        write_csv(args.out, results)

    for shape in args.shapes.split(","):
        batch, length = map(int, shape.split("x"))
        dense_cache, paged = fill_caches(model, batch, length, args.block_size, device, dense=UNPATCHED in rows)
        if UNPATCHED in rows:
            add(measure(model, dense_cache, (batch, length), UNPATCHED, args, graph=False))
        del dense_cache
        empty_cache(device)
        for name in [r for r in rows if r != UNPATCHED]:
            row, compiled = PATCHED[name]
            with patched(model, paged, row, args, compiled, args.warmup + 2 * args.steps + 1):
                add(measure(model, paged, (batch, length), name, args, graph=row[3] or compiled is not None))
        del paged
        empty_cache(device)

    cols = ["batch", "context", "row", "wall_ms", "kernels", "gpu_us", "gap_us", "bubble_us"]
    cols += [f"{SHORT[c]}_us" for c in CATEGORIES] + ["mm_gb_s"]
    shape = (
        "tiny Llama (4 layers, 8/2 heads, head dim 32)" if args.tiny else f"Llama-3.1-8B shape, {args.layers} layers"
    )
    title = f"{shape}, bf16, block_size {args.block_size}: GPU time per decode step"
    if device == "cuda":
        title += f" (HBM copy bandwidth {hbm_bandwidth(device):.0f} GB/s)"
    else:
        title += " (CPU dry run: gpu_us is the CPU ops' self time, classified by the op or function they run in)"
    print_table(results, cols, title=title)
    for r in results:
        if r["note"]:
            print(f"  {r['batch']}x{r['context']} {r['row']}: {r['note']}")


if __name__ == "__main__":
    main()
