"""Training-inference discrepancy of a bfloat16 sampler beside a float32 trainer, at staleness 0.

Samples ``--batches`` training batches with the task's warm-start policy (version 0) through the real
:class:`~copc.rollout.generator.RolloutGenerator` with ``rollout.dtype`` = float32 and = bfloat16, then
recomputes every sampled token's log-prob with the float32 model (teacher-forced, the same temperature
transform the trainer's ``logp_old`` uses). The weights are the same, so ``d = log pi_train - log mu``
is the pure training-inference discrepancy. Printed for each sampler dtype: number of sampled tokens,
mean and std of ``d``, quantiles of ``|d|`` and the fraction of tokens whose ratio ``exp(d)`` leaves the
band [0.8, 1.2] (the mask band of COPC / IcePop-style corrections).

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/bf16_discrepancy.py [--task arith_tool] \
        [--hard] [--batches 4] [--seed 0] [--device cuda] [--policy HF_FOLDER]

``--device cuda`` puts the sampler on the GPU (the trainer's recompute stays a float32 forward on the CPU):
the discrepancy a Ray rollout actor on a GPU (``driver.ray_gpus_per_worker=1``) feeds a CPU trainer, as
docs/scaling.md sets it up. ``--policy`` takes the weights from an HF folder instead of the task's warm
start (cached or built), e.g. a pinned warm start under ``results/warmstarts/``.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from copc.models import load_policy
from copc.models.hf import token_logprobs
from copc.rollout.generator import RolloutGenerator
from copc.run.build import policy_path
from copc.run.config import RunConfig, task_defaults
from copc.tasks import get_task
from copc.types import Trajectory


def discrepancy(model: torch.nn.Module, trajectories: list[Trajectory], temperature: float) -> torch.Tensor:
    """``log pi_train - log mu`` on every sampled token ``[N] float32``, one unpadded forward per
    trajectory."""
    out = []
    with torch.no_grad():
        for traj in trajectories:
            if traj.num_action_tokens == 0:
                continue
            ids = traj.token_ids.unsqueeze(0)
            logp = token_logprobs(model, ids, torch.ones_like(ids, dtype=torch.bool),
                                  temperature=temperature).logp[0]
            out.append((logp - traj.logp_behav)[traj.action_mask])
    return torch.cat(out)


def report(name: str, d: torch.Tensor) -> None:
    a = d.abs().double()
    q = torch.quantile(a, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    ratio = d.double().exp()
    outside = float(((ratio < 0.8) | (ratio > 1.2)).double().mean())
    print(f"{name:9s} tokens {d.numel():6d}  mean {float(d.double().mean()):+.2e}  std "
          f"{float(d.double().std()):.2e}  "
          f"|d| p50 {q[0]:.2e} p90 {q[1]:.2e} p99 {q[2]:.2e} max {float(a.max()):.2e}  "
          f"outside [0.8, 1.2] {outside:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="arith_tool")
    parser.add_argument("--hard", action="store_true", help="task_options.hard=true")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the sampler runs (the trainer's forward: cpu)")
    parser.add_argument("--policy", type=Path,
                        help="HF folder of the policy (default: the task's warm start)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    options = {**task_defaults(args.task), **({"hard": True} if args.hard else {})}
    cfg = replace(RunConfig(task=args.task, task_options=options), seed=args.seed)
    if args.policy is not None:
        path = args.policy
    else:
        with tempfile.TemporaryDirectory() as scratch:
            path = policy_path(cfg, Path(scratch))
    trainer_model, tokenizer = load_policy(path)
    task = get_task(args.task, **options)  # type: ignore[arg-type]
    print(f"{args.task} (hard={args.hard}), warm start {path.name}, {args.batches} batches of "
          f"{cfg.rollout.batch_size}, temperature {cfg.rollout.temperature}, "
          f"sampler on {args.device}, trainer float32 on cpu")
    for dtype in ("float32", "bfloat16"):
        sampler_model, _ = load_policy(path, device=args.device)
        generator = RolloutGenerator(sampler_model, tokenizer, task, replace(cfg.rollout, dtype=dtype),
                                     seed=args.seed)
        trajectories = [t for j in range(args.batches) for t in generator.generate(j).trajectories]
        report(dtype, discrepancy(trainer_model, trajectories, cfg.rollout.temperature))


if __name__ == "__main__":
    main()
