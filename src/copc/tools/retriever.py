"""A BM25 retriever over a corpus of ``{"id", "contents"}`` rows (the Search-R1 corpus format).

Scoring is Okapi BM25 as implemented by ``bm25s`` (Lù 2024), Lucene variant (which drops the constant
``k1 + 1`` factor of Robertson's numerator; the ranking is unchanged):

    score(q, d) = sum_{t in q} idf(t) * tf(t, d) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))
    idf(t)      = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))

where the sum runs over query tokens with repetition, ``N`` is the number of documents, ``df`` the
number of documents containing ``t``, ``|d|`` the document length in tokens and ``avgdl`` its mean.

Text is lowercased and split into words of two or more characters, English stop words removed, no
stemming. Only documents sharing at least one term with the query are returned (score > 0), best first,
ties broken by corpus order so results are deterministic.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import bm25s
import numpy as np
from bm25s.tokenization import Tokenizer

_FORMAT_VERSION = 1
_DOCS_FILE = "docs.jsonl"
_META_FILE = "copc_retriever.json"


@dataclass(frozen=True)
class Hit:
    """One retrieved document."""

    id: str
    contents: str
    #: BM25 score (> 0; higher is better).
    score: float


def _check_row(row: object, where: str) -> tuple[str, str]:
    """(id, contents) of a corpus row, or a ValueError that names the row and the fix."""
    if not isinstance(row, Mapping):
        raise ValueError(f"corpus {where}: expected a JSON object with 'id' and 'contents', got "
                         f"{type(row).__name__}")
    missing = [key for key in ("id", "contents") if key not in row]
    if missing:
        raise ValueError(
            f"corpus {where}: missing field(s) {missing} (has {sorted(row)}); every row needs "
            "'id' (string) and 'contents' (text); rename the columns or fix the row"
        )
    if not isinstance(row["contents"], str):
        raise ValueError(f"corpus {where}: 'contents' must be a string, got {type(row['contents']).__name__}")
    return str(row["id"]), row["contents"]


def _new_tokenizer() -> Tokenizer:
    return Tokenizer(lower=True, stopwords="en", stemmer=None)


class BM25Retriever:
    """Top-k BM25 search over documents; built from rows or JSONL, saved to and loaded from a directory.

    Thread-safe for concurrent searches. Pickling sends the whole index; for Ray, prefer sending the
    saved directory and calling :meth:`load` in the worker.
    """

    def __init__(self, ids: list[str], contents: list[str], *, k1: float = 1.5, b: float = 0.75):
        if not ids:
            raise ValueError("BM25Retriever: the corpus is empty; give at least one {'id', 'contents'} row")
        if len(set(ids)) != len(ids):
            duplicates = sorted({i for i in ids if ids.count(i) > 1})[:5] if len(ids) < 10_000 else "some"
            raise ValueError(f"BM25Retriever: duplicate document ids {duplicates}; make every 'id' unique")
        if k1 < 0 or not 0 <= b <= 1:
            raise ValueError(f"BM25Retriever: need k1 >= 0 and 0 <= b <= 1, got k1={k1}, b={b}")
        self.ids, self.contents, self.k1, self.b = ids, contents, k1, b
        self._lock = threading.Lock()
        self._tokenizer = _new_tokenizer()
        corpus_tokens = self._tokenizer.tokenize(contents, show_progress=False, return_as="tuple")
        self._bm25 = bm25s.BM25(k1=k1, b=b)
        self._bm25.index(corpus_tokens, show_progress=False)

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping[str, object]], *, k1: float = 1.5,
                  b: float = 0.75) -> BM25Retriever:
        """Index rows that each have ``id`` and ``contents``."""
        pairs = [_check_row(row, f"row {i}") for i, row in enumerate(rows)]
        return cls([p[0] for p in pairs], [p[1] for p in pairs], k1=k1, b=b)

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike[str], *, k1: float = 1.5, b: float = 0.75) -> BM25Retriever:
        """Index a JSONL file, one ``{"id": ..., "contents": ...}`` object per line (blank lines skipped)."""
        pairs: list[tuple[str, str]] = []
        with open(path, encoding="utf-8") as handle:
            for line_no, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"corpus {path} line {line_no}: not valid JSON ({exc.msg}); "
                                     "fix the line") from exc
                pairs.append(_check_row(row, f"{path} line {line_no}"))
        return cls([p[0] for p in pairs], [p[1] for p in pairs], k1=k1, b=b)

    def __getstate__(self) -> dict[str, object]:
        return {key: value for key, value in self.__dict__.items() if key != "_lock"}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.ids)

    def search(self, query: str, k: int = 3) -> list[Hit]:
        """The ``k`` best documents for ``query`` (fewer when fewer share a term with it)."""
        return self.search_batch([query], k)[0]

    def search_batch(self, queries: Sequence[str], k: int = 3) -> list[list[Hit]]:
        """:meth:`search` for several queries at once (one vectorised BM25 call)."""
        if k < 1:
            raise ValueError(f"BM25Retriever.search: k={k} must be >= 1")
        if not queries:
            return []
        with self._lock:  # bm25s' tokenizer keeps caches in plain dicts: one caller at a time
            query_ids = self._tokenizer.tokenize(
                list(queries), update_vocab=False, show_progress=False, return_as="ids"
            )
        return [self._top_k(ids, k) for ids in query_ids]

    def _top_k(self, token_ids: list[int], k: int) -> list[Hit]:
        """Best ``k`` documents with score > 0, ties broken by corpus index (bm25s' own top-k is not)."""
        scores_N = np.asarray(self._bm25.get_scores(list(token_ids) or [0]), dtype=np.float64)
        top = min(k, scores_N.shape[0])
        kth = np.partition(scores_N, scores_N.shape[0] - top)[scores_N.shape[0] - top]
        candidates = np.flatnonzero((scores_N >= kth) & (scores_N > 0))  # every doc tied with the k-th
        order = np.lexsort((candidates, -scores_N[candidates]))[:top]
        return [
            Hit(self.ids[int(i)], self.contents[int(i)], float(scores_N[i])) for i in candidates[order]
        ]

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write the index, the vocabulary and the documents (ids + contents) into ``directory``."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self._bm25.save(str(out), show_progress=False)
        self._tokenizer.save_vocab(str(out))
        self._tokenizer.save_stopwords(str(out))
        tmp = out / (_DOCS_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as handle:
            for doc_id, text in zip(self.ids, self.contents, strict=True):
                handle.write(json.dumps({"id": doc_id, "contents": text}, ensure_ascii=False) + "\n")
        os.replace(tmp, out / _DOCS_FILE)
        meta = {"format_version": _FORMAT_VERSION, "num_docs": len(self.ids), "k1": self.k1, "b": self.b}
        (out / _META_FILE).write_text(json.dumps(meta, indent=2))

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> BM25Retriever:
        """Load what :meth:`save` wrote; the index is not rebuilt."""
        src = Path(directory)
        meta_path = src / _META_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(
                f"BM25Retriever.load: {meta_path} not found; {src} is not a saved retriever "
                "(build one with BM25Retriever.from_jsonl(...).save(dir))"
            )
        meta = json.loads(meta_path.read_text())
        if meta.get("format_version") != _FORMAT_VERSION:
            raise ValueError(
                f"BM25Retriever.load: {src} has format {meta.get('format_version')}, this copc reads "
                f"{_FORMAT_VERSION}; rebuild the index from the corpus JSONL"
            )
        self = cls.__new__(cls)
        with open(src / _DOCS_FILE, encoding="utf-8") as handle:
            rows = [json.loads(line) for line in handle if line.strip()]
        self.ids = [str(row["id"]) for row in rows]
        self.contents = [row["contents"] for row in rows]
        self.k1, self.b = float(meta["k1"]), float(meta["b"])
        self._lock = threading.Lock()
        self._tokenizer = _new_tokenizer()
        self._tokenizer.load_vocab(str(src))
        self._tokenizer.load_stopwords(str(src))
        self._bm25 = bm25s.BM25.load(str(src), show_progress=False)
        if len(self.ids) != meta["num_docs"]:
            raise ValueError(f"BM25Retriever.load: {src} is incomplete ({len(self.ids)} of "
                             f"{meta['num_docs']} docs)")
        return self
