"""End-to-end decode speed of a Llama-3.1-8B-shaped model (random weights, bf16): does generate() get faster?

One command on the GPU, a table printed last, a CSV written::

    python benchmarks/bench_e2e.py --out benchmarks/results/bench_e2e.csv

Method. The model is built from a config (32 layers, 32/8 heads, head dim 128, FFN 14336, vocab 128256) with random
weights. For each (batch, context) the KV caches are filled with random keys/values of the right shape (the cost
of a decode step depends on the shape, not on the values; prefill is timed separately, at the lengths given by
``--ttft``): a ``DynamicCache`` for the unpatched ``sdpa`` model and a ``PagedKVCache`` for the patched rows. Each
row then decodes ``--steps`` tokens one forward at a time (after ``--warmup`` steps), synchronising the device
around each step, and reports the median: that is the per-token latency a caller of ``model(...)`` sees, Python
overhead included. The cache is cropped back to the context between rows.

Rows named ``graph: ...`` patch with ``cuda_graph=True``: each decode step replays a captured CUDA graph (one
capture per selection width, during the warm-up steps; a width change inside the timed steps shows as one slow
step, which the median ignores). ``graph: Quest 1/16 auto`` runs ``mode="auto"`` with the crossover table for
captured steps (``--crossover`` names another): dense below the table's crossover, Quest from it.

Columns: ms/token (median), tokens/s (batch / median), KV MB read per step (all layers, from the cache's counter),
KV GB held, peak GPU GB during the row, speedup over unpatched. Selection cost ~ Quest row - SinkWindow row at the
same budget (same bytes read, no scoring).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import env_info, print_table, write_csv

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.policies import Dense, Quest, SinkWindow


def llama8b_config(layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=262144,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )


def build_model(layers: int, device: str, config: LlamaConfig | None = None) -> LlamaForCausalLM:
    """The model of ``config`` (default: the 8B shape with ``layers`` layers), random bf16 weights, on ``device``."""
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = LlamaForCausalLM(config or llama8b_config(layers))
    torch.set_default_dtype(torch.float32)
    model.config._attn_implementation = "sdpa"
    model.set_attn_implementation("sdpa")
    return model.eval()


def fill_caches(
    model, batch: int, length: int, block_size: int, device: str, kv_heads: int | None = None, cache_cls=PagedKVCache
):
    """A DynamicCache and a ``cache_cls`` (a PagedKVCache) holding the same random ``length`` tokens per sequence,
    for ``kv_heads`` KV heads per layer (default the config's; under tensor parallelism, a rank's share)."""
    cfg = model.config
    dense = DynamicCache(config=cfg)
    paged = cache_cls(cfg, block_size=block_size, max_length=length + 256)
    g = torch.Generator(device=device).manual_seed(0)
    for i in range(cfg.num_hidden_layers):
        shape = (batch, kv_heads or cfg.num_key_value_heads, length, cfg.head_dim)
        k = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        v = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        dense.update(k, v, i)
        paged.layers[i].update(k, v)
        del k, v
    return dense, paged


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_gb() -> float | None:
    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def time_decode(model, cache, batch: int, length: int, steps: int, warmup: int) -> list[float]:
    """Seconds per decode step (device-synchronised) for ``steps`` steps after ``warmup``; crops back after."""
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=model.device)
    times = []
    kw = {cache_kwarg(model): cache, "use_cache": True}
    with torch.no_grad():
        for i in range(warmup + steps):
            pos = torch.full((batch, 1), length + i, device=model.device)
            sync(model.device)
            t0 = time.perf_counter()
            logits = model(ids, position_ids=pos, **kw).logits
            ids = logits[:, -1:].argmax(-1)
            sync(model.device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    cache.crop(length - cache.get_seq_length())  # negative: tokens to drop (every 5.x)
    return times


def time_prefill(model, batch: int, length: int) -> float:
    """Seconds of one prefill of ``length`` tokens (logits of the last token only): the best of two after a
    warm-up at the same length (kernels compile per shape); one run past 32K tokens."""
    ids = torch.randint(0, model.config.vocab_size, (batch, length), device=model.device)
    runs = 2 if length <= 32768 else 1
    times = []
    with torch.no_grad():
        model(ids[:, : min(length, 32768)], use_cache=True, logits_to_keep=1)  # warm-up
        for _ in range(runs):
            sync(model.device)
            t0 = time.perf_counter()
            model(ids, use_cache=True, logits_to_keep=1)
            sync(model.device)
            times.append(time.perf_counter() - t0)
    return min(times)


ROWS = [  # (name, policy, mode, cuda_graph)
    ("patched Dense", Dense(), "block", False),
    ("Quest 1/8 mask", Quest(budget=0.125), "mask", False),
    ("Quest 1/8 token", Quest(budget=0.125), "token", False),
    ("Quest 1/8 block", Quest(budget=0.125), "block", False),
    ("Quest 1/16 mask", Quest(budget=0.0625), "mask", False),
    ("Quest 1/16 token", Quest(budget=0.0625), "token", False),
    ("Quest 1/16 block", Quest(budget=0.0625), "block", False),
    ("SinkWindow 1/16 block", SinkWindow(sink=4, budget=0.0625), "block", False),
    ("Quest 1/16 auto", Quest(budget=0.0625), "auto", False),
    ("graph: patched Dense", Dense(), "block", True),
    ("graph: Quest 1/8 block", Quest(budget=0.125), "block", True),
    ("graph: Quest 1/16 block", Quest(budget=0.0625), "block", True),
    ("graph: SinkWindow 1/16 block", SinkWindow(sink=4, budget=0.0625), "block", True),
    ("graph: Quest 1/16 auto", Quest(budget=0.0625), "auto", True),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1x8192,1x32768,1x65536,1x131072,8x8192,8x32768", help="BxL,...")
    p.add_argument("--ttft", default="1x8192,1x32768,1x131072", help="BxL shapes whose prefill is timed")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rows", default="", help="comma-separated row names to keep (default: all)")
    p.add_argument("--out", default="benchmarks/results/bench_e2e.csv")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script")
    p.add_argument("--crossover", default=None, help="crossover table for the auto rows (default: the shipped one)")
    args = p.parse_args()
    device = args.device
    print(env_info(), flush=True)
    model = build_model(args.layers, device)
    print(f"model built: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters", flush=True)
    rows_wanted = [r for r in ROWS if not args.rows or r[0] in args.rows.split(",")]
    results = []

    for shape in args.ttft.split(",") if args.ttft else []:
        batch, length = map(int, shape.split("x"))
        base = time_prefill(model, batch, length)
        patch_model(model, policy=Quest(budget=0.0625), mode="block", block_size=args.block_size)
        patched = time_prefill(model, batch, length)
        unpatch_model(model)
        results.append(
            {
                "batch": batch,
                "context": length,
                "row": "TTFT (s): unpatched / patched",
                "ttft_s": base,
                "ttft_patched_s": patched,
                "ttft_ratio": patched / base,
            }
        )
        print(results[-1], flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()

    for shape in args.shapes.split(","):
        batch, length = map(int, shape.split("x"))
        dense_cache, paged = fill_caches(model, batch, length, args.block_size, device)
        kv_held = {
            "unpatched": sum(t.numel() * t.element_size() for k, v, *_ in dense_cache for t in (k, v)),
            "paged": paged.memory_bytes(),
        }
        reset_peak()
        t = time_decode(model, dense_cache, batch, length, args.steps, args.warmup)
        base_ms = 1000 * statistics.median(t)
        results.append(
            {
                "batch": batch,
                "context": length,
                "row": "unpatched sdpa",
                "ms_per_token": base_ms,
                "tokens_per_s": batch / (base_ms / 1000),
                "kv_mb_per_step": None,
                "kv_gb_held": kv_held["unpatched"] / 1e9,
                "peak_gb": peak_gb(),
                "speedup": 1.0,
            }
        )
        print(results[-1], flush=True)
        del dense_cache
        if device == "cuda":
            torch.cuda.empty_cache()
        for name, policy, mode, graph in rows_wanted:
            table = {"crossover": args.crossover} if mode == "auto" else {}
            patch_model(model, policy=policy, mode=mode, block_size=args.block_size, cuda_graph=graph, **table)
            reset_peak()
            read0, steps0 = int(paged.kv_bytes_read), paged.decode_steps
            t = time_decode(model, paged, batch, length, args.steps, args.warmup)
            ms = 1000 * statistics.median(t)
            read = (int(paged.kv_bytes_read) - read0) / max(paged.decode_steps - steps0, 1)
            results.append(
                {
                    "batch": batch,
                    "context": length,
                    "row": name,
                    "ms_per_token": ms,
                    "tokens_per_s": batch / (ms / 1000),
                    "kv_mb_per_step": read / 1e6,
                    "kv_gb_held": kv_held["paged"] / 1e9,
                    "peak_gb": peak_gb(),
                    "speedup": base_ms / ms,
                }
            )
            print(results[-1], flush=True)
            unpatch_model(model)
        del paged
        if device == "cuda":
            torch.cuda.empty_cache()

    write_csv(args.out, results)
    cols = [
        "batch",
        "context",
        "row",
        "ms_per_token",
        "tokens_per_s",
        "kv_mb_per_step",
        "kv_gb_held",
        "peak_gb",
        "speedup",
        "ttft_s",
        "ttft_patched_s",
        "ttft_ratio",
    ]
    print_table(results, cols, title=f"Llama-3.1-8B shape, {args.layers} layers, bf16, block_size {args.block_size}")


if __name__ == "__main__":
    main()
