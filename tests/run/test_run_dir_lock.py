"""One process per run directory: a second ``copc train`` there is refused in one line naming the holder,
nothing of the first run is touched, the hold ends with the process, and ``copc sweep`` skips a cell
another process is training."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from copc.config import ConfigError
from copc.experiments.sweep_cli import sweep_cli
from copc.run.build import claimed_run_dir, run_dir_holder
from copc.run.config import default_config


def test_a_second_claim_is_refused_naming_the_holder_and_touches_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = replace(default_config(), run_dir=str(run))
    assert run_dir_holder(run) is None
    with claimed_run_dir(cfg) as path:
        (path / "metrics.jsonl").write_text("{}\n")  # the first run's output so far
        assert run_dir_holder(run) == os.getpid()
        for other in (cfg, replace(cfg, resume=True), replace(cfg, overwrite=True)):
            with pytest.raises(ConfigError,
                               match=r"in use by another copc train \(pid \d+\)"), claimed_run_dir(other):
                pass
        assert (path / "metrics.jsonl").read_text() == "{}\n"  # overwrite=true did not remove it
    assert run_dir_holder(run) is None
    with claimed_run_dir(replace(cfg, resume=True)):  # free again once the holder let go
        pass


def claimant(run: Path, then: str) -> subprocess.Popen[str]:
    """A Python process that claims ``run`` and then runs the code ``then`` (its stdout piped)."""
    return subprocess.Popen([sys.executable, "-c", (
        "import os, time; from dataclasses import replace; from copc.run.build import claimed_run_dir; "
        "from copc.run.config import default_config; "
        f"cm = claimed_run_dir(replace(default_config(), run_dir={str(run)!r})); cm.__enter__()\n{then}"
    )], stdout=subprocess.PIPE, text=True)


def test_the_hold_ends_with_the_process_however_it_ends(tmp_path: Path) -> None:
    run = tmp_path / "run"
    holder = claimant(run, "print('held', flush=True); time.sleep(60)")
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert run_dir_holder(run) == holder.pid
    finally:
        holder.kill()  # SIGKILL: no cleanup code runs
        holder.wait(timeout=30)
    deadline = time.monotonic() + 10
    while run_dir_holder(run) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert run_dir_holder(run) is None


def test_a_hold_inherited_by_a_child_names_the_child_not_the_dead_parent(tmp_path: Path) -> None:
    """CLI review item 18: a process forked by the claimant (it shares the lock's open file) holds the
    directory after the claimant ends; the refusal named the claimant's stale pid from the lock file."""
    run = tmp_path / "run"
    parent = claimant(run, "pid = os.fork()\nif pid == 0:\n    time.sleep(60); os._exit(0)\nprint(pid, "
                           "flush=True); os._exit(0)")
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.wait(timeout=30)
    try:
        with pytest.raises(ConfigError) as err, claimed_run_dir(replace(default_config(), run_dir=str(run))):
            pass
        message = str(err.value)
        assert f"pid {child}" in message and f"pid {parent.pid}" in message and "has ended" in message, (
            message)
        assert run_dir_holder(run) == child
    finally:
        os.kill(child, 9)


def test_sweep_skips_a_cell_another_process_is_training(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    spec = {"experiment": "held", "seeds": 1, "shared": ["model.policy=tiny", "steps=2"],
            "axes": {"method": {"ppo_sync": ["method=ppo", "driver.kind=sync"]}}}
    (tmp_path / "held.yaml").write_text(yaml.safe_dump(spec))
    runs = tmp_path / "runs" / "sweep" / "held"
    cell_dir = runs / "method=ppo_sync__seed0"
    with claimed_run_dir(replace(default_config(), run_dir=str(cell_dir))):
        code = sweep_cli(["held.yaml", "--jobs", "1", "--runs", str(runs),
                          "--results", str(tmp_path / "results")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "skipped, pid" in out and "start" not in out
    assert not (tmp_path / "results" / "held").exists()


def test_a_cell_another_sweep_starts_after_the_plan_is_skipped_when_its_turn_comes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two queues over one grid: a cell the other queue claims while this one is busy with an earlier
    cell is not started a second time (before, the plan's states were final and the second train failed
    on the claim)."""
    from contextlib import ExitStack

    from copc.experiments.sweep import Paths, resolve, run_cells
    from copc.experiments.sweep_spec import expand, parse_spec

    monkeypatch.chdir(tmp_path)
    spec = parse_spec({"experiment": "two", "seeds": 2, "shared": ["model.policy=tiny", "steps=2"],
                       "axes": {"method": {"ppo_sync": ["method=ppo", "driver.kind=sync"]}}})
    first, second = expand(spec)
    paths = Paths(tmp_path / "results", tmp_path / "runs")
    lines: list[str] = []
    with ExitStack() as other_queue:
        def log(line: str) -> None:
            lines.append(line)
            # meanwhile the other queue takes the second
            if line.startswith(f"[sweep] start {first.cell_id}"):
                other_queue.enter_context(claimed_run_dir(resolve(second, paths.run_dir(second))))

        failures = run_cells(spec, [first, second], paths, jobs=1, nice=0, log=log)
    assert failures == [], lines
    assert any(f"{second.cell_id}: skipped, pid {os.getpid()}" in line for line in lines), lines
    assert not any(line.startswith(f"[sweep] start {second.cell_id}") for line in lines), lines
    assert paths.record("two", first).is_file() and not paths.record("two", second).exists()
