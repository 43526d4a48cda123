"""CUDA-graph decoding: the static decode step (blocks reserved, lengths in device buffers, widths planned on the
host) computes exactly what the eager step computes. On the CPU the static step runs eagerly; on CUDA it is
captured and replayed."""

import contextlib

import pytest
import torch
from tiny_models import DEVICE, greedy, prompt, static_steps_anywhere, tiny_model

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.attention import StaticPlan, static_plan
from hf_sparse_kv.crossover import CrossoverTable
from hf_sparse_kv.graphs import DecodeGraphs, graph_pool
from hf_sparse_kv.patched import patch_state
from hf_sparse_kv.policies import (
    Dense,
    Fp8BlockTopK,
    QuantBlockTopK,
    Quest,
    SinkWindow,
    SnapKV,
    TokenTopK,
    TopPBlockTopK,
    TwoStageBlockTopK,
)

POLICIES = [
    Dense(),
    Quest(budget=16, sink=4, window=8),
    Quest(budget=0.25, sink=0, window=8),
    SinkWindow(sink=4, budget=0.3),
]


def _eager_steps(model, ids, n):
    cache = PagedKVCache(model.config, block_size=8)
    kw = {cache_kwarg(model): cache}
    out = []
    with torch.no_grad():
        logits = model(ids, **kw).logits[:, -1:]
        for _ in range(n):
            token = logits.argmax(-1)
            logits = model(token, **kw).logits
            out.append(logits)
    return torch.cat(out, 1)


def _static_steps(model, ids, n):
    """Prefill ``ids``, then ``n`` greedy steps through :class:`DecodeGraphs` (captured on CUDA): the cache, the
    runner and the logits ``[B, n, V]``."""
    cache = PagedKVCache(model.config, block_size=8)
    out = []
    with torch.no_grad():
        logits = model(ids, **{cache_kwarg(model): cache}).logits[:, -1:]
        runner = DecodeGraphs(model, cache, max_length=ids.shape[1] + n, capture=DEVICE.type == "cuda")
        for _ in range(n):
            logits = runner.step(logits.argmax(-1))
            out.append(logits)
    return cache, runner, torch.cat(out, 1)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{type(p).__name__}-{getattr(p, 'budget', '')}")
def test_static_step_equals_eager(policy):
    model = tiny_model("llama")
    ids = prompt(37, batch=2)
    patch_model(model, policy=policy, mode="block", block_size=8, dense_layers=(0,))
    ref = _eager_steps(model, ids, 24)
    cache, _, out = _static_steps(model, ids, 24)
    unpatch_model(model)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert cache.get_seq_length() == 37 + 24 and cache.blocks_in_use == 2 * 8  # reserved up front
    assert cache.decode_steps == 24


def test_static_auto_step_switches_at_the_crossover_like_eager():
    model = tiny_model("llama")
    ids = prompt(37, batch=2)
    entry = {"budget": 0.25, "batch": 1, "num_kv_heads": 2, "head_dim": 16, "crossover": 50}
    table = CrossoverTable([entry], max_context=1 << 20)
    policy = Quest(budget=0.25, sink=4, window=8)
    patch_model(model, policy=policy, mode="auto", crossover=table, block_size=8, dense_layers=(0,))
    ref = _eager_steps(model, ids, 24)
    cache, runner, out = _static_steps(model, ids, 24)
    unpatch_model(model)
    # the plan (and its key) holds the crossover's decision: one graph below 50 tokens, the policy's widths from there
    assert runner.plan(49) == StaticPlan(False, None, None)
    counts = policy.plan((50, 50), 8)
    assert runner.plan(50) == StaticPlan(True, tuple(counts), (max(counts),))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    # two sparse layers per step; steps at 38..49 tokens dense, 50..61 sparse
    assert cache.auto_steps == {"dense": 2 * 12, "sparse": 2 * 12}


