"""The host part of a captured decode step on the CPU alone, warm and after a wait: is the host slow, or cold?

``probe_host_step.py`` measures the host part of a captured step on the GPU (100-350 µs before the replay on an
H100's host, 2026-12-06, where this machine's CPU runs the same Python in ~25 µs). This probe runs that host part
with the graph's replay replaced by nothing (a tiny model of the 8B shape's layer count on the CPU, its steps never
computed: the patch's hooks, the checks, the plan, the buffers' fills and the token's copy run as in a captured
step), ``--steps`` times per row, each step after ``--wait`` milliseconds of ``none`` (back to back: a warm CPU),
``sleep`` (the thread sleeps, as a host waiting on a blocking sync) or ``spin`` (a busy loop). It reports the
median µs of each stage (``probe_host_step.Clock``'s: ``hook``, ``checks``, ``plan``, ``fill``, ``launch``) and of
the whole host part (``host_us``)::

    python benchmarks/probe_host_cold.py --waits none,sleep,spin     # any machine; no GPU needed

Not a test of the library's steps (their graphs are tests/test_graphs.py's): a measurement of its host Python.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_e2e import build_model, fill_caches, llama8b_config
from probe_host_step import Clock

from hf_sparse_kv import cache_kwarg, graphs, patch_model, unpatch_model
from hf_sparse_kv.policies import Dense, Quest


class _NoGraph:
    """A captured graph whose replay does nothing (the step's GPU work is not what is measured)."""

    def replay(self) -> None:
        pass


def _init(inner):
    def init(self, *args, **kwargs):
        inner(self, *args, **kwargs)
        self.capture = True  # the captured path (a no-op graph), not the CPU's static step

    return init


def wait(how: str, ms: float) -> None:
    if how == "sleep":
        time.sleep(ms / 1000)
    elif how == "spin":
        t = time.perf_counter()
        while time.perf_counter() - t < ms / 1000:
            pass


def probe(layers: int, length: int, steps: int, waits: list[str], wait_ms: float) -> list[dict]:
    cfg = llama8b_config(layers)
    cfg.update({"vocab_size": 256, "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4})
    cfg.update({"num_key_value_heads": 2, "head_dim": 16})
    model = build_model(layers, "cpu", cfg)
    logits = torch.zeros(1, 1, cfg.vocab_size)
    rows = []
    patches = [
        mock.patch.object(graphs, "step_applies", graphs.static_step_applies),  # CPU ids
        mock.patch.object(graphs.DecodeGraphs, "__init__", _init(graphs.DecodeGraphs.__init__)),
        mock.patch.object(graphs.DecodeGraphs, "_capture", lambda self: (_NoGraph(), logits)),
        mock.patch.object(torch.cuda, "CUDAGraph", _NoGraph),  # the Clock wraps CUDAGraph.replay
    ]
    for p in patches:
        p.start()
    try:
        for how in waits:
            for name, policy in (("Dense", Dense()), ("Quest 1/16", Quest(budget=0.0625))):
                with torch.no_grad():
                    patch_model(model, policy=policy, cuda_graph=True)
                    _, cache = fill_caches(model, 1, length, 16, "cpu", dense=False)
                    clock = Clock(stamps=True)
                    ids = torch.zeros(1, 1, dtype=torch.long)
                    kw = {cache_kwarg(model): cache, "use_cache": True}
                    times = []
                    for i in range(steps + 5):
                        pos = torch.full((1, 1), length + i)
                        wait(how, wait_ms)
                        t0 = time.perf_counter()
                        model(ids, position_ids=pos, **kw)
                        if i >= 5:
                            times.append({**clock.stages(t0), "host_us": 1e6 * (clock.enter - t0)})
                    clock.close()
                    unpatch_model(model)
                rows.append({"row": name, "wait": how, **{k: statistics.median(t[k] for t in times) for k in times[0]}})
    finally:
        for p in reversed(patches):
            p.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=180)
    ap.add_argument("--waits", default="none,sleep,spin")
    ap.add_argument("--wait-ms", type=float, default=7.0, help="the wait before each step (a GPU step's time)")
    args = ap.parse_args()
    rows = probe(args.layers, args.length, args.steps, args.waits.split(","), args.wait_ms)
    keys = [k for k in rows[0] if k.endswith("_us")]
    print(f"{args.layers} layers, 1 x {args.length}, median of {args.steps} steps, {args.wait_ms} ms waits (µs)")
    print(f" {'row':<11} {'wait':<6} " + " ".join(f"{k:>10}" for k in keys))
    for r in rows:
        print(f" {r['row']:<11} {r['wait']:<6} " + " ".join(f"{r[k]:>10.1f}" for k in keys))


if __name__ == "__main__":
    main()
