"""Issue 13: does a low-bit key with one step per token score faster than ``QuantBlockTopK``'s per-channel grid?

``QuantBlockTopK(bits=4)``'s scoring kernel runs far from its bytes (~100 us at 1 x 128K for ~23 us of codes and
min / max, benchmarks/RESULTS.md): each block's per-channel steps need their own scaled query. With one step per
token (``reference.token_quantize_keys``: the block's channel minima as zero points, a token's largest offset as its
top level) the query is one operand for hundreds of tokens (``ops/triton/token_quant.py``). This probe, at the
Llama-3-8B layer's shape (8 KV heads, 4 query heads each, head dim 128, block size 16; 1 x 128K and 8 x 32K):

1. checks ``token_quant_block_lse`` against the float32 reference on fresh random bf16 keys (relative error, the
   same ``-inf`` pattern, the top-1/16 blocks of the mass shared, no NaN), at every knob point;
2. times (``common.bench``: CUDA graph, L2 flushed, median) each knob point of the scoring kernel, then at the best
   point the whole scoring (kernel + ``quant_lse_mass``'s two-launch tail, forced blocks) and the selection (+ the
   top-k of 1/16) and the kernel on codes and steps kept in one 68-byte row per token (a single cache state), beside ``QuantBlockTopK``'s default kernel, scoring and selection and Quest's selection, each
   with its bytes' floor at the copy bandwidth measured in the same run.

    python benchmarks/probe_token_quant.py --out $OUT/probe_token_quant.csv
    TRITON_INTERPRET=1 python benchmarks/probe_token_quant.py --device cpu --smoke     # a dry run
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from check_quant_keys import SINK, WINDOW, compare, layer_inputs
from common import bench, cpu_dry_run, env_info, hbm_bandwidth, print_table, write_csv

from hf_sparse_kv.ops import get_ops
from hf_sparse_kv.ops import reference as R

SHAPES = ((1, 8200), (8, 2048))  # (sequences, blocks each) at block size 16: 1 x 128K and 8 x 32K
SMOKE_SHAPES = ((1, 40), (2, 20))
KNOBS = {"block_m": (16, 32), "tiles_per_program": (1, 2, 4), "num_stages": (1, 2), "num_warps": (4, 8)}
SMOKE_KNOBS = {"block_m": (16,), "tiles_per_program": (1, 2), "num_stages": (1,), "num_warps": (4,)}


def knob_points(smoke: bool) -> list[dict]:
    grid = SMOKE_KNOBS if smoke else KNOBS
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def probe(dev: str, bits: int, smoke: bool) -> list[dict]:
    """The rows of the module docstring for one code width."""
    hbm = hbm_bandwidth(dev) if torch.device(dev).type == "cuda" else None
    print(f"copy bandwidth {hbm and round(hbm)} GB/s", flush=True)
    return [r for B, MB in (SMOKE_SHAPES if smoke else SHAPES) for r in probe_shape(dev, hbm, bits, B, MB, smoke)]


def probe_shape(dev: str, hbm: float | None, bits: int, B: int, MB: int, smoke: bool) -> list[dict]:
    """:func:`probe`'s rows at ``B`` sequences of ``MB`` blocks."""
    from hf_sparse_kv.ops.triton.quant import quant_block_lse, quant_lse_mass
    from hf_sparse_kv.ops.triton.token_quant import token_quant_block_lse

    ops = get_ops("triton", dev)
    H, G, D, BS = (2 if smoke else 8), 4, 128, 16
    rows = []
    k_pool, table, lens, zero, q, scale, shape = layer_inputs(dev, B, MB, H, G, D, BS)
    kmin, kmax = k_pool.amin(2), k_pool.amax(2)
    kmean = k_pool.float().mean(2).to(torch.bfloat16)
    codes_t, steps = R.token_quantize_keys(k_pool, kmin, bits)
    codes_c = R.quantize_keys(k_pool, kmin, kmax, bits)
    k = max(1, MB // 16)
    t_args = (q, codes_t, steps, kmin, table, lens, zero, scale, bits)
    c_args = (q, codes_c, kmin, kmax, table, lens, zero, scale, bits)
    ref_lse = R.token_quant_block_lse(*t_args)
    ref_mass = R.lse_block_mass(ref_lse, table, lens, zero, BS, H, SINK, WINDOW)
    t_bytes = codes_t.numel() + steps.numel() * steps.element_size() + kmin.numel() * kmin.element_size()
    c_bytes = codes_c.numel() + 2 * kmin.numel() * kmin.element_size()
    q_bytes = 2 * kmin.numel() * kmin.element_size()
    base = {"bits": bits, "shape": shape}

    def floor(us: float, nbytes: int) -> float | None:
        return us / (nbytes / hbm / 1e3) if hbm else None

    best = None
    for kw in knob_points(smoke):
        lse = token_quant_block_lse(*t_args, **kw)
        bad = int(lse.isnan().sum())
        rel, _, inf_ok = compare(lse, ref_lse, k)
        mass = quant_lse_mass(lse, table, lens, zero, BS, H, SINK, WINDOW)
        _, same, _ = compare(mass, ref_mass, k)
        us, mode = bench(functools.partial(token_quant_block_lse, *t_args, **kw), rep=20)
        ok = bad == 0 and inf_ok and same >= 0.99
        row = {**base, "what": "token lse " + " ".join(f"{a}={b}" for a, b in kw.items()), **kw, "us": us,
               "timing": mode, "floor": floor(us, t_bytes), "rel_err": rel, "shared": same, "nan": bad,
               "inf_ok": inf_ok, "ok": ok}  # fmt: skip
        rows.append(row)
        print(f"{shape} {bits} bits {row['what']}: {us:.1f} us, rel {rel:.1e}, shared {same:.4f}, ok {ok}", flush=True)
        if ok and (best is None or us < best[1]):
            best = (kw, us)
    if best is None:
        print(f"{shape} {bits} bits: no knob point right; nothing more timed", flush=True)
        return rows
    kw = best[0]

    joined_codes, joined_steps = R.split_token_rows(R.token_rows(codes_t, steps))
    j_args = (q, joined_codes, joined_steps, *t_args[3:])
    lse = token_quant_block_lse(*j_args, **kw)
    rel, _, inf_ok = compare(lse, ref_lse, k)
    us, mode = bench(functools.partial(token_quant_block_lse, *j_args, **kw), rep=20)
    rows.append({**base, "what": "joined: token lse on codes + step in one 68-byte row (best knobs)", **kw, "us": us,
                 "timing": mode, "floor": floor(us, t_bytes), "rel_err": rel, "inf_ok": inf_ok})  # fmt: skip
    print(f"{shape} {bits} bits joined rows: {us:.1f} us, rel {rel:.1e}, inf pattern {inf_ok}", flush=True)

    def t_scores(kw=kw):
        lse = token_quant_block_lse(*t_args, **kw)
        return quant_lse_mass(lse, table, lens, zero, BS, H, SINK, WINDOW)

    thunks = {
        ("token scores (best lse + tail)", t_bytes): t_scores,
        ("token selection (scores + top-k)", t_bytes): lambda: ops.topk_indices(t_scores(), k),
        (f"quant{bits} lse (default)", c_bytes): functools.partial(quant_block_lse, *c_args),
        (f"quant{bits} scores (default)", c_bytes): lambda: ops.quant_block_scores(*c_args, SINK, WINDOW),
        (f"quant{bits} selection", c_bytes): lambda: ops.topk_indices(ops.quant_block_scores(*c_args, SINK, WINDOW), k),
        ("quest selection", q_bytes): lambda: ops.topk_indices(
            ops.block_scores(q, kmin, kmax, kmean, table, lens, BS, "quest", zero, SINK, WINDOW), k
        ),
    }
    for (what, nbytes), fn in thunks.items():
        us, mode = bench(fn, rep=20)
        rows.append({**base, "what": what, "us": us, "timing": mode, "floor": floor(us, nbytes)})
        print(f"{shape} {bits} bits {what}: {us:.1f} us", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--bits", type=int, nargs="+", default=[4])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and two knob points (a dry run)")
    ap.add_argument("--out", default=None, help="CSV (default $OUT/probe_token_quant.csv, else the temp folder)")
    a = ap.parse_args()
    if torch.device(a.device).type == "cpu":
        cpu_dry_run()
    torch.manual_seed(0)
    rows = [r for bits in a.bits for r in probe(a.device, bits, a.smoke)]
    import tempfile

    out = a.out or os.path.join(os.environ.get("OUT") or tempfile.gettempdir(), "probe_token_quant.csv")
    write_csv(out, rows)
    shown = [{**r, "floor": r.get("floor") and f"{r['floor']:.2f}", "shared": r.get("shared") and
              f"{r['shared']:.4f}"} for r in rows if not r["what"].startswith("token lse") or r.get("ok")]  # fmt: skip
    print_table(shown, ["bits", "shape", "what", "us", "floor", "shared"], title=f"token-step keys ({env_info()})")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
