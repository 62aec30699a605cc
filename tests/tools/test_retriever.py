"""BM25 retriever: golden scores, a per-term oracle, ranking, persistence, bad rows."""

from __future__ import annotations

import json
import math
import pickle
import random
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from bm25s.stopwords import STOPWORDS_EN

from copc.tools.retriever import BM25Retriever, Hit

TOY = [
    {"id": "a", "contents": "cat dog"},
    {"id": "b", "contents": "cat cat fish bird"},
    {"id": "c", "contents": "bird"},
]


def test_golden_scores_by_hand() -> None:
    # N = 3, df(cat) = 2: idf = ln(1 + (3 - 2 + 0.5) / (2 + 0.5)) = ln(1.6) = 0.4700036.
    # avgdl = (2 + 4 + 1) / 3 = 7/3; k1 = 1.5, b = 0.75.
    # a: tf 1, |d| 2: 1 / (1 + 1.5 (0.25 + 0.75 * 2 * 3/7)) = 1 / 2.3392857 = 0.4274809 -> 0.2009176
    # b: tf 2, |d| 4: 2 / (2 + 1.5 (0.25 + 0.75 * 4 * 3/7)) = 2 / 4.3035714 = 0.4647303 -> 0.2184249
    hits = BM25Retriever.from_rows(TOY).search("cat", k=3)
    assert [h.id for h in hits] == ["b", "a"]  # c has no "cat": not returned
    # bm25s stores float32 scores: 1e-6 relative is a few float32 ulps.
    assert hits[0].score == pytest.approx(0.4700036 * 0.4647303, rel=1e-6)
    assert hits[1].score == pytest.approx(0.4700036 * 0.4274809, rel=1e-6)


def _tokens(text: str) -> list[str]:
    return [t for t in re.findall(r"(?u)\b\w\w+\b", text.lower()) if t not in STOPWORDS_EN]


def _oracle_scores(docs: list[str], query: str, k1: float = 1.5, b: float = 0.75) -> list[float]:
    """The module docstring's formula, one document and one query term at a time."""
    doc_tokens = [_tokens(d) for d in docs]
    n, avgdl = len(docs), sum(len(t) for t in doc_tokens) / len(docs)
    scores = []
    for tokens in doc_tokens:
        tf, score = Counter(tokens), 0.0
        for term in _tokens(query):
            df = sum(term in other for other in doc_tokens)
            if df == 0 or tf[term] == 0:
                continue
            idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
            score += idf * tf[term] / (tf[term] + k1 * (1 - b + b * len(tokens) / avgdl))
        scores.append(score)
    return scores


def test_against_per_term_oracle_on_random_corpus() -> None:
    rng = random.Random(0)
    words = [f"w{i}" for i in range(30)] + ["the", "and", "of"]
    docs = [" ".join(rng.choices(words, k=rng.randint(1, 25))) for _ in range(60)]
    retriever = BM25Retriever.from_rows({"id": str(i), "contents": d} for i, d in enumerate(docs))
    for _ in range(20):
        query = " ".join(rng.choices(words, k=rng.randint(1, 4)))
        expected = _oracle_scores(docs, query)
        hits = retriever.search(query, k=len(docs))
        positive = sorted((-s, i) for i, s in enumerate(expected) if s > 0)
        assert [h.id for h in hits] == [str(i) for _, i in positive]
        for hit in hits:
            assert hit.score == pytest.approx(expected[int(hit.id)], rel=1e-5)  # float32 sums of <= 4 terms


def test_document_with_query_terms_ranks_first() -> None:
    rows = [{"id": f"d{i}", "contents": f"report {i} on weather in region {i % 5}"} for i in range(200)]
    rows.insert(97, {"id": "target", "contents": "The zebra named Quill lives in Oslo."})
    hits = BM25Retriever.from_rows(rows).search("Where does the zebra Quill live?", k=3)
    assert hits[0] == Hit("target", "The zebra named Quill lives in Oslo.", hits[0].score)
    assert len(hits) == 1  # no other document shares a term


def test_ties_are_broken_by_corpus_order() -> None:
    rows = [{"id": f"d{i}", "contents": f"topic{i % 7} color{i % 3}"} for i in range(100)]
    hits = BM25Retriever.from_rows(rows).search("topic3 color1", k=3)
    # i % 7 == 3 and i % 3 == 1: 10, 31, 52, 73, 94 all tie; the first three in corpus order win.
    assert [h.id for h in hits] == ["d10", "d31", "d52"]


def test_no_match_and_batch() -> None:
    retriever = BM25Retriever.from_rows(TOY)
    assert retriever.search("xyzzy", k=3) == [] and retriever.search("", k=3) == []
    batch = retriever.search_batch(["bird", "dog", "the"], k=2)
    assert batch == [retriever.search("bird", 2), retriever.search("dog", 2), []]
    assert [h.id for h in batch[1]] == ["a"]


def test_save_load_round_trip(tmp_path: Path) -> None:
    rng = random.Random(1)
    words = [f"term{i}" for i in range(50)]
    rows = [{"id": f"doc-{i}", "contents": " ".join(rng.choices(words,
                                                                k=12)) + " ünïcode"} for i in range(300)]
    retriever = BM25Retriever.from_rows(rows)
    retriever.save(tmp_path / "index")
    loaded = BM25Retriever.load(tmp_path / "index")
    queries = [" ".join(rng.choices(words, k=3)) for _ in range(25)] + ["ünïcode term1", "unseen words"]
    assert loaded.search_batch(queries, k=5) == retriever.search_batch(queries, k=5)
    assert loaded.ids == retriever.ids and loaded.contents == retriever.contents


def test_from_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in TOY) + "\n\n")
    assert BM25Retriever.from_jsonl(path).search("fish", 1)[0].id == "b"


def test_bad_rows_name_the_row_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps(TOY[0]) + "\n" + json.dumps({"id": "x", "text": "oops"}) + "\n")
    with pytest.raises(ValueError, match=r"line 2: missing field\(s\) \['contents'\].*rename the columns"):
        BM25Retriever.from_jsonl(path)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match="line 1: not valid JSON"):
        BM25Retriever.from_jsonl(path)
    with pytest.raises(ValueError, match=r"row 1: missing field\(s\) \['id'\]"):
        BM25Retriever.from_rows([TOY[0], {"contents": "no id"}])
    with pytest.raises(ValueError, match="duplicate document ids"):
        BM25Retriever.from_rows([TOY[0], TOY[0]])
    with pytest.raises(ValueError, match="corpus is empty"):
        BM25Retriever.from_rows([])
    with pytest.raises(FileNotFoundError, match="not a saved retriever"):
        BM25Retriever.load(tmp_path)


def test_pickle_and_concurrent_searches() -> None:
    rows = [{"id": f"d{i}", "contents": f"alpha{i % 13} beta{i % 5} gamma{i}"} for i in range(500)]
    retriever = pickle.loads(pickle.dumps(BM25Retriever.from_rows(rows)))
    queries = [f"alpha{i % 13} gamma{i}" for i in range(40)]
    expected = [retriever.search(q, 3) for q in queries]
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(lambda q: retriever.search(q, 3), queries))
    assert got == expected and all(hits[0].id == f"d{i}" for i, hits in enumerate(got))
