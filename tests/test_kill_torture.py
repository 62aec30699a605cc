"""The kill torture with a small N (``benchmarks/kill_torture.py``; docs/reliability.md reports the full
runs): ``copc train`` SIGKILLed at random moments and resumed until it finishes must equal the
uninterrupted run (sync) or lose and repeat no batch (async)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kill_torture.py"


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("driver", ["sync", "async"])
def test_random_kills_resume_to_the_same_run(tmp_path: Path, driver: str) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--kills", "3", "--driver", driver, "--steps", "6",
                           "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=1100)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert last == "kills=3 divergences=0 lost=0 duplicated=0", done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_an_interrupted_torture_resumes_where_it_stopped(tmp_path: Path) -> None:
    """A second invocation with --resume counts the runs the first finished, reuses its reference and
    goes on to --kills in all; kills aimed at checkpoint writes (--schedule writes)."""
    common = [sys.executable, str(SCRIPT), "--driver", "sync", "--steps", "4", "--schedule", "writes",
              "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    first = subprocess.run([*common, "--kills", "1"], capture_output=True, text=True, timeout=550)
    assert first.stdout.strip().splitlines()[-1] == "kills=1 divergences=0 lost=0 duplicated=0", first.stderr
    done = len((tmp_path / "out" / "runs.jsonl").read_text().splitlines())
    second = subprocess.run([*common, "--kills", "2", "--resume"], capture_output=True, text=True,
                            timeout=550)
    lines = second.stdout.strip().splitlines()
    assert f"; {done} runs recorded before" in lines[0], second.stdout
    assert lines[-1] == "kills=2 divergences=0 lost=0 duplicated=0", second.stdout + second.stderr
    assert len((tmp_path / "out" / "kills.jsonl").read_text().splitlines()) == 2
