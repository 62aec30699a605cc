"""The kill torture with a small N (``benchmarks/kill_torture.py``; docs/reliability.md reports the full runs):
``copc train`` SIGKILLed at random moments and resumed until it finishes must equal the uninterrupted run
(sync) or lose and repeat no batch (async)."""

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
