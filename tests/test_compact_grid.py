"""evaluation/compact_grid.py (an issue-13 experiment): low-bit keys on a per-group min / max grid stored in few
bytes. The grid spans each group's valid keys only; the codes are the library's quantizer's on that grid; 1 bit
takes the nearer end; the stored min / max are what bf16 / fp8 can hold; on keys the grid holds exactly the policy
ranks like the oracle, and more bits track the oracle's mass more closely."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from test_channel_quant import BS, NB, B, D, G, H, _inputs  # the same paged layout and inputs
from test_global_grid import SCALE, SPEC, _state

from evaluation.compact_grid import (
    CompactGridBlockTopK,
    ProgressiveGridBlockTopK,
    dequantized_pool,
    group_grid,
    parse_cell,
    parse_progressive,
    progressive_fraction,
    progressive_label,
    scoring_fraction,
    stored,
)
from hf_sparse_kv.ops import get_ops
from hf_sparse_kv.ops import reference as R
from hf_sparse_kv.ops.layout import cdiv
from hf_sparse_kv.policies.base import DecodeState

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


@pytest.mark.parametrize("bits", [2, 4])
def test_top_plane_is_the_middle_of_the_levels_it_leaves(bits):
    _, k_pool, table, seq_lens, start = _inputs(5)
    lo, hi = group_grid(k_pool, table, seq_lens, start, BS)
    full = dequantized_pool(k_pool, table, lo, hi, bits)
    assert torch.equal(dequantized_pool(k_pool, table, lo, hi, bits, known=bits), full)
    top = dequantized_pool(k_pool, table, lo, hi, bits, known=1)
    half = 2 ** (bits - 1)  # levels below the top bit's
    for b in range(B):
        for m in range(table.shape[1]):
            blk = int(table[b, m])
            if blk < 0:
                continue
            l, h = lo[b, m][:, None, :], hi[b, m][:, None, :]
            delta = (h - l) / (2**bits - 1)
            level = ((full[blk] - l) / delta).round()  # the full codes (checked against the library's above)
            want = l + torch.where(level >= half, half + (half - 1) / 2, (half - 1) / 2) * delta
            torch.testing.assert_close(top[blk], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="known"):
        dequantized_pool(k_pool, table, lo, hi, bits, known=0)


def _long_state(seed: int) -> DecodeState:
    """Two sequences of 29 and 24 blocks (BS tokens each) in a shuffled pool: enough blocks that the top plane's
    candidates, the full codes' choice among them and the forced blocks all differ."""
    g = torch.Generator().manual_seed(seed)
    lens = (29 * BS - 3, 24 * BS)
    nb = sum(cdiv(n, BS) for n in lens)
    k_pool = torch.randn(nb, H, BS, D, generator=g) * torch.linspace(0.2, 3.0, D)  # uneven channels
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    table = torch.full((2, cdiv(lens[0], BS)), -1, dtype=torch.int32)
    table[0, :29], table[1, :24] = perm[:29], perm[29:]
    q = torch.randn(2, H * G, D, generator=g)
    seq_lens, start = torch.tensor(lens, dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    zeros = torch.zeros(nb, H, D)
    return DecodeState(
        q=q, k_pool=k_pool, kmin=zeros, kmax=zeros, kmean=zeros, block_table=table, seq_lens=seq_lens, start=start,
        lens=lens, length=max(lens), block_size=BS, scale=SCALE, ops=get_ops("reference"), state={}, layer=0,
    )  # fmt: skip


LONG = {"budget": 6 * BS, "sink": 0, "window": BS}  # 6 blocks a sequence, 2 or 3 of them forced


def test_with_every_block_a_candidate_it_is_the_full_codes_selection():
    for seed in range(3):
        state = _long_state(seed)
        got = ProgressiveGridBlockTopK(bits=2, group=BS, meta="bf16", candidates=100, **LONG).select(state)
        want = CompactGridBlockTopK(bits=2, group=BS, meta="bf16", **LONG).select(state)
        assert torch.equal(got.indices, want.indices)


def _coarse_top(policy, state) -> list[list[set[int]]]:
    """Per sequence and KV head, the blocks the top plane ranks first (forced ones first), as many as the
    candidates: ``ceil(c x count)``."""
    coarse, _ = policy.stage_masses(state)
    forced = policy.forced_blocks(state, policy.sink, policy.window)
    out = []
    for b, k in enumerate(policy.widths(state).per_sequence()):
        live = coarse[b] > float("-inf")
        ranked = coarse[b].masked_fill(forced[b] & live, float("inf"))
        n = math.ceil(policy.candidates * k)
        out.append([set(ranked[h].argsort(descending=True, stable=True)[:n].tolist()) for h in range(H)])
    return out


@pytest.mark.parametrize("candidates", [1, 2])
def test_only_the_top_planes_candidates_are_kept_and_the_full_codes_pick_among_them(candidates):
    differs = 0
    for seed in range(3):
        state = _long_state(seed)
        policy = ProgressiveGridBlockTopK(bits=2, group=BS, meta="exact", candidates=candidates, **LONG)
        sel = policy.select(state)
        _, fine = policy.stage_masses(state)
        forced = policy.forced_blocks(state, policy.sink, policy.window)
        plain = CompactGridBlockTopK(bits=2, group=BS, meta="exact", **LONG).select(state)
        top = _coarse_top(policy, state)
        for b, k in enumerate(policy.widths(state).per_sequence()):
            for h, cand in enumerate(top[b]):
                chosen = set(sel.indices[b, h, :k].tolist())
                assert chosen <= cand and len(chosen) == k
                rest = fine[b, h].masked_fill(forced[b], float("inf"))  # the full codes' ranking of the candidates
                best = sorted(cand, key=lambda i: -float(rest[i]))[:k]
                assert chosen == set(best)
                differs += chosen != set(plain.indices[b, h, :k].tolist())
    assert differs > 0  # the top plane's cut changed some choice: the inputs test the two stages


def test_progressive_bytes_labels_and_bad_specs():
    assert progressive_fraction(2, 32, "fp8", 4, 1 / 16) == Fraction(7, 64)
    assert progressive_fraction(2, 32, "fp8", 8, 1 / 16) == Fraction(1, 8)
    assert progressive_fraction(2, 16, "fp8", 4, 1 / 16) == Fraction(9, 64)
    assert progressive_fraction(2, 16, "bf16", 100, 1 / 16) == scoring_fraction(2, 16, "bf16")  # all read: capped
    assert parse_progressive("2:32:fp8:4") == (2, 32, "fp8", 4.0)
    assert progressive_label(2, 32, "fp8", 4.0) == "pg2_g32_fp8_c4"
    for bad in ("2:32:fp8", "2:32:fp8:x", "two:32:fp8:4"):
        with pytest.raises(ValueError, match="bits:group:meta:candidates"):
            parse_progressive(bad)
    with pytest.raises(ValueError, match="bits >= 2"):
        ProgressiveGridBlockTopK(bits=1, **SPEC)
    with pytest.raises(ValueError, match="candidates"):
        ProgressiveGridBlockTopK(candidates=0.5, **SPEC)
