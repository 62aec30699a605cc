"""``copc testbed``: plateau detection, the paired sync-vs-lagged comparison, commands and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from copc import tracking as m
from copc.experiments.testbed import (
    analyse,
    arms_for,
    plateau_step,
    run_dir_for,
    run_overrides,
    run_state,
    train_command,
)
from copc.experiments.testbed import testbed_cli as cli
from copc.run.tracker import Tracker


def test_plateau_step_golden():
    steps = np.arange(10)
    # final level = mean of the last 2 values (tail 0.2 of 10) = 1.0; 90% of the rise from 0 is 0.9
    assert plateau_step(steps, np.array([0.0, 0.5, 0.8, 0.95, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])) == 3
    # a curve still rising at the end: final level (8/9 + 1) / 2 = 0.944, threshold 0.85 -> step 8
    assert plateau_step(steps, np.linspace(0.0, 1.0, 10)) == 8
    # a spike does not set the level: final 0.5, threshold 0.45 is first reached at step 2
    assert plateau_step(steps, np.array([0.0, 0.3, 0.46, 2.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])) == 2
    # no rise to the final level: the first step
    assert plateau_step(steps, np.array([0.5, 0.9, 0.3, 0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1])) == 0
    # fraction and tail: final = mean of the last 5 = 0.7, rise 0.5 from 0.2, threshold 0.45 -> step 3
    values = np.array([0.2, 0.3, 0.4, 0.5, 0.6, 0.6, 0.7, 0.7, 0.8, 0.7])
    assert plateau_step(steps, values, fraction=0.5, tail=0.5) == 3
    with pytest.raises(ValueError):
        plateau_step(np.zeros(0), np.zeros(0))


def write_run(run_dir, accuracies: dict[int, float], rewards: list[float]) -> None:
    with Tracker(run_dir, tensorboard=False, strict=True) as tracker:
        for step, reward in enumerate(rewards):
            metrics = {m.REWARD_MEAN: reward, m.STALENESS_MEAN: 0.0}
            if step in accuracies:
                metrics[m.EVAL_ACCURACY] = accuracies[step]
                metrics[m.EVAL_GREEDY_ACCURACY] = accuracies[step] + 0.1
            tracker.log(step, metrics)


def test_analyse_pairs_seeds_and_excludes_the_shared_start(tmp_path):
    sync, lagged = arms_for(16)
    # seed 0: sync leads by 0.2 and 0.1 at steps 2 and 4; seed 1: lagged leads by 0.1 at both.
    write_run(run_dir_for(tmp_path, sync, 0), {0: 0.3, 2: 0.6, 4: 0.7}, [0.0, 0.2, 0.4, 0.6, 0.8])
    write_run(run_dir_for(tmp_path, lagged, 0), {0: 0.3, 2: 0.4, 4: 0.6}, [0.0, 0.1, 0.2, 0.3, 0.4])
    write_run(run_dir_for(tmp_path, sync, 1), {0: 0.2, 2: 0.4, 4: 0.5}, [0.0, 0.0, 0.0, 0.0, 0.0])
    write_run(run_dir_for(tmp_path, lagged, 1), {0: 0.2, 2: 0.5, 4: 0.6}, [0.1, 0.1, 0.1, 0.1, 0.1])
    report = analyse(tmp_path, (sync, lagged), [0, 1], reward_window=1)
    gap = report["gap_sync_minus"][lagged.name]
    assert gap["eval_steps"] == [2, 4]  # step 0 is the shared warm start, not a difference
    np.testing.assert_allclose(gap["eval_accuracy_gap_per_seed"], [0.15, -0.1], atol=1e-12)
    assert gap["eval_accuracy_gap"]["mean"] == pytest.approx(0.025)
    assert gap["eval_accuracy_gap"]["min"] == pytest.approx(-0.1)
    np.testing.assert_allclose(gap["train_reward_gap_per_seed"], [0.2, -0.1], atol=1e-12)
    assert gap["seeds_where_sync_leads"] == 1
    assert gap["eval_accuracy_gap_sampling_se_per_seed"] is None  # no config.yaml: episodes unknown
    arm = report["arms"][sync.name]
    assert arm["eval_steps"] == [0, 2, 4]
    assert arm["eval_accuracy"][1]["mean"] == pytest.approx(0.5)
    # seed-mean sync reward [0, .1, .2, .3, .4]: 90% of the rise is reached at step 4
    assert arm["plateau_step"] == 4 and arm["plateau_step_per_seed"] == [4, 0]


def test_train_command_always_resumes(tmp_path):
    sync, lagged = arms_for(8)
    run_dir = run_dir_for(tmp_path, lagged, 2)
    command = train_command(lagged, 2, run_dir, steps=30, eval_every=10, extra=["trainer.actor_lr=1e-4"])
    assert command[2:5] == ["copc.cli", "train", "--no-progress"]
    for item in ("staleness.mode=fixed_lag", "staleness.staleness=8", "method=async_ppo", "seed=2",
                 "steps=30", "trainer.actor_lr=1e-4", "resume=true", "task_options.hard=true"):
        assert item in command  # resume=true: continues a checkpoint, or starts at step 0 without one
    assert "method=ppo" in train_command(sync, 0, run_dir, steps=30, eval_every=10, extra=[])


def test_a_run_directory_is_reused_only_by_the_config_that_made_it(tmp_path, capsys):
    """Finished runs used to be skipped whatever config made them (a 400-step lr 3e-4 run counted as the
    300-step lr 1e-4 run asked for) and testbed.json named the new command."""
    from copc.config import dump_yaml
    from copc.run.config import load_run_config

    sync, _ = arms_for(8)
    run_dir = run_dir_for(tmp_path, sync, 0)
    overrides = run_overrides(sync, 0, run_dir, steps=30, eval_every=10, extra=["trainer.actor_lr=1e-4"])
    assert run_state(overrides, run_dir) == "fresh"
    run_dir.mkdir(parents=True)
    dump_yaml(load_run_config(None, overrides), run_dir / "config.yaml")
    (run_dir / "summary.json").write_text(json.dumps({"steps": 30}))
    (run_dir / "checkpoints" / "step_00000030").mkdir(parents=True)  # a finished run's last checkpoint
    assert run_state(overrides, run_dir) == "finished"
    other = run_overrides(sync, 0, run_dir, steps=30, eval_every=10, extra=["trainer.actor_lr=3e-4"])
    with pytest.raises(ValueError,
                       match=f"{run_dir} holds a run of another config; move it away .* or give --runs"):
        run_state(other, run_dir)
    longer = run_overrides(sync, 0, run_dir, steps=40, eval_every=10, extra=["trainer.actor_lr=1e-4"])
    assert run_state(longer, run_dir) == "resume"  # extended from its checkpoint
    assert cli(["--steps", "20", "--eval-every", "10", "--runs", str(tmp_path), "--out", str(tmp_path / "o"),
                "--staleness", "8", "--seeds", "1", "trainer.actor_lr=1e-4"]) == 2  # steps 20 < the run's 30
    assert "holds a run of another config" in capsys.readouterr().err


def test_cli_rejects_bad_input_in_one_line(tmp_path, capsys):
    assert cli(["--staleness", "0", "--runs", str(tmp_path)]) == 2
    assert "--staleness must be >= 1" in capsys.readouterr().err
    assert cli(["--seeds", "0"]) == 2
    assert cli(["steps"]) == 2
    assert "key=value" in capsys.readouterr().err
    assert cli(["--analyse-only", "--runs", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2
    assert "no metrics in" in capsys.readouterr().err


def test_analyse_only_writes_figures_and_report(tmp_path, capsys):
    sync, lagged = arms_for(16)
    for seed in range(2):
        write_run(run_dir_for(tmp_path, sync, seed), {0: 0.3, 2: 0.6}, [0.1 * i for i in range(3)])
        (run_dir_for(tmp_path, sync, seed) / "config.yaml").write_text("eval:\n  prompts: 50\n  samples: 2\n")
        write_run(run_dir_for(tmp_path, lagged, seed), {0: 0.3, 2: 0.5}, [0.05 * i for i in range(3)])
    out = tmp_path / "figs"
    (run_dir_for(tmp_path, sync, 0) / "summary.json").write_text(json.dumps({"steps": 2}))
    assert cli(["--analyse-only", "--seeds", "2", "--runs", str(tmp_path), "--out", str(out)]) == 0
    # the runs were made elsewhere: what each trained is said, and that it is not the --steps given
    assert "warning: --steps 300, but the runs analysed are 2 steps, unfinished runs" in capsys.readouterr(
        ).err
    assert (out / "testbed_curves.png").stat().st_size > 0 and (out / "testbed_staleness.png").is_file()
    report = json.loads((out / "testbed.json").read_text())
    assert report["trained_steps"][str(run_dir_for(tmp_path, sync,
                                                   0))] == 2 and report["command"]["analyse_only"]
    gap = report["gap_sync_minus"][lagged.name]
    assert gap["eval_accuracy_gap"]["mean"] == pytest.approx(0.1)
    # 100 episodes per evaluation: s.e. of one gap at step 2 = sqrt(.6 * .4 / 100 + .5 * .5 / 100)
    np.testing.assert_allclose(gap["eval_accuracy_gap_sampling_se_per_seed"], [np.sqrt(0.49 / 100)] * 2)
