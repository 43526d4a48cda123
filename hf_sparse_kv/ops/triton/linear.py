"""A decode step's weight matmul, ``y = x @ W.T (+ bias)`` for a few tokens: the Triton twin of
``reference.decode_linear`` (``F.linear``).

At decode a linear layer multiplies ``B <= 16`` rows by a weight ``W [N, K]`` and is bound by reading ``W``. cuBLAS
reaches 88-92 % of the HBM bandwidth on an 8B model's large projections but 60-77 % on its smaller ones (``o``,
the merged ``qkv``: benchmarks/RESULTS.md, "Merged projections"). This kernel reads ``W`` in tiles of ``BN`` rows
× ``BK`` columns, one program per ``BN`` rows walking all of ``K``, and multiplies each tile by the tokens on tensor
cores with the roles swapped (``W``'s rows as the product's rows, the tokens padded to 16 as its columns): no
split of ``K``, so no second pass and no workspace. Float32 accumulation; the output in ``x``'s dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import DECODE_LINEAR_DTYPES, DECODE_LINEAR_ROWS

# (BN, BK, num_warps, num_stages[, "sum"]); "sum": for one token, products summed along the weight's rows instead of
# a tensor-core product. benchmarks/bench_linear.py sweeps them against cuBLAS (benchmarks/RESULTS.md, 2026-12-06)
ONE_TOKEN_CONFIG = (4, 512, 4, 2, "sum")
DEFAULT_CONFIG = (32, 256, 4, 4)
CUBLAS_ELEMENTS = 1 << 26  # weights of at least this many elements: cuBLAS already reads them at the bandwidth


def choose(N: int, K: int, B: int) -> tuple | None:
    """The configuration for a ``[B, K] x [N, K]^T`` product, or ``None`` where cuBLAS is as fast (``F.linear``).

    The rule of the H100 sweep on Llama-3.1-8B's projections at B = 1 and 8 (benchmarks/RESULTS.md, 2026-12-06):
    cuBLAS for weights of :data:`CUBLAS_ELEMENTS` or more (the merged ``gate_up``, 28672 × 4096: every tile within
    ±3 % of it), :data:`ONE_TOKEN_CONFIG` for one token with ``K <= 8192`` (``qkv`` 18.8 µs against cuBLAS's 20.2,
    ``o`` 13.6 against 15.4), :data:`DEFAULT_CONFIG` otherwise (``down`` 40.6 / 41.1 against 42.9 / 43.1 at B = 1 / 8,
    ``o`` 14.0 against 16.1 and ``qkv`` 20.2 against 20.4 at B = 8). Not swept on other GPUs."""
    if N * K >= CUBLAS_ELEMENTS:
        return None
    if B == 1 and K <= 8192:
        return ONE_TOKEN_CONFIG
    return DEFAULT_CONFIG


@triton.jit
def decode_linear_kernel(
    x,  # [B, K]
    w,  # [N, K], rows contiguous
    bias,  # [N] (unused without HAS_BIAS)
    y,  # [B, N]
    B,
    N,
    K,
    stride_x,
    stride_w,
    stride_y,
    HAS_BIAS: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BB: tl.constexpr,
    DOT: tl.constexpr,
):
    i_n = tl.program_id(0)
    o_n = i_n * BN + tl.arange(0, BN)
    o_b = tl.arange(0, BB)
    o_k = tl.arange(0, BK)
    m_n = o_n < N
    m_b = o_b < B
    # [BN, BB]
    b_acc = tl.zeros([BN, BB], dtype=tl.float32)
    for k0 in tl.range(0, K, BK):
        m_k = k0 + o_k < K
        # [BN, BK]
        b_w = tl.load(
            w + o_n.to(tl.int64)[:, None] * stride_w + (k0 + o_k)[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0
        )
        if DOT:
            # [BK, BB]: the tokens as columns
            b_x = tl.load(
                x + o_b[None, :] * stride_x + (k0 + o_k)[:, None], mask=m_b[None, :] & m_k[:, None], other=0.0
            )
            b_acc = tl.dot(b_w, b_x.to(b_w.dtype), b_acc)
        else:  # one token (BB == 1): products summed along the row, no tensor cores
            b_x = tl.load(x + (k0 + o_k), mask=m_k, other=0.0).to(tl.float32)
            b_acc += tl.sum(b_w.to(tl.float32) * b_x[None, :], 1)[:, None]
    if HAS_BIAS:
        b_acc += tl.load(bias + o_n, mask=m_n, other=0.0).to(tl.float32)[:, None]
    tl.store(y + o_b[None, :] * stride_y + o_n[:, None], b_acc.to(y.dtype.element_ty), mask=m_b[None, :] & m_n[:, None])


def decode_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: tuple | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., K]`` holding at most ``reference.DECODE_LINEAR_ROWS`` rows,
    ``weight [N, K]`` (rows contiguous), ``bias [N]``, in one of ``DECODE_LINEAR_DTYPES``; returns ``[..., N]`` in
    ``x``'s dtype. ``config``: ``(BN, BK, num_warps, num_stages)`` and optionally ``"sum"`` (one row: no tensor
    cores); when ``None``, :func:`choose`'s (which may say ``F.linear``)."""
    *lead, K = x.shape
    N = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"decode_linear: weight {tuple(weight.shape)} does not take inputs of width {K}")
    if weight.stride(1) != 1:
        raise ValueError("decode_linear: the weight's rows must be contiguous")
    if weight.dtype not in DECODE_LINEAR_DTYPES or x.dtype != weight.dtype:
        raise ValueError(
            f"decode_linear: bfloat16 or float16 x and weight of one dtype, not {x.dtype} and {weight.dtype}"
        )
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"decode_linear: bias {tuple(bias.shape)} for {N} outputs")
    x2 = x.reshape(-1, K)
    B = x2.shape[0]
    if B > DECODE_LINEAR_ROWS:
        raise ValueError(f"decode_linear: {B} rows, at most {DECODE_LINEAR_ROWS}")
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if config is None:
        config = choose(N, K, B)
    if config is None:
        return torch.nn.functional.linear(x, weight, bias)
    y = torch.empty(B, N, dtype=x.dtype, device=x.device)
    BN, BK, num_warps, num_stages, *variant = config
    dot = not (variant and variant[0] == "sum")
    if not dot and B != 1:
        raise ValueError(f"decode_linear: the 'sum' variant takes one row, not {B}")
    if B:
        decode_linear_kernel[(triton.cdiv(N, BN),)](
            x2,
            weight,
            weight if bias is None else bias,
            y,
            B,
            N,
            K,
            x2.stride(0),
            weight.stride(0),
            y.stride(0),
            HAS_BIAS=bias is not None,
            BN=BN,
            BK=BK,
            BB=DECODE_LINEAR_ROWS if dot else 1,
            DOT=dot,
            num_warps=num_warps,
            num_stages=num_stages,
        )
    return y.reshape(*lead, N)
