"""The interval of a ratio of paired timings (copc.experiments.stats.ratio_interval), worked by hand."""

from __future__ import annotations

import math

import pytest

from copc.experiments.stats import ratio_interval


def test_a_constant_ratio_has_no_spread() -> None:
    got = ratio_interval([2.0, 2.2, 4.0], [1.0, 1.1, 2.0])
    assert got.mean == pytest.approx(2.0) and got.low == pytest.approx(2.0) and got.high == pytest.approx(2.0)


def test_ratio_interval_is_the_t_interval_of_the_log_ratios() -> None:
    # log ratios 0.1, -0.1, 0: mean 0, s = 0.1, t_{0.975, 2} = 4.303 -> exp(-+0.2484)
    num = [math.exp(0.1), math.exp(-0.1), 1.0]
    got = ratio_interval(num, [1.0, 1.0, 1.0])
    assert got.n == 3 and got.mean == pytest.approx(1.0)
    assert got.low == pytest.approx(math.exp(-4.302653 * 0.1 / math.sqrt(3)), rel=1e-5)
    assert got.high == pytest.approx(math.exp(4.302653 * 0.1 / math.sqrt(3)), rel=1e-5)


def test_ratio_interval_refuses_unpaired_or_non_positive_times() -> None:
    with pytest.raises(ValueError, match="paired"):
        ratio_interval([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        ratio_interval([1.0, 0.0], [1.0, 1.0])
