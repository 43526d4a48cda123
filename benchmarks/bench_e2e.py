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

Rows named ``graph+compile: ...`` patch with ``cuda_graph=True, compile="inductor"``: the static decode step is
compiled (``fullgraph=True``; inductor fuses the model's own norms, rotary, SiLU) and the compiled step captured.
Rows named ``reduce-overhead: ...`` are the user's way: the patched model's cache reserved (``reserve_static``) and
``model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)``.
The row ``unpatched StaticCache + compile`` is what the transformers docs recommend for fast decoding: the unpatched
model on a ``StaticCache`` with ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)``.

The floor. The bandwidth of a device-to-device copy is measured in the same run (``common.hbm_bandwidth``); a row's
floor is the bytes its step must read over that bandwidth: the weights (the input embedding counted as the ``B``
rows a step reads), the K/V bytes the row's cache counted (the unpatched rows: the whole context), and the block
metadata its selection scores (Quest: min and max, BlockTopK: mean, of every block of each sparse layer). The row
``floor: dense`` is the floor of reading the whole context; every row prints ``of_floor`` = ms / its own floor.

``--generate BxL`` also times real ``generate()`` calls: a real prefill of ``L`` random tokens, then
``--new-tokens`` (128) greedy tokens, for the unpatched model (dynamic and static cache), patched Dense and Quest
1/16 captured; reported as TTFT (``max_new_tokens=1``), the whole call, and the decode ms/token
(``(whole - TTFT) / (new - 1)``). With ``B > 1`` the prompts are also run left-padded (lengths spread over
``[3L/4, L]``), the serving-style batch.

