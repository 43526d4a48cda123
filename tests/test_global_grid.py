"""evaluation/global_grid.py (an issue-13 experiment): low-bit keys on one grid per (sequence, KV head, channel).
The grid spans what it says over the valid keys only; keys that sit on the grid come back exactly, so the policy
then ranks like the oracle; more bits track the oracle's mass more closely."""

from __future__ import annotations

import pytest
import torch
from test_channel_quant import BS, NB, B, D, H, _inputs  # the same paged layout and inputs

from evaluation.global_grid import GAUSS_RANGE, GlobalGridBlockTopK, dequantized_pool, sequence_grid
from hf_sparse_kv.ops import get_ops
from hf_sparse_kv.ops import reference as R
from hf_sparse_kv.policies.base import DecodeState

pytestmark = pytest.mark.usefixtures("one_thread")

SCALE = 0.3
SPEC = {"budget": 16, "sink": 0, "window": 8}


def _valid_keys(k_pool, table, seq_lens, start, b):
    """``[n, Hkv, D]`` the valid keys of sequence ``b``, gathered one position at a time."""
    out = []
    for p in range(int(start[b]), int(seq_lens[b])):
        blk = int(table[b, p // BS])
        if blk >= 0:
            out.append(k_pool[blk, :, p % BS])
    return torch.stack(out)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_grid_spans_the_valid_keys_only(bits):
    _, k_pool, table, seq_lens, start = _inputs()
    k_pool = k_pool.clone()
    k_pool[11] = 1e4  # a block no sequence holds (and positions past each length) must not move the grid
    lo, hi = sequence_grid(k_pool, table, seq_lens, start, bits, "minmax")
    glo, ghi = sequence_grid(k_pool, table, seq_lens, start, bits, "gauss")
    assert lo.shape == hi.shape == (B, H, D)
    for b in range(B):
        keys = _valid_keys(k_pool, table, seq_lens, start, b)
        torch.testing.assert_close(lo[b], keys.amin(0))
        torch.testing.assert_close(hi[b], keys.amax(0))
        mean, sd = keys.mean(0), keys.std(0, unbiased=False)
        torch.testing.assert_close(glo[b], mean - GAUSS_RANGE[bits] * sd, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ghi[b], mean + GAUSS_RANGE[bits] * sd, rtol=1e-5, atol=1e-5)


def test_keys_on_the_grid_come_back_exactly_and_the_rest_is_clamped():
    k_pool, table = _inputs(1)[1:3]
    lo = torch.full((B, H, D), -1.5)
    hi = torch.full((B, H, D), 1.5)
    on_grid = torch.randint(0, 4, k_pool.shape, generator=torch.Generator().manual_seed(0)).float() - 1.5
    got = dequantized_pool(on_grid, table, lo, hi, 2)
    held = sorted({int(x) for x in table.flatten() if x >= 0})
    free = [i for i in range(NB) if i not in held]
    assert torch.equal(got[held], on_grid[held]) and bool((got[free] == 0).all())
    far = dequantized_pool(on_grid * 10, table, lo, hi, 2)
    assert bool((far[held].abs() == 1.5).all())  # beyond the ends: the end levels


def _state(q, k_pool, table, seq_lens, start):
    n = int(seq_lens.max())
    zeros = torch.zeros(NB, H, D)
    return DecodeState(
        q=q, k_pool=k_pool, kmin=zeros, kmax=zeros, kmean=zeros, block_table=table, seq_lens=seq_lens, start=start,
        lens=tuple(int(x) for x in seq_lens), length=n, block_size=BS, scale=SCALE, ops=get_ops("reference"),
        state={}, layer=0,
    )  # fmt: skip


def test_mass_is_the_oracles_on_grid_keys_and_closer_with_more_bits():
    q, k_pool, table, seq_lens, start = _inputs(2)
    oracle = R.oracle_block_scores(q, k_pool, table, seq_lens, start, SCALE)
    # keys that take only the two values of each channel's min / max: 1 bit on the min / max grid is exact
    two = torch.where(k_pool > 0, 1.0, -0.5)
    exact = GlobalGridBlockTopK(bits=1, grid="minmax", **SPEC).mass(_state(q, two, table, seq_lens, start))
    want = R.oracle_block_scores(q, two, table, seq_lens, start, SCALE)
    assert torch.equal(exact.isinf(), want.isinf())
    torch.testing.assert_close(exact, want)
    live = oracle.isfinite()
    state = _state(q, k_pool, table, seq_lens, start)
    mass = {bits: GlobalGridBlockTopK(bits=bits, **SPEC).mass(state) for bits in (1, 2, 4)}
    err = {bits: (m - oracle)[live].abs().mean() for bits, m in mass.items()}
    assert err[4] < err[2] < err[1]
    assert all(torch.equal(m.isinf(), oracle.isinf()) for m in mass.values())


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="grid"):
        GlobalGridBlockTopK(grid="median", **SPEC)
    with pytest.raises(ValueError, match="bits"):
        GlobalGridBlockTopK(bits=8, **SPEC)
