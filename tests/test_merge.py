"""Merged projections (hf_sparse_kv.merge, ``patch_model(merge_projections=True)``): q/k/v and gate/up as one matmul
give the unmerged outputs eagerly, under a compiled static step (with fewer matmuls traced), and under autograd;
weight names, objects and memory are kept; a layer fed another input computes its own; what is not safe to merge
stays as it is; re-patching and unpatching restore the separate weights bit for bit; captured steps refuse a model
patched again under them."""

import contextlib
import warnings

import pytest
import torch
from tiny_models import ARCHS, DEVICE, greedy, prompt, tiny_model

import hf_sparse_kv.patch as patch_module
from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.graphs import DecodeGraphs
from hf_sparse_kv.merge import GROUPS, merge, unmerge
from hf_sparse_kv.patched import STATE_ATTR
from hf_sparse_kv.policies import Dense, Quest

pytestmark = pytest.mark.usefixtures("one_thread")


def _projections(model) -> dict[str, torch.nn.Linear]:
    names = {n for group in GROUPS for n in group}
    return {k: m for k, m in model.named_modules() if k.rsplit(".", 1)[-1] in names}


def _storages(model) -> set[int]:
    return {m.weight.untyped_storage().data_ptr() for m in _projections(model).values()}


@pytest.mark.parametrize("arch", ARCHS)
def test_merged_patch_generates_the_unmerged_tokens_and_unpatch_restores_every_weight(arch):
    model = tiny_model(arch)
    ids = prompt(40, batch=2)
    params = {k: (p, p.detach().clone()) for k, p in model.named_parameters()}
    patch_model(model, policy=Quest(budget=24, sink=4, window=8), block_size=8, dense_layers=(0,))
    ref_tokens, ref_scores = greedy(model, ids, new_tokens=8)
    n_proj = len(_projections(model))
    patch_model(
        model, policy=Quest(budget=24, sink=4, window=8), block_size=8, dense_layers=(0,), merge_projections=True
    )
    groups = getattr(model, STATE_ATTR).merged
    assert len(groups) == 2 * model.config.num_hidden_layers, "q/k/v and gate/up in every layer"
    assert len(_storages(model)) == len(groups), "each group's weights share one storage"
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(p is params[k][0] for k, p in model.named_parameters()), "the same Parameter objects"
    tokens, scores = greedy(model, ids, new_tokens=8)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(scores, ref_scores, rtol=0, atol=1e-5)
    unpatch_model(model)
    assert len(_storages(model)) == n_proj, "every projection its own storage again"
    for k, p in model.named_parameters():
        assert p is params[k][0] and torch.equal(p, params[k][1]), k
    assert all("forward" not in m.__dict__ for m in _projections(model).values())


def _linears(seen: list):
    """A compile backend recording, for each traced step, its calls of the ``decode_linear`` custom op and of the
    other linear ops (``F.linear``)."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        names = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        ours = sum("decode_linear" in t for t in names)
        seen.append((ours, sum("linear" in t for t in names) - ours))
        return aot_eager(gm, example_inputs)

    return backend


def _compiled_static_steps(model, ids, steps: int, seen: list) -> torch.Tensor:
    """Greedy logits ``[B, steps, V]`` of ``steps`` compiled static steps (:func:`_linears` recording into ``seen``)
    after a prefill of ``ids`` into a fresh cache."""
    cache, out = PagedKVCache(model.config, block_size=8), []
    with torch.no_grad():
        logits = model(ids, **{cache_kwarg(model): cache}).logits[:, -1:]
        runner = DecodeGraphs(model, cache, ids.shape[1] + steps, capture=False, compile={"backend": _linears(seen)})
        for _ in range(steps):
            logits = runner.step(logits.argmax(-1))
            out.append(logits)
    return torch.cat(out, 1)


@pytest.mark.parametrize("merged", [False, True])
def test_compiled_static_step_traces_one_matmul_per_group(merged):
    """A compiled static step of a merged model equals the unmerged eager steps and traces 4 matmuls a layer
    (qkv, o, gate_up, down) where the unmerged one traces 7."""
    torch._dynamo.reset()
    model = tiny_model("llama")
    ids, steps = prompt(37, batch=2), 6
    patch_model(model, policy=Quest(budget=24, sink=4, window=8), block_size=8, dense_layers=(0,))
    cache = PagedKVCache(model.config, block_size=8)
    ref = []
    with torch.no_grad():
        logits = model(ids, **{cache_kwarg(model): cache}).logits[:, -1:]
        for _ in range(steps):
            logits = model(logits.argmax(-1), **{cache_kwarg(model): cache}).logits
            ref.append(logits)
    patch_model(
        model, policy=Quest(budget=24, sink=4, window=8), block_size=8, dense_layers=(0,), merge_projections=merged
    )
    seen = []
    out = _compiled_static_steps(model, ids, steps, seen)
    torch.testing.assert_close(out, torch.cat(ref, 1), rtol=0, atol=1e-5)
    layers = model.config.num_hidden_layers
    assert seen and set(seen) == {(0, layers * (4 if merged else 7) + 1)}, seen  # + the LM head
    assert all(group.last is None for group in getattr(model, STATE_ATTR).merged), "nothing kept between steps"
    unpatch_model(model)


def test_gradients_reach_the_parameters_as_unmerged():
    model = tiny_model("qwen2")  # q/k/v with biases
    ids = prompt(12)
    model.zero_grad()
    model(ids).logits.square().mean().backward()
    ref = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    groups = merge(model)
    model(ids).logits.square().mean().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[k], rtol=1e-5, atol=1e-6, msg=k)
    unmerge(groups)


class _Cross(torch.nn.Module):
    """Calls q_proj on one input and k_proj / v_proj on another, then q_proj twice on the same input."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(8, n, bias=False) for n in (8, 4, 4))

    def forward(self, x, y):
        return self.q_proj(x), self.k_proj(y), self.v_proj(y), self.q_proj(x), self.q_proj(x)


