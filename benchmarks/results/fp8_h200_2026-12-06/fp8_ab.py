"""A/B of the float8 scoring kernel: HEAD's (pointer built [BM, BS] and reshaped) vs the working tree's (rows one by
one), and the probe's kernel, on the same Llama-3-8B layer states (1 x 128K, 8 x 32K; CUDA graph of 4 layers, L2
flushed); outputs compared with each other and the reference."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks")); sys.path.insert(0, ".stage")
import torch
import bench_decode as bd
from common import bench, hbm_bandwidth
from hf_sparse_kv.ops import get_ops
from hf_sparse_kv.ops import reference as R
from hf_sparse_kv.ops.triton import fp8 as NEW
import fp8_old as OLD
DEV = os.environ.get("DEV", "cuda")
bd.DEV = DEV
ops = get_ops("triton", DEV)
hbm = hbm_bandwidth(DEV, 2**31 if DEV == "cuda" else 2**20)
if DEV == "cpu":
    bd.SELECTOR_TARGETS = [("smollm2", 1, 1024, [16], [16])]
print(f"copy {hbm:.0f} GB/s", flush=True)
for model, B, L, _, _ in bd.SELECTOR_TARGETS:
    layer = bd.Layer(model, B, L, 4)
    caches, bt = layer.paged(16)
    f8 = [R.fp8_code(c[0]) for c in caches]
    args = lambda i: (layer.q, f8[i][0], f8[i][1], bt, layer.seq_lens, layer.zero, layer.scale)
    ref = R.fp8_block_lse(*args(0))
    for name, mod in (("old", OLD), ("new", NEW)):
        out = mod.fp8_block_lse(*args(0))
        fin = torch.isfinite(ref)
        err = ((out - ref).abs()[fin].max() / ref.abs()[fin].max()).item()
        same_inf = torch.equal(torch.isinf(out), torch.isinf(ref))
        for bm, w in ((8, 4), (4, 4), (16, 8)):
            us, _ = bench([lambda i=i: mod.fp8_block_lse(*args(i), block_m=bm, num_warps=w) for i in range(4)], rep=30)
            nbytes = f8[0][0].numel() + f8[0][1].numel() * 4
            print(f"B={B} L={L} {name} BM={bm} w={w}: {us:.1f} us ({nbytes / us / 1e3 / hbm:.2f} of copy), err {err:.1e}, inf pattern {same_inf}", flush=True)
    del layer, caches, f8
    torch.cuda.empty_cache() if DEV == "cuda" else None
