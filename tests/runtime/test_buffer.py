"""Trajectory buffer: policy-governed batches, counted drops, checkpointable state, thread safety."""

from __future__ import annotations

import io
import threading

import pytest
import torch

from copc.runtime.buffer import TrajectoryBuffer, trajectory_from_dict, trajectory_to_dict
from copc.runtime.staleness import StalenessConfig
from copc.types import Prompt, StopReason, Trajectory


def traj(version: int, pid: str = "p", n_tokens: int = 3, reward: float = 0.0) -> Trajectory:
    """Two prompt tokens, then ``n_tokens`` sampled by ``version`` (``version = -1``: nothing sampled)."""
    version_L = torch.tensor([-1, -1] + [version] * n_tokens, dtype=torch.int64)
    length = version_L.numel()
    return Trajectory(
        prompt_id=pid,
        token_ids=torch.arange(length, dtype=torch.int64),
        prompt_len=2,
        action_mask=version_L >= 0,
        logp_behav=torch.linspace(-1.0, -0.1, length),
        policy_version=version_L,
        reward=reward,
        token_rewards=torch.zeros(length),
        stop_reason=StopReason.ANSWER,
        info={"tool_calls": 1.0},
        group=version,
    )


def ids(batch: list[Trajectory] | None) -> list[str]:
    assert batch is not None
    return [t.prompt_id for t in batch]


def test_fixed_lag_groups_by_version_in_arrival_order():
    buf = TrajectoryBuffer(StalenessConfig(mode="fixed_lag", staleness=2), batch_size=2)
    # version 0 must supply (s+1)*B = 6; interleave with later versions to check grouping
    buf.put([traj(0, "a0"), traj(1, "b0"), traj(0, "a1"), traj(0, "a2")])
    assert ids(buf.get_batch(0)) == ["a0", "a1"]
    assert buf.get_batch(1) is None  # only a2 of version 0 left: wait
    buf.put([traj(0, "a3"), traj(2, "c0"), traj(0, "a4"), traj(0, "a5"), traj(1, "b1")])
    assert ids(buf.get_batch(1)) == ["a2", "a3"]
    assert ids(buf.get_batch(2)) == ["a4", "a5"]
    assert ids(buf.get_batch(3)) == ["b0", "b1"]  # step 3 reads version 3 - 2 = 1
    assert buf.get_batch(4) is None  # needs two of version 2, has one
    assert buf.metrics()["buffer/dropped"] == 0
    assert buf.metrics()["buffer/consumed"] == 8


def test_fixed_lag_counts_unreachable_versions_as_dropped():
    buf = TrajectoryBuffer(StalenessConfig(mode="fixed_lag", staleness=0), batch_size=1)
    buf.put([traj(0, "a"), traj(0, "extra"), traj(1, "b")])
    assert ids(buf.get_batch(0)) == ["a"]
    assert ids(buf.get_batch(1)) == ["b"]  # "extra" (version 0) can never be read again
    metrics = buf.metrics()
    assert metrics["buffer/dropped_unscheduled"] == 1 and metrics["buffer/dropped"] == 1
    assert len(buf) == 0


def test_bounded_oldest_first_and_over_bound_counted():
    buf = TrajectoryBuffer(StalenessConfig(mode="bounded", staleness=1), batch_size=2)
    buf.put([traj(2, "new"), traj(0, "old1"), traj(1, "mid"), traj(0, "old2")])
    assert ids(buf.get_batch(1)) == ["old1", "old2"]
    assert buf.metrics()["buffer/over_bound"] == 0  # lag 1 <= s
    assert ids(buf.get_batch(3)) == ["mid", "new"]  # lag 3-1 = 2 > s for "mid": counted, not dropped
    assert buf.get_batch(4) is None
    metrics = buf.metrics()
    assert metrics["buffer/over_bound"] == 1 and metrics["buffer/dropped"] == 0


def test_empty_and_reported_drops_are_counted():
    buf = TrajectoryBuffer(StalenessConfig(), batch_size=1)
    prompt = Prompt(id="q", text="1+1", answers=("2",))
    assert buf.admit(0, [prompt]) == [prompt]
    buf.record_drop("timeout", prompts=[prompt])
    assert buf.in_flight() == []
    buf.put([traj(-1, "nothing")])
    metrics = buf.metrics()
    assert metrics["buffer/dropped_timeout"] == 1 and metrics["buffer/dropped_empty"] == 1
    assert metrics["buffer/dropped"] == 2
    with pytest.raises(ValueError, match="unknown drop reason"):
        buf.record_drop("bored")


