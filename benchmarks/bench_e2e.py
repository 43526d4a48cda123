"""End-to-end decode speed of a Llama-3.1-8B-shaped model (random weights, bf16): does generate() get faster?
(``--shape smollm2`` or ``qwen2.5``: the suite's full-attention models' shapes instead, ``benchmarks/shapes.py``.)

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
Rows named ``graph+compile+merged: ...`` (and ``generate: graph+compile+merged: ...``) do the same with
``merge_projections=True`` (q/k/v and gate/up as one matmul each); ``graph+compile+merged+autotune: ...`` also
compiles with inductor's ``mode="max-autotune-no-cudagraphs"`` (each matmul's kernel chosen by timing; minutes);
``graph+compile+merged+linear: ...`` runs the decode-sized products through the package's Triton matmul
(``decode_linear=True``) instead of cuBLAS.
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
``--new-tokens`` (128) greedy tokens, for the unpatched model (dynamic cache; static cache, which transformers
compiles), patched Dense and Quest 1/16 captured (on a ``PagedKVCache`` the script passes in, so that the row can
report its ``captured_steps``: decode steps replayed from a graph; ``graphs``: the graphs captured, one per selection
width, and ``capture_s``: their captures' wall time), and issue 13's product-quantized coarse pass with
its centres fitted at the prefill (``pq prefill-fit c4``: ``TopPBlockTopK(candidates=4, p=1, coarse="pq",
calibration="prefill")``, whose TTFT holds the fit). One call per row: a logits processor takes a
device-synchronised timestamp at every new token, so TTFT is the time to the first token and ``ms_per_token`` the
median time between two tokens (a forward, argmax and generate's own work; the capture of a new plan's graph, or a
compile, is one slow step the median ignores and ``mean_step_ms`` includes). With ``B > 1`` the prompts are also run
left-padded to lengths spread over ``[3L/4, L]`` (the serving-style batch of different lengths; sequence 0 keeps
``L``), and each padded row gives ``vs_unpadded`` = its ms/token over the same row's on the unpadded batch. Floors
of the generate rows: the weights, the K/V of each sequence's real context halfway through the call (the unpatched
rows; ``generate: floor: dense``) or what the row's cache counted, and the selection's metadata.

Order and progress. A run goes by phases (``--phases``): ``decode`` (per shape: the floor, the unpatched model,
the eager and captured patched rows), ``generate``, then ``compiled``: every row that compiles (the StaticCache rows,
``graph+compile:``, ``reduce-overhead:``; minutes each on the 8B shape), last, so that a run stopped by a time limit
has measured the rest. Every row prints as it is measured, after a ``[HH:MM:SS +elapsed s]`` stamp, and the CSV is
rewritten after each row. ``--rows`` keeps the named rows (names as in the tables, without `` (left-padded)``;
``TTFT`` for the prefill rows of Quest, ``TTFT: pq prefill-fit`` for those of the product-quantized selector, whose
prefill fits its centres); an unknown name is an error. The filled-cache rows of a phase run in the tables' order;
``--reverse`` runs them the other way round (a pair of rows timed both ways shows whether a row's place in the process
moves its time).

The target rows of issue 14 at the 8B shape (the StaticCache row compiles once per shape, which takes minutes: leave
it out of ``--rows`` for a quick run; ``timeout`` keeps what was measured before it)::

    timeout 470 python benchmarks/bench_e2e.py --shapes 1x131072,8x32768 --ttft "" --generate 8x32768 --steps 12 \
        --rows "floor: dense,unpatched sdpa,unpatched StaticCache + compile,graph: patched Dense,\
graph: Quest 1/16 block,generate: floor: dense,generate: unpatched sdpa,generate: graph: patched Dense,\
generate: graph: Quest 1/16 block" --out benchmarks/results/bench_e2e_targets.csv

Columns: ms/token (median), tokens/s (batch / median), KV MB read per step (all layers, from the cache's counter),
KV GB held, peak GPU GB during the row, speedup over unpatched, floor ms and ms / floor. Selection cost ~ Quest row
- SinkWindow row at the same budget (same bytes read, no scoring).

A dry run on the CPU (a tiny model of the same ratios; every row, about a minute; ``graph:`` rows run their steps
eagerly there, and the compiled rows use the ``aot_eager`` backend)::

    python benchmarks/bench_e2e.py --device cpu --tiny --shapes 1x256,2x128 --ttft 1x128 --generate 2x128 \
        --new-tokens 8 --steps 3 --warmup 1 --out /tmp/bench_e2e.csv
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import env_info, hbm_bandwidth, print_table, write_csv
from shapes import shape_config
from transformers import StaticCache

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.ops.layout import cdiv
from hf_sparse_kv.policies import BlockTopK, Dense, Fp8BlockTopK, Quest, SinkWindow, SnapKV, TopPBlockTopK


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


# the shapes --shape builds besides the 8B one: full-attention models only (the floors count every layer's K/V, and
# two dense layers besides the sparse ones; Gemma-3's sliding-window layers hold a window, not the context)
OTHER_SHAPES = ("smollm2", "qwen2.5")


def head_dim(cfg) -> int:
    """A config's head dimension (Qwen2's config leaves it to ``hidden_size / num_attention_heads``)."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def model_config(shape: str, layers: int | None):
    """The config ``--shape`` names (``"llama8b"`` or one of :data:`OTHER_SHAPES`, which ``main`` checks), with
    ``layers`` layers when given (default: the shape's own; 32 for the 8B shape)."""
    if shape == "llama8b":
        return llama8b_config(layers or 32)
    cfg = shape_config(shape)
    if layers:
        cfg.num_hidden_layers = layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:layers]
    return cfg


