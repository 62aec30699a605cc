"""Built-in task ``arith_tool``: arithmetic a tiny model cannot do in its head but can do with Python.

Episode format (one turn per line; the policy writes the lines without ``->``)::

    What is 347*82+915?                      <- prompt
    <python>print(347*82+915)</python>       <- turn 1, generation stops at </python>
    -> <output>29369\\n</output>              <- observation from the real sandbox (not trained on)
    <answer>29369</answer>                   <- turn 2, stops at </answer>; reward 1 iff numeric_equal

Problems come from a seeded generator. Eval problems are drawn first; train problems (and warm-start
demonstrations) skip every expression the eval split holds, so the splits share no expression. They
are compared as written: at difficulty 3, 12 of the 500 eval problems are a train problem with its
operands in another order (``932*551`` and ``551*932``); difficulty 2 (the default) and ``hard`` have
none (counted 2026-12-04).

Difficulty (operand sizes and forms; ``hard=True`` means level 4 plus word problems)::

    1: a*b (2x2 digits)
    2: a*b (3x2), a*b+c (2,2,3), a+b+c (3,3,3)            <- default
    3: a*b (3x3), a*b-c (3,3,3), a*b*c (2,2,2)
    4: a*b (4x4), a*b+c (4,3,4), a*b*c (3,3,2)
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from copc.config import check_fraction, check_positive
from copc.tasks.base import Demo, Segment, Split, check_split, draw_distinct, prompt_text, register_task, take
from copc.tasks.envs import PYTHON_TAGS
from copc.tasks.graders import NumericGrader
from copc.tasks.tooling import python_tool_env, sandbox_config
from copc.types import Env, Prompt

if TYPE_CHECKING:
    from copc.tools.sandbox import SandboxConfig

#: Forms per difficulty: (expression template, digits of each operand).
FORMS: dict[int, tuple[tuple[str, tuple[int, ...]], ...]] = {
    1: (("{0}*{1}", (2, 2)),),
    2: (("{0}*{1}", (3, 2)), ("{0}*{1}+{2}", (2, 2, 3)), ("{0}+{1}+{2}", (3, 3, 3))),
    3: (("{0}*{1}", (3, 3)), ("{0}*{1}-{2}", (3, 3, 3)), ("{0}*{1}*{2}", (2, 2, 2))),
    4: (("{0}*{1}", (4, 4)), ("{0}*{1}+{2}", (4, 3, 4)), ("{0}*{1}*{2}", (3, 3, 2))),
}

#: Word problems for ``word_frac`` > 0: (template, expression it encodes).
WORD_TEMPLATES: dict[str, str] = {
    "A crate holds {0} jars. How many jars are in {1} crates?": "{0}*{1}",
    "{0} people pay {1} coins each and {2} coins are refunded. How many coins are kept?": "{0}*{1}-{2}",
    "A farm has {0} rows of {1} trees and {2} more trees. How many trees?": "{0}*{1}+{2}",
}


@dataclass(frozen=True)
class ArithToolConfig:
    seed: int = 0
    """Seed of the problem generator (train/eval splits and demonstrations)."""
    difficulty: int = 2
    """Operand sizes and forms, 1 (easiest) .. 4; see the module docstring."""
    hard: bool = False
    """Hard setting for long RL runs: difficulty 4 and half word problems (overrides the two fields)."""
    word_frac: float = 0.0
    """Fraction of problems phrased as word problems instead of bare expressions."""
    eval_size: int = 500
    """Number of eval problems."""
    train_size: int = 20000
    """Number of train problems (all distinct, none in the eval split)."""
    max_output_chars: int = 160
    """Sandbox output shown to the policy is truncated to this many characters."""
    timeout_s: float = 5.0
    """Wall-clock limit of one sandbox run, seconds."""
    max_tool_calls: int = 3
    """Python calls allowed per episode; later calls get an error observation."""
    sft_tool_frac: float = 0.5
    """Warm-start mix: fraction of demonstrations that call the tool (the rest answer directly)."""
    sft_error_frac: float = 0.3
    """Warm-start mix: fraction of tool demonstrations with a mistake (wrong operand or output copy)."""

    def __post_init__(self) -> None:
        if self.difficulty not in FORMS:
            raise ValueError(
                f"ArithToolConfig.difficulty must be one of {sorted(FORMS)}, got {self.difficulty}")
        check_positive("ArithToolConfig", eval_size=self.eval_size, train_size=self.train_size)
        check_positive("ArithToolConfig", timeout_s=self.timeout_s)
        if self.max_output_chars < 64:
            raise ValueError(f"ArithToolConfig.max_output_chars must be >= 64, got {self.max_output_chars}")
        check_positive("ArithToolConfig", max_tool_calls=self.max_tool_calls)
        check_fraction("ArithToolConfig", word_frac=self.word_frac, sft_tool_frac=self.sft_tool_frac)
        check_fraction("ArithToolConfig", sft_error_frac=self.sft_error_frac)

    @property
    def level(self) -> int:
        return 4 if self.hard else self.difficulty

    @property
    def effective_word_frac(self) -> float:
        return max(self.word_frac, 0.5) if self.hard else self.word_frac


@dataclass(frozen=True)
class ArithProblem:
    question: str
    expression: str
    operands: tuple[int, ...]
    answer: int


def _random_operand(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def sample_problem(rng: random.Random, config: ArithToolConfig) -> ArithProblem:
    """One problem: a form of the configured level, fresh operands, phrased as words or an expression."""
    template, digits = rng.choice(FORMS[config.level])
    operands = tuple(_random_operand(rng, d) for d in digits)
    expression = template.format(*operands)
    question = f"What is {expression}?"
    if rng.random() < config.effective_word_frac:
        words = [w for w, expr in WORD_TEMPLATES.items() if expr.count("{") == len(operands)]
        if words:
            word = rng.choice(words)
            expression = WORD_TEMPLATES[word].format(*operands)
            question = word.format(*operands)
    answer = eval(expression, {"__builtins__": {}})  # digits and + - * only, built just above
    return ArithProblem(question=question, expression=expression, operands=operands, answer=int(answer))


def generate_problems(
    config: ArithToolConfig, stream: str, n: int, exclude: frozenset[str] = frozenset()
) -> list[ArithProblem]:
    """``n`` problems with distinct expressions, none in ``exclude``; deterministic in (seed, stream)."""
    rng = random.Random(f"arith_tool/{config.seed}/{stream}")
    failure = f"could not draw {n} distinct problems at level {config.level}; lower the size"
    return draw_distinct(lambda: sample_problem(rng, config), lambda p: p.expression, n, set(exclude),
                         failure=failure)


def _perturb_digit(rng: random.Random, number: int) -> int:
    """``number`` with one digit changed (never the leading digit to 0): a plausible copy slip."""
    digits = list(str(number))
    position = rng.randrange(len(digits))
    low = 1 if position == 0 and len(digits) > 1 else 0
    choices = [str(d) for d in range(low, 10) if str(d) != digits[position]]
    digits[position] = rng.choice(choices)
    return int("".join(digits))


def _guess(rng: random.Random, number: int) -> int:
    """A "mental arithmetic" guess: the leading half of the digits kept, the rest random."""
    text = str(abs(number))
    keep = max(1, len(text) // 2)
    tail = "".join(str(rng.randrange(10)) for _ in range(len(text) - keep))
    guess = int(text[:keep] + tail)
    guess = -guess if number < 0 else guess
    return guess if guess != number else guess + 1


@register_task("arith_tool", ArithToolConfig)
class ArithToolTask:
    """Arithmetic with a Python tool (see the module docstring)."""

    name = "arith_tool"

    def __init__(self, config: ArithToolConfig) -> None:
        self.config = config
        self._cache: dict[str, list[ArithProblem]] = {}

    def __getstate__(self) -> dict[str, object]:
        return {"config": self.config, "_cache": {}}

    def problems(self, split: Split) -> list[ArithProblem]:
        check_split(split)
        if split not in self._cache:
            if split == "eval":
                self._cache["eval"] = generate_problems(self.config, "eval", self.config.eval_size)
            else:
                exclude = frozenset(p.expression for p in self.problems("eval"))
                self._cache["train"] = generate_problems(self.config, "train", self.config.train_size,
                                                         exclude)
        return self._cache[split]

    def prompts(self, split: Split, n: int | None = None) -> list[Prompt]:
        problems = take(self.problems(split), n, f"{split} problems")
        return [
            Prompt(
                id=f"arith_tool/{split}/{i}",
                text=prompt_text(p.question),
                answers=(str(p.answer),),
                meta={"expression": p.expression, "level": self.config.level},
            )
            for i, p in enumerate(problems)
        ]

    def sandbox_config(self) -> SandboxConfig:
        """The sandbox its tool calls run in (checked and recorded at the start of a run)."""
        return sandbox_config(self.config.timeout_s)

    def make_env(self, prompt: Prompt) -> Env:
        return python_tool_env(prompt, self.config, syntax=PYTHON_TAGS,
                               grader=NumericGrader(prompt.answers[0]))

    def sft_demos(self, n: int, seed: int) -> list[Demo]:
        """Warm-start demonstrations: tool use (some with copy slips) and direct guesses, in a seeded mix."""
        exclude = frozenset(p.expression for p in self.problems("eval"))
        problems = generate_problems(self.config, f"sft/{seed}", n, exclude)
        rng = random.Random(f"arith_tool/{self.config.seed}/sft-mix/{seed}")
        return [self._demo(rng, p) for p in problems]

    def sft_examples(self, n: int, seed: int) -> list[str]:
        return [demo.text for demo in self.sft_demos(n, seed)]

    def _demo(self, rng: random.Random, problem: ArithProblem) -> Demo:
        prompt = Segment(prompt_text(problem.question), is_action=False)
        if rng.random() >= self.config.sft_tool_frac:
            guess = _guess(rng, problem.answer)
            return Demo((prompt, Segment(f"<answer>{guess}</answer>", True)), kind="direct")
        kind, expression, shown = "tool", problem.expression, problem.answer
        if rng.random() < self.config.sft_error_frac:
            if rng.random() < 0.5:
                kind = "operand_error"
                slipped = list(problem.operands)
                index = rng.randrange(len(slipped))
                old = str(slipped[index])
                slipped[index] = _perturb_digit(rng, slipped[index])
                expression = _replace_nth_number(problem.expression, index, old, str(slipped[index]))
                shown = eval(expression, {"__builtins__": {}})  # digits and + - * only
            else:
                kind = "output_error"
        value = eval(expression, {"__builtins__": {}})
        answer = _perturb_digit(rng, shown) if kind == "output_error" else shown
        return Demo(
            (
                prompt,
                Segment(f"<python>print({expression})</python>", True),
                Segment(python_observation(f"{value}\n", self.config.max_output_chars), False),
                Segment(f"<answer>{answer}</answer>", True),
            ),
            kind=kind,
        )


def _replace_nth_number(expression: str, index: int, old: str, new: str) -> str:
    """Replace the ``index``-th integer literal of ``expression`` (which equals ``old``) by ``new``."""
    import re

    spans = [m.span() for m in re.finditer(r"\d+", expression)]
    start, end = spans[index]
    assert expression[start:end] == old
    return expression[:start] + new + expression[end:]


def python_observation(stdout: str, max_output_chars: int) -> str:
    """The observation the env shows for a clean run printing ``stdout`` (same formatter as the env)."""
    from copc.tools.sandbox import SandboxResult, format_observation

    result = SandboxResult(stdout=stdout, stderr="", exit_code=0, timed_out=False, error=None, duration_s=0.0)
    text = format_observation(result, max_output_chars)
    return f"{PYTHON_TAGS.obs_open}{text}{PYTHON_TAGS.obs_close}"
