"""evaluation/compact_grid.py (an issue-13 experiment): low-bit keys on a per-group min / max grid stored in few
bytes. The grid spans each group's valid keys only; the codes are the library's quantizer's on that grid; 1 bit
takes the nearer end; the stored min / max are what bf16 / fp8 can hold; on keys the grid holds exactly the policy
ranks like the oracle, and more bits track the oracle's mass more closely."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from test_channel_quant import BS, NB, B, D, H, _inputs  # the same paged layout and inputs
from test_global_grid import SCALE, SPEC, _state

from evaluation.compact_grid import (
    CompactGridBlockTopK,
    dequantized_pool,
    group_grid,
    parse_cell,
    scoring_fraction,
    stored,
)
from hf_sparse_kv.ops import reference as R

pytestmark = pytest.mark.usefixtures("one_thread")


def _group_keys(k_pool, table, seq_lens, start, b, blocks):
    """``[n, Hkv, D]`` the valid keys of sequence ``b`` in its logical ``blocks``, one position at a time."""
    out = []
    for m in blocks:
        blk = int(table[b, m])
        for t in range(BS):
            p = m * BS + t
            if blk >= 0 and int(start[b]) <= p < int(seq_lens[b]):
                out.append(k_pool[blk, :, t])
    return torch.stack(out) if out else None


@pytest.mark.parametrize("g", [1, 2, 3])
def test_grid_spans_each_groups_valid_keys_only(g):
    _, k_pool, table, seq_lens, start = _inputs()
    k_pool = k_pool.clone()
    k_pool[11] = 1e4  # a block no sequence holds, and positions outside [start, length), must not move a grid
    k_pool[2, :, 5:] = 1e4  # sequence 0's last block: positions 37.. (length 37)
    k_pool[6, :, 1:] = -1e4  # sequence 1's last block: positions 33.. (length 33)
    k_pool[4, :, :5] = 1e4  # sequence 1's first block: positions 0..4 (start 5)
    lo, hi = group_grid(k_pool, table, seq_lens, start, g * BS)
    MB = table.shape[1]
    assert lo.shape == hi.shape == (B, MB, H, D)
    for b in range(B):
        for m in range(MB):
            first = m // g * g
            keys = _group_keys(k_pool, table, seq_lens, start, b, range(first, min(first + g, MB)))
            if keys is None:
                assert bool((lo[b, m] == 0).all() and (hi[b, m] == 0).all())
            else:
                torch.testing.assert_close(lo[b, m], keys.amin(0))
                torch.testing.assert_close(hi[b, m], keys.amax(0))


@pytest.mark.parametrize("bits", [2, 4])
def test_codes_are_the_librarys_quantizer_on_the_grid(bits):
    _, k_pool, table, seq_lens, start = _inputs(1)
    lo, hi = group_grid(k_pool, table, seq_lens, start, 2 * BS)
    got = dequantized_pool(k_pool, table, lo, hi, bits)
    for b in range(B):
        for m in range(table.shape[1]):
            blk = int(table[b, m])
            if blk < 0:
                continue
            l, h = lo[b, m], hi[b, m]  # [Hkv, D]
            want = R.dequantize_keys(R.quantize_keys(k_pool[blk], l, h, bits), l, h, bits)
            torch.testing.assert_close(got[blk], want, rtol=1e-6, atol=1e-6)
    held = {int(x) for x in table.flatten() if x >= 0}
    assert all(bool((got[i] == 0).all()) for i in range(NB) if i not in held)


def test_one_bit_takes_the_nearer_end():
    _, k_pool, table, seq_lens, start = _inputs(2)
    lo, hi = group_grid(k_pool, table, seq_lens, start, BS)
    got = dequantized_pool(k_pool, table, lo, hi, 1)
    for b in range(B):
        for m in range(table.shape[1]):
            blk = int(table[b, m])
            if blk < 0:
                continue
            l, h, k = lo[b, m][:, None, :], hi[b, m][:, None, :], k_pool[blk]
            want = torch.where(k - l < h - k, l, h)  # a key halfway rounds up, as floor(x + 0.5)
            want = torch.where(k - l == h - k, h, want)
            torch.testing.assert_close(got[blk], want.expand_as(k))  # lo + 1 * (hi - lo): hi within an ulp


def test_stored_min_max_are_what_the_format_holds():
    x = torch.tensor([-1e4, -3.3, -0.01, 0.0, 0.7, 1.1e-3, 447.9, 1e4])
    fp8 = stored(x, "fp8")
    assert torch.equal(fp8, fp8.to(torch.float8_e4m3fn).float()) and float(fp8.abs().max()) == 448.0
    assert torch.equal(stored(x, "bf16"), x.to(torch.bfloat16).float())
    assert torch.equal(stored(x, "exact"), x)
    normal = x.abs().ge(2**-6) & x.abs().le(448)  # e4m3's normal range: 3 mantissa bits, half a step 1/16
    assert float((fp8 - x)[normal].abs().div(x[normal].abs()).max()) <= 1 / 16


def test_scoring_bytes():
    assert scoring_fraction(1, 16, "fp8") == Fraction(1, 8)
    assert scoring_fraction(1, 32, "bf16") == Fraction(1, 8)
    assert scoring_fraction(2, 16, "bf16") == Fraction(1, 4)  # QuantBlockTopK(bits=2)'s codes + the block's min / max
    assert scoring_fraction(4, 16, "bf16") == Fraction(3, 8)


@pytest.mark.parametrize("meta", ["exact", "bf16", "fp8"])
def test_keys_the_grid_holds_rank_like_the_oracle(meta):
    q, k_pool, table, seq_lens, start = _inputs(3)
    two = torch.where(k_pool > 0, 1.0, -0.5)  # each channel of a group takes at most these two values
    policy = CompactGridBlockTopK(bits=1, group=2 * BS, meta=meta, **SPEC)
    got = policy.mass(_state(q, two, table, seq_lens, start))
    want = R.oracle_block_scores(q, two, table, seq_lens, start, SCALE)
    assert torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got, want)


def test_more_bits_track_the_oracle_more_closely():
    q, k_pool, table, seq_lens, start = _inputs(4)
    oracle = R.oracle_block_scores(q, k_pool, table, seq_lens, start, SCALE)
    state = _state(q, k_pool, table, seq_lens, start)
    mass = {b: CompactGridBlockTopK(bits=b, group=BS, meta="exact", **SPEC).mass(state) for b in (1, 2, 4)}
    live = oracle.isfinite()
    err = {b: (m - oracle)[live].abs().mean() for b, m in mass.items()}
    assert err[4] < err[2] < err[1]
    assert all(torch.equal(m.isinf(), oracle.isinf()) for m in mass.values())


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="bits"):
        CompactGridBlockTopK(bits=3, **SPEC)
    with pytest.raises(ValueError, match="meta"):
        CompactGridBlockTopK(meta="int8", **SPEC)
    with pytest.raises(ValueError, match="group"):
        CompactGridBlockTopK(group=0, **SPEC)
    _, k_pool, table, seq_lens, start = _inputs()
    with pytest.raises(ValueError, match="multiple of the block size"):
        group_grid(k_pool, table, seq_lens, start, BS + 1)
    assert parse_cell("1:16:fp8") == (1, 16, "fp8")
    for bad in ("1:16", "one:16:fp8", "1:16:fp8:x"):
        with pytest.raises(ValueError, match="bits:group:meta"):
            parse_cell(bad)
