"""Partial rollouts and PACE in the async driver, end to end (tiny model, real arith_tool, worker processes).

- every consumed token's version is <= the step, versions never go back inside a trajectory, no trajectory
  is lost or duplicated (each batch holds its prompts' groups whole, minus what PACE counted as rejected);
- the new metrics are logged; resuming a partial-rollout PACE run from a checkpoint reaches the end;
- fixed_lag with partial rollouts, and PACE with the sync driver, are refused with one line.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from tests.runtime.test_drivers import small_config, step_metrics

from copc.run.config import DriverConfig, RunConfig
from copc.run.train import train
from copc.runtime.staleness import PaceConfig, StalenessConfig

NEW_METRICS = ("rollout/versions_per_traj", "rollout/versions_per_traj_max", "staleness/generation_mean",
               "staleness/generation_max", "staleness/waiting_mean", "staleness/waiting_max",
               "staleness/pace_rejected", "staleness/pace_reject_rate")


def _partial_pace(run_dir: Path, steps: int, **extra: object) -> RunConfig:
    cfg = small_config(run_dir, driver="async", mode="bounded", s=2, steps=steps, **extra)
    return replace(
        cfg,
        driver=DriverConfig(kind="async", num_workers=2, partial_rollouts=True, partial_chunk_tokens=2),
        staleness=StalenessConfig(mode="bounded", staleness=2, filter="pace", pace=PaceConfig(min_score=0.0)),
    )


def test_partial_rollouts_with_pace_train_resume_and_log(tmp_path: Path) -> None:
    cfg = _partial_pace(tmp_path / "run", steps=2, checkpoint_every=2)
    train(cfg, show_progress=False)
    train(replace(cfg, steps=4, resume=True), show_progress=False)
    rows = step_metrics(tmp_path / "run")
    assert len(rows) == 4
    batch = cfg.rollout.batch_size
    for row in rows:
        assert all(name in row for name in NEW_METRICS)
        assert row["staleness/max"] <= 2 + 1  # bounded s = 2 (+1: a batch finishing out of order)
        assert row["staleness/generation_max"] + row["staleness/waiting_max"] >= row["staleness/max"]
        assert 1 <= row["rollout/versions_per_traj"] <= row["rollout/versions_per_traj_max"] <= 3
        assert row["staleness/pace_reject_rate"] <= 0.5
    # Nothing lost or duplicated across the resume: every trajectory of the 4 batches was trained on or
    # rejected by PACE (and counted), none twice.
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    last = [json.loads(line) for line in lines if "loss/value" in line][-1]
    assert last["buffer/consumed"] + last["buffer/dropped_pace"] == 4 * batch
    assert last["staleness/pace_rejected"] == last["buffer/dropped_pace"]


def test_bad_combinations_are_refused_with_one_line(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, driver="async", mode="fixed_lag", s=1)
    with pytest.raises(ValueError, match=r"partial_rollouts=true needs staleness\.mode=bounded"):
        replace(cfg, driver=DriverConfig(kind="async", partial_rollouts=True))
    with pytest.raises(ValueError, match=r"needs driver\.kind=async"):
        DriverConfig(kind="sync", partial_rollouts=True)
    with pytest.raises(ValueError, match="sync driver has none"):
        replace(cfg, staleness=StalenessConfig(mode="bounded", filter="pace"),
                driver=DriverConfig(kind="sync"))
