"""Readers beside a writer: ``copc eval``, ``copc export``, ``copc plot`` and ``copc sweep --report`` run
while a real ``copc train`` process trains, frozen in the middle of a checkpoint write, and right after
it was SIGKILLed there. Each reads only complete checkpoints and whole records, says which checkpoint it
read and whether the run is training, and notes each partial checkpoint or torn record it passed over in
one line; none prints a traceback (docs/reliability.md, "Readers beside a writer")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from copc import cli
from copc.trainer.checkpoint import list_checkpoints

TINY = [
    "model.policy=tiny", "task=arith_tool", "task_options={train_size: 100, eval_size: 4}", "steps=400",
    "checkpoint_every=1", "rollout.prompts_per_batch=2", "rollout.group_size=2",
    "rollout.max_new_tokens_per_turn=8", "rollout.max_total_tokens=12", "eval.prompts=2", "eval.samples=1",
    "eval.every=0", "driver.kind=sync", "trainer.critic_warmup_steps=0", "plots=false", "keep_checkpoints=3",
]
READERS_EVAL = ["--prompts", "2", "--samples", "1", "--no-greedy"]


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("wb") as handle:
        return subprocess.Popen([sys.executable, "-m", "copc.cli", *args], stdout=handle,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_for(check: object, proc: subprocess.Popen[bytes], log: Path, seconds: float = 240.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():  # type: ignore[operator]
        assert proc.poll() is None, f"the writer ended (exit {proc.returncode}):\n{log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"timed out waiting:\n{log.read_text()[-2000:]}"
        time.sleep(0.05)


def _freeze_mid_checkpoint(proc: subprocess.Popen[bytes], run: Path, log: Path) -> list[str]:
    """SIGSTOP the writer while a ``.tmp-step_*`` checkpoint directory of its is on disk (polled every
    ~0.2 ms; a stop that lands after the rename is undone and tried again). Returns those names."""
    root = run / "checkpoints"
    for _ in range(200):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-2000:]
            if any(n.startswith(".tmp-step_") for n in os.listdir(root)):
                os.kill(proc.pid, signal.SIGSTOP)
                break
            time.sleep(0.0002)
        time.sleep(0.05)  # the stop has taken effect
        partial = sorted(n for n in os.listdir(root) if n.startswith(".tmp-step_"))
        if partial:
            return partial
        os.kill(proc.pid, signal.SIGCONT)
    raise AssertionError("never caught the writer inside a checkpoint write")


def _read(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path, Path]]:
    run, log = tmp_path / "run", tmp_path / "train.log"
    proc = _start(["train", "--no-progress", f"run_dir={run}", *TINY], log)
    try:
        yield proc, run, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


@pytest.mark.timeout(600)
def test_readers_beside_a_run_frozen_mid_checkpoint_then_killed(
        writer: tuple[subprocess.Popen[bytes], Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    proc, run, log = writer
    _wait_for(lambda: len(list_checkpoints(run)) >= 2, proc, log)
    partial = _freeze_mid_checkpoint(proc, run, log)
    newest = max(list_checkpoints(run))
    for state, when in ((f"training now (pid {proc.pid})", "frozen"), ("not training", "killed")):
        code, out, err = _read(["eval", "--checkpoint", str(run), *READERS_EVAL], capsys)
        assert code == 0, err
        said = f"the checkpoint of step {newest} (the newest complete checkpoint; the run is {state}"
        assert said in out, (when, out)
        notes = [line for line in err.splitlines() if line.startswith("note: skipped")]
        assert len(notes) == len(partial) and all(p in " ".join(notes) for p in partial), (when, err)
        code, out, err = _read(["export", str(run), str(tmp_path / f"hf_{when}")], capsys)
        assert code == 0, err
        assert f"at step {newest} (the newest complete checkpoint; the run is {state}" in out, (when, out)
        assert len([line for line in err.splitlines() if line.startswith("note: skipped")]) == len(partial)
        if when == "frozen":  # the moment a kill lands: the writer is stopped inside the write
            os.kill(proc.pid, signal.SIGKILL)
            os.kill(proc.pid, signal.SIGCONT)
            proc.wait(timeout=60)
            time.sleep(0.2)  # the lock goes with the process's last file
    assert sorted(n for n in os.listdir(run / "checkpoints") if n.startswith(".tmp-step_")) == partial

    # A line cut short by a kill during its append (one write() of a line is seldom cut, so the cut is
    # made here; it is the state a kill or a full disk leaves).
    rows = [line for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    with (run / "metrics.jsonl").open("a") as handle:
        handle.write(rows[-1][: len(rows[-1]) // 2])
    code, out, err = _read(["plot", str(run), "--out", str(tmp_path / "plots")], capsys)
    assert code == 0, err
    assert len(out.split()) == 4 and all(p.endswith(".png") for p in out.split())
    assert f"metrics.jsonl: line {len(rows) + 1} is not a whole record" in err
    steps = [json.loads(r)["step"] for r in rows]
    assert f"{run}: {len(rows)} records, steps {min(steps)}-{max(steps)}; the run is not training" in err, err


def test_an_older_checkpoint_named_by_latest_is_not_called_damaged(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A writer killed between renaming its new checkpoint into place and moving ``latest`` leaves a
    complete newer checkpoint that ``latest`` does not name: the reader reads what a resume would (the
    one ``latest`` names) and does not call the newer one damaged."""
    run = tmp_path / "run"
    assert cli.main(["train", "--no-progress", f"run_dir={run}", *TINY[:3], "steps=1", *TINY[4:]]) == 0
    first = (run / "summary.json").stat().st_ino
    # extended by a step: summary.json is replaced whole (a new file renamed over it), never rewritten in
    # place, where a reader would find it empty or cut short
    assert cli.main(["train", "--no-progress", f"run_dir={run}", "resume=true", "steps=2"]) == 0
    assert (run / "summary.json").stat().st_ino != first
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    assert list_checkpoints(run) == [1, 2]
    (run / "checkpoints" / "latest").write_text("step_00000001\n")
    capsys.readouterr()
    code, out, err = _read(["eval", "--checkpoint", str(run), *READERS_EVAL], capsys)
    assert code == 0, err
    assert "damaged" not in out + err
    assert "the checkpoint of step 1 (the checkpoint `latest` named" in out and "step 2 is newer" in out


