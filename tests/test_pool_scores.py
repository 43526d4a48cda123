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


def _groups(n: int, seed: int):
    """``n`` windows' rows in turn, each group's table into its own slice of the pool (``_case``'s shared layout
    shifted by the slice), the pools laid one after the other: the simulate way's windows scored together."""
    cases = [_case(True, seed + w) for w in range(n)]
    NB = cases[0][1].shape[0]
    q = torch.cat([c[0] for c in cases])
    k_pool = torch.cat([c[1] for c in cases])
    table = torch.cat([torch.where(c[2] >= 0, c[2] + w * NB, -1) for w, c in enumerate(cases)]).int()
    seq_lens, start = torch.cat([c[3] for c in cases]), torch.cat([c[4] for c in cases])
    return cases, q, k_pool, table, seq_lens, start


def test_groups_of_rows_through_their_slices_of_the_pool_score_as_each_group_alone():
    """``through_pool=n``: the rows in ``n`` groups, each scored against its own slice of the pool only, give what
    each group gives alone through its own pool (token scores, the oracle's masses, Quest's and the mean key's
    block scores), and ``simulate_ops(n)`` passes the groups on; groups that do not divide the rows or the pool are
    refused."""
    cases, q, k_pool, table, seq_lens, start = _groups(3, 7)
    B = cases[0][0].shape[0]
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(2, *k_pool.shape[:2], k_pool.shape[3], generator=g)
    meta = (torch.minimum(a, b), torch.maximum(a, b), (a + b) / 2)
    NB = cases[0][1].shape[0]
    ops = simulate_ops(3)
    together = {
        "token": ops.token_scores(q, k_pool, table, seq_lens, start, 20),
        "oracle": ops.oracle_block_scores(q, k_pool, table, seq_lens, start, 0.3, 20),
        "quest": ops.block_scores(q, *meta, table, seq_lens, 4, "quest", start=start, sink=4, window=6),
        "mean": ops.block_scores(q, *meta, table, seq_lens, 4, "mean"),
    }
    for w, (qw, kw, tw, sw, stw) in enumerate(cases):
        rows, blocks = slice(w * B, (w + 1) * B), slice(w * NB, (w + 1) * NB)
        mw = tuple(m[blocks] for m in meta)
        alone = {
            "token": ref.token_scores(qw, kw, tw, sw, stw, 20, through_pool=True),
            "oracle": ref.oracle_block_scores(qw, kw, tw, sw, stw, 0.3, 20, through_pool=True),
            "quest": ref.block_scores(qw, *mw, tw, sw, 4, "quest", start=stw, sink=4, window=6, through_pool=True),
            "mean": ref.block_scores(qw, *mw, tw, sw, 4, "mean", through_pool=True),
        }
        for name, want in alone.items():
            got = together[name][rows]
            assert torch.equal(got.isinf(), want.isinf()) and want.isfinite().any(), name
            torch.testing.assert_close(got[want.isfinite()], want[want.isfinite()], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="equal groups"):
        ref.token_scores(q, k_pool, table, seq_lens, start, 20, through_pool=2)  # 15 rows
    with pytest.raises(ValueError, match="equal groups"):
        ref.block_scores(q, *meta, table, seq_lens, 4, "mean", through_pool=4)


class _Largest(torch.utils._python_dispatch.TorchDispatchMode):
    """The most elements any op's output held."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


def test_groups_score_each_row_against_its_slice_only():
    """What the groups are for: each row's products cover its group's slice of the pool, not the whole pool (with
    the whole pool the same scores come out, at ``n`` times the products)."""
    _, q, k_pool, table, seq_lens, start = _groups(3, 9)
    sizes = {}
    for groups in (True, 3):
        with _Largest() as seen:
            ref.token_scores(q, k_pool, table, seq_lens, start, 20, through_pool=groups)
        sizes[groups] = seen.most
    assert sizes[3] * 3 == sizes[True]
