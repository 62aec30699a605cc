"""Question-answering rewards: SQuAD-normalised exact match and token F1 (Search-R1's reward).

Normalisation (Rajpurkar et al. 2016, the official SQuAD v1.1 evaluation script): lowercase, drop
punctuation, drop the articles "a", "an", "the", squeeze whitespace. Both metrics take the maximum over
the gold answers.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, punctuation and articles removed, whitespace squeezed.

    ``"The  Eiffel-Tower!"`` -> ``"eiffeltower"``; ``"an apple"`` -> ``"apple"``. As in the official
    SQuAD script and Search-R1, a sign and a decimal point are punctuation too: ``"-5"`` matches ``"5"``
    and ``"3.5"`` matches ``"35"``. Numeric answers that need them belong to a numeric grader.
    """
    lowered = text.lower()
    no_punct = "".join(ch for ch in lowered if ch not in _PUNCTUATION)
    no_articles = _ARTICLES.sub(" ", no_punct)
    return " ".join(no_articles.split())


def _as_golds(golds: str | Sequence[str]) -> list[str]:
    gold_list = [golds] if isinstance(golds, str) else list(golds)
    if not gold_list:
        raise ValueError("QA reward: the list of gold answers is empty; give at least one gold answer per "
                         "question")
    return gold_list


def exact_match(pred: str | None, golds: str | Sequence[str]) -> float:
    """1.0 when ``normalize_answer(pred)`` equals that of any gold answer, else 0.0 (0.0 for None).

    An answer that normalises to nothing (``""``, ``"the"``, ``"."``) scores 0.0 whatever the golds: the
    official SQuAD script would match it to a gold that also normalises to nothing, which rewards saying
    nothing."""
    gold_list = _as_golds(golds)
    if pred is None:
        return 0.0
    normalized = normalize_answer(pred)
    if not normalized:
        return 0.0
    return float(any(normalized == normalize_answer(gold) for gold in gold_list))


def _f1_one(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    """Token F1 = 2 P R / (P + R), P = overlap / |pred|, R = overlap / |gold| (overlap as multisets).

    Two empty answers match (1.0); one empty against a non-empty one scores 0.0 (SQuAD v2 convention).
    """
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    overlap = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred_tokens), overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1(pred: str | None, golds: str | Sequence[str]) -> float:
    """Maximum over gold answers of the token F1 between normalised prediction and gold (0.0 for None)."""
    gold_list = _as_golds(golds)
    if pred is None:
        return 0.0
    pred_tokens = normalize_answer(pred).split()
    return max(_f1_one(pred_tokens, normalize_answer(gold).split()) for gold in gold_list)


def answer_tag_span(text: str) -> tuple[int, str] | None:
    """(end position, raw content) of the last complete ``<answer>...</answer>``; None when there is none.

    Searched from the right (linear time): the last ``</answer>`` and the nearest ``<answer>`` before it,
    so ``"<answer>a<answer>b</answer>"`` gives ``"b"``.
    """
    close = text.rfind("</answer>")
    if close < 0:
        return None
    start = text.rfind("<answer>", 0, close)
    if start < 0:
        return None
    return close + len("</answer>"), text[start + len("<answer>") : close]


def extract_answer_tag(text: str) -> str | None:
    """Content of the last complete ``<answer>...</answer>`` span, stripped; None when there is none."""
    span = answer_tag_span(text)
    return span[1].strip() if span is not None else None
