"""``patch_model`` on vision-language models (tiny random configs, nothing downloaded), prompts holding an image:
Gemma-3 (SigLIP tower, sliding and global layers, bidirectional image tokens), Llava (CLIP tower) and Qwen2.5-VL
(multimodal rotary positions: ``generate()`` passes position ids of shape ``[4, B, 1]``, the text axis shifted by the
image). The vision tower keeps its own attention; the language model's layers are paged. Each patched Dense gives the
unpatched greedy tokens, a sparse policy reads less than Dense, unpatching restores the model, and the static decode
steps that ``cuda_graph=True`` captures on a GPU (on the CPU run uncaptured, as the CPU tests of the graph path do;
``HF_SPARSE_KV_TEST_DEVICE=cuda`` captures and replays them) give the eager steps' logits."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers as T
from tiny_models import DEVICE, static_steps_anywhere

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.graphs import DecodeGraphs
from hf_sparse_kv.policies import Dense, Quest

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
IMAGE = 299  # the image token of every config below
BACKEND = "reference" if DEVICE.type == "cpu" else "auto"  # the reference ops cannot be captured on a GPU
LENGTH = 150


def _ids(at: int, count: int) -> torch.Tensor:
    ids = torch.randint(3, 290, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    ids[0, at : at + count] = IMAGE
    return ids


def gemma3() -> tuple[torch.nn.Module, dict]:
    text = T.Gemma3TextConfig(**TEXT, sliding_window=64, layer_types=["sliding_attention", "full_attention"])
    vision = T.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8
    )
    config = T.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=IMAGE, boi_token_index=297,
        eoi_token_index=298,
    )  # fmt: skip
    ids = _ids(10, 4)
    inputs = {"pixel_values": torch.randn(1, 3, 32, 32), "token_type_ids": (ids == IMAGE).long()}
    return T.Gemma3ForConditionalGeneration(config), {"input_ids": ids, **inputs}


def llava() -> tuple[torch.nn.Module, dict]:
    vision = T.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8,
        projection_dim=32,
    )  # fmt: skip
    config = T.LlavaConfig(
        text_config=T.LlamaConfig(**TEXT), vision_config=vision, image_token_index=IMAGE, image_seq_length=16,
        vision_feature_layer=-1,
    )  # fmt: skip
    return T.LlavaForConditionalGeneration(config), {
        "input_ids": _ids(10, 16),
        "pixel_values": torch.randn(1, 3, 32, 32),
    }


def qwen2_5_vl() -> tuple[torch.nn.Module, dict]:
    text = {**TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    vision = {
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64, "patch_size": 4,
        "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 8, "fullatt_block_indexes": [1],
    }  # fmt: skip
    config = T.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=298, vision_start_token_id=297
    )
    ids = _ids(10, 4)  # one image of 1 x 4 x 4 patches, merged 2 x 2: 4 tokens after its start token
    ids[0, 9] = 297
    inputs = {"pixel_values": torch.randn(16, 3 * 2 * 4 * 4), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    return T.Qwen2_5_VLForConditionalGeneration(config), {"input_ids": ids, **inputs}


MODELS = {"gemma3": gemma3, "llava": llava, "qwen2_5_vl": qwen2_5_vl}


def build(name: str) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    inputs = {**inputs, "attention_mask": torch.ones_like(inputs["input_ids"])}
    return model.eval().to(DEVICE), {k: v.to(DEVICE) for k, v in inputs.items()}


def generate(model, inputs: dict, **kw):
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, **kw
        )
    return out.sequences, torch.stack(out.logits), out.past_key_values


@pytest.mark.parametrize("name", sorted(MODELS))
def test_dense_is_the_model_and_a_sparse_policy_reads_less(name):
    model, inputs = build(name)
    want, _, _ = generate(model, inputs)
    reads = {}
    for policy in (Dense(), Quest(budget=32, sink=4, window=16)):
        patch_model(model, policy=policy, block_size=16, backend=BACKEND, dense_layers=())
        cache = PagedKVCache(model.config, block_size=16, backend=BACKEND)
        tokens, _, _ = generate(model, inputs, **{cache_kwarg(model): cache})
        if isinstance(policy, Dense):
            assert torch.equal(tokens, want), f"{name}: patched Dense changed the tokens"
        assert cache.decode_steps == 7 and cache.blocks_in_use > 0
        reads[type(policy).__name__] = cache.kv_bytes_read
        unpatch_model(model)
    assert 0 < reads["Quest"] < reads["Dense"], reads
    assert torch.equal(generate(model, inputs)[0], want), f"{name}: unpatching did not restore the model"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_static_steps_of_cuda_graph_give_the_eager_steps(name, monkeypatch):
    model, inputs = build(name)
    static_steps_anywhere(monkeypatch)
    for policy in (Dense(), Quest(budget=32, sink=4, window=16)):
        patch_model(model, policy=policy, block_size=16, backend=BACKEND, dense_layers=())
        tokens, logits, _ = generate(model, inputs)
        unpatch_model(model)
        on_cpu = pytest.warns(UserWarning, match="not on a CUDA device") if DEVICE.type == "cpu" else None
        with on_cpu or contextlib.nullcontext():
            patch_model(
                model, policy=policy, block_size=16, backend=BACKEND, dense_layers=(), cuda_graph=True,
                merge_projections=False,
            )  # fmt: skip
        static_tokens, static_logits, cache = generate(model, inputs)
        unpatch_model(model)
        runner = cache.session.graphs
        assert isinstance(runner, DecodeGraphs), f"{name}: the steps did not run statically"
        assert runner.replays > 0 or DEVICE.type == "cpu", f"{name}: no step replayed a CUDA graph"
        assert torch.equal(static_tokens, tokens), f"{name} {type(policy).__name__}: static steps changed the tokens"
        torch.testing.assert_close(static_logits, logits, rtol=1e-5, atol=1e-5)
