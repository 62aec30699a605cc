"""The shipped word problems: the files are the generator's output, the splits are disjoint, the answers are
right, and ``math_tool`` reads them with the recipe's template."""

import json
import random
import re
import sys
from pathlib import Path

import pytest

from copc.tasks import get_task
from copc.tasks.word_problems import (
    ANSWER_STOP,
    EXAMPLE,
    KINDS,
    TEMPLATE,
    check_splits,
    make_splits,
    problem,
    shipped_paths,
)

ROOT = Path(__file__).resolve().parents[2]


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_shipped_files_are_the_generators_output():
    train, evals = make_splits()
    train_path, eval_path = shipped_paths()
    assert read(train_path) == train
    assert read(eval_path) == evals


def test_splits_are_disjoint_and_big_enough():
    train, evals = (read(p) for p in shipped_paths())
    assert len(evals) >= 200 and len(train) >= 1000
    check_splits(train, evals)
    texts = [r["problem"] for r in train + evals]
    assert len(set(texts)) == len(texts)
    assert EXAMPLE not in texts  # the template's worked example is no row
    assert {r["kind"] for r in evals} == set(KINDS)


def solve(row):
    """The answer worked out again from the text: a slow oracle independent of the generator's arithmetic."""
    n = [int(x) for x in re.findall(r"\d+", row["problem"])]
    if row["kind"] == "convert":
        factor = {"centimeters": 100, "meters": 1000, "minutes": 60, "seconds": 60, "grams": 1000,
                  "hours": 24,
                  "days": 7, "inches": 12, "milliliters": 1000, "eggs": 12}[row["problem"].split()[2]]
        return n[0] * factor
    return {"add": lambda: n[0] + n[1], "sub": lambda: n[0] - n[1], "mul": lambda: n[0] * n[1],
            "div": lambda: n[0] // n[1], "two_step": lambda: n[0] + n[1] - n[2]}[row["kind"]]()


def test_every_answer_is_the_problems_value():
    train, evals = (read(p) for p in shipped_paths())
    for row in train + evals:
        assert int(row["answer"]) == solve(row), row
        assert int(row["answer"]) >= 0
    # a hand-checked row: 16 shared among 4 is 4 each
    assert evals[0] == {"problem": "Lena shares 16 marbles equally among 4 friends. How many marbles does "
                                   "each "
                        "friend get?", "answer": "4", "kind": "div"}


def test_division_is_exact_and_generation_is_seeded():
    rng = random.Random(3)
    for _ in range(200):
        row = problem("div", rng)
        total, friends = (int(x) for x in re.findall(r"\d+", row["problem"]))
        assert total % friends == 0
    assert make_splits(train=50, eval=20, seed=1) == make_splits(train=50, eval=20, seed=1)
    assert make_splits(train=50, eval=20, seed=1) != make_splits(train=50, eval=20, seed=2)


@pytest.mark.parametrize(("train", "evals", "message"), [
    ([{"problem": "a", "answer": "1"}], [{"problem": "a", "answer": "1"}], "in both splits"),
    ([{"problem": "a", "answer": "1"}, {"problem": "a", "answer": "2"}], [{"problem": "b", "answer": "1"}],
     "repeats"),
    ([{"problem": "a", "answer": "x"}], [{"problem": "b", "answer": "1"}], "integer answer"),
])
def test_check_splits_names_the_problem(train, evals, message):
    with pytest.raises(ValueError, match=message):
        check_splits(train, evals)


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="choose one of add"):
        problem("mod", random.Random(0))


def test_math_tool_reads_the_shipped_rows_with_the_template():
    train_path, eval_path = shipped_paths()
    task = get_task("math_tool", data=str(train_path), eval_data=str(eval_path), template=TEMPLATE)
    evals = task.prompts("eval")
    assert len(evals) == 300
    assert evals[0].answers == ("4",)
    assert evals[0].text.endswith(
        "Question: Lena shares 16 marbles equally among 4 friends. How many marbles "
                                  "does each friend get?\nReply:\n")
    assert "\\boxed{8}" in evals[0].text  # the braces of the worked example survive str.format
    assert not {p.text for p in evals} & {p.text for p in task.prompts("train")}


def test_recipe_overrides_parse_to_the_template(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from real_model_recipe import RECIPE, TRAIN_RECIPE

    from copc.run.config import apply_run_overrides, default_config

    cfg = apply_run_overrides(default_config(), [*TRAIN_RECIPE, f"run_dir={tmp_path}/r"])
    assert cfg.task_options["template"] == TEMPLATE
    assert cfg.task_options["answer_stop"] == ANSWER_STOP == "Question:"
    assert cfg.method == "async_ppo" and cfg.driver.kind == "async"
    assert set(RECIPE) <= set(TRAIN_RECIPE)


def word_problem_task(**options):
    train_path, eval_path = shipped_paths()
    return get_task("math_tool", data=str(train_path), eval_data=str(eval_path), template=TEMPLATE,
                    grade_timeout_s=10.0, **options)


def test_the_answer_stop_ends_the_reply_that_starts_the_next_question():
    # The base model's usual reply: the right sum, boxed, then a question of its own with another box. The
    # grader reads the last box, so the reply is right only when the turn ends at the next "Question:".
    task = word_problem_task(answer_stop=ANSWER_STOP)
    prompt = task.prompts("eval", 1)[0]  # 16 marbles among 4 friends: 4
    env = task.make_env(prompt)
    assert env.stop_strings == ("```\n", "Question:")
    env.initial_text()
    assert not env.step("```python\nprint(16 // 4)\n```\n").done  # the code block is a tool call
    step = env.step("The answer is \\boxed{4}.\n\nQuestion:")  # the engine stops the turn here
    assert step.done and step.reward == 1.0
    wrong = task.make_env(prompt)
    wrong.initial_text()
    assert wrong.step("The answer is \\boxed{16}.\n\nQuestion:").reward == 0.0
    # Without the option the fences' stop is the only one (math_tool's default is unchanged).
    assert word_problem_task().make_env(prompt).stop_strings == ("```\n",)


def test_a_blank_answer_stop_is_refused():
    with pytest.raises(ValueError, match="answer_stop is blank"):
        word_problem_task(answer_stop="  ")
