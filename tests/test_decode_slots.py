"""Captured decode steps kept across batches: ``PagedKVCache.load_static`` refills a reserved cache in place,
``DecodeGraphs.rebind`` takes the model patched again, and :class:`evaluation.slots.DecodeSlots` decodes a suite
job's batches with each policy's steps captured once. The tokens equal the eager steps'; a step on a refilled slot
reads the same tensors and the same host values as on the slot's first contents (what a CUDA graph replays)."""

import pytest
import torch
from tiny_models import DEVICE, batch_policies, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from evaluation.needle import PhaseClock, first_step_frees, greedy_batch, pad_left
from evaluation.slots import DecodeSlots
from hf_sparse_kv import PagedKVCache, cache_kwarg, is_patched, patch_model, unpatch_model
from hf_sparse_kv.graphs import DecodeGraphs
from hf_sparse_kv.policies import Dense, QuantBlockTopK, Quest, SnapKV, TokenTopK


def _prefill(model, prompts: list[list[int]], block_size: int = 8) -> tuple[PagedKVCache, tuple]:
    """A left-padded prefill of ``prompts`` minus their last tokens: the cache and (ids, mask, positions)."""
    ids, mask, pos = pad_left(prompts, model.device)
    cache = PagedKVCache(model.config, block_size=block_size)
    with torch.no_grad():
        model(
            ids[:, :-1], attention_mask=mask[:, :-1], position_ids=pos[:, :-1],
            **{cache_kwarg(model): cache}, use_cache=True,
        )  # fmt: skip
    return cache, (ids, mask, pos)


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (n,), generator=g).tolist() for n in lengths]


# batches of one job: other paddings (the first sequence unpadded, then padded most), one longer than the first
BATCHES = [(150, 133, 141), (128, 150, 139), (140, 131, 158)]


@pytest.mark.parametrize("arch,mode", [("llama", "block"), ("llama", "token"), ("llama", "mask"), ("gemma3", "block")])
def test_slots_across_batches_give_the_eager_tokens(arch, mode):
    """Three batches of one job through one :class:`DecodeSlots`: each batch's answers equal its eager answers for
    every policy (a policy with per-token state, quant4, included; SnapKV, which frees the prompt's blocks at its
    first step, alone, sharing its observation with another budget, and with Quest over what it keeps); one slot is
    made, refilled for every policy of every batch, and each policy keeps one runner (``DecodeGraphs``) for the
    whole job."""
    model = tiny_model(arch)
    policies = batch_policies()  # quant4: per-token state in the cache
    snap = {"sink": 4, "window": 16, "observe": 8}
    policies["snapkv 1/4"] = SnapKV(budget=0.25, **snap)  # observes as "snapkv" does: one pass for the two
    policies["snapkv+quest"] = SnapKV(budget=0.5, then=Quest(budget=0.25, sink=4, window=16), **snap)
    args = {"dense_layers": (0,), "block_size": 8, "mode": mode}
    slots = DecodeSlots(margin=16)
    runners = {}
    for i, lengths in enumerate(BATCHES):
        batch = _prompts(10 + i, lengths)
        eager = greedy_batch(model, batch, policies, 6, **args)
        clock = PhaseClock()
        assert greedy_batch(model, batch, policies, 6, static=True, slots=slots, clock=clock, **args) == eager
        assert set(slots.runners) == set(policies)  # SnapKV too: its freed blocks left out of the refill
        if i == 0:
            runners = dict(slots.runners)
        assert all(slots.runners[k] is r for k, r in runners.items()), "each policy's runner kept"
        assert set(clock.per_key) == set(policies)
    assert slots.slots_made == 1 and slots.loads == 3 * len(policies)
    assert not is_patched(model)


def test_a_longer_batch_or_another_size_makes_a_new_slot():
    model = tiny_model("llama")
    policies = {"quest": Quest(budget=0.25, sink=4, window=16)}
    args = {"dense_layers": (0,), "block_size": 8, "mode": "block"}
    slots = DecodeSlots(margin=0)
    for lengths, made in [((150, 133), 1), ((149, 140), 1), ((160, 133), 2), ((120, 133, 99), 3)]:
        batch = _prompts(len(lengths) + lengths[0], lengths)
        eager = greedy_batch(model, batch, policies, 5, **args)
        assert greedy_batch(model, batch, policies, 5, static=True, slots=slots, **args) == eager
        assert slots.slots_made == made
    with pytest.raises(ValueError, match="margin"):
        DecodeSlots(margin=-1)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="a CUDA model (HF_SPARSE_KV_TEST_DEVICE=cuda)")
