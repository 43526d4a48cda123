import time, torch, sys
from evaluation.assets import load_model, load_essays
from hf_sparse_kv import patch_model, unpatch_model
from hf_sparse_kv.policies import Dense, Quest
torch.manual_seed(0)
name = sys.argv[1]
path = {'qwen': '/root/.cache/hf_sparse_kv/models/qwen2.5-coder-1.5b-instruct-q4_k_m/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf',
        'gemma': '/root/.cache/hf_sparse_kv/models/gemma-3-270m-q4_k_m/gemma-3-270m-q4_k_m.gguf'}[name]
t = time.time(); model, tok = load_model(path, dtype=torch.float32); print('loaded', round(time.time() - t, 1), type(model).__name__, flush=True)
text = load_essays()[:12000]
ids = tok(text, return_tensors='pt').input_ids[:, :1500]
kw = dict(max_new_tokens=12, do_sample=False)
def gen():
    with torch.no_grad():
        out = model.generate(ids, output_scores=True, return_dict_in_generate=True, **kw)
    return out.sequences[0, ids.shape[1]:].tolist(), torch.stack(out.scores)
t = time.time(); base, bs = gen(); print('unpatched', base, round(time.time() - t, 1), flush=True)
patch_model(model, policy=Dense(), block_size=16)
d, ds = gen(); print('dense same tokens', d == base, 'max |dlogit|', (ds - bs).abs().max().item(), flush=True)
patch_model(model, policy=Quest(budget=0.125), block_size=16)
q, qs = gen(); print('quest 1/8', q, 'agree', sum(a == b for a, b in zip(q, base)), '/', len(base), flush=True)
unpatch_model(model)
u, us = gen(); print('unpatched again same', u == base, (us - bs).abs().max().item(), flush=True)
