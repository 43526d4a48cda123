"""``patch_model`` on the causal LMs of the installed transformers beyond the five the other tests build (tiny random
configs, nothing downloaded): README's "Loading a model" list, checked in CI. Each patched Dense gives the unpatched
greedy tokens, with its projections merged or not; a sparse policy's decode steps run; unpatching restores the
model. Models the kernels would compute wrongly, or that do not route their attention through transformers'
``AttentionInterface``, are refused with a ``TypeError`` that says why, and left as they were; those whose attention
is given something else than what the paged cache returned (a fact only a forward shows) are refused at their first
forward with a ``NotImplementedError``, and unpatching restores them."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_sparse_kv import patch_model, unpatch_model
from hf_sparse_kv.policies import Dense, Quest

SMALL = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 1,
}
# transformers' names without "Config" / "ForCausalLM"; those a given version lacks are skipped
PATCHED = (
    "Phi3", "Phi", "Granite", "GraniteMoe", "Olmo", "Olmo2", "Olmo3", "Cohere", "Cohere2", "Starcoder2", "Mixtral",
    "Qwen2Moe", "Qwen3Moe", "Gemma", "Glm", "Glm4", "Helium", "SmolLM3", "Exaone4", "Ernie4_5", "Apertus", "Arcee",
    "Ministral", "Nemotron", "Persimmon", "GPTNeoX", "Lfm2",
    # added 2026-12-05 from a scan of transformers 5.25's 178 causal LMs (tiny configs; patched Dense equal, Quest ran)
    "Olmoe", "Phimoe", "Glm4Moe", "Ernie4_5_Moe", "HunYuanDenseV1", "HunYuanMoEV1", "SeedOss", "GPTBigCode", "OPT",
    "Jais2", "BitNet", "Cwm", "FlexOlmo", "Cohere2Moe", "MiniMaxM2", "Ministral3", "AriaText", "Afmoe",
    "GraniteMoeShared", "ExaoneMoe",
)  # fmt: skip
REFUSED = {
    "StableLm": "AttentionInterface",
    "Gemma2": "soft-caps",
    "GptOss": "sink",
    "Falcon": "AttentionInterface",
    "MiniCPM3": "latent attention",  # its cache holds compressed latents, expanded after reading
    "DeepseekV2": "latent attention",
    "Mistral4": "latent attention",
    "MiniMax": "cache of its own",
}
# multi-head latent attention at a tiny size (the defaults are DeepSeek-V3's widths)
MLA = {"qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 32, "q_lora_rank": 32,
       "num_key_value_heads": 4, "head_dim": 24, "n_routed_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1}  # fmt: skip
CONFIGS = {"MiniCPM3": MLA, "DeepseekV2": MLA, "Mistral4": MLA, "MiniMax": {"num_hidden_layers": 8}}
# patched without complaint, but each forward gives the attention other keys / values than the cache returned:
# DiffLlama halves of the values, JetMoe its KV heads tiled, HrmText another layer's cache slot; Doge a mask of its own
# built from the new token's values only
AT_FIRST_FORWARD = {
    "DiffLlama": "other keys or values",
    "JetMoe": "other keys or values",
    "HrmText": "other keys or values",
    "Doge": "builds its own mask",
}


def build(name: str) -> torch.nn.Module:
    """A tiny ``name`` causal LM (eval, float32), or a skip where this transformers has none."""
    config_cls = getattr(transformers, f"{name}Config", None)
    model_cls = getattr(transformers, f"{name}ForCausalLM", None)
    if config_cls is None or model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}ForCausalLM")
    config = config_cls(**{**SMALL, **CONFIGS.get(name, {})})
    if hasattr(config, "head_dim") and name not in CONFIGS:  # some default it to 128 or None; 64 / 4 heads
        try:
            config.head_dim = 16
        except AttributeError:  # derived from the hidden size
            pass
    torch.manual_seed(0)
    return model_cls(config).eval()


def greedy(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)


@pytest.mark.parametrize("name", PATCHED)
def test_dense_is_the_model_and_a_sparse_policy_runs(name):
    model = build(name)
    ids = torch.randint(2, SMALL["vocab_size"], (1, 150), generator=torch.Generator().manual_seed(1))
    want = greedy(model, ids)
    for merge in (False, True):
        patch_model(model, policy=Dense(), block_size=16, backend="reference", merge_projections=merge)
        assert torch.equal(greedy(model, ids), want), f"{name}: patched Dense (merged: {merge}) changed the tokens"
        unpatch_model(model)
    patch_model(model, policy=Quest(budget=48, sink=4, window=16), block_size=16, backend="reference")
    sparse = greedy(model, ids)
    assert sparse.shape == want.shape and torch.equal(sparse[:, :150], ids)
    unpatch_model(model)
    assert torch.equal(greedy(model, ids), want), f"{name}: unpatching did not restore the model"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_model_the_kernels_cannot_serve_is_refused_and_left_alone(name):
    model = build(name)
    ids = torch.randint(2, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(2))
    want = greedy(model, ids)
    with pytest.raises(TypeError, match=REFUSED[name]):
        patch_model(model, policy=Quest(budget=48), block_size=16, backend="reference")
    assert torch.equal(greedy(model, ids), want)


@pytest.mark.parametrize("name", sorted(AT_FIRST_FORWARD))
def test_an_attention_given_other_keys_than_the_cache_returned_is_refused_at_its_first_forward(name):
    """Without the refusal these models decoded silently wrong (patched Dense's logits 1e-3 to 1e-2 from the
    unpatched ones at every decode step, against 1e-7 for Llama) or failed with an unrelated message."""
    model = build(name)
    ids = torch.randint(2, SMALL["vocab_size"], (1, 150), generator=torch.Generator().manual_seed(3))
    want = greedy(model, ids)
    for policy in (Dense(), Quest(budget=48, sink=4, window=16)):
        patch_model(model, policy=policy, block_size=16, backend="reference")
        with pytest.raises(NotImplementedError, match=AT_FIRST_FORWARD[name]):
            greedy(model, ids)
        unpatch_model(model)
    assert torch.equal(greedy(model, ids), want)


def test_the_scan_behind_these_lists_reports_each_outcome():
    """``tests/scan_architectures.py`` (README's command), one class per outcome, each in its own process."""
    from scan_architectures import one

    outcomes = {name: one(name).split("\t")[1] for name in ("Llama", "DiffLlama", "Gemma2")}
    assert outcomes == {"Llama": "ok", "DiffLlama": "first-forward", "Gemma2": "refused"}