def test_a_slot_made_after_the_last_graphs_of_the_pool_were_freed_captures_into_it(monkeypatch):
    """A new slot replaces the only one (a longer batch) and the garbage collector frees the old runners' graphs
    before the new runner captures into the shared pool: the capture works and the answers equal the eager ones.
    With the pool a bare ``graph_pool_handle()`` the test above failed once in two GPU runs (2026-12-06) inside the
    caching allocator (``use_count > 0``): a capture into a pool whose graphs were all freed while memory they
    allocated lived on."""
    import gc

    make = DecodeSlots._slot

    def slot_then_collect(self, *args):
        slot = make(self, *args)
        gc.collect()
        return slot

    monkeypatch.setattr(DecodeSlots, "_slot", slot_then_collect)
    model = tiny_model("llama")
    policies = {"quest": Quest(budget=0.25, sink=4, window=16)}
    args = {"dense_layers": (0,), "block_size": 8, "mode": "block"}
    slots = DecodeSlots(margin=0, keep=1)
    for lengths, made in [((150, 133), 1), ((160, 133), 2), ((120, 133, 99), 3)]:
        batch = _prompts(len(lengths) + lengths[0], lengths)
        eager = greedy_batch(model, batch, policies, 5, **args)
        assert greedy_batch(model, batch, policies, 5, static=True, slots=slots, **args) == eager
        assert slots.slots_made == made and len(slots.kept) == 1


def test_every_runner_of_every_slot_captures_into_one_graph_pool(monkeypatch):
    """On a GPU every policy's ``DecodeGraphs`` on every slot (here two batch sizes) captures into the one pool of
    the ``DecodeSlots`` (a ``graphs.graph_pool()``), asked for once; ``drop`` lets go of it. The GPU is stood in for:
    the pool is a counter, the runners record the pool they are given."""
    from evaluation import slots as slots_module

    handles = iter(range(100))
    given = []

    class Recorder(DecodeGraphs):
        def __init__(self, *args, pool=None, **kwargs):
            given.append(pool)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(slots_module, "DecodeGraphs", Recorder)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(slots_module, "graph_pool", lambda device: next(handles))
    model = tiny_model("llama")
    slots = DecodeSlots(margin=16)
    for prompts in (_prompts(3, (150, 133)), _prompts(4, (150, 133, 140))):
        prefix, _ = _prefill(model, prompts)
        for key, policy in (("quest", Quest(budget=0.25, sink=4, window=16)), ("dense", Dense())):
            patch_model(model, policy=policy, dense_layers=(0,), block_size=8)
            slots.decode(model, key, prefix, 160 + 8, [Quest(budget=0.25, sink=4, window=16)])
    unpatch_model(model)
    assert given == [0, 0, 0, 0] and slots.slots_made == 2 and sorted(slots.kept) == [2, 3]
    slots.drop()
    assert slots.pool is None and not slots.kept and slots.cache is None and slots.runners == {}


def test_slots_are_kept_per_batch_size_across_jobs():
    """Batches of three, then two, then three prompts again (a job's last, smaller batch, then the next job): the
    slot of three and its runners are found again (no capture anew), the answers equal the eager ones; with
    ``keep=1`` the slot of two pushes it out and the third batch makes a new one; the least recently used goes
    first."""
    model = tiny_model("llama")
    policies = {"quest": Quest(budget=0.25, sink=4, window=16), "dense": Dense()}
    args = {"dense_layers": (0,), "block_size": 8, "mode": "block"}
    batches = [(150, 133, 141), (128, 150), (140, 131, 149)]
    for keep, made in ((3, 2), (1, 3)):
        slots, first = DecodeSlots(margin=16, keep=keep), None
        for i, lengths in enumerate(batches):
            batch = _prompts(20 + i, lengths)
            eager = greedy_batch(model, batch, policies, 5, **args)
            assert greedy_batch(model, batch, policies, 5, static=True, slots=slots, **args) == eager
            if i == 0:
                first = dict(slots.runners)
        assert slots.slots_made == made and len(slots.kept) == min(keep, 2)
        kept = all(slots.runners[k] is r for k, r in first.items())
        assert kept == (keep > 1), "the runners of three prompts kept only while their slot is"
    slots = DecodeSlots(keep=2)
    patch_model(model, policy=Dense(), dense_layers=(0,), block_size=8)
    for n in (3, 2, 4):  # the slot of three is the least recently used when four arrives
        slots.decode(model, "dense", _prefill(model, _prompts(30 + n, [60] * n))[0], 70, [Dense()])
    unpatch_model(model)
    assert list(slots.kept) == [2, 4]
    with pytest.raises(ValueError, match="keep"):
        DecodeSlots(keep=0)


