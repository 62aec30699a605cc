"""Running a policy on a task's eval prompts: :func:`evaluate` (avg@k, unbiased pass@k and greedy
accuracy, used by ``copc train`` before, during and after training) and ``copc eval`` on a checkpoint.
The maths of the metrics lives in :mod:`copc.eval.metrics`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from copc.config import ConfigError, from_dict, load_yaml
from copc.eval.metrics import avg_at_k, greedy_accuracy, mean_pass_at_k
from copc.models.hf import load_policy
from copc.rollout.engine import Engine
from copc.rollout.episode import run_episodes
from copc.run_build import policy_path, quiet_transformers
from copc.run_config import EvalConfig, RunConfig, validate_names
from copc.runtime.sync import RolloutConfig
from copc.tasks import Task, get_task
from copc.trainer.checkpoint import load_latest
from copc.types import Prompt, Trajectory

__all__ = ["eval_cli", "evaluate"]


def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    rollout: RolloutConfig,
    eval_cfg: EvalConfig,
    *,
    seed: int,
) -> dict[str, float]:
    """avg@k and unbiased pass@k at the rollout temperature, and greedy accuracy, on eval prompts.

    Sampling uses a generator seeded by ``seed`` (the same prompts and seeds before and after
    training, so the difference is the policy's). Metrics under ``eval/``.
    """
    if eval_cfg.prompts == 0:
        return {}
    prompts = task.prompts("eval", n=eval_cfg.prompts)
    k = eval_cfg.samples
    sampled = _play(model, tokenizer, task, prompts, k, rollout, seed=seed, greedy=False)
    correct = _by_prompt(sampled, len(prompts), k)
    out = {
        "eval/accuracy": avg_at_k(correct),
        "eval/pass_at_k": mean_pass_at_k(correct, k),
        "eval/tool_use_rate": sum(t.info.get("tool_calls", 0.0) > 0 for t in sampled) / len(sampled),
    }
    if eval_cfg.greedy:
        greedy = _play(model, tokenizer, task, prompts, 1, rollout, seed=seed, greedy=True)
        out["eval/greedy_accuracy"] = greedy_accuracy([bool(_correct(t)) for t in greedy])
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
    )


def eval_cli(argv: Sequence[str]) -> int:
    """``copc eval --checkpoint DIR|RUN_DIR [--task NAME] [--prompts N] [--samples K] [--seed S]``."""
    parser = argparse.ArgumentParser(prog="copc eval", description="avg@k, unbiased pass@k and greedy accuracy")
    parser.add_argument("--checkpoint", required=True,
                        help="an HF policy folder, or a run directory (its latest checkpoint is evaluated)")
    parser.add_argument("--task", default=None, help="task name (default: the run's task, else arith_tool)")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--samples", type=int, default=4, help="k of avg@k and pass@k")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-greedy", action="store_true")
    args = parser.parse_args(list(argv))
    quiet_transformers()
    try:
        cfg, model, tokenizer = _load_for_eval(Path(args.checkpoint), args.task)
        eval_cfg = EvalConfig(prompts=args.prompts, samples=args.samples, greedy=not args.no_greedy)
    except (ConfigError, ValueError, OSError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    task = get_task(cfg.task, **cfg.task_options)
    metrics = evaluate(model, tokenizer, task, cfg.rollout, eval_cfg, seed=args.seed)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"copc eval on {cfg.task} ({args.prompts} prompts, k={args.samples})",
                  caption=f"checkpoint: {args.checkpoint}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        table.add_row(key.removeprefix("eval/"), f"{value:.4f}")
    Console().print(table)
    return 0


def _load_for_eval(path: Path, task: str | None) -> tuple[RunConfig, PreTrainedModel, PreTrainedTokenizerBase]:
    if (path / "config.yaml").exists() and (path / "checkpoints").exists():
        cfg = load_yaml(RunConfig, path / "config.yaml")
        if task:
            cfg = replace(cfg, task=task)
        latest = load_latest(path)
        if latest is None:
            raise ValueError(f"{path} has no complete checkpoint to evaluate")
        model, tokenizer = load_policy(policy_path(cfg, path))
        model.load_state_dict(latest[1]["trainer"]["policy"])  # type: ignore[index]
        return cfg, model, tokenizer
    if task is None:
        task = "arith_tool"
    cfg = from_dict(RunConfig, {"task": task})
    validate_names(cfg)
    model, tokenizer = load_policy(path)
    return cfg, model, tokenizer
