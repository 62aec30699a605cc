"""The host side of the fork server: starting it, sending it runs, and reading what a run printed.

:class:`ForkServer` owns the jailed server process (see :mod:`copc.tools.sandbox.forkserver`) and a
listener thread for its ``done`` messages; :class:`Slots` hands out the leased uids to concurrent runs
with a bounded wait; :func:`pump` reads a run's stdout/stderr (capped) and status pipe until it ends
or a deadline passes. Nothing here waits without a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import selectors
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from copc.tools.sandbox.config import SandboxUnavailable

TRUNCATION_MARK = "\n[... output truncated: {n} more bytes]"
_SERVER_SOURCE = (Path(__file__).parent / "forkserver.py").read_text()

DoneCallback = Callable[[str | None], None]


class ForkServer:
    """One jailed fork server. Thread-safe; :meth:`alive` turns False if it dies (then make a new one)."""

    def __init__(self, prefix: list[str], python: str, params: dict[str, object],
                 start_timeout_s: float) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = parent
        self._send_lock = threading.Lock()
        self._pending: dict[int, DoneCallback] = {}
        self._pending_lock = threading.Lock()
        self._alive = True
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (the server's stderr, read if it fails)
        argv = [*prefix, python, "-I", "-S", "-B", "-X", "utf8", "-c", _SERVER_SOURCE,
                json.dumps(params | {"control_fd": child.fileno()})]
        try:
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log, pass_fds=(child.fileno(),
                                                                                              ),
                start_new_session=True, env={"PATH": "/usr/bin:/bin"}, cwd="/",
            )
        except OSError as exc:
            parent.close()
            raise SandboxUnavailable(f"cannot start the sandbox fork server: {exc}") from exc
        finally:
            child.close()
        if not select.select([parent], [], [], start_timeout_s)[0]:
            self.close()
            raise SandboxUnavailable(
                f"the sandbox fork server did not start within {start_timeout_s:.0f}s: {self._log_tail()}"
            )
        ready = parent.recv(1 << 16)
        if not ready or json.loads(ready).get("op") != "ready":
            self.close()
            raise SandboxUnavailable(f"the sandbox fork server failed to start: {self._log_tail()}")
        threading.Thread(target=self._listen, name="copc-sandbox-listener", daemon=True).start()

    @property
    def alive(self) -> bool:
        """False once the server is known dead: its socket closed, or its bwrap process exited."""
        return self._alive and self._proc.poll() is None

    def submit(self, run_id: int, request: dict[str, object], fds: list[int], on_done: DoneCallback) -> None:
        """Send a run with its four fds; ``on_done(error)`` is called once its namespace is empty."""
        with self._pending_lock:
            if not self._alive:
                raise OSError("the sandbox fork server is gone")
            self._pending[run_id] = on_done
        try:
            with self._send_lock:
                socket.send_fds(self._sock, [json.dumps(request | {"op": "run", "id": run_id}).encode()], fds)
        except OSError as exc:
            with self._pending_lock:
                self._pending.pop(run_id, None)
                if isinstance(exc, (BrokenPipeError, ConnectionError)):
                    self._alive = False  # the server is gone; its listener will see it too
            raise

    def cpu_s(self) -> float:
        """CPU seconds used so far by the server's whole process tree (finished runs included: each
        run's processes are reaped inside the tree, so their time adds up in the server's own)."""
        tick = os.sysconf("SC_CLK_TCK")
        total, todo = 0.0, [self._proc.pid]
        while todo:
            pid = todo.pop()
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += sum(int(v) for v in fields[11:15]) / tick  # utime stime cutime cstime
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
        return total

    def kill(self, run_id: int) -> None:
        with contextlib.suppress(OSError), self._send_lock:
            self._sock.send(json.dumps({"op": "kill", "id": run_id}).encode())

    def close(self) -> None:
        """End the server and every run in it (its PID namespace dies with it)."""
        self._alive = False
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, 9)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)
        self._log.close()

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError, ValueError):
            self._log.seek(0)
            text = self._log.read().decode("utf-8", "replace").strip()
            return text.splitlines()[-1][:300] if text else f"exit status {self._proc.poll()}"
        return "no log"

    def _listen(self) -> None:
        while True:
            try:
                message = self._sock.recv(1 << 16)
            except OSError:
                message = b""
            if not message:
                break
            event = json.loads(message)
            if event.get("op") == "done":
                with self._pending_lock:
                    callback = self._pending.pop(event["id"], None)
                if callback is not None:
                    callback(event.get("error"))
        with self._pending_lock:
            self._alive = False
            pending, self._pending = self._pending, {}
        for callback in pending.values():
            callback(f"the sandbox fork server died ({self._log_tail()})")
        with contextlib.suppress(OSError):
            self._sock.close()


class Slots:
    """Concurrent runs of one sandbox, each on its own leased uid (or None when uids are not dropped)."""

    def __init__(self, uids: list[int | None]) -> None:
        self._cond = threading.Condition()
        self._free = list(uids)

    def acquire(self, timeout_s: float) -> tuple[bool, int | None]:
        """(True, uid) for a free slot, or (False, None) when none came free within ``timeout_s``."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout=timeout_s):
                return False, None
            return True, self._free.pop()

    def release(self, uid: int | None) -> None:
        with self._cond:
            self._free.append(uid)
            self._cond.notify()


