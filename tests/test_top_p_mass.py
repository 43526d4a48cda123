"""TopPBlockTopK ranks by ``candidate_scores(reduce="mass")`` (each candidate's log-sum-exp, ``[B, Hkv, C]``) and
selects exactly what it selected from the token form (``[B, Hkv, C, BS]`` scores, softmax over all the candidates'
tokens, summed per block), on random states: GQA 1/3/4/8, lengths not multiples of the block size, left padding
(``start``), evicted blocks, padded candidates (a sequence shorter than the batch's widths), p = 1 and p < 1; and the
Triton ops select what the reference selects. ``pool="heads"`` (``reduce="head_mass"``, each query head's mass) over
every block at p = 1 selects what OracleBlockTopK selects."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_sparse_kv.ops import get_ops
from hf_sparse_kv.policies import DecodeState, OracleBlockTopK, TopPBlockTopK
from hf_sparse_kv.policies.base import Selection
from hf_sparse_kv.policies.two_stage import pick

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

STATES = [  # (Hkv, G, D, BS, lens, starts, evict)
    (2, 1, 16, 8, [61, 100], [0, 3], False),
    (1, 3, 32, 16, [300, 517, 129], [0, 20, 0], True),
    (2, 4, 32, 16, [250, 77], [5, 0], True),
    (2, 8, 16, 8, [203], [0], False),
]


def _random_state(Hkv, G, D, BS, lens, starts, evict, seed, ops) -> DecodeState:
    """Random keys in a permuted block table, Quest's metadata from them, a peaked random query; with ``evict`` the
    second block of each sequence long enough is freed (table entry -1, counted in ``evicted``)."""
    g = torch.Generator().manual_seed(seed)
    B, MB = len(lens), -(-max(lens) // BS)
    NB = B * MB + 2
    k_pool = torch.randn(NB, Hkv, BS, D, generator=g)
    table = torch.randperm(NB, generator=g)[: B * MB].view(B, MB).int()
    for b, n in enumerate(lens):
        table[b, -(-n // BS) :] = -1  # past the sequence's end
    evicted = None
    if evict:
        evicted = tuple(int(-(-n // BS) >= 4) for n in lens)
        for b, e in enumerate(evicted):
            if e:
                table[b, 1] = -1
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return DecodeState(
        q=(torch.randn(B, Hkv * G, D, generator=g) * 3).to(DEVICE), k_pool=k_pool.to(DEVICE),
        kmin=k_pool.amin(2).to(DEVICE), kmax=k_pool.amax(2).to(DEVICE), kmean=k_pool.mean(2).to(DEVICE),
        block_table=table.to(DEVICE), seq_lens=seq_lens.to(DEVICE),
        start=torch.tensor(starts, dtype=torch.int32, device=DEVICE), lens=tuple(lens), length=max(lens),
        block_size=BS, scale=D**-0.5, ops=ops, evicted=evicted,
    )  # fmt: skip


def _top_p_by_token_scores(policy: TopPBlockTopK, state: DecodeState) -> Selection:
    """``TopPBlockTopK.select`` as it was before the mass form (main at 3fd56d1), verbatim but for the candidates'
    token scores coming from ``candidate_blocks`` + ``candidate_scores`` (what its ``candidate_pass`` did)."""
    found = policy.candidate_blocks(state)
    if found is None:
        return policy.dense_selection(state)
    counts, cand = found
    exact = state.ops.candidate_scores(state.q, state.k_pool, state.block_table, state.seq_lens, state.start, cand)
    B, H, C, BS = exact.shape
    mass = (exact.view(B, H, C * BS) * state.scale).softmax(-1).nan_to_num(0.0).view(B, H, C, BS).sum(-1)
    return rank_by_mass(policy, state, mass, cand, counts)


def rank_by_mass(policy, state: DecodeState, mass: torch.Tensor, cand: torch.Tensor, counts) -> Selection:
    """The selection from the candidates' ``mass [B, Hkv, C]`` as the torch code before ``candidate_mass`` made it
    (verbatim: the forced mask, its gather at the candidates, two fills, top-p's cut, ``pick``); shared by the
    comparisons here and in test_candidate_mass.py."""
    B, H, C = cand.shape
    forced = policy.forced_blocks(state, policy.sink, policy.window)  # [B, nblk]
    f = forced.gather(1, cand.long().clamp(min=0).view(B, -1)).view(B, H, C) & (cand >= 0)
    key = mass.masked_fill(f, float("inf")).masked_fill(cand < 0, float("-inf"))
    if policy.p < 1:
        order = key.argsort(-1, descending=True)
        ranked = mass.gather(-1, order)
        above = ranked.cumsum(-1) - ranked
        keep = (above < policy.p) | f.gather(-1, order)
        keep = torch.zeros_like(keep).scatter(-1, order, keep)
        key = key.masked_fill(~keep, float("-inf"))
    blocks = pick(state.ops, key, cand, counts, state)
    return Selection("block", blocks, state.start, state.start, counts.per_sequence())


def _policies():
    for candidates in (2, 8):
        for p in (1.0, 0.9, 0.5, 0.2):
            yield TopPBlockTopK(budget=64, sink=4, window=8, candidates=candidates, p=p, pool="max")
    yield TopPBlockTopK(budget=0.25, sink=0, window=1, candidates=3, p=0.7, pool="max")


@pytest.mark.parametrize("shape", STATES, ids=lambda s: f"H{s[0]}G{s[1]}BS{s[3]}{'ev' if s[6] else ''}")
def test_mass_form_selects_what_the_token_form_selected(shape):
    ref = get_ops("reference", DEVICE)
    dropped = 0
    for seed in range(3):
        state = _random_state(*shape, seed=seed, ops=ref)
        for policy in _policies():
            new, old = policy.select(state), _top_p_by_token_scores(policy, state)
            assert new.counts == old.counts and torch.equal(new.indices, old.indices), (policy, seed)
            dropped += int((new.indices < 0).sum()) if policy.p < 1 else 0
    assert dropped > 0, "p < 1 left no block out: the comparison would not see the cumulative mass"


@pytest.mark.parametrize("shape", STATES, ids=lambda s: f"H{s[0]}G{s[1]}BS{s[3]}{'ev' if s[6] else ''}")
def test_triton_selects_what_the_reference_selects(shape):
    """Both pools, p = 1 and p < 1: the Triton ops select what the reference ops select."""
    pytest.importorskip("triton")
    state = _random_state(*shape, seed=11, ops=get_ops("reference", DEVICE))
    for pool in ("heads", "max"):
        for policy in (
            TopPBlockTopK(64, 4, 8, candidates=8, p=1.0, pool=pool),
            TopPBlockTopK(64, 4, 8, candidates=2, p=0.6, pool=pool),
        ):
            ref = policy.select(state)
            out = policy.select(dataclasses.replace(state, ops=get_ops("triton", DEVICE)))
            assert out.counts == ref.counts and torch.equal(out.indices, ref.indices), policy
            assert (ref.indices >= 0).sum() > 0


@pytest.mark.parametrize("shape", STATES, ids=lambda s: f"H{s[0]}G{s[1]}BS{s[3]}{'ev' if s[6] else ''}")
def test_heads_pool_over_every_block_selects_what_the_oracle_selects(shape):
    """``pool="heads"`` is the oracle's criterion on the candidates: with every live block a candidate and ``p = 1``
    it selects what :class:`OracleBlockTopK` (true softmax mass per query head, summed over the group) selects with
    the same budget, sink and window; ``pool="max"`` does not (the comparison sees the pooling)."""
    ref = get_ops("reference", DEVICE)
    differs = 0
    for seed in range(3):
        state = _random_state(*shape, seed=seed, ops=ref)
        for budget, sink, window in ((64, 4, 8), (0.25, 0, 1), (48, 2, 20)):
            oracle = OracleBlockTopK(budget=budget, sink=sink, window=window).select(state)
            kw = {"budget": budget, "sink": sink, "window": window, "candidates": 1000, "p": 1.0}
            heads = TopPBlockTopK(**kw, pool="heads").select(state)
            assert heads.counts == oracle.counts and torch.equal(heads.indices, oracle.indices), (budget, seed)
            pooled = TopPBlockTopK(**kw, pool="max").select(state)
            differs += int(not torch.equal(pooled.indices, oracle.indices))
    assert differs > 0 or shape[1] == 1, "max pooling selected the oracle's blocks everywhere: the test shows nothing"


@pytest.mark.parametrize("shape", STATES, ids=lambda s: f"H{s[0]}G{s[1]}BS{s[3]}{'ev' if s[6] else ''}")
def test_heads_pool_mass_is_a_fraction_per_kv_head(shape):
    """Each KV head's candidate mass sums to 1 in both pools (so ``p`` is the same fraction); with one query head
    per KV head the pools are the same criterion and select the same blocks at every ``p``."""
    ref = get_ops("reference", DEVICE)
    state = _random_state(*shape, seed=3, ops=ref)
    dropped = 0
    for policy in _policies():
        heads = dataclasses.replace(policy, pool="heads")
        _, cand = heads.candidate_blocks(state)
        for pol in (policy, heads):
            total = pol.mass_and_key(state, cand)[0].sum(-1)
            torch.testing.assert_close(total, torch.ones_like(total))
        sel, base = heads.select(state), policy.select(state)
        if shape[1] == 1:
            assert torch.equal(sel.indices, base.indices), policy
        dropped += int((sel.indices < 0).sum()) if policy.p < 1 else 0
    assert dropped > 0, "p < 1 left no block out with pool='heads'"


def test_a_bad_pool_is_refused():
    for pool in ("mean", "", None, "Heads"):
        with pytest.raises(ValueError, match="pool"):
            TopPBlockTopK(64, 4, 8, candidates=2, pool=pool)
