"""What a static decode step runs per layer (the step a CUDA graph captures, run on the CPU without a graph): its
attention launches the sparse ops and nothing else, and its host part counts what the eager step counts.

Index tensors that are the same for every layer (a dense layer's selection) are made once and kept with the
reservation, and a padded batch's per-sequence counts are a buffer the host part fills before the step; a captured
graph replays every kernel of every layer, so anything computed per layer is paid per layer at every token."""

import pytest
import torch
from tiny_models import prompt, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from hf_sparse_kv import PagedKVCache, attention, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.crossover import CrossoverTable
from hf_sparse_kv.graphs import DecodeGraphs
from hf_sparse_kv.policies import Dense, Quest

pytestmark = pytest.mark.usefixtures("one_thread")


class _OpsInAttention(TorchDispatchMode):
    """The ops each call of :func:`hf_sparse_kv.attention.static_attention` dispatches (views excluded), by layer."""

    def __init__(self):
        super().__init__()
        self.layer = None
        self.ops: dict[int, list[str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.layer is not None and not func.is_view:
            self.ops.setdefault(self.layer, []).append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _record_step(monkeypatch, runner, token) -> dict[int, list[str]]:
    """Run one static step and return the non-view ops of each paged layer's attention."""
    rec = _OpsInAttention()
    inner = attention.static_attention

    def recorded(config, cache, module, query, scale, **kw):
        rec.layer = module.layer_idx
        rec.ops.setdefault(rec.layer, [])
        try:
            return inner(config, cache, module, query, scale, **kw)
        finally:
            rec.layer = None

    monkeypatch.setattr(attention, "static_attention", recorded)
    with rec:
        runner.step(token)
    monkeypatch.setattr(attention, "static_attention", inner)
    return rec.ops


def _runner(model, ids, mask, steps):
    cache = PagedKVCache(model.config, block_size=8)
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(ids, attention_mask=mask, position_ids=pos, **{cache_kwarg(model): cache}).logits[:, -1:]
    return cache, DecodeGraphs(model, cache, ids.shape[1] + steps, capture=False), logits.argmax(-1)


def _left_padded(lengths, total):
    ids = prompt(total, batch=len(lengths))
    mask = torch.ones_like(ids)
    for b, n in enumerate(lengths):
        mask[b, : total - n] = 0
        ids[b, : total - n] = 0
    return ids, mask


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize(
    "policy,mode",
    [(Dense(), "block"), (Dense(), "token"), (Quest(budget=0.25, sink=4, window=8), "block")],
    ids=["Dense-block", "Dense-token", "Quest-block"],
)
def test_static_attention_launches_only_the_sparse_ops(monkeypatch, policy, mode, padded):
    """Every op of a static step's attention, in every paged layer (dense layer 0 included), is a registered sparse
    op (``hf_sparse_kv::*``: scores, top-k, decode): no per-layer index arithmetic, no per-layer count copies. The
    padded batch's sequences keep different numbers of blocks (per-sequence counts for the top-k). A dense layer in
    token mode reads its blocks with the block kernel (the same rows, without expanding blocks to tokens)."""
    model = tiny_model("llama")
    ids, mask = _left_padded([200, 64, 120] if padded else [200] * 3, 200)
    patch_model(model, policy=policy, mode=mode, block_size=8, dense_layers=(0,))
    cache, runner, token = _runner(model, ids, mask, 4)
    with torch.no_grad():
        plans = []
        for _ in range(2):  # the first steps of a plan make what the reservation keeps
            runner.step(token)
            plans.append(cache.static.plan)
        ops = _record_step(monkeypatch, runner, token)
    plans.append(cache.static.plan)
    unpatch_model(model)
    assert plans[1] == plans[2], "the recorded step runs the plan of the step before"
    if padded and not isinstance(policy, Dense):
        assert len(set(plans[2].counts)) > 1, "the padded batch plans different widths per sequence"
    assert sorted(ops) == [i for i, layer in enumerate(cache.layers) if type(layer).__name__ == "PagedLayer"]
    assert all(ops.values()), f"a layer ran no op: {ops}"
    other = {layer: [n for n in names if not n.startswith("hf_sparse_kv.")] for layer, names in ops.items()}
    assert not any(other.values()), f"ops other than the sparse ops, by layer: {other}"


def _eager_counters(model, ids, mask, steps):
    cache = PagedKVCache(model.config, block_size=8)
    kw = {cache_kwarg(model): cache}
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(ids, attention_mask=mask, position_ids=pos, **kw).logits[:, -1:]
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            pos = mask.sum(-1, keepdim=True) - 1
            logits = model(logits.argmax(-1), attention_mask=mask, position_ids=pos, **kw).logits
    return cache.session.counters


TABLE = CrossoverTable(  # mode="auto": dense below 70 tokens, sparse from there (the steps cross it)
    [{"budget": 0.25, "batch": 1, "num_kv_heads": 2, "head_dim": 16, "crossover": 70}], max_context=1 << 20
)


@pytest.mark.parametrize("mode", ["mask", "token", "block", "auto"])
def test_static_counters_equal_the_eager_ones_and_are_planned_once_per_plan(monkeypatch, mode):
    """A left-padded batch decodes 20 static steps across block boundaries and plan changes (and, in
    ``mode="auto"``, the crossover): the counters (steps, K/V bytes, auto choices) are the eager step's, and the
    per-layer byte count (:func:`hf_sparse_kv.attention.kv_bytes`) runs once per layer and plan, not per step."""
    model = tiny_model("llama")
    ids, mask = _left_padded([60, 41, 53], 60)
    table = {"crossover": TABLE} if mode == "auto" else {}
    patch_model(model, policy=Quest(budget=0.25, sink=4, window=8), mode=mode, block_size=8, dense_layers=(0,), **table)
    ref = _eager_counters(model, ids, mask, 20)
    cache, runner, token = _runner(model, ids, mask, 20)
    calls, inner = [], attention.kv_bytes
    monkeypatch.setattr(attention, "kv_bytes", lambda *a: calls.append(1) or inner(*a))
    plans = set()
    with torch.no_grad():
        for _ in range(20):
            token = runner.step(token).argmax(-1)
            plans.add(cache.static.plan)
    unpatch_model(model)
    assert cache.session.counters == ref
    assert ref.kv_bytes_read > 0 and (mode != "auto" or ref.auto_steps["dense"] and ref.auto_steps["sparse"])
    assert len(plans) > 1
    assert len(calls) <= len(plans) * len(cache.paged_layers)


class _OutputShapes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out])
                        if isinstance(t, torch.Tensor)]  # fmt: skip
        return out


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_captured_step_builds_no_mask_of_the_reserved_length(arch):
    """No layer of a reserved cache reads the forward's mask (paged layers read the buffers, sliding rings mask
    themselves), so a :class:`DecodeGraphs` step does not let transformers build one (a reserved cache is
    "compileable", and transformers then builds the mask at every single-token step: ``[B, 1, 1, max_length]``)."""
    model = tiny_model(arch)
    ids, mask = _left_padded([37, 30], 37)
    patch_model(model, policy=Quest(budget=16, sink=4, window=8), mode="block", block_size=8, dense_layers=())
    cache, runner, token = _runner(model, ids, mask, 24)  # reserves 61 tokens per sequence
    rec = _OutputShapes()
    with torch.no_grad(), rec:
        runner.step(token)
    unpatch_model(model)
    assert cache.static.max_length == 61 and rec.shapes
    assert not [s for s in rec.shapes if s and s[-1] == 61], "a tensor of the reserved length was built"


