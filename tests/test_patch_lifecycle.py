"""A patched model's life beside other code (found by a review, 2026-12-07): a cache filled while patched continues
right under another attention, a refused crop changes nothing, the instance's own ``forward`` (accelerate's hooks, a
user's wrapper) survives patching and comes back on unpatching, a one-token prompt decodes under SnapKV, and a
patched model pickles."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from tiny_models import prompt, tiny_model
from transformers import DynamicCache

from hf_sparse_kv import PagedKVCache, cache_kwarg, is_patched, patch_model, unpatch_model
from hf_sparse_kv.policies import Dense, Quest, SinkWindow, SnapKV


def _continue(model, cache, ids):
    with torch.no_grad():
        return model(ids, use_cache=True, **{cache_kwarg(model): cache}).logits


@pytest.mark.parametrize("then", ["unpatch", "sdpa"])
def test_a_cache_filled_while_patched_continues_under_another_attention(then):
    """After a patched prefill the cache hands the next forward's attention the whole context: before, the first
    write left each layer's "read the pages yourself" flag set, so an attention that was not the patched one (after
    ``unpatch_model`` or ``set_attn_implementation``) got the new token's K / V only: wrong logits, no error."""
    ref, model = tiny_model("llama"), tiny_model("llama")
    ids, nxt = prompt(30), prompt(1, seed=3)
    want_cache = DynamicCache(config=ref.config)
    _continue(ref, want_cache, ids)
    want = _continue(ref, want_cache, nxt)
    patch_model(model, policy=Dense())
    cache = PagedKVCache(model.config)
    _continue(model, cache, ids)
    if then == "unpatch":
        unpatch_model(model)
    else:
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(_continue(model, cache, nxt), want, rtol=1e-5, atol=1e-5)
    unpatch_model(model)


def _gemma_filled(tokens: int):
    """A tiny Gemma-3 patched under Dense and an unpatched twin, each prefilled with the same batch of 2 x
    ``tokens``: ``(model, its PagedKVCache, the twin, its DynamicCache)``."""
    ref, model = tiny_model("gemma3"), tiny_model("gemma3")
    patch_model(model, policy=Dense(), dense_layers=())
    ids = prompt(tokens, batch=2)
    cache, want_cache = PagedKVCache(model.config), DynamicCache(config=ref.config)
    _continue(model, cache, ids)
    _continue(ref, want_cache, ids)
    return model, cache, ref, want_cache


def test_a_crop_that_a_sliding_layer_refuses_changes_nothing():
    """Gemma-3's sliding-window layers (transformers' own) cannot crop past their window: the crop raises as
    transformers' ``DynamicCache`` does, and the pages, table and lengths stay as they were (before, the paged
    layers' blocks were released first, and the next write took another sequence's recycled block)."""
    model, cache, ref, want_cache = _gemma_filled(40)
    rows, lengths = [list(r) for r in cache.table.rows], [layer.get_seq_length() for layer in cache.layers]
    for c in (want_cache, cache):
        with pytest.raises(RuntimeError, match="does not track past states"):
            c.crop(-10)
    assert [list(r) for r in cache.table.rows] == rows
    assert [layer.get_seq_length() for layer in cache.layers] == lengths
    nxt = prompt(1, batch=2, seed=9)
    torch.testing.assert_close(_continue(model, cache, nxt), _continue(ref, want_cache, nxt), rtol=1e-5, atol=1e-5)
    unpatch_model(model)


def test_a_batch_of_another_size_is_refused_before_any_layer_runs():
    """A filled cache given a batch of another size raises the cache's ``ValueError`` before any layer runs, Gemma-3
    too (before, its first layer, transformers' sliding window, failed first with a raw ``torch.cat`` size error), and
    the cache then continues its own batch as if nothing happened."""
    model, cache, ref, want_cache = _gemma_filled(30)
    lengths = [layer.get_seq_length() for layer in cache.layers]
    with pytest.raises(ValueError, match="holds 2 sequences but got a batch of 1"):
        _continue(model, cache, prompt(3, batch=1, seed=4))
    assert [layer.get_seq_length() for layer in cache.layers] == lengths
    nxt = prompt(1, batch=2, seed=9)
    torch.testing.assert_close(_continue(model, cache, nxt), _continue(ref, want_cache, nxt), rtol=1e-5, atol=1e-5)
    unpatch_model(model)


