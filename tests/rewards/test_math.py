"""Maths rewards: answer extraction, exact numeric check, math-verify in a killable worker."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from copc.rewards.math import (
    WALL_FACTOR,
    MathVerifier,
    RewardResult,
    extract_answer,
    numeric_equal,
)

TIMEOUT_S = 2.0
# Killing the worker and launching its replacement (not waiting for it) happen after the timeout; one
# second covers scheduling noise on a loaded 2-vCPU machine.
SLACK_S = 1.0


def stall(verifier: MathVerifier) -> None:
    """Stop ``verifier``'s worker (SIGSTOP) once it is ready: its next check waits and uses no CPU, as a
    starved worker does, whatever sympy's speed. The timeout kills it and a fresh worker takes over."""
    verifier.start()
    assert verifier._proc is not None
    os.kill(verifier._proc.pid, signal.SIGSTOP)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so the answer is \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces are kept whole
        (r"\boxed{\{1, \{2\}\}}", r"\{1, \{2\}\}"),  # escaped braces count as braces, still balanced
        (r"first \boxed{1} then \boxed{2}", "2"),  # last one wins
        (r"\boxed{1} <answer>7</answer>", "7"),  # the one that closes last wins
        (r"<answer>7</answer> then \boxed{8}", "8"),
        (r"<answer>\boxed{5}</answer>", "5"),  # a box inside the tag gives its content
        ("<answer> 3 </answer> <answer>4</answer>", "4"),
        (r"\boxed {x = 3}", "x = 3"),
        (r"\fbox{9}", "9"),
        (r"unclosed \boxed{\frac{1}{2}", None),  # unbalanced: not an answer
        ("<answer>no close", None),
        (r"\boxed{}", None),  # empty is no answer
        ("no answer at all", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def _boxed_oracle(text: str) -> list[str]:
    """Slow reference: from every box opening, scan forward counting braces until they balance."""
    contents = []
    for i in range(len(text)):
        for prefix in ("\\boxed{", "\\fbox{"):
            if text.startswith(prefix, i):
                depth, start = 1, i + len(prefix)
                for j in range(start, len(text)):
                    depth += {"{": 1, "}": -1}.get(text[j], 0)
                    if depth == 0:
                        contents.append((j, text[start:j]))
                        break
    return [c for _, c in sorted(contents)]


def test_boxed_extraction_matches_slow_oracle_on_random_strings() -> None:
    import random

    from copc.rewards.math import _boxed_spans

    rng = random.Random(0)
    pieces = ["\\boxed{", "\\fbox{", "{", "}", "x", "1", " ", "\\frac"]
    for _ in range(500):
        text = "".join(rng.choices(pieces, k=rng.randint(0, 20)))
        assert [c for _, c in _boxed_spans(text)] == _boxed_oracle(text), text


def test_extraction_is_linear_on_degenerate_responses() -> None:
    """20k unclosed boxes and answer tags: a quadratic scan would take minutes, this takes milliseconds."""
    text = "\\boxed{" * 20_000 + "<answer>" * 20_000 + "\\boxed{7}"
    start = time.monotonic()
    assert extract_answer(text) == "7"
    assert time.monotonic() - start < 2.0  # generous for a loaded machine; measured ~0.02 s


@pytest.mark.parametrize(
    ("pred", "gold", "equal"),
    [
        ("42", "42", True),
        ("42.0", "42", True),
        ("1,000", "1000", True),
        ("1/2", "0.5", True),
        ("-3", "-3.000", True),
        ("1e3", "1000", True),
        ("$12$", "12", True),
        ("0.1", "1/10", True),  # exact rationals: no float rounding (0.1 is not 0.1000000000000000055)
        ("0.3333333", "1/3", False),  # exact, so a rounded decimal is not equal
        ("41", "42", False),
        ("forty-two", "42", False),
        ("", "42", False),
        (None, "42", False),
        ("3/0", "3", False),
        # audit of 2026-12-04: commas and spaces were deleted anywhere, so these wrong answers were right
        ("12, 34", "1234", False),
        ("12 34", "1234", False),
        ("1,2,3,4", "1234", False),
        ("1,5", "15", False),
        ("12,345,678", "12345678", True),  # thousands separators still read as written
        ("-1,234.5", "-1234.5", True),
        # and these right answers were wrong, with nothing counted
        ("$1234", "1234", True),
        ("\\boxed{1234}", "1234", True),
        ("\u22121234", "-1234", True),  # a Unicode minus sign
        ("1234 jars", "1234", True),
        ("1234 jars of 5", "1234", False),
    ],
)
def test_numeric_equal(pred: str | None, gold: str, equal: bool) -> None:
    assert numeric_equal(pred, gold) is equal


def test_numeric_equal_agrees_with_fractions_on_random_spellings() -> None:
    """Against ``Fraction`` (exact, and fine while exponents stay small) on decimals, scientific
    notation and ratios of the same and of different values."""
    import random
    from fractions import Fraction

    rng = random.Random(0)

    def spell() -> str:
        kind = rng.randrange(3)
        sign = rng.choice(["", "-", "+"])
        if kind == 0:
            return f"{sign}{rng.randrange(0, 2000)}/{rng.randrange(1, 2000)}"
        digits = str(rng.randrange(0, 10 ** rng.randrange(1, 8))).zfill(rng.randrange(1, 4))
        cut = rng.randrange(len(digits) + 1)
        number = digits[:cut] + "." + digits[cut:] if rng.random() < 0.6 and cut < len(digits) else digits
        exponent = f"e{rng.randrange(-30, 31)}" if kind == 2 else ""
        return sign + number + exponent

    spellings = [spell() for _ in range(400)]
    # equal pairs
    spellings += [f"{Fraction(s).numerator}/{Fraction(s).denominator}" for s in spellings[:200]]
    for _ in range(20000):
        a, b = rng.choice(spellings), rng.choice(spellings)
        assert numeric_equal(a, b) is (Fraction(a) == Fraction(b)), (a, b)


def test_a_huge_exponent_is_graded_at_once() -> None:
    """A sampled answer ``1537640e412537443412`` (E2, 2026-12-02) made ``Fraction`` build 10**412537443412:
    the episode's grading never ended. Run in a child so that a regression fails instead of hanging."""
    code = ("from copc.rewards.math import numeric_equal as n; "
            "assert not n('1537640e412537443412', '1537640'); assert not n('1e-99999999999', '0'); "
            "assert n('1e400', '1' + '0' * 400) and not n('25e-99999999999', '0'); "
            "assert n('1.5e1', '15') and not n('1' * 5000, '1')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def verifier() -> Iterator[MathVerifier]:
    """Short timeout: for the timeout tests."""
    with MathVerifier(timeout_s=TIMEOUT_S) as v:
        v.start()  # the timed calls below measure checking, not the worker's start-up
        yield v


@pytest.fixture(scope="module")
def patient_verifier() -> Iterator[MathVerifier]:
    """Long timeout for the golden cases: sympy's simplify takes ~1 s on (x+1)^2 on a loaded machine,
    and a golden case must not turn into "timeout" because other jobs share the CPU."""
    with MathVerifier(timeout_s=60.0) as v:
        yield v


@pytest.mark.parametrize(
    ("response", "gold", "expected"),
    [
        (r"so \boxed{\frac{1}{2}}", "0.5", RewardResult(1.0, "correct", r"\frac{1}{2}")),
        (r"\boxed{0.5}", r"\frac{1}{2}", RewardResult(1.0, "correct", "0.5")),
        (r"\boxed{(x+1)^2}", "x^2+2x+1", RewardResult(1.0, "correct", "(x+1)^2")),
        (r"\boxed{2^{1/2}}", r"\sqrt{2}", RewardResult(1.0, "correct", "2^{1/2}")),
        ("<answer>42</answer>", "42", RewardResult(1.0, "correct", "42")),
        (r"\boxed{41}", "42", RewardResult(0.0, "wrong", "41")),
        (r"\boxed{1} ... \boxed{42}", "42", RewardResult(1.0, "correct", "42")),
        (r"\boxed{42} ... \boxed{1}", "42", RewardResult(0.0, "wrong", "1")),
        ("I think it is 42", "42", RewardResult(0.0, "no_answer", None)),
        # MATH writes money with an escaped dollar: text, not math mode, so it is boxed like any answer
        (r"\boxed{\$18.90}", r"\$18.90", RewardResult(1.0, "correct", r"\$18.90")),
        (r"\boxed{18.90}", r"\$18.90", RewardResult(1.0, "correct", "18.90")),
        (r"\boxed{\$5}", "5", RewardResult(1.0, "correct", r"\$5")),
        (r"\boxed{\$6}", r"\$5", RewardResult(0.0, "wrong", r"\$6")),
        (r"so $12$ is \boxed{12}", "$12$", RewardResult(1.0, "correct", "12")),
    ],
)
def test_math_verifier_golden(
    patient_verifier: MathVerifier, response: str, gold: str, expected: RewardResult
) -> None:
    assert patient_verifier.score(response, gold) == expected


def test_pathological_answer_is_too_costly_and_worker_is_replaced(verifier: MathVerifier) -> None:
    """sympy never finishes 9^(9^(9^9)) (checked: > 60 s with math-verify's own timeout off): the check
    uses its whole CPU budget, so it is the answer's cost (graded 0), not the grader's failure."""
    start = time.monotonic()
    result = verifier.score(r"\boxed{9^{9^{9^{9}}}}", "10")
    elapsed = time.monotonic() - start
    assert result == RewardResult(0.0, "too_costly", "9^{9^{9^{9}}}")
    assert TIMEOUT_S <= elapsed < WALL_FACTOR * TIMEOUT_S + SLACK_S, elapsed
    assert verifier.score(r"\boxed{7}", "7").reason == "correct"  # a fresh worker answers


def test_worker_killed_from_outside_is_replaced(patient_verifier: MathVerifier) -> None:
    assert patient_verifier.score(r"\boxed{1}", "1").reward == 1.0
    assert patient_verifier._proc is not None
    patient_verifier._proc.kill()  # e.g. the OOM killer
    patient_verifier._proc.wait()
    assert patient_verifier.score(r"\boxed{2}", "2").reward == 1.0


def test_script_without_main_guard_can_use_the_verifier(tmp_path: Path) -> None:
    """multiprocessing's spawn would re-run this script in the worker and fail; a plain subprocess does
    not."""
    script = tmp_path / "user_script.py"
    script.write_text(
        "from copc.rewards.math import MathVerifier\n"
        "v = MathVerifier(timeout_s=60)\n"
        "print(v.score('\\\\boxed{4}', '4').reason)\n"
        "v.close()\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "correct\n", done.stderr[-2000:]


def test_a_stalled_worker_times_out_deterministically(verifier: MathVerifier) -> None:
    before = verifier.num_timeouts
    stall(verifier)
    start = time.monotonic()
    result = verifier.score(r"\boxed{1}", "1")
    # a check that uses no CPU (a stalled worker) is the grader's timeout, after WALL_FACTOR * timeout_s
    assert result.reason == "timeout" and time.monotonic() - start < WALL_FACTOR * TIMEOUT_S + SLACK_S
    assert verifier.num_timeouts == before + 1
    assert verifier.score(r"\boxed{3}", "3").reward == 1.0


def test_concurrent_callers_get_their_own_answers(patient_verifier: MathVerifier) -> None:
    results: dict[int, RewardResult] = {}

    def work(i: int) -> None:
        results[i] = patient_verifier.score(rf"\boxed{{{i}}}", str(i if i % 2 else i + 1))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {i: r.reason for i, r in results.items()} == {i: "correct" if i % 2 else "wrong" for i in range(6)}


def test_pickle_round_trip_starts_its_own_worker(verifier: MathVerifier) -> None:
    copy = pickle.loads(pickle.dumps(verifier))
    try:
        assert copy.timeout_s == TIMEOUT_S and copy.score(r"\boxed{2}", "2").reward == 1.0
    finally:
        copy.close()


def test_bad_timeout_says_how_to_fix() -> None:
    with pytest.raises(ValueError, match=r"timeout_s=0 must be in \(0, 600\]"):
        MathVerifier(timeout_s=0)


def test_a_grader_timeout_is_a_failed_grade_the_episode_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """math-verify that times out for want of CPU (here: a stopped worker) gives reward 0 like a wrong
    answer; the grader says it failed and the episode's info counts it (``grade_failures``), so training
    and evaluation can report it. An answer that uses the whole CPU budget is the answer's cost: graded 0,
    not a failure."""
    from copc.tasks import graders
    from copc.tasks.envs import PYTHON_FENCES, Grade, ToolEnv
    from copc.tasks.graders import MathVerifyGrader

    class NoTool:
        def call(self, code: str) -> tuple[str, bool]:
            raise AssertionError("no tool call in this episode")

    stalled = MathVerifier(timeout_s=TIMEOUT_S)
    monkeypatch.setitem(graders._VERIFIERS, TIMEOUT_S, stalled)
    try:
        grader = MathVerifyGrader("10", timeout_s=TIMEOUT_S)
        stall(stalled)
        assert grader.grade(r"\boxed{10}") == Grade(0.0, failed=True)
        env = ToolEnv("q", syntax=PYTHON_FENCES, tool=NoTool(), grader=grader,  # type: ignore[arg-type]
                      max_tool_calls=1)
        stall(stalled)
        step = env.step(r"so \boxed{10}")
        assert step.done and step.reward == 0.0
        assert step.info["grade_failures"] == 1.0 and step.info["correct"] == 0.0
        costly = MathVerifyGrader("10", timeout_s=TIMEOUT_S)
        assert costly.grade(r"\boxed{9^{9^{9^{9}}}}") == Grade(0.0, failed=False)
        assert costly.grade(r"\boxed{10}") == Grade(1.0, failed=False)
        assert costly.grade(r"\boxed{3}") == Grade(0.0, failed=False)
    finally:
        stalled.close()
