"""A left-padded batch's prefill run one sequence at a time (hf_sparse_kv.prefill) computes what the masked call
computes; it is taken only where the mask is causal left padding."""

import pytest
import torch
from tiny_models import DEVICE, tiny_model
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from evaluation.needle import greedy_batch, greedy_under_policies, pad_left
from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, prefill, unpatch_model
from hf_sparse_kv.cache import PagedLayer
from hf_sparse_kv.policies import Dense, Quest


def _prefill_logits(model, ids, mask, pos):
    patch_model(model, policy=Dense(), dense_layers=(0,), block_size=8)
    try:
        cache = PagedKVCache(model.config, block_size=8)
        with torch.no_grad():
            out = model(ids, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_kwarg(model): cache})
        k = [layer.dense_kv()[0] for layer in cache.layers if isinstance(layer, PagedLayer)]
        return out.logits, k
    finally:
        unpatch_model(model)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "mistral"])
def test_rows_equal_masked_prefill(arch, monkeypatch):
    """Logits at every real position and the stored keys equal the masked prefill's (float32, the row path forced
    on: on the CPU it is otherwise left to the masked call). Every layer takes it, the sliding-window ones (Gemma-3's
    local layers, Mistral's: a window of 24 over prompts of 41-70 tokens) within their window."""
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (70, 53, 64, 41)]
    ids, mask, pos = pad_left(prompts, DEVICE)
    masked, k_masked = _prefill_logits(model, ids, mask, pos)
    calls, windowed = [], []
    real, real_window = prefill.prefill_by_rows, prefill.window_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    def counted_window(*args, **kwargs):
        windowed.append(args[4])
        return real_window(*args, **kwargs)

    checks = []
    real_check = prefill.causal_left_padded

    def counted_check(*args, **kwargs):
        checks.append(kwargs.get("window"))
        return real_check(*args, **kwargs)

    monkeypatch.setattr(prefill, "flash_dtype", lambda q: True)
    monkeypatch.setattr(prefill, "causal_left_padded", counted_check)
    monkeypatch.setattr(prefill, "window_attention", counted_window)
    monkeypatch.setattr("hf_sparse_kv.attention.prefill_by_rows", counted)
    rows, k_rows = _prefill_logits(model, ids, mask, pos)
    layers = model.config.num_hidden_layers
    sliding = {"gemma3": layers // 2, "mistral": layers}.get(arch, 0)
    assert len(calls) == layers  # the row path ran on every layer
    assert len(windowed) == sliding * len(prompts) and set(windowed) <= {24}  # each sliding layer's rows windowed
    # each mask checked once for the forward (the full one, the sliding one), its verdict reused by the other layers
    assert sorted(checks, key=str) == sorted({None if sliding < layers else 24, 24 if sliding else None}, key=str)
    real_pos = mask.bool()
    # 1e-4: the CPU's float32 GEMMs are not bitwise reproducible across allocations (layer 0's keys, which no
    # attention path touches, came out up to 7e-5 apart in ~1 run of 8); a wrong mask or window moves them by O(1)
    torch.testing.assert_close(rows[real_pos], masked[real_pos], rtol=1e-4, atol=1e-4)
    for a, b in zip(k_rows, k_masked):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_rows_batch_equals_one_at_a_time(monkeypatch):
    """The needle runner's padded batch, prefilled by rows, answers as each prompt alone."""
    monkeypatch.setattr(prefill, "flash_dtype", lambda q: True)
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (120, 97, 111)]
    policies = {"dense": Dense(), "quest": Quest(budget=0.25, sink=4, window=16)}
    batched = greedy_batch(model, prompts, policies, 5, dense_layers=(0,), block_size=8, mode="block")
    for p, got in zip(prompts, batched):
        assert got == greedy_under_policies(model, torch.tensor([p], device=DEVICE), policies, 5, (0,), 8, "block")


def _causal(B, L, pads):
    i = torch.arange(L).view(1, 1, L, 1)
    j = torch.arange(L).view(1, 1, 1, L)
    pad = torch.tensor(pads).view(B, 1, 1, 1)
    return (j <= i) & (j >= pad)


def test_causal_left_padded_checks_every_real_row(monkeypatch):
    monkeypatch.setattr(prefill, "CHECK_ROWS", 3)  # several chunks
    pads = [0, 2, 5]
    m = _causal(3, 9, pads)
    assert prefill.causal_left_padded(m, pads)
    additive = torch.zeros(m.shape).masked_fill(~m, torch.finfo(torch.float32).min)
    assert prefill.causal_left_padded(additive, pads)
    odd = m.clone()
    odd[1, 0, 1] = True  # a padded query's row: not looked at
    assert prefill.causal_left_padded(odd, pads)
    # a real query seeing the future, missing a key, seeing a padded key
    for b, i, j, v in ((2, 6, 8, True), (0, 4, 3, False), (1, 5, 0, True)):
        bad = m.clone()
        bad[b, 0, i, j] = v
        assert not prefill.causal_left_padded(bad, pads)
    window = m & (torch.arange(9).view(1, 1, 9, 1) - torch.arange(9).view(1, 1, 1, 9) < 4)
    assert not prefill.causal_left_padded(window, pads)  # a sliding window is not plain causal
    assert prefill.causal_left_padded(window, pads, window=4)  # but is that window
    assert not prefill.causal_left_padded(window, pads, window=3) and not prefill.causal_left_padded(m, pads, window=4)
    assert not prefill.causal_left_padded(m, [0, 2])  # pads of another batch
    assert not prefill.causal_left_padded(m[:, :, 1:], pads)  # keys beyond the queries (a later chunk)


