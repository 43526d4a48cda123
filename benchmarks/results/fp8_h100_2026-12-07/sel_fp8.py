"""Selection + attention per layer for Quest and Fp8BlockTopK at the two target shapes
(Llama-3-8B layer, bf16, 1/16, BS 16, L2 flushed, CUDA graph of 4 layers), states built as bench_decode builds them."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import torch
import bench_decode as bd
from common import bench, hbm_bandwidth
from hf_sparse_kv.ops import get_ops
from hf_sparse_kv.ops import reference as R
from hf_sparse_kv.policies import Fp8BlockTopK, QuantBlockTopK, Quest
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
    H, D = layer.H, layer.D
    ckeys = [c[0][..., :16].contiguous() for c in caches]  # unused by these three
    pc = bd.paged_args(layer, caches, bt)
    states = {
        "quest": bd.layer_states(layer, caches, bt, 16, ops, ckeys),
        
        "fp8": bd.layer_states(layer, caches, bt, 16, ops, ckeys, fp8=[R.fp8_code(c[0]) for c in caches]),
    }
    pols = {"quest": Quest(budget=1 / 16), "fp8": Fp8BlockTopK(budget=1 / 16)}
    for name, p in pols.items():
        st = states[name]
        sel = [lambda i=i: p.select(st[i]) for i in range(4)]
        both = [lambda i=i: ops.decode_blocks(*pc(i), (s := p.select(st[i])).indices, s.ex_lo, s.ex_hi, layer.scale) for i in range(4)]
        us_sel, _ = bench(sel, rep=30)
        us_all, _ = bench(both, rep=30)
        print(f"B={B} L={L} {name}: selection + attention {us_all:.1f} us, selection {us_sel:.1f} us", flush=True)
    del layer, caches, states
    torch.cuda.empty_cache() if DEV == "cuda" else None
