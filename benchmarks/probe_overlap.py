"""Can the HBM idle while Quest selects be used to pull the layer's ``o_proj`` weight into L2? A probe, not a library
path (issue 14: Quest's step is 1.4-1.5x its floor; the selection's top-k runs on 8 SMs for ~18 us at 1 x 128K and
the whole selection + attention reads at a fraction of the bandwidth, while ``o_proj`` right after reads 33.5 MB).

Per layer of the Llama-3-8B shape (Quest 1/16, 16-token blocks; states built as ``bench_decode.py`` builds them; a
CUDA graph of 4 layers, each on its own cache and weight, L2 flushed by reads before each replay), µs a layer:

- ``mm``: ``o_proj`` alone (``x [B, 4096] @ W^T``, cuBLAS), and ``pf+mm``: a prefetch of ``W`` then ``mm`` on the
  same stream (what an L2-resident weight buys, and what the prefetch costs alone: ``pf``);
- ``chain``: selection, attention, ``mm``; ``chain+pf``: the same with the prefetch of ``W`` on a side stream
  forked before the selection and joined before ``mm``; the outputs must be equal (bit for bit).

Prefetch kernels: ``load`` (``probe_read_floor.py``'s bare read: programs read the weight in 8 KB rows and keep a
sum, loads with ``evict_last``) and ``asm`` (``prefetch.global.L2::evict_last`` per 128-byte line: no registers
wait), each at a few program counts (the top-k and attention need SMs too).

    python benchmarks/probe_overlap.py          # a GPU; on the CPU: a dry run of the states and the chain
"""

from __future__ import annotations

import os
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import bench_decode as bd
import torch
import triton
import triton.language as tl
from common import bench, hbm_bandwidth
from probe_read_floor import CHUNK, read_kernel

from hf_sparse_kv.policies import Quest


@triton.jit
def prefetch_asm_kernel(w, out, n_chunks, CHUNK: tl.constexpr):
    """Issue ``prefetch.global.L2::evict_last`` for each 128-byte line of ``w`` (64 bf16), lines strided by program."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    LINES: tl.constexpr = CHUNK // 64
    acc = tl.zeros([LINES], dtype=tl.int32)
    for c in range(pid, n_chunks, nprog):
        p = w + c.to(tl.int64) * CHUNK + tl.arange(0, LINES) * 64
        acc += tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [p], dtype=tl.int32, is_pure=False, pack=1
        )
    tl.store(out + pid, tl.sum(acc, 0).to(tl.float32))


def prefetcher(kind: str, nprog: int, w: torch.Tensor, out: torch.Tensor):
    """``load``: the read probe's bare read of ``w`` with ``evict_last`` loads; ``asm``: :func:`prefetch_asm_kernel`."""
    n_chunks = w.numel() // CHUNK
    assert w.numel() % CHUNK == 0 and w.numel() < 2**31 and w.is_contiguous()
    if kind == "load":
        return lambda: read_kernel[(nprog,)](w, out, n_chunks, CHUNK=CHUNK, EVICT="evict_last", num_warps=4)
    return lambda: prefetch_asm_kernel[(nprog,)](w, out, n_chunks, CHUNK=CHUNK, num_warps=4)


