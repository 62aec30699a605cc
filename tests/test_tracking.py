"""Metrics namespace and Tracker: JSONL records, resume, TensorBoard mirror, strictness."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from copc import tracking
from copc.run.tracker import Tracker, histogram_record
from copc.tracking import METRICS, is_known, read_metrics


def test_namespace_is_defined_once_and_documented():
    constants = {v for k, v in vars(tracking).items() if k.isupper() and isinstance(v, str) and "/" in v}
    assert constants == set(METRICS)  # every constant documented, every documented name a constant
    assert all(doc.strip() and "\n" not in doc for doc in METRICS.values())
    for name in (
        "loss/policy", "loss/value", "ratio/mask_frac", "ratio/clip_low_frac", "ratio/clip_high_frac",
        "ratio/ess_tok", "ratio/ess_seq", "ratio/mean_abs_log", "staleness/mean", "staleness/max",
        "critic/explained_var", "critic/value_bias_gap", "grad/actor_norm", "grad/critic_norm",
        "perf/tokens_per_s", "time/generate", "time/wait", "time/train", "time/step", "reward/mean",
        "eval/accuracy", "rollout/tool_use_rate", "buffer/dropped",
    ):  # fmt: skip
        assert name in METRICS
    assert is_known("buffer/dropped_timeout") and is_known("eval/accuracy/arith_tool")
    assert not is_known("loss/polcy")


def test_ops_diagnostics_use_the_namespace():
    """The ops return stats dicts keyed by metric names; they cannot import this module (imports point
    down), so check here that every key they emit is declared."""
    from copc.ops.importance import importance_diagnostics

    log_w = torch.tensor([[0.1, -0.2, 0.0]])
    mask = torch.tensor([[True, True, False]])
    stats = importance_diagnostics(log_w, mask, clip_low=0.8, clip_high=1.2, keep_mask=mask)
    unknown = sorted(k for k in stats if k not in METRICS)
    assert not unknown, f"ops.importance emits names missing from METRICS: {unknown}"
    # and every metric-like string literal in the ops modules (policy/value loss stats ...)
    import copc.ops

    pattern = re.compile(r'"((?:loss|ratio|policy|value|critic|adv|returns|staleness|grad)/[a-z0-9_@]+)"')
    for path in Path(copc.ops.__file__).parent.glob("*.py"):
        names = set(pattern.findall(path.read_text()))
        missing = sorted(n for n in names if not is_known(n))
        assert not missing, f"{path.name} emits metric names missing from METRICS: {missing}"


def test_jsonl_records_and_resume_truncation(tmp_path):
    with Tracker(tmp_path, tensorboard=False, strict=True) as tracker:
        for step in range(4):
            tracker.log(step, {tracking.LOSS_POLICY: torch.tensor(0.5 * step), tracking.REWARD_MEAN: step})
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[2][tracking.LOSS_POLICY] == 1.0 and records[3][tracking.REWARD_MEAN] == 3.0
    # a crash cut the last line in half: skipped on read
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 4, "loss/po')
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 4
    # resume from the checkpoint of step 2: steps >= 2 are redone, so their old records go
    with Tracker(tmp_path, tensorboard=False, resume_step=2) as tracker:
        tracker.log(2, {tracking.REWARD_MEAN: 20.0})
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[-1][tracking.REWARD_MEAN] == 20.0


def test_samples_are_appended_mirrored_as_text_and_truncated_on_resume(tmp_path):
    episode = {"prompt_id": "p/0", "prompt": "2+2?\n", "turns": [{"source": "policy",
                                                                  "text": "<python>print(4)"},
               {"source": "forced", "text": "</python><output>4</output>"}], "reward": 1.0,
               "stop_reason": "done"}
    with Tracker(tmp_path) as tracker:
        for step in range(3):
            tracker.log_samples(step, "train", [episode, {**episode, "prompt_id": "p/1"}])
        tracker.log_samples(3, "eval", [episode])
        tracker.log_samples(3, "train", [])  # nothing to write: no empty record
    rows = [json.loads(line) for line in (tmp_path / tracking.SAMPLES_FILE).read_text().splitlines()]
    assert [(r["step"], r["source"], r["prompt_id"]) for r in rows] == [
        (0, "train", "p/0"), (0, "train", "p/1"), (1, "train", "p/0"), (1, "train", "p/1"),
        (2, "train", "p/0"), (2, "train", "p/1"), (3, "eval", "p/0")]
    assert rows[0]["turns"][1] == {"source": "forced", "text": "</python><output>4</output>"}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / tracking.TENSORBOARD_DIR), size_guidance={"tensors": 0}).Reload()
    texts = events.Tensors("samples/train/text_summary")
    assert [t.step for t in texts] == [0, 1, 2]
    assert "print(4)" in texts[0].tensor_proto.string_val[0].decode()
    with Tracker(tmp_path, tensorboard=False, resume_step=2):  # steps >= 2 are redone: their samples go
        pass
    rows = [json.loads(line) for line in (tmp_path / tracking.SAMPLES_FILE).read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 0, 1, 1]


def test_unknown_names_and_bad_values(tmp_path):
    with Tracker(tmp_path, tensorboard=False, strict=True) as tracker:
        with pytest.raises(KeyError, match=r"not in copc\.tracking\.METRICS"):
            tracker.log(0, {"loss/polcy": 1.0})
        with pytest.raises(ValueError, match="must be a scalar"):
            tracker.log(0, {tracking.LOSS_VALUE: torch.ones(2)})
    with Tracker(tmp_path, tensorboard=False) as tracker, pytest.warns(UserWarning, match="custom/x"):
        tracker.log(0, {"custom/x": 1.0})
    with pytest.raises(RuntimeError, match="closed"):
        tracker.log(1, {})


def test_tensorboard_mirror_and_histogram(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracker(tmp_path, strict=True) as tracker:
        for step in range(3):
            tracker.log(
                step,
                {tracking.STALENESS_MEAN: 1.5 + step},
                histograms={tracking.STALENESS_HIST: torch.tensor([0, 1, 1, 2 + step])},
            )
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()
    scalars = events.Scalars(tracking.STALENESS_MEAN)
    assert [(e.step, e.value) for e in scalars] == [(0, 1.5), (1, 2.5), (2, 3.5)]
    assert len(events.Histograms(tracking.STALENESS_HIST)) == 3
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert line[tracking.STALENESS_HIST] == {"counts": [1, 2, 1]}  # values 0, 1, 1, 2


def test_tensorboard_hides_the_steps_a_resume_redoes(tmp_path):
    """As metrics.jsonl drops the rows of redone steps, TensorBoard must not show them beside the new
    ones (purge_step); the kept evaluation at a finished run's end stays in both."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def scalars(tag: str) -> list[tuple[int, float]]:
        events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
        events.Reload()
        return sorted((e.step, e.value) for e in events.Scalars(tag))

    with Tracker(tmp_path, strict=True) as tracker:  # killed after step 9; its checkpoint was step 5
        for step in range(10):
            tracker.log(step, {tracking.REWARD_MEAN: 0.1})
    with Tracker(tmp_path, strict=True, resume_step=5) as tracker:
        for step in range(5, 10):
            tracker.log(step, {tracking.REWARD_MEAN: 0.9})
        tracker.log(10, {tracking.EVAL_ACCURACY: 0.5})  # the run's end
    assert scalars(tracking.REWARD_MEAN) == [(s, pytest.approx(0.1)) for s in range(5)] + [
        (s, pytest.approx(0.9)) for s in range(5, 10)]
    with Tracker(tmp_path, strict=True, resume_step=10, keep_resume_evaluation=True) as tracker:  # extended
        tracker.log(10, {tracking.REWARD_MEAN: 0.7})
    assert scalars(tracking.EVAL_ACCURACY) == [(10, 0.5)]
    assert [r["step"] for r in read_metrics(tmp_path)].count(10) == 2  # the kept evaluation and the new step
    # the continuation was killed before its next checkpoint and resumes at step 10 again: its step 10 is
    # redone, and TensorBoard shows the redone value alone beside the kept evaluation (before, purge_step
    # 11 kept the killed process's value too: found by a review, 2026-12-04)
    with Tracker(tmp_path, strict=True, resume_step=10, keep_resume_evaluation=True) as tracker:
        tracker.log(10, {tracking.REWARD_MEAN: 0.8})
    assert scalars(tracking.REWARD_MEAN)[-1:] == [(10, pytest.approx(0.8))]
    assert [s for s, _ in scalars(tracking.REWARD_MEAN)].count(10) == 1
    assert scalars(tracking.EVAL_ACCURACY) == [(10, 0.5)]


def test_histogram_record_forms():
    assert histogram_record(torch.tensor([3, 0, 3])) == {"counts": [1, 0, 0, 2]}
    assert histogram_record(torch.tensor([2.0, 1.0])) == {"counts": [0, 1, 1]}
    assert histogram_record(torch.tensor([-1.0, 0.5, 2.0])) == {"n": 3, "min": -1.0, "max": 2.0, "mean": 0.5}
    assert histogram_record(torch.tensor([], dtype=torch.int64)) == {"counts": []}
