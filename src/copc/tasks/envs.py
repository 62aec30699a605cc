"""The two tool loops every task is built from: a Python-tool episode and a search episode.

Both are single-use :class:`~copc.types.Env` objects (one per prompt). One policy *turn* is the text the
policy generated up to (and including) a stop string, or up to end-of-sequence. Each turn is one of:

- a **tool call** that ends the turn (``...<python>code</python>``, a fenced ```` ```python ```` block, or
  ``...<search>query</search>``): the tool runs and its output comes back as the observation, wrapped in
  the task's observation tags (``<output>``, ```` ```output ````, ``<information>``), which the episode
  loop inserts as non-action tokens. Bad calls (empty code or query, code that raises or times out, no
  calls left) return an error text as the observation and count ``tool_errors``; they never crash;
- a **final answer** (``<answer>...</answer>``; for tasks without an answer tag, any turn that is not a
  tool call): graded, ``done=True``, reward 1.0 or 0.0;
- what is graded is the policy's *prose* (:meth:`CallSyntax.prose`): tool calls and observation blocks
  the policy wrote itself are cut out first, so an answer inside code, a query or an imitated
  observation is no answer;
- a **void turn** (neither a complete tool call nor an answer, e.g. free text that ended with EOS):
  with answer tags the episode ends with reward 0; without them (``math_tool``: a final turn with no
  ``answer_marker``, ``\\boxed{``) it is still graded on the whole response (its prose). Either way
  ``info["void_turn"] = 1``, so a trainer can drop it (SimpleTIR's stabiliser, ``trainer.void_turns =
  mask``) or keep it as a plain failure.

``finish(reason)`` is called when the loop stops the episode itself (turn / token / context budget, or
EOS without a step): there is no answer to grade, so the reward is 0.

Counters in ``info`` (summed over the episode on the final step): ``tool_calls``, ``tool_errors``,
``tool_infra_errors`` (calls the tool's machinery failed, e.g. the sandbox could not run the code: not
the model's error, so not in ``tool_errors``), ``grade_failures`` (1 when the grader could not decide,
e.g. math-verify timed out or raised: graded 0, but not known to be wrong), ``void_turn``, ``correct``,
``turns``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from copc.types import EnvStep, StopReason


class Grade(NamedTuple):
    """A grade from a grader that can tell its own failure (a timeout, an error) from a wrong answer."""

    reward: float
    failed: bool


class Grader(Protocol):
    """Grades the final answer of an episode: reward in [0, 1], or a :class:`Grade` that says whether the
    grader itself failed (reward 0 then, counted in ``info["grade_failures"]``)."""

    def grade(self, answer_text: str) -> float | Grade:
        """``answer_text``: the content of the answer tag, or the whole response's prose for tag-free
        syntaxes."""
        ...


class ToolReply(NamedTuple):
    """What a tool call gives back, for tools that can tell their own failure from the request's."""

    text: str
    failed: bool
    #: The tool's machinery failed (the sandbox could not start, the machine was overloaded), not the
    #: request: counted as ``tool_infra_errors``, never as the model's ``tool_errors``.
    infra_failed: bool = False


class Tool(Protocol):
    """One tool: takes the body of a call (code, query) and returns the text to show and a failure flag."""

    def call(self, request: str) -> tuple[str, bool] | ToolReply:
        """Returns ``(observation_text, failed)`` or a :class:`ToolReply`; never raises on bad requests."""
        ...


@dataclass(frozen=True)
class CallSyntax:
    """How a tool call, its observation and the final answer are written.

    ``answer_open``/``answer_close`` empty means "no answer tag": a turn that is not a tool call is the
    final answer and the grader sees the whole response.
    """

    call_open: str
    call_close: str
    obs_open: str
    obs_close: str
    answer_open: str = "<answer>"
    answer_close: str = "</answer>"
    #: String that ends a tool-call turn when it differs from ``call_close`` (fences: "```" + newline).
    call_stop: str = ""
    #: Without answer tags: the text a final turn must contain to state an answer (else it is a void turn).
    answer_marker: str = ""
    #: More strings that end a turn as a final answer: a few-shot prompt's example separator (the next
    #: ``Question:``), so the turn that states an answer ends there instead of inventing the next example.
    answer_stops: tuple[str, ...] = ()

    @property
    def stop_strings(self) -> tuple[str, ...]:
        call_stop = self.call_stop or self.call_close
        return ((call_stop, self.answer_close) if self.answer_open else (call_stop,)) + self.answer_stops

    def trailing_call(self, text: str) -> str | None:
        """Body of a tool call that ends ``text`` (trailing whitespace ignored), else None."""
        stripped = text.rstrip()
        if not stripped.endswith(self.call_close):
            return None
        end = len(stripped) - len(self.call_close)
        start = stripped.rfind(self.call_open, 0, end)
        if start < 0:
            return None
        return stripped[start + len(self.call_open) : end]

    def prose(self, text: str) -> str:
        """``text`` without its tool calls and the observation blocks it wrote itself (each span from its
        open tag to its close, or to the end when unclosed): what the policy states. An answer tag or a
        ``\\boxed{}`` inside code, a query or an imitated observation is not an answer."""
        spans = ((self.call_open, self.call_close), (self.obs_open, self.obs_close))
        kept, at = [], 0
        while True:
            found = [(text.find(o, at), o, c) for o, c in spans if o and text.find(o, at) >= 0]
            if not found:
                kept.append(text[at:])
                return "".join(kept)
            start, opened, close = min(found)
            kept.append(text[at:start])
            end = text.find(close, start + len(opened))
            if end < 0:
                return "".join(kept)
            at = end + len(close)

    def answer(self, text: str) -> str | None:
        """Content of the last complete answer span in ``text`` (None without one or without tags)."""
        if not self.answer_open:
            return None
        end = text.rfind(self.answer_close)
        if end < 0:
            return None
        start = text.rfind(self.answer_open, 0, end)
        if start < 0:
            return None
        return text[start + len(self.answer_open) : end]


