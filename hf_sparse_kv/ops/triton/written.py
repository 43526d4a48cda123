"""Where a state write's program writes: the per-block state writes (``quant_write``, ``pq_write``) run one program
per (logical block the written positions ``[lo, hi)`` touch, sequence, KV head), the per-position ones
(``projected_write``, ``fp8_write``) one per (tile of written positions, sequence, KV head); one ``@triton.jit`` form
of each bookkeeping, inlined by its kernels."""

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


@triton.jit
def written_positions(lo, hi, block_table, i_b, i_t, MB, BS: tl.constexpr, BT: tl.constexpr):
    """``(b_phys, off, m_p)``, each ``[BT]``, of tile ``i_t`` of sequence ``i_b``'s written positions ``[lo, hi)``
    (``BT`` positions from ``lo + i_t * BT``): their physical blocks (int64, 0 where none), offsets in the block, and
    which to write (written, inside the table, in a held block)."""
    b_lo = tl.load(lo + i_b).to(tl.int64)
    b_hi = tl.load(hi + i_b).to(tl.int64)
    o_p = b_lo + i_t * BT + tl.arange(0, BT)
    lb = o_p // BS
    m_p = (o_p < b_hi) & (lb < MB)
    b_phys = tl.load(block_table + i_b * MB + tl.minimum(lb, MB - 1), mask=m_p, other=-1)
    return tl.maximum(b_phys, 0).to(tl.int64), o_p % BS, m_p & (b_phys >= 0)
