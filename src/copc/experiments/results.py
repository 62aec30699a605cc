"""The results store of ``copc sweep``: one small JSON record per finished run, and the table over seeds.

A record (``results/<experiment>/<cell-id>.json``, a few KB) keeps what a comparison needs once the run
directory is gone: the resolved config and its hash, the cell's levels and seed, every held-out
evaluation, the train-reward curve and the :data:`DIAGNOSTIC_CURVES` averaged into at most :data:`CURVE_POINTS` bins,
the summary figures,
step times, wall seconds and the machine. Records are written atomically (a temporary sibling, then
``os.replace``), so a reader never sees half a record, and a cell whose record exists is finished.
:func:`commit_alone` commits records to git as they land (``copc sweep --commit``).

Summary figures of one run (``record["summary"]``):

- ``eval_last_half``: mean held-out avg@k over the evaluations in the last half of training
  (``step >= steps / 2``, the final evaluation included);
- ``eval_final`` / ``greedy_final``: the final evaluation (sampled avg@k, greedy accuracy);
- ``greedy_last_half``: as ``eval_last_half`` for greedy accuracy (greedy EM on search);
- ``eval_after_start`` / ``greedy_after_start``: mean over every evaluation after step 0 (the area under
  the held-out curve, per evaluation interval);
- ``train_reward_last``: mean train reward over the last 20% of the steps.

Across seeds, :func:`~copc.experiments.stats.t_interval` gives the mean with its Student-t interval, and :func:`paired_differences`
pairs each cell's seeds with the baseline's (same seed = same prompts and warm start) and gives the mean
difference with its interval. Both are exact for normal data; with 3 seeds the intervals are wide, which
is the honest width.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import cast

import numpy as np

from copc import tracking as m
from copc.experiments.stats import Interval, t_interval

__all__ = [
    "CURVE_POINTS",
    "DIAGNOSTIC_CURVES",
    "RECORD_VERSION",
    "SUMMARY_METRICS",
    "build_record",
    "by_group",
    "collapse_step",
    "collapse_text",
    "commit_alone",
    "config_hash",
    "group_key",
    "group_text",
    "known_metric",
    "load_records",
    "machine_info",
    "metric_names",
    "paired_differences",
    "read_record",
    "report_text",
    "start_mismatches",
    "subsample_curve",
    "write_record",
]

#: Bump when the record layout changes (readers refuse a newer version).
RECORD_VERSION = 1
#: The train-reward curve is averaged into at most this many bins.
CURVE_POINTS = 60
#: Config keys that do not change what a run computes (left out of the hash).
UNHASHED_KEYS = ("run_dir", "resume", "plots", "checkpoint_every", "keep_checkpoints", "stall_timeout_s",
                 "no_signal_steps", "wandb", "wandb_project")
#: The diagnostic curves every record keeps (record["curves"]: name -> binned [[step, mean], ...]), so a
#: result can be explained once the run directory is gone: drift from the behaviour policy, what each
#: channel did (mask rate, advantage-clip rates), ESS, the critic, entropy, tool use and the realised lag.
DIAGNOSTIC_CURVES: dict[str, str] = {
    "drift": m.RATIO_MEAN_ABS_LOG_W,
    "mask_rate": m.POLICY_MASK_FRAC,
    "adv_clip_low": m.RATIO_CLIP_FRAC_LOW,
    "adv_clip_high": m.RATIO_CLIP_FRAC_HIGH,
    "ess_token": m.RATIO_ESS_TOKEN,
    "ess_seq": m.RATIO_ESS_SEQ,
    "critic_explained_var": m.CRITIC_EXPLAINED_VAR,
    "entropy": m.LOSS_ENTROPY,
    "entropy_mc": m.ROLLOUT_ENTROPY_MC,
    "tool_use_rate": m.ROLLOUT_TOOL_USE_RATE,
    "lag_mean": m.STALENESS_MEAN,
    "lag_max": m.STALENESS_MAX,
    "ppo_clip_low": m.POLICY_CLIP_FRAC_LOW,
    "ppo_clip_high": m.POLICY_CLIP_FRAC_HIGH,
    "approx_kl": m.POLICY_APPROX_KL,
    "grad_actor_norm": m.GRAD_ACTOR_NORM,
    "response_tokens": m.ROLLOUT_RESPONSE_TOKENS,
}
#: The per-run figures a report can tabulate (record["summary"] keys).
SUMMARY_METRICS = (
    "eval_last_half", "eval_final", "greedy_last_half", "greedy_final", "eval_after_start", "greedy_after_start",
    "train_reward_last",
)


# ------------------------------------------------------------------------------------------ records
#: Nested keys (``section.field``) left out of the hash for the same reason: they act only on a fault
#: (a stopped rollout worker) or on how, not what, a run computes (activation recomputation: the same
#: gradients), never on its results. Fields added after records were made go here, so those records keep
#: their hash (their configs lack the keys).
UNHASHED_NESTED_KEYS = ("driver.silent_worker_warn_s", "driver.silent_worker_restart_s",
                        "trainer.gradient_checkpointing")


def config_hash(config: Mapping[str, object]) -> str:
    """16 hex digits of the SHA-256 of the config (as a plain dict) without :data:`UNHASHED_KEYS` and
    :data:`UNHASHED_NESTED_KEYS`."""
    kept = {k: v for k, v in config.items() if k not in UNHASHED_KEYS}
    for dotted in UNHASHED_NESTED_KEYS:
        section, field = dotted.split(".", 1)
        if isinstance(kept.get(section), Mapping) and field in kept[section]:  # type: ignore[operator]
            kept[section] = {k: v for k, v in kept[section].items() if k != field}  # type: ignore[attr-defined]
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def machine_info() -> dict[str, object]:
    """Where the run ran: host, CPU model and count, Python and torch versions."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"host": platform.node(), "cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}


