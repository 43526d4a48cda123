"""A budget below what a policy always attends (sink + window) says so at construction, with the effective budget."""

import warnings

import pytest

from hf_sparse_kv.policies import BlockTopK, OracleBlockTopK, Quest, SinkWindow, SnapKV, TokenTopK


@pytest.mark.parametrize("cls", [Quest, BlockTopK, OracleBlockTopK, TokenTopK, SnapKV])
def test_int_budget_below_sink_and_window_warns_with_the_effective_budget(cls):
    with pytest.warns(UserWarning, match=r"budget=8\) .*sink \+ window = 4 \+ 32 = 36.*budget=36") as caught:
        low = cls(budget=8, sink=4, window=32)
    assert caught[0].filename == __file__  # points at the line that built the policy
    if cls is not SnapKV:  # what the warning says: it plans what budget=36 plans
        lens = (100, 1000, 5000)
        assert low.plan(lens, 16) == cls(budget=36, sink=4, window=32).plan(lens, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cls(budget=36, sink=4, window=32)  # at the rule's limit, and fractions, say nothing
        cls(budget=0.01, sink=4, window=32)


def test_sink_window_budget_below_the_sink_warns():
    with pytest.warns(UserWarning, match=r"budget=3\) .*sink \+ window = 4 \+ 1 = 5.*budget=5"):
        SinkWindow(sink=4, budget=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SinkWindow(sink=4, budget=5)
