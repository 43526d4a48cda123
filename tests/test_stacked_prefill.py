"""A left-padded batch's cache stacked from prefills of one prompt each (``PagedKVCache.stacked``,
``greedy_batch(prefill="rows")``): the contents a prefill of the padded batch leaves (keys, values, metadata, padding,
lengths), the same answers after it, refusals before anything is made."""

from __future__ import annotations

import pytest
import torch
from test_decode_slots import _prefill, _prompts
from tiny_models import batch_policies, tiny_model

from evaluation.needle import PhaseClock, greedy_batch, pad_left, stacked_prefill
from evaluation.slots import DecodeSlots
from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.policies import Dense, QuantBlockTopK, SnapKV


def _batched(model, prompts, block_size: int = 8) -> PagedKVCache:
    """The cache a prefill of the left-padded batch (its last tokens left out) leaves."""
    return _prefill(model, prompts, block_size)[0]


def test_a_stacked_cache_holds_what_the_batch_prefill_holds_and_decodes_on():
    """Per sequence, the keys and values at every stored position, each block's min / max / mean and the declared
    state (quant4's codes) equal the batched prefill's (float32 rounding of the matmuls at another batch shape), with
    its padding and length; a decode step on each gives the same logits; the pools hold the rows' blocks and a spare
    block a sequence."""
    model = tiny_model("llama")
    prompts = _prompts(3, (150, 133, 141))
    patch_model(model, policy=QuantBlockTopK(budget=0.25, sink=4, window=16, bits=4), block_size=8, dense_layers=(0,))
    try:
        want = _batched(model, prompts)
        got = stacked_prefill(model, prompts, 8, PhaseClock())
        assert got.pads == want.pads == [0, 17, 9] and got.get_seq_length() == want.get_seq_length() == 149
        assert got.table.capacity == sum(map(len, got.table.rows)) + 3 and got.specs == want.specs
        assert got.metadata == want.metadata == ("kmin", "kmax")  # what QuantBlockTopK reads (no mean)
        for a, b in zip(got.paged_layers, want.paged_layers):
            for x, y in zip(a.dense_kv(), b.dense_kv()):
                torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
            assert a.kept_metadata() == b.kept_metadata() == ("kmin", "kmax")
            for row, (ra, rb) in enumerate(zip(got.table.rows, want.table.rows)):
                for name in (*a.kept_metadata(), *a.state):
                    x = getattr(a, name) if name in a.kept_metadata() else a.state[name]
                    y = getattr(b, name) if name in b.kept_metadata() else b.state[name]
                    torch.testing.assert_close(x[ra].float(), y[rb].float(), rtol=0, atol=1e-5, msg=(name, row))
        ids, mask, pos = pad_left(prompts, model.device)
        step = {"attention_mask": mask, "position_ids": pos[:, -1:], "use_cache": True}
        with torch.no_grad():
            out = [model(ids[:, -1:], **{cache_kwarg(model): c}, **step).logits for c in (got, want)]
        torch.testing.assert_close(out[0], out[1], rtol=0, atol=1e-4)
    finally:
        unpatch_model(model)


def test_stacking_may_consume_its_rows_layer_by_layer(monkeypatch):
    """``consume=True``: the same stacked cache, and each row's pools let go as soon as its layer is copied (layer by
    layer, every row's, in order), so the rows and the batch never both hold the whole batch; the rows end empty and
    a consumed row takes a new prefill as a fresh cache does."""
    from hf_sparse_kv.cache import PagedLayer

    model = tiny_model("llama")
    prompts = _prompts(12, (60, 47))
    patch_model(model, policy=Dense(), block_size=8, dense_layers=(0,))
    try:
        rows = [_batched(model, [p]) for p in prompts]
        want = PagedKVCache.stacked(model.config, rows, [0, 13])
        freed, free = [], PagedLayer.free_pools
        monkeypatch.setattr(PagedLayer, "free_pools", lambda self: freed.append(self.index) or free(self))
        got = PagedKVCache.stacked(model.config, rows, [0, 13], consume=True)
        assert freed == [i for i in range(len(got.layers)) for _ in rows]
        for a, b in zip(got.paged_layers, want.paged_layers):
            for x, y in zip(a._tensors(), b._tensors()):
                assert torch.equal(x, y)
        assert all(layer.k_pool is None and not layer.is_initialized for r in rows for layer in r.paged_layers)
        assert all(not r.table.rows and r.get_seq_length() == 0 for r in rows)
        with torch.no_grad():
            model(torch.tensor([prompts[0][:-1]], device=model.device), **{cache_kwarg(model): rows[0]}, use_cache=True)
        fresh = _batched(model, prompts[:1])
        for x, y in zip(rows[0].paged_layers[1].dense_kv(), fresh.paged_layers[1].dense_kv()):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    finally:
        unpatch_model(model)


