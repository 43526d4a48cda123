"""Error messages tell the user what to do: each names the bad argument and a valid alternative.

``test_bad_input.py`` checks that each bad input raises and names its argument; this file checks the rest of the
wording (the valid values, the way out) and the bad inputs it does not cover (a cache of the wrong batch, a cache of
another model, a decode mask that changes the padding, ``cache_implementation``, ``PagedKVCache(backend=...)``).
"""

from __future__ import annotations

import re

import pytest
import torch
from tiny_models import prompt, tiny_model

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.policies import BlockTopK, OracleBlockTopK, Quest, SinkWindow, TokenTopK


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture
def patched(model):
    patch_model(model, policy=Quest(budget=8, sink=0, window=8), block_size=8, dense_layers=())
    yield model
    unpatch_model(model)


def message(exc_info) -> str:
    return str(exc_info.value)


def says(text: str, *needles: str) -> None:
    """``text`` contains every needle (plain substrings)."""
    missing = [n for n in needles if n not in text]
    assert not missing, f"{missing} not in message: {text!r}"


# ----------------------------------------------------------------------------------------------------- policies

BUDGET_FORMS = ("int", "tokens", "(0, 1]")


@pytest.mark.parametrize("cls", [Quest, BlockTopK, OracleBlockTopK, TokenTopK])
@pytest.mark.parametrize("budget", [0, -5, 1.5, 0.0, "1/8", None, [64]])
def test_budget_messages_give_the_valid_forms(cls, budget):
    with pytest.raises((ValueError, TypeError)) as e:
        cls(budget=budget)
    says(message(e), "budget")
    # a wrong type or a missing budget lists both forms; a wrong value states the rule it broke
    if isinstance(budget, float):
        says(message(e), "(0, 1]", "fraction")
    elif isinstance(budget, int):
        says(message(e), "positive", "tokens")
    else:
        says(message(e), *BUDGET_FORMS)


@pytest.mark.parametrize("cls", [Quest, TokenTopK])
@pytest.mark.parametrize("field", ["sink", "window"])
@pytest.mark.parametrize("value", [-1, 2.5, "4"])
def test_sink_and_window_messages(cls, field, value):
    with pytest.raises(ValueError) as e:
        cls(budget=64, **{field: value})
    says(message(e), field, "non-negative int", repr(value))


@pytest.mark.parametrize("kwargs", [{"sink": 4}, {"sink": 4, "window": 8, "budget": 16}])
def test_sink_window_needs_exactly_one_of_window_or_budget(kwargs):
    with pytest.raises(ValueError) as e:
        SinkWindow(**kwargs)
    says(message(e), "window", "budget", "exactly one")


@pytest.mark.parametrize("window", [0, -2, 8.0, True])
def test_sink_window_window_message(window):
    with pytest.raises(ValueError) as e:
        SinkWindow(sink=4, window=window)
    says(message(e), "window", "positive int", "tokens")


# ----------------------------------------------------------------------------------------------- patch_model


@pytest.mark.parametrize(
    "kwargs,needles",
    [
        ({"mode": "sparse"}, ("mode", "'mask'", "'token'", "'block'", "'sparse'")),
        ({"mode": None}, ("mode", "'block'", "None")),
        ({"block_size": 12}, ("block_size", "power of two", "8", "256", "12")),
        ({"block_size": True}, ("block_size", "power of two")),
        ({"backend": "cuda"}, ("backend", "'auto'", "'reference'", "'triton'", "'cuda'")),
        ({"dense_layers": (0, 3)}, ("dense_layers", "[0, 3)", "[3]")),
        ({"dense_layers": (0, 1.0)}, ("dense_layers", "[0, 3)", "1.0")),
        ({"dense_layers": "all"}, ("dense_layers", "sequence of layer indices")),
        ({"policy": "quest"}, ("policy", "instance", "Quest(budget=", "'quest'")),
        ({"policy": Quest}, ("policy", "instance", "Quest(budget=")),
        ({"policy": TokenTopK(budget=64), "mode": "block"}, ("TokenTopK", "mode='token'", "mode='mask'")),
    ],
)
def test_patch_model_messages(model, kwargs, needles):
    with pytest.raises((ValueError, TypeError)) as e:
        patch_model(model, **kwargs)
    says(message(e), *needles)


# ------------------------------------------------------------------------------------------------- the cache


def test_cache_implementation_message(patched):
    with pytest.raises(ValueError) as e, torch.no_grad():
        patched.generate(prompt(10), max_new_tokens=2, cache_implementation="static")
    says(message(e), "cache_implementation", "'static'", "leave it unset")


def test_foreign_cache_message_lists_the_ways_out(patched):
    with pytest.raises(TypeError) as e, torch.no_grad():
        patched(prompt(10), **{cache_kwarg(patched): ((torch.zeros(1),),)})
    says(message(e), "PagedKVCache", "tuple", "PagedKVCache(model.config)", "unpatch_model(model)", "Pass none")


def padded_prefill(patched) -> PagedKVCache:
    """A cache filled by a batch of two 10-token prompts, the first left-padded by 3."""
    cache = PagedKVCache(patched.config, block_size=8)
    ids = prompt(10, batch=2)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        patched(ids, attention_mask=mask, **{cache_kwarg(patched): cache})
    return cache


def test_decode_mask_that_changes_the_padding(patched):
    cache = padded_prefill(patched)
    with torch.no_grad():
        moved = torch.ones(2, 11, dtype=torch.long)
        moved[1, :3] = 0  # the padding moved to the other sequence
        with pytest.raises(NotImplementedError) as e:
            patched(prompt(1, batch=2), attention_mask=moved, **{cache_kwarg(patched): cache})
    says(message(e), "pads differently", "left padding fixed at prefill", "generate()")


def test_decode_mask_that_drops_the_padding_is_refused(patched):
    cache = padded_prefill(patched)
    with torch.no_grad(), pytest.raises(NotImplementedError, match="pads differently"):
        patched(prompt(1, batch=2), attention_mask=torch.ones(2, 11, dtype=torch.long),
                **{cache_kwarg(patched): cache})  # fmt: skip


def test_cache_of_another_batch_says_reset(patched):
    cache = PagedKVCache(patched.config, block_size=8)
    with torch.no_grad():
        patched.generate(prompt(10, batch=2), max_new_tokens=2, **{cache_kwarg(patched): cache})
        with pytest.raises(ValueError) as e:
            patched.generate(prompt(10, batch=3), max_new_tokens=2, **{cache_kwarg(patched): cache})
    says(message(e), "2", "3", "reset()")


def test_cache_backend_checked_at_construction(model):
    with pytest.raises(ValueError) as e:
        PagedKVCache(model.config, backend="tpu")
    says(message(e), "backend", "'auto'", "'reference'", "'triton'")


def test_cache_of_a_smaller_model_is_refused_clearly(patched):
    small = tiny_model("llama", num_hidden_layers=2)
    cache = PagedKVCache(small.config, block_size=8)
    with pytest.raises((ValueError, TypeError)) as e, torch.no_grad():
        patched.generate(prompt(10), max_new_tokens=3, **{cache_kwarg(patched): cache})
    assert re.search(r"layer", message(e)) and "PagedKVCache(model.config)" in message(e), message(e)
