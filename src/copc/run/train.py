"""``copc train``: build every component from one config and run it.

    copc train                                  # the embedded default (below)
    copc train --config my.yaml trainer.actor_lr=3e-5 staleness.staleness=16 driver.kind=sync
    copc train resume=true run_dir=runs/X steps=120   # continue runs/X as it was configured (its config.yaml)

The embedded default: the tiny warm-started policy on ``arith_tool``, method ``copc``, the ``async``
driver (one rollout worker process beside the trainer), bounded staleness 8. It evaluates the policy
before and after training on held-out prompts and writes a run directory:

    runs/<time>-<method>-<task>/
        config.yaml          the resolved config
        metrics.jsonl        one JSON line per step (and per evaluation)
        tb/                  TensorBoard events
        checkpoints/         atomic checkpoints (policy, critic, optimizers, RNG, buffer, in-flight)
        rollouts/            journal of finished rollout batches not yet covered by a checkpoint
        plots/*.png          reward and eval accuracy, staleness, mask and clip rates, explained variance
        summary.json         eval_accuracy_before/after, steps, wall_seconds, method, lag, commit ...

"Eval accuracy" is avg@k at the rollout temperature (mean reward over ``eval.samples`` samples of each of
``eval.prompts`` eval prompts); greedy accuracy and pass@k are reported beside it.
"""

from __future__ import annotations

import argparse
import errno
import json
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from copc import tracking as m
from copc.config import CommandParser, ConfigError, dump_yaml, parse_override, to_dict
from copc.eval.evaluate import evaluate
from copc.models.hf import load_policy
from copc.rollout.generator import GeneratedBatch, RolloutConfig
from copc.rollout.samples import render_episode
from copc.run.build import (
    build_critic,
    build_source,
    capped_context_limit,
    check_prompts_fit,
    check_sandbox,
    claimed_run_dir,
    policy_path,
    quiet_transformers,
    seed_everything,
)
from copc.run.config import (
    RunConfig,
    load_run_config,
    resolve_method,
    sampling_from_rollout,
)
from copc.run.plots import plot_run
from copc.run.progress import NoSignal, StepLines
from copc.run.provenance import lag_text, run_provenance
from copc.run.resume import earlier_wall_seconds, eval_change, find_checkpoint, finished_at
from copc.run.tracker import Tracker
from copc.run.wandb_mirror import WandbMirror
from copc.runtime.async_local import AsyncSource
from copc.runtime.loop import Interrupted, LoopResult, RunError, StopSignals, run_loop
from copc.runtime.staleness import realized_staleness
from copc.runtime.stall import StallWatchdog
from copc.runtime.sync import SyncSource
from copc.tasks import Task, get_task
from copc.tasks.datasets import DataError
from copc.tools.sandbox import SandboxUnavailable
from copc.trainer.checkpoint import (
    CheckpointError,
    capture_rng_state,
    restore_rng_state,
    save_checkpoint,
)
from copc.trainer.common import eval_mode
from copc.trainer.trainer import ActorCriticTrainer
from copc.types import Trajectory

__all__ = ["DiskFullError", "TrainResult", "train", "train_cli"]


# ---------------------------------------------------------------------------------------- training
@dataclass
class TrainResult:
    run_dir: Path
    summary: dict[str, object]


def checkpoint_payload(
    cfg: RunConfig, step: int, trainer: ActorCriticTrainer, source: SyncSource | AsyncSource
) -> dict[str, object]:
    return {
        "trainer": trainer.state_dict(optimizers=cfg.checkpoint_optimizer),
        "source": source.state_dict(),
        "rng": capture_rng_state(),
        "config": to_dict(cfg),
        "next_step": step,
    }


@dataclass
class _Saved:
    """The last checkpointed step, where this process's time outside the training steps went, and the
    run's wall time: earlier processes' (``wall_before``) plus this one's since ``started``."""

    started: float
    step: int = -1
    eval_s: float = 0.0
    checkpoint_s: float = 0.0
    wall_before: float = 0.0

    def wall_seconds(self) -> float:
        return self.wall_before + time.perf_counter() - self.started


def _save(cfg: RunConfig, run_dir: Path, done: int, trainer: ActorCriticTrainer, source: SyncSource | AsyncSource,
          eval_before: dict[str, float] | None, saved: _Saved) -> None:
    start = time.perf_counter()
    payload = checkpoint_payload(cfg, done, trainer, source)
    payload["eval_before"] = eval_before
    payload["wall_seconds"] = saved.wall_seconds()
    save_checkpoint(run_dir, done, payload, keep=cfg.keep_checkpoints)
    saved.step = done
    saved.checkpoint_s += time.perf_counter() - start
    if isinstance(source, AsyncSource):
        source.prune_journal(int(payload["source"]["next_put"]))  # type: ignore[index]