def test_the_instance_forward_survives_patching_and_comes_back():
    """accelerate's hooks wrap ``forward`` on the instance: patching kept calling it (before, patching dropped it and
    unpatching never brought it back: a dispatched model's hooks stopped running), through a re-patch, with and
    without ``cuda_graph``, and unpatching restores it."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    calls = []

    class Count(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append(1)
            return args, kwargs

    model = tiny_model("llama")
    add_hook_to_module(model, Count())
    wrapped = model.__dict__["forward"]
    ids = prompt(8)
    with torch.no_grad():
        model(ids)
        patch_model(model, policy=Dense())
        model(ids)
        with pytest.warns(UserWarning, match="not on a CUDA device"):
            patch_model(model, policy=Quest(budget=16), cuda_graph=True)
        model(ids)
        unpatch_model(model)
        model(ids)
    assert len(calls) == 4
    assert model.__dict__["forward"] is wrapped and not is_patched(model)


def test_a_one_token_prompt_decodes_under_snapkv():
    """A prompt of one token (a BOS) has no prefill to observe: its forward is a decode step. SnapKV has nothing to
    free then and decodes (before: "this cache was filled without it", on the fresh cache generate() built); the
    tokens are the unpatched model's."""
    ref, model = tiny_model("llama"), tiny_model("llama")
    patch_model(model, policy=SnapKV(budget=0.5))
    for n in (1, 2):
        ids = prompt(n)
        with torch.no_grad():
            got = model.generate(ids, max_new_tokens=8, do_sample=False)
            want = ref.generate(ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(got, want), n
    unpatch_model(model)


@pytest.mark.parametrize("policy", ["quest", "fp8", "quant4", "pq prefill"])
def test_a_patched_model_and_its_cache_pickle(policy):
    """``torch.save(model)`` / ``pickle`` of a patched model (multiprocessing, ray): the hooks are module-level
    functions (before, the model hook was a ``torch.compiler.disable`` wrapper made at patching, which pickle could
    not find by name) and the policies' state shapes picklable objects (before, lambdas: the float8, quantized and pq
    policies did not pickle); the copy is patched and decodes as the original. A filled ``PagedKVCache`` pickles too
    (before, its layers' weak references did not), and the loaded copy decodes on as the original."""
    from hf_sparse_kv.policies import Fp8BlockTopK, QuantBlockTopK, TopPBlockTopK

    policy = {
        "quest": Quest(budget=32, sink=4, window=8),
        "fp8": Fp8BlockTopK(budget=32, sink=4, window=8),
        "quant4": QuantBlockTopK(budget=32, sink=4, window=8, bits=4),
        "pq prefill": TopPBlockTopK(32, 4, 8, coarse="pq", calibration="prefill"),
    }[policy]
    model = tiny_model("llama")
    patch_model(model, policy=policy)
    torch.save(model, io.BytesIO())
    copy = pickle.loads(pickle.dumps(model))
    assert is_patched(copy)
    ids = prompt(40)
    with torch.no_grad():
        assert torch.equal(
            copy.generate(ids, max_new_tokens=4, do_sample=False),
            model.generate(ids, max_new_tokens=4, do_sample=False),
        )
        cache = PagedKVCache(model.config)
        _continue(model, cache, ids)
        buffer = io.BytesIO()
        torch.save(cache, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert all(layer.cache is loaded for layer in loaded.paged_layers)
        nxt = prompt(1, seed=3)
        torch.testing.assert_close(_continue(model, loaded, nxt), _continue(model, cache, nxt), rtol=0, atol=0)
    unpatch_model(copy)
    unpatch_model(model)


def test_a_cache_passed_by_position_is_the_cache_used():
    """``model(ids, mask, None, cache)``: the hook finds the cache by the forward's parameter order (before: it
    built one of its own beside it, "got multiple values for argument 'cache'"); the logits are the unpatched
    model's on its own cache passed the same way."""
    ref, model = tiny_model("llama"), tiny_model("llama")
    patch_model(model, policy=Quest(budget=10**6))
    ids = prompt(30)
    mask = torch.ones_like(ids)
    cache, want_cache = PagedKVCache(model.config), DynamicCache(config=ref.config)
    with torch.no_grad():
        got = model(ids, mask, None, cache, use_cache=True).logits
        want = ref(ids, mask, None, want_cache, use_cache=True).logits
    assert cache.get_seq_length() == 30
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    unpatch_model(model)


def test_refusals_change_nothing(tmp_path):
    """A warning turned into an error (``cuda_graph=True`` on a CPU model), a ``cuda_graph`` that is not a bool and
    a crossover file holding no table are refused before anything changes."""
    import warnings

    model = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="not on a CUDA device"):
            patch_model(model, policy=Dense(), cuda_graph=True)
    assert not is_patched(model)
    with pytest.raises(TypeError, match="cuda_graph must be True or False"):
        patch_model(model, policy=Dense(), cuda_graph="yes")
    for text in ("{}", "not json"):
        path = tmp_path / "t.json"
        path.write_text(text)
        with pytest.raises(ValueError, match="crossover file"):
            patch_model(model, policy=Quest(budget=0.125), mode="auto", crossover=str(path))
    assert not is_patched(model)


@pytest.mark.parametrize("how", ["assistant", "prompt lookup"])
@pytest.mark.parametrize("policy", [SinkWindow(sink=4, window=20, evict=True), SnapKV(budget=0.5)])
def test_a_policy_that_frees_blocks_refuses_assisted_decoding_up_front(policy, how):
    """Assisted and prompt-lookup decoding verify several tokens a forward: under eviction or SnapKV those ran dense
    over the whole cache (nothing freed, memory growing with the output, no word said) or stopped midway; now
    ``generate()`` refuses before its prefill, and the model decodes as before without them."""
    model = tiny_model("llama")
    patch_model(model, policy=policy, dense_layers=())
    ids = prompt(60)
    extra = {"assistant_model": tiny_model("llama", seed=3)} if how == "assistant" else {"prompt_lookup_num_tokens": 5}
    with torch.no_grad():
        with pytest.raises(ValueError, match="frees blocks as it decodes"):
            model.generate(ids, max_new_tokens=8, do_sample=False, **extra)
        assert model.generate(ids, max_new_tokens=8, do_sample=False).shape == (1, 68)
    unpatch_model(model)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_a_loss_on_a_right_padded_batch_needs_no_cache(mode):
    """A forward with ``labels``, or any forward in training mode, that does not ask for a cache gets none (before,
    the config's ``use_cache`` made the patch build one, whose pages refuse right padding: a loss or a training step
    on a right-padded batch raised even under Dense); the loss is the unpatched model's."""
    ref, model = tiny_model("llama"), tiny_model("llama")
    patch_model(model, policy=Dense())
    ids = prompt(12, batch=2)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    getattr(model, mode)()
    getattr(ref, mode)()
    out = model(ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.loss, ref(ids, attention_mask=mask, labels=labels).loss, rtol=1e-6, atol=1e-6)
    if mode == "train":
        out.loss.backward()
    unpatch_model(model)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_right_padded_forward_that_asks_for_no_cache_gets_the_unpatched_logits(arch):
    """A plain forward (no labels, eval mode) of a right-padded batch, as a scoring harness makes, that does not ask for
    a cache gets none and the unpatched logits (before, the config's ``use_cache`` made the patch build one, whose pages
    refuse right padding: it raised); asking for one (``use_cache=True``) still raises the clear error; a left-padded
    forward still gets a ``PagedKVCache``."""
    ref, model = tiny_model(arch), tiny_model(arch)
    patch_model(model, policy=Quest(budget=16), dense_layers=())
    ids = prompt(24, batch=2)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
        assert out.past_key_values is None
        torch.testing.assert_close(out.logits, ref(ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-5)
        with pytest.raises(NotImplementedError, match="padded on the right"):
            model(ids, attention_mask=mask, use_cache=True)
        assert isinstance(model(ids, attention_mask=mask.flip(1)).past_key_values, PagedKVCache)
    unpatch_model(model)