def test_a_job_of_policies_keeping_other_state_under_one_name_decodes_as_eager():
    """2- and 4-bit ``QuantBlockTopK`` keep other codes under one name (``kcodes``), two ``Fp8BlockTopK`` budgets the
    same float8 keys: on slots each policy decodes with its own state (the one decoding now keeps its name; the other
    gets a new slot at its turn) and the float8 state is kept once, so every batch gives the eager tokens (before, the
    slot declared both codes under one name: every write refreshed both into one tensor, a shape error)."""
    from hf_sparse_kv.policies import Fp8BlockTopK

    model = tiny_model("llama")
    f = {"budget": 0.25, "sink": 4, "window": 16}
    policies = {
        "q2": QuantBlockTopK(bits=2, **f),
        "q4": QuantBlockTopK(bits=4, **f),
        "fp8": Fp8BlockTopK(**f),
        "fp8 1/8": Fp8BlockTopK(budget=0.125, sink=4, window=16),
    }
    args = {"dense_layers": (0,), "block_size": 8, "mode": "block"}
    slots = DecodeSlots(margin=16)
    for i, lengths in enumerate(BATCHES[:2]):
        batch = _prompts(10 + i, lengths)
        eager = greedy_batch(model, batch, policies, 4, **args)
        assert greedy_batch(model, batch, policies, 4, static=True, slots=slots, **args) == eager
        names = [spec.name for spec in slots.current.cache.specs]
        assert len(names) == len(set(names)) == 3  # fp8 codes and scales once, one kcodes
    assert not is_patched(model)


def test_load_static_holds_what_the_source_holds():
    """After a refill the slot's context (keys, values in transformers' frame), lengths, padding and declared state
    at every stored position are the source's, whatever the slot held before."""
    model = tiny_model("llama")
    policy = QuantBlockTopK(budget=0.25, sink=4, window=16, bits=4)
    patch_model(model, policy=policy, mode="block", block_size=8, dense_layers=(0,))
    try:
        first, _ = _prefill(model, _prompts(1, (150, 133, 141)))
        slot = first
        slot.reserve_static(200, any_padding=True)
        source, _ = _prefill(model, _prompts(2, (120, 140, 101)))
        slot.load_static(source)
        assert slot.pads == source.pads == [20, 0, 39] and slot.get_seq_length() == source.get_seq_length()
        assert slot.static.pads.tolist() == source.pads
        for mine, theirs in zip(slot.paged_layers, source.paged_layers):
            for a, b in zip(mine.dense_kv(), theirs.dense_kv()):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            for name in theirs.state:  # per token: compare stored positions through each table
                for b, n in enumerate(s - p for s, p in zip([source.get_seq_length()] * 3, source.pads)):
                    for pos in range(n):
                        mb, off = divmod(pos, 8)
                        x = mine.state[name][slot.table.rows[b][mb], :, off]
                        y = theirs.state[name][source.table.rows[b][mb], :, off]
                        assert torch.equal(x, y), (name, b, pos)
    finally:
        unpatch_model(model)


def test_load_static_refuses_what_does_not_fit_and_changes_nothing():
    model = tiny_model("llama")
    patch_model(model, policy=Quest(budget=0.25, sink=4, window=16), mode="block", block_size=8, dense_layers=(0,))
    try:
        slot, _ = _prefill(model, _prompts(1, (150, 133, 141)))
        source, _ = _prefill(model, _prompts(2, (140, 150, 101)))
        with pytest.raises(ValueError, match="reserved for static"):
            slot.load_static(source)
        slot.reserve_static(170)  # rows sized for this batch's padding only
        before = (list(slot.pads), slot.get_seq_length(), slot.paged_layers[0].k_pool.clone())
        with pytest.raises(ValueError, match="any_padding"):  # sequence 0 (pad 0 before) ... now padded less
            slot.load_static(source)
        other, _ = _prefill(model, _prompts(3, (150, 133)))
        with pytest.raises(ValueError, match="2 sequences"):
            slot.load_static(other)
        long, _ = _prefill(model, _prompts(4, (180, 160, 171)))
        with pytest.raises(ValueError, match="tokens per sequence"):
            slot.load_static(long)
        with pytest.raises(ValueError, match="not reserved"):
            slot.load_static(slot)
        assert (list(slot.pads), slot.get_seq_length()) == before[:2]
        assert torch.equal(slot.paged_layers[0].k_pool, before[2])
    finally:
        unpatch_model(model)


def test_rebind_takes_an_equal_patch_and_refuses_another():
    model = tiny_model("llama")
    quest = Quest(budget=0.25, sink=4, window=16)
    patch_model(model, policy=quest, mode="block", block_size=8, dense_layers=(0,))
    cache, (ids, _, pos) = _prefill(model, _prompts(1, (40, 33)))
    runner = DecodeGraphs(model, cache, 60)
    runner.step(ids[:, -1:], position_ids=pos[:, -1:])
    patch_model(model, policy=Dense(), mode="block", block_size=8, dense_layers=(0,))
    with pytest.raises(ValueError, match="other settings"):
        runner.rebind(model)
    with pytest.raises(RuntimeError, match="patched again"):
        runner.step(ids[:, -1:], position_ids=pos[:, -1:] + 1)
    patch_model(model, policy=Quest(budget=0.25, sink=4, window=16), mode="block", block_size=8, dense_layers=(0,))
    runner.rebind(model)  # an equal policy, another object
    assert cache.session.graphs is runner
    runner.step(ids[:, -1:], position_ids=pos[:, -1:] + 1)
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone())
    with pytest.raises(ValueError, match="addresses"):
        runner.rebind(model)
    unpatch_model(model)
    with pytest.raises(ValueError, match="unpatched"):
        runner.rebind(model)


