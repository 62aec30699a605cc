"""Fault injection (issue 18): the runtime never hangs, never orphans a process, never loses a run silently.

Every async run here is ``fixed_lag``, so whatever happens to its workers it must end bit-identical to
the synchronous lag simulation of the same config (the module's reference run): a restarted worker
regenerates the same batch, a resumed run continues the same timeline. Faults injected:

- a rollout worker SIGKILLed (one of one, one of two), and more deaths than ``max_worker_restarts``;
- the trainer SIGKILLed and SIGTERMed in a subprocess (then: no process of its group left, resume exact);
- a journal write that fails (a directory in the way), a damaged journal entry, a full disk (tmpfs);
- every checkpoint corrupt, the latest corrupt (fallback), a reused run dir, resume without run_dir or
  with another method / batch size, a kill before the first checkpoint (no duplicate metric steps);
- non-finite options and weights; bad dataset rows; prompts that fill the context (issue 10, defect 1);
- resume: below the finished step, into a run_dir that does not exist, with only run_dir (the run's own
  config), past a finished run's final evaluation; copc eval of a damaged latest checkpoint or of a run
  without one (issue 34, cases 1, 2, 8, 9; issue 35, item 2);
- a read-only run_dir or COPC_CACHE, a prompt longer than the model's own context, a full disk named by
  its file with what was kept (issue 34, cases 4, 10, 12).

docs/reliability.md lists each guarantee with the test here that checks it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import IO

import numpy as np
import pytest
import torch

from copc.config import to_dict
from copc.eval.evaluate import EvalConfig
from copc.rollout.generator import RolloutConfig
from copc.run.config import DriverConfig, ModelConfig, RunConfig
from copc.run.eval import eval_cli
from copc.run.train import train, train_cli
from copc.runtime.async_local import AsyncSource, RolloutError
from copc.runtime.journal import Journal, JournalDamage, JournalError
from copc.runtime.staleness import StalenessConfig
from copc.runtime.workers import WorkerSpec
from copc.trainer.checkpoint import CheckpointError, list_checkpoints, load_latest, save_checkpoint
from copc.trainer.config import TrainerConfig
from copc.trainer.weight_files import Weights

pytestmark = pytest.mark.timeout(400)  # generous: a 2-core machine shared with other jobs

#: Metrics that measure time or who generated the batch (they differ between equal runs).
VOLATILE = ("time/", "perf/", "memory/", "buffer/", "runtime/")


def config(run_dir: Path, *, driver: str = "async", steps: int = 6, **extra: object) -> RunConfig:
    cfg = RunConfig(
        task="arith_tool", task_options={"train_size": 200, "eval_size": 8}, method="copc", steps=steps,
        seed=5,
        run_dir=str(run_dir), checkpoint_every=1, plots=False, model=ModelConfig(policy="tiny"),
        rollout=RolloutConfig(prompts_per_batch=2, group_size=2, max_turns=2, max_new_tokens_per_turn=8,
                              max_total_tokens=12, context_limit=96),
        trainer=TrainerConfig(actor_lr=1e-3, critic_lr=1e-3, micro_batch_size=4),
        staleness=StalenessConfig(mode="fixed_lag", staleness=1),
        driver=DriverConfig(kind=driver),  # type: ignore[arg-type]
        eval=EvalConfig(prompts=2, samples=1, greedy=False),
    )
    return replace(cfg, **extra)  # type: ignore[arg-type]


def steps_of(run_dir: Path) -> list[dict[str, object]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE) and k != "time"} for r in rows
            if "loss/value" in r]


def policy_of(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = load_latest(run_dir)
    assert latest is not None
    return latest[1]["trainer"]["policy"]  # type: ignore[index,return-value]


def assert_matches(reference: Path, run: Path) -> None:
    assert steps_of(run) == steps_of(reference)
    ref, got = policy_of(reference), policy_of(run)
    for name in ref:
        assert torch.equal(ref[name], got[name]), name


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synchronous lag simulation every async fixed_lag run below must reproduce exactly."""
    run_dir = tmp_path_factory.mktemp("faults") / "reference"
    train(config(run_dir, driver="sync"), show_progress=False)
    return run_dir


# ------------------------------------------------------------------------------ processes on /proc
def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                out.append(int(entry))
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def rollout_workers() -> list[int]:
    """Live rollout workers of this process: the children of its fork server."""
    servers = [p for p in _children(os.getpid()) if "forkserver" in _cmdline(p)]
    return [w for s in servers for w in _children(s)]


def kill_a_worker_once(run_dir: Path, killed: list[int]) -> Callable[[], None]:
    """A thread body: once batch 0 is journaled (workers are busy), SIGKILL one worker, once."""

    def body() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed:
            if list((run_dir / "rollouts").glob("batch_*.pt")) and rollout_workers():
                victim = rollout_workers()[0]
                os.kill(victim, signal.SIGKILL)
                killed.append(victim)
                return
            time.sleep(0.01)

    return body


# --------------------------------------------------------------------------------- worker deaths
@pytest.mark.parametrize("workers", [1, 2])
def test_a_killed_worker_is_restarted_and_the_run_is_unchanged(reference: Path, tmp_path: Path,
                                                               workers: int) -> None:
    cfg = replace(config(tmp_path / "run"), driver=DriverConfig(kind="async", num_workers=workers))
    killed: list[int] = []
    killer = threading.Thread(target=kill_a_worker_once(tmp_path / "run", killed))
    killer.start()
    summary = train(cfg, show_progress=False).summary
    killer.join()
    assert len(killed) == 1
    assert summary["worker_restarts"] == 1
    last = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
            if "loss/value" in x][-1]
    assert last["runtime/worker_restarts"] == 1
    assert_matches(reference, tmp_path / "run")
    assert rollout_workers() == []  # closed: nothing left behind


