"""``ops.block_shares`` (the per-head coarse score of ``coarse="quest_heads"`` / ``"quest_heads_max"``): its shape
and masks, its semantics against a loop over (sequence, query head, block) in plain Python floats, its relation to
``block_scores`` with one query head per KV head, the Triton namespace running its reference, and the two-stage
selectors' coarse pass through it (with every block a candidate, the oracle's selection)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_top_p_mass import STATES, _random_state

from hf_sparse_kv.ops import REFERENCE_ONLY, get_ops, reference
from hf_sparse_kv.ops.layout import forced_block_mask
from hf_sparse_kv.policies import OracleBlockTopK, TopPBlockTopK, TwoStageBlockTopK

INF = float("inf")
IDS = lambda s: f"H{s[0]}G{s[1]}BS{s[3]}{'ev' if s[6] else ''}"


def _args(state):
    return (state.q, state.kmin, state.kmax, state.block_table, state.seq_lens, state.block_size, state.scale)


def _loop(state, pool: str) -> list:
    """The definition, one float at a time: ``[B][Hkv][MB]`` (``None``: not in use)."""
    q, kmin, kmax, table = state.q.double(), state.kmin.double(), state.kmax.double(), state.block_table
    B, Hq, D = q.shape
    Hkv, BS, MB = kmin.shape[1], state.block_size, table.shape[1]
    G = Hq // Hkv
    out = []
    for b in range(B):
        nblk = -(-int(state.seq_lens[b]) // BS)
        live = [m for m in range(MB) if m < nblk and int(table[b, m]) >= 0]
        rows = []
        for k in range(Hkv):
            shares = []
            for g in range(G):
                h = k * G + g
                u = {}
                for m in live:
                    p = int(table[b, m])
                    bound = sum(max(q[b, h, d] * kmin[p, k, d], q[b, h, d] * kmax[p, k, d]) for d in range(D))
                    u[m] = state.scale * float(bound)
                top = max(u.values())
                z = sum(math.exp(x - top) for x in u.values())
                shares.append({m: math.exp(x - top) / z for m, x in u.items()})
            row = [None] * MB
            for m in live:
                vals = [s[m] for s in shares]
                row[m] = sum(vals) / G if pool == "mean" else max(vals)
            rows.append(row)
        out.append(rows)
    return out


@pytest.mark.parametrize("pool", ["mean", "max"])
@pytest.mark.parametrize("shape", STATES[:3], ids=IDS)
def test_block_shares_is_its_definition(shape, pool):
    """Against the loop: each query head's softmax over the blocks in use of its scaled Quest bounds, pooled over the
    group by its mean or max; ``-inf`` where a block is not in use (past the end, evicted); ``[B, Hkv, MB]`` float32."""
    state = _random_state(*shape, seed=0, ops=get_ops("reference"))
    got = reference.block_shares(*_args(state), pool)
    B, Hkv, MB = state.q.shape[0], state.kmin.shape[1], state.block_table.shape[1]
    assert got.shape == (B, Hkv, MB) and got.dtype == torch.float32
    want = _loop(state, pool)
    for b in range(B):
        for k in range(Hkv):
            for m in range(MB):
                w = want[b][k][m]
                if w is None:
                    assert got[b, k, m] == -INF, (b, k, m)
                else:
                    assert math.isclose(float(got[b, k, m]), w, rel_tol=1e-4, abs_tol=1e-6), (b, k, m)


@pytest.mark.parametrize("shape", STATES, ids=IDS)
def test_forced_blocks_are_inf_and_shares_sum_to_one(shape):
    """With a window the forced blocks in use score ``+inf`` and nothing else changes; without one the mean pool sums
    to 1 over the blocks in use of each (sequence, KV head), and the max pool is at least the mean."""
    state = _random_state(*shape, seed=1, ops=get_ops("reference"))
    plain = reference.block_shares(*_args(state), "mean")
    live = plain > -INF
    total = plain.masked_fill(~live, 0).sum(-1)
    torch.testing.assert_close(total, torch.ones_like(total))
    high = reference.block_shares(*_args(state), "max")
    assert torch.equal(high > -INF, live) and bool((high[live] >= plain[live] - 1e-7).all())
    sink, window = 3, 20
    forced_in = reference.block_shares(*_args(state), "mean", state.start, sink, window)
    MB = state.block_table.shape[1]
    forced = forced_block_mask(state.seq_lens, state.start, sink, window, state.block_size, MB).unsqueeze(1) & live
    assert bool(forced.any()) and bool((forced_in[forced] == INF).all())
    assert torch.equal(forced_in[~forced], plain[~forced])


@pytest.mark.parametrize("shape", [s for s in STATES if s[1] == 1], ids=IDS)
def test_one_query_head_per_kv_head_ranks_as_quest(shape):
    """With ``G = 1`` both pools are the one head's softmax, a monotone map of ``block_scores``' Quest bound: the same
    order of the blocks in use (the coarse pass keeps the same candidates as ``coarse="quest"``)."""
    for seed in range(3):
        state = _random_state(*shape, seed=seed, ops=get_ops("reference"))
        mean = reference.block_shares(*_args(state), "mean")
        assert torch.equal(mean, reference.block_shares(*_args(state), "max"))
        quest = reference.block_scores(
            state.q, state.kmin, state.kmax, state.kmean, state.block_table, state.seq_lens, state.block_size, "quest"
        )
        live = quest > -INF
        a, b = mean.masked_fill(~live, -1.0), quest.masked_fill(~live, -INF)
        # pairwise order over the blocks in use: never reversed (ties in the softmax may round together)
        reversed_ = (a.unsqueeze(-1) > a.unsqueeze(-2)) & (b.unsqueeze(-1) < b.unsqueeze(-2))
        assert not bool(reversed_.any()), seed


def test_bad_arguments_are_refused():
    state = _random_state(*STATES[0], seed=0, ops=get_ops("reference"))
    with pytest.raises(ValueError, match="pool"):
        reference.block_shares(*_args(state), "sum")
    with pytest.raises(ValueError, match="scale"):
        reference.block_shares(*_args(state)[:-1], 0.0)
    with pytest.raises(ValueError, match="coarse"):
        TwoStageBlockTopK(budget=0.25, coarse="quest_mean")


def test_triton_namespace_runs_the_reference_explicitly():
    """``block_shares`` has no kernel: the Triton namespace holds the reference function itself (listed in
    ``REFERENCE_ONLY``), and every other op of the namespace is a kernel or a listed reference."""
    pytest.importorskip("triton")
    ops = get_ops("triton", "cpu")
    assert "block_shares" in REFERENCE_ONLY and ops.block_shares is reference.block_shares
    for name in REFERENCE_ONLY:
        assert getattr(ops, name) is getattr(reference, name), name


@pytest.mark.parametrize("coarse", ["quest_heads", "quest_heads_max"])
@pytest.mark.parametrize("shape", STATES, ids=IDS)
def test_coarse_pass_over_every_block_keeps_the_oracles_selection(shape, coarse):
    """Every block a candidate: the per-head coarse pass changes nothing and top-p's heads pool selects what the
    oracle selects; with few candidates the coarse pass keeps the forced blocks (every selection holds them)."""
    ref = get_ops("reference")
    for seed in range(2):
        state = _random_state(*shape, seed=seed, ops=ref)
        for budget, sink, window in ((64, 4, 8), (0.25, 0, 1)):
            oracle = OracleBlockTopK(budget=budget, sink=sink, window=window).select(state)
            kw = {"budget": budget, "sink": sink, "window": window, "p": 1.0, "pool": "heads", "coarse": coarse}
            sel = TopPBlockTopK(**kw, candidates=1000).select(state)
            assert sel.counts == oracle.counts and torch.equal(sel.indices, oracle.indices), (budget, seed)
            few = TopPBlockTopK(**kw, candidates=1).select(state)
            MB = state.block_table.shape[1]
            forced = forced_block_mask(state.seq_lens, state.start, sink, window, state.block_size, MB)
            forced = forced & (state.block_table >= 0)  # [B, MB]
            held = torch.zeros(*few.indices.shape[:2], MB + 1, dtype=torch.bool, device=few.indices.device)
            held.scatter_(2, few.indices.long().masked_fill(few.indices < 0, MB), True)
            assert bool((held[..., :MB] | ~forced.unsqueeze(1)).all()), (budget, seed)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_static_ops_select_what_the_eager_ops_select(backend):
    """Through the registered custom op (what a static step calls) the per-head coarse pass selects what it selects
    with the reference namespace, on either backend's registered ops (both run the reference)."""
    if backend == "triton":
        pytest.importorskip("triton")
    from hf_sparse_kv.ops.library import registered_ops

    state = _random_state(*STATES[2], seed=4, ops=get_ops("reference"))
    for coarse in ("quest_heads", "quest_heads_max"):
        policy = TopPBlockTopK(budget=64, sink=4, window=8, candidates=2, p=1.0, coarse=coarse)
        want = policy.select(state)
        got = policy.select(dataclasses.replace(state, ops=registered_ops(backend)))
        assert got.counts == want.counts and torch.equal(got.indices, want.indices), coarse
