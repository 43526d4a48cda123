"""Merged projections (``patch_model(merge_projections=True)``) checked on the 8B shape before they are timed: the
logits of compiled, captured decode steps with and without merging, against the unpatched model in float32.

    python benchmarks/check_merge.py --out benchmarks/results/check_merge.csv      # CUDA; a few minutes
    python benchmarks/check_merge.py --device cpu --tiny                            # a dry run (no graph, aot_eager)

Method: the Llama-3.1-8B shape with ``--layers`` layers and random weights, a real prefill of ``B x --context``
random tokens, then ``--steps`` decode steps fed the same fixed tokens (teacher forcing, so that a near tie in random
logits cannot fork the rows). Per dtype (``--dtypes``): the unpatched model, then patched ``Dense`` and ``Quest
1/16`` with ``cuda_graph=True, compile="inductor"``, each unmerged and merged. Columns: the largest relative error
(``max |d| / max |ref|`` over all steps) of each row's logits against the unpatched float32 model (``vs_fp32``), and
of a merged row against its unmerged twin of the same dtype (``vs_unmerged``), the greedy tokens of each step equal
to the twin's, NaN seen, the steps replayed from graphs. Merging changes only the order of the matmuls' sums, so in
float32 (TF32 off) a merged row must match its twin within ``--tol`` (1e-4); in bf16 a random-weight model amplifies
any rounding difference (on 2026-12-01 the unpatched bf16 model was 1.26 away from the float32 one at 8 layers:
random weights, not a fault), so bf16 rows are reported (``vs_unmerged``, argmax, NaN), and fail only on NaN.
Printed last as a table; the script exits with status 1 when a check fails.

``--model NAME`` (an asset of ``evaluation.assets.load_model``: ``qwen2.5-coder-1.5b``, ``gemma3-270m``,
``smollm2``, staged under ``$HF_SPARSE_KV_ASSETS`` on a machine without network) runs the same rows on that real
model, prefilled with ``B`` windows of the essays and fed their next tokens; there bf16 is expected to agree with
float32 too, so a bf16 merged row whose argmax differs from its twin's is reported (and fails with ``--strict-bf16``).
``ms_step`` is the median wall time of a decode step after the first two (on CUDA, synchronised per step): with
``--steps 32`` it compares merged and unmerged speed on that model.

    python benchmarks/check_merge.py --model qwen2.5-coder-1.5b --batch 2 --context 16384 --steps 32 \
        --dtypes float32,bfloat16 --out benchmarks/results/check_merge_qwen.csv
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_e2e import build_model, tiny_config
from common import env_info, print_table, write_csv

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.policies import Dense, Quest


def decode(model, ids, steps: torch.Tensor, cache=None, times: list[float] | None = None) -> torch.Tensor:
    """Logits ``[B, S, V]`` (float32) of the ``S`` decode steps after prefilling ``ids [B, L]``, step ``i`` fed
    ``steps[:, i]``; ``times`` (when given) gets each step's wall seconds (synchronised on CUDA)."""
    kw = {cache_kwarg(model): cache} if cache is not None else {}
    out = []
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    with torch.no_grad():
        res = model(ids, use_cache=True, **kw)
        past = res.past_key_values if cache is None else cache
        for i in range(steps.shape[1]):
            sync()
            t0 = time.perf_counter()
            res = model(steps[:, i : i + 1], use_cache=True, **{cache_kwarg(model): past})
            out.append(res.logits[:, -1].float())
            sync()
            if times is not None:
                times.append(time.perf_counter() - t0)
    return torch.stack(out, 1)


def real_model(name: str, dtype: torch.dtype, device: str):
    """(model, tokenizer): the asset ``name`` loaded in ``dtype`` (a GGUF model refuses ``.to(dtype)``)."""
    from evaluation.assets import load_model  # the repository root is on sys.path (top of this file)

    return load_model(name, dtype=dtype, device=device)


