"""``resume=true``: which checkpoint a run continues from, and the settings it must share with it.

A resumed run continues as it was configured (``run_dir/config.yaml`` is the base of the config); the
settings of :data:`RESUME_MUST_MATCH` change what a run computes and are refused in one line when an
override differs; the wall time of the earlier processes is carried on (docs/reliability.md).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from copc.config import ConfigError, parse_override, to_dict
from copc.run.config import RunConfig
from copc.runtime.loop import RunError
from copc.trainer.checkpoint import CheckpointError, list_checkpoints, load_latest

__all__ = ["NO_SPACE", "RESUME_MAY_CHANGE", "RESUME_MUST_MATCH", "DiskFullError", "check_resume_config",
           "config_file", "disk_full_message", "earlier_wall_seconds", "eval_change", "find_checkpoint"]


#: Settings a resumed run must share with the checkpoint it continues, since they change what the run
#: computes (anything else may change: steps, checkpointing, eval, plots, worker count, threads).
RESUME_MUST_MATCH = ("task", "task_options", "method", "method_overrides", "seed", "model", "rollout",
                     "trainer",
                     "staleness", "driver.kind", "driver.partial_rollouts", "driver.partial_chunk_tokens")


#: Settings inside RESUME_MUST_MATCH's sections that change how, not what, a run computes: they may change.
RESUME_MAY_CHANGE = ("trainer.gradient_checkpointing",)


def _first_difference(saved: object, current: object, prefix: str) -> tuple[str, object, object] | None:
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in sorted(set(saved) | set(current)):
            if f"{prefix}.{key}" in RESUME_MAY_CHANGE:
                continue
            found = _first_difference(saved.get(key), current.get(key), f"{prefix}.{key}")
            if found is not None:
                return found
        return None
    return None if saved == current else (prefix, saved, current)


def check_resume_config(cfg: RunConfig, saved: Mapping[str, object], where: Path, run_dir: Path) -> None:
    """Refuse (one line) to resume with another method, batch size, task ... than the checkpoint's, saying
    where the other value can have come from (the run's ``config.yaml`` is the base of a resumed config)."""
    current = to_dict(cfg)
    for dotted in RESUME_MUST_MATCH:
        a: object = saved
        b: object = current
        for part in dotted.split("."):
            a = a.get(part) if isinstance(a, dict) else None
            b = b.get(part) if isinstance(b, dict) else None
        found = _first_difference(a, b, dotted)
        if found is not None:
            key, old, new = found
            if (run_dir / "config.yaml").is_file():
                source = ("from an override, --config or an edit of its config.yaml; resume=true run_dir=... "
                          "alone continues the run as it was configured, or start a new run_dir")
            else:
                source = (f"because {run_dir / 'config.yaml'} is missing, this config was built from the "
                          "embedded default (or --config) and the overrides; restore config.yaml, give the "
                          "run's settings again, or start a new run_dir")
            raise ConfigError(
                f"resume: {where} was made with {key}={json.dumps(old)}, this config has {json.dumps(new)}, "
                f"which would change what the run computes: {source}"
            )


def eval_change(cfg: RunConfig, saved: Mapping[str, object]) -> str | None:
    """How the resumed run's ``eval`` settings differ from the checkpoint's (``eval.samples 1 -> 2``),
    None when they do not: evaluations may change on resume, but the run's earlier evaluations (the
    summary's "before") were made with the old ones, and the summary must say so."""
    old, new = saved.get("eval"), to_dict(cfg).get("eval")
    if not isinstance(old, dict) or not isinstance(new, dict):
        return None
    changed = [f"eval.{k} {json.dumps(old.get(k))} -> {json.dumps(new.get(k))}"
               for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    return ", ".join(changed) or None


def find_checkpoint(cfg: RunConfig, run_dir: Path) -> tuple[int, dict[str, object]] | None:
    """The checkpoint ``resume=true`` continues from, saying on stderr what it skipped and which step it
    resumes from; None = none yet.

    Raises :class:`CheckpointError` when checkpoints exist but none is usable (resuming from step 0
    would silently throw the run away), and :class:`ConfigError` when ``cfg.steps`` is below the
    checkpoint's step (the run would be relabelled as a shorter one: its evaluation and summary
    rewritten with weights trained longer than they say).
    """
    skipped: list[str] = []
    found = load_latest(run_dir, on_skip=skipped.append)
    for reason in skipped:
        print(f"warning: {reason}; falling back to an older checkpoint", file=sys.stderr, flush=True)
    if found is None and list_checkpoints(run_dir):
        raise CheckpointError(
            f"every checkpoint under {run_dir / 'checkpoints'} is damaged ({'; '.join(skipped)}); nothing to "
            "resume from: restore a backup, or start over with overwrite=true"
        )
    if found is None and (run_dir / "summary.json").exists():  # trained, then its checkpoints went
        raise CheckpointError(
            f"{run_dir} holds a trained run (summary.json) but no checkpoint to resume from; starting from "
            "step 0 would overwrite its metrics and summary: restore "
            "its checkpoints/, or start over with overwrite=true"
        )
    if found is None:
        print(f"note: {run_dir} has no checkpoint yet; starting from step 0", file=sys.stderr, flush=True)
        return None
    step, payload = found
    where = run_dir / "checkpoints" / f"step_{step:08d}"
    check_resume_config(cfg, payload.get("config", {}), where, run_dir)  # type: ignore[arg-type]
    if cfg.steps < step:
        raise ConfigError(f"resume: {run_dir} has already trained {step} steps (its checkpoint of step "
                          f"{step}); steps={cfg.steps} would go back: give steps "
                          f">= {step} to continue it, or start a new run_dir")
    older = " (an older checkpoint: the newer one is damaged, above)" if skipped else ""
    print(f"resuming {run_dir} from the checkpoint of step {step}{older}, to step {cfg.steps}",
          file=sys.stderr, flush=True)
    return found


def _finished_summary(run_dir: Path, step: int) -> dict[str, object] | None:
    """``summary.json`` of a process that finished at ``step`` (its final evaluation made), else None."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        return summary if int(summary["steps"]) == step else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def finished_at(run_dir: Path, step: int, payload: Mapping[str, object]) -> bool:
    """Whether an earlier process of the run finished at the checkpoint of ``step``, its final evaluation
    logged there: the checkpoint's own run ended there, or a later process resumed it with ``steps`` equal to
    it (nothing to train, so no new checkpoint) and finished. A run continued past it keeps that evaluation;
    a mid-run checkpoint's step is redone, its evaluation with it."""
    config = payload.get("config")
    ended = isinstance(config, Mapping) and config.get("steps") == step
    return ended or _finished_summary(run_dir, step) is not None


def earlier_wall_seconds(run_dir: Path, step: int, payload: Mapping[str, object]) -> float:
    """Wall seconds the run's earlier processes spent up to the checkpoint of ``step``: all of a process
    that finished at that step (its ``summary.json``: final evaluation and plots included), else the
    total the checkpoint recorded when it was written (the time a killed process spent after its last
    checkpoint is not known; those steps are redone and counted again)."""
    summary = _finished_summary(run_dir, step)
    try:
        if summary is not None:
            return float(summary["wall_seconds"])  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError):
        pass
    return float(payload.get("wall_seconds", 0.0))  # type: ignore[arg-type]


#: What copc's errors say of a full disk (``copc.runtime.journal.describe_os_error``, checkpoints, the CLI).
NO_SPACE = "no space left on device"


class DiskFullError(RunError):
    """The disk filled during a run; the message names the file and says what was kept."""


def disk_full_message(what: str, cfg: RunConfig, run_dir: Path, step: int) -> str:
    """One line: ``what`` failed (it names the file), what the run kept (its last checkpoint, or none) and how
    to continue. ``step`` is the last checkpointed step, -1 for none."""
    if step >= 0:
        kept = f"the checkpoint of step {step} is kept"
        then = f"free space, then continue with copc train resume=true run_dir={run_dir}"
    else:
        kept = "no checkpoint was written yet"
        then = f"free space, then start again (copc train resume=true run_dir={run_dir} starts at step 0)"
    if cfg.checkpoint_every == 0:  # the journal keeps every batch since the last checkpoint: the whole run
        then += "; checkpoint_every=N keeps the rollout journal (rollouts/) to N steps of batches"
    return f"{what}; {kept}; {then}"


def config_file(config: str | None, overrides: Sequence[str]) -> str | None:
    """The YAML file the config starts from: ``--config``, else with ``resume=true`` the run's own
    ``run_dir/config.yaml`` (a run continues as it was configured, the overrides applied on top), else
    None (the embedded default)."""
    if config is not None:
        return config
    given: dict[str, object] = {}
    for text in overrides:
        try:
            path, value = parse_override(text)
        except ConfigError:
            return None  # load_run_config says what is wrong with it
        if path in (["resume"], ["run_dir"]):
            given[path[0]] = value
    saved = Path(str(given.get("run_dir") or "")) / "config.yaml"
    return str(saved) if given.get("resume") is True and given.get("run_dir") and saved.is_file() else None
