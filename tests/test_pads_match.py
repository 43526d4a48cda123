"""A captured decode step's mask check (``graphs.pads_match``: replay only when the mask pads as the prompt did) and
what tells ``generate()`` whether to build a 4-D mask for each step (``PagedKVCache.is_compileable``)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.masking_utils import causal_mask_function, sdpa_mask

from hf_sparse_kv import PagedKVCache
from hf_sparse_kv.graphs import pads_match

CONFIG = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)


def cache_padded(pads: list[int]) -> PagedKVCache:
    cache = PagedKVCache(CONFIG, block_size=8, backend="reference")
    cache.set_padding(pads)
    return cache


def mask2d(pads: list[int], length: int, dtype=torch.long) -> torch.Tensor:
    """A tokenizer's left-padded mask ``[B, length]``: 0 over each sequence's padding, 1 after it."""
    return (torch.arange(length) >= torch.tensor(pads).view(-1, 1)).to(dtype)


def mask4d(m2: torch.Tensor, additive: bool = False) -> torch.Tensor:
    """transformers' decode mask ``[B, 1, 1, L]`` of a 2-D mask (bool from sdpa_mask, or additive float)."""
    B, L = m2.shape
    m = sdpa_mask(B, 1, L, q_offset=L - 1, mask_function=causal_mask_function, attention_mask=m2.bool(),
                  allow_is_causal_skip=False)  # fmt: skip
    if not additive:
        return m
    return torch.zeros(m.shape).masked_fill(~m, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("pads", [[0, 0], [0, 3], [2, 5], [0, 7]])
@pytest.mark.parametrize("form", ["2d", "2d bool", "4d", "4d additive"])
def test_the_prompts_padding_matches(pads, form):
    length = 12
    m2 = mask2d(pads, length, torch.bool if form == "2d bool" else torch.long)
    mask = m2 if form.startswith("2d") else mask4d(m2, additive=form == "4d additive")
    cache = cache_padded(pads)
    assert pads_match(cache, mask, length)
    assert pads_match(cache, torch.cat([m2, torch.ones(2, 3, dtype=m2.dtype)], -1), length)  # longer: its start
    for other in ([1, pads[1]], [pads[0], pads[1] + 1], [pads[0], max(0, pads[1] - 1)]):
        if other != pads:
            assert not pads_match(cache_padded(other), mask, length), other


def test_holes_short_masks_and_no_mask():
    cache = cache_padded([0, 2])
    m = mask2d([0, 2], 10)
    holed = m.clone()
    holed[0, 4] = 0  # a hole inside the first sequence
    assert not pads_match(cache, holed, 10)
    assert not pads_match(cache, m[:, :9], 10)  # shorter than the step's length
    assert not pads_match(cache, m[:1], 10)  # another batch
    assert not pads_match(cache, None, 10)  # no mask: no padding, but the prompt had some
    assert pads_match(cache_padded([0, 0]), None, 10)
    assert pads_match(cache_padded([]), None, 10)


def test_generate_builds_no_4d_mask_for_captured_steps():
    """``is_compileable``: a cache reserved for static steps is, unless the patch's graphs run them (then
    ``generate()`` must not build a mask each step for a forward that never reads it); a cache whose graphs
    failed (``False``) runs static steps itself again."""
    cache = PagedKVCache(CONFIG, block_size=8, backend="reference", max_length=64)
    assert not cache.is_compileable
    assert PagedKVCache(CONFIG, block_size=8, backend="reference", max_length=64, static=True).is_compileable
    cache.update(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), 0)
    cache.reserve_static(64)
    assert cache.is_compileable
    cache.session.set_graphs(object())  # a runner replays the steps
    assert not cache.is_compileable
    cache.session.set_graphs(False)  # this cache cannot use one
    assert cache.is_compileable
