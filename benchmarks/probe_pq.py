"""Where the product-quantized scoring kernel's time goes (issue 13): variants of ``pq_group_lse_kernel`` timed side
by side at the Llama-3-8B layer's shapes, each one change away from the library's kernel.

    python benchmarks/probe_pq.py                                         # a CUDA device
    ncu --clock-control none -k regex:pq_group_lse python benchmarks/probe_pq.py --once   # the library's kernel
    TRITON_INTERPRET=1 python benchmarks/probe_pq.py --device cpu --smoke  # a dry run on the CPU

Variants (``MODE``; the library's tile: 4 blocks a program, 1 warp, unless the row says otherwise):

- ``library``: ``ops/triton/product.py``'s kernel itself (through ``pq_group_table_lse``);
- ``copy``: this file's copy of it, unchanged (the copy's own overhead, if any);
- ``ca`` / ``evict_last``: the table's gather with ``cache_modifier=".ca"`` / ``eviction_policy="evict_last"``;
- ``codes_cg``: the codes loaded with ``cache_modifier=".cg"`` (through L2 only: the table keeps L1 to itself);
- ``codes_first``: the codes loaded with ``eviction_policy="evict_first"``, the table's gather ``"evict_last"``;
- ``bf16``: the table in bfloat16 (half the bytes a gather moves; sums still float32); ``bf16_codes_first``: and
  the codes and gather as ``codes_first``;
- ``no_gather``: every (token, piece) reads its piece's first entry (the same address for every code): all the
  kernel's work but the random gather;
- ``no_lse``: the gather and the sum over the pieces, then a plain max over the block's tokens (no exp / log);
- ``pieces_loop``: a static loop over the pieces, each a ``[BM, BS]`` load of its codes and a ``[BM, BS, GP]``
  gather added to the scores (no sum across lanes over the pieces; not run on the GPU yet).

Each variant's output is compared with the library's (``no_gather`` and ``no_lse`` compute something else: their
error is printed, not checked), with the share of each query head's top 4/16 blocks it keeps (``top4_shared``: what
a c = 4 coarse pass at a 1/16 budget would hand on). ``us`` is ``common.bench``'s (CUDA graph, L2 flushed, median of 20). ``floor``: the
codes' bytes over the copy bandwidth measured in the run.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from check_quant_keys import layer_inputs
from common import bench, cpu_dry_run, env_info, hbm_bandwidth, print_table, write_csv

from hf_sparse_kv.ops import reference as R
from hf_sparse_kv.ops.triton.product import block_tile, tile_lse

MODES = (
    "copy", "ca", "evict_last", "codes_cg", "codes_first", "bf16", "bf16_codes_first", "no_gather", "no_lse",
    "pieces_loop",
)  # fmt: skip


@triton.jit
def probe_kernel(
    table, codes, block_table, seq_lens, start, out, s_cn, MB,
    HQ: tl.constexpr, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, M: tl.constexpr, C: tl.constexpr,
    BS: tl.constexpr, BM: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_m, m_m, phys, ok = block_tile(block_table, seq_lens, start, i_b, i_m, MB, BM, BS)
    o_t = tl.arange(0, BS)
    o_j = tl.arange(0, M)
    o_g = tl.arange(0, GP)
    ok3 = ok[:, :, None] & (o_j[None, None, :] < M)
    if MODE == "pieces_loop":  # a static loop over the pieces: no sum across lanes over them
        base = table + i_bh.to(tl.int64) * (M * C * GP)
        at = phys[:, None] * s_cn + (i_h * BS + o_t[None, :]) * M  # [BM, BS]
        s = tl.zeros([BM, BS, GP], dtype=tl.float32)
        for j in tl.static_range(M):
            c_j = tl.load(codes + at + j, mask=ok, other=0).to(tl.int32)
            p_j = base + ((j * C + c_j) * GP)[:, :, None] + o_g[None, None, :]
            s += tl.load(p_j, mask=ok[:, :, None], other=0.0)
    else:
        row = phys[:, None, None] * s_cn + ((i_h * BS + o_t[None, :, None]) * M + o_j[None, None, :])
        if MODE == "codes_cg":
            code = tl.load(codes + row, mask=ok3, other=0, cache_modifier=".cg").to(tl.int32)
        elif MODE == "codes_first" or MODE == "bf16_codes_first":
            code = tl.load(codes + row, mask=ok3, other=0, eviction_policy="evict_first").to(tl.int32)
        else:
            code = tl.load(codes + row, mask=ok3, other=0).to(tl.int32)
        if MODE == "no_gather":
            code = code * 0
        entry = (o_j[None, None, :] * C + code) * GP
        ptr = table + i_bh.to(tl.int64) * (M * C * GP) + entry[:, :, :, None] + o_g[None, None, None, :]
        m4 = ok3[:, :, :, None]
        if MODE == "ca":
            val = tl.load(ptr, mask=m4, other=0.0, cache_modifier=".ca")
        elif MODE == "evict_last" or MODE == "codes_first" or MODE == "bf16_codes_first":
            val = tl.load(ptr, mask=m4, other=0.0, eviction_policy="evict_last")
        else:
            val = tl.load(ptr, mask=m4, other=0.0)
        s = tl.sum(val.to(tl.float32), axis=2)
    if MODE == "no_lse":
        lse = tl.max(tl.where(ok[:, :, None], s, float("-inf")), axis=1)
    else:
        lse = tile_lse(s, ok)
    head = (i_b * HQ + i_h * G + o_g).to(tl.int64)
    tl.store(out + head[None, :] * MB + o_m[:, None], lse, mask=m_m[:, None] & (o_g[None, :] < G))


def probe(tab, codes, block_table, seq_lens, start, group, mode, tpp=4, num_warps=1):
    """``[B, Hkv * group, MB]`` float32: the variant ``mode`` of the kernel (module docstring)."""
    B, H, M, C, GP = tab.shape
    BS = codes.shape[2]
    MB = block_table.shape[1]
    out = torch.empty(B, H * group, MB, dtype=torch.float32, device=tab.device)
    grid = (triton.cdiv(MB, tpp), B * H)
    probe_kernel[grid](
        tab, codes, block_table, seq_lens, start, out, codes.stride(0), MB,
        HQ=H * group, H=H, G=group, GP=GP, M=M, C=C, BS=BS, BM=tpp, MODE=mode, num_warps=num_warps,
    )  # fmt: skip
    return out


def top_mask(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x [..., N]`` -> bool ``[..., N]``: its ``k`` largest entries along the last dim."""
    return torch.zeros_like(x, dtype=torch.bool).scatter_(-1, x.topk(k, dim=-1).indices, True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (a dry run)")
    ap.add_argument("--once", action="store_true", help="only the library's kernel, once at 8 x 32K (for ncu)")
    ap.add_argument("--out", help="the CSV (default: $OUT/probe_pq.csv when OUT is set, else benchmarks/results/)")
    a = ap.parse_args()
    dev = a.device
    if torch.device(dev).type == "cpu":
        cpu_dry_run()
    from hf_sparse_kv.ops.triton.product import pq_group_table, pq_group_table_lse

    hbm = hbm_bandwidth(dev) if torch.device(dev).type == "cuda" else None
    H, G, D, BS, M, C = (2 if a.smoke else 8), 4, 128, 16, 16, 256
    rows = []
    torch.manual_seed(0)
    for B, MB in ((1, 12), (2, 5)) if a.smoke else ((8, 2048),) if a.once else ((1, 8200), (8, 2048)):
        k_pool, table, lens, zero, q, scale, shape = layer_inputs(dev, B, MB, H, G, D, BS)
        centres = torch.randn(H, M, C, D // M, device=dev)
        codes = R.pq_encode(k_pool.transpose(1, 2), centres).transpose(1, 2).contiguous()
        tab = pq_group_table(q, centres, scale)
        want = pq_group_table_lse(tab, codes, table, lens, zero, G)
        if a.once:
            torch.cuda.synchronize()
            return
        fin = want.isfinite()
        floor = codes.numel() / hbm / 1e3 if hbm else None
        runs = {"library": functools.partial(pq_group_table_lse, tab, codes, table, lens, zero, G)}
        for mode in MODES:
            t = tab.to(torch.bfloat16) if mode.startswith("bf16") else tab
            runs[mode] = functools.partial(probe, t, codes, table, lens, zero, G, mode)
        for tpp, warps in ((16, 1), (4, 2), (1, 1)):
            runs[f"copy tpp={tpp} w={warps}"] = functools.partial(
                probe, tab, codes, table, lens, zero, G, "copy", tpp, warps
            )
        k4 = max(1, MB // 4)  # the c = 4 candidates of a 1/16 budget, per query head
        want_top = top_mask(want, k4)
        for what, fn in runs.items():
            got = fn()
            shared = ((top_mask(got, k4) & want_top).sum() / want_top.sum()).item()
            same = torch.equal(got.isneginf(), want.isneginf())
            err = ((got[fin] - want[fin]).abs().max() / want[fin].abs().max()).item() if fin.any() else 0.0
            us, mode = bench(fn, rep=20)
            rows.append({"shape": shape, "what": what, "us": us, "timing": mode, "x_floor": us / floor if floor else None,
                         "rel_err": err, "inf_same": same, "top4_shared": shared})  # fmt: skip
            print(f"{shape} {what}: {us:.1f} us, max rel err {err:.1e}, -inf pattern equal {same}, top 4/16 shared "
                  f"{shared:.4f}", flush=True)  # fmt: skip
            exact = ("copy", "ca", "evict_last", "codes_cg", "codes_first", "pieces_loop", "library")
            if what in exact or what.startswith("copy "):
                assert same and err < 1e-5, f"{what} differs from the library's kernel"
            if what.startswith("bf16"):
                assert same and err < 2e-2, "the bf16 table's lse is off by more than bf16 rounding"
    out = a.out or os.path.join(os.environ.get("OUT") or "benchmarks/results", "probe_pq.csv")
    write_csv(out, rows)
    shown = [{**r, "rel_err": f"{r['rel_err']:.1e}", "x_floor": r["x_floor"] and f"{r['x_floor']:.1f}"} for r in rows]
    print_table(
        shown, ["shape", "what", "us", "x_floor", "rel_err", "inf_same"], title=f"pq lse variants ({env_info()})"
    )


if __name__ == "__main__":
    main()
