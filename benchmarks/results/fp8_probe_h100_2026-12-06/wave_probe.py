"""Quest's scores (tiles a program) and the block attention (splits) around the one-wave point, 4 layers each."""
import sys, os, functools
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import torch
from common import bench, hbm_bandwidth
from hf_sparse_kv.ops import get_ops
from hf_sparse_kv.ops.triton.block_scores import block_scores
from hf_sparse_kv.ops.triton.block_decode import decode_blocks_fwd
dev = os.environ.get("DEV", "cuda")
small = dev == "cpu"
ops = get_ops("triton", dev)
H, G, D, BS = 8, 4, 128, 16
hbm = hbm_bandwidth(dev) if dev == "cuda" else 1.0
print("hbm", hbm, flush=True)
rows = []
for B, MB in ((1, 40), (2, 20)) if small else ((1, 8200), (8, 2050)):
    torch.manual_seed(0)
    L = 4 if not small else 1
    layers = []
    for _ in range(L):
        kp = torch.randn(B * MB, H, BS, D, device=dev).to(torch.bfloat16)
        vp = torch.randn_like(kp)
        layers.append((kp, vp, kp.amin(2), kp.amax(2), kp.float().mean(2).to(torch.bfloat16)))
    table = torch.arange(B * MB, device=dev, dtype=torch.int32).view(B, MB)
    lens = torch.tensor([MB * BS - 3 * i for i in range(B)], device=dev, dtype=torch.int32)
    zero = torch.zeros(B, dtype=torch.int32, device=dev)
    q = torch.randn(B, H * G, D, device=dev).to(torch.bfloat16)
    meta_bytes = 2 * B * MB * H * D * 2
    ref = block_scores(q, *layers[0][2:], table, lens, BS, "quest", zero, 4, 32)
    for tpp in (1, 2, 3, 4, 5, 6):
        for st in (2, 3):
            kw = dict(tiles_per_program=tpp, num_stages=st)
            out = block_scores(q, *layers[0][2:], table, lens, BS, "quest", zero, 4, 32, **kw)
            ok = torch.equal(out, ref)
            fns = [functools.partial(block_scores, q, *c[2:], table, lens, BS, "quest", zero, 4, 32, **kw) for c in layers]
            us, _ = bench(fns, rep=20)
            print(f"scores B={B} MB={MB} tpp={tpp} stages={st}: {us:.2f} us, {meta_bytes / us / 1e3 / hbm:.2f} of hbm, equal {ok}", flush=True)
    sel = ops.topk_indices(ref, MB // 16)
    kv_bytes = 2 * B * H * (MB // 16) * BS * D * 2
    o_ref, _ = decode_blocks_fwd(q, layers[0][0], layers[0][1], table, lens, zero, sel, zero, zero, D**-0.5)
    for S in ((2, 4) if small else (16, 24, 32, 40, 48, 56, 64, 96)):
        for nw, st in ((4, 2), (4, 3), (8, 2)):
            kw = dict(num_splits=S, num_warps=nw, num_stages=st)
            o, _ = decode_blocks_fwd(q, layers[0][0], layers[0][1], table, lens, zero, sel, zero, zero, D**-0.5, **kw)
            err = ((o.float() - o_ref.float()).abs().max() / o_ref.float().abs().max()).item()
            fns = [functools.partial(decode_blocks_fwd, q, c[0], c[1], table, lens, zero, sel, zero, zero, D**-0.5, **kw) for c in layers]
            us, _ = bench(fns, rep=20)
            print(f"attn B={B} MB={MB} splits={S} warps={nw} stages={st}: {us:.2f} us, {kv_bytes / us / 1e3 / hbm:.2f} of hbm, rel err {err:.1e}", flush=True)
