"""Plots from metrics.jsonl: curve extraction, seed means with bands, PNG files."""

from __future__ import annotations

import numpy as np
import pytest

from copc import tracking as m
from copc.run.plots import FIGURES, curves_for, plot_run, plot_runs, seed_group, series, smooth
from copc.run.tracker import Tracker
from copc.tracking import read_metrics


def write_run(run_dir, scale: float, steps=range(5), eval_every: int = 2) -> None:
    with Tracker(run_dir, tensorboard=False, strict=True) as tracker:
        for step in steps:
            metrics = {
                m.REWARD_MEAN: scale * step,
                m.STALENESS_MEAN: 1.0,
                m.STALENESS_MAX: 2.0,
                m.POLICY_MASK_FRAC: 0.1,
                m.RATIO_CLIP_FRAC_LOW: 0.01,
                m.RATIO_CLIP_FRAC_HIGH: 0.02,
                m.CRITIC_EXPLAINED_VAR: 0.5,
            }
            if step % eval_every == 0:
                metrics[m.EVAL_ACCURACY] = 0.1 * scale
            tracker.log(step, metrics)


def test_series_last_record_of_a_step_wins():
    records = [{"step": 0, "a": 1.0}, {"step": 1, "b": 5.0}, {"step": 1, "a": 2.0}, {"step": 1, "a": 3.0}]
    steps, values = series(records, "a")
    assert steps.tolist() == [0, 1] and values.tolist() == [1.0, 3.0]


def test_seed_group_and_smooth():
    assert seed_group("/x/ppo_s16_seed0") == "ppo_s16" == seed_group("/y/ppo_s16-seed12")
    assert seed_group("/x/copc") == "copc"
    assert seed_group("runs/20261129-201500-copc-arith_tool-s8-seed1") == "copc-arith_tool-s8"
    # trailing mean of window 2: [1, (1+3)/2, (3+5)/2]
    assert smooth(np.array([1.0, 3.0, 5.0]), 2).tolist() == [1.0, 2.0, 4.0]


def test_seed_mean_and_band(tmp_path):
    dirs = [tmp_path / f"ppo_seed{i}" for i in range(3)]
    for i, d in enumerate(dirs):
        # seed 2 misses step 4: the mean uses steps every seed logged
        write_run(d, scale=i + 1.0, steps=range(4) if i == 2 else range(5))
    runs = {str(d): read_metrics(d) for d in dirs}
    (curve,) = curves_for(runs, m.REWARD_MEAN, mean_seeds=True)
    assert curve.label == "ppo (n=3)"
    assert curve.steps.tolist() == [0, 1, 2, 3]
    # rewards are scale * step with scales 1, 2, 3: mean 2*step, band [step, 3*step]
    assert curve.mean.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert curve.low is not None and curve.high is not None
    assert curve.low.tolist() == [0.0, 1.0, 2.0, 3.0] and curve.high.tolist() == [0.0, 3.0, 6.0, 9.0]
    separate = curves_for(runs, m.REWARD_MEAN, mean_seeds=False)
    assert [c.label for c in separate] == ["ppo_seed0", "ppo_seed1", "ppo_seed2"]
    assert all(c.low is None for c in separate)


def test_plot_files_for_one_run_and_overlay(tmp_path):
    run = tmp_path / "copc_seed0"
    write_run(run, 1.0)
    written = plot_run(run)
    assert sorted(p.name for p in written) == sorted(FIGURES)
    for path in written:
        assert path.parent == run / "plots" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 5_000  # a drawn figure, not an empty canvas
    other = tmp_path / "copc_seed1"
    write_run(other, 2.0)
    sparse = tmp_path / "sparse"
    with Tracker(sparse, tensorboard=False) as tracker:
        tracker.log(0, {m.REWARD_MEAN: 0.0})  # nothing else: panels say "no data"
    out = tmp_path / "overlay"
    written = plot_runs([run, other, sparse], out, mean_seeds=True, smooth_window=2)
    assert {p.parent for p in written} == {out} and len(written) == len(FIGURES)
    assert not list(out.glob(".*tmp*"))


def test_plot_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="copc run directory"):
        plot_runs([tmp_path])
    with pytest.raises(ValueError, match="out_dir"):
        plot_runs([tmp_path / "a", tmp_path / "b"])


def test_plot_cli_onto_a_file_is_one_line_and_keeps_the_file(tmp_path, capsys):
    from copc.cli import plot_cli

    run = tmp_path / "copc_seed0"
    write_run(run, 1.0)
    mine = tmp_path / "mine.png"
    mine.write_text("mine")
    assert plot_cli([str(run), "--out", str(mine)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out takes a folder" in err and mine.read_text() == "mine"