def build_model(layers: int, device: str, config=None):
    """The model of ``config`` (default: the 8B shape with ``layers`` layers), random bf16 weights, on ``device``."""
    from transformers import AutoModelForCausalLM

    config = config or llama8b_config(layers)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = (
            LlamaForCausalLM(config) if isinstance(config, LlamaConfig) else AutoModelForCausalLM.from_config(config)
        )
    torch.set_default_dtype(torch.float32)
    model.config._attn_implementation = "sdpa"
    model.set_attn_implementation("sdpa")
    return model.eval()


DECODE_ROOM = 256  # tokens a filled cache can still take: the decode steps a row times after its context


def fill_caches(
    model,
    batch: int,
    length: int,
    block_size: int,
    device: str,
    kv_heads: int | None = None,
    cache_cls=PagedKVCache,
    dense: bool = True,
):
    """A DynamicCache and a ``cache_cls`` (a PagedKVCache) holding the same random ``length`` tokens per sequence,
    for ``kv_heads`` KV heads per layer (default the config's; under tensor parallelism, a rank's share), the paged
    one with room for :data:`DECODE_ROOM` more. ``dense=False``: no DynamicCache (``None`` in its place; the paged
    one's contents are the same), for runs without the unpatched row: the 8B shape's 8 × 32K then fits an H100."""
    cfg = model.config
    dense_cache = DynamicCache(config=cfg) if dense else None
    paged = cache_cls(cfg, block_size=block_size, max_length=length + DECODE_ROOM)
    g = torch.Generator(device=device).manual_seed(0)
    for i in range(cfg.num_hidden_layers):
        shape = (batch, kv_heads or cfg.num_key_value_heads, length, head_dim(cfg))
        k = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        v = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        if dense_cache is not None:
            dense_cache.update(k, v, i)
        paged.layers[i].update(k, v)
        del k, v
    return dense_cache, paged


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_gb() -> float | None:
    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def time_decode(model, cache, batch: int, length: int, steps: int, warmup: int, crop: bool = True) -> list[float]:
    """Seconds per decode step (device-synchronised) for ``steps`` steps after ``warmup``; crops back after (with
    ``crop``: a ``StaticCache``, used once, has no ``crop`` on transformers 5.17)."""
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
    if crop:
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
        shape = (batch, cfg.num_key_value_heads, length, head_dim(cfg))
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


def metadata_bytes(model, policy, blocks: int, sparse_layers: float) -> int:
    """Block metadata a step's selection reads: ``sparse_layers`` layers (an average under ``mode="auto"``) of min
    and max (Quest) or mean (BlockTopK) of the ``blocks`` blocks held (all sequences), ``[Hkv, D]`` bf16 each; SnapKV
    with a fractional budget: its ``then``'s over that share of the blocks (an int budget: over all, an upper
    bound)."""
    if isinstance(policy, SnapKV):
        share = policy.budget if isinstance(policy.budget, float) else 1.0
        return metadata_bytes(model, policy.then, int(blocks * share), sparse_layers) if policy.then else 0
    per = 2 if isinstance(policy, Quest) else 1 if isinstance(policy, BlockTopK) else 0
    cfg = model.config
    return int(per * sparse_layers * blocks * cfg.num_key_value_heads * head_dim(cfg) * 2)


