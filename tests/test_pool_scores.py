"""The exact scorers through the pool (``through_pool=True``, the simulate way's) equal them through gathered keys."""

import pytest
import torch

from evaluation.simulate import simulate_ops
from hf_sparse_kv.ops import reference as ref


def _case(shared: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    NB, Hkv, G, BS, D, B, MB = 32, 2, 3, 4, 8, 5, 6
    k_pool = torch.randn(NB, Hkv, BS, D, generator=g)
    q = torch.randn(B, Hkv * G, D, generator=g)
    if shared:  # the simulate way's rows: the same blocks in order, each its own current block, some freed
        table = torch.arange(MB).repeat(B, 1)
        table[:, -1] = torch.arange(NB - B, NB)
        table[:, 2] = -1
    else:  # separate sequences: disjoint blocks in any order
        table = torch.randperm(NB, generator=g)[: B * MB].view(B, MB)
        table[1, 3:] = -1
    seq_lens = torch.tensor([24, 21, 13, 24, 17], dtype=torch.int32)
    start = torch.tensor([0, 0, 3, 0, 5], dtype=torch.int32)
    return q, k_pool, table.int(), seq_lens, start


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_scores_through_the_pool_equal_gathered(shared, seed):
    q, k_pool, table, seq_lens, start = _case(shared, seed)
    for length in (None, 20):
        a = ref.token_scores(q, k_pool, table, seq_lens, start, length)
        b = ref.token_scores(q, k_pool, table, seq_lens, start, length, through_pool=True)
        assert torch.equal(a.isinf(), b.isinf())
        torch.testing.assert_close(b[a.isfinite()], a[a.isfinite()], rtol=1e-5, atol=1e-5)
        m = ref.oracle_block_scores(q, k_pool, table, seq_lens, start, 0.3, length)
        n = ref.oracle_block_scores(q, k_pool, table, seq_lens, start, 0.3, length, through_pool=True)
        assert torch.equal(m.isinf(), n.isinf()) and m.isfinite().any()
        torch.testing.assert_close(n[m.isfinite()], m[m.isfinite()], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("method", ["quest", "mean"])
def test_block_scores_through_the_pool_equal_gathered(shared, method):
    q, k_pool, table, seq_lens, start = _case(shared, 3)
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(2, *k_pool.shape[:2], k_pool.shape[3], generator=g)
    kmin, kmax, kmean = torch.minimum(a, b), torch.maximum(a, b), (a + b) / 2
    for forcing in ({}, {"start": start, "sink": 4, "window": 6}):
        want = ref.block_scores(q, kmin, kmax, kmean, table, seq_lens, 4, method, **forcing)
        got = ref.block_scores(q, kmin, kmax, kmean, table, seq_lens, 4, method, **forcing, through_pool=True)
        assert torch.equal(want.isinf(), got.isinf()) and torch.equal(want == float("inf"), got == float("inf"))
        torch.testing.assert_close(got[want.isfinite()], want[want.isfinite()], rtol=1e-5, atol=1e-5)


def test_simulate_ops_score_through_the_pool():
    ops = simulate_ops()
    q, k_pool, table, seq_lens, start = _case(True, 2)
    assert ops.name == "reference" and ops.topk_indices is ref.topk_indices
    want = ref.token_scores(q, k_pool, table, seq_lens, start, through_pool=True)
    assert torch.equal(ops.token_scores(q, k_pool, table, seq_lens, start), want)
    want = ref.oracle_block_scores(q, k_pool, table, seq_lens, start, 0.5, through_pool=True)
    assert torch.equal(ops.oracle_block_scores(q, k_pool, table, seq_lens, start, 0.5), want)
    meta = k_pool.amin(2), k_pool.amax(2), k_pool.mean(2)
    want = ref.block_scores(q, *meta, table, seq_lens, 4, "quest", through_pool=True)
    assert torch.equal(ops.block_scores(q, *meta, table, seq_lens, 4, "quest"), want)