Columns: ms/token (median), tokens/s (batch / median), KV MB read per step (all layers, from the cache's counter),
KV GB held, peak GPU GB during the row, speedup over unpatched, floor ms and ms / floor. Selection cost ~ Quest row
- SinkWindow row at the same budget (same bytes read, no scoring).

A dry run on the CPU (a tiny model of the same ratios, seconds)::

    python benchmarks/bench_e2e.py --device cpu --tiny --shapes 1x256,2x128 --ttft 1x128 --generate 2x128 \
        --new-tokens 8 --steps 3 --warmup 1 --out /tmp/bench_e2e.csv
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

from common import env_info, hbm_bandwidth, print_table, write_csv
from transformers import StaticCache

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.policies import BlockTopK, Dense, Quest, SinkWindow


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


def tiny_config() -> LlamaConfig:
    """The 8B shape's ratios at a size the CPU runs in seconds (4 layers, 8 query / 2 KV heads, head dim 32)."""
    cfg = llama8b_config(4)
    cfg.update({"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8})
    cfg.update({"num_key_value_heads": 2, "head_dim": 32})
    return cfg


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


def static_cache(model, batch: int, length: int, max_length: int, device: str) -> StaticCache:
    """A transformers ``StaticCache`` of ``max_length`` tokens holding ``length`` random tokens per sequence (the
    same generator and shapes as :func:`fill_caches`)."""
    cfg = model.config
    cache = StaticCache(config=cfg, max_cache_len=max_length)
    g = torch.Generator(device=device).manual_seed(0)
    for i in range(cfg.num_hidden_layers):
        shape = (batch, cfg.num_key_value_heads, length, cfg.head_dim)
        k = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        v = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        cache.update(k, v, i)
        del k, v
    return cache


def weight_bytes(model, batch: int) -> int:
    """Bytes of weights a decode step reads: every parameter, the input embedding counted as the ``batch`` rows
    looked up (an untied head reads its whole matrix)."""
    embed = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.get_output_embeddings().weight is embed:  # tied: read whole by the head
        return total
    return total - embed.numel() * embed.element_size() + batch * embed.shape[1] * embed.element_size()


def metadata_bytes(model, policy, batch: int, length: int, block_size: int, sparse_layers: float) -> int:
    """Block metadata a step's selection reads: ``sparse_layers`` layers (an average under ``mode="auto"``) of
    min and max (Quest) or mean (BlockTopK) of every block, ``[B, Hkv, nblk, D]`` bf16 each."""
    per = 2 if isinstance(policy, Quest) else 1 if isinstance(policy, BlockTopK) else 0
    cfg = model.config
    nblk = -(-length // block_size)
    return int(per * sparse_layers * batch * nblk * cfg.num_key_value_heads * cfg.head_dim * 2)


def dense_kv_bytes(model, batch: int, length: int) -> int:
    cfg = model.config
    return 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * length * cfg.head_dim * 2


def time_generate(model, ids, mask, new_tokens: int, **kw) -> tuple[float, float]:
    """Seconds of ``generate()`` with ``max_new_tokens=1`` (TTFT) and ``new_tokens`` (greedy, every token made),
    after a warm-up call of two tokens (kernels built, compiled steps compiled)."""
    out = []
    kw = {"pad_token_id": 0, **kw}
    with torch.no_grad():
        for n in (2, 1, new_tokens):
            sync(model.device)
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)
            sync(model.device)
            out.append(time.perf_counter() - t0)
    return out[1], out[2]


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
COMPILED_ROWS = [  # (name, policy, mode, how): "graph" = cuda_graph=True, compile="inductor"; "reduce-overhead" =
    # the cache reserved (reserve_static) and model.forward = torch.compile(model.forward, mode="reduce-overhead")
    ("graph+compile: patched Dense", Dense(), "block", "graph"),
    ("graph+compile: Quest 1/16 block", Quest(budget=0.0625), "block", "graph"),
    ("reduce-overhead: patched Dense", Dense(), "block", "reduce-overhead"),
    ("reduce-overhead: Quest 1/16 block", Quest(budget=0.0625), "block", "reduce-overhead"),
]
STATIC_ROW = "unpatched StaticCache + compile"
GENERATE_ROWS = [  # (name, policy or None (unpatched), extra generate() arguments)
    ("generate: unpatched sdpa", None, {}),
    ("generate: unpatched StaticCache + compile", None, {"cache_implementation": "static"}),
    ("generate: graph: patched Dense", Dense(), {}),
    ("generate: graph: Quest 1/16 block", Quest(budget=0.0625), {}),
]


def floor_fields(ms: float, nbytes: int, bandwidth: float) -> dict:
    floor = 1000 * nbytes / (bandwidth * 1e9)
    return {"floor_ms": floor, "of_floor": ms / floor if ms else None}


def run_generate(model, args, results, bandwidth) -> None:
    """The ``--generate`` rows: real prefill, then ``--new-tokens`` tokens, per shape (padded too when ``B > 1``)."""
    for shape in args.generate.split(",") if args.generate else []:
        batch, length = map(int, shape.split("x"))
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(3, model.config.vocab_size, (batch, length), generator=g).to(model.device)
        variants = [("", None)]
        if batch > 1:  # left-padded prompts of lengths spread over [3L/4, L]
            mask = torch.ones_like(ids)
            for b in range(batch):
                mask[b, : (length // 4) * b // (batch - 1)] = 0
            variants.append((" (left-padded)", mask))
        for suffix, mask in variants:
            for name, policy, extra in GENERATE_ROWS:
                if policy is not None:
                    patch_model(model, policy=policy, mode="block", block_size=args.block_size, cuda_graph=True)
                reset_peak()
                try:
                    ttft, whole = time_generate(model, ids, mask, args.new_tokens, **extra)
                except Exception as e:  # noqa: BLE001 - a row that cannot run says why, the others go on
                    print(f"{name}{suffix}: {type(e).__name__}: {e}", flush=True)
                    ttft = whole = float("nan")
                if policy is not None:
                    unpatch_model(model)
                ms = 1000 * (whole - ttft) / max(args.new_tokens - 1, 1)
                results.append(
                    {"batch": batch, "context": length, "row": name + suffix, "ms_per_token": ms,
                     "tokens_per_s": batch / (ms / 1000), "ttft_s": ttft, "generate_s": whole, "peak_gb": peak_gb()}
                )  # fmt: skip
                print(results[-1], flush=True)
                if args.device == "cuda":
                    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1x8192,1x32768,1x65536,1x131072,8x8192,8x32768", help="BxL,...")
    p.add_argument("--ttft", default="1x8192,1x32768,1x131072", help="BxL shapes whose prefill is timed")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tiny", action="store_true", help="a tiny model of the same ratios (a dry run, e.g. on the CPU)")
    p.add_argument("--generate", default="1x32768,8x32768", help="BxL shapes of the timed generate() calls ('' none)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens each timed generate() makes")
    p.add_argument("--no-static", action="store_true", help="skip the StaticCache + torch.compile row")
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
    model = build_model(args.layers, device, tiny_config() if args.tiny else None)
    print(f"model built: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters", flush=True)
    keep = args.rows.split(",") if args.rows else None
    rows_wanted = [r for r in ROWS if not keep or r[0] in keep]
    compiled_wanted = [r for r in COMPILED_ROWS if not keep or r[0] in keep]
    static_wanted = not args.no_static and (not keep or STATIC_ROW in keep)
    bandwidth = hbm_bandwidth(device, 2**31 if device == "cuda" else 2**24)
    print(f"HBM bandwidth (device copy): {bandwidth:.0f} GB/s", flush=True)
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

    for shape in args.shapes.split(",") if args.shapes else []:
        batch, length = map(int, shape.split("x"))
        dense_cache, paged = fill_caches(model, batch, length, args.block_size, device)
        kv_held = {
            "unpatched": sum(t.numel() * t.element_size() for k, v, *_ in dense_cache for t in (k, v)),
            "paged": paged.memory_bytes(),
        }
        weights, dense_kv = weight_bytes(model, batch), dense_kv_bytes(model, batch, length)
        results.append(
            {"batch": batch, "context": length, "row": "floor: dense", "kv_mb_per_step": dense_kv / 1e6,
             **floor_fields(0.0, weights + dense_kv, bandwidth), "hbm_gb_s": bandwidth}
        )  # fmt: skip
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
                "kv_mb_per_step": dense_kv / 1e6,
                "kv_gb_held": kv_held["unpatched"] / 1e9,
                "peak_gb": peak_gb(),
                "speedup": 1.0,
                **floor_fields(base_ms, weights + dense_kv, bandwidth),
            }
        )
        print(results[-1], flush=True)
        del dense_cache
        if device == "cuda":
            torch.cuda.empty_cache()
        if static_wanted:  # the unpatched model as the transformers docs recommend for fast decoding
            static = static_cache(model, batch, length, length + args.steps + args.warmup + 1, device)
            forward = model.forward
            options = {"mode": "reduce-overhead"} if device == "cuda" else {"backend": "aot_eager"}
            model.forward = torch.compile(forward, fullgraph=True, **options)
            reset_peak()
            try:
                t = time_decode(model, static, batch, length, args.steps, args.warmup)
                ms = 1000 * statistics.median(t)
            except Exception as e:  # noqa: BLE001 - the row says why it could not run; the others go on
                print(f"{STATIC_ROW}: {type(e).__name__}: {e}", flush=True)
                ms = float("nan")
            del model.forward
            results.append(
                {"batch": batch, "context": length, "row": STATIC_ROW, "ms_per_token": ms,
                 "tokens_per_s": batch / (ms / 1000), "kv_mb_per_step": dense_kv / 1e6, "peak_gb": peak_gb(),
                 "speedup": base_ms / ms, **floor_fields(ms, weights + dense_kv, bandwidth)}
            )  # fmt: skip
            print(results[-1], flush=True)
            del static
            torch._dynamo.reset()
            if device == "cuda":
                torch.cuda.empty_cache()
        backend = "inductor" if device == "cuda" else "aot_eager"
        patched_rows = [(n, p, m, g, None) for n, p, m, g in rows_wanted]
        patched_rows += [(n, p, m, how == "graph", how) for n, p, m, how in compiled_wanted]
        for name, policy, mode, graph, compiled in patched_rows:
            table = {"crossover": args.crossover} if mode == "auto" else {}
            backend_if_graph = backend if compiled == "graph" else None
            patch_model(
                model, policy=policy, mode=mode, block_size=args.block_size, cuda_graph=graph,
                compile=backend_if_graph, **table,
            )  # fmt: skip
            if compiled == "reduce-overhead":  # the user's way: a reserved cache, the model's forward compiled
                paged.reserve_static(length + args.steps + args.warmup + 1)
                options = {"mode": "reduce-overhead"} if device == "cuda" else {"backend": "aot_eager"}
                model.forward = torch.compile(model.forward, fullgraph=True, **options)
            reset_peak()
            read0, steps0 = int(paged.kv_bytes_read), paged.decode_steps
            auto0 = paged.auto_steps
            t = time_decode(model, paged, batch, length, args.steps, args.warmup)
            ms = 1000 * statistics.median(t)
            steps = max(paged.decode_steps - steps0, 1)
            read = (int(paged.kv_bytes_read) - read0) / steps
            sparse_layers = model.config.num_hidden_layers - 2  # the default dense layers (0, 1)
            if mode == "auto":
                sparse_layers = (paged.auto_steps["sparse"] - auto0["sparse"]) / steps
            meta = metadata_bytes(model, policy, batch, length, args.block_size, sparse_layers)
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
                    **floor_fields(ms, weights + int(read) + meta, bandwidth),
                }
            )
            print(results[-1], flush=True)
            if compiled == "reduce-overhead":
                del model.forward
            unpatch_model(model)
            if compiled:
                torch._dynamo.reset()
        del paged
        if device == "cuda":
            torch.cuda.empty_cache()

    run_generate(model, args, results, bandwidth)

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
        "floor_ms",
        "of_floor",
        "generate_s",
        "ttft_s",
        "ttft_patched_s",
        "ttft_ratio",
    ]
    shape = (
        "tiny Llama (4 layers, 8/2 heads, head dim 32)" if args.tiny else f"Llama-3.1-8B shape, {args.layers} layers"
    )
    print_table(results, cols, title=f"{shape}, bf16, block_size {args.block_size}, HBM {bandwidth:.0f} GB/s")


if __name__ == "__main__":
    main()