@pytest.mark.slow  # a sweep process and its cell's copc train: about 70 s on a loaded 2-core machine
@pytest.mark.timeout(600)
def test_sweep_report_names_a_cell_in_training_then_killed(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "readers.yaml"
    spec.write_text("experiment: readers\nseeds: [0]\nshared:\n" + "".join(
        f"  - {json.dumps(o)}\n" for o in TINY) + "axes:\n  method:\n    copc: [method=copc]\n")
    results, runs, log = tmp_path / "results", tmp_path / "runs", tmp_path / "sweep.log"
    sweep = _start(["sweep", str(spec), "--jobs", "1", "--nice", "0", "--results", str(results),
                    "--runs", str(runs)], log)
    report = ["sweep", str(spec), "--report", "--results", str(results), "--runs", str(runs)]
    try:
        _wait_for(lambda: any(list_checkpoints(r) for r in runs.glob("*") if r.is_dir()), sweep, log)
        code, out, err = _read(report, capsys)
        assert code == 0, err
        assert "0 of 1 cells recorded" in out and "not recorded yet: " in out, out
        line = next(x for x in out.splitlines() if x.startswith("not recorded yet: "))
        assert "training now (pid" in line and "newest checkpoint: step" in line, line
    finally:
        os.killpg(sweep.pid, signal.SIGKILL)  # the sweep and its cell's copc train
        sweep.wait(timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        code, out, err = _read(report, capsys)
        if "training now" not in out:
            break
        time.sleep(0.5)
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("not recorded yet: "))
    assert "not training (stopped or killed before its end); newest checkpoint: step" in line, line