class _HostOps(TorchDispatchMode):
    """The ops a :class:`DecodeGraphs` step dispatches outside its ``_forward`` (the part a captured graph holds):
    what the host launches before (and after) the replay, views excluded."""

    def __init__(self, runner):
        super().__init__()
        self.inside = False
        self.ops: list[str] = []
        inner = runner._forward

        def forward():
            self.inside = True
            try:
                return inner()
            finally:
                self.inside = False

        runner._forward = forward

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside and not func.is_view:
            self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("given", [False, True], ids=["positions-default", "positions-given"])
def test_the_host_part_of_a_step_at_the_next_frame_fills_no_length(given):
    """A step at the frame the previous one left launches on the host only the position ids (copied, or made from
    the frame) and the token's copy before the forward, and the logits' copy after it: the frame is moved on by the
    step itself and the lengths derived from it inside the step (launches the GPU would wait for, tens of µs each on
    a loaded host). The steps stay the eager ones, and the frame buffer holds the next frame after each step."""
    model = tiny_model("llama")
    ids, mask = _left_padded([60, 41, 53], 60)
    patch_model(model, policy=Quest(budget=0.25, sink=4, window=8), mode="block", block_size=8, dense_layers=(0,))
    cache, runner, token = _runner(model, ids, mask, 8)
    eager = PagedKVCache(model.config, block_size=8)
    kw = {cache_kwarg(model): eager}
    rec = _HostOps(runner)
    first, later = [], []
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        model(ids, attention_mask=mask, position_ids=pos, **kw)
        ref_mask = mask
        for i in range(6):
            ref_mask = torch.cat([ref_mask, torch.ones_like(mask[:, :1])], 1)
            step_pos = ref_mask.sum(-1, keepdim=True) - 1
            ref = model(token, attention_mask=ref_mask, position_ids=step_pos, **kw).logits
            filled = cache.static.filled
            with rec:
                got = runner.step(token, step_pos if given else None)
            # a plan's per-sequence counts change every few blocks: each changed one is filled (kernel argument)
            changed = sum(a != b for a, b in zip(filled, cache.static.filled)) if filled else 0
            (first if i == 0 else later).append(
                [op for op in rec.ops if op != "aten.fill_"] + ["fill"] * (rec.ops.count("aten.fill_") - changed)
            )
            rec.ops = []
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
            assert int(cache.static.frame) == cache.get_seq_length(), "the step moved the frame on"
            token = ref.argmax(-1)
    unpatch_model(model)
    assert "fill" in first[0], "the first step fills the frame"
    expected = ["aten.copy_" if given else "aten.sub", "aten.copy_", "aten.clone"]
    assert all(ops == expected for ops in later), later


