"""The ``mask`` mode on the GPU: SDPA over the whole (gathered) cache with a boolean mask.

Not a Triton kernel: the mask mode exists to show that expressing sparsity with a mask saves nothing, so it runs
the same dense kernel the model would (PyTorch SDPA) on a contiguous copy of the pages, in the cache's dtype. Its
reference is ``reference.decode_masked`` (float32 einsum).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..reference import gather_dense


def decode_masked(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q ``[B, Hq, D]``, pools ``[NB, Hkv, BS, D]``, mask ``[B, Hkv, L]`` bool -> ``[B, Hq, D]`` (see the reference)."""
    Hq, Hkv, L = q.shape[1], k_pool.shape[1], mask.shape[-1]
    keys, values = gather_dense(k_pool, block_table, L), gather_dense(v_pool, block_table, L)  # [B, Hkv, L, D]
    attn_mask = mask.repeat_interleave(Hq // Hkv, dim=1).unsqueeze(2)  # [B, Hq, 1, L]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys.to(q.dtype), values.to(q.dtype), attn_mask=attn_mask, scale=scale, enable_gqa=True
    )
    # a query with nothing to attend gives 0, as in the reference (SDPA would give NaN)
    return torch.where(mask.any(-1).repeat_interleave(Hq // Hkv, 1).unsqueeze(-1), out.squeeze(2), 0.0).to(q.dtype)
