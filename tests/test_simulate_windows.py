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


def test_a_policy_fitted_on_the_whole_batch_is_scored_one_window_at_a_time():
    """Product-quantized coarse codes fitted at the prefill fit their centres on every sequence's keys
    (``fits_to_the_batch``), so windows scored together would share centres: a session of several windows refuses
    it, one of one window scores it; SnapKV inherits it from ``then``, the other policies do not fit to the batch."""
    from hf_sparse_kv.policies import QuantBlockTopK, TopPBlockTopK, TwoStageBlockTopK

    pq = TopPBlockTopK(budget=0.25, sink=4, window=8, candidates=4, p=1.0, coarse="pq", calibration="prefill")
    assert pq.fits_to_the_batch and SnapKV(budget=0.5, then=pq).fits_to_the_batch
    others = [Quest(budget=0.25), QuantBlockTopK(budget=0.25, bits=4), TwoStageBlockTopK(budget=0.25), SnapKV()]
    assert not any(p.fits_to_the_batch for p in others)
    model = tiny_model("llama")
    ids = torch.cat([prompt(200, seed=1), prompt(200, seed=2)])
    with pytest.raises(ValueError, match="fits_to_the_batch"):
        SimulateSession(model, ids, 40, block_size=8).run_windows(pq, dense_layers=(0,))
    lp, _ = SimulateSession(model, ids[:1], 40, block_size=8).run(pq, dense_layers=(0,))
    assert lp.isfinite().all()
