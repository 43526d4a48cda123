"""Decode attention over one layer's KV cache: dense, mask, FlexAttention, and our token / block kernels.

The question: how much of the bandwidth that a budget saves does each way of executing a sparse selection turn into
time, and where is dense still faster? bf16, random data (never zeros), a random block table (a permutation of the
pool). Each provider is timed as a CUDA graph of ``--layers`` calls, one per layer, each layer on its own cache (as
in a model's decode step), L2 flushed before each replay; the time is the median replay over the layer count.
Providers, timed in the same run:

- ``dense``: SDPA over a contiguous ``[B, Hkv, L, D]`` cache (``enable_gqa=True``)
- ``mask``: the same call with a boolean mask keeping the selection (the ``mask`` mode: reads everything)
- ``flex``: FlexAttention with a block mask built from the selection (compiled; only at ``--flex-at`` shapes)
- ``token`` / ``block``: ``decode_tokens`` over the expanded selection / ``decode_blocks`` over the selected pages
- ``+sel``: the same with the selection included (``block_scores`` quest + ``topk_indices`` + kernel)
- ``dense_T``: SDPA dense on a contiguous cache of the ``T`` tokens the budget keeps (the paging + selection cost)
- with ``--selectors`` (issue 13), selection + attention per layer through each policy's own ``select()``:
  ``quest`` (Quest, block), ``proj_blk`` (ProjectedBlockTopK, compressed keys ``R = D/8``, block),
  ``proj_tok`` (ProjectedTokenTopK, token kernel), ``2st_c2`` / ``2st_c4`` (TwoStageBlockTopK, Quest coarse pass
  to 2x / 4x / 8x the budget's blocks, exact scores over them), ``2st_tok`` (TwoStageTokenTopK, c = 4), ``topp_c4``
  (TopPBlockTopK, c = 4, p = 0.9: its bytes are the budget's cap), ``mass_c8`` (TopPBlockTopK, c = 8, p = 1: the
  candidates ranked by their softmax mass, ``candidate_scores(reduce="mass")``), ``massh_c8`` (the same ranked by
  each query head's mass, ``pool="heads"``: ``candidate_scores(reduce="head_mass")``), ``quant2`` / ``quant4``
  (QuantBlockTopK: every block's mass under 2- / 4-bit keys, ``quant_block_scores``), ``fp8`` (Fp8BlockTopK:
  under float8 keys, ``fp8_block_scores``), ``pq_c4`` (TopPBlockTopK,
  c = 4, p = 1, ``coarse="pq"``: the candidates by their mass under product-quantized keys, one byte per 8 channels,
  random centres, ``pq_block_scores``), ``pq_c4_f32`` (the same, its scoring table in float32 rather than the default bfloat16); each also as ``<name>:sel`` (the selection alone), and ``proj:write`` /
  ``quant2:write`` / ``pq:write`` (the compressed keys' / the 2-bit codes' / the pq codes' refresh of one decode
  token)

Bytes are the KV bytes each provider must read by design (``+sel`` adds the min/max metadata of every block); GB/s
and the fraction of the HBM bandwidth measured at the start of the run follow from them.

    python benchmarks/bench_decode.py --quick                 # ~3 minutes on an H200
    python benchmarks/bench_decode.py --models llama3-8b --batches 8   # one chunk of the full grid
    python benchmarks/bench_decode.py --selector-targets      # the selectors at 1 x 128K and 8 x 32K, 1/16, BS 16
    python benchmarks/bench_decode.py --tune-selectors        # their scoring kernels checked and swept there, then
                                                              # the selectors with the best knobs (~2-3 minutes)
    python benchmarks/bench_decode.py --tune-quest            # Quest's scoring kernel checked and swept there
"""

from __future__ import annotations

import argparse
import csv
import functools
import itertools
import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import bench, cpu_dry_run, env_info, hbm_bandwidth, print_table, write_csv

from hf_sparse_kv.ops import get_ops
from hf_sparse_kv.ops import reference as R
from hf_sparse_kv.ops.layout import cdiv
from hf_sparse_kv.ops.triton.block_decode import decode_blocks_fwd
from hf_sparse_kv.policies import (
    Counts,
    DecodeState,
    Fp8BlockTopK,
    ProjectedBlockTopK,
    ProjectedTokenTopK,
    QuantBlockTopK,
    Quest,
    TopPBlockTopK,
    TwoStageBlockTopK,
    TwoStageTokenTopK,
)

MODELS = {"llama3-8b": (32, 8, 128), "smollm2": (9, 3, 64)}  # (Hq, Hkv, D) of one layer
KI = 1024
DEV = "cuda"
FULL = {
    "batches": [1, 8],
    "contexts": [1, 2, 4, 8, 16, 32, 64, 128, 256],  # K tokens; 256K at batch 1 only
    "budgets": [4, 8, 16, 32, 64],  # 1/budget of the context
    "block_sizes": [16, 32, 64],
}
QUICK = [  # (models, batches, contexts, budgets, block sizes): the targets' shapes and a few around them
    (["llama3-8b"], [1], [4, 16, 128], [8, 16, 64], [16, 64]),
    (["llama3-8b"], [8], [4, 32], [8, 16, 64], [16, 64]),
    (["smollm2"], [1, 8], [32], [16], [32]),
]
SKIPPABLE = ["scores", "topk", "topk_torch"]  # the others feed the table's columns
TUNE_AT = [("llama3-8b", 8, 32 * KI, 8), ("llama3-8b", 1, 128 * KI, 16)]
SELECTOR_TARGETS = [("llama3-8b", 1, 128 * KI, [16], [16]), ("llama3-8b", 8, 32 * KI, [16], [16])]
SELECTORS = (
    "quest", "proj_blk", "proj_tok", "2st_c2", "2st_c4", "2st_c8", "2st_tok", "topp_c4", "mass_c8", "massh_c8",
    "quant2", "quant4", "fp8", "pq_c4", "pq_c4_f32", "pq16_c4",
)  # fmt: skip


def meta_bytes(B: int, H: int, n_blocks: int, D: int) -> int:
    return B * H * n_blocks * D * 2 * 2  # kmin and kmax of every block in use, bf16


def kv_bytes(B: int, H: int, n_tokens: int, D: int) -> int:
    return B * H * n_tokens * D * 2 * 2  # keys and values, bf16


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return float("nan") if out.isnan().any() else ((out - ref).norm() / ref.norm()).item()


class Layer:
    """``n`` layers' caches at (model, B, L): contiguous for SDPA, and paged per block size for our kernels.

    Every layer has its own memory (as in a model, where each layer reads its own cache once per step); they share
    the query, the block table and, where given, the selection.
    """

    def __init__(self, model: str, B: int, L: int, n: int):
        self.Hq, self.H, self.D = MODELS[model]
        self.G, self.B, self.L, self.n, self.scale = self.Hq // self.H, B, L, n, self.D**-0.5
        shape, bf16 = (B, self.H, L, self.D), torch.bfloat16
        self.q = torch.randn(B, self.Hq, self.D, device=DEV, dtype=bf16)
        self.k = [torch.randn(shape, device=DEV, dtype=bf16) for _ in range(n)]
        self.v = [torch.randn(shape, device=DEV, dtype=bf16) for _ in range(n)]
        self.seq_lens = torch.full((B,), L, dtype=torch.int32, device=DEV)
        self.zero = torch.zeros(B, dtype=torch.int32, device=DEV)

    def paged(self, BS: int):
        """(per layer [(k_pool, v_pool, kmin, kmax, kmean)], block_table): a random permutation of each pool."""
        B, H, L, D = self.B, self.H, self.L, self.D
        MB = L // BS
        perm = torch.randperm(B * MB, device=DEV)
        layers = []
        for k, v in zip(self.k, self.v):
            pools = []
            for t in (k, v):
                pool = torch.empty(B * MB, H, BS, D, device=DEV, dtype=torch.bfloat16)
                pool[perm] = t.view(B, H, MB, BS, D).permute(0, 2, 1, 3, 4).reshape(B * MB, H, BS, D)
                pools.append(pool)
            kp = pools[0]
            layers.append((*pools, kp.amin(2), kp.amax(2), kp.float().mean(2).to(torch.bfloat16)))
        return layers, perm.view(B, MB).int()

    def sdpa(self, k, v, mask=None):
        return F.scaled_dot_product_attention(
            self.q.unsqueeze(2), k, v, attn_mask=mask, scale=self.scale, enable_gqa=True
        )  # [B, Hq, 1, D]