def test_generate_with_cuda_graph_flag_matches_eager():
    model = tiny_model("llama")
    ids = prompt(30)
    policy = Quest(budget=0.25, sink=0, window=8)
    patch_model(model, policy=policy, mode="block", block_size=8)
    ref_seqs, ref_scores = greedy(model, ids, new_tokens=20)
    patch_model(model, policy=policy, mode="block", block_size=8, cuda_graph=True)
    seqs, scores = greedy(model, ids, new_tokens=20)
    unpatch_model(model)
    assert "forward" not in model.__dict__
    assert torch.equal(seqs, ref_seqs)
    torch.testing.assert_close(scores, ref_scores, rtol=0, atol=1e-5)


def test_cuda_graph_refuses_a_policy_that_frees_blocks_at_every_step_and_accepts_every_mode():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="frees blocks at every step"):
        patch_model(model, policy=SinkWindow(sink=4, window=8, evict=True), dense_layers=(), cuda_graph=True)
    for mode in ("mask", "token", "block", "auto"):
        patch_model(model, policy=Dense(), mode=mode, cuda_graph=True)
    patch_model(model, policy=SnapKV(budget=0.25, sink=4, window=8, observe=8), cuda_graph=True)  # frees once
    unpatch_model(model)


SNAPKV = [
    SnapKV(budget=0.3, sink=4, window=8, observe=8),
    SnapKV(budget=0.4, sink=4, window=8, observe=8, then=Quest(budget=0.15, sink=4, window=8)),
    SnapKV(budget=0.4, sink=4, window=8, observe=8, then=TokenTopK(budget=0.15, sink=4, window=8)),
    # a budget past what is held: the counts are cut to what each sequence still holds, as the eager step cuts them
    SnapKV(budget=0.25, sink=4, window=8, observe=8, then=Quest(budget=0.6, sink=4, window=8)),
    SnapKV(budget=0.25, sink=4, window=8, observe=8, then=TokenTopK(budget=0.6, sink=4, window=8)),
]


def _static_after_first_step(model, ids, mask, n, backend="auto", before_first=None):
    """Prefill the left-padded ``ids``, decode the first of ``n`` greedy steps eagerly (a policy that frees once frees
    then), the others through :class:`DecodeGraphs` (captured on CUDA): the cache and the logits ``[B, n, V]``.
    ``before_first(cache)`` runs between the prefill and the first step."""
    cache = PagedKVCache(model.config, block_size=8, backend=backend)
    kw = {cache_kwarg(model): cache}
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(ids, attention_mask=mask, position_ids=pos, **kw).logits[:, -1:]
        if before_first is not None:
            before_first(cache)
        m = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        logits = model(logits.argmax(-1), attention_mask=m, position_ids=m.sum(-1, keepdim=True) - 1, **kw).logits
        out = [logits]
        runner = DecodeGraphs(model, cache, ids.shape[1] + n, capture=DEVICE.type == "cuda")
        for _ in range(n - 1):
            logits = runner.step(logits.argmax(-1))
            out.append(logits)
    return cache, torch.cat(out, 1)


