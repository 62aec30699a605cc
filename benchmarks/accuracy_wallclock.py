"""Is async worth it? Held-out accuracy against wall-clock time, from sweep records and measured step times.

    python benchmarks/accuracy_wallclock.py --step-times STEP_TIMES.json --records results/A results/B \
        [--seeds 200 201 202] --out docs/figures/wallclock_X.png

The curves come from fixed-lag records (``copc sweep``, the sync driver simulating a lag exactly, so a
curve is the lag's effect and nothing else); their time axis comes from step times measured in one sitting
by ``benchmarks/step_time.py --json`` on the same task and batch: the sync driver's step for sync PPO, the
async driver's step for 3a (``async_ppo``) and for the COPC preset that file timed. The time of a point at
step ``k`` is ``k`` times that median step (held-out evaluations are measurement, not training, and are not
counted; nor is the warm start, the same for every arm). This is a combination of two measurements, not
one async run: it assumes a lagged run's step takes the async driver's step time whatever its lag, which
holds once the lag is at least the one the async driver reaches by itself (``staleness`` in the step-time
file, printed below).

Prints each curve (hours, mean held-out accuracy over the seeds, n) and, for every lagged curve, the
questions users ask: at the wall-clock time it ends, what has sync PPO reached (linear between its
evaluations)? And how long does it take to reach 90% of sync PPO's best gain over the shared start,
against sync PPO's own time to it?
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

SYNC, ASYNC_3A, ASYNC_COPC = "sync PPO", "async PPO (3a)", "async COPC"


def configuration(method: str, copc: str) -> str | None:
    """The step-time configuration whose step a record's method takes (None: not timed)."""
    return {"ppo": SYNC, "async_ppo": ASYNC_3A, copc: ASYNC_COPC}.get(method)


def curves(records: list[dict], seeds: set[int] | None,
           timed: set[str]) -> dict[tuple[str, int], dict[int, list[float]]]:
    """(method, lag) -> step -> held-out accuracies of the seeds recorded there, for the ``timed`` methods.
    Records of one method and lag must share their ``method_overrides`` (else two variants would be
    averaged into one curve)."""
    out: dict[tuple[str, int], dict[int, list[float]]] = {}
    variants: dict[tuple[str, int], str] = {}
    for record in records:
        method = record["config"]["method"]
        if (seeds is not None and record["seed"] not in seeds) or method not in timed:
            continue
        lag = 0 if method == "ppo" else int(record["config"]["staleness"]["staleness"])
        overrides = json.dumps(record["config"].get("method_overrides"), sort_keys=True)
        if variants.setdefault((method, lag), overrides) != overrides:
            raise SystemExit(f"error: {record['cell']} runs {method} at lag {lag} with other "
                             "method_overrides than an earlier record; give --records folders of one variant "
                             "per method")
        for point in record.get("evals", []):
            out.setdefault((method, lag), {}).setdefault(int(point["step"]), []).append(point["accuracy"])
    return out


def at_time(points: list[tuple[float, float]], hours: float) -> float | None:
    """Linear interpolation of (hours, accuracy) points at ``hours`` (None outside them)."""
    for (h0, a0), (h1, a1) in itertools.pairwise(points):
        if h0 <= hours <= h1:
            return a0 if h1 == h0 else a0 + (a1 - a0) * (hours - h0) / (h1 - h0)
    return None


