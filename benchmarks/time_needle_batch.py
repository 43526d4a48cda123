"""Where one batch of needle trials spends its time: building the trials, the left-padded prefill, the cache copies,
the decoding, for a real model (issue 12: a batch of 8 trials at 32K took ~10.5 s on the H200 whatever the number of
policies, so a fixed cost dominates the needle cells).

    python benchmarks/time_needle_batch.py --model qwen2.5-coder-1.5b --length 32768 --batch 8 \
        --out benchmarks/results/time_needle_batch.csv
    python benchmarks/time_needle_batch.py --model smollm2 --length 2048 --batch 2 --device cpu   # a dry run

Rows (each a fresh :func:`evaluation.needle.greedy_batch` call on the same trials, after one untimed warm-up call
of every row's kind, of ``--warm-tokens`` new tokens): ``padded`` (the trials as the suite runs them: left-padded to the longest; its prefill runs
each sequence unmasked, :mod:`hf_sparse_kv.prefill`, where that applies), ``padded, masked`` (the same with that
path turned off: one SDPA call with the causal + padding mask, as before 2026-12-01), ``equal`` (each trial cut from
the left to the shortest one's length: no padding at all), each with dense alone and with Quest 1/16 after it; with
``--static``, ``padded, static`` too (the padded trials decoded through static steps, captured as CUDA graphs:
``greedy_batch(static=True)``, the suite's ``static: true``); with ``--reuse``, ``padded, reused`` (the same with the
captured steps kept in an :class:`evaluation.slots.DecodeSlots`, the suite's ``reuse_graphs: true``), then ``second,
padded`` and ``second, reused`` (another batch of trials, eager, then on the kept steps: no capture). Columns: the phases of :class:`evaluation.needle.PhaseClock` (``prefill``, ``copy``, ``decode``), ``build``
(making and encoding the trials one after the other on this machine's CPU, measured once), and ``same`` (prompts
whose answers under every policy equal the ``padded, masked`` row's; for a static row, the ``padded`` row's;
``differs``: the policies whose answers did not). ``--sparse`` picks the policies after dense (the suite's at 1/16),
``--kinds`` the rows (a static row brings its ``padded`` row along; so does ``own``, SnapKV prefilling on its
own instead of from the shared prefill, whose answers are checked against it). A second table (and ``OUT``'s
``_policies.csv``) splits each row's decoding by policy: seconds, and for a static row the graphs captured, the
seconds of their captures (warm-up forward + capture each) and the ms a step of the rest. Where a row's answers
differ from its reference's, a third table (and ``_diverge.csv``) gives, per prompt and policy, the first step where
they part and both decodings' margins there (top-1 minus top-2 logit): a tie broken by rounding, or not.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from contextlib import nullcontext
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import env_info, print_table, write_csv

from evaluation.assets import load_model
from evaluation.needle import PhaseClock, greedy_batch, needle_trial, pad_left
from evaluation.slots import DecodeSlots
from evaluation.suite import suite_text
from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.policies import (
    BlockTopK,
    Dense,
    OracleBlockTopK,
    QuantBlockTopK,
    Quest,
    SinkWindow,
    SnapKV,
    TokenTopK,
)

SPARSE = {  # the suite's policies at 1/16 (recipes/suite_gaps.sh), by the labels its cells carry
    "quest": lambda: Quest(budget=1 / 16, sink=4, window=32),
    "oracle": lambda: OracleBlockTopK(budget=1 / 16, sink=4, window=32),
    "quant4": lambda: QuantBlockTopK(budget=1 / 16, sink=4, window=32, bits=4),
    "token_topk": lambda: TokenTopK(budget=1 / 16, sink=4, window=32),
    "block_topk": lambda: BlockTopK(budget=1 / 16, sink=4, window=32),
    "sink_window": lambda: SinkWindow(budget=1 / 16, sink=4),
    "snapkv": lambda: SnapKV(budget=1 / 16, sink=4, window=32, observe=32),
    "snapkv1/4+quest": lambda: SnapKV(
        budget=1 / 4, sink=4, window=32, observe=32, then=Quest(budget=1 / 16, sink=4, window=32)
    ),
}


def trials(tok, length: int, batch: int, essays: str, first: int = 0) -> tuple[list[list[int]], float]:
    """(token ids of ``batch`` 8-key needle trials at ``length`` (trials ``first`` on), seconds to build and encode
    them)."""
    t0 = time.perf_counter()
    out = []
    for i in range(first, first + batch):
        t = needle_trial(tok, length, 0.1 + 0.8 * (i % batch) / max(1, batch - 1), "multi_key", i, 997 * i, 8, essays)
        out.append(tok.encode(t["text"]))
    return out, time.perf_counter() - t0


def differing(answers: list[dict], ref: list[dict]) -> list[str]:
    """The policies (keys) whose tokens differ from ``ref``'s for at least one prompt, sorted."""
    return sorted({str(k) for x, y in zip(answers, ref) for k in x if x[k] != y.get(k)})


