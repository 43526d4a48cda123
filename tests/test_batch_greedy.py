"""Needle/QA answers for several prompts in one left-padded batch equal the answers one prompt at a time."""

import copy

import pytest
import torch
from tiny_models import batch_policies, tiny_model

from evaluation.needle import PhaseClock, greedy_batch, greedy_under_policies
from hf_sparse_kv import is_patched
from hf_sparse_kv.policies import Dense, Quest, SnapKV


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batched_greedy_equals_one_at_a_time(arch):
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (150, 131, 144)]
    policies = batch_policies(quant4=False)
    if arch == "gemma3":  # sliding + global layers: the padding must reach both kinds of mask
        policies = {k: policies[k] for k in ("dense", "quest", "snapkv")}
    mode = "block" if arch == "llama" else "mask"
    clock = PhaseClock()
    batched = greedy_batch(model, prompts, policies, 6, dense_layers=(0,), block_size=8, mode=mode, clock=clock)
    for prompt, got in zip(prompts, batched):
        alone = PhaseClock()
        ids = torch.tensor([prompt], device=model.device)
        one = greedy_under_policies(model, ids, policies, 6, (0,), 8, mode, clock=alone)
        assert got == one
        assert set(alone.per_key) == set(policies) and all(n["decode"] > 0 for n in alone.per_key.values())
    assert not is_patched(model)
    # the clock saw each phase: the shared prefill and SnapKV's own, a copy per other policy, every decode
    assert set(clock.seconds) == {"prefill", "copy", "decode"}
    assert all(v > 0 for v in clock.seconds.values())


def test_phase_clock_sums_phases_and_survives_errors():
    clock = PhaseClock("cpu")
    for _ in range(2):
        with clock.phase("a"):
            torch.ones(4).sum()
    with pytest.raises(RuntimeError), clock.phase("b"):
        raise RuntimeError("inside")
    assert set(clock.seconds) == {"a", "b"} and clock.seconds["a"] > 0


def test_stateful_selector_beside_dense(monkeypatch):
    """A policy keeping per-token state (compressed keys, low-bit codes) decodes from a copy of the shared dense
    prefill, whose cache computes the state from the stored keys: its answers equal those after a prefill of its
    own (which keeps the state write by write). Batched and one at a time agree, and equal the policy run alone."""
    from tiny_models import prompt

    from evaluation import needle
    from hf_sparse_kv.calibrate_selector import calibrate_selector
    from hf_sparse_kv.policies import ProjectedBlockTopK, ProjectedTokenTopK, QuantBlockTopK, TwoStageBlockTopK

    model = tiny_model("llama")
    cal = calibrate_selector(model, prompt(96, seed=5), "pairs", 4)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (140, 127)]
    policies = {
        "dense": Dense(),
        "proj_blk": ProjectedBlockTopK(budget=0.25, sink=4, window=16, calibration=cal),
        "proj_tok": ProjectedTokenTopK(budget=0.25, sink=4, window=16, calibration=cal),
        "two_stage": TwoStageBlockTopK(
            budget=0.25, sink=4, window=16, candidates=2, coarse="projected", calibration=cal
        ),
        "quant2": QuantBlockTopK(budget=0.25, sink=4, window=16, bits=2),
    }
    batched = greedy_batch(model, prompts, policies, 5, dense_layers=(0,), block_size=8, mode="block")
    for prompt_ids, got in zip(prompts, batched):
        ids = torch.tensor([prompt_ids], device=model.device)
        assert got == greedy_under_policies(model, ids, policies, 5, (0,), 8, "block")
        for key in ("proj_blk", "proj_tok"):
            assert got[key] == greedy_under_policies(model, ids, {key: policies[key]}, 5, (0,), 8, "block")[key]
    monkeypatch.setattr(needle, "own_prefill", lambda policy: True)  # every policy prefills with its state
    assert greedy_batch(model, prompts, policies, 5, dense_layers=(0,), block_size=8, mode="block") == batched


