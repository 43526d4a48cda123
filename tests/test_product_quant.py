"""evaluation/product_quant.py (an issue-13 experiment): two stages whose coarse pass reads product-quantized keys.
The centres are fitted on valid keys only; with a centre per key the coarse pass is the oracle's; with every block a
candidate the fine pass alone decides; with as many candidates as the budget the coarse pass alone does."""

from __future__ import annotations

import pytest
import torch
from test_compact_grid import BS, LONG, _long_state

from evaluation.compact_grid import CompactGridBlockTopK
from evaluation.product_quant import ProductQuantBlockTopK
from hf_sparse_kv.ops.reference import held_positions
from hf_sparse_kv.policies import OracleBlockTopK

pytestmark = pytest.mark.usefixtures("one_thread")


def _valid_slots(state) -> torch.Tensor:
    """``[NB, BS]`` bool: the pool's slots some sequence holds a valid key in."""
    w = held_positions(state.block_table, state.seq_lens, state.start, BS)
    out = torch.zeros(state.k_pool.shape[0], BS, dtype=torch.bool)
    held = state.block_table >= 0
    out[state.block_table[held].long()] = w[held]
    return out


def test_a_centre_per_key_codes_every_valid_key_exactly_and_ranks_like_the_oracle():
    for seed in range(2):
        state = _long_state(seed)
        policy = ProductQuantBlockTopK(sub_dim=4, centroids=4096, candidates=1, **LONG)
        coded = policy.coded_pool(state)
        valid = _valid_slots(state)
        assert torch.equal(coded.transpose(1, 2)[valid], state.k_pool.transpose(1, 2)[valid])
        want = OracleBlockTopK(**LONG).select(state)
        assert torch.equal(policy.select(state).indices, want.indices)


def test_keys_outside_the_sequences_do_not_move_the_centres():
    state = _long_state(0)
    policy = ProductQuantBlockTopK(sub_dim=4, centroids=8, **LONG)
    clean = policy.coded_pool(state)
    valid = _valid_slots(state)
    dirty = state.k_pool.clone().transpose(1, 2)  # [NB, BS, Hkv, D]
    dirty[~valid] = 1e4  # stale slots: past a sequence's end, before its start
    state.k_pool = dirty.transpose(1, 2).contiguous()
    assert torch.equal(policy.coded_pool(state).transpose(1, 2)[valid], clean.transpose(1, 2)[valid])


def test_the_candidates_bound_the_choice_and_the_fine_pass_picks():
    differs = 0
    for seed in range(3):
        state = _long_state(seed)
        rough = {"sub_dim": 8, "centroids": 4, **LONG}
        every = ProductQuantBlockTopK(candidates=100, **rough).select(state)
        assert torch.equal(every.indices, OracleBlockTopK(**LONG).select(state).indices)
        every4 = ProductQuantBlockTopK(candidates=100, fine="quant4", **rough).select(state)
        quant4 = CompactGridBlockTopK(bits=4, group=BS, meta="bf16", **LONG).select(state)
        assert torch.equal(every4.indices, quant4.indices)
        one = ProductQuantBlockTopK(candidates=1, **rough).select(state)  # the coarse pass's choice
        assert torch.equal(
            one.indices, ProductQuantBlockTopK(candidates=1, fine="quant4", **rough).select(state).indices
        )
        differs += not torch.equal(one.indices, every.indices)
    assert differs > 0  # 4 centres a piece do not rank like the oracle: the inputs test the two stages


def test_bad_arguments_are_refused():
    bad_args = ({"sub_dim": 0}, {"centroids": 1}, {"iters": 0}, {"fine": "bf16"}, {"candidates": 0.5})
    for bad in (*bad_args, {"sample": 0}, {"sample": True}, {"sample": 2.5}):
        with pytest.raises(ValueError):
            ProductQuantBlockTopK(budget=0.25, **bad)
    state = _long_state(0)
    with pytest.raises(ValueError, match="does not divide"):
        ProductQuantBlockTopK(sub_dim=5, **LONG).coded_pool(state)
