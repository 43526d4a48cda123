"""Calibrate a compressed-key selector (:mod:`hf_sparse_kv.policies.projected`) on a few hundred tokens of text.

:func:`calibrate_selector` runs the model once over ``input_ids`` with an attention function that records every
layer's queries and keys after RoPE (what the cache stores and a decode query sees), then derives per layer and KV
head a projection ``P [Hkv, D, R]``:

- ``"channels"`` (Double Sparsity's offline channel calibration, https://arxiv.org/abs/2408.07092): the ``R``
  channels with the largest ``E[q_d^2] Var(k_d)``, queries pooled over the GQA group. A channel's mean key adds the
  same ``q_d E[k_d]`` to every key's score, so only its variance moves a ranking;
- ``"pairs"``: the same importance summed over RoPE's channel pairs ``(d, d + D/2)`` (transformers' ``rotate_half``
  layout), the ``R / 2`` best pairs kept whole. RoPE turns each pair by an angle that grows with the position, so a
  lone channel's share of ``q . k`` depends on where query and key sit, and channels ranked at the calibration's
  positions can fall away at longer ones; a whole pair contributes the rotation-consistent 2-D product;
- ``"pca"`` (Loki, https://arxiv.org/abs/2406.02542): the top ``R`` principal directions of the centered keys;
- ``"svd"`` (query-aware low rank): the rank-``R`` bilinear form ``q^T B A^T k`` closest to ``q^T k`` on average
  over the recorded queries and centered keys, ``E[(q^T (I - B A^T) k)^2] = ||Cq^(1/2) (I - B A^T) Ck^(1/2)||^2``:
  with ``Cq^(1/2) Ck^(1/2) = U S V^T``, keys are compressed by ``A = Ck^(-1/2) V_R`` and queries by
  ``B = Cq^(-1/2) U_R S_R`` (stored as ``"qproj"``; the other methods project both by one ``P``).

The result is a small dict (``torch.save`` it; ``hf-sparse-kv calibrate-selector`` does) that the projected policies
take as ``calibration=``. ``method="pq"`` instead fits product-quantization centres per layer and KV head
(:func:`~hf_sparse_kv.policies.product.fit_centres` over the recorded keys) for a two-stage policy's
``coarse="pq"``: calibrate it on as many tokens as the contexts it will serve (RoPE: :mod:`.policies.product`).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .policies.product import METHOD as PQ_METHOD
from .policies.product import fit_centres
from .policies.projected import METHODS

ATTENTION_NAME = "hf_sparse_kv_record"
RECORD_KWARG = "hf_sparse_kv_record"


def record_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA, after storing ``(query [Hq, N, D], key [Hkv, N, D])`` float32 (batch rows concatenated along ``N``)
    under the layer's index in the dict passed as ``hf_sparse_kv_record``."""
    record = kwargs.pop(RECORD_KWARG, None)
    if record is not None:
        q = query.float().transpose(0, 1).flatten(1, 2)  # [B, H, N, D] -> [H, B*N, D]
        k = key.float().transpose(0, 1).flatten(1, 2)
        record[module.layer_idx] = (q, k)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def record_qk(model: torch.nn.Module, input_ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Every attention layer's post-RoPE queries ``[Hq, N, D]`` and keys ``[Hkv, N, D]`` over ``input_ids [B, N]``
    (scoped: the model's attention is restored after)."""
    record: dict = {}
    AttentionInterface.register(ATTENTION_NAME, record_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)

    def hook(module, args, kwargs):
        kwargs[RECORD_KWARG] = record
        return args, kwargs

    modules = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "k_proj")]
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    original = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        with torch.no_grad():
            model(input_ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
        model.set_attn_implementation(original)
    return record


def _sqrt_and_inverse(c: torch.Tensor, eps: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """``C^(1/2)`` and ``(C + eps tr(C)/D I)^(-1/2)`` of symmetric PSD ``[..., D, D]`` (float64)."""
    vals, vecs = torch.linalg.eigh(c)
    vals = vals.clamp(min=0)
    floor = eps * vals.mean(-1, keepdim=True)
    root = (vecs * vals.sqrt().unsqueeze(-2)) @ vecs.transpose(-1, -2)
    inv = (vecs * (vals + floor).rsqrt().unsqueeze(-2)) @ vecs.transpose(-1, -2)
    return root, inv


def query_aware(q: torch.Tensor, k: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``"svd"`` method: (key projection ``A``, query projection ``B``), each ``[Hkv, D, rank]`` float32."""
    Hkv, N, D = k.shape
    qg = q.reshape(Hkv, -1, D).double()
    kc = (k - k.mean(1, keepdim=True)).double()
    cq_root, cq_inv = _sqrt_and_inverse(qg.transpose(1, 2) @ qg / qg.shape[1])
    ck_root, ck_inv = _sqrt_and_inverse(kc.transpose(1, 2) @ kc / N)
    U, S, Vh = torch.linalg.svd(cq_root @ ck_root)
    A = ck_inv @ Vh[:, :rank].transpose(1, 2)  # [Hkv, D, R]
    B = cq_inv @ (U[..., :rank] * S[:, None, :rank])
    return A.float().contiguous(), B.float().contiguous()


def projection(q: torch.Tensor, k: torch.Tensor, rank: int, method: str) -> torch.Tensor:
    """``[Hkv, D, rank]`` float32 from queries ``[Hq, N, D]`` and keys ``[Hkv, N, D]`` (see the module); for
    ``"svd"`` the key projection (:func:`query_aware` gives both)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    Hkv, N, D = k.shape
    if not 0 < rank <= D:
        raise ValueError(f"rank must lie in [1, {D}], got {rank}")
    if method in ("channels", "pairs"):
        qg = q.reshape(Hkv, -1, D)  # the group's queries pooled: [Hkv, G * N, D]
        q2, kvar = qg.pow(2).mean(1), k.var(1, unbiased=False)  # [Hkv, D] each
        if method == "channels":
            idx = (q2 * kvar).topk(rank, dim=-1).indices.sort(-1).values  # [Hkv, R]
        else:
            if rank % 2 or D % 2:
                raise ValueError(f"method 'pairs' keeps whole RoPE pairs: rank and head dim must be even, got {rank}")
            half = D // 2
            pair = (q2[:, :half] + q2[:, half:]) * (kvar[:, :half] + kvar[:, half:])  # [Hkv, D / 2]
            top = pair.topk(rank // 2, dim=-1).indices
            idx = torch.cat([top, top + half], -1).sort(-1).values
        P = torch.zeros(Hkv, D, rank)
        P.scatter_(1, idx.unsqueeze(1), 1.0)  # P[h, idx[h, r], r] = 1
        return P
    if method == "svd":
        return query_aware(q, k, rank)[0]
    kc = k - k.mean(1, keepdim=True)
    cov = kc.transpose(1, 2) @ kc / N  # [Hkv, D, D]
    _, vecs = torch.linalg.eigh(cov.double())  # ascending eigenvalues
    return vecs[..., -rank:].flip(-1).float().contiguous()


def calibrate_selector(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    method: str = "channels",
    rank: int | None = None,
    sub_dim: int = 8,
    centroids: int = 256,
) -> dict:
    """Run ``model`` over ``input_ids [B, N]`` and return the calibration of a projected selector:
    ``{"method", "rank", "tokens", "model", "proj": {layer index: [Hkv, D, R] float32}}`` (and ``"qproj"``, the
    queries' projections, for ``"svd"``); ``rank`` defaults to
    ``D // 8`` (the compressed keys then weigh 1/8 of the keys). With ``method="pq"``, the centres of a
    product-quantized coarse pass instead: ``{"method": "pq", "sub_dim", "centroids", "tokens", "model", "centres":
    {layer index: [Hkv, D / sub_dim, centroids, sub_dim] float32}}``."""
    if method not in (*METHODS, PQ_METHOD):
        raise ValueError(f"method must be one of {(*METHODS, PQ_METHOD)}, got {method!r}")
    record = record_qk(model, input_ids)
    if not record:
        raise ValueError("no attention layer was recorded: is this a transformers causal LM?")
    D = next(iter(record.values()))[1].shape[-1]
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    if method == PQ_METHOD:
        centres = {layer: fit_centres(k.cpu(), sub_dim, centroids) for layer, (_, k) in sorted(record.items())}
        meta = {"sub_dim": sub_dim, "centroids": centroids, "tokens": int(input_ids.numel()), "model": name}
        return {"method": PQ_METHOD, **meta, "centres": centres}
    rank = rank or max(1, D // 8)
    out = {"method": method, "rank": rank, "tokens": int(input_ids.numel()), "model": name}
    if method == "svd":
        pairs = {layer: query_aware(q.cpu(), k.cpu(), rank) for layer, (q, k) in sorted(record.items())}
        return {**out, "proj": {i: a for i, (a, _) in pairs.items()}, "qproj": {i: b for i, (_, b) in pairs.items()}}
    proj = {layer: projection(q.cpu(), k.cpu(), rank, method) for layer, (q, k) in sorted(record.items())}
    return {**out, "proj": proj}