def test_rows_apply_refuses_what_it_cannot_compute(monkeypatch):
    monkeypatch.setattr(prefill, "flash_dtype", lambda q: True)
    module = torch.nn.Module()
    q, k = torch.zeros(2, 4, 6, 8), torch.zeros(2, 2, 6, 8)
    m = _causal(2, 6, [0, 3])
    assert prefill.rows_apply(module, q, k, m, [0, 3])
    assert not prefill.rows_apply(module, q, k, m, [0, 0])  # no padding: the masked call is SDPA's own fast path
    assert not prefill.rows_apply(module, q, k, None, [0, 3])
    assert not prefill.rows_apply(module, q, k, m, [0, 3], sliding_window=4)  # a causal mask, a windowed layer
    window = m & (torch.arange(6).view(1, 1, 6, 1) - torch.arange(6).view(1, 1, 1, 6) < 4)
    assert prefill.rows_apply(module, q, k, window, [0, 3], sliding_window=4)  # the layer's window: by rows
    module.sliding_window = 4
    assert not prefill.rows_apply(module, q, k, m, [0, 3])
    assert prefill.rows_apply(module, q, k, window, [0, 3])
    assert not prefill.rows_apply(module, q, k, window, [0, 3], sliding_window=3)  # the call's window first
    # a sliding layer without padding, or one prompt alone, still gets a mask from transformers: by rows too
    unpadded = _causal(2, 6, [0, 0]) & (torch.arange(6).view(1, 1, 6, 1) - torch.arange(6).view(1, 1, 1, 6) < 4)
    assert prefill.rows_apply(module, q, k, unpadded, [0, 0])
    assert prefill.rows_apply(module, q[:1], k[:1], unpadded[:1], [0])
    assert not prefill.rows_apply(module, q, k, unpadded, [0, 1])  # the mask of other pads
    module.sliding_window = None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not prefill.rows_apply(torch.nn.Module(), q, k, m, [0, 3])  # inside a trace: the masked call
    monkeypatch.undo()
    assert not prefill.flash_dtype(q) and not prefill.rows_apply(torch.nn.Module(), q, k, m, [0, 3])


def test_mask_verdict_is_kept_while_the_mask_lives_unchanged():
    from hf_sparse_kv.runtime import DecodeSession

    session, seen = DecodeSession(), []

    def check(mask, pads):
        seen.append(tuple(pads))
        return True

    m = _causal(2, 6, [0, 3])
    assert session.mask_verdict(m, [0, 3], check) and session.mask_verdict(m, [0, 3], check)
    assert len(seen) == 1
    session.mask_verdict(m, [0, 2], check)  # other pads
    m[0, 0, 0, 1] = True  # changed in place (its version moves)
    session.mask_verdict(m, [0, 2], check)
    session.mask_verdict(m.clone(), [0, 2], check)  # another tensor
    assert len(seen) == 4


@pytest.mark.parametrize("n, window", [(1, 4), (4, 4), (5, 4), (37, 8), (64, 16), (20, 64)])
def test_window_attention_equals_the_masked_call(n, window):
    """One sequence's chunked sliding-window attention equals SDPA under transformers' sliding-window mask (query
    ``i`` sees keys ``i - window < j <= i``), for lengths below, at and between multiples of the window, with grouped
    heads."""
    g = torch.Generator().manual_seed(n + window)
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    q = torch.randn(1, 4, n, 8, generator=g)
    k, v = torch.randn(2, 1, 2, n, 8, generator=g)
    i, j = torch.arange(n).view(n, 1), torch.arange(n).view(1, n)
    mask = ((j <= i) & (j > i - window)).view(1, 1, n, n)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    got = prefill.window_attention(module, q, k, v, window, scaling=0.3, sliding_window=window)
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-6)


def test_mask_verdict_keeps_one_verdict_per_tag():
    """Full and sliding-window layers alternate (Gemma-3): each of the two masks is checked once per forward."""
    from hf_sparse_kv.runtime import DecodeSession

    session, seen = DecodeSession(), []

    def check(mask, pads):
        seen.append(mask.shape)
        return True

    full, local = _causal(2, 6, [0, 3]), _causal(2, 6, [0, 3]).clone()
    for _ in range(3):
        session.mask_verdict(full, [0, 3], check, tag=None)
        session.mask_verdict(local, [0, 3], check, tag=4)
    assert len(seen) == 2


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
@pytest.mark.parametrize("lengths", [(60, 60), (57,)])
def test_sliding_layers_by_rows_without_padding(arch, lengths, monkeypatch):
    """Equal-length prompts and one prompt alone: transformers still masks the sliding-window layers (the full ones
    take SDPA's unmasked causal path), so those take the windowed rows, with the masked prefill's logits."""
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in lengths]
    ids, mask, pos = pad_left(prompts, DEVICE)
    masked, k_masked = _prefill_logits(model, ids, mask, pos)
    windowed, real_window = [], prefill.window_attention

    def counted_window(*args, **kwargs):
        windowed.append(1)
        return real_window(*args, **kwargs)

    monkeypatch.setattr(prefill, "flash_dtype", lambda q: True)
    monkeypatch.setattr(prefill, "window_attention", counted_window)
    rows, k_rows = _prefill_logits(model, ids, mask, pos)
    layers = model.config.num_hidden_layers
    assert len(windowed) == (layers // 2 if arch == "gemma3" else layers) * len(prompts)
    torch.testing.assert_close(rows, masked, rtol=1e-4, atol=1e-4)  # 1e-4: as in test_rows_equal_masked_prefill
    for a, b in zip(k_rows, k_masked):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
