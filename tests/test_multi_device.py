"""A patched model dispatched by accelerate over several devices (``device_map``): each layer's pages live on the
device the layer runs on and the outputs equal the same model on one device. Needs CUDA (skipped in CI); the split
over two GPUs needs two. With a GPU present, accelerate offloads the layers mapped to "cpu" (weights kept in CPU
memory, run on the GPU), so their pages are on the GPU too."""

import pytest
import torch
from tiny_models import greedy, prompt, tiny_model

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.policies import Quest, SinkWindow, SnapKV

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

POLICIES = [
    Quest(budget=24, sink=4, window=8),
    SnapKV(budget=32, sink=4, window=8, observe=8, then=Quest(budget=16, sink=4, window=8)),
    SinkWindow(sink=4, window=16, evict=True),
]


def dispatched(tmp_path, devices: list):
    """The tiny Llama (4 layers) saved and loaded back with its layers spread over ``devices`` in turn."""
    from transformers import LlamaForCausalLM

    model = tiny_model("llama", num_hidden_layers=4).cpu()
    model.save_pretrained(tmp_path)
    device_map = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0]}
    device_map.update({f"model.layers.{i}": devices[i * len(devices) // 4] for i in range(4)})
    device_map.update({"model.norm": devices[-1], "lm_head": devices[-1]})
    return LlamaForCausalLM.from_pretrained(tmp_path, device_map=device_map, dtype=torch.float32).eval(), model


def two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    return [0, 1]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("split", ["cuda+cpu", "two gpus"])
def test_device_map_keeps_pages_on_each_layers_device_and_matches_one_device(tmp_path, split, policy):
    devices = [0, "cpu"] if split == "cuda+cpu" else two_gpus()
    torch.backends.cuda.matmul.allow_tf32 = False
    model, single = dispatched(tmp_path, devices)
    ids = prompt(70, batch=2).to("cuda:0")
    dense_layers = () if getattr(policy, "evict", False) else (0,)
    results = []
    for m in (single.to("cuda:0"), model):
        patch_model(m, policy=policy, mode="block", dense_layers=dense_layers, block_size=8)
        cache = PagedKVCache(m.config, block_size=8)
        results.append(greedy(m, ids, new_tokens=12, **{cache_kwarg(m): cache}))
        unpatch_model(m)
    for i, layer in enumerate(model.model.layers):
        hook = getattr(layer, "_hf_hook", None)  # accelerate runs a "cpu" (offloaded) layer on its execution device
        run_on = getattr(hook, "execution_device", None)
        expected = torch.device(run_on) if run_on is not None else next(layer.parameters()).device
        if isinstance(run_on, int):
            expected = torch.device("cuda", run_on)
        assert cache.layers[i].k_pool.device == expected and cache.layers[i].kmin.device == expected
    (ref_seqs, ref_scores), (seqs, scores) = results
    assert torch.equal(seqs.cpu(), ref_seqs.cpu())
    finite = ref_scores.isfinite()
    torch.testing.assert_close(scores.cpu()[finite.cpu()], ref_scores.cpu()[finite.cpu()], rtol=0, atol=1e-4)


def test_a_model_on_the_second_gpu_runs_its_kernels_there_and_captures_its_steps():
    """The whole model on ``cuda:1`` while ``cuda:0`` is the current device: every kernel of a decode step runs on
    ``cuda:1`` (Triton launches on the current device: the ops set their tensors' device first) and ``cuda_graph=True``
    captures the steps there (the runner's capture stream and pool on the model's device) and decodes the eager
    tokens."""
    two_gpus()
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.set_device(0)
    model = tiny_model("llama").to("cuda:1")
    ids = prompt(60).to("cuda:1")
    policy = Quest(budget=24, sink=4, window=8)
    patch_model(model, policy=policy, block_size=8, dense_layers=(0,))
    try:
        want, want_scores = greedy(model, ids, new_tokens=12)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            greedy(model, ids, new_tokens=3)
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        ours = [e for e in kernels if "kernel" in e.name and not e.name.startswith(("void", "at::"))]
        assert ours, "the profile saw no Triton kernel"
        assert {e.device_index for e in kernels} == {1}, sorted({(e.name, e.device_index) for e in kernels})
        patch_model(model, policy=policy, block_size=8, dense_layers=(0,), cuda_graph=True)
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, return_dict_in_generate=True,
                output_scores=True,
            )  # fmt: skip
        runner = out.past_key_values.session.graphs
        assert runner.replays > 0 and torch.cuda.current_device() == 0
        assert torch.equal(out.sequences, want)
        torch.testing.assert_close(torch.stack(out.scores), want_scores, rtol=0, atol=1e-4)
    finally:
        unpatch_model(model)
        torch.cuda.set_device(0)
