"""Held-out accuracy of a real model on the word problems, per prompt, with its interval and a paired gain.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/real_model_eval.py --checkpoint smollm2-hf \
        --prompts 200 --samples 2 --out before.json [key=value ...]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/real_model_eval.py --checkpoint runs/R \
        --prompts 200 --samples 2 --out after.json --pair before.json

``--checkpoint`` is an HF folder (the recipe of :data:`RECIPE` applies: ``math_tool`` on the shipped word
problems, :data:`~copc.tasks.word_problems.TEMPLATE`, the real-model budgets) or a run directory (its own
config and latest checkpoint, as ``copc eval``). The evaluation is ``copc eval``'s
(:func:`copc.eval.evaluate`, sampled at the rollout temperature, the same seeds for every checkpoint), without
the greedy pass. Written to ``--out``: avg@k, its 95% t-interval over prompts (each prompt's share of its k
samples correct is one value), and every prompt's share; with ``--pair`` (an earlier ``--out`` of the same
prompts), the gain ``after - before`` and its paired 95% t-interval over the same prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from real_model_recipe import RECIPE  # noqa: E402

if TYPE_CHECKING:
    from copc.types import Trajectory

__all__ = ["paired_gain", "per_prompt_accuracy", "summarise"]


def per_prompt_accuracy(correct: list[bool], prompts: int, k: int) -> list[float]:
    """Each prompt's share of correct samples; ``correct`` is ordered prompt-major (prompt i's k samples at
    ``i * k .. i * k + k - 1``, as :func:`copc.eval.evaluate` plays them)."""
    if len(correct) != prompts * k:
        raise ValueError(f"expected {prompts} x {k} = {prompts * k} episodes, got {len(correct)}")
    return [sum(correct[i * k:(i + 1) * k]) / k for i in range(prompts)]


def summarise(shares: list[float]) -> dict[str, float]:
    """avg@k (the mean of the per-prompt shares) and its 95% t-interval over prompts."""
    from copc.experiments.stats import t_interval

    ci = t_interval(shares)
    return {"accuracy": sum(shares) / len(shares), "ci_low": ci.low, "ci_high": ci.high}


def paired_gain(before: list[float], after: list[float]) -> dict[str, float]:
    """Mean of ``after - before`` over the same prompts and its paired 95% t-interval."""
    if len(before) != len(after):
        raise ValueError(f"paired over the same prompts: {len(before)} before, {len(after)} after")
    from copc.experiments.stats import t_interval

    diffs = [a - b for a, b in zip(after, before, strict=True)]
    ci = t_interval(diffs)
    return {"gain": sum(diffs) / len(diffs), "gain_ci_low": ci.low, "gain_ci_high": ci.high}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--pair", default=None, help="an earlier --out of the same prompts")
    parser.add_argument("--chunk", type=int, default=50, help="prompts played at once (memory: the KV caches "
                        "of every episode in flight; 200 at once took 10 GB with SmolLM2)")
    parser.add_argument("--replies", default=None, help="also write every episode's reply text, reward and "
                        "stop reason to this .jsonl (to read what the model does)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    import torch

    from copc.eval.evaluate import EvalConfig, evaluate
    from copc.run.build import capped_context_limit, quiet_transformers
    from copc.run.eval import _load_model, eval_config, is_run_dir
    from copc.tasks import get_task

    torch.set_num_threads(1)
    quiet_transformers()
    path = Path(args.checkpoint)
    cfg = eval_config(path, None if is_run_dir(path) else "math_tool",
                      [*([] if is_run_dir(path) else RECIPE), *args.overrides])
    model, tokenizer, step = _load_model(path)
    task = get_task(cfg.task, **cfg.task_options)
    rollout = replace(cfg.rollout, context_limit=capped_context_limit(cfg.rollout.context_limit, model))
    start = time.perf_counter()
    shares: list[float] = []
    ids: list[str] = []
    metrics: list[dict[str, float]] = []
    for first in range(0, args.prompts, args.chunk):
        episodes: list[Trajectory] = []
        part = Slice(task, first)
        metrics.append(evaluate(model, tokenizer, part, rollout, EvalConfig(  # type: ignore[arg-type]
            prompts=min(args.chunk, args.prompts - first), samples=args.samples, greedy=False),
            seed=args.seed + first, episodes=episodes))
        correct = [t.info.get("correct", float(t.reward > 0)) > 0 for t in episodes]
        shares += per_prompt_accuracy(correct, len(episodes) // args.samples, args.samples)
        ids += [episodes[i * args.samples].prompt_id for i in range(len(episodes) // args.samples)]
        if args.replies:
            _append_replies(Path(args.replies), episodes, tokenizer, first == 0)
        _write(args, path, step, shares, ids, metrics, time.perf_counter() - start)
    print(json.dumps({k: v for k, v in json.loads(Path(args.out).read_text()).items()
                      if k not in ("per_prompt", "prompt_ids", "metrics")}))


class Slice:
    """The task with its eval prompts from index ``first`` on (ids kept), so a long evaluation runs in
    chunks: chunk c's sampling seed is ``seed + first``, whatever the chunk size before it."""

    def __init__(self, task: object, first: int) -> None:
        self.task, self.first = task, first
        self.name = task.name  # type: ignore[attr-defined]

    def prompts(self, split: str, n: int | None = None) -> list[object]:
        pool = self.task.prompts(split)  # type: ignore[attr-defined]
        return pool[self.first: None if n is None else self.first + n]  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> object:
        return getattr(self.task, name)


def _append_replies(path: Path, episodes: list[Trajectory], tokenizer: object, fresh: bool) -> None:
    """One line per episode: its prompt id, reward, stop reason and the text after the prompt."""
    with path.open("w" if fresh else "a") as handle:
        for t in episodes:
            text = tokenizer.decode(t.token_ids[t.prompt_len:])  # type: ignore[attr-defined]
            handle.write(json.dumps({"prompt_id": t.prompt_id, "reward": t.reward,
                                     "stop": t.stop_reason.value, "reply": text}) + "\n")


def _write(args: argparse.Namespace, path: Path, step: int | None, shares: list[float], ids: list[str],
           metrics: list[dict[str, float]], seconds: float) -> None:
    """The figures so far (after each chunk, so a stopped evaluation keeps what it measured)."""
    out: dict[str, object] = {"checkpoint": str(path), "step": step, "prompts": len(shares),
                              "samples": args.samples,
                              "seed": args.seed, "chunk": args.chunk, "eval_seconds": seconds,
                              **summarise(shares),
                              "metrics": metrics, "per_prompt": shares, "prompt_ids": ids,
                              "complete": len(shares) == args.prompts}
    if args.pair:
        before = json.loads(Path(args.pair).read_text())
        if before["prompt_ids"][: len(ids)] != ids:
            raise SystemExit(f"--pair {args.pair} was measured on other prompts; evaluate the same ones")
        out.update(paired_gain(before["per_prompt"][: len(shares)], shares))
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k not in ("per_prompt", "prompt_ids", "metrics")}))


if __name__ == "__main__":
    main()
