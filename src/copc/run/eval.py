"""``copc eval``: evaluate an HF policy folder or a run directory's latest checkpoint on any task.

    copc eval --checkpoint RUN_DIR                          # the run's task, options and rollout budgets
    copc eval --checkpoint HF_DIR --task math_tool task_options.data=rows.jsonl task_options.eval_size=50 \\
        rollout.max_new_tokens_per_turn=256 rollout.chat_template=auto

The config is the run's ``config.yaml`` (a run directory) or the embedded default (an HF folder), then
``--task`` (which resets ``task_options`` to the new task's defaults when it changes the task), then the
``key.sub=value`` overrides, with the same one-line checks as ``copc train`` (unknown keys, bad values,
missing data files) before any model is loaded.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from copc.config import CommandParser, ConfigError, load_yaml
from copc.eval.evaluate import EvalConfig, evaluate
from copc.models.hf import load_policy
from copc.rollout.samples import append_samples
from copc.run.build import capped_context_limit, policy_path, quiet_transformers
from copc.run.config import RunConfig, apply_run_overrides, default_config, validate_names
from copc.run.readers import checkpoint_phrase, partial_checkpoint_notes, run_state
from copc.tasks import get_task
from copc.trainer.checkpoint import list_checkpoints, load_latest
from copc.types import Trajectory

__all__ = ["eval_cli", "eval_config"]


def eval_cli(argv: Sequence[str]) -> int:
    """``copc eval --checkpoint DIR|RUN_DIR [--task NAME] [--prompts N] [--samples K] [key.sub=value
    ...]``."""
    parser = CommandParser(prog="copc eval", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="an HF policy folder, or a run directory (its latest checkpoint is evaluated)")
    parser.add_argument("--task", default=None, help="task name (default: the run's task, else arith_tool)")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--samples", type=int, default=4, help="k of avg@k and pass@k")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-greedy", action="store_true")
    parser.add_argument("--samples-out", default=None, metavar="FILE",
                        help="append rendered sampled episodes (prompt, turns, tool output, reward) as JSONL")
    parser.add_argument("--samples-limit", type=int, default=8, help="episodes written by --samples-out")
    parser.add_argument("overrides", nargs="*",
                        help="key.sub=value overrides of the run config (task_options.*, rollout.* ...)")
    args = parser.parse_args(list(argv))
    quiet_transformers()
    path = Path(args.checkpoint)
    if args.samples_out and Path(args.samples_out).is_dir():  # found before the evaluation, not after it
        print(f"error: --samples-out {args.samples_out} is a folder; give a file to append the episodes to "
              "(e.g. samples.jsonl)", file=sys.stderr)
        return 2
    try:
        cfg = eval_config(path, args.task, args.overrides)
        eval_cfg = EvalConfig(prompts=args.prompts, samples=args.samples, greedy=not args.no_greedy)
        task = get_task(cfg.task, **cfg.task_options)
        model, tokenizer, step = _load_model(path)
    except (ConfigError, ValueError, OSError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    episodes: list[Trajectory] = []
    rollout = replace(cfg.rollout, context_limit=capped_context_limit(cfg.rollout.context_limit, model))
    report = EvalProgress()
    with report:
        metrics = evaluate(model, tokenizer, task, rollout, eval_cfg, seed=args.seed, episodes=episodes,
                           progress=report.update)
    if args.samples_out:
        written = append_samples(args.samples_out, episodes, tokenizer, step=step or 0,
                                 limit=args.samples_limit)
        print(f"{written} rendered episodes appended to {args.samples_out}")
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"copc eval on {cfg.task} ({args.prompts} prompts, k={args.samples})",
                  caption=f"checkpoint: {args.checkpoint}" + ("" if step is None else f" (step {step})"))
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        table.add_row(key.removeprefix("eval/"), f"{value:.4f}")
    Console().print(table)
    return 0


class EvalProgress:
    """Progress of ``copc eval`` on stderr, so a long evaluation is not minutes of silence: ``eval: D/N
    episodes done, Ts`` at most every ``every_s`` seconds while it runs (a thread, since one round of turns
    over every prompt can itself take minutes), and once at the end."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self.done, self.total = 0, 0
        self.started = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eval-progress", daemon=True)

    def update(self, done: int, total: int) -> None:
        self.done, self.total = done, total

    def _line(self) -> str:
        total = f"/{self.total}" if self.total else ""
        return f"eval: {self.done}{total} episodes done, {time.perf_counter() - self.started:.0f}s"

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            print(self._line(), file=sys.stderr, flush=True)

    def __enter__(self) -> EvalProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.total:
            print(self._line(), file=sys.stderr, flush=True)


def is_run_dir(path: Path) -> bool:
    """A ``copc train`` run directory (its ``config.yaml``; an HF folder has a ``config.json`` instead),
    with or without a checkpoint yet."""
    return (path / "config.yaml").is_file() and not (path / "config.json").is_file()


def eval_config(path: Path, task: str | None, overrides: Sequence[str]) -> RunConfig:
    """The run config ``copc eval`` uses for ``path`` (module docstring), checked like ``copc train``'s."""
    if not path.exists():
        raise ValueError(f"--checkpoint {path} does not exist; give an HF model folder or a run directory")
    if is_run_dir(path):
        cfg = load_yaml(RunConfig, path / "config.yaml")
    else:  # the folder is the policy evaluated
        cfg = replace(default_config(), model=replace(default_config().model, policy=str(path)))
    if task is not None:
        cfg = apply_run_overrides(cfg, [f"task={task}"])
    cfg = apply_run_overrides(cfg, overrides)
    validate_names(cfg, check_options=True, check_paths=True)
    return cfg


def _load_model(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, int | None]:
    """The policy of an HF folder (step None), or a run's newest checkpoint that verifies on the run's
    own base model, with its step. Which step is evaluated and why (copc.run.readers) goes to stdout, each
    checkpoint passed over (damaged: its sizes or sha256 do not match; partial: being written or cut short
    by a kill) to stderr with the reason, one line each."""
    if not is_run_dir(path):
        model, tokenizer = load_policy(path)
        return model, tokenizer, None
    if not list_checkpoints(path):
        every = load_yaml(RunConfig, path / "config.yaml").checkpoint_every
        first = f"step {every} or the end of the run" if every else "the end of the run"
        raise ValueError(f"run directory {path} has no checkpoint yet (the first is written at {first}); "
                         f"wait for it, or continue the run with copc train resume=true run_dir={path}")
    skipped: list[str] = []
    latest = load_latest(path, on_skip=skipped.append)
    for reason in skipped:
        print(f"warning: skipped {reason}", file=sys.stderr, flush=True)
    for note in partial_checkpoint_notes(path):
        print(note, file=sys.stderr, flush=True)
    if latest is None:
        raise ValueError(f"every checkpoint under {path / 'checkpoints'} is damaged; nothing to evaluate")
    step, payload = latest
    which = f"{checkpoint_phrase(path, step, skipped)}; the run is {run_state(path)}"
    print(f"evaluating {path}: the checkpoint of step {step} ({which})", flush=True)
    model, tokenizer = load_policy(policy_path(load_yaml(RunConfig, path / "config.yaml"), path))
    model.load_state_dict(payload["trainer"]["policy"])  # type: ignore[index]
    return model, tokenizer, step