def train(cfg: RunConfig, *, show_progress: bool = True) -> TrainResult:
    """Run ``cfg`` end to end (module docstring) and return the run directory and its summary.

    Raises :class:`~copc.runtime.loop.Interrupted` on Ctrl-C / SIGTERM after saving the last completed
    step (when the stop came at a step boundary), and the runtime's errors (docs/reliability.md).
    """
    wall = time.perf_counter()
    with claimed_run_dir(cfg) as run_dir:  # one process per run directory, for the whole run
        watchdog = StallWatchdog(cfg.stall_timeout_s, resume_hint=f"copc train resume=true run_dir={run_dir}")
        saved = _Saved(started=wall)
        try:
            return _train(cfg, run_dir, wall, show_progress, watchdog, saved)
        except OSError as err:  # metrics, samples, TensorBoard
            if err.errno != errno.ENOSPC:
                raise
            raise DiskFullError(disk_full_message(f"{NO_SPACE} at {err.filename or run_dir}", cfg, run_dir,
                                                  saved.step)) from None
        except RunError as err:  # the rollout journal (its line names the file)
            if NO_SPACE not in str(err) or isinstance(err, DiskFullError):
                raise
            raise DiskFullError(disk_full_message(str(err), cfg, run_dir, saved.step)) from None
        finally:
            watchdog.close()


#: What copc's errors say of a full disk (``copc.runtime.journal.describe_os_error``, checkpoints, the CLI).
NO_SPACE = "no space left on device"


class DiskFullError(RunError):
    """The disk filled during a run; the message names the file and says what was kept."""


def disk_full_message(what: str, cfg: RunConfig, run_dir: Path, step: int) -> str:
    """One line: ``what`` failed (it names the file), what the run kept (its last checkpoint, or none) and how
    to continue. ``step`` is the last checkpointed step, -1 for none."""
    if step >= 0:
        kept = f"the checkpoint of step {step} is kept"
        then = f"free space, then continue with copc train resume=true run_dir={run_dir}"
    else:
        kept = "no checkpoint was written yet"
        then = f"free space, then start again (copc train resume=true run_dir={run_dir} starts at step 0)"
    if cfg.checkpoint_every == 0:  # the journal keeps every batch since the last checkpoint: the whole run
        then += "; checkpoint_every=N keeps the rollout journal (rollouts/) to N steps of batches"
    return f"{what}; {kept}; {then}"


