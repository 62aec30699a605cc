"""Eval maths: unbiased pass@k against subset enumeration, avg@k, greedy accuracy."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from copc.eval.metrics import avg_at_k, greedy_accuracy, mean_pass_at_k, pass_at_k


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all size-k subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


def test_pass_at_k_golden():
    # n=4, c=1, k=2: C(3,2)/C(4,2) = 3/6 of subsets miss the correct one -> pass@2 = 1/2
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5, abs=1e-15)
    # n=5, c=2, k=1: pass@1 = c/n = 0.4
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4, abs=1e-15)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 3, 3) == 1.0  # n - c = 2 < k: every subset has a correct sample


def test_pass_at_k_matches_subset_enumeration():
    # every (n, c, k) with n <= 9: the product form agrees with exhaustive enumeration to
    # float rounding (at most ~n multiplications of numbers in [0, 1])
    for n in range(1, 10):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_is_stable_for_large_n():
    # n = 2000: C(2000, 500) overflows floats; the product form stays exact-ish. Compare with lgamma.
    n, c, k = 2000, 37, 500
    log_ratio = (
        math.lgamma(n - c + 1) - math.lgamma(n - c - k + 1) - math.lgamma(n + 1) + math.lgamma(n - k + 1)
    )
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.exp(log_ratio), rel=1e-9)
    assert 0.0 <= pass_at_k(n, 1, 1) <= 1.0


def test_pass_at_1_equals_avg():
    rng = random.Random(0)
    correct = [[rng.random() < 0.3 for _ in range(8)] for _ in range(20)]
    assert mean_pass_at_k(correct, 1) == pytest.approx(avg_at_k(correct), abs=1e-12)
    assert mean_pass_at_k(correct, 8) == pytest.approx(sum(any(r) for r in correct) / 20, abs=1e-12)


def test_avg_and_greedy_golden():
    # problem 0: 3/4 correct, problem 1: 1/4 -> avg = 0.5
    assert avg_at_k([[1, 1, 1, 0], [0, 1, 0, 0]]) == 0.5
    assert greedy_accuracy([True, False, False, True]) == 0.5


def test_bad_inputs():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="problem 1 has no samples"):
        avg_at_k([[True], []])
    with pytest.raises(ValueError):
        greedy_accuracy([])
