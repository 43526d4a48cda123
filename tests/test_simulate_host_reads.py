"""The simulate way reads nothing back from the device while it forwards: its per-layer host values (lengths,
widths) come from host ints and its fidelity sums stay on the device until read, so on a GPU the host queues a whole
forward ahead of the kernels instead of waiting for them at every layer (a read-back is a stream synchronisation).
Counted on the CPU with a TorchFunctionMode that sees every ``item`` / ``tolist`` / ``int()`` / ``float()`` /
``bool()`` of a tensor."""

from __future__ import annotations

import pytest
import torch
from tiny_models import prompt, tiny_model
from torch.overrides import TorchFunctionMode

from evaluation.simulate import SimulateSession
from hf_sparse_kv.policies import BlockTopK, OracleBlockTopK, Quest, SinkWindow, TokenTopK

READS = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__"}


class CountReads(TorchFunctionMode):
    """Counts the tensor methods that copy a value to the host."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "policy, reuse",
    [
        (Quest(budget=0.25, sink=4, window=8), 1),
        (Quest(budget=0.25, sink=4, window=8), 3),
        (OracleBlockTopK(budget=32, sink=2, window=8), 1),
        (TokenTopK(budget=0.25, sink=4, window=8), 1),
        (BlockTopK(budget=0.25, sink=4, window=8), 1),
        (SinkWindow(budget=48, sink=4), 1),
    ],
    ids=lambda x: type(x).__name__ if not isinstance(x, int) else f"reuse{x}",
)
def test_a_simulated_forward_reads_nothing_back_and_its_fidelity_is_read_once(policy, reuse):
    model = tiny_model("llama")
    session = SimulateSession(model, prompt(160), 40, block_size=8, chunk=16)  # three chunks of scored queries
    with CountReads() as counter:
        logprobs, fid = session.run(policy, dense_layers=(0,), fidelity=True, reuse=reuse)
    assert counter.reads == []
    assert isinstance(fid.recall_sum, torch.Tensor) and fid.recall_sum.dtype == torch.float64
    assert 0.0 < fid.recall <= 1.0 + 1e-9 and 0.0 <= fid.hit_rate <= 1.0
    assert torch.isfinite(logprobs).all()


def test_a_simulated_forward_plans_each_chunk_once_not_once_a_layer(monkeypatch):
    """The policy's ``plan`` (Python over every scored query's length) runs once per chunk of scored queries and
    rule (the policy's, the fidelity oracle's), not again at every layer: the answers are remembered for the
    forward; the policy the caller passed is left as it was."""
    from hf_sparse_kv.policies.blocks import _BlockTopK

    calls = []
    real = _BlockTopK.plan
    monkeypatch.setattr(
        _BlockTopK, "plan", lambda self, lens, bs: calls.append(type(self).__name__) or real(self, lens, bs)
    )
    model = tiny_model("llama", num_hidden_layers=4)
    session = SimulateSession(model, prompt(160), 40, block_size=8, chunk=16)  # three chunks, three sparse layers
    policy = Quest(budget=0.25, sink=4, window=8)
    session.run(policy, dense_layers=(0,), fidelity=True)
    assert sorted(calls) == ["Quest"] * 3 + ["_GivenScores"] * 3
    assert "plan" not in vars(policy)