def subsample_curve(steps: Sequence[int], values: Sequence[float], points: int = CURVE_POINTS) -> list[list[float]]:
    """``[[last step of the bin, mean of the bin], ...]``: the curve cut into at most ``points`` equal bins."""
    if len(steps) != len(values):
        raise ValueError(f"subsample_curve: {len(steps)} steps but {len(values)} values")
    if not steps:
        return []
    bins = np.array_split(np.arange(len(steps)), min(points, len(steps)))
    return [[int(steps[b[-1]]), float(np.mean([values[i] for i in b]))] for b in bins]


def _median(values: Sequence[float]) -> float | None:
    return float(np.median(values)) if values else None


def _summary_figures(evals: list[dict[str, float]], rewards: list[float], steps: int) -> dict[str, float | None]:
    def mean_of(rows: list[dict[str, float]], key: str) -> float | None:
        values = [r[key] for r in rows if key in r]
        return float(np.mean(values)) if values else None

    last_half = [e for e in evals if e["step"] >= steps / 2]
    after_start = [e for e in evals if e["step"] > 0]
    final = evals[-1] if evals and evals[-1]["step"] >= steps else None
    tail = rewards[-max(1, len(rewards) // 5):] if rewards else []
    return {
        "eval_last_half": mean_of(last_half, "accuracy"),
        "eval_final": final.get("accuracy") if final else None,
        "greedy_last_half": mean_of(last_half, "greedy_accuracy"),
        "greedy_final": final.get("greedy_accuracy") if final else None,
        "eval_after_start": mean_of(after_start, "accuracy"),
        "greedy_after_start": mean_of(after_start, "greedy_accuracy"),
        "train_reward_last": float(np.mean(tail)) if tail else None,
    }


def _as_a_direct_run(evals: list[dict[str, float]], steps: int, every: int
                    ) -> tuple[list[dict[str, float]], list[dict[str, float]], list[int]]:
    """The evaluations a run trained to ``steps`` in one go would have: ``(evals, kept off schedule,
    the steps it was extended from)``.

    A run's evaluation after ``k`` updates is logged at step ``k - 1`` (merged into that step's row),
    its last one at ``steps``. A run extended from a shorter one (a larger ``steps``, resumed) keeps that
    run's last evaluation, alone at its old end ``N``: it is the evaluation a direct run logs at ``N - 1``
    when ``N`` is on the schedule (``eval.every`` divides it), and relabelled so; otherwise a direct run
    has none there, and it is set apart (kept in the record, out of its figures).
    """
    out, off, ends = [], [], []
    for point in evals:
        point = dict(point)
        alone = point.pop("alone", 0.0)
        step = int(point["step"])
        if alone and 0 < step < steps:  # an earlier process's end, kept by the extension
            ends.append(step)
            if every and step % every == 0:
                point["step"] = step - 1
            else:
                off.append(point)
                continue
        out.append(point)
    return out, off, ends


def build_record(
    run_dir: Path,
    *,
    experiment: str,
    cell_id: str,
    levels: Mapping[str, str],
    config: Mapping[str, object],
    wall_seconds: float | None = None,
    machine: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """The record of the finished run in ``run_dir`` (its ``summary.json`` and ``metrics.jsonl``).

    ``config`` is the resolved RunConfig as a dict; ``wall_seconds`` the sweep's own total over the
    run's processes as the sweep counted them (``summary.json`` carries the earlier processes' time too,
    but a process started by hand outside the sweep is in that figure only).
    """
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = m.read_metrics(run_dir)
    eval_keys = {m.EVAL_ACCURACY: "accuracy", m.EVAL_GREEDY_ACCURACY: "greedy_accuracy",
                 m.EVAL_PASS_AT_K: "pass_at_k", m.EVAL_TOOL_USE_RATE: "tool_use_rate"}
    evals = []
    for row in rows:
        if m.EVAL_ACCURACY in row:
            point: dict[str, float] = {"step": int(row["step"])}
            point.update({short: float(row[key]) for key, short in eval_keys.items() if key in row})
            if m.REWARD_MEAN not in row:
                point["alone"] = 1.0  # an evaluation row of its own (step 0, the end, or a kept end)
            evals.append(point)
    every = int(cast(Mapping[str, object], config.get("eval", {})).get("every", 0) or 0)  # type: ignore[call-overload]
    evals, kept_off, extended_from = _as_a_direct_run(evals, int(summary["steps"]), every)
    train = [r for r in rows if m.REWARD_MEAN in r]
    reward_steps = [int(r["step"]) for r in train]
    rewards = [float(r[m.REWARD_MEAN]) for r in train]
    step_times = [float(r[m.TIME_STEP]) for r in train if m.TIME_STEP in r]
    steps = int(summary["steps"])
    curves = {}
    for name, key in DIAGNOSTIC_CURVES.items():
        points = [(int(r["step"]), float(r[key])) for r in train if key in r]
        if points:
            curves[name] = subsample_curve([p[0] for p in points], [p[1] for p in points])
    return {
        "version": RECORD_VERSION,
        "experiment": experiment,
        "cell": cell_id,
        "levels": dict(levels),
        "seed": int(config["seed"]),  # type: ignore[call-overload]
        "config_hash": config_hash(config),
        "config": dict(config),
        "steps": steps,
        "evals": evals,
        **({"extended_from": extended_from, "evals_off_schedule": kept_off} if extended_from else {}),
        "train_reward": subsample_curve(reward_steps, rewards),
        "curves": curves,
        "summary": _summary_figures(evals, rewards, steps),
        "step_seconds": {
            "median": _median(step_times),
            "mean": float(np.mean(step_times)) if step_times else None,
            "generate_median": _median([float(r[m.TIME_GENERATE]) for r in train if m.TIME_GENERATE in r]),
            "train_median": _median([float(r[m.TIME_TRAIN]) for r in train if m.TIME_TRAIN in r]),
        },
        "wall_seconds": wall_seconds if wall_seconds is not None else summary.get("wall_seconds"),
        "wall_seconds_last_process": summary.get("wall_seconds_this_process", summary.get("wall_seconds")),
        "machine": dict(machine) if machine is not None else machine_info(),
    }


def write_record(path: Path, record: Mapping[str, object]) -> Path:
    """Write ``record`` to ``path`` atomically (temporary sibling, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("w") as handle:
        json.dump(record, handle, indent=1, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path


def read_record(path: Path) -> dict[str, object]:
    """One record; fails in one line on a record this copc cannot read."""
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable sweep record ({err}); delete it to re-run the cell") from None
    if not isinstance(record, dict) or int(record.get("version", 0)) > RECORD_VERSION:
        raise ValueError(f"{path}: record version {record.get('version') if isinstance(record, dict) else '?'} "
                         f"is newer than this copc reads ({RECORD_VERSION}); update copc")
    return record


def load_records(folder: Path) -> list[dict[str, object]]:
    """Every record of one experiment folder, in file-name order (temporary files skipped)."""
    if not folder.is_dir():
        return []
    return [read_record(p) for p in sorted(folder.glob("*.json")) if not p.name.startswith(".")]


def commit_alone(files: Sequence[Path], message: str, log: Callable[[str], None] = print) -> bool:
    """``git add`` and ``git commit`` these files (those that exist) and nothing else: whatever else is
    staged stays staged. A failure (no repository, a held index lock) is logged, not raised: the files
    are on disk, and a later commit of the same paths takes them. True when a commit was made."""
    existing = [str(p.resolve()) for p in files if p.exists()]
    if not existing:
        return False

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=os.path.dirname(existing[0]), capture_output=True, text=True,
                              timeout=60, check=True)

    try:
        git("add", "--", *existing)
        if not git("status", "--porcelain", "--", *existing).stdout.strip():
            return False
        git("commit", "-q", "-m", message, "--", *existing)
    except (OSError, subprocess.SubprocessError) as err:
        detail = (getattr(err, "stderr", "") or str(err)).strip()
        log(f"[sweep] warning: records not committed ({detail.splitlines()[-1] if detail else err}); they are "
            "on disk: the next record's commit takes them, or commit them by hand")
        return False
    log(f"[sweep] committed: {message}")
    return True


def collapse_step(record: Mapping[str, object], metric: str = "greedy_accuracy", *, margin: float = 0.1,
                  patience: int = 3) -> int | None:
    """E4's collapse detector: the step of the first evaluation that starts a run of ``patience``
    consecutive evaluations all more than ``margin`` below the running best of ``metric`` so far (the
    best over the evaluations before each one); None when the run never collapses.

    A dip that recovers within ``patience - 1`` evaluations is not a collapse; a run that ends inside
    its drop before ``patience`` evaluations is not counted either (too short to tell).
    """
    if margin <= 0 or patience < 1:
        raise ValueError(f"collapse_step needs margin > 0 and patience >= 1, got {margin}, {patience}")
    evals = record.get("evals")
    points = [(int(e["step"]), float(e[metric])) for e in evals if metric in e] if isinstance(evals, list) else []
    best, start, length = float("-inf"), None, 0
    for step, value in points:
        if value < best - margin:
            start, length = (step, 1) if length == 0 else (start, length + 1)
            if length >= patience:
                return start
        else:
            length = 0
        best = max(best, value)
    return None


def collapse_text(records: Sequence[Mapping[str, object]], metric: str = "greedy_accuracy", *, margin: float = 0.1,
                  patience: int = 3) -> str:
    """E4's count: per group, how many of its runs collapse (:func:`collapse_step`) and where."""
    groups: dict[tuple[tuple[str, str], ...], list[tuple[int, int | None]]] = {}
    for record in records:
        step = collapse_step(record, metric, margin=margin, patience=patience)
        groups.setdefault(group_key(record), []).append((int(record["seed"]), step))  # type: ignore[call-overload]
    lines = [f"collapses ({patience} consecutive evaluations more than {margin:g} below the run's best {metric}):"]
    width = max((len(group_text(k)) for k in groups), default=0)
    for key, runs in groups.items():
        hits = sorted((seed, step) for seed, step in runs if step is not None)
        where = f"  ({', '.join(f'seed {seed} at step {step}' for seed, step in hits)})" if hits else ""
        lines.append(f"  {group_text(key):<{width}}  {len(hits)} of {len(runs)}{where}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ tables
def group_key(record: Mapping[str, object]) -> tuple[tuple[str, str], ...]:
    """The record's axis levels as ``((axis, level), ...)``: its group, seeds aside."""
    levels = record["levels"]
    assert isinstance(levels, dict)
    return tuple((str(k), str(v)) for k, v in levels.items())


def group_text(key: tuple[tuple[str, str], ...]) -> str:
    return " ".join(f"{axis}={level}" for axis, level in key) or "(one cell)"


def known_metric(metric: str) -> bool:
    """A summary figure (:data:`SUMMARY_METRICS`) or ``mean:<curve>`` of a :data:`DIAGNOSTIC_CURVES` name."""
    return metric in SUMMARY_METRICS or (metric.startswith("mean:") and metric[5:] in DIAGNOSTIC_CURVES)


def metric_names() -> str:
    """The valid report metrics, for error messages."""
    return f"{', '.join(SUMMARY_METRICS)}, or mean:<curve> with <curve> one of {', '.join(DIAGNOSTIC_CURVES)}"


def _metric(record: Mapping[str, object], metric: str) -> float | None:
    if metric.startswith("mean:"):  # the run's mean of one diagnostic curve (its bins differ by at most one step)
        curves = record.get("curves")
        points = curves.get(metric[5:]) if isinstance(curves, dict) else None
        values = [float(v) for _, v in points or () if v is not None and math.isfinite(float(v))]
        return float(np.mean(values)) if values else None
    summary = record.get("summary")
    value = summary.get(metric) if isinstance(summary, dict) else None
    return float(value) if value is not None else None


def by_group(records: Sequence[Mapping[str, object]], metric: str) -> dict[tuple[tuple[str, str], ...], dict[int, float]]:
    """``{levels: {seed: value}}`` for the records that have ``metric``."""
    groups: dict[tuple[tuple[str, str], ...], dict[int, float]] = {}
    for record in records:
        value = _metric(record, metric)
        if value is not None:
            groups.setdefault(group_key(record), {})[int(record["seed"])] = value  # type: ignore[call-overload]
    return groups


def paired_differences(
    records: Sequence[Mapping[str, object]], metric: str, baseline: Mapping[str, str], confidence: float = 0.95
) -> dict[tuple[tuple[str, str], ...], tuple[Interval, list[int]]]:
    """For each group other than the baseline: the t interval of ``group - baseline`` over shared seeds.

    ``baseline`` names levels (``{"method": "ppo_sync"}``); a group is compared with the baseline group
    whose levels agree with it on every axis the baseline does not name (so ``method=copc s=16`` is paired
    with ``method=ppo_sync`` alone when the baseline group has no ``s`` axis). Returns the interval and the
    seeds used, for each group with at least one shared seed. A seed whose two records start from
    different policies (:func:`start_mismatches`) is not shared: it is left out of the pair.
    """
    groups = by_group(records, metric)
    starts = start_keys(records)
    base_groups = [k for k in groups if all(dict(k).get(a) == lv for a, lv in baseline.items())]
    out: dict[tuple[tuple[str, str], ...], tuple[Interval, list[int]]] = {}
    for key, values in groups.items():
        if key in base_groups:
            continue
        levels = dict(key)
        match = [b for b in base_groups
                 if all(levels.get(a) == lv for a, lv in b if a not in baseline)]
        if not match:
            continue
        base = groups[match[0]]
        seeds = [s for s in sorted(set(values) & set(base)) if same_start(starts, [key, match[0]], s)]
        if seeds:
            out[key] = (t_interval([values[s] - base[s] for s in seeds], confidence), seeds)
    return out


def start_key(record: Mapping[str, object]) -> tuple[float, float] | None:
    """The record's step-0 (accuracy, greedy accuracy), rounded: the policy it started from, as far as
    the evaluation sees it; None for a record without a step-0 evaluation."""
    evals = cast(list[dict[str, float]], record.get("evals", []) or [])
    first = next((e for e in evals if e.get("step") == 0), None)
    if first is None:
        return None
    return round(float(first.get("accuracy", math.nan)), 6), round(float(first.get("greedy_accuracy", math.nan)), 6)


def start_keys(records: Sequence[Mapping[str, object]]) -> dict[tuple[tuple[tuple[str, str], ...], int], tuple[float, float] | None]:
    """``{(group, seed): start_key}`` of the records."""
    return {(group_key(r), int(cast(int, r["seed"]))): start_key(r) for r in records}


def same_start(starts: Mapping[tuple[tuple[tuple[str, str], ...], int], tuple[float, float] | None],
               groups: Sequence[tuple[tuple[str, str], ...]], seed: int) -> bool:
    """Whether the records of ``groups`` at ``seed`` may be paired: no two known step-0 evaluations differ."""
    known = {starts.get((g, seed)) for g in groups} - {None}
    return len(known) <= 1


def start_mismatches(records: Sequence[Mapping[str, object]]) -> list[str]:
    """One line per task and seed whose records start from different policies: their step-0 evaluations
    (made before any update, so a function of the warm start and the evaluation alone) differ. Such
    records are not paired, whatever their seed says: the warm start was built anew on another machine
    (pin it, ``copc.run.warmstart``), or the evaluation changed. Records of different tasks have
    different warm starts by design and are never compared."""
    starts: dict[tuple[str, int], dict[tuple[float, float], list[str]]] = {}
    for record in records:
        key = start_key(record)
        if key is not None:
            task = str(cast(Mapping[str, object], record.get("config", {})).get("task", ""))
            seed = int(cast(int, record["seed"]))
            starts.setdefault((task, seed), {}).setdefault(key, []).append(str(record["cell"]))
    return [f"{task + ' ' if task else ''}seed {seed}: "
            + "; ".join(f"step-0 accuracy {a:g} / greedy {g:g}: {', '.join(sorted(cells))}"
                        for (a, g), cells in sorted(by.items()))
            for (task, seed), by in sorted(starts.items()) if len(by) > 1]


def report_text(
    records: Sequence[Mapping[str, object]],
    metrics: Sequence[str] = ("eval_last_half", "eval_final", "greedy_last_half"),
    baseline: Mapping[str, str] | None = None,
    confidence: float = 0.95,
    *,
    markdown: bool = False,
) -> str:
    """The table of one experiment: per group and metric, mean [95% t interval] over seeds, and the
    paired difference from ``baseline`` with its interval (marked ``*`` where it excludes 0);
    ``markdown``: the same figures as one Markdown table per metric (for docs/results.md)."""
    if not records:
        return "no finished records"
    pct = f"{100 * confidence:g}%"
    lines = [f"warning: records of one seed start from different policies, so they are not paired (each such "
             f"pair is left out of the paired differences and contrasts): {line}" for line in start_mismatches(records)]
    lines.append(f"{len(records)} records; mean [{pct} t interval over seeds] (n = seeds)")
    for metric in metrics:
        groups = by_group(records, metric)
        if not groups:
            continue
        diffs = paired_differences(records, metric, baseline, confidence) if baseline else {}
        if markdown:
            lines.extend(_markdown_table(metric, groups, diffs, baseline, confidence))
            continue
        lines.append(f"\n{metric}:")
        width = max(len(group_text(k)) for k in groups)
        for key, values in groups.items():
            row = f"  {group_text(key):<{width}}  {t_interval(values.values(), confidence).text()}"
            if key in diffs:
                interval, _ = diffs[key]
                mark = " *" if interval.excludes_zero() else ""
                row += f"   minus {group_text(tuple(baseline.items())) if baseline else ''}: "
                row += f"{interval.text()}{mark}"
            lines.append(row)
    if baseline and not markdown:
        lines.append(f"\n* the {pct} interval of the paired difference excludes 0")
    return "\n".join(lines)


def _markdown_table(metric: str, groups: Mapping[tuple[tuple[str, str], ...], Mapping[int, float]],
                    diffs: Mapping[tuple[tuple[str, str], ...], tuple[Interval, list[int]]],
                    baseline: Mapping[str, str] | None, confidence: float) -> list[str]:
    """One metric of :func:`report_text` as a Markdown table (bold where the paired interval excludes 0)."""
    pct = f"{100 * confidence:g}%"
    base = group_text(tuple(baseline.items())) if baseline else ""
    head = f"| {metric} | mean [{pct} t interval] | n |" + (f" minus {base} [{pct} t interval] | n |" if baseline else "")
    rule = "| --- | --- | --- |" + (" --- | --- |" if baseline else "")
    lines = ["", head, rule]
    for key, values in groups.items():
        interval = t_interval(values.values(), confidence)
        row = f"| {group_text(key)} | {_bounds(interval)} | {interval.n} |"
        if baseline:
            diff = diffs.get(key)
            if diff is None:
                row += " | |"
            else:
                text = _bounds(diff[0])
                row += f" {f'**{text}**' if diff[0].excludes_zero() else text} | {diff[0].n} |"
        lines.append(row)
    return lines


def _bounds(interval: Interval, digits: int = 3) -> str:
    if interval.low is None or interval.high is None:
        return f"{interval.mean:.{digits}f}"
    return f"{interval.mean:.{digits}f} [{interval.low:.{digits}f}, {interval.high:.{digits}f}]"
