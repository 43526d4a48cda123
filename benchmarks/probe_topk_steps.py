"""How many radix-select steps the one-program top-k (``ops/triton/topk.py``, ``"row"`` with its early stop) takes on
Quest's block scores of a real model's keys, against keys drawn at random (what ``bench_e2e``'s filled caches hold).

The kernel's time at 1 x 128K is ~4 µs of load, ~0.7 µs a step and ~2.4 µs of write (benchmarks/RESULTS.md, "The
top-k taken apart"), and its steps depend on the data: the select stops once exactly ``k`` keys are at or above its
threshold, i.e. after the bits that separate the k-th score from the next. This replays the kernel's select on the
host (the same key transform, two bits a step) for every sparse layer's rows of one decode step after a real
prefill of ``--length`` essay tokens, then after a cache of random keys of the same shape. ``--random-8b LAYERS``
takes ``bench_e2e``'s Llama-3.1-8B shape with that many layers and random weights instead (float32, a 32000-token
vocabulary) and prefills random tokens, as ``bench_e2e``'s ``generate:`` rows do. CPU; no timing::

    python benchmarks/probe_topk_steps.py --model smollm2 --length 8192
    python benchmarks/probe_topk_steps.py --random-8b 8 --length 4096
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import llama8b_config
from transformers import LlamaForCausalLM

from evaluation.assets import load_essays, load_model
from evaluation.text import essay_tokens
from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model
from hf_sparse_kv.policies import Quest


def order_keys(scores: torch.Tensor) -> torch.Tensor:
    """The kernel's order-preserving unsigned keys of float32 ``scores`` (as int64 holding uint32 values)."""
    bits = scores.float().contiguous().view(torch.int32).long()
    keys = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) & 0xFFFFFFFF
    return keys ^ 0x80000000


def select_steps(row: torch.Tensor, kk: int) -> int:
    """Steps of the kernel's radix select (two bits a step from the top, early stop) to find the kk-th largest."""
    key = order_keys(row)
    t, n_t, shift, steps = 0, key.numel(), 30, 0
    while shift >= 0 and n_t != kk:
        one = 1 << shift
        counts = [int((key >= t + j * one).sum()) for j in (1, 2, 3)]
        inc = sum(int(c >= kk) for c in counts)
        if inc:
            n_t = counts[inc - 1]
        t, shift, steps = t + (inc << shift), shift - 2, steps + 1
    return steps


class ScoreSpy:
    """Keeps the scores Quest's selection ranks in a step (``[B, Hkv, nblk]`` each layer)."""

    def __init__(self, policy: Quest):
        self.rows, self.policy, self.scores = [], policy, type(policy).scores

    def __call__(self, state):
        s = self.scores(self.policy, state)
        self.rows.extend(s.detach().reshape(-1, s.shape[-1]))
        return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--budget", type=float, default=0.0625)
    ap.add_argument("--random-8b", type=int, default=0, metavar="LAYERS", help="the 8B shape, random weights")
    args = ap.parse_args()
    if args.random_8b:
        torch.manual_seed(0)
        cfg = llama8b_config(args.random_8b)
        cfg.vocab_size = 32000
        model = LlamaForCausalLM(cfg).eval()
        ids = torch.randint(3, cfg.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(1))
    else:
        model, tok = load_model(args.model)
        cfg = model.config
        ids = torch.tensor([essay_tokens(tok, args.length, essays=load_essays())])
    policy = Quest(budget=args.budget)
    patch_model(model, policy=policy, mode="block", block_size=16)
    spy = ScoreSpy(policy)
    object.__setattr__(policy, "scores", spy)  # this instance's scores, spied on (the class is untouched)
    g = torch.Generator().manual_seed(0)
    for name in ("real prefill", "random keys"):
        cache = PagedKVCache(cfg, block_size=16)
        with torch.no_grad():
            if name == "real prefill":
                token = model(ids, use_cache=True, **{cache_kwarg(model): cache}).logits[:, -1:].argmax(-1)
            else:
                for i in range(cfg.num_hidden_layers):
                    shape = (1, cfg.num_key_value_heads, args.length, cfg.head_dim)
                    cache.layers[i].update(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
                token = torch.randint(3, cfg.vocab_size, (1, 1), generator=g)
            spy.rows.clear()
            model(token, use_cache=True, **{cache_kwarg(model): cache})
        kk = policy.plan((args.length + 1,), 16)[0]
        steps = [select_steps(row, kk) for row in spy.rows]
        ties = max(int((row == row.topk(kk).values[-1]).sum()) for row in spy.rows)
        print(
            f"{name}: {len(steps)} rows of {spy.rows[0].numel()} blocks, k = {kk}: radix steps mean "
            f"{statistics.mean(steps):.2f}, median {statistics.median(steps)}, min {min(steps)}, max {max(steps)}; "
            f"at most {ties} scores equal to the k-th"
        )


if __name__ == "__main__":
    main()
