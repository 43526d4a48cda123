"""How fast can a kernel read what one layer of Quest's selection and attention reads? A probe, not a library path
(issue 14: at 1 x 128K Quest's scores read their ~34 MB of min / max at ~0.5 of the copy bandwidth and the block
attention its ~34 MB of selected K / V at ~0.4-0.5; the floors in RESULTS.md divide by the bandwidth of a 2 GB copy,
which a 34 MB read may not reach at all).

Per layer of the Llama-3-8B shape (Quest 1/16, 16-token blocks; states as ``bench_decode.py`` builds them; a CUDA
graph of 4 layers, each on its own memory, L2 flushed by reads before each replay), µs a layer and GB/s:

- ``read``: the layer's min / max bytes read contiguously by a bare Triton kernel (a sum per program, nothing else),
  at a few program counts; ``sum``: the same bytes through ``torch.sum``;
- ``gather``: the K / V tiles of a fixed Quest selection read through the block table as the attention reads them
  (same tiles, same split of the work, a sum per program instead of the softmax);
- ``scores``, ``topk``, ``attention``: the library's kernels on the same states and the same fixed selection.

If ``read`` and ``gather`` come close to ``scores`` and ``attention``, a ~34 MB read costs that much whatever the
kernel does, and the per-layer gap to the floor is the size's, not the kernels'.

    python benchmarks/probe_read_floor.py          # a GPU; on the CPU: a dry run of every row at a small shape
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

from hf_sparse_kv.policies import Quest

CHUNK = 4096  # elements a program reads per step of ``read_kernel`` (8 KB of bf16)


@triton.jit
def read_kernel(x, out, n_chunks, CHUNK: tl.constexpr, EVICT: tl.constexpr = ""):
    """Read ``x`` (under 2**31 elements) ``CHUNK`` at a time, chunks strided by the program count; a sum per program.

    ``EVICT``: the loads' L2 eviction policy (``probe_overlap.py`` prefetches a weight with ``"evict_last"``)."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for c in range(pid, n_chunks, nprog):
        acc += tl.load(x + c * CHUNK + tl.arange(0, CHUNK), eviction_policy=EVICT).to(tl.float32)
    tl.store(out + pid, tl.sum(acc, 0))


