"""A refill of a reserved cache from the contents it held last (``PagedKVCache.load_static``, the suite's turns of
one batch on its kept slot) rewrites only what changed: the blocks the static steps wrote since, and the blocks
whose hole status changed. Every tensor then ends bit for bit as a whole refill leaves it; a source that changed
since, or another object, is refilled whole."""

import copy

import pytest
import torch
from tiny_models import tiny_model

from evaluation.needle import pad_left
from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.cache import PagedLayer
from hf_sparse_kv.graphs import DecodeGraphs
from hf_sparse_kv.policies import QuantBlockTopK, Quest, SnapKV
from hf_sparse_kv.static import WindowRing

BS = 8


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (n,), generator=g).tolist() for n in lengths]


def _prefill(model, prompts) -> PagedKVCache:
    ids, mask, pos = pad_left(prompts, model.device)
    cache = PagedKVCache(model.config, block_size=BS)
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=pos, **{cache_kwarg(model): cache}, use_cache=True)
    return cache


def _slot(model, lengths, reserve: int) -> PagedKVCache:
    """A reservation made from other contents (so that a refill must replace them)."""
    slot = _prefill(model, _prompts(99, lengths))
    slot.reserve_static(reserve, any_padding=True)
    return slot


def _steps(model, slot: PagedKVCache, n: int) -> None:
    """``n`` static steps on ``slot`` (eager on the CPU: what a captured step writes)."""
    runner = DecodeGraphs(model, slot, slot.static.max_length, capture=False)
    token = torch.full((len(slot.table.rows), 1), 7, dtype=torch.long, device=model.device)
    with torch.no_grad():
        for _ in range(n):
            token = runner.step(token)[:, -1:].argmax(-1)


def _held(slot: PagedKVCache) -> list[torch.Tensor]:
    """Every tensor a refill writes, cloned: the paged layers' pools, metadata and state, the rings, the step's
    table and padding, and the lengths."""
    out = []
    for layer in slot.layers:
        if isinstance(layer, PagedLayer):
            out += [t.clone() for t in layer._tensors()] + [torch.tensor(layer.length)]
        elif isinstance(layer, WindowRing):
            out += [layer.keys.clone(), layer.values.clone()]
    return out + [slot.static.table.clone(), slot.static.pads.clone(), torch.tensor(slot.pads)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def spy(monkeypatch):
    """The refills per layer: whether whole (``zero`` not given) and how many blocks each copied."""
    calls = []
    load = PagedLayer.load

    def recording(self, source, length, dst, src, zero=None):
        calls.append((zero is None, dst.numel()))
        return load(self, source, length, dst, src, zero)

    monkeypatch.setattr(PagedLayer, "load", recording)
    return calls


CASES = [  # (arch, policy, the blocks left out at each of three refills)
    ("llama", Quest(budget=0.25, sink=4, window=16), [None, None, None]),
    ("llama", SnapKV(budget=0.3, sink=4, window=8, observe=8), [[[1, 2], [3]], [[2, 4], [1]], [[2], [1]]]),
    ("llama", QuantBlockTopK(budget=0.25, sink=4, window=16, bits=4), [None, None, None]),  # per-token state
    ("llama", QuantBlockTopK(budget=0.25, sink=4, window=16, bits=4), [[[1]], [[1, 3]], [[1, 3]]]),  # state + holes
    ("gemma3", Quest(budget=0.25, sink=4, window=16), [None, [[2], [1, 3]], None]),  # sliding layers: rings
]


@pytest.mark.parametrize(("arch", "policy", "frees"), CASES, ids=lambda x: getattr(x, "__name__", None))
def test_a_refill_from_the_same_contents_ends_as_a_whole_refill(arch, policy, frees, spy):
    """Refills from one prefill, static steps between them: each refill after the first leaves every tensor as a
    whole refill (from a copy of the prefill, another object) leaves it, having copied only the tail blocks and
    the holes that moved; with declared state and holes that moved, it refills whole."""
    model = tiny_model(arch)
    prompts = _prompts(5, (61, 44))[: 1 if any(f is not None and len(f) == 1 for f in frees) else 2]
    patch_model(model, policy=policy, mode="block", block_size=BS, dense_layers=(0,))
    try:
        source = _prefill(model, prompts)
        slot = _slot(model, [50] * len(prompts), 90)
        twin = copy.deepcopy(slot)  # the same reservation, refilled whole every time
        full_blocks = sum(len(r) for r in source.table.rows)
        for i, free in enumerate(frees):
            spy.clear()
            before = _held(slot)
            slot.load_static(source, free)
            got = _held(slot)
            whole = i == 0 or (bool(policy.cache_state()) and free != frees[i - 1])
            assert spy and all(w == whole for w, _ in spy), (i, spy[:2])
            if not whole:  # the tail blocks and the moved holes only
                last, now = (f or [[]] * len(prompts) for f in frees[i - 1 : i + 1])
                moved = sum(len(set(a) ^ set(b)) for a, b in zip(last, now))
                assert all(n <= 2 * len(prompts) + moved < full_blocks for _, n in spy), spy[:2]
                assert not _same(before, got)  # the steps had written: there was something to undo
            spy.clear()
            twin.load_static(copy.deepcopy(source), free)  # another object: a whole refill
            assert spy and all(w for w, _ in spy)
            assert _same(got, _held(twin)), f"refill {i} differs from a whole refill"
            _steps(model, slot, 5)
    finally:
        unpatch_model(model)


def test_a_source_written_since_or_a_reset_slot_is_refilled_whole(spy):
    """The stamp: a source written since the last refill (cropped by two tokens and given two others: the same
    length, other contents, no decode step) is refilled whole, and so is anything after the slot's reset."""
    model = tiny_model("llama")
    patch_model(model, policy=Quest(budget=0.25, sink=4, window=16), mode="block", block_size=BS, dense_layers=(0,))
    try:
        prompts = _prompts(6, (61, 44))
        source = _prefill(model, prompts)
        slot = _slot(model, (50, 50), 90)
        twin = copy.deepcopy(slot)
        slot.load_static(source)
        _steps(model, slot, 3)
        length = source.get_seq_length()
        source.crop(length - 2)
        ids, mask, pos = pad_left(prompts, model.device)
        with torch.no_grad():  # two tokens: a write that is not a decode step
            model(
                torch.full_like(ids[:, -2:], 11), attention_mask=mask, position_ids=pos[:, -2:],
                **{cache_kwarg(model): source}, use_cache=True,
            )  # fmt: skip
        assert source.get_seq_length() == length
        spy.clear()
        slot.load_static(source)
        assert spy and all(w for w, _ in spy)
        twin.load_static(copy.deepcopy(source))
        assert _same(_held(slot), _held(twin))
        spy.clear()
        slot.load_static(source)  # unchanged now, no step since: partial, nothing but the tails
        assert spy and not any(w for w, _ in spy)
        assert _same(_held(slot), _held(twin))
        spy.clear()
        slot.load_static(source, whole=True)  # asked for: whole all the same, the same contents
        assert spy and all(w for w, _ in spy) and _same(_held(slot), _held(twin))
        slot.reset()
        assert slot._refill is None
    finally:
        unpatch_model(model)
