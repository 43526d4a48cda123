"""A/B of the float8 scoring kernel on one machine: fa2e879's (codes as uint8 + bitcast, 93 registers), 5d70e54's
(codes as a float8 view, 65), the working tree's (a loop over `tiles` tiles a program, `num_stages` pipelined; at
tiles = 1 the same work as 5d70e54's) and the probe's kernel (per-channel scales, query converted outside), on the
same Llama-3-8B layer states (1 x 128K, 8 x 32K; CUDA graph of 4 layers, L2 flushed, median of 30); every output
compared with the float32 reference on the same codes."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks")); sys.path.insert(0, ".stage/ab")
import torch
import bench_decode as bd
import probe_fp8_keys as P
from common import bench, hbm_bandwidth
from hf_sparse_kv.ops import reference as R
from hf_sparse_kv.ops.triton import fp8 as NEW
import fp8_u8 as U8
import fp8_head as HEAD
DEV = os.environ.get("DEV", "cuda")
bd.DEV = DEV
cpu = DEV == "cpu"
hbm = hbm_bandwidth(DEV, 2**31 if not cpu else 2**20)
targets = [("smollm2", 1, 1024, [16], [16])] if cpu else bd.SELECTOR_TARGETS
print(f"copy {hbm:.0f} GB/s", flush=True)
VARIANTS = [("u8", U8, {}), ("head", HEAD, {}), ("new t1", NEW, {})]
for bm, w, t, st in ((8, 4, 2, 2), (8, 4, 4, 2), (8, 4, 4, 3), (8, 4, 8, 3), (4, 4, 4, 3), (4, 4, 8, 3), (16, 8, 2, 2), (16, 8, 4, 2)):
    VARIANTS.append((f"new bm{bm} w{w} t{t} s{st}", NEW, dict(block_m=bm, num_warps=w, tiles=t, num_stages=st)))
if cpu:
    VARIANTS = VARIANTS[:4]
rows = []
for model, B, L, _, _ in targets:
    layer = bd.Layer(model, B, L, 1 if cpu else 4)
    caches, bt = layer.paged(16)
    f8 = [R.fp8_code(c[0]) for c in caches]
    args = lambda i: (layer.q, f8[i][0], f8[i][1], bt, layer.seq_lens, layer.zero, layer.scale)
    ref = R.fp8_block_lse(*args(0))
    fin = torch.isfinite(ref)
    nbytes = f8[0][0].numel() + f8[0][1].numel() * 4
    for name, mod, kw in VARIANTS:
        out = mod.fp8_block_lse(*args(0), **kw)
        err = ((out - ref).abs()[fin].max() / ref.abs()[fin].max()).item()
        ok = torch.equal(torch.isinf(out), torch.isinf(ref)) and not out.isnan().any().item() and err < 2e-3
        us, _ = bench([lambda i=i: mod.fp8_block_lse(*args(i), **kw) for i in range(len(f8))], rep=30)
        rows.append((f"{B}x{L}", name, us, nbytes / us / 1e3 / hbm, err, ok, kw if mod is NEW else None))
        print(f"B={B} L={L} {name}: {us:.1f} us ({nbytes / us / 1e3 / hbm:.2f} of copy), err {err:.1e}, ok {ok}", flush=True)
    # the probe's kernel on the same codes (its per-channel scales all 1: the same bytes, the per-key scales unread)
    G = layer.q.shape[1] // f8[0][0].shape[1]
    qs, qh, ql, qinv = P.fp8_query(layer.q * layer.scale, torch.ones(f8[0][0].shape[1], layer.q.shape[2], device=DEV), G)
    k8s = [c[0].view(torch.float8_e4m3fn) for c in f8]
    us, _ = bench([lambda i=i: P.fp8_lse(qh, ql, qinv, k8s[i], bt, layer.seq_lens, G) for i in range(len(f8))], rep=30)
    rows.append((f"{B}x{L}", "probe (no key scales)", us, f8[0][0].numel() / us / 1e3 / hbm, float("nan"), True, None))
    print(f"B={B} L={L} probe: {us:.1f} us", flush=True)
    del layer, caches, f8, k8s
    if not cpu:
        torch.cuda.empty_cache()
print("\n| shape | kernel | us | of copy | rel err | ok |\n| - | - | - | - | - | - |")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.2f} | {r[4]:.1e} | {r[5]} |")

# the winner: the working tree's configuration with the least summed time relative to tiles = 1 over the shapes, if it
# is right everywhere and > 3 % faster than tiles = 1 at every shape; written for the calls after this one
shapes = sorted({r[0] for r in rows})
base = {r[0]: r[2] for r in rows if r[1] == "new t1"}
cands = {}
for r in rows:
    if r[6] is not None and r[1] != "new t1":
        cands.setdefault(r[1], []).append(r)
best = None
for name, rs in cands.items():
    if len(rs) == len(shapes) and all(r[5] and r[2] < 0.97 * base[r[0]] for r in rs):
        score = sum(r[2] / base[r[0]] for r in rs)
        if best is None or score < best[0]:
            best = (score, name, rs[0][6])
print("winner:", best and best[1], best and round(best[0] / len(shapes), 3))
if best:
    kw = best[2]
    os.makedirs(".stage/keep", exist_ok=True)
    with open(".stage/keep/fp8_winner.txt", "w") as f:
        f.write(f"{kw['block_m']} {kw['num_warps']} {kw['tiles']} {kw['num_stages']}\n")
