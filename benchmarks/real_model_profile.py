"""One real-model step by phase against a FLOP bound from this machine's matmul throughput, and the bf16
autocast candidate measured on the same rows.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/real_model_profile.py --model smollm2-hf [--steps 2] \
        [--walkthrough] [--out profile.json] [key=value ...]

One batch is generated with the recipe (``benchmarks/real_model_recipe.py``; ``--walkthrough``: the
docs/own-model.md section 7 settings the issue-35 step time was measured at) and the trainer (method from
the recipe, critic warm-up off) steps on it ``--steps`` times after one warm-up step. Printed and written:

- the phases' wall seconds (median over the timed steps): ``generate`` (the batch, one process, one
  thread), ``prepare`` (the no-grad forwards: ``old`` where the method recomputes it, the values, the
  advantages), ``critic`` and ``actor`` (forward, backward and optimizer of each update), the rest of the
  step (``publish``: finiteness check, weight hand-over, bookkeeping);
- each phase's matmul FLOPs, counted from the model's shapes and the batch's real tokens (forward
  ``2 P t`` plus attention ``4 L t^2 d`` per row plus the head ``2 d V t``; backward twice the forward;
  recomputation one more forward), and its bound at this thread's measured matmul throughput in float32
  and in bfloat16 (``torch.matmul`` at the model's own shapes, 2 s each);
- the bf16 candidate: one actor micro-batch's forward + backward in float32 and under
  ``torch.autocast("cpu", dtype=torch.bfloat16)`` (fp32 master weights, log-probs in float32), their
  wall seconds, and the log-prob drift of the autocast forward against the float32 one at lag 0 (the same
  weights: what ``w = old / mu`` would see), max and mean ``|d|`` over action tokens.

The figures depend on the machine's load (printed); compare rows of one sitting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from real_model_recipe import TRAIN_RECIPE  # noqa: E402

WALKTHROUGH = ["task=math_tool", f"task_options.data={ROOT / 'tests/fixtures/math_tool.jsonl'}",
               "task_options.eval_size=2", "rollout.max_new_tokens_per_turn=256",
               "rollout.max_total_tokens=512",
               "rollout.context_limit=2048", "rollout.prompts_per_batch=2", "rollout.group_size=4",
               "trainer.actor_lr=5e-6", "trainer.critic_warmup_steps=0", "eval.prompts=0", "method=copc"]


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, seconds: float = 2.0) -> float:
    """GFLOP/s of ``[m, k] @ [k, n]`` in ``dtype`` on this thread (median of 5 timed blocks)."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    for _ in range(2):
        a @ b
    start = time.perf_counter()
    a @ b
    one = max(time.perf_counter() - start, 1e-6)
    reps = max(1, int(seconds / 5 / one))
    rates = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        rates.append(2 * m * k * n * reps / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def forward_gflop(params: int, layers: int, hidden: int, vocab: int, lengths: list[int], *,
                  head: bool) -> float:
    """Matmul GFLOP of one forward over rows of ``lengths`` real tokens: ``2 P t`` for the non-embedding
    weights, ``4 L t^2 d`` for attention scores and values (causal: half of it is masked but still computed
    by SDPA's dense kernel), ``2 d V t`` for the LM head."""
    total = 0.0
    for t in lengths:
        total += 2 * params * t + 4 * layers * t * t * hidden + (2 * hidden * vocab * t if head else 0)
    return total / 1e9


@contextmanager
def timed_phases(times: dict[str, list[float]]) -> Iterator[None]:
    """Record the wall seconds of every ``PEAKS.phase(name)`` block the trainer enters."""
    from copc.trainer import memory

    original: Callable[[str], object] = memory.PEAKS.phase

    @contextmanager
    def phase(name: str) -> Iterator[None]:
        start = time.perf_counter()
        with original(name):  # type: ignore[attr-defined]
            yield
        times[name].append(time.perf_counter() - start)

    memory.PEAKS.phase = phase  # type: ignore[method-assign]
    try:
        yield
    finally:
        memory.PEAKS.phase = original  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--walkthrough", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from copc.channels.methods import get_method
    from copc.models.hf import ValueModel, load_policy, token_logprobs
    from copc.rollout.generator import RolloutGenerator
    from copc.run.build import quiet_transformers
    from copc.run.config import load_run_config
    from copc.tasks import get_task
    from copc.trainer.batching import collate
    from copc.trainer.trainer import ActorCriticTrainer

    quiet_transformers()
    base = WALKTHROUGH if args.walkthrough else TRAIN_RECIPE
    cfg = load_run_config(None, [*base, f"model.policy={args.model}", "run_dir=/tmp/copc-profile-unused",
                                 *args.overrides])
    model, tokenizer = load_policy(args.model)
    conf = model.config
    hidden, layers, vocab = int(conf.hidden_size), int(conf.num_hidden_layers), int(conf.vocab_size)
    embed = vocab * hidden
    params = sum(p.numel() for p in model.parameters()) - embed  # tied head: the embedding counted once
    generator = RolloutGenerator(model, tokenizer, get_task(cfg.task, **cfg.task_options), cfg.rollout,
                                 seed=cfg.seed)
    start = time.perf_counter()
    batch_trajs = generator.generate(0).trajectories
    generate_s = time.perf_counter() - start
    batch = collate(batch_trajs, pad_id=int(tokenizer.pad_token_id))
    lengths = [int(x) for x in batch.attention_mask.sum(dim=-1)]
    new_tokens = int(batch.action_mask.sum())
    prompt_tokens = sum(lengths) - new_tokens

    policy, _ = load_policy(args.model)
    torch.manual_seed(0)
    trainer = ActorCriticTrainer(policy, ValueModel.from_policy(policy), get_method(cfg.method),
                                 replace(cfg.trainer, critic_warmup_steps=0))
    times: dict[str, list[float]] = defaultdict(list)
    steps: list[float] = []
    trainer.step(batch)
    with timed_phases(times):
        for _ in range(args.steps):
            start = time.perf_counter()
            trainer.step(batch)
            steps.append(time.perf_counter() - start)
    phase_s = {name: statistics.median(v) for name, v in times.items()}
    step_s = statistics.median(steps)
    phase_s["publish"] = max(0.0, step_s - sum(phase_s.values()))

    # FLOPs. Generation: every new token is one forward of its position against the cache (2 P + 2 d V, plus
    # attention over the prefix); the prompt is one prefill. Updates: forward + backward (2x) + recomputation
    # (1x forward) per epoch; the critic has no LM head.
    fwd_actor = forward_gflop(params, layers, hidden, vocab, lengths, head=True)
    fwd_critic = forward_gflop(params, layers, hidden, vocab, lengths, head=False)
    gen = (2 * params + 2 * hidden * vocab) * (prompt_tokens + new_tokens) / 1e9
    gen += sum(4 * layers * t * t * hidden / 2 for t in lengths) / 1e9
    method = get_method(cfg.method)
    recompute = 1 if trainer.config.gradient_checkpointing != "never" and params + embed >= 50e6 else 0
    old_fwd = fwd_actor if method.needs_old_forward else 0.0
    flops = {"generate": gen, "prepare": old_fwd + fwd_critic, "critic": (3 + recompute) * fwd_critic,
             "actor": (3 + recompute) * fwd_actor, "publish": 0.0}
    tokens = max(8, sum(lengths) // max(1, len(lengths)))
    rate = {str(dt).removeprefix("torch."): max(matmul_gflops(tokens, hidden, int(conf.intermediate_size),
                                                              dt),
                                               matmul_gflops(tokens, hidden, hidden, dt))
            for dt in (torch.float32, torch.bfloat16)}
    phase_s["generate"] = generate_s

    # The bf16 autocast candidate on one actor micro-batch of the batch's longest rows.
    rows = torch.argsort(batch.attention_mask.sum(dim=-1), descending=True)[:2]
    ids, mask = batch.input_ids[rows], batch.attention_mask[rows]
    action = batch.action_mask[rows]
    candidate: dict[str, float] = {}
    for name, ctx in (("float32", None), ("bf16_autocast", torch.bfloat16)):
        clock = []
        for _ in range(2):
            policy.zero_grad(set_to_none=True)
            start = time.perf_counter()
            if ctx is None:
                logp = token_logprobs(policy, ids, mask, temperature=cfg.rollout.temperature).logp
            else:
                with torch.autocast("cpu", dtype=ctx):
                    logp = token_logprobs(policy, ids, mask, temperature=cfg.rollout.temperature).logp
            logp.float()[action].sum().backward()
            clock.append(time.perf_counter() - start)
        candidate[f"{name}_fwd_bwd_s"] = min(clock)
        candidate[f"{name}_logp"] = logp.detach().float()  # type: ignore[assignment]
    drift = (candidate.pop("bf16_autocast_logp") - candidate.pop("float32_logp"))[action].abs(
        )  # type: ignore[operator]
    candidate["drift_max"], candidate["drift_mean"] = float(drift.max()), float(drift.mean())
    candidate["speedup"] = candidate["float32_fwd_bwd_s"] / candidate["bf16_autocast_fwd_bwd_s"]

    load = os.getloadavg()[0]
    print(f"batch: {len(lengths)} rows, {sum(lengths)} real tokens ({new_tokens} generated), longest "
          f"{max(lengths)}; method {cfg.method}; load average {load:.1f}; matmul GFLOP/s on one thread: "
          + ", ".join(f"{k} {v:.1f}" for k, v in rate.items()))
    print(f"{'phase':<10}{'s':>9}{'GFLOP':>10}{'fp32 bound s':>14}{'bf16 bound s':>14}{'s / fp32 bound':>16}")
    for name in ("generate", "prepare", "critic", "actor", "publish"):
        s, g = phase_s.get(name, 0.0), flops[name]
        b32, b16 = g / rate["float32"], g / rate["bfloat16"]
        ratio = s / b32 if b32 else float("nan")
        print(f"{name:<10}{s:>9.1f}{g:>10.1f}{b32:>14.1f}{b16:>14.1f}{ratio:>16.1f}")
    train_s = step_s
    print(f"trainer step (median of {len(steps)}): {train_s:.1f} s; with generation: "
          f"{train_s + generate_s:.1f} s")
    print("bf16 autocast, one actor micro-batch (2 longest rows) forward+backward: "
          + ", ".join(f"{k} {v:.4g}" for k, v in candidate.items()))
    if args.out:
        Path(args.out).write_text(json.dumps({
            "rows": len(lengths), "real_tokens": sum(lengths), "generated_tokens": new_tokens, "load": load,
            "method": cfg.method, "matmul_gflops": rate, "phase_s": phase_s, "phase_gflop": flops,
            "train_step_s": train_s, "steps": steps, "bf16_candidate": candidate,
            "settings": "walkthrough" if args.walkthrough else "recipe"}, indent=1) + "\n")


if __name__ == "__main__":
    main()
