"""benchmarks/accuracy_wallclock.py: the curves it groups from sweep records, its interpolation, and the
printed time axis (steps x the measured step time of the driver each method runs on), hand-worked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from accuracy_wallclock import at_time, configuration, curves, time_to  # noqa: E402


def record(method: str, seed: int, lag: int | None, accuracies: dict[int, float],
           overrides: dict | None = None) -> dict:
    staleness = ({"mode": "fixed_lag", "staleness": lag} if lag is not None
                 else {"mode": "bounded", "staleness": 8})
    return {"cell": f"arm={method}__seed{seed}", "seed": seed,
            "config": {"method": method, "staleness": staleness, "method_overrides": overrides or {}},
            "evals": [{"step": s, "accuracy": a} for s, a in accuracies.items()]}


def test_interpolation_hand_worked():
    points = [(0.0, 0.2), (1.0, 0.6), (2.0, 0.6)]
    assert at_time(points, 0.25) == pytest.approx(0.3)  # 0.2 + 0.4 * 0.25
    assert at_time(points, 1.5) == pytest.approx(0.6)
    assert at_time(points, 0.0) == pytest.approx(0.2)
    assert at_time(points, 2.5) is None  # beyond the last evaluation: no extrapolation
    assert at_time([(1.0, 0.5), (1.0, 0.7)], 1.0) == 0.5  # a zero-length segment takes its first point


def test_time_to_a_level_hand_worked():
    points = [(0.0, 0.2), (1.0, 0.6), (2.0, 0.5), (3.0, 0.9)]
    assert time_to(points, 0.4) == pytest.approx(0.5)  # 0.2 -> 0.6 over the first hour: 0.4 halfway
    assert time_to(points, 0.6) == pytest.approx(1.0)  # reached exactly at a point
    assert time_to(points, 0.7) == pytest.approx(2.5)  # the first crossing, after the dip: 0.5 + 0.4 * 0.5
    assert time_to(points, 0.2) == 0.0
    assert time_to(points, 0.95) is None  # never reached: no extrapolation


def test_curves_group_by_method_and_lag_and_keep_only_timed_methods():
    records = [record("ppo", 1, None, {0: 0.2, 10: 0.6}), record("ppo", 2, None, {0: 0.4, 10: 0.8}),
               record("async_ppo", 1, 16, {0: 0.2, 10: 0.4}), record("async_ppo", 1, 4, {0: 0.2, 10: 0.5}),
               record("vtrace", 1, 16, {0: 0.2, 10: 0.1})]
    got = curves(records, None, {"ppo", "async_ppo"})
    # sync PPO is lag 0 whatever its record's staleness setting says (the sync driver has no lag)
    assert got[("ppo", 0)] == {0: [0.2, 0.4], 10: [0.6, 0.8]}
    assert got[("async_ppo", 16)] == {0: [0.2], 10: [0.4]}
    assert got[("async_ppo", 4)] == {0: [0.2], 10: [0.5]}
    assert ("vtrace", 16) not in got
    assert curves(records, {2}, {"ppo", "async_ppo"}) == {("ppo", 0): {0: [0.4], 10: [0.8]}}
    assert configuration("copc_behaviour", "copc_behaviour") == "async COPC"
    assert configuration("vtrace", "copc_behaviour") is None


def test_two_variants_of_one_method_and_lag_are_refused():
    records = [record("async_ppo", 1, 16, {0: 0.2}, {"advantage": {"lam_actor": 0.95}}),
               record("async_ppo", 2, 16, {0: 0.2}, {})]
    with pytest.raises(SystemExit, match="other method_overrides"):
        curves(records, None, {"async_ppo"})


def test_the_time_axis_is_steps_times_each_drivers_step(tmp_path: Path):
    folder = tmp_path / "records"
    folder.mkdir()
    for i, rec in enumerate([record("ppo", 1, None, {0: 0.2, 100: 0.6, 200: 0.8}),
                             record("async_ppo", 1, 16, {0: 0.2, 100: 0.5, 200: 0.7}),
                             record("copc_behaviour", 1, 16, {0: 0.2, 100: 0.4, 200: 0.6}),
                             record("async_ppo", 1, 4, {0: 0.2, 100: 0.8, 200: 0.9})]):
        (folder / f"r{i}.json").write_text(json.dumps(rec))
    times = tmp_path / "times.json"
    times.write_text(json.dumps({"task": "arith_tool", "copc": "copc_behaviour", "configurations": {
        "sync PPO": {"step": 36.0, "staleness": 0.0},
        "async PPO (3a)": {"step": 18.0, "staleness": 1.5},
        "async PPO (3b, recompute)": {"step": 20.0, "staleness": 1.5},
        "async COPC": {"step": 27.0, "staleness": 1.2}}}))
    script = str(ROOT / "benchmarks/accuracy_wallclock.py")
    figure = tmp_path / "wallclock.png"
    out = subprocess.run([sys.executable, script, "--step-times", str(times), "--records", str(folder),
                          "--out", str(figure)], capture_output=True, text=True, check=True).stdout
    # sync: 100 steps x 36 s = 1 h, 200 -> 2 h; 3a: 200 x 18 s = 1 h; R1: 200 x 27 s = 1.5 h
    assert "ppo lag 0: 0.000 h 0.200 (n=1)  1.000 h 0.600 (n=1)  2.000 h 0.800 (n=1)" in out
    assert "async_ppo lag 16: 0.000 h 0.200 (n=1)  0.500 h 0.500 (n=1)  1.000 h 0.700 (n=1)" in out
    # at 1 h sync PPO has 0.600; at 1.5 h it has 0.6 + 0.2 * 0.5 = 0.700
    assert "async_ppo lag 16: 0.700 at 1.000 h; sync PPO 0.600" in out
    assert "copc_behaviour lag 16: 0.600 at 1.500 h; sync PPO 0.700" in out
    # 90% of sync PPO's best gain: 0.2 + 0.9 * 0.6 = 0.74; sync reaches it at 1 h + 0.14 / 0.2 h = 1.7 h;
    # 3a (best 0.7) and R1 (best 0.6) never do
    assert "sync PPO reaches 0.740 (90% of its best gain) at 1.700 h" in out
    assert "async_ppo lag 16: never (best 0.700)" in out
    # 3a at lag 4: 0.2 -> 0.8 over its first 0.5 h reaches 0.74 at 0.5 * 0.54 / 0.6 = 0.45 h, 0.26 of 1.7 h
    assert "async_ppo lag 4: 0.450 h, 0.26 of sync PPO's time" in out
    assert figure.stat().st_size > 0 and f"wrote {figure}" in out
