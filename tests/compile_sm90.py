"""Compile every Triton kernel for an H100/H200 (sm_90) on a machine without a GPU, launching nothing; and the float8
keys' kernels in the form an A100 (sm_80) runs.

The CPU tests run the kernels through Triton's interpreter, which executes them as Python: it never builds them, so
a kernel that the interpreter runs can still fail to compile (a reassigned ``tl.constexpr``, an integer literal
that promotes a tensor to 64 bits, a shape the layout pass rejects). This script calls each op on small CPU tensors
with Triton's active driver replaced by one that names an sm_90 target, and with every launch turned into a
compile-only warm-up (Triton's own ``warmup`` path: parse, lower, ``ptxas``). The ops' outputs are never read.

    python tests/compile_sm90.py        # prints one line per op variant, exit status 1 if any failed to build

Must run without ``TRITON_INTERPRET`` (tests/test_triton_compile.py starts it in a fresh process).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback
from functools import partial

import torch

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("compile_sm90.py builds kernels: run it without TRITON_INTERPRET")

import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver as triton_driver
from triton.runtime.jit import JITFunction

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from evaluation.kernel_specs import TargetDriver
from hf_sparse_kv.ops.triton import (
    block_scores,
    candidate_mass,
    candidate_scores,
    decode_blocks,
    decode_tokens,
    fp8_block_scores,
    fp8_write,
    merge_partials,
    oracle_block_scores,
    paged_write,
    pq_block_scores,
    pq_encode,
    pq_write,
    projected_scores,
    projected_write,
    quant_block_scores,
    quant_write,
    token_scores,
    topk_indices,
)
from hf_sparse_kv.ops.triton.fp8 import fp8_block_lse
from hf_sparse_kv.ops.triton.linear import decode_linear
from hf_sparse_kv.ops.triton.product import pq_block_lse
from hf_sparse_kv.ops.triton.quant import quant_block_lse


@contextlib.contextmanager
def compile_only(arch: int = 90):
    """Within: every Triton launch compiles its kernel for ``sm_<arch>`` and returns without running it."""
    real_run, saved = JITFunction.run, triton_driver._active

    def run(self, *args, grid, warmup, **kwargs):
        return real_run(self, *args, grid=grid, warmup=True, **kwargs)

    triton_driver.set_active(TargetDriver(GPUTarget("cuda", arch, 32)))  # just enough of a driver
    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = real_run
        triton_driver._active = saved


NO_FP8 = "(no float8: sm_80 / sm_86's form)"  # the float8 kernels' form that main() also builds for sm_80


def cases():
    """(name, thunk) pairs: each thunk calls one op variant on small CPU tensors."""
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype, D, BS, G in (
        (torch.bfloat16, 128, 16, 4),
        (torch.float16, 64, 32, 3),
        (torch.float32, 256, 64, 1),
        (torch.bfloat16, 80, 16, 2),
    ):
        B, H, MB = 2, 2, 8
        NB = B * MB
        q = torch.randn(B, H * G, D, generator=g).to(dtype)
        k_pool, v_pool = (torch.randn(NB, H, BS, D, generator=g).to(dtype) for _ in range(2))
        meta = [torch.randn(NB, H, D, generator=g).to(dtype) for _ in range(3)]
        none = torch.empty(0, dtype=dtype)
        table = torch.arange(NB, dtype=torch.int32).view(B, MB)
        lens = torch.full((B,), MB * BS - 3, dtype=torch.int32)
        zero = torch.zeros(B, dtype=torch.int32)
        blocks = torch.arange(MB, dtype=torch.int32).expand(B, H, MB).contiguous()
        tokens = torch.arange(MB * BS, dtype=torch.int32).expand(B, H, MB * BS).contiguous()
        new = torch.randn(B, H, 3, D, generator=g).to(dtype)  # [B, H, T, D]
        paged = (q, k_pool, v_pool, table, lens, zero)
        tag = f"{str(dtype).split('.')[-1]} D={D} BS={BS} G={G}"
        walk = {"reduce": "token", "sink": 4, "window": 32, "tiles_per_program": 2}
        knobs = {"num_warps": 8, "tiles_per_program": 2}
        mass_walk = {"tiles_per_program": 2, "num_stages": 3}
        quest_walk = {"block_m": 16, "tiles_per_program": 4, "num_stages": 3}
        out += [
            (f"decode_blocks {tag}", partial(decode_blocks, *paged, blocks, zero, zero, 0.1)),
            (f"decode_tokens {tag}", partial(decode_tokens, *paged, tokens, zero, zero, 0.1)),
            (f"block_scores quest {tag}", partial(block_scores, q, *meta, table, lens, BS, "quest")),
            (f"block_scores mean+forced {tag}", partial(block_scores, q, *meta, table, lens, BS, "mean", zero, 4, 32)),
            (f"block_scores quest walk {tag}", partial(block_scores, q, *meta, table, lens, BS, "quest", **quest_walk)),
            (f"paged_write {tag}", partial(paged_write, k_pool, v_pool, *meta, table, zero, new, new)),
            # a cache keeping only min / max (Quest), only the mean (BlockTopK), none (Dense, the exact and float8
            # selectors): the metadata not kept comes as an empty tensor
            (
                f"paged_write min/max {tag}",
                partial(paged_write, k_pool, v_pool, *meta[:2], none, table, zero, new, new),
            ),
            (
                f"paged_write mean {tag}",
                partial(paged_write, k_pool, v_pool, none, none, meta[2], table, zero, new, new),
            ),
            (
                f"paged_write no metadata {tag}",
                partial(paged_write, k_pool, v_pool, none, none, none, table, zero, new, new),
            ),
            (f"candidate_scores {tag}", partial(candidate_scores, q, k_pool, table, lens, zero, blocks[..., :5])),
            (f"token_scores (every block) {tag}", partial(token_scores, q, k_pool, table, lens, zero, MB * BS)),
            (
                f"oracle_block_scores (every block) {tag}",
                partial(oracle_block_scores, q, k_pool, table, lens, zero, D**-0.5, MB * BS),
            ),
            (
                f"candidate_scores block+forced {tag}",
                partial(candidate_scores, q, k_pool, table, lens, zero, blocks, reduce="block", sink=4, window=32),
            ),
            (
                f"candidate_scores mass {tag}",
                partial(candidate_scores, q, k_pool, table, lens, zero, blocks, reduce="mass", scale=D**-0.5),
            ),
            (
                f"candidate_scores mass, 2 tiles/program, 3 stages {tag}",
                partial(
                    candidate_scores, q, k_pool, table, lens, zero, blocks, 2, reduce="mass", scale=0.1, **mass_walk
                ),
            ),
            (
                f"candidate_scores head_mass {tag}",
                partial(candidate_scores, q, k_pool, table, lens, zero, blocks, reduce="head_mass", scale=D**-0.5),
            ),
            (
                f"candidate_scores head_mass, 2 tiles/program, 3 stages {tag}",
                partial(
                    candidate_scores,
                    q,
                    k_pool,
                    table,
                    lens,
                    zero,
                    blocks,
                    2,
                    reduce="head_mass",
                    scale=0.1,
                    **mass_walk,
                ),
            ),
            (
                f"candidate_scores token+forced, 2 tiles/program, 3 stages {tag}",
                partial(candidate_scores, q, k_pool, table, lens, zero, blocks, 2, **walk, num_stages=3),
            ),
        ]
        R = D // 8
        ckeys = torch.randn(NB, H, BS, R, generator=g).to(dtype)
        qp = torch.randn(B, H * G, R, generator=g)
        proj = torch.randn(H, D, R, generator=g)
        lo, hi = torch.zeros(B, dtype=torch.int64), lens.long()
        out += [
            (f"projected_write prefill {tag}", partial(projected_write, ckeys, k_pool, proj, table, lo, hi, 100)),
            (f"projected_write decode {tag}", partial(projected_write, ckeys, k_pool, proj, table, hi - 1, hi, 1)),
            (
                f"projected_scores block+forced {tag}",
                partial(projected_scores, qp, ckeys, table, lens, zero, "block", 4, 32),
            ),
            (
                f"projected_scores token+forced {tag}",
                partial(projected_scores, qp, ckeys, table, lens, zero, "token", 4, 32),
            ),
            (f"projected_scores token {tag}", partial(projected_scores, qp, ckeys, table, lens, zero, "token")),
            (
                f"projected_scores block+forced, queries projected inside {tag}",
                partial(projected_scores, q, ckeys, table, lens, zero, "block", 4, 32, qproj=proj),
            ),
            (
                f"projected_scores token, 2 tiles/program, 8 warps {tag}",
                partial(projected_scores, q, ckeys, table, lens, zero, "token", qproj=proj, block_m=2, **knobs),
            ),
        ]
    for G, C, block_c in ((1, 37, None), (3, 300, None), (4, 8200, None), (8, 8200, None), (8, 100, 16)):
        B, H, BS = 2, 2, 16
        lse = torch.randn(B, H * G, C, generator=g)
        cand = torch.arange(C, dtype=torch.int32).expand(B, H, C).contiguous()
        lens = torch.full((B,), C * BS - 5, dtype=torch.int32)
        args = (lse, cand, lens, torch.zeros_like(lens), BS, 4, 32, block_c)
        out.append((f"candidate_mass G={G} C={C} block_c={block_c}", partial(candidate_mass, *args)))
    for bits in (2, 4):  # the low-bit keys: the write and the block mass, bf16 keys of the 8B shape's head dim
        NB, H, BS, D = 12, 2, 16, 128
        k_pool = torch.randn(NB, H, BS, D, generator=g).to(torch.bfloat16)
        codes = torch.zeros(NB, H, BS, D * bits // 8, dtype=torch.uint8)
        table = torch.arange(NB, dtype=torch.int32).view(2, 6)
        lens, zero = torch.tensor([90, 40], dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
        span_lo, span_hi = torch.tensor([88, 39]), torch.tensor([90, 40])
        out.append((f"quant_write bits={bits}", partial(quant_write, codes, k_pool, table, span_lo, span_hi, 2, bits)))
        kmin, kmax = k_pool.amin(2), k_pool.amax(2)
        for G in (1, 4, 8):
            q = torch.randn(2, H * G, D, generator=g).to(torch.bfloat16)
            args = (q, codes, kmin, kmax, table, lens, zero, 0.088, bits)
            out.append((f"quant_block_scores bits={bits} G={G}", partial(quant_block_scores, *args)))
            forced = partial(quant_block_scores, *args, 4, 32)  # the tail with the forced blocks
            out.append((f"quant_block_scores bits={bits} G={G} sink+window", forced))
            for layout, tpp, warps, knobs in (
                ("slices", 2, 2, {}),
                ("tile", 4, 4, {}),
                ("tile", 16, 8, {}),
                ("tile", 4, 4, {"dot": "bf16"}),
                ("wide", 1, 4, {}),
                ("wide", 4, 4, {}),
                ("wide", 8, 8, {}),
                ("wide", 4, 4, {"dot": "bf16"}),
                ("diag", 4, 4, {}),
                ("diag", 8, 4, {}),
                ("diag", 4, 4, {"dot": "fp16"}),
                ("diag_kq", 4, 4, {}),
                ("diag_kq", 8, 8, {}),
            ):
                lse = partial(quant_block_lse, *args, tpp=tpp, num_warps=warps, layout=layout, **knobs)
                out.append((f"quant_block_lse {layout} bits={bits} G={G} tpp={tpp} warps={warps} {knobs}", lse))
    for dtype, D in ((torch.bfloat16, 128), (torch.float16, 64), (torch.float32, 32)):  # the float8 keys
        NB, H, BS = 12, 2, 16
        k_pool = torch.randn(NB, H, BS, D, generator=g).to(dtype)
        codes, kscale = torch.zeros(NB, H, BS, D, dtype=torch.uint8), torch.ones(NB, H, BS)
        table = torch.arange(NB, dtype=torch.int32).view(2, 6)
        lens, zero = torch.tensor([90, 40], dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
        span = (torch.tensor([0, 30]), torch.tensor([90, 40]), 90)
        tag = f"{str(dtype).split('.')[-1]} D={D}"
        out.append((f"fp8_write codes {tag}", partial(fp8_write, codes, k_pool, table, *span, "codes")))
        out.append((f"fp8_write scales {tag}", partial(fp8_write, kscale, k_pool, table, *span, "scales")))
        soft = partial(fp8_write, codes, k_pool, table, *span, "codes", native=False)
        out.append((f"fp8_write codes {tag} {NO_FP8}", soft))
        for G in (1, 4, 8):
            q = torch.randn(2, H * G, D, generator=g).to(dtype)
            args = (q, codes, kscale, table, lens, zero, 0.088)
            out.append((f"fp8_block_scores {tag} G={G} sink+window", partial(fp8_block_scores, *args, 4, 32)))
            soft = partial(fp8_block_scores, *args, 4, 32, native=False)
            out.append((f"fp8_block_scores {tag} G={G} sink+window {NO_FP8}", soft))
            for bm, warps, tiles, stages in ((4, 4, 1, 1), (16, 8, 1, 1), (8, 4, 4, 3)):
                lse = partial(fp8_block_lse, *args, block_m=bm, num_warps=warps, tiles=tiles, num_stages=stages)
                out.append((f"fp8_block_lse {tag} G={G} block_m={bm} warps={warps} tiles={tiles}x{stages}", lse))
            lse = partial(fp8_block_lse, *args, block_m=8, num_warps=4, tiles=4, num_stages=2, native=False)
            out.append((f"fp8_block_lse {tag} G={G} block_m=8 warps=4 tiles=4x2 {NO_FP8}", lse))
    o, lse = torch.randn(2, 4, 5, 64, generator=g), torch.randn(2, 4, 5, generator=g)
    out.append(("merge_partials", partial(merge_partials, o, lse)))
    for dtype, bias, config in ((torch.bfloat16, False, None), (torch.float16, True, (64, 128, 4, 3))):
        x, w = torch.randn(3, 4096, generator=g).to(dtype), torch.randn(1000, 4096, generator=g).to(dtype)
        b = torch.randn(1000, generator=g).to(dtype) if bias else None
        out.append((f"decode_linear {dtype} bias={bias} {config}", partial(decode_linear, x, w, b, config)))
    out.append(("decode_linear one token (choose: the sum variant)", partial(decode_linear, x[:1], w, b)))
    for n in (100, 2048, 8200, 20000):  # one tile; one tile; 8192 + 16 lanes; 16384 + 4096 lanes
        scores = torch.randn(2, n, generator=g)
        out.append((f"topk_indices N={n}", partial(topk_indices, scores, n // 16, method="row")))
    out.append(("topk_indices N=20000 all steps", partial(topk_indices, scores, 512, method="row", early=False)))
    counts = torch.tensor([3, 0])
    out.append(("topk_indices row counts", partial(topk_indices, torch.randn(2, 2, 500, generator=g), 40, counts)))
    for n, k, chunks in ((8193, 512, None), (131073, 8192, None), (3000, 100, 4)):  # 256, 4096, 1024 lanes a chunk
        scores = torch.randn(2, n, generator=g)
        out.append((f"topk_indices chunks N={n}", partial(topk_indices, scores, k, method="chunks", chunks=chunks)))
    scores = torch.randn(2, 3, 9000, generator=g)
    out.append(("topk_indices chunks counts", partial(topk_indices, scores, 600, counts, method="chunks")))
    for H, G, M, d, BS in ((2, 4, 16, 8, 16), (1, 4, 32, 8, 16), (2, 6, 16, 8, 64)):  # Llama-3, Gemma-3, Qwen2.5-like
        B, MB, C = 2, 8, 256
        q = torch.randn(B, H * G, M * d, generator=g).to(torch.bfloat16)
        codes = torch.randint(0, C, (B * MB, H, BS, M), dtype=torch.uint8, generator=g)
        centres = torch.randn(H, M, C, d, generator=g)
        table = torch.arange(B * MB, dtype=torch.int32).view(B, MB)
        lens, zero = torch.full((B,), MB * BS - 3, dtype=torch.int32), torch.zeros(B, dtype=torch.int32)
        args = (q, codes, centres, table, lens, zero, 0.088)
        out.append((f"pq_block_scores H={H} G={G} M={M} BS={BS}", partial(pq_block_scores, *args)))
        out.append((f"pq_block_scores H={H} G={G} M={M} BS={BS} sink+window", partial(pq_block_scores, *args, 4, 32)))
        out.append((f"pq_block_lse tpp=16 w=2 H={H} G={G} M={M} BS={BS}", partial(pq_block_lse, *args, 16, 2)))
        out.append(
            (
                f"pq_block_scores bf16 table H={H} G={G} M={M} BS={BS}",
                partial(pq_block_scores, *args, 0, None, "bfloat16"),
            )
        )
    for N, H, M, C, d in ((16384, 8, 16, 256, 8), (3, 2, 16, 256, 8), (40, 1, 3, 100, 4)):  # a fit; a decode write
        keys = torch.randn(N, H, M * d, generator=g).to(torch.bfloat16)
        centres = torch.randn(H, M, C, d, generator=g)
        out.append((f"pq_encode N={N} H={H} M={M} C={C} d={d}", partial(pq_encode, keys, centres)))
    for H, M, C, d, BS in ((8, 16, 256, 8, 16), (1, 32, 256, 8, 16), (2, 3, 100, 4, 64)):  # Llama-3, Gemma-3, odd
        NB, B, MB = 6, 2, 3
        k_pool = torch.randn(NB, H, BS, M * d, generator=g).to(torch.bfloat16)
        codes = torch.zeros(NB, H, BS, M, dtype=torch.uint8)
        table = torch.arange(B * MB, dtype=torch.int32).view(B, MB)
        lo, hi = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([BS * MB, 6], dtype=torch.int32)
        args = (codes, k_pool, torch.randn(H, M, C, d, generator=g), table, lo, hi, BS * MB)
        out.append((f"pq_write H={H} M={M} C={C} d={d} BS={BS}", partial(pq_write, *args)))
    return out


@contextlib.contextmanager
def built_ptx():
    """Within (inside :func:`compile_only`): every kernel built is recorded; yields ``{kernel name: [its PTX, one per
    build]}``, filled as they build."""
    built: dict[str, list[str]] = {}
    inner = JITFunction.run

    def record(self, *args, **kwargs):
        kernel = inner(self, *args, **kwargs)
        built.setdefault(self.__name__, []).append(kernel.asm["ptx"])
        return kernel

    JITFunction.run = record
    try:
        yield built
    finally:
        JITFunction.run = inner


def width_invariant_ptx() -> dict[str, bool]:
    """Kernel name -> whether ``quant_lse_mass`` builds the same PTX for tables of 2047, 2049, 2048 and 2064 blocks
    (G = 6). A static step's table is reserved wider than the eager step's; where Triton specialised a kernel on
    its width's divisibility by 16, the two compiled differently, reduced in another order and ranked near-tied
    blocks the other way on the H200 (tests/test_quant_keys.py::test_triton_tail_is_the_same_on_a_wider_table,
    2026-12-02): same PTX, same order, the same scores."""
    from hf_sparse_kv.ops.triton.quant import quant_lse_mass

    with built_ptx() as built:
        for MB in (2047, 2049, 2048, 2064):
            B, H, G = 2, 2, 6
            lse = torch.randn(B, H * G, MB)
            table = torch.arange(B * MB, dtype=torch.int32).view(B, MB)
            lens = torch.tensor([MB * 16 - 5, MB * 16 - 300], dtype=torch.int32)
            quant_lse_mass(lse, table, lens, torch.zeros(B, dtype=torch.int32), 16, H, 4, 40)
    return {name: len(set(ptx)) == 1 and len(ptx) == 4 for name, ptx in built.items()}


def byte_loads() -> dict[str, int]:
    """Kernel name -> how many of its global loads read one byte each, over every case of :func:`cases`. A tile's
    codes loaded through a pointer the compiler cannot prove aligned come a byte at a time: the float8 scorer's
    keys, addressed as ``[BM, BS]`` and reshaped, were 128 one-byte loads a thread instead of 16-byte vectors, and
    its kernel ran 1.8-2.1x slower on an H200 (benchmarks/RESULTS.md, 2026-12-06)."""
    with built_ptx() as built:
        for _, thunk in cases():
            thunk()
    one_byte = re.compile(r"ld\.global(?:\.\w+)*\.[bsu]8\b")
    return {name: sum(len(one_byte.findall(p)) for p in ptx) for name, ptx in built.items()}


def main() -> int:
    print(f"triton {triton.__version__}, target sm_90")
    if "--loads" in sys.argv:
        with compile_only():
            counts = byte_loads()
        for name, n in sorted(counts.items()):
            print(f"{n:5d} one-byte global loads: {name}")
        return 0 if counts and not any(counts.values()) else 1
    if "--widths" in sys.argv:
        with compile_only():
            same = width_invariant_ptx()
        for name, ok in same.items():
            print(f"{'same' if ok else 'DIFFERENT'} PTX at every table width: {name}")
        return 0 if same and all(same.values()) else 1
    failed = 0
    # every case for sm_90; then the float8 kernels' form for GPUs without float8 (an A100's float8 instructions do
    # not build: the library picks that form there) for sm_80
    for arch, only in ((90, ""), (80, NO_FP8)):
        with compile_only(arch):
            for name, thunk in cases():
                if only not in name:
                    continue
                try:
                    thunk()
                    print(f"ok      {name}{'' if arch == 90 else f' at sm_{arch}'}")
                except Exception:  # noqa: BLE001 - report every failure, then fail
                    failed += 1
                    print(f"FAILED  {name} at sm_{arch}\n{traceback.format_exc(limit=-3)}")
    print(f"{failed} failed" if failed else "all compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
