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
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from copc import tracking as m
from copc.config import CommandParser, ConfigError, dump_yaml, to_dict
from copc.eval.evaluate import evaluate
from copc.models.hf import load_policy
from copc.rollout.chat import chat_format
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
from copc.run.oracle import OracleScorer
from copc.run.plots import plot_run
from copc.run.progress import NoSignal, StepLines, print_summary
from copc.run.provenance import run_provenance
from copc.run.resume import (
    NO_SPACE,
    DiskFullError,
    config_file,
    disk_full_message,
    earlier_wall_seconds,
    eval_change,
    find_checkpoint,
    finished_at,
)
from copc.run.tracker import Tracker
from copc.run.wandb_mirror import WandbMirror
from copc.runtime.loop import BatchSource, Interrupted, LoopResult, RunError, StopSignals, run_loop
from copc.runtime.staleness import realized_staleness
from copc.runtime.stall import StallWatchdog
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

__all__ = ["TrainResult", "train", "train_cli"]


# ---------------------------------------------------------------------------------------- training
@dataclass
class TrainResult:
    run_dir: Path
    summary: dict[str, object]


def checkpoint_payload(cfg: RunConfig, step: int, trainer: ActorCriticTrainer,
                       source: BatchSource) -> dict[str, object]:
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


@dataclass
class _Run:
    """What one process assembled for a run: the loop, the evaluations and the checkpoints read it."""

    cfg: RunConfig
    run_dir: Path
    #: the episodes' settings: cfg's, the context limit capped to the model's (cfg itself, saved in
    #: config.yaml and in each checkpoint, keeps the value given)
    rollout: RolloutConfig
    policy: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    task: Task
    trainer: ActorCriticTrainer
    source: BatchSource
    saved: _Saved
    watchdog: StallWatchdog
    show_progress: bool


@dataclass
class _Start:
    """Where this process starts: step 0, or what a checkpoint restored."""

    step: int = 0
    eval_before: dict[str, float] | None = None
    #: the checkpoint is where an earlier process ended (its final evaluation is kept, not redone)
    ended_here: bool = False
    #: the evaluation settings changed on resume (said in the summary)
    eval_note: dict[str, object] | None = None


def _save(run: _Run, done: int, eval_before: dict[str, float] | None) -> None:
    start, saved = time.perf_counter(), run.saved
    payload = checkpoint_payload(run.cfg, done, run.trainer, run.source)
    payload["eval_before"] = eval_before
    payload["wall_seconds"] = saved.wall_seconds()
    save_checkpoint(run.run_dir, done, payload, keep=run.cfg.keep_checkpoints)
    saved.step = done
    saved.checkpoint_s += time.perf_counter() - start
    run.source.checkpointed(payload["source"])  # type: ignore[arg-type]


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


def _train(cfg: RunConfig, run_dir: Path, wall: float, show_progress: bool, watchdog: StallWatchdog,
           saved: _Saved) -> TrainResult:
    """Assemble, restore, run, finish."""
    torch.set_num_threads(cfg.driver.trainer_threads)
    seed_everything(cfg.seed)
    cfg = sampling_from_rollout(cfg)  # a RunConfig built in code, not by load_run_config, too
    resumed = find_checkpoint(cfg, run_dir) if cfg.resume else None
    dump_yaml(cfg, run_dir / "config.yaml")
    run = _assemble(cfg, run_dir, show_progress=show_progress, watchdog=watchdog, saved=saved)
    start = _restore(run, *resumed) if resumed is not None else _Start()
    loop, before, after = _run(run, start)
    return _finish(run, start, loop, before, after, wall)


def _assemble(cfg: RunConfig, run_dir: Path, *, show_progress: bool, watchdog: StallWatchdog,
              saved: _Saved) -> _Run:
    """The task, the policy (and critic), the trainer and the driver's batch source."""
    method = resolve_method(cfg)
    task = get_task(cfg.task, **cfg.task_options)
    check_sandbox(task, run_dir)
    model_dir = policy_path(cfg, run_dir)
    policy, tokenizer = load_policy(model_dir)
    context_limit = capped_context_limit(cfg.rollout.context_limit, policy)
    check_prompts_fit(task, tokenizer, context_limit, configured=cfg.rollout.context_limit)
    rollout = replace(cfg.rollout, context_limit=context_limit)
    critic = build_critic(cfg, policy, tokenizer) if method.needs_critic else None
    trainer = ActorCriticTrainer(policy, critic, method, replace(cfg.trainer, seed=cfg.seed))
    if trainer.warmup_steps > 0:  # a frozen actor looks like a stuck run: say so once, at the start
        print(f"note: method {cfg.method!r} trains only the critic for the first {trainer.warmup_steps} "
              "steps (critic warm-up; the actor is frozen); trainer.critic_warmup_steps=0 turns it off",
              file=sys.stderr, flush=True)
    source = build_source(cfg, model_dir=model_dir, policy=policy, tokenizer=tokenizer, task=task,
                          run_dir=run_dir, context_limit=context_limit)
    return _Run(cfg=cfg, run_dir=run_dir, rollout=rollout, policy=policy, tokenizer=tokenizer, task=task,
                trainer=trainer, source=source, saved=saved, watchdog=watchdog, show_progress=show_progress)


def _restore(run: _Run, step: int, payload: dict[str, object]) -> _Start:
    """The trainer, the batch source and the RNGs as the checkpoint of ``step`` left them."""
    cfg, saved = run.cfg, run.saved
    saved.step = step
    saved.wall_before = earlier_wall_seconds(run.run_dir, step, payload)
    if not run.trainer.load_state_dict(payload["trainer"]):  # type: ignore[arg-type]
        print(f"note: the checkpoint of step {step} has no optimizer state (checkpoint_optimizer=false): "
              "the AdamW moments restart from zero", file=sys.stderr, flush=True)
    run.source.load_state_dict(payload["source"])  # type: ignore[arg-type]
    restore_rng_state(payload["rng"])  # type: ignore[arg-type]
    start_step = int(payload["next_step"])  # type: ignore[call-overload]
    start = _Start(step=start_step, eval_before=payload.get("eval_before"),  # type: ignore[arg-type]
                   ended_here=finished_at(run.run_dir, start_step, payload))
    changed = eval_change(cfg, payload.get("config", {}))  # type: ignore[arg-type]
    if changed:
        start.eval_note = {"step": step, "change": changed}
        print(f"note: the evaluation settings differ from the run's ({changed}): the evaluations up to step "
              f"{step}, the summary's 'before' among them, were made with the earlier ones",
              file=sys.stderr, flush=True)
    return start


def _run(run: _Run, start: _Start) -> tuple[LoopResult, dict[str, float], dict[str, float]]:
    """The metrics writer, the evaluation before (unless restored), the loop and the final evaluation;
    returns the loop's result and the two evaluations."""
    cfg = run.cfg
    # A resumed run drops the records of the steps it redoes (all of them when no checkpoint was made); the
    # final evaluation of an earlier process that ended at the checkpoint stays when the run goes past it.
    mirror = WandbMirror(project=cfg.wandb_project,
                         config=to_dict(cfg)).open(run.run_dir) if cfg.wandb else None
    tracker = Tracker(run.run_dir, resume_step=start.step if cfg.resume else None,
                      keep_resume_evaluation=start.ended_here and start.step < cfg.steps, mirror=mirror)
    signals = StopSignals()
    signals.install()
    finished = False
    before = start.eval_before
    try:
        if before is None:
            with run.watchdog.phase(f"the evaluation at step {start.step}"):
                before = _evaluate(run, tracker, start.step)
            if before:
                tracker.log(start.step, before)
        run.source.start()
        loop = _run_with_progress(run, tracker, signals, start.step, before)
        finished = True
    except Interrupted as stop:
        trainer, saved = run.trainer, run.saved
        if stop.clean and trainer.version > max(saved.step, start.step):
            _save(run, trainer.version, before)
        what = f"checkpoint of step {saved.step} kept" if saved.step >= 0 else "no checkpoint yet"
        print(f"stopped by {stop.signal_name} after {trainer.version} steps; {what}; continue with "
              f"resume=true run_dir={run.run_dir}", file=sys.stderr, flush=True)
        raise
    finally:
        run.source.close()
        signals.restore()
        if not finished:
            tracker.close()
    with run.watchdog.phase(f"the evaluation at step {cfg.steps}"):
        after = _evaluate(run, tracker, cfg.steps, final=True)
    if after:
        tracker.log(cfg.steps, after)
    tracker.close()
    return loop, before, after


def _finish(run: _Run, start: _Start, loop: LoopResult, before: dict[str, float], after: dict[str, float],
            wall: float) -> TrainResult:
    """summary.json and the plots."""
    saved = run.saved
    summary = _summary(run.cfg, before, after, loop, saved.wall_seconds(), run.run_dir)
    summary["wall_seconds_this_process"] = time.perf_counter() - wall
    if start.eval_note is not None:
        summary["eval_changed_on_resume"] = start.eval_note
    summary["eval_seconds_this_process"] = saved.eval_s
    summary["checkpoint_seconds_this_process"] = saved.checkpoint_s
    summary.update(run.source.counters())  # restored_batches, worker_restarts, journal_damaged
    # replaced whole: a reader beside the run (copc sweep, a script) never finds it empty or cut short
    tmp = run.run_dir / f".summary.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, run.run_dir / "summary.json")
    try:
        if run.cfg.plots:
            plot_run(run.run_dir)
    except Exception as err:  # plots are a convenience; a plotting failure must not lose the run
        print(f"warning: plots failed: {err}", file=sys.stderr)
    return TrainResult(run_dir=run.run_dir, summary=summary)


def _evaluate(run: _Run, tracker: Tracker, step: int, *, final: bool = False) -> dict[str, float]:
    """Held-out evaluation of the policy (the trained policy itself, in eval mode: no copy of it is kept for
    this) on the same prompts and seeds every time; its first sampled episodes go to the samples (marked
    ``final`` for the run's final evaluation: a run continued past its end keeps those), its wall seconds
    to ``saved.eval_s``."""
    start, cfg = time.perf_counter(), run.cfg
    episodes: list[Trajectory] = []
    with eval_mode(run.policy):
        out = evaluate(run.policy, run.tokenizer, run.task, run.rollout, cfg.eval, seed=cfg.seed + 777,
                       episodes=episodes)
    shown = [render_episode(t, run.tokenizer) for t in episodes[: cfg.samples.per_log]]
    tracker.log_samples(step, "eval", shown, final=final)
    run.saved.eval_s += time.perf_counter() - start
    return out


def _run_with_progress(run: _Run, tracker: Tracker, signals: StopSignals, start_step: int,
                       eval_before: dict[str, float] | None) -> LoopResult:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cfg, show = run.cfg, run.show_progress
    lines = StepLines(cfg.steps) if show and not sys.stdout.isatty() else None  # nohup, a pipe, a file
    progress = Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(), disable=not show or lines is not None, transient=False,
    )
    bar = progress.add_task("train", total=cfg.steps, completed=start_step, status="")
    no_signal = NoSignal(cfg.no_signal_steps)

    def on_step(step: int, metrics: dict[str, float], batch: GeneratedBatch) -> None:
        done = step + 1
        if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.steps:
            before = run.saved.eval_s
            with run.watchdog.phase(f"the evaluation after step {step}"):
                metrics.update(_evaluate(run, tracker, step))
            metrics[m.TIME_EVAL] = run.saved.eval_s - before
        if cfg.samples.every and done % cfg.samples.every == 0:
            tracker.log_samples(step, "train", [render_episode(t, run.tokenizer)
                                                for t in batch.trajectories[: cfg.samples.per_log]])
        lags = realized_staleness(batch.trajectories, step).token_values()
        tracker.log(step, metrics, histograms={m.STALENESS_HIST: lags})
        if (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == cfg.steps:
            _save(run, done, eval_before)
        status = (
            f"step {done}  reward {metrics['reward/mean']:.3f}  acc {metrics['rollout/accuracy']:.3f}  "
            f"stale {metrics['staleness/mean']:.1f}"
        )
        progress.update(bar, completed=done, status=status)
        if lines is not None:
            lines.step(done, status)
        no_signal.step(done, metrics)

    oracle = OracleScorer(cfg.oracle, trainer=run.trainer, task=run.task, rollout=run.rollout,
                          tokenizer=run.tokenizer, chat=chat_format(run.tokenizer, run.rollout.chat_template),
                          seed=cfg.seed, estimator=resolve_method(cfg).advantage)
    with progress:
        return run_loop(run.trainer, run.source, start_step=start_step, steps=cfg.steps,
                        pad_id=int(run.tokenizer.pad_token_id),  # type: ignore[arg-type]
                        on_step=on_step, signals=signals, watchdog=run.watchdog,
                        wait_bounded=batch_wait_bounded(run.source),
                        before_step=oracle if oracle.needed else None)


def batch_wait_bounded(source: BatchSource) -> bool:
    """Whether the source's wait for a batch has a limit of its own (the async driver's
    ``driver.batch_timeout_s``, 0 = none), so the stall watchdog may pause during it; without one the
    watchdog bounds the wait too."""
    return source.batch_timeout_s is not None


def _summary(
    cfg: RunConfig, before: dict[str, float], after: dict[str, float], loop: LoopResult, wall: float,
    run_dir: Path
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
        # the whole run's (train_reward_last: the last fifth)
        "realized_staleness_mean": mean(m.STALENESS_MEAN, history),
        "step_seconds_median": float(np.median(times)) if times else None,
        "run_dir": str(run_dir),
        **run_provenance(cfg),  # the code, libraries, resolved method and stated lag (copc.run.provenance)
    }


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
        cfg = load_run_config(config_file(args.config, args.overrides), args.overrides,
                              strict=not args.print_config)
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


def run_dir_of(args: argparse.Namespace) -> str:
    return next((o.split("=", 1)[1] for o in args.overrides if o.startswith("run_dir=")), "the run directory")
