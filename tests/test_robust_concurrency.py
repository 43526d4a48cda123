"""Several models in one process: patched models with different policies, modes and block sizes do not interfere,
whether their generate() calls, their decode steps or two threads interleave; an unpatched model stays bit-exact."""

from __future__ import annotations

import threading

import pytest
import torch
from tiny_models import COMMON, greedy, prompt, tiny_model
from transformers import LlamaConfig, LlamaForCausalLM

from hf_sparse_kv import PagedKVCache, cache_kwarg, is_patched, patch_model, unpatch_model
from hf_sparse_kv.policies import Dense, Quest, SinkWindow, TokenTopK

NEW = 10
SETTINGS = {  # name: (architecture, patch_model arguments)
    "a": ("llama", {"policy": Quest(budget=16, sink=2, window=8), "mode": "block", "dense_layers": (), "block_size": 8}),
    "b": ("llama", {"policy": TokenTopK(budget=12, sink=2, window=4), "mode": "token", "dense_layers": (0,),
                    "block_size": 16}),
    "c": ("gemma3", {"policy": SinkWindow(sink=2, window=9), "mode": "mask", "dense_layers": (), "block_size": 8}),
    "u": ("qwen2", None),  # never patched
}  # fmt: skip
PROMPTS = [prompt(n, batch=b, seed=n) for n, b in ((33, 1), (41, 2), (27, 3), (50, 1))]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def solo():
    """Each model's outputs on every prompt, computed while it is the only patched model in the process."""
    models = {name: tiny_model(arch, seed=i) for i, (name, (arch, _)) in enumerate(SETTINGS.items())}
    refs = {}
    for name, model in models.items():
        kw = SETTINGS[name][1]
        if kw:
            patch_model(model, **kw)
        refs[name] = [greedy(model, ids, new_tokens=NEW) for ids in PROMPTS]
        if kw:
            unpatch_model(model)
    return models, refs


def patch_all(models):
    for name, model in models.items():
        if SETTINGS[name][1]:
            patch_model(model, **SETTINGS[name][1])


def unpatch_all(models):
    for model in models.values():
        unpatch_model(model)


def same(got, ref, exact=False):
    assert torch.equal(got[0], ref[0])
    if exact:
        assert torch.equal(got[1], ref[1])
    else:
        torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-6)


def test_interleaved_generate_calls(solo):
    models, refs = solo
    patch_all(models)
    caches = {n: PagedKVCache(m.config, block_size=SETTINGS[n][1]["block_size"]) for n, m in models.items() if n != "u"}
    try:
        for round_ in range(2):  # round 0: generate builds the caches; round 1: each model reuses its own
            for i, ids in enumerate(PROMPTS):
                for name, model in models.items():
                    kw = {cache_kwarg(model): caches[name]} if round_ and name in caches else {}
                    same(greedy(model, ids, new_tokens=NEW, **kw), refs[name][i], exact=True)
                    if kw:
                        caches[name].reset()
    finally:
        unpatch_all(models)


def decode_loop_steps(model, ids, cache):
    """A manual greedy loop, one forward per yield: yields the logits of each step."""
    with torch.no_grad():
        kw = {cache_kwarg(model): cache} if cache is not None else {"use_cache": True}
        out = model(ids, **kw)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        for _ in range(NEW):
            logits = out.logits[:, -1]
            yield logits
            out = model(logits.argmax(-1, keepdim=True), **{cache_kwarg(model): cache})


def test_interleaved_decode_steps(solo):
    """Forward calls of three patched models and an unpatched one alternate step by step; each model's logits are
    those of its own loop run alone."""
    models, _ = solo
    ids = PROMPTS[1]
    patch_all(models)
    try:
        alone = {n: torch.stack(list(decode_loop_steps(m, ids, None))) for n, m in models.items()}
        loops = {n: decode_loop_steps(m, ids, None) for n, m in models.items()}
        mixed = {n: [] for n in models}
        for _ in range(NEW):
            for name in ("a", "u", "b", "c"):
                mixed[name].append(next(loops[name]))
        for name in models:
            assert torch.equal(torch.stack(mixed[name]), alone[name]), name
    finally:
        unpatch_all(models)


def test_two_threads(solo):
    """Two patched models generate at the same time from two threads (torch releases the GIL inside ops)."""
    models, refs = solo
    patch_all(models)
    results, errors = {}, []

    def work(name):
        try:
            results[name] = [greedy(models[name], ids, new_tokens=NEW) for ids in PROMPTS for _ in range(2)]
        except Exception as e:  # noqa: BLE001 (asserted empty in the main thread)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in ("a", "b", "u")]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        unpatch_all(models)
    assert not errors, errors
    for name, outs in results.items():
        for j, out in enumerate(outs):
            same(out, refs[name][j // 2], exact=True)


def test_patching_leaves_other_models_bit_exact(solo):
    """An unpatched model is bit-exact while others are patched, repatched with another policy and unpatched."""
    models, refs = solo
    u = models["u"]
    for step in ("patch", "repatch", "unpatch"):
        if step == "patch":
            patch_all(models)
        elif step == "repatch":
            patch_model(models["a"], policy=Dense(), mode="mask", block_size=16)
        else:
            unpatch_all(models)
        assert not is_patched(u) and u.config._attn_implementation == "sdpa"
        for i, ids in enumerate(PROMPTS[:2]):
            same(greedy(u, ids, new_tokens=NEW), refs["u"][i], exact=True)
    # and the patched ones are back to their own unpatched selves
    for name in ("a", "b"):
        assert not is_patched(models[name])


# ----------------------------------------------------------------------------------- models sharing one config


def twins():
    """Two models of the same class built from one config object (``Model(config)`` twice)."""
    config = LlamaConfig(**COMMON)
    torch.manual_seed(0)
    m1 = LlamaForCausalLM(config).eval()
    torch.manual_seed(1)
    m2 = LlamaForCausalLM(config).eval()
    m1.set_attn_implementation("sdpa")
    assert m1.config is m2.config
    return m1, m2


def test_twin_unpatched_while_the_other_is_patched():
    m1, m2 = twins()
    ids = PROMPTS[1]
    ref = greedy(m2, ids, new_tokens=NEW)
    patch_model(m1, policy=Quest(budget=16, sink=0, window=8), dense_layers=(), block_size=8)
    same(greedy(m2, ids, new_tokens=NEW), ref, exact=True)
    unpatch_model(m1)
    same(greedy(m2, ids, new_tokens=NEW), ref, exact=True)


def test_twin_stays_patched_when_the_other_is_unpatched():
    m1, m2 = twins()
    ids = PROMPTS[1]
    ref = greedy(m2, ids, new_tokens=NEW)
    patch_model(m1, policy=Dense(), block_size=8)
    patch_model(m2, policy=Dense(), block_size=8)
    unpatch_model(m1)
    same(greedy(m2, ids, new_tokens=NEW), ref)


def test_attn_implementation_changed_on_a_patched_model():
    """``set_attn_implementation`` on a patched model: correct outputs or a clear error, never silent garbage."""
    model = tiny_model("llama")
    ids = PROMPTS[0]
    ref = greedy(model, ids, new_tokens=NEW)
    patch_model(model, policy=Dense(), block_size=8)
    model.set_attn_implementation("sdpa")
    try:
        got = greedy(model, ids, new_tokens=NEW)
    except (ValueError, RuntimeError) as e:
        assert "patch" in str(e), e
    else:
        same(got, ref)
