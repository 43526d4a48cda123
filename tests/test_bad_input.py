"""Every bad input raises a clear error naming the argument, and leaves the model unpatched."""

import pytest
import torch
from tiny_models import prompt, tiny_model
from transformers import BloomConfig, BloomForCausalLM, DynamicCache

from hf_sparse_kv import PagedKVCache, cache_kwarg, is_patched, patch_model, unpatch_model
from hf_sparse_kv.policies import BlockTopK, Dense, OracleBlockTopK, Quest, SinkWindow, TokenTopK


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("cls", [Quest, BlockTopK, OracleBlockTopK, TokenTopK])
@pytest.mark.parametrize(
    "budget,err",
    [
        (0, ValueError),
        (-5, ValueError),
        (0.0, ValueError),
        (1.5, ValueError),
        (-0.1, ValueError),
        ("1/8", TypeError),
        (True, TypeError),
    ],
)
def test_bad_budget(cls, budget, err):
    with pytest.raises(err, match="budget"):
        cls(budget=budget)


def test_bad_sink_window():
    with pytest.raises(ValueError, match="sink"):
        Quest(budget=64, sink=-1)
    with pytest.raises(ValueError, match="window"):
        SinkWindow(sink=4, window=0)
    with pytest.raises(ValueError, match="window"):
        SinkWindow(sink=4)
    with pytest.raises(ValueError, match="budget"):
        SinkWindow(sink=4, budget=2.0)


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        ({"block_size": 12}, ValueError, "block_size"),
        ({"block_size": 4}, ValueError, "block_size"),
        ({"block_size": 512}, ValueError, "block_size"),
        ({"block_size": 16.0}, ValueError, "block_size"),
        ({"mode": "sparse"}, ValueError, "mode"),
        ({"policy": "quest"}, TypeError, "policy"),
        ({"policy": Quest}, TypeError, "policy"),
        ({"policy": TokenTopK(budget=64), "mode": "block"}, ValueError, "mode='token'"),
        ({"dense_layers": (0, 3)}, ValueError, "dense_layers"),
        ({"dense_layers": (-1,)}, ValueError, "dense_layers"),
        ({"dense_layers": 1}, TypeError, "dense_layers"),
        ({"backend": "cuda"}, ValueError, "backend"),
        ({"cuda_graph": True, "policy": SinkWindow(sink=4, window=8, evict=True), "dense_layers": ()}, ValueError,
         "frees blocks"),
        ({"compile": "inductor"}, ValueError, "cuda_graph=True"),
        ({"compile": 3, "cuda_graph": True}, TypeError, "compile"),
        ({"crossover": "table.json"}, ValueError, "crossover"),
        ({"mode": "auto", "crossover": "/nonexistent/table.json"}, FileNotFoundError, "table.json"),
    ],
)  # fmt: skip
def test_bad_patch_arguments_leave_the_model_unpatched(model, kwargs, err, match):
    ids = prompt(12)
    with torch.no_grad():
        before = model(ids).logits
    with pytest.raises(err, match=match):
        patch_model(model, **kwargs)
    assert not is_patched(model)
    assert model.config._attn_implementation == "sdpa"
    assert all(not m._forward_pre_hooks for m in model.modules())
    assert "_prepare_cache_for_generation" not in vars(model) and "forward" not in vars(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_model_without_attention_interface():
    bloom = BloomForCausalLM(BloomConfig(n_layer=1, hidden_size=32, n_head=2, vocab_size=50))
    with pytest.raises(TypeError, match="AttentionInterface"):
        patch_model(bloom)
    assert not is_patched(bloom)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        patch_model(torch.nn.Linear(2, 2))


def test_output_attentions_refused(model):
    patch_model(model, policy=Dense())
    try:
        with pytest.raises(ValueError, match="output_attentions"):
            model(prompt(10), output_attentions=True)
        with pytest.raises(ValueError, match="output_attentions"), torch.no_grad():
            model.generate(prompt(10), max_new_tokens=2, output_attentions=True, return_dict_in_generate=True)
    finally:
        unpatch_model(model)


def test_foreign_cache_refused_with_advice(model):
    patch_model(model, policy=Dense())
    try:
        with pytest.raises(TypeError, match="PagedKVCache"), torch.no_grad():
            model.generate(prompt(10), max_new_tokens=2, **{cache_kwarg(model): DynamicCache(config=model.config)})
        with pytest.raises(TypeError, match="unpatch_model"), torch.no_grad():
            model(prompt(10), **{cache_kwarg(model): DynamicCache(config=model.config)})
    finally:
        unpatch_model(model)


def test_bad_cache_arguments(model):
    with pytest.raises(ValueError, match="block_size"):
        PagedKVCache(model.config, block_size=24)
    with pytest.raises(ValueError, match="backend"):
        PagedKVCache(model.config, backend="tpu").update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), 0)


def test_mask_with_holes_is_refused(model):
    patch_model(model, policy=Quest(budget=8, sink=0, window=8), block_size=8, dense_layers=())
    try:
        ids = prompt(20)
        mask = torch.ones_like(ids)
        mask[0, 5] = 0
        with pytest.raises(NotImplementedError, match="holes inside the context"), torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=2)
    finally:
        unpatch_model(model)


@pytest.mark.parametrize("policy", [Dense(), Quest(budget=8, sink=0, window=8)], ids=["dense", "quest"])
def test_a_right_padded_batch_is_told_to_pad_on_the_left(model, policy):
    patch_model(model, policy=policy, block_size=8, dense_layers=())
    try:
        ids = prompt(20, batch=2)
        mask = torch.ones_like(ids)
        mask[1, 15:] = 0  # the second prompt is 15 tokens long, padded on the right
        with pytest.raises(NotImplementedError, match="padded on the right.*padding_side = 'left'"), torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0)
        mask = torch.ones_like(ids)
        mask[1, :5] = 0  # the same prompt padded on the left decodes
        with torch.no_grad():
            assert model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0).shape == (2, 22)
    finally:
        unpatch_model(model)


@pytest.mark.parametrize("layers,expected", [(1, (0,)), (3, (0, 1))])
def test_default_dense_layers_fit_the_model(layers, expected):
    """The default keeps the first two layers dense, or the only one of a one-layer model (not refused)."""
    from hf_sparse_kv.patched import patch_state

    small = tiny_model("llama", num_hidden_layers=layers)
    patch_model(small, policy=Quest(budget=8, sink=0, window=8), block_size=8)
    try:
        assert patch_state(small).config.dense_layers == expected
        with torch.no_grad():
            out = small.generate(prompt(20), max_new_tokens=2, do_sample=False)
        assert out.shape == (1, 22)
    finally:
        unpatch_model(small)


def test_a_patch_that_leaves_no_layer_to_the_policy_warns():
    """Every full-attention layer in dense_layers (or none paged: all sliding): decoding stays dense, said once at
    patching; a patch with a layer left to the policy, or a Dense one, says nothing."""
    import warnings

    cases = [
        (tiny_model("llama", num_hidden_layers=2), Quest(budget=64), {}, True),  # the default keeps both dense
        (tiny_model("mistral"), Quest(budget=64), {"dense_layers": ()}, True),  # every layer slides (window 24)
        (tiny_model("llama"), Quest(budget=64), {}, False),
        (tiny_model("llama", num_hidden_layers=2), Dense(), {}, False),
    ]
    for small, policy, kw, warns in cases:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            patch_model(small, policy=policy, **kw)
        unpatch_model(small)
        assert any("no layer of" in str(w.message) for w in seen) == warns, (type(small).__name__, policy, kw)
