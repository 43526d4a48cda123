"""torch.compile on a patched model: the static decode step (hf_sparse_kv.graphs) traces under ``fullgraph=True``
(backend ``aot_eager`` here; the sparse ops are custom ops, hf_sparse_kv.ops.library) and gives the eager outputs,
for every policy and mode, the selectors of policies/projected.py, two_stage.py and top_p.py included, through
:class:`DecodeGraphs` and through a user's own ``torch.compile(model.forward)``."""

import math

import pytest
import torch
from test_selectors import PQ_FIT, _calibration
from tiny_models import prompt, tiny_model

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.calibrate_selector import calibrate_selector
from hf_sparse_kv.crossover import CrossoverTable
from hf_sparse_kv.graphs import DecodeGraphs
from hf_sparse_kv.ops.layout import cdiv
from hf_sparse_kv.patched import STATE_ATTR
from hf_sparse_kv.policies import (
    BlockTopK,
    Counts,
    Dense,
    Fp8BlockTopK,
    OracleBlockTopK,
    ProjectedBlockTopK,
    ProjectedTokenTopK,
    QuantBlockTopK,
    Quest,
    SinkWindow,
    SnapKV,
    TokenTopK,
    TopPBlockTopK,
    TwoStageBlockTopK,
    TwoStageTokenTopK,
)

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK_POLICIES = [
    Dense(),
    SinkWindow(sink=4, window=12),
    Quest(budget=24, sink=4, window=8),
    BlockTopK(budget=24, sink=4, window=8),
    OracleBlockTopK(budget=24, sink=4, window=8),
]
CASES = [(p, m) for p in BLOCK_POLICIES for m in ("mask", "token", "block", "auto")]
CASES += [(TokenTopK(budget=20, sink=4, window=8), m) for m in ("mask", "token", "auto")]
# the crossover of mode="auto": dense below 45 tokens, sparse from there (the steps cross it)
TABLE = CrossoverTable(
    [{"budget": 0.5, "batch": 1, "num_kv_heads": 2, "head_dim": 16, "crossover": 45}], max_context=1 << 20
)
PROMPT, STEPS = 37, 12


def _patch(model, policy, mode):
    table = {"crossover": TABLE} if mode == "auto" else {}
    patch_model(model, policy=policy, mode=mode, block_size=8, dense_layers=(0,), **table)


def _eager(model, ids, n):
    cache = PagedKVCache(model.config, block_size=8)
    kw = {cache_kwarg(model): cache}
    out = []
    with torch.no_grad():
        logits = model(ids, **kw).logits[:, -1:]
        for _ in range(n):
            logits = model(logits.argmax(-1), **kw).logits
            out.append(logits)
    return cache, torch.cat(out, 1)


@pytest.mark.parametrize("policy,mode", CASES, ids=lambda x: type(x).__name__ if not isinstance(x, str) else x)
def test_compiled_static_step_equals_eager(policy, mode):
    torch._dynamo.reset()
    model = tiny_model("llama", num_hidden_layers=2)
    ids = prompt(PROMPT, batch=2)
    _patch(model, policy, mode)
    ref_cache, ref = _eager(model, ids, STEPS)
    cache, out = PagedKVCache(model.config, block_size=8), []
    with torch.no_grad():
        logits = model(ids, **{cache_kwarg(model): cache}).logits[:, -1:]
        runner = DecodeGraphs(model, cache, PROMPT + STEPS, capture=False, compile="aot_eager")
        for _ in range(STEPS):
            logits = runner.step(logits.argmax(-1))
            out.append(logits)
    unpatch_model(model)
    torch.testing.assert_close(torch.cat(out, 1), ref, rtol=0, atol=1e-5)
    assert _counted(cache) == _counted(ref_cache)  # the static step counts on the host what the eager step counts


def _counted(cache) -> tuple:
    """What a cache counted: decode steps, K/V bytes read, ``mode="auto"``'s dense / sparse layer-steps."""
    return cache.decode_steps, cache.kv_bytes_read, cache.auto_steps