def _train(cfg: RunConfig, run_dir: Path, wall: float, show_progress: bool, watchdog: StallWatchdog,
           saved: _Saved) -> TrainResult:
    torch.set_num_threads(cfg.driver.trainer_threads)
    seed_everything(cfg.seed)
    cfg = sampling_from_rollout(cfg)  # a RunConfig built in code, not by load_run_config, too
    resumed = find_checkpoint(cfg, run_dir) if cfg.resume else None
    dump_yaml(cfg, run_dir / "config.yaml")
    method = resolve_method(cfg)
    task = get_task(cfg.task, **cfg.task_options)
    check_sandbox(task, run_dir)
    model_dir = policy_path(cfg, run_dir)
    policy, tokenizer = load_policy(model_dir)
    context_limit = capped_context_limit(cfg.rollout.context_limit, policy)
    check_prompts_fit(task, tokenizer, context_limit, configured=cfg.rollout.context_limit)
    # The episodes' rollout settings: cfg's, the context limit capped (cfg itself, saved in config.yaml and in
    # each checkpoint, keeps the value given).
    rollout = replace(cfg.rollout, context_limit=context_limit)
    critic = build_critic(cfg, policy, tokenizer) if method.needs_critic else None
    trainer = ActorCriticTrainer(policy, critic, method, replace(cfg.trainer, seed=cfg.seed))
    if trainer.warmup_steps > 0:  # a frozen actor looks like a stuck run: say so once, at the start
        print(f"note: method {cfg.method!r} trains only the critic for the first {trainer.warmup_steps} steps "
              "(critic warm-up; the actor is frozen); trainer.critic_warmup_steps=0 turns it off",
              file=sys.stderr, flush=True)
    source = build_source(cfg, model_dir=model_dir, policy=policy, tokenizer=tokenizer, task=task, run_dir=run_dir,
                          context_limit=context_limit)
    start_step, summary_before, ended_here = 0, None, False
    eval_note: dict[str, object] | None = None
    if resumed is not None:
        saved.step, payload = resumed
        saved.wall_before = earlier_wall_seconds(run_dir, saved.step, payload)
        if not trainer.load_state_dict(payload["trainer"]):  # type: ignore[arg-type]
            print(f"note: the checkpoint of step {saved.step} has no optimizer state (checkpoint_optimizer=false): "
                  "the AdamW moments restart from zero", file=sys.stderr, flush=True)
        source.load_state_dict(payload["source"])  # type: ignore[arg-type]
        restore_rng_state(payload["rng"])  # type: ignore[arg-type]
        start_step = int(payload["next_step"])  # type: ignore[call-overload]
        ended_here = finished_at(run_dir, start_step, payload)  # then its final evaluation is kept, not redone
        summary_before = payload.get("eval_before")
        changed = eval_change(cfg, payload.get("config", {}))  # type: ignore[arg-type]
        if changed:
            eval_note = {"step": saved.step, "change": changed}
            print(f"note: the evaluation settings differ from the run's ({changed}): the evaluations up to step "
                  f"{saved.step}, the summary's 'before' among them, were made with the earlier ones",
                  file=sys.stderr, flush=True)
    # A resumed run drops the records of the steps it redoes (all of them when no checkpoint was made); the
    # final evaluation of an earlier process that ended at the checkpoint stays when the run goes past it.
    mirror = WandbMirror(project=cfg.wandb_project, config=to_dict(cfg)).open(run_dir) if cfg.wandb else None
    tracker = Tracker(run_dir, resume_step=start_step if cfg.resume else None,
                      keep_resume_evaluation=ended_here and start_step < cfg.steps, mirror=mirror)
    signals = StopSignals()
    signals.install()
    finished = False
    try:
        if summary_before is None:
            with watchdog.phase(f"the evaluation at step {start_step}"):
                summary_before = _evaluate(cfg, rollout, policy, tokenizer, task, tracker, start_step, saved)
            if summary_before:
                tracker.log(start_step, summary_before)
        if isinstance(source, AsyncSource):
            source.start()
        loop = _run_with_progress(cfg, rollout, trainer, source, tracker, run_dir, start_step, tokenizer,
                                  summary_before, policy, task, show_progress, saved, signals, watchdog)  # type: ignore[arg-type]
        finished = True
    except Interrupted as stop:
        if stop.clean and trainer.version > max(saved.step, start_step):
            _save(cfg, run_dir, trainer.version, trainer, source, summary_before, saved)  # type: ignore[arg-type]
        what = f"checkpoint of step {saved.step} kept" if saved.step >= 0 else "no checkpoint yet"
        print(f"stopped by {stop.signal_name} after {trainer.version} steps; {what}; continue with "
              f"resume=true run_dir={run_dir}", file=sys.stderr, flush=True)
        raise
    finally:
        source.close()
        signals.restore()
        if not finished:
            tracker.close()
    with watchdog.phase(f"the evaluation at step {cfg.steps}"):
        after = _evaluate(cfg, rollout, policy, tokenizer, task, tracker, cfg.steps, saved, final=True)
    if after:
        tracker.log(cfg.steps, after)
    tracker.close()
    summary = _summary(cfg, summary_before, after, loop, saved.wall_seconds(), run_dir)  # type: ignore[arg-type]
    summary["wall_seconds_this_process"] = time.perf_counter() - wall
    if eval_note is not None:
        summary["eval_changed_on_resume"] = eval_note
    summary["eval_seconds_this_process"], summary["checkpoint_seconds_this_process"] = saved.eval_s, saved.checkpoint_s
    summary["restored_batches"] = source.restored if isinstance(source, AsyncSource) else 0
    summary["worker_restarts"] = source.restarts if isinstance(source, AsyncSource) else 0
    summary["journal_damaged"] = source.journal_damaged if isinstance(source, AsyncSource) else 0
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    try:
        if cfg.plots:
            plot_run(run_dir)
    except Exception as err:  # plots are a convenience; a plotting failure must not lose the run
        print(f"warning: plots failed: {err}", file=sys.stderr)
    return TrainResult(run_dir=run_dir, summary=summary)