#: ``<python>code</python>`` -> ``<output>...</output>``, answer in ``<answer>`` (built-in arith_tool).
PYTHON_TAGS = CallSyntax("<python>", "</python>", "<output>", "</output>")
#: ToRL / SimpleTIR fenced blocks; the closing fence on its own line ends the turn; answer in \\boxed{}.
PYTHON_FENCES = CallSyntax(
    "```python", "```", "```output\n", "\n```\n", answer_open="", answer_close="", call_stop="```\n",
    answer_marker="\\boxed{",
)
#: Search-R1: ``<search>q</search>`` -> ``<information>...</information>``, answer in ``<answer>``.
SEARCH_TAGS = CallSyntax("<search>", "</search>", "<information>", "</information>")


class ToolEnv:
    """One episode of a tool loop (see the module docstring for the turn rules).

    Args:
        prompt_text: what the policy sees first.
        syntax: how calls, observations and answers are written.
        tool: runs the calls (a Python sandbox, a retriever).
        grader: grades the final answer.
        max_tool_calls: calls beyond this get an error observation instead of running.
    """

    def __init__(
        self,
        prompt_text: str,
        *,
        syntax: CallSyntax,
        tool: Tool,
        grader: Grader,
        max_tool_calls: int,
    ) -> None:
        self._prompt_text = prompt_text
        self._syntax = syntax
        self._tool = tool
        self._grader = grader
        self._max_tool_calls = max_tool_calls
        self._response: list[str] = []
        self._counts = {"tool_calls": 0.0, "tool_errors": 0.0, "tool_infra_errors": 0.0,
                        "grade_failures": 0.0,
                        "void_turn": 0.0, "correct": 0.0, "turns": 0.0}
        self._done = False

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._syntax.stop_strings

    def initial_text(self) -> str:
        return self._prompt_text

    def step(self, action_text: str) -> EnvStep:
        if self._done:
            raise RuntimeError("this episode is over (done was returned); make a new env per episode")
        self._counts["turns"] += 1
        self._response.append(action_text)
        call = self._syntax.trailing_call(action_text)
        if call is not None:
            return EnvStep(observation=self._observe(call), done=False, info=dict(self._counts))
        stated = self._syntax.prose(action_text)
        answer = self._syntax.answer(stated)
        if answer is None and self._syntax.answer_open:
            self._counts["void_turn"] = 1.0
            return self._end(0.0)
        if not self._syntax.answer_open and self._syntax.answer_marker not in stated:
            self._counts["void_turn"] = 1.0  # graded on the whole response all the same (module docstring)
        graded = answer if answer is not None else "".join(self._syntax.prose(t) for t in self._response)
        grade = self._grader.grade(graded)
        if isinstance(grade, Grade):
            self._counts["grade_failures"] = float(grade.failed)
            return self._end(grade.reward)
        return self._end(grade)

    def finish(self, reason: StopReason) -> EnvStep:
        """The loop ended the episode without an answer (``reason``): nothing to grade, reward 0."""
        if self._done:
            raise RuntimeError("finish() after done: the episode was already graded")
        return self._end(0.0)

    def _observe(self, call: str) -> str:
        self._counts["tool_calls"] += 1
        if self._counts["tool_calls"] > self._max_tool_calls:
            self._counts["tool_errors"] += 1
            text = f"Error: no tool calls left (limit {self._max_tool_calls}); give the final answer."
        else:
            reply = self._tool.call(call)
            text, failed = reply[0], reply[1]
            infra = isinstance(reply, ToolReply) and reply.infra_failed
            self._counts["tool_infra_errors" if infra else "tool_errors"] += float(failed or infra)
        return f"{self._syntax.obs_open}{text}{self._syntax.obs_close}"

    def _end(self, reward: float) -> EnvStep:
        self._done = True
        self._counts["correct"] = float(reward >= 1.0)
        return EnvStep(observation=None, done=True, reward=reward, info=dict(self._counts))
