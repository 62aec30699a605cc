"""The tables over a sweep's records: groups, paired differences with their Student-t intervals, the
report text (plain or Markdown) and E4's collapse count (the records themselves: copc.experiments.results).

Seeds are paired: a cell's seed is compared with the baseline's same seed (same prompts, same warm
start); records of one seed that start from different policies (their step-0 evaluations differ) are
left out of every pair, and the report says so.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

from copc.experiments.results import curve_mean, recorded_config
from copc.experiments.stats import Interval, t_interval

__all__ = ["by_group", "collapse_step", "collapse_text", "group_key", "group_text", "paired_differences",
           "report_text", "same_start", "start_config", "start_key", "start_keys", "start_mismatches"]


#: Evaluations are fractions of a few hundred prompts; differences within this are rounding, not a gap.
_EPS = 1e-9


def record_evals(record: Mapping[str, object]) -> list[Mapping[str, Any]]:
    """The record's evaluations (``record["evals"]``: one mapping per evaluation, ``step`` and each
    metric)."""
    evals = record.get("evals")
    return [e for e in evals if isinstance(e, Mapping)] if isinstance(evals, list) else []


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
    points = [(int(e["step"]), float(e[metric])) for e in record_evals(record) if metric in e]
    best, start, length = float("-inf"), None, 0
    for step, value in points:
        if best - value > margin + _EPS:  # "more than margin below": a gap equal to it up to rounding is not
            start, length = (step, 1) if length == 0 else (start, length + 1)
            if length >= patience:
                return start
        else:
            length = 0
        best = max(best, value)
    return None


def collapse_text(records: Sequence[Mapping[str, object]], metric: str = "greedy_accuracy", *,
                  margin: float = 0.1,
                  patience: int = 3) -> str:
    """E4's count: per group, how many of its runs collapse (:func:`collapse_step`) and where."""
    groups: dict[tuple[tuple[str, str], ...], list[tuple[int, int | None]]] = {}
    for record in records:
        step = collapse_step(record, metric, margin=margin, patience=patience)
        seed = int(record["seed"])  # type: ignore[call-overload]
        groups.setdefault(group_key(record), []).append((seed, step))
    lines = [f"collapses ({patience} consecutive evaluations more than {margin:g} below the run's best "
             f"{metric}):"]
    width = max((len(group_text(k)) for k in groups), default=0)
    for key, runs in groups.items():
        hits = sorted((seed, step) for seed, step in runs if step is not None)
        where = f"  ({', '.join(f'seed {seed} at step {step}' for seed, step in hits)})" if hits else ""
        lines.append(f"  {group_text(key):<{width}}  {len(hits)} of {len(runs)}{where}")
    return "\n".join(lines)


def group_key(record: Mapping[str, object]) -> tuple[tuple[str, str], ...]:
    """The record's axis levels as ``((axis, level), ...)``: its group, seeds aside."""
    levels = record["levels"]
    assert isinstance(levels, dict)
    return tuple((str(k), str(v)) for k, v in levels.items())


def group_text(key: tuple[tuple[str, str], ...]) -> str:
    return " ".join(f"{axis}={level}" for axis, level in key) or "(one cell)"


def _metric(record: Mapping[str, object], metric: str) -> float | None:
    if metric.startswith("mean:"):  # the run's mean over steps of one diagnostic curve
        return curve_mean(record, metric[5:])
    summary = record.get("summary")
    value = summary.get(metric) if isinstance(summary, dict) else None
    return float(value) if value is not None else None


def by_group(records: Sequence[Mapping[str, object]],
             metric: str) -> dict[tuple[tuple[str, str], ...], dict[int, float]]:
    """``{levels: {seed: value}}`` for the records that have ``metric``."""
    groups: dict[tuple[tuple[str, str], ...], dict[int, float]] = {}
    for record in records:
        value = _metric(record, metric)
        if value is not None:
            seed = int(record["seed"])  # type: ignore[call-overload]
            groups.setdefault(group_key(record), {})[seed] = value
    return groups


