"""Phase peaks of the training process (copc.trainer.memory): an allocation is charged to the phase it
happens in, what happens between phases to ``other``, and a real run logs every phase of its steps."""

from __future__ import annotations

import numpy as np
import pytest

from copc import tracking as m
from copc.trainer import memory
from copc.trainer.memory import PhasePeaks

pytestmark = pytest.mark.skipif(not PhasePeaks()._start(), reason="needs /proc/self/clear_refs (Linux)")

MIB_300 = 300 * 2**20


def touch(nbytes: int) -> np.ndarray:
    block = np.ones(nbytes // 8)  # written, so resident
    return block


def test_an_allocation_is_charged_to_its_phase_and_between_phases_to_other():
    peaks = PhasePeaks()
    with peaks.phase("warm"):
        pass
    base = peaks.take()[f"{m.MEMORY_PEAK}_warm"]
    with peaks.phase("big"):
        block = touch(MIB_300)
        del block
    with peaks.phase("small"):
        pass
    between = touch(MIB_300)  # neither phase: start-up, evaluation, checkpoints are charged to `other`
    del between
    with peaks.phase("small"):
        pass
    out = peaks.take()
    assert out[f"{m.MEMORY_PEAK}_big"] >= base + 0.28
    assert out[f"{m.MEMORY_PEAK}_small"] < base + 0.1  # freed before the phase: not charged to it
    assert out[f"{m.MEMORY_PEAK}_other"] >= base + 0.28
    assert out[m.MEMORY_PEAK] == max(v for k, v in out.items() if k != m.MEMORY_PEAK)
    assert peaks.take() == {}  # cleared


def test_nested_phases_charge_the_outer_one():
    peaks = PhasePeaks()
    with peaks.phase("outer"), peaks.phase("inner"):
        block = touch(MIB_300)
        del block
    out = peaks.take()
    assert f"{m.MEMORY_PEAK}_inner" not in out and f"{m.MEMORY_PEAK}_outer" in out


def test_no_metric_where_the_mark_cannot_be_reset(monkeypatch):
    monkeypatch.setattr(memory, "_reset_hwm", lambda: False)
    peaks = PhasePeaks()
    with peaks.phase("actor"):
        pass
    assert peaks.take() == {} and peaks.enabled is False


def test_a_run_logs_the_peak_of_every_phase_of_its_steps(tmp_path):
    from copc.run.train import train_cli
    from copc.tracking import is_known, read_metrics

    run = tmp_path / "run"
    assert train_cli(["--no-progress", "model.policy=tiny", "driver.kind=sync", "steps=2", "eval.prompts=2",
                      "plots=false", "trainer.critic_warmup_steps=0", f"run_dir={run}"]) == 0
    steps = [r for r in read_metrics(run) if m.TIME_STEP in r]
    assert len(steps) == 2
    for record in steps:
        phases = {k for k in record if k.startswith(m.MEMORY_PEAK)}
        assert {f"{m.MEMORY_PEAK}_{p}" for p in ("batch", "prepare", "critic", "actor", "publish", "other")} <= phases
        assert all(is_known(k) for k in phases)
        assert record[m.MEMORY_PEAK] == max(record[k] for k in phases if k != m.MEMORY_PEAK) > 0.1