@pytest.mark.parametrize(
    ("policy", "mode"),
    [(p, m) for p in SNAPKV for m in ("block", "token", "mask") if not (p.granularity == "token" and m == "block")],
    ids=lambda x: x if isinstance(x, str) else f"{type(x.then).__name__}-{getattr(x.then, 'budget', '')}",
)
def test_a_policy_that_frees_once_decodes_statically_after_its_first_step(policy, mode):
    """SnapKV frees the prompt's blocks at its first decode step (eager), then static steps run over the table with
    its holes: the eager steps' logits and counters (steps, K/V bytes read), in a left-padded batch; the reservation
    after the freeing holds fewer blocks than the prompt's. Static steps before the first step are refused."""
    model = tiny_model("llama")
    ids, mask = _padded_prompt([61, 40, 53], 61)
    patch_model(model, policy=policy, mode=mode, block_size=8, dense_layers=(0,))
    eager = PagedKVCache(model.config, block_size=8)
    ref = _eager_padded(model, ids, mask, 20, eager)

    def refused(cache):  # before the first step has freed the prompt's blocks
        with pytest.raises(ValueError, match="only after its first decode step"):
            DecodeGraphs(model, cache, ids.shape[1] + 20, capture=False)

    cache, out = _static_after_first_step(model, ids, mask, 20, before_first=refused)
    unpatch_model(model)
    assert cache.static.evicted == cache.evicted_counts() and min(cache.static.evicted) > 0
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert cache.decode_steps == eager.decode_steps == 20
    assert cache.kv_bytes_read == eager.kv_bytes_read
    assert cache.blocks_in_use < sum(-(-(n + 20) // 8) for n in (61, 40, 53))  # the freed blocks stay freed


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_a_policy_that_frees_once_decodes_statically_beside_sliding_window_layers(arch):
    """SnapKV on Gemma-3 (sliding and full layers) and Mistral with a window (every layer sliding: nothing paged,
    nothing freed): after its eager first step, static steps over the rings and the paged table's holes give the
    eager steps' logits, left-padded."""
    model = tiny_model(arch)
    ids, mask = _padded_prompt([61, 44], 61)
    patch_model(model, policy=SNAPKV[1], mode="block", block_size=8, dense_layers=())
    ref = _eager_padded(model, ids, mask, 16)
    cache, out = _static_after_first_step(model, ids, mask, 16)
    unpatch_model(model)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert (cache.static.evicted is not None) == bool(cache.paged_layers)


def test_generate_with_cuda_graph_decodes_a_policy_that_frees_once_statically(monkeypatch):
    """``generate()`` with ``cuda_graph=True`` and SnapKV: its first decode step runs eagerly (it frees the prompt's
    blocks), the others through the cache's :class:`DecodeGraphs` (static steps; on the CPU uncaptured): the eager
    ``generate()``'s tokens and scores."""
    static_steps_anywhere(monkeypatch)
    model = tiny_model("llama")
    ids = prompt(61, batch=2)
    policy = SNAPKV[1]
    patch_model(model, policy=policy, mode="block", block_size=8, dense_layers=(0,))
    ref_seqs, ref_scores = greedy(model, ids, new_tokens=20)
    on_cpu = pytest.warns(UserWarning, match="not on a CUDA device") if DEVICE.type == "cpu" else None
    with on_cpu or contextlib.nullcontext():
        patch_model(
            model, policy=policy, mode="block", block_size=8, dense_layers=(0,), cuda_graph=True,
            merge_projections=False,
        )  # fmt: skip
    with torch.no_grad():  # the cache generate() makes: reserved for its maximum length (after the first step)
        out = model.generate(
            ids, max_new_tokens=20, min_new_tokens=20, do_sample=False, output_scores=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    unpatch_model(model)
    cache = out.past_key_values
    assert isinstance(cache.session.graphs, DecodeGraphs) and cache.static.evicted is not None
    assert cache.decode_steps == 19  # the first eager (it frees), 18 static
    assert torch.equal(out.sequences, ref_seqs)
    torch.testing.assert_close(torch.stack(out.scores), ref_scores, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", ["block", "token"])
def test_a_policy_that_frees_once_decodes_statically_through_the_triton_kernels(mode):
    """The same through the Triton kernels (the interpreter on the CPU): SnapKV 0.4 + Quest, left-padded; its static
    steps read the table with holes as its eager steps do (logits, K/V bytes)."""
    model = tiny_model("llama")
    ids, mask = _padded_prompt([61, 44], 61)
    patch_model(model, policy=SNAPKV[1], mode=mode, block_size=8, dense_layers=(0,), backend="triton")
    eager = PagedKVCache(model.config, block_size=8, backend="triton")
    ref = _eager_padded(model, ids, mask, 8, eager)
    cache, out = _static_after_first_step(model, ids, mask, 8, backend="triton")
    unpatch_model(model)
    assert cache.static.evicted is not None
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert cache.kv_bytes_read == eager.kv_bytes_read


def test_a_reservation_made_after_freeing_is_not_refilled():
    """``load_static`` refuses a reservation whose table has freed blocks (its steps keep the blocks it held)."""
    model = tiny_model("llama")
    ids = prompt(61, batch=2)
    patch_model(model, policy=SNAPKV[0], mode="block", block_size=8, dense_layers=(0,))
    cache, source = PagedKVCache(model.config, block_size=8), PagedKVCache(model.config, block_size=8)
    with torch.no_grad():
        logits = model(ids, **{cache_kwarg(model): cache}).logits[:, -1:]
        model(logits.argmax(-1), **{cache_kwarg(model): cache})
        DecodeGraphs(model, cache, 90, capture=False)
    patch_model(model, policy=Dense(), mode="block", block_size=8, dense_layers=(0,))
    with torch.no_grad():
        model(ids, **{cache_kwarg(model): source})
    unpatch_model(model)
    with pytest.raises(ValueError, match="reservation made after blocks were freed"):
        cache.load_static(source)


def _refilled_leaving_out(model, ids, mask, n, backend="auto"):
    """A slot (another prompt prefilled, then reserved) refilled with the observed prefill of the left-padded ``ids``
    less the blocks the patched policy frees at its first step (``load_static(free=...)``), then ``n`` greedy static
    steps from the first one (captured on CUDA): the slot, the source, ``free`` and the logits ``[B, n, V]``."""
    policy = patch_state(model).config.policy
    source, slot = (PagedKVCache(model.config, block_size=8, backend=backend) for _ in range(2))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        model(prompt(ids.shape[1] - 3, batch=ids.shape[0]), **{cache_kwarg(model): slot})  # other contents first
        logits = model(ids, attention_mask=mask, position_ids=pos, **{cache_kwarg(model): source}).logits[:, -1:]
        slot.reserve_static(ids.shape[1] + n, any_padding=True)
        lens = tuple(ids.shape[1] + 1 - p for p in source.pads)  # the first step's stored lengths
        free = policy.blocks_to_free(source.session.peek_observation(), lens, 8)
        slot.load_static(source, free)
        assert slot.session.observation_used  # handed over: the steps may start
        runner = DecodeGraphs(model, slot, ids.shape[1] + n, capture=DEVICE.type == "cuda")
        out = []
        for _ in range(n):
            logits = runner.step(logits.argmax(-1))
            out.append(logits)
    return slot, source, free, torch.cat(out, 1)


@pytest.mark.parametrize(
    ("policy", "mode"),
    [(p, m) for p in SNAPKV for m in ("block", "token") if not (p.granularity == "token" and m == "block")],
    ids=lambda x: x if isinstance(x, str) else f"{type(x.then).__name__}-{getattr(x.then, 'budget', '')}",
)
def test_a_refill_leaving_out_what_a_policy_frees_decodes_it_statically_from_its_first_step(policy, mode):
    """``load_static(source, free)`` with the blocks SnapKV frees at its first step: the step's table has holes there
    (the blocks stay the reservation's), and static steps from the first one give the eager steps' logits and
    counters (steps, K/V bytes read), left-padded; the source is left as it was (its observation pending, nothing
    freed). A refill without ``free`` gives the table its blocks back."""
    model = tiny_model("llama")
    ids, mask = _padded_prompt([61, 40, 53], 61)
    patch_model(model, policy=policy, mode=mode, block_size=8, dense_layers=(0,))
    eager = PagedKVCache(model.config, block_size=8)
    ref = _eager_padded(model, ids, mask, 20, eager)
    slot, source, free, out = _refilled_leaving_out(model, ids, mask, 20)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert slot.decode_steps == eager.decode_steps == 20
    assert slot.kv_bytes_read == eager.kv_bytes_read
    rows, table = slot.table.rows, slot.static.table.tolist()
    assert (
        min(map(len, free)) > 0 and all(-1 not in row for row in rows) and not slot.evicted
    )  # the blocks stay the slot's
    assert all(table[b][j] == (-1 if j in f else rows[b][j]) for b, f in enumerate(free) for j in range(len(rows[b])))
    assert slot.static.evicted == tuple(map(len, free)) and slot.static.held == len(table[0])
    holes = [rows[b][j] for b, f in enumerate(free) for j in f]  # not copied: the refill zeroed them
    assert all(not layer.k_pool[holes].any() and not layer.v_pool[holes].any() for layer in slot.paged_layers)
    assert source.session.peek_observation() is not None and not source.evicted
    config, lens = patch_state(model).config, tuple(ids.shape[1] + 21 - p for p in slot.pads)
    holed = static_plan(config, slot, lens)
    patch_model(model, policy=Dense(), mode="block", block_size=8, dense_layers=(0,))
    other = PagedKVCache(model.config, block_size=8)
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), **{cache_kwarg(model): other})
    slot.load_static(other)
    unpatch_model(model)
    assert slot.static.table.tolist() == [row + [-1] * (len(table[0]) - len(row)) for row in rows]
    assert slot.static.evicted is None and slot.static.held is None and not slot.session.observation_used
    # a step captured over the holes (its dense selection as wide as the table) is not replayed over the whole table
    assert holed.held == len(table[0]) and static_plan(config, slot, lens).key != holed.key


def test_a_refill_leaving_out_blocks_through_the_triton_kernels():
    """The same through the Triton kernels (the interpreter on the CPU), SnapKV alone and with Quest, block mode:
    the dense selection of the blocks held is as wide as the table, mostly ``-1``."""
    model = tiny_model("llama")
    ids, mask = _padded_prompt([61, 44], 61)
    for policy in SNAPKV[:2]:
        patch_model(model, policy=policy, mode="block", block_size=8, dense_layers=(0,), backend="triton")
        eager = PagedKVCache(model.config, block_size=8, backend="triton")
        ref = _eager_padded(model, ids, mask, 8, eager)
        slot, _, _, out = _refilled_leaving_out(model, ids, mask, 8, backend="triton")
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
        assert slot.kv_bytes_read == eager.kv_bytes_read
    unpatch_model(model)


def test_a_refill_refuses_to_leave_out_what_is_not_a_whole_stored_block():
    """``free`` names whole blocks of each stored context, one list per sequence; anything else is refused before
    anything changes."""
    model = tiny_model("llama")
    ids, mask = _padded_prompt([61, 40], 61)
    patch_model(model, policy=SNAPKV[0], mode="block", block_size=8, dense_layers=(0,))
    source, slot = PagedKVCache(model.config, block_size=8), PagedKVCache(model.config, block_size=8)
    with torch.no_grad():
        for cache in (source, slot):
            model(
                ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), **{cache_kwarg(model): cache}
            )
    unpatch_model(model)
    slot.reserve_static(90, any_padding=True)
    before = (slot.static.table.clone(), slot.paged_layers[0].k_pool.clone(), slot.session.observation_used)
    for free, match in [
        ([[1]], "the source holds 2"),
        ([[1], [5]], "whole blocks"),
        ([[7], []], "whole blocks"),
        ([[-1], []], "whole blocks"),
    ]:
        with pytest.raises(ValueError, match=match):  # 40 stored tokens: blocks 0-4 whole; 61: 0-6 (7 is partial)
            slot.load_static(source, free)
    assert torch.equal(slot.static.table, before[0]) and torch.equal(slot.paged_layers[0].k_pool, before[1])
    assert slot.session.observation_used == before[2] and slot.static.evicted is None
    slot.load_static(source, [[6], [4]])  # the last whole block of each
    assert slot.static.evicted == (1, 1)


# ---- left padding and sliding-window layers ----------------------------------------------------------------------


def _padded_prompt(lengths, total):
    """Left-padded ids ``[B, total]`` and their mask (sequence ``b`` holds ``lengths[b]`` real tokens)."""
    ids = prompt(total, batch=len(lengths))
    mask = torch.ones_like(ids)
    for b, n in enumerate(lengths):
        mask[b, : total - n] = 0
        ids[b, : total - n] = 0
    return ids, mask


def _eager_padded(model, ids, mask, n, cache=None):
    """Greedy steps of an eager forward with the growing mask and generate()'s position ids: logits ``[B, n, V]``
    (``cache``: the one to fill, for its counters; default a new one)."""
    cache = PagedKVCache(model.config, block_size=8) if cache is None else cache
    kw = {cache_kwarg(model): cache}
    out = []
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(ids, attention_mask=mask, position_ids=pos, **kw).logits[:, -1:]
        for _ in range(n):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            pos = mask.sum(-1, keepdim=True) - 1
            logits = model(logits.argmax(-1), attention_mask=mask, position_ids=pos, **kw).logits
            out.append(logits)
    return torch.cat(out, 1)


def _static_padded(model, ids, mask, n, graph_path: bool = False, **runner):
    """Prefill the left-padded ``ids``, then ``n`` greedy static steps (captured on CUDA; ``graph_path``: through the
    graph path on any device, for a stand-in ``_capture``): the cache (its runner in ``cache.session.graphs``) and
    the logits ``[B, n, V]``."""
    cache = PagedKVCache(model.config, block_size=8)
    out = []
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(ids, attention_mask=mask, position_ids=pos, **{cache_kwarg(model): cache}).logits[:, -1:]
        graphs = DecodeGraphs(model, cache, ids.shape[1] + n, capture=DEVICE.type == "cuda", **runner)
        graphs.capture = graphs.capture or graph_path
        for _ in range(n):
            logits = graphs.step(logits.argmax(-1))  # position ids from the padding buffer
            out.append(logits)
    return cache, torch.cat(out, 1)


@pytest.mark.parametrize("policy", POLICIES[:3], ids=lambda p: f"{type(p).__name__}-{getattr(p, 'budget', '')}")
def test_static_step_of_a_left_padded_batch_equals_eager(policy):
    model = tiny_model("llama")
    ids, mask = _padded_prompt([37, 20, 29], 37)
    patch_model(model, policy=policy, mode="block", block_size=8, dense_layers=(0,))
    ref = _eager_padded(model, ids, mask, 20)
    cache, out = _static_padded(model, ids, mask, 20)
    unpatch_model(model)
    assert cache.pads == [0, 17, 8]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_static_step_with_sliding_window_layers_equals_eager(arch, padded):
    """Gemma-3 (sliding and full layers alternate) and Mistral with a window (every layer sliding, so nothing is
    paged): the ring of a static step holds what transformers' sliding layer holds, and the window moves past it
    (window 24, prompt 30, 20 steps)."""
    model = tiny_model(arch)
    ids, mask = _padded_prompt([30, 17] if padded else [30, 30], 30)
    patch_model(model, policy=Quest(budget=16, sink=4, window=8), mode="block", block_size=8, dense_layers=())
    ref = _eager_padded(model, ids, mask, 20)
    cache, out = _static_padded(model, ids, mask, 20)
    unpatch_model(model)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert cache.get_seq_length() == 50
    cache.reset()
    assert all(type(layer).__name__ != "WindowRing" for layer in cache.layers), "reset gives the layers back"


# ---- one graph per plan key: a new per-sequence count replays the graph of its width -----------------------------


class _ReplayAtItsPlan:
    """A CUDA graph's stand-in on the CPU: captured at one step, its replay runs the step again with the host
    decisions of that step (its plan) on the device buffers of the step now, which is what a real replay does."""

    def __init__(self, runner: DecodeGraphs):
        self.runner, self.plan = runner, runner.static.plan
        self.logits = runner._forward()

    def replay(self) -> None:
        now = self.runner.static.plan
        self.runner.static.plan = self.plan
        try:
            self.logits.copy_(self.runner._forward())
        finally:
            self.runner.static.plan = now


def _capture_stand_in(runner: DecodeGraphs) -> tuple:
    """In place of :meth:`DecodeGraphs._capture`: the stand-in graph and its logits."""
    graph = _ReplayAtItsPlan(runner)
    return graph, graph.logits


@pytest.mark.parametrize(
    "policy, mode",
    [
        (Quest(budget=0.25, sink=0, window=8), "block"),
        (Quest(budget=0.25, sink=4, window=8), "mask"),
        (TokenTopK(budget=0.25, sink=4, window=8), "token"),
        (QuantBlockTopK(budget=0.25, sink=4, window=8, bits=4), "block"),
    ],
    ids=["quest-block", "quest-mask", "token_topk", "quant4"],
)
def test_a_left_padded_batch_captures_a_graph_per_width_not_per_count(monkeypatch, policy, mode):
    """Sequences of a left-padded batch cross block boundaries at different steps: the plans differ in their
    per-sequence counts far more often than in their widths. Graphs keyed on the widths, replayed at plans with
    other counts (read from the device buffer), decode as the eager steps do."""
    from hf_sparse_kv import graphs

    model = tiny_model("llama")
    ids, mask = _padded_prompt([60, 51, 56], 60)  # past the sink + window floor: every count moves
    patch_model(model, policy=policy, mode=mode, block_size=8, dense_layers=(0,))
    ref = _eager_padded(model, ids, mask, 20)
    plans = []
    begin = graphs.begin_static_step
    monkeypatch.setattr(graphs, "begin_static_step", lambda *a, **k: plans.append(begin(*a, **k)) or plans[-1])
    monkeypatch.setattr(DecodeGraphs, "_capture", _capture_stand_in)
    cache, out = _static_padded(model, ids, mask, 20, graph_path=True)
    unpatch_model(model)
    runner = cache.session.graphs
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert runner.replays == 20
    assert len(runner.graphs) == len({p.key for p in plans}) < len(set(plans))
    assert runner.capture_seconds > 0  # the captures' own time, which benchmarks/time_needle_batch.py reports


@pytest.mark.parametrize(
    "policy, mode",
    [
        (Quest(budget=0.5, sink=0, window=8), "block"),
        (Quest(budget=0.5, sink=4, window=8), "mask"),
        (TokenTopK(budget=0.5, sink=4, window=8), "token"),
        (SinkWindow(sink=4, budget=0.5), "block"),
        (QuantBlockTopK(budget=0.5, sink=4, window=8, bits=4), "block"),
        (Fp8BlockTopK(budget=0.5, sink=4, window=8), "block"),
        (TwoStageBlockTopK(budget=0.25, sink=4, window=8, candidates=2.5), "block"),
        (TopPBlockTopK(budget=0.25, sink=4, window=8, candidates=2, p=0.9), "block"),
    ],
    ids=["quest-block", "quest-mask", "token_topk", "sink_window", "quant4", "fp8", "two_stage", "top_p"],
)
def test_a_wide_selection_is_rounded_up_and_replays_fewer_graphs(monkeypatch, policy, mode):
    """Past 64 entries a static step's width is its plan's largest count rounded up (``static_width``): the slots
    past each sequence's count are ``-1``, so the steps decode as the eager ones, and a width that grows by one
    every few tokens makes a new graph only when its rounded value changes."""
    from hf_sparse_kv import graphs

    model = tiny_model("llama", max_position_embeddings=4096)
    ids = prompt(2100)  # 263 blocks of 8: Quest's width 132 (rounded to multiples of 4), TokenTopK's 1050 (of 32)
    patch_model(model, policy=policy, mode=mode, block_size=8, dense_layers=(0,))
    ref = _eager_steps(model, ids, 40)
    plans = []
    begin = graphs.begin_static_step
    monkeypatch.setattr(graphs, "begin_static_step", lambda *a, **k: plans.append(begin(*a, **k)) or plans[-1])
    monkeypatch.setattr(DecodeGraphs, "_capture", _capture_stand_in)
    cache, out = _static_padded(model, ids, torch.ones_like(ids), 40, graph_path=True)  # no padding
    unpatch_model(model)
    runner = cache.session.graphs
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert all(p.widths[0] >= max(p.counts) for p in plans)
    assert any(p.widths[0] > max(p.counts) for p in plans)  # rounded up at some step
    assert len(runner.graphs) == len({p.widths for p in plans}) < len({max(p.counts) for p in plans})


@pytest.mark.skipif(DEVICE.type != "cuda", reason="a CUDA model (HF_SPARSE_KV_TEST_DEVICE=cuda)")
def test_the_reference_backend_decodes_its_static_steps_uncaptured_on_a_gpu():
    """The reference ops index by data-dependent masks (host syncs): capturing them failed with a raw CUDA error
    (``operation not permitted when stream is capturing``) at the first decode step. They now run uncaptured, with
    a warning at patch time, and decode as the eager steps do."""
    model = tiny_model("llama")
    ids = prompt(60)
    policy = Quest(budget=24, sink=4, window=8)
    patch_model(model, policy=policy, block_size=8, backend="reference")
    want, _ = greedy(model, ids, new_tokens=12)
    with pytest.warns(UserWarning, match="backend='reference'"):
        patch_model(model, policy=policy, block_size=8, backend="reference", cuda_graph=True, merge_projections=False)
    try:
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, return_dict_in_generate=True
            )
        assert torch.equal(out.sequences, want)
        runner = out.past_key_values.session.graphs
        assert isinstance(runner, DecodeGraphs) and runner.replays == 0 and not runner.graphs
    finally:
        unpatch_model(model)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="a CUDA model (HF_SPARSE_KV_TEST_DEVICE=cuda)")
