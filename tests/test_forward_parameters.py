"""hf_sparse_kv.patched.forward_parameters / cache_kwarg: a forward's parameter names read from its code object are
the names ``inspect.signature`` lists (plain, ``functools.wraps``-decorated, ``__signature__``-declaring and callable
objects, and the installed transformers' causal LMs), so every decode step can ask for the cache keyword cheaply."""

from __future__ import annotations

import functools
import inspect

import pytest
import transformers

from hf_sparse_kv.patched import cache_kwarg, forward_parameters


def _plain(a, b=1, *args, cache=None, d=2, **kw):
    return a


@functools.wraps(_plain)
def _wrapped(*args, **kwargs):
    return _plain(*args, **kwargs)


def _declared(x, **kw):
    return x


_declared.__signature__ = inspect.Signature([inspect.Parameter("past_key_values", inspect.Parameter.KEYWORD_ONLY)])


class _Callable:
    def __call__(self, input_ids, past_key_values=None):
        return input_ids


@pytest.mark.parametrize(
    "fn",
    [_plain, _wrapped, _declared, _Callable(), lambda a, /, b: a],
    ids=["plain", "wrapped", "declared", "callable", "lambda"],
)
def test_the_names_are_the_signatures(fn):
    assert forward_parameters(fn) == frozenset(inspect.signature(fn).parameters)


def test_every_causal_lm_of_transformers_gets_its_signatures_cache_keyword():
    names = [n for n in dir(transformers) if n.endswith("ForCausalLM")]
    checked = 0
    for name in names:
        try:
            cls = getattr(transformers, name)
        except (ImportError, AttributeError):  # an optional backend missing
            continue
        if not hasattr(cls, "forward"):  # the Auto* factories
            continue
        assert forward_parameters(cls.forward) == frozenset(inspect.signature(cls.forward).parameters), name
        checked += 1
    assert checked > 50

    class Model:  # cache_kwarg reads the class's forward
        forward = transformers.LlamaForCausalLM.forward

    want = (
        "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else "past_key_values"
    )
    assert cache_kwarg(Model()) == want
