"""LoRA adapters (``peft``) against full fine-tuning: the trainer's step time, peak memory and how far a few
steps move the policy, on one real-model batch, each mode in its own process.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/real_model_lora.py --model smollm2-hf --batch b.pt \
        --mode full|lora [--steps 3] [--rank 16] [--lr 2e-6] [--out out.json] [key=value ...]

The batch is generated once with the recipe (``benchmarks/real_model_recipe.py``) and saved to ``--batch``
(a later call with the same file reuses it), so both modes step on the same rows. ``--mode lora`` wraps
the policy and the critic's backbone in rank-``--rank`` adapters on every linear layer (``peft``,
``lora_alpha = 2 rank``, no dropout; the base weights frozen, the value head trained in full); ``full``
trains every weight. The trainer (the recipe's method, critic warm-up off) steps ``--steps`` times on the
batch, each step timed (wall and this thread's CPU seconds: on a shared machine the CPU seconds are the
steadier figure) and its phases (``PEAKS.phase``). Printed and written: each step's seconds
and their median, the process's peak RSS (``ru_maxrss``, so one mode per process), the trainable
parameters, and the learning check: the mean log-prob change, after the steps, of the action tokens of
the batch's rewarded episodes and of the others (a policy that learns from the batch raises the first
relative to the second), from no-grad forwards of the same weights before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from real_model_profile import WALKTHROUGH, timed_phases  # noqa: E402
from real_model_recipe import TRAIN_RECIPE  # noqa: E402


def lora_wrap(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """``model`` with rank-``rank`` LoRA adapters on its linear layers, base weights frozen."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise SystemExit("--mode lora needs peft: pip install 'peft>=0.13'") from None
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear",
                        bias="none")
    return get_peft_model(model, config)  # type: ignore[arg-type]


def action_logp(policy: torch.nn.Module, batch: object, temperature: float) -> torch.Tensor:
    """``[B, T]`` float32 log-probs of the batch's tokens under ``policy`` (no grad, eval mode)."""
    from copc.models.hf import token_logprobs
    from copc.trainer.common import eval_mode

    with torch.no_grad(), eval_mode(policy):
        return token_logprobs(policy, batch.input_ids, batch.attention_mask,  # type: ignore[attr-defined]
                              temperature=temperature).logp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", required=True, help="the saved batch (generated and written if missing)")
    parser.add_argument("--mode", choices=("full", "lora"), required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=0, help="step on the batch's first ROWS rows (0: all)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=None, help="actor lr (default: the recipe's)")
    parser.add_argument("--walkthrough", action="store_true", help="docs/own-model.md section 7's settings")
    parser.add_argument("--out", default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from copc.channels.methods import get_method
    from copc.models.hf import ValueModel, load_policy
    from copc.rollout.generator import RolloutGenerator
    from copc.run.build import quiet_transformers
    from copc.run.config import load_run_config
    from copc.tasks import get_task
    from copc.trainer.batching import collate
    from copc.trainer.trainer import ActorCriticTrainer

    quiet_transformers()
    base = WALKTHROUGH if args.walkthrough else TRAIN_RECIPE
    cfg = load_run_config(None, [*base, f"model.policy={args.model}", "run_dir=/tmp/copc-lora-unused",
                                 *args.overrides])
    policy, tokenizer = load_policy(args.model)
    path = Path(args.batch)
    if not path.exists():
        generator = RolloutGenerator(policy, tokenizer, get_task(cfg.task, **cfg.task_options), cfg.rollout,
                                     seed=cfg.seed)
        torch.save(generator.generate(0).trajectories, path)
    trajectories = torch.load(path, weights_only=False)
    trajectories = trajectories[: args.rows] if args.rows else trajectories
    batch = collate(trajectories, pad_id=int(tokenizer.pad_token_id))
    rewarded = torch.tensor([t.reward > 0 for t in trajectories])

    critic = ValueModel.from_policy(policy)
    if args.mode == "lora":
        policy = lora_wrap(policy, args.rank)
        critic.backbone = lora_wrap(critic.backbone, args.rank)  # type: ignore[assignment]
    trainable = {name: sum(p.numel() for p in m.parameters() if p.requires_grad)
                 for name, m in (("actor", policy), ("critic", critic))}
    torch.manual_seed(0)
    trainer_cfg = replace(cfg.trainer, critic_warmup_steps=0,
                          **({"actor_lr": args.lr} if args.lr is not None else {}))
    trainer = ActorCriticTrainer(policy, critic, get_method(cfg.method), trainer_cfg)
    temperature = cfg.rollout.temperature
    before = action_logp(policy, batch, temperature)
    times: dict[str, list[float]] = defaultdict(list)
    steps: list[float] = []
    cpu: list[float] = []
    with timed_phases(times):
        for _ in range(args.steps):
            start, cpu_start = time.perf_counter(), time.thread_time()
            trainer.step(batch)
            steps.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - cpu_start)
    after = action_logp(policy, batch, temperature)
    delta = (after - before)[:, :]
    action = batch.action_mask
    rows = rewarded[:, None].expand_as(action)
    moved = {
        "dlogp_rewarded": float(delta[action & rows].mean()) if bool((action & rows).any()) else None,
        "dlogp_unrewarded": float(delta[action & ~rows].mean()) if bool((action & ~rows).any()) else None,
        "mean_abs_dlogp": float(delta[action].abs().mean()),
    }
    out = {
        "mode": args.mode, "rank": args.rank if args.mode == "lora" else None,
        "actor_lr": trainer_cfg.actor_lr, "method": cfg.method,
        "settings": "walkthrough" if args.walkthrough else "recipe",
        "rows": len(trajectories), "real_tokens": int(batch.attention_mask.sum()),
        "rewarded_rows": int(rewarded.sum()), "trainable": trainable,
        "steps_s": steps, "step_median_s": statistics.median(steps),
        "steps_cpu_s": cpu, "step_median_cpu_s": statistics.median(cpu),
        "phase_median_s": {k: statistics.median(v) for k, v in times.items()},
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "load": os.getloadavg()[0], **moved,
    }
    print(json.dumps(out))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
