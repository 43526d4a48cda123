"""Screen: one layer's block selection reused by the next layer(s). Per window, every sparse layer's oracle (per KV
head) is compared with (a) its own selection pooled over its KV heads (one set of blocks for all heads), (b) the
previous sparse layer's pooled selection, (c) the previous layer's per-head selection (head h for head h).
Hit rate against the layer's per-head oracle, as selector_probe counts it."""
import sys, torch
from evaluation.selector_probe import capture, _head_mass, _pick
from evaluation.assets import load_model
from evaluation.suite import suite_text, windows_of
from evaluation.stats import t_interval
from hf_sparse_kv.ops.layout import cdiv, forced_block_mask
from hf_sparse_kv.policies import OracleBlockTopK

model_name, length, nwin = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model, tok = load_model(model_name, dtype=torch.float32)
texts = {n: suite_text(n) for n in ("essays", "kjv")}
wins = windows_of(tok, texts, length, nwin, {})
rows = {k: [] for k in ("own_pooled", "prev_pooled", "prev_head", "prev2_pooled")}
BS, sink, window, budget = 16, 4, 32, 1 / 16
for i, (text, w) in enumerate(wins):
    got = capture(model, torch.tensor([w]), 128, (0, 1))
    layers = sorted(got)
    sel = {}
    for L in layers:
        q, k, scale = got[L]
        S, T = q.shape[1], k.shape[1]
        pos = torch.arange(T - S, T)
        nb = cdiv(T, BS)
        lens = tuple(int(p) + 1 for p in pos)
        counts = OracleBlockTopK(budget=budget, sink=sink, window=window).plan(lens, BS)
        keep = torch.tensor(counts)
        seq = (pos + 1).int()
        forced = forced_block_mask(seq, torch.zeros_like(seq), sink, window, BS, nb)
        mass = _head_mass(q, k, scale, pos, BS).sum(2)  # [S, Hkv, NB]
        oracle = _pick(mass, keep, forced)
        # pooled over KV heads: each head's mass normalised to 1, summed; one set for all heads
        m = mass.clamp(min=0)
        pooled = (m / m.sum(-1, keepdim=True).clamp(min=1e-30)).sum(1, keepdim=True)
        pooled = pooled.masked_fill(mass[:, :1] == float("-inf"), float("-inf"))
        psel = _pick(pooled, keep, forced).expand_as(oracle)
        sel[L] = (oracle, psel, keep, forced)
    for j, L in enumerate(layers):
        oracle = sel[L][0]
        def hit(s):
            return float(((s & oracle).sum(-1).float() / oracle.sum(-1).clamp(min=1)).mean())
        rows["own_pooled"].append(hit(sel[L][1]))
        if j >= 1:
            rows["prev_pooled"].append(hit(sel[layers[j - 1]][1]))
            rows["prev_head"].append(hit(sel[layers[j - 1]][0]))
        if j >= 2:
            rows["prev2_pooled"].append(hit(sel[layers[j - 2]][1]))
    print(f"window {i} ({text}): " + ", ".join(f"{k} {sum(v[-len(layers)+2:])/len(v[-len(layers)+2:]):.3f}" for k, v in rows.items() if v), flush=True)
print(f"\n{model_name} {length}, {nwin} windows, hit rate vs each layer's per-head oracle at 1/16 (mean over layers and windows, 95% t over layer-windows)")
for k, v in rows.items():
    print(k, "%.3f [%.3f, %.3f]" % t_interval(v), len(v))