def test_more_deaths_than_the_restart_limit_end_the_run_with_the_workers_error(tmp_path: Path) -> None:
    cfg = replace(config(tmp_path / "run"), driver=DriverConfig(kind="async", max_worker_restarts=0))
    killed: list[int] = []
    killer = threading.Thread(target=kill_a_worker_once(tmp_path / "run", killed))
    killer.start()
    with pytest.raises(RolloutError, match=r"max_worker_restarts=0.*\n.*killed by SIGKILL") as err:
        train(cfg, show_progress=False)
    killer.join()
    assert "rollout worker 0 failed" in str(err.value)
    assert rollout_workers() == []


def test_a_failing_journal_write_ends_the_run_with_its_path(tmp_path: Path) -> None:
    """Issue 18, defect 3: the receiver thread died and the trainer waited forever."""
    run_dir = tmp_path / "run"
    (run_dir / "rollouts" / "batch_00000001.pt").mkdir(parents=True)  # a directory where the file goes
    (run_dir / ".lock").touch()  # a run directory copc made (an earlier claim), not a folder of the user's
    cfg = replace(config(run_dir), resume=True)  # an existing dir without a run: resume starts at step 0
    started = time.monotonic()
    with pytest.raises(RolloutError, match=r"rollout journal: cannot write .*batch_00000001\.pt"):
        train(cfg, show_progress=False)
    assert time.monotonic() - started < 120
    assert rollout_workers() == []


# ------------------------------------------------------------------------------- trainer killed
def _overrides(cfg: RunConfig) -> list[str]:
    flat: list[str] = []

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict) and prefix != "task_options":
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            flat.append(f"{prefix}={json.dumps(value)}")

    walk("", to_dict(cfg))
    return flat


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_trainer_killed_leaves_no_process_and_resumes_exactly(reference: Path, tmp_path: Path,
                                                              sig: int) -> None:
    """Issue 18, defect 2 (orphans; SIGTERM a clean stop) and defect 4 (a damaged journal entry)."""
    cfg = config(tmp_path / "run")
    code = "import sys; from copc.run.train import train_cli; sys.exit(train_cli(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "--no-progress", *_overrides(cfg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    run_dir = Path(cfg.run_dir)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if list_checkpoints(run_dir):
                break
            time.sleep(0.02)
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "exited early"
        os.kill(proc.pid, sig)
        code_ = proc.wait(timeout=60)
        stderr = proc.stderr.read().decode() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if sig == signal.SIGTERM:
        assert code_ == 128 + signal.SIGTERM, stderr
        assert "stopped by SIGTERM" in stderr and "resume=true" in stderr, stderr
    # Workers, the fork server and the resource tracker are gone within seconds (they were in its group).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _group_alive(proc.pid):
        time.sleep(0.1)
    assert not _group_alive(proc.pid), [(p, _cmdline(p)) for p in _children(1) if os.getpgid(p) == proc.pid]
    latest = load_latest(run_dir)
    assert latest is not None
    next_put = int(latest[1]["source"]["next_put"])  # type: ignore[index]
    journal = Journal(run_dir / "rollouts")
    after = [j for j in journal.indices() if j >= next_put]
    damaged = 0
    if after:  # damage one entry the checkpoint does not hold: it must be named and generated again
        journal.path(after[0]).write_bytes(b"\x00garbage")
        damaged = 1
    summary = train(replace(cfg, resume=True), show_progress=False).summary
    assert summary["journal_damaged"] == damaged
    assert summary["restored_batches"] == len(after) - damaged
    assert_matches(reference, run_dir)
    # the counts are the run's, not the last process's: a run continued past its end still reports them
    end = load_latest(run_dir)
    assert end is not None
    beyond = [j for j in journal.indices() if j >= int(end[1]["source"]["next_put"])]  # type: ignore[index]
    again = train(replace(cfg, resume=True, steps=cfg.steps + 1), show_progress=False).summary
    # this process restores the batches generated past the end of the run before it, and adds them
    assert again["journal_damaged"] == damaged
    assert again["restored_batches"] == len(after) - damaged + len(beyond)


def _tiny_source(tmp_path: Path, **kwargs: object) -> AsyncSource:
    """An async source over the tiny model (one worker, fixed_lag, s=1), not started."""
    from copc.models import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    rollout = RolloutConfig(prompts_per_batch=2, group_size=2, max_turns=1, max_new_tokens_per_turn=4,
                            max_total_tokens=8, context_limit=96)
    spec = WorkerSpec(model_path=str(tmp_path / "tiny"), task="arith_tool",
                      task_options={"train_size": 50, "eval_size": 4},
                      rollout=rollout, seed=0)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return AsyncSource(spec, StalenessConfig(mode="fixed_lag", staleness=1), weights,
                       journal_dir=tmp_path / "run" / "rollouts", **kwargs)  # type: ignore[arg-type]


def test_batches_held_by_a_checkpointed_buffer_keep_their_generation_time(tmp_path: Path) -> None:
    """A batch generated before the checkpoint and consumed after the resume was logged with
    time/generate 0.0 and without its generator counters (found by a review, 2026-12-03)."""
    source = _tiny_source(tmp_path)
    source.start()
    try:
        deadline = time.monotonic() + 120
        while source.next_put < 2:  # batches 0 and 1 (s = 1) generated and buffered, none consumed
            assert time.monotonic() < deadline, "the worker never delivered two batches"
            time.sleep(0.05)
        state = source.state_dict()
        held = dict(source.generate_s)
    finally:
        source.close()
    assert sorted(held) == [0, 1] and all(v > 0 for v in held.values())
    resumed = _tiny_source(tmp_path)
    resumed.load_state_dict(state)
    resumed.start()
    try:
        for step in (0, 1):
            batch, _ = resumed.next_batch(step)
            assert batch.generate_s == held[step], step
    finally:
        resumed.close()