def test_a_runner_captures_again_into_its_pool_after_every_graph_was_freed():
    """A runner whose graphs were all freed (cleared, as a new position-ids shape clears them) while a tensor their
    capture allocated in the pool lives on (here their logits) captures into its pool again and replays right. With
    a bare ``graph_pool_handle()`` the last graph took the pool's only reference with it, the live tensor kept the
    allocator from releasing the pool, and the next capture failed inside the caching allocator
    (``use_count > 0``; a repro without the library in benchmarks/RESULTS.md, 2026-12-06)."""
    import gc

    model = tiny_model("llama")
    ids = prompt(60)
    patch_model(model, policy=Quest(budget=24, sink=4, window=8), block_size=8, dense_layers=(0,))
    try:
        ref = _eager_steps(model, ids, 8)
        cache = PagedKVCache(model.config, block_size=8)
        out = []
        with torch.no_grad():
            logits = model(ids, **{cache_kwarg(model): cache}).logits[:, -1:]
            runner = DecodeGraphs(model, cache, max_length=ids.shape[1] + 8)
            for i in range(8):
                if i == 4:
                    alive = [captured for _, captured in runner.graphs.values()]  # allocated in the pool
                    assert alive
                    runner.graphs.clear()
                    gc.collect()
                logits = runner.step(logits.argmax(-1))
                out.append(logits)
        assert runner.graphs and runner.replays >= 4 and alive
        torch.testing.assert_close(torch.cat(out, 1), ref, rtol=0, atol=1e-4)
    finally:
        unpatch_model(model)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="a CUDA model (HF_SPARSE_KV_TEST_DEVICE=cuda)")
