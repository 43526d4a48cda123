"""What does one captured-path decode step run, layer by layer, against another version of the package? (CPU)

A CUDA graph replays every kernel its capture launched; a step that recomputes something per layer pays it per layer
at every token, and a host part before the replay is paid at every token too (the GPU waits). This script runs the
step ``DecodeGraphs.step`` runs (``capture=False`` on the CPU: the same forward, without a graph) on a tiny Llama,
records every aten op and every call of the backend's op namespace (``OPS.<name>``: one Triton launcher on the GPU,
its reference's inner ops not listed), by region, for this checkout's ``hf_sparse_kv`` and, with ``--old``, for
another version's package (a folder holding ``hf_sparse_kv/``, as for ``bench_ab.py``), and prints the op counts
per region and the differences (the other version must not register the ops as ``torch.library`` custom ops, as
versions up to ea754b3 do not: two packages registering ``hf_sparse_kv::*`` in one process collide; compare two such
versions with ``--full`` runs from each checkout)::

    python benchmarks/trace_static_step.py --old .ab/old --out benchmarks/results/trace_static_step.txt

Regions: ``host`` (before the forward: the step's buffers and ids, outside the graph), ``forward`` (embedding,
rotary and mask, before layer 0), ``L<i> attn`` (the attention module: projections, rotary, the write, selection,
decode, output projection), ``L<i> rest`` (the norm after the attention, the MLP, the next layer's input norm),
``post`` (final norm, head, the logits' clone). Views count as ops here (they launch no kernel); each count also
gives the ops that are not views. Last, per policy, the host time of ``DecodeGraphs.step`` with the replay stubbed
(a ``--host-layers`` model, 32 by default as the 8B shape): what the GPU waits for before each replay when steps are
synchronised (``bench_e2e``'s ``time_decode`` and ``generate()`` do).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import difflib
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_ab import load_old
from transformers import LlamaConfig, LlamaForCausalLM

import hf_sparse_kv


class Recorder(TorchDispatchMode):
    """Every aten op (name and first tensor shape) by region; ``OPS.<name>`` for a call of the op namespace."""

    def __init__(self):
        super().__init__()
        self.region = "host"
        self.log: dict[str, list[tuple[str, bool]]] = collections.defaultdict(list)  # (op, is a view)
        self.inside_op = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside_op:
            shape = next((tuple(a.shape) for a in args if isinstance(a, torch.Tensor)), ())
            name = str(func).removeprefix("aten.").removesuffix(".default")
            self.log[self.region].append((f"{name}{list(shape)}", func.is_view))
        return func(*args, **(kwargs or {}))

    def wrap(self, ns) -> None:
        """Record each function of an op namespace as one op (its inner ops not listed)."""
        for name, fn in list(vars(ns).items()):
            if callable(fn):
                setattr(ns, name, self._wrapped(name, fn))

    def _wrapped(self, name, fn):
        def call(*args, **kwargs):
            if not self.inside_op:
                self.log[self.region].append((f"OPS.{name}", False))
            self.inside_op += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside_op -= 1

        return call

    def hooks(self, model) -> list:
        def at(region):
            return lambda *a: setattr(self, "region", region)

        handles = [model.model.register_forward_pre_hook(at("forward"))]
        for i, layer in enumerate(model.model.layers):
            handles.append(layer.self_attn.register_forward_pre_hook(at(f"L{i} attn")))
            handles.append(layer.self_attn.register_forward_hook(at(f"L{i} rest")))
        handles.append(model.model.norm.register_forward_pre_hook(at("post")))
        return handles


def tiny_llama(layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    return model


def patched(version, policy, layers: int, block_size: int):
    """A tiny Llama of ``layers`` patched by ``version`` (a package: the current one or an old copy) with its own
    class of ``policy`` (same fields), a fresh cache of that version, and the version's ``graphs`` module."""
    model = tiny_llama(layers)
    policies = importlib.import_module(f"{version.__name__}.policies")
    policy = getattr(policies, type(policy).__name__)(
        **{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
    )
    version.patch_model(model, policy=policy, mode="block", block_size=block_size, cuda_graph=True)
    cache = version.PagedKVCache(model.config, block_size=block_size)
    return model, cache, importlib.import_module(f"{version.__name__}.graphs")


def trace(version, policy, batch: int, length: int, layers: int, block_size: int) -> dict:
    """The op log of the second static step after a prefill of ``length`` random tokens per sequence."""
    model, cache, graphs = patched(version, policy, layers, block_size)
    ids = torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(1))
    rec = Recorder()
    with torch.no_grad():
        token = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
        runner = graphs.DecodeGraphs(
            model, cache, length + 8, capture=False, forward=type(model).forward.__get__(model)
        )
        runner.step(token)  # the first step makes what a captured step's warm-up makes
        static = getattr(cache, "static", None)
        for ns in [*cache._ops.values(), *([static.ops] if getattr(static, "ops", None) else [])]:
            rec.wrap(ns)
        handles = rec.hooks(model)
        with rec:
            runner.step(token)
        for h in handles:
            h.remove()
    version.unpatch_model(model)
    return rec.log