def test_a_layer_fed_another_input_computes_its_own():
    torch.manual_seed(0)
    module = _Cross().eval()
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    with torch.no_grad():
        ref = module(x, y)
        groups = merge(module)
        assert len(groups) == 1
        got = module(x, y)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    unmerge(groups)


class _Hooked(torch.nn.Module):
    def __init__(self, linear=torch.nn.Linear):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (linear(8, 8) for _ in range(3))


class _Sub(torch.nn.Linear):
    pass


def test_what_is_not_plainly_safe_is_left_alone():
    torch.manual_seed(0)
    cases = [_Hooked(_Sub), _Hooked(), _Hooked(), _Hooked()]
    cases[1].k_proj.register_forward_hook(lambda *a: None)
    cases[2].v_proj.to(torch.float64)
    cases[3].v_proj.bias = None
    for module in cases:
        before = [m.weight.untyped_storage().data_ptr() for m in (module.q_proj, module.k_proj, module.v_proj)]
        assert merge(module) == []
        assert [m.weight.untyped_storage().data_ptr() for m in (module.q_proj, module.k_proj, module.v_proj)] == before


def test_repatching_keeps_or_undoes_the_merge_and_a_refused_patch_changes_nothing():
    model = tiny_model("llama")
    n_proj = len(_projections(model))
    patch_model(model, policy=Dense(), merge_projections=True)
    groups = getattr(model, STATE_ATTR).merged
    patch_model(model, policy=Quest(budget=48), merge_projections=True)
    assert getattr(model, STATE_ATTR).merged is groups, "kept, not merged twice"
    with pytest.raises(ValueError):
        patch_model(model, policy=Dense(), mode="nope", merge_projections=False)
    assert getattr(model, STATE_ATTR).merged is groups and len(_storages(model)) == len(groups)
    with pytest.raises(TypeError, match="merge_projections"):
        patch_model(model, merge_projections="yes")
    patch_model(model, policy=Dense(), merge_projections=False)
    assert getattr(model, STATE_ATTR).merged == [] and len(_storages(model)) == n_proj
    unpatch_model(model)


def test_merging_is_the_default_with_cuda_graph_only():
    """``merge_projections=None`` (the default) merges with ``cuda_graph=True`` and not without; an explicit value
    wins either way."""
    model = tiny_model("llama")
    n_proj = len(_projections(model))

    @contextlib.contextmanager
    def eager_warning():  # a CPU model: captured steps fall back to eager ones, with a warning; a CUDA model: none
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            yield
        eager = [w for w in seen if issubclass(w.category, UserWarning) and "eager" in str(w.message)]
        assert bool(eager) == (model.device.type == "cpu"), [str(w.message) for w in seen]

    with eager_warning():
        patch_model(model, policy=Dense(), cuda_graph=True)
    assert getattr(model, STATE_ATTR).merged and len(_storages(model)) < n_proj
    patch_model(model, policy=Dense())
    assert getattr(model, STATE_ATTR).merged == [] and len(_storages(model)) == n_proj
    with eager_warning():
        patch_model(model, policy=Dense(), cuda_graph=True, merge_projections=False)
    assert getattr(model, STATE_ATTR).merged == []
    patch_model(model, policy=Dense(), merge_projections=True)
    assert getattr(model, STATE_ATTR).merged
    unpatch_model(model)
    assert len(_storages(model)) == n_proj