class _Reads(TorchDispatchMode):
    """Every op a forward runs: its name, the host values among its arguments, and for each tensor argument that
    no earlier op of the forward made, its address, shape, strides and dtype; a tensor made from host data
    (``lift_fresh``) records its values. What a CUDA graph captures of the step, on the CPU."""

    def __init__(self):
        super().__init__()
        self.ops, self.made = [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        record = [str(func)]
        for a in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor):
                mine = a.untyped_storage().data_ptr() in self.made
                record.append("made" if mine else (a.data_ptr(), tuple(a.shape), a.stride(), str(a.dtype)))
            else:
                record.append(repr(a))
        out = func(*args, **kwargs)
        if "lift_fresh" in str(func):
            record.append(out.tolist())
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not any(t is a for a in torch.utils._pytree.tree_leaves(args)):
                self.made.add(t.untyped_storage().data_ptr())
        self.ops.append(tuple(record))
        return out


@pytest.mark.parametrize(
    "arch,policy,mode",
    [
        ("llama", Quest(budget=0.25, sink=4, window=16), "block"),
        ("llama", TokenTopK(budget=0.25, sink=4, window=16), "token"),
        ("llama", QuantBlockTopK(budget=0.25, sink=4, window=16, bits=4), "block"),
        ("llama", Dense(), "mask"),
        ("gemma3", Quest(budget=0.25, sink=4, window=16), "block"),
        ("llama", SnapKV(budget=0.5, sink=4, window=16, observe=8), "block"),
        (
            "llama",
            SnapKV(budget=0.5, sink=4, window=16, observe=8, then=Quest(budget=0.25, sink=4, window=16)),
            "token",
        ),
    ],
    ids=["quest", "token_topk", "quant4", "dense-mask", "gemma3-quest", "snapkv", "snapkv+quest"],
)
@pytest.mark.skipif(DEVICE.type == "cuda", reason="a replayed graph runs no Python to record: the CPU's steps do")
def test_a_refilled_slot_steps_on_the_same_tensors_and_host_values(arch, policy, mode):
    """A CUDA graph replays the tensors and host values of its capture. Two batches of the same padded width but
    other paddings and tokens, loaded in turn into one slot: at every step whose plan key agrees, the forward runs
    the same ops on the same cache and buffer tensors (addresses, shapes, strides) with the same host arguments,
    so the graph captured on the first batch computes the second's step. SnapKV's refills leave out what its first
    step frees (other blocks in each batch): the same ops read the rewritten table and the remade held blocks."""
    model = tiny_model(arch)
    patch_model(model, policy=policy, mode=mode, block_size=8, dense_layers=(0,))
    try:
        slots, steps = DecodeSlots(margin=8), []
        for seed, lengths in [(1, (150, 133, 141)), (2, (131, 150, 122))]:
            prefix, (ids, _, pos) = _prefill(model, _prompts(seed, lengths))
            free = first_step_frees(prefix, policy) if policy.frees_blocks else None  # the prefill observed
            cache, runner = slots.decode(model, "k", prefix, ids.shape[1] - 1 + 6, [policy], free)
            forward, reads = runner.forward_fn, []

            def recorded(*a, _forward=forward, _reads=reads, **k):
                with _Reads() as mode_:
                    out = _forward(*a, **k)
                _reads.append(mode_.ops)
                return out

            runner.forward_fn = recorded
            token, p, keys = ids[:, -1:], pos[:, -1:], []
            with torch.no_grad():
                for _ in range(6):
                    token = runner.step(token, position_ids=p).argmax(-1)
                    keys.append(cache.static.plan.key)
                    p = p + 1
            runner.forward_fn = forward
            steps.append(list(zip(keys, reads)))
        assert slots.slots_made == 1
        # the first batch's last step of each key: its first made what the reservation keeps (state.keep), as a
        # graph's warm-up forward does before the capture
        captured = dict(steps[0])
        compared = 0
        for key, ops in steps[1]:
            if key in captured:
                assert len(ops) == len(captured[key])
                for a, b in zip(ops, captured[key]):
                    assert a == b
                compared += 1
        assert compared >= 3
    finally:
        unpatch_model(model)
