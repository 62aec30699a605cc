"""PACE (staleness.filter=pace): effective-staleness score, occupancy budget, group rejection; golden values.

Hand-worked values are derived in the comments; docs/algorithms.md "PACE" has the formulas.
"""

from __future__ import annotations

import pytest
import torch

from copc.runtime.buffer import TrajectoryBuffer
from copc.runtime.staleness import (
    PaceConfig,
    StalenessConfig,
    effective_staleness,
    pace_budget,
    pace_select,
    prefix_generation_staleness,
)
from copc.types import StopReason, Trajectory


def traj(versions: list[int], *, group: int = 0, prompt_id: str = "p") -> Trajectory:
    """Prompt token (-1), then one sampled token per entry of ``versions`` (-1 = a tool-output token)."""
    v = torch.tensor([-1, *versions], dtype=torch.long)
    n = v.numel()
    return Trajectory(
        prompt_id=prompt_id, token_ids=torch.arange(n), prompt_len=1, action_mask=v >= 0,
        logp_behav=torch.zeros(n), policy_version=v, reward=0.0, token_rewards=torch.zeros(n),
        stop_reason=StopReason.ANSWER, group=group,
    )


def test_score_golden_values() -> None:
    # Sampled versions 3, 3, (tool token), 5, 5, 5 consumed at n = 7: v_end = 5, s_wait = 7 - 5 = 2;
    # g = (2 + 2 + 0 + 0 + 0) / 5 = 0.8 (the tool token does not count); score = 2 + beta * 0.8.
    t = traj([3, 3, -1, 5, 5, 5])
    assert prefix_generation_staleness(t.policy_version, t.action_mask) == pytest.approx(0.8, abs=1e-12)
    assert effective_staleness(t, 7, gen_weight=1.0, filed_version=3) == pytest.approx(2.8, abs=1e-12)
    assert effective_staleness(t, 7, gen_weight=0.5, filed_version=3) == pytest.approx(2.4, abs=1e-12)
    # beta = 1 is the token-mean staleness n - mean_t v_t = 7 - 21/5 = 2.8, not the oldest token's 7 - 3 = 4.
    # A single-version trajectory: g = 0, score = s_wait.
    assert effective_staleness(traj([4, 4]), 7, gen_weight=1.0, filed_version=4) == 3.0
    # No sampled token: g = 0 and v_end is the filed version: 7 - 4 = 3.
    assert effective_staleness(traj([-1, -1]), 7, gen_weight=1.0, filed_version=4) == 3.0


def test_budget_golden_values() -> None:
    # C = 4, |batch| = 4, f = 0.5 -> cap floor(2.0) = 2.
    assert pace_budget(pool=14, target=4, batch=4, gain=1.0, max_reject_frac=0.5) == 2  # min(10, 2)
    assert pace_budget(pool=5, target=4, batch=4, gain=1.0, max_reject_frac=0.5) == 1  # min(1, 2)
    assert pace_budget(pool=4, target=4, batch=4, gain=1.0, max_reject_frac=0.5) == 0  # no excess
    assert pace_budget(pool=10, target=4, batch=8, gain=0.3, max_reject_frac=0.5) == 1  # floor(0.3 * 6 = 1.8)
    assert pace_budget(pool=10, target=4, batch=6, gain=0.5, max_reject_frac=0.5) == 3  # floor(3.0), not 2
    assert pace_budget(pool=30, target=4, batch=6, gain=2.0, max_reject_frac=0.0) == 0  # f = 0: never
    with pytest.raises(ValueError, match="pace_budget"):
        pace_budget(pool=-1, target=4, batch=4, gain=1.0, max_reject_frac=0.5)


