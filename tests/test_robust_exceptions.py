"""An exception in the middle of generate() (a RuntimeError, a KeyboardInterrupt) leaves the model and a reused
cache usable: after ``cache.reset()`` the next generate equals a run on a fresh cache, the block bookkeeping is
consistent, and no deferred-read flag or step plan of the aborted run survives."""

from __future__ import annotations

import pytest
import torch
from test_robust_generate import check_table
from tiny_models import greedy, prompt, tiny_model
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.policies import Quest

BS = 8
NEW = 8


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class Boom(StoppingCriteria):
    """Raises ``exc`` at its ``at``-th call (generate calls it once per new token)."""

    def __init__(self, exc: type[BaseException], at: int = 3):
        self.exc, self.at, self.calls = exc, at, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise self.exc("boom from a stopping criterion")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def raise_on_decode_step(exc: type[BaseException], at: int = 3):
    """A forward pre-hook raising ``exc`` at the ``at``-th single-token forward of the module it is registered on."""
    seen = [0]

    def hook(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if hidden.shape[1] == 1:
            seen[0] += 1
            if seen[0] == at:
                raise exc("boom from a forward hook")

    return hook


@pytest.fixture(scope="module")
def patched():
    model = tiny_model("llama")
    patch_model(model, policy=Quest(budget=16, sink=2, window=8), mode="block", dense_layers=(), block_size=BS)
    yield model
    unpatch_model(model)


def abort(model, where: str, exc: type[BaseException], ids: torch.Tensor, cache: PagedKVCache | None) -> None:
    """Run a generate that ``exc`` interrupts at the third decode step, raised from ``where``."""
    kw = {cache_kwarg(model): cache} if cache is not None else {}
    handle, criteria = None, None
    if where == "decoder layer":  # between two layers: layer 0 wrote this step's K/V, layers 1-2 did not
        handle = model.model.layers[1].register_forward_pre_hook(raise_on_decode_step(exc), with_kwargs=True)
    elif where == "attention":  # after hf_sparse_kv's pre-hook asked layer 1 to defer its reads, before its write
        attn = model.model.layers[1].self_attn
        handle = attn.register_forward_pre_hook(raise_on_decode_step(exc), with_kwargs=True)
    else:  # between two steps: every layer holds the same tokens
        criteria = StoppingCriteriaList([Boom(exc)])
    try:
        with pytest.raises(exc, match="boom"), torch.no_grad():
            model.generate(ids, max_new_tokens=NEW, do_sample=False, stopping_criteria=criteria, **kw)
    finally:
        if handle is not None:
            handle.remove()


WHERE = ["decoder layer", "attention", "stopping criterion"]


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("where", WHERE)
def test_reused_cache_after_an_exception(patched, where, exc):
    ids, next_ids = prompt(29, batch=2, seed=1), prompt(35, batch=2, seed=2)
    ref_seqs, ref_scores = greedy(patched, next_ids, new_tokens=NEW)
    cache = PagedKVCache(patched.config, block_size=BS)
    abort(patched, where, exc, ids, cache)
    check_table(cache)
    assert cache.blocks_in_use > 0
    cache.reset()
    assert cache.blocks_in_use == 0 and not cache.table.rows and not cache._deferred
    check_table(cache)
    seqs, scores = greedy(patched, next_ids, new_tokens=NEW, **{cache_kwarg(patched): cache})
    assert torch.equal(seqs, ref_seqs)
    torch.testing.assert_close(scores, ref_scores, rtol=0, atol=1e-6)
    # and the same cache once more, after a normal run
    cache.reset()
    seqs, _ = greedy(patched, next_ids, new_tokens=NEW, **{cache_kwarg(patched): cache})
    assert torch.equal(seqs, ref_seqs)


@pytest.mark.parametrize("at", [1, 3, 5])
def test_reused_cache_after_an_exception_in_beam_search(patched, at):
    """Beam search shares blocks between beams (reference counts, copy on write): an abort at any step, then reset(),
    leaves the table consistent and the next beam search equal to one on a fresh cache."""
    next_ids = prompt(31, batch=2, seed=9)
    with torch.no_grad():
        ref = patched.generate(next_ids, num_beams=3, max_new_tokens=6, do_sample=False)
    cache = PagedKVCache(patched.config, block_size=BS)
    attn = patched.model.layers[2].self_attn
    handle = attn.register_forward_pre_hook(raise_on_decode_step(RuntimeError, at), with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
            patched.generate(prompt(29, batch=2), num_beams=3, max_new_tokens=NEW, do_sample=False,
                             **{cache_kwarg(patched): cache})  # fmt: skip
    finally:
        handle.remove()
    check_table(cache)
    cache.reset()
    check_table(cache)
    assert cache.blocks_in_use == 0
    with torch.no_grad():
        out = patched.generate(
            next_ids, num_beams=3, max_new_tokens=6, do_sample=False, **{cache_kwarg(patched): cache}
        )
    assert torch.equal(out, ref)


@pytest.mark.parametrize("where", WHERE)
def test_model_usable_after_an_exception(patched, where):
    """No cache given: generate() builds one; the aborted run leaves nothing on the model."""
    ids = prompt(29, seed=3)
    ref_seqs, ref_scores = greedy(patched, ids, new_tokens=NEW)
    abort(patched, where, RuntimeError, ids, None)
    seqs, scores = greedy(patched, ids, new_tokens=NEW)
    assert torch.equal(seqs, ref_seqs) and torch.equal(scores, ref_scores)
    # unpatching after an aborted run still restores the original model exactly
    model = tiny_model("llama")
    ref_seqs, ref_scores = greedy(model, ids, new_tokens=NEW)
    patch_model(model, policy=Quest(budget=16, sink=2, window=8), dense_layers=(), block_size=BS)
    abort(model, where, KeyboardInterrupt, ids, None)
    unpatch_model(model)
    seqs, scores = greedy(model, ids, new_tokens=NEW)
    assert torch.equal(seqs, ref_seqs) and torch.equal(scores, ref_scores)
    assert all(not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("aborted", [False, True])
def test_reset_forgets_the_last_step_plan(patched, aborted):
    """After reset(), a batch of another size whose first decode step has the length of the previous run's last step
    (here 21: a 20-token prompt, 2 new tokens each) must run as on a fresh cache."""
    cache = PagedKVCache(patched.config, block_size=BS)
    with torch.no_grad():
        if aborted:  # the third call of the criterion comes after the second decode step, at length 21
            with pytest.raises(KeyboardInterrupt):
                patched.generate(prompt(19, batch=3), max_new_tokens=NEW, do_sample=False,
                                 stopping_criteria=StoppingCriteriaList([Boom(KeyboardInterrupt)]),
                                 **{cache_kwarg(patched): cache})  # fmt: skip
        else:
            patched.generate(prompt(20, batch=3), max_new_tokens=2, do_sample=False, **{cache_kwarg(patched): cache})
    cache.reset()
    ids = prompt(20, batch=4, seed=5)
    ref = greedy(patched, ids, new_tokens=2)
    got = greedy(patched, ids, new_tokens=2, **{cache_kwarg(patched): cache})
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-6)
