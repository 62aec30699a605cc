"""arith_tool: seeded generator, disjoint splits, per-turn env behaviour with the real sandbox, demos."""

import re
from collections import Counter

import pytest

from copc.tasks import get_task
from copc.types import StopReason

SMALL = {"eval_size": 60, "train_size": 300}


def expressions(prompts):
    return {p.meta["expression"] for p in prompts}


def test_generator_is_deterministic_and_seeded():
    a = get_task("arith_tool", **SMALL).prompts("train")
    b = get_task("arith_tool", **SMALL).prompts("train")
    c = get_task("arith_tool", seed=1, **SMALL).prompts("train")
    assert a == b
    assert expressions(a) != expressions(c)


@pytest.mark.parametrize("fields", [{"difficulty": 1, "eval_size": 500, "train_size": 4000}, {"hard": True,
                                                                                              **SMALL}])
def test_splits_and_demos_share_no_expression(fields):
    # Difficulty 1 has only 90 * 90 = 8100 expressions: independent draws of 500 and 4000 would share
    # about 250, so this fails unless the train split really skips the eval expressions.
    task = get_task("arith_tool", **fields)
    train, evals = task.prompts("train"), task.prompts("eval")
    assert len(expressions(train)) == len(train) == fields["train_size"]  # distinct within a split too
    assert not expressions(train) & expressions(evals)
    demos = task.sft_demos(2000, seed=0)
    demo_exprs = {re.search(r"print\((.*)\)", d.text).group(1) for d in demos if d.kind == "tool"}
    assert not demo_exprs & expressions(evals)


def test_answers_are_the_values_of_the_expressions():
    for fields in ({}, {"hard": True}):
        for prompt in get_task("arith_tool", **SMALL, **fields).prompts("eval"):
            assert int(prompt.answers[0]) == eval(prompt.meta["expression"])


def test_difficulty_sets_operand_sizes_and_hard_adds_word_problems():
    easy = get_task("arith_tool", difficulty=1, **SMALL).prompts("eval")
    assert all(re.fullmatch(r"\d\d\*\d\d", p.meta["expression"]) for p in easy)
    hard = get_task("arith_tool", hard=True, **SMALL).prompts("eval")
    operands = [len(x) for p in hard for x in re.findall(r"\d+", p.meta["expression"])]
    assert min(operands) >= 2 and max(operands) == 4
    words = sum(not p.text.startswith("What is") for p in hard)
    assert 0.3 < words / len(hard) < 0.7  # about half are word problems
    assert get_task("arith_tool", hard=True, **SMALL).config.level == 4


@pytest.fixture(scope="module")
def task():
    return get_task("arith_tool", **SMALL)


@pytest.fixture()
def prompt(task):
    return task.prompts("eval", 1)[0]


def test_tool_call_then_correct_answer(task, prompt):
    env = task.make_env(prompt)
    assert env.initial_text() == prompt.text
    assert env.stop_strings == ("</python>", "</answer>")
    step = env.step(f"<python>print({prompt.meta['expression']})</python>")
    assert not step.done and step.reward == 0.0
    assert step.observation == f"<output>{prompt.answers[0]}</output>"
    assert step.info["tool_calls"] == 1 and step.info["tool_errors"] == 0
    final = env.step(f"<answer>{prompt.answers[0]}</answer>")
    assert final.done and final.observation is None and final.reward == 1.0
    assert final.info["correct"] == 1.0 and final.info["turns"] == 2
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step("<answer>1</answer>")


def test_wrong_answer_scores_zero(task, prompt):
    final = task.make_env(prompt).step(f"<answer>{int(prompt.answers[0]) + 1}</answer>")
    assert final.done and final.reward == 0.0 and final.info["correct"] == 0.0


def test_malformed_code_returns_the_error_as_text(task, prompt):
    env = task.make_env(prompt)
    step = env.step("<python>print(12*</python>")
    assert not step.done
    assert step.observation.startswith("<output>") and step.observation.endswith("</output>")
    assert "SyntaxError" in step.observation
    assert step.info["tool_errors"] == 1
    empty = env.step("<python>  </python>")
    assert "empty code block" in empty.observation and empty.info["tool_errors"] == 2


def test_long_output_is_truncated(task, prompt):
    step = task.make_env(prompt).step("<python>print('x' * 5000)</python>")
    body = step.observation.removeprefix("<output>").removesuffix("</output>")
    assert len(body) <= task.config.max_output_chars and "truncated" in body


def test_tool_budget(prompt):
    env = get_task("arith_tool", max_tool_calls=1, **SMALL).make_env(prompt)
    assert "Error" not in env.step("<python>print(1)</python>").observation
    over = env.step("<python>print(2)</python>")
    assert "no tool calls left" in over.observation and over.info["tool_errors"] == 1


def test_void_turn_ends_the_episode_with_zero(task, prompt):
    """A turn with neither a complete call nor an answer (e.g. text then EOS) is a void turn."""
    env = task.make_env(prompt)
    final = env.step("I think it is big")
    assert final.done and final.reward == 0.0 and final.info["void_turn"] == 1.0


def test_finish_without_answer_scores_zero(task, prompt):
    env = task.make_env(prompt)
    env.step("<python>print(1)</python>")
    final = env.finish(StopReason.MAX_TURNS)
    assert final.done and final.reward == 0.0 and final.info["tool_calls"] == 1


def test_demos_mix_and_consistency_with_the_env(task):
    demos = task.sft_demos(400, seed=3)
    assert [d.text for d in demos] == task.sft_examples(400, seed=3)
    assert demos != task.sft_demos(400, seed=4)
    kinds = Counter(d.kind for d in demos)
    # sft_tool_frac 0.5, sft_error_frac 0.3 split evenly between the two slips: expected 200/140/30/30.
    assert 160 < kinds["direct"] < 240 and 100 < kinds["tool"] < 180
    assert 12 < kinds["operand_error"] < 50 and 12 < kinds["output_error"] < 50
    for demo in demos[:40]:
        assert not demo.segments[0].is_action  # the prompt is never trained on
        if demo.kind == "direct":
            continue
        call, obs, answer = demo.segments[1:]
        assert call.is_action and not obs.is_action and answer.is_action
        # The observation in the demo is exactly what the env (real sandbox) returns for that call.
        env = task.make_env(task.prompts("eval", 1)[0])
        assert env.step(call.text).observation == obs.text
        shown = obs.text.removeprefix("<output>").removesuffix("</output>")
        given = answer.text.removeprefix("<answer>").removesuffix("</answer>")
        assert (given == shown) == (demo.kind != "output_error")


def test_operand_error_demos_change_one_digit(task):
    demos = [d for d in task.sft_demos(300, seed=0) if d.kind == "operand_error"]
    assert demos
    for demo in demos:
        question = re.search(r"What is (.*)\?", demo.segments[0].text).group(1)
        code = re.search(r"print\((.*)\)", demo.segments[1].text).group(1)
        assert len(question) == len(code)
        assert sum(a != b for a, b in zip(question, code, strict=True)) == 1
