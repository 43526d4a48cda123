"""``candidate_mass``: a top-p selector's mass and ranking key from ``candidate_scores``' log-sum-exps in one op.

The Triton kernel against the reference over awkward shapes (GQA 1/3/4/8 through the rows of ``lse``, ``C`` not a
power of two and larger than a tile, fully padded rows, rows of ``-inf``, ``start > 0``, several sinks and windows,
forced blocks among the candidates); the reference against its definition (softmax, ``nan_to_num``, mean over the
group; ``forced_block_mask`` gathered at the candidates); and :class:`TopPBlockTopK` selecting exactly what it selected
before the op (the torch chain it ran, kept below), pools ``"max"`` and ``"heads"``, ``p = 1`` and ``p < 1``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_top_p_mass import STATES, _random_state, rank_by_mass

from hf_sparse_kv.ops import get_ops
from hf_sparse_kv.ops import reference as R
from hf_sparse_kv.ops.layout import cdiv, forced_block_mask
from hf_sparse_kv.policies import TopPBlockTopK
from hf_sparse_kv.policies.base import Selection

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INF = float("inf")

# (B, Hkv, G, C, BS, block_c): block_c None is the launcher's default (one tile up to 4096 // G lanes)
SHAPES = [
    (1, 1, 1, 1, 8, None),
    (2, 2, 1, 37, 16, None),
    (3, 1, 3, 100, 8, 16),  # 7 tiles of 16
    (2, 2, 4, 300, 16, None),
    (2, 1, 8, 1000, 8, None),  # 2 tiles of 512
    (1, 2, 8, 777, 16, 64),
    (2, 1, 1, 5000, 16, None),  # 2 tiles of 4096
]


def _case(B, H, G, C, BS, seed):
    """Random log-sum-exps ``[B, H * G, C]`` of random candidates ``[B, H, C]`` (distinct blocks per row, ascending,
    -1 padded at the end, some rows fully padded), ``-inf`` at padding, some candidates and one whole row of a head
    without a valid token; lengths not multiples of ``BS``, ``start > 0``."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, C * BS + 40, (B,), generator=g)
    start = torch.randint(0, 20, (B,), generator=g).minimum(lens - 1)
    blocks = torch.full((B, H, C), -1, dtype=torch.int32)
    for b in range(B):
        nblk = cdiv(int(lens[b]), BS)
        for h in range(H):
            keep = int(torch.randint(0, min(C, nblk) + 1, (1,), generator=g))
            if (b + h) % 3 == 0:
                keep = min(C, nblk)  # full rows: the forced blocks are candidates
            chosen = torch.randperm(nblk, generator=g)[:keep].sort().values
            blocks[b, h, :keep] = chosen.int()
    if B > 1:
        blocks[-1, -1] = -1  # a fully padded row
    lse = torch.randn(B, H * G, C, generator=g) * 6
    lse = lse.masked_fill(torch.rand(B, H * G, C, generator=g) < 0.1, -INF)  # candidates without a valid token
    lse = lse.masked_fill(blocks.repeat_interleave(G, 1) < 0, -INF)
    lse[0, -1] = -INF  # a head's row without any
    return lse, blocks, lens, start


