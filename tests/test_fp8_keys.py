"""The float8-key selector (``Fp8BlockTopK``): its codes' error bound, its state in the cache through prefill, left
padding, decode, beams and crop, its block mass as the oracle's on the decoded keys, its kernels against the
reference, one selection in every mode."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from test_quant_keys import one_selection_every_mode, paged_case, walk_cache
from tiny_models import DEVICE

from hf_sparse_kv import PagedKVCache
from hf_sparse_kv.ops import get_ops
from hf_sparse_kv.ops import reference as R
from hf_sparse_kv.ops.triton import fp8 as triton_fp8
from hf_sparse_kv.ops.triton.fp8 import e4m3_as_f16, e4m3_byte, fp8_block_lse, fp8_native
from hf_sparse_kv.ops.triton.fp8 import fp8_block_scores as triton_fp8_block_scores
from hf_sparse_kv.ops.triton.fp8 import fp8_write as triton_fp8_write
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


@pytest.mark.parametrize("backend,native", [("reference", True), ("triton", True), ("triton", False)])
def test_codes_follow_prefill_padding_decode_beams_and_crop(backend, native, monkeypatch):
    """... on a GPU without float8 too (``native=False``: the write kernel's integer rounding, as an A100 runs it)."""
    monkeypatch.setattr(triton_fp8, "fp8_native", lambda device: native)
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


@triton.jit
def _byte_kernel(x, out, N, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + o, e4m3_byte(tl.load(x + o, mask=o < N, other=0.0)), mask=o < N)


@triton.jit
def _widen_kernel(c, out, N, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + o, e4m3_as_f16(tl.load(c + o, mask=o < N, other=0)), mask=o < N)


def test_float8_without_float8_instructions_is_exact():
    """The kernels' form for GPUs without float8 (``NATIVE=False``): ``e4m3_byte`` rounds as torch's float8 e4m3 cast
    does (nearest even) on every e4m3 value, every midpoint between two neighbours (the ties), the floats just
    either side of each midpoint, subnormals, both zeros and random values of every magnitude up to 448; and
    ``e4m3_as_f16`` widens every byte but NaN to exactly ``value * 2^-8``."""
    every = torch.arange(256, dtype=torch.uint8)
    finite = every[(every & 0x7F) != 0x7F]  # 0x7F / 0xFF are NaN
    values = finite.view(torch.float8_e4m3fn).float().unique()  # sorted, -448 .. 448, one zero
    mids = (values[1:] + values[:-1]) / 2  # exact in float32
    g = torch.Generator().manual_seed(0)
    x = torch.cat([
        values, mids, torch.nextafter(mids, torch.tensor(float("inf"))), torch.nextafter(mids, torch.tensor(-float("inf"))),
        torch.tensor([0.0, -0.0, 2.0**-10, -(2.0**-10), 2.0**-6 * 0.999, 448.0, -448.0, 447.9]),
        (torch.rand(4096, generator=g) * 2 - 1) * torch.logspace(-12, 2.65, 4096, base=2.0),
    ]).to(DEVICE)  # fmt: skip
    got = torch.empty(x.shape, dtype=torch.uint8, device=DEVICE)
    _byte_kernel[(triton.cdiv(x.numel(), 1024),)](x, got, x.numel(), BLOCK=1024)
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), got[i].item(), want[i].item()) for i in bad[:8].tolist()]
    c = finite.to(DEVICE)
    wide = torch.empty(c.shape, dtype=torch.float16, device=DEVICE)
    _widen_kernel[(1,)](c, wide, c.numel(), BLOCK=256)
    assert torch.equal(wide.float(), c.view(torch.float8_e4m3fn).float() * 2.0**-8)


def test_float8_native_by_compute_capability(monkeypatch):
    """Float8 instructions from compute capability 8.9 (Ada, Hopper): an A100 (8.0) or an RTX 30xx (8.6) takes the
    integer forms; CPU tensors (the interpreter) the native one."""
    assert fp8_native(torch.device("cpu"))
    for cap, native in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True), ((10, 0), True)):
        props = SimpleNamespace(major=cap[0], minor=cap[1])
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, props=props: props)
        assert fp8_native(torch.device("cuda", 0)) is native, cap


@pytest.mark.parametrize("native", [None, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("span", [1, 5, 13])
def test_triton_write_matches_reference(dtype, span, native):
    """Writes of ``span`` tokens at ragged offsets (one sequence writes nothing) store the same bytes and scales as
    the reference, and nothing outside ``[lo, hi)``; by the library op, and by the kernel's form for GPUs without
    float8 (``native=False``)."""
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
        if native is None:
            ops.fp8_write(got, k_pool, table, lo, hi, span, part)
        else:
            triton_fp8_write(got, k_pool, table, lo, hi, span, part, native=native)
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
    # the library op, and the scorer's form for GPUs without float8 (the codes widened to float16)
    for got in (get_ops("triton", DEVICE).fp8_block_scores(*args), triton_fp8_block_scores(*args, native=False)):
        assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got == float("inf"), want == float("inf"))
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-4)
    if bs >= 16 and D >= 32:
        lse_want = R.fp8_block_lse(*args[:7])
        fin = lse_want.isfinite()
        atol = 2e-3 * lse_want[fin].abs().max().item()
        # one tile a program; two or four a program, pipelined, the last program's last tiles past the table (MB = 6)
        for block_m, tiles, stages, native in ((2, 1, 1, None), (2, 2, 2, None), (1, 4, 3, None), (2, 2, 2, False)):
            lse_got = fp8_block_lse(*args[:7], block_m=block_m, tiles=tiles, num_stages=stages, native=native)
            assert torch.equal(lse_got.isinf(), lse_want.isinf()), (block_m, tiles, native)
            torch.testing.assert_close(lse_got[fin], lse_want[fin], rtol=0, atol=atol)


def test_registered_and_refuses_nothing_it_needs():
    assert POLICIES["fp8_block_topk"] is Fp8BlockTopK
    p = Fp8BlockTopK(budget=0.0625, sink=4, window=32)
    assert [s.name for s in p.cache_state()] == ["k8", "k8scale"]
    assert [s.dtype for s in p.cache_state()] == [torch.uint8, torch.float32]