def probe_shape(ops, dev: str, model: str, B: int, L: int, variants) -> None:
    """Print every row of one shape (4 layers of the Llama-3-8B shape, or SmolLM2's head on the CPU) as it goes."""
    layer = bd.Layer(model, B, L, 4)
    caches, bt = layer.paged(16)
    ckeys = [c[0][..., :16].contiguous() for c in caches]
    pc = bd.paged_args(layer, caches, bt)
    st = bd.layer_states(layer, caches, bt, 16, ops, ckeys)
    pol = Quest(budget=1 / 16)
    hidden = layer.Hq * layer.D
    W = [torch.randn(hidden, hidden, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(4)]
    sink = torch.zeros(128, device=dev)
    side = torch.cuda.Stream() if dev == "cuda" else None
    # the step's write of one token (the last position again), serial or beside the selection on the side stream
    k_new = torch.randn(B, layer.H, 1, layer.D, device=dev, dtype=torch.bfloat16)
    pos0 = torch.full((B,), L - 1, dtype=torch.int32, device=dev)

    def beside(side_work, main_work):
        """``main_work()`` on the current stream while ``side_work()`` runs on the side stream, joined after."""
        main_s = torch.cuda.current_stream()
        side.wait_stream(main_s)
        with torch.cuda.stream(side):
            side_work()
        out = main_work()
        main_s.wait_stream(side)
        return out

    def decode(i, s):
        return ops.decode_blocks(*pc(i), s.indices, s.ex_lo, s.ex_hi, layer.scale)  # [B, Hq, D]

    def attend(i):
        return decode(i, pol.select(st[i]))

    def write(i):
        c = caches[i]
        ops.paged_write(c[0], c[1], c[2], c[3], c[4], bt, pos0, k_new, k_new)

    def write_attend(i, overlap=False):
        if overlap:
            return decode(i, beside(lambda: write(i), lambda: pol.select(st[i])))
        write(i)
        return attend(i)

    def chain(i, pf=None):
        o = attend(i) if pf is None else beside(pf[i], lambda: attend(i))
        return o.reshape(B, hidden) @ W[i].t()

    x = [attend(i).reshape(B, hidden) for i in range(4)]
    base = {
        "mm": bench([lambda i=i: x[i] @ W[i].t() for i in range(4)])[0],
        "attend": bench([lambda i=i: attend(i) for i in range(4)])[0],
        "chain": bench([lambda i=i: chain(i) for i in range(4)])[0],
        "write": bench([lambda i=i: write(i) for i in range(4)])[0],
        "write+attend": bench([lambda i=i: write_attend(i) for i in range(4)])[0],
    }
    if dev == "cuda":
        same_w = all(torch.equal(write_attend(i), write_attend(i, True)) for i in range(4))
        base["write|select,attend"] = bench([lambda i=i: write_attend(i, True) for i in range(4)])[0]
        print(f"  write beside the selection: same={same_w}", flush=True)
    print(f"B={B} L={L}: " + ", ".join(f"{k} {v:.1f} us" for k, v in base.items()), flush=True)
    ref = [chain(i) for i in range(4)]  # after the writes above (each writes the same token again)
    for kind, nprog in variants:
        pfs = [prefetcher(kind, nprog, W[i], sink) for i in range(4)]
        got = [chain(i, pfs) for i in range(4)]
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(got, ref))
        pf_us = bench(pfs)[0]
        pfmm_us = bench([lambda i=i: (pfs[i](), x[i] @ W[i].t()) for i in range(4)])[0]  # noqa: B023 - timed here
        ch_us = bench([lambda i=i: chain(i, pfs) for i in range(4)])[0]  # noqa: B023 - timed here
        print(
            f"  {kind:4s} x{nprog:3d}: pf {pf_us:6.1f}  pf+mm {pfmm_us:6.1f} (mm {base['mm']:.1f})  "
            f"chain+pf {ch_us:6.1f} (chain {base['chain']:.1f}, {ch_us - base['chain']:+.1f})  same={same}",
            flush=True,
        )


def main() -> None:
    dev, ops = bd.probe_ops()
    targets = bd.SELECTOR_TARGETS if dev == "cuda" else [("smollm2", 1, 256, [16], [16])]
    if dev == "cuda":
        print(f"{torch.cuda.get_device_name()}, copy {hbm_bandwidth(dev):.0f} GB/s", flush=True)
    variants = [("load", 16), ("load", 32), ("load", 66), ("asm", 8), ("asm", 16), ("asm", 32)]
    if dev == "cpu":
        variants = []  # the interpreter runs no inline PTX; the dry run checks the states and the chain
    for model, B, L, _, _ in targets:
        probe_shape(ops, dev, model, B, L, variants)
        if dev == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