def kv_token_bytes(model) -> int:
    """K and V bytes of one token in every layer (bf16)."""
    cfg = model.config
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim(cfg) * 2


def dense_kv_bytes(model, batch: int, length: int) -> int:
    return kv_token_bytes(model) * batch * length


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
COMPILED_ROWS = [  # (name, policy, mode, how): "graph" = cuda_graph=True, compile="inductor"; "graph+merged": the
    # same with merge_projections=True; "graph+merged+autotune": and inductor's mode="max-autotune-no-cudagraphs";
    # "reduce-overhead" = the cache reserved (reserve_static) and
    # model.forward = torch.compile(model.forward, mode="reduce-overhead")
    ("graph+compile: patched Dense", Dense(), "block", "graph"),
    ("graph+compile: Quest 1/16 block", Quest(budget=0.0625), "block", "graph"),
    ("graph+compile+merged: patched Dense", Dense(), "block", "graph+merged"),
    ("graph+compile+merged: Quest 1/16 block", Quest(budget=0.0625), "block", "graph+merged"),
    # inductor's max-autotune picks each matmul's kernel by timing cuBLAS against its Triton templates (minutes of
    # compile): whether o_proj (60 % of the bandwidth under cuBLAS at batch 1) and the rest get faster kernels
    ("graph+compile+merged+autotune: patched Dense", Dense(), "block", "graph+merged+autotune"),
    # the decode-sized products through the package's Triton matmul (decode_linear=True) instead of cuBLAS
    ("graph+compile+merged+linear: patched Dense", Dense(), "block", "graph+merged+linear"),
    ("graph+compile+merged+linear: Quest 1/16 block", Quest(budget=0.0625), "block", "graph+merged+linear"),
    # the float8-key selector (the oracle's ranking on e4m3 copies of the keys)
    ("graph+compile+merged+linear: Fp8 1/16 block", Fp8BlockTopK(budget=0.0625), "block", "graph+merged+linear"),
    ("graph+compile+merged+autotune: Quest 1/16 block", Quest(budget=0.0625), "block", "graph+merged+autotune"),
    ("reduce-overhead: patched Dense", Dense(), "block", "reduce-overhead"),
    ("reduce-overhead: Quest 1/16 block", Quest(budget=0.0625), "block", "reduce-overhead"),
]
STATIC_ROW = "unpatched StaticCache + compile"
PQ_PREFILL = TopPBlockTopK(
    budget=0.0625, sink=4, window=32, candidates=4, p=1.0, pool="heads", coarse="pq", calibration="prefill"
)
SNAPKV_QUEST = SnapKV(budget=0.25, sink=4, window=32, observe=32, then=Quest(budget=0.0625, sink=4, window=32))
TTFT_ROWS = [  # (name for --rows, policy, the row's label): each prefill timed against the unpatched model's
    ("TTFT", Quest(budget=0.0625), "TTFT (s): unpatched / patched"),
    # the product-quantized selector fits each layer's centres at the prefill: what that adds to a prompt's TTFT
    ("TTFT: pq prefill-fit", PQ_PREFILL, "TTFT (s): unpatched / pq prefill-fit"),
]
GENERATE_ROWS = [  # (name, policy or None (unpatched), extra generate() arguments, how the captured step is
    # compiled: None (not), "graph" (inductor), "graph+merged" (inductor, merge_projections=True))
    ("generate: unpatched sdpa", None, {}, None),
    ("generate: unpatched StaticCache + compile", None, {"cache_implementation": "static"}, None),
    ("generate: graph: patched Dense", Dense(), {}, None),
    ("generate: graph: Quest 1/16 block", Quest(budget=0.0625), {}, None),
    ("generate: graph+compile: patched Dense", Dense(), {}, "graph"),
    ("generate: graph+compile: Quest 1/16 block", Quest(budget=0.0625), {}, "graph"),
    ("generate: graph+compile+merged: Quest 1/16 block", Quest(budget=0.0625), {}, "graph+merged"),
    # issue 13's product-quantized coarse pass, its centres fitted at the prefill (TTFT holds the fit), 4 x candidates
    ("generate: graph: pq prefill-fit c4 1/16 block", PQ_PREFILL, {}, None),
    ("generate: graph+compile+merged: pq prefill-fit c4 1/16 block", PQ_PREFILL, {}, "graph+merged"),
    # the float8-key selector: its codes written at the prefill, the oracle's ranking on them at every step
    ("generate: graph+compile+merged: Fp8 1/16 block", Fp8BlockTopK(budget=0.0625), {}, "graph+merged"),
    # SnapKV keeps a quarter of the prompt at its first decode step (eager), Quest reads 1/16 of the context from
    # it; the other steps captured over the table with the freed blocks left out
    ("generate: graph: SnapKV 1/4 + Quest 1/16 block", SNAPKV_QUEST, {}, None),
    ("generate: graph+compile+merged: SnapKV 1/4 + Quest 1/16 block", SNAPKV_QUEST, {}, "graph+merged"),
]


