"""Adapters from the real tools (:mod:`copc.tools`) to the :class:`~copc.tasks.envs.Tool` interface.

Both are picklable: the sandbox is created lazily in the process that runs it, and a retriever tool
pickles its task-level source (rows or a corpus path) rather than the index, rebuilding it on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from copc.tasks.envs import SEARCH_TAGS, CallSyntax, Grader, ToolEnv, ToolReply
from copc.tasks.graders import ExactMatchGrader
from copc.types import Prompt

if TYPE_CHECKING:  # imported lazily at run time: the tools are heavy and run in worker processes
    from copc.tools.retriever import BM25Retriever
    from copc.tools.sandbox import PythonSandbox, SandboxConfig


class SandboxTool:
    """Runs a code string in the real :class:`~copc.tools.sandbox.PythonSandbox`.

    Args:
        timeout_s: wall-clock limit of one run (the sandbox kills the process after it).
        max_output_chars: the observation (stdout, then stderr) is truncated to this many characters.
    """

    def __init__(self, *, timeout_s: float, max_output_chars: int) -> None:
        from copc.tools.sandbox import require_protections

        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self._sandbox: PythonSandbox | None = None
        # Checked where the env is made, outside the episode loop (which turns an exception of
        # env.step into a zero-reward episode): a missing protection stops the run, in one line.
        require_protections(self._config())

    def __getstate__(self) -> dict[str, object]:
        return {"timeout_s": self.timeout_s, "max_output_chars": self.max_output_chars, "_sandbox": None}

    def _get_sandbox(self) -> PythonSandbox:
        if self._sandbox is None:
            from copc.tools.sandbox import shared_sandbox

            self._sandbox = shared_sandbox(self._config())  # one warm sandbox per process, for every episode
        return self._sandbox

    def _config(self) -> SandboxConfig:
        return sandbox_config(self.timeout_s)

    def call(self, request: str) -> ToolReply:
        """Run ``request`` as Python; the formatted output, whether it failed, and whether the sandbox did."""
        from copc.tools.sandbox import format_observation

        if not request.strip():
            return ToolReply("Error: empty code block; write Python code that prints the result.", True)
        result = self._get_sandbox().run(request)
        failed = result.exit_code != 0 or result.timed_out or bool(result.error)
        return ToolReply(format_observation(result, self.max_output_chars), failed, result.infra_failed)


def sandbox_cpu_s(task: object) -> float:
    """CPU seconds used so far by this process's shared sandbox of ``task`` (its live fork server's whole
    process tree, every run included; ``RUSAGE_CHILDREN`` sees none of it while the server lives); 0 for
    a task whose tools run no model-written code."""
    config_of = getattr(task, "sandbox_config", None)
    if config_of is None:
        return 0.0
    from copc.tools.sandbox import shared_sandbox

    return shared_sandbox(config_of()).server_cpu_s()


def sandbox_config(timeout_s: float) -> SandboxConfig:
    """The sandbox every Python tool call of a task runs in: its wall timeout, and the protections the
    environment (``COPC_SANDBOX_ALLOW_MISSING``) explicitly allows to be missing."""
    from copc.tools.sandbox import SandboxConfig, allow_missing_from_env

    return SandboxConfig(timeout_s=timeout_s, allow_missing=allow_missing_from_env())


class PythonToolOptions(Protocol):
    """The config fields every sandboxed-Python task has."""

    @property
    def timeout_s(self) -> float: ...
    @property
    def max_output_chars(self) -> int: ...
    @property
    def max_tool_calls(self) -> int: ...


def python_tool_env(prompt: Prompt, options: PythonToolOptions, *, syntax: CallSyntax,
                    grader: Grader) -> ToolEnv:
    """An episode whose tool runs the model's code in the sandbox, with the task's limits."""
    tool = SandboxTool(timeout_s=options.timeout_s, max_output_chars=options.max_output_chars)
    return ToolEnv(prompt.text, syntax=syntax, tool=tool, grader=grader,
                   max_tool_calls=options.max_tool_calls)


def search_env(prompt: Prompt, tool: RetrieverTool, *, max_tool_calls: int) -> ToolEnv:
    """An episode that searches with ``tool`` and is graded by exact match against the prompt's answers."""
    return ToolEnv(prompt.text, syntax=SEARCH_TAGS, tool=tool, grader=ExactMatchGrader(prompt.answers),
                   max_tool_calls=max_tool_calls)


def format_passages(contents: list[str], max_chars: int) -> str:
    """Retrieved passages, one per line, in rank order, cut to ``max_chars`` characters in total."""
    text = "\n".join(contents)
    return text if len(text) <= max_chars else text[:max_chars]


class CorpusLoader:
    """Picklable retriever builder: BM25 over the rows ``rows(*args)`` gives (``id``, ``contents``), built
    again in each process that searches (``rows`` must be a module-level function, so it pickles)."""

    def __init__(self, rows: Callable[..., list[dict[str, str]]], *args: object) -> None:
        self.rows = rows
        self.args = args

    def __call__(self) -> BM25Retriever:
        from copc.tools.retriever import BM25Retriever

        return BM25Retriever.from_rows(self.rows(*self.args))


class RetrieverTool:
    """Searches a real :class:`~copc.tools.retriever.BM25Retriever` and formats the top-k passages.

    Args:
        load: picklable zero-argument callable that builds (or loads) the retriever; called once.
        top_k: passages per query.
        max_chars: the observation is cut to this many characters.
    """

    def __init__(self, load: Callable[[], BM25Retriever], *, top_k: int, max_chars: int) -> None:
        self.load = load
        self.top_k = top_k
        self.max_chars = max_chars
        self._retriever: BM25Retriever | None = None

    def __getstate__(self) -> dict[str, object]:
        return {"load": self.load, "top_k": self.top_k, "max_chars": self.max_chars, "_retriever": None}

    def retriever(self) -> BM25Retriever:
        if self._retriever is None:
            self._retriever = self.load()
        return self._retriever

    def call(self, request: str) -> tuple[str, bool]:
        """Search ``request``; returns the passages (or an error text) and whether the query was bad."""
        query = request.strip()
        if not query:
            return "Error: empty query; write words to search for between the search tags.", True
        hits = self.retriever().search(query, self.top_k)
        if not hits:
            return "No results; try other words.", False
        return format_passages([hit.contents for hit in hits], self.max_chars), False
