"""The low-bit-key kernels against the float32 reference on fresh random bf16 inputs at the Llama-3-8B layer's shape
(8 KV heads, 4 query heads each, head dim 128, block size 16): ``quant_write`` (codes equal, or off by one step where
a value sits on a rounding boundary) and ``quant_block_scores`` (relative error of the mass; the blocks each selects
at a budget of 1/16, as a share of the reference's).

    python benchmarks/check_quant_keys.py            # a CUDA device; --device cpu runs it through the interpreter
    python benchmarks/check_quant_keys.py --sweep    # then every scoring layout x knobs, checked and timed

The sweep, at 1 x 128K (8200 blocks) and 8 x 32K (2048 blocks each), for 2 and 4 bits: each point of :data:`GRID`
(``quant_block_lse``'s layout, blocks per tile, warps and the ``dot`` precision) is checked (``quant_block_scores``
at those knobs against the float32 reference: relative error, top-1/16 blocks shared) and timed (``common.bench``:
CUDA graph, L2 flushed, median): the scoring kernel alone (``us``) and the whole scoring at those knobs
(``scores_us``: 3 launches, no forced blocks), then the whole scoring at the defaults (``LSE_DEFAULTS`` + the
two-launch tail, forced blocks included), the same scoring with the torch tail it replaced
(``reference.lse_block_mass``), and the whole selection (scores + top-k at a budget of 1/8) beside Quest's. Columns:
``us``, ``GB/s`` of the scoring state read (codes + min / max), ``floor`` (times the bytes' time at the copy bandwidth
measured in the run), ``vs_default`` (time over the default layout's), ``rel_err``, ``shared``, ``scores_us``. The
CSV goes to ``--out``, else ``$OUT/quant_sweep.csv`` when ``OUT`` is set, else
``benchmarks/results/quant_sweep.csv``.

    TRITON_INTERPRET=1 python benchmarks/check_quant_keys.py --device cpu --blocks 16 --sweep --smoke   # a dry run
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

from common import bench, cpu_dry_run, env_info, hbm_bandwidth, print_table, write_csv

from hf_sparse_kv.ops import get_ops
from hf_sparse_kv.ops import reference as R

# (layout, blocks per tile, warps, other knobs) per width and shape: 16 points, 64 in all, each timed twice (the
# kernel, the whole scoring). The 2026-12-01 default (wide 4 / 4) and tile 4 / 4 as the references, then the
# block-diagonal layouts ("diag", "diag_kq", 2026-12-03) around 4 blocks and 4 warps, and probes (``dot`` "bf16" / "fp16": timing
# points, never a default). Earlier sweeps' other points (slices, tile's and wide's neighbours, the FMA and
# pipelined loop layouts) are in benchmarks/RESULTS.md.
GRID = (
    ("tile", 4, 4, {}),
    ("wide", 4, 4, {}),
    ("wide", 4, 4, {"dot": "bf16"}),
    ("diag", 2, 4, {}),
    ("diag", 4, 2, {}),
    ("diag", 4, 4, {}),
    ("diag", 8, 4, {}),
    ("diag", 8, 8, {}),
    ("diag", 4, 4, {"dot": "fp16"}),
    ("diag", 8, 4, {"dot": "fp16"}),
    ("diag_kq", 4, 4, {}),
    ("diag_kq", 8, 4, {}),
    ("diag_kq", 8, 8, {}),
    ("diag_kq", 16, 8, {}),
    ("diag_kq", 4, 4, {"dot": "fp16"}),
    ("diag_kq", 8, 8, {"dot": "fp16"}),
)
SMOKE_GRID = (
    ("slices", 2, 1, {}),
    ("diag", 2, 4, {}),
    ("diag_kq", 4, 4, {"dot": "fp16"}),
    ("tile", 4, 4, {}),
    ("tile", 4, 4, {"dot": "bf16"}),
    ("wide", 2, 4, {}),
    ("wide", 2, 4, {"dot": "bf16"}),
)
SHAPES = ((1, 8200), (8, 2048))  # (sequences, blocks each): 1 x 128K and 8 x 32K at block size 16
SMOKE_SHAPES = ((1, 12), (2, 5))
SINK, WINDOW = 4, 32  # the policies' defaults


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--blocks", type=int, default=2048, help="blocks per sequence of the check")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--sweep", action="store_true", help="check and time every layout x knobs (module docstring)")
    ap.add_argument("--smoke", action="store_true", help="the sweep at tiny shapes, 4 points, 2 KV heads (a dry run)")
    ap.add_argument(
        "--apply",
        action="store_true",
        help="with --sweep: write each width's fastest correct TF32 point into LSE_DEFAULTS (apply_defaults)",
    )
    ap.add_argument(
        "--out",
        help="the sweep's CSV (default: $OUT/quant_sweep.csv when OUT is set, else "
        "benchmarks/results/quant_sweep.csv; a --smoke run: the temp folder)",
    )
    a = ap.parse_args()
    dev, B, MB, H, G, D, BS = a.device, a.batch, a.blocks, 8, 4, 128, 16
    if torch.device(dev).type == "cpu":
        cpu_dry_run()
    ops = get_ops("triton", dev)
    torch.manual_seed(0)
    NB = B * MB
    k_pool = torch.randn(NB, H, BS, D, device=dev).to(torch.bfloat16)
    table = torch.randperm(NB, device=dev).view(B, MB).int()
    seq_lens = torch.tensor([MB * BS - 3, MB * BS // 2 + 5], device=dev, dtype=torch.int32)[:B]
    start = torch.zeros(B, dtype=torch.int32, device=dev)
    q = torch.randn(B, H * G, D, device=dev).to(torch.bfloat16)
    kmin, kmax = k_pool.amin(2), k_pool.amax(2)
    lo = torch.zeros(B, dtype=torch.long, device=dev)
    hi = seq_lens.long()
    for bits in (2, 4):
        want = torch.zeros(NB, H, BS, D * bits // 8, dtype=torch.uint8, device=dev)
        got = want.clone()
        R.quant_write(want, k_pool, table, lo, hi, int(hi.max()), bits)
        ops.quant_write(got, k_pool, table, lo, hi, int(hi.max()), bits)
        L = 2**bits - 1
        codes_w = torch.cat([(want.int() >> (j * bits)) & L for j in range(8 // bits)], -1)
        codes_g = torch.cat([(got.int() >> (j * bits)) & L for j in range(8 // bits)], -1)
        diff = (codes_w - codes_g).abs()
        ref = R.quant_block_scores(q, want, kmin, kmax, table, seq_lens, start, D**-0.5, bits)
        out = ops.quant_block_scores(q, want, kmin, kmax, table, seq_lens, start, D**-0.5, bits)
        rel, same, inf_ok = compare(out, ref, max(1, MB // 16))
        print(
            f"bits={bits}: codes equal {diff.eq(0).float().mean().item():.6f}, off by more than one "
            f"{int(diff.gt(1).sum())}; mass rel err {rel:.2e}, NaN {int(out.isnan().sum())}, "
            f"inf pattern equal {inf_ok}; top-{max(1, MB // 16)} blocks shared {same:.4f}"
        )
    if a.sweep:
        rows = sweep(dev, 2 if a.smoke else H, G, D, BS, a.smoke)
        folder = tempfile.gettempdir() if a.smoke else "benchmarks/results"
        out = a.out or os.path.join(os.environ.get("OUT") or folder, "quant_sweep.csv")
        write_csv(out, rows)
        cols = ["bits", "shape", "what", "us", "GB/s", "floor", "vs_default", "rel_err", "shared", "scores_us"]
        shown = [{**r, "rel_err": r.get("rel_err") and f"{r['rel_err']:.1e}", "shared": r.get("shared") and
                  f"{r['shared']:.4f}", "floor": r.get("floor") and f"{r['floor']:.2f}",
                  "vs_default": r.get("vs_default") and f"{r['vs_default']:.2f}"} for r in rows]  # fmt: skip
        print_table(shown, cols, title=f"quant_block_scores sweep ({env_info()})")
        print(f"wrote {out}")
        if a.apply and a.smoke:
            print("--apply skipped: a --smoke run's timings are not the GPU's")
        elif a.apply:
            for bits, knobs in apply_defaults(rows, QUANT_SOURCE).items():
                print(f"LSE_DEFAULTS[{bits}] = {knobs}")


QUANT_SOURCE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "hf_sparse_kv", "ops", "triton", "quant.py"
)
KNOB_KEYS = ("layout", "tpp", "num_warps")


def best_points(rows: list[dict]) -> dict[int, dict]:
    """Per code width, the knobs of the grid point with the least whole-scoring time (``scores_us``) summed over
    every shape the sweep timed, among the points at a layout's default precision (``dot`` unset or one of
    ``quant.DEFAULT_DOTS``: not the bf16 / fp16 probes) that are right at every shape (top blocks shared >= 0.99 with
    the float32 reference, the same ``+-inf`` pattern). ``{bits: {layout, tpp, num_warps}}``."""
    from hf_sparse_kv.ops.triton.quant import DEFAULT_DOTS

    shapes = {r["shape"] for r in rows if "layout" in r}
    total: dict[tuple, dict] = {}
    for r in rows:
        if "layout" not in r or r.get("dot", DEFAULT_DOTS[0]) not in DEFAULT_DOTS:
            continue
        key = (r["bits"], r["layout"], r["tpp"], r["num_warps"])
        t = total.setdefault(key, {"us": 0.0, "shapes": set(), "ok": True})
        t["us"] += r["scores_us"]
        t["shapes"].add(r["shape"])
        t["ok"] &= r["shared"] >= 0.99 and r["inf_ok"]
    best: dict[int, tuple] = {}
    for key, t in total.items():
        if t["ok"] and t["shapes"] == shapes and (key[0] not in best or t["us"] < best[key[0]][1]):
            best[key[0]] = (key, t["us"])
    return {bits: dict(zip(KNOB_KEYS, key[1:])) for bits, (key, _) in sorted(best.items())}


def apply_defaults(rows: list[dict], path: str) -> dict[int, dict]:
    """Rewrite the ``LSE_DEFAULTS`` literal of ``path`` (``ops/triton/quant.py``) with :func:`best_points`, dated;
    raises if the literal is not found or a width has no correct point. Returns what it wrote."""
    import datetime
    import json
    import re

    best = best_points(rows)
    if set(best) != {2, 4}:
        raise SystemExit(f"no correct point for every width: {best}")
    with open(path) as f:
        src = f.read()
    pat = re.compile(r"LSE_DEFAULTS = \{[^\n]*\n(    [24]: \{[^\n]*\},\n){2}\}")
    if len(pat.findall(src)) != 1:
        raise SystemExit(f"LSE_DEFAULTS literal not found once in {path}")
    day = datetime.date.today().isoformat()
    body = "".join(
        f"    {b}: {{{', '.join(f'{json.dumps(k)}: {json.dumps(v)}' for k, v in best[b].items())}}},\n" for b in (2, 4)
    )
    new = f"LSE_DEFAULTS = {{  # {day} sweep (--apply): least whole-scoring time over 1 x 128K + 8 x 32K\n{body}}}"
    with open(path, "w") as f:
        f.write(pat.sub(lambda m: new, src))
    return best


def compare(out: torch.Tensor, ref: torch.Tensor, k: int) -> tuple[float, float, bool]:
    """``(relative error of the finite scores, share of the reference's top-k blocks also in out's, same inf
    pattern)`` for ``[B, H, MB]`` scores."""
    fin = ref.isfinite()
    rel = ((out - ref).abs()[fin].max() / ref[fin].abs().max()).item()
    a_sel, b_sel = ref.topk(k, -1).indices, out.topk(k, -1).indices
    same = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a_sel.flatten(0, 1), b_sel.flatten(0, 1)))
    return rel, same / a_sel.flatten(0, 1).numel(), bool(torch.equal(out.isinf(), ref.isinf()))


def layer_inputs(dev, B: int, MB: int, H: int, G: int, D: int, BS: int) -> tuple:
    """Fresh random inputs of one layer's selection: ``(k_pool [B * MB, H, BS, D] bf16, block_table [B, MB] (block i
    of sequence b at b * MB + i), seq_lens [B] (the first sequence 3 tokens short of full, each next 3 shorter), start
    [B] zeros, q [B, H * G, D] bf16, scale, a label like "8x32K")``."""
    k_pool = torch.randn(B * MB, H, BS, D, device=dev).to(torch.bfloat16)
    table = torch.arange(B * MB, device=dev, dtype=torch.int32).view(B, MB)
    lens = torch.tensor([MB * BS - 3 * i for i in range(B)], device=dev, dtype=torch.int32)
    zero = torch.zeros(B, dtype=torch.int32, device=dev)
    q = torch.randn(B, H * G, D, device=dev).to(torch.bfloat16)
    shape = f"{B}x{MB * BS // 1024}K" if MB * BS >= 1024 else f"{B}x{MB * BS}"
    return k_pool, table, lens, zero, q, D**-0.5, shape


def sweep(dev, H, G, D, BS, smoke: bool = False) -> list[dict]:
    """Every point of :data:`GRID` checked and timed, then the whole scoring and selection (module docstring)."""
    from hf_sparse_kv.ops.triton.quant import LSE_DEFAULTS, quant_block_lse

    ops = get_ops("triton", dev)
    cuda = torch.device(dev).type == "cuda"
    hbm = hbm_bandwidth(dev) if cuda else None  # GB/s, a device-to-device copy
    print(f"copy bandwidth {hbm and round(hbm)} GB/s", flush=True)
    rows = []
    for B, MB in SMOKE_SHAPES if smoke else SHAPES:
        k_pool, table, lens, zero, q, scale, shape = layer_inputs(dev, B, MB, H, G, D, BS)
        kmin, kmax = k_pool.amin(2), k_pool.amax(2)
        kmean = k_pool.float().mean(2).to(torch.bfloat16)
        for bits in (2, 4):
            codes = R.quantize_keys(k_pool, kmin, kmax, bits)
            nbytes = codes.numel() + 2 * kmin.numel() * kmin.element_size()
            args = (q, codes, kmin, kmax, table, lens, zero, scale, bits)
            ref = R.quant_block_scores(*args)
            base = {"bits": bits, "shape": shape}
            default = None
            for layout, tpp, warps, knobs in SMOKE_GRID if smoke else GRID:
                out = ops.quant_block_scores(*args, layout=layout, tpp=tpp, num_warps=warps, **knobs)
                rel, same, inf_ok = compare(out, ref, max(1, MB // 16))
                us, mode = bench(functools.partial(quant_block_lse, *args, tpp, warps, layout, **knobs), rep=20)
                whole_us, _ = bench(
                    functools.partial(ops.quant_block_scores, *args, layout=layout, tpp=tpp, num_warps=warps, **knobs),
                    rep=20,
                )
                d = LSE_DEFAULTS[bits]
                default = us if (layout, tpp, warps, knobs) == (d["layout"], d["tpp"], d["num_warps"], {}) else default
                what = f"lse {layout} tpp={tpp} w={warps}" + "".join(f" {k}={v}" for k, v in knobs.items())
                rows.append({**base, "what": what, "layout": layout, "tpp": tpp, "num_warps": warps, **knobs,
                             "us": us, "timing": mode, "rel_err": rel, "shared": same, "inf_ok": inf_ok,
                             "GB/s": nbytes / us / 1e3, "floor": us / (nbytes / hbm / 1e3) if hbm else None,
                             "scores_us": whole_us})  # fmt: skip
                print(
                    f"{bits} bits {shape} {what}: {us:.1f} us (scores {whole_us:.1f}), rel err {rel:.1e}, "
                    f"shared {same:.4f}, inf pattern equal {inf_ok}",
                    flush=True,
                )
            for r in rows:
                if r.get("shape") == shape and r["bits"] == bits and default:
                    r["vs_default"] = r["us"] / default
            forced = (*args, SINK, WINDOW)
            whole = whole_scoring(ops, args, kmean, max(1, MB // 8))
            check = R.quant_block_scores(*forced)
            rel, same, inf_ok = compare(ops.quant_block_scores(*forced), check, max(1, MB // 16))
            for what, fn in whole.items():
                us, mode = bench(fn, rep=20)
                row = {**base, "what": what, "us": us, "timing": mode, "vs_default": us / default if default else None}
                if what.startswith("scores (lse"):
                    row.update(rel_err=rel, shared=same, inf_ok=inf_ok)
                rows.append(row)
                print(f"{bits} bits {shape} {what}: {us:.1f} us", flush=True)
            del codes, ref
    return rows


def whole_scoring(ops, args: tuple, kmean: torch.Tensor, k: int) -> dict:
    """name -> thunk: the whole scoring at the defaults (forced blocks included), the same with the torch tail it
    replaced, the whole selection (scores + top-``k``) and Quest's."""
    from hf_sparse_kv.ops.triton.quant import quant_block_lse

    q, codes, kmin, kmax, table, lens, zero = args[:7]
    H, BS = codes.shape[1], codes.shape[2]
    forced = (*args, SINK, WINDOW)
    return {
        "scores (lse + tail)": lambda: ops.quant_block_scores(*forced),
        "scores, torch tail": lambda: R.lse_block_mass(quant_block_lse(*args), table, lens, zero, BS, H, SINK, WINDOW),
        "selection (scores + top-k)": lambda: ops.topk_indices(ops.quant_block_scores(*forced), k),
        "quest selection": lambda: ops.topk_indices(
            ops.block_scores(q, kmin, kmax, kmean, table, lens, BS, "quest", zero, SINK, WINDOW), k
        ),
    }


if __name__ == "__main__":
    main()