def test_a_patch_failing_after_merging_unmerges(monkeypatch):
    model = tiny_model("llama")
    n_proj = len(_projections(model))

    def boom(model, kernel=False):
        groups = merge(model, kernel)
        unmerge(groups)  # what merge() itself does when it fails half-way
        raise RuntimeError("boom")

    monkeypatch.setattr(patch_module, "merge", boom)
    with pytest.raises(RuntimeError, match="boom"):
        patch_model(model, merge_projections=True)
    assert not hasattr(model, STATE_ATTR) and len(_storages(model)) == n_proj
    assert model.config._attn_implementation == "sdpa"


def test_save_pretrained_of_a_merged_model_loads_back(tmp_path):
    model = tiny_model("llama")
    ids = prompt(10)
    patch_model(model, merge_projections=True)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).to(model.device).eval()
    loaded.set_attn_implementation("sdpa")
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
    unpatch_model(model)


def test_static_steps_refuse_a_model_patched_again_under_them():
    model = tiny_model("llama")
    ids = prompt(20)
    patch_model(model, policy=Quest(budget=48, sink=4, window=8), block_size=8)
    cache = PagedKVCache(model.config, block_size=8)
    with torch.no_grad():
        logits = model(ids, **{cache_kwarg(model): cache}).logits[:, -1:]
        runner = DecodeGraphs(model, cache, 30, capture=False)
        runner.step(logits.argmax(-1))
        patch_model(model, policy=Quest(budget=48, sink=4, window=8), block_size=8, merge_projections=True)
        length = cache.get_seq_length()
        with pytest.raises(RuntimeError, match="patched again"):
            runner.step(logits.argmax(-1))
        assert cache.get_seq_length() == length, "nothing moved"
    unpatch_model(model)


def test_a_replaced_weight_is_used_never_ignored():
    """A layer given a new ``Parameter`` after merging computes its own product; a group whose ``data`` was
    replaced (``param.data = ...``, ``model.to(...)`` after patching) is merged again from the current weights at the
    next prefill; a group whose layers come to differ in dtype is unmerged instead. Every output is the unmerged
    model's."""
    model = tiny_model("llama")
    ids = prompt(16)
    patch_model(model, merge_projections=True)
    groups = getattr(model, STATE_ATTR).merged
    k_proj = model.model.layers[1].self_attn.k_proj
    with torch.no_grad():
        new = torch.nn.Parameter(torch.randn_like(k_proj.weight))
        k_proj.weight = new
        unmerged = tiny_model("llama")
        unmerged.model.layers[1].self_attn.k_proj.weight = torch.nn.Parameter(new.detach().clone())
        torch.testing.assert_close(model(ids).logits, unmerged(ids).logits, rtol=0, atol=1e-5)
        assert [g.intact() for g in groups].count(False) == 1 and not any(g.stale() for g in groups)
        up, gate = model.model.layers[0].mlp.up_proj, model.model.layers[0].mlp.gate_proj
        up.weight.data = torch.randn_like(up.weight)
        unmerged.model.layers[0].mlp.up_proj.weight.data = up.weight.detach().clone()
        torch.testing.assert_close(model(ids).logits, unmerged(ids).logits, rtol=0, atol=1e-5)  # merged again
        assert up.weight.untyped_storage().data_ptr() == gate.weight.untyped_storage().data_ptr()
        model.to(torch.float64)  # converts every parameter's data: the merged tensors are left behind, then rebuilt
        unmerged.to(torch.float64)
        torch.testing.assert_close(model(ids).logits, unmerged(ids).logits, rtol=0, atol=1e-10)
        assert all(g.intact() for g in groups), "all merged again (k_proj's group adopting its new Parameter)"
        v_proj = model.model.layers[2].self_attn.v_proj
        v_proj.to(torch.float32)  # one layer of a group in another dtype: that group is unmerged
        unmerged.model.layers[2].self_attn.v_proj.to(torch.float32)
        model.model.layers[2].self_attn.q_proj.weight.data = model.model.layers[2].self_attn.q_proj.weight.clone()
        with pytest.raises(RuntimeError):  # float32 v_proj in a float64 model: both models refuse alike
            unmerged(ids)
        with pytest.raises(RuntimeError):
            model(ids)
        assert sum(g.active for g in groups) == len(groups) - 1
        assert "forward" not in v_proj.__dict__
    unpatch_model(model)