@pytest.mark.parametrize("mode", ["block", "token", "auto"])
@pytest.mark.parametrize("then", [None, Quest(budget=12, sink=4, window=8)], ids=["alone", "then_quest"])
def test_compiled_static_steps_of_a_policy_that_frees_once_equal_eager(then, mode):
    """SnapKV's steps after its first (eager, it frees the prompt's blocks), compiled with ``fullgraph=True`` over
    the table with holes: the eager steps' logits and counters."""
    torch._dynamo.reset()
    model = tiny_model("llama", num_hidden_layers=2)
    ids = prompt(PROMPT, batch=2)
    _patch(model, SnapKV(budget=0.4, sink=4, window=8, observe=8, then=then), mode)
    ref_cache, ref = _eager(model, ids, STEPS)
    cache = PagedKVCache(model.config, block_size=8)
    with torch.no_grad():
        logits = model(ids, **{cache_kwarg(model): cache}).logits[:, -1:]
        logits = model(logits.argmax(-1), **{cache_kwarg(model): cache}).logits
        out = [logits]
        runner = DecodeGraphs(model, cache, PROMPT + STEPS, capture=False, compile="aot_eager")
        assert cache.static.held is not None
        for _ in range(STEPS - 1):
            logits = runner.step(logits.argmax(-1))
            out.append(logits)
    unpatch_model(model)
    torch.testing.assert_close(torch.cat(out, 1), ref, rtol=0, atol=1e-5)
    assert _counted(cache) == _counted(ref_cache)


def _pq(model) -> dict:
    return calibrate_selector(model, prompt(96, seed=5), "pq", sub_dim=4, centroids=16)


# the selectors, built on the model they run on (a calibration where they need one), and the custom ops their step
# calls besides the decode ops (hf_sparse_kv.ops.library)
SELECTORS = {
    "ProjectedBlockTopK": (
        lambda m: ProjectedBlockTopK(24, 4, 8, calibration=_calibration(m, "svd")),
        {"projected_write", "projected_scores", "topk_indices"},
    ),
    "ProjectedTokenTopK": (
        lambda m: ProjectedTokenTopK(21, 4, 5, calibration=_calibration(m)),
        {"projected_write", "projected_scores", "topk_indices"},
    ),
    "TwoStageBlockTopK": (
        lambda m: TwoStageBlockTopK(24, 2, 4, candidates=1.5, coarse="projected", calibration=_calibration(m, "pca")),
        {"projected_write", "projected_scores", "candidate_scores", "topk_indices"},
    ),
    # candidates=1 and a 12-token window: at some lengths the forced blocks outnumber the candidates the budget
    # wants, which the static step counts on the device
    "TwoStageTokenTopK": (
        lambda m: TwoStageTokenTopK(24, 4, 12, candidates=1),
        {"block_scores", "candidate_scores", "topk_indices"},
    ),
    "TopPBlockTopK": (
        lambda m: TopPBlockTopK(24, 2, 4, candidates=2, p=0.8),
        {"block_scores", "candidate_scores", "candidate_mass", "topk_indices"},
    ),
    "TopPBlockTopK(pool=heads)": (
        lambda m: TopPBlockTopK(24, 2, 4, candidates=2, p=0.8, pool="heads"),
        {"block_scores", "candidate_scores", "candidate_mass", "topk_indices"},
    ),
    "TopPBlockTopK(coarse=pq)": (
        lambda m: TopPBlockTopK(24, 2, 4, candidates=2, p=1.0, pool="heads", coarse="pq", calibration=_pq(m)),
        {"pq_write", "pq_block_scores", "candidate_scores", "candidate_mass", "topk_indices"},
    ),
    "TopPBlockTopK(coarse=pq, prefill fit)": (
        lambda m: TopPBlockTopK(24, 2, 4, candidates=2, p=1.0, pool="heads", coarse="pq", calibration=PQ_FIT),
        {"pq_write", "pq_block_scores", "candidate_scores", "candidate_mass", "topk_indices"},
    ),
    "QuantBlockTopK": (
        lambda m: QuantBlockTopK(24, 2, 4, bits=2),
        {"quant_write", "quant_block_scores", "topk_indices"},
    ),
    "Fp8BlockTopK": (
        lambda m: Fp8BlockTopK(24, 2, 4),
        {"fp8_write", "fp8_block_scores", "topk_indices"},
    ),
}
SELECTOR_CASES = [
    (name, mode)
    for name in SELECTORS
    for mode in (("mask", "token") if name.endswith("TokenTopK") else ("mask", "token", "block"))
]


