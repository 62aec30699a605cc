"""Sandbox uids leased machine-wide, so that no two live runs anywhere on the machine share one.

A lease is an exclusive ``flock`` on ``<uid>.lock`` in one directory shared by every process of the
machine (``/run/copc-sandbox/uids`` for root). The kernel drops the lock when the holder dies, however
it dies, so a lease can never leak and never be held twice: two processes (Ray workers, two trainers,
a test run beside a training run) always get distinct uids, whatever their pids.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import tempfile

UID_RANGE = 65536
_SPREAD = random.SystemRandom()


def lease_dir() -> str:
    """The machine-wide directory of lease files (created 0700 on first use)."""
    base = "/run/copc-sandbox" if os.geteuid() == 0 and os.path.isdir("/run") else tempfile.gettempdir()
    path = os.path.join(base, "uids" if base.startswith("/run") else f"copc-sandbox-uids-{os.geteuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def lease_is_free(uid: int) -> bool:
    """True when no process holds the lease of ``uid`` (checked by taking and dropping it)."""
    try:
        fd = os.open(os.path.join(lease_dir(), f"{uid}.lock"), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


class UidLeases:
    """``count`` distinct uids from ``[uid_base, uid_base + 65536)``, held until :meth:`release`."""

    def __init__(self, uid_base: int, count: int) -> None:
        directory = lease_dir()
        self._fds: dict[int, int] = {}
        # Spread callers out (fewer locked files to skip) with the OS's randomness: the global ``random``
        # is seeded by training runs, so every run of one seed would try the same uids first.
        start = _SPREAD.randrange(UID_RANGE)
        for offset in range(UID_RANGE):
            if len(self._fds) == count:
                break
            uid = uid_base + (start + offset) % UID_RANGE
            fd = os.open(os.path.join(directory, f"{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            self._fds[uid] = fd
        if len(self._fds) < count:
            self.release()
            raise OSError(f"only {len(self._fds)} of {count} sandbox uids are free in [{uid_base}, "
                          f"+{UID_RANGE})")

    @property
    def uids(self) -> list[int]:
        return sorted(self._fds)

    def release(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
