"""``ops/triton/linear.py``'s decode matmul against ``F.linear`` in float32.

Without CUDA the kernel runs through Triton's interpreter (tiny shapes); with CUDA the same tests run on the GPU,
plus an 8B projection's shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from hf_sparse_kv.ops.reference import DECODE_LINEAR_ROWS
from hf_sparse_kv.ops.triton import linear
from hf_sparse_kv.ops.triton.linear import decode_linear

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in output"
    return ((out.float() - ref).norm() / ref.norm()).item()


def make(B, N, K, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, K, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=g) * K**-0.5).to(dtype).to(DEVICE)
    b = torch.randn(N, generator=g).to(dtype).to(DEVICE) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "B, N, K, bias, config",
    [
        (1, 64, 128, False, (16, 64, 4, 2)),
        (3, 40, 200, True, (16, 64, 4, 2)),  # N and K not multiples of the tile: masked edges
        (16, 33, 96, True, (32, 32, 2, 3)),  # every row a call takes
        (8, 100, 300, False, None),  # choose(): the default tile (BK 256, K 300: a masked second step)
        (1, 50, 700, True, None),  # choose(): the one-token tile
        (1, 40, 200, True, (16, 64, 4, 2, "sum")),  # one token without tensor cores
    ],
)
def test_decode_linear_equals_the_float32_product(B, N, K, bias, config, dtype):
    x, w, b = make(B, N, K, dtype, bias)
    out = decode_linear(x, w, b, config)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.dtype == dtype and out.shape == (B, N)
    assert rel_err(out, ref) < 1e-2


def test_decode_linear_keeps_leading_dims_and_reads_strided_rows():
    x, w, b = make(6, 48, 64, torch.bfloat16, True)
    x3 = x.view(2, 3, 64)
    wide = torch.zeros(48, 80, dtype=w.dtype, device=DEVICE)
    wide[:, :64] = w  # rows of 64 values 80 apart: a merged weight's view
    out = decode_linear(x3, wide[:, :64], b, (16, 32, 2, 2))
    assert out.shape == (2, 3, 48)
    assert rel_err(out, F.linear(x3.float(), w.float(), b.float())) < 1e-2


def test_decode_linear_refuses_what_it_cannot_compute():
    x, w, _ = make(2, 32, 64, torch.bfloat16, False)
    with pytest.raises(ValueError, match="at most"):
        decode_linear(torch.zeros(DECODE_LINEAR_ROWS + 1, 64, dtype=x.dtype, device=DEVICE), w)
    with pytest.raises(ValueError, match="width"):
        decode_linear(x, w[:, :32])
    with pytest.raises(ValueError, match="contiguous"):
        decode_linear(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match="dtype"):
        decode_linear(x.half(), w)
    with pytest.raises(ValueError, match="bias"):
        decode_linear(x, w, torch.zeros(31, dtype=x.dtype, device=DEVICE))


def test_decode_linear_of_no_rows_is_empty():
    x, w, _ = make(1, 32, 64, torch.bfloat16, False)
    assert decode_linear(x[:0], w).shape == (0, 32)


def test_choose_follows_the_sweep_rule():
    assert linear.choose(28672, 4096, 1) is None and linear.choose(28672, 4096, 8) is None  # cuBLAS at the bandwidth
    assert linear.choose(6144, 4096, 1) == linear.ONE_TOKEN_CONFIG
    assert linear.choose(4096, 14336, 1) == linear.DEFAULT_CONFIG  # K past 8192: tensor cores even for one token
    assert linear.choose(6144, 4096, 2) == linear.DEFAULT_CONFIG
    assert linear.ONE_TOKEN_CONFIG[4:] == ("sum",) and len(linear.DEFAULT_CONFIG) == 4


def test_where_choose_says_cublas_the_call_is_f_linear(monkeypatch):
    monkeypatch.setattr(linear, "choose", lambda N, K, B: None)
    x, w, b = make(3, 40, 64, torch.bfloat16, True)
    assert torch.equal(decode_linear(x, w, b), F.linear(x, w, b))


@pytest.mark.skipif(not CUDA, reason="needs CUDA (an 8B projection's shape)")
@pytest.mark.parametrize("N, K", [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("B", [1, 8])
def test_cuda_decode_linear_on_an_8b_projection(B, N, K):
    x, w, _ = make(B, N, K, torch.bfloat16, False)
    ref = F.linear(x.float(), w.float())
    assert rel_err(decode_linear(x, w), ref) < 1e-2


def test_the_sum_variant_takes_one_row():
    x, w, _ = make(2, 32, 64, torch.bfloat16, False)
    with pytest.raises(ValueError, match="one row"):
        decode_linear(x, w, None, (16, 64, 4, 2, "sum"))
