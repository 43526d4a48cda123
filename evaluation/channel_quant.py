"""Issue 13, an experiment on the CPU: the oracle's mass from 4-bit keys read on only ``r`` channels per step.

``QuantBlockTopK(bits=4)`` ranks blocks as the oracle does (each query head's softmax mass per block, summed over
the GQA group) within noise on every model measured, but its scoring reads 4-bit codes of every channel of every
key (1/4 of K's bytes plus the blocks' min / max) and its kernel is bound by the per-channel work of unpacking them
(benchmarks/RESULTS.md, "Low-bit keys"). SparQ Attention (Ribar et al., https://arxiv.org/abs/2312.04985) scores
keys on the ``r`` channels where the query is largest; :class:`ChannelQuantBlockTopK` does that on the 4-bit codes:

- per KV head, the ``r`` channels of the largest ``sum_g |q_g|`` over its group (one channel set per group, so
  that the group's heads share the reads), ``S``;
- each token's logit ``q_S . k_hat_S + q_rest . m`` with ``k_hat`` the dequantized keys and ``m`` either the mean
  key of the head over its live blocks (``rest="mean"``: one ``[D]`` vector per head, no per-block bytes) or the
  block's own mean key (``rest="block"``: the cache's ``kmean``, ``D`` values a block); ``rest="none"`` drops the
  other channels and scales the logits by SparQ's ``1 / sqrt(||q_S||_1 / ||q||_1)``;
- then the oracle's mass and top-k, as ``QuantBlockTopK``.

A kernel would read ``r / D`` of the codes (at ``r = D / 4``: 1/16 of K's bytes) and the min / max of those
channels. This module is the PyTorch reference only, for :mod:`evaluation.coarse_pool`'s ``simulate`` screen: no
Triton kernel, not registered as a policy of the library.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_sparse_kv.ops.reference import lse_block_mass, quant_block_lse
from hf_sparse_kv.policies import QuantBlockTopK
from hf_sparse_kv.policies.base import DecodeState

RESTS = ("mean", "block", "none")


def channel_mask(q: torch.Tensor, num_kv_heads: int, channels: int, group: int = 1) -> torch.Tensor:
    """``[B, Hkv, D]`` float32, 1 on the ``channels`` channels of the largest ``sum_g |q_g|`` of each KV head's group
    (``q [B, Hq, D]``), 0 elsewhere; with ``group > 1``, the ``channels / group`` runs of ``group`` consecutive
    channels of the largest such sums (a kernel reads memory in 32-byte sectors: at 4 bits a block's row of one
    channel is 8 bytes, so only runs of 4 channels cut the bytes read in proportion)."""
    B, Hq, D = q.shape
    if not 0 < channels <= D or group < 1 or channels % group or D % group:
        raise ValueError(f"channels must be in 1..{D} and a multiple of group, not {channels} (group {group})")
    pooled = q.float().view(B, num_kv_heads, Hq // num_kv_heads, D // group, group).abs().sum((2, 4))
    runs = torch.zeros_like(pooled).scatter_(-1, pooled.topk(channels // group, -1).indices, 1.0)
    return runs.repeat_interleave(group, -1)  # [B, Hkv, D]


def channel_quant_block_lse(
    q: torch.Tensor,
    codes: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    kmean: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    bits: int,
    channels: int,
    rest: str,
    group: int = 1,
) -> torch.Tensor:
    """``[B, Hq, MB]`` float32: per query head and logical block, the log-sum-exp over the block's valid positions
    of the approximate logits of the module docstring (``-inf`` where no position is valid).

    Args: ``q [B, Hq, D]``; ``codes [NB, Hkv, BS, D * bits // 8]`` uint8; ``kmin``, ``kmax``, ``kmean``
    ``[NB, Hkv, D]``; ``block_table [B, MB]``; ``seq_lens``, ``start`` ``[B]``; ``channels`` (``r``); ``rest``
    (one of :data:`RESTS`); ``group`` (runs of channels, :func:`channel_mask`).
    """
    if rest not in RESTS:
        raise ValueError(f"rest must be one of {RESTS}, not {rest!r}")
    B = block_table.shape[0]
    H, D = codes.shape[1], q.shape[-1]
    qg = q.float().view(B, H, -1, D)  # [B, Hkv, G, D]
    m = channel_mask(q, H, channels, group)[:, :, None, :]  # [B, Hkv, 1, D]
    q_kept = qg * m
    if rest == "none":  # SparQ's temperature: the share of |q| kept, per query head
        kept = (qg.abs() * m).sum(-1) / qg.abs().sum(-1).clamp(min=1e-30)  # [B, Hkv, G]
        q_kept = q_kept / kept.clamp(min=1e-6).sqrt()[..., None]
    # the kept channels' logits: QuantBlockTopK's log-sum-exp of the masked queries
    lse = quant_block_lse(q_kept.flatten(1, 2), codes, kmin, kmax, block_table, seq_lens, start, scale, bits)
    if rest == "none":
        return lse
    # the other channels add one logit per block ("block") or per head ("mean"): the same to each of the block's
    # positions, so the same to its log-sum-exp (a block without a valid position stays -inf)
    means = kmean[block_table.long().clamp(min=0)].float()  # [B, MB, Hkv, D]
    q_rest = qg * (1 - m)
    if rest == "block":
        extra = torch.einsum("bhgd,bmhd->bhgm", q_rest, means)  # [B, Hkv, G, MB]
    else:
        live = lse[:, 0].isfinite().float()  # [B, MB]: blocks with a valid position
        head_mean = torch.einsum("bm,bmhd->bhd", live, means) / live.sum(-1).clamp(min=1).view(B, 1, 1)
        extra = torch.einsum("bhgd,bhd->bhg", q_rest, head_mean)[..., None]
    return lse + scale * extra.flatten(1, 2)


@dataclass
class ChannelQuantBlockTopK(QuantBlockTopK):
    """``QuantBlockTopK`` scored on the ``channels`` channels of the largest pooled ``|q|`` (module docstring).

    Args: as :class:`~hf_sparse_kv.policies.QuantBlockTopK`, plus ``channels`` (``r``), ``rest`` (the other
    channels: ``"mean"``, ``"block"`` or ``"none"``) and ``group`` (runs of consecutive channels chosen together).
    Reference ops only (an experiment)."""

    bits: int = 4
    channels: int = 16
    rest: str = "mean"
    group: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rest not in RESTS:
            raise ValueError(f"rest must be one of {RESTS}, not {self.rest!r}")

    def key_metadata(self) -> tuple[str, ...]:
        return ("kmin", "kmax", "kmean")  # the blocks' means for ``rest="block"``

    def scores(self, state: DecodeState) -> torch.Tensor:
        """``[B, Hkv, nblk]`` the approximate mass per block, ``+inf`` for the forced blocks, ``-inf`` off use."""
        lse = channel_quant_block_lse(
            state.q, self.codes(state), state.kmin, state.kmax, state.kmean, state.block_table, state.seq_lens,
            state.start, state.scale, self.bits, self.channels, self.rest, self.group,
        )  # fmt: skip
        H = state.k_pool.shape[1]
        return lse_block_mass(
            lse, state.block_table, state.seq_lens, state.start, state.block_size, H, self.sink, self.window
        )
