"""Block scores and their top-k in one launch: the Triton twin of ``reference.block_topk``
(``topk_indices(block_scores(...))``).

The grid is :func:`~.block_scores.block_scores_kernel`'s (tile programs x ``B * Hkv`` rows). Each program scores its
tiles and stores them, then reports to its row's counter (``tl.atomic_add``, acquire-release at GPU scope, after a
barrier so that every lane's stores come first). The program that arrives last holds the row's only remaining work:
it resets the counter to zero (left as found for the next launch), reads the row's scores back past L1 (``.cg``:
other programs stored them) and runs the one-program top-k of :func:`~.topk.row_topk`. Nothing else waits, so no
program can deadlock on a grid larger than the machine.

What it saves against the two launches: the top-k's launch and its start behind the scoring kernel's last wave,
on the one SM of a row that finishes last. The scores themselves are still written and read (they are 4 bytes a
block, in L2). Rows longer than the one-program top-k holds (``TOPK_MAX_N`` blocks) take the two launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_scores import block_scores, score_launch, score_tiles
from .topk import TOPK_MAX_N, _row_k, row_tiles, row_topk, topk_indices


@triton.jit
def block_topk_kernel(
    q, kmin, kmax, kmean, block_table, seq_lens, start, scores, s_mn, MB, SINK, WINDOW,
    arrived,  # [B * H] int32, zero on entry and on exit
    counts,  # [B] int64 (read only if HAS_COUNTS)
    out,  # [B * H, K] int32
    K, KK,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr,
    BM: tl.constexpr, QUEST: tl.constexpr, FORCE: tl.constexpr, F32: tl.constexpr, TPP: tl.constexpr,
    STAGES: tl.constexpr, HAS_COUNTS: tl.constexpr, BN: tl.constexpr, BN2: tl.constexpr, BK: tl.constexpr,
    EARLY: tl.constexpr,
):  # fmt: skip
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    score_tiles(
        q, kmin, kmax, kmean, block_table, seq_lens, start, scores, s_mn, MB, SINK, WINDOW, i_m, i_bh,
        H, G, D, BS, BG, BD, BM, QUEST, FORCE, F32, TPP, STAGES,
    )  # fmt: skip
    tl.debug_barrier()  # every lane's scores stored before the program reports
    before = tl.atomic_add(arrived + i_bh, 1, sem="acq_rel", scope="gpu")
    if before == tl.num_programs(0) - 1:  # the row's last program: all its scores are stored
        tl.store(arrived + i_bh, 0)  # as found, for the next launch
        kk = _row_k(KK, counts, i_bh, H, HAS_COUNTS)
        i_r = i_bh.to(tl.int64)
        row_topk(scores + i_r * MB, out + i_r * K, kk, MB, K, BN, BN2, BK, EARLY, ".cg")


def block_topk(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    kmean: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    method: str,
    k: int,
    counts: torch.Tensor | None = None,
    start: torch.Tensor | None = None,
    sink: int = 0,
    window: int | None = None,
    fused: bool = True,
    num_warps: int | None = None,
    block_m: int | None = None,
    tiles_per_program: int = 2,
    num_stages: int = 2,
) -> torch.Tensor:
    """The top-``k`` blocks of every sequence and KV head by :func:`~.block_scores.block_scores`, in one launch.

    Args:
        q, kmin, kmax, kmean, block_table, seq_lens, block_size, method, start, sink, window: as
            :func:`~.block_scores.block_scores`.
        k, counts: as :func:`~.topk.topk_indices` on the ``[B, Hkv, MB]`` scores (``counts [B]``: sequence ``b``
            keeps ``min(k, counts[b])``, read on the device).
        fused: ``False`` (or a table wider than ``TOPK_MAX_N`` blocks) runs the two launches instead.
        num_warps: the fused kernel's warps (default: 4 up to 2048 blocks, 8 above, as the top-k's); block_m,
            tiles_per_program, num_stages: the scoring knobs of :func:`~.block_scores.block_scores`.

    Returns:
        ``[B, Hkv, k]`` int32 logical block numbers, ascending, ``-1`` after the kept ones (the ties at the threshold
        go to the lowest block numbers; no ``-inf`` score is kept).
    """
    MB = block_table.shape[1]
    if not fused or MB > TOPK_MAX_N or MB == 0 or k == 0:
        scores = block_scores(
            q, kmin, kmax, kmean, block_table, seq_lens, block_size, method, start, sink, window, block_m,
            num_warps or 4, tiles_per_program, num_stages,
        )  # fmt: skip
        return topk_indices(scores, k, counts)
    launch = score_launch(
        q, kmin, kmax, kmean, block_table, seq_lens, block_size, method, start, sink, window, block_m,
        tiles_per_program, num_stages,
    )  # fmt: skip
    B, H = q.shape[0], kmin.shape[1]
    out = torch.empty(B, H, k, dtype=torch.int32, device=q.device)
    if counts is not None:
        if counts.shape != (B,):
            raise ValueError(f"counts must be [{B}], got {tuple(counts.shape)}")
        counts = counts.to(q.device)
    arrived = torch.zeros(B * H, dtype=torch.int32, device=q.device)
    BN, BN2 = row_tiles(MB)
    block_topk_kernel[launch.grid](
        *launch.args, arrived, counts if counts is not None else arrived, out, k, min(k, MB), **launch.meta,
        HAS_COUNTS=counts is not None, BN=BN, BN2=BN2, BK=max(16, min(1024, triton.next_power_of_2(k))), EARLY=True,
        num_warps=num_warps or max(4, min(8, (BN + BN2) // 512)),
    )  # fmt: skip
    return out
