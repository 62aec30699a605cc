"""How far the trainer step is from this CPU's floor: FLOPs of a step against one core's matmul peak (issue
12).

    .venv/bin/python benchmarks/train_roofline.py [--methods async_ppo,copc] [--batches 3] [--repeats 4]
    [key=value ...]

The hard testbed's batches (``copc testbed`` settings: arith_tool hard, 8 prompts x 4 samples) are
generated once by the warm start; each method's trainer then steps on them (critic warm-up off, so every
step trains the actor and the critic). Printed, measured in this one run with one torch thread:

- the batch: rows, real tokens per row, the padded rectangle, action tokens;
- per method: the median step time; from ``torch.profiler`` (``with_flops``) on one step, the matmul
  GFLOP of the step (mm, addmm, bmm: forwards, backwards, no-grad forwards) and the self time those
  kernels took, so their achieved GFLOP/s; the remaining time (attention, element-wise ops, the optimizer,
  Python) as a share of the step;
- one core's single-precision matmul peak, at the model's own shapes and at 2048^3;
- the floor: the step's matmul GFLOP at the model-shape peak with nothing else (no attention, no
  element-wise work, no Python), and step / floor: the most any rewrite of the trainer could gain on this
  CPU without computing fewer FLOPs. Padding is FLOPs that could be saved: the batch line gives its share
  of the batch's rectangle, an upper bound (the trainer trims each micro-batch to its longest row).

Use it with ``benchmarks/throughput.py``, which says what share of a testbed run the trainer is.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")


def sgemm_peak(m: int, k: int, n: int, seconds: float = 1.0) -> float:
    """GFLOP/s of ``[m, k] @ [k, n]`` in float32 on this thread (median of 5 timed blocks)."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(3):
        a @ b
    reps = max(3, int(seconds * 4e10 / (2 * m * k * n) / 5))
    rates = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        rates.append(2 * m * k * n * reps / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="async_ppo,copc")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=4, help="timed steps per method after one warm-up")
    parser.add_argument("overrides", nargs="*", help="copc train overrides on top of the testbed's")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from torch.profiler import ProfilerActivity, profile

    from copc.channels.methods import get_method
    from copc.experiments.testbed import base_overrides
    from copc.models.hf import ValueModel, load_policy
    from copc.rollout.generator import RolloutGenerator
    from copc.run.build import policy_path, quiet_transformers
    from copc.run.config import load_run_config
    from copc.tasks import get_task
    from copc.trainer.batching import collate
    from copc.trainer.trainer import ActorCriticTrainer

    quiet_transformers()
    tmp = Path(tempfile.mkdtemp(prefix="copc-roofline-"))
    cfg = load_run_config(None, [*base_overrides("arith_tool"), f"run_dir={tmp}/run", *args.overrides])
    model_dir = policy_path(cfg, tmp)
    model, tokenizer = load_policy(model_dir)
    hidden, inter = int(model.config.hidden_size), int(model.config.intermediate_size)
    generator = RolloutGenerator(model, tokenizer, get_task(cfg.task, **cfg.task_options), cfg.rollout,
                                 seed=cfg.seed)
    batches = [collate(generator.generate(j).trajectories, pad_id=int(tokenizer.pad_token_id))
               for j in range(args.batches)]
    real = [float(b.attention_mask.sum()) for b in batches]
    rect = [float(b.attention_mask.numel()) for b in batches]
    rows = batches[0].attention_mask.shape[0]
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.3f} M parameters (hidden {hidden}, "
          f"intermediate {inter}, {model.config.num_hidden_layers} "
          f"layers); {args.batches} batches of {rows} rows")
    print(
        f"tokens per row: {statistics.mean(real) / rows:.1f} real, {statistics.mean(rect) / rows:.1f} in the "
          f"batch's rectangle ({1 - sum(real) / sum(rect):.0%} padding at most); action tokens per row "
          f"{statistics.mean(float(b.action_mask.sum()) for b in batches) / rows:.1f}")

    tokens = int(statistics.mean(real) / 4)  # a micro-batch-sized matmul: a quarter of the batch's tokens
    peaks = {f"{tokens}x{hidden}x{inter}": sgemm_peak(tokens, hidden, inter),
             f"{tokens}x{inter}x{hidden}": sgemm_peak(tokens, inter, hidden),
             f"{tokens}x{hidden}x{hidden}": sgemm_peak(tokens, hidden, hidden),
             "2048x2048x2048": sgemm_peak(2048, 2048, 2048)}
    model_peak = max(v for k, v in peaks.items() if not k.startswith("2048"))
    print("one core's float32 matmul peak: " + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in peaks.items()))

    print(f"\n{'method':<12}{'step s':>8}{'matmul GFLOP':>14}{'matmul s':>10}{'GFLOP/s':>9}{'other s':>9}"
          f"{'floor s':>9}{'step/floor':>12}")
    for name in args.methods.split(","):
        policy, _ = load_policy(model_dir)
        torch.manual_seed(0)
        trainer = ActorCriticTrainer(policy, ValueModel.from_policy(policy), get_method(name),
                                     replace(cfg.trainer, critic_warmup_steps=0))
        trainer.step(batches[0])
        times = []
        for i in range(args.repeats):
            start = time.perf_counter()
            trainer.step(batches[i % len(batches)])
            times.append(time.perf_counter() - start)
        with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
            trainer.step(batches[0])
        events = prof.key_averages()
        flops = sum(e.flops for e in events if e.key in MATMULS and e.flops) / 1e9
        matmul_s = sum(e.self_cpu_time_total for e in events if e.key in MATMULS) / 1e6
        profiled_s = sum(e.self_cpu_time_total for e in events) / 1e6
        step = statistics.median(times)
        floor = flops / model_peak
        # the step's non-matmul share, scaled to the unprofiled step
        other = step * (1 - matmul_s / profiled_s)
        print(f"{name:<12}{step:>8.3f}{flops:>14.2f}{matmul_s:>10.3f}{flops / matmul_s:>9.1f}{other:>9.3f}"
              f"{floor:>9.3f}{step / floor:>12.2f}")
    print("\nfloor = matmul GFLOP / the best model-shape peak: the step if every other op were free and "
          "every matmul ran at peak; step/floor bounds what any rewrite "
          "could gain on this CPU without computing fewer FLOPs")


if __name__ == "__main__":
    main()
