"""copc.rewards: maths (math-verify in a killable worker, exact numeric check) and QA (EM / F1)."""

from copc.rewards.math import MathVerifier, RewardResult, extract_answer, numeric_equal
from copc.rewards.qa import exact_match, extract_answer_tag, f1, normalize_answer

__all__ = [
    "MathVerifier",
    "RewardResult",
    "exact_match",
    "extract_answer",
    "extract_answer_tag",
    "f1",
    "normalize_answer",
    "numeric_equal",
]
