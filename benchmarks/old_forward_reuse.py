"""Trainer step time on identical batches: async PPO 3a / 3b and COPC, with and without
``trainer.old_forward_reuse`` and ``trainer.micro_batch_by_length``.

    nice -n 10 .venv/bin/python benchmarks/old_forward_reuse.py [--repeats 12] [--policy warmstart] [--testbed
    arith_tool]

The trainer-only measurement of ``benchmarks/step_time.py`` (``trainer_overhead``: three recorded batches
of the default run config, the trainers alternated in a rotating order so a drifting load hits them
alike, medians of wall time and of the process's CPU time: on a shared machine the CPU time of a
one-thread step is the steadier figure), with two more trainers: 3b and COPC with the first actor minibatch's
``old`` taken from its own first forward (issue 12 item 2). Prints each median, COPC's overhead over 3a and 3b
before and after, and the fraction of rows whose old forward was skipped. One run, so the ratios are paired.
``--testbed TASK`` takes the batches and trainer settings of ``copc testbed --task TASK`` (its hard
setting) instead of the default run's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from copc.channels.methods import get_method
from copc.eval.evaluate import EvalConfig
from copc.experiments.testbed import base_overrides
from copc.models.hf import ValueModel, load_policy
from copc.rollout.generator import RolloutGenerator
from copc.run.build import policy_path
from copc.run.config import default_config, load_run_config
from copc.tasks import get_task
from copc.trainer.batching import collate
from copc.trainer.trainer import ActorCriticTrainer

CONFIGS = {  # label: (method, old_forward_reuse, micro_batch_by_length)
    "3a (async_ppo)": ("async_ppo", False, False),
    "3b (async_ppo_recompute)": ("async_ppo_recompute", False, False),
    "3b + reuse": ("async_ppo_recompute", True, False),
    "COPC": ("copc", False, False),
    "COPC + reuse": ("copc", True, False),
    "COPC + by length": ("copc", False, True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=12,
                        help="steps per trainer (after one warm-up step each)")
    parser.add_argument("--policy", default="warmstart", help="warmstart | tiny | an HF folder")
    parser.add_argument("--testbed", default=None, help="a copc testbed task: its hard setting's batches")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = load_run_config(None, base_overrides(args.testbed)) if args.testbed else default_config()
    base = replace(base, model=replace(base.model, policy=args.policy), eval=EvalConfig(prompts=0))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = policy_path(base, Path(tmp))
        gen_model, tokenizer = load_policy(model_dir)
        task = get_task(base.task, **base.task_options)
        generator = RolloutGenerator(gen_model, tokenizer, task, base.rollout, seed=base.seed)
        batches = [collate(generator.generate(j).trajectories,
                           pad_id=int(tokenizer.pad_token_id)) for j in range(3)]
        trainers = {}
        for label, (method, reuse, by_length) in CONFIGS.items():
            policy, _ = load_policy(model_dir)
            torch.manual_seed(0)
            cfg = replace(base.trainer, critic_warmup_steps=0, old_forward_reuse=reuse,
                          micro_batch_by_length=by_length)
            trainers[label] = ActorCriticTrainer(policy, ValueModel.from_policy(policy), get_method(method),
                                                 cfg)
    times: dict[str, list[float]] = {label: [] for label in trainers}
    cpu: dict[str, list[float]] = {label: [] for label in trainers}
    reused: dict[str, list[float]] = {label: [] for label in trainers}
    labels = list(trainers)
    for rep in range(args.repeats + 1):
        for label in labels[rep % len(labels):] + labels[: rep % len(labels)]:  # rotate the order
            start, start_cpu = time.perf_counter(), time.process_time()
            metrics = trainers[label].step(batches[rep % len(batches)])
            if rep > 0:  # the first step of each trainer warms its allocator up
                times[label].append(time.perf_counter() - start)
                cpu[label].append(time.process_time() - start_cpu)
                reused[label].append(metrics.get("proximal/reused_rows_frac", 0.0))
    rows = batches[0].batch_size
    print(f"trainer step alone, {args.repeats} paired repeats on 3 identical batches of {rows} trajectories "
          f"({args.testbed or 'default'} run config: micro_batch_size {base.trainer.micro_batch_size})")
    print(f"  {'':26s} {'wall s':>7s} {'CPU s':>7s}   old rows from the first forward")
    for label in trainers:
        print(f"  {label:26s} {statistics.median(times[label]):7.3f} {statistics.median(cpu[label]):7.3f}   "
              f"{statistics.mean(reused[label]):.0%}")
    for kind, series in (("wall", times), ("CPU", cpu)):
        med = {label: statistics.median(values) for label, values in series.items()}
        t3a, t3b = med["3a (async_ppo)"], med["3b (async_ppo_recompute)"]
        print(f"{kind}:")
        for label in ("COPC", "COPC + reuse", "3b + reuse"):
            print(f"  {label:14s} {med[label] / t3a - 1:+.1%} vs 3a, {med[label] / t3b - 1:+.1%} vs 3b")
        print(f"  reuse saves {1 - med['COPC + reuse'] / med['COPC']:.1%} of COPC's step, "
              f"{1 - med['3b + reuse'] / t3b:.1%} of 3b's; micro-batches by length save "
              f"{1 - med['COPC + by length'] / med['COPC']:.1%} of COPC's")


if __name__ == "__main__":
    main()