def test_admission_tracks_requests_and_in_flight():
    buf = TrajectoryBuffer(StalenessConfig(mode="bounded", staleness=1), batch_size=2)
    prompts = [Prompt(id=f"q{i}", text=str(i), answers=(str(i),)) for i in range(6)]
    # version 0, s = 1: batches 0 and 1 -> 4 requests
    assert [p.id for p in buf.admit(0, prompts)] == ["q0", "q1", "q2", "q3"]
    assert not buf.can_request(0)
    assert buf.can_request(1)
    buf.put([traj(0, "q1")])
    assert [p.id for p in buf.in_flight()] == ["q0", "q2", "q3"]
    assert [p.id for p in buf.admit(1, prompts[4:])] == ["q4", "q5"]
    assert buf.num_requested == 6


def _round_trip(state: dict[str, object]) -> dict[str, object]:
    stream = io.BytesIO()
    torch.save(state, stream)
    stream.seek(0)
    return torch.load(stream, weights_only=True)


def test_state_dict_round_trip_keeps_trajectories_and_requeues_in_flight():
    cfg = StalenessConfig(mode="fixed_lag", staleness=1)
    buf = TrajectoryBuffer(cfg, batch_size=2)
    prompts = [Prompt(id=f"q{i}", text=f"t{i}", answers=("x", "y"), meta={"hops": i}) for i in range(4)]
    buf.admit(0, prompts)
    buf.put([traj(0, "q0", reward=1.0), traj(0, "q1"), traj(0, "q2", n_tokens=5)])
    buf.put([traj(0, "zz")])  # not admitted through the buffer: stored, clears nothing
    ids(buf.get_batch(0))
    before = buf.metrics()

    restored = TrajectoryBuffer(cfg, batch_size=2)
    restored.load_state_dict(_round_trip(buf.state_dict()))
    assert len(restored) == 2
    after = restored.metrics()
    assert after["buffer/consumed"] == before["buffer/consumed"]
    assert after["buffer/requeued"] == 1
    requeued = restored.take_requeued()
    assert requeued == [prompts[3]]  # q3 was in flight: handed back, meta intact
    assert restored.take_requeued() == []
    assert [p.id for p in restored.in_flight()] == ["q3"]
    assert restored.num_requested == 4
    # the rest of the run sees exactly what the uninterrupted buffer would
    a, b = buf.get_batch(1), restored.get_batch(1)
    assert a is not None and b is not None
    for x, y in zip(a, b, strict=True):
        assert x.prompt_id == y.prompt_id and x.reward == y.reward and x.info == y.info
        for name in ("token_ids", "action_mask", "logp_behav", "policy_version", "token_rewards"):
            assert torch.equal(getattr(x, name), getattr(y, name))


def test_trajectory_record_round_trip():
    original = traj(3, "r", reward=0.5)
    back = trajectory_from_dict(_round_trip(trajectory_to_dict(original)))
    assert back.stop_reason is StopReason.ANSWER and back.group == 3 and back.prompt_len == 2
    assert torch.equal(back.logp_behav, original.logp_behav)


def test_concurrent_producer_and_trainer_lose_nothing():
    """A producer thread puts 200 trajectories in small chunks while the trainer waits for batches:
    each trajectory is consumed exactly once, in version order per step."""
    buf = TrajectoryBuffer(StalenessConfig(mode="fixed_lag", staleness=0), batch_size=4)
    n_steps = 50

    def produce() -> None:
        for version in range(n_steps):
            chunk = [traj(version, f"v{version}-{i}") for i in range(4)]
            buf.put(chunk[:1])
            buf.put(chunk[1:])

    producer = threading.Thread(target=produce)
    producer.start()
    seen: list[str] = []
    for step in range(n_steps):
        batch = buf.wait_batch(step, timeout_s=30.0)
        assert batch is not None, f"step {step} timed out"
        assert {t.min_version for t in batch} == {step}
        seen += ids(batch)
    producer.join(timeout=30.0)
    assert len(seen) == len(set(seen)) == 4 * n_steps
    assert buf.wait_batch(n_steps, timeout_s=0.05) is None
    assert buf.metrics()["buffer/dropped"] == 0