def test_a_bare_pool_handle_is_refused_before_the_cache_is_reserved():
    model = tiny_model("llama")
    ids = prompt(60)
    patch_model(model, policy=Quest(budget=24, sink=4, window=8), block_size=8, dense_layers=(0,))
    try:
        cache = PagedKVCache(model.config, block_size=8)
        with torch.no_grad():
            model(ids, **{cache_kwarg(model): cache})
        with pytest.raises(TypeError, match="graph_pool"):
            DecodeGraphs(model, cache, ids.shape[1] + 8, pool=torch.cuda.graph_pool_handle())
        assert cache.static is None and cache.session.graphs is None
        runner = DecodeGraphs(model, cache, ids.shape[1] + 8, pool=graph_pool())
        assert isinstance(runner.pool, torch.cuda.MemPool)
    finally:
        unpatch_model(model)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="a cache on the CPU")
def test_a_cpu_cache_is_not_captured_on_a_machine_with_a_gpu(monkeypatch):
    """A cache on the CPU whose ops would capture (the Triton backend: here its interpreter) decodes its static steps
    uncaptured even where a GPU is present (stood in for here): a CUDA graph would hold none of its ops and its
    replays would do nothing (the GPU test suite's dry runs warned "The CUDA Graph is empty", 2026-12-06)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = tiny_model("llama")
    ids = prompt(40)
    patch_model(model, policy=Quest(budget=24, sink=4, window=8), block_size=8, dense_layers=(0,), backend="triton")
    try:
        cache = PagedKVCache(model.config, block_size=8, backend="triton")
        with torch.no_grad():
            logits = model(ids, **{cache_kwarg(model): cache}).logits[:, -1:]
            runner = DecodeGraphs(model, cache, ids.shape[1] + 4)
            assert not runner.capture and runner.pool is None
            for _ in range(4):
                logits = runner.step(logits.argmax(-1))
        assert runner.replays == 0 and not runner.graphs and logits.isfinite().all()
    finally:
        unpatch_model(model)
