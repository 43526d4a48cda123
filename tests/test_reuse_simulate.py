"""Reused selections in the simulate way (``SimulateSession.run(reuse=r)``): the policy selects at every ``r``-th
decode step and the steps in between attend that selection plus the tokens decoded since. Checked against a decode
through the patched model whose policy does exactly that (a test-only wrapper keeping each layer's last selection),
and the grid / suite plumbing around it."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from tiny_models import prompt, tiny_model

from evaluation.perplexity import decode_logprobs, nll_of
from evaluation.simulate import SimulateSession
from evaluation.suite import Job, _units
from evaluation.sweep import decoded_cells, policy_grid
from hf_sparse_kv.policies import OracleBlockTopK, Policy, QuantBlockTopK, Quest
from hf_sparse_kv.policies.base import Selection


@dataclass
class _ReusingDecode(Policy):
    """Test-only: ``inner`` selects at decode positions ``first, first + every, ...``; a step in between reads the
    anchor's blocks plus its own current block (batch 1, block selections). Keeps its state on itself (a test
    double, one cache at a time)."""

    inner: Policy = None
    every: int = 4
    first: int = 0
    granularity = "block"
    last: dict = field(default_factory=dict)

    def plan(self, lens, block_size):
        counts = self.inner.plan(lens, block_size)
        return None if counts is None else [c + 1 for c in counts]

    def select(self, state):
        t = state.lens[0] - 1  # the position of the token this step decodes
        if (t - self.first) % self.every == 0:
            self.last[state.layer] = self.inner.select(state)
            return self.last[state.layer]
        anchor = self.last[state.layer]
        assert anchor.kind == "block" and state.q.shape[0] == 1
        cur = t // state.block_size
        c = anchor.counts[0]
        idx = anchor.indices
        if bool((idx[..., :c] == cur).any(-1).all()):  # the current block is read already (by every head)
            return anchor
        col = torch.full_like(idx[..., :1], cur)
        idx = torch.cat([idx[..., :c], col, idx[..., c:]], -1)
        return Selection("block", idx, anchor.ex_lo, anchor.ex_hi, (c + 1,))


@pytest.mark.parametrize(
    "inner",
    [
        Quest(budget=0.25, sink=4, window=8),
        OracleBlockTopK(budget=32, sink=2, window=8),
        QuantBlockTopK(budget=0.25, sink=4, window=8, bits=2),
    ],
    ids=["quest", "oracle", "quant2"],
)
@pytest.mark.parametrize("every", [2, 4, 8])
def test_reused_selection_equals_a_decode_that_reuses(inner, every):
    model = tiny_model("llama")
    ids = prompt(160)
    n = 24
    session = SimulateSession(model, ids, n, block_size=8, chunk=6)
    fast = session.nll(session.run(inner, dense_layers=(0,), reuse=every)[0])
    first = ids.shape[1] - n - 1
    wrapper = _ReusingDecode(inner=inner, every=every, first=first)
    exact = nll_of(decode_logprobs(model, ids, n, wrapper, dense_layers=(0,), block_size=8, mode="block"), ids)
    assert torch.allclose(exact, fast, atol=1e-4, rtol=0), (exact - fast).abs().max()
    fresh = session.nll(session.run(inner, dense_layers=(0,))[0])
    # the first step selects fresh; later anchors differ too (their context holds keys of reused steps)
    assert abs(float(fresh[0] - fast[0])) < 1e-4
    assert (fresh - fast).abs().max() > 1e-4  # the steps between anchors attend something else: not vacuous


def test_reused_selection_on_sliding_window_layers():
    """Gemma-3's shape (sliding layers untouched, the global ones sparse) in the mask mode: the same agreement."""
    model = tiny_model("gemma3")
    ids = prompt(120)
    n, inner = 16, Quest(budget=48, sink=4, window=8)
    session = SimulateSession(model, ids, n, block_size=8, chunk=6)
    fast = session.nll(session.run(inner, dense_layers=(0,), reuse=4)[0])
    wrapper = _ReusingDecode(inner=inner, every=4, first=ids.shape[1] - n - 1)
    exact = nll_of(decode_logprobs(model, ids, n, wrapper, dense_layers=(0,), block_size=8, mode="mask"), ids)
    assert torch.allclose(exact, fast, atol=1e-4, rtol=0), (exact - fast).abs().max()
    assert (session.nll(session.run(inner, dense_layers=(0,))[0]) - fast).abs().max() > 1e-4


def test_reuse_fidelity_and_checks():
    model = tiny_model("llama")
    session = SimulateSession(model, prompt(128), 32, block_size=8)
    oracle = OracleBlockTopK(budget=0.25, window=8)
    _, fid = session.run(oracle, dense_layers=(0,), fidelity=True, reuse=1)
    assert fid.hit_rate == pytest.approx(1.0)
    _, stale = session.run(oracle, dense_layers=(0,), fidelity=True, reuse=8)
    assert stale.hit_rate < 1.0 and 0 < stale.recall < 1  # a stale oracle misses some of the fresh oracle's blocks
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="reuse"):
            session.run(oracle, dense_layers=(0,), reuse=bad)


def test_grid_cells_with_reuse():
    cells = policy_grid(
        [{"name": "dense"}, {"name": "quest", "reuse": 4}, {"name": "quest", "label": "q8", "reuse": 8}, "quest"],
        ["1/16"],
    )
    assert [(c.label, c.reuse) for c in cells] == [("dense", 1), ("quest_r4", 4), ("q8", 8), ("quest", 1)]
    for spec in ({"name": "dense", "reuse": 2}, {"name": "snapkv", "reuse": 2}, {"name": "quest", "reuse": 0}):
        with pytest.raises(ValueError, match="reuse"):
            policy_grid([spec], ["1/16"])
    with pytest.raises(ValueError, match="simulate way"):
        decoded_cells(cells)
    assert decoded_cells([cells[0], cells[3]]) == [cells[0], cells[3]]
    cfg = {"perplexity": {"windows": 2}, "needle": {"trials": 3}}
    ppl = _units(cfg, Job("perplexity", 64, ("dense", "quest_r4", "quest"), ("1/16",)), cells)
    assert {u[-2] for u in ppl} == {"dense", "quest_r4", "quest"}
    needle = _units(cfg, Job("needle", 64, ("dense", "quest_r4", "quest"), ("1/16",), {"variant": "single"}), cells)
    assert {u[-2] for u in needle} == {"dense", "quest"}  # needles decode: reused cells are left out
