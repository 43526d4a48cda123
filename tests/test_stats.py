"""The interval arithmetic of evaluation/stats.py against known values."""

import math

import pytest

from evaluation.stats import (
    Paired,
    betainc,
    bootstrap_interval,
    delta_ppl,
    mcnemar_exact,
    paired,
    t_interval,
    t_quantile,
    wilson,
)


def test_wilson_known_values():
    # 8/10: (0.4902, 0.9433); 0/10: (0, 0.2775); 50/100: (0.4038, 0.5962) (Wilson 1927; Newcombe 1998, table I)
    assert wilson(8, 10) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    assert wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson(50, 100) == pytest.approx((0.4038, 0.5962), abs=1e-4)
    assert wilson(10, 10)[1] == 1.0 and wilson(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson(3, 2)


def test_t_quantiles_match_the_table():
    for df, q in [(1, 12.7062047), (4, 2.7764451), (15, 2.1314495), (30, 2.0422725), (1000, 1.9623391)]:
        assert t_quantile(0.975, df) == pytest.approx(q, abs=1e-6)
    assert t_quantile(0.5, 7) == pytest.approx(0.0, abs=1e-6)
    assert betainc(2, 3, 0.4) == pytest.approx(0.5248, abs=1e-4)  # I_0.4(2, 3) = 1 - (0.6^4 + 4 * 0.4 * 0.6^3)


def test_t_interval_and_bootstrap():
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    mean, lo, hi = t_interval(values)  # sd = 1.5811, se = 0.7071, t(4) = 2.7764
    assert mean == 3.0 and lo == pytest.approx(3 - 1.96324, abs=1e-4) and hi == pytest.approx(3 + 1.96324, abs=1e-4)
    assert math.isnan(t_interval([2.0])[1])
    bmean, blo, bhi = bootstrap_interval(values, reps=4000)
    assert bmean == 3.0 and lo < blo < 3 < bhi < hi  # the bootstrap is narrower on 5 values


def test_delta_ppl_is_the_pooled_ratio_with_its_interval():
    dense = [2.0, 2.5, 3.0, 2.2]
    policy = [d + x for d, x in zip(dense, [0.02, 0.03, 0.01, 0.04])]
    out = delta_ppl(policy, dense)
    assert out.windows == 4 and out.mean_log_diff == pytest.approx(0.025)
    assert out.pct == pytest.approx(100 * (math.exp(0.025) - 1))
    # diffs sd = 0.01291, se = 0.006455, t(3) = 3.18245
    assert out.low == pytest.approx(100 * math.expm1(0.025 - 3.18245 * 0.006455), abs=1e-3)
    assert out.high == pytest.approx(100 * math.expm1(0.025 + 3.18245 * 0.006455), abs=1e-3)
    with pytest.raises(ValueError):
        delta_ppl([1.0], [1.0, 2.0])


def test_mcnemar_exact_known_values():
    assert mcnemar_exact(10, 2) == pytest.approx(2 * (1 + 12 + 66) / 4096)  # 0.0386
    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(3, 3) == 1.0
    assert mcnemar_exact(0, 6) == pytest.approx(2 / 64)


def test_paired_counts_and_newcombe_interval():
    p = paired([True, False, True, False, True], [True, True, False, False, True])
    assert (p.both, p.lost, p.gained, p.neither) == (2, 1, 1, 1) and p.difference == 0.0
    # a small table: the interval holds the difference and is about as wide as the Wald one
    lo, hi = Paired(8, 5, 4, 9).interval()
    assert Paired(8, 5, 4, 9).difference == pytest.approx(-1 / 26)
    assert lo < -1 / 26 < hi and -0.35 < lo < -0.15 and 0.1 < hi < 0.3
    # large n: close to the Wald interval of the paired difference
    big = Paired(600, 80, 40, 280)
    d = big.difference
    se = math.sqrt((80 + 40) / 1000 - d * d) / math.sqrt(1000)
    assert big.interval() == pytest.approx((d - 1.96 * se, d + 1.96 * se), abs=3e-3)
    assert Paired(0, 0, 0, 10).interval()[0] <= 0 <= Paired(0, 0, 0, 10).interval()[1]
