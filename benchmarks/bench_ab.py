"""Same-process A/B of two versions of hf_sparse_kv on bench_e2e's decode step: did a change move the speed?

Two runs of ``bench_e2e.py`` on one machine differ by a few percent from run to run (clocks, placement); a change
that must stay within +-3% needs both versions timed in one process, on one model, interleaved. Put the other
version's package in a folder (``git archive REV hf_sparse_kv | tar -x -C /tmp/old``; a version before 2026-12-06
registers its ops under a literal namespace: set ``NAMESPACE = __name__.split(".")[0]`` in its ``ops/library.py``,
as this one does, so that its ops do not take this version's names) and run::

    python benchmarks/bench_ab.py --old /tmp/old --shapes 1x131072,8x32768 \
        --rows "graph: patched Dense,graph: Quest 1/16 block" --rounds 2 --out benchmarks/results/bench_ab.csv

The old package is imported under the name ``hf_sparse_kv_old`` (its imports are relative), each version fills its
own cache with the same random K/V (``bench_e2e.fill_caches``), and every round times each row on both versions, in
alternating order. The table gives each version's median ms/token over the rounds' medians and new / old.

Compiled rows (``bench_e2e.COMPILED_ROWS``' ``graph+compile[+merged]: ...``) compile each version's captured step
anew in every round (dynamo reset after each).

Without ``--old``, ``--old-env NAME=VALUE`` makes "old" this package with that environment variable set while its
rows are patched, captured and timed: for a switch read at launch (and so at capture), such as the
``HF_SPARSE_KV_PDL=0`` of 13fc689 (programmatic dependent launch, measured and reverted)::

    python benchmarks/bench_ab.py --old-env NAME=VALUE --shapes 1x131072 --rows "graph: Quest 1/16 block"
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import importlib.util
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import COMPILED_ROWS, ROWS, build_model, fill_caches, step_options, time_decode
from common import env_info, print_table, write_csv

import hf_sparse_kv


def load_old(folder: Path):
    """The ``hf_sparse_kv`` package found in ``folder``, imported as ``hf_sparse_kv_old``."""
    init = folder / "hf_sparse_kv" / "__init__.py"
    if not init.exists():
        raise SystemExit(f"--old {folder}: no hf_sparse_kv/__init__.py there")
    spec = importlib.util.spec_from_file_location(
        "hf_sparse_kv_old", init, submodule_search_locations=[str(init.parent)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["hf_sparse_kv_old"] = module
    spec.loader.exec_module(module)
    library = importlib.import_module("hf_sparse_kv_old.ops.library")
    if getattr(library, "NAMESPACE", None) != "hf_sparse_kv_old":
        raise SystemExit(
            f"--old {folder}: its ops register under the namespace {getattr(library, 'NAMESPACE', None)!r}, as this "
            "version's do (one registry, the same op names: the second version's calls fail). Set NAMESPACE = "
            '__name__.split(".")[0] in its hf_sparse_kv/ops/library.py (versions before 2026-12-06 name it literally).'
        )
    return module


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """Within: the environment with ``values`` set; afterwards as it was."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _policies(version):
    return importlib.import_module(f"{version.__name__}.policies")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", type=Path, help="folder holding the other version's hf_sparse_kv/")
    p.add_argument("--old-env", help="NAME=VALUE: without --old, 'old' is this package run with that variable set")
    p.add_argument("--shapes", default="1x131072,8x32768")
    p.add_argument("--rows", default="graph: patched Dense,graph: Quest 1/16 block")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/bench_ab.csv")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    if (args.old is None) == (args.old_env is None) or (args.old_env is not None and "=" not in args.old_env):
        raise SystemExit("give --old FOLDER or --old-env NAME=VALUE (one of them)")
    versions = {"old": load_old(args.old) if args.old else hf_sparse_kv, "new": hf_sparse_kv}
    env = dict([args.old_env.split("=", 1)]) if args.old_env else {}
    print(env_info(), flush=True)
    model = build_model(args.layers, args.device)
    # (name, policy, mode, cuda_graph, how): a compiled row (COMPILED_ROWS' "graph", "graph+merged") is captured
    names = args.rows.split(",")
    rows = [(*r, None) for r in ROWS if r[0] in names]
    rows += [
        (name, pol, mode, True, how)
        for name, pol, mode, how in COMPILED_ROWS
        if name in names and how.startswith("graph")
    ]
    if len(rows) != len(names):
        raise SystemExit(f"--rows: unknown or unsupported rows {sorted(set(names) - {r[0] for r in rows})}")
    results, summary = [], []
    for shape in args.shapes.split(","):
        batch, length = map(int, shape.split("x"))
        caches = {
            name: fill_caches(
                model, batch, length, args.block_size, args.device, cache_cls=v.PagedKVCache, dense=False
            )[1]
            for name, v in versions.items()
        }
        times = {(name, row[0]): [] for name in versions for row in rows}
        for rnd in range(args.rounds):
            order = list(versions) if rnd % 2 == 0 else list(reversed(versions))
            for row, policy, mode, graph, how in rows:
                for name in order:
                    v = versions[name]
                    pol = getattr(_policies(v), type(policy).__name__)(
                        **{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
                    )
                    with environment(env if name == "old" else {}):
                        opts = step_options(args.device, how)
                        v.patch_model(
                            model, policy=pol, mode=mode, block_size=args.block_size, cuda_graph=graph, **opts
                        )
                        t = time_decode(model, caches[name], batch, length, args.steps, args.warmup)
                        v.unpatch_model(model)
                        if how:
                            torch._dynamo.reset()
                    ms = 1000 * statistics.median(t)
                    times[(name, row)].append(ms)
                    results.append({"batch": batch, "context": length, "row": row, "version": name, "round": rnd,
                                    "ms_per_token": ms})  # fmt: skip
                    print(results[-1], flush=True)
        for row, *_ in rows:
            old, new = (statistics.median(times[(n, row)]) for n in ("old", "new"))
            summary.append({"batch": batch, "context": length, "row": row, "old_ms": old, "new_ms": new,
                            "new_over_old": new / old})  # fmt: skip
        del caches
        gc.collect()  # a cache and its captured-graph runner refer to each other
        if args.device == "cuda":
            torch.cuda.empty_cache()
    write_csv(args.out, results)
    print_table(summary, ["batch", "context", "row", "old_ms", "new_ms", "new_over_old"],
                title=f"A/B, median over {args.rounds} rounds of the median of {args.steps} steps")  # fmt: skip


if __name__ == "__main__":
    main()
