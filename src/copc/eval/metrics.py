"""Evaluation maths: avg@k, unbiased pass@k, greedy accuracy, and per-benchmark tables.

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

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


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


@dataclass(frozen=True)
class BenchmarkResult:
    """Eval figures of one benchmark (``None`` where not measured)."""

    name: str
    num_problems: int
    samples_per_problem: int
    avg_at_k: float | None
    pass_at_k: Mapping[int, float]
    greedy_accuracy: float | None


def summarize(
    name: str,
    sampled: Sequence[Sequence[bool]] | None = None,
    greedy: Sequence[bool] | None = None,
    ks: Sequence[int] = (1,),
) -> BenchmarkResult:
    """All figures for one benchmark from per-sample correctness (``sampled``) and/or greedy answers.

    pass@k is reported for each ``k`` in ``ks`` not larger than the samples per problem (the same for every
    problem: unequal counts are refused).
    """
    if sampled is None and greedy is None:
        raise ValueError("summarize needs sampled and/or greedy correctness")
    counts = {len(row) for row in sampled} if sampled else set()
    if len(counts) > 1:  # avg@k names one k; a mean over mixed counts would be labelled with the smallest
        raise ValueError(f"summarize: problems have {min(counts)} to {max(counts)} samples; give every "
                         "problem the same number (avg@k and pass@k are per k)")
    n_min = min(counts) if counts else 0
    return BenchmarkResult(
        name=name,
        num_problems=len(sampled) if sampled is not None else len(greedy or ()),
        samples_per_problem=n_min,
        avg_at_k=avg_at_k(sampled) if sampled else None,
        pass_at_k={k: mean_pass_at_k(sampled, k) for k in ks if sampled and k <= n_min},
        greedy_accuracy=greedy_accuracy(greedy) if greedy else None,
    )


def to_record(result: BenchmarkResult) -> dict[str, float | int | str | None]:
    """Flat, JSON-ready dict of a result: ``avg@k``, ``pass@1`` ..., ``greedy``."""
    record: dict[str, float | int | str | None] = {
        "benchmark": result.name,
        "problems": result.num_problems,
        "samples": result.samples_per_problem,
        f"avg@{result.samples_per_problem}": result.avg_at_k,
        "greedy": result.greedy_accuracy,
    }
    record.update({f"pass@{k}": v for k, v in sorted(result.pass_at_k.items())})
    return record


def format_table(results: Sequence[BenchmarkResult], *, digits: int = 3) -> str:
    """A plain-text table, one row per benchmark plus a mean row when there are several.

    Columns: benchmark, problems, avg@k, pass@k for each reported k, greedy. Missing figures show '-'.
    """
    if not results:
        return "(no benchmarks)"
    ks = sorted({k for r in results for k in r.pass_at_k})
    header = ["benchmark", "problems", "avg@k", *[f"pass@{k}" for k in ks], "greedy"]
    rows = [
        [r.name, str(r.num_problems), _fmt(r.avg_at_k, digits)]
        + [_fmt(r.pass_at_k.get(k), digits) for k in ks]
        + [_fmt(r.greedy_accuracy, digits)]
        for r in results
    ]
    if len(results) > 1:
        rows.append(
            [
                "mean",
                str(sum(r.num_problems for r in results)),
                _fmt(_mean([r.avg_at_k for r in results]), digits),
            ]
            + [_fmt(_mean([r.pass_at_k.get(k) for r in results]), digits) for k in ks]
            + [_fmt(_mean([r.greedy_accuracy for r in results]), digits)]
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _mean(values: Sequence[float | None]) -> float | None:
    """Unweighted mean over benchmarks (each benchmark counts once); None if any is missing."""
    if any(v is None for v in values):
        return None
    present = [v for v in values if v is not None]
    return sum(present) / len(present)


def _fmt(value: float | None, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"