def _recording(seen: set):
    """A ``torch.compile`` backend: ``aot_eager``, after adding the names of the graph's hf_sparse_kv ops to ``seen``."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        targets = (str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        seen.update(t.split(".")[1] for t in targets if t.startswith("hf_sparse_kv."))
        return aot_eager(gm, example_inputs)

    return backend


@pytest.mark.parametrize("name,mode", SELECTOR_CASES)
def test_compiled_selector_step_equals_eager(name, mode):
    """A selector's static step (its compressed keys' refresh inside the write, its scores, its candidates) traces
    under ``fullgraph=True`` with its ops as custom ops, never their Python, and gives the eager logits."""
    torch._dynamo.reset()
    model = tiny_model("llama", num_hidden_layers=2)
    build, selector_ops = SELECTORS[name]
    policy = build(model)
    ids = prompt(PROMPT, batch=2)
    _patch(model, policy, mode)
    _, ref = _eager(model, ids, STEPS)
    cache, out, seen = PagedKVCache(model.config, block_size=8), [], set()
    with torch.no_grad():
        logits = model(ids, **{cache_kwarg(model): cache}).logits[:, -1:]
        runner = DecodeGraphs(model, cache, PROMPT + STEPS, capture=False, compile={"backend": _recording(seen)})
        for _ in range(STEPS):
            logits = runner.step(logits.argmax(-1))
            out.append(logits)
    unpatch_model(model)
    torch.testing.assert_close(torch.cat(out, 1), ref, rtol=0, atol=1e-5)
    assert runner.static.plan.counts is not None, "the last step ran the selector (not dense)"
    assert selector_ops <= seen, f"ops traced as Python instead of custom ops: {sorted(selector_ops - seen)}"


def test_inductor_freezing_is_refused():
    """Inductor's ``freezing`` turns every tensor marked as a static address into a constant of the compiled step,
    the cache's pools and the step's buffers included (on the CPU: right logits at the first step, wrong from the
    second). ``patch_model`` refuses it in ``compile``'s options before patching; :class:`DecodeGraphs` refuses it
    before reserving; a static step that may compile refuses to begin while the global flag is on, on the compiled
    captured path and on a user's own (maybe compiled) forward, and runs again once it is off; a runner that never
    compiles is not refused."""
    import torch._inductor.config as inductor_config

    model = tiny_model("llama")
    freezing = {"backend": "inductor", "options": {"freezing": True}}
    with pytest.raises(ValueError, match="freezing"):
        patch_model(model, policy=Quest(budget=16), cuda_graph=True, compile=freezing)
    assert not hasattr(model, STATE_ATTR), "a refused patch left the model patched"
    ids = prompt(30, batch=2)
    _patch(model, Quest(budget=16, sink=4, window=8), "block")
    cache = PagedKVCache(model.config, block_size=8)
    with torch.no_grad():
        logits = model(ids, **{cache_kwarg(model): cache}).logits[:, -1:]
        with pytest.raises(ValueError, match="freezing"):
            DecodeGraphs(model, cache, 40, capture=False, compile=freezing)
        assert cache.static is None, "a refused runner reserved the cache"
        runner = DecodeGraphs(model, cache, 40, capture=False, compile="aot_eager")
        n = cache.get_seq_length()
        with inductor_config.patch(freezing=True):
            with pytest.raises(RuntimeError, match="freezing"):
                runner.step(logits.argmax(-1))
            assert cache.get_seq_length() == n, "a refused step moved the cache on"
            uncompiled = DecodeGraphs(model, cache, 40, capture=False)  # a step that never compiles: not refused
            assert uncompiled.step(logits.argmax(-1)).shape[1] == 1 and cache.get_seq_length() == n + 1
            cache.crop(n)
            cache.reserve_static(40)
            cache.session.set_graphs(None)  # a user's own forward on the reserved cache: the patch's hook refuses too
            with pytest.raises(RuntimeError, match="freezing"):
                model(logits.argmax(-1), **{cache_kwarg(model): cache})
        assert model(logits.argmax(-1), **{cache_kwarg(model): cache}).logits.shape[1] == 1  # the flag off again
    unpatch_model(model)


@pytest.mark.parametrize("merged", [False, True], ids=["separate", "merged"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_users_compiled_forward_on_a_reserved_cache_equals_eager(arch, merged):
    """``model.forward = torch.compile(model.forward, fullgraph=True)`` after the prefill, on a cache reserved with
    ``reserve_static``: the patch's model hook (outside the compiled forward) begins each static step and passes
    its position ids; with ``merge_projections`` too (the reference: eager steps without merging)."""
    torch._dynamo.reset()
    model = tiny_model(arch)
    ids = prompt(30, batch=2)
    _patch(model, Quest(budget=16, sink=4, window=8), "block")
    _, ref = _eager(model, ids, STEPS)
    if merged:
        patch_model(model, policy=Quest(budget=16, sink=4, window=8), block_size=8, dense_layers=(0,),
                    merge_projections=True)  # fmt: skip
    cache, out = PagedKVCache(model.config, block_size=8), []
    with torch.no_grad():
        logits = model(ids, **{cache_kwarg(model): cache}).logits[:, -1:]
        cache.reserve_static(30 + STEPS)
        model.forward = torch.compile(model.forward, backend="aot_eager", fullgraph=True)
        for _ in range(STEPS):
            logits = model(logits.argmax(-1), **{cache_kwarg(model): cache}).logits
            out.append(logits)
    del model.forward
    unpatch_model(model)
    torch.testing.assert_close(torch.cat(out, 1), ref, rtol=0, atol=1e-5)
    assert cache.get_seq_length() == 30 + STEPS


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_generate_with_a_compile_config_compiles_static_steps(padded):
    """``generate(compile_config=...)``: the patch builds a cache that decodes in static steps (reserved at the first
    decode step by the model hook, which is never traced), transformers compiles ``model.__call__`` for the decode
    steps, and the tokens and logits are the eager ones."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = tiny_model("llama", num_hidden_layers=2)
    ids = prompt(30, batch=2)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :7] = 0
    patch_model(model, policy=Quest(budget=16, sink=4, window=8), block_size=8, dense_layers=(0,))
    config = CompileConfig(backend="aot_eager")
    config._compile_all_devices = True  # transformers' switch for compiling on the CPU
    kw = {"attention_mask": mask, "max_new_tokens": 10, "min_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
    kw.update(output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        out = model.generate(ids, compile_config=config, **kw)
    unpatch_model(model)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), rtol=0, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "the decode steps were compiled"


def test_a_growing_plan_compiles_twice_not_per_plan():
    """A long generation moves through many plans (Quest's budget grows with the context: a new width every few
    blocks): the compiled step recompiles once, with the widths dynamic (dynamo's automatic dynamic shapes), and not
    at every plan (each compile of an 8B model takes ~25 s on an H200), and every step equals eager."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = tiny_model("llama", num_hidden_layers=2)
    ids = prompt(30, batch=2)
    _patch(model, Quest(budget=0.5, sink=4, window=8), "block")
    steps = 80
    _, ref = _eager(model, ids, steps)
    cache, out, plans = PagedKVCache(model.config, block_size=8), [], set()
    with torch.no_grad():
        logits = model(ids, **{cache_kwarg(model): cache}).logits[:, -1:]
        runner = DecodeGraphs(model, cache, 30 + steps, capture=False, compile="aot_eager")
        for _ in range(steps):
            logits = runner.step(logits.argmax(-1))
            out.append(logits)
            plans.add(runner.static.plan)
    unpatch_model(model)
    torch.testing.assert_close(torch.cat(out, 1), ref, rtol=0, atol=1e-5)
    assert len(plans) >= 5, f"the steps crossed too few plans to tell: {plans}"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2, dict(torch._dynamo.utils.counters["stats"])


@pytest.mark.parametrize(
    "policy,mode,compiles",
    [(Quest(budget=0.5, sink=4, window=8), "block", 2), (TwoStageTokenTopK(0.5, 4, 12, candidates=1.5), "token", 3)],
    ids=["Quest", "TwoStageTokenTopK"],
)
def test_a_padded_batch_compiles_twice_not_per_sequence(policy, mode, compiles):
    """A left-padded batch: its sequences cross selection widths at different steps, so the planned counts change
    one sequence at a time. The step reads them on the device (``StaticBuffers.counts``, filled before it) and only
    the plan's widths on the host: it compiles for the first plan and once more when the width first changes (then
    dynamic), not once per sequence (4 and 5 graphs here when the counts were host ints, up to the batch size + 1).
    A two-stage policy with a float ``candidates`` has a second plan int, its candidates' width, which a token
    policy's plan first changes a few tokens after the width (every ``block_size`` tokens of it): one more. Every
    step equals eager."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = tiny_model("llama", num_hidden_layers=2)
    B, steps = 4, 64
    ids = prompt(40, batch=B)
    mask = torch.ones_like(ids)
    for b in range(B):
        mask[b, : 9 * b] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    patch_model(model, policy=policy, mode=mode, block_size=8, dense_layers=(0,))
    gen = model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    ref = torch.stack(gen.logits[1:], 1)  # the decode steps' logits (the first came from the prefill)
    cache, out, plans = PagedKVCache(model.config, block_size=8), [], set()
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, position_ids=pos, **{cache_kwarg(model): cache}).logits
        runner = DecodeGraphs(model, cache, 40 + steps, capture=False, compile="aot_eager")
        for i in range(steps - 1):  # generate()'s own tokens (min_new_tokens masks EOS where the argmax may be it)
            logits = runner.step(gen.sequences[:, 40 + i : 41 + i])
            out.append(logits[:, -1])
            plans.add(runner.static.plan)
    unpatch_model(model)
    torch.testing.assert_close(torch.stack(out, 1), ref, rtol=0, atol=1e-5)
    changed = {b for p in plans for q in plans if p.widths == q.widths for b in range(B) if p.counts[b] != q.counts[b]}
    assert len(plans) >= 8 and changed, f"no count changed under an unchanged width: {plans}"
    stats = torch._dynamo.utils.counters["stats"]
    assert stats["unique_graphs"] <= compiles, dict(stats)


