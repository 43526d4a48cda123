"""The oracle policies' exact scorers on the Triton backend (``ops/triton/exact.py``: the candidate kernel over every
block) against the reference: every token's score (TokenTopK) and each block's softmax mass (OracleBlockTopK), with
GQA groups, left starts, evicted blocks, a length past the longest sequence and a sequence with nothing valid; the
Triton namespace serves them (no longer reference-only), and they trace as registered ops."""

from __future__ import annotations

import pytest
import torch

from hf_sparse_kv.ops import REFERENCE_ONLY, get_ops
from hf_sparse_kv.ops import reference as R

pytest.importorskip("triton")
from test_triton_ops import DEVICE, make_case

from hf_sparse_kv.ops.triton import exact


def _case(dtype=torch.float32, seed=0):
    c = make_case(B=3, H=2, G=3, D=16, BS=8, lens=[61, 37, 8], starts=[0, 5, 0], dtype=dtype, seed=seed)
    c["block_table"][0, 2] = -1  # an evicted block
    c["block_table"][1, 1] = -1
    return c


@pytest.mark.parametrize("length", [None, 64, 72])
def test_token_scores_equal_the_reference(length):
    c = _case(seed=1)
    args = (c["q"], c["k_pool"], c["block_table"], c["seq_lens"], c["start"], length)
    want, got = R.token_scores(*args), exact.token_scores(*args)
    assert got.shape == want.shape and torch.equal(got.isneginf(), want.isneginf()) and want.isfinite().any()
    torch.testing.assert_close(got[want.isfinite()], want[want.isfinite()], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length", [None, 64, 44])
def test_oracle_block_scores_equal_the_reference(length):
    """Each block's mass; ``length`` 44 cuts the first sequence's context inside a block (the reference scores the
    positions below it only); the third sequence's start leaves nothing of it valid: its heads add 0."""
    c = _case(seed=2)
    c["start"][2] = 8  # nothing valid: its heads add 0
    args = (c["q"], c["k_pool"], c["block_table"], c["seq_lens"], c["start"], 0.37, length)
    want, got = R.oracle_block_scores(*args), exact.oracle_block_scores(*args)
    assert got.shape == want.shape and torch.equal(got.isneginf(), want.isneginf())
    torch.testing.assert_close(got[want.isfinite()], want[want.isfinite()], rtol=1e-5, atol=1e-6)
    assert not got.isnan().any()


def test_bf16_scores_within_bf16_tolerance_and_the_namespace_serves_them():
    c = _case(dtype=torch.bfloat16, seed=3)
    args = (c["q"], c["k_pool"], c["block_table"], c["seq_lens"], c["start"])
    ops = get_ops("triton", DEVICE)
    assert "token_scores" not in REFERENCE_ONLY and "oracle_block_scores" not in REFERENCE_ONLY
    # the namespace serves them, run on their tensors' device (ops.triton.on_its_device)
    assert ops.token_scores.__wrapped__ is exact.token_scores
    assert ops.oracle_block_scores.__wrapped__ is exact.oracle_block_scores
    for name, extra in (("token_scores", ()), ("oracle_block_scores", (0.25,))):
        want, got = getattr(R, name)(*args, *extra), getattr(ops, name)(*args, *extra)
        fin = want.isfinite()
        assert torch.equal(got.isneginf(), want.isneginf())
        err = ((got[fin] - want[fin]).norm() / want[fin].norm()).item()
        assert err < 1e-2, (name, err)


def test_a_length_past_the_table_is_refused():
    c = _case()
    with pytest.raises(ValueError, match="block table holds"):
        exact.token_scores(c["q"], c["k_pool"], c["block_table"], c["seq_lens"], c["start"], 8 * 40)


@pytest.mark.parametrize("mode", ["block", "token"])
def test_the_oracle_policies_decode_through_the_triton_scorers_as_through_the_reference(mode):
    """A patched model's decode steps under TokenTopK and OracleBlockTopK, eager and static (the registered ops), give
    the reference backend's logits: the Triton namespace's scorers select the same blocks / tokens."""
    from tiny_models import prompt, tiny_model

    from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
    from hf_sparse_kv.graphs import DecodeGraphs
    from hf_sparse_kv.policies import OracleBlockTopK, TokenTopK

    model = tiny_model("llama")
    ids = prompt(70, batch=2)
    for policy in (TokenTopK(budget=0.25, sink=4, window=8), OracleBlockTopK(budget=0.25, sink=4, window=8)):
        if (policy.granularity == "token") != (mode == "token"):  # each policy in its physically sparse mode
            continue
        out = {}
        for backend in ("reference", "triton"):
            patch_model(model, policy=policy, mode=mode, block_size=8, dense_layers=(0,), backend=backend)
            cache = PagedKVCache(model.config, block_size=8, backend=backend)
            with torch.no_grad():
                logits = model(ids, **{cache_kwarg(model): cache}, use_cache=True).logits[:, -1:]
                steps = [model(logits.argmax(-1), **{cache_kwarg(model): cache}, use_cache=True).logits]
                runner = DecodeGraphs(model, cache, ids.shape[1] + 5, capture=False)
                for _ in range(3):
                    steps.append(runner.step(steps[-1][:, -1:].argmax(-1)))
            out[backend] = torch.cat(steps, 1)
            unpatch_model(model)
        torch.testing.assert_close(out["triton"], out["reference"], rtol=0, atol=1e-4)