def real_inputs(name: str, batch: int, context: int, steps: int, device: str):
    """(float32 model, ids ``[B, context]``, steps ``[B, steps]``): the asset ``name`` and ``B`` consecutive windows
    of the essays, each followed by its next ``steps`` tokens."""
    from evaluation.suite import suite_text
    from evaluation.text import essay_tokens

    model, tok = real_model(name, torch.float32, device)
    n = context + steps
    essays = suite_text("essays")  # $HF_SPARSE_KV_ASSETS/essays.txt where staged (a machine without network)
    rows = [essay_tokens(tok, n, offset=i * n, essays=essays) for i in range(batch)]
    t = torch.tensor(rows, device=device)
    return model, t[:, :context].contiguous(), t[:, context:].contiguous()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-6)).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tol", type=float, default=1e-4, help="float32: merged against unmerged")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--tiny", action="store_true", help="a tiny config (a dry run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="benchmarks/results/check_merge.csv")
    p.add_argument("--model", default="", help="a real model asset instead of the random 8B shape (docstring)")
    p.add_argument("--strict-bf16", action="store_true", help="fail when a bf16 merged row's argmax differs")
    args = p.parse_args()
    print(env_info(), flush=True)
    if args.model:
        model, ids, steps = real_inputs(args.model, args.batch, args.context, args.steps, args.device)
    else:
        model = build_model(args.layers, args.device, tiny_config() if args.tiny else None)
        g = torch.Generator(device=args.device).manual_seed(0)
        V = model.config.vocab_size
        ids = torch.randint(3, V, (args.batch, args.context), generator=g, device=args.device)
        steps = torch.randint(3, V, (args.batch, args.steps), generator=g, device=args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    reference = decode(model if args.model else model.float(), ids, steps)
    results = []
    compile_backend = "inductor" if args.device == "cuda" else "aot_eager"
    failed = False
    reference_model = model if args.model else None  # a GGUF model refuses .to(dtype): loaded once per other dtype
    for dtype in args.dtypes.split(","):
        if not args.model:
            model.to(getattr(torch, dtype))
        elif dtype == "float32":
            if model is not reference_model:  # free the other dtype's copy first (a 32K fp32 prefill needs room)
                del model
                if args.device == "cuda":
                    torch.cuda.empty_cache()
            model = reference_model
        else:
            del model
            model = real_model(args.model, getattr(torch, dtype), args.device)[0]
        results.append({"row": f"{dtype}: unpatched", "vs_fp32": rel(decode(model, ids, steps), reference)})
        for name, policy in (("Dense", Dense()), ("Quest 1/16", Quest(budget=0.0625))):
            twin = None
            for merged in (False, True):
                patch_model(model, policy=policy, cuda_graph=True, compile=compile_backend, merge_projections=merged)
                cache = PagedKVCache(model.config, max_length=args.context + args.steps + 1)
                times: list[float] = []
                try:
                    logits = decode(model, ids, steps, cache, times)
                finally:
                    unpatch_model(model)
                    torch._dynamo.reset()
                runner = cache.session.graphs
                row = {"row": f"{dtype}: graph+compile{'+merged' if merged else ''}: {name}"}
                row.update(vs_fp32=rel(logits, reference), nan=bool(torch.isnan(logits).any()))
                row["replayed"] = runner.replays if runner else 0
                row["ms_step"] = 1000 * statistics.median(times[2:] or times)
                failed |= row["nan"]
                if twin is not None:
                    row["vs_unmerged"] = rel(logits, twin)
                    row["same_argmax"] = bool(torch.equal(logits.argmax(-1), twin.argmax(-1)))
                    failed |= dtype == "float32" and row["vs_unmerged"] > args.tol
                    failed |= args.strict_bf16 and dtype == "bfloat16" and not row["same_argmax"]
                twin = logits
                print(row, flush=True)
                results.append(row)
    write_csv(args.out, results)
    table = [{k: f"{v:.2e}" if k.startswith("vs_") else v for k, v in r.items()} for r in results]
    for r in table:
        r["ms_step"] = f"{r['ms_step']:.2f}" if "ms_step" in r else ""
    cols = ["row", "vs_fp32", "vs_unmerged", "same_argmax", "nan", "replayed", "ms_step"]
    print_table(table, cols, title=f"merged projections{': ' + args.model if args.model else ''}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
