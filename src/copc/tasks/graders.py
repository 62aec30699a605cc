"""Final-answer graders used by the task environments (picklable; the reward code is imported lazily).

Each grader maps the final answer to a reward in {0.0, 1.0}:

- :class:`NumericGrader`: ``numeric_equal(answer, gold)`` (built-in ``arith_tool``);
- :class:`ExactMatchGrader`: SQuAD-normalised exact match against any gold answer (``kv_search``,
  ``search_qa``; Search-R1's reward);
- :class:`MathVerifyGrader`: math-verify on the ``\\boxed{}`` answer of the whole response, in a killable
  subprocess with a timeout (``math_tool``; ToRL / SimpleTIR's reward); a timeout or an error is a
  :class:`~copc.tasks.envs.Grade` with ``failed`` set, counted in the episode's ``grade_failures``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from copc.tasks.envs import Grade

if TYPE_CHECKING:
    from copc.rewards.math import MathVerifier

#: One math-verify worker per timeout per process, shared by every environment of that process.
_VERIFIERS: dict[float, MathVerifier] = {}


class NumericGrader:
    """Reward 1.0 when the answer equals ``gold`` as a number (:func:`copc.rewards.math.numeric_equal`)."""

    def __init__(self, gold: str) -> None:
        self.gold = gold

    def grade(self, answer_text: str) -> float:
        from copc.rewards.math import numeric_equal

        return 1.0 if numeric_equal(answer_text.strip(), self.gold) else 0.0


class ExactMatchGrader:
    """Reward 1.0 when the answer matches one of ``golds`` after SQuAD normalisation."""

    def __init__(self, golds: tuple[str, ...]) -> None:
        self.golds = golds

    def grade(self, answer_text: str) -> float:
        from copc.rewards.qa import exact_match

        return float(exact_match(answer_text, list(self.golds)))


class MathVerifyGrader:
    """Reward from :class:`copc.rewards.math.MathVerifier` on the whole response (it extracts
    ``\\boxed{}``)."""

    def __init__(self, gold: str, *, timeout_s: float) -> None:
        self.gold = gold
        self.timeout_s = timeout_s

    def grade(self, answer_text: str) -> Grade:
        """The verifier's reward; ``failed`` when it timed out or raised (graded 0 without knowing)."""
        from copc.rewards.math import MathVerifier

        if self.timeout_s not in _VERIFIERS:
            _VERIFIERS[self.timeout_s] = MathVerifier(self.timeout_s)
        result = _VERIFIERS[self.timeout_s].score(answer_text, self.gold)
        return Grade(float(result.reward), failed=result.reason in ("timeout", "error"))
