"""The compressed-key and two-stage selectors through tiny models: the modes agree, left padding keeps each prompt
its own output, the compressed keys in the cache follow prefill, decode, padding, beam reorder and crop, a
full-rank calibration reproduces the exact selectors, and a missing calibration is refused with advice."""

from __future__ import annotations

import pytest
import torch
from test_patch_sparse import _left_pad
from tiny_models import DEVICE, greedy, prompt, tiny_model

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.calibrate_selector import calibrate_selector, query_aware
from hf_sparse_kv.policies import (
    POLICIES,
    DecodeState,
    ProjectedBlockTopK,
    ProjectedTokenTopK,
    TokenTopK,
    TopPBlockTopK,
    TwoStageBlockTopK,
    TwoStageTokenTopK,
)

pytestmark = pytest.mark.usefixtures("one_thread")
BS = 8


def _calibration(model, method="channels", rank=4):
    return calibrate_selector(model, prompt(96, seed=5), method, rank)


PQ_FIT = {"method": "pq", "fit": "prefill", "sub_dim": 4, "centroids": 16}  # centres fitted at each prefill


def _policies(model):
    cal, pca = _calibration(model), _calibration(model, "pca")
    pq = calibrate_selector(model, prompt(96, seed=5), "pq", sub_dim=4, centroids=16)
    return [
        ProjectedBlockTopK(budget=24, sink=4, window=8, calibration=cal),
        ProjectedBlockTopK(budget=0.3, sink=0, window=8, calibration=pca),
        ProjectedTokenTopK(budget=21, sink=4, window=5, calibration=cal),
        TwoStageBlockTopK(budget=24, sink=4, window=4, candidates=2),
        TwoStageBlockTopK(budget=24, sink=2, window=4, candidates=1.5, coarse="projected", calibration=pca),
        TwoStageTokenTopK(budget=21, sink=4, window=5, candidates=2),
        ProjectedBlockTopK(budget=24, sink=4, window=8, calibration=_calibration(model, "svd")),
        TopPBlockTopK(budget=24, sink=2, window=4, candidates=2, p=0.8),
        TopPBlockTopK(budget=24, sink=2, window=4, candidates=2, p=0.8, pool="heads"),
        TopPBlockTopK(budget=24, sink=2, window=4, candidates=2, p=1.0, pool="heads", coarse="pq", calibration=pq),
        TwoStageTokenTopK(budget=21, sink=4, window=5, candidates=2, coarse="pq", calibration=pq),
        TopPBlockTopK(budget=24, sink=2, window=4, candidates=2, p=1.0, pool="heads", coarse="pq", calibration=PQ_FIT),
    ]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("which", range(12))
def test_one_selection_every_mode(arch, which):
    model = tiny_model(arch)
    policy = _policies(model)[which]
    ids = prompt(61)
    modes = ("mask", "token") if policy.granularity == "token" else ("mask", "token", "block")
    runs = {}
    for mode in modes:
        patch_model(model, policy=policy, mode=mode, dense_layers=(0,), block_size=BS)
        runs[mode] = greedy(model, ids, new_tokens=12)
    unpatch_model(model)
    ref_seqs, ref_scores = runs["mask"]
    for mode in modes[1:]:
        seqs, scores = runs[mode]
        assert torch.equal(seqs, ref_seqs), mode
        torch.testing.assert_close(scores, ref_scores, rtol=0, atol=1e-5)
    _, dense_scores = greedy(model, ids, new_tokens=12)
    assert not torch.allclose(ref_scores, dense_scores, atol=1e-4), "the policy should really be sparse here"


@pytest.mark.parametrize("which", [0, 2, 3, 5, 9, 11])
def test_left_padded_batch_gives_each_prompt_its_own_output(which):
    model = tiny_model("qwen2")
    policy = _policies(model)[which]
    mode = "token" if policy.granularity == "token" else "block"
    prompts = [prompt(n, seed=n)[0] for n in (45, 29, 38)]
    ids, mask = _left_pad(prompts)
    patch_model(model, policy=policy, mode=mode, dense_layers=(), block_size=BS)
    batch_seqs, batch_scores = greedy(model, ids, new_tokens=8, attention_mask=mask)
    for i, p in enumerate(prompts):
        seqs, scores = greedy(model, p[None], new_tokens=8)
        assert torch.equal(batch_seqs[i, ids.shape[1] :], seqs[0, len(p) :])
        torch.testing.assert_close(batch_scores[:, i], scores[:, 0], rtol=0, atol=1e-4)
    unpatch_model(model)