def add_derived(row: dict, block_bytes: int, hbm: float) -> None:
    """The derived columns of a table row: the block kernel's GB/s and share of the HBM probe, speedups, block/dense_T."""
    gbps = block_bytes / (row["block"] * 1e-6) / 1e9
    row.update({"blk GB/s": gbps, "blk %HBM": 100 * gbps / hbm, "x blk+sel": row["dense"] / row["block+sel"]})
    row["x block"] = row["dense"] / row["block"]
    row["blk/dense_T"] = row["block"] / row["dense_T"]


def rows_from_csv(path: str) -> tuple[list[dict], float]:
    """The table rows (one per model, B, L, BS, budget) and the HBM probe, rebuilt from the long CSV of a run."""
    with open(path) as f:
        long_rows = list(csv.DictReader(f))
    dense = {(r["model"], r["B"], r["L"]): float(r["us"]) for r in long_rows if r["provider"] == "dense"}
    table: dict[tuple, dict] = {}
    for r in long_rows:
        if r["provider"] == "dense":
            continue
        key = (r["model"], r["B"], r["L"], r["BS"], r["budget"])
        row = table.setdefault(key, {"model": r["model"], "B": int(r["B"]), "L": int(r["L"]), "BS": int(r["BS"]),
                                     "budget": r["budget"], "dense": dense[key[:3]]})  # fmt: skip
        row[r["provider"]] = float(r["us"])
        if r["provider"] == "block":
            row["_block_bytes"] = int(r["kv_bytes"])
    hbm = float(long_rows[0]["hbm_GBps"])
    for row in table.values():
        add_derived(row, row.pop("_block_bytes"), hbm)
    return list(table.values()), hbm


def flex_fns(layer: Layer, keep: torch.Tensor):
    """Compiled FlexAttention calls (one per layer) with a block mask from ``keep [B, Hkv, L]``, and the KV bytes
    of the 128-token blocks it visits; (None, 0) where it does not build."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        G = layer.G

        def mask_mod(b, h, q_idx, kv_idx):
            return keep[b, h // G, kv_idx]

        bm = create_block_mask(mask_mod, layer.B, layer.Hq, 1, layer.L, device=DEV)
        compiled = torch.compile(flex_attention, dynamic=False)
        q4 = layer.q.unsqueeze(2)
        fns = [
            lambda k=k, v=v: compiled(q4, k, v, block_mask=bm, scale=layer.scale, enable_gqa=True)
            for k, v in zip(layer.k, layer.v)
        ]
        fns[0]()
        n_blocks = (bm.kv_num_blocks + (bm.full_kv_num_blocks if bm.full_kv_num_blocks is not None else 0))[:, ::G]
        return fns, int(n_blocks.sum()) * 128 * layer.D * 2 * 2
    except Exception as e:  # noqa: BLE001 - report n/a, keep benchmarking
        print(f"  flex: n/a ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''})")
        return None, 0


def compressed_keys(caches, H: int, D: int) -> tuple[dict, list[torch.Tensor], torch.Tensor]:
    """Compressed keys ``R = D / 8`` of random channels (a "channels" calibration), kept beside each layer's pool as
    the cache keeps them: (the calibration, per layer ``[NB, Hkv, BS, R]``, the projection ``[Hkv, D, R]`` on the
    device)."""
    Rk = D // 8
    g = torch.Generator().manual_seed(0)
    channels = torch.stack([torch.randperm(D, generator=g)[:Rk].sort().values for _ in range(H)])  # [H, R]
    P = torch.zeros(H, D, Rk).scatter_(1, channels.unsqueeze(1), 1.0)
    cal = {"method": "channels", "proj": dict.fromkeys(range(len(caches)), P)}
    ckeys = [c[0][:, :, :, channels.to(DEV)].diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).contiguous() for c in caches]
    assert ckeys[0].shape == (*caches[0][0].shape[:3], Rk)
    return cal, ckeys, P.to(DEV)


def layer_states(layer, caches, bt, BS, ops, ckeys, kcodes=None, pqcodes=None, fp8=None) -> list[DecodeState]:
    """One :class:`DecodeState` per layer (its own pool, metadata, compressed keys and, given ``kcodes`` /
    ``pqcodes`` / ``fp8``, low-bit / product-quantization codes / float8 keys and scales; the shared query and
    table)."""
    B, L = layer.B, layer.L

    def state(i, c):
        extra = {} if kcodes is None else {"kcodes": kcodes[i]}
        extra |= {} if pqcodes is None else {"pqcodes": pqcodes[i]}
        extra |= {} if fp8 is None else {"k8": fp8[i][0], "k8scale": fp8[i][1]}
        return DecodeState(
            q=layer.q, k_pool=c[0], kmin=c[2], kmax=c[3], kmean=c[4], block_table=bt, seq_lens=layer.seq_lens,
            start=layer.zero, lens=(L,) * B, length=L, block_size=BS, scale=layer.scale, ops=ops,
            state={"ckeys": ckeys[i], **extra}, layer=i,
        )  # fmt: skip

    return [state(i, c) for i, c in enumerate(caches)]


def probe_ops():
    """For a probe built on this module's layers: the device (``"cuda"``, else ``"cpu"``: a dry run through Triton's
    interpreter, prepared here), made this module's ``DEV``, and the Triton ops on it."""
    global DEV
    DEV = "cuda" if torch.cuda.is_available() else "cpu"
    if DEV == "cpu":
        cpu_dry_run()
    return DEV, get_ops("triton", DEV)


def paged_args(layer, caches, bt):
    """``pc(i)``: the paged arguments of layer ``i``'s attention (query, pools, table, lengths, start)."""
    return lambda i: (layer.q, caches[i][0], caches[i][1], bt, layer.seq_lens, layer.zero)