def static_row(row) -> bool:
    """Whether a ``GENERATE_ROWS`` row is transformers' ``StaticCache`` + compile (``--no-static`` skips it)."""
    return row[2].get("cache_implementation") == "static"


def compiles(row) -> bool:
    """Whether a ``GENERATE_ROWS`` row compiles (it runs in the ``compiled`` phase)."""
    return static_row(row) or row[3] is not None


PHASES = ("decode", "generate", "compiled")  # the order of a run: cheap rows first, the compiles last


def floor_fields(ms: float, nbytes: int, bandwidth: float) -> dict:
    floor = 1000 * nbytes / (bandwidth * 1e9)
    return {"floor_ms": floor, "of_floor": ms / floor if ms else None}


class Report:
    """The rows measured so far: each one printed with a timestamp as it is measured and the CSV rewritten, so a run
    stopped by a time limit leaves what it measured."""

    def __init__(self, out: str):
        self.out, self.rows, self.t0 = out, [], time.perf_counter()

    def say(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - self.t0:6.0f} s] {msg}", flush=True)

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.say(", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        write_csv(self.out, self.rows)


def compile_backend(device: str) -> str:
    """The backend that compiles a captured step: inductor on CUDA, ``aot_eager`` on the CPU (a dry run)."""
    return "inductor" if device == "cuda" else "aot_eager"


def merges_projections(how: str | None) -> bool:
    """Whether a row's ``how`` patches with ``merge_projections=True`` (``"graph+merged"`` and its variants)."""
    return how is not None and how.startswith("graph+merged")


def step_compile(device: str, how: str | None) -> str | dict | None:
    """``patch_model``'s ``compile`` for a row's ``how``: ``None`` (not compiled), the backend name (``"graph"``,
    ``"graph+merged"``) or, for ``"graph+merged+autotune"`` on CUDA, inductor with ``max-autotune-no-cudagraphs``."""
    if how != "graph" and not merges_projections(how):
        return None
    if how.endswith("autotune") and device == "cuda":
        return {"backend": "inductor", "mode": "max-autotune-no-cudagraphs"}
    return compile_backend(device)


def step_options(device: str, how: str | None) -> dict:
    """``patch_model``'s ``compile`` and ``merge_projections`` for a row's ``how`` (``COMPILED_ROWS``,
    ``GENERATE_ROWS``)."""
    opts = {"compile": step_compile(device, how), "merge_projections": merges_projections(how)}
    if how == "graph+merged+linear":  # (only then: bench_ab.py's older package may not take the argument)
        opts["decode_linear"] = True
    return opts


def patch_row(model, policy, mode: str, args, graph: bool, compiled: str | None = None) -> None:
    table = {"crossover": args.crossover} if mode == "auto" else {}
    patch_model(
        model,
        policy=policy,
        mode=mode,
        block_size=args.block_size,
        cuda_graph=graph,
        **step_options(args.device, compiled),
        **table,
    )


def compile_options(device: str) -> dict:
    """``mode="reduce-overhead"`` on CUDA; ``aot_eager`` on the CPU (a dry run: no CUDA graphs there)."""
    return {"mode": "reduce-overhead"} if device == "cuda" else {"backend": "aot_eager"}


@contextmanager
def patched(model, paged, row, args, compiled: str | None = None, tokens: int = 0):
    """The model patched as ``row`` ``(name, policy, mode, cuda_graph)`` inside the ``with`` block, unpatched after
    (and dynamo reset when ``compiled``). ``compiled``: ``"graph"`` (the captured step compiled), ``"graph+merged"``
    (the same with ``merge_projections=True``), ``"graph+merged+autotune"`` (and inductor's max-autotune) or
    ``"reduce-overhead"`` (the user's way: ``paged`` reserved for ``tokens`` more tokens, the model's forward
    compiled)."""
    _, policy, mode, graph = row
    patch_row(model, policy, mode, args, graph, compiled)
    try:
        if compiled == "reduce-overhead":
            paged.reserve_static(paged.get_seq_length() + tokens)
            model.forward = torch.compile(model.forward, fullgraph=True, **compile_options(args.device))
        yield
    finally:
        if compiled == "reduce-overhead":
            vars(model).pop("forward", None)  # the compiled forward (unset if the reservation failed)
        unpatch_model(model)
        if compiled:
            torch._dynamo.reset()


def patched_decode_row(model, paged, row, args, shape, weights, bandwidth, compiled=None) -> dict:
    """Time one patched row ``(name, policy, mode, cuda_graph)`` on the filled cache ``paged`` (cropped back after);
    ``compiled``: a ``COMPILED_ROWS`` row's ``how`` (see :func:`patched`)."""
    name, policy, mode, _ = row
    batch, length, base_ms, kv_held = shape
    with patched(model, paged, row, args, compiled, args.steps + args.warmup + 1):
        reset_peak()
        read0, steps0, auto0 = int(paged.kv_bytes_read), paged.decode_steps, paged.auto_steps
        t = time_decode(model, paged, batch, length, args.steps, args.warmup)
        ms = 1000 * statistics.median(t)
    steps = max(paged.decode_steps - steps0, 1)
    read = (int(paged.kv_bytes_read) - read0) / steps
    sparse_layers = model.config.num_hidden_layers - 2  # the default dense layers (0, 1)
    if mode == "auto":
        sparse_layers = (paged.auto_steps["sparse"] - auto0["sparse"]) / steps
    meta = metadata_bytes(model, policy, batch * cdiv(length, args.block_size), sparse_layers)
    return {"batch": batch, "context": length, "row": name, "ms_per_token": ms, "tokens_per_s": batch / (ms / 1000),
            "kv_mb_per_step": read / 1e6, "kv_gb_held": kv_held / 1e9, "peak_gb": peak_gb(),
            "speedup": base_ms / ms if base_ms else None, **floor_fields(ms, weights + int(read) + meta, bandwidth)}  # fmt: skip


def decode_phase(model, batch, length, args, report, bandwidth, keep) -> float | None:
    """The floor, the unpatched model and the eager and captured patched rows at one shape; returns the unpatched
    ms/token (``None`` when that row is not wanted)."""
    weights, dense_kv = weight_bytes(model, batch), dense_kv_bytes(model, batch, length)
    if keep("floor: dense"):
        report.add({"batch": batch, "context": length, "row": "floor: dense", "kv_mb_per_step": dense_kv / 1e6,
                    **floor_fields(0.0, weights + dense_kv, bandwidth), "hbm_gb_s": bandwidth})  # fmt: skip
    rows = [r for r in ROWS if keep(r[0])][:: -1 if args.reverse else 1]
    if not keep("unpatched sdpa") and not rows:
        return None
    report.say(f"{batch}x{length}: filling the caches")
    dense_cache, paged = fill_caches(model, batch, length, args.block_size, args.device, dense=keep("unpatched sdpa"))
    base_ms = None
    if keep("unpatched sdpa"):
        held = sum(t.numel() * t.element_size() for k, v, *_ in dense_cache for t in (k, v))
        reset_peak()
        base_ms = 1000 * statistics.median(time_decode(model, dense_cache, batch, length, args.steps, args.warmup))
        report.add({"batch": batch, "context": length, "row": "unpatched sdpa", "ms_per_token": base_ms,
                    "tokens_per_s": batch / (base_ms / 1000), "kv_mb_per_step": dense_kv / 1e6,
                    "kv_gb_held": held / 1e9, "peak_gb": peak_gb(), "speedup": 1.0,
                    **floor_fields(base_ms, weights + dense_kv, bandwidth)})  # fmt: skip
    del dense_cache
    empty_cache(args.device)
    shape = (batch, length, base_ms, paged.memory_bytes())
    for row in rows:
        report.say(f"{batch}x{length}: {row[0]}")
        report.add(patched_decode_row(model, paged, row, args, shape, weights, bandwidth))
    del paged
    empty_cache(args.device)
    return base_ms


def compiled_phase(model, batch, length, args, report, bandwidth, keep, base_ms) -> None:
    """The rows that compile (minutes each on the 8B shape): transformers' ``StaticCache`` with
    ``torch.compile(mode="reduce-overhead")``, the compiled captured step and the user's compiled forward."""
    weights, dense_kv = weight_bytes(model, batch), dense_kv_bytes(model, batch, length)
    rows = [r for r in COMPILED_ROWS if keep(r[0])][:: -1 if args.reverse else 1]
    if rows:  # the patched compiled rows first: a time limit stops the StaticCache row, not them
        report.say(f"{batch}x{length}: filling the paged cache")
        _, paged = fill_caches(model, batch, length, args.block_size, args.device, dense=False)
        shape = (batch, length, base_ms, paged.memory_bytes())
        for name, policy, mode, how in rows:
            report.say(f"{batch}x{length}: {name} (compile, steps)")
            row = (name, policy, mode, how != "reduce-overhead")
            report.add(patched_decode_row(model, paged, row, args, shape, weights, bandwidth, how))
        del paged
        empty_cache(args.device)
    if keep(STATIC_ROW) and not args.no_static:  # the unpatched model as the transformers docs recommend
        report.say(f"{batch}x{length}: {STATIC_ROW} (fill, compile, steps)")
        static = static_cache(model, batch, length, length + args.steps + args.warmup + 1, args.device)
        model.forward = torch.compile(model.forward, fullgraph=True, **compile_options(args.device))
        reset_peak()
        try:
            ms = 1000 * statistics.median(time_decode(model, static, batch, length, args.steps, args.warmup, False))
        except Exception as e:  # noqa: BLE001 - the row says why it could not run; the others go on
            report.say(f"{STATIC_ROW}: {type(e).__name__}: {e}")
            ms = float("nan")
        del model.forward
        report.add({"batch": batch, "context": length, "row": STATIC_ROW, "ms_per_token": ms,
                    "tokens_per_s": batch / (ms / 1000), "kv_mb_per_step": dense_kv / 1e6, "peak_gb": peak_gb(),
                    "speedup": base_ms / ms if base_ms else None,
                    **floor_fields(ms, weights + dense_kv, bandwidth)})  # fmt: skip
        del static
        torch._dynamo.reset()
        empty_cache(args.device)


class StepClock(LogitsProcessor):
    """Called by ``generate()`` once per new token, after that token's forward: device-synchronised timestamps (the
    first one closes the prefill, each next one a decode step)."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sync(self.device)
        self.times.append(time.perf_counter())
        return scores


def time_generate(model, ids, mask, new_tokens: int, **kw) -> dict:
    """One greedy ``generate()`` of ``new_tokens`` tokens (every one made): TTFT (the prefill and the first token),
    the median decode step (the time between two tokens: forward, argmax and generate's own work) and its mean over
    the call (capture or compile of the first steps included), and the whole call, in seconds."""
    clock = StepClock(model.device)
    kw = {"pad_token_id": 0, "logits_processor": LogitsProcessorList([clock]), **kw}
    with torch.no_grad():
        sync(model.device)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, **kw)  # fmt: skip
        sync(model.device)
        whole = time.perf_counter() - t0
    steps = [b - a for a, b in zip(clock.times, clock.times[1:])] or [float("nan")]
    return {"ttft_s": clock.times[0] - t0, "step_s": statistics.median(steps), "mean_step_s": statistics.fmean(steps),
            "generate_s": whole}  # fmt: skip


def generate_prompts(model, batch: int, length: int) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """Random prompts ``[B, L]``: unpadded, and with ``B > 1`` left-padded to lengths spread over ``[3L/4, L]`` (the
    serving-style batch; sequence 0 keeps ``L``)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (batch, length), generator=g).to(model.device)
    variants = [("", ids, None)]
    if batch > 1:
        mask = torch.ones_like(ids)
        for b in range(batch):
            mask[b, : (length // 4) * b // (batch - 1)] = 0
        variants.append((" (left-padded)", ids.masked_fill(mask == 0, 0), mask))
    return variants


def generate_phase(model, args, report, bandwidth, keep, compiled: bool) -> None:
    """The ``--generate`` rows: a real prefill, then ``--new-tokens`` greedy tokens, per shape (left-padded too when
    ``B > 1``, with its ms/token over the unpadded batch's). ``compiled``: the rows that compile (StaticCache,
    graph+compile)."""
    rows = [
        r for r in GENERATE_ROWS if keep(r[0]) and compiles(r) == compiled and not (args.no_static and static_row(r))
    ]
    for shape in args.generate.split(",") if args.generate and rows else []:
        batch, length = map(int, shape.split("x"))
        unpadded = {}
        for suffix, ids, mask in generate_prompts(model, batch, length):
            real = [length] * batch if mask is None else mask.sum(-1).tolist()
            mid = [n + args.new_tokens // 2 for n in real]  # the context halfway through the generation
            weights, dense_kv = weight_bytes(model, batch), kv_token_bytes(model) * sum(mid)
            if keep("generate: floor: dense") and not compiled:
                report.add({"batch": batch, "context": length, "row": "generate: floor: dense" + suffix,
                            "kv_mb_per_step": dense_kv / 1e6, **floor_fields(0.0, weights + dense_kv, bandwidth)})  # fmt: skip
            for name, policy, extra, how in rows:
                report.say(f"{batch}x{length}{suffix}: {name}")
                cache, extra = None, dict(extra)
                if policy is not None:
                    patch_model(
                        model,
                        policy=policy,
                        mode="block",
                        block_size=args.block_size,
                        cuda_graph=True,
                        **step_options(args.device, how),
                    )
                    cache = PagedKVCache(model.config, block_size=args.block_size, max_length=length + args.new_tokens)
                    extra[cache_kwarg(model)] = cache
                reset_peak()
                try:
                    t = time_generate(model, ids, mask, args.new_tokens, **extra)
                except Exception as e:  # noqa: BLE001 - a row that cannot run says why, the others go on
                    report.say(f"{name}{suffix}: {type(e).__name__}: {e}")
                    t = dict.fromkeys(("ttft_s", "step_s", "mean_step_s", "generate_s"), float("nan"))
                finally:
                    if policy is not None:
                        unpatch_model(model)
                    if compiled:
                        torch._dynamo.reset()
                ms = 1000 * t["step_s"]
                nbytes, captured, graphs, capture_s = weights + dense_kv, None, None, None
                if cache is not None:  # what the cache counted, the selection's metadata on top
                    nbytes = weights + cache.kv_bytes_read // max(cache.decode_steps, 1)
                    nblk = sum(cdiv(n, args.block_size) for n in mid)
                    nbytes += metadata_bytes(model, policy, nblk, model.config.num_hidden_layers - 2)
                    runner = cache.session.graphs
                    captured = runner.replays if runner else 0
                    graphs = len(runner.graphs) if runner else 0
                    capture_s = runner.capture_seconds if runner else 0.0
                row = {"batch": batch, "context": length, "row": name + suffix, "ms_per_token": ms,
                       "tokens_per_s": batch / (ms / 1000), "kv_mb_per_step": (nbytes - weights) / 1e6,
                       "peak_gb": peak_gb(), **floor_fields(ms, nbytes, bandwidth), "ttft_s": t["ttft_s"],
                       "mean_step_ms": 1000 * t["mean_step_s"], "generate_s": t["generate_s"],
                       "captured_steps": captured, "graphs": graphs, "capture_s": capture_s}  # fmt: skip
                if suffix:
                    row["vs_unpadded"] = ms / unpadded[name] if name in unpadded else None
                else:
                    unpadded[name] = ms
                report.add(row)
                del cache
                empty_cache(args.device)


def empty_cache(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1x8192,1x32768,1x65536,1x131072,8x8192,8x32768", help="BxL,...")
    p.add_argument("--ttft", default="1x8192,1x32768,1x131072", help="BxL shapes whose prefill is timed")
    p.add_argument("--layers", type=int, default=None, help="layers (default: the shape's own; 32 for llama8b)")
    p.add_argument("--shape", default="llama8b", help=f"llama8b (default) or one of {', '.join(OTHER_SHAPES)}")
    p.add_argument(
        "--tiny", action="store_true", help="a tiny model of the 8B shape's ratios (a dry run, e.g. on the CPU)"
    )
    p.add_argument("--generate", default="1x32768,8x32768", help="BxL shapes of the timed generate() calls ('' none)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens each timed generate() makes")
    p.add_argument("--no-static", action="store_true", help="skip the StaticCache + torch.compile rows")
    p.add_argument(
        "--reverse",
        action="store_true",
        help="time each phase's filled-cache rows in the reverse of the table's order (does a row's place in the "
        "process move its time?)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rows", default="", help="comma-separated row names to keep (default: all; see ROWS)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"which of {PHASES} to run, in that order")
    p.add_argument("--out", default="benchmarks/results/bench_e2e.csv")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script")
    p.add_argument("--crossover", default=None, help="crossover table for the auto rows (default: the shipped one)")
    args = p.parse_args()
    if args.shape != "llama8b" and (args.shape not in OTHER_SHAPES or args.tiny):
        raise SystemExit(f"--shape: {args.shape!r} is not one of llama8b, {', '.join(OTHER_SHAPES)} (nor with --tiny)")
    wanted = {r.strip() for r in args.rows.split(",") if r.strip()}
    known = {r[0] for r in ROWS + COMPILED_ROWS + GENERATE_ROWS} | {"floor: dense", "unpatched sdpa", STATIC_ROW}
    known |= {"generate: floor: dense"} | {r[0] for r in TTFT_ROWS}
    if wanted - known:
        raise SystemExit(f"--rows: unknown {sorted(wanted - known)}; rows are {sorted(known)}")
    phases = args.phases.split(",")

    def keep(name: str) -> bool:
        return not wanted or name in wanted

    report = Report(args.out)
    report.say(str(env_info()))
    model = build_model(
        args.layers or 32, args.device, tiny_config() if args.tiny else model_config(args.shape, args.layers)
    )
    report.say(f"model built: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters")
    bandwidth = hbm_bandwidth(args.device, 2**31 if args.device == "cuda" else 2**24)
    report.say(f"HBM bandwidth (device copy): {bandwidth:.0f} GB/s")

    ttft_rows = [r for r in TTFT_ROWS if keep(r[0])]
    for shape in args.ttft.split(",") if args.ttft and ttft_rows else []:
        batch, length = map(int, shape.split("x"))
        report.say(f"{batch}x{length}: TTFT")
        base = time_prefill(model, batch, length)
        for _, policy, label in ttft_rows:
            patch_model(model, policy=policy, mode="block", block_size=args.block_size)
            patched = time_prefill(model, batch, length)
            unpatch_model(model)
            report.add({"batch": batch, "context": length, "row": label, "ttft_s": base, "ttft_patched_s": patched,
                        "ttft_ratio": patched / base})  # fmt: skip
        empty_cache(args.device)

    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else []
    base = {}
    if "decode" in phases:
        for batch, length in shapes:
            base[(batch, length)] = decode_phase(model, batch, length, args, report, bandwidth, keep)
    if "generate" in phases:
        generate_phase(model, args, report, bandwidth, keep, compiled=False)
    if "compiled" in phases:
        for batch, length in shapes:
            compiled_phase(model, batch, length, args, report, bandwidth, keep, base.get((batch, length)))
        generate_phase(model, args, report, bandwidth, keep, compiled=True)

    report.say(f"done; CSV: {args.out}")
    cols = ["batch", "context", "row", "ms_per_token", "tokens_per_s", "kv_mb_per_step", "kv_gb_held", "peak_gb",
            "speedup", "floor_ms", "of_floor", "vs_unpadded", "captured_steps", "graphs", "capture_s", "mean_step_ms",
            "generate_s", "ttft_s",
            "ttft_patched_s", "ttft_ratio"]  # fmt: skip
    cfg = model.config
    shape = (
        "tiny Llama (4 layers, 8/2 heads, head dim 32)"
        if args.tiny
        else f"{'Llama-3.1-8B' if args.shape == 'llama8b' else args.shape} shape, {cfg.num_hidden_layers} layers, "
        f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, head dim {head_dim(cfg)}"
    )
    print_table(report.rows, cols, title=f"{shape}, bf16, block_size {args.block_size}, HBM {bandwidth:.0f} GB/s")


if __name__ == "__main__":
    main()
