"""Issue 13, an experiment on the CPU: each block's softmax mass estimated from two moments of its keys.

Quest ranks a block by an upper bound on its largest logit (its keys' per-channel min / max, 1/8 of K's bytes at
block size 16) and keeps 43-53 % of the oracle's blocks on Qwen2.5 (evaluation/RESULTS.md); the oracle ranks by the
block's softmax mass, the log-sum-exp of its logits. With the same bytes, the block's mean key ``m`` and per-channel
variance ``v`` (what a cache would keep instead of, or beside, min / max: ``kmean`` is kept already), the log-sum-exp
of ``n`` logits ``s q . k`` has a closed form when the keys are Gaussian with a diagonal covariance,
``log E[sum exp] = log n + s q . m + s^2 / 2 * sum_d q_d^2 v_d`` (the moment-generating function). ``estimate``:

- ``"gauss"``: that estimate;
- ``"gauss_cap"``: that estimate, capped by the exact bound the min / max give (``log n + s * max_k q . k`` is at most
  ``log n + s * sum_d max(q_d min_d, q_d max_d)``), where heavy-tailed blocks make the Gaussian term overshoot;
- ``"mean"``: ``log n + s q . m`` (no variance term; the mean key pooled like the oracle, a baseline).

Then the oracle's pooling and top-k (:func:`~hf_sparse_kv.ops.reference.lse_block_mass`). This module is the
PyTorch reference only, computing the moments from the keys at each step, for the suite's ``simulate`` screen
(``name: "evaluation.moments:MomentBlockTopK"``): no cache state, no Triton kernel, not registered as a policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_sparse_kv.ops.reference import held_positions, lse_block_mass
from hf_sparse_kv.policies.base import DecodeState
from hf_sparse_kv.policies.blocks import _BlockTopK

ESTIMATES = ("gauss", "gauss_cap", "mean")


def moment_block_lse(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    estimate: str = "gauss",
) -> torch.Tensor:
    """``[B, Hq, MB]`` float32: per query head and logical block, the estimated log-sum-exp of ``scale * q . k``
    over the block's valid positions (``start <= p < seq_len``, block held) from the moments of those keys (module
    docstring), ``-inf`` where none is valid.

    Args: ``q [B, Hq, D]``; ``k_pool [NB, Hkv, BS, D]``; ``block_table [B, MB]`` int; ``seq_lens``, ``start`` ``[B]``;
    ``estimate`` one of :data:`ESTIMATES`.
    """
    if estimate not in ESTIMATES:
        raise ValueError(f"estimate must be one of {ESTIMATES}, not {estimate!r}")
    B, MB = block_table.shape
    H, BS, D = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
    keys = k_pool[block_table.long().clamp(min=0)].float()  # [B, MB, Hkv, BS, D]
    w = held_positions(block_table, seq_lens, start, BS).float()[:, :, None, :, None]  # [B, MB, 1, BS, 1]
    n = w.sum(3)  # [B, MB, 1, 1]
    mean = (keys * w).sum(3) / n.clamp(min=1)  # [B, MB, Hkv, D]
    qg = q.float().view(B, H, -1, D)  # [B, Hkv, G, D]
    est = scale * torch.einsum("bhgd,bmhd->bhgm", qg, mean)
    if estimate != "mean":
        var = ((keys - mean[:, :, :, None]) ** 2 * w).sum(3) / n.clamp(min=1)  # [B, MB, Hkv, D]
        est = est + 0.5 * scale**2 * torch.einsum("bhgd,bmhd->bhgm", qg * qg, var)
    if estimate == "gauss_cap":
        big = torch.finfo(torch.float32).max
        kmax = keys.masked_fill(w == 0, -big).amax(3)  # [B, MB, Hkv, D]
        kmin = keys.masked_fill(w == 0, big).amin(3)
        qd = qg[:, :, :, None, :]  # [B, Hkv, G, 1, D]
        lo, hi = kmin.permute(0, 2, 1, 3)[:, :, None], kmax.permute(0, 2, 1, 3)[:, :, None]  # [B, Hkv, 1, MB, D]
        bound = scale * torch.maximum(qd * lo, qd * hi).sum(-1)  # [B, Hkv, G, MB]
        est = torch.minimum(est, bound)
    lse = est + n.view(B, 1, 1, MB).clamp(min=1).log()
    live = (n.view(B, MB) > 0).view(B, 1, 1, MB)
    return lse.masked_fill(~live, float("-inf")).flatten(1, 2)


@dataclass
class MomentBlockTopK(_BlockTopK):
    """Blocks ranked by their softmax mass estimated from their keys' mean and per-channel variance, pooled over
    the GQA group like the oracle (module docstring). Args as :class:`~hf_sparse_kv.policies.Quest`, plus
    ``estimate`` (one of :data:`ESTIMATES`). Reference ops only (an experiment)."""

    estimate: str = "gauss"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.estimate not in ESTIMATES:
            raise ValueError(f"estimate must be one of {ESTIMATES}, not {self.estimate!r}")

    def scores(self, state: DecodeState) -> torch.Tensor:
        """``[B, Hkv, nblk]`` the estimated mass per block, ``+inf`` for the forced blocks, ``-inf`` off use."""
        lse = moment_block_lse(
            state.q, state.k_pool, state.block_table, state.seq_lens, state.start, state.scale, self.estimate
        )
        H = state.k_pool.shape[1]
        return lse_block_mass(
            lse, state.block_table, state.seq_lens, state.start, state.block_size, H, self.sink, self.window
        )
