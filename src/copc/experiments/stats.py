"""Exact interval maths for the results store, without scipy: Student's t and Fisher's F from the
regularized incomplete beta (continued fraction, Numerical Recipes 6.4), and the mean with its t interval.

Golden values in tests/experiments/test_sweep.py and tests/experiments/test_interaction.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = ["Interval", "f_survival", "ratio_interval", "student_t_quantile", "t_interval"]


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta (modified Lentz; Numerical Recipes 6.4)."""

    def nonzero(v: float) -> float:
        return v if abs(v) > 1e-300 else 1e-300

    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 / nonzero(1.0 - qab * x / qap)
    h = d
    for k in range(1, 300):
        m2 = 2 * k
        aa = k * (b - k) * x / ((qam + m2) * (a + m2))  # even step
        d, c = 1.0 / nonzero(1.0 + aa * d), nonzero(1.0 + aa / c)
        h *= d * c
        aa = -(a + k) * (qab + k) * x / ((a + m2) * (qap + m2))  # odd step
        d, c = 1.0 / nonzero(1.0 + aa * d), nonzero(1.0 + aa / c)
        h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betai(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(
        -x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def _t_cdf(t: float, df: float) -> float:
    tail = 0.5 * _betai(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def f_survival(f: float, df1: float, df2: float) -> float:
    """``P(F > f)`` for Fisher's F with ``(df1, df2)`` degrees of freedom: ``I_{df2/(df2 + df1 f)}(df2/2,
    df1/2)``."""
    if df1 <= 0 or df2 <= 0:
        raise ValueError(f"f_survival needs df1 > 0 and df2 > 0, got {df1}, {df2}")
    if f <= 0.0:
        return 1.0
    return _betai(df2 / 2.0, df1 / 2.0, df2 / (df2 + df1 * f))


def student_t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on the exact CDF)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"student_t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -student_t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while _t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if _t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low < 1e-12 * max(1.0, high):
            break
    return 0.5 * (low + high)


@dataclass(frozen=True)
class Interval:
    """Mean of ``n`` values with its two-sided t interval ``[low, high]`` (None bounds when n < 2)."""

    mean: float
    low: float | None
    high: float | None
    n: int

    def text(self, digits: int = 3) -> str:
        if self.low is None or self.high is None:
            return f"{self.mean:.{digits}f} (n={self.n})"
        spread = "" if self.high > self.low else " (no spread: every seed gave the same value)"
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]{spread} (n={self.n})"

    def excludes_zero(self) -> bool:
        return self.low is not None and self.high is not None and (self.low > 0 or self.high < 0)


def t_interval(values: Iterable[float], confidence: float = 0.95) -> Interval:
    """Mean and Student-t interval ``mean -+ t_{(1+c)/2, n-1} s / sqrt(n)`` (s: sample std, ddof 1)."""
    data = np.asarray(list(values), dtype=float)
    if data.size == 0:
        raise ValueError("t_interval needs at least one value")
    mean = float(data.mean())
    if data.size < 2:
        return Interval(mean, None, None, 1)
    half = student_t_quantile(0.5 + confidence / 2.0,
                              data.size - 1) * float(data.std(ddof=1)) / math.sqrt(data.size)
    return Interval(mean, mean - half, mean + half, int(data.size))


def ratio_interval(numerators: Iterable[float], denominators: Iterable[float],
                   confidence: float = 0.95) -> Interval:
    """Geometric mean of the paired ratios ``num_i / den_i`` with the t interval of their logs, mapped back
    (a ratio of timings is multiplicative: a round twice as slow for both sides leaves it unchanged)."""
    num, den = np.asarray(list(numerators), dtype=float), np.asarray(list(denominators), dtype=float)
    if num.shape != den.shape or num.size == 0:
        raise ValueError(f"ratio_interval needs paired values, got {num.size} and {den.size}")
    if (num <= 0).any() or (den <= 0).any():
        raise ValueError("ratio_interval needs positive values (timings)")
    logs = t_interval(np.log(num / den), confidence)
    low = None if logs.low is None else math.exp(logs.low)
    high = None if logs.high is None else math.exp(logs.high)
    return Interval(math.exp(logs.mean), low, high, logs.n)
