"""``copc testbed``: does staleness hurt on this testbed? Sync PPO against uncorrected async PPO.

COPC's claims (joint sweeps at staleness 8/12/16, robustness at 64, stability) only mean something on a
testbed where stale rollouts measurably slow learning. This command trains, for each seed, two arms on
the ``hard`` built-in task and compares them at equal steps:

- ``ppo_sync``: synchronous PPO (every batch sampled by the current weights);
- ``async_ppo_s<S>``: asynchronous PPO with the behaviour policy as the PPO anchor (method ``async_ppo``,
  no correction beyond PPO's own clip), fed rollouts of policy version exactly ``k - S`` at step ``k``
  (``fixed_lag`` staleness).

The lagged arm runs on the ``sync`` driver, which *simulates* ``fixed_lag`` by keeping the last
``S + 1`` weight versions: batch ``k`` is the same list of trajectories the ``async`` driver would give
(copc.runtime.sync; ``tests/runtime/test_drivers.py`` checks the two agree), but each run is then a single
deterministic process, free of timing noise, and two runs share the machine evenly. Each run is a
``copc train`` subprocess; finished runs of the same config are skipped and interrupted ones resumed
from their last checkpoint, so the command can be re-run; a run directory made by another config is
named and never reused.

Outputs (``--out``): ``testbed_curves.png`` (held-out avg@1 and greedy accuracy, train reward; mean of
the seeds with a min-max band), ``testbed_staleness.png`` (realized staleness and the PPO clip rate)
and ``testbed.json``: per arm and eval step the seed mean/min/max, each arm's plateau step, and the paired
gap sync - async at equal steps (per seed, with its binomial sampling standard error; mean and spread),
and ``provenance``: the commit of each run's code (:func:`run_commits`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from copc import tracking as m
from copc.config import CommandParser
from copc.run.plots import align_runs, curves_for, save_figure, series, smooth
from copc.tracking import read_metrics

__all__ = ["Arm", "analyse", "arms_for", "plateau_step", "run_commits", "testbed_cli"]

#: The hard setting of each task ``copc testbed --task`` knows (arith_tool is the copc train default task).
TASK_SETTINGS: dict[str, tuple[str, ...]] = {
    "arith_tool": ("task_options.hard=true",),
    "kv_search": ("task=kv_search", "task_options={hard: true}"),
}
#: Overrides every testbed run shares beside its task setting: batches of 8 prompts x 4 samples and half
#: the default actor learning rate (so sync PPO takes longer to plateau; with 16 prompts and lr 2e-4 it
#: plateaued by step ~40 on arith_tool, docs/testbed.md), held-out evaluation on 200 prompts, no per-run
#: plots.
COMMON_OVERRIDES: tuple[str, ...] = (
    "rollout.prompts_per_batch=8",
    "trainer.actor_lr=1e-4",
    "eval.prompts=200",
    "plots=false",
)
#: The arith_tool testbed: the hard task from its default warm start and the common overrides.
BASE_OVERRIDES: tuple[str, ...] = (*TASK_SETTINGS["arith_tool"], *COMMON_OVERRIDES)


def base_overrides(task: str) -> tuple[str, ...]:
    """The overrides every testbed run on ``task`` shares (its hard setting, then the common ones)."""
    if task not in TASK_SETTINGS:
        raise ValueError(f"--task must be one of {', '.join(TASK_SETTINGS)}; got {task!r}")
    return (*TASK_SETTINGS[task], *COMMON_OVERRIDES)


@dataclass(frozen=True)
class Arm:
    """One configuration of the comparison: a name (run directories are ``<name>_seed<N>``), a label for
    the plots and the ``copc train`` overrides that define it."""

    name: str
    label: str
    overrides: tuple[str, ...]


def arms_for(staleness: int) -> tuple[Arm, Arm]:
    """The synchronous baseline and uncorrected async PPO at ``fixed_lag`` staleness ``staleness``."""
    if staleness < 1:
        raise ValueError(f"--staleness must be >= 1 (the lagged arm), got {staleness}")
    sync = Arm("ppo_sync", "sync PPO", ("method=ppo", "driver.kind=sync"))
    lagged = Arm(
        f"async_ppo_s{staleness}",
        f"async PPO, fixed lag {staleness} (uncorrected)",
        ("method=async_ppo", "driver.kind=sync", "staleness.mode=fixed_lag",
         f"staleness.staleness={staleness}"),
    )
    return sync, lagged


#: How run directories are named: by ``copc testbed``, or by ``copc sweep`` with the arms on an ``arm`` axis
#: (experiments/kv_search_testbed.yaml).
LAYOUTS = ("testbed", "sweep")


def run_dir_for(root: Path, arm: Arm, seed: int, layout: str = "testbed") -> Path:
    return root / (f"arm={arm.name}__seed{seed}" if layout == "sweep" else f"{arm.name}_seed{seed}")


def run_overrides(arm: Arm, seed: int, run_dir: Path, steps: int, eval_every: int, extra: Sequence[str],
                  base: Sequence[str] = BASE_OVERRIDES) -> list[str]:
    """The ``copc train`` overrides of one run (its config; :func:`train_command` adds ``resume=true``)."""
    return [*base, *arm.overrides, *extra, f"steps={steps}", f"eval.every={eval_every}", f"seed={seed}",
            f"run_dir={run_dir}"]


def train_command(arm: Arm, seed: int, run_dir: Path, steps: int, eval_every: int, extra: Sequence[str],
                  base: Sequence[str] = BASE_OVERRIDES) -> list[str]:
    """The ``copc train`` command of one run: always ``resume=true`` (continues from the last checkpoint;
    a run directory without one, e.g. killed before its first checkpoint, starts again at step 0)."""
    return [sys.executable, "-m", "copc.cli", "train", "--no-progress",
            *run_overrides(arm, seed, run_dir, steps, eval_every, extra, base), "resume=true"]


def run_state(overrides: Sequence[str], run_dir: Path) -> str:
    """``finished``, ``resume`` or ``fresh`` for the run of ``overrides`` (:func:`run_overrides`) in
    ``run_dir``, by copc sweep's rule (copc.experiments.sweep.cell_state): a run directory made by another
    config (other steps, overrides, eval schedule) is never reused: ValueError naming it and the fix."""
    from copc.config import to_dict
    from copc.experiments.sweep import cell_state
    from copc.run.config import load_run_config

    config = to_dict(load_run_config(None, list(overrides)))
    state, detail = cell_state(config, run_dir, run_dir / ".no-record.json")  # type: ignore[arg-type]
    if state == "conflict":
        raise ValueError(f"{detail}, or give --runs another folder")
    return state


def run_commits(run_dirs: Sequence[Path]) -> dict[str, object]:
    """The code behind a testbed report (copc.run.provenance): this process's commit and library versions,
    and each run's ``commit`` and ``commit_dirty`` from its ``summary.json`` (None for a run made before
    summaries named their code, or unfinished)."""
    from copc.run.provenance import code_commit, library_versions

    runs: dict[str, object] = {}
    for run_dir in run_dirs:
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
        except (OSError, ValueError):
            summary = {}
        runs[str(run_dir)] = {"commit": summary.get("commit"), "commit_dirty": summary.get("commit_dirty")}
    return {"analysed_by": {**code_commit(), "versions": library_versions()}, "runs": runs}


def _trained_steps(run_dir: Path) -> int | None:
    try:
        return int(json.loads((run_dir / "summary.json").read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unfinished


def prepare_warmstart(overrides: Sequence[str]) -> Path:
    """Build (or find) the warm start every run starts from, once, before the runs start in parallel."""
    from copc.run.build import policy_path
    from copc.run.config import load_run_config

    cfg = load_run_config(None, list(overrides))
    return policy_path(cfg, Path(cfg.run_dir or "."))


def pending_jobs(jobs: list[tuple[Arm, int]], root: Path, *, steps: int, eval_every: int,
                 extra: Sequence[str],
                 base: Sequence[str] = BASE_OVERRIDES) -> list[tuple[Arm, int]]:
    """The jobs still to train; every run directory is checked (:func:`run_state`) before any run starts."""
    pending = []
    for arm, seed in jobs:
        run_dir = run_dir_for(root, arm, seed)
        if run_state(run_overrides(arm, seed, run_dir, steps, eval_every, extra, base),
                     run_dir) == "finished":
            print(f"[testbed] {run_dir}: finished, skipped", flush=True)
        else:
            pending.append((arm, seed))
    return pending


def run_all(
    pending: list[tuple[Arm, int]], root: Path, *, steps: int, eval_every: int, extra: Sequence[str],
    parallel: int,
    base: Sequence[str] = BASE_OVERRIDES,
) -> list[str]:
    """Run ``pending`` (:func:`pending_jobs`), ``parallel`` at a time (one torch thread each); returns
    failures."""
    pending = list(pending)
    running: list[tuple[str, subprocess.Popen[bytes], float]] = []
    failures: list[str] = []
    while pending or running:
        while pending and len(running) < parallel:
            arm, seed = pending.pop(0)
            run_dir = run_dir_for(root, arm, seed)
            run_dir.mkdir(parents=True, exist_ok=True)
            command = train_command(arm, seed, run_dir, steps, eval_every, extra, base)
            log = (root / f"{run_dir.name}.log").open("ab")
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            print(f"[testbed] start {run_dir.name}: {' '.join(command[3:])}", flush=True)
            running.append((run_dir.name, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                           env=env),
                            time.perf_counter()))
            log.close()
        time.sleep(2.0)
        for item in list(running):
            name, proc, start = item
            if proc.poll() is None:
                continue
            running.remove(item)
            took = time.perf_counter() - start
            if proc.returncode == 0:
                print(f"[testbed] done  {name} in {took:.0f} s", flush=True)
            else:
                failures.append(name)
                print(f"[testbed] FAILED {name} (exit {proc.returncode}); see {root / (name + '.log')}",
                      flush=True)
    return failures


# ------------------------------------------------------------------------------------------- analysis
def plateau_step(steps: np.ndarray, values: np.ndarray, fraction: float = 0.9, tail: float = 0.2) -> int:
    """First step at which ``values`` has made ``fraction`` of its rise from the first value to its final
    level (the mean over the last ``tail`` of the steps).

    Applied to the smoothed train reward: a curve still rising at the end plateaus late, one that
    saturates early plateaus early; measuring the rise to the final level rather than to the maximum
    keeps one lucky spike from moving it. A curve that does not rise returns its first step.
    """
    if steps.size == 0:
        raise ValueError("plateau_step needs a non-empty curve")
    final = float(values[-max(1, round(tail * values.size)):].mean())
    rise = final - float(values[0])
    if rise <= 0:
        return int(steps[0])
    reached = np.nonzero(values >= values[0] + fraction * rise)[0]
    return int(steps[reached[0]])


def _seed_stack(runs: dict[str, list[dict[str, float]]], names: Sequence[str], metric: str, window: int = 1
                ) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values [seeds, steps])`` of ``metric`` at the steps every run logged."""
    per_run = [series(runs[n], metric) for n in names]
    return align_runs([(s, smooth(v, window)) for s, v in per_run])


def _eval_episodes(run_dir: Path) -> int | None:
    """Episodes per held-out evaluation (eval.prompts x eval.samples) from the run's config.yaml."""
    import yaml

    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        return int(cfg["eval"]["prompts"]) * int(cfg["eval"]["samples"])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return None


def _describe(values: np.ndarray) -> dict[str, float]:
    return {"mean": float(values.mean()), "min": float(values.min()), "max": float(values.max()),
            "std": float(values.std(ddof=1)) if values.size > 1 else 0.0}


def analyse(root: Path, arms: Sequence[Arm], seeds: Sequence[int], *, reward_window: int = 20,
            layout: str = "testbed") -> dict[str, object]:
    """Curves and the paired comparison of the first arm (sync) with each other arm, seed by seed."""
    runs = {f"{arm.name}_seed{s}": read_metrics(run_dir_for(root, arm, s,
                                                            layout)) for arm in arms for s in seeds}
    report: dict[str, object] = {"seeds": list(seeds), "reward_window": reward_window, "arms": {}}
    arm_reports: dict[str, dict[str, object]] = {}
    for arm in arms:
        names = [f"{arm.name}_seed{s}" for s in seeds]
        steps, acc = _seed_stack(runs, names, m.EVAL_ACCURACY)
        _, greedy = _seed_stack(runs, names, m.EVAL_GREEDY_ACCURACY)
        r_steps, reward = _seed_stack(runs, names, m.REWARD_MEAN, window=reward_window)
        entry: dict[str, object] = {
            "label": arm.label,
            "eval_steps": steps.tolist(),
            "eval_accuracy": [_describe(acc[:, j]) for j in range(steps.size)],
            "eval_greedy_accuracy": [_describe(greedy[:, j]) for j in range(greedy.shape[1])],
            "train_reward_final": _describe(reward[:, -1]) if r_steps.size else None,
        }
        if r_steps.size:
            entry["plateau_step"] = plateau_step(r_steps, reward.mean(0))
            entry["plateau_step_per_seed"] = [plateau_step(r_steps, row) for row in reward]
        arm_reports[arm.name] = entry
    sync = arms[0]
    gaps: dict[str, object] = {}
    for other in arms[1:]:
        a_names = [f"{sync.name}_seed{s}" for s in seeds]
        b_names = [f"{other.name}_seed{s}" for s in seeds]
        steps, a = _seed_stack(runs, a_names, m.EVAL_ACCURACY)
        steps_b, b = _seed_stack(runs, b_names, m.EVAL_ACCURACY)
        shared = np.intersect1d(steps, steps_b)
        after_start = shared[shared > 0]
        ia, ib = np.searchsorted(steps, after_start), np.searchsorted(steps_b, after_start)
        per_seed = (a[:, ia] - b[:, ib]).mean(1) if after_start.size else np.zeros(len(seeds))
        n = _eval_episodes(run_dir_for(root, sync, seeds[0], layout))
        # binomial standard error of each seed's mean gap (independent evaluations of n episodes each)
        var = (a[:, ia] * (1 - a[:, ia]) + b[:, ib] * (1 - b[:, ib])) / n if n else None
        sampling_se = np.sqrt(var.sum(1)) / max(1, after_start.size) if var is not None else None
        r_steps, ra = _seed_stack(runs, a_names, m.REWARD_MEAN)
        r_steps_b, rb = _seed_stack(runs, b_names, m.REWARD_MEAN)
        r_shared = np.intersect1d(r_steps, r_steps_b)
        reward_gap = (ra[:, np.searchsorted(r_steps, r_shared)] - rb[:, np.searchsorted(r_steps_b,
                                                                                        r_shared)]).mean(1)
        gaps[other.name] = {
            "eval_steps": after_start.tolist(),
            "eval_accuracy_gap_per_seed": per_seed.tolist(),
            "eval_accuracy_gap_sampling_se_per_seed": sampling_se.tolist(
                ) if sampling_se is not None else None,
            "eval_accuracy_gap": _describe(per_seed),
            "eval_accuracy_gap_by_step": [_describe(a[:, i] - b[:, j]) for i, j in zip(ia, ib, strict=True)],
            "train_reward_gap_per_seed": reward_gap.tolist(),
            "train_reward_gap": _describe(reward_gap),
            "seeds_where_sync_leads": int((per_seed > 0).sum()),
        }
    report["arms"] = arm_reports
    report["gap_sync_minus"] = gaps
    return report


def draw(root: Path, arms: Sequence[Arm], seeds: Sequence[int], out: Path, *, reward_window: int = 20,
         prefix: str = "testbed", task: str = "arith_tool", layout: str = "testbed") -> list[Path]:
    """``<prefix>_curves.png`` and ``<prefix>_staleness.png`` (seed mean, min-max band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {f"{arm.name}_seed{s}": arm.label for arm in arms for s in seeds}
    runs = {str(run_dir_for(root, arm, s, layout)): read_metrics(run_dir_for(root, arm, s, layout))
            for arm in arms for s in seeds}
    figures = {
        f"{prefix}_curves.png": (
            f"Sync PPO vs uncorrected async PPO ({task} hard; {len(seeds)} "
            f"seed{'s' if len(seeds) > 1 else ''}: "
            "mean and min-max)",
            (("held-out accuracy, avg@1 sampled", m.EVAL_ACCURACY, 1),
             ("held-out accuracy, greedy", m.EVAL_GREEDY_ACCURACY, 1),
             (f"train reward (moving average of {reward_window} steps)", m.REWARD_MEAN, reward_window)),
        ),
        f"{prefix}_staleness.png": (
            "What the lagged arm sees",
            (("realized staleness per token, mean [versions]", m.STALENESS_MEAN, 1),
             ("PPO clip active at 1 - eps (5-step average)", m.POLICY_CLIP_FRAC_LOW, 5),
             ("PPO clip active at 1 + eps (5-step average)", m.POLICY_CLIP_FRAC_HIGH, 5)),
        ),
    }
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, (title, panels) in figures.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), squeeze=False)
        for ax, (panel_title, metric, window) in zip(axes[0], panels, strict=True):
            curves = curves_for(runs, metric, mean_seeds=True, window=window)
            for k, curve in enumerate(curves):
                # a group is named after its runs' directories less the seed: "ppo_sync_" or "arm=ppo_sync_"
                group = curve.label.split(" (n=")[0].removeprefix("arm=").rstrip("_")
                label = labels.get(f"{group}_seed{seeds[0]}", group)
                ax.plot(curve.steps, curve.mean, color=f"C{k}", label=f"{label} (n={len(seeds)})")
                if curve.low is not None and curve.high is not None:
                    ax.fill_between(curve.steps, curve.low, curve.high, color=f"C{k}", alpha=0.2)
            ax.set_title(panel_title, fontsize=10)
            ax.set_xlabel("training step")
            ax.grid(alpha=0.3)
            if curves:
                ax.legend(fontsize=7)
            else:
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
        fig.suptitle(title)
        written.append(save_figure(fig, out / file_name))
    return written


# ------------------------------------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="copc testbed",
        description="Sync PPO vs uncorrected async PPO at fixed lag S on the hard task, several seeds.",
    )
    parser.add_argument("--task", default="arith_tool", choices=sorted(TASK_SETTINGS),
                        help="the task's hard setting")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per arm (0 .. N-1)")
    parser.add_argument("--steps", type=int, default=300, help="training steps per run")
    parser.add_argument("--staleness", type=int, default=16, help="fixed lag S of the async arm")
    parser.add_argument("--eval-every", type=int, default=25, help="held-out evaluation every N steps")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time (one torch thread each)")
    parser.add_argument("--runs", default=None, help="folder of the run directories and logs "
                        "(default runs/testbed, runs/testbed_<task> for another task)")
    parser.add_argument("--out", default="docs/figures", help="folder for testbed[_<task>]_*.png and .json")
    parser.add_argument("--analyse-only", action="store_true", help="do not train; redraw from existing runs")
    parser.add_argument("--layout", default="testbed", choices=LAYOUTS,
                        help="run directory names of copc testbed, or of copc sweep (with --analyse-only)")
    parser.add_argument("overrides", nargs="*", help="extra copc train overrides for every run (key=value)")
    return parser


def testbed_cli(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    if args.seeds < 1 or args.steps < 1 or args.parallel < 1 or args.eval_every < 1:
        print("copc testbed: error: --seeds, --steps, --parallel and --eval-every must be >= 1",
              file=sys.stderr)
        return 2
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        print(f"copc testbed: error: overrides must be key=value, got {bad}", file=sys.stderr)
        return 2
    try:
        arms = arms_for(args.staleness)
    except ValueError as err:
        print(f"copc testbed: error: {err}", file=sys.stderr)
        return 2
    base = base_overrides(args.task)
    prefix = "testbed" if args.task == "arith_tool" else f"testbed_{args.task}"
    root, out, seeds = Path(args.runs or f"runs/{prefix}"), Path(args.out), list(range(args.seeds))
    root.mkdir(parents=True, exist_ok=True)
    if args.layout == "sweep" and not args.analyse_only:
        print("copc testbed: error: --layout sweep reads runs of copc sweep; add --analyse-only",
              file=sys.stderr)
        return 2
    if not args.analyse_only:
        jobs = [(arm, seed) for seed in seeds for arm in arms]
        try:  # before the warm start is built
            pending = pending_jobs(jobs, root, steps=args.steps, eval_every=args.eval_every,
                                   extra=args.overrides,
                                   base=base)
        except ValueError as err:
            print(f"copc testbed: error: {err}", file=sys.stderr)
            return 2
        print(f"[testbed] warm start: {prepare_warmstart([*base, *args.overrides])}", flush=True)
        failures = run_all(pending, root, steps=args.steps, eval_every=args.eval_every, extra=args.overrides,
                           parallel=args.parallel, base=base)
        if failures:
            print(f"copc testbed: error: runs failed: {', '.join(failures)}; re-run to resume them",
                  file=sys.stderr)
            return 1
    missing = [str(run_dir_for(root, a, s, args.layout)) for a in arms for s in seeds
               if not (run_dir_for(root, a, s, args.layout) / "metrics.jsonl").is_file()]
    if missing:
        print(f"copc testbed: error: no metrics in {', '.join(missing)}; run without --analyse-only",
              file=sys.stderr)
        return 2
    report = analyse(root, arms, seeds, layout=args.layout)
    report["command"] = {"steps": args.steps, "staleness": args.staleness, "eval_every": args.eval_every,
                         "task": args.task, "overrides": [*base, *args.overrides],
                         "analyse_only": args.analyse_only}
    report["provenance"] = run_commits([run_dir_for(root, a, s, args.layout) for a in arms for s in seeds])
    if args.analyse_only:  # the runs were made elsewhere: the figures are of what they trained, said here
        trained = {str(run_dir_for(root, a, s, args.layout)): _trained_steps(run_dir_for(root, a, s,
                                                                                         args.layout))
                   for a in arms for s in seeds}
        report["trained_steps"] = trained
        other = sorted({"unfinished runs" if v is None else f"{v} steps" for v in trained.values(
            ) if v != args.steps})
        if other:
            print(f"warning: --steps {args.steps}, but the runs analysed are {', '.join(other)} "
                  "(testbed.json's trained_steps names each)", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{prefix}.json").write_text(json.dumps(report, indent=2))
    for path in draw(root, arms, seeds, out, prefix=prefix, task=args.task, layout=args.layout):
        print(path)
    print(out / f"{prefix}.json")
    print(summary_text(report))
    return 0


def summary_text(report: dict[str, object]) -> str:
    """A few lines for the terminal: plateau step of each arm and the paired gap."""
    lines = []
    arms = report["arms"]
    assert isinstance(arms, dict)
    for name, entry in arms.items():
        acc = entry["eval_accuracy"]
        first, last = acc[0], acc[-1]
        lines.append(
            f"{name:>18}: eval avg@1 {first['mean']:.3f} -> {last['mean']:.3f} "
            f"[{last['min']:.3f}, {last['max']:.3f}]  plateau step {entry.get('plateau_step')} "
            f"(per seed {entry.get('plateau_step_per_seed')})"
        )
    gaps = report["gap_sync_minus"]
    assert isinstance(gaps, dict)
    for name, gap in gaps.items():
        g, r = gap["eval_accuracy_gap"], gap["train_reward_gap"]
        se = gap["eval_accuracy_gap_sampling_se_per_seed"]
        se_text = f"; sampling s.e. per seed {', '.join(f'{x:.3f}' for x in se)}" if se else ""
        lines.append(
            f"sync - {name}: eval accuracy {g['mean']:+.3f} (seeds "
            f"{', '.join(f'{x:+.3f}' for x in gap['eval_accuracy_gap_per_seed'])}{se_text}), "
            f"train reward {r['mean']:+.3f} (seeds "
            f"{', '.join(f'{x:+.3f}' for x in gap['train_reward_gap_per_seed'])})"
        )
    return "\n".join(lines)