@pytest.mark.parametrize("arch,mode", [("llama", "block"), ("llama", "token"), ("llama", "mask"), ("gemma3", "block")])
def test_static_decode_equals_eager(arch, mode, monkeypatch):
    """``static=True`` decodes each policy through the static step (uncaptured on the CPU) and gives the eager
    steps' tokens for a left-padded batch and for one prompt alone, in every mode and on sliding + global layers; a
    policy that frees blocks once (SnapKV) decodes its first step eagerly (it frees them), the others statically.
    The static steps do run: they are counted."""
    from hf_sparse_kv import graphs

    model = tiny_model(arch)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (150, 133, 141)]
    policies = batch_policies()  # quant4: per-token state in the cache
    steps = []
    original = graphs.DecodeGraphs.step
    monkeypatch.setattr(graphs.DecodeGraphs, "step", lambda self, *a, **k: steps.append(1) or original(self, *a, **k))
    args = {"dense_layers": (0,), "block_size": 8, "mode": mode}
    for batch in (prompts, prompts[1:2]):
        eager = greedy_batch(model, batch, policies, 6, **args)
        before, clock = len(steps), PhaseClock()
        assert greedy_batch(model, batch, policies, 6, static=True, clock=clock, **args) == eager
        assert len(steps) - before == 6 * 5 + 5  # every step of every policy but SnapKV's first
        # each policy's decode seconds noted apart; no graph on the CPU (static steps run uncaptured), at least one
        # captured graph per static policy on a GPU (HF_SPARSE_KV_TEST_DEVICE=cuda)
        assert set(clock.per_key) == set(policies) and all(n["decode"] > 0 for n in clock.per_key.values())
        captured = {k for k, n in clock.per_key.items() if n["graphs"] > 0 and n["capture"] > 0}
        assert captured == (set() if model.device.type == "cpu" else set(policies))  # SnapKV's after its first step
        assert sum(n["decode"] for n in clock.per_key.values()) == pytest.approx(clock.seconds["decode"])
        # each policy's whole turn (its copy, SnapKV's own observation pass, its decoding): every phase but the
        # shared prefill falls in exactly one policy's turn
        assert all(n["phases"] >= n["decode"] for n in clock.per_key.values())
        shared = sum(clock.seconds.values()) - sum(n["phases"] for n in clock.per_key.values())
        assert 0 < shared <= clock.seconds["prefill"] + 1e-6
    assert not is_patched(model)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_snapkv_from_the_shared_prefill_answers_as_its_own(arch, monkeypatch):
    """SnapKV starting from a copy of the shared dense prefill, cropped by its observation window and that window
    forwarded again under its patch, answers as with a prefill of its own (the same observation, the same blocks
    freed), left-padded or alone, with a query-aware policy after it too. On sliding + global layers (Gemma-3: a
    sliding layer cannot be cropped back) it starts from a dense prefill up to its window shared by the batch
    (:func:`~evaluation.needle.shares_base`) and answers as with its own, too."""
    from evaluation import needle

    model = tiny_model(arch)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (150, 131, 142)]
    policies = {
        "dense": Dense(),
        "snapkv": SnapKV(budget=0.4, sink=4, window=16, observe=8),
        "snapkv_quest": SnapKV(budget=0.5, sink=4, window=16, observe=12, then=Quest(budget=0.25, sink=4, window=8)),
    }
    args = {"dense_layers": (0,), "block_size": 8, "mode": "block"}
    shared, based, prefills = [], [], []
    original, original_base, real_fsp = needle.shares_prefill, needle.shares_base, needle.from_shared_prefill
    monkeypatch.setattr(needle, "shares_prefill", lambda *a: shared.append(original(*a)) or shared[-1])
    monkeypatch.setattr(needle, "shares_base", lambda *a: based.append(original_base(*a)) or based[-1])
    monkeypatch.setattr(
        needle, "from_shared_prefill", lambda m, p, *a, **k: prefills.append(p) or real_fsp(m, p, *a, **k)
    )
    for batch in (prompts, prompts[:1]):
        n0 = len(prefills)
        got = greedy_batch(model, batch, policies, 6, **args)
        assert shared[-2:] == [arch == "llama"] * 2  # both SnapKV policies shared the dense prefill on Llama
        new = prefills[n0:]  # what they started from: the prefix (Llama), a base per window (Gemma-3)
        width = max(map(len, batch)) - 1  # (one prompt alone takes the batch-1 path: the same sharing)
        assert [p.get_seq_length() for p in new] == ([width] * 2 if arch == "llama" else [width - 8, width - 12])
        with monkeypatch.context() as m:
            m.setattr(needle, "shares_prefill", lambda *a: False)
            m.setattr(needle, "shares_base", lambda *a: False)
            assert greedy_batch(model, batch, policies, 6, **args) == got
    assert not is_patched(model)