def test_partial_rollout_is_filed_under_its_oldest_version():
    """A trajectory whose tokens span versions 1 and 2 (partial rollout) has lag n - min_t v_t: under
    fixed_lag with s = 1 it is consumed at step 2, not 3."""
    version_L = torch.tensor([-1, 1, 1, 2])
    mixed = Trajectory(
        prompt_id="mixed",
        token_ids=torch.arange(4),
        prompt_len=1,
        action_mask=version_L >= 0,
        logp_behav=torch.zeros(4),
        policy_version=version_L,
        reward=0.0,
        token_rewards=torch.zeros(4),
        stop_reason=StopReason.MAX_TOKENS,
    )
    buf = TrajectoryBuffer(StalenessConfig(mode="fixed_lag", staleness=1), batch_size=1)
    buf.put([mixed])
    assert buf.get_batch(3) is None  # step 3 reads version 2: "mixed" is unreachable from now on
    assert buf.metrics()["buffer/dropped_unscheduled"] == 1
    buf.put([mixed])
    assert ids(buf.get_batch(2)) == ["mixed"]


def test_a_batch_with_empty_trajectories_is_consumed_whole():
    """Issue 10, defect 1: a prompt that fills the context yields a trajectory with no sampled token.
    ``put`` drops it (counted), so a step waiting for B trajectories of that batch waits forever;
    ``put_batch`` keeps it under the batch's version and ``take_batch`` returns the whole batch."""
    for mode, s in (("fixed_lag", 0), ("fixed_lag", 2), ("bounded", 0), ("bounded", 1)):
        old = TrajectoryBuffer(StalenessConfig(mode=mode, staleness=s),
                               batch_size=3)  # type: ignore[arg-type]
        old.put([traj(0, "a"), traj(-1, "empty"), traj(0, "b")])
        assert old.get_batch(0) is None  # B - 1 stored: the old async path never got its batch
        buf = TrajectoryBuffer(StalenessConfig(mode=mode, staleness=s),
                               batch_size=3)  # type: ignore[arg-type]
        buf.put_batch(0, 0, [traj(0, "a"), traj(-1, "empty"), traj(0, "b")])
        assert ids(buf.take_batch(0)) == ["a", "empty", "b"]
        metrics = buf.metrics()
        assert metrics["buffer/empty_kept"] == 1 and metrics["buffer/dropped"] == 0
        assert metrics["buffer/consumed"] == 3


def test_batches_of_any_size_are_one_step_each_and_clear_their_requests():
    """A generator that filters groups (DAPO dynamic sampling) returns fewer than B trajectories:
    step n still consumes batch n whole, and the batch's admitted requests leave the in-flight list."""
    buf = TrajectoryBuffer(StalenessConfig(mode="bounded", staleness=1), batch_size=4)
    requests = [Prompt(id=f"q{i}", text=str(i), answers=("x",)) for i in range(4)]
    assert len(buf.admit(0, requests)) == 4
    buf.put_batch(1, 0, [traj(0, f"b1-{i}") for i in range(5)])
    buf.put_batch(0, 0, [traj(0, "q0"), traj(0, "q2")], requests=requests)
    assert buf.in_flight() == []
    assert buf.take_batch(2) is None
    assert ids(buf.take_batch(0)) == ["q0", "q2"]
    assert len(buf.take_batch(1) or []) == 5
    restored = TrajectoryBuffer(StalenessConfig(mode="bounded", staleness=1), batch_size=4)
    buf.put_batch(2, 1, [traj(1, "c"), traj(-1, "e")])
    restored.load_state_dict(_round_trip(buf.state_dict()))
    assert ids(restored.take_batch(2)) == ["c", "e"]  # batch membership and the empty row survive


def test_fixed_lag_take_batch_refuses_a_batch_of_the_wrong_version():
    buf = TrajectoryBuffer(StalenessConfig(mode="fixed_lag", staleness=1), batch_size=1)
    buf.put_batch(3, 0, [traj(0, "late")])
    with pytest.raises(RuntimeError, match="needs version 2"):
        buf.take_batch(3)
