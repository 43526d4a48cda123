"""tests/interpreter_shims.py's fixes to Triton's interpreter, checked where they matter: on the CPU, under
``TRITON_INTERPRET=1`` (conftest applies them); on a GPU these kernels run compiled and must agree all the same."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from tiny_models import DEVICE


@triton.jit
def _casts(ints, floats, out_bf16, out_int, N: tl.constexpr):
    o = tl.arange(0, N)
    out_bf16_v = tl.load(ints + o).to(tl.bfloat16)  # int32 -> bf16
    tl.store(out_bf16 + o, out_bf16_v)
    tl.store(out_int + o, tl.load(floats + o).to(tl.int32))  # bf16 -> int32 (toward zero)


def test_casts_between_integers_and_bf16_convert_values():
    """``int32 -> bf16`` gives the bf16 nearest the integer (torch's rounding) and ``bf16 -> int32`` truncates the
    value; the unpatched interpreter converted into and out of bf16's uint16 storage words instead (``.to`` of 3 gave
    the bf16 whose bits are 3)."""
    ints = torch.tensor([0, 1, 3, 15, -7, 255, 257, 259, 1000, -4099, 70000, 123456, 5, 6, 7, 8], dtype=torch.int32)
    floats = torch.tensor([0.0, 1.5, -2.5, 3.75, 255.0, -0.5, 1e4, 7.9, 2, 3, 4, 5, 6, 7, 8, 9]).to(torch.bfloat16)
    ints, floats = ints.to(DEVICE), floats.to(DEVICE)
    out_bf16 = torch.empty(16, dtype=torch.bfloat16, device=DEVICE)
    out_int = torch.empty(16, dtype=torch.int32, device=DEVICE)
    _casts[(1,)](ints, floats, out_bf16, out_int, 16)
    assert torch.equal(out_bf16, ints.float().to(torch.bfloat16))
    assert torch.equal(out_int, floats.float().trunc().to(torch.int32))


@triton.jit
def _round(x, out, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(out + o, tl.load(x + o).to(tl.bfloat16))  # float32 -> bf16


def test_float32_to_bf16_rounds_to_nearest_even():
    """As the GPU's conversion and torch's: ties to even, overflow to inf, NaN stays NaN; the unpatched interpreter
    truncated (259.0 -> 258)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, generator=g) * torch.logspace(-30, 30, 1024)
    x[:6] = torch.tensor([259.0, 257.0, 3.4e38, -3.4e38, float("inf"), float("nan")])
    x = x.to(DEVICE)
    out = torch.empty(1024, dtype=torch.bfloat16, device=DEVICE)
    _round[(1,)](x, out, 1024)
    want = x.to(torch.bfloat16)
    assert out[0] == 260 and out[1] == 256 and out[2].isinf() and out[5].isnan()
    assert torch.equal(out[:5], want[:5]) and torch.equal(out[6:], want[6:])


@triton.jit
def _to_e4m3(x, out, N: tl.constexpr):
    o = tl.arange(0, N)
    v = tl.load(x + o).to(tl.float8e4nv, fp_downcast_rounding="rtne")  # float32 -> float8 e4m3
    tl.store(out + o, v.to(tl.uint8, bitcast=True))


def test_float32_to_float8_e4m3_rounds_to_nearest_even_across_binades_and_subnormals():
    """As the GPU's ``cvt.rn.satfinite`` and torch's: a mantissa that rounds up carries into the exponent (7.89 -> 8),
    subnormals round to nearest (3e-3 -> 2 steps of 2^-9); the unpatched interpreter gave 4.0 and 1 step."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, generator=g) * torch.logspace(-3, 2.5, 1024)
    x[:6] = torch.tensor([7.89, -7.89, 3e-3, 447.0, -0.0, 0.0])
    x = x.clamp(-448, 448).to(DEVICE)
    out = torch.empty(1024, dtype=torch.uint8, device=DEVICE)
    _to_e4m3[(1,)](x, out, 1024)
    got = out.view(torch.float8_e4m3fn).float()
    assert got[0] == 8 and got[1] == -8 and got[2] == 2 * 2.0**-9 and got[3] == 448
    assert torch.equal(out, x.to(torch.float8_e4m3fn).view(torch.uint8))