class _Replay:
    """Stands in for a captured graph: ``step()`` does all its host work and replays nothing."""

    def replay(self) -> None:
        pass


class _EveryPlan(dict):
    """A runner's graphs as if every plan had been captured (the same stand-in for each)."""

    def __init__(self, entry: tuple):
        super().__init__()
        self.entry = entry

    def __contains__(self, key) -> bool:
        return True

    def __getitem__(self, key) -> tuple:
        return self.entry


def host_time(version, policy, batch: int, layers: int, block_size: int, reps: int = 200) -> float:
    """Median µs of ``DecodeGraphs.step`` on the host with the graph replay stubbed (plan, buffers, counters, ids,
    the logits' clone): what the GPU waits for before each replay when steps are synchronised, at ``layers``."""
    model, cache, graphs = patched(version, policy, layers, block_size)
    ids = torch.randint(3, 96, (batch, 600), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        token = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
        runner = graphs.DecodeGraphs(model, cache, 600 + 20 * reps, capture=False)
        runner.step(token)
    logits = torch.zeros(batch, 1, model.config.vocab_size)
    entry = (_Replay(), logits) if hasattr(graphs, "begin_static_step") else (_Replay(), logits, (0, {}))
    runner.capture, runner.graphs = True, _EveryPlan(entry)
    pos = torch.zeros(batch, 1, dtype=torch.long)
    times = []
    for i in range(reps + 10):
        t0 = time.perf_counter()
        runner.step(token, pos)
        if i >= 10:
            times.append(time.perf_counter() - t0)
    version.unpatch_model(model)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", type=Path, default=None, help="folder holding another version's hf_sparse_kv/")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--length", type=int, default=2000)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--full", action="store_true", help="print every region's op list, not only the differences")
    p.add_argument("--host-layers", type=int, default=32, help="layers of the model whose host time is measured")
    p.add_argument("--out", default=None, help="also write the report to this file")
    args = p.parse_args()
    versions = {"new": hf_sparse_kv}
    if args.old is not None:
        versions = {"old": load_old(args.old), **versions}
    from hf_sparse_kv.policies import Dense, Quest

    lines = []
    for policy in (Quest(budget=0.0625), Dense()):
        logs = {name: trace(v, policy, args.batch, args.length, args.layers, args.block_size) for name, v in
                versions.items()}  # fmt: skip
        lines.append(f"===== {type(policy).__name__} (block mode, dense layers 0 and 1), B={args.batch}, "
                     f"{args.length} tokens, {args.layers} layers")  # fmt: skip
        regions = list(dict.fromkeys(r for log in logs.values() for r in log))
        for region in regions:
            ops = {name: [op for op, _ in log.get(region, [])] for name, log in logs.items()}
            kernels = {name: sum(not view for _, view in log.get(region, [])) for name, log in logs.items()}
            counts = ", ".join(f"{n} {len(o)} ops ({kernels[n]} not views)" for n, o in ops.items())
            lines.append(f"--- {region}: {counts}")
            if args.full:
                for name, o in ops.items():
                    lines.append(f"    {name}: {' '.join(o)}")
            elif len(ops) == 2 and ops["old"] != ops["new"]:
                diff = difflib.unified_diff(ops["old"], ops["new"], "old", "new", lineterm="", n=0)
                lines += [f"    {d}" for d in diff if not d.startswith(("---", "+++"))]
        host = {n: host_time(v, policy, args.batch, args.host_layers, args.block_size) for n, v in versions.items()}
        lines.append(f"--- host time of DecodeGraphs.step, replay stubbed, {args.host_layers} layers (median, µs): "
                     + ", ".join(f"{n} {us:.1f}" for n, us in host.items()))  # fmt: skip
    report = "\n".join(lines)
    print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