def is_tie(margin: float, ref_margin: float, top: float, dtype: torch.dtype) -> bool:
    """Whether two decodings that chose different tokens both saw their two best logits within 2 units in the last
    place of ``dtype`` at the top logit ``top`` (bf16: 0.125 between 16 and 32): a tie that a different summation
    order may break either way, not a different computation."""
    ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(top), torch.finfo(dtype).tiny)))
    return max(margin, ref_margin) <= 2 * ulp


def divergences(
    variant: str, answers: list[dict], ref: list[dict], top2: dict, ref_top2: dict, dtype: torch.dtype
) -> list[dict]:
    """One row per (prompt, policy) whose tokens differ from ``ref``'s: the first step where they part, the token
    each chose there, each decoding's margin there (its top logit minus its second, float32) and whether that is a
    tie in the logits' ``dtype`` (:func:`is_tie`); a large margin on either side is a different computation."""
    out = []
    for i, (x, y) in enumerate(zip(answers, ref)):
        for k in sorted(x, key=str):
            if x[k] == y.get(k):
                continue
            s = next(j for j, (u, v) in enumerate(zip(x[k], y[k])) if u != v)
            (v, _), (rv, rids) = top2[k], ref_top2[k]
            margin, ref_margin, top = (
                float(v[i, s, 0] - v[i, s, 1]),
                float(rv[i, s, 0] - rv[i, s, 1]),
                float(rv[i, s, 0]),
            )
            out.append(
                {
                    "variant": variant,
                    "policy": k,
                    "prompt": i,
                    "step": s,
                    "token": x[k][s],
                    "margin": round(margin, 4),
                    "ref_token": y[k][s],
                    "ref_margin": round(ref_margin, 4),
                    "ref_second": int(rids[i, s, 1]),
                    "ref_top_logit": round(top, 3),
                    "tie": is_tie(margin, ref_margin, top, dtype),
                }
            )
    return out


def policy_rows(variant: str, clock: PhaseClock, new_tokens: int) -> list[dict]:
    """One row per policy of a variant: its decode seconds and, decoded statically, the graphs its runner captured,
    their seconds and the ms a step of the rest (``PhaseClock.per_key``)."""
    out = []
    for key, noted in clock.per_key.items():
        rest = noted["decode"] - noted.get("capture", 0.0)
        out.append(
            {
                "variant": variant,
                "policy": key,
                "decode_s": round(noted["decode"], 3),
                "graphs": int(noted.get("graphs", 0)),
                "capture_s": round(noted.get("capture", 0.0), 3),
                "rest_ms_step": round(1e3 * rest / new_tokens, 2),
            }
        )
    return out


