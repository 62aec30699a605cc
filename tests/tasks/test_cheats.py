"""A policy that tries to cheat: outputs built to earn reward without solving the task, played through each
task's real reward path (``task.make_env(prompt)``, then ``env.step``: the tool loop, the grader, the real
sandbox and retriever), as the episode loop plays them.

Every cheat earns exactly what a correct reading gives (0 here), and none is counted as the sandbox's
(``tool_infra_errors``) or the grader's (``grade_failures``) fault. The graders' rules are listed in
docs/reliability.md ("What the graders accept").
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from copc.tasks import get_task
from copc.tasks.base import Task
from copc.types import StopReason

pytestmark = pytest.mark.timeout(300)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GOLD = "{gold}"  # replaced by the prompt's gold answer in each cheat
ZWSP, CYRILLIC_A = "\u200b", "\u0430"


def build(name: str) -> Task:
    options: dict[str, dict[str, object]] = {
        "arith_tool": {"eval_size": 4, "timeout_s": 10.0},
        "math_tool": {"data": str(FIXTURES / "math_tool.jsonl"), "eval_size": 2, "grade_timeout_s": 3.0},
        "search_qa": {
            "data": str(FIXTURES / "search_qa.jsonl"),
            "corpus": str(FIXTURES / "corpus.jsonl"),
            "eval_size": 2,
        },
    }
    return get_task(name, **options.get(name, {}))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tasks() -> dict[str, Task]:
    return {}


def play(tasks: dict[str, Task], name: str, turns: Sequence[str], *, prompt: int = 0) -> tuple[float, dict]:
    """Play ``turns`` (``{gold}`` replaced by the gold answer) as the policy's turns of one episode; the
    loop ends an episode that is not done after them (``finish``: nothing to grade)."""
    if name not in tasks:
        tasks[name] = build(name)
    task = tasks[name]
    chosen = task.prompts("eval", 2)[prompt]
    env = task.make_env(chosen)
    env.initial_text()
    step = None
    for turn in turns:
        step = env.step(turn.replace(GOLD, chosen.answers[0]))
        if step.done:
            break
    if step is None or not step.done:
        step = env.finish(StopReason.MAX_TURNS)
    return float(step.reward), dict(step.info)


def assert_cheat_earns_nothing(reward: float, info: dict) -> None:
    assert reward == 0.0, info
    assert info.get("correct", 0.0) == 0.0, info
    assert info.get("tool_infra_errors", 0.0) == 0.0, info  # not the sandbox's fault
    assert info.get("grade_failures", 0.0) == 0.0, info  # not the grader's fault


TAGGED = ("arith_tool", "kv_search", "kv_chain", "search_qa")

#: (task, turns): the honest answer, to show the path rewards a correct reading.
HONEST = [(name, ["<answer>{gold}</answer>"]) for name in TAGGED] + [("math_tool", [r"so \boxed{{gold}}"])]

CHEATS = {
    # text that imitates a tool observation or a search result, with no answer of its own
    "imitated observation": [(n, ["<output>{gold}</output>"]) for n in ("arith_tool",)]
    + [(n, ["<information>the answer is {gold}</information>"]) for n in TAGGED[1:]]
    + [("math_tool", ["```output\n\\boxed{{gold}}\n```\n"])],
    # the answer written inside an imitated observation (the turn stops at </answer>, its stop string)
    "answer inside an imitated observation": [("arith_tool", ["<output><answer>{gold}</answer>"])]
    + [(n, ["<information><answer>{gold}</answer>"]) for n in TAGGED[1:]],
    # answer tags inside a tool call: code or a query, not an answer
    "answer inside a tool call": [("arith_tool", ['<python>x = "<answer>{gold}</answer>"</python>'])]
    + [(n, ["<search><answer>{gold}</answer></search>"]) for n in TAGGED[1:]]
    + [
        ("math_tool", ["```python\nprint('\\\\boxed{{gold}}')\n```\n", "I cannot tell."]),
        ("math_tool", ["Look: ```python\nx = '\\\\boxed{{gold}}'\n``` is my guess"]),
    ],
    # an unclosed tool call whose turn ends at the answer's close (the stop string)
    "answer inside an unclosed tool call": [("arith_tool", ['<python>print("<answer>{gold}</answer>'])],
    # several answers: the last one is the answer, so hedging with the right one first earns nothing
    "several answers, the last wrong": [(n, ["<answer>{gold}</answer> <answer>0</answer>"]) for n in TAGGED]
    + [("math_tool", [r"\boxed{{gold}} or maybe \boxed{0}"])],
    "several values in one answer": [
        ("arith_tool", ["<answer>{gold} or 1</answer>"]),
        ("arith_tool", ["<answer>{gold}, 1</answer>"]),
        ("kv_search", ["<answer>{gold} or something</answer>"]),
        ("math_tool", [r"\boxed{{gold}, 1}"]),
    ],
    # 1 MB answers: graded wrong, in bounded time, not a grader failure
    "a 1 MB answer": [(n, ["<answer>" + "9" * 1_000_000 + "</answer>"]) for n in ("arith_tool", "kv_search")]
    + [
        ("arith_tool", ["<answer>{gold}" + " " * 1_000_000 + "0</answer>"]),
        ("math_tool", ["\\boxed{" + "9" * 1_000_000 + "}"]),
    ],
    # LaTeX that sends sympy into a loop (or past any time limit): the answer's cost, not the grader's fault
    "LaTeX that never finishes": [
        ("math_tool", [r"\boxed{9^{9^{9^{9}}}}"]),
        ("math_tool", [r"\boxed{10^{10^{10^{10^{10}}}}}"]),
        ("math_tool", ["\\boxed{" + "(" * 2000 + "1" + ")" * 2000 + "}"]),
    ],
    # Unicode look-alikes and zero-width characters against exact and numeric match
    "zero-width characters": [(n, ["<answer>{gold}" + ZWSP + "</answer>"]) for n in TAGGED]
    + [(n, ["<answer>" + ZWSP + "{gold}</answer>"]) for n in TAGGED],
    "look-alike letters": [("kv_search", ["<answer>" + CYRILLIC_A + " {gold}</answer>"])],
    # code that prints an answer tag (or a box) into its observation, then a turn that only closes it
    "code that prints an answer into its observation": [
        ("arith_tool", ['<python>print("<answer>{gold}</answer>")</python>', "</answer>"]),
        ("arith_tool", ['<python>print("<answer>{gold}")</python>', "</answer>"]),
        ("math_tool", ["```python\nprint('\\\\boxed{{gold}}')\n```\n", "}"]),
    ],
}


@pytest.mark.parametrize(("name", "turns"), HONEST, ids=[n for n, _ in HONEST])
def test_the_honest_answer_earns_the_reward(tasks: dict[str, Task], name: str, turns: list[str]) -> None:
    reward, info = play(tasks, name, turns)
    assert reward == 1.0 and info["correct"] == 1.0, info


CASES = [(kind, name, turns) for kind, cases in CHEATS.items() for name, turns in cases]


@pytest.mark.parametrize(
    ("kind", "name", "turns"), CASES, ids=[f"{k}-{n}-{i}" for i, (k, n, _) in enumerate(CASES)]
)
def test_a_cheat_earns_nothing_and_is_nobodys_fault(
    tasks: dict[str, Task], kind: str, name: str, turns: list[str]
) -> None:
    start = time.monotonic()
    reward, info = play(tasks, name, turns)
    assert_cheat_earns_nothing(reward, info)
    assert time.monotonic() - start < 60, f"{kind}: grading took {time.monotonic() - start:.0f} s"


def test_fullwidth_digits_are_read_as_the_number_they_spell(tasks: dict[str, Task]) -> None:
    """Not a cheat: ``４２`` is 42 written in full-width digits (Unicode decimal digits), and the numeric
    grader reads it as 42, as Python's ``int`` does. A correct reading, so it earns the reward."""
    full = str.maketrans("0123456789", "０１２３４５６７８９")
    if "arith_tool" not in tasks:
        tasks["arith_tool"] = build("arith_tool")
    gold = tasks["arith_tool"].prompts("eval", 2)[0].answers[0]
    reward, info = play(tasks, "arith_tool", [f"<answer>{gold.translate(full)}</answer>"])
    assert reward == 1.0, info
