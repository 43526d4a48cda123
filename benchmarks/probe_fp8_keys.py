"""Issue 13 probe: score every key from a float8 (e4m3) copy of K, one scaled query for every token.

``QuantBlockTopK(bits=4)``'s scoring kernel is bound by the instructions that unpack its 4-bit codes into a product's
operands (Nsight Compute, benchmarks/RESULTS.md, 2026-12-06), and its per-block grids need a differently scaled
query for every 16-token block. Here the keys are kept as float8 e4m3 after dividing each channel by one scale per
KV head (``max |k| / 448``): ``q . k = (q * scale) . k8``, so one query operand serves a whole tile of tokens and the
tile's fp8 rows go into the tensor-core product as they are loaded. Twice the bytes of 4-bit codes, no unpacking.

Per (tile of ``BM`` logical blocks, sequence, KV head) the kernel gathers the tile's ``[BM * BS, D]`` fp8 keys through
the block table, multiplies them with the group's scaled query (a power of two brings it into fp8's range; ``two``:
in two fp8 parts, hi + lo, ~7 bits of mantissa; else one part, 3 bits), and stores each block's log-sum-exp per
query head over its valid positions (``QuantBlockTopK``'s ``quant_block_lse`` output; its tail would turn them into
the block's mass). Not a library kernel: a probe of what such a selector's scoring would cost.

The library's kernel (``ops/triton/fp8.py``: one scale per key, the query's fp8 parts made in every program) runs on
per-key codes of the same keys at each of ``LIB_CONFIGS`` (blocks a tile, warps, tiles a program, pipeline stages),
checked against ``reference.fp8_block_lse`` and timed the same way (its bytes: the codes and the scales).

Each configuration is checked against a float32 reference on the same fp8 keys (relative error, the share of each
query head's top 1/16 blocks kept, the same ``-inf`` pattern, no NaN), then timed (``common.bench``: CUDA graph of 4
layers, L2 flushed, median of 20) against the fp8 keys' bytes at the copy bandwidth measured in the run.

    python benchmarks/probe_fp8_keys.py                                               # a CUDA device
    TRITON_INTERPRET=1 python benchmarks/probe_fp8_keys.py --device cpu --out x.csv   # a dry run, tiny shapes
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

from common import bench, cpu_dry_run, env_info, hbm_bandwidth, print_table, write_csv

from hf_sparse_kv.ops import reference as R
from hf_sparse_kv.ops.triton.fp8 import fp8_block_lse

FP8 = torch.float8_e4m3fn
CONFIGS = ((4, 4, True), (8, 4, True), (8, 8, True), (16, 8, True), (8, 4, False), (16, 4, False))  # BM, warps, two
# the library's kernel (per-key scales, the query converted inside): block_m, num_warps, tiles, num_stages, native
# (False: the form for GPUs without float8, the codes widened to float16; timed here on a GPU that has float8)
LIB_CONFIGS = (
    (8, 4, 1, 1, True), (4, 4, 1, 1, True), (8, 4, 2, 2, True), (8, 4, 4, 2, True), (8, 4, 4, 3, True),
    (8, 4, 8, 3, True), (4, 4, 4, 3, True), (4, 4, 8, 3, True), (16, 8, 2, 2, True), (16, 8, 4, 2, True),
    (8, 4, 4, 2, False), (8, 4, 1, 1, False), (8, 8, 4, 2, False), (16, 8, 4, 2, False),
)  # fmt: skip


@triton.jit
def fp8_lse_kernel(
    qh,  # [B, HQ, D] fp8: the scaled query times its power of two, rounded
    ql,  # [B, HQ, D] fp8: what that rounding left (read only if TWO)
    qinv,  # [B, HQ] float32: one over the power of two
    k8,  # [NB, H, BS, D] fp8 keys over their channel scales
    table,  # [B, MB] int32
    lens,  # [B] int32
    out,  # [B, HQ, MB] float32
    s_kn,
    MB,
    HQ: tl.constexpr,
    H: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BM: tl.constexpr,
    TWO: tl.constexpr,
):
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_g = tl.arange(0, GP)
    o_d = tl.arange(0, D)
    m_g = o_g < G
    qrow = (i_b * HQ + i_h * G + o_g).to(tl.int64)
    b_qh = tl.load(qh + qrow[:, None] * D + o_d[None, :], mask=m_g[:, None], other=0.0)  # [GP, D]
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < MB
    o_t = tl.arange(0, BM * BS)
    blk = i_m * BM + o_t // BS  # each row's logical block
    phys = tl.load(table + i_b * MB + blk, mask=blk < MB, other=0).to(tl.int64)
    ok = blk * BS + o_t % BS < tl.load(lens + i_b)
    ptr = k8 + phys[:, None] * s_kn + (i_h * BS + o_t % BS)[:, None] * D + o_d[None, :]
    b_k = tl.load(ptr, mask=ok[:, None], other=0.0)  # [BM * BS, D] fp8, straight into the product
    s = tl.dot(b_k, tl.trans(b_qh))  # [BM * BS, GP] float32
    if TWO:
        b_ql = tl.load(ql + qrow[:, None] * D + o_d[None, :], mask=m_g[:, None], other=0.0)
        s += tl.dot(b_k, tl.trans(b_ql))
    s = s * tl.load(qinv + qrow, mask=m_g, other=1.0)[None, :]
    s = tl.where(ok[:, None], s, float("-inf"))
    s3 = tl.reshape(s, (BM, BS, GP))
    mx = tl.max(s3, 1)  # [BM, GP]
    ref = tl.where(mx == float("-inf"), 0.0, mx)
    lse = ref + tl.log(tl.sum(tl.exp(s3 - ref[:, None, :]), 1))
    tl.store(out + qrow[None, :] * MB + o_m[:, None], lse, mask=m_m[:, None] & m_g[None, :])


def fp8_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``k [NB, H, BS, D]`` -> (``k8`` the same shape in e4m3, ``scale [H, D]`` float32: ``max |k| / 448`` of each
    head's channel, 1 where the channel is all zeros)."""
    amax = k.float().abs().amax(dim=(0, 2))
    scale = R.fp8_scale(amax)
    return R.fp8_encode(k, scale[None, :, None, :]).view(FP8), scale