@pytest.mark.parametrize("static", [False, True])
def test_greedy_batch_answers_the_same_prefilled_by_rows(static):
    """``prefill="rows"`` gives the batch prefill's answers for every policy (SnapKV, which observes its window on the
    stacked cache, included), eagerly and on a kept slot; an unknown value is refused."""
    model = tiny_model("llama")
    policies = batch_policies()
    args = {"dense_layers": (0,), "block_size": 8, "mode": "block", "static": static}
    slots = DecodeSlots(margin=16) if static else None
    for seed, lengths in [(4, (150, 133, 141)), (5, (128, 150, 139))]:
        prompts = _prompts(seed, lengths)
        want = greedy_batch(model, prompts, policies, 6, **args)
        assert greedy_batch(model, prompts, policies, 6, prefill="rows", slots=slots, **args) == want
    with pytest.raises(ValueError, match="prefill"):
        greedy_batch(model, prompts, policies, 6, prefill="row", **args)


def test_a_model_with_sliding_layers_prefills_the_batch(monkeypatch):
    """Gemma-3's sliding layers hold their padded window: ``prefill="rows"`` prefills the batch there (nothing is
    stacked) and answers as before."""
    from evaluation import needle

    model = tiny_model("gemma3")
    prompts = _prompts(6, (150, 133))
    called = []
    monkeypatch.setattr(needle, "stacked_prefill", lambda *a: called.append(a))
    policies = {"dense": Dense(), "snapkv": SnapKV(budget=0.5, sink=4, window=16, observe=8)}
    args = {"dense_layers": (0,), "block_size": 8, "mode": "block"}
    assert greedy_batch(model, prompts, policies, 4, prefill="rows", **args) == greedy_batch(
        model, prompts, policies, 4, **args
    )
    assert not called


def test_stacking_refuses_what_it_cannot_stack():
    """One sequence a cache, unpadded, every layer paged, one block size, nothing evicted or pending, lengths and
    paddings making one frame; each refused with what is wrong."""
    model = tiny_model("llama")
    patch_model(model, policy=Dense(), block_size=8, dense_layers=(0,))
    try:
        one = [_batched(model, [p]) for p in _prompts(7, (40, 33))]  # 39 and 32 stored tokens
        assert PagedKVCache.stacked(model.config, one, [0, 7]).pads == [0, 7]
        two = _batched(model, _prompts(9, (40, 33)))
        patch_model(model, policy=Dense(), block_size=16, dense_layers=(0,))
        other = _batched(model, _prompts(8, (21,)), block_size=16)  # 20 stored tokens
        cases = [
            ([], [], "0 caches"),
            (one, [0], "2 caches and 1"),
            (one, [0, 6], "one frame"),
            (one, [0, -7], "one frame"),
            ([two, one[0]], [0, 0], "one sequence"),
            ([one[0], other], [0, 19], "differ"),
        ]
        for rows, pads, match in cases:
            with pytest.raises(ValueError, match=match):
                PagedKVCache.stacked(model.config, rows, pads)
        patch_model(model, policy=SnapKV(budget=0.5, sink=4, window=16, observe=8), block_size=8, dense_layers=(0,))
        observed = [_batched(model, [p]) for p in _prompts(10, (40, 40))]
        with pytest.raises(ValueError, match="pending observation"):
            PagedKVCache.stacked(model.config, observed, [0, 0])
    finally:
        unpatch_model(model)
    gemma = tiny_model("gemma3")
    patch_model(gemma, policy=Dense(), block_size=8, dense_layers=(0,))
    try:
        sliding = _batched(gemma, _prompts(11, (40,)))
        with pytest.raises(ValueError, match="every layer must be paged"):
            PagedKVCache.stacked(gemma.config, [sliding], [0])
    finally:
        unpatch_model(gemma)
