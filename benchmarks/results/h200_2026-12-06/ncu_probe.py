"""Each selection kernel at 1 x 128K (Llama-3-8B layer), three launches each, for ncu."""
import sys, os
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import torch
from check_quant_keys import layer_inputs
from hf_sparse_kv.ops import get_ops
from hf_sparse_kv.ops import reference as R
dev = os.environ.get("DEV", "cuda")
ops = get_ops("triton", dev)
torch.manual_seed(0)
B, MB, H, G, D, BS = 1, int(os.environ.get("MB", 8200)), 8, 4, 128, 16
k_pool, table, lens, zero, q, scale, shape = layer_inputs(dev, B, MB, H, G, D, BS)
v_pool = torch.randn_like(k_pool)
kmin, kmax = k_pool.amin(2), k_pool.amax(2)
kmean = k_pool.float().mean(2).to(torch.bfloat16)
codes = R.quantize_keys(k_pool, kmin, kmax, 4)
K = MB // 16
for _ in range(3):
    qs = ops.quant_block_scores(q, codes, kmin, kmax, table, lens, zero, scale, 4, 4, 32)
for _ in range(3):
    s = ops.block_scores(q, kmin, kmax, kmean, table, lens, BS, "quest", zero, 4, 32)
for _ in range(3):
    sel = ops.topk_indices(s, K)
for _ in range(3):
    o = ops.decode_blocks(q, k_pool, v_pool, table, lens, zero, sel, zero, zero, scale)
torch.cuda.synchronize() if dev == "cuda" else None
print("ok", qs.shape, s.shape, sel.shape, o[0].shape if isinstance(o, tuple) else o.shape)
