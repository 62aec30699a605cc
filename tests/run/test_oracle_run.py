"""The oracle inside a run: the mc_oracle arm trains on oracle advantages; the diagnostic is logged."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from copc.channels import AdvantageChannelConfig, compute_advantages, get_method
from copc.experiments.results import build_record
from copc.run.oracle import OracleConfig, compared_estimators, contrasts_of, offpolicy_stats
from copc.run.train import train_cli

TINY = [
    "task=kv_chain", "model.policy=tiny", "steps=2", "checkpoint_every=0", "rollout.prompts_per_batch=2",
    "rollout.group_size=2", "rollout.max_turns=3", "rollout.max_new_tokens_per_turn=6",
    "rollout.max_total_tokens=18",
    "eval.prompts=0", "driver.kind=sync", "trainer.critic_warmup_steps=0", "plots=false", "oracle.samples=2",
    "rollout.temperature=3.0",  # the random tiny model then ends turns at its stop strings often enough
]


def _rows(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_oracle_arm_trains_on_oracle_advantages(tmp_path: Path) -> None:
    run_dir = tmp_path / "oracle"
    assert train_cli(["--no-progress", f"run_dir={run_dir}", *TINY, "method=async_ppo_oracle"]) == 0
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["oracle/failed_frac"] == 0.0 and r["oracle/seconds"] > 0 for r in rows)
    assert all("loss/value" not in r for r in rows)  # no critic


def test_the_diagnostic_compares_each_estimator_with_the_oracle(tmp_path: Path) -> None:
    run_dir = tmp_path / "diag"
    assert train_cli(["--no-progress", f"run_dir={run_dir}", *TINY, "method=async_ppo", "oracle.every=1",
                      "oracle.trajectories=2", "staleness.mode=fixed_lag", "staleness.staleness=1"]) == 0
    rows = _rows(run_dir)
    for r in rows:
        for name in ("gae", "clipped_td", "vtrace", "lag0_gae"):
            assert f"oracle/{name}_mse" in r and r[f"oracle/{name}_mse"] >= 0
        assert r["offpolicy/trace_clip_median"] > 0
        # the hypotheses' differences, at the same step and on the same trajectories
        assert r["oracle/gae_excess_mse"] == r["oracle/gae_mse"] - r["oracle/lag0_gae_mse"]
        assert r["oracle/clipped_td_minus_gae_mse"] == r["oracle/clipped_td_mse"] - r["oracle/gae_mse"]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    record = build_record(run_dir, experiment="x", cell_id="c", levels={}, config=config)
    means = record["curve_means"]
    assert means["oracle_gae_excess"] == pytest.approx(sum(r["oracle/gae_excess_mse"] for r in rows) / 2)
    assert set(record["curves"]) >= {"oracle_gae_mse", "oracle_lag0_gae_mse", "offpolicy_sum_abs_log_w"}


def test_contrasts_of_a_diagnostic_step() -> None:
    out = {"oracle/gae_mse": 0.25, "oracle/lag0_gae_mse": 0.125, "oracle/clipped_td_mse": 0.5,
           "oracle/vtrace_mse": 0.0625}
    assert contrasts_of(out) == {"oracle/gae_excess_mse": 0.125, "oracle/clipped_td_minus_gae_mse": 0.25,
                                 "oracle/vtrace_minus_gae_mse": -0.1875}
    assert contrasts_of({"oracle/gae_mse": 0.25}) == {}  # no lag-0 side measured: no difference


def test_mc_oracle_estimator_passes_the_oracle_through_and_needs_it() -> None:
    cfg = get_method("async_ppo_oracle").advantage
    assert cfg.needs_oracle and not cfg.needs_critic
    mask = torch.tensor([[False, True, True, False]])
    oracle = torch.tensor([[5.0, 0.5, -0.25, 9.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    raw = compute_advantages(AdvantageChannelConfig(estimator="mc_oracle", whiten=False), rewards=rewards,
                             values=None, log_w=None, action_mask=mask, oracle=oracle)
    assert torch.equal(raw.advantages, torch.tensor([[0.0, 0.5, -0.25, 0.0]]))
    assert torch.equal(raw.returns, torch.tensor([[0.0, 1.0, 1.0, 0.0]]))  # the Monte-Carlo reward-to-go
    with pytest.raises(ValueError, match="needs the oracle's advantages"):
        compute_advantages(cfg, rewards=rewards, values=None, log_w=None, action_mask=mask)


def test_offpolicy_stats_golden() -> None:
    mask = torch.tensor([[True, True, False], [True, False, False]])
    log_w = torch.log(torch.tensor([[1.5, 0.5, 9.0], [1.1, 1.0, 1.0]]))
    out = offpolicy_stats(log_w, mask)
    # row 0: |log 1.5| + |log 0.5| = 1.0986; row 1: log 1.1 = 0.0953; median of two = the lower (torch)
    assert out["offpolicy/sum_abs_log_w"] == pytest.approx(0.0953, abs=1e-4)
    # clipped products: 1.2 * 0.8 = 0.96 and 1.1; V-trace: min(1, w): 0.5 and 1
    assert out["offpolicy/trace_clip_median"] == pytest.approx(0.96, abs=1e-5)
    assert out["offpolicy/trace_vtrace_median"] == pytest.approx(0.5, abs=1e-6)
    assert out["offpolicy/adv_clip_frac"] == pytest.approx(2 / 3)


def test_the_diagnostic_scores_each_estimator_at_the_runs_lambda() -> None:
    """A run at lambda 0.95 is scored on GAE at 0.95 (not the preset's 1.0); each estimator keeps its own
    preset's other settings (R1's ratio band, V-trace's traces)."""
    run = replace(get_method("async_ppo").advantage, lam_actor=0.95, lam_critic=0.9, gamma=0.99)
    got = compared_estimators(run)
    assert set(got) == {"gae", "clipped_td", "vtrace"}
    for name, preset in (("gae", "async_ppo"), ("clipped_td", "copc_behaviour"), ("vtrace", "vtrace")):
        want = replace(get_method(preset).advantage, whiten=False, lam_actor=0.95, lam_critic=0.9, gamma=0.99)
        assert got[name] == want
    assert got["clipped_td"].estimator == get_method("copc_behaviour").advantage.estimator != "gae"


def test_the_diagnostic_runs_from_its_first_step_on() -> None:
    assert [s for s in range(120) if OracleConfig(every=50).diagnoses(s)] == [0, 50, 100]
    assert [s for s in range(120) if OracleConfig(every=50, first=50).diagnoses(s)] == [50, 100]
    assert [s for s in range(120) if OracleConfig(every=0, first=50).diagnoses(s)] == []
    with pytest.raises(ValueError, match="first"):
        OracleConfig(every=50, first=-1)
