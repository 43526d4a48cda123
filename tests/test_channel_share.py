"""evaluation.channel_share: the kept channels' share of q . k, the correlation and top-1/16 recall it gives, on
constructed inputs whose answers are known, and on tiny models (only the full-attention layers are measured)."""

import pytest
import torch
from tiny_models import prompt, tiny_model

from evaluation.channel_share import channel_share, measure, record_at
from evaluation.simulate import full_attention_layers

pytestmark = pytest.mark.usefixtures("one_thread")


def test_queries_living_on_the_kept_channels_lose_nothing():
    g = torch.Generator().manual_seed(0)
    Hq, Hkv, N, D, r = 4, 2, 96, 16, 4
    q = torch.zeros(Hq, N, D)
    q[..., :r] = torch.randn(Hq, N, r, generator=g) * 3 + 1  # |q| largest (and only nonzero) on the first r channels
    k = torch.randn(Hkv, N, D, generator=g)
    out = channel_share(q, k, r, queries=16)
    assert out["share"] == pytest.approx(1.0) and out["corr"] == pytest.approx(1.0, abs=1e-5)
    assert out["recall"] == pytest.approx(1.0)
    every = channel_share(torch.randn(Hq, N, D, generator=g), k, D, queries=16)
    assert every["share"] == pytest.approx(1.0) and every["recall"] == pytest.approx(1.0)


def test_few_channels_of_spread_queries_carry_little():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(4, 128, 64, generator=g), torch.randn(2, 128, 64, generator=g)
    few, half = channel_share(q, k, 4, queries=32), channel_share(q, k, 32, queries=32)
    assert 0 < few["share"] < half["share"] < 1 and few["corr"] < half["corr"] < 1 and few["recall"] < 1
    with pytest.raises(ValueError, match="queries"):
        channel_share(q, k, 4, queries=128)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_measure_covers_the_full_attention_layers(arch):
    model = tiny_model(arch)
    layers = sorted(full_attention_layers(model.config))
    assert layers == ([1, 3] if arch == "gemma3" else [0, 1, 2])
    rows = measure(model, prompt(48), [0.25, 0.5], queries=8)
    assert [r["layer"] for r in rows] == [x for x in layers for _ in range(2)]
    assert all(0 < r["share"] <= 1 + 1e-6 and -1 <= r["corr"] <= 1 + 1e-6 and 0 <= r["recall"] <= 1 for r in rows)
    assert {r["channels"] for r in rows} == {4, 8} and {r["of"] for r in rows} == {16}


def test_queries_and_keys_are_recorded_before_rope_and_qk_norm():
    """``projection``: ``q_proj`` / ``k_proj`` outputs as heads; ``norm``: Gemma-3's ``q_norm`` / ``k_norm`` outputs;
    ``attention``: after both, with RoPE: the same shapes; position 0 (rotated by angle 0) is the same before and
    after RoPE, a later one differs."""
    ids = prompt(24)
    llama = tiny_model("llama")
    proj, seen = record_at(llama, ids, "projection"), record_at(llama, ids, "attention")
    layer = llama.model.layers[1].self_attn
    q_heads, D = llama.config.num_attention_heads, layer.head_dim
    assert proj[1][0].shape == seen[1][0].shape == (q_heads, 24, D)
    assert proj[1][1].shape == seen[1][1].shape == (llama.config.num_key_value_heads, 24, D)
    torch.testing.assert_close(proj[1][1][:, 0], seen[1][1][:, 0])
    assert not torch.allclose(proj[1][1][:, 5], seen[1][1][:, 5])
    with pytest.raises(ValueError, match="no q_norm"):
        record_at(llama, ids, "norm")
    with pytest.raises(ValueError, match="at must be"):
        record_at(llama, ids, "nowhere")
    gemma = tiny_model("gemma3")
    normed, attended = record_at(gemma, ids, "norm"), record_at(gemma, ids, "attention")
    assert normed[1][0].shape == attended[1][0].shape
    torch.testing.assert_close(normed[1][0][:, 0], attended[1][0][:, 0])  # RoPE at position 0 is the identity
    rows = measure(gemma, ids, [0.5], queries=8, at="norm")
    assert {r["at"] for r in rows} == {"norm"} and [r["layer"] for r in rows] == [1, 3]
