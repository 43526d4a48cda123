"""Architectures beyond tests/tiny_models.py: one that takes its cache under another name (GPT-NeoX's
``layer_past``) runs through the sparse attention instead of staying dense unseen; attentions whose softmax the
kernels do not compute (GPT-OSS's learned sinks, Gemma-2's soft-capped logits) are refused at patching, the model
left as it was."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import COMMON

from hf_sparse_kv import PagedKVCache, cache_kwarg, is_patched, patch_model, unpatch_model
from hf_sparse_kv.policies import Dense, Quest

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(name: str, **overrides):
    torch.manual_seed(0)
    config = getattr(transformers, f"{name}Config")(**{**COMMON, **overrides})
    return getattr(transformers, f"{name}ForCausalLM")(config).eval()


def _greedy_logits(model, ids, cache=None):
    kw = {} if cache is None else {cache_kwarg(model): cache}
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **kw)  # fmt: skip
    return out.sequences, torch.stack(out.logits)


def test_gpt_neox_takes_the_sparse_path():
    """GPT-NeoX hands its attention the cache as ``layer_past``: patched, its decode steps run the policy (they are
    counted), Dense equals the unpatched model, and a small Quest budget changes the logits."""
    model = _tiny("GPTNeoX")
    ids = torch.randint(3, 90, (1, 120), generator=torch.Generator().manual_seed(1))
    ref_tokens, ref = _greedy_logits(model, ids)
    patch_model(model, policy=Dense(), block_size=16, dense_layers=())
    try:
        cache = PagedKVCache(model.config, block_size=16)
        tokens, dense = _greedy_logits(model, ids, cache)
        assert cache.decode_steps == 5 and cache.kv_bytes_read > 0
        assert torch.equal(tokens, ref_tokens)
        torch.testing.assert_close(dense, ref, rtol=1e-5, atol=1e-5)
        patch_model(model, policy=Quest(budget=32, sink=4, window=8), block_size=16, dense_layers=())
        cache = PagedKVCache(model.config, block_size=16)
        _, sparse = _greedy_logits(model, ids, cache)
        assert cache.decode_steps == 5 and not torch.allclose(sparse, ref, atol=1e-4)
    finally:
        unpatch_model(model)


@pytest.mark.parametrize(
    "name,overrides,match",
    [
        ("GptOss", {}, "sinks"),
        ("Gemma2", {"head_dim": 16}, "soft-caps"),
    ],
)
def test_attention_the_kernels_do_not_compute_is_refused(name, overrides, match):
    model = _tiny(name, **overrides)
    attn = model.config._attn_implementation
    ids = torch.randint(3, 90, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(ids).logits
    with pytest.raises(TypeError, match=match):
        patch_model(model, policy=Quest(budget=32, sink=4, window=8))
    assert not is_patched(model) and model.config._attn_implementation == attn
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_gemma2_without_soft_capping_patches():
    model = _tiny("Gemma2", head_dim=16, attn_logit_softcapping=None)
    patch_model(model, policy=Dense(), block_size=16, dense_layers=())
    assert is_patched(model)
    unpatch_model(model)


def test_an_attention_taking_its_cache_under_an_unknown_name_is_refused():
    """An attention whose forward names its cache otherwise would never see the paged cache (and attend densely,
    silently): refused."""
    model = _tiny("Llama")
    attention = model.model.layers[1].self_attn
    original = type(attention)

    class RenamedAttention(original):
        def forward(self, hidden_states, position_embeddings, attention_mask=None, kv_store=None, **kwargs):
            return super().forward(hidden_states, position_embeddings, attention_mask, kv_store, **kwargs)

    attention.__class__ = RenamedAttention
    with pytest.raises(TypeError, match="takes its cache under none of"):
        patch_model(model, policy=Dense())
    assert not is_patched(model)
