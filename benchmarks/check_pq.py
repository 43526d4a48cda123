"""The product-quantized keys' scoring kernel against the float32 reference on fresh random inputs at the
Llama-3-8B layer's shape (8 KV heads, 4 query heads each, head dim 128, block size 16; 8-channel pieces, 256 centres:
one byte per 8 channels of a key), then every knob of ``pq_block_lse`` checked and timed.

    python benchmarks/check_pq.py                 # a CUDA device
    TRITON_INTERPRET=1 python benchmarks/check_pq.py --device cpu --smoke     # a dry run on the CPU

At 1 x 128K (8200 blocks) and 8 x 32K (2048 blocks each): each point of :data:`GRID` (layout, blocks a program,
warps) is checked (``pq_block_scores`` at those knobs against ``reference.pq_block_scores`` in
float32: relative error of the mass, the reference's top-1/16 blocks shared, the same ``+-inf`` pattern) and timed
(``common.bench``: CUDA graph, L2 flushed, median): the kernel alone (``us``, the table made beforehand) and the whole
scoring (``scores_us``: the table, the kernel, the tail). Then, at the same shapes: the table alone, one
decode token's codes written (``pq_write``, the reference ops), Quest's scores and Quest's scores + top-k at 1/16,
the PQ scores + top-k of the c = 4 candidates (4/16), one layer's centres fitted at a prefill
(``calibration="prefill"``: ``ProductCodes.fit`` on the layer's stored keys, timed eagerly) with the reference's and
with the kernel's assignment, and ``pq_encode``'s kernel at a few tiles on one k-means round's keys (codes equal to the
reference's: ``shared``). ``floor``: time over
the codes' bytes at the copy bandwidth measured in the run. The CSV goes to ``--out``, else ``$OUT/pq_sweep.csv``
when ``OUT`` is set, else ``benchmarks/results/pq_sweep.csv``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from check_quant_keys import compare, layer_inputs
from common import bench, cpu_dry_run, env_info, hbm_bandwidth, print_table, write_csv

from hf_sparse_kv.ops import get_ops
from hf_sparse_kv.ops import reference as R
from hf_sparse_kv.policies.product import ProductCodes

# (blocks a program, warps); the layouts before (one load a (token, piece, head), or a loop over the pieces) were
# slower at every point (2026-12-04) and are removed
GRID = tuple((tpp, w) for tpp in (1, 2, 4, 8, 16) for w in (1, 2, 4, 8))
SMOKE_GRID = ((2, 4), (4, 1))
SHAPES = ((1, 8200), (8, 2048))  # (sequences, blocks each): 1 x 128K and 8 x 32K at block size 16
SMOKE_SHAPES = ((1, 12), (2, 5))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 2 points, 2 KV heads (a dry run)")
    ap.add_argument("--out", help="the CSV (default: $OUT/pq_sweep.csv when OUT is set, else benchmarks/results/)")
    a = ap.parse_args()
    dev = a.device
    if torch.device(dev).type == "cpu":
        cpu_dry_run()
    rows = sweep(dev, 2 if a.smoke else 8, 4, 128, 16, a.smoke)
    folder = tempfile.gettempdir() if a.smoke else "benchmarks/results"
    out = a.out or os.path.join(os.environ.get("OUT") or folder, "pq_sweep.csv")
    write_csv(out, rows)
    shown = [
        {**r, **{k: r.get(k) and f"{r[k]:.{n}}" for k, n in (("rel_err", "1e"), ("shared", "4f"), ("floor", "2f"))}}
        for r in rows
    ]
    cols = ["shape", "what", "us", "GB/s", "floor", "rel_err", "shared", "inf_ok", "scores_us"]
    print_table(shown, cols, title=f"pq scoring ({env_info()})")
    print(f"wrote {out}")


def sweep(dev, H, G, D, BS, smoke: bool = False, M: int = 16, C: int = 256) -> list[dict]:
    """Every point of :data:`GRID` checked and timed, then the table, the write and the selections beside Quest's."""
    ops = get_ops("triton", dev)
    cuda = torch.device(dev).type == "cuda"
    hbm = hbm_bandwidth(dev) if cuda else None
    print(f"copy bandwidth {hbm and round(hbm)} GB/s", flush=True)
    torch.manual_seed(0)
    rows = []
    for B, MB in SMOKE_SHAPES if smoke else SHAPES:
        rows += one_shape(dev, ops, hbm, B, MB, H, G, D, BS, smoke, M, C)
        if cuda:
            torch.cuda.empty_cache()
    return rows


