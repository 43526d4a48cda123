"""The exact scorers of the oracle policies on the Triton backend: ``token_scores`` (every token's ``q . k``, max over
the GQA group: TokenTopK) and ``oracle_block_scores`` (each block's true softmax mass, summed over the group:
OracleBlockTopK), twins of their ``..reference`` functions.

Both read every key once, through the candidate kernel (:mod:`.candidates`) with every logical block of the context
as a candidate: ``reduce="token"`` gives the token scores as they are; ``reduce="head_mass"`` gives each (query head,
block)'s log-sum-exp of ``scale * q . k``, and a block's mass for a head is ``exp(its lse - the head's lse over all
blocks)``, so no ``[B, Hq, L]`` softmax is written. The reference gathers every key into a float32 copy and multiplies
it out: on a GPU that was most of a decode step of these policies (evaluation's needle cells of the oracle and
TokenTopK took 3x the others', 2026-12-05).
"""

from __future__ import annotations

import torch

from ..layout import cdiv
from ..reference import held_block_mass
from .candidates import candidate_scores


def _every_block(q: torch.Tensor, k_pool: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, Hkv, nblk]`` int32: the logical blocks ``0 .. nblk - 1`` covering ``length`` positions, as candidates."""
    nblk = cdiv(length, k_pool.shape[2])
    if nblk > block_table.shape[1]:
        raise ValueError(f"length {length} needs {nblk} blocks; the block table holds {block_table.shape[1]}")
    blocks = torch.arange(nblk, dtype=torch.int32, device=q.device)
    return blocks.expand(q.shape[0], k_pool.shape[1], nblk).contiguous()


def token_scores(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    length: int | None = None,
) -> torch.Tensor:
    """Exact ``q . k`` of every token, max over each GQA group: ``[B, Hkv, L]`` float32, ``-inf`` where invalid
    (before ``start``, past the end, in an evicted block). ``L`` is ``length``, by default ``max(seq_lens)`` (read
    from the device). Shapes as ``reference.token_scores``."""
    L = int(seq_lens.max()) if length is None else length
    B, H = q.shape[0], k_pool.shape[1]
    blocks = _every_block(q, k_pool, block_table, L)
    s = candidate_scores(q, k_pool, block_table, seq_lens, start, blocks, reduce="token")  # [B, H, nblk, BS]
    return s.view(B, H, -1)[..., :L]


def oracle_block_scores(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    length: int | None = None,
) -> torch.Tensor:
    """True softmax mass of each block, summed over each GQA group's query heads: ``[B, Hkv, MB]`` float32, ``-inf``
    for blocks past the sequence or evicted; a head with nothing valid adds 0. Reads every key up to ``length``
    positions (default ``max(seq_lens)``, read from the device). Shapes as ``reference.oracle_block_scores``."""
    L = int(seq_lens.max()) if length is None else length
    B, HQ = q.shape[:2]
    H = k_pool.shape[1]
    blocks = _every_block(q, k_pool, block_table, L)
    within = seq_lens.clamp(max=L)  # positions past ``length`` are not scored (the reference's window)
    lse = candidate_scores(q, k_pool, block_table, within, start, blocks, reduce="head_mass", scale=scale)
    # a head's share of each block: exp(block lse - the head's lse); a head with nothing valid: -inf - -inf -> 0
    mass = (lse - lse.logsumexp(-1, keepdim=True)).exp().nan_to_num(0.0)  # [B, HQ, nblk]
    return held_block_mass(mass.view(B, H, HQ // H, -1).sum(2), block_table, seq_lens, k_pool.shape[2])
