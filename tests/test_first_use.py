"""What a new user hits first: patching the wrong object, transformers' usual ``generate()`` arguments,
``cuda_graph=True`` on the CPU. Every refusal leaves the model exactly as it was (bit-identical outputs after)."""

import warnings

import pytest
import torch
from tiny_models import greedy, prompt, tiny_model

from hf_sparse_kv import PagedKVCache, is_patched, patch_model, unpatch_model
from hf_sparse_kv.policies import Quest, SinkWindow

pytestmark = pytest.mark.usefixtures("one_thread")

QUEST = {"policy": Quest(budget=16, sink=0, window=8), "block_size": 8, "dense_layers": ()}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def reference(model):
    """Greedy tokens and scores of the unpatched model, and of the model patched with ``QUEST``."""
    ids = prompt(40)
    plain = greedy(model, ids, new_tokens=8)
    patch_model(model, **QUEST)
    try:
        sparse = greedy(model, ids, new_tokens=8)
    finally:
        unpatch_model(model)
    return ids, plain, sparse


def untouched(model) -> None:
    """The model carries nothing of a patch: no state, its attention ``sdpa`` everywhere, no hooks, no wrappers."""
    assert not is_patched(model) and not is_patched(model.model)
    assert model.config._attn_implementation == "sdpa" and model.model.config._attn_implementation == "sdpa"
    assert all(not m._forward_pre_hooks for m in model.modules())
    assert "_prepare_cache_for_generation" not in vars(model) and "forward" not in vars(model)


def same(result, expected) -> None:
    assert torch.equal(result[0], expected[0])
    assert torch.equal(result[1], expected[1])


# ---- 1. patching the base model, and any refusal, changes nothing ------------------------------------------------


def test_base_model_is_refused_naming_what_to_pass(model, reference):
    ids, plain, sparse = reference
    with pytest.raises(TypeError, match=r"LlamaModel.*LlamaForCausalLM.*not model\.model"):
        patch_model(model.model, **QUEST)
    untouched(model)
    same(greedy(model, ids, new_tokens=8), plain)
    unpatch_model(model.model)  # both are no-ops on what the refusal left
    unpatch_model(model)
    untouched(model)
    same(greedy(model, ids, new_tokens=8), plain)
    patch_model(model, **QUEST)  # the right object patches as ever
    try:
        same(greedy(model, ids, new_tokens=8), sparse)
    finally:
        unpatch_model(model)
    same(greedy(model, ids, new_tokens=8), plain)


def test_base_model_of_a_patched_model_is_refused_and_the_patch_kept(model, reference):
    ids, plain, sparse = reference
    patch_model(model, **QUEST)
    try:
        with pytest.raises(TypeError, match="not model.model"):
            patch_model(model.model, **QUEST)
        unpatch_model(model.model)  # not patched itself: a no-op, the outer patch stays
        assert is_patched(model)
        same(greedy(model, ids, new_tokens=8), sparse)
    finally:
        unpatch_model(model)
    untouched(model)
    same(greedy(model, ids, new_tokens=8), plain)


def _failing(model, monkeypatch):
    """Make ``set_attn_implementation`` fail half-way, as transformers' does when a sub-model refuses the name: the
    top-level config has already changed when it raises."""

    def fail(name, *args, **kwargs):
        model.config._attn_implementation_internal = name
        raise ValueError("a sub-model refused the attention implementation")

    monkeypatch.setattr(model, "set_attn_implementation", fail)


def test_error_while_patching_restores_the_model(model, reference, monkeypatch):
    ids, plain, _ = reference
    with monkeypatch.context() as m:
        _failing(model, m)
        with pytest.raises(ValueError, match="refused"):
            patch_model(model, **QUEST, cuda_graph=True)
    untouched(model)
    same(greedy(model, ids, new_tokens=8), plain)


@pytest.mark.filterwarnings("ignore:cuda_graph=True")
@pytest.mark.parametrize("graph", [False, True])
def test_error_while_repatching_keeps_the_previous_patch(model, reference, monkeypatch, graph):
    ids, plain, sparse = reference
    patch_model(model, **QUEST, cuda_graph=graph)
    try:
        # the patch's own answer before the refused repatch: on a GPU, cuda_graph=True merges the projections and
        # captures the steps, whose float rounding differs from the eager reference's (same tokens)
        before = greedy(model, ids, new_tokens=8)
        assert torch.equal(before[0], sparse[0])
        if not graph or model.device.type == "cpu":
            same(before, sparse)
        handles = len(model._forward_pre_hooks)
        wrapped = dict(vars(model))
        with monkeypatch.context() as m:
            _failing(model, m)
            with pytest.raises(ValueError, match="refused"):
                patch_model(model, policy=SinkWindow(sink=4, window=8), block_size=8)
        assert is_patched(model) and len(model._forward_pre_hooks) == handles
        assert [vars(model).get(k) for k in ("forward", "_prepare_cache_for_generation")] == [
            wrapped.get(k) for k in ("forward", "_prepare_cache_for_generation")
        ]
        assert model.config._attn_implementation == "hf_sparse_kv"
        same(greedy(model, ids, new_tokens=8), before)
    finally:
        unpatch_model(model)
    untouched(model)
    same(greedy(model, ids, new_tokens=8), plain)


# ---- 2. generate(cache_implementation="dynamic") ------------------------------------------------------------------


def test_cache_implementation_dynamic_builds_the_paged_cache(model, reference):
    ids, _, sparse = reference
    patch_model(model, **QUEST)
    try:
        same(greedy(model, ids, new_tokens=8, cache_implementation="dynamic"), sparse)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=2, cache_implementation="dynamic", return_dict_in_generate=True)
        assert isinstance(out.past_key_values, PagedKVCache)
        with pytest.raises(ValueError, match="leave it unset"), torch.no_grad():
            model.generate(ids, max_new_tokens=2, cache_implementation="static")
        model.generation_config.cache_implementation = "static"  # a model whose own generation config sets it
        try:
            with pytest.raises(ValueError, match="generation_config.cache_implementation = None"), torch.no_grad():
                model.generate(ids, max_new_tokens=2)
        finally:
            model.generation_config.cache_implementation = None
    finally:
        unpatch_model(model)


# ---- 6. unpatch on an unpatched object, cuda_graph=True on the CPU ------------------------------------------------


def test_unpatch_of_an_unpatched_model_is_a_documented_no_op(model):
    assert "no-op" in unpatch_model.__doc__
    assert unpatch_model(model) is model
    untouched(model)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the model is on the CPU only without CUDA")
def test_cuda_graph_on_the_cpu_warns_once_that_it_runs_eagerly(model, reference):
    ids, _, sparse = reference
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patch_model(model, **QUEST, cuda_graph=True)
        try:
            same(greedy(model, ids, new_tokens=8), sparse)
        finally:
            unpatch_model(model)
    ours = [w for w in caught if "cuda_graph" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, UserWarning)
    assert "eager" in str(ours[0].message)
