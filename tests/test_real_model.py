"""One real-model test: SmolLM2-135M from its PyPI asset on a real 2K-token essay prompt."""

from pathlib import Path

import pytest
import torch

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.patched import STATE_ATTR
from hf_sparse_kv.policies import Dense, Quest

pytestmark = [pytest.mark.slow, pytest.mark.network]


@pytest.fixture(scope="module")
def smollm2(smollm2_fp32):
    from evaluation.text import essay_tokens

    model, tok = smollm2_fp32  # loaded once for the session (conftest)
    ids = torch.tensor([essay_tokens(tok, 2048, offset=1000)])
    return model, ids


def _greedy(model, ids, n):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, ids.shape[1] :]


def _teacher_forced_argmax(model, ids, continuation):
    """The patched model's next-token argmax at each position of ``continuation``, fed one token at a time."""
    cache = PagedKVCache(model.config)
    with torch.no_grad():
        preds = [model(ids, **{cache_kwarg(model): cache}).logits[0, -1].argmax()]
        for token in continuation[:-1]:
            preds.append(model(token.view(1, 1), **{cache_kwarg(model): cache}).logits[0, -1].argmax())
    return torch.stack(preds)


def test_smollm2_dense_and_quest(smollm2):
    model, ids = smollm2
    ref = _greedy(model, ids, 16)
    patch_model(model, policy=Dense(), mode="block")
    dense = _greedy(model, ids, 16)
    patch_model(model, policy=Quest(budget=0.25), mode="block")
    free = _greedy(model, ids, 16)
    forced = _teacher_forced_argmax(model, ids, ref)
    unpatch_model(model)
    assert torch.equal(dense, ref)
    free_agree = (free == ref).float().mean().item()
    forced_agree = (forced == ref).float().mean().item()
    print(
        f"\nSmolLM2, 2K essay prompt, Quest(budget=0.25) block mode vs dense over 16 new tokens: "
        f"next-token agreement {forced_agree:.0%} (same prefix), free-running greedy agreement {free_agree:.0%}"
    )
    assert forced_agree >= 0.75
    assert torch.equal(_greedy(model, ids, 4), ref[:4])  # unpatched again


def test_smollm2_merged_projections_generate_the_same_tokens(smollm2):
    """The real model loaded from GGUF merges (its q/k/v and gate/up are plain linears): every group merged, the same
    greedy tokens as unmerged under Quest, and unpatching gives back the same weights."""
    model, ids = smollm2
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    patch_model(model, policy=Quest(budget=0.25), mode="block")
    ref = _greedy(model, ids, 16)
    patch_model(model, policy=Quest(budget=0.25), mode="block", merge_projections=True)
    groups = len(getattr(model, STATE_ATTR).merged)
    merged = _greedy(model, ids, 16)
    unpatch_model(model)
    assert groups == 2 * model.config.num_hidden_layers
    assert torch.equal(merged, ref)
    assert all(torch.equal(p, before[k]) for k, p in model.named_parameters())


def test_a_dequantized_copy_loads_what_the_gguf_loads(tmp_path, monkeypatch):
    """With ``$HF_SPARSE_KV_DEQUANTIZED`` set, the first load of a GGUF asset keeps it de-quantized there and the
    next one loads that copy instead of the GGUF file: the same weights bit for bit, the same tokens, the same
    logits; another dtype names another copy; loading options other than the defaults bypass it."""
    import transformers

    from evaluation import assets

    monkeypatch.setenv(assets.DEQUANT_ENV, str(tmp_path))
    sources = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def recording(source, *args, **kwargs):
        sources.append((Path(source), kwargs.get("gguf_file")))
        return real(source, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", recording)
    first, tok1 = assets.load_model("smollm2")
    kept = [p for p in tmp_path.iterdir()]
    assert len(kept) == 1 and (kept[0] / assets.MARKER).is_file() and sources[-1][1] is not None
    second, tok2 = assets.load_model("smollm2")
    assert sources[-1] == (kept[0], None)  # from the kept copy, not the GGUF file
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c1, c2 = first.config.to_dict(), second.config.to_dict()
    differ = {k for k in c1.keys() | c2.keys() if c1.get(k) != c2.get(k)}
    assert differ <= {"_name_or_path", "quantization_config"}, differ  # the GGUF load's marker is not kept
    text = "The quick brown fox jumps over the lazy dog. 1234 ünïcödé\n\tdef f(x): return x"
    ids = tok1.encode(text)
    assert tok2.encode(text) == ids and tok2.decode(ids) == tok1.decode(ids)
    assert tok2.eos_token_id == tok1.eos_token_id and tok2.bos_token_id == tok1.bos_token_id
    with torch.no_grad():
        x = torch.tensor([ids])
        assert torch.equal(first(x).logits, second(x).logits)
    gguf = sources[0][0] / sources[0][1]
    assert assets.dequantized_dir(gguf, torch.bfloat16) != kept[0] == assets.dequantized_dir(gguf, torch.float32)
    # other loading options: from the GGUF file, nothing kept (the loads stood in for: what they are asked matters)
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", lambda source, **kw: sources.append(kw) or first
    )
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda source, **kw: tok1)
    assets.load_model("smollm2", low_cpu_mem_usage=True)
    assert sources[-1]["gguf_file"] and len(list(tmp_path.iterdir())) == 1
    monkeypatch.delenv(assets.DEQUANT_ENV)
    assert assets.dequantized_dir(gguf, torch.float32) is None
