"""Short arithmetic and unit-conversion word problems for ``math_tool``: the real-model walk-through's data.

A small instruct model (SmolLM2-135M-Instruct) answers some of these and misses others, so a run on them
has a learning signal from its first step, which competition maths (MATH, GSM8K) does not give a model
that small. Every row is ``{"problem", "answer", "kind"}`` with an integer answer; the kinds::

    add       Mia has 7 marbles. She gets 5 more. How many marbles does she have now?
    sub       Mia has 14 marbles. She gives away 6. How many marbles does she have left?
    mul       Mia buys 4 boxes with 3 marbles in each box. How many marbles does Mia buy?
    div       Mia shares 12 marbles equally among 3 friends. How many marbles does each friend get?
    two_step  Mia has 8 marbles. She gets 3 more and gives away 5. How many marbles does she have now?
    convert   How many centimeters are in 4 meters?

The numbers are small on purpose: SmolLM2-135M-Instruct gets about 3% of the same kinds right with
two-digit numbers (its sums are often wrong, and it seldom writes ``\\boxed{}``), which leaves a run almost
no reward to learn from.

Splits are disjoint by construction: each problem text goes to one split only (the eval rows are drawn
first, then train rows whose text is not among them), and :func:`check_splits` verifies it.

    python -m copc.tasks.word_problems OUT_DIR [--train 2000] [--eval 300] [--seed 0]

writes ``OUT_DIR/train.jsonl`` and ``OUT_DIR/eval.jsonl``; the shipped copies (:func:`shipped_paths`) are
the output for the defaults.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

from copc.tasks.base import draw_distinct

__all__ = ["ANSWER_STOP", "KINDS", "TEMPLATE", "check_splits", "make_splits", "problem", "shipped_paths",
           "write_splits"]

NAMES = ("Mia", "Noah", "Ava", "Liam", "Zoe", "Omar", "Lena", "Ravi", "Sara", "Tom", "Nina", "Ben")
PRONOUNS = {"Mia": "She", "Ava": "She", "Zoe": "She", "Lena": "She", "Sara": "She", "Nina": "She"}
ITEMS = ("marbles", "apples", "stickers", "pencils", "cards", "shells", "stamps", "cookies", "books", "coins")
#: (bigger unit, smaller unit, smaller units in one bigger unit)
UNITS = (("meters", "centimeters", 100), ("kilometers", "meters", 1000), ("hours", "minutes", 60),
         ("minutes", "seconds", 60), ("kilograms", "grams", 1000), ("days", "hours", 24),
         ("weeks", "days", 7), ("feet", "inches", 12), ("liters", "milliliters", 1000), ("dozens", "eggs",
                                                                                         12))

Row = dict[str, str]

#: The ``math_tool`` prompt for these rows (``task_options.template``): one worked example that runs Python
#: and boxes the printed value, then the problem. A 135M model copies the example's form; with the task's
#: own instruction-only template it seldom runs code or boxes an answer.
EXAMPLE = "Tom has 5 apples. He gets 3 more. How many apples does he have now?"
TEMPLATE = (
    f"Question: {EXAMPLE}\nReply:\n"
    "```python\nprint(5 + 3)\n```\n```output\n8\n```\nThe answer is \\boxed{{8}}.\n\n"
    "Question: {problem}\nReply:\n"
)
#: ``math_tool``'s ``answer_stop`` for :data:`TEMPLATE`: a reply ends where the model starts the next
#: ``Question:`` of the pattern. Without it the 135M model boxes the right value, then invents another
#: question, runs its code and boxes that one, and the grader (the last ``\boxed{}``) marks it wrong.
ANSWER_STOP = "Question:"


def _who(rng: random.Random) -> tuple[str, str, str]:
    name = rng.choice(NAMES)
    pronoun = PRONOUNS.get(name, "He")
    return name, pronoun, rng.choice(ITEMS)


def _add(rng: random.Random) -> tuple[str, int]:
    name, he, item = _who(rng)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"{name} has {a} {item}. {he} gets {b} more. How many {item} does {he.lower()} have now?", a + b


def _sub(rng: random.Random) -> tuple[str, int]:
    name, he, item = _who(rng)
    a = rng.randint(6, 18)
    b = rng.randint(2, a - 2)
    return f"{name} has {a} {item}. {he} gives away {b}. How many {item} does {he.lower()} have left?", a - b


def _mul(rng: random.Random) -> tuple[str, int]:
    name, _, item = _who(rng)
    a, b = rng.randint(2, 5), rng.randint(2, 6)
    return f"{name} buys {a} boxes with {b} {item} in each box. How many {item} does {name} buy?", a * b


def _div(rng: random.Random) -> tuple[str, int]:
    name, _, item = _who(rng)
    each, friends = rng.randint(2, 5), rng.randint(2, 4)
    return (f"{name} shares {each * friends} {item} equally among {friends} friends. "
            f"How many {item} does each friend get?", each)


def _two_step(rng: random.Random) -> tuple[str, int]:
    name, he, item = _who(rng)
    a, b = rng.randint(3, 9), rng.randint(2, 5)
    c = rng.randint(1, a)
    return (f"{name} has {a} {item}. {he} gets {b} more and gives away {c}. "
            f"How many {item} does {he.lower()} have now?", a + b - c)


def _convert(rng: random.Random) -> tuple[str, int]:
    big, small, factor = rng.choice(UNITS)
    n = rng.randint(2, 9)
    return f"How many {small} are in {n} {big}?", n * factor


KINDS: dict[str, Callable[[random.Random], tuple[str, int]]] = {
    "add": _add, "sub": _sub, "mul": _mul, "div": _div, "two_step": _two_step, "convert": _convert,
}


def problem(kind: str, rng: random.Random) -> Row:
    """One row of ``kind`` (a key of :data:`KINDS`) drawn with ``rng``."""
    if kind not in KINDS:
        raise ValueError(f"unknown word-problem kind {kind!r}; choose one of {', '.join(KINDS)}")
    text, answer = KINDS[kind](rng)
    return {"problem": text, "answer": str(answer), "kind": kind}


def _draw(rng: random.Random, n: int, taken: set[str]) -> list[Row]:
    """``n`` rows of distinct texts not in ``taken`` (each of a kind drawn at random, so each kind is about
    1/6 of them until its texts run out); the texts drawn are added to ``taken``."""
    kinds = list(KINDS)
    return draw_distinct(lambda: problem(rng.choice(kinds), rng), lambda row: row["problem"], n, taken,
                         failure=f"could not draw {n} distinct word problems; ask for fewer rows")


def make_splits(*, train: int = 2000, eval: int = 300, seed: int = 0) -> tuple[list[Row], list[Row]]:
    """``(train_rows, eval_rows)``: deterministic in ``seed``, no problem text in both."""
    if train < 1 or eval < 1:
        raise ValueError(f"train and eval must be >= 1 rows, got train={train} eval={eval}")
    rng = random.Random(seed)
    taken = {EXAMPLE}  # the template's worked example is in no split
    evals = _draw(rng, eval, taken)
    return _draw(rng, train, taken), evals


def check_splits(train: Sequence[Row], evals: Sequence[Row]) -> None:
    """Raise ValueError naming the first problem unless every row has a problem and an integer answer
    and no problem text is in both splits or twice in one."""
    for split, rows in (("train", train), ("eval", evals)):
        seen: set[str] = set()
        for i, row in enumerate(rows):
            if not row.get("problem") or not str(row.get("answer", "")).lstrip("-").isdigit():
                raise ValueError(f"{split} row {i}: needs a problem and an integer answer, got {row}")
            if row["problem"] in seen:
                raise ValueError(f"{split} row {i} repeats an earlier problem: {row['problem']!r}")
            seen.add(row["problem"])
    both = {r["problem"] for r in train} & {r["problem"] for r in evals}
    if both:
        raise ValueError(f"{len(both)} problems are in both splits, e.g. {sorted(both)[0]!r}")


def write_splits(folder: str | Path, *, train: int = 2000, eval: int = 300,
                 seed: int = 0) -> tuple[Path, Path]:
    """Write ``folder/train.jsonl`` and ``folder/eval.jsonl`` (:func:`make_splits`); return their paths."""
    rows = make_splits(train=train, eval=eval, seed=seed)
    check_splits(*rows)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = (out / "train.jsonl", out / "eval.jsonl")
    for path, split in zip(paths, rows, strict=True):
        path.write_text("".join(json.dumps(r) + "\n" for r in split))
    return paths


def shipped_paths() -> tuple[Path, Path]:
    """``(train.jsonl, eval.jsonl)`` shipped with copc (the defaults' output): ``task_options.data=`` and
    ``task_options.eval_data=`` of the real-model walk-through."""
    folder = Path(__file__).resolve().parent / "data" / "word_problems"
    return folder / "train.jsonl", folder / "eval.jsonl"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="folder to write train.jsonl and eval.jsonl to")
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--eval", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for path in write_splits(args.out, train=args.train, eval=args.eval, seed=args.seed):
        print(path)


if __name__ == "__main__":
    main()
