"""Low-bit keys with one step per token (issue 13's probe): the reference's grid and the Triton scoring kernel
against it (``ops/triton/token_quant.py``, through Triton's interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import DEVICE

from hf_sparse_kv.ops import reference as R

triton_tq = pytest.importorskip("hf_sparse_kv.ops.triton.token_quant")


@pytest.mark.parametrize("bits", [2, 4])
def test_token_codes_round_trip_within_half_a_step(bits):
    """Every channel of a valid token comes back within half its token's step; the top level is the token's largest
    offset from the block's minimum; invalid slots get code 0 and step 0."""
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(3, 2, 16, 64, generator=g) * torch.linspace(0.1, 8, 64)  # channels of very different ranges
    valid = torch.ones(3, 2, 16, dtype=torch.bool)
    valid[1, :, 9:] = False
    lo = keys.masked_fill(~valid[..., None], float("inf")).amin(2)
    codes, steps = R.token_quantize_keys(keys, lo, bits, valid)
    assert codes.dtype == torch.uint8 and codes.shape == (3, 2, 16, 64 * bits // 8) and steps.shape == (3, 2, 16)
    back = R.token_dequantize_keys(codes, lo, steps, bits)
    err = (back - keys).abs()[valid]
    assert (err <= steps[valid][:, None] / 2 * (1 + 1e-5) + 1e-6).all()
    off = keys - lo[:, :, None, :]
    top = R._unpack_codes(codes, bits).amax(-1)
    assert torch.equal(top[valid], torch.full_like(top[valid], 2**bits - 1))  # each token reaches the top level
    assert torch.allclose(steps[valid], off.amax(-1)[valid] / (2**bits - 1))
    assert (codes[~valid] == 0).all() and (steps[~valid] == 0).all()


def test_token_codes_of_a_constant_token_are_zero():
    """A token equal to the block's minimum in every channel has step 0 and codes 0 (no division by zero)."""
    keys = torch.zeros(1, 1, 16, 32)
    keys[0, 0, 3] = torch.arange(32.0)
    codes, steps = R.token_quantize_keys(keys, keys.amin(2), 4)
    assert steps[0, 0, 0] == 0 and (codes[0, 0, 0] == 0).all() and steps[0, 0, 3] == 31 / 15
    assert not R.token_dequantize_keys(codes, keys.amin(2), steps, 4).isnan().any()


def _inputs(dtype, bits, B, H, G, D, lens, start, seed=0):
    g = torch.Generator().manual_seed(seed)
    BS = 16
    MB = max((n + BS - 1) // BS for n in lens) + 2
    NB = B * MB + 3
    k = torch.randn(NB, H, BS, D, generator=g).to(dtype)
    kmin = k.float().amin(2).to(dtype)
    codes, steps = R.token_quantize_keys(k, kmin, bits)
    table = torch.randperm(NB, generator=g)[: B * MB].view(B, MB).int()
    table[0, 1] = -1  # an evicted block: not read, -inf
    q = torch.randn(B, H * G, D, generator=g).to(dtype)
    lens_t, start_t = torch.tensor(lens, dtype=torch.int32), torch.tensor(start, dtype=torch.int32)
    moved = (t.to(DEVICE) for t in (q, codes, steps, kmin, table, lens_t, start_t))
    return (*moved, D**-0.5, bits)


@pytest.mark.parametrize(
    "dtype,bits,B,H,G,D,lens,start",
    [
        (torch.float32, 4, 2, 2, 3, 64, [300, 77], [3, 0]),
        (torch.bfloat16, 4, 1, 2, 4, 128, [530], [0]),
        (torch.float32, 2, 2, 1, 2, 64, [40, 260], [0, 17]),
        (torch.float16, 4, 1, 1, 1, 128, [33], [0]),
    ],
)
@pytest.mark.parametrize(
    "knobs",
    [{}, {"block_m": 32, "tiles_per_program": 1, "num_stages": 1}, {"tiles_per_program": 4, "num_stages": 3}],
)
def test_token_quant_lse_kernel_matches_the_reference(dtype, bits, B, H, G, D, lens, start, knobs):
    """The kernel's log-sum-exps equal the float32 reference's (the codes meet bf16 / fp16 queries in their own
    dtype: exact products), with the same ``-inf`` blocks (evicted, before ``start``, past the length), no NaN."""
    args = _inputs(dtype, bits, B, H, G, D, lens, start)
    ref = R.token_quant_block_lse(*args)
    out = triton_tq.token_quant_block_lse(*args, **knobs)
    assert out.shape == ref.shape and not out.isnan().any()
    assert torch.equal(out.isfinite(), ref.isfinite())
    fin = ref.isfinite()
    assert fin.any()
    torch.testing.assert_close(out[fin], ref[fin], rtol=1e-5, atol=1e-5)


def test_token_quant_lse_kernel_reads_codes_and_steps_from_one_row():
    """Codes and steps kept in one ``[NB, Hkv, BS, W + 4]`` byte tensor (``reference.token_rows``) give the
    same log-sum-exps as separate tensors: the kernel follows the views' strides."""
    q, codes, steps, *rest = _inputs(torch.bfloat16, 4, 2, 2, 4, 64, [200, 90], [0, 5])
    codes_j, steps_j = R.split_token_rows(R.token_rows(codes, steps))
    assert codes_j.stride(2) == codes.shape[-1] + 4 and torch.equal(codes_j, codes) and torch.equal(steps_j, steps)
    want = triton_tq.token_quant_block_lse(q, codes, steps, *rest)
    got = triton_tq.token_quant_block_lse(q, codes_j, steps_j, *rest)
    assert torch.equal(want.isfinite(), got.isfinite())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_token_quant_lse_refuses_bad_shapes():
    q, codes, steps, kmin, table, lens, start, scale, bits = _inputs(torch.float32, 4, 1, 1, 1, 64, [40], [0])
    with pytest.raises(AssertionError, match="steps"):
        triton_tq.token_quant_block_lse(q, codes, steps[:, :, :8], kmin, table, lens, start, scale, bits)
    with pytest.raises(ValueError, match="bits"):
        triton_tq.token_quant_block_lse(q, codes, steps, kmin, table, lens, start, scale, 3)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_token_quant_write_kernel_matches_the_reference(bits, dtype):
    """The write re-codes the blocks a write touches (a partly filled block's earlier tokens too: its minima move)
    and nothing else, with the reference's codes and steps, into the two views of one row-per-token state."""
    g = torch.Generator().manual_seed(3)
    NB, H, BS, D = 10, 2, 16, 64
    W = D * bits // 8
    k_pool = torch.randn(NB, H, BS, D, generator=g).to(dtype)
    table = torch.tensor([[3, 7, -1, 1], [0, 9, 4, 2]], dtype=torch.int32)
    lo, hi = torch.tensor([17, 40]), torch.tensor([33, 41])  # across a block edge; one token into a part-filled block
    fill = torch.randint(0, 256, (NB, H, BS, W), dtype=torch.uint8, generator=g)
    k_pool, table, lo, hi, fill = (t.to(DEVICE) for t in (k_pool, table, lo, hi, fill))
    want = R.token_rows(fill, torch.full((NB, H, BS), 7.0, device=DEVICE))
    got = want.clone()
    R.token_quant_write(want, k_pool, table, lo, hi, 16, bits)
    triton_tq.token_quant_write(got, k_pool, table, lo, hi, 16, bits)
    assert torch.equal(got, want)
    want_c, want_s = R.split_token_rows(want)
    touched = {7, 4}  # sequence 0: logical blocks 1 and 2 (evicted: skipped); sequence 1: logical block 2
    for blk in range(NB):
        assert torch.equal(want_c[blk], fill[blk]) == (blk not in touched)
    # the touched blocks hold the reference grid of their filled prefix: block 4 holds 41 - 32 = 9 tokens
    valid = torch.arange(BS, device=DEVICE) < 9
    kmin = k_pool[4].float().masked_fill(~valid[None, :, None], float("inf")).amin(1).to(dtype)
    c, st = R.token_quantize_keys(k_pool[4].float().masked_fill(~valid[None, :, None], 0.0), kmin, bits,
                                  valid.expand(H, BS))  # fmt: skip
    assert torch.equal(want_c[4], c) and torch.equal(want_s[4], st)


@pytest.mark.parametrize("window", [None, 32])
def test_token_quant_block_scores_match_the_reference(window):
    """The whole scoring (kernel + the low-bit keys' mass tail) against the reference's mass: the same ``-inf`` /
    ``+inf`` blocks (forced ones with ``window``), the finite masses within float32 rounding."""
    q, codes, steps, *rest = _inputs(torch.bfloat16, 4, 2, 2, 4, 128, [300, 77], [0, 5])
    rows = R.token_rows(codes, steps)
    ref = R.token_quant_block_scores(q, rows, *rest, 4, window)
    out = triton_tq.token_quant_block_scores(q, rows, *rest, 4, window)
    assert torch.equal(out.isposinf(), ref.isposinf()) and torch.equal(out.isneginf(), ref.isneginf())
    assert out.isposinf().any() == (window is not None)
    fin = ref.isfinite()
    torch.testing.assert_close(out[fin], ref[fin], rtol=1e-5, atol=1e-6)
