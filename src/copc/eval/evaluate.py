"""Running a policy on a task's eval prompts: :func:`evaluate` (avg@k, unbiased pass@k and greedy
accuracy, used by ``copc train`` before, during and after training, by ``copc eval`` and to score the
warm start). The maths of the metrics lives in :mod:`copc.eval.metrics`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from copc import tracking as m
from copc.config import check_at_least
from copc.eval.metrics import avg_at_k, greedy_accuracy, mean_pass_at_k
from copc.rollout.chat import chat_format
from copc.rollout.engine import Engine
from copc.rollout.episode import run_episodes
from copc.rollout.episode_state import truncation_stats
from copc.rollout.generator import RolloutConfig
from copc.tasks import Task
from copc.types import Prompt, Trajectory

__all__ = ["EvalConfig", "evaluate"]


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation before and after training (and every ``every`` steps)."""

    prompts: int = 200
    """Eval prompts (from the task's eval split); 0 = no evaluation (benchmarks)."""
    samples: int = 1
    """Samples per prompt k (avg@k, pass@k)."""
    greedy: bool = True
    """Also measure greedy accuracy (one extra greedy pass)."""
    every: int = 0
    """Evaluate every this many steps during training (0 = only before and after)."""

    def __post_init__(self) -> None:
        check_at_least("eval", 0, prompts=self.prompts, every=self.every)
        check_at_least("eval", 1, samples=self.samples)


def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    rollout: RolloutConfig,
    eval_cfg: EvalConfig,
    *,
    seed: int,
    episodes: list[Trajectory] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, float]:
    """avg@k and unbiased pass@k at the rollout temperature, and greedy accuracy, on eval prompts.

    Sampling uses a generator seeded by ``seed`` (the same prompts and seeds before and after
    training, so the difference is the policy's). Metrics under ``eval/``. ``episodes``, when given,
    receives the sampled (not greedy) trajectories, e.g. to log what the model wrote. ``progress``, when
    given, is called after each round of turns with (episodes finished, episodes in all), the greedy pass's
    counted after the sampled pass's.
    """
    if eval_cfg.prompts == 0:
        return {}
    prompts = task.prompts("eval", n=eval_cfg.prompts)
    k = eval_cfg.samples
    total = len(prompts) * (k + int(eval_cfg.greedy))

    def counter(before: int) -> Callable[[int], None] | None:
        return None if progress is None else (lambda done: progress(before + done, total))

    sampled = _play(model, tokenizer, task, prompts, k, rollout, seed=seed, greedy=False, on_round=counter(0))
    if episodes is not None:
        episodes.extend(sampled)
    correct = _by_prompt(sampled, len(prompts), k)
    out = {
        m.EVAL_ACCURACY: avg_at_k(correct),
        m.EVAL_PASS_AT_K: mean_pass_at_k(correct, k),
        m.EVAL_TOOL_USE_RATE: sum(t.info.get("tool_calls", 0.0) > 0 for t in sampled) / len(sampled),
    }
    cut = truncation_stats(sampled)
    out.update({m.EVAL_TRUNCATED_FRAC: cut.episode_frac, m.EVAL_TRUNCATED_TURN_FRAC: cut.turn_frac,
                m.EVAL_TURN_LIMIT_FRAC: cut.turn_limit_frac})
    played = list(sampled)
    if eval_cfg.greedy:
        greedy = _play(model, tokenizer, task, prompts, 1, rollout, seed=seed, greedy=True,
                       on_round=counter(len(sampled)))
        out[m.EVAL_GREEDY_ACCURACY] = greedy_accuracy([bool(_correct(t)) for t in greedy])
        played += greedy
    # Episodes the machine or the task failed are graded wrong, as the policy's answer never came back: say
    # how many, or the accuracy looks like the policy's alone.
    failed = sum(t.info.get("tool_infra_errors", 0.0) > 0 for t in played)
    raised = sum(t.info.get("env_errors", 0.0) > 0 for t in played)
    out[m.EVAL_TOOL_INFRA_FRAC] = failed / len(played)
    out[m.EVAL_ENV_ERROR_FRAC] = raised / len(played)
    undecided = sum(t.info.get("grade_failures", 0.0) > 0 for t in played)
    out[m.EVAL_GRADE_FAILURE_FRAC] = undecided / len(played)
    if failed:
        print(f"warning: {failed} of {len(played)} evaluation episodes had a tool call fail for the machine "
              f"(the sandbox, not the code) and are graded wrong ({m.EVAL_TOOL_INFRA_FRAC}); the sandbox's "
              "failure kinds are in docs/sandbox.md", file=sys.stderr, flush=True)
    if raised:
        print(f"warning: {raised} of {len(played)} evaluation episodes ended because the environment raised "
              f"(a bug in the task or its tool; the log has the traceback) and are graded wrong "
              f"({m.EVAL_ENV_ERROR_FRAC})",
              file=sys.stderr, flush=True)
    if undecided:
        print(f"warning: {undecided} of {len(played)} evaluation episodes were not graded because the grader "
              f"timed out or raised (e.g. math-verify on a pathological answer) and count as wrong "
              f"({m.EVAL_GRADE_FAILURE_FRAC})",
              file=sys.stderr, flush=True)
    return out


def _correct(traj: Trajectory) -> int:
    return int(traj.info.get("correct", float(traj.reward > 0)) > 0)


def _by_prompt(trajs: Sequence[Trajectory], prompts: int, k: int) -> list[list[bool]]:
    return [[bool(_correct(t)) for t in trajs[i * k : (i + 1) * k]] for i in range(prompts)]


def _play(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    prompts: Sequence[Prompt],
    k: int,
    rollout: RolloutConfig,
    *,
    seed: int,
    greedy: bool,
    on_round: Callable[[int], None] | None = None,
) -> list[Trajectory]:
    engine = Engine(model, tokenizer)
    envs = [task.make_env(p) for p in prompts for _ in range(k)]
    return run_episodes(
        engine,
        envs,
        sampling=rollout.sampling(greedy=greedy),
        seed=seed,
        max_turns=rollout.max_turns,
        max_new_tokens_per_turn=rollout.max_new_tokens_per_turn,
        max_total_tokens=rollout.max_total_tokens,
        context_limit=rollout.context_limit,
        prompt_ids=[p.id for p in prompts for _ in range(k)],
        chat=chat_format(tokenizer, rollout.chat_template),
        on_round=on_round,
    )
