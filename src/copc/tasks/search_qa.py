"""Dataset-backed task ``search_qa``: Search-R1 style question answering with a BM25 retriever.

Rows hold ``question`` and ``golden_answers`` (a list; a single string is accepted); the corpus is a
JSONL file of ``{"id", "contents"}`` rows. Episode (Search-R1 tags)::

    <prompt: instruction + question>
    <think>...</think><search>query</search>          <- turn, stops at </search>
    -> <information>passage 1\\npassage 2\\npassage 3</information>   <- top-k BM25 (not trained on)
    <think>...</think><answer>Paris</answer>           <- stops at </answer>; reward: exact match

Reward: exact match of the last ``<answer>`` against any gold answer after SQuAD normalisation.
The BM25 index is built from the corpus the first time a process needs it (``index_dir``: saved there
and loaded next time).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from copc.config import check_positive
from copc.rewards.qa import normalize_answer
from copc.tasks.base import PerProcess, Split, register_task
from copc.tasks.datasets import DataError, SourceRow, answers_column, text_column
from copc.tasks.math_tool import DatasetSplits, check_readable_file, warn_split_overlap
from copc.tasks.tooling import RetrieverTool, search_env
from copc.types import Env, Prompt

if TYPE_CHECKING:
    from copc.tools.retriever import BM25Retriever

DEFAULT_TEMPLATE = (
    "Answer the given question. Reason inside <think> and </think> first. If you lack knowledge, search "
    "with <search> query </search>; the results come back between <information> and </information>. "
    "Search as often as you like. Give the final answer, without explanation, inside <answer> and "
    "</answer>, e.g. <answer> Beijing </answer>. Question: {question}\n"
)


@dataclass(frozen=True)
class SearchQAConfig(DatasetSplits):
    PATH_OPTIONS: ClassVar[tuple[str, ...]] = ("data", "eval_data", "corpus", "index_dir")
    corpus: str = ""
    """Corpus JSONL with ``id`` and ``contents`` per line (required)."""
    index_dir: str = ""
    """Where to save / load the BM25 index; empty: build in memory in each process."""
    question_key: str = "question"
    """Column holding the question."""
    answer_key: str = "golden_answers"
    """Column holding the gold answers (a list of strings, or one string)."""
    template: str = DEFAULT_TEMPLATE
    """Prompt text; ``{question}`` is replaced by the question."""
    top_k: int = 3
    """Passages per search (Search-R1: 3)."""
    max_obs_chars: int = 2000
    """Retrieved text shown to the policy is cut to this many characters."""
    max_tool_calls: int = 4
    """Searches per episode; later ones get an error observation."""

    def __post_init__(self) -> None:
        self.check("SearchQAConfig")
        if not self.corpus:
            raise ValueError("SearchQAConfig.corpus is empty; set it to a JSONL file of {id, contents} rows")
        if "{question}" not in self.template:
            raise ValueError("SearchQAConfig.template must contain {question}")
        check_positive("SearchQAConfig", top_k=self.top_k, max_obs_chars=self.max_obs_chars)
        check_positive("SearchQAConfig", max_tool_calls=self.max_tool_calls)

    def check_paths(self) -> None:
        """Start-up check of the rows, the corpus and the index folder (the corpus is read only when no
        saved index exists in ``index_dir``)."""
        super().check_paths()
        index = Path(self.index_dir).expanduser() if self.index_dir else None
        if index is not None and index.exists() and not index.is_dir():
            raise FileNotFoundError(
                f"index_dir={self.index_dir} is a file; set index_dir to a folder (or empty)")
        if index is None or not index.exists():
            check_readable_file("corpus", self.corpus, "a JSONL file of {id, contents} rows")


class CorpusLoader:
    """Picklable retriever builder: load the saved index from ``index_dir`` or build it from ``corpus``."""

    def __init__(self, corpus: str, index_dir: str) -> None:
        self.corpus = corpus
        self.index_dir = index_dir

    def __call__(self) -> BM25Retriever:
        from copc.tools.retriever import BM25Retriever

        if self.index_dir and Path(self.index_dir).exists():
            return BM25Retriever.load(self.index_dir)
        if not Path(self.corpus).exists():
            raise FileNotFoundError(
                f"corpus {self.corpus} does not exist; set corpus=<JSONL of id, contents>")
        retriever = BM25Retriever.from_jsonl(self.corpus)
        if self.index_dir:
            retriever.save(self.index_dir)
        return retriever


@register_task("search_qa", SearchQAConfig)
class SearchQATask:
    """Questions from a dataset, answered by searching a BM25 index over a corpus."""

    name = "search_qa"

    def __init__(self, config: SearchQAConfig) -> None:
        self.config = config
        #: The search tool, shared by this process's environments (the index is built once).
        self.tool = PerProcess(partial(_search_tool, config))

    def prompts(self, split: Split, n: int | None = None) -> list[Prompt]:
        return self.config.row_prompts("search_qa", split, n, self._read)

    def _read(self, row: SourceRow) -> tuple[str, tuple[str, ...]]:
        """The prompt and the golds that exact match can grade: a gold that SQuAD normalisation empties
        (``""``, ``"The"``, the letter ``"A"``) would make an empty answer correct, so it is left out, and
        a row with no other gold is refused."""
        question = text_column(row, self.config.question_key, option="task_options.question_key")
        golds = answers_column(row, self.config.answer_key, option="task_options.answer_key")
        graded = tuple(g for g in golds if normalize_answer(g))
        if not graded:
            raise DataError(
                f"{row.where}: every answer in column {self.config.answer_key!r} ({list(golds)}) is empty "
                "after SQuAD normalisation (lowercase, no punctuation, no articles), so an empty answer "
                "would be graded right; fix the row's answers or drop the row"
            )
        return self.config.template.format(question=question), graded

    def check_rows(self) -> None:
        """Start-up check: every row of both splits reads (local files; ``hf:`` sources are read at the
        start), and a note on stderr counts eval prompts that are also train prompts."""
        if self.config.local_sources():
            warn_split_overlap(self.name, self.prompts("train"), self.prompts("eval"))

    def make_env(self, prompt: Prompt) -> Env:
        return search_env(prompt, self.tool(), max_tool_calls=self.config.max_tool_calls)


def _search_tool(config: SearchQAConfig) -> RetrieverTool:
    loader = CorpusLoader(config.corpus, config.index_dir)
    return RetrieverTool(loader, top_k=config.top_k, max_chars=config.max_obs_chars)