def profile_decode(model, prompts: list[list[int]], policy, steps: int, out: str) -> None:
    """``torch.profiler`` over ``steps`` eager decode steps of a left-padded batch after its prefill (the padded
    path of :func:`evaluation.needle.greedy_batch`); the top operators by CPU and by device time into ``out``."""
    ids, mask, pos = pad_left(prompts, model.device)
    patch_model(model, policy=policy)
    try:
        cache, kw = PagedKVCache(model.config), {"use_cache": True}
        kw[cache_kwarg(model)] = cache
        with torch.no_grad():
            model(ids[:, :-1], attention_mask=mask[:, :-1], position_ids=pos[:, :-1], logits_to_keep=1, **kw)
            token, m, p = ids[:, -1:], mask, pos[:, -1:]
            acts = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            )
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(steps):
                    token = model(token, attention_mask=m, position_ids=p, **kw).logits[:, -1].argmax(-1, keepdim=True)
                    m, p = torch.cat([m, torch.ones_like(token)], 1), p + 1
                token.tolist()
    finally:
        unpatch_model(model)
    with open(out, "a") as f:
        for key in ("self_cpu_time_total", "self_cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"):
            f.write(f"\n## {len(prompts)} prompts, {type(policy).__name__}, {steps} steps, by {key}\n")
            f.write(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="benchmarks/results/time_needle_batch.csv")
    p.add_argument("--profile", default="", help="a text file: profile padded and equal decode steps into it")
    p.add_argument("--static", action="store_true", help="add the padded rows decoded through static steps")
    p.add_argument(
        "--reuse", action="store_true",
        help="add static rows whose captured steps are kept across two batches (evaluation.slots.DecodeSlots, the "
        "suite's reuse_graphs): the first batch's, then another batch's (other trials) with no new capture",
    )  # fmt: skip
    p.add_argument(
        "--sparse", default="quest",
        help=f"comma-separated policies decoded after dense in the two-policy rows, of {sorted(SPARSE)}",
    )  # fmt: skip
    p.add_argument(
        "--kinds", default="masked,padded,equal",
        help="which of the rows masked, padded, equal, own (SnapKV prefilling on its own, not from the shared prefill)",
    )  # fmt: skip
    p.add_argument(
        "--warm-tokens", type=int, default=None,
        help="new tokens of the untimed warm-up call of each kind (default: --new-tokens, so that the timed rows meet "
        "no width or length a kernel is compiled for the first time; 2 before 2026-12-02 13:00 UTC)",
    )  # fmt: skip
    a = p.parse_args()
    names, kinds = [x for x in a.sparse.split(",") if x], set(a.kinds.split(","))
    warm_tokens = a.new_tokens if a.warm_tokens is None else a.warm_tokens
    if not names or set(names) - set(SPARSE) or not kinds or kinds - {"masked", "padded", "equal", "own"}:
        p.error(f"--sparse takes names of {sorted(SPARSE)}, --kinds of masked, padded, equal, own")
    model, tok = load_model(a.model, dtype=getattr(torch, a.dtype), device=a.device)
    prompts, build = trials(tok, a.length, a.batch, suite_text("essays"))
    short = min(len(x) for x in prompts)
    equal = [x[len(x) - short :] for x in prompts]
    sparse = {name: SPARSE[name]() for name in names}
    masked = mock.patch("hf_sparse_kv.prefill.flash_dtype", lambda q: False)  # the row path off
    own = mock.patch("evaluation.needle.shares_prefill", lambda *a: False)  # SnapKV prefills on its own
    second = trials(tok, a.length, a.batch, suite_text("essays"), first=a.batch)[0] if a.reuse else []
    variants = {}  # name -> (prompts, policies, context, static, slots)
    for pols in ({"dense": Dense()}, {"dense": Dense(), **sparse}):
        tag = "" if len(pols) == 1 else ", dense + " + " + ".join(names)
        if "masked" in kinds:
            variants[f"padded, masked{tag}"] = (prompts, pols, lambda: masked, False, None)
        if "padded" in kinds or a.static or a.reuse or "own" in kinds:  # static / own rows are checked against it
            variants[f"padded{tag}"] = (prompts, pols, nullcontext, False, None)
        if "own" in kinds:
            variants[f"padded, own{tag}"] = (prompts, pols, lambda: own, False, None)
        if a.static:
            variants[f"padded, static{tag}"] = (prompts, pols, nullcontext, True, None)
        if a.reuse:
            slots = DecodeSlots()
            variants[f"padded, reused{tag}"] = (prompts, pols, nullcontext, True, slots)
            variants[f"second, padded{tag}"] = (second, pols, nullcontext, False, None)
            variants[f"second, reused{tag}"] = (second, pols, nullcontext, True, slots)
        if "equal" in kinds:
            variants[f"equal{tag}"] = (equal, pols, nullcontext, False, None)
    warm = [(prompts, nullcontext, False)] + [(prompts, lambda: masked, False)] * ("masked" in kinds)
    warm += [(equal, nullcontext, False)] * ("equal" in kinds)
    for ps, ctx, static in warm + [(prompts, nullcontext, True)] * (a.static or a.reuse):
        with ctx():  # warm-up: kernels (Triton specialises on the batch's sizes), allocator
            greedy_batch(model, ps, {"dense": Dense(), **sparse}, warm_tokens, static=static)
    rows, answers, per_policy, top2s, diverge = [], {}, [], {}, []
    for name, (ps, policies, ctx, static, slots) in variants.items():
        clock = PhaseClock(model.device)
        t0 = time.perf_counter()
        with ctx():
            top2s[name] = {}
            answers[name] = greedy_batch(
                model, ps, policies, a.new_tokens, clock=clock, static=static, slots=slots, top2=top2s[name]
            )
        total = time.perf_counter() - t0
        if slots is not None:
            ref_name = name.replace(", reused", ", padded" if name.startswith("second") else "", 1)
        elif static:
            ref_name = name.replace(", static", "", 1)
        elif name.startswith("padded, own"):
            ref_name = name.replace(", own", "", 1)
        else:
            ref_name = name.replace("padded", "padded, masked", 1) if name.startswith("padded") else None
        ref = answers.get(ref_name)
        if ref is not None:
            diverge += divergences(name, answers[name], ref, top2s[name], top2s[ref_name], model.dtype)
        rows.append(
            {
                "model": a.model,
                "length": a.length,
                "batch": len(ps),
                "tokens": f"{min(map(len, ps))}-{max(map(len, ps))}",
                "variant": name,
                "build_s": round(build, 3),
                **{f"{k}_s": round(v, 3) for k, v in clock.seconds.items()},
                "total_s": round(total, 3),
                "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if a.device == "cuda" else "",
                "same": "" if ref is None else sum(x == y for x, y in zip(answers[name], ref)),
                "differs": "" if ref is None else " ".join(differing(answers[name], ref)),
                **env_info(),
            }
        )
        per_policy += policy_rows(name, clock, a.new_tokens)
        if a.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
    cols = ["variant", "tokens", "build_s", "prefill_s", "copy_s", "decode_s", "total_s", "peak_gib", "same", "differs"]
    print_table(rows, cols, title=f"{a.model}, {a.batch} x {a.length} 8-key needle trials, {a.new_tokens} new tokens")
    write_csv(a.out, rows)
    print_table(per_policy, list(per_policy[0]), title="decode per policy (graphs, capture: static rows)")
    write_csv(os.path.splitext(a.out)[0] + "_policies.csv", per_policy)
    if diverge:
        print_table(
            diverge, list(diverge[0]), title="where a row parts from its reference (margins: top-1 - top-2 logit)"
        )
        write_csv(os.path.splitext(a.out)[0] + "_diverge.csv", diverge)
    if a.profile:
        for ps in (prompts, equal):
            profile_decode(model, ps, Dense(), 3, a.profile)


if __name__ == "__main__":
    main()