def _assert_same(got, want):
    (mass, key), (mass_ref, key_ref) = got, want
    torch.testing.assert_close(mass, mass_ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(key.isposinf(), key_ref.isposinf()) and torch.equal(key.isneginf(), key_ref.isneginf())
    fin = key_ref.isfinite()
    torch.testing.assert_close(key[fin], key_ref[fin], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}H{s[1]}G{s[2]}C{s[3]}BS{s[4]}bc{s[5]}")
def test_candidate_mass_matches_reference(shape):
    pytest.importorskip("triton")
    B, H, G, C, BS, block_c = shape
    tri = get_ops("triton", DEVICE)
    for seed, (sink, window) in enumerate(((0, 1), (4, 16), (13, 70), (40, 0))):
        lse, blocks, lens, start = (t.to(DEVICE) for t in _case(B, H, G, C, BS, seed))
        want = R.candidate_mass(lse, blocks, lens, start, BS, sink, window)
        _assert_same(tri.candidate_mass(lse, blocks, lens, start, BS, sink, window), want)
        if block_c is not None:
            from hf_sparse_kv.ops.triton.candidate_mass import candidate_mass

            _assert_same(candidate_mass(lse, blocks, lens, start, BS, sink, window, block_c, num_warps=2), want)
        assert want[0].isfinite().all() and want[1].isposinf().any(), "no forced candidate: the test sees no +inf"


@pytest.mark.parametrize("shape", SHAPES[:5], ids=lambda s: f"B{s[0]}H{s[1]}G{s[2]}C{s[3]}BS{s[4]}")
def test_candidate_mass_reference_is_the_definition(shape):
    """Mass: the softmax of each row of ``lse`` over the candidates, NaN (a row of ``-inf``) to 0, mean over the
    group's rows; key: ``+inf`` where ``forced_block_mask`` holds the candidate, ``-inf`` at padding."""
    B, H, G, C, BS, _ = shape
    lse, blocks, lens, start = _case(B, H, G, C, BS, seed=5)
    mass, key = R.candidate_mass(lse, blocks, lens, start, BS, 4, 16)
    assert torch.equal(mass, lse.softmax(-1).nan_to_num(0.0).view(B, H, G, C).mean(2))
    assert not mass.isnan().any() and torch.equal(mass[blocks < 0], torch.zeros_like(mass[blocks < 0]))
    has = lse.view(B, H, G, C).isfinite().any(-1).all(-1)  # every head of the group has mass
    torch.testing.assert_close(mass.sum(-1)[has], torch.ones_like(mass.sum(-1)[has]))
    MB = cdiv(int(lens.max()), BS)
    forced = forced_block_mask(lens, start, 4, 16, BS, MB).gather(1, blocks.long().clamp(min=0).view(B, -1))
    forced = forced.view(B, H, C) & (blocks >= 0)
    want = mass.masked_fill(forced, INF).masked_fill(blocks < 0, -INF)
    assert torch.equal(key, want)


def test_candidate_mass_forces_what_the_rule_forces():
    """Every block of every length up to 100 as a candidate: the Triton key's ``+inf`` is ``forced_block_mask``."""
    pytest.importorskip("triton")
    tri = get_ops("triton", DEVICE)
    BS, H = 8, 2
    lens = torch.arange(1, 101)
    start = lens.remainder(7).minimum(lens - 1)
    B, MB = len(lens), cdiv(100, BS) + 1
    blocks = torch.arange(MB, dtype=torch.int32).expand(B, H, MB).contiguous()
    lse = torch.zeros(B, H, MB)
    for sink, window in ((0, 0), (0, 1), (4, 8), (13, 30), (9, 200)):
        _, key = tri.candidate_mass(
            lse.to(DEVICE), blocks.to(DEVICE), lens.to(DEVICE), start.to(DEVICE), BS, sink, window
        )
        forced = forced_block_mask(lens, start, sink, window, BS, MB)
        assert torch.equal(key.isposinf().cpu(), forced.unsqueeze(1).expand(B, H, MB)), (sink, window)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_candidate_mass_refuses_bad_shapes(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    ops = get_ops(backend, DEVICE)
    blocks = torch.zeros(2, 2, 5, dtype=torch.int32, device=DEVICE)
    n = torch.ones(2, dtype=torch.int32, device=DEVICE)
    for lse in (torch.zeros(2, 3, 5), torch.zeros(2, 4, 6), torch.zeros(1, 2, 5), torch.zeros(2, 2)):
        with pytest.raises(ValueError, match="candidate_mass"):
            ops.candidate_mass(lse.to(DEVICE), blocks, n, n, 8, 0, 1)


# ---- the policy selects what it selected before the op ----------------------------------------------------------


def _select_before_candidate_mass(policy: TopPBlockTopK, state) -> Selection:
    """``TopPBlockTopK.select`` (with its ``mass``) as it was before ``candidate_mass`` (branch masskeys' base,
    abc3a87), verbatim: softmax, ``nan_to_num``, mean over the group, the forced mask, its gather, two fills."""
    found = policy.candidate_blocks(state)
    if found is None:
        return policy.dense_selection(state)
    counts, cand = found
    B, H, C = cand.shape
    args = (state.q, state.k_pool, state.block_table, state.seq_lens, state.start, cand)
    if policy.pool == "max":
        lse = state.ops.candidate_scores(*args, reduce="mass", scale=state.scale)
        mass = lse.softmax(-1).nan_to_num(0.0)
    else:
        lse = state.ops.candidate_scores(*args, reduce="head_mass", scale=state.scale)
        mass = lse.softmax(-1).nan_to_num(0.0).view(B, H, lse.shape[1] // H, C).mean(2)
    return rank_by_mass(policy, state, mass, cand, counts)


def _policies():
    for pool in ("max", "heads"):
        for p in (1.0, 0.7):
            yield TopPBlockTopK(budget=64, sink=4, window=8, candidates=8, p=p, pool=pool)
            yield TopPBlockTopK(budget=0.25, sink=0, window=1, candidates=3, p=p, pool=pool)
        yield TopPBlockTopK(budget=48, sink=2, window=20, candidates=2, p=0.4, pool=pool)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("shape", STATES, ids=lambda s: f"H{s[0]}G{s[1]}BS{s[3]}{'ev' if s[6] else ''}")
def test_top_p_selects_what_it_selected_before_candidate_mass(shape, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    ops = get_ops(backend, DEVICE)
    dropped = 0
    for seed in range(2 if backend == "reference" else 1):
        state = _random_state(*shape, seed=seed, ops=ops)
        for policy in _policies():
            new, old = policy.select(state), _select_before_candidate_mass(policy, state)
            assert new.counts == old.counts and torch.equal(new.indices, old.indices), (policy, seed)
            dropped += int((new.indices < 0).sum()) if policy.p < 1 else 0
    assert dropped > 0, "p < 1 left no block out: the comparison would not see the cumulative mass"


def test_top_p_static_ops_select_what_the_eager_ops_select():
    """Through the registered custom op (what a static step calls) the policy selects what it selects eagerly."""
    from hf_sparse_kv.ops.library import registered_ops

    state = _random_state(*STATES[2], seed=4, ops=get_ops("reference", DEVICE))
    for policy in _policies():
        want = policy.select(state)
        got = policy.select(dataclasses.replace(state, ops=registered_ops("reference")))
        assert torch.equal(got.indices, want.indices), policy