def fp8_query(q: torch.Tensor, scale: torch.Tensor, G: int) -> tuple[torch.Tensor, ...]:
    """``q [B, HQ, D]``, ``scale [H, D]`` -> (``qs`` float32 the scaled query, ``qh``, ``ql`` its two fp8 parts after
    a power of two per row brings its largest entry to [112, 224], ``qinv [B, HQ]`` one over that power)."""
    B, HQ, D = q.shape
    qs = (q.float().view(B, HQ // G, G, D) * scale.view(1, -1, 1, D)).view(B, HQ, D)
    top = qs.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    f = torch.exp2(torch.floor(torch.log2(224 / top)))
    qh = (qs * f).to(FP8)
    ql = (qs * f - qh.float()).to(FP8)
    return qs, qh, ql, (1 / f).view(B, HQ).contiguous()


def fp8_lse(qh, ql, qinv, k8, table, lens, G: int, BM: int = 8, warps: int = 4, two: bool = True) -> torch.Tensor:
    """``[B, HQ, MB]`` float32: each block's log-sum-exp per query head (module docstring)."""
    B, HQ, D = qh.shape
    H, BS = k8.shape[1], k8.shape[2]
    MB = table.shape[1]
    out = torch.empty(B, HQ, MB, dtype=torch.float32, device=qh.device)
    grid = (triton.cdiv(MB, BM), B * H)
    fp8_lse_kernel[grid](
        qh, ql, qinv, k8, table, lens, out, k8.stride(0), MB,
        HQ=HQ, H=H, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BS=BS, BM=BM, TWO=two, num_warps=warps,
    )  # fmt: skip
    return out


def reference(qs: torch.Tensor, k8: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, G: int) -> torch.Tensor:
    """float32 ``[B, HQ, MB]``: per block and query head, the log-sum-exp over valid positions of ``qs . k8`` (the
    fp8 keys taken exactly)."""
    B, HQ, D = qs.shape
    H, BS = k8.shape[1], k8.shape[2]
    MB = table.shape[1]
    k = k8.float()[table.long()]  # [B, MB, H, BS, D]
    s = torch.einsum("bhgd,bmhtd->bhgmt", qs.view(B, H, G, D), k)
    pos = torch.arange(MB * BS, device=k.device).view(MB, BS)
    s = s.masked_fill(~(pos < lens.view(B, 1, 1, 1, 1)), float("-inf"))
    return torch.logsumexp(s, -1).reshape(B, HQ, MB)


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Relative error of the finite entries, share of each row's top 1/16 kept, same ``-inf`` pattern, NaN count."""
    fin = ref.isfinite()
    k = max(1, ref.shape[-1] // 16)
    top = torch.zeros_like(ref, dtype=torch.bool).scatter_(-1, ref.topk(k, -1).indices, True)
    got = torch.zeros_like(ref, dtype=torch.bool).scatter_(-1, out.topk(k, -1).indices, True)
    return {
        "rel_err": ((out - ref).abs()[fin].max() / ref[fin].abs().max()).item(),
        "shared": (top & got).sum().item() / top.sum().item(),
        "inf_ok": bool(torch.equal(out.isinf(), ref.isinf())),
        "nan": int(out.isnan().sum()),
    }


def timed_row(shape: str, knobs: dict, us: float, mode: str, nbytes: int, hbm: float | None, check: dict) -> dict:
    """One CSV row (printed as it is made): the shape, the kernel and its knobs, its time and its ``nbytes`` read as
    GB/s and as a share of the copy bandwidth ``hbm`` (``None`` off the GPU), and the checks of :func:`compare`."""
    row = {"shape": shape, **knobs, "us": us, "timing": mode, "GB/s": nbytes / us / 1e3,
           "of_copy": nbytes / us / 1e3 / hbm if hbm else None, **check}  # fmt: skip
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--out", help="the CSV (default: $OUT/probe_fp8_keys.csv when OUT is set, else benchmarks/results/)"
    )
    ap.add_argument("--library", action="store_true", help="time the library's kernel only (not the probe's)")
    a = ap.parse_args()
    dev = a.device
    cpu = torch.device(dev).type == "cpu"
    if cpu:
        cpu_dry_run()
    hbm = None if cpu else hbm_bandwidth(dev)
    print(f"copy bandwidth {hbm and round(hbm)} GB/s", flush=True)
    H, G, D, BS = (2 if cpu else 8), 4, 128, 16
    rows = []
    for B, MB in ((1, 24), (2, 9)) if cpu else ((1, 8200), (8, 2050)):
        torch.manual_seed(0)
        pools, lib = [], []  # four layers' keys, channels of different widths: per-channel and per-key codes
        for _ in range(1 if cpu else 4):
            keys = (torch.randn(B * MB, H, BS, D, device=dev) * torch.linspace(0.3, 4, D, device=dev)).bfloat16()
            pools.append(fp8_keys(keys))
            lib.append(R.fp8_code(keys))
            del keys
        table = torch.randperm(B * MB, device=dev).view(B, MB).int()
        lens = torch.tensor([MB * BS - 3 - 5 * i for i in range(B)], device=dev, dtype=torch.int32)
        q = torch.randn(B, H * G, D, device=dev).bfloat16()
        k8, scale = pools[0]
        qs, qh, ql, qinv = fp8_query(q, scale, G)
        ref = reference(qs, k8, table, lens, G)
        shape = f"{B}x{MB}"
        for BM, warps, two in () if a.library else CONFIGS[:2] + CONFIGS[4:5] if cpu else CONFIGS:
            check = compare(fp8_lse(qh, ql, qinv, k8, table, lens, G, BM, warps, two), ref)
            if check["nan"] or not check["inf_ok"] or check["rel_err"] > (2e-3 if two else 6e-2):
                raise SystemExit(f"{shape} BM={BM} warps={warps} two={two}: wrong against the reference: {check}")
            fns = [functools.partial(fp8_lse, qh, ql, qinv, p[0], table, lens, G, BM, warps, two) for p in pools]
            us, mode = bench(fns, rep=20)
            knobs = {"kernel": "probe", "BM": BM, "warps": warps, "two": two}
            rows.append(timed_row(shape, knobs, us, mode, B * MB * H * BS * D, hbm, check))  # bytes: the fp8 keys
        # the library's kernel on per-key codes of the same keys
        zero = torch.zeros(B, dtype=torch.int32, device=dev)
        largs = [(q, codes, kscale, table, lens, zero, 1.0) for codes, kscale in lib]  # per layer
        lref = R.fp8_block_lse(*largs[0])
        for bm, warps, tiles, stages, native in (
            LIB_CONFIGS[:1] + LIB_CONFIGS[2:3] + LIB_CONFIGS[10:11] if cpu else LIB_CONFIGS
        ):
            kw = {"block_m": bm, "num_warps": warps, "tiles": tiles, "num_stages": stages, "native": native}
            check = compare(fp8_block_lse(*largs[0], **kw), lref)
            if check["nan"] or not check["inf_ok"] or check["rel_err"] > 2e-3:
                raise SystemExit(f"{shape} library {kw}: wrong against the reference: {check}")
            us, mode = bench([functools.partial(fp8_block_lse, *args, **kw) for args in largs], rep=20)
            knobs = {"kernel": "library" if native else "library, no float8", "BM": bm, "warps": warps,
                     "two": True if native else "f16", "tiles": tiles, "stages": stages}  # fmt: skip
            nbytes = lib[0][0].numel() + 4 * lib[0][1].numel()  # codes and scales
            rows.append(timed_row(shape, knobs, us, mode, nbytes, hbm, check))
    out = a.out or os.path.join(os.environ.get("OUT") or "benchmarks/results", "probe_fp8_keys.csv")
    write_csv(out, rows)
    shown = [{**r, "us": f"{r['us']:.1f}", "rel_err": f"{r['rel_err']:.1e}", "shared": f"{r['shared']:.4f}",
              "of_copy": r["of_copy"] and f"{r['of_copy']:.2f}"} for r in rows]  # fmt: skip
    print_table(
        shown,
        ["shape", "kernel", "BM", "warps", "two", "tiles", "stages", "us", "of_copy", "rel_err", "shared"],
        f"fp8 keys ({env_info()})",
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
