"""Patched Dense against unpatched on a real model (12 greedy tokens after 1500 essay tokens), Quest 1/8, unpatch.

python evaluation/results/real_models_cpu_2026-12-06/realcheck.py qwen   # or gemma
"""

import sys
import time

import torch

from evaluation.assets import load_essays, load_model
from hf_sparse_kv import patch_model, unpatch_model
from hf_sparse_kv.policies import Dense, Quest

torch.manual_seed(0)
name = {"qwen": "qwen2.5-coder-1.5b", "gemma": "gemma3-270m"}[sys.argv[1]]  # the PyPI assets (evaluation.assets)
t = time.time()
model, tok = load_model(name, dtype=torch.float32)
print("loaded", round(time.time() - t, 1), type(model).__name__, flush=True)
ids = tok(load_essays()[:12000], return_tensors="pt").input_ids[:, :1500]


def gen():
    with torch.no_grad():
        out = model.generate(ids, output_scores=True, return_dict_in_generate=True, max_new_tokens=12, do_sample=False)
    return out.sequences[0, ids.shape[1] :].tolist(), torch.stack(out.scores)


t = time.time()
base, bs = gen()
print("unpatched", base, round(time.time() - t, 1), flush=True)
patch_model(model, policy=Dense(), block_size=16)
d, ds = gen()
print("dense same tokens", d == base, "max |dlogit|", (ds - bs).abs().max().item(), flush=True)
patch_model(model, policy=Quest(budget=0.125), block_size=16)
q, _ = gen()
print("quest 1/8", q, "agree", sum(a == b for a, b in zip(q, base)), "/", len(base), flush=True)
unpatch_model(model)
u, us = gen()
print("unpatched again same", u == base, (us - bs).abs().max().item(), flush=True)
