"""Several windows through one :class:`~evaluation.simulate.SimulateSession` (``ids [B, W]``): each op of a forward
serves them all, and each window gets what a session of its own gives it (log-probabilities, fidelity, SnapKV's freed
blocks), with every policy kind, selections reused over decode steps, and sliding-window layers."""

from __future__ import annotations

import pytest
import torch
from tiny_models import prompt, tiny_model

from evaluation.simulate import SimulateSession
from hf_sparse_kv.policies import Dense, OracleBlockTopK, Quest, SinkWindow, SnapKV, TokenTopK

POLICIES = [
    (Quest(budget=0.25, sink=4, window=8), 1),
    (Quest(budget=0.25, sink=4, window=8), 3),
    (OracleBlockTopK(budget=32, sink=2, window=8), 1),
    (TokenTopK(budget=0.25, sink=4, window=8), 3),
    (SinkWindow(budget=48, sink=4), 1),
    (SnapKV(budget=0.5, sink=4, window=16, observe=8), 1),
    (Dense(), 1),
]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize(
    "policy, reuse", POLICIES, ids=lambda x: type(x).__name__ if not isinstance(x, int) else f"r{x}"
)
def test_windows_scored_together_get_what_each_gets_alone(arch, policy, reuse):
    model = tiny_model(arch)
    ids = torch.cat([prompt(200, seed=s) for s in (1, 2, 3)])
    fidelity = not policy.compresses and not isinstance(policy, Dense)
    together = SimulateSession(model, ids, 40, block_size=8, chunk=16)  # three chunks of scored queries
    logprobs, fids = together.run_windows(policy, dense_layers=(0,), fidelity=fidelity, reuse=reuse)
    assert logprobs.shape[:2] == (3, 40) and len(fids) == 3
    nll = together.nll(logprobs)
    for b in range(3):
        alone = SimulateSession(model, ids[b : b + 1], 40, block_size=8, chunk=16)
        lp, fid = alone.run(policy, dense_layers=(0,), fidelity=fidelity, reuse=reuse)
        # the model's own matmuls see another batch: float32 rounding apart at most (bit-identical on Llama here)
        torch.testing.assert_close(logprobs[b], lp, rtol=0, atol=1e-5)
        torch.testing.assert_close(nll[b], alone.nll(lp), rtol=0, atol=1e-5)
        if fidelity:
            assert fids[b].recall == pytest.approx(fid.recall, rel=1e-5)
            assert fids[b].hit_rate == pytest.approx(fid.hit_rate, rel=1e-5)
        else:
            assert fids[b] is None and fid is None
        if policy.compresses:
            assert together.freed_windows(policy)[b] == alone.freed(policy)
    if policy.compresses:
        assert len(set(together.freed_windows(policy))) > 1  # the windows free other blocks


def test_a_session_of_several_windows_refuses_the_one_window_calls():
    model = tiny_model("llama")
    session = SimulateSession(model, torch.cat([prompt(120, seed=1), prompt(120, seed=2)]), 16, block_size=8)
    with pytest.raises(ValueError, match="run_windows"):
        session.run(Quest(budget=0.25, sink=4, window=8), dense_layers=(0,))
    with pytest.raises(ValueError, match="freed_windows"):
        session.freed(SnapKV(budget=0.5, sink=4, window=16, observe=8))
