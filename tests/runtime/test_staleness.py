"""Staleness policies: the admission formula, fixed-lag schedule and realized staleness statistics."""

from __future__ import annotations

import random

import pytest
import torch

from copc.config import ConfigError, from_dict
from copc.runtime.staleness import (
    StalenessConfig,
    admits_request,
    eligible,
    expired,
    fixed_lag_quota,
    realized_staleness,
    request_capacity,
    source_version,
)
from copc.types import StopReason, Trajectory


def make_traj(versions: list[int], prompt_len: int = 2, prompt_id: str = "p") -> Trajectory:
    """A trajectory with ``prompt_len`` prompt tokens then one token per entry of ``versions``
    (-1 = inserted tool output, not sampled)."""
    version_L = torch.tensor([-1] * prompt_len + versions, dtype=torch.int64)
    length = version_L.numel()
    return Trajectory(
        prompt_id=prompt_id,
        token_ids=torch.arange(length, dtype=torch.int64),
        prompt_len=prompt_len,
        action_mask=version_L >= 0,
        logp_behav=torch.zeros(length),
        policy_version=version_L,
        reward=0.0,
        token_rewards=torch.zeros(length),
        stop_reason=StopReason.ANSWER,
    )


def test_admission_golden():
    # B=4, s=2, version 0: requests 0..11 fall in batches 0..2 <= 0+2 -> admitted; request 12 is batch 3.
    for n_r in range(12):
        assert admits_request(version=0, batch_size=4, num_requested=n_r, staleness=2)
    assert not admits_request(version=0, batch_size=4, num_requested=12, staleness=2)
    # after one update (version 1) batch 3 opens: requests 12..15
    assert admits_request(version=1, batch_size=4, num_requested=15, staleness=2)
    assert not admits_request(version=1, batch_size=4, num_requested=16, staleness=2)
    # capacity = B(i+s+1) - N_r = 4*3 - 5 = 7
    assert request_capacity(version=0, batch_size=4, num_requested=5, staleness=2) == 7
    assert request_capacity(version=0, batch_size=4, num_requested=12, staleness=2) == 0
    # s = 0 is synchronous: exactly one batch per version
    assert request_capacity(version=3, batch_size=4, num_requested=12, staleness=0) == 4
    assert request_capacity(version=3, batch_size=4, num_requested=16, staleness=0) == 0


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="batch_size"):
        admits_request(version=0, batch_size=0, num_requested=0, staleness=0)
    with pytest.raises(ValueError):
        source_version(-1, 2)


@pytest.mark.parametrize(("batch_size", "staleness"), [(1, 0), (3, 0), (4, 2), (2, 5)])
def test_bounded_pacing_keeps_lag_within_bound_and_reaches_it(batch_size, staleness):
    """Simulate a producer that requests all it may and finishes in order, and a trainer that consumes
    the B oldest per step: every consumed trajectory has lag <= s, and the bound is attained."""
    rng = random.Random(0)
    queue: list[int] = []  # versions of finished trajectories, oldest first
    n_r, lags = 0, []
    for version in range(30):
        # the producer may run ahead several times between trainer steps
        for _ in range(rng.randint(1, 3)):
            room = request_capacity(
                version=version, batch_size=batch_size, num_requested=n_r, staleness=staleness
            )
            queue.extend([version] * room)
            n_r += room
        batch, queue = queue[:batch_size], queue[batch_size:]
        assert len(batch) == batch_size  # never starves: s+1 batches are admitted ahead
        lags += [version - v for v in batch]
    assert max(lags) == staleness
    assert min(lags) >= 0


def test_fixed_lag_schedule_golden():
    # s = 3: steps 0..3 read the warm start, then step n reads version n - 3.
    assert [source_version(n, 3) for n in range(7)] == [0, 0, 0, 0, 1, 2, 3]
    assert [source_version(n, 0) for n in range(3)] == [0, 1, 2]
    assert fixed_lag_quota(0, 3, 5) == 20 and fixed_lag_quota(4, 3, 5) == 5
    assert eligible("fixed_lag", step=5, staleness=3, min_version=2)
    assert not eligible("fixed_lag", step=5, staleness=3, min_version=3)
    assert expired("fixed_lag", step=5, staleness=3, min_version=1)
    assert not expired("bounded", step=50, staleness=3, min_version=0)
    assert eligible("bounded", step=50, staleness=3, min_version=0)