def test_resume_counts_are_the_runs_and_survive_the_next_checkpoint(tmp_path: Path) -> None:
    """``restored_batches`` and ``journal_damaged`` counted only the last process's resume; a run resumed
    twice (or continued past its end) lost the earlier counts. Restored batches travel in the source's
    state; damaged entries are the ``*.damaged`` files the run's journal keeps, so a process that set one
    aside and was killed before its next checkpoint still counts (found by a review, 2026-12-04)."""
    source = _tiny_source(tmp_path)
    checkpoint = source.state_dict()  # next_put 0: every journal entry is beyond it
    source.close()
    journal = tmp_path / "run" / "rollouts"
    (journal / "batch_00000000.pt").write_bytes(b"garbage")  # a torn entry
    killed = _tiny_source(tmp_path)
    killed.load_state_dict(checkpoint)  # sets the entry aside, then is killed before its next checkpoint
    assert killed.journal_damaged == 1
    killed.close()
    (journal / "batch_00000000.pt").write_bytes(b"torn again")  # the same batch, damaged a second time
    again = _tiny_source(tmp_path)
    again.load_state_dict(checkpoint)
    try:
        assert again.journal_damaged == 2 and again.metrics()["runtime/journal_damaged"] == 2
        assert sorted(p.name for p in journal.glob("*.damaged")) == ["batch_00000000.1.damaged",
                                                                     "batch_00000000.damaged"]
        again.restored = 3  # as if this resume restored three batches: the next checkpoint carries them
        state = again.state_dict()
    finally:
        again.close()
    later = _tiny_source(tmp_path)
    later.load_state_dict(state)
    try:
        assert (later.restored, later.journal_damaged) == (3, 2)
    finally:
        later.close()


def test_a_worker_that_cannot_be_restarted_ends_the_run_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34, item 2: the multiprocessing fork server (it starts every rollout worker) killed mid-run.
    Its workers die with it and the restart's connection to it is refused; before, the run ended through
    a raw ``the receiver thread failed: Traceback ... ConnectionRefusedError``. Now one line names what
    died and the resume command (``copc train`` prints it as its ``error:`` line, exit 1; nothing is
    removed, so the checkpoints stay). A worker is killed and the fork server's refusal injected."""
    import multiprocessing.context

    source = _tiny_source(tmp_path)
    source.start()
    try:
        source.next_batch(0)
        pid = source.workers.pid(0)  # type: ignore[attr-defined]

        def refused(self: object) -> None:
            raise ConnectionRefusedError(111, "Connection refused")

        monkeypatch.setattr(multiprocessing.context.ForkServerProcess, "start", refused)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RolloutError) as err:
            for step in range(1, 50):
                source.next_batch(step)
    finally:
        monkeypatch.undo()
        source.close()
    message = str(err.value)
    assert "Traceback" not in message and len(message.splitlines()) == 1, message
    assert "worker fork server" in message and "ConnectionRefusedError" in message, message
    assert f"resume=true run_dir={tmp_path / 'run'}" in message, message


