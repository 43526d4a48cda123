"""Tiny random-initialised models of each supported architecture (nothing downloaded), float32."""

from __future__ import annotations

import os

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from hf_sparse_kv.policies import Dense, OracleBlockTopK, QuantBlockTopK, Quest, SnapKV, TokenTopK

VOCAB = 96
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3")

# The model tests run on the CPU in CI; HF_SPARSE_KV_TEST_DEVICE=cuda runs them through the Triton kernels.
DEVICE = torch.device(os.environ.get("HF_SPARSE_KV_TEST_DEVICE", "cpu"))


def tiny_model(arch: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny ``arch`` causal LM in eval mode with the ``sdpa`` attention (the unpatched reference)."""
    torch.manual_seed(seed)
    kw = {**COMMON, **overrides}
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **kw))
    elif arch == "mistral":
        kw.setdefault("sliding_window", 24)
        model = MistralForCausalLM(MistralConfig(**kw))
    elif arch == "gemma3":
        kw.setdefault("num_hidden_layers", 4)
        kw["num_hidden_layers"] = max(kw["num_hidden_layers"], 4)
        types = ["sliding_attention", "full_attention"] * (kw["num_hidden_layers"] // 2)
        model = Gemma3ForCausalLM(
            Gemma3TextConfig(head_dim=16, sliding_window=24, layer_types=types, query_pre_attn_scalar=16, **kw)
        )
    else:
        raise ValueError(arch)
    model.config._attn_implementation = "sdpa"
    model.set_attn_implementation("sdpa")
    return model.to(DEVICE).eval()


def prompt(length: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g).to(DEVICE)


def static_steps_anywhere(monkeypatch) -> None:
    """Let ``cuda_graph=True``'s decode steps go through :class:`~hf_sparse_kv.graphs.DecodeGraphs` on any device (on
    the CPU, uncaptured): ``graphs.step_applies`` without its CUDA check (``graphs.static_step_applies``)."""
    from hf_sparse_kv import graphs

    monkeypatch.setattr(graphs, "step_applies", graphs.static_step_applies)


def greedy(model, input_ids, new_tokens: int = 32, **kw):
    """Greedy generate with scores: (sequences, stacked scores [steps, B, V])."""
    with torch.no_grad():
        out = model.generate(
            input_ids,
            max_new_tokens=new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            min_new_tokens=new_tokens,
            **kw,
        )
    return out.sequences, torch.stack(out.scores)


def batch_policies(quant4: bool = True) -> dict:
    """The policies the batched / static / slot decoding tests run side by side (budgets for ~150-token prompts in
    blocks of 8): dense, Quest, the oracle, TokenTopK, ``quant4`` (per-token state in the cache; ``quant4=False``
    leaves it out) and SnapKV (frees blocks once: its first step eager, then static steps of its own, no slot)."""
    policies = {
        "dense": Dense(),
        "quest": Quest(budget=0.25, sink=4, window=16),
        "oracle": OracleBlockTopK(budget=0.25, sink=4, window=16),
        "token": TokenTopK(budget=0.25, sink=4, window=16),
        "quant4": QuantBlockTopK(budget=0.25, sink=4, window=16, bits=4),
        "snapkv": SnapKV(budget=0.5, sink=4, window=16, observe=8),
    }
    if not quant4:
        del policies["quant4"]
    return policies