@pytest.mark.parametrize(("batch_size", "staleness"), [(2, 0), (3, 4)])
def test_fixed_lag_quota_matches_admission_and_schedule(batch_size, staleness):
    """Cumulative quota of versions 0..v equals what admission control admits at version v, and the
    number of steps reading version v equals its quota in batches."""
    total = 0
    for version in range(10):
        total += fixed_lag_quota(version, staleness, batch_size)
        assert total == batch_size * (version + staleness + 1)
        assert (
            request_capacity(
                version=version, batch_size=batch_size, num_requested=total - 1, staleness=staleness
            )
            == 1
        )
        steps = [n for n in range(40) if source_version(n, staleness) == version]
        assert len(steps) * batch_size == fixed_lag_quota(version, staleness, batch_size)


def test_realized_staleness_golden():
    # consumed at n = 5:
    #   A: sampled versions 3, 3, 4 (one tool token between) -> token lags 2, 2, 1;
    #      s_max = 5-3 = 2, s_gen = 4-3 = 1, s_wait = 5-4 = 1
    #   B: sampled versions 5, 5 -> lags 0, 0; s_max = s_gen = s_wait = 0
    #   C: nothing sampled -> ignored
    batch = [make_traj([3, 3, -1, 4]), make_traj([5, 5]), make_traj([-1])]
    stats = realized_staleness(batch, version=5)
    assert stats.num_tokens == 5
    assert stats.token_mean == pytest.approx(5 / 5)  # (2+2+1+0+0)/5, exact in binary
    assert stats.token_max == 2
    assert (stats.s_max_mean, stats.s_max_max) == (1.0, 2)
    assert (stats.s_gen_mean, stats.s_gen_max) == (0.5, 1)
    assert (stats.s_wait_mean, stats.s_wait_max) == (0.5, 1)
    assert stats.histogram == (2, 1, 2)
    assert sorted(stats.token_values().tolist()) == [0, 0, 1, 2, 2]


def test_realized_staleness_against_loop():
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        n = 30
        batch = []
        for _ in range(int(torch.randint(1, 6, (1,), generator=gen))):
            length = int(torch.randint(1, 12, (1,), generator=gen))
            versions = torch.randint(-1, n + 1, (length,), generator=gen).tolist()
            batch.append(make_traj(versions))
        lags = [n - v for t in batch for v in t.policy_version.tolist() if v >= 0]
        per_traj = [[v for v in t.policy_version.tolist() if v >= 0] for t in batch]
        per_traj = [vs for vs in per_traj if vs]
        stats = realized_staleness(batch, version=n)
        if not lags:
            assert stats.num_tokens == 0
            continue
        assert stats.token_mean == pytest.approx(sum(lags) / len(lags), rel=1e-12), trial
        assert stats.token_max == max(lags)
        assert stats.s_max_max == max(n - min(vs) for vs in per_traj)
        assert stats.s_gen_mean == pytest.approx(sum(max(vs) - min(vs) for vs in per_traj) / len(per_traj))
        assert stats.s_wait_mean == pytest.approx(sum(n - max(vs) for vs in per_traj) / len(per_traj))
        assert list(stats.histogram) == [lags.count(k) for k in range(max(lags) + 1)]


def test_realized_staleness_rejects_future_versions():
    with pytest.raises(ValueError, match="newer than the consuming"):
        realized_staleness([make_traj([4])], version=3)


def test_config_validates():
    assert from_dict(StalenessConfig, {"mode": "fixed_lag", "staleness": 16}).staleness == 16
    with pytest.raises(ConfigError, match="'fixed_lag', 'bounded'"):
        from_dict(StalenessConfig, {"mode": "lagged"})
    with pytest.raises(ConfigError, match="0 = synchronous"):
        from_dict(StalenessConfig, {"staleness": -2})


def test_rollout_metrics_count_episodes_the_environment_or_the_grader_failed():
    """A training batch says how many of its episodes ended because the environment raised and how many
    the grader could not decide: both get reward 0, which the policy's reward curve would otherwise hide
    (review 14: only the evaluation counted environment errors, nothing counted grader failures)."""
    from dataclasses import replace

    from copc.rollout.generator import GeneratedBatch
    from copc.runtime.loop import rollout_metrics

    base = make_traj([0, 0])
    trajs = [replace(base, info={"env_errors": 1.0}), replace(base, info={"grade_failures": 1.0}),
             replace(base, info={"grade_failures": 0.0}), replace(base, info={})]
    out = rollout_metrics(GeneratedBatch(index=0, version=0, trajectories=trajs, generate_s=0.0), version=1)
    assert out["rollout/env_error_frac"] == 0.25 and out["rollout/grade_failure_frac"] == 0.25