def one_shape(dev, ops, hbm, B, MB, H, G, D, BS, smoke, M, C) -> list[dict]:
    """The grid checked and timed at ``B`` sequences of ``MB`` blocks, then the other rows (:func:`sweep`)."""
    from hf_sparse_kv.ops.triton.product import (
        pq_block_lse,
        pq_block_scores,
        pq_encode,
        pq_group_table,
        pq_group_table_lse,
    )
    from hf_sparse_kv.ops.triton.quant import quant_lse_mass

    rows = []
    k_pool, table, lens, zero, q, scale, shape = layer_inputs(dev, B, MB, H, G, D, BS)
    centres = torch.randn(H, M, C, D // M, device=dev)
    codes = R.pq_encode(k_pool.transpose(1, 2), centres).transpose(1, 2).contiguous()  # [NB, H, BS, M] uint8
    args = (q, codes, centres, table, lens, zero, scale)
    ref = R.pq_block_scores(q.float(), codes, centres, table, lens, zero, scale)
    nbytes = codes.numel()
    k16 = max(1, MB // 16)
    tab = pq_group_table(q, centres, scale)  # the kernel's input, made once
    for tpp, warps in SMOKE_GRID if smoke else GRID:
        lse_fn = functools.partial(pq_block_lse, *args, tpp=tpp, num_warps=warps)
        out = quant_lse_mass(lse_fn(), table, lens, zero, BS, H, 0, None)
        rel, same, inf_ok = compare(out, ref, k16)
        us, mode = bench(functools.partial(pq_group_table_lse, tab, codes, table, lens, zero, G, tpp, warps), rep=20)
        whole, _ = bench(lambda f=lse_fn: quant_lse_mass(f(), table, lens, zero, BS, H, 0, None), rep=20)
        what = f"lse tpp={tpp} w={warps}"
        rows.append({"shape": shape, "what": what, "tpp": tpp, "num_warps": warps, "us": us,
                     "timing": mode, "rel_err": rel, "shared": same, "inf_ok": inf_ok, "GB/s": nbytes / us / 1e3,
                     "floor": us / (nbytes / hbm / 1e3) if hbm else None, "scores_us": whole})  # fmt: skip
        print(f"{shape} {what}: {us:.1f} us (scores {whole:.1f}), rel err {rel:.1e}, shared {same:.4f}, "
              f"inf pattern equal {inf_ok}", flush=True)  # fmt: skip
    lo = (lens - 1).long()
    k_new = k_pool.clone()
    kmin, kmax = k_pool.amin(2), k_pool.amax(2)
    quest = functools.partial(ops.block_scores, q, kmin, kmax, kmin, table, lens, BS, "quest", zero, 4, 32)
    extra = {
        "table": lambda: pq_group_table(q, centres, scale),
        "pq_block_scores (default)": lambda: pq_block_scores(*args),
        "pq_write, one token (reference)": lambda: R.pq_write(codes, k_new, centres, table, lo, lo + 1, 1),
        "quest scores": quest,
        "quest scores + top-k 1/16": lambda: ops.topk_indices(quest(), k16),
        "pq scores + top-k 4/16": lambda: ops.topk_indices(pq_block_scores(*args, sink=4, window=32), 4 * k16),
    }
    extra["pq_write, one token (Triton)"] = lambda: ops.pq_write(codes, k_new, centres, table, lo, lo + 1, 1)
    # the smoke run fits 16 centres on 40 keys: the interpreter runs each (tokens, head, piece) program in NumPy
    fitter = ProductCodes({"method": "pq", "fit": "prefill", "sub_dim": D // M, "centroids": 16 if smoke else C}, "")
    stored = k_pool.transpose(0, 1).reshape(H, -1, D)  # [H, NB * BS, D]: every slot, as a prefill would store
    stored = stored[:, :40] if smoke else stored
    extra["prefill fit, one layer (reference codes)"] = lambda: fitter.fit(0, stored, R.pq_encode)
    if not smoke:  # 8 rounds of ~100 interpreted programs each take ~4 s on the CPU
        extra["prefill fit, one layer (Triton codes)"] = lambda: fitter.fit(0, stored, ops.pq_encode)
    sample = stored[:, : min(stored.shape[1], 16384)].transpose(0, 1)  # [N, H, D]: one k-means round's keys
    sample = sample[:24] if smoke else sample
    want = R.pq_encode(sample, centres)
    for bn, warps in ((16, 1),) if smoke else ((32, 2), (64, 2), (64, 4), (128, 4), (128, 8)):
        enc = functools.partial(pq_encode, sample, centres, bn, warps)
        us, mode = bench(enc, rep=20)
        rows.append({"shape": shape, "what": f"pq_encode {sample.shape[0]} keys bn={bn} w={warps}", "us": us,
                     "timing": mode, "shared": (enc() == want).float().mean().item()})  # fmt: skip
        print(f"{shape} pq_encode bn={bn} w={warps}: {us:.1f} us, codes equal {rows[-1]['shared']:.5f}", flush=True)
    for what, fn in extra.items():
        us, mode = bench(fn, rep=5 if "fit" in what else 20, graph="fit" not in what)
        moved = {"pq_block_scores (default)": nbytes, "quest scores": 2 * kmin.numel() * kmin.element_size()}.get(what)
        rows.append({"shape": shape, "what": what, "us": us, "timing": mode,
                     "GB/s": moved / us / 1e3 if moved else None,
                     "floor": us / (moved / hbm / 1e3) if moved and hbm else None})  # fmt: skip
        print(f"{shape} {what}: {us:.1f} us", flush=True)
    return rows


if __name__ == "__main__":
    main()
