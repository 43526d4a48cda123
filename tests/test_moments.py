"""evaluation/moments.py (an issue-13 experiment): a block's softmax mass from its keys' mean and variance. Exact
where the keys make it exact (one distinct key per block), close to the truth on Gaussian keys, capped by Quest's
bound, and ranked through the oracle's pooling and top-k."""

from __future__ import annotations

import math

import pytest
import torch
from test_channel_quant import BS, MB, NB, B, D, G, H, _inputs  # the same paged layout and inputs

from evaluation.moments import MomentBlockTopK, moment_block_lse
from hf_sparse_kv.ops import reference as R

pytestmark = pytest.mark.usefixtures("one_thread")

SCALE = 0.3


def _exact_lse(q, k_pool, table, seq_lens, start):
    """The true log-sum-exp per head and block: QuantBlockTopK's reference on keys that quantize exactly (8 bits
    of a grid that holds them) is too indirect; compute it straight."""
    keys = k_pool[table.long().clamp(min=0)].float()  # [B, MB, Hkv, BS, D]
    s = torch.einsum("bhgd,bmhtd->bhgmt", q.float().view(B, H, G, D), keys) * SCALE
    pos = torch.arange(MB * BS).view(MB, BS)
    ok = (pos < seq_lens.view(-1, 1, 1)) & (pos >= start.view(-1, 1, 1)) & (table >= 0).unsqueeze(-1)
    return s.masked_fill(~ok.view(B, 1, 1, MB, BS), float("-inf")).logsumexp(-1).flatten(1, 2)


@pytest.mark.parametrize("estimate", ["gauss", "gauss_cap", "mean"])
def test_exact_when_each_block_holds_one_key(estimate):
    """Every position of a block holds the same key: no variance, the bound is that key's logit, so every estimate
    is the log-sum-exp itself, with ``-inf`` exactly where nothing is valid."""
    q, k_pool, table, seq_lens, start = _inputs()
    k_pool = k_pool[:, :, :1].expand(NB, H, BS, D).contiguous()
    got = moment_block_lse(q, k_pool, table, seq_lens, start, SCALE, estimate)
    want = _exact_lse(q, k_pool, table, seq_lens, start)
    assert got.shape == (B, H * G, MB)
    assert torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gauss_tracks_gaussian_keys_and_the_mean_alone_falls_short():
    """On many Gaussian keys per block with per-channel spreads, the variance term carries the log-sum-exp: the
    Gaussian estimate lands within a few hundredths of the truth, the mean alone under it by about that term."""
    g = torch.Generator().manual_seed(3)
    n, d = 4096, 8
    sd = torch.linspace(0.2, 1.5, d)
    keys = (torch.randn(1, 1, n, d, generator=g) * sd + 0.5).contiguous()  # one block of n keys, one head
    q = 2 * torch.randn(1, 1, d, generator=g)
    table, lens, start = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([n], dtype=torch.int32), torch.zeros(1)
    truth = torch.logsumexp(SCALE * keys[0, 0] @ q[0, 0], 0).item()
    gauss = moment_block_lse(q, keys, table, lens, start.int(), SCALE, "gauss").item()
    mean = moment_block_lse(q, keys, table, lens, start.int(), SCALE, "mean").item()
    term = 0.5 * SCALE**2 * float((q[0, 0] ** 2 * sd**2).sum())
    assert abs(gauss - truth) < 0.05
    assert term > 0.5 and abs(truth - mean - term) < 0.05
    assert mean < truth < mean + 2 * term


def test_cap_never_exceeds_quests_bound_and_gauss_elsewhere():
    q, k_pool, table, seq_lens, start = _inputs(1)
    k_pool = k_pool * 10.0  # a wide spread: the Gaussian term overshoots the bound in some blocks
    gauss = moment_block_lse(q, k_pool, table, seq_lens, start, SCALE, "gauss")
    cap = moment_block_lse(q, k_pool, table, seq_lens, start, SCALE, "gauss_cap")
    exact = _exact_lse(q, k_pool, table, seq_lens, start)
    live = exact.isfinite()
    assert torch.equal(cap.isinf(), exact.isinf())
    assert bool((cap[live] <= gauss[live] + 1e-5).all())
    assert bool((cap[live] < gauss[live] - 1e-3).any())  # the cap acts somewhere here
    # the true log-sum-exp is at most log n + the largest logit, itself at most the bound: so the cap, which is
    # log n + min(Gaussian, bound), is never below the largest logit, true log-sum-exp - log n
    assert bool((cap[live] >= exact[live] - math.log(BS) - 1e-4).all())


def test_policy_ranks_through_the_oracles_pooling():
    """The policy's scores are the oracle's pooled mass of the estimates; with one key per block they are the
    oracle's own scores, forced blocks and unused ones included."""
    q, k_pool, table, seq_lens, start = _inputs(2)
    k_pool = k_pool[:, :, :1].expand(NB, H, BS, D).contiguous()
    lse = moment_block_lse(q, k_pool, table, seq_lens, start, SCALE, "gauss")
    got = R.lse_block_mass(lse, table, seq_lens, start, BS, H, 4, 8)
    want = R.lse_block_mass(_exact_lse(q, k_pool, table, seq_lens, start), table, seq_lens, start, BS, H, 4, 8)
    assert torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    MomentBlockTopK(budget=64, estimate="gauss_cap")  # a valid spec builds
    with pytest.raises(ValueError, match="estimate"):
        MomentBlockTopK(budget=64, estimate="median")
    with pytest.raises(ValueError, match="estimate"):
        moment_block_lse(q, k_pool, table, seq_lens, start, SCALE, "median")
