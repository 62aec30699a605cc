"""copc.eval.evaluate with the tiny model and a scripted task whose rewards and tool outcomes are known."""

from __future__ import annotations

from collections import Counter

import pytest

from copc import tracking as m
from copc.eval.evaluate import EvalConfig, evaluate
from copc.models.tiny import build_tiny_model, build_tiny_tokenizer
from copc.rollout.generator import RolloutConfig
from copc.tasks.base import Split
from copc.types import EnvStep, Prompt
from reference.scripted_env import ScriptedEnv


class ScriptedTask:
    """Prompt i is answered right when i is even; the first episode made for prompt 0 has its tool call
    fail for the machine (the sandbox, not the code): it is graded wrong."""

    name = "scripted"

    def __init__(self, *, infra: bool = True) -> None:
        self.pool = [Prompt(id=f"p{i}", text=f"q{i}:", answers=("1",)) for i in range(3)]
        self.made: Counter[str] = Counter()
        self.infra = infra

    def prompts(self, split: Split, n: int | None = None) -> list[Prompt]:
        return self.pool[:n]

    def make_env(self, prompt: Prompt) -> ScriptedEnv:
        first = self.made[prompt.id] == 0
        self.made[prompt.id] += 1
        infra = self.infra and prompt.id == "p0" and first
        right = int(prompt.id[1:]) % 2 == 0 and not infra
        return ScriptedEnv(prompt, float(right), {"tool_calls": 1.0, "tool_infra_errors": float(infra)})


def test_tool_failures_of_the_machine_are_reported_not_hidden_in_the_accuracy(
        capsys: pytest.CaptureFixture[str]) -> None:
    """An evaluation episode whose tool call failed for the machine counts as wrong (the accuracy is what
    the policy got), and the evaluation says how many there were, in ``eval/tool_infra_frac`` and on
    stderr; before (found by an audit, 2026-12-04), nothing showed them."""
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=0)
    rollout = RolloutConfig(max_turns=1, max_new_tokens_per_turn=4, max_total_tokens=4, context_limit=64)
    out = evaluate(model, tok, ScriptedTask(), rollout, EvalConfig(prompts=3, samples=2, greedy=True),
                   seed=0)  # type: ignore[arg-type]
    # sampled: p0 1/2 right (its first episode failed), p1 0/2, p2 2/2 -> avg@2 (0.5 + 0 + 1) / 3
    assert out[m.EVAL_ACCURACY] == pytest.approx(0.5)
    # one episode of the 9 (6 sampled, 3 greedy) had the machine fail its tool call
    assert out[m.EVAL_TOOL_INFRA_FRAC] == pytest.approx(1 / 9)
    err = capsys.readouterr().err
    assert "1 of 9 evaluation episodes had a tool call fail for the machine" in err
    assert out[m.EVAL_ENV_ERROR_FRAC] == 0.0
    clean = evaluate(model, tok, ScriptedTask(infra=False), rollout, EvalConfig(prompts=3, samples=2),
                     seed=0)  # type: ignore[arg-type]
    assert clean[m.EVAL_TOOL_INFRA_FRAC] == 0.0 and clean[m.EVAL_ACCURACY] == pytest.approx(2 / 3)
    assert "fail for the machine" not in capsys.readouterr().err


class RaisingTask(ScriptedTask):
    """As ScriptedTask without tool failures, but the environment of prompt p2 raises (a bug in the
    environment, e.g. a search tool that crashes): those episodes end with reward 0."""

    def make_env(self, prompt: Prompt) -> ScriptedEnv:
        env = super().make_env(prompt)
        if prompt.id == "p2":
            def broken(action_text: str) -> EnvStep:
                raise RuntimeError("the retriever crashed")
            env.step = broken  # type: ignore[method-assign]
            env.finish = lambda reason: broken("")  # type: ignore[method-assign]
        return env


def test_environment_errors_are_reported_not_hidden_in_the_accuracy(
        capsys: pytest.CaptureFixture[str]) -> None:
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=0)
    rollout = RolloutConfig(max_turns=1, max_new_tokens_per_turn=4, max_total_tokens=4, context_limit=64)
    out = evaluate(model, tok, RaisingTask(infra=False), rollout,
                   EvalConfig(prompts=3, samples=2, greedy=False), seed=0)  # type: ignore[arg-type]
    assert out[m.EVAL_ACCURACY] == pytest.approx(1 / 3)  # p0 2/2, p1 0/2, p2 (crashed) 0/2
    assert out[m.EVAL_ENV_ERROR_FRAC] == pytest.approx(2 / 6) and out[m.EVAL_TOOL_INFRA_FRAC] == 0.0
    assert "2 of 6 evaluation episodes ended because the environment raised" in capsys.readouterr().err


class UndecidedTask(ScriptedTask):
    """As ScriptedTask without tool failures, but the grader of prompt p2 could not decide (math-verify timed
    out): reward 0 with ``grade_failures`` = 1."""

    def make_env(self, prompt: Prompt) -> ScriptedEnv:
        if prompt.id == "p2":
            return ScriptedEnv(prompt, 0.0, {"grade_failures": 1.0})
        return super().make_env(prompt)


def test_grader_failures_are_reported_not_hidden_in_the_accuracy(capsys: pytest.CaptureFixture[str]) -> None:
    """An answer the grader could not decide (a timeout, an error) scores 0 like a wrong one; the
    evaluation says how many, in ``eval/grade_failure_frac`` and on stderr (review 14: nothing did)."""
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=0)
    rollout = RolloutConfig(max_turns=1, max_new_tokens_per_turn=4, max_total_tokens=4, context_limit=64)
    out = evaluate(model, tok, UndecidedTask(infra=False), rollout,
                   EvalConfig(prompts=3, samples=2, greedy=False), seed=0)  # type: ignore[arg-type]
    assert out[m.EVAL_ACCURACY] == pytest.approx(1 / 3) and out[m.EVAL_GRADE_FAILURE_FRAC] == pytest.approx(
        2 / 6)
    assert ("2 of 6 evaluation episodes were not graded because the grader timed out or raised"
            in capsys.readouterr().err)
