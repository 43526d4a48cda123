"""The dense prefill of a left-padded batch, one sequence at a time on SDPA's causal path.

A left-padded batch reaches the attention with a mask ``[B, 1, L, L]`` (causal and padding). SDPA cannot run its
flash kernel with a mask (it takes another kernel), and transformers repeats the KV heads for it (no grouped-query
attention with a mask). Each sequence without its padding is a plain causal prefill: run alone and unmasked, it
takes the flash kernel. On an H200, 8 prompts of ~32K tokens (Qwen2.5-1.5B, bf16) prefilled in 7.4-7.5 s masked,
4.8-4.9 s this way (the same answers) and 2.8 s cut to equal lengths (benchmarks/RESULTS.md, 2026-12-01). The
outputs at padded positions are zeros: they are never stored (the paged cache drops the padding) and only padded
positions read them.

Taken only when it computes exactly what the mask asks, and outside a ``torch.compile`` trace (the check below reads
a device value on the host): a first prefill (the keys are the queries' own positions), a layer without a sliding
window, a mask that allows each real query exactly the real keys up to itself (checked on the device, a chunk of
rows at a time, once per forward: the layers share the mask), and a dtype that SDPA's flash kernel takes (fp16 / bf16 on CUDA; in float32 the masked call was
faster: unmasked float32 with grouped heads falls back to SDPA's math kernel).
"""

from __future__ import annotations

from functools import partial

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .ops.layout import mask_allows

CHECK_ROWS = 2048  # query rows of the mask checked at once (B x 2048 x L booleans: 0.5 GiB at 8 x 32K)


def flash_dtype(query: torch.Tensor) -> bool:
    """Whether SDPA runs ``query`` unmasked on its flash kernel (fp16 / bf16 on CUDA)."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)


def causal_left_padded(mask: torch.Tensor, pads: list[int]) -> bool:
    """Whether ``mask [B, 1, L, L]`` (bool, or additive float) lets each real query ``i >= pads[b]`` attend exactly
    the keys ``pads[b] <= j <= i`` (rows of padded queries are not looked at)."""
    B, _, Q, K = mask.shape
    if mask.shape[1] != 1 or Q != K or len(pads) != B:
        return False
    device = mask.device
    pad = torch.tensor(pads, device=device).view(B, 1, 1)
    j = torch.arange(K, device=device).view(1, 1, K)
    good = torch.ones((), dtype=torch.bool, device=device)
    for r0 in range(0, Q, CHECK_ROWS):
        ok = mask_allows(mask[:, 0, r0 : r0 + CHECK_ROWS])  # [B, R, K]
        i = torch.arange(r0, r0 + ok.shape[1], device=device).view(1, -1, 1)
        good &= ((ok == ((j <= i) & (j >= pad))) | (i < pad)).all()
    return bool(good)  # one synchronisation for the whole mask


def rows_apply(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    mask: torch.Tensor | None,
    pads: list[int],
    session=None,
    **kw,
) -> bool:
    """Whether :func:`prefill_by_rows` computes this call (``query [B, Hq, L, D]``, ``key [B, Hkv, L, D]``,
    ``mask`` as transformers passes it, the cache's ``pads``; ``kw`` the attention call's other arguments). With the
    cache's ``session`` (:class:`~hf_sparse_kv.runtime.DecodeSession`) the mask is checked once per forward, not at
    every layer."""
    B, _, L, _ = query.shape
    check = causal_left_padded if session is None else partial(session.mask_verdict, check=causal_left_padded)
    return (
        not torch.compiler.is_compiling()  # the mask check reads a device value on the host: not inside a graph
        and B > 1
        and any(pads)
        and mask is not None
        and key.shape[2] == L
        and getattr(module, "sliding_window", None) is None
        and kw.get("sliding_window") is None
        and kw.get("position_bias") is None
        and flash_dtype(query)
        and check(mask, pads)
    )


def prefill_by_rows(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    pads: list[int],
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention of each sequence without its left padding: ``query [B, Hq, L, D]``, ``key``/``value``
    ``[B, Hkv, L, D]``, ``pads`` per sequence -> ``([B, L, Hq, D], None)`` as ``sdpa_attention_forward`` returns,
    zeros at padded positions."""
    B, Hq, L, _ = query.shape
    kwargs.pop("is_causal", None)  # the mask was checked causal: so is each sequence's call
    out = query.new_zeros(B, L, Hq, value.shape[-1])
    for b, p in enumerate(pads):
        if p >= L:
            continue
        o, _ = sdpa_attention_forward(
            module, query[b : b + 1, :, p:], key[b : b + 1, :, p:], value[b : b + 1, :, p:], None,
            dropout=dropout, scaling=scaling, is_causal=True, **kwargs,
        )  # fmt: skip
        out[b, p:] = o[0]
    return out, None