@triton.jit
def gather_kernel(
    k_pool, v_pool, blocks, block_table, out, K, MB, s_kn, H, n_tiles, BS: tl.constexpr, BN: tl.constexpr,
    D: tl.constexpr,
):  # fmt: skip
    """Read the selected ``[BS, D]`` K and V tiles of one (sequence, KV head) as ``block_decode`` walks them.

    Program (split, b * H + h) reads tiles ``split, split + n_splits, ...`` of ``BN`` rows; ``blocks`` ``[B, H, K]``
    logical block ids, ``block_table`` ``[B, MB]``, pools ``[blocks, H, BS, D]``; one float32 sum per program.
    """
    i_s, i_bh = tl.program_id(0), tl.program_id(1)
    n_splits = tl.num_programs(0)
    i_b, i_h = i_bh // H, i_bh % H
    o_d = tl.arange(0, D)
    acc = tl.zeros([BN, D], dtype=tl.float32)
    for i_t in range(i_s, n_tiles, n_splits):
        o_f = i_t * BN + tl.arange(0, BN)
        b_lb = tl.load(blocks + i_bh * K + o_f // BS, mask=o_f // BS < K, other=-1)
        m_n = b_lb >= 0  # [BN] rows of a selected block (a hole, -1, or past K: none)
        b_phys = tl.load(block_table + i_b * MB + tl.maximum(b_lb, 0))
        o_kv = b_phys.to(tl.int64) * s_kn + (i_h * BS + o_f % BS) * D
        p = o_kv[:, None] + o_d[None, :]
        acc += tl.load(k_pool + p, mask=m_n[:, None], other=0.0).to(tl.float32)
        acc += tl.load(v_pool + p, mask=m_n[:, None], other=0.0).to(tl.float32)
    tl.store(out + i_bh * n_splits + i_s, tl.sum(tl.sum(acc, 1), 0))


def probe_shape(ops, dev: str, model: str, B: int, L: int, read_programs, splits, copy_gbs: float) -> None:
    """Print every row of one shape as it goes: µs a layer, and GB/s over the bytes the row must read."""
    layer = bd.Layer(model, B, L, 4)
    caches, bt = layer.paged(16)
    ckeys = [c[0][..., :16].contiguous() for c in caches]
    st = bd.layer_states(layer, caches, bt, 16, ops, ckeys)
    pol = Quest(budget=1 / 16)
    scores = [pol.scores(st[i]) for i in range(4)]
    sel = [pol.select(st[i]) for i in range(4)]
    K = sel[0].indices.shape[-1]
    meta = [torch.cat([c[2].reshape(-1), c[3].reshape(-1)]) for c in caches]  # the min / max bytes, contiguous
    meta_bytes = meta[0].numel() * 2
    kv_bytes = B * layer.H * K * 16 * layer.D * 2 * 2
    sink = torch.zeros(4096, device=dev)

    def show(name: str, us: float, nbytes: int) -> None:
        gbs = nbytes / (us * 1e-6) / 1e9
        print(f"  {name:28s} {us:7.1f} us  {gbs:6.0f} GB/s  {gbs / copy_gbs:5.2f} of the copy", flush=True)

    print(f"B={B} L={L}: min/max {meta_bytes / 1e6:.1f} MB a layer, selected K/V {kv_bytes / 1e6:.1f} MB", flush=True)
    n_chunks = meta[0].numel() // CHUNK
    assert meta[0].numel() % CHUNK == 0

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:  # a read that reads what it should
        err = abs(float(got.sum()) - float(want)) / max(abs(float(want)), 1.0)
        assert err < 1e-3, f"{name}: sum {float(got.sum())} against {float(want)}"

    for nprog in read_programs:
        read_kernel[(nprog,)](meta[0], sink, n_chunks, CHUNK=CHUNK, num_warps=4)
        check(f"read x{nprog}", sink[:nprog], meta[0].float().sum())
        fns = [
            lambda i=i, n=nprog: read_kernel[(n,)](meta[i], sink, n_chunks, CHUNK=CHUNK, num_warps=4) for i in range(4)
        ]
        show(f"read x{nprog}", bench(fns)[0], meta_bytes)
    show("sum (torch)", bench([lambda i=i: meta[i].sum() for i in range(4)])[0], meta_bytes)
    show("scores (library)", bench([lambda i=i: pol.scores(st[i]) for i in range(4)])[0], meta_bytes)
    w = scores[0].shape[-1]
    show("topk (library)", bench([lambda i=i: ops.topk_indices(scores[i], K) for i in range(4)])[0], 0)
    show("select (library)", bench([lambda i=i: pol.select(st[i]) for i in range(4)])[0], meta_bytes)
    BN = 128
    n_tiles = triton.cdiv(K * 16, BN)
    MB = bt.shape[1]
    phys = bt.long().gather(1, sel[0].indices.long().clamp(min=0).flatten(1)).view(B, layer.H, K)  # [B, H, K]
    heads = torch.arange(layer.H, device=dev)[None, :, None]
    held = (sel[0].indices >= 0)[..., None, None]  # [B, H, K, 1, 1]
    want_kv = sum((caches[0][j][phys, heads].float() * held).sum() for j in (0, 1))  # [B, H, K, BS, D] each
    for s in sorted({min(n, n_tiles) for n in splits}):  # a split count past the tile count runs as that count
        part = torch.zeros(B * layer.H * s, device=dev)

        def gather(i, s=s, part=part):
            c = caches[i]
            gather_kernel[(s, B * layer.H)](
                c[0], c[1], sel[i].indices, bt, part, K, MB, c[0].stride(0), layer.H, n_tiles, BS=16, BN=BN, D=layer.D,
                num_warps=4,
            )  # fmt: skip

        gather(0)
        check(f"gather x{s}", part, want_kv)
        show(f"gather x{s} splits", bench([lambda i=i: gather(i) for i in range(4)])[0], kv_bytes)
    q, scale = layer.q, layer.scale

    def attend(i):
        c, s = caches[i], sel[i]
        return ops.decode_blocks(q, c[0], c[1], bt, layer.seq_lens, layer.zero, s.indices, s.ex_lo, s.ex_hi, scale)

    show("attention (library)", bench([lambda i=i: attend(i) for i in range(4)])[0], kv_bytes)
    print(f"  (scores width {w}, top-k {K} a row)", flush=True)


def main() -> None:
    dev, ops = bd.probe_ops()
    if dev == "cuda":
        copy = hbm_bandwidth(dev)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        print(f"{torch.cuda.get_device_name()}, copy {copy:.0f} GB/s, {sms} SMs", flush=True)
        targets = [(m, B, L) for m, B, L, _, _ in bd.SELECTOR_TARGETS]
        programs, splits = [sms, 2 * sms, 4 * sms, 8 * sms], [8, 16, 32, 64]
    else:
        copy, targets, programs, splits = 1.0, [("smollm2", 1, 1024)], [2], [2]
    for model, B, L in targets:
        probe_shape(ops, dev, model, B, L, programs, splits, copy)
        if dev == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
