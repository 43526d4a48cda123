"""evaluation.selector_probe: the captured queries and keys, the key variants, and the hit rate / recall against the
``simulate`` way's on the same window."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from tiny_models import prompt, tiny_model

from evaluation.selector_probe import (
    VARIANTS,
    Calibrated,
    Exact,
    MinMax,
    Pairs,
    PerKey,
    ProductQuantized,
    Progressive,
    Residual,
    TwoLevel,
    bind,
    calibrated,
    capture,
    fidelity,
    hadamard,
    main,
    pair_weight,
    variant_fraction,
)
from evaluation.simulate import SimulateSession
from hf_sparse_kv.ops.reference import fp8_code, fp8_decode
from hf_sparse_kv.policies import OracleBlockTopK, QuantBlockTopK


def test_two_level_code_reads_back_each_sides_mean():
    k = torch.tensor([0.0, 1.0, 2.0, 7.0]).view(4, 1, 1)  # one group of 4 tokens, 1 head, 1 channel
    one = TwoLevel(1, 4, "exact")(k, block_size=4).flatten()
    assert one.tolist() == [1.0, 1.0, 1.0, 7.0]  # split at the mean 2.5: {0, 1, 2} -> 1, {7} -> 7
    two = TwoLevel(2, 4, "exact")(k, block_size=4).flatten()
    assert two.tolist() == [0.5, 0.5, 2.0, 7.0]  # each side split again at its own mean
    assert TwoLevel(2, 4, "exact", known=1)(k, block_size=4).flatten().tolist() == one.tolist()
    assert TwoLevel(1, 32, "fp8").fraction() == Fraction(1, 16) + Fraction(1, 32)


def test_per_key_codes():
    torch.manual_seed(0)
    k = torch.randn(40, 2, 64)
    k[..., 5] *= 30  # an outlier channel
    # float8: Fp8BlockTopK's own keys
    codes, scale = fp8_code(k)
    assert torch.equal(PerKey("fp8", meta=4)(k, 16), fp8_decode(codes, scale))
    # int4: every channel a multiple of the key's bf16-stored scale max|k| / 7, at most half a step off
    s = (k.abs().amax(-1, keepdim=True) / 7).to(torch.bfloat16).float()
    got = PerKey("int4")(k, 16)
    assert torch.allclose(got / s, (got / s).round(), atol=1e-4) and (got / s).abs().max() <= 7 + 1e-4
    assert ((got - k).abs() <= s / 2 + 1e-5 + 1e-2 * k.abs()).all()
    # uint4: 16 levels from the key's min to its max; the extremes within a step (the min and step in bf16)
    u = PerKey("uint4", meta=4)(k, 16)
    step = (k.amax(-1) - k.amin(-1)) / 15
    assert ((u.amax(-1) - k.amax(-1)).abs() < step).all() and ((u.amin(-1) - k.amin(-1)).abs() < step / 16).all()
    assert all(len(torch.unique(row)) <= 16 for row in u.reshape(-1, 64))
    # fp4: every value e2m1's grid times the scale
    f = PerKey("fp4")(k, 16) / (k.abs().amax(-1, keepdim=True) / 6).to(torch.bfloat16).float()
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    assert ((f.abs().unsqueeze(-1) - grid).abs().amin(-1) < 1e-4).all()
    # the rotation is orthonormal, so it spreads the outlier's range: the rotated codes lose less
    h = hadamard(64)
    assert torch.allclose(h @ h.T, torch.eye(64), atol=1e-6)
    err = {r: ((PerKey("int4", rotate=r)(k, 16) - k).norm() / k.norm()).item() for r in (False, True)}
    assert err[True] < err[False] / 2
    # groups: each run of channels its own scale, at least as close as one scale for the key
    assert ((PerKey("int4", group=16)(k, 16) - k).norm() / k.norm()).item() <= err[False]
    # channel scales from a prefix of the keys only: the keys after it do not move them
    later = k.clone()
    later[20:] *= 3
    c = PerKey("int4", channels=0.5)
    assert torch.equal(c(later, 16)[:20], c(k, 16)[:20])
    assert PerKey("int4").fraction() == Fraction(1, 4) + Fraction(2, 256)
    assert PerKey("uint4", meta=4, group=32).fraction() == Fraction(1, 4) + Fraction(4, 64)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(48)
    with pytest.raises(ValueError, match="code must be"):
        PerKey("int3")
    with pytest.raises(ValueError, match="channels must be"):
        PerKey("int4", channels=0.0)
    with pytest.raises(ValueError, match="does not divide"):
        PerKey("int4", group=48)(k, 16)


def test_rotary_pairs_keep_whole_pairs_chosen_by_a_prefix_or_by_calibration_queries():
    torch.manual_seed(0)
    T, Hkv, D = 40, 2, 16
    k = torch.randn(T, Hkv, D)
    k[:, 0, [3, 3 + D // 2]] *= 10  # head 0: pair 3 the largest; head 1: pair 6
    k[:, 1, [6, 6 + D // 2]] *= 10
    half = Pairs(Exact(), 1 / 4)  # 2 of 8 pairs
    m = half.mask(k)
    assert m.sum(1).tolist() == [4, 4] and torch.equal(m[:, : D // 2], m[:, D // 2 :])  # whole pairs
    assert m[0, 3] and m[1, 6] and not m[0, 6]
    got = half(k, 16)
    assert torch.equal(got, k * m)  # the kept channels exact, the others zero
    # the pairs come from the first half of the keys: the later ones do not move them
    later = k.clone()
    later[20:, 0, [5, 5 + D // 2]] *= 100
    assert torch.equal(half.mask(later), m) and not torch.equal(Pairs(Exact(), 1 / 4, channels=1.0).mask(later), m)
    # float8 inside: each key coded over its kept channels only (its scale from those)
    f8 = Pairs(PerKey("fp8", meta=2), 1 / 4)
    codes, scale = fp8_code(k * m)
    assert torch.equal(f8(k, 16), fp8_decode(codes, scale) * m)
    assert f8.fraction() == Fraction(1, 2) * Fraction(16, 64) + Fraction(2, 256)
    assert half.fraction() == Fraction(16, 64)
    # chosen by calibration queries: a pair the queries weigh most wins over the keys' largest
    by_q = Pairs(Exact(), 1 / 8, by_query=True)  # 1 pair
    assert calibrated(by_q) and not calibrated(half)
    with pytest.raises(ValueError, match="bind"):
        by_q(k, 16)
    q = torch.randn(4, 8, D) * 0.01  # 2 query heads a KV head
    q[:2, :, [1, 1 + D // 2]] = 100.0
    q[2:, :, [2, 2 + D // 2]] = 100.0
    bound = bind(by_q, k, q)
    w = pair_weight(k, q)
    assert w.shape == (Hkv, D // 2) and w[0].argmax() == 1 and w[1].argmax() == 2
    assert bound.mask(k)[0, [1, 1 + D // 2]].all() and bound.mask(k).sum() == 4
    with pytest.raises(ValueError, match="queries"):
        bind(by_q, k)
    with pytest.raises(ValueError, match="keep must be"):
        Pairs(Exact(), 0.0)
    with pytest.raises(ValueError, match="even head dim"):
        half.mask(torch.randn(4, 1, 7))


def test_product_quantization_with_a_centre_per_key_is_the_keys():
    k = torch.randn(32, 2, 16, generator=torch.Generator().manual_seed(3))
    out = ProductQuantized(sub_dim=4, centroids=256)(k, block_size=16)
    assert torch.equal(out, k)
    coarse = ProductQuantized(sub_dim=4, centroids=4)(k, block_size=16)
    assert coarse.shape == k.shape and not torch.equal(coarse, k)
    pieces = coarse.view(32, 2, 4, 4)  # every piece is one of at most 4 centres per head and piece
    assert all(len(torch.unique(pieces[:, h, j], dim=0)) <= 4 for h in range(2) for j in range(4))
    assert ProductQuantized(8).fraction() == Fraction(1, 16) and ProductQuantized(4).fraction() == Fraction(1, 8)
    rough = ProductQuantized(sub_dim=4, centroids=4)
    assert torch.allclose(Residual(rough, ProductQuantized(sub_dim=4, centroids=256))(k, 16), k, atol=1e-6)
    err = (Residual(rough, rough)(k, 16) - k).norm()  # a second stage on what the first left: closer
    assert err < (coarse - k).norm() and Residual(rough, rough).fraction() == 2 * rough.fraction()
    with pytest.raises(ValueError, match="does not divide"):
        ProductQuantized(sub_dim=5)(k, block_size=16)


def test_product_quantization_fits_on_a_sample_and_codes_every_key():
    """With ``sample`` keys and as many centres, k-means keeps each centre on one sampled key: the centres of every
    head and piece are the pieces of the same ``sample`` rows (fitted on all 64 keys they would be means)."""
    k = torch.randn(64, 2, 8, generator=torch.Generator().manual_seed(0))
    pq = ProductQuantized(sub_dim=4, centroids=16, iters=2, sample=16)
    centres = pq.fit(k)  # [H * m, 16, 4]
    pieces = pq._pieces(k)  # [H * m, 64, 4]
    rows = [torch.cdist(c, p).argmin(-1) for c, p in zip(centres, pieces)]
    for c, p, r in zip(centres, pieces, rows):
        assert torch.equal(c, p[r])
    assert all(set(r.tolist()) == set(rows[0].tolist()) for r in rows) and len(set(rows[0].tolist())) == 16
    everywhere = ProductQuantized(sub_dim=4, centroids=16, iters=2).fit(k)
    assert not all((pieces[0] == c).all(-1).any() for c in everywhere[0])
    assert pq.apply(k, centres).shape == k.shape


def _layer(T=1024, S=16, H=4, Hkv=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(H, S, D, generator=g), torch.randn(Hkv, T, D, generator=g) * 2, D**-0.5


def test_product_quantization_fitted_on_a_prefix_ignores_the_keys_after_it():
    k = torch.randn(64, 2, 8, generator=torch.Generator().manual_seed(1))
    later = k.clone()
    later[32:] = 1e4  # keys the fit must not see
    pq = ProductQuantized(sub_dim=4, centroids=8, iters=3, prefix=0.5)
    assert torch.equal(pq.fit(later), ProductQuantized(sub_dim=4, centroids=8, iters=3).fit(k[:32]))
    assert pq.apply(later, pq.fit(later)).shape == k.shape  # every key coded, the later ones too
    for bad in (0.0, 1.5, -0.5):
        with pytest.raises(ValueError, match="prefix"):
            ProductQuantized(prefix=bad)


def test_calibrated_product_quantization_codes_with_centres_fitted_elsewhere():
    gen = torch.Generator().manual_seed(2)
    mine, other = torch.randn(64, 2, 8, generator=gen), torch.randn(64, 2, 8, generator=gen)
    pq = ProductQuantized(sub_dim=4, centroids=8, iters=3)
    variant = Progressive(Calibrated(pq), Exact(), 2)
    assert calibrated(variant) and not calibrated(Progressive(pq, Exact(), 2)) and not calibrated(pq)
    with pytest.raises(ValueError, match="bind"):
        variant.coarse(mine, 16)
    bound = bind(variant, other)
    assert torch.equal(bound.coarse(mine, 16), pq.apply(mine, pq.fit(other)))  # the other keys' centres
    assert not torch.equal(bound.coarse(mine, 16), pq(mine, 16))  # not the ones fitted on the keys coded
    assert torch.equal(bind(variant, mine).coarse(mine, 16), pq(mine, 16))
    assert bound.fine is variant.fine and bound.candidates == 2 and bind(pq, other) is pq


def test_exact_keys_are_the_oracle_and_two_stages_bound_the_choice():
    q, k, scale = _layer()
    coarse, fine = MinMax(1, 16, "exact"), Exact()
    got = fidelity(
        q,
        k,
        scale,
        {
            "exact": Exact(),
            "coarse": coarse,
            "c1": Progressive(coarse, fine, 1),  # candidates = the count: the fine stage cannot change the set
            "c_all": Progressive(coarse, fine, 1000),  # every block a candidate: the fine stage alone
        },
        budget=1 / 8,
    )
    rate = {name: h / n for name, (h, r, n) in got.items()}
    assert rate["exact"] == 1.0 and rate["c_all"] == 1.0
    assert got["c1"] == got["coarse"] and rate["coarse"] < 1.0
    assert got["exact"][1] == pytest.approx(got["c_all"][1])


def test_the_probe_agrees_with_the_simulate_way_on_one_window():
    """Hit rate and recall of the oracle and of 4-bit keys on a tiny Llama's window, from the probe and from the
    ``simulate`` way's fidelity (which rebuilds every step's paged state and calls the policies)."""
    model = tiny_model("llama")
    ids = prompt(1024)  # 64 blocks: at 1/8 about half of the 8 kept are chosen, not forced
    scored, budget = 32, 1 / 8
    got = capture(model, ids, scored, dense_layers=())
    assert sorted(got) == list(range(model.config.num_hidden_layers))
    q, k, _ = got[0]
    assert q.shape[1] == scored and k.shape[1] == ids.shape[1] - 1
    sums = {}
    for q, k, scale in got.values():
        for name, (h, r, n) in fidelity(q, k, scale, {"oracle": Exact(), "quant4": VARIANTS["quant4"]}, budget).items():
            s = sums.setdefault(name, [0.0, 0.0, 0])
            s[0], s[1], s[2] = s[0] + h, s[1] + r, s[2] + n
    session = SimulateSession(model, ids, scored, block_size=16, chunk=16)
    _, fo = session.run(OracleBlockTopK(budget=budget, sink=4, window=32), dense_layers=(), fidelity=True)
    _, fq = session.run(QuantBlockTopK(budget=budget, sink=4, window=32, bits=4), dense_layers=(), fidelity=True)
    assert sums["oracle"][0] / sums["oracle"][2] == 1.0 == fo.hit_rate
    assert sums["oracle"][1] / sums["oracle"][2] == pytest.approx(fo.recall, abs=1e-4)
    assert sums["quant4"][0] / sums["quant4"][2] < 0.99  # a choice was made (0.967 here)
    assert sums["quant4"][0] / sums["quant4"][2] == pytest.approx(fq.hit_rate, abs=0.02)  # 0.972
    assert sums["quant4"][1] / sums["quant4"][2] == pytest.approx(fq.recall, abs=0.01)


def test_bytes_and_bad_variants():
    assert variant_fraction(VARIANTS["quant4"], 1 / 16) == Fraction(3, 8)
    assert variant_fraction(VARIANTS["pg2_g32_fp8_c4"], 1 / 16) == Fraction(7, 64)  # compact_grid's figure
    assert variant_fraction(VARIANTS["pq8_c2_quant4"], 1 / 16) == Fraction(1, 16) + Fraction(1, 8) * Fraction(5, 16)
    with pytest.raises(SystemExit):
        main(["--variants", "no_such_variant", "--out", "unused.csv"])  # refused before any model loads