def test_a_silent_worker_is_warned_about_then_restarted(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 34, item 3: a worker stopped (SIGSTOP) stalled the run for as long as it was stopped, without
    a word (up to driver.batch_timeout_s, 3600 s). Now a warning after silent_warn_s (what, how long),
    a restart after silent_restart_s, counted in runtime/worker_restarts."""
    source = _tiny_source(tmp_path, silent_warn_s=1.0, silent_restart_s=3.0)
    source.start()
    try:
        pid = source.workers.pid(0)  # type: ignore[attr-defined]
        os.kill(pid, signal.SIGSTOP)  # holding batch 0 (assigned at start)
        started = time.monotonic()
        batch, _ = source.next_batch(0)
        waited = time.monotonic() - started
    finally:
        source.close()
    err = capsys.readouterr().err
    assert re.search(rf"warning: rollout worker 0 \(pid {pid}\) has been stopped \(SIGSTOP\?\) for \d+ s "
                     r"while generating batch 0", err), err
    assert "silent while generating batch 0" in err and "driver.silent_worker_restart_s=3" in err, err
    assert source.metrics()["runtime/worker_restarts"] == 1
    assert batch.index == 0 and waited >= 3.0
    # on by default
    assert DriverConfig().silent_worker_warn_s > 0 and DriverConfig().silent_worker_restart_s > 0
    with pytest.raises(ValueError,
                       match=r"silent_worker_restart_s=30 must be above driver.silent_worker_warn_s=60"):
        DriverConfig(silent_worker_warn_s=60, silent_worker_restart_s=30)
    with pytest.raises(ValueError, match=r"driver.silent_worker_warn_s must be finite"):
        DriverConfig(silent_worker_warn_s=-1)


# ------------------------------------------------------------------------------------ journal
def test_damaged_journal_entries_are_detected_and_named(tmp_path: Path) -> None:
    from copc.rollout.generator import GeneratedBatch
    from copc.runtime.buffer import encode_batch

    journal = Journal(tmp_path)
    payload = encode_batch(GeneratedBatch(index=3, version=1, trajectories=[], generate_s=0.5))
    journal.write(3, payload)
    assert journal.read(3).version == 1
    raw = journal.path(3).read_bytes()
    for damage in (raw[:-7], raw[:-1] + bytes([raw[-1] ^ 1]), b"PK\x03\x04" + raw[4:], b""):
        journal.path(3).write_bytes(damage)
        with pytest.raises(JournalDamage, match=r"journal file .*batch_00000003\.pt is damaged"):
            journal.read(3)
    journal.write(4, payload)  # holds batch 3 under the name of batch 4
    with pytest.raises(JournalDamage, match="holds batch 3, not 4"):
        journal.read(4)


# ---------------------------------------------------------------------------------- full disk
@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Path:
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip() or 'not root'})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_disk_is_one_line_and_keeps_the_previous_checkpoint(small_tmpfs: Path) -> None:
    """Issue 18, defect 8: torch said ``[enforce fail at inline_container.cc:672]``."""
    run_dir = small_tmpfs / "run"
    save_checkpoint(run_dir, 1, {"w": torch.zeros(1000)})
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(run_dir, 2, {"w": torch.zeros(1 << 20)})  # 4 MiB on a 2 MiB disk
    message = str(err.value)
    assert len(message.splitlines()) == 1
    assert f"no space left on device at {run_dir}" in message and "step_00000001 is intact" in message
    assert list_checkpoints(run_dir) == [1]
    latest = load_latest(run_dir)
    assert latest is not None and latest[0] == 1
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    journal = Journal(run_dir / "rollouts")
    with pytest.raises(JournalError, match=r"^no space left on device at .*batch_00000000\.pt$"):
        journal.write(0, bytes(3 << 20))
    assert journal.indices() == []


def test_a_full_disk_in_a_weights_file_is_one_line_and_keeps_the_previous_checkpoint(
    small_tmpfs: Path,
) -> None:
    """The safetensors writer reports its own error type; the checkpoint still says which file and why."""
    run_dir = small_tmpfs / "run"
    save_checkpoint(run_dir, 1, {"policy": Weights({"w": torch.zeros(1000)})})
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(run_dir, 2, {"policy": Weights({"w": torch.zeros(1 << 20)})})  # 4 MiB on 2 MiB
    message = str(err.value)
    assert len(message.splitlines()) == 1
    assert re.search(r"no space left on device at \S+policy\.safetensors; the previous checkpoint "
                     r"step_00000001 is intact$", message), message
    assert list_checkpoints(run_dir) == [1]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    latest = load_latest(run_dir)
    assert latest is not None and torch.equal(latest[1]["policy"]["w"], torch.zeros(1000))  # type: ignore[index]


# ------------------------------------------------------------------------ run dirs and resume
TINY = [
    "model.policy=tiny", "task_options={train_size: 100, eval_size: 8}", "steps=2", "checkpoint_every=1",
    "rollout.prompts_per_batch=2", "rollout.group_size=2", "rollout.max_new_tokens_per_turn=8",
    "rollout.max_total_tokens=12", "eval.prompts=2", "eval.samples=1", "driver.kind=sync",
    "trainer.critic_warmup_steps=0", "plots=false",
]


def cli(run_dir: Path, *extra: str) -> int:
    return train_cli(["--no-progress", f"run_dir={run_dir}", *TINY, *extra])


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, lines
    return lines[0]


def logged_steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines(
        ) if "loss/value" in x]


def test_run_dirs_are_never_reused_or_resumed_by_accident(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 18, defect 5: reuse, fallback, all corrupt, resume without run_dir or with other settings."""
    run = tmp_path / "run"
    assert cli(run) == 0
    capsys.readouterr()
    assert cli(run) == 2 and "already holds a run" in one_error_line(capsys)
    assert train_cli(["--no-progress", *TINY, "resume=true"]) == 2
    assert "resume=true needs run_dir" in one_error_line(capsys)
    assert cli(run, "resume=true", "method=ppo") == 2
    assert "method=" in one_error_line(capsys)
    assert cli(run, "resume=true", "rollout.group_size=4") == 2
    assert "rollout.group_size=2" in one_error_line(capsys)
    # The latest checkpoint corrupt: resume falls back to the older one and says so; no step twice.
    state = run / "checkpoints" / "step_00000002" / "state.pt"
    state.write_bytes(state.read_bytes()[:-100])
    assert cli(run, "resume=true", "steps=3") == 0
    err = capsys.readouterr().err
    assert "falling back" in err and "step 1" in err, err
    assert logged_steps(run) == [0, 1, 2]
    # Every checkpoint corrupt: an error, not a silent restart from step 0.
    for path in (run / "checkpoints").glob("step_*/state.pt"):
        path.write_bytes(b"junk")
    assert cli(run, "resume=true", "steps=3") == 1
    assert "every checkpoint" in one_error_line(capsys)
    assert logged_steps(run) == [0, 1, 2]
    # Its checkpoints removed altogether: refused too (it retrained from step 0 over metrics and summary).
    shutil.rmtree(run / "checkpoints")
    summary = (run / "summary.json").read_bytes()
    assert cli(run, "resume=true", "steps=3") == 1
    assert "summary.json" in one_error_line(capsys)
    assert logged_steps(run) == [0, 1, 2] and (run / "summary.json").read_bytes() == summary
    # overwrite=true replaces the run (fresh metrics).
    assert cli(run, "overwrite=true") == 0
    capsys.readouterr()
    assert logged_steps(run) == [0, 1]


def test_a_folder_copc_did_not_make_is_never_overwritten(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """CLI review item 20: run_dir=<a project folder> overwrite=true removed the folder's own config.yaml and
    plots/ (they share names with what copc writes)."""
    project = tmp_path / "project"
    (project / "plots").mkdir(parents=True)
    (project / "config.yaml").write_text("mine: 1\n")
    (project / "plots" / "figure.png").write_bytes(b"png")
    for extra in ((), ("overwrite=true",)):
        assert cli(project, *extra) == 2
        line = one_error_line(capsys)
        assert "not a copc run directory" in line and "config.yaml" in line, line
    assert cli(project, "resume=true") == 2  # refused too: the folder's config.yaml is not a run config
    assert "config.yaml" in one_error_line(capsys)
    assert (project / "config.yaml").read_text() == "mine: 1\n" and (project / "plots" / "figure.png").exists(
        )
    assert sorted(p.name for p in project.iterdir()) == ["config.yaml", "plots"]
    run = tmp_path / "run"  # a run copc made is still replaced by overwrite=true
    assert cli(run) == 0
    assert cli(run, "overwrite=true") == 0
    # as a run made before .lock existed, without a checkpoint: its config.yaml tells
    (run / ".lock").unlink()
    shutil.rmtree(run / "checkpoints")
    assert cli(run, "overwrite=true") == 0


def test_a_refused_resume_names_where_the_differing_value_came_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """CLI review item 14: without an override, the message blamed one (--config, a missing config.yaml)."""
    run = tmp_path / "run"
    assert cli(run) == 0
    capsys.readouterr()
    other = tmp_path / "other.yaml"
    other.write_text("method: ppo\n")
    assert train_cli(["--no-progress", "--config", str(other), f"run_dir={run}", *TINY, "resume=true"]) == 2
    line = one_error_line(capsys)
    assert "method=" in line and "--config" in line and "resume=true run_dir=" in line, line
    (run / "config.yaml").unlink()
    assert train_cli(["--no-progress", f"run_dir={run}", "resume=true"]) == 2
    line = one_error_line(capsys)
    assert "config.yaml is missing" in line and "embedded default" in line, line
    assert logged_steps(run) == [0, 1]


def test_weights_only_checkpoints_are_smaller_and_resume_with_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 17: checkpoint_optimizer=false keeps weights (safetensors) but no AdamW moments."""
    full, lean = tmp_path / "full", tmp_path / "lean"
    assert cli(full) == 0 and cli(lean, "checkpoint_optimizer=false") == 0

    def sizes(run: Path) -> dict[str, int]:
        return {p.name: p.stat().st_size for p in (run / "checkpoints" / "step_00000002").iterdir()}

    # The driver's snapshot of version 2 is the trained policy: stored once (source.snapshots.2 -> it).
    assert sorted(sizes(full)) == ["meta.json", "state.pt", "trainer.critic.safetensors",
                                   "trainer.policy.safetensors"]
    assert sizes(lean)["trainer.policy.safetensors"] == sizes(full)["trainer.policy.safetensors"]
    weights = sizes(full)["trainer.policy.safetensors"] + sizes(full)["trainer.critic.safetensors"]
    assert sizes(lean)["state.pt"] < 0.05 * weights  # counters, RNG, config: no tensor of model size
    assert sizes(full)["state.pt"] > 1.99 * weights  # AdamW's two moments per weight
    a, b = (load_latest(run)[1]["trainer"]["policy"] for run in (full, lean))  # type: ignore[index]
    assert sorted(a) == sorted(b) and all(torch.equal(a[k],
                                                      b[k]) for k in a)  # type: ignore[index,union-attr]
    capsys.readouterr()
    assert cli(lean, "resume=true", "steps=3", "checkpoint_optimizer=false") == 0
    assert "no optimizer state (checkpoint_optimizer=false)" in capsys.readouterr().err
    assert logged_steps(lean) == [0, 1, 2]


def test_resume_before_the_first_checkpoint_logs_each_step_once(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert cli(run) == 0
    for path in (run / "checkpoints").iterdir():  # as if killed after two steps, before any checkpoint
        subprocess.run(["rm", "-rf", str(path)], check=True)
    (run / "summary.json").unlink()  # written only by a run that finished (with it: refused, test above)
    assert cli(run, "resume=true") == 0
    assert "no checkpoint yet" in capsys.readouterr().err
    assert logged_steps(run) == [0, 1]
    evals = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines(
        ) if "eval/accuracy" in x]
    assert evals == [0, 2]


def files_of(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def test_resume_continues_the_run_as_configured_and_keeps_its_history(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 35 item 2 and issue 34 case 1: ``resume=true run_dir=R`` alone continues R with R's own config
    (here not the default: a tiny model, sync driver, small batches), says from which step; steps below the
    finished ones are refused with R unchanged; the earlier final evaluation and wall time are kept."""
    run = tmp_path / "run"
    assert cli(run) == 0
    first = json.loads((run / "summary.json").read_text())
    before = files_of(run)
    capsys.readouterr()
    bare = ["--no-progress", f"run_dir={run}", "resume=true"]
    assert cli(run, "resume=true", "steps=1") == 2  # it used to evaluate step 2's weights as "step 1"
    line = one_error_line(capsys)
    assert "already trained 2 steps" in line and "give steps >= 2" in line, line
    assert files_of(run) == before
    assert train_cli([*bare, "steps=3", "seed=1"]) == 2  # changes what the run computes
    assert "seed=0" in one_error_line(capsys) and files_of(run) == before
    assert train_cli([*bare, "steps=3", "eval.samples=2"]) == 0
    out, err = capsys.readouterr()
    assert "note: 'before' was evaluated with the run's earlier settings" in " ".join(out.split())
    assert f"resuming {run} from the checkpoint of step 2" in err
    # evaluations may change on resume, but the summary says that 'before' was made with the earlier ones
    assert "note: the evaluation settings differ from the run's (eval.samples 1 -> 2)" in err
    assert logged_steps(run) == [0, 1, 2]
    evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "eval/accuracy" in x]
    assert [e["step"] for e in evals] == [0, 2, 3]  # the first process's final evaluation (step 2) kept
    kept = next(e for e in evals if e["step"] == 2)
    assert kept == [json.loads(x) for x in before["metrics.jsonl"].decode().splitlines(
        ) if "eval/accuracy" in x][-1]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["wall_seconds_this_process"] > 0
    assert summary["eval_changed_on_resume"] == {"step": 2, "change": "eval.samples 1 -> 2"}
    assert summary["wall_seconds"] == pytest.approx(
        first["wall_seconds"] + summary["wall_seconds_this_process"],
                                                    abs=0.5)
    # the run's figures are the whole run's (its metrics.jsonl), not the steps this process trained
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"reward/mean"' in x]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert summary["step_seconds_median"] == pytest.approx(float(np.median([r["time/step"] for r in rows])))
    assert summary["train_reward_last"] == pytest.approx(rows[-1]["reward/mean"])
    assert train_cli([*bare, "steps=3"]) == 0  # resumed at its end: nothing trained now, the figures stay
    again = json.loads((run / "summary.json").read_text())
    for key in ("step_seconds_median", "train_reward_last", "realized_staleness_mean"):
        assert again[key] == summary[key], key


def test_the_summarys_realized_staleness_is_the_whole_runs(tmp_path: Path) -> None:
    """Audit of 2026-12-04: ``realized_staleness_mean`` was the mean of the last fifth of the steps (as
    ``train_reward_last``), not the whole run's that its name and docs/reliability.md give."""
    from types import SimpleNamespace

    from copc.run.config import default_config
    from copc.run.train import _summary

    lags = [min(step, 64) for step in range(150)]  # fixed lag 64 reached after a ramp
    rows = [{"step": i, "reward/mean": 0.5, "staleness/mean": float(x), "time/step": 1.0} for i,
            x in enumerate(lags)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = _summary(default_config(), {}, {}, SimpleNamespace(steps=150), 1.0,
                       tmp_path)  # type: ignore[arg-type]
    assert summary["realized_staleness_mean"] == pytest.approx(sum(lags) / len(lags))


def test_resume_of_a_run_dir_that_does_not_exist_is_refused(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 34, case 9: a mistyped run_dir with resume=true used to start a new run there."""
    assert cli(tmp_path / "typo", "resume=true") == 2
    line = one_error_line(capsys)
    assert "no run to resume" in line and "drop resume=true" in line, line
    assert not (tmp_path / "typo").exists()


def test_copc_eval_names_the_step_it_evaluates_and_what_it_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 34, cases 2 and 8: a damaged latest checkpoint was passed over silently; a run dir without
    a checkpoint was called 'not an HF folder'."""
    run = tmp_path / "run"
    assert cli(run) == 0
    weights = run / "checkpoints" / "step_00000002" / "trainer.policy.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    capsys.readouterr()
    samples = tmp_path / "samples.jsonl"
    args = ["--checkpoint", str(run), "--prompts", "2", "--samples", "1", "--no-greedy"]
    assert eval_cli([*args, "--samples-out", str(samples), "--samples-limit", "1"]) == 0
    out, err = capsys.readouterr()
    assert "the checkpoint of step 1" in out and "step 2 is damaged" in out, out
    skipped = [x for x in err.splitlines() if x.startswith("warning: skipped")]
    assert len(
        skipped) == 1 and "step_00000002" in skipped[0] and "trainer.policy.safetensors" in skipped[0], err
    assert [json.loads(x)["step"] for x in samples.read_text().splitlines()] == [1]
    subprocess.run(["rm", "-rf", str(run / "checkpoints")], check=True)  # as if no checkpoint was written yet
    assert eval_cli(args) == 2
    line = one_error_line(capsys)
    assert "has no checkpoint yet" in line and f"resume=true run_dir={run}" in line, line


# ---------------------------------------------------------------------------------- bad values
def test_non_finite_settings_and_weights_stop_the_run(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 18, defect 6: actor_lr=inf trained NaN weights and exited 0."""
    assert cli(tmp_path / "a", "trainer.actor_lr=inf") == 2
    assert "trainer.actor_lr" in one_error_line(capsys)
    # A finite learning rate whose first update turns the loss into nan.
    assert cli(tmp_path / "b", "trainer.actor_lr=1e30", "checkpoint_every=1") == 1
    assert "not finite" in one_error_line(capsys)
    assert list_checkpoints(tmp_path / "b") == []  # nothing non-finite was saved


def test_bad_rows_are_one_line_with_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 18, defect 7."""
    good = json.dumps({"problem": "What is 2+2?", "answer": "4"})
    cases = {
        "utf8.jsonl": (good + "\n\n" + '{"problem": "caf\xe9", "answer": "1"}\n').encode("latin-1"),
        "empty.jsonl": b"\n\n",
        "bool.jsonl": (good + "\n" + json.dumps({"problem": "p", "answer": True}) + "\n").encode(),
        "long.jsonl": (good + "\n" + json.dumps({"problem": "x " * 400, "answer": "1"}) + "\n").encode(),
    }
    expected = {
        "utf8.jsonl": r"utf8\.jsonl, line 3: not valid UTF-8 \(byte 0xe9",
        "empty.jsonl": r"empty\.jsonl holds no rows",
        "bool.jsonl": r"bool\.jsonl, line 2: column 'answer' holds the bool true",
        "long.jsonl": r"long\.jsonl, line 2: prompt is \d+ tokens, >= rollout\.context_limit=512 \(1 of 2",
    }
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        code = train_cli(["--no-progress", f"run_dir={tmp_path / name}.run", "task=math_tool",
                          f"task_options={{data: {path}}}", "rollout.context_limit=512",
                          *[o for o in TINY if not o.startswith("task_options")]])
        assert code == 2, name
        line = one_error_line(capsys)
        assert re.search(expected[name], line), line


# ------------------------------------------------------------------- issue 10, defect 1 (async)
def test_prompts_that_fill_the_context_do_not_hang_the_async_driver() -> None:
    """Every prompt has >= context_limit tokens: each episode ends with zero sampled tokens. The buffer
    used to drop them, so the batch held B - 1 and next_batch waited forever; now batch 0 arrives whole
    (rows without action tokens), and the loop refuses to train on it with a clear error."""
    from copc.models import build_tiny_model, build_tiny_tokenizer
    from copc.rollout.generator import GeneratedBatch

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"copc-faults-tiny-{os.getpid()}"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    rollout = RolloutConfig(prompts_per_batch=2, group_size=2, max_turns=1, max_new_tokens_per_turn=4,
                            max_total_tokens=4, context_limit=4)
    spec = WorkerSpec(model_path=str(folder), task="arith_tool", task_options={"train_size": 50,
                                                                               "eval_size": 4},
                      rollout=rollout, seed=0)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for mode in ("fixed_lag", "bounded"):
        source = AsyncSource(spec, StalenessConfig(mode=mode, staleness=0), weights)  # type: ignore[arg-type]
        source.start()
        try:
            batch, _ = source.next_batch(0)
        finally:
            source.close()
        assert isinstance(batch, GeneratedBatch)
        assert len(batch.trajectories) == rollout.batch_size
        assert all(t.num_action_tokens == 0 for t in batch.trajectories)
        assert source.metrics()["buffer/empty_kept"] == rollout.batch_size


def test_the_loop_refuses_to_train_on_zero_tokens() -> None:
    """The sync driver trained on a batch of empty episodes without a word (issue 18, defect 7)."""
    from copc.channels.methods import get_method
    from copc.models import build_tiny_model, build_tiny_tokenizer
    from copc.models.hf import ValueModel
    from copc.rollout.generator import RolloutGenerator
    from copc.runtime.loop import RunError, run_loop
    from copc.runtime.sync import SyncSource
    from copc.tasks import get_task
    from copc.trainer.trainer import ActorCriticTrainer

    tokenizer = build_tiny_tokenizer()
    policy = build_tiny_model(tokenizer, seed=0)
    task = get_task("arith_tool", train_size=50, eval_size=4)
    rollout = RolloutConfig(prompts_per_batch=2, group_size=2, max_turns=1, max_new_tokens_per_turn=4,
                            max_total_tokens=4, context_limit=4)
    source = SyncSource(RolloutGenerator(build_tiny_model(tokenizer, seed=0), tokenizer, task, rollout,
                                         seed=0),
                        StalenessConfig(mode="fixed_lag", staleness=0))
    source.publish(0, {k: v.detach().clone() for k, v in policy.state_dict().items()})
    trainer = ActorCriticTrainer(policy, ValueModel.from_policy(policy), get_method("copc"), TrainerConfig())
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    with pytest.raises(RunError, match="none of the 4 trajectories of batch 0 has a sampled token"):
        run_loop(trainer, source, start_step=0, steps=1, pad_id=int(tokenizer.pad_token_id))
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())


def test_a_stop_signal_waits_for_the_end_of_the_step_and_a_second_one_does_not() -> None:
    from copc.runtime.loop import Interrupted, StopSignals

    signals = StopSignals()
    with pytest.raises(Interrupted) as between:
        signals._handle(signal.SIGTERM, None)  # between steps: at once, the state is consistent
    assert between.value.clean and between.value.signal_name == "SIGTERM"
    signals = StopSignals()
    finished = []
    with pytest.raises(Interrupted) as inside, signals.step():
        signals._handle(signal.SIGINT, None)  # inside a step: noted, the step goes on
        finished.append(True)
    assert finished and inside.value.clean
    signals = StopSignals()
    with pytest.raises(Interrupted) as twice, signals.step():
        signals._handle(signal.SIGINT, None)
        signals._handle(signal.SIGINT, None)
    assert not twice.value.clean


# ------------------------------------------- issue 34, cases 4, 10, 12: read-only dirs, model context, full
# disk
def _mount_tmpfs(where: Path, options: str) -> Iterator[Path]:
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip() or 'not root'})")
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture
def read_only_fs(tmp_path: Path) -> Iterator[Path]:
    """A read-only filesystem (a tmpfs mounted ``ro``): unlike ``chmod``, it stops root too."""
    yield from _mount_tmpfs(tmp_path / "ro", "ro,size=1m")


def test_a_read_only_run_dir_or_cache_is_one_line(read_only_fs: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a traceback from claimed_run_dir (``OSError: [Errno 30] Read-only file system``)."""
    assert cli(read_only_fs / "run") == 2
    line = one_error_line(capsys)
    assert f"run_dir {read_only_fs / 'run'} is not writable (Read-only file system)" in line
    assert "writable filesystem" in line
    monkeypatch.setenv("COPC_CACHE", str(read_only_fs / "cache"))  # the warm start would be built there
    started = time.monotonic()
    assert cli(read_only_fs.parent / "run", "model.policy=warmstart") == 2
    line = one_error_line(capsys)
    assert f"the warm-start cache {read_only_fs / 'cache'}" in line and "set COPC_CACHE to a writable" in line
    assert time.monotonic() - started < 60  # refused before the warm start's SFT, not after it


def test_a_prompt_longer_than_the_models_context_is_refused(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Before: rollout.context_limit=8000 on a model of 2048 positions took a 2,200-token prompt and trained
    on it. Now the limit is capped by max_position_embeddings (said once on stderr) and the prompt refused."""
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"problem": "What is 2+2?", "answer": "4"}) + "\n"
                    + json.dumps({"problem": "x " * 1100, "answer": "1"}) + "\n")
    code = train_cli(["--no-progress", f"run_dir={tmp_path / 'run'}", "task=math_tool",
                      f"task_options={{data: {data}}}",
                      "rollout.context_limit=8000", *[o for o in TINY if not o.startswith("task_options")]])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("note: rollout.context_limit=8000 is above the model's own context "
                     "(max_position_embeddings=2048); episodes are limited to 2048 tokens") == 1
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and re.search(
        r"long\.jsonl, line 2: prompt is \d+ tokens, >= the model's own context "
                                          r"of 2048 tokens \(max_position_embeddings; "
                                          r"rollout\.context_limit=8000 "
                                          r"is capped to it\)", errors[0]), errors
    # issue 34 (7): an input error found while the run is built leaves no run directory behind, so the
    # corrected command is not refused with "already holds a run"
    assert not (tmp_path / "run").exists()


