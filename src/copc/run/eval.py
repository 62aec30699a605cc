"""``copc eval``: evaluate an HF policy folder or a run directory's latest checkpoint on a task."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from copc.config import ConfigError, from_dict, load_yaml
from copc.eval.evaluate import EvalConfig, evaluate
from copc.models.hf import load_policy
from copc.run.build import policy_path, quiet_transformers
from copc.run.config import RunConfig, validate_names
from copc.tasks import get_task
from copc.trainer.checkpoint import load_latest

__all__ = ["eval_cli"]


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
