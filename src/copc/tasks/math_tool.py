"""Dataset-backed task ``math_tool``: tool-integrated math in the ToRL / SimpleTIR format.

Rows hold a problem and a ground-truth answer (columns ``problem`` / ``answer`` by default). Episode::

    <prompt: the problem and the instruction below>
    ...reasoning...
    ```python
    print(2**10)
    ```                                     <- the closing fence (then a newline) ends the turn
    -> ```output
    -> 1024
    -> ```                                  <- sandbox output, inserted (not trained on)
    ... the answer is \\boxed{1024}.          <- a turn without a code block is the final answer

Reward: math-verify (:class:`~copc.rewards.math.MathVerifier`, killable subprocess) of the ``\\boxed{}``
answer in the whole response against the gold answer; no format bonus. Up to ``max_tool_calls`` code
runs (SimpleTIR: 5 in training, 10 in evaluation); later blocks get an error text instead of running.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from copc.config import check_positive
from copc.tasks.base import Split, check_split, register_task, take
from copc.tasks.datasets import DataError, SourceRow, load_rows, text_column
from copc.tasks.envs import PYTHON_FENCES
from copc.tasks.graders import MathVerifyGrader
from copc.tasks.tooling import python_tool_env, sandbox_config
from copc.types import Env, Prompt

if TYPE_CHECKING:
    from copc.tools.sandbox import SandboxConfig

DEFAULT_TEMPLATE = (
    "{problem}\n\nSolve the problem step by step. You may run Python code in ```python ... ``` blocks; "
    "the output appears in an ```output ... ``` block. Put the final answer in \\boxed{{}}.\n"
)


def check_readable_file(option: str, source: str, what: str) -> None:
    """One-line error unless ``source`` (config ``option``) is empty, an ``hf:`` name or a readable file."""
    if not source or source.startswith("hf:"):
        return
    path = Path(source).expanduser()
    if not path.is_file():
        problem = "is a folder" if path.is_dir() else "does not exist"
        raise FileNotFoundError(f"{option}={source} {problem}; set {option} to {what}")
    try:
        with path.open("rb"):
            pass
    except OSError as err:
        raise FileNotFoundError(
            f"{option}={source} cannot be read ({err.strerror}); fix its permissions") from None


@dataclass(frozen=True)
class DatasetSplits:
    """Which rows make each split: ``eval_data`` if given, else the first ``eval_size`` rows of ``data``."""

    PATH_OPTIONS: ClassVar[tuple[str, ...]] = ("data", "eval_data")  # saved absolute (copc.run.config)
    data: str = ""
    """Train rows: a .jsonl/.json/.parquet path or hf:NAME[:CONFIG]."""
    eval_data: str = ""
    """Eval rows (same formats); empty: take the first ``eval_size`` rows of ``data``."""
    eval_size: int = 0
    """Rows of ``data`` held out for eval when ``eval_data`` is empty."""
    hf_split: str = "train"
    """Split name for hf: sources."""

    def check(self, owner: str) -> None:
        if not self.data:
            raise ValueError(f"{owner}.data is empty; set it to a .jsonl/.parquet path or hf:NAME")
        if self.eval_size < 0:
            raise ValueError(f"{owner}.eval_size must be >= 0, got {self.eval_size}")

    def local_sources(self) -> bool:
        """Every split is read from a local file (no ``hf:`` source, which would need the hub)."""
        return not any(source.startswith("hf:") for source in (self.data, self.eval_data))

    def check_paths(self) -> None:
        """Start-up check: every local file the splits will read exists (``hf:`` sources are not checked)."""
        for option, source in (("data", self.data), ("eval_data", self.eval_data)):
            check_readable_file(option, source, "a .jsonl/.json/.parquet file or hf:NAME")

    def rows(self, split: Split) -> tuple[str, list[SourceRow]]:
        """(source name, rows) of ``split``; each row knows its file and line."""
        check_split(split)
        if self.eval_data and split == "eval":
            return self.eval_data, load_rows(self.eval_data, hf_split=self.hf_split)
        rows = load_rows(self.data, hf_split=self.hf_split)
        if self.eval_data:
            return self.data, rows
        if self.eval_size >= len(rows) and split == "train":
            raise DataError(
                f"{self.data}: eval_size={self.eval_size} leaves no train rows ({len(rows)} rows); "
                "lower eval_size or set eval_data"
            )
        return self.data, rows[: self.eval_size] if split == "eval" else rows[self.eval_size :]

    def row_prompts(
        self, task: str, split: Split, n: int | None, read: Callable[[SourceRow], tuple[str, tuple[str, ...]]]
    ) -> list[Prompt]:
        """Prompts ``task/split/i`` from the first ``n`` rows of ``split``; ``read(row)`` = (text, gold
        answers)."""
        source, rows = self.rows(split)
        prompts = []
        for i, row in enumerate(take(rows, n, f"{split} rows")):
            text, answers = read(row)
            meta: dict[str, str | int | float] = {"source": source, "row": row.line, "where": row.where}
            prompts.append(Prompt(id=f"{task}/{split}/{i}", text=text, answers=answers, meta=meta))
        return prompts


def warn_split_overlap(task: str, train: list[Prompt], evals: list[Prompt]) -> int:
    """Say on stderr how many eval prompts are also train prompts (the same text), and return the count.

    Nothing removes duplicates across the cut: a dataset that repeats its problems, or ``eval_data`` set
    to the same file as ``data``, makes "held-out" accuracy partly train accuracy. A start-up note, not a
    refusal: it may be wanted (a sanity run on the train set)."""
    seen = {p.text for p in train}
    both = sum(p.text in seen for p in evals)
    if both:
        print(f"warning: {task}: {both} of {len(evals)} eval prompts are also train prompts (the same text; "
              "held-out accuracy is then partly train accuracy): remove "
              "them from the train rows or choose eval_data without them", file=sys.stderr, flush=True)
    return both


@dataclass(frozen=True)
class MathToolConfig(DatasetSplits):
    question_key: str = "problem"
    """Column holding the problem text (the same option name as search_qa's)."""
    answer_key: str = "answer"
    """Column holding the ground-truth answer."""
    template: str = DEFAULT_TEMPLATE
    """Prompt text; ``{problem}`` is replaced by the problem."""
    max_tool_calls: int = 5
    """Code runs per episode (SimpleTIR: 5 train / 10 eval)."""
    max_output_chars: int = 1024
    """Sandbox output shown to the policy is truncated to this many characters (>= 64)."""
    timeout_s: float = 10.0
    """Wall-clock limit of one sandbox run, seconds."""
    grade_timeout_s: float = 10.0
    """Limit of one math-verify check, seconds."""
    answer_stop: str = ""
    """A string that ends a turn as its final answer (a few-shot template's next ``Question:``); "": none."""

    def __post_init__(self) -> None:
        self.check("MathToolConfig")
        if "{problem}" not in self.template:
            raise ValueError("MathToolConfig.template must contain {problem}")
        if self.answer_stop and not self.answer_stop.strip():
            raise ValueError("MathToolConfig.answer_stop is blank; give text such as 'Question:' or leave it "
                             "empty")
        check_positive("MathToolConfig", max_tool_calls=self.max_tool_calls, timeout_s=self.timeout_s)
        check_positive("MathToolConfig", grade_timeout_s=self.grade_timeout_s)
        if self.max_output_chars < 64:
            raise ValueError(f"MathToolConfig.max_output_chars must be >= 64, got {self.max_output_chars}")


@register_task("math_tool", MathToolConfig)
class MathToolTask:
    """Math problems from a dataset with a Python tool and a math-verify reward."""

    name = "math_tool"

    def __init__(self, config: MathToolConfig) -> None:
        self.config = config

    def prompts(self, split: Split, n: int | None = None) -> list[Prompt]:
        return self.config.row_prompts("math_tool", split, n, self._read)

    def _read(self, row: SourceRow) -> tuple[str, tuple[str, ...]]:
        problem = text_column(row, self.config.question_key, option="task_options.question_key")
        answer = text_column(row, self.config.answer_key, option="task_options.answer_key")
        return self.config.template.format(problem=problem), (answer,)

    def check_rows(self) -> None:
        """Start-up check: every row of both splits reads (local files; ``hf:`` sources are read at the
        start), and a note on stderr counts eval prompts that are also train prompts."""
        if self.config.local_sources():
            warn_split_overlap(self.name, self.prompts("train"), self.prompts("eval"))

    def sandbox_config(self) -> SandboxConfig:
        """The sandbox its tool calls run in (checked and recorded at the start of a run)."""
        return sandbox_config(self.config.timeout_s)

    def make_env(self, prompt: Prompt) -> Env:
        grader = MathVerifyGrader(prompt.answers[0], timeout_s=self.config.grade_timeout_s)
        stops = (self.config.answer_stop,) if self.config.answer_stop else ()
        syntax = replace(PYTHON_FENCES, answer_stops=stops)
        return python_tool_env(prompt, self.config, syntax=syntax, grader=grader)
