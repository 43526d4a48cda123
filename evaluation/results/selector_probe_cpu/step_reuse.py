"""Screen: a selection reused for the next decode steps. For each scored query at position p and each reuse distance
r, the blocks are ranked by the query at p - r (the exact oracle's mass, or the float8 keys' mass), with p's own
forced blocks (sink, window) and count: hit rate against p's per-head oracle, as selector_probe counts it."""
import sys, torch
from evaluation.selector_probe import capture, _head_mass, _pick, PerKey
from evaluation.assets import load_model
from evaluation.suite import suite_text, windows_of
from evaluation.stats import t_interval
from hf_sparse_kv.ops.layout import cdiv, forced_block_mask
from hf_sparse_kv.policies import OracleBlockTopK

model_name, length, nwin = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
R = (0, 1, 2, 4, 8, 16)
model, tok = load_model(model_name, dtype=torch.float32)
texts = {n: suite_text(n) for n in ("essays", "kjv")}
wins = windows_of(tok, texts, length, nwin, {})
rows = {(kind, r): [] for kind in ("exact", "fp8") for r in R}
recs = {r: [] for r in R}
BS, sink, window, budget, S = 16, 4, 32, 1 / 16, 128
fp8 = PerKey("fp8", meta=4)
for i, (text, w) in enumerate(wins):
    got = capture(model, torch.tensor([w]), S, (0, 1))
    sums = {key: [] for key in rows}
    rsum = {r: [] for r in R}
    for L, (q, k, scale) in got.items():
        T = k.shape[1]
        pos = torch.arange(T - S, T)
        nb = cdiv(T, BS)
        lens = tuple(int(p) + 1 for p in pos)
        keep = torch.tensor(OracleBlockTopK(budget=budget, sink=sink, window=window).plan(lens, BS))
        seq = (pos + 1).int()
        forced = forced_block_mask(seq, torch.zeros_like(seq), sink, window, BS, nb)
        hm = _head_mass(q, k, scale, pos, BS)  # [S, Hkv, G, NB]
        exact = hm.sum(2)  # [S, Hkv, NB]
        approx = _head_mass(q, fp8(k.transpose(0, 1), BS).transpose(0, 1), scale, pos, BS).sum(2)
        oracle = _pick(exact, keep, forced)[max(R):]
        live = exact[max(R):] > float("-inf")
        for kind, mass in (("exact", exact), ("fp8", approx)):
            for r in R:
                old = mass[max(R) - r : S - r]  # ranked by the query r steps before
                # blocks the old query could not see yet are inside the new query's forced window (r <= window)
                old = torch.where(live & (old == float("-inf")), torch.zeros_like(old), old)
                sel = _pick(old.masked_fill(~live, float("-inf")), keep[max(R):], forced[max(R):])
                hit = (sel & oracle).sum(-1).float() / oracle.sum(-1).clamp(min=1)
                sums[(kind, r)].append(float(hit.mean()))
                if kind == "exact":  # the dense softmax mass inside the reused blocks, the group's heads averaged
                    rsum[r].append(float((hm[max(R):].clamp(min=0) * sel.unsqueeze(2)).sum(-1).mean()))
    for key, v in sums.items():
        rows[key].append(sum(v) / len(v))
    for r, v in rsum.items():
        recs[r].append(sum(v) / len(v))
    print(f"window {i} ({text}): " + ", ".join(f"{k}{r} {rows[(k, r)][-1]:.3f}" for k, r in rows), flush=True)
print(f"\n{model_name} {length}, {nwin} windows, last {S - max(R)} of {S} scored queries, hit rate vs each step's per-head oracle at 1/16 [95 % t over windows]")
for (kind, r), v in rows.items():
    print(f"| {kind} | {r} | %.3f [%.3f, %.3f] |" % t_interval(v))
print("recall (dense mass inside the exact oracle's blocks chosen r steps before) [95 % t over windows]")
for r, v in recs.items():
    print(f"| recall | {r} | %.3f [%.3f, %.3f] |" % t_interval(v))