def selector_fns(layer, caches, bt, BS, budget, ops, pc):
    """``--selectors``: per selector, selection + attention and the selection alone, one call per layer, each
    through the policy's own ``select()`` on a :class:`DecodeState` of that layer (compressed keys ``R = D / 8`` of
    random channels, kept beside the pool as the cache keeps them). Returns (fns, bytes read by design)."""
    B, H, L, D, scale = layer.B, layer.H, layer.L, layer.D, layer.scale
    lens = layer.seq_lens
    cal, ckeys, _ = compressed_keys(caches, H, D)
    Rk = ckeys[0].shape[-1]
    f = 1 / budget
    policies = {
        "quest": Quest(budget=f),
        "proj_blk": ProjectedBlockTopK(budget=f, calibration=cal),
        "proj_tok": ProjectedTokenTopK(budget=f, calibration=cal),
        "2st_c2": TwoStageBlockTopK(budget=f, candidates=2),
        "2st_c4": TwoStageBlockTopK(budget=f, candidates=4),
        "2st_c8": TwoStageBlockTopK(budget=f, candidates=8),
        "2st_tok": TwoStageTokenTopK(budget=f, candidates=4),
        "topp_c4": TopPBlockTopK(budget=f, candidates=4, p=0.9, pool="max"),
        "mass_c8": TopPBlockTopK(budget=f, candidates=8, p=1.0, pool="max"),
        "massh_c8": TopPBlockTopK(budget=f, candidates=8, p=1.0, pool="heads"),
        "quant2": QuantBlockTopK(budget=f, bits=2),
        "quant4": QuantBlockTopK(budget=f, bits=4),
        "fp8": Fp8BlockTopK(budget=f),
    }
    # product quantization: 256 random centres a piece (the timing does not depend on where they lie), as
    # name: (channels a piece, calibration settings beyond the centres; the scoring table bfloat16 by default);
    # pq16_c4: 16-channel pieces (half the codes and half the scoring kernel's table gathers)
    pq_variants = {"pq_c4": (8, {}), "pq_c4_f32": (8, {"table": "float32"}), "pq16_c4": (16, {})}
    pq_sub = {name: d for name, (d, _) in pq_variants.items()}
    centres = {d: torch.randn(H, D // d, 256, d, generator=torch.Generator().manual_seed(1)) for d in (8, 16)}
    pq_codes = {
        d: [R.pq_encode(c[0].transpose(1, 2), cd.to(DEV)).transpose(1, 2).contiguous() for c in caches]
        for d, cd in centres.items()
    }
    for name, (d, extra) in pq_variants.items():
        cal = {"method": "pq", "centres": dict.fromkeys(range(len(caches)), centres[d]), **extra}
        policies[name] = TopPBlockTopK(budget=f, candidates=4, p=1.0, pool="heads", coarse="pq", calibration=cal)
    pqcodes = pq_codes[8]  # what pq:write refreshes
    states = layer_states(layer, caches, bt, BS, ops, ckeys)
    pq_states = {d: layer_states(layer, caches, bt, BS, ops, ckeys, pqcodes=codes) for d, codes in pq_codes.items()}
    codes = {b: [R.quantize_keys(c[0], c[2], c[3], b) for c in caches] for b in (2, 4)}  # as the writes leave them
    quant_states = {b: layer_states(layer, caches, bt, BS, ops, ckeys, codes[b]) for b in (2, 4)}
    fp8 = [R.fp8_code(c[0]) for c in caches]  # as the writes leave them
    fp8_states = layer_states(layer, caches, bt, BS, ops, ckeys, fp8=fp8)

    def attend(i, sel):
        if sel.kind == "block":
            return ops.decode_blocks(*pc(i), sel.indices, sel.ex_lo, sel.ex_hi, scale)
        return ops.decode_tokens(*pc(i), sel.indices, sel.ex_lo, sel.ex_hi, scale)

    fns, need = {}, {}
    n_layers = len(caches)
    for name, policy in policies.items():
        if name.startswith("quant"):
            st = quant_states[policy.bits]
        elif name == "fp8":
            st = fp8_states
        else:
            st = pq_states[pq_sub[name]] if name in pq_sub else states
        fns[name] = [lambda i=i, p=policy, st=st: attend(i, p.select(st[i])) for i in range(n_layers)]
        fns[f"{name}:sel"] = [lambda i=i, p=policy, st=st: p.select(st[i]) for i in range(n_layers)]
        sel = policy.select(st[0])
        width = sel.counts[0] * (BS if sel.kind == "block" else 1)
        attn = kv_bytes(B, H, width, D) + (B * H * width * 4 if sel.kind == "token" else 0)
        two_stage = name.startswith(("2st", "topp", "mass", "pq"))
        score = meta_bytes(B, H, L // BS, D) if name == "quest" or two_stage else B * H * L * Rk * 2
        if name in pq_sub:  # the codes of every token (one byte a piece), then the candidates' keys below
            score = B * H * L * (D // pq_sub[name])
        if name.startswith("quant"):  # the codes of every token and the min / max of every block
            score = meta_bytes(B, H, L // BS, D) + B * H * L * D * policy.bits // 8
        if name == "fp8":  # every token's e4m3 bytes and its scale
            score = B * H * L * (D + 4)
        if two_stage:
            blocks = [sel.counts[0] if sel.kind == "block" else cdiv(sel.counts[0], BS)] * B
            cand = policy._coarse.counts(states[0], Counts.of(blocks), policy.sink, policy.window)[0]  # its width
            score += B * H * cand * BS * D * 2
        need[f"{name}:sel"], need[name] = score, score + attn
    lo = lens.long() - 1
    proj_policy = policies["proj_blk"]
    fns["proj:write"] = [
        lambda i=i: proj_policy._keys.refresh(ckeys[i], caches[i][0], bt, lo, lens, layer=i, span=1, ops=ops, states={})
        for i in range(n_layers)
    ]
    need["proj:write"] = B * H * (D + Rk) * 2
    q2 = policies["quant2"]
    fns["quant2:write"] = [
        lambda i=i: q2._refresh(codes[2][i], caches[i][0], bt, lo, lens, layer=i, span=1, ops=ops, states={})
        for i in range(n_layers)
    ]
    need["quant2:write"] = B * H * BS * (D * 2 + D * 2 // 8)  # the block's keys read, its codes written
    pq_codes = policies["pq_c4"]._coarse.codes
    fns["pq:write"] = [
        lambda i=i: pq_codes.refresh(pqcodes[i], caches[i][0], bt, lo, lens, layer=i, span=1, ops=ops, states={})
        for i in range(n_layers)
    ]
    need["pq:write"] = B * H * (D * 2 + D // 8)  # the token's key read, its codes written
    return fns, need


def run_budget(layer, model, BS, budget, paged, ops, args, hbm, dense_us, dense_t_cache, rows, long_rows, check):
    B, H, L, D, G, q, scale = layer.B, layer.H, layer.L, layer.D, layer.G, layer.q, layer.scale
    caches, bt = paged
    z, lens = layer.zero, layer.seq_lens
    Kb = max(1, L // budget // BS)
    T = Kb * BS

    def select(c):
        return ops.topk_indices(ops.block_scores(q, c[2], c[3], c[4], bt, lens, BS, "quest"), Kb)

    blocks = select(caches[0])
    tokens = R.blocks_to_tokens(blocks, BS)
    keep = R.selection_to_mask(blocks, "block", BS, L, lens, z, z, z)  # [B, Hkv, L]
    mask = keep.repeat_interleave(G, 1).unsqueeze(2)  # [B, Hq, 1, L]
    scores = [ops.block_scores(q, c[2], c[3], c[4], bt, lens, BS, "quest") for c in caches]

    def per_layer(f):
        return [lambda i=i: f(i) for i in range(layer.n)]

    def pc(i):  # the paged arguments of layer i
        return q, caches[i][0], caches[i][1], bt, lens, z

    fns = {
        "mask": per_layer(lambda i: layer.sdpa(layer.k[i], layer.v[i], mask)),
        "token": per_layer(lambda i: ops.decode_tokens(*pc(i), tokens, z, z, scale)),
        "token+sel": per_layer(
            lambda i: ops.decode_tokens(*pc(i), R.blocks_to_tokens(select(caches[i]), BS), z, z, scale)
        ),
        "block": per_layer(lambda i: ops.decode_blocks(*pc(i), blocks, z, z, scale)),
        "block+sel": per_layer(lambda i: ops.decode_blocks(*pc(i), select(caches[i]), z, z, scale)),
        "sel": per_layer(lambda i: select(caches[i])),
        "scores": per_layer(lambda i: ops.block_scores(q, *caches[i][2:], bt, lens, BS, "quest")),
        "topk": per_layer(lambda i: ops.topk_indices(scores[i], Kb)),
        "topk_torch": per_layer(lambda i: R.topk_indices(scores[i], Kb)),
    }
    for name in args.skip:
        fns.pop(name, None)
    flex_bytes = 0
    if f"{B}:{L}:{budget}" in args.flex_at and BS == min(args.block_sizes_of(model, B, L)):
        ffns, flex_bytes = flex_fns(layer, keep)
        if ffns is not None:
            fns["flex"] = ffns

    if check:  # every provider against the float32 reference on the same selection (layer 0)
        ref = R.decode_blocks(*pc(0), blocks, z, z, scale).float()
        errs = {n: rel_err(fns[n][0]().reshape(ref.shape), ref) for n in ("mask", "token", "block", "flex") if n in fns}
        errs["scores"] = rel_err(scores[0], R.block_scores(q, *caches[0][2:], bt, lens, BS, "quest"))
        errs["topk!=torch"] = (ops.topk_indices(scores[0], Kb) != R.topk_indices(scores[0], Kb)).float().mean().item()
        full = torch.ones(B, H, L, dtype=torch.bool, device=DEV)
        dense_ref = R.decode_masked(*pc(0)[:4], lens, full, scale)
        errs["dense"] = rel_err(layer.sdpa(layer.k[0], layer.v[0]).reshape(ref.shape), dense_ref)
        bad = {n: e for n, e in errs.items() if not e < 2e-2}
        print(f"  check {model} B={B} L={L} BS={BS} 1/{budget}: " + " ".join(f"{n}={e:.1e}" for n, e in errs.items()))
        if bad:
            print(f"  CHECK FAILED: {bad}")

    if T not in dense_t_cache:
        kv_t = [(k[:, :, :T].contiguous(), v[:, :, :T].contiguous()) for k, v in zip(layer.k, layer.v)]
        dense_t_cache[T] = bench([lambda kv=kv: layer.sdpa(*kv) for kv in kv_t], rep=args.rep)[0]
        del kv_t
    meta = meta_bytes(B, H, L // BS, D)
    need = {
        "mask": kv_bytes(B, H, L, D),
        "flex": flex_bytes,
        "token": kv_bytes(B, H, T, D) + B * H * T * 4,
        "block": kv_bytes(B, H, T, D),
        "sel": meta,
        "scores": meta,
        "topk": 0,
        "topk_torch": 0,
    }
    need["token+sel"], need["block+sel"] = need["token"] + meta, need["block"] + meta
    if args.selectors:
        sfns, sneed = selector_fns(layer, caches, bt, BS, budget, ops, pc)
        fns.update(sfns)
        need.update(sneed)
    key = {"model": model, "B": B, "L": L, "BS": BS, "budget": f"1/{budget}", "K": Kb, "T": T}
    row = {**key, "dense": dense_us}
    for name, fn in fns.items():
        us, mode = bench(fn, rep=args.rep)
        row[name] = us
        gbps = need[name] / (us * 1e-6) / 1e9 if need[name] else None
        long_rows.append(
            {**key, "provider": name, "us": round(us, 2), "kv_bytes": need[name], "GBps": round(gbps, 1) if gbps else "",
             "frac_hbm": round(gbps / hbm, 3) if gbps else "", "speedup_vs_dense": round(dense_us / us, 2), "timing": mode}
        )  # fmt: skip
    row["dense_T"] = dense_t_cache[T]
    add_derived(row, need["block"], hbm)
    long_rows.append(
        {**key, "provider": "dense_T", "us": round(row["dense_T"], 2), "kv_bytes": kv_bytes(B, H, T, D),
         "speedup_vs_dense": round(dense_us / row["dense_T"], 2), "timing": mode}
    )  # fmt: skip
    rows.append(row)
    print(
        f"  {model} B={B} L={L // KI}K BS={BS} 1/{budget}: dense {dense_us:.1f} | block {row['block']:.1f} "
        f"({row['blk %HBM']:.0f}% HBM) | block+sel {row['block+sel']:.1f} | token {row['token']:.1f} | "
        f"sel {row['sel']:.1f} (topk {row.get('topk', float('nan')):.1f}) | dense_T {row['dense_T']:.1f}",
        flush=True,
    )


def at_target_shapes(ops, args):
    """The targets' shapes (``TUNE_AT``) at block sizes 16 and 64, one at a time: a namespace with the model, B, L,
    budget, BS, the ``Layer``, its paged caches and block table, Kb, and ``args_of`` (``decode_blocks_fwd``'s
    arguments per layer over Quest's selection). The memory is freed after each."""
    for model, B, L, budget in TUNE_AT:
        layer = Layer(model, B, L, args.layers)
        for BS in (16, 64):
            caches, bt = layer.paged(BS)
            Kb = L // budget // BS
            lens, z = layer.seq_lens, layer.zero
            blocks = ops.topk_indices(ops.block_scores(layer.q, *caches[0][2:], bt, lens, BS, "quest"), Kb)
            args_of = [(layer.q, c[0], c[1], bt, lens, z, blocks, z, z, layer.scale) for c in caches]
            yield SimpleNamespace(
                model=model, B=B, L=L, budget=budget, BS=BS, layer=layer, caches=caches, bt=bt, Kb=Kb, args_of=args_of
            )
            del caches, blocks, args_of
        del layer
        torch.cuda.empty_cache()


def tune(ops, args, hbm):
    """Sweep the knobs of decode_blocks and block_scores at the targets' shapes; prints the tables, returns nothing."""
    from hf_sparse_kv.ops.triton.block_decode import default_block_n, default_num_splits
    from hf_sparse_kv.ops.triton.block_scores import default_block_m

    out, scores = [], []
    for t in at_target_shapes(ops, args):
        layer, B, L, BS = t.layer, t.B, t.L, t.BS
        key = {"model": t.model, "B": B, "L": L, "BS": BS}
        nbytes = kv_bytes(B, layer.H, t.Kb * BS, layer.D)
        for bn, nw, ns in itertools.product((64, 128), (4, 8), (2, 3, 4)):
            base = default_num_splits(B * layer.H, cdiv(t.Kb * BS, bn), layer.q.device)
            for f in (0.5, 1, 1.5, 2):
                S = max(1, int(base * f))
                try:
                    kw = {"block_n": bn, "num_splits": S, "num_warps": nw, "num_stages": ns}
                    us, _ = bench([functools.partial(decode_blocks_fwd, *a, **kw) for a in t.args_of], rep=20)
                except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory)
                    print(f"  tune {bn}/{nw}/{ns}: {type(e).__name__}")
                    break
                out.append({**key, "budget": f"1/{t.budget}", "block_n": bn, "warps": nw, "stages": ns, "splits": S,
                            "us": us, "pct_hbm": 100 * nbytes / (us * 1e-6) / 1e9 / hbm,
                            "default": bn == default_block_n(layer.D, 2) and nw == 4 and ns == 2 and f == 1})  # fmt: skip
        meta = meta_bytes(B, layer.H, L // BS, layer.D)
        lens = layer.seq_lens
        for bm, nw in itertools.product((16, 32, 64, 128), (2, 4, 8)):
            kw = {"block_m": bm, "num_warps": nw}
            fns = [
                functools.partial(ops.block_scores, layer.q, *c[2:], t.bt, lens, BS, "quest", **kw) for c in t.caches
            ]
            us, _ = bench(fns, rep=20)
            scores.append({**key, "block_m": bm, "warps": nw, "us": us,
                           "pct_hbm": 100 * meta / (us * 1e-6) / 1e9 / hbm,
                           "default": bm == default_block_m(L // BS) and nw == 4})  # fmt: skip

    def best_of(rows, cols, title):
        best = []
        for _, grp in itertools.groupby(rows, key=lambda r: (r["model"], r["B"], r["L"], r["BS"])):
            grp = sorted(grp, key=lambda r: r["us"])
            best += grp[:3] + [r for r in grp if r["default"]]
        print_table(best, cols, title)

    best_of(out, ["model", "B", "L", "BS", "budget", "block_n", "warps", "stages", "splits", "us", "pct_hbm", "default"],
            "decode_blocks knobs: the 3 fastest and the default per shape")  # fmt: skip
    best_of(scores, ["model", "B", "L", "BS", "block_m", "warps", "us", "pct_hbm", "default"],
            "block_scores knobs: the 3 fastest and the default per shape")  # fmt: skip
    folder = os.path.dirname(os.path.abspath(args.out))
    write_csv(os.path.join(folder, "bench_decode_tune.csv"), out)
    write_csv(os.path.join(folder, "bench_decode_tune_scores.csv"), scores)


QUEST_KNOBS = {"block_m": (16, 32, 64), "num_warps": (4, 8), "tiles_per_program": (1, 2, 4, 8), "num_stages": (1, 2, 3)}


def tune_quest(ops, args, hbm) -> None:
    """``--tune-quest``: Quest's scoring kernel (``block_scores``, with the forced blocks as the policy calls it) at
    every point of :data:`QUEST_KNOBS`, at the targets' shapes: each point checked against the default's scores
    (the same ``+-inf`` pattern, relative error) and timed over the 4 layers' metadata; prints the 5 fastest and the
    default per shape, writes ``bench_decode_tune_quest.csv``."""
    rows = []
    for t in at_target_shapes(ops, args):
        layer, B, L, BS = t.layer, t.B, t.L, t.BS
        key = {"model": t.model, "B": B, "L": L, "BS": BS}
        meta = meta_bytes(B, layer.H, L // BS, layer.D)
        tail = (t.bt, layer.seq_lens, BS, "quest", torch.zeros_like(layer.seq_lens), 4, 32)
        want = ops.block_scores(layer.q, *t.caches[0][2:], *tail)
        for knobs in itertools.product(*QUEST_KNOBS.values()):
            kw = dict(zip(QUEST_KNOBS, knobs))
            fns = [functools.partial(ops.block_scores, layer.q, *c[2:], *tail, **kw) for c in t.caches]
            try:
                err = scores_err(fns[0](), want)
                us, _ = bench(fns, rep=20)
            except Exception as e:  # noqa: BLE001 - a point that does not compile (registers, shared memory)
                print(f"  tune-quest {kw}: {type(e).__name__}")
                continue
            default = kw == {"block_m": 32, "num_warps": 4, "tiles_per_program": 1, "num_stages": 1}
            rows.append({**key, **kw, "us": us, "pct_hbm": 100 * meta / (us * 1e-6) / 1e9 / hbm, "err": err,
                         "default": default})  # fmt: skip
    best = []
    for _, grp in itertools.groupby(rows, key=lambda r: (r["model"], r["B"], r["L"], r["BS"])):
        grp = sorted(grp, key=lambda r: r["us"])
        best += grp[:5] + [r for r in grp if r["default"]]
    cols = ["model", "B", "L", "BS", *QUEST_KNOBS, "us", "pct_hbm", "err", "default"]
    print_table(best, cols, "Quest's block_scores knobs: the 5 fastest and the default per shape")
    write_csv(os.path.join(os.path.dirname(os.path.abspath(args.out)), "bench_decode_tune_quest.csv"), rows)


def scores_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMSE of scores over the reference's finite entries; ``inf`` where the ``+-inf`` entries differ."""
    same = torch.equal(out.isposinf(), ref.isposinf()) and torch.equal(out.isneginf(), ref.isneginf())
    fin = ref.isfinite()
    return rel_err(out[fin], ref[fin]) if same and fin.any() else float("inf")


def tuned_ops(ops, proj_kw: dict, cand_kw: dict) -> SimpleNamespace:
    """``ops`` with the scoring ops' knobs bound (the namespace the policies call through ``DecodeState.ops``)."""
    return SimpleNamespace(
        **{**vars(ops), "projected_scores": functools.partial(ops.projected_scores, **proj_kw),
           "candidate_scores": functools.partial(ops.candidate_scores, **cand_kw)}
    )  # fmt: skip


def selector_check_inputs(layer, caches, bt, ckeys, cands):
    """Fresh random inputs at the layer's shape for the kernels' check: a new query, compressed keys and key pool,
    lengths that are not multiples of the block size, a left-padded first sequence, an evicted block, candidate sets
    with padding slots. Returns a namespace (``proj_args``, ``cand_args`` per candidate count)."""
    B, L = layer.B, layer.L
    g = torch.Generator(device=DEV).manual_seed(1)
    q = torch.randn(layer.q.shape, generator=g, device=DEV).to(torch.bfloat16)
    ck = torch.randn(ckeys[0].shape, generator=g, device=DEV).to(torch.bfloat16)
    pool = torch.randn(caches[0][0].shape, generator=g, device=DEV).to(torch.bfloat16)
    table = bt.clone()
    table[:, 1] = -1
    lens = torch.tensor([L - 5 - 11 * (b % 2) for b in range(B)], dtype=torch.int32, device=DEV)
    start = torch.tensor([3] + [0] * (B - 1), dtype=torch.int32, device=DEV)
    padded = {
        c: torch.where(torch.rand(cand.shape, generator=g, device=DEV) < 0.1, -1, cand) for c, cand in cands.items()
    }
    return SimpleNamespace(
        proj_args=(q, ck, table, lens, start),
        cand_args={c: (q, pool, table, lens, start, p) for c, p in padded.items()},
    )


PROJ_KNOBS = {"block_m": (16, 32, 64, 128), "num_warps": (4, 8), "tiles_per_program": (1, 2, 4)}
CAND_KNOBS = {"block_c": (4, 8, 16), "num_warps": (4, 8), "walk": ((1, 2), (2, 2), (4, 2), (4, 3))}  # (tiles, stages)


def tune_selectors(ops, args, hbm) -> None:
    """``--tune-selectors``: at 1 x 128K and 8 x 32K (Llama-3-8B layer, bf16, BS 16, budget 1/16), check the two
    scoring kernels of the issue-13 selectors against the float32 reference on fresh random inputs (every config),
    sweep their knobs (us and GB/s per config against the HBM probe), then time the selectors through their own
    ``select()`` with each shape's best configs. Prints the tables (a short summary last), writes two CSVs beside
    ``--out``."""
    from hf_sparse_kv.ops.triton.candidates import default_block_c
    from hf_sparse_kv.ops.triton.projected import default_block_m

    BS, budget, sink, window = 16, 16, 4, 32  # the policies' defaults
    # --device cpu: a dry run through the interpreter (small shapes, two configs per kernel); its bf16 x bf16 tl.dot
    # is wrong (any kernel's), so candidate_scores' check fails there
    cpu = DEV != "cuda"
    shapes = (
        [("llama3-8b", 1, 2 * KI), ("llama3-8b", 2, KI)] if cpu else [(m, B, L) for m, B, L, *_ in SELECTOR_TARGETS]
    )
    proj_grid = list(itertools.product(*PROJ_KNOBS.values()))[: 2 if cpu else None]
    cand_grid = list(itertools.product(*CAND_KNOBS.values()))[: 2 if cpu else None]
    t0 = time.monotonic()
    sweep, sel_rows, summary = [], [], []
    for model, B, L in shapes:
        layer = Layer(model, B, L, args.layers)
        caches, bt = layer.paged(BS)
        H, D, q, lens, z = layer.H, layer.D, layer.q, layer.seq_lens, layer.zero
        _, ckeys, P = compressed_keys(caches, H, D)
        Rk, MB = ckeys[0].shape[-1], bt.shape[1]
        states = layer_states(layer, caches, bt, BS, ops, ckeys)
        cands = {c: [TwoStageBlockTopK(budget=1 / budget, candidates=c).candidate_blocks(s)[1] for s in states]
                 for c in (2, 4)}  # fmt: skip
        chk = selector_check_inputs(layer, caches, bt, ckeys, {c: v[0] for c, v in cands.items()})
        proj_ref = R.projected_scores(*chk.proj_args, "block", sink, window, qproj=P)
        cand_ref = {
            c: R.candidate_scores(*a, reduce="block", sink=sink, window=window) for c, a in chk.cand_args.items()
        }
        tok_ref = R.candidate_scores(*chk.cand_args[4])  # TwoStageTokenTopK's per-token form, default knobs only
        tok_err = scores_err(ops.candidate_scores(*chk.cand_args[4]), tok_ref)
        mass_kw = {"reduce": "mass", "scale": layer.scale}  # TopPBlockTopK's mass form, default knobs only
        mass_err = scores_err(
            ops.candidate_scores(*chk.cand_args[4], **mass_kw), R.candidate_scores(*chk.cand_args[4], **mass_kw)
        )
        key = {"model": model, "B": B, "L": L, "BS": BS, "budget": f"1/{budget}"}
        print(f"  {model} B={B} L={L // KI}K: setup + references {time.monotonic() - t0:.0f} s; "
              f"candidate_scores token / mass form (default knobs) rel err {tok_err:.1e} / {mass_err:.1e}",
              flush=True)  # fmt: skip

        proj_bytes = B * H * MB * BS * Rk * 2 + B * H * MB * 4  # every compressed key once, a score per block
        for bm, nw, tpp in proj_grid:
            kw = {"block_m": bm, "num_warps": nw, "tiles_per_program": tpp}
            row = {**key, "kernel": "projected_scores", "config": f"bm={bm} w={nw} tiles={tpp}", "knobs": kw,
                   "default": (bm, nw, tpp) == (default_block_m(BS, Rk), 4, 1), "bytes": proj_bytes}  # fmt: skip
            try:
                row["err"] = scores_err(
                    ops.projected_scores(*chk.proj_args, "block", sink, window, qproj=P, **kw), proj_ref
                )
                fns = [functools.partial(ops.projected_scores, q, ck, bt, lens, z, "block", sink, window, qproj=P, **kw)
                       for ck in ckeys]  # fmt: skip
                row["us"] = bench(fns, rep=args.rep)[0]
            except Exception as e:  # noqa: BLE001 - a config that does not build (registers, shared memory)
                row["error"] = f"{type(e).__name__}: {str(e)[:80]}"
            sweep.append(row)
        print(f"  projected_scores: {len(proj_grid)} configs, {time.monotonic() - t0:.0f} s", flush=True)

        for bc, nw, (tpp, ns) in cand_grid:
            kw = {"block_c": bc, "num_warps": nw, "tiles_per_program": tpp, "num_stages": ns}
            for c, per_layer in cands.items():
                n_cand = int((per_layer[0] >= 0).sum())
                row = {**key, "kernel": f"candidate_scores c={c}", "config": f"bc={bc} w={nw} tiles={tpp} st={ns}",
                       "knobs": kw, "default": (bc, nw, tpp, ns) == (default_block_c(BS, D), 4, 1, 2),
                       "bytes": n_cand * BS * D * 2 + per_layer[0].numel() * 8}  # fmt: skip
                try:
                    got = ops.candidate_scores(*chk.cand_args[c], reduce="block", sink=sink, window=window, **kw)
                    row["err"] = scores_err(got, cand_ref[c])
                    fns = [functools.partial(ops.candidate_scores, q, cc[0], bt, lens, z, cand, reduce="block", sink=sink,
                                             window=window, **kw) for cc, cand in zip(caches, per_layer)]  # fmt: skip
                    row["us"] = bench(fns, rep=args.rep)[0]
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:80]}"
                sweep.append(row)
        print(f"  candidate_scores: {len(cand_grid)} configs x c = 2, 4, {time.monotonic() - t0:.0f} s", flush=True)

        rows = [r for r in sweep if r["L"] == L and r["B"] == B]
        for r in rows:
            if "us" in r:
                r["GBps"] = r["bytes"] / (r["us"] * 1e-6) / 1e9
                r["pct_hbm"] = 100 * r["GBps"] / hbm
        ok = [r for r in rows if r.get("err", float("inf")) < 2e-2 and "us" in r]
        bad = [f"{r['kernel']} {r['config']}: {r.get('error', r.get('err'))}" for r in rows if r not in ok]
        if bad:
            print("  CHECK FAILED or not built:\n    " + "\n    ".join(bad))
        # the fastest config that passed (for candidate_scores: over c = 2 and 4 together); the defaults if none did
        fallback = {"config": "default (no config passed)", "knobs": {}, "us": None, "pct_hbm": None}
        best_proj = min((r for r in ok if r["kernel"] == "projected_scores"), key=lambda r: r["us"], default=fallback)
        by_cfg: dict[str, list[dict]] = {}
        for r in ok:
            if r["kernel"].startswith("candidate"):
                by_cfg.setdefault(r["config"], []).append(r)
        best_cand = min(
            (g for g in by_cfg.values() if len(g) == 2), key=lambda g: sum(r["us"] for r in g), default=[fallback]
        )
        best_of = {"projected_scores": best_proj, **{r.get("kernel"): r for r in best_cand}}
        for kernel in ("projected_scores", "candidate_scores c=2", "candidate_scores c=4"):
            best = best_of.get(kernel, fallback)
            same = [r for r in rows if r["kernel"] == kernel]
            default = next((r for r in same if r["default"]), {})
            summary.append({**key, "kernel": kernel, "default us": default.get("us"),
                            "default %HBM": default.get("pct_hbm"), "best us": best["us"], "best %HBM": best["pct_hbm"],
                            "best config": best["config"], "max err": max(r.get("err", 0) for r in same)})  # fmt: skip

        tops = tuned_ops(ops, best_proj["knobs"], best_cand[0]["knobs"])
        sfns, need = selector_fns(layer, caches, bt, BS, budget, tops, paged_args(layer, caches, bt))
        row = {**key, "proj knobs": best_proj["config"], "cand knobs": best_cand[0]["config"]}
        for name, fn in sfns.items():
            row[name] = bench(fn, rep=args.rep)[0]
            row[f"{name} GB/s"] = need[name] / (row[name] * 1e-6) / 1e9
        sel_rows.append(row)
        print(f"  selectors with the best knobs: {time.monotonic() - t0:.0f} s", flush=True)
        del layer, caches, states, cands, chk, sfns
        if not cpu:
            torch.cuda.empty_cache()

    cols = ["model", "B", "L", "kernel", "config", "us", "GBps", "pct_hbm", "err", "default"]
    top = []
    for _, grp in itertools.groupby(sweep, key=lambda r: (r["B"], r["L"], r["kernel"])):
        grp = sorted(grp, key=lambda r: r.get("us", float("inf")))
        top += grp[:4] + [r for r in grp[4:] if r["default"]]
    print_table(top, cols, f"scoring kernels: the 4 fastest configs and the default per shape (HBM {hbm:.0f} GB/s)")
    names = [n for s in SELECTORS for n in (s, f"{s}:sel")] + ["proj:write", "quant2:write", "pq:write"]
    print_table(sel_rows, ["model", "B", "L", *names], "selectors with the best knobs: selection + attention (name) "
                "and selection alone (name:sel), us per layer")  # fmt: skip
    folder = os.path.dirname(os.path.abspath(args.out))
    write_csv(os.path.join(folder, "bench_decode_tune_selectors.csv"),
              [{k: v for k, v in r.items() if k != "knobs"} | {"hbm_GBps": round(hbm)} for r in sweep])  # fmt: skip
    write_csv(
        os.path.join(folder, "bench_decode_selectors_tuned.csv"), [r | {"hbm_GBps": round(hbm)} for r in sel_rows]
    )
    print(f"\nwrote {folder}/bench_decode_tune_selectors.csv and bench_decode_selectors_tuned.csv "
          f"({time.monotonic() - t0:.0f} s)")  # fmt: skip
    print_table(summary, ["B", "L", "kernel", "default us", "default %HBM", "best us", "best %HBM", "best config",
                          "max err"], "scoring kernels: default and best config per shape (err: worst over the configs)")  # fmt: skip


def budget_key(r: dict) -> tuple:
    """Sort key: model, batch, then the budget as a number (1/4 before 1/16)."""
    return r["model"], r["B"], int(r["budget"].split("/")[1])


def best_by_context(rows) -> dict[tuple, dict[int, tuple[float, float]]]:
    """Per (model, B, budget): {context: (fastest block+sel over the block sizes, dense)}."""
    out: dict[tuple, dict[int, tuple[float, float]]] = {}
    for r in sorted(rows, key=budget_key):
        by_len = out.setdefault((r["model"], r["B"], r["budget"]), {})
        by_len[r["L"]] = (min(by_len.get(r["L"], (float("inf"), 0))[0], r["block+sel"]), r["dense"])
    return out


def merge_share(ops, args, hbm):
    """At the targets' shapes: the block op, its stage 1 alone, and the merge alone (µs per layer); prints a table."""
    from hf_sparse_kv.ops.triton.merge import merge_partials_fwd

    out = []
    for t in at_target_shapes(ops, args):
        parts = [decode_blocks_fwd(*a, merge=False) for a in t.args_of]
        times = {
            "op": bench([functools.partial(decode_blocks_fwd, *a) for a in t.args_of], rep=args.rep)[0],
            "stage1": bench([functools.partial(decode_blocks_fwd, *a, merge=False) for a in t.args_of], rep=args.rep)[
                0
            ],
            "merge": bench([functools.partial(merge_partials_fwd, *p) for p in parts], rep=args.rep)[0],
        }
        nbytes = kv_bytes(t.B, t.layer.H, t.Kb * t.BS, t.layer.D)
        out.append({"model": t.model, "B": t.B, "L": t.L, "BS": t.BS, "budget": f"1/{t.budget}",
                    "splits": parts[0][1].shape[-1], **times,
                    "op %HBM": 100 * nbytes / (times["op"] * 1e-6) / 1e9 / hbm,
                    "stage1 %HBM": 100 * nbytes / (times["stage1"] * 1e-6) / 1e9 / hbm})  # fmt: skip
    cols = ["model", "B", "L", "BS", "budget", "splits", "op", "stage1", "merge", "op %HBM", "stage1 %HBM"]
    print_table(out, cols, "decode_blocks: the whole op, stage 1 alone, the merge alone (us per layer)")


def crossovers(rows):
    """Per (model, batch, budget): the context below which dense beats block+sel (best block size at each context)."""
    out = []
    for (model, B, budget), by_len in best_by_context(rows).items():
        lens = sorted(by_len)
        wins = [by_len[n][0] < by_len[n][1] for n in lens]
        if all(wins):
            where = f"<= {lens[0] // KI}K (sparse wins at every measured context)"
        elif not any(wins):
            where = f"> {lens[-1] // KI}K (dense wins at every measured context)"
        else:
            last_loss = max(i for i, w in enumerate(wins) if not w)
            where = (
                f"between {lens[last_loss] // KI}K and {lens[last_loss + 1] // KI}K"
                if last_loss + 1 < len(lens)
                else f"> {lens[-1] // KI}K"
            )
        contexts = ",".join(f"{n // KI}K" for n in lens)
        out.append({"model": model, "B": B, "budget": budget, "contexts": contexts, "crossover": where})
    return out


def speedups(rows) -> tuple[list[dict], list[str]]:
    """Per (model, batch, budget): dense / block+sel (best block size) at each context; and the context columns."""
    out, cols = [], set()
    for (model, B, budget), by_len in best_by_context(rows).items():
        row = {"model": model, "B": B, "budget": budget}
        for n, (sparse, dense) in sorted(by_len.items()):
            row[f"{n // KI}K"] = f"{dense / sparse:.2f}"
            cols.add(n)
        out.append(row)
    return out, [f"{n // KI}K" for n in sorted(cols)]


def token_vs_block(rows):
    """Per (model, batch, block size): token / block time at the same selection (median, min, max over the rows)."""
    out = []

    def key(r):
        return r["model"], r["B"], r["BS"]

    for (model, B, BS), grp in itertools.groupby(sorted(rows, key=key), key=key):
        ratios = sorted(r["token"] / r["block"] for r in grp)
        out.append({"model": model, "B": B, "BS": BS, "rows": len(ratios), "median": f"{ratios[len(ratios) // 2]:.2f}",
                    "min": f"{ratios[0]:.2f}", "max": f"{ratios[-1]:.2f}"})  # fmt: skip
    return out


def targets(rows, hbm):
    """The issue's targets, measured (Llama-3-8B layer, bf16); each line says met / not met."""

    def find(B, L, budget):
        return [
            r
            for r in rows
            if r["model"] == "llama3-8b" and r["B"] == B and r["L"] == L and r["budget"] == f"1/{budget}"
        ]

    lines = []
    for r in find(8, 32 * KI, 8):
        ok = r["blk %HBM"] >= 80
        lines.append(
            f"block alone >= 80% HBM @B8 32K 1/8 BS={r['BS']}: {r['blk %HBM']:.0f}% ({r['blk GB/s']:.0f} GB/s of {hbm:.0f}) {'MET' if ok else 'NOT MET'}"
        )
    for r in find(1, 128 * KI, 16):
        ok = r["block+sel"] <= 17 and r["x blk+sel"] >= 8
        lines.append(
            f"sel+attn <= 17us, >= 8x dense @B1 128K 1/16 BS={r['BS']}: {r['block+sel']:.1f} us, {r['x blk+sel']:.1f}x (dense {r['dense']:.1f}) {'MET' if ok else 'NOT MET'}"
        )
    for r in find(8, 32 * KI, 16):
        ok = r["x blk+sel"] >= 8
        lines.append(
            f"sel+attn >= 8x dense @B8 32K 1/16 BS={r['BS']}: {r['x blk+sel']:.1f}x ({r['block+sel']:.1f} vs {r['dense']:.1f} us) {'MET' if ok else 'NOT MET'}"
        )
    worst = max((r for r in rows if r["model"] == "llama3-8b"), key=lambda r: r["blk/dense_T"], default=None)
    if worst:
        n_ok = sum(r["blk/dense_T"] <= 1.2 for r in rows if r["model"] == "llama3-8b")
        n = sum(r["model"] == "llama3-8b" for r in rows)
        lines.append(
            f"block over T tokens <= 1.2x dense on T contiguous: {n_ok}/{n} rows; worst {worst['blk/dense_T']:.2f}x at B={worst['B']} L={worst['L'] // KI}K {worst['budget']} BS={worst['BS']}"
        )
    return lines  # fmt: skip


def summarize(rows: list[dict], hbm: float) -> None:
    """The crossover, speedup, token/block and target tables of a run."""
    print_table(crossovers(rows), ["model", "B", "budget", "contexts", "crossover"], "crossover (block+sel vs dense)")
    table, cols = speedups(rows)
    print_table(table, ["model", "B", "budget", *cols], "dense / block+sel (best block size), per context")
    print_table(
        token_vs_block(rows), ["model", "B", "BS", "rows", "median", "min", "max"], "token / block (same selection)"
    )
    print("\ntargets:\n  " + "\n  ".join(targets(rows, hbm)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the reduced grid (~3 minutes on an H200)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--batches", nargs="+", type=int, default=FULL["batches"])
    p.add_argument("--contexts", nargs="+", type=float, default=FULL["contexts"], help="in K tokens")
    p.add_argument("--budgets", nargs="+", type=int, default=FULL["budgets"], help="denominators: 16 = 1/16")
    p.add_argument("--block-sizes", nargs="+", type=int, default=FULL["block_sizes"])
    p.add_argument("--flex-at", nargs="*", default=["1:131072:16", "8:32768:16"], help="B:L:budget shapes for flex")
    p.add_argument("--skip", nargs="*", default=[], choices=SKIPPABLE, help="providers not to time (a faster grid)")
    p.add_argument("--time-limit", type=float, default=0, help="seconds: start no new shape after this (0: none)")
    p.add_argument("--rep", type=int, default=30, help="timed replays per provider")
    p.add_argument("--layers", type=int, default=4, help="layers per timed graph, each on its own cache")
    p.add_argument("--tune", action="store_true", help="also sweep the decode_blocks knobs at the targets' shapes")
    p.add_argument("--tune-quest", action="store_true",
                   help="only: check and sweep Quest's scoring kernel (block_scores) knobs at the targets' shapes "
                   "(CUDA only; ~1-2 minutes on an H200)")  # fmt: skip
    p.add_argument("--merge-share", action="store_true", help="only time stage 1 and the merge at the targets' shapes")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check against the reference")
    p.add_argument("--out", default="benchmarks/results/bench_decode.csv")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script through Triton's interpreter")
    p.add_argument("--summarize", metavar="CSV", help="print the summary tables of an earlier run's CSV and exit")
    p.add_argument("--selectors", action="store_true", help="also time the issue-13 selectors (selection + attention)")
    p.add_argument("--selector-targets", action="store_true", help="--selectors at 1 x 128K and 8 x 32K, 1/16, BS 16")
    p.add_argument("--tune-selectors", action="store_true",
                   help="only: check and sweep the selectors' scoring kernels at the targets' shapes, then time the "
                   "selectors with the best knobs (~2-3 minutes on an H200)")  # fmt: skip
    args = p.parse_args()
    if args.summarize:
        rows, hbm = rows_from_csv(args.summarize)
        summarize(rows, hbm)
        return
    global DEV
    DEV = args.device
    assert DEV == "cpu" or torch.cuda.is_available(), "this benchmark needs a CUDA device (or --device cpu)"
    if DEV == "cpu":
        cpu_dry_run()  # the interpreter and the tests' shims to it (it failed in topk under NumPy >= 2.4 without)
    torch.manual_seed(0)
    torch._dynamo.config.cache_size_limit = 64

    args.selectors = args.selectors or args.selector_targets
    if args.selector_targets:
        grid = list(SELECTOR_TARGETS)
        args.out = args.out.replace("bench_decode.csv", "bench_decode_selectors.csv")
    elif args.quick:
        grid = []
        for models, batches, contexts, budgets, bss in QUICK:
            grid += [(m, b, int(c * KI), budgets, bss) for m in models for b in batches for c in contexts]
    else:
        grid = [(m, b, int(c * KI), args.budgets, args.block_sizes) for m in args.models for b in args.batches
                for c in args.contexts if not (c > 128 and b > 1)]  # fmt: skip
    shape_bss = {(m, b, L): bss for m, b, L, _, bss in grid}
    args.block_sizes_of = lambda m, b, L: shape_bss[(m, b, L)]

    info = env_info()
    hbm = hbm_bandwidth(DEV, 2**31 if DEV == "cuda" else 2**24)
    print(f"env: {info}\nHBM probe (2 GiB device copy, read+write): {hbm:.0f} GB/s", flush=True)
    ops = get_ops("triton", DEV)
    if args.tune_selectors:
        tune_selectors(ops, args, hbm)
        return
    if args.tune:
        tune(ops, args, hbm)
    if args.tune_quest:
        if DEV != "cuda":
            raise SystemExit("--tune-quest times the kernel's knobs at the targets' shapes: it needs a CUDA device")
        tune_quest(ops, args, hbm)
        return
    if args.merge_share:
        merge_share(ops, args, hbm)
        return

    rows, long_rows, checked = [], [], set()
    t0 = time.monotonic()
    for i_shape, (model, B, L, budgets, bss) in enumerate(grid):
        if args.time_limit and time.monotonic() - t0 > args.time_limit:
            print(f"time limit: stopped after {i_shape} of {len(grid)} shapes (the tables cover those)", flush=True)
            break
        layer = Layer(model, B, L, args.layers)
        dense_us, mode = bench([lambda k=k, v=v, lay=layer: lay.sdpa(k, v) for k, v in zip(layer.k, layer.v)], args.rep)
        nbytes = kv_bytes(B, layer.H, L, layer.D)
        long_rows.append({"model": model, "B": B, "L": L, "provider": "dense", "us": round(dense_us, 2), "kv_bytes": nbytes,
                          "GBps": round(nbytes / (dense_us * 1e-6) / 1e9, 1), "timing": mode})  # fmt: skip
        dense_t_cache: dict[int, float] = {}
        for BS in bss:
            paged = layer.paged(BS)
            for budget in budgets:
                check = not args.no_check and (model, BS) not in checked
                checked.add((model, BS))
                run_budget(
                    layer, model, BS, budget, paged, ops, args, hbm, dense_us, dense_t_cache, rows, long_rows, check
                )
            del paged
        del layer
        torch.cuda.empty_cache()
        write_csv(args.out, [{**r, "hbm_GBps": round(hbm, 0), **info} for r in long_rows])  # so far

    print(f"\nwrote {args.out} ({len(long_rows)} rows)")
    summarize(rows, hbm)
    cols = ["model", "B", "L", "BS", "budget", "dense", "mask", "flex", "token", "token+sel", "block",
            "block+sel", "sel", "topk", "topk_torch", "blk %HBM", "x blk+sel", "x block", "dense_T", "blk/dense_T"]  # fmt: skip
    print_table(
        [{**r, "L": f"{r['L'] // KI}K"} for r in rows],
        cols,
        f"decode, bf16, us per layer (median of {args.rep} graph replays of {args.layers} layers); HBM {hbm:.0f} GB/s",
    )
    if args.selectors:
        names = [n for s in SELECTORS for n in (s, f"{s}:sel")] + ["proj:write", "quant2:write", "pq:write"]
        print_table(
            [{**r, "L": f"{r['L'] // KI}K"} for r in rows],
            ["model", "B", "L", "BS", "budget", "dense", "block+sel", *names],
            "selectors: selection + attention (name) and selection alone (name:sel), us per layer",
        )


if __name__ == "__main__":
    main()
