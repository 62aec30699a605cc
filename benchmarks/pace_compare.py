"""PACE vs plain bounded from finished ``copc train`` run directories, paired by seed.

Expects ``<root>/m_none_s<seed>`` and ``<root>/m_pace_s<seed>`` (the runs of docs/algorithms.md, "PACE
vs plain bounded"). Prints per run and per seed pair: held-out avg@1 at each evaluation (equal steps),
the training accuracy of the consumed batches at equal wall time (mean over the steps finished in the
second half of the pair's common training time), training wall time, PACE's rejection rate, versions per
trajectory and generation / waiting staleness (means over steps).

    .venv/bin/python benchmarks/pace_compare.py /tmp/pp_runs
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def load(run: Path) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """(training step rows, evaluation rows) of one run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss/value" in r], [r for r in rows if "eval/accuracy" in r]


def mean(rows: list[dict[str, float]], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.fmean(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    args = parser.parse_args()
    seeds = sorted({int(p.name.rsplit("_s", 1)[1]) for p in args.root.glob("m_*_s*") if p.is_dir()})
    gaps_eval, gaps_wall = [], []
    for seed in seeds:
        runs = {arm: args.root / f"m_{arm}_s{seed}" for arm in ("none", "pace")}
        if not all((r / "summary.json").exists() for r in runs.values()):
            print(f"seed {seed}: not finished, skipped")
            continue
        data = {arm: load(run) for arm, run in runs.items()}
        start = {arm: data[arm][1][0]["time"] for arm in runs}  # the step-0 evaluation starts the clock
        train_s = {arm: data[arm][0][-1]["time"] - data[arm][0][0]["time"] + data[arm][0][0]["time/step"]
                   for arm in runs}
        common = min(train_s.values())
        evals = {arm: [round(r["eval/accuracy"], 3) for r in data[arm][1]] for arm in runs}
        at_wall = {}
        for arm in runs:
            t0 = data[arm][0][0]["time"] - data[arm][0][0]["time/step"]
            window = [r for r in data[arm][0] if common / 2 < r["time"] - t0 <= common]
            at_wall[arm] = mean(window, "rollout/accuracy")
        for arm in runs:
            steps = data[arm][0]
            print(f"seed {seed} {arm:4s}: eval avg@1 {evals[arm]}  train acc (equal wall, 2nd half of "
                  f"{common:.0f} s) {at_wall[arm]:.3f}  train wall {train_s[arm]:.0f} s  "
                  f"(from eval 0 {steps[-1]['time'] - start[arm]:.0f} s)  reject rate "
                  f"{mean(steps, 'staleness/pace_reject_rate'):.3f}  versions/traj "
                  f"{mean(steps, 'rollout/versions_per_traj'):.2f} (max "
                  f"{max(r['rollout/versions_per_traj_max'] for r in steps):.0f})"
                  f"  token staleness {mean(steps, 'staleness/mean'):.2f}"
                  f"  s_gen {mean(steps, 'staleness/generation_mean'):.2f}  s_wait "
                  f"{mean(steps, 'staleness/waiting_mean'):.2f}"
                  f"  trained traj/step {mean(steps, 'batch/sequences'):.1f}"
                  f"  median step {statistics.median(r['time/step'] for r in steps):.1f} s")
        gaps_eval.append(statistics.fmean(evals["pace"][1:]) - statistics.fmean(evals["none"][1:]))
        gaps_wall.append(at_wall["pace"] - at_wall["none"])
        print(f"seed {seed} pace - none: eval avg@1 (mean after step 0) {gaps_eval[-1]:+.3f}, "
              f"train acc at equal wall time {gaps_wall[-1]:+.3f}")
    if gaps_eval:
        print(f"mean over {len(gaps_eval)} seed pairs: eval {statistics.fmean(gaps_eval):+.3f}, "
              f"equal wall time {statistics.fmean(gaps_wall):+.3f}")


if __name__ == "__main__":
    main()