class _Replay:
    """A captured graph's stand-in on the CPU: its replay records what the host holds when the GPU would start the
    step (the cache's length and the steps counted)."""

    def __init__(self, cache):
        self.cache, self.seen = cache, []

    def replay(self):
        self.seen.append((self.cache.get_seq_length(), self.cache.session.counters.decode_steps))


def test_a_replayed_step_does_its_host_bookkeeping_after_launching(monkeypatch):
    """A replay reads no host state, so :class:`DecodeGraphs` moves the layers' lengths on and counts the step after
    launching it (the host's bookkeeping overlaps the GPU's step); a step that captures (or runs uncaptured) does it
    first, as the model's Python may read the lengths. Either way, once a step returns its lengths and counters are
    the eager step's."""
    model = tiny_model("llama")
    ids, mask = _left_padded([60, 41, 53], 60)
    patch_model(model, policy=Quest(budget=0.25, sink=4, window=8), mode="block", block_size=8, dense_layers=(0,))
    ref = _eager_counters(model, ids, mask, 6)
    cache, runner, token = _runner(model, ids, mask, 6)
    graph = _Replay(cache)
    monkeypatch.setattr(runner, "_capture", lambda: (graph, torch.zeros(3, 1, model.config.vocab_size)))
    runner.capture = True  # the captured path, with the stand-in graph
    before = []
    with torch.no_grad():
        for _ in range(6):
            before.append((cache.get_seq_length(), cache.session.counters.decode_steps))
            runner.step(token)
    unpatch_model(model)
    first_key_steps = 1  # the first step captures: its bookkeeping runs before its (first) replay
    assert graph.seen[0] == (before[0][0] + 1, before[0][1] + 1)
    assert graph.seen[first_key_steps:] == before[first_key_steps:], "a replay launched before the bookkeeping"
    assert runner.replays == 6 and cache.get_seq_length() == before[0][0] + 6
    assert cache.session.counters == ref