def time_to(points: list[tuple[float, float]], level: float) -> float | None:
    """The first time the linear interpolation of (hours, accuracy) points reaches ``level`` (None:
    never, within the points)."""
    if points and points[0][1] >= level:
        return points[0][0]
    for (h0, a0), (h1, a1) in itertools.pairwise(points):
        if a0 < level <= a1:
            return h0 + (h1 - h0) * (level - a0) / (a1 - a0)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-times", type=Path, required=True,
                        help="benchmarks/step_time.py --json output")
    parser.add_argument("--records", type=Path, nargs="+", required=True, help="results/<experiment> folders")
    parser.add_argument("--seeds", type=int, nargs="*", default=None, help="only these seeds (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="the figure (PNG); none without it")
    args = parser.parse_args()
    timing = json.loads(args.step_times.read_text())
    step_s = {name: row["step"] for name, row in timing["configurations"].items()}
    records = [json.loads(p.read_text()) for folder in args.records for p in sorted(folder.glob("*.json"))]
    if not records:
        raise SystemExit("error: no records in " + ", ".join(map(str, args.records)))
    seeds = set(args.seeds) if args.seeds else None
    lines: dict[tuple[str, int], list[tuple[float, float, int]]] = {}
    timed = {"ppo", "async_ppo", timing["copc"]}
    for (method, lag), by_step in sorted(curves(records, seeds, timed).items()):
        name = configuration(method, timing["copc"])
        assert name is not None  # curves() keeps only the timed methods
        lines[(method, lag)] = [(step * step_s[name] / 3600, statistics.fmean(accs), len(accs))
                                for step, accs in sorted(by_step.items())]
    print(f"task {timing['task']}: median step (s) " + ", ".join(f"{k} {v:.2f}" for k, v in step_s.items())
          + "; the async driver's own lag (median): "
          + ", ".join(f"{k} {row['staleness']:.2f}" for k, row in timing["configurations"].items()
                      if k != SYNC))
    for (method, lag), points in lines.items():
        print(f"{method} lag {lag}: " + "  ".join(f"{h:.3f} h {a:.3f} (n={n})" for h, a, n in points))
    sync = next(([(h, a) for h, a, _ in pts] for (m, _), pts in lines.items() if m == "ppo"), None)
    if sync:
        print("\nat the time each lagged curve ends, against sync PPO at that time:")
        for (method, lag), points in lines.items():
            if method == "ppo":
                continue
            end_h, end_a, _ = points[-1]
            reached = at_time(sync, end_h)
            where = "beyond sync's last evaluation" if reached is None else f"sync PPO {reached:.3f}"
            print(f"  {method} lag {lag}: {end_a:.3f} at {end_h:.3f} h; {where}")
    if sync:
        start, best = sync[0][1], max(a for _, a in sync)
        level = start + 0.9 * (best - start)
        sync_h = time_to(sync, level)
        assert sync_h is not None  # sync reaches its own best, so 90% of the gain on the way
        print(f"\ntime to a level: sync PPO reaches {level:.3f} (90% of its best gain) at {sync_h:.3f} h")
        for (method, lag), points in lines.items():
            if method == "ppo":
                continue
            reached_h = time_to([(h, a) for h, a, _ in points], level)
            if reached_h is None:
                print(f"  {method} lag {lag}: never (best {max(a for _, a, _ in points):.3f})")
            else:
                share = f"{reached_h / sync_h:.2f} of sync PPO's time" if sync_h > 0 else "at once"
                print(f"  {method} lag {lag}: {reached_h:.3f} h, {share}")
    if args.out is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for (method, lag), points in lines.items():
            seeds_here = max(n for _, _, n in points)
            label = (f"sync PPO (n={seeds_here})" if method == "ppo"
                     else f"{method} (lag {lag}, n={seeds_here})")
            ax.plot([h for h, _, _ in points], [a for _, a, _ in points], marker="o", label=label)
        ax.set_xlabel("wall-clock hours (steps x measured step time)")
        ax.set_ylabel("held-out accuracy (sampled avg@1, seed mean)")
        own_lag = max(row["staleness"] for k, row in timing["configurations"].items() if k != SYNC)
        ax.set_title(f"{timing['task']}: accuracy against wall-clock (seed means; n = seeds per curve)\n"
                     f"fixed-lag curves x step times measured in one sitting "
                     f"(the async driver's own lag: {own_lag:.1f})", fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(args.out, dpi=120)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
