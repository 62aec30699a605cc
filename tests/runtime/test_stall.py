"""The stall watchdog (copc.runtime.stall): a phase that never ends stops the process, whether the hang
runs Python code or holds the GIL in a C call; phases that end in time, nested or paused, do not.

Every stall runs in a child process (the watchdog ends the process it runs in)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from copc.run.train import train_cli
from copc.runtime.stall import STALL_EXIT_CODE, StallWatchdog
from copc.trainer.checkpoint import list_checkpoints

TINY = [
    "model.policy=tiny", "task_options={train_size: 100, eval_size: 8}", "checkpoint_every=1",
    "rollout.prompts_per_batch=2", "rollout.group_size=2", "rollout.max_new_tokens_per_turn=8",
    "rollout.max_total_tokens=12", "eval.prompts=2", "eval.samples=1", "driver.kind=sync",
    "trainer.critic_warmup_steps=0", "plots=false",
]


def child(code: str, *args: str, limit: float = 120) -> tuple[int, str, float]:
    """Run ``code`` in a fresh interpreter; its exit status, stderr and wall seconds."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True,
                          text=True,
                          timeout=limit)
    return done.returncode, done.stderr, time.monotonic() - start


def test_a_phase_that_hangs_in_python_is_one_line_the_stacks_and_exit_124() -> None:
    rc, err, wall = child("""
        import time
        from copc.runtime.stall import StallWatchdog
        dog = StallWatchdog(1.0, resume_hint="copc train resume=true run_dir=R")
        with dog.phase("step 7"):
            time.sleep(60)
    """)
    assert rc == STALL_EXIT_CODE, err
    assert wall < 30
    first = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(first) == 1 and first[0].startswith("error: step 7 did not end within 1 s (stall_timeout_s)")
    assert "resume=true run_dir=R" in first[0]
    assert 'File "<string>", line 6 in <module>' in err  # the stuck frame (the sleep) is in the stacks


def test_a_hang_that_holds_the_gil_is_ended_by_the_c_backstop() -> None:
    """``ctypes.PyDLL`` calls keep the GIL (as a huge ``10 ** n`` does): the Python thread cannot run."""
    rc, err, wall = child("""
        import ctypes
        from copc.runtime.stall import StallWatchdog
        dog = StallWatchdog(1.0, backstop_s=1.0)
        with dog.phase("step 3"):
            ctypes.PyDLL(None).sleep(60)
    """)
    assert rc == 1, err
    assert wall < 30
    assert "Timeout (0:00:02)!" in err


def test_phases_that_end_in_time_nested_or_paused_do_not_stop_the_process() -> None:
    rc, err, _ = child("""
        import time
        from copc.runtime.stall import StallWatchdog
        dog = StallWatchdog(1.5, backstop_s=0.5)
        for step in range(2):
            with dog.phase(f"step {step}"):
                time.sleep(0.6)
                with dog.paused():          # a wait bounded elsewhere: longer than the limit
                    time.sleep(2.5)
                with dog.phase("eval"):     # each phase its own limit
                    time.sleep(1.0)
                time.sleep(1.0)             # the outer phase re-armed when eval ended
        time.sleep(2.5)                     # after the last phase: disarmed
        dog.close()
        print("ok")
    """)
    assert rc == 0, err


def test_no_limit_and_bad_limits() -> None:
    dog = StallWatchdog(0)
    with dog.phase("step 0"):
        assert not dog.enabled
    dog.close()
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="stall_timeout_s must be finite and >= 0"):
            StallWatchdog(bad)


def test_a_run_whose_env_step_hangs_stops_and_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """The whole path: ``copc train`` (sync driver) with every env step of step 1 hanging; the process
    ends with 124 naming step 1, the checkpoint of step 1 is intact, and resume finishes the run."""
    run = tmp_path / "run"
    rc, err, wall = child("""
        import sys, time
        from pathlib import Path
        import copc.rollout.episode as episode
        real = episode._step_envs
        def hang_after_step_0(*args, **kwargs):
            if (Path(sys.argv[1]) / "checkpoints" / "step_00000001").exists():
                time.sleep(600)
            return real(*args, **kwargs)
        episode._step_envs = hang_after_step_0
        from copc.run.train import train_cli
        sys.exit(train_cli(["--no-progress", f"run_dir={sys.argv[1]}", *sys.argv[2:]]))
    """, str(run), *TINY, "steps=3", "stall_timeout_s=3", limit=300)
    assert rc == STALL_EXIT_CODE, err
    assert "error: step 1 did not end within 3 s (stall_timeout_s)" in err
    assert wall < 200
    assert list_checkpoints(run) == [1]
    assert train_cli(["--no-progress", f"run_dir={run}", *TINY, "steps=3", "resume=true"]) == 0
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines(
        ) if "loss/value" in x]
    assert steps == [0, 1, 2]


def test_stall_timeout_is_checked_and_not_part_of_a_records_hash(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from copc.experiments.results import config_hash
    from copc.run.config import default_config

    assert train_cli(["--no-progress", f"run_dir={tmp_path / 'r'}", *TINY, "steps=1",
                      "stall_timeout_s=-5"]) == 2
    assert "stall_timeout_s must be finite and >= 0" in capsys.readouterr().err
    from copc.config import to_dict
    base = to_dict(default_config())
    assert config_hash({**base, "stall_timeout_s": 5.0}) == config_hash(base)  # type: ignore[dict-item]


def test_the_watchdog_pauses_only_for_a_batch_wait_with_its_own_limit() -> None:
    """The async driver's wait is bounded by driver.batch_timeout_s; with that off (0, passed as None) the
    watchdog must bound the wait itself, or a worker that hangs would hold the run for ever."""
    from copc.run.train import batch_wait_bounded
    from copc.runtime.async_local import AsyncSource
    from copc.runtime.sync import SyncSource

    def async_source(timeout: float | None) -> AsyncSource:
        source = AsyncSource.__new__(AsyncSource)  # the attribute alone: no workers are started
        source.batch_timeout_s = timeout
        return source

    assert batch_wait_bounded(async_source(3600.0))
    assert not batch_wait_bounded(async_source(None))
    assert not batch_wait_bounded(SyncSource.__new__(SyncSource))
