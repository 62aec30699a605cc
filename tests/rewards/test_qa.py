"""QA rewards: SQuAD normalisation, exact match, token F1, answer-tag extraction."""

from __future__ import annotations

import pytest

from copc.rewards.qa import exact_match, extract_answer_tag, f1, normalize_answer


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        ("The Eiffel Tower", "eiffel tower"),
        ("  an   Apple!! ", "apple"),
        ("Eiffel-Tower.", "eiffeltower"),  # punctuation is dropped, not replaced by a space
        ("theater", "theater"),  # "the" only as a whole word
        ("A, B and C", "b and c"),  # "a" is an article once the comma is gone
        ("", ""),
    ],
)
def test_normalize_answer(text: str, normalized: str) -> None:
    assert normalize_answer(text) == normalized


def test_exact_match_takes_max_over_golds() -> None:
    assert exact_match("the Paris", ["London", "paris"]) == 1.0
    assert exact_match("Paris, France", ["Paris"]) == 0.0
    assert exact_match("Paris", "paris") == 1.0  # a single gold string is accepted
    assert exact_match(None, ["Paris"]) == 0.0


def test_an_answer_that_normalises_to_nothing_never_matches() -> None:
    """The SQuAD script matches "" to a gold that also normalises to "" ("a", "The", "!"): copc does not,
    so saying nothing is never rewarded."""
    assert exact_match("", ["a"]) == 0.0 and exact_match(".", ["!"]) == 0.0 and exact_match("the",
                                                                                            ["The"]) == 0.0
    assert exact_match("A", ["vitamin A", "a"]) == 0.0 and exact_match("vitamin A", ["vitamin A"]) == 1.0


def test_f1_golden_values() -> None:
    # pred "barack obama jr" vs gold "barack obama": overlap 2, P = 2/3, R = 2/2,
    # F1 = 2 * (2/3) * 1 / (2/3 + 1) = (4/3) / (5/3) = 0.8.
    assert f1("Barack Obama Jr.", ["Barack Obama"]) == pytest.approx(0.8, abs=1e-12)
    # Repeated tokens count as a multiset: pred "x x y" vs gold "x x z": overlap min(2,2) = 2,
    # P = R = 2/3 -> F1 = 2/3 (a set overlap would count x once: P = R = 1/3).
    assert f1("x x y", ["x x z"]) == pytest.approx(2 / 3, abs=1e-12)
    # Max over golds: "new york" vs ["york", "new york city"]: 2/3 (P=1/2,R=1) and 0.8 (P=1,R=2/3).
    assert f1("new york", ["york", "new york city"]) == pytest.approx(0.8, abs=1e-12)
    assert f1("paris", ["london"]) == 0.0
    assert f1("the", ["a"]) == 1.0  # both normalise to empty: SQuAD v2 convention
    assert f1("the", ["paris"]) == 0.0
    assert f1(None, ["paris"]) == 0.0


def test_empty_gold_list_is_an_error_with_a_fix() -> None:
    with pytest.raises(ValueError, match="at least one gold answer"):
        exact_match("x", [])


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("<think>hm</think><answer> Paris </answer>", "Paris"),
        ("<answer>a</answer> more <answer>b</answer>", "b"),
        ("<answer>unclosed", None),
        ("no tags", None),
        ("<answer>multi\nline</answer>", "multi\nline"),
        ("<answer>a<answer>b</answer>", "b"),  # the nearest opening tag before the last closing one
        ("</answer><answer>x", None),
    ],
)
def test_extract_answer_tag(text: str, answer: str | None) -> None:
    assert extract_answer_tag(text) == answer
