"""The dense prefill of a left-padded batch, one sequence at a time on SDPA's causal path.

A left-padded batch reaches the attention with a mask ``[B, 1, L, L]`` (causal and padding). SDPA cannot run its
flash kernel with a mask (it takes another kernel), and transformers repeats the KV heads for it (no grouped-query
attention with a mask). Each sequence without its padding is a plain causal prefill: run alone and unmasked, it
takes the flash kernel. On an H200, 8 prompts of ~32K tokens (Qwen2.5-1.5B, bf16) prefilled in 7.4-7.5 s masked,
4.8-4.9 s this way (the same answers) and 2.8 s cut to equal lengths (benchmarks/RESULTS.md, 2026-12-01). The
outputs at padded positions are zeros: they are never stored (the paged cache drops the padding) and only padded
positions read them.

A sliding-window layer (Gemma-3's local layers, Mistral with a window) gets the same treatment with its window:
each sequence without its padding, its queries cut into chunks of ``window`` that attend only the ``window`` keys
before each chunk and the chunk's own (one SDPA call over all chunks, a small mask shared by them): ``L x 2W`` scores
a sequence instead of the masked call's ``B x L x L`` (on an H100, Gemma-3-270M's needle batches at 32K spent ~3.7 s a
prompt in the masked prefill, evaluation/RESULTS.md, 2026-12-05). Transformers masks a sliding layer whatever the
padding, so these take the rows also for a batch without padding and for one prompt alone.

Taken only when it computes exactly what the mask asks, and outside a ``torch.compile`` trace (the check below reads
a device value on the host): a first prefill (the keys are the queries' own positions), a mask that allows each real
query exactly the real keys up to itself (within the layer's window, for a sliding layer; checked on the device, a
chunk of rows at a time, once per forward and window: the layers share their masks), and a dtype that SDPA's flash
kernel takes (fp16 / bf16 on CUDA; in float32 the masked call was faster: unmasked float32 with grouped heads falls
back to SDPA's math kernel).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .ops.layout import mask_allows

CHECK_ROWS = 2048  # query rows of the mask checked at once (B x 2048 x L booleans: 0.5 GiB at 8 x 32K)


def flash_dtype(query: torch.Tensor) -> bool:
    """Whether SDPA runs ``query`` unmasked on its flash kernel (fp16 / bf16 on CUDA)."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)


def causal_left_padded(mask: torch.Tensor, pads: list[int], window: int | None = None) -> bool:
    """Whether ``mask [B, 1, L, L]`` (bool, or additive float) lets each real query ``i >= pads[b]`` attend exactly
    the keys ``pads[b] <= j <= i`` (and ``j > i - window`` with a ``window``: transformers' sliding window); rows of
    padded queries are not looked at."""
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
        want = (j <= i) & (j >= pad)
        if window is not None:
            want &= j > i - window
        good &= ((ok == want) | (i < pad)).all()
    return bool(good)  # one synchronisation for the whole mask


def layer_window(module: torch.nn.Module, kw: dict) -> int | None:
    """The sliding window of an attention call (its ``sliding_window`` argument, else the module's), ``None`` for
    full attention."""
    window = kw.get("sliding_window")
    return window if window is not None else getattr(module, "sliding_window", None)


def rows_apply(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    mask: torch.Tensor | None,
    pads: list[int],
    session=None,
    **kw,
) -> bool:
    """Whether :func:`prefill_by_rows` (with the layer's :func:`layer_window`) computes this call (``query [B, Hq, L,
    D]``, ``key [B, Hkv, L, D]``, ``mask`` as transformers passes it, the cache's ``pads``; ``kw`` the attention
    call's other arguments). With the cache's ``session`` (:class:`~hf_sparse_kv.runtime.DecodeSession`) each mask
    is checked once per forward, not at every layer."""
    B, _, L, _ = query.shape
    window = layer_window(module, kw)
    check = partial(causal_left_padded, window=window)
    if session is not None:
        check = partial(session.mask_verdict, check=check, tag=window)
    return (
        not torch.compiler.is_compiling()  # the mask check reads a device value on the host: not inside a graph
        # unpadded, a full-attention layer gets no mask from transformers (SDPA's causal flash path); a sliding one
        # gets its window's mask whatever the padding, one prompt alone included
        and (window is not None or (B > 1 and any(pads)))
        and mask is not None
        and key.shape[2] == L
        and (window is None or (isinstance(window, int) and window > 0))
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
    zeros at padded positions. A sliding-window layer (:func:`layer_window` of ``module`` and ``kwargs``) attends
    within its window (:func:`window_attention`)."""
    B, Hq, L, _ = query.shape
    kwargs.pop("is_causal", None)  # the mask was checked causal: so is each sequence's call
    window = layer_window(module, kwargs)
    out = query.new_zeros(B, L, Hq, value.shape[-1])
    for b, p in enumerate(pads):
        if p >= L:
            continue
        q, k, v = query[b : b + 1, :, p:], key[b : b + 1, :, p:], value[b : b + 1, :, p:]
        if window is not None:
            out[b, p:] = window_attention(module, q, k, v, window, dropout=dropout, scaling=scaling, **kwargs)
            continue
        o, _ = sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True, **kwargs)
        out[b, p:] = o[0]
    return out, None


def window_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    window: int,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> torch.Tensor:
    """Sliding-window causal attention of one unpadded sequence: ``query [1, Hq, n, D]``, ``key``/``value`` ``[1,
    Hkv, n, D]`` -> ``[n, Hq, D]``, query ``i`` attending keys ``i - window < j <= i``. The queries are cut into
    chunks of ``window``; chunk ``c`` attends the ``2 x window`` keys from ``c x window - window`` on (the keys
    left-padded by ``window`` zeros, never attended), all chunks in one SDPA call under one mask ``[chunks, 1,
    window, 2 x window]``."""
    kwargs.pop("sliding_window", None)
    _, Hq, n, D = query.shape
    W = C = int(window)
    chunks = -(-n // C)
    extra = chunks * C - n
    q = F.pad(query, (0, 0, 0, extra))[0].view(Hq, chunks, C, D).transpose(0, 1)  # [chunks, Hq, C, D]

    def windows(x: torch.Tensor) -> torch.Tensor:  # [1, H, n, d] -> [chunks, H, W + C, d]
        return F.pad(x, (0, 0, W, extra))[0].unfold(1, W + C, C).permute(1, 0, 3, 2)

    r = torch.arange(C, device=query.device).view(C, 1)
    s = torch.arange(W + C, device=query.device).view(1, W + C)
    start = torch.arange(chunks, device=query.device).view(chunks, 1, 1) * C - W  # the first key of each chunk
    mask = ((s > r) & (s <= r + W)).unsqueeze(0) & (start + s >= 0)  # key start + s of query c x C + r
    o, _ = sdpa_attention_forward(
        module, q, windows(key), windows(value), mask.unsqueeze(1), dropout=dropout, scaling=scaling, is_causal=False,
        **kwargs,
    )  # fmt: skip
    return o.reshape(chunks * C, Hq, -1)[:n]