def paired_differences(
    records: Sequence[Mapping[str, object]], metric: str, baseline: Mapping[str, str],
    confidence: float = 0.95
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
    return round(float(first.get("accuracy", math.nan)), 6), round(float(first.get("greedy_accuracy",
                                                                                   math.nan)), 6)


# What a run's step-0 evaluation is a function of: the warm start (task, its options, the policy's model
# settings) and the evaluation (its size, the rollout's generation settings; the seed is keyed apart).
# What only trains (method, learning rates, lag, batch shape, the critic, the evaluation schedule) is not.
_START_SECTIONS = ("task", "task_options", "model", "eval")
_NOT_START = {"model": ("critic",), "eval": ("every",)}
_START_ROLLOUT = ("temperature", "top_p", "top_k", "max_turns", "max_new_tokens_per_turn", "max_total_tokens",
                  "context_limit", "chat_template", "dtype")


def start_config(record: Mapping[str, object]) -> str:
    """The part of the record's config its step-0 evaluation depends on, as canonical JSON, read in
    today's form (a key a record predates takes its default, copc.experiments.results.recorded_config):
    records whose start configs differ start apart by design (an axis over the warm start's model or the
    task's options) and are never expected to agree at step 0."""
    return _start_config(json.dumps(record.get("config", {}) or {}, sort_keys=True, default=str))


@functools.lru_cache(maxsize=4096)
def _start_config(raw: str) -> str:
    """:func:`start_config` of one config (canonical JSON): a report asks for each record's many times
    (every metric's pairs, every contrast), and reading a config in today's form builds a RunConfig."""
    loaded = json.loads(raw)
    config = cast(Mapping[str, object], recorded_config({"config": loaded}) or loaded)
    part: dict[str, object] = {}
    for section in _START_SECTIONS:
        if section in config:
            value = config[section]
            drop = _NOT_START.get(section, ())
            part[section] = {k: v for k,
                             v in value.items() if k not in drop} if isinstance(value, Mapping) else value
    rollout = cast(Mapping[str, object], config.get("rollout", {}) or {})
    part["rollout"] = {k: rollout[k] for k in _START_ROLLOUT if k in rollout}
    return json.dumps(part, sort_keys=True, default=str)


StartKeys = dict[tuple[tuple[tuple[str, str], ...], int], tuple[str, tuple[float, float] | None]]


def start_keys(records: Sequence[Mapping[str, object]]) -> StartKeys:
    """``{(group, seed): (start_config, start_key)}`` of the records."""
    return {(group_key(r), int(cast(int, r["seed"]))): (start_config(r), start_key(r)) for r in records}


def same_start(starts: StartKeys, groups: Sequence[tuple[tuple[str, str], ...]], seed: int) -> bool:
    """Whether the records of ``groups`` at ``seed`` may be paired: no two of them that share a start config
    have different step-0 evaluations (records that start apart by design stay paired)."""
    known: dict[str, set[tuple[float, float]]] = {}
    for g in groups:
        config, key = starts.get((g, seed), ("", None))
        if key is not None:
            known.setdefault(config, set()).add(key)
    return all(len(keys) <= 1 for keys in known.values())


def start_mismatches(records: Sequence[Mapping[str, object]]) -> list[str]:
    """One line per start config (:func:`start_config`) and seed whose records start from different
    policies: their step-0 evaluations (made before any update, so a function of the warm start and the
    evaluation alone) differ. Such records are not paired, whatever their seed says: the warm start was
    built anew on another machine (pin it, ``copc.run.warmstart``). Records of different start configs
    (other tasks, another warm start's model) start apart by design and are never compared."""
    starts: dict[tuple[str, int], dict[tuple[float, float], list[str]]] = {}
    tasks: dict[str, str] = {}
    for record in records:
        key = start_key(record)
        if key is not None:
            config = start_config(record)
            tasks[config] = str(cast(Mapping[str, object], record.get("config", {}) or {}).get("task", ""))
            seed = int(cast(int, record["seed"]))
            starts.setdefault((config, seed), {}).setdefault(key, []).append(str(record["cell"]))
    return [f"{tasks[config] + ' ' if tasks[config] else ''}seed {seed}: "
            + "; ".join(f"step-0 accuracy {a:g} / greedy {g:g}: {', '.join(sorted(cells))}"
                        for (a, g), cells in sorted(by.items()))
            for (config, seed), by in sorted(starts.items(), key=lambda kv: (tasks[kv[0][0]], kv[0][1],
                                                                             kv[0][0]))
            if len(by) > 1]


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
             f"pair is left out of the paired differences and contrasts): {line}"
             for line in start_mismatches(records)]
    lines.append(f"{len(records)} records; mean [{pct} t interval over seeds] (n = seeds)")
    for metric in metrics:
        groups = by_group(records, metric)
        if not groups:  # said, not skipped: a metric asked for by name that prints nothing reads as a typo
            lines.append(
                f"\n{metric}: no record holds it (a curve this method does not log, or a record from "
                         "before it was kept)")
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
    head = f"| {metric} | mean [{pct} t interval] | n |" + (
        f" minus {base} [{pct} t interval] | n |" if baseline else "")
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
