"""SnapKV: prefill compression frees the unkept prompt blocks and decodes like a model whose cache holds only the kept
tokens; with a query-aware policy on top, the three modes agree."""

import pytest
import torch
from tiny_models import DEVICE, greedy, prompt, tiny_model
from transformers import DynamicCache

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.policies import Quest, SinkWindow, SnapKV, TokenTopK

BS = 8


def kept_positions(model, ids: torch.Tensor, policy: SnapKV) -> list[int]:
    """The prompt positions SnapKV keeps, computed independently: attention probabilities from the unpatched eager
    model, the last ``observe`` rows summed per block over heads and layers, sink + window + best blocks."""
    L = ids.shape[1]
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions  # per layer [1, Hq, L, L]
    model.set_attn_implementation("sdpa")
    w = min(policy.observe, L)
    nblk_prompt = -(-L // BS)
    per_head = []  # per layer and KV head: the mass of the last w queries of its query group, per block
    for a in attentions:
        Hq, Hkv = a.shape[1], model.config.num_key_value_heads
        mass = a[0, :, L - w :].sum(1).view(Hkv, Hq // Hkv, L).sum(1) / (Hq // Hkv * w)  # [Hkv, L]
        per_head.append(torch.nn.functional.pad(mass, (0, nblk_prompt * BS - L)).view(Hkv, -1, BS).sum(-1).cpu())
    per_head = torch.cat(per_head)  # [layers * Hkv, nblk]
    scores = per_head.amax(0) if policy.pool == "max" else per_head.mean(0)
    n = L + 1  # compression runs at the first decode step, whose token is stored already
    nblk = -(-n // BS)
    win_start = max(n - policy.window, policy.sink)
    forced = set(range(-(-policy.sink // BS))) | set(range(win_start // BS, nblk))
    keep = max(policy.budget // BS, len(forced))
    ranked = sorted((b for b in range(nblk_prompt) if b not in forced), key=lambda b: -float(scores[b]))
    blocks = forced | set(ranked[: keep - len(forced)])
    return [p for p in range(L) if p // BS in blocks]


def compacted_greedy(
    model, ids: torch.Tensor, keep: list[int], new_tokens: int, prefill: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding by the unpatched model whose cache holds only the ``keep`` positions of the prefill (the
    first ``prefill`` tokens of ``ids``, default all; the rest are then fed one decode step each). The tokens are
    removed from a DynamicCache: RoPE was applied before caching, the positions are passed explicitly."""
    L = ids.shape[1]
    P = L if prefill is None else prefill
    cache = DynamicCache(config=model.config)
    kw = {cache_kwarg(model): cache, "use_cache": True}
    idx = torch.tensor(keep, device=DEVICE)
    step = lambda token, pos: model(token, position_ids=torch.tensor([[pos]], device=DEVICE), **kw).logits[:, -1]
    with torch.no_grad():
        logits = model(ids[:, :P], **kw).logits[:, -1]
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, idx], layer.values[:, :, idx]
        for pos in range(P, L):
            logits = step(ids[:, pos : pos + 1], pos)
        tokens, scores = [], []
        for i in range(new_tokens):
            scores.append(logits)
            tokens.append(logits.argmax(-1, keepdim=True))
            if i + 1 < new_tokens:
                logits = step(tokens[-1], L + i)
    return torch.cat([ids, *tokens], 1), torch.stack(scores)


@pytest.mark.parametrize("dense_layers,pool", [((), "max"), ((0,), "max"), ((), "mean")])
@pytest.mark.parametrize("mode", ["mask", "token", "block"])
def test_snapkv_decodes_like_a_cache_holding_only_the_kept_tokens(mode, dense_layers, pool):
    model = tiny_model("llama")
    ids = prompt(150)
    policy = SnapKV(budget=32, sink=4, window=8, observe=8, pool=pool)
    keep = kept_positions(model, ids, policy)
    ref_seqs, ref_scores = compacted_greedy(model, ids, keep, new_tokens=10)
    patch_model(model, policy=policy, mode=mode, dense_layers=dense_layers, block_size=BS)
    cache = PagedKVCache(model.config, block_size=BS)
    seqs, scores = greedy(model, ids, new_tokens=10, **{cache_kwarg(model): cache})
    unpatch_model(model)
    assert torch.equal(seqs, ref_seqs)
    finite = scores.isfinite()  # generate's min_new_tokens sets the EOS score to -inf
    assert finite.float().mean() > 0.98
    torch.testing.assert_close(scores[finite], ref_scores[finite], rtol=0, atol=1e-5)
    assert cache.evicted
    # 32 tokens of the context kept (4 blocks, the first generated token's included), then one block of new tokens
    assert cache.blocks_in_use == 4 + 1
    assert [i for i, b in enumerate(cache.table.rows[0]) if b >= 0] == sorted({p // BS for p in keep} | {19})
    assert cache.table.capacity == 16  # the pool grew to 32 blocks for the prompt, compaction gave half back


def test_snapkv_with_left_padding_gives_each_prompt_its_own_output():
    model = tiny_model("qwen2")
    long, short = prompt(60, seed=3), prompt(37, seed=4)
    policy = SnapKV(budget=0.5, sink=4, window=8, observe=6)
    patch_model(model, policy=policy, mode="block", dense_layers=(), block_size=BS)
    alone = [greedy(model, p, new_tokens=8) for p in (long, short)]
    ids = torch.cat([long, torch.cat([torch.zeros(1, 23, dtype=torch.long, device=DEVICE), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :23] = 0
    seqs, scores = greedy(model, ids, new_tokens=8, attention_mask=mask)
    unpatch_model(model)
    for b, (ref_seqs, ref_scores) in enumerate(alone):
        assert torch.equal(seqs[b, -8:], ref_seqs[0, -8:])
        torch.testing.assert_close(scores[:, b], ref_scores[:, 0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("then", [Quest(budget=24, sink=4, window=8), TokenTopK(budget=20, sink=4, window=8)])
def test_a_query_aware_policy_on_the_compressed_cache_agrees_across_modes(then):
    model = tiny_model("llama")
    ids = prompt(90, batch=2)
    policy = SnapKV(budget=48, sink=4, window=8, observe=8, then=then)
    runs = {}
    for mode in ("mask", "token", "block") if isinstance(then, Quest) else ("mask", "token"):
        patch_model(model, policy=policy, mode=mode, dense_layers=(), block_size=BS)
        cache = PagedKVCache(model.config, block_size=BS)
        runs[mode] = greedy(model, ids, new_tokens=12, **{cache_kwarg(model): cache})
        assert cache.blocks_in_use == 2 * (48 // BS + 1)  # kept prompt blocks + the block of the new tokens
    unpatch_model(model)
    seqs, scores = runs["mask"]
    for other_seqs, other_scores in runs.values():
        assert torch.equal(other_seqs, seqs)
        torch.testing.assert_close(other_scores, scores, rtol=0, atol=1e-5)


@pytest.mark.parametrize("then", ["fp8", "pq prefill"])
def test_snapkv_keeps_the_state_its_then_policy_reads(then, monkeypatch):
    """``SnapKV(then=...)`` declares the state ``then`` reads: the cache keeps it from the prefill, and no decode step
    codes the keys again (before, ``then`` found no state and took the fallback meant for evaluation's simulate way
    at every step: every key of the pool coded again, and a pq prefill fit refitted on the held keys each step, so
    captured steps decoded other tokens than eager); the tokens are what decoding with the fallback gives where that
    is exact (float8 codes are a function of each key)."""
    from hf_sparse_kv.policies import Fp8BlockTopK, TopPBlockTopK
    from hf_sparse_kv.policies.product import ProductCodes

    fit = {"method": "pq", "fit": "prefill", "sub_dim": 4, "centroids": 16}
    inner = {
        "fp8": Fp8BlockTopK(budget=24, sink=4, window=8),
        "pq prefill": TopPBlockTopK(24, 4, 8, candidates=1, p=1.0, coarse="pq", calibration=fit),
    }[then]
    policy = SnapKV(budget=48, sink=4, window=8, observe=8, then=inner)
    model, ids = tiny_model("llama"), prompt(90, batch=2)
    patch_model(model, policy=policy, dense_layers=(), block_size=BS)
    fits = []
    real_fit = ProductCodes.fit
    monkeypatch.setattr(ProductCodes, "fit", lambda self, *a, **kw: fits.append(a[0]) or real_fit(self, *a, **kw))
    cache = PagedKVCache(model.config, block_size=BS)
    seqs, _ = greedy(model, ids, new_tokens=6, **{cache_kwarg(model): cache})
    names = {spec.name for spec in inner.cache_state()}
    assert names and all(set(layer.state) == names for layer in cache.paged_layers)
    assert cache.evicted  # the prompt's unkept blocks were freed at the first step
    if then == "pq prefill":
        assert sorted(fits) == list(range(len(cache.paged_layers))), "fitted once a layer, at the prefill"
    else:
        monkeypatch.setattr(SnapKV, "cache_state", lambda self: ())  # no state: the fallback codes every step
        fallback, _ = greedy(
            model, ids, new_tokens=6, **{cache_kwarg(model): PagedKVCache(model.config, block_size=BS)}
        )
        assert torch.equal(seqs, fallback)
    unpatch_model(model)


def test_an_evicted_snapkv_cache_forks_and_takes_an_equal_policy_again():
    """A SnapKV cache whose first step freed blocks, its ``then`` keeping calibrated state (pq codes): a deep copy
    (a forked conversation) decodes on as the original does, and so does the original under an equal policy patched
    again (the same calibration loaded anew). Before, the copy's specs were copies, unequal to the policy's, and the
    evicted cache refused them as new state ("keeps (pqcodes) other than what the patched policy needs (pqcodes)")."""
    import copy

    from hf_sparse_kv.calibrate_selector import calibrate_selector
    from hf_sparse_kv.policies import TopPBlockTopK

    model = tiny_model("llama")
    cal = calibrate_selector(model, prompt(200, seed=3), method="pq", sub_dim=4, centroids=16)

    def patched(calibration):
        then = TopPBlockTopK(24, 4, 8, candidates=1, p=1.0, coarse="pq", calibration=calibration)
        patch_model(model, policy=SnapKV(budget=48, sink=4, window=8, observe=8, then=then), block_size=BS)

    def step(cache, seed):
        return model(prompt(1, seed=seed), use_cache=True, **{cache_kwarg(model): cache}).logits

    patched(cal)
    cache = PagedKVCache(model.config, block_size=BS)
    with torch.no_grad():
        model(prompt(90), use_cache=True, **{cache_kwarg(model): cache})
        step(cache, 5)  # frees the prompt's unkept blocks
        assert cache.evicted
        fork = copy.deepcopy(cache)
        torch.testing.assert_close(step(fork, 6), step(cache, 6), rtol=0, atol=0)
        patched({**cal, "centres": {k: v.clone() for k, v in cal["centres"].items()}})  # equal, loaded anew
        torch.testing.assert_close(step(cache, 7), step(fork, 7), rtol=0, atol=0)
    unpatch_model(model)


def test_a_budget_covering_the_prompt_frees_nothing_and_equals_dense():
    model = tiny_model("llama")
    ids = prompt(40)
    ref = greedy(model, ids, new_tokens=8)
    patch_model(model, policy=SnapKV(budget=1.0, then=Quest(budget=1.0)), dense_layers=(), block_size=BS)
    cache = PagedKVCache(model.config, block_size=BS)
    seqs, scores = greedy(model, ids, new_tokens=8, **{cache_kwarg(model): cache})
    unpatch_model(model)
    assert not cache.evicted
    assert torch.equal(seqs, ref[0])
    torch.testing.assert_close(scores, ref[1], rtol=0, atol=1e-5)


def test_compact_moves_the_blocks_in_use_and_shrinks_the_pools():
    model = tiny_model("qwen2")
    patch_model(model, policy=Quest(budget=16), block_size=BS)
    cache = PagedKVCache(model.config, block_size=BS)
    with torch.no_grad():
        model(prompt(150, batch=2), use_cache=True, **{cache_kwarg(model): cache})
    before = cache.capacity_bytes()
    cache.free_blocks([range(2, 15), range(1, 17)])
    layer = cache.paged_layers[0]
    live = [[(lb, b) for lb, b in enumerate(row) if b >= 0] for row in cache.table.rows]
    contents = [[(layer.k_pool[b].clone(), layer.kmax[b].clone()) for _, b in row] for row in live]
    assert cache.compact() == 16 and cache.capacity_bytes() < before / 2
    for b, (row, kept) in enumerate(zip(live, contents)):
        for (lb, _), (k, kmax) in zip(row, kept):
            new = cache.table.rows[b][lb]
            assert torch.equal(layer.k_pool[new], k) and torch.equal(layer.kmax[new], kmax)
    assert sorted(b for row in cache.table.rows for b in row if b >= 0) == list(range(cache.blocks_in_use))
    unpatch_model(model)


def test_compression_holds_less_memory_and_the_cache_is_reusable():
    model = tiny_model("llama")
    patch_model(model, policy=SnapKV(budget=0.25, sink=4, window=8), dense_layers=(), block_size=BS)
    full = PagedKVCache(model.config, block_size=BS)
    cache = PagedKVCache(model.config, block_size=BS)
    ids = prompt(128)
    with torch.no_grad():
        model(ids, use_cache=True, **{cache_kwarg(model): full})
        greedy(model, ids, new_tokens=4, **{cache_kwarg(model): cache})
        # a quarter of the 129-token context at the first decode step, in whole blocks: 4, the new tokens' one included
        assert cache.blocks_in_use == 129 // 4 // BS
        assert cache.memory_bytes() < full.memory_bytes() / 3
        with pytest.raises(NotImplementedError, match="freed blocks"):
            model(prompt(3), **{cache_kwarg(model): cache})
        cache.reset()
        assert cache.blocks_in_use == 0 and not cache.evicted and not cache.observed
        greedy(model, ids, new_tokens=4, **{cache_kwarg(model): cache})
    unpatch_model(model)


def test_bad_compositions_are_refused_with_advice():
    with pytest.raises(ValueError, match="Quest, BlockTopK"):
        SnapKV(then=SinkWindow(window=8))
    with pytest.raises(ValueError, match="observe"):
        SnapKV(observe=0)
    with pytest.raises(ValueError, match="pool"):
        SnapKV(pool="sum")
    with pytest.raises(ValueError, match="budget"):
        SnapKV(budget=0.0)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="mode='token'"):
        patch_model(model, policy=SnapKV(then=TokenTopK()), mode="block")
    with pytest.raises(ValueError, match="cuda_graph=False"):  # SnapKV frees once: captured (tests/test_graphs.py)
        patch_model(model, policy=SinkWindow(window=8, evict=True), dense_layers=(), cuda_graph=True)


def test_a_cache_prefilled_without_snapkv_is_refused_not_silently_dense():
    model = tiny_model("llama")
    ids = prompt(60)
    patch_model(model, policy=Quest(budget=16), dense_layers=(), block_size=BS)
    cache = PagedKVCache(model.config, block_size=BS)
    kw = {cache_kwarg(model): cache, "use_cache": True}
    with torch.no_grad():
        model(ids, **kw)
        patch_model(model, policy=SnapKV(budget=16), dense_layers=(), block_size=BS)
        with pytest.raises(ValueError, match="prefill the prompt with the model patched for SnapKV"):
            model(ids[:, -1:], **kw)
    unpatch_model(model)


def test_the_needle_helper_prefills_snapkv_itself():
    from evaluation.needle import greedy_under_policies

    model = tiny_model("llama")
    ids = prompt(70)
    policy = SnapKV(budget=32, sink=4, window=8, observe=8)
    got = greedy_under_policies(model, ids, {"snap": policy}, 6, dense_layers=(), block_size=BS)["snap"]
    keep = kept_positions(model, ids[:, :-1], policy)
    ref, _ = compacted_greedy(model, ids, keep, new_tokens=6, prefill=ids.shape[1] - 1)
    assert got == ref[0, -6:].tolist()
