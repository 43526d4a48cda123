"""The main job on the embedded default: SmolLM2-135M-Instruct (Q4_1 GGUF, from PyPI) on a ~4K-token essay prompt
with a needle in it.

For ``Dense``, ``Quest`` and ``SinkWindow`` at one budget (1/8 by default) it prints the generated answer, its
agreement with dense, decode ms/token, KV bytes read per decode step and the perplexity of a held-out
continuation scored token by token through the patched decode path. Runs in a few minutes on 2 CPU cores::

    python -m evaluation.demo            # or: hf-sparse-kv demo
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.policies import Dense, Quest, SinkWindow

from .assets import load_model
from .text import essay_tokens, needle_prompt, score_answer


def decode_continuation(model, context: torch.Tensor, continuation: torch.Tensor, block_size: int):
    """Teacher-forced decode: prefill ``context [1, C]``, then feed ``continuation [1, N]`` one token at a time.

    Returns (negative log-likelihood per continuation token ``[N]``, seconds per decode step, cache).
    """
    cache = PagedKVCache(model.config, block_size=block_size)
    nll, times = [], []
    with torch.no_grad():
        logits = model(context, **{cache_kwarg(model): cache}, use_cache=True).logits[:, -1]
        for i in range(continuation.shape[1]):
            token = continuation[:, i : i + 1]
            nll.append(-torch.log_softmax(logits.float(), -1)[0, token[0, 0]])
            t0 = time.perf_counter()
            logits = model(token, **{cache_kwarg(model): cache}, use_cache=True).logits[:, -1]
            times.append(time.perf_counter() - t0)
    return torch.stack(nll), times, cache


def run(args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, tok = load_model(args.model)
    needle = needle_prompt(tok, args.context, depth=args.depth, seed=args.seed)
    ids = tok(needle["text"], return_tensors="pt").input_ids
    held_out = torch.tensor([essay_tokens(tok, args.context + args.ppl_tokens, offset=args.ppl_offset)])
    context, continuation = held_out[:, : args.context], held_out[:, args.context :]
    print(f"prompt: {ids.shape[1]} tokens, needle at token {needle['needle_token_pos']}, answer {needle['answer']}")
    policies = {
        "Dense": Dense(),
        "Quest": Quest(budget=args.budget),
        "SinkWindow": SinkWindow(sink=4, budget=args.budget),
    }
    rows, dense_tokens = [], None
    for name, policy in policies.items():
        patch_model(model, policy=policy, mode=args.mode, block_size=args.block_size)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
        gen = out[0, ids.shape[1] :]
        text = tok.decode(gen, skip_special_tokens=True)
        dense_tokens = gen if dense_tokens is None else dense_tokens
        n = min(len(gen), len(dense_tokens))
        agree = (gen[:n] == dense_tokens[:n]).float().mean().item()
        nll, times, cache = decode_continuation(model, context, continuation, args.block_size)
        unpatch_model(model)
        rows.append(
            {
                "policy": name,
                "answer": text.strip().split("\n")[0][:24],
                "correct": score_answer(text, needle["answer"]),
                "agree": agree,
                "ms_per_token": 1000 * sorted(times)[len(times) // 2],
                "kv_mb_per_step": int(cache.kv_bytes_read) / max(cache.decode_steps, 1) / 1e6,
                "ppl": math.exp(nll.mean().item()),
                "seconds": time.perf_counter() - t0,
            }
        )
        print(f"  {name}: done in {rows[-1]['seconds']:.0f} s", flush=True)
    return rows


MODEL_NAMES = {"smollm2": "SmolLM2-135M-Instruct (Q4_1 GGUF)", "gemma3-270m": "Gemma-3-270M (Q4_K_M GGUF)"}


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\n{MODEL_NAMES.get(args.model, args.model)}, {args.context}-token essay prompt, budget {args.budget}, "
        f"mode={args.mode}, block_size={args.block_size}, CPU reference backend"
    )
    head = f"{'policy':<11} {'answer':<26} {'ok':<4} {'agree':>6} {'ms/token':>9} {'KV MB/step':>11} {'ppl':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['policy']:<11} {r['answer']!r:<26} {'yes' if r['correct'] else 'no':<4} {r['agree']:>6.2f} "
            f"{r['ms_per_token']:>9.1f} {r['kv_mb_per_step']:>11.2f} {r['ppl']:>7.2f}"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="'smollm2', 'gemma3-270m', a hub id or a local path")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens")
    p.add_argument("--budget", type=float, default=0.125, help="fraction of the context (or tokens if > 1)")
    p.add_argument("--mode", default="block", choices=["mask", "token", "block"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--depth", type=float, default=0.5, help="needle depth in [0, 1]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--ppl-tokens", type=int, default=64, help="held-out tokens scored by decoding")
    p.add_argument("--ppl-offset", type=int, default=60000, help="essay token offset of the held-out text")
    args = p.parse_args(argv)
    if args.budget > 1:
        args.budget = int(args.budget)
    print_table(run(args), args)


if __name__ == "__main__":
    main()