@pytest.mark.parametrize("static", [False, True])
def test_top2_records_each_steps_two_best_logits(static):
    """``top2`` receives, per policy, the two best float32 logits of every step and their ids: the first id is the
    token decoded, the first value is not below the second, and recording them changes no token; with ``top2``, one
    prompt takes the batched path (eagerly too) and is recorded as well."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (120, 101)]
    policies = {"dense": Dense(), "quest": Quest(budget=0.25, sink=4, window=16)}
    args = {"dense_layers": (0,), "block_size": 8, "mode": "block", "static": static}
    for batch in (prompts, prompts[:1]):
        top2: dict = {}
        got = greedy_batch(model, batch, policies, 5, top2=top2, **args)
        assert got == greedy_batch(model, batch, policies, 5, **args)
        assert set(top2) == set(policies)
        for key, (values, ids) in top2.items():
            assert values.shape == ids.shape == (len(batch), 5, 2) and values.dtype == torch.float32
            assert (values[..., 0] >= values[..., 1]).all() and (ids[..., 0] != ids[..., 1]).all()
            assert ids[..., 0].tolist() == [answer[key] for answer in got]


def _observing_policies() -> dict:
    """SnapKV policies observing one window alike (other budgets, pooling, a policy after them), dense, and one
    observing another window."""
    quest = Quest(budget=0.25, sink=4, window=8)
    return {
        "snapkv": SnapKV(budget=0.4, sink=4, window=16, observe=8),
        "dense": Dense(),
        "snapkv_mean": SnapKV(budget=0.3, sink=4, window=16, observe=8, pool="mean"),
        "snapkv_quest": SnapKV(budget=0.5, sink=4, window=16, observe=8, then=quest),
        "snapkv_12": SnapKV(budget=0.4, sink=4, window=16, observe=12),
    }


def _count_passes(monkeypatch) -> list[int]:
    """The observation windows of the observation passes ``greedy_batch`` makes from now on, in order."""
    from evaluation import needle

    passes, real = [], needle.from_shared_prefill
    monkeypatch.setattr(
        needle, "from_shared_prefill", lambda m, p, i, w, *a, **k: passes.append(w) or real(m, p, i, w, *a, **k)
    )
    return passes


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_snapkv_policies_of_one_observation_share_its_pass(arch, monkeypatch):
    """SnapKV policies that observe the same window (other budgets, pooling, a policy after them) run one
    observation pass a batch and decode on copies of it (the last on the pass's cache itself), the blocks all of
    them free already freed on it (``release_common``), answering as each with a pass of its own; a policy
    observing another window gets its own pass."""
    from evaluation import needle

    model = tiny_model(arch)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (150, 131, 142)]
    policies, args = _observing_policies(), {"dense_layers": (0,), "block_size": 8, "mode": "block"}
    passes = _count_passes(monkeypatch)
    freed, release = [], needle.release_common
    monkeypatch.setattr(needle, "release_common", lambda c, qs: freed.append(release(c, qs)) or freed[-1])
    for batch in (prompts, prompts[:1]):
        del passes[:], freed[:]
        got = greedy_batch(model, batch, policies, 6, **args)
        assert sorted(passes) == [8, 12]  # one pass for the three policies observing 8 positions, one for 12
        assert len(freed) == 1 and freed[0] > 0  # the pass shared by three freed what all three free
        for key, policy in policies.items():
            del passes[:]
            assert [a[key] for a in greedy_batch(model, batch, {key: policy}, 6, **args)] == [a[key] for a in got]
    assert not is_patched(model)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_snapkv_policies_on_a_kept_slot_load_their_shared_pass_without_copies(arch, monkeypatch):
    """With static steps on a kept slot (``DecodeSlots``), the SnapKV policies observing one window still make one
    pass a batch, and each decodes on the slot refilled from that pass's cache itself, less the blocks it frees
    (no copy of the pass, nothing freed on it, ``release_common`` not called): the eager answers, batch after
    batch, with each policy's steps kept; a policy observing more than the shortest prompt holds before its last
    token prefills and steps on its own."""
    from evaluation import needle
    from evaluation.slots import DecodeSlots

    model = tiny_model(arch)
    g = torch.Generator().manual_seed(12)
    policies, args = _observing_policies(), {"dense_layers": (0,), "block_size": 8, "mode": "block"}
    passes = _count_passes(monkeypatch)
    freed = []
    monkeypatch.setattr(needle, "release_common", lambda c, qs: freed.append(qs) or 0)
    copies, deepcopy = [], copy.deepcopy
    monkeypatch.setattr(needle.copy, "deepcopy", lambda x, *a: copies.append(type(x).__name__) or deepcopy(x, *a))
    slots, runners = DecodeSlots(margin=16), {}
    for i, lengths in enumerate([(150, 131, 142), (139, 150, 128)]):
        batch = [torch.randint(3, 90, (n,), generator=g).tolist() for n in lengths]
        eager = greedy_batch(model, batch, policies, 6, **args)
        del passes[:], copies[:], freed[:]
        assert greedy_batch(model, batch, policies, 6, static=True, slots=slots, **args) == eager
        # the caches copied: the two passes' starts (a copy of the prefill each) and, in the first batch, the slot
        assert sorted(passes) == [8, 12] and not freed and copies.count("PagedKVCache") == 2 + (i == 0)
        assert set(slots.runners) == set(policies)
        runners = runners or dict(slots.runners)
        assert all(slots.runners[k] is r for k, r in runners.items())
    short = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [7] * 9]  # 8 tokens before the last: too few to observe 8
    assert greedy_batch(model, short, policies, 4, static=True, slots=slots, **args) == greedy_batch(
        model, short, policies, 4, **args
    )
    assert set(slots.runners) == {"dense"}  # a new slot (shorter batch): only dense decoded on it
    assert not is_patched(model)


@pytest.mark.parametrize("arch,length", [("llama", 160), ("llama", 161), ("llama", 167), ("gemma3", 160)])
def test_release_common_leaves_each_policy_the_blocks_its_first_step_keeps(arch, length):
    """On an observed cache two SnapKV budgets decode copies of, ``release_common`` frees what both free at their
    first step: after that step each holds exactly the blocks it holds on a copy freed by its own step alone (at
    160 tokens the budget's and the window's blocks move by one block if the step's length is off by one; Gemma-3's
    first layer slides, so the cache's length is not a paged layer's)."""
    from evaluation.needle import from_shared_prefill, release_common
    from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model

    model = tiny_model(arch)
    ids = torch.randint(3, 90, (1, length), generator=torch.Generator().manual_seed(5)).to(model.device)
    wide, narrow = (SnapKV(budget=b, sink=4, window=16, observe=8) for b in (0.4, 0.25))
    kw = {"dense_layers": (0,), "block_size": 8}
    patch_model(model, policy=Dense(), **kw)
    prefix = PagedKVCache(model.config, block_size=8)
    with torch.no_grad():  # up to the observation window (a sliding layer cannot be cropped back)
        model(ids[:, : -1 - 8], **{cache_kwarg(model): prefix}, use_cache=True, logits_to_keep=1)
    patch_model(model, policy=wide, **kw)
    observed = from_shared_prefill(model, prefix, ids, 8, PhaseClock())
    plain = copy.deepcopy(observed)
    assert release_common(observed, [wide, narrow]) > 0

    def held_after_first_step(policy, cache):
        patch_model(model, policy=policy, **kw)
        with torch.no_grad():
            model(ids[:, -1:], **{cache_kwarg(model): cache}, use_cache=True)
        return [[lb for lb, blk in enumerate(row) if blk >= 0] for row in cache.table.rows]

    for policy in (wide, narrow):
        assert held_after_first_step(policy, copy.deepcopy(observed)) == held_after_first_step(
            policy, copy.deepcopy(plain)
        )
    unpatch_model(model)