def test_a_refused_repatch_leaves_the_previous_patch_merged(monkeypatch):
    """Re-patching with stale merged groups unmerges them before merging afresh; when that merge fails, the previous
    patch stays in force with its groups merged again (from the current weights) and the unmerged model's outputs,
    under a new state object, so that static steps set up before refuse to replay the moved weights."""
    model = tiny_model("llama")
    ids = prompt(16)
    patch_model(model, policy=Dense(), merge_projections=True)
    state = getattr(model, STATE_ATTR)
    up, gate = model.model.layers[0].mlp.up_proj, model.model.layers[0].mlp.gate_proj
    with torch.no_grad():
        up.weight.data = torch.randn_like(up.weight)  # a stale group: re-patching merges every group afresh
    real_merge, calls = patch_module.merge, []

    def fail_once(model, kernel=False):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real_merge(model, kernel)

    monkeypatch.setattr(patch_module, "merge", fail_once)
    with pytest.raises(RuntimeError, match="boom"):
        patch_model(model, policy=Quest(budget=48), merge_projections=True)
    now = getattr(model, STATE_ATTR)  # a new state (the weights moved), the previous patch's settings and hooks
    assert now is not state and now.config is state.config and now.handles is state.handles and len(calls) == 2
    assert now.merged and all(g.intact() for g in now.merged)
    assert up.weight.untyped_storage().data_ptr() == gate.weight.untyped_storage().data_ptr()
    reference = tiny_model("llama")
    reference.load_state_dict(model.state_dict())  # the current (replaced) weights, unmerged
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
    unpatch_model(model)


def test_decode_linear_runs_every_projection_of_a_step_through_the_op():
    """With ``decode_linear=True`` a compiled static step traces the ``decode_linear`` op for the 4 products of each
    layer (qkv, o, gate_up, down: the reference backend off CUDA) and F.linear only for the LM head, and gives the
    merged model's logits; the prefill (more than 16 rows) keeps F.linear; unpatching restores every layer."""
    torch._dynamo.reset()
    model = tiny_model("llama")
    ids, steps = prompt(37, batch=2), 4
    policy = Quest(budget=24, sink=4, window=8)
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    out = {}
    for kernel in (False, True):
        patch_model(model, policy=policy, block_size=8, dense_layers=(0,), merge_projections=True, decode_linear=kernel)
        groups = getattr(model, STATE_ATTR).merged
        assert all(g.kernel is kernel for g in groups)
        assert len(groups) == (4 if kernel else 2) * model.config.num_hidden_layers
        seen = []
        out[kernel] = _compiled_static_steps(model, ids, steps, seen)
        layers = model.config.num_hidden_layers
        assert seen and set(seen) == ({(4 * layers, 1)} if kernel else {(0, 4 * layers + 1)}), seen
    torch.testing.assert_close(out[True], out[False], rtol=0, atol=0)
    unpatch_model(model)
    for k, p in model.named_parameters():
        assert torch.equal(p, params[k]), k
    assert not any("forward" in m.__dict__ for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_decode_linear_needs_merged_projections_and_a_bool():
    model = tiny_model("llama")
    patch_model(model, merge_projections=True)
    groups = getattr(model, STATE_ATTR).merged
    with pytest.raises(ValueError, match="merge_projections=True"):
        patch_model(model, merge_projections=False, decode_linear=True)
    with pytest.raises(TypeError, match="decode_linear"):
        patch_model(model, merge_projections=True, decode_linear="yes")
    assert getattr(model, STATE_ATTR).merged is groups, "a refused patch keeps the previous one"
    patch_model(model, merge_projections=True, decode_linear=True)
    assert all(g.kernel for g in getattr(model, STATE_ATTR).merged), "re-patched with the kernel: merged afresh"
    patch_model(model, merge_projections=True)
    assert not any(g.kernel for g in getattr(model, STATE_ATTR).merged)
    assert len(getattr(model, STATE_ATTR).merged) == 2 * model.config.num_hidden_layers
    unpatch_model(model)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the Triton matmul on a CUDA model (HF_SPARSE_KV_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("batch", [1, 3])
def test_decode_linear_on_cuda_generates_the_cublas_tokens(batch):
    """bf16 on CUDA, captured and compiled: the Triton matmul's greedy tokens are cuBLAS's and its logits within
    bf16 rounding of them."""
    torch._dynamo.reset()
    model = tiny_model("llama").to(DEVICE, torch.bfloat16)
    ids = prompt(40, batch=batch)
    runs = {}
    for kernel in (False, True):
        patch_model(
            model,
            policy=Quest(budget=24, sink=4, window=8),
            block_size=8,
            dense_layers=(0,),
            cuda_graph=True,
            compile="inductor",
            merge_projections=True,
            decode_linear=kernel,
        )
        runs[kernel] = greedy(model, ids, new_tokens=8)
    assert torch.equal(runs[True][0], runs[False][0])
    torch.testing.assert_close(runs[True][1].float(), runs[False][1].float(), rtol=2e-2, atol=2e-2)
    unpatch_model(model)
