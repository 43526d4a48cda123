"""Shared timing helpers of the benchmarks: GPU timing (median), an HBM bandwidth probe, tables and CSV.

Timing: ``bench`` runs a function a few times eagerly (compilation, autotuning, allocator warm-up), captures it in a
CUDA graph when it can (so that several launches cost what a decode step under graphs costs, not the Python launch
overhead), then times each replay with CUDA events, flushing the L2 cache before each one by reading a 256 MB buffer
(a decode step reads each layer's cache once, so a warm L2 would flatter small working sets), and returns the median
in microseconds.
"""

from __future__ import annotations

import csv
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

_FLUSH: dict[torch.device, torch.Tensor] = {}


def cpu_dry_run() -> None:
    """Prepare a benchmark's CPU dry run of Triton kernels: they run through Triton's interpreter, which needs
    ``TRITON_INTERPRET=1`` set before ``triton`` is imported (a clear exit here when it is not) and the tests' four
    fixes to it (``tests/interpreter_shims.py``: NumPy >= 2.4 loop bounds, bf16 ``tl.dot``, bf16 and float8 casts)."""
    if not os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("a CPU run of the Triton kernels needs TRITON_INTERPRET=1 in the environment")
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from interpreter_shims import apply

    apply()


def _flush_buffer(device: torch.device) -> torch.Tensor:
    if device not in _FLUSH:  # 256 MB, over 4x the H200's 60 MB L2
        _FLUSH[device] = torch.ones(64 * 2**20, dtype=torch.float32, device=device)
    return _FLUSH[device]


def bench(
    fn: Callable[[], object] | Sequence[Callable[[], object]],
    rep: int = 30,
    warmup: int = 3,
    graph: bool = True,
    flush: bool = True,
):
    """Median time of ``fn()`` in microseconds and how it was timed (``"graph"``, ``"eager"``, ``"cpu"``).

    ``fn`` may be a list, e.g. one call per layer, each on its own memory: they run in sequence (in one graph) and
    the time returned is per call, so a single replay's fixed costs are shared as in a model's decode step.
    """
    if isinstance(fn, (list, tuple)):
        fns = list(fn)
        us, mode = bench(lambda: [f() for f in fns], rep, warmup, graph, flush)
        return us / len(fns), mode
    if not torch.cuda.is_available():  # a dry run on the CPU: wall clock, no graph, no flush
        fn()
        times = []
        for _ in range(min(rep, 3)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6, "cpu"
    device = torch.device("cuda", torch.cuda.current_device())
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    run, mode = fn, "eager"
    if graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            torch.cuda.synchronize()
            run, mode = g.replay, "graph"
        except Exception:  # noqa: BLE001 - some callables cannot be captured: time them eagerly
            torch.cuda.synchronize()
    buf = _flush_buffer(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    run()
    for i in range(rep):
        if flush:  # by reading: a write (Triton's do_bench zeroes a buffer) would leave the L2 full of dirty lines
            buf.sum()  # that the timed kernel then pays to write back (~15 us for 60 MB at 4 TB/s)
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3, mode


def hbm_bandwidth(device: torch.device | str = "cuda", nbytes: int = 2**31, rep: int = 20) -> float:
    """Measured HBM bandwidth in GB/s: a device-to-device copy of ``nbytes``, counting bytes read plus written."""
    src = torch.randint(0, 127, (nbytes,), dtype=torch.int8, device=device)
    dst = torch.empty_like(src)
    us, _ = bench(lambda: dst.copy_(src), rep=rep, graph=False, flush=False)
    return 2 * nbytes / (us * 1e-6) / 1e9


def env_info() -> dict[str, str]:
    """Device and versions, for the header of a result."""
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "cuda": str(torch.version.cuda)}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, sms=str(p.multi_processor_count), memory_gib=f"{p.total_memory / 2**30:.0f}")
    return info


def fmt(x: object, digits: int = 1) -> str:
    """A cell: floats with ``digits`` decimals, None as ``n/a``."""
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def print_table(rows: Sequence[dict], columns: Sequence[str], title: str | None = None) -> None:
    """Print ``rows`` (dicts) as a fixed-width table of ``columns`` (missing cells print as ``n/a``)."""
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    if title:
        print(f"\n{title}")
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def write_csv(path: str, rows: Sequence[dict]) -> None:
    """Write ``rows`` (dicts, union of keys as the header, in first-seen order) to ``path``, creating its folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
