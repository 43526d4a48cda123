"""evaluation/channel_quant.py (an issue-13 experiment): 4-bit-key mass on the query's largest channels. With every
channel it is ``QuantBlockTopK``'s log-sum-exp; with fewer, each way of filling in the other channels is exact where
it should be; the screen's cells are built from their specs."""

from __future__ import annotations

import pytest
import torch

from evaluation.channel_quant import ChannelQuantBlockTopK, channel_mask, channel_quant_block_lse
from evaluation.coarse_pool import cells
from hf_sparse_kv.ops import reference as R

pytestmark = pytest.mark.usefixtures("one_thread")

NB, H, G, BS, D, B, MB = 12, 2, 3, 8, 16, 2, 5


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(NB, H, BS, D, generator=g)
    table = torch.tensor([[3, 7, 1, 9, 2], [4, -1, 5, 0, 6]], dtype=torch.int32)
    seq_lens, start = torch.tensor([37, 33], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    q = torch.randn(B, H * G, D, generator=g)
    return q, k_pool, table, seq_lens, start


def _lse(q, k_pool, table, seq_lens, start, channels, rest):
    kmin, kmax, kmean = k_pool.amin(2), k_pool.amax(2), k_pool.mean(2)
    codes = R.quantize_keys(k_pool, kmin, kmax, 4)
    args = (codes, kmin, kmax)
    got = channel_quant_block_lse(q, *args, kmean, table, seq_lens, start, 0.3, 4, channels, rest)
    return got, R.quant_block_lse(q, *args, table, seq_lens, start, 0.3, 4)


@pytest.mark.parametrize("rest", ["mean", "block", "none"])
def test_every_channel_is_quant_block_topk(rest):
    got, want = _lse(*_inputs(), D, rest)
    assert got.shape == (B, H * G, MB)
    assert torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_channel_mask_takes_the_groups_largest_pooled_magnitudes():
    q = torch.zeros(1, H * G, D)
    q[0, 0, 3], q[0, 1, 3], q[0, 2, 7] = 1.0, -1.5, 2.0  # group 0: channel 3 (2.5) before 7 (2.0)
    q[0, 3:, 9] = -0.1  # group 1: only channel 9
    m = channel_mask(q, H, 2)
    assert m.shape == (1, H, D) and m.sum(-1).tolist() == [[2.0, 2.0]]
    assert m[0, 0, 3] == 1 and m[0, 0, 7] == 1 and m[0, 1, 9] == 1
    assert torch.equal(channel_mask(q, H, 1)[0, 0].nonzero().flatten(), torch.tensor([3]))
    with pytest.raises(ValueError, match="channels"):
        channel_mask(q, H, D + 1)
    runs = channel_mask(q, H, 8, group=4)  # group 0: runs [0, 4) (2.5 at channel 3) and [4, 8) (2.0 at 7)
    assert runs[0, 0].nonzero().flatten().tolist() == list(range(8))
    assert runs[0, 1].sum() == 8 and runs[0, 1, 8:12].sum() == 4  # group 1: the run holding channel 9, and one more
    with pytest.raises(ValueError, match="group"):
        channel_mask(q, H, 6, group=4)


def test_block_means_fill_in_channels_that_are_constant_within_each_block():
    """``rest="block"`` is exact when the other channels hold each block's mean; ``"mean"`` is not (the blocks'
    means differ), and dropping them changes the logits too."""
    q, k_pool, table, seq_lens, start = _inputs(1)
    m = channel_mask(q, H, 4)  # [B, H, D]; in each sequence's blocks the channels outside its set: constant
    k_pool = k_pool.clone()
    for b in range(B):
        for phys in table[b][table[b] >= 0].long():
            outside = (m[b] == 0).view(H, 1, D).expand(H, BS, D)
            k_pool[phys] = torch.where(outside, k_pool[phys].mean(1, keepdim=True), k_pool[phys])
    got, want = _lse(q, k_pool, table, seq_lens, start, 4, "block")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for rest in ("mean", "none"):
        other, _ = _lse(q, k_pool, table, seq_lens, start, 4, rest)
        assert not torch.allclose(other[want.isfinite()], want[want.isfinite()], atol=1e-3)


def test_bad_rest_is_refused_and_cells_come_from_specs():
    with pytest.raises(ValueError, match="rest"):
        ChannelQuantBlockTopK(budget=64, rest="median")
    grid = cells(1 / 16, 4, 32, [8], ["quest"], (4,), ("16:mean", "8:block", "32", "16:block:4"))
    made = {k: (v.channels, v.rest, v.group) for k, v in grid.items() if isinstance(v, ChannelQuantBlockTopK)}
    assert made == {
        "quant4_r16_mean": (16, "mean", 1),
        "quant4_r8_block": (8, "block", 1),
        "quant4_r32_mean": (32, "mean", 1),
        "quant4_r16_block_g4": (16, "block", 4),
    }
