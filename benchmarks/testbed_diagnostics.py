"""Print a testbed's mechanism diagnostics from sweep records, one row per record (a markdown table).

Can COPC's advantage channel act in a testbed? These are the figures that say so, read from the records
``copc sweep`` writes (``results/<experiment>/*.json``), never from run directories:

    python benchmarks/testbed_diagnostics.py results/dev_kv_chain [--step 50]

Columns: the primary metric (``eval_after_start``) and the held-out curve; the median over steps of the
batch's mean policy tokens per episode; the critic's explained variance, mean of the last 10 steps; at the
diagnostic step ``--step`` (the last one at or before it), the median summed ``|log(cur/mu)|`` per
trajectory, the median clipped trace product, V-trace's median truncated trace, the share of tokens where
the advantage clip bites, and the oracle's chunk-advantage MSE of GAE on the batch, of GAE on fresh
episodes (lag 0), of COPC's clipped TD and of V-trace, with the critic's correlation with the oracle.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

AT_STEP = [
    ("sum abs log w", "offpolicy_sum_abs_log_w"), ("clipped trace", "offpolicy_trace_clip_median"),
    ("V-trace trace", "offpolicy_trace_vtrace_median"), ("adv clip", "offpolicy_adv_clip_frac"),
    ("MSE GAE", "oracle_gae_mse"), ("MSE GAE lag 0", "oracle_lag0_gae_mse"),
    ("MSE clipped TD", "oracle_clipped_td_mse"), ("MSE V-trace", "oracle_vtrace_mse"),
    ("critic-oracle corr", "oracle_critic_value_corr"),
]


def at_step(curve: list[list[float]] | None, step: int) -> float | None:
    """The curve's value at the last point at or before ``step`` (None without one)."""
    points = [value for at, value in curve or [] if at <= step]
    return points[-1] if points else None


def row(record: dict, step: int) -> list[str]:
    curves = record.get("curves", {})
    tokens = [value for _, value in curves.get("response_tokens", [])]
    explained = [value for _, value in curves.get("critic_explained_var", [])][-10:]
    cells = [
        record["cell"], f"{record['summary']['eval_after_start']:.3f}",
        " ".join(f"{e['accuracy']:.2f}" for e in record.get("evals", [])),
        f"{statistics.median(tokens):.0f}" if tokens else "-",
        f"{statistics.fmean(explained):.2f}" if explained else "-",
    ]
    for _, key in AT_STEP:
        value = at_step(curves.get(key), step)
        cells.append("-" if value is None else f"{value:.3f}")
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a folder of sweep records (results/<experiment>)")
    parser.add_argument("--step", type=int, default=50, help="the diagnostic step to report (default 50)")
    args = parser.parse_args()
    records = [json.loads(path.read_text()) for path in sorted(args.results.glob("*.json"))]
    if not records:
        raise SystemExit(f"error: no records (*.json) in {args.results}; give a results/<experiment> folder")
    head = ["cell", "primary", "held-out curve", "tokens (median)", "critic EV (last 10)",
            *(f"{name} @{args.step}" for name, _ in AT_STEP)]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for record in records:
        print("| " + " | ".join(row(record, args.step)) + " |")


if __name__ == "__main__":
    main()
