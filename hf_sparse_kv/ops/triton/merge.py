"""Merge split-KV partial results by their log-sum-exp: the Triton twin of ``reference.merge_partials``.

Each split ``s`` produced an output ``o_s`` normalised over its own positions and ``lse_s = log sum exp(logits_s)``.
With ``m = max_s lse_s`` and weights ``w_s = exp(lse_s - m)``, the merged output is ``sum_s w_s o_s / sum_s w_s``
and the merged log-sum-exp is ``m + log sum_s w_s``. Empty splits have ``lse = -inf`` (weight 0); a row whose splits
are all empty merges to output 0 and ``-inf``. One program per row, two passes over its splits (max, then the
weighted sum), ``BSP`` splits at a time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def merge_partials_kernel(
    o,  # [N, S, D]
    lse,  # [N, S]
    out,  # [N, D]
    lse_out,  # [N] float32
    S,
    D: tl.constexpr,
    BD: tl.constexpr,
    BSP: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    o_sp = tl.arange(0, BSP)
    o_d = tl.arange(0, BD)
    m_d = o_d < D

    # pass 1: the largest log-sum-exp of the row (a finite stand-in 0 when every split is empty)
    b_max = tl.full([BSP], float("-inf"), dtype=tl.float32)
    for i_s in range(0, S, BSP):
        # [BSP]
        b_lse = tl.load(lse + i_n * S + i_s + o_sp, mask=i_s + o_sp < S, other=float("-inf")).to(tl.float32)
        b_max = tl.maximum(b_max, b_lse)
    m = tl.max(b_max, 0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)

    # pass 2: weights w_s = exp(lse_s - m) <= 1 and the weighted sum of the partial outputs
    b_w_sum = tl.zeros([BSP], dtype=tl.float32)
    b_acc = tl.zeros([BD], dtype=tl.float32)
    for i_s in range(0, S, BSP):
        m_s = i_s + o_sp < S
        b_lse = tl.load(lse + i_n * S + i_s + o_sp, mask=m_s, other=float("-inf")).to(tl.float32)
        b_w = tl.exp(b_lse - m_ref)  # [BSP], 0 for empty splits
        # [BSP, BD]
        b_o = tl.load(
            o + (i_n * S + i_s + o_sp)[:, None] * D + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0
        ).to(tl.float32)
        b_acc += tl.sum(b_w[:, None] * b_o, 0)
        b_w_sum += b_w
    w_sum = tl.sum(b_w_sum, 0)
    has = w_sum > 0
    b_out = b_acc / tl.where(has, w_sum, 1.0)
    tl.store(out + i_n * D + o_d, b_out.to(out.dtype.element_ty), mask=m_d)
    tl.store(lse_out + i_n, tl.where(has, m_ref + tl.log(tl.where(has, w_sum, 1.0)), float("-inf")))


def merge_partials_fwd(
    o: torch.Tensor,
    lse: torch.Tensor,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the merge. ``o [..., S, D]``, ``lse [..., S]`` -> (``out [..., D]``, ``lse_out [...]`` float32).

    ``out`` (any float dtype, default ``o.dtype``) and ``lse_out`` may be given to write into (contiguous).
    """
    *lead, S, D = o.shape
    assert tuple(lse.shape) == (*lead, S), f"lse {tuple(lse.shape)} does not match o {tuple(o.shape)}"
    N = 1
    for n in lead:
        N *= n
    o3, lse2 = o.reshape(N, S, D).contiguous(), lse.reshape(N, S).contiguous()
    if out is None:
        out = torch.empty((*lead, D), dtype=o.dtype, device=o.device)
    if lse_out is None:
        lse_out = torch.empty(tuple(lead), dtype=torch.float32, device=o.device)
    assert out.shape == (*lead, D) and out.is_contiguous(), f"out {tuple(out.shape)} must be contiguous {(*lead, D)}"
    assert lse_out.shape == tuple(lead) and lse_out.is_contiguous() and lse_out.dtype == torch.float32
    if N == 0:
        return out, lse_out
    if S == 0:
        out.zero_()
        lse_out.fill_(float("-inf"))
        return out, lse_out
    BD = triton.next_power_of_2(D)
    BSP = max(1, min(triton.next_power_of_2(S), 4096 // BD, 64))
    merge_partials_kernel[(N,)](o3, lse2, out, lse_out, S, D=D, BD=BD, BSP=BSP, num_warps=4 if BD >= 128 else 2)
    return out, lse_out


def merge_partials(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge split-KV partial results by their log-sum-exp.

    Args:
        o: ``[..., S, D]`` partial outputs, each normalised over its own split.
        lse: ``[..., S]`` their log-sum-exp (``-inf`` for an empty split).

    Returns:
        (``[..., D]`` merged output in ``o.dtype``, ``[...]`` merged log-sum-exp float32).
    """
    return merge_partials_fwd(o, lse)
