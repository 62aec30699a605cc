"""Measured step times of ``copc sweep`` runs: the table in ``results/step_times.json`` and the
estimates ``--dry-run`` prints from it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

from copc.config import to_dict
from copc.experiments.results import write_record
from copc.run.config import RunConfig

STEP_TIMES = "step_times.json"


def timing_key(cfg: RunConfig) -> str:
    """What a step's cost depends on: task setting, rollout and eval sizes, method and driver."""
    size = json.dumps([cfg.task_options, to_dict(cfg.rollout), cfg.eval.prompts, cfg.eval.samples,
                       cfg.eval.greedy],
                      sort_keys=True, default=str)
    return f"{cfg.task}/{hashlib.sha256(size.encode()).hexdigest()[:8]}/{cfg.method}/{cfg.driver.kind}"


def evaluations(cfg: RunConfig, start: int = 0) -> int:
    """Held-out evaluations a run from ``start`` to ``cfg.steps`` performs (before, every, after)."""
    if cfg.eval.prompts == 0:
        return 0
    every = [d for d in range(cfg.eval.every, cfg.steps, cfg.eval.every)] if cfg.eval.every else []
    return (1 if start == 0 else 0) + sum(1 for d in every if d > start) + 1


def load_step_times(results: Path) -> dict[str, dict[str, object]]:
    try:
        return dict(json.loads((results / STEP_TIMES).read_text()))
    except (OSError, ValueError):
        return {}


def store_step_time(results: Path, key: str, entry: Mapping[str, object]) -> None:
    table = load_step_times(results)
    table[key] = dict(entry)
    write_record(results / STEP_TIMES, dict(sorted(table.items())))


def timing_from_record(record: Mapping[str, object], cfg: RunConfig) -> dict[str, object] | None:
    """Seconds per step (the mean: the estimate multiplies it by the steps) and per evaluation (the rest of
    the wall time, startup included)."""
    times, wall = record.get("step_seconds"), record.get("wall_seconds")
    step = times.get("mean") if isinstance(times, dict) else None
    if step is None or not isinstance(wall, (int, float)):
        return None
    n_evals = max(1, evaluations(cfg))
    rest = max(0.0, float(wall) - float(step) * cfg.steps)
    return {"step_seconds": float(step), "eval_seconds": rest / n_evals, "source": f"record {record['cell']}",
            "steps": record["steps"], **episodes(cfg)}


def episodes(cfg: RunConfig) -> dict[str, int]:
    """Episodes of one training batch and of one evaluation (sampled and greedy): what the costs scale
    with."""
    per_prompt = cfg.eval.samples + (1 if cfg.eval.greedy else 0)
    return {"batch_episodes": cfg.rollout.prompts_per_batch * cfg.rollout.group_size,
            "eval_episodes": cfg.eval.prompts * per_prompt}


def estimate_seconds(cfg: RunConfig, table: Mapping[str, Mapping[str, object]], start: int = 0
                     ) -> tuple[float | None, str]:
    """``(seconds, where the figures come from)`` for the steps ``start .. cfg.steps`` of ``cfg``.

    A kind never measured borrows the figures of the same task and method, else of the same task, scaled
    by the episodes per batch and per evaluation (:func:`episodes`) when the entry records them.
    """
    key = timing_key(cfg)
    task, _, method, _ = key.split("/")
    entry, note = table.get(key), "measured"
    if entry is None:
        near = [k for k in table if k.split("/")[0] == task and k.split("/")[2] == method]
        near = near or [k for k in table if k.split("/")[0] == task]
        if not near:
            return None, "no measurement for this task"
        entry, note = table[near[0]], f"borrowed from {near[0]}"
    step, per_eval = float(entry["step_seconds"]), float(entry["eval_seconds"])  # type: ignore[arg-type]
    mine = episodes(cfg)
    if note != "measured" and entry.get("batch_episodes") and entry.get("eval_episodes"):
        step *= mine["batch_episodes"] / float(entry["batch_episodes"])  # type: ignore[arg-type]
        per_eval *= mine["eval_episodes"] / float(entry["eval_episodes"])  # type: ignore[arg-type]
        note += ", scaled by episodes"
    return (cfg.steps - start) * step + evaluations(cfg, start) * per_eval, note


# ------------------------------------------------------------------------------------------ capacity