def _check_ckeys(cache: PagedKVCache, cal: dict) -> None:
    """Every stored position's compressed key equals its key times the layer's projection."""
    for layer in cache.paged_layers:
        proj = cal["proj"][layer.index]
        for b, row in enumerate(cache.table.rows):
            for p in range(layer.length - cache.pads[b]):
                blk, off = row[p // BS], p % BS
                want = torch.einsum("hd,hdr->hr", layer.k_pool[blk, :, off].float(), proj.to(DEVICE))
                torch.testing.assert_close(layer.state["ckeys"][blk, :, off].float(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_compressed_keys_follow_prefill_padding_decode_beams_and_crop(backend):
    model = tiny_model("llama")
    cal = _calibration(model, "pca")
    patch_model(model, policy=ProjectedBlockTopK(budget=16, calibration=cal), block_size=BS, backend=backend)
    cache = PagedKVCache(model.config, block_size=BS, backend=backend)
    ids, mask = _left_pad([prompt(n, seed=n)[0] for n in (29, 21)])
    kw = {cache_kwarg(model): cache}
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=True, **kw)  # a prefill with left padding (negative pos0)
        _check_ckeys(cache, cal)
        for i in range(3):  # single-token writes
            mask = torch.cat([mask, mask.new_ones(2, 1)], 1)
            model(prompt(1, batch=2, seed=10 + i), attention_mask=mask, use_cache=True, **kw)
        _check_ckeys(cache, cal)
        cache.reorder_cache(torch.tensor([1, 1], device=DEVICE))  # beams share every block, then copy on write
        mask = torch.cat([mask[[1, 1]], mask.new_ones(2, 1)], 1)
        model(prompt(1, batch=2, seed=20), attention_mask=mask, use_cache=True, **kw)
        _check_ckeys(cache, cal)
        cache.crop(27)  # back into a partial block, then continue
        mask = torch.cat([mask[:, :27], mask.new_ones(2, 1)], 1)
        model(prompt(1, batch=2, seed=21), attention_mask=mask, use_cache=True, **kw)
        _check_ckeys(cache, cal)
    unpatch_model(model)


def _full_rank(model) -> dict:
    """A channels calibration keeping every channel: the compressed keys are the keys (scores are exact)."""
    return _calibration(model, "channels", rank=model.config.hidden_size // model.config.num_attention_heads)


def test_full_rank_projection_is_the_exact_token_selector():
    model = tiny_model("llama")
    ids = prompt(53)
    out = {}
    for policy in (TokenTopK(budget=17, sink=2, window=4), ProjectedTokenTopK(17, 2, 4, calibration=_full_rank(model))):
        patch_model(model, policy=policy, mode="token", dense_layers=(), block_size=BS)
        out[type(policy).__name__] = greedy(model, ids, new_tokens=10)
    unpatch_model(model)
    assert torch.equal(out["TokenTopK"][0], out["ProjectedTokenTopK"][0])
    torch.testing.assert_close(out["TokenTopK"][1], out["ProjectedTokenTopK"][1], rtol=0, atol=1e-5)


def test_full_rank_projection_and_full_candidates_agree_on_blocks():
    """Blocks ranked by their best exact token: the full-rank projected selector and the two-stage selector with
    every block a candidate choose the same blocks."""
    model = tiny_model("llama")
    ids = prompt(70)
    out = {}
    policies = (
        ProjectedBlockTopK(budget=24, sink=2, window=4, calibration=_full_rank(model)),
        TwoStageBlockTopK(budget=24, sink=2, window=4, candidates=100),
    )
    for policy in policies:
        patch_model(model, policy=policy, mode="block", dense_layers=(), block_size=BS)
        out[type(policy).__name__] = greedy(model, ids, new_tokens=10)
    unpatch_model(model)
    assert torch.equal(out["ProjectedBlockTopK"][0], out["TwoStageBlockTopK"][0])
    torch.testing.assert_close(out["ProjectedBlockTopK"][1], out["TwoStageBlockTopK"][1], rtol=0, atol=1e-5)


def test_two_stage_with_every_candidate_matches_the_exact_token_selector():
    model = tiny_model("llama")
    ids = prompt(53)
    out = {}
    for policy in (TokenTopK(budget=17, sink=2, window=4), TwoStageTokenTopK(17, 2, 4, candidates=100)):
        patch_model(model, policy=policy, mode="token", dense_layers=(), block_size=BS)
        out[type(policy).__name__] = greedy(model, ids, new_tokens=10)
    unpatch_model(model)
    assert torch.equal(out["TokenTopK"][0], out["TwoStageTokenTopK"][0])
    torch.testing.assert_close(out["TokenTopK"][1], out["TwoStageTokenTopK"][1], rtol=0, atol=1e-5)


def test_missing_or_mismatched_calibration_is_refused_with_advice():
    with pytest.raises(ValueError, match="calibrate-selector"):
        ProjectedBlockTopK(budget=0.25)
    with pytest.raises(ValueError, match="calibrate-selector"):
        TwoStageBlockTopK(budget=0.25, coarse="projected")
    with pytest.raises(ValueError, match="coarse"):
        TwoStageBlockTopK(budget=0.25, coarse="mean")
    with pytest.raises(ValueError, match="candidates"):
        TwoStageTokenTopK(budget=0.25, candidates=0.5)
    other = tiny_model("llama", num_key_value_heads=1)
    policy = ProjectedBlockTopK(budget=16, calibration=_calibration(other))
    model = tiny_model("llama")
    patch_model(model, policy=policy, block_size=BS)
    with pytest.raises(ValueError, match="KV heads, head dim"):
        greedy(model, prompt(30), new_tokens=2)
    unpatch_model(model)


def test_calibration_file_round_trip(tmp_path):
    model = tiny_model("llama")
    cal = _calibration(model)
    assert cal["rank"] == 4 and sorted(cal["proj"]) == [0, 1, 2]
    P = cal["proj"][0]
    assert P.shape == (2, 16, 4) and torch.equal(P.sum(1), torch.ones(2, 4)), "one channel per column"
    pairs = _calibration(model, "pairs")["proj"][2]  # whole rotate_half pairs (d, d + 8) of the 16 channels
    chosen = pairs.sum(-1) > 0  # [Hkv, D]
    assert torch.equal(chosen[:, :8], chosen[:, 8:]) and chosen.sum(-1).tolist() == [4, 4]
    pca = _calibration(model, "pca")["proj"][1]
    torch.testing.assert_close(pca.transpose(1, 2) @ pca, torch.eye(4).expand(2, 4, 4), rtol=0, atol=1e-5)
    path = tmp_path / "sel.pt"
    torch.save(cal, path)
    policy = POLICIES["projected_block_topk"](budget=16, calibration=str(path))
    patch_model(model, policy=policy, block_size=BS)
    seqs, _ = greedy(model, prompt(40), new_tokens=3)
    assert seqs.shape == (1, 43)
    unpatch_model(model)


def test_query_aware_projection_at_full_rank_is_the_identity_form():
    """``"svd"`` at rank D: ``B A^T`` is the identity (up to the regularisation), so scores are exact."""
    g = torch.Generator().manual_seed(0)
    mix = torch.eye(16) + 0.3 * torch.randn(16, 16, generator=g)  # well conditioned
    q, k = torch.randn(6, 400, 16, generator=g) @ mix, torch.randn(2, 400, 16, generator=g) @ mix.T + 3.0
    A, B = query_aware(q, k, 16)
    torch.testing.assert_close(B @ A.transpose(1, 2), torch.eye(16).expand(2, 16, 16), rtol=0, atol=2e-2)
    A4, B4 = query_aware(q, k, 4)
    assert A4.shape == B4.shape == (2, 16, 4)
    # rank 4 keeps more of the centered scores' variance than any 4 of the channels would on this data
    kc = k - k.mean(1, keepdim=True)
    exact = torch.einsum("hnd,hmd->hnm", q.view(2, -1, 16), kc)
    approx = torch.einsum("hnr,hmr->hnm", q.view(2, -1, 16) @ B4, kc @ A4)
    assert (exact - approx).pow(2).mean() < 0.9 * exact.pow(2).mean()


@pytest.mark.parametrize("which", [0, 3, 4, 6, 7, 8, 9, 11])
def test_static_decode_step_equals_eager(which):
    """The selectors inside DecodeGraphs (captured on CUDA: the compressed keys' refresh and the selection replay
    from device buffers) compute what the eager step computes."""
    from test_graphs import _eager_steps, _static_steps

    model = tiny_model("llama")
    policy = _policies(model)[which]
    ids = prompt(37, batch=2)
    patch_model(model, policy=policy, mode="block", block_size=8, dense_layers=(0,))
    ref = _eager_steps(model, ids, 20)
    _, _, out = _static_steps(model, ids, 20)
    unpatch_model(model)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("which", [2, 5, 10, "floor"])
def test_static_token_step_equals_eager(which):
    """The token selectors in a static step (mode="token"). ``"floor"``: at some lengths (41 tokens) the forced
    blocks (the sink's, a 12-token window over two blocks, the current one) outnumber the 3 candidate blocks the
    budget wants; a static step knows the lengths on the device only, and must count its candidates there."""
    from test_graphs import _eager_steps, _static_steps

    model = tiny_model("llama")
    policy = _policies(model)[which] if which != "floor" else TwoStageTokenTopK(24, 4, 12, candidates=1)
    ids = prompt(37, batch=2)
    patch_model(model, policy=policy, mode="token", block_size=8, dense_layers=(0,))
    ref = _eager_steps(model, ids, 12)
    _, _, out = _static_steps(model, ids, 12)
    unpatch_model(model)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("which", [0, "floor"])
def test_static_step_of_a_left_padded_batch_equals_eager(which):
    """Sequences of different lengths in one static step: the compressed keys written at each sequence's own
    position, the forced blocks counted per sequence on the device."""
    from test_graphs import _eager_padded, _padded_prompt, _static_padded

    model = tiny_model("llama")
    policy = _policies(model)[which] if which != "floor" else TwoStageTokenTopK(24, 4, 12, candidates=1)
    mode = "token" if policy.granularity == "token" else "block"
    ids, mask = _padded_prompt([37, 29, 34], 37)
    patch_model(model, policy=policy, mode=mode, block_size=BS, dense_layers=(0,))
    ref = _eager_padded(model, ids, mask, 12)
    cache, out = _static_padded(model, ids, mask, 12)
    unpatch_model(model)
    assert cache.pads == [0, 8, 3]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_projections_reach_the_device_at_the_prefill():
    """The keys' and the queries' projections (``"svd"``: two per layer) are on the device after the prefill's
    writes: a decode step (a captured one included) copies nothing from the host and adds nothing to the policy."""
    model = tiny_model("llama")
    policy = ProjectedBlockTopK(budget=16, sink=4, window=8, calibration=_calibration(model, "svd"))
    assert policy._keys.calibration["qproj"], "svd calibrates its own query projection"
    patch_model(model, policy=policy, mode="block", block_size=BS, dense_layers=())
    cache = PagedKVCache(model.config, block_size=BS)
    kw = {cache_kwarg(model): cache}
    with torch.no_grad():
        logits = model(prompt(40), use_cache=True, **kw).logits[:, -1:]
        after_prefill = {k: [t.data_ptr() for t in v] for k, v in policy._keys.on_device.items()}
        for _ in range(3):
            logits = model(logits.argmax(-1), use_cache=True, **kw).logits
    unpatch_model(model)
    assert sorted(k[0] for k in after_prefill) == [0, 1, 2]
    assert {k: [t.data_ptr() for t in v] for k, v in policy._keys.on_device.items()} == after_prefill


def _decode_state(length=120, batch=2):
    """A decode step's state of layer 1 of a tiny Llama after a ``length``-token prefill (a random query)."""
    model = tiny_model("llama")
    patch_model(model, policy=TwoStageBlockTopK(budget=16), block_size=BS, dense_layers=())
    cache = PagedKVCache(model.config, block_size=BS)
    with torch.no_grad():
        model(prompt(length, batch=batch), use_cache=True, **{cache_kwarg(model): cache})
    unpatch_model(model)
    layer = cache.paged_layers[1]
    lens = torch.full((batch,), length, dtype=torch.int32, device=DEVICE)
    return DecodeState(
        q=torch.randn(batch, 4, 16, generator=torch.Generator().manual_seed(0)).to(DEVICE) * 3, k_pool=layer.k_pool,
        kmin=layer.kmin, kmax=layer.kmax, kmean=layer.kmean, block_table=cache.table.tensor(DEVICE), seq_lens=lens,
        start=torch.zeros_like(lens), lens=(length,) * batch, length=length, block_size=BS, scale=0.25,
        ops=cache.ops(DEVICE), state=layer.state, layer=1,
    )  # fmt: skip


def _sets(selection):
    return [[set(h.tolist()) - {-1} for h in seq] for seq in selection.indices]


def test_top_p_keeps_fewer_blocks_as_p_falls_within_the_budget():
    state = _decode_state()
    full = _sets(TopPBlockTopK(budget=48, sink=2, window=4, candidates=2, p=1.0).select(state))
    assert all(len(s) == 48 // BS for seq in full for s in seq), "p = 1 fills the budget"
    forced = {0, *range(state.length // BS - 1, -(-state.length // BS))}  # sink block, window and current blocks
    previous = full
    for p in (0.9, 0.5, 0.1, 1e-6):
        sel = TopPBlockTopK(budget=48, sink=2, window=4, candidates=2, p=p).select(state)
        assert sel.indices.shape[-1] == 48 // BS and sel.counts == (48 // BS,) * 2, "the width is the budget's cap"
        sets = _sets(sel)
        for b in range(2):
            for h in range(2):
                assert sets[b][h] <= previous[b][h] and forced <= sets[b][h]
        previous = sets
    assert all(s == forced for seq in previous for s in seq), "p -> 0 keeps only the forced blocks"


@pytest.mark.parametrize("which", range(6))
def test_triton_ops_select_what_the_reference_selects(which):
    """Each policy whose scores come from the compressed-key or candidate kernels (the queries projected inside
    ``projected_scores``; TwoStageBlockTopK ranking ``candidate_scores(reduce="block")``) selects through the Triton
    ops exactly what it selects through the reference."""
    pytest.importorskip("triton")
    import dataclasses

    from hf_sparse_kv.ops import get_ops

    state = _decode_state(length=150)
    cal = _calibration(tiny_model("llama"), "svd")
    ckeys = torch.einsum("nhtd,hdr->nhtr", state.k_pool.float(), cal["proj"][1].to(DEVICE))
    state.state = {"ckeys": ckeys.to(state.k_pool.dtype).contiguous()}
    policy = [
        TwoStageBlockTopK(budget=48, sink=2, window=4, candidates=2),
        TwoStageBlockTopK(budget=40, sink=3, window=9, candidates=3, coarse="projected", calibration=cal),
        TopPBlockTopK(budget=48, sink=2, window=4, candidates=2, p=0.7),
        ProjectedBlockTopK(budget=40, sink=4, window=8, calibration=cal),
        ProjectedTokenTopK(budget=40, sink=4, window=5, calibration=cal),
        TopPBlockTopK(budget=48, sink=2, window=4, candidates=2, p=0.7, pool="heads"),
    ][which]
    ref = policy.select(dataclasses.replace(state, ops=get_ops("reference", DEVICE)))
    out = policy.select(dataclasses.replace(state, ops=get_ops("triton", DEVICE)))
    assert out.counts == ref.counts and torch.equal(out.indices, ref.indices)
    assert (ref.indices >= 0).sum() > 0


def test_compressed_keys_projected_on_the_fly_reach_the_triton_kernel():
    """A state without the cache's compressed keys (evaluation's simulate way) gets them projected from the pool;
    the projected copy must satisfy the Triton launcher's layout checks and select what the reference selects."""
    pytest.importorskip("triton")
    import dataclasses

    from hf_sparse_kv.ops import get_ops

    state = _decode_state(length=150)
    state.state = {}
    cal = _calibration(tiny_model("llama"), "pairs")
    for policy in (
        ProjectedBlockTopK(budget=40, sink=4, window=8, calibration=cal),
        TwoStageBlockTopK(budget=40, sink=3, window=9, candidates=2, coarse="projected", calibration=cal),
    ):
        ref = policy.select(dataclasses.replace(state, ops=get_ops("reference", DEVICE)))
        out = policy.select(dataclasses.replace(state, ops=get_ops("triton", DEVICE)))
        assert out.counts == ref.counts and torch.equal(out.indices, ref.indices)
