"""The low-bit-key kernels against the float32 reference on fresh random bf16 inputs at the Llama-3-8B layer's shape
(8 KV heads, 4 query heads each, head dim 128, block size 16): ``quant_write`` (codes equal, or off by one step where
a value sits on a rounding boundary) and ``quant_block_scores`` (relative error of the mass; the blocks each selects
at a budget of 1/16, as a share of the reference's).

    python benchmarks/check_quant_keys.py            # a CUDA device; --device cpu runs it through the interpreter
    python benchmarks/check_quant_keys.py --sweep    # then the scoring kernel's layouts and knobs timed at 1 x 128K
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_sparse_kv.ops import get_ops
from hf_sparse_kv.ops import reference as R


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--blocks", type=int, default=2048, help="blocks per sequence")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--sweep", action="store_true", help="time quant_block_lse's tpp x num_warps at 1 x 128K")
    a = ap.parse_args()
    dev, B, MB, H, G, D, BS = a.device, a.batch, a.blocks, 8, 4, 128, 16
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
        fin = ref.isfinite()
        rel = ((out - ref).abs()[fin].max() / ref[fin].abs().max()).item()
        k = MB // 16
        a_sel, b_sel = ref.topk(k, -1).indices.sort(-1).values, out.topk(k, -1).indices.sort(-1).values
        same = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a_sel.flatten(0, 1), b_sel.flatten(0, 1)))
        print(
            f"bits={bits}: codes equal {diff.eq(0).float().mean().item():.6f}, off by more than one "
            f"{int(diff.gt(1).sum())}; mass rel err {rel:.2e}, NaN {int(out.isnan().sum())}, "
            f"inf pattern equal {bool(torch.equal(out.isinf(), ref.isinf()))}; top-{k} blocks shared "
            f"{same / (B * H * k):.4f}"
        )
    if a.sweep:
        sweep(dev, H, G, D, BS)


def sweep(dev, H, G, D, BS, MB=8200) -> None:
    """``quant_block_lse`` at 1 x 128K (``MB`` blocks, one sequence), median us of ``triton.testing.do_bench`` (L2 not
    flushed: the codes and min/max of one layer, 67 MB at 2 bits, exceed the H200's 50 MB L2 anyway)."""
    import triton

    from hf_sparse_kv.ops.triton.quant import quant_block_lse

    k_pool = torch.randn(MB, H, BS, D, device=dev).to(torch.bfloat16)
    kmin, kmax = k_pool.amin(2), k_pool.amax(2)
    table = torch.arange(MB, device=dev, dtype=torch.int32).view(1, MB)
    lens, zero = torch.tensor([MB * BS], device=dev, dtype=torch.int32), torch.zeros(1, dtype=torch.int32, device=dev)
    q = torch.randn(1, H * G, D, device=dev).to(torch.bfloat16)
    for bits in (2, 4):
        codes = R.quantize_keys(k_pool, kmin, kmax, bits)
        nbytes = codes.numel() + 2 * kmin.numel() * 2
        grid = [("slices", t, w) for t in (1, 2, 4, 8, 16) for w in (1, 2, 4)]
        grid += [("tile", t, w) for t in (2, 4, 8) for w in (2, 4, 8)]
        for layout, tpp, warps in grid:
            args = (q, codes, kmin, kmax, table, lens, zero, 0.088, bits, tpp, warps, layout)
            ms = triton.testing.do_bench(functools.partial(quant_block_lse, *args))
            print(
                f"sweep bits={bits} {layout} tpp={tpp} warps={warps}: {ms * 1e3:.1f} us, {nbytes / ms / 1e6:.0f} GB/s"
            )


if __name__ == "__main__":
    main()