def test_select_golden_values() -> None:
    scores, sizes = [2.8, 3.0, 0.5, 3.0], [2, 2, 2, 2]
    # Order: group 1 (3.0), group 3 (3.0, tie -> smaller index first), group 0 (2.8), group 2 (0.5).
    assert pace_select(scores, sizes, budget=4, min_score=1.0) == [1, 3]  # then group 0 does not fit
    assert pace_select(scores, sizes, budget=5, min_score=1.0) == [1, 3]  # 1 left < 2
    assert pace_select(scores, sizes, budget=6, min_score=1.0) == [1, 3, 0]  # group 2 scores < 1
    assert pace_select(scores, sizes, budget=8, min_score=0.0) == [1, 3, 0]  # never the last group
    # a group is rejected whole or not at all
    assert pace_select(scores, sizes, budget=1, min_score=0.0) == []
    assert pace_select(scores, sizes, budget=8, min_score=3.5) == []


def _bounded_pace(**pace: float) -> TrajectoryBuffer:
    return TrajectoryBuffer(StalenessConfig(mode="bounded", staleness=8, filter="pace",
                                            pace=PaceConfig(**pace)), 4)


def test_buffer_rejects_whole_stale_groups_and_counts_them() -> None:
    buf = _bounded_pace()
    # Batch 2, sampled from version 0 on: group 20 finished at version 0 (s_wait = 2, g = 0, score 2);
    # group 21: one sample picked up versions 1 and 2 (v_end = 2, s_wait = 0, g = (1 + 0 + 0 + 0) / 4 = 0.25),
    # the other is all version 2 (score 0): group score 0.125 < min_score 1, never rejected.
    stale = [traj([0, 0], group=20, prompt_id="a"), traj([0, 0, 0], group=20, prompt_id="a")]
    fresh = [traj([1, 2, 2, 2], group=21, prompt_id="b"), traj([2, 2], group=21, prompt_id="b")]
    buf.put_batch(2, 0, stale + fresh)
    buf.put_batch(3, 1, [traj([1], group=30 + k // 2) for k in range(4)])
    # Pool P = 8 when step 2 takes batch 2, C = 1 * 4: budget = min(floor(8 - 4), floor(0.5 * 4)) = 2.
    kept = buf.take_batch(2)
    assert kept == fresh
    metrics = buf.metrics()
    assert metrics["staleness/pace_rejected"] == 2 and metrics["buffer/dropped_pace"] == 2
    assert metrics["staleness/pace_reject_rate"] == 0.5 and metrics["staleness/pace_budget"] == 2
    assert metrics["staleness/pace_pool"] == 8
    # Scores 2, 2, 0.25, 0 -> mean 4.25 / 4 = 1.0625.
    assert metrics["staleness/pace_score_mean"] == pytest.approx(1.0625, abs=1e-12)
    assert metrics["buffer/consumed"] == 2
    # Batch 3 alone in the pool (P = 4 = C): budget 0, nothing rejected whatever the scores.
    assert len(buf.take_batch(3) or []) == 4
    assert buf.metrics()["staleness/pace_rejected"] == 2 and buf.metrics(
        )["staleness/pace_reject_rate"] == 0.0


def test_fresh_data_is_never_rejected_however_full_the_pool() -> None:
    buf = _bounded_pace(gain=10.0)
    for j in range(5):
        buf.put_batch(j, 0, [traj([0, 0], group=10 * j + k // 2) for k in range(4)])
    assert len(buf.take_batch(0) or []) == 4  # scores 0 < min_score 1
    assert buf.metrics()["staleness/pace_budget"] == 2 and buf.metrics()["staleness/pace_rejected"] == 0


def test_filter_none_changes_nothing_and_logs_no_pace_metrics() -> None:
    buf = TrajectoryBuffer(StalenessConfig(mode="bounded", staleness=8), 4)
    batch = [traj([0], group=k // 2) for k in range(4)]
    buf.put_batch(5, 0, batch)
    buf.put_batch(6, 0, batch)
    assert buf.take_batch(5) == batch
    assert not any(k.startswith("staleness/pace") for k in buf.metrics())


def test_bad_settings_say_what_to_do() -> None:
    with pytest.raises(ValueError, match=r"staleness\.filter=pace needs staleness\.mode=bounded"):
        StalenessConfig(mode="fixed_lag", staleness=2, filter="pace")
    with pytest.raises(ValueError, match=r"staleness\.filter must be one of"):
        StalenessConfig(filter="oldest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_reject_frac"):
        PaceConfig(max_reject_frac=1.0)