def test_the_capped_context_limit_is_what_episodes_get(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A run of rollout.context_limit=8000 trains and evaluates with 2048-token episodes; its config keeps
    8000."""
    import copc.run.train as train_module

    seen: list[int] = []
    real = train_module.evaluate

    def spy(*args: object, **kwargs: object) -> dict[str, float]:
        seen.append(args[3].context_limit)  # type: ignore[attr-defined]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(train_module, "evaluate", spy)
    cfg = config(tmp_path / "run", driver="sync", steps=1, rollout=replace(config(tmp_path).rollout,
                                                                           context_limit=8000))
    result = train(cfg, show_progress=False)
    assert seen == [2048, 2048]
    assert "context_limit: 8000" in (result.run_dir / "config.yaml").read_text()


class _FullAfter:
    """A metrics file whose ``write`` fails as a full disk does (ENOSPC, no file name) from the
    ``fail_at``-th training record on."""

    def __init__(self, handle: IO[str], fail_at: int) -> None:
        self.handle, self.fail_at, self.records = handle, fail_at, 0

    def write(self, text: str) -> int:
        self.records += "loss/value" in text
        if self.records >= self.fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.handle.write(text)

    def __getattr__(self, name: str) -> object:
        return getattr(self.handle, name)


def test_a_full_disk_names_the_file_and_what_was_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``error: no space left on device at RUN_DIR`` (the directory: a failed write carries no file
    name), nothing on what was kept."""
    import copc.run.tracker

    opened = copc.run.tracker.Tracker.__init__

    def init(self: copc.run.tracker.Tracker, *args: object, **kwargs: object) -> None:
        opened(self, *args, **kwargs)  # type: ignore[arg-type]
        self._file = _FullAfter(self._file, fail_at=2)  # type: ignore[arg-type,assignment]

    monkeypatch.setattr(copc.run.tracker.Tracker, "__init__", init)
    run = tmp_path / "run"
    assert cli(run, "steps=3") == 1
    line = one_error_line(capsys)
    assert line == (
        f"error: no space left on device at {run / 'metrics.jsonl'}; the checkpoint of step 1 is kept; "
                    f"free space, then continue with copc train resume=true run_dir={run}")
    assert list_checkpoints(run) == [1]


@pytest.fixture
def tmpfs_2200k(tmp_path: Path) -> Iterator[Path]:
    """Room for the tiny model's 1.8 MiB initial weights and a little more."""
    yield from _mount_tmpfs(tmp_path / "tmpfs", "size=2200k")


def test_a_disk_filled_by_the_journal_says_what_was_kept(tmpfs_2200k: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """checkpoint_every=0: the journal keeps every batch of the run until the disk is full; whichever write
    fails then (a journal entry, metrics, TensorBoard's events) is named, with no checkpoint kept."""
    run = tmpfs_2200k / "run"
    assert cli(run, "driver.kind=async", "checkpoint_every=0", "steps=400", "eval.prompts=0") == 1
    line = one_error_line(capsys)
    found = re.match(
        r"error: (rollout journal: )?no space left on device at (\S+); no checkpoint was written yet; "
                     r"free space, then start again \(copc train resume=true run_dir=(\S+) starts at step "
                     r"0\); "
                     r"checkpoint_every=N keeps the rollout journal \(rollouts/\) to N steps of batches$",
                     line)
    assert found, line
    assert Path(found.group(2)).parent.is_relative_to(run) and Path(found.group(2)).name != run.name  # a file
    assert found.group(3) == str(run)
    assert rollout_workers() == []


def test_a_resume_from_a_checkpoint_before_an_evaluation_writes_its_samples_once(tmp_path: Path) -> None:
    """An evaluation logged at the step a mid-run resume starts from is redone by the resumed run, so its
    samples are dropped with the redone steps (before, the samples of the killed process's evaluation were
    kept as if it were a finished run's final one, and ``samples.jsonl`` held them twice)."""
    schedule = ["steps=4", "checkpoint_every=2", "eval.every=3", "samples.every=1"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert cli(straight, *schedule) == 0
    assert cli(killed, *schedule) == 0
    checkpoints = killed / "checkpoints"
    # as if killed after the evaluation of step 2, before step 4's
    shutil.rmtree(checkpoints / "step_00000004")
    (checkpoints / "latest").write_text("step_00000002\n")
    assert cli(killed, *schedule, "resume=true") == 0

    def samples(run: Path) -> list[tuple[int, str]]:
        return [(r["step"], r["source"]) for r in map(json.loads,
                                                      (run / "samples.jsonl").read_text().splitlines())]

    assert samples(killed) == samples(straight)
    assert (2, "eval") in samples(straight) and samples(straight).count((2, "eval")) == samples(
        straight).count((0, "eval"))
    evals = [[json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines(
        ) if "eval/accuracy" in x]
             for run in (straight, killed)]
    assert evals[0] == evals[1] == [0, 2, 4]


def _eval_samples(run: Path) -> dict[int, int]:
    counts: dict[int, int] = {}
    for r in map(json.loads, (run / "samples.jsonl").read_text().splitlines()):
        if r["source"] == "eval":
            counts[r["step"]] = counts.get(r["step"], 0) + 1
    return counts


def _eval_steps(run: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines(
        ) if "eval/accuracy" in x]


def _as_if_killed_before(run: Path, step: int, latest: int) -> None:
    checkpoints = run / "checkpoints"
    shutil.rmtree(checkpoints / f"step_{step:08d}")
    (checkpoints / "latest").write_text(f"step_{latest:08d}\n")


def test_a_continued_run_killed_before_its_first_checkpoint_writes_each_evaluation_once(
        tmp_path: Path) -> None:
    """A finished run (2 steps) continued to 4 with an evaluation after update 3, logged at step 2 where the
    first process's final evaluation is: killed before step 4's checkpoint and resumed from step 2's, it
    redoes that evaluation, and only the first process's final one is kept (found by a review, 2026-12-04:
    the redone evaluation's samples were written twice)."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    schedule = ["checkpoint_every=2", "eval.every=3"]
    for run in (straight, killed):
        assert cli(run, *schedule) == 0
        assert cli(run, "resume=true", "steps=4", *schedule) == 0
    _as_if_killed_before(killed, 4, latest=2)
    assert cli(killed, "resume=true", "steps=4", *schedule) == 0
    assert _eval_samples(killed) == _eval_samples(straight) == {0: 2, 2: 4, 4: 2}
    assert _eval_steps(killed) == _eval_steps(straight)


def test_a_run_resumed_to_its_checkpoint_then_continued_keeps_that_final_evaluation(tmp_path: Path) -> None:
    """Killed at a mid-run checkpoint (step 4 of 6), finished there by a resume with steps=4 (nothing to
    train, no new checkpoint: the final evaluation of step 4), then continued to 6: the evaluation of step 4
    stays, as in any run continued past its end (found by a review, 2026-12-04: it was dropped)."""
    run = tmp_path / "run"
    assert cli(run, "steps=6", "checkpoint_every=2") == 0
    _as_if_killed_before(run, 6, latest=4)
    assert cli(run, "resume=true", "steps=4") == 0
    assert _eval_steps(run) == [0, 4]
    assert cli(run, "resume=true", "steps=6") == 0
    assert _eval_steps(run) == [0, 4, 6] and _eval_samples(run) == {0: 2, 4: 2, 6: 2}
