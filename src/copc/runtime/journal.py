"""The rollout journal: finished batches on disk until a checkpoint covers them.

One file per batch, ``rollouts/batch_XXXXXXXX.pt``: a magic line, the sha256 of the payload, then the
payload (:func:`~copc.runtime.buffer.encode_batch` bytes). It is written to a temp file, ``fsync``-ed
and renamed (``os.replace``), so a kill never leaves a half-written entry under the final name; a file
damaged anyway (a disk error, a hand edit, an older format) fails its hash or its decoding and is
reported by :meth:`Journal.read` as :class:`JournalDamage` naming the file, so the driver generates
that batch again instead of refusing to resume.

A failing write (disk full, a directory in the way, permissions) raises :class:`JournalError` with one
line naming the path: the driver ends the run with it rather than losing the batch silently.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from copc.rollout.generator import GeneratedBatch
from copc.runtime.buffer import decode_batch

__all__ = ["Journal", "JournalDamage", "JournalError", "describe_os_error"]

_MAGIC = b"copc-journal-1\n"
_HASH_BYTES = 32


class JournalError(RuntimeError):
    """A journal entry could not be written (the message is one line naming the path)."""


class JournalDamage(ValueError):
    """A journal entry on disk is damaged (the message names the file and what is wrong)."""


def describe_os_error(err: OSError, path: Path) -> str:
    """One line for a failed write: ``no space left on device at PATH`` for ENOSPC, else the OS reason."""
    if err.errno == errno.ENOSPC:
        return f"no space left on device at {path}"
    return f"cannot write {path}: {err.strerror or err}"


class Journal:
    """Journal files of one run directory (module docstring)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, index: int) -> Path:
        return self.directory / f"batch_{index:08d}.pt"

    def write(self, index: int, payload: bytes) -> None:
        """Write batch ``index`` atomically (raises :class:`JournalError`)."""
        final = self.path(index)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        try:
            with tmp.open("wb") as handle:
                handle.write(_MAGIC + hashlib.sha256(payload).digest() + payload)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, final)
        except OSError as err:
            _remove(tmp)
            raise JournalError(describe_os_error(err, final)) from None

    def indices(self) -> list[int]:
        """Batch indices with a journal file, ascending."""
        out = []
        for path in self.directory.glob("batch_*.pt"):
            try:
                out.append(int(path.stem.split("_")[1]))
            except (IndexError, ValueError):
                continue
        return sorted(out)

    def read(self, index: int) -> GeneratedBatch:
        """Batch ``index`` from disk; raises :class:`JournalDamage` naming the file if it is damaged."""
        path = self.path(index)
        try:
            data = path.read_bytes()
        except OSError as err:
            raise JournalDamage(f"journal file {path} cannot be read ({err.strerror or err})") from None
        head = len(_MAGIC) + _HASH_BYTES
        if not data.startswith(_MAGIC) or len(data) < head:
            raise JournalDamage(f"journal file {path} is damaged (no copc journal header)")
        payload = data[head:]
        if hashlib.sha256(payload).digest() != data[len(_MAGIC) : head]:
            raise JournalDamage(f"journal file {path} is damaged (its sha256 does not match)")
        try:
            batch = decode_batch(payload)
        except Exception as err:  # a damaged payload can fail in pickle, zip or torch)
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise JournalDamage(f"journal file {path} is damaged ({first})") from None
        if batch.index != index:
            raise JournalDamage(f"journal file {path} holds batch {batch.index}, not {index}")
        return batch

    def set_aside(self, index: int) -> Path:
        """Rename a damaged entry to ``*.damaged`` (kept for inspection, never read again; a batch damaged
        again later gets ``*.1.damaged``, ``*.2.damaged``, ...: none is overwritten)."""
        path = self.path(index)
        target, n = path.with_suffix(".damaged"), 0
        while target.exists():
            n += 1
            target = path.with_suffix(f".{n}.damaged")
        os.replace(path, target)
        return target

    def damaged(self) -> list[Path]:
        """The entries set aside as damaged over the run (a fresh run's :meth:`clear` removes them)."""
        return sorted(self.directory.glob("batch_*.damaged"))

    def prune(self, consumed_before: int) -> None:
        """Delete entries ``< consumed_before`` (a checkpoint covers them)."""
        for index in self.indices():
            if index < consumed_before:
                _remove(self.path(index))

    def remove_temps(self) -> None:
        """Delete temp files a killed writer left (call before any writer of this run starts)."""
        for tmp in self.directory.glob(".batch_*.tmp-*"):
            _remove(tmp)

    def clear(self) -> None:
        """Delete every entry (a fresh run must not pick up batches of an earlier attempt)."""
        for path in self._entries():
            if path.is_file():  # a directory in the way is not ours: leave it (a write there fails loudly)
                _remove(path)

    def _entries(self) -> Iterator[Path]:
        yield from self.directory.glob("batch_*")
        yield from self.directory.glob(".batch_*")


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass
