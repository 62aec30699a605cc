"""Experiment throughput: steps per hour of one hard-testbed run, and of two side by side (issue 12, part 3).

    .venv/bin/python benchmarks/throughput.py [--steps 50] [--method copc] [--lag 16] [--eval-every 25]
    [key=value ...]

A run is a ``copc train`` with the ``copc testbed`` settings (``copc.experiments.testbed.base_overrides``:
arith_tool hard, 8 prompts x 4 samples, 200 held-out prompts, avg@1 + greedy, evaluation every 25
steps), ``--method`` at ``fixed_lag`` ``--lag`` on the sync driver, from the cached warm start (built
first if missing, not timed). It runs once alone, then twice at once (seeds 0 and 1, two processes), and
prints for each:

- steps per hour: ``steps / wall * 3600``, ``wall`` the whole ``copc train`` call (model loading, the
  sandbox check, evaluations and checkpoints included: what a sweep cell costs), and per run when two
  share the machine (their sum is the machine's experiment throughput);
- where the wall time went: generation (``time/generate``, tool calls included), the sandbox's CPU
  seconds (its fork server's whole process tree, every run included, read before the process exits),
  training (``time/train``), held-out evaluation (every one, before and after included), checkpoints,
  and the rest (start-up, logging, publication);
- the first and last evaluation and the train reward of the last 10 steps, to compare learning
  curves between code versions on the same seed (same batches: the figures must not move).

Figures are wall seconds on a shared machine: compare rows of one run of this script.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from copc.experiments.testbed import base_overrides


def run_one(steps: int, method: str, lag: int, eval_every: int, seed: int, run_dir: Path,
            extra: list[str]) -> dict[str, float]:
    """Train one testbed run in this process; its throughput figures."""
    import torch

    from copc.run.config import load_run_config
    from copc.run.train import train
    from copc.tasks import get_task
    from copc.tasks.tooling import sandbox_cpu_s
    from copc.tracking import read_metrics

    torch.set_num_threads(1)
    overrides = [*base_overrides("arith_tool"), f"method={method}", "driver.kind=sync", f"steps={steps}",
                 f"eval.every={eval_every}", f"seed={seed}", f"run_dir={run_dir}", "samples.per_log=0"]
    if method != "ppo":
        overrides += ["staleness.mode=fixed_lag", f"staleness.staleness={lag}"]
    cfg = load_run_config(None, [*overrides, *extra])
    start = time.perf_counter()
    result = train(cfg, show_progress=False)
    wall = time.perf_counter() - start
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "time/step" in r]
    summary = result.summary
    # Tool CPU: subprocesses that exited (RUSAGE_CHILDREN) and the process's warm sandbox fork server,
    # still alive here (it serves every run of the process), through its process tree.
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    tool_cpu = usage.ru_utime + usage.ru_stime
    tool_cpu += sandbox_cpu_s(get_task(cfg.task, **cfg.task_options))
    rewards = [float(r["reward/mean"]) for r in rows[-10:]]
    return {
        "steps": steps,
        "wall_s": wall,
        "steps_per_hour": steps / wall * 3600,
        "generate_s": sum(float(r["time/generate"]) for r in rows),
        "tool_cpu_s": tool_cpu,
        "train_s": sum(float(r["time/train"]) for r in rows),
        "eval_s": float(summary["eval_seconds_this_process"]),
        # type: ignore[arg-type]  (a fresh run: one process)
        "checkpoint_s": float(summary["checkpoint_seconds_this_process"]),  # type: ignore[arg-type]
        "eval_before": float(summary["eval_accuracy_before"]),  # type: ignore[arg-type]
        "eval_after": float(summary["eval_accuracy_after"]),  # type: ignore[arg-type]
        "reward_last10": sum(rewards) / len(rewards),
    }


def spawn(args: argparse.Namespace, seed: int, run_dir: Path) -> subprocess.Popen[str]:
    command = [sys.executable, __file__, "--one", "--steps", str(args.steps), "--method", args.method,
               "--lag", str(args.lag), "--eval-every", str(args.eval_every), "--seed", str(seed),
               "--run-dir", str(run_dir), *args.overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)


def collect(process: subprocess.Popen[str]) -> dict[str, float]:
    out, _ = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"a benchmark run failed with exit code {process.returncode}")
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def row(name: str, r: dict[str, float]) -> str:
    rest = r["wall_s"] - r["generate_s"] - r["train_s"] - r["eval_s"] - r["checkpoint_s"]
    return (f"{name:<22} {r['steps_per_hour']:>7.0f} {r['wall_s']:>7.1f} {r['generate_s']:>7.1f} "
            f"{r['tool_cpu_s']:>7.1f} {r['train_s']:>7.1f} {r['eval_s']:>7.1f} {r['checkpoint_s']:>6.1f} "
            f"{rest:>6.1f}   {r['eval_before']:.3f} -> {r['eval_after']:.3f}  "
            f"reward {r['reward_last10']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--method", default="copc")
    parser.add_argument("--lag", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="more copc train overrides for every run (e.g. "
                             "trainer.critic_forward_reuse=true)")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.steps, args.method, args.lag, args.eval_every, args.seed,
                                 Path(args.run_dir),
                                 args.overrides)))
        return
    with tempfile.TemporaryDirectory(prefix="copc-throughput-") as tmp:
        root = Path(tmp)
        collect(spawn(argparse.Namespace(**{**vars(args), "steps": 1, "eval_every": 0}), 0, root / "warm"))
        start = time.perf_counter()
        alone = collect(spawn(args, 0, root / "alone"))
        pair = [spawn(args, seed, root / f"pair{seed}") for seed in (0, 1)]
        both = [collect(p) for p in pair]
        print(f"hard testbed, {args.method} at fixed lag {args.lag}, {args.steps} steps, evaluation every "
              f"{args.eval_every} {' '.join(args.overrides)} (measured {time.strftime('%Y-%m-%d %H:%M')}, "
              f"{time.perf_counter() - start:.0f} s)")
        print(f"{'':<22} {'steps/h':>7} {'wall':>7} {'gen':>7} {'toolCPU':>7} {'train':>7} {'eval':>7} "
              f"{'ckpt':>6} {'rest':>6}   eval before -> after, train reward of the last 10 steps")
        print(row("one run alone", alone))
        for seed, r in enumerate(both):
            print(row(f"two at once, seed {seed}", r))
        total = sum(r["steps_per_hour"] for r in both)
        print(f"machine throughput: {alone['steps_per_hour']:.0f} steps/h with one run, {total:.0f} with two "
              f"({total / alone['steps_per_hour']:.2f}x)")


if __name__ == "__main__":
    main()
