"""The results store of ``copc sweep``: one small JSON record per finished run (the tables:
copc.experiments.tables).

A record (``results/<experiment>/<cell-id>.json``, a few KB) keeps what a comparison needs once the run
directory is gone: the resolved config and its hash, the cell's levels and seed, every held-out
evaluation, the train-reward curve and the :data:`DIAGNOSTIC_CURVES` averaged into at most
:data:`CURVE_POINTS` bins, the summary figures,
step times, wall seconds, the machine, and the provenance (copc.run.provenance: ``commit`` and
``commit_dirty``, library ``versions``, ``method_resolved``, the preset's every field, and ``lag``, the lag
the configuration states beside the one measured). Records made before the provenance lack those keys;
every reader takes them as unknown. Records are written atomically (a temporary sibling, then
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

Across seeds, :func:`~copc.experiments.stats.t_interval` gives the mean with its Student-t interval, and
``paired_differences`` pairs each cell's seeds with the baseline's (same seed = same prompts and warm start)
and gives the mean difference with its interval (both in copc.experiments.tables). Both are exact for normal
data; with 3 seeds the intervals are wide, which is the honest width.
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

__all__ = [
    "CURVE_POINTS",
    "DIAGNOSTIC_CURVES",
    "RECORD_VERSION",
    "SUMMARY_METRICS",
    "build_record",
    "commit_alone",
    "config_hash",
    "curve_mean",
    "known_metric",
    "load_records",
    "machine_info",
    "metric_names",
    "read_record",
    "recorded_config",
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
    # the Monte-Carlo oracle's diagnostic, at its steps only (oracle.every)
    "oracle_gae_mse": m.ORACLE_GAE_MSE,
    "oracle_lag0_gae_mse": m.ORACLE_LAG0_GAE_MSE,
    "oracle_clipped_td_mse": m.ORACLE_CLIPPED_TD_MSE,
    "oracle_vtrace_mse": m.ORACLE_VTRACE_MSE,
    "oracle_gae_excess": m.ORACLE_GAE_EXCESS,
    "oracle_clipped_td_minus_gae": m.ORACLE_CLIPPED_TD_GAIN,
    "oracle_vtrace_minus_gae": m.ORACLE_VTRACE_GAIN,
    "oracle_critic_value_corr": m.ORACLE_CRITIC_VALUE_CORR,
    "oracle_noise_var": m.ORACLE_NOISE_VAR,
    "offpolicy_sum_abs_log_w": m.OFFPOLICY_SUM_ABS_LOG_W,
    "offpolicy_trace_clip_median": m.OFFPOLICY_TRACE_CLIP_MEDIAN,
    "offpolicy_trace_vtrace_median": m.OFFPOLICY_TRACE_VTRACE_MEDIAN,
    "offpolicy_adv_clip_frac": m.OFFPOLICY_ADV_CLIP_FRAC,
}
#: The per-run figures a report can tabulate (record["summary"] keys).
SUMMARY_METRICS = (
    "eval_last_half", "eval_final", "greedy_last_half", "greedy_final", "eval_after_start",
    "greedy_after_start",
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


def subsample_curve(steps: Sequence[int], values: Sequence[float],
                    points: int = CURVE_POINTS) -> list[list[float]]:
    """``[[last step of the bin, mean of the bin], ...]``: the curve cut into at most ``points`` equal
    bins."""
    if len(steps) != len(values):
        raise ValueError(f"subsample_curve: {len(steps)} steps but {len(values)} values")
    if not steps:
        return []
    bins = np.array_split(np.arange(len(steps)), min(points, len(steps)))
    return [[int(steps[b[-1]]), float(np.mean([values[i] for i in b]))] for b in bins]


def curve_mean(record: Mapping[str, object], name: str) -> float | None:
    """The run mean over steps of the diagnostic curve ``name``: every step weighs the same.

    Records keep it exactly (``curve_means``). An older record has only the binned curve, whose bins
    differ by one step (150 steps: 30 bins of 3, 30 of 2), so the plain mean of its bins would weigh the
    end of the run more; there each bin's count is recovered from the binning itself: the only point
    count ``n`` whose :func:`subsample_curve` bins of steps ``first .. first + n - 1`` (``first >= 0``)
    end at the recorded steps. ``None`` when the record lacks the curve, when no bin is finite, or when
    the counts cannot be recovered (a curve with gaps): never a mean with the wrong weights.
    """
    means = record.get("curve_means")
    if isinstance(means, Mapping) and name in means:
        value = means[name]
        return float(value) if value is not None and math.isfinite(float(value)) else None
    curves = record.get("curves")
    points = curves.get(name) if isinstance(curves, Mapping) else None
    if not points:
        return None
    counts = _bin_counts([int(step) for step, _ in points])
    if counts is None:
        return None
    pairs = [(float(v), c) for (_, v), c in zip(points, counts,
                                                strict=True) if v is not None and math.isfinite(float(v))]
    weight = sum(c for _, c in pairs)
    return sum(v * c for v, c in pairs) / weight if weight else None


def _bin_counts(last_steps: list[int], points: int = CURVE_POINTS) -> list[int] | None:
    """The number of steps in each bin of a curve binned by :func:`subsample_curve`, from the bins' last
    steps, assuming one point per step; ``None`` unless exactly one count fits."""
    bins, end = len(last_steps), last_steps[-1]
    fits: list[list[int]] = []
    for n in range(bins, end + 2):  # first step = end - n + 1 >= 0
        if min(points, n) != bins:
            continue
        sizes = [len(b) for b in np.array_split(np.arange(n), bins)]
        first = end - n + 1
        if list(first - 1 + np.cumsum(sizes)) == last_steps:
            fits.append(sizes)
    return fits[0] if len(fits) == 1 else None


def _median(values: Sequence[float]) -> float | None:
    return float(np.median(values)) if values else None


def _summary_figures(evals: list[dict[str, float]], rewards: list[float], steps: int, *, initial: bool
                     ) -> dict[str, float | None]:
    """``initial``: ``evals[0]`` is the evaluation before any update (its own row at step 0); every other
    evaluation is after the start, the one after the first update too (logged at step 0 with
    ``eval.every = 1``)."""
    def mean_of(rows: list[dict[str, float]], key: str) -> float | None:
        values = [r[key] for r in rows if key in r]
        return float(np.mean(values)) if values else None

    last_half = [e for e in evals if e["step"] >= steps / 2]
    after_start = evals[1:] if initial else evals
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
    # the evaluation before any update
    initial = bool(evals) and evals[0]["step"] == 0 and "alone" in evals[0]
    evals, kept_off, extended_from = _as_a_direct_run(evals, int(summary["steps"]), every)
    train = [r for r in rows if m.REWARD_MEAN in r]
    reward_steps = [int(r["step"]) for r in train]
    rewards = [float(r[m.REWARD_MEAN]) for r in train]
    step_times = [float(r[m.TIME_STEP]) for r in train if m.TIME_STEP in r]
    steps = int(summary["steps"])
    curves, curve_means = {}, {}
    for name, key in DIAGNOSTIC_CURVES.items():
        points = [(int(r["step"]), float(r[key])) for r in train if key in r]
        if points:
            curves[name] = subsample_curve([p[0] for p in points], [p[1] for p in points])
            finite = [v for _, v in points if math.isfinite(v)]
            curve_means[name] = float(np.mean(finite)) if finite else None
    return {
        "version": RECORD_VERSION,
        **_provenance(summary, config, train),
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
        "curve_means": curve_means,  # each curve's exact mean over its steps (read by curve_mean)
        "summary": _summary_figures(evals, rewards, steps, initial=initial),
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


def _provenance(summary: Mapping[str, object], config: Mapping[str, object], train: list[dict[str, float]]
                ) -> dict[str, object]:
    """The record's provenance (copc.run.provenance): the run's own, from its ``summary.json``; for a run
    whose summary predates it, this process's (``provenance_from`` says which), with ``method_resolved`` and
    ``lag`` from the config (None when today's config cannot read it). ``lag`` gains the lag the run
    measured: ``realized_mean`` (mean over steps) and ``realized_max``."""
    from copc.config import ConfigError, from_dict
    from copc.run.config import RunConfig
    from copc.run.provenance import PROVENANCE_KEYS, run_provenance

    if "commit" in summary:
        out: dict[str, object] = {k: summary.get(k) for k in PROVENANCE_KEYS}
        out["provenance_from"] = "run"
    else:
        try:
            out = dict(run_provenance(from_dict(RunConfig, dict(config))))
        except (ConfigError, TypeError, ValueError):
            from copc.run.provenance import code_commit, library_versions

            out = {**code_commit(), "versions": library_versions(), "method_resolved": None, "lag": None}
        out["provenance_from"] = "record writer"
    means = [r[m.STALENESS_MEAN] for r in train if m.STALENESS_MEAN in r and math.isfinite(
        r[m.STALENESS_MEAN])]
    maxima = [r[m.STALENESS_MAX] for r in train if m.STALENESS_MAX in r and math.isfinite(r[m.STALENESS_MAX])]
    if isinstance(out.get("lag"), Mapping):
        out["lag"] = {**cast(Mapping[str, object], out["lag"]),
                      "realized_mean": float(np.mean(means)) if means else None,
                      "realized_max": float(max(maxima)) if maxima else None}
    return out


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
        raise ValueError(
            f"{path}: not a readable sweep record ({err}); delete it to re-run the cell") from None
    if not isinstance(record, dict) or int(record.get("version", 0)) > RECORD_VERSION:
        raise ValueError(
            f"{path}: record version {record.get('version') if isinstance(record, dict) else '?'} "
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
        return subprocess.run(["git", *args], cwd=os.path.dirname(existing[0]), capture_output=True,
                              text=True,
                              timeout=60, check=True)

    try:
        git("add", "--", *existing)
        if not git("status", "--porcelain", "--", *existing).stdout.strip():
            return False
        git("commit", "-q", "-m", message, "--", *existing)
    except (OSError, subprocess.SubprocessError) as err:
        detail = (getattr(err, "stderr", "") or str(err)).strip()
        log(f"[sweep] warning: records not committed ({detail.splitlines()[-1] if detail else err}); they "
            "are on disk: the next record's commit takes them, or commit them by hand")
        return False
    log(f"[sweep] committed: {message}")
    return True


def known_metric(metric: str) -> bool:
    """A summary figure (:data:`SUMMARY_METRICS`) or ``mean:<curve>`` of a :data:`DIAGNOSTIC_CURVES` name."""
    return metric in SUMMARY_METRICS or (metric.startswith("mean:") and metric[5:] in DIAGNOSTIC_CURVES)


def metric_names() -> str:
    """The valid report metrics, for error messages."""
    return f"{', '.join(SUMMARY_METRICS)}, or mean:<curve> with <curve> one of {', '.join(DIAGNOSTIC_CURVES)}"


def recorded_config(record: Mapping[str, object]) -> dict[str, object] | None:
    """The record's config in today's form: keys added to the config since the record was made take
    their defaults (a field added later, at its default, does not change what the run computed); None
    when today's config cannot read it (a key removed or renamed since)."""
    # the run config pulls in torch: imported only when a record is read this way
    from copc.config import ConfigError, from_dict, to_dict
    from copc.run.config import RunConfig

    config = record.get("config")
    if not isinstance(config, dict):
        return None
    try:
        return to_dict(from_dict(RunConfig, config))  # type: ignore[return-value]
    except (ConfigError, TypeError, ValueError):
        return None
