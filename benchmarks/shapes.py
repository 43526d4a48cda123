"""The shapes of the suite's models for benchmarks that build them with random weights (no model file, no hub): their
configs as their GGUF files give them (SmolLM2-135M-Instruct, Gemma-3-270M, Qwen2.5-Coder-1.5B-Instruct), and a tiny
one for the CPU. A decode step's time depends on the shapes, not on the weights' values.

``SHAPES[name]`` is the keyword arguments of ``transformers.AutoConfig.for_model`` plus ``"suite"``, the suite model
whose recipe goes with the shape (``hf-sparse-kv suite NAME``).
"""

from __future__ import annotations

import torch

SHAPES = {
    "smollm2": {
        "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
        "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "suite": "smollm2",
    },
    "gemma3": {
        "model_type": "gemma3_text", "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
        "max_position_embeddings": 32768, "sliding_window": 512, "query_pre_attn_scalar": 256,
        "tie_word_embeddings": True, "suite": "gemma3",
    },
    "qwen2.5": {
        "model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
        "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
        "rope_theta": 1e6, "tie_word_embeddings": True, "suite": "qwen2.5",
    },
    "tiny": {
        "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 4096,
        "rope_theta": 1e4, "tie_word_embeddings": True, "suite": "qwen2.5",
    },
}  # fmt: skip


def shape_config(shape: str):
    """The transformers config of ``SHAPES[shape]`` (SDPA attention)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(**{k: v for k, v in SHAPES[shape].items() if k != "suite"})
    config._attn_implementation = "sdpa"
    return config


def random_model(shape: str, dtype: torch.dtype, device: str):
    """A model of ``SHAPES[shape]`` with random weights (seed 0), SDPA attention as the suite loads it."""
    from transformers import AutoModelForCausalLM

    config = shape_config(shape)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs (1.5B random weights take minutes on a CPU)
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
