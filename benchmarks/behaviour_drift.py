"""How far each run's policy moved from the behaviour policy, against how well it did (issue 13, E1).

    .venv/bin/python benchmarks/behaviour_drift.py [runs/sweep/e1_arith_tool] [--results
    results/e1_arith_tool]

For every finished cell of a sweep it reads the run's ``metrics.jsonl`` and prints the mean over the last
half of training of ``ratio/mean_abs_log`` (``|log pi_old - log mu|`` per action token: how far the
step-start policy is from the one that sampled the batch, s versions earlier; for async PPO 3a, which
has no step-start forward, the first minibatch's ``|log pi - log mu|``) and of ``ratio/kl_k3`` (the k3
estimate of KL(mu || pi_old)), beside the record's held-out ``eval_last_half``. It then prints the
Spearman rank correlation between drift and accuracy over all runs, and the drift of each method paired
by seed with the sweep's baseline method (95% t interval over seeds). ``--plot PNG`` draws each run's
drift and greedy accuracy over training, with its E4 collapse marked (E4 on search).

This is a diagnostic read off finished runs: a correlation, not an intervention. It tunes nothing.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from copc.experiments.interaction import rank_correlation
from copc.experiments.stats import t_interval
from copc.experiments.tables import collapse_step
from copc.tracking import read_metrics


def last_half_mean(rows: list[dict[str, float]], key: str, steps: int) -> float:
    values = [float(r[key]) for r in rows if key in r and int(r["step"]) >= steps / 2]
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="?", default="runs/sweep/e1_arith_tool")
    parser.add_argument("--results", default="results/e1_arith_tool")
    parser.add_argument("--baseline", default="async_ppo", help="method the drift is paired with")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="also draw each run's drift and greedy accuracy "
                        "over training, its E4 collapse (greedy_accuracy, 0.1, 3) marked")
    args = parser.parse_args()
    table: dict[str, dict[int, tuple[float, float, float]]] = defaultdict(dict)
    traces: dict[str, tuple[list[dict[str, float]], dict[str, Any]]] = {}
    for record_path in sorted(Path(args.results).glob("*.json")):
        record = json.loads(record_path.read_text())
        run_dir = Path(args.runs) / record_path.stem
        if not (run_dir / "metrics.jsonl").exists():
            continue
        method, seed_text = record_path.stem.split("__seed")
        steps = int(record["config"]["steps"])
        rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
        drift = last_half_mean(rows, "ratio/mean_abs_log", steps)
        kl = last_half_mean(rows, "ratio/kl_k3", steps)
        table[method.split("=", 1)[-1]][int(seed_text)] = (drift, kl,
                                                           float(record["summary"]["eval_last_half"]))
        traces[f"{method.split('=', 1)[-1]} seed {seed_text}"] = (rows, record)
    print(f"{'method':<10} {'seed':>4} {'|log old/mu|':>13} {'k3 KL':>8} {'eval_last_half':>15}")
    drifts, accs = [], []
    for method, seeds in sorted(table.items()):
        for seed, (drift, kl, acc) in sorted(seeds.items()):
            print(f"{method:<10} {seed:>4} {drift:>13.3f} {kl:>8.4f} {acc:>15.3f}")
            if method != "ppo_sync":  # sync PPO has no lag: its drift is 0 by construction
                drifts.append(drift)
                accs.append(acc)
    if len(drifts) >= 3:
        print(f"\nSpearman rank correlation of drift and eval_last_half over the {len(drifts)} lagged runs: "
              f"{rank_correlation(np.array(drifts), np.array(accs)):+.2f}")
    base = table.get(args.baseline, {})
    for method, seeds in sorted(table.items()):
        paired = [seeds[s][0] - base[s][0] for s in sorted(seeds) if s in base]
        if method in (args.baseline, "ppo_sync") or not paired:
            continue
        interval = t_interval(paired).text() if len(paired) > 1 else f"{paired[0]:+.3f} (n=1)"
        print(f"drift of {method} minus {args.baseline}, paired by seed: {interval}")
    if args.plot:
        print(f"wrote {plot_traces(traces, Path(args.plot))}")


def plot_traces(traces: dict[str, tuple[list[dict[str, float]], dict[str, Any]]], out: Path) -> Path:
    """Per run: its drift (10-step means) and greedy accuracy over training, the collapse step dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name, (rows, record) in sorted(traces.items()):
        steps = [int(r["step"]) for r in rows if "ratio/mean_abs_log" in r]
        drift = [float(r["ratio/mean_abs_log"]) for r in rows if "ratio/mean_abs_log" in r]
        bins = range(0, len(drift), 10)
        line = top.plot([steps[i] for i in bins], [sum(drift[i:i + 10]) / len(drift[i:i + 10]) for i in bins],
                        label=name)[0]
        evals = record["evals"]
        assert isinstance(evals, list)
        bottom.plot([e["step"] for e in evals], [e["greedy_accuracy"] for e in evals], marker="o",
                    markersize=3,
                    color=line.get_color(), label=name)
        collapse = collapse_step(record)
        if collapse is not None:
            for ax in (top, bottom):
                ax.axvline(collapse, color=line.get_color(), linestyle="--", alpha=0.6)
    top.set_yscale("log")
    top.set_ylabel("|log pi_old - log mu| per action token")
    bottom.set_ylabel("greedy accuracy (held out)")
    bottom.set_xlabel("training step (dashed: E4 collapse, 3 evaluations > 0.1 below the best)")
    top.legend(fontsize=7)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    main()
