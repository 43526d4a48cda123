"""The float8-key selector (``Fp8BlockTopK``): its codes' error bound, its state in the cache through prefill, left
padding, decode, beams and crop, its block mass as the oracle's on the decoded keys, its kernels against the
reference, one selection in every mode."""

from __future__ import annotations

import pytest
import torch
from test_quant_keys import one_selection_every_mode, paged_case, walk_cache
from tiny_models import DEVICE

from hf_sparse_kv import PagedKVCache
from hf_sparse_kv.ops import get_ops
from hf_sparse_kv.ops import reference as R
from hf_sparse_kv.policies import POLICIES, Fp8BlockTopK

pytestmark = pytest.mark.usefixtures("one_thread")
BS = 8


def test_codes_keep_three_mantissa_bits_of_every_channel():
    """Each key over its own scale (``max |k| / 448``): every channel within 2^-4 of itself relatively (e4m3's
    rounding; its subnormals only below ``2^-6`` of the scale), the largest exact, an all-zero key zero with scale 1."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(64, 3, 32, generator=g) * torch.logspace(-2, 2, 32)
    k[5, 1] = 0.0
    codes, scale = R.fp8_code(k)
    assert codes.dtype == torch.uint8 and codes.shape == k.shape and scale.shape == k.shape[:-1]
    back = R.fp8_decode(codes, scale)
    assert (back - k).abs().le(k.abs() * 2.0**-4 + scale[..., None] * 2.0**-10).all()
    top = k.abs() == k.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(back[top & (k != 0)], k[top & (k != 0)], rtol=1e-6, atol=0)  # 448 * (amax / 448)
    assert scale[5, 1] == 1 and back[5, 1].eq(0).all()
    with pytest.raises(ValueError, match="part"):
        R.fp8_write(
            codes, k.view(64, 3, 1, 32), torch.zeros(1, 1, dtype=torch.int32), k.new_zeros(1), k.new_ones(1), 1, "bytes"
        )


def test_scale_is_the_correctly_rounded_quotient_on_every_device():
    """``fp8_code``'s scale is ``max |k| / 448`` rounded once (as the Triton write's IEEE division), on the test
    device: PyTorch divides a CUDA tensor by a Python number as a product with its reciprocal, an ulp off at times,
    and the write's codes and scales then differed from the reference's on an H100 (2026-12-06)."""
    g = torch.Generator().manual_seed(1)
    k = (torch.randn(4096, 64, generator=g) * torch.logspace(-3, 3, 4096)[:, None]).to(DEVICE)
    _, scale = R.fp8_code(k)
    want = (k.double().abs().amax(-1) / R.FP8_MAX).float()  # float64 then one rounding: the float32 quotient
    assert torch.equal(scale, want)


def test_block_mass_is_the_oracle_on_the_decoded_keys():
    """``fp8_block_scores`` equals ``oracle_block_scores`` run on the keys the codes stand for, with ragged lengths,
    left padding and an evicted block; with a window the forced blocks still held are ``+inf``; ``fp8_block_lse``'s
    tail (``lse_block_mass``) is the same mass."""
    g = torch.Generator().manual_seed(0)
    NB, H, D, B, MB, G = 12, 2, 16, 2, 5, 3
    k_pool = torch.randn(NB, H, BS, D, generator=g)
    codes, kscale = R.fp8_code(k_pool)
    table = torch.tensor([[3, 7, 1, 9, 2], [4, -1, 5, 0, 6]], dtype=torch.int32)
    seq_lens, start = torch.tensor([37, 33], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    q = torch.randn(B, H * G, D, generator=g)
    want = R.oracle_block_scores(q, R.fp8_decode(codes, kscale), table, seq_lens, start, 0.25, length=MB * BS)
    got = R.fp8_block_scores(q, codes, kscale, table, seq_lens, start, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got[1, :, 1].eq(float("-inf")).all(), "the evicted block"
    lse = R.fp8_block_lse(q, codes, kscale, table, seq_lens, start, 0.25)
    torch.testing.assert_close(R.lse_block_mass(lse, table, seq_lens, start, BS, H, 2, 12), R.fp8_block_scores(
        q, codes, kscale, table, seq_lens, start, 0.25, 2, 12))  # fmt: skip
    assert R.fp8_block_scores(q, codes, kscale, table, seq_lens, start, 0.25, 2, 12).eq(float("inf")).any()


def _check_codes(cache: PagedKVCache) -> None:
    """Every stored position's codes and scale are its key's ``fp8_code``."""
    for layer in cache.paged_layers:
        for b, row in enumerate(cache.table.rows):
            for p in range(layer.length - cache.pads[b]):
                blk, off = row[p // BS], p % BS
                codes, scale = R.fp8_code(layer.k_pool[blk, :, off])
                assert torch.equal(layer.state["k8"][blk, :, off], codes), (b, p)
                assert torch.equal(layer.state["k8scale"][blk, :, off], scale), (b, p)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_codes_follow_prefill_padding_decode_beams_and_crop(backend):
    walk_cache(Fp8BlockTopK(budget=40), backend, _check_codes)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_one_selection_every_mode(arch):
    one_selection_every_mode(arch, Fp8BlockTopK(budget=24, sink=2, window=4))


def test_selects_what_the_oracle_selects_on_random_keys():
    """Float8 keys rank blocks almost as the exact mass does (a behaviour check on random keys, not a quality
    figure): at least 7 of the oracle's top 8 blocks of 40 in every head."""
    g = torch.Generator().manual_seed(1)
    NB, H, D, G = 40, 2, 16, 2
    k_pool = torch.randn(NB, H, BS, D, generator=g)
    table = torch.arange(NB, dtype=torch.int32).view(1, NB)
    seq_lens, start = torch.tensor([NB * BS], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    q = torch.randn(1, H * G, D, generator=g) * 2
    exact = R.oracle_block_scores(q, k_pool, table, seq_lens, start, 0.25, length=NB * BS)
    approx = R.fp8_block_scores(q, *R.fp8_code(k_pool), table, seq_lens, start, 0.25)
    for h in range(H):
        a, b = set(exact.topk(8, -1).indices[0, h].tolist()), set(approx.topk(8, -1).indices[0, h].tolist())
        assert len(a & b) >= 7, (h, a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("span", [1, 5, 13])
def test_triton_write_matches_reference(dtype, span):
    """Writes of ``span`` tokens at ragged offsets (one sequence writes nothing) store the same bytes and scales as
    the reference, and nothing outside ``[lo, hi)``."""
    k_pool, table, _, _, _ = paged_case(span, dtype=dtype, spread=True)
    NB, H, _, D = k_pool.shape
    lo = torch.tensor([3, 25, 9], dtype=torch.int64, device=DEVICE)  # (sequence 1's block 2, evicted, not written)
    hi = (lo + torch.tensor([span, max(1, span - 2), 0], device=DEVICE)).clamp(max=table.shape[1] * BS)
    ops = get_ops("triton", DEVICE)
    for part, old in (
        ("codes", torch.randint(0, 255, (NB, H, BS, D), dtype=torch.uint8, device=DEVICE)),
        ("scales", torch.rand(NB, H, BS, device=DEVICE)),
    ):
        want, got = old.clone(), old.clone()
        R.fp8_write(want, k_pool, table, lo, hi, span, part)
        ops.fp8_write(got, k_pool, table, lo, hi, span, part)
        assert not torch.equal(want, old), "the write changed something"
        assert torch.equal(got, want), part


@pytest.mark.parametrize("G,D,bs", [(1, 64, 16), (4, 128, 16), (3, 32, 16), (3, 16, 8)])
@pytest.mark.parametrize("window", [None, 20])
def test_triton_block_mass_matches_reference(G, D, bs, window):
    """The kernels (blocks of 16, heads of >= 32 channels: the fp8 product's tiles; the query in two fp8 parts) and
    the reference they run below those sizes give the same mass within the query's rounding, the same blocks out of
    play and, with a window, the same forced ones; and the kernel's log-sum-exps are the reference's."""
    k_pool, table, seq_lens, start, q = paged_case(G, G=G, D=D, bs=bs, dtype=torch.bfloat16, spread=True)
    codes, kscale = R.fp8_code(k_pool)
    args = (q, codes, kscale, table, seq_lens, start, 0.3, 2, window)
    want = R.fp8_block_scores(*args)
    got = get_ops("triton", DEVICE).fp8_block_scores(*args)
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got == float("inf"), want == float("inf"))
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-4)
    if bs >= 16 and D >= 32:
        from hf_sparse_kv.ops.triton.fp8 import fp8_block_lse

        lse_want = R.fp8_block_lse(*args[:7])
        fin = lse_want.isfinite()
        atol = 2e-3 * lse_want[fin].abs().max().item()
        # one tile a program; two or four a program, pipelined, the last program's last tiles past the table (MB = 6)
        for block_m, tiles, stages in ((2, 1, 1), (2, 2, 2), (1, 4, 3)):
            lse_got = fp8_block_lse(*args[:7], block_m=block_m, tiles=tiles, num_stages=stages)
            assert torch.equal(lse_got.isinf(), lse_want.isinf()), (block_m, tiles)
            torch.testing.assert_close(lse_got[fin], lse_want[fin], rtol=0, atol=atol)


def test_registered_and_refuses_nothing_it_needs():
    assert POLICIES["fp8_block_topk"] is Fp8BlockTopK
    p = Fp8BlockTopK(budget=0.0625, sink=4, window=32)
    assert [s.name for s in p.cache_state()] == ["k8", "k8scale"]
    assert [s.dtype for s in p.cache_state()] == [torch.uint8, torch.float32]
