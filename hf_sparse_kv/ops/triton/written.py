"""The block a state write's program works on: the per-token state writes (``quant_write``, ``pq_write``) run one
program per (logical block the written positions ``[lo, hi)`` touch, sequence, KV head); one ``@triton.jit`` form
of that bookkeeping, inlined by both."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def written_block(lo, hi, block_table, i_b, i_n, MB, BS: tl.constexpr):
    """``(b_lo, b_hi, lb, b_phys, ok)`` of program ``i_n`` of sequence ``i_b``: the written range ``[b_lo, b_hi)``,
    the logical block ``lb`` (the ``i_n``-th from the one holding ``b_lo``), its physical block, and whether there is
    anything to write there (a non-empty range reaching ``lb``, inside the table, a held block)."""
    b_lo = tl.load(lo + i_b).to(tl.int64)
    b_hi = tl.load(hi + i_b).to(tl.int64)
    lb = b_lo // BS + i_n
    ok = (b_hi > b_lo) & (lb <= (b_hi - 1) // BS) & (lb < MB)
    b_phys = tl.load(block_table + i_b * MB + lb, mask=ok, other=-1).to(tl.int64)
    return b_lo, b_hi, lb, b_phys, ok & (b_phys >= 0)
