"""Evaluation maths: avg@k, unbiased pass@k, greedy accuracy.

Notation: a benchmark has ``P`` problems; problem ``p`` gets ``n_p`` sampled answers of which ``c_p``
are correct.

- **avg@k** (the paper's "mean avg@32"): the mean correctness of ``k`` samples per problem, averaged
  over problems: ``(1/P) Σ_p c_p / n_p`` with ``n_p = k``.
- **pass@k**, unbiased (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1):
  with ``n >= k`` samples of which ``c`` are correct, the probability that a random size-``k`` subset
  holds at least one correct sample is ``1 − C(n−c, k) / C(n, k)``. Computed as the product
  ``1 − Π_{i=n−c+1}^{n} (1 − k/i)`` (their numerically stable form: no huge binomials), and 1 exactly
  when ``n − c < k``.
- **greedy accuracy**: the fraction of problems whose single greedy (temperature 0) answer is correct.

Running a checkpoint on a task is ``copc.eval.evaluate`` (``copc eval``); this module only
aggregates the correctness it produces.
"""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem: ``1 − C(n−c, k)/C(n, k)``.

    Args:
        n: samples drawn (``n >= k``).
        c: correct samples among them (``0 <= c <= n``).
        k: subset size (``k >= 1``).
    """
    if not (k >= 1 and n >= k and 0 <= c <= n):
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every size-k subset contains a correct sample
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
    """Mean unbiased pass@k over problems; ``correct[p]`` holds the correctness of problem p's samples."""
    _check_nonempty(correct)
    return sum(pass_at_k(len(row), sum(bool(x) for x in row), k) for row in correct) / len(correct)


def avg_at_k(correct: Sequence[Sequence[bool]]) -> float:
    """avg@k: mean over problems of the fraction of correct samples (k = samples per problem)."""
    _check_nonempty(correct)
    return sum(sum(bool(x) for x in row) / len(row) for row in correct) / len(correct)


def greedy_accuracy(correct: Sequence[bool]) -> float:
    """Fraction of problems whose greedy answer is correct."""
    if len(correct) == 0:
        raise ValueError("greedy_accuracy needs at least one problem")
    return sum(bool(x) for x in correct) / len(correct)


def _check_nonempty(correct: Sequence[Sequence[bool]]) -> None:
    if len(correct) == 0:
        raise ValueError("need at least one problem")
    for p, row in enumerate(correct):
        if len(row) == 0:
            raise ValueError(f"problem {p} has no samples; sample k >= 1 answers per problem")