def _evaluate(cfg: RunConfig, rollout: RolloutConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
              task: Task, tracker: Tracker, step: int, saved: _Saved, *, final: bool = False) -> dict[str, float]:
    """Held-out evaluation of ``model`` (the trained policy itself, in eval mode: no copy of it is kept for
    this) on the same prompts and seeds every time; its first sampled episodes go to the samples (marked
    ``final`` for the run's final evaluation: a run continued past its end keeps those), its wall seconds
    to ``saved.eval_s``."""
    start = time.perf_counter()
    episodes: list[Trajectory] = []
    with eval_mode(model):
        out = evaluate(model, tokenizer, task, rollout, cfg.eval, seed=cfg.seed + 777, episodes=episodes)
    tracker.log_samples(step, "eval", [render_episode(t, tokenizer) for t in episodes[: cfg.samples.per_log]],
                        final=final)
    saved.eval_s += time.perf_counter() - start
    return out


def _run_with_progress(
    cfg: RunConfig,
    rollout: RolloutConfig,
    trainer: ActorCriticTrainer,
    source: SyncSource | AsyncSource,
    tracker: Tracker,
    run_dir: Path,
    start_step: int,
    tokenizer: PreTrainedTokenizerBase,
    eval_before: dict[str, float],
    policy: PreTrainedModel,
    task: Task,
    show_progress: bool,
    saved: _Saved,
    signals: StopSignals,
    watchdog: StallWatchdog,
) -> LoopResult:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    lines = StepLines(cfg.steps) if show_progress and not sys.stdout.isatty() else None  # nohup, a pipe, a file
    progress = Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(), disable=not show_progress or lines is not None, transient=False,
    )
    bar = progress.add_task("train", total=cfg.steps, completed=start_step, status="")
    no_signal = NoSignal(cfg.no_signal_steps)

    def on_step(step: int, metrics: dict[str, float], batch: GeneratedBatch) -> None:
        done = step + 1
        if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.steps:
            before = saved.eval_s
            with watchdog.phase(f"the evaluation after step {step}"):
                metrics.update(_evaluate(cfg, rollout, policy, tokenizer, task, tracker, step, saved))
            metrics[m.TIME_EVAL] = saved.eval_s - before
        if cfg.samples.every and done % cfg.samples.every == 0:
            tracker.log_samples(step, "train", [render_episode(t, tokenizer)
                                                for t in batch.trajectories[: cfg.samples.per_log]])
        lags = realized_staleness(batch.trajectories, step).token_values()
        tracker.log(step, metrics, histograms={m.STALENESS_HIST: lags})
        if (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == cfg.steps:
            _save(cfg, run_dir, done, trainer, source, eval_before, saved)
        status = (
            f"step {done}  reward {metrics['reward/mean']:.3f}  acc {metrics['rollout/accuracy']:.3f}  "
            f"stale {metrics['staleness/mean']:.1f}"
        )
        progress.update(bar, completed=done, status=status)
        if lines is not None:
            lines.step(done, status)
        no_signal.step(done, metrics)

    with progress:
        return run_loop(trainer, source, start_step=start_step, steps=cfg.steps,
                        pad_id=int(tokenizer.pad_token_id), on_step=on_step, signals=signals,  # type: ignore[arg-type]
                        watchdog=watchdog, wait_bounded=batch_wait_bounded(source))


def batch_wait_bounded(source: object) -> bool:
    """Whether the source's wait for a batch has a limit of its own (the async driver's
    ``driver.batch_timeout_s``, 0 = none), so the stall watchdog may pause during it; without one the
    watchdog bounds the wait too."""
    return isinstance(source, AsyncSource) and source.batch_timeout_s is not None


def _summary(
    cfg: RunConfig, before: dict[str, float], after: dict[str, float], loop: LoopResult, wall: float, run_dir: Path
) -> dict[str, object]:
    # The run's training rows from its metrics.jsonl, not this process's loop: after a resume the file holds
    # every step of the run once (the tracker drops the redone ones), the loop only those trained now.
    history = [row for row in m.read_metrics(run_dir) if m.REWARD_MEAN in row]
    tail = history[-max(1, len(history) // 5):] if history else []
    times = [h[m.TIME_STEP] for h in history if m.TIME_STEP in h]

    def mean(key: str, rows: list[dict[str, float]] = tail) -> float | None:
        values = [h[key] for h in rows if key in h]
        return sum(values) / len(values) if values else None

    return {
        "eval_accuracy_before": before.get(m.EVAL_ACCURACY),
        "eval_accuracy_after": after.get(m.EVAL_ACCURACY),
        "eval_greedy_accuracy_before": before.get(m.EVAL_GREEDY_ACCURACY),
        "eval_greedy_accuracy_after": after.get(m.EVAL_GREEDY_ACCURACY),
        "eval_tool_use_rate_before": before.get(m.EVAL_TOOL_USE_RATE),
        "eval_tool_use_rate_after": after.get(m.EVAL_TOOL_USE_RATE),
        "steps": loop.steps,
        "wall_seconds": wall,
        "method": cfg.method,
        "staleness": cfg.staleness.staleness,
        "staleness_mode": cfg.staleness.mode,
        "driver": cfg.driver.kind,
        "task": cfg.task,
        "seed": cfg.seed,
        "train_reward_last": mean(m.REWARD_MEAN),
        "realized_staleness_mean": mean(m.STALENESS_MEAN, history),  # the whole run's (train_reward_last: the last fifth)
        "step_seconds_median": float(np.median(times)) if times else None,
        "run_dir": str(run_dir),
        **run_provenance(cfg),  # the code, libraries, resolved method and stated lag (copc.run.provenance)
    }


def print_summary(summary: Mapping[str, object]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"copc train: {summary['method']} on {summary['task']} ({summary['driver']}, "
                        f"{lag_text(summary['lag'])})")  # type: ignore[arg-type]
    table.add_column("metric")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")

    def fmt(value: object) -> str:
        if value is None:  # eval.prompts=0: not evaluated
            return "-"
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    table.add_row("eval accuracy (avg@k)", fmt(summary["eval_accuracy_before"]), fmt(summary["eval_accuracy_after"]))
    table.add_row("greedy accuracy", fmt(summary["eval_greedy_accuracy_before"]),
                  fmt(summary["eval_greedy_accuracy_after"]))
    table.add_row("tool-use rate", fmt(summary["eval_tool_use_rate_before"]),
                  fmt(summary["eval_tool_use_rate_after"]))
    table.add_row("steps", "", str(summary["steps"]))
    table.add_row("wall time (s)", "", f"{float(summary['wall_seconds']):.0f}")  # type: ignore[arg-type]
    console = Console()
    console.print(table)
    changed = summary.get("eval_changed_on_resume")
    if isinstance(changed, dict):
        console.print(f"note: 'before' was evaluated with the run's earlier settings; they changed when it resumed "
                      f"from step {changed['step']} ({changed['change']})", markup=False)
    console.print(f"run directory: [bold]{summary['run_dir']}[/bold]")


# ---------------------------------------------------------------------------------------- CLI
def train_cli(argv: Sequence[str]) -> int:
    """``copc train [--config FILE.yaml] [key.sub=value ...]``."""
    parser = CommandParser(prog="copc train", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config file (sections as in RunConfig)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (every key, its value and its doc) and exit")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, applied in order")
    args = parser.parse_args(list(argv))
    quiet_transformers()
    try:
        cfg = load_run_config(config_file(args.config, args.overrides), args.overrides, strict=not args.print_config)
        if args.print_config:
            from copc.run.describe import format_config

            print(format_config(cfg))
            return 0
        result = train(cfg, show_progress=not args.no_progress)
    except (ConfigError, DataError, SandboxUnavailable) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (RunError, CheckpointError) as err:  # RolloutError carries the worker's traceback after its line
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Interrupted as stop:  # the message was printed by train()
        return 128 + int(getattr(signal, stop.signal_name, signal.SIGINT))
    except OSError as err:  # a full disk outside the checkpoint (metrics, plots, config)
        if err.errno != errno.ENOSPC:
            raise
        print(f"error: no space left on device at {err.filename or run_dir_of(args)}", file=sys.stderr)
        return 1
    print_summary(result.summary)
    return 0


def config_file(config: str | None, overrides: Sequence[str]) -> str | None:
    """The YAML file the config starts from: ``--config``, else with ``resume=true`` the run's own
    ``run_dir/config.yaml`` (a run continues as it was configured, the overrides applied on top), else
    None (the embedded default)."""
    if config is not None:
        return config
    given: dict[str, object] = {}
    for text in overrides:
        try:
            path, value = parse_override(text)
        except ConfigError:
            return None  # load_run_config says what is wrong with it
        if path in (["resume"], ["run_dir"]):
            given[path[0]] = value
    saved = Path(str(given.get("run_dir") or "")) / "config.yaml"
    return str(saved) if given.get("resume") is True and given.get("run_dir") and saved.is_file() else None


def run_dir_of(args: argparse.Namespace) -> str:
    return next((o.split("=", 1)[1] for o in args.overrides if o.startswith("run_dir=")), "the run directory")
