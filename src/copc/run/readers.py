"""What a reader of a run directory (``copc eval``, ``copc export``, ``copc plot``, ``copc sweep --report``)
says about the state it found, since a run may be training beside it or have been killed mid-write:
which checkpoint it read and why, the partial checkpoints and torn records it passed over (one note
each), and whether the run is training now.

Nothing here changes what is read: checkpoints are read only when complete
(:func:`copc.trainer.checkpoint.load_latest`), records only when whole (:func:`copc.tracking.read_metrics`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

#: The lock file ``copc train`` holds (flock) on its run directory while it runs (copc.run.build, not
#: imported here: it loads torch and transformers, which ``copc plot`` does without).
LOCK_NAME = ".lock"

__all__ = ["checkpoint_phrase", "partial_checkpoint_notes", "record_notes", "run_progress", "run_state"]


def run_state(run_dir: Path) -> str:
    """``training now (pid N)``, ``finished`` or ``not training (stopped or killed before its end)``."""
    holder = _holder(run_dir / LOCK_NAME)
    if holder is not None:
        return f"training now (pid {holder})" if holder > 0 else "training now"
    if (run_dir / "summary.json").is_file():
        return "finished"
    return "not training (stopped or killed before its end)"


def _holder(lock: Path) -> int | None:
    """The pid holding ``lock`` (-1: held, pid unknown), or None when no process holds it. Read from
    ``/proc/locks`` so that the reader never takes the lock itself (a ``copc train`` starting that moment
    would find its run directory in use); elsewhere, a held lock is told by trying it."""
    try:
        info = os.stat(lock)
    except OSError:
        return None
    key = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return _try_lock(lock)
    for line in lines:
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == key:
            return int(fields[4]) if fields[4].isdigit() else -1
    return None


def _try_lock(lock: Path) -> int | None:
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return -1
    else:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def partial_checkpoint_notes(run_dir: Path) -> list[str]:
    """One note per checkpoint directory still being written, or left so by a kill (never read)."""
    from copc.trainer.checkpoint import checkpoint_root

    root = checkpoint_root(run_dir)
    partial = sorted(root.glob(".tmp-step_*")) if root.is_dir() else []
    return [f"note: skipped {path}: a checkpoint being written, or cut short by a kill (not read)"
            for path in partial]


def checkpoint_phrase(run_dir: Path, step: int, skipped: list[str]) -> str:
    """Why checkpoint ``step`` is the one read, for a reader that asked for the newest: the newest
    complete one, or an older one and why (newer ones damaged, or one not yet named by ``latest``)."""
    from copc.trainer.checkpoint import list_checkpoints

    newer = [s for s in list_checkpoints(run_dir) if s > step]
    if not newer:
        return "the newest complete checkpoint"
    if skipped:
        return f"the newest that verifies: step {newer[-1]} is damaged, see above"
    return (f"the checkpoint `latest` named, which a resume continues from; step {newer[-1]} is newer: "
            "written since, or complete but not yet named by `latest` when its writer stopped")


def record_notes(path: Path) -> list[str]:
    """One note per line of a ``metrics.jsonl`` that is not a whole record (a line being written, or cut
    by a kill; ``read_metrics`` skips it)."""
    notes = []
    with path.open(errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if not isinstance(record, dict):
                notes.append(f"note: {path}: line {number} is not a whole record (being written, or cut "
                             "short by a kill); skipped")
    return notes


def run_progress(run_dir: Path) -> str:
    """Whether the run is training, and its newest checkpoint (a ``step_*`` directory is complete by
    construction; not hashed here, so that a report over many large runs stays quick)."""
    from copc.trainer.checkpoint import list_checkpoints

    steps = list_checkpoints(run_dir)
    newest = f"newest checkpoint: step {steps[-1]}" if steps else "no checkpoint yet"
    return f"{run_state(run_dir)}; {newest}"
