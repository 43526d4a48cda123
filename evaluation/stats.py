"""95% intervals for the quality tables: accuracies (Wilson), the paired change in perplexity over windows
(Student t over per-window log-perplexity differences), and the paired needle comparison with dense on the same
trials (hits lost / gained, McNemar's exact test, Newcombe's interval for the difference of paired proportions).

Plain Python (no scipy): the t quantile comes from the regularized incomplete beta function.

Why a t interval over windows for Δppl. The unit that is independent is the window, not the token: the scored tokens
of one window share their context, so an interval over tokens would be too narrow. The comparison is paired: every
policy scores the same windows as dense, and most of the window-to-window spread (some text is harder) cancels in
the difference ``d_w = mean NLL(policy, w) - mean NLL(dense, w)``. Each ``d_w`` is a mean over 256 tokens, close to
normal, so the t interval over ``n >= 16`` windows is accurate; a percentile bootstrap over so few windows is known
to be too narrow (it ignores the t correction), and :func:`bootstrap_interval` is kept only as a cross-check. With
equal scored tokens per window, ``mean(d_w)`` is exactly the log of the pooled perplexity ratio, so the point
estimate is the table's Δppl and the interval is its ``exp`` image.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

Z95 = 1.959963984540054  # the 0.975 quantile of the standard normal


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for ``k`` successes in ``n`` trials: ``(low, high)`` in [0, 1] (``(0, 1)`` if n = 0)."""
    if n == 0:
        return 0.0, 1.0
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if k == 0 else max(0.0, centre - half)
    return lo, 1.0 if k == n else min(1.0, centre + half)


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1, a - 1
    c, d = 1.0, 1 - qab * x / qap
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1 + num * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta function ``I_x(a, b)``."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1 - front * _betacf(b, a, 1 - x) / b


def t_cdf(t: float, df: float) -> float:
    """CDF of Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * betainc(df / 2, 0.5, df / (df + t * t))
    return 1 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on :func:`t_cdf`, to 1e-12)."""
    if not 0 < p < 1:
        raise ValueError(f"p must lie in (0, 1), got {p}")
    lo, hi = -1e4, 1e4
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return (lo + hi) / 2


def t_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """``(mean, low, high)``: Student t interval for the mean of ``values`` (``(mean, nan, nan)`` for one value)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def bootstrap_interval(
    values: Sequence[float], reps: int = 10_000, level: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """``(mean, low, high)``: percentile bootstrap of the mean (a cross-check of :func:`t_interval`)."""
    n = len(values)
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(reps))
    lo = means[int((1 - level) / 2 * reps)]
    hi = means[min(reps - 1, int((1 + level) / 2 * reps))]
    return sum(values) / n, lo, hi


@dataclass
class DeltaPpl:
    """Δppl of a policy against dense over paired windows, in percent, with its 95% interval."""

    windows: int
    pct: float
    low: float
    high: float
    mean_log_diff: float


def delta_ppl(policy_nll: Sequence[float], dense_nll: Sequence[float], level: float = 0.95) -> DeltaPpl:
    """Paired Δppl from the mean NLL per window (nats/token) of a policy and of dense on the same windows.

    ``pct = 100 (exp(mean d) - 1)`` with ``d_w = policy_nll[w] - dense_nll[w]``; the interval is the t interval of
    ``mean d`` mapped the same way (see the module docstring for why)."""
    if len(policy_nll) != len(dense_nll):
        raise ValueError(f"paired windows needed: {len(policy_nll)} against {len(dense_nll)}")
    diffs = [p - d for p, d in zip(policy_nll, dense_nll)]
    mean, lo, hi = t_interval(diffs, level)

    def pct(x: float) -> float:
        return 100 * math.expm1(x) if not math.isnan(x) else math.nan

    return DeltaPpl(len(diffs), pct(mean), pct(lo), pct(hi), mean)


def binom_cdf(k: int, n: int, p: float = 0.5) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def mcnemar_exact(lost: int, gained: int) -> float:
    """Two-sided exact McNemar p-value: the discordant pairs split as Binomial(lost + gained, 1/2) under no change."""
    n = lost + gained
    if n == 0:
        return 1.0
    return min(1.0, 2 * binom_cdf(min(lost, gained), n))


@dataclass
class Paired:
    """A policy against dense on the same trials: both hit, lost (dense hit, policy missed), gained, both missed."""

    both: int
    lost: int
    gained: int
    neither: int

    @property
    def n(self) -> int:
        return self.both + self.lost + self.gained + self.neither

    @property
    def difference(self) -> float:
        """Policy accuracy minus dense accuracy on these trials."""
        return (self.gained - self.lost) / self.n if self.n else math.nan

    @property
    def p_value(self) -> float:
        return mcnemar_exact(self.lost, self.gained)

    def interval(self, z: float = Z95) -> tuple[float, float]:
        """Newcombe's (1998, method 10) 95% interval for :attr:`difference`, from the Wilson intervals of the two
        accuracies and the correlation of the paired outcomes."""
        n = self.n
        if n == 0:
            return -1.0, 1.0
        a, b, c, d = self.both, self.lost, self.gained, self.neither
        p1, p2 = (a + b) / n, (a + c) / n  # dense, policy
        l1, u1 = wilson(a + b, n, z)
        l2, u2 = wilson(a + c, n, z)
        den = (a + b) * (c + d) * (a + c) * (b + d)
        phi = (a * d - b * c) / math.sqrt(den) if den else 0.0
        theta = p2 - p1
        delta = math.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2))
        eps = math.sqrt(max(0.0, (u2 - p2) ** 2 - 2 * phi * (u2 - p2) * (p1 - l1) + (p1 - l1) ** 2))
        return max(-1.0, theta - delta), min(1.0, theta + eps)


def paired(policy_hits: Sequence[bool], dense_hits: Sequence[bool]) -> Paired:
    """Count the four outcomes of a policy against dense over the same trials (same order)."""
    if len(policy_hits) != len(dense_hits):
        raise ValueError(f"paired trials needed: {len(policy_hits)} against {len(dense_hits)}")
    both = lost = gained = neither = 0
    for p, d in zip(policy_hits, dense_hits):
        if p and d:
            both += 1
        elif d:
            lost += 1
        elif p:
            gained += 1
        else:
            neither += 1
    return Paired(both, lost, gained, neither)