# --------------------------------------------------------------------------------------------------
# Reading a run's pipes.


@dataclass
class Capture:
    """Bytes kept from one pipe, and how many were discarded past the cap."""

    kept: bytearray
    dropped: int = 0

    def add(self, chunk: bytes, cap: int) -> None:
        room = max(0, cap - len(self.kept))
        self.kept.extend(chunk[:room])
        self.dropped += max(0, len(chunk) - room)

    def text(self) -> str:
        out = self.kept.decode("utf-8", errors="replace")
        return out + TRUNCATION_MARK.format(n=self.dropped) if self.dropped else out


@dataclass(frozen=True)
class Ended:
    """How a run ended, as its pipes and its status told it: ``status`` merges the JSON lines the run
    wrote (``code_started`` once the code was about to run, then I's report of how it ended; empty: no
    word by the deadline)."""

    stdout: Capture
    stderr: Capture
    status: dict[str, object]
    status_closed: bool = False
    """The status pipe reached end of file: the run's init (its only writer once the code runs) is gone."""


def pump(stdout_fd: int, stderr_fd: int, status_fd: int, deadline: float, cap: int) -> Ended:
    """Read stdout/stderr (capped) and the status pipe until all close, or the deadline passes.

    Once the status has come, waits at most 0.1 s more for the output pipes: the run's namespace is
    being torn down and they close right after, unless the machine is very slow.
    """
    captures = {stdout_fd: Capture(bytearray()), stderr_fd: Capture(bytearray())}
    status_bytes = bytearray()
    status_closed_at: float | None = None
    with selectors.DefaultSelector() as selector:
        for fd in (stdout_fd, stderr_fd, status_fd):
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            now = time.monotonic()
            if status_closed_at is not None:
                deadline = min(deadline, status_closed_at + 0.1)
            if now >= deadline:
                break
            for key, _ in selector.select(timeout=deadline - now):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    if key.fd == status_fd:
                        status_closed_at = time.monotonic()
                elif key.fd == status_fd:
                    status_bytes.extend(chunk[:4096])
                else:
                    captures[key.fd].add(chunk, cap)
    status: dict[str, object] = {}
    try:
        for line in status_bytes.decode().splitlines():
            if line.strip():
                status.update(json.loads(line))
    except ValueError:
        status["setup_error"] = f"unreadable status {bytes(status_bytes)[:80]!r}"
    return Ended(captures[stdout_fd], captures[stderr_fd], status, status_closed_at is not None)