@pytest.mark.parametrize("candidates", [1, 2, 4, 8, 1.1, 1.5, 4 / 3, 1.7, 2.9999999999999996, 1 + 2**-52, 7.7])
def test_device_candidate_counts_equal_the_host_formula(candidates):
    """A static step derives a two-stage policy's candidates per sequence on the device from the planned counts
    (``CoarsePass.device_width``) and their width on the host from the plan's width (``static_widths``): the device
    form is the host's ``math.ceil(candidates * k)`` for every count (float64: Python's 1.1 * 50 is
    55.00000000000001, float32's 55), and the width is the most any sequence wants, for the block and the token
    policy."""
    policy = TwoStageTokenTopK(0.5, 4, 12, candidates=candidates)
    coarse = policy._coarse
    k = torch.cat([torch.arange(0, 20_000), torch.tensor([2**20 + 1, 2**31 - 1, 2**40 + 3])])
    host = [math.ceil(candidates * n) for n in k.tolist()]
    assert coarse.device_width(k).tolist() == host
    assert [coarse.width(n) for n in k.tolist()] == host
    if candidates == 1.1:  # the values tell float64 from float32
        assert torch.ceil(k.float() * candidates).long().tolist() != host
    BS, counts = 8, [37, 5, 120, 64, 1]
    blocks = Counts(max(counts), device=torch.tensor(counts)).map(lambda n: cdiv(n, BS))
    assert blocks.device.tolist() == [cdiv(n, BS) for n in counts] and blocks.width == cdiv(120, BS)
    # the candidates' width: planned on the host for a float, derived in the step (integer arithmetic) for an int
    block_policy = TwoStageBlockTopK(24, 4, 8, candidates=candidates)
    for p, blocks in ((policy, [cdiv(n, BS) for n in counts]), (block_policy, counts)):
        want = max(math.ceil(candidates * n) for n in blocks)
        assert p._coarse.width(p.coarse_blocks(max(counts), BS)) == want
        assert p.static_widths(counts, BS) == ((120,) if isinstance(candidates, int) else (120, want))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor + CUDA-graph capture of the compiled step: CUDA")
@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_captured_inductor_step_equals_eager_on_cuda(arch, merged):
    """``DecodeGraphs(compile="inductor")`` (what ``patch_model(cuda_graph=True, compile="inductor")`` runs): the
    step compiled by inductor, then captured and replayed, on a left-padded batch; with ``merge_projections`` too
    (the reference: generate() without merging)."""
    torch._dynamo.reset()
    model = tiny_model(arch)
    ids = prompt(30, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    _patch(model, Quest(budget=16, sink=4, window=8), "block")
    cache = PagedKVCache(model.config, block_size=8)
    kw = {cache_kwarg(model): cache}
    out = []
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
        ref = torch.stack(gen.logits[1:], 1)  # the decode steps' raw logits (the first came from the prefill)
        if merged:
            patch_model(model, policy=Quest(budget=16, sink=4, window=8), block_size=8, dense_layers=(0,),
                        merge_projections=True)  # fmt: skip
        model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), **kw)  # prefill
        runner = DecodeGraphs(model, cache, 30 + STEPS, capture=True, compile="inductor")
        for i in range(STEPS):  # generate()'s own tokens: min_new_tokens masks EOS, so an argmax here could differ
            logits = runner.step(gen.sequences[:, 30 + i : 31 + i])
            out.append(logits[:, -1])
    unpatch_model(model)
    assert runner.replays == STEPS
    torch.testing.assert_close(torch.stack(out[:-1], 1), ref, rtol=0, atol=2e-4)
