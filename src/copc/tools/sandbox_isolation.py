"""The process machinery under :class:`~copc.tools.sandbox.PythonSandbox`: how a run is isolated.

- ``_BOOTSTRAP``: the program that runs first inside the namespaces, mounts private tmpfs, sets rlimits,
  drops to the sandbox uid and execs the code's interpreter, reporting how the code ended on a pipe;
- the launch environment, detected once per process: an interpreter the sandbox uid can run, and the
  ``unshare`` prefix giving the namespaces (probed, cached);
- the sandbox uids (a pool of distinct uids per caller process) and the killing of their leftovers;
- the per-process parent of per-run work directories, and the reaping of parents of dead callers;
- reading the child's stdout/stderr with a byte cap, and its status pipe, until it ends or times out.

``copc.tools.sandbox`` holds the user-facing side (config, result, ``PythonSandbox``, the probe).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from copc.tools.sandbox import SandboxConfig

# The bootstrap runs first inside the namespaces (as root there, when the caller is root), mounts the
# private tmpfs, then forks the code's process, which sets rlimits, drops to the sandbox uid and
# execs a fresh interpreter. The bootstrap reports how the code's process ended on a status pipe, so
# the exit code of the code is never confused with the bootstrap's own.
_BOOTSTRAP = r"""
import ctypes, json, os, resource, sys
p = json.loads(sys.argv[1])
fd = p["status_fd"]
def report(obj):
    os.write(fd, json.dumps(obj).encode())
def fail(msg):
    report({"setup_error": msg})
    os._exit(125)
libc = ctypes.CDLL(None, use_errno=True)
try:
    os.chdir(p["workdir"])
    if p["tmpfs_dirs"]:
        opts = ("size=%dk,mode=1777" % p["tmpfs_kb"]).encode()
        for d in p["tmpfs_dirs"]:
            if os.path.isdir(d) and libc.mount(b"tmpfs", d.encode(), b"tmpfs", 6, opts) != 0:
                fail("mount tmpfs on %s: errno %d" % (d, ctypes.get_errno()))
        os.mkdir("/tmp/work", 0o700)
        if libc.mount(b".", b"/tmp/work", None, 4096, None) != 0:
            fail("bind work dir: errno %d" % ctypes.get_errno())
        os.chdir("/tmp/work")
    env = dict(p["env"], HOME=os.getcwd())
except Exception as e:
    fail("%s: %s" % (type(e).__name__, e))
pid = os.fork()
if pid == 0:
    try:
        os.set_inheritable(fd, False)
        for res, soft, hard in p["rlimits"]:
            resource.setrlimit(getattr(resource, res), (soft, hard))
        dropped = False
        if p["uid"] is not None:
            try:  # a container without CAP_SETUID cannot: go on as uid 0 (the probe reports it)
                os.setgroups([])
                os.setgid(p["gid"])
                os.setuid(p["uid"])
                dropped = True
            except PermissionError:
                pass
        if not dropped:
            # Still uid 0 (root in a user namespace, or drop_privileges=False): SECBIT_NOROOT and its
            # lock (PR_SET_SECUREBITS = 28, bits 1 | 2) make execve grant no capabilities to uid 0.
            libc.prctl(28, 3, 0, 0, 0)
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: setuid binaries cannot raise privileges
        os.execve(p["python"], p["argv"], env)
    except BaseException as e:
        report({"setup_error": "%s: %s" % (type(e).__name__, e)})
        os._exit(126)
_, st = os.waitpid(pid, 0)
if os.WIFSIGNALED(st):
    report({"signal": os.WTERMSIG(st)})
else:
    report({"exit": os.WEXITSTATUS(st)})
os._exit(0)
"""

_WORLD_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_TRUNCATION_MARK = "\n[... output truncated: {n} more bytes]"
_MAX_SLOTS = 64  # concurrent runs per caller process (each gets its own uid)


# --------------------------------------------------------------------------------------------------
# Launch environment: detected once per process.


def _world_executable(path: str) -> bool:
    """True when a uid with no special rights can execute ``path`` (every directory traversable)."""
    real = os.path.realpath(path)
    if not os.path.isfile(real) or not os.stat(real).st_mode & stat.S_IXOTH:
        return False
    parent = os.path.dirname(real)
    while True:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
        if parent == os.path.dirname(parent):
            return True
        parent = os.path.dirname(parent)


def _pick_python(config: SandboxConfig, drop_uid: bool) -> str:
    if config.python_executable:
        return config.python_executable
    candidates = [sys.executable, "/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3") or ""]
    for candidate in candidates:
        if candidate and (not drop_uid or _world_executable(candidate)):
            return os.path.realpath(candidate)
    raise RuntimeError(
        "PythonSandbox: no python3 executable that an unprivileged uid can run was found; "
        "install python3 under /usr/bin or set SandboxConfig.python_executable"
    )


_UNSHARE_CACHE: dict[tuple[str, ...], bool] = {}
_UNSHARE_LOCK = threading.Lock()


def _unshare_prefix(config: SandboxConfig) -> list[str]:
    """``unshare`` arguments giving the configured namespaces, or [] when they cannot be created here."""
    unshare = shutil.which("unshare")
    if not config.namespaces or unshare is None or sys.platform != "linux":
        return []
    flags = ["--mount", "--pid", "--fork", "--kill-child", "--mount-proc"]
    if not config.network:
        flags.insert(0, "--net")
    if os.geteuid() != 0:
        flags = ["--user", "--map-root-user", *flags]
    prefix = [unshare, *flags, "--"]
    key = tuple(prefix)
    with _UNSHARE_LOCK:
        if key not in _UNSHARE_CACHE:
            try:
                probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10, env={})
                _UNSHARE_CACHE[key] = probe.returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                _UNSHARE_CACHE[key] = False
    return prefix if _UNSHARE_CACHE[key] else []


class _UidPool:
    """Hands out distinct sandbox uids to concurrent runs of this process (thread-safe).

    uid = uid_base + (pid mod 1024) * 64 + slot, so that runs of other processes on the machine (Ray
    workers ...) rarely share a uid, and so an RLIMIT_NPROC budget, with ours.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._free = list(range(_MAX_SLOTS))

    @contextlib.contextmanager
    def slot(self, uid_base: int) -> Iterator[int]:
        with self._cond:
            self._cond.wait_for(lambda: bool(self._free))
            index = self._free.pop()
        try:
            yield uid_base + (os.getpid() % 1024) * _MAX_SLOTS + index
        finally:
            with self._cond:
                self._free.append(index)
                self._cond.notify()


_UID_POOL = _UidPool()

_SESSION_PREFIX = "copc-sbx-"
_SESSION_RE = re.compile(rf"^{_SESSION_PREFIX}(\d+)-")
_SESSION_LOCK = threading.Lock()
_SESSION: tuple[int, str] | None = None  # (pid, path) of this process's parent of per-run work dirs


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_orphan_workdirs(root: str | None = None) -> list[str]:
    """Remove the sandbox work directories of processes that no longer exist; returns what was removed.

    Each process keeps its runs' work directories under one parent, ``copc-sbx-<pid>-*`` in the temp
    directory. A process killed by SIGKILL cannot clean up, so the next sandbox of any process on the
    machine removes parents whose pid is gone (a reused pid only delays the cleanup; it never deletes a
    live process's directory).
    """
    root = root or tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        match = _SESSION_RE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            path = os.path.join(root, name)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _remove_session_dir(pid: int, path: str) -> None:
    if os.getpid() == pid:  # not in a forked child that inherited the handler
        shutil.rmtree(path, ignore_errors=True)


def _session_dir() -> str:
    """This process's parent of per-run work dirs (created on first use, after reaping orphans)."""
    global _SESSION
    with _SESSION_LOCK:
        pid = os.getpid()
        if _SESSION is None or _SESSION[0] != pid or not os.path.isdir(_SESSION[1]):
            reap_orphan_workdirs()
            path = tempfile.mkdtemp(prefix=f"{_SESSION_PREFIX}{pid}-")
            os.chmod(path, 0o711)  # the sandbox uid may traverse to its own run dir, never list others
            atexit.register(_remove_session_dir, pid, path)
            _SESSION = (pid, path)
        return _SESSION[1]


def _live_pids_of_uid(uid: int) -> list[int]:
    """Host pids whose real uid is ``uid`` and that are not zombies (read from /proc)."""
    pids: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as handle:
                fields = dict(line.split(":", 1) for line in handle if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1 ").split()[0]) == uid and not fields.get("State", "").strip().startswith("Z"):
            pids.append(int(name))
    return pids


def _kill_uid(uid: int, budget_s: float = 2.0) -> None:
    """SIGKILL every process of the sandbox uid (catches code that escaped the process group)."""
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        pids = _live_pids_of_uid(uid)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)




# --------------------------------------------------------------------------------------------------
# Reading the child's pipes.


@dataclass
class _Capture:
    """Bytes kept from one pipe, and how many were discarded past the cap."""

    kept: bytearray
    dropped: int = 0

    def add(self, chunk: bytes, cap: int) -> None:
        room = max(0, cap - len(self.kept))
        self.kept.extend(chunk[:room])
        self.dropped += max(0, len(chunk) - room)

    def text(self) -> str:
        out = self.kept.decode("utf-8", errors="replace")
        return out + _TRUNCATION_MARK.format(n=self.dropped) if self.dropped else out


@dataclass(frozen=True)
class _Ended:
    """How the child run ended, as the pipes and the status channel told it."""

    stdout: _Capture
    stderr: _Capture
    status: dict[str, int | str]
    timed_out: bool


def _has_exited(pid: int) -> bool:
    """True when the child has exited, without reaping it (its pid stays reserved for ``killpg``)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _pump(proc: subprocess.Popen[bytes], status_fd: int, deadline: float, cap: int) -> _Ended:
    """Read stdout/stderr (capped) and the status pipe until the child ends or the deadline passes.

    Stops waiting for pipe EOF shortly after the child exits: an orphan that kept a pipe open must not
    hold the caller (it is killed right after).
    """
    assert proc.stdout is not None and proc.stderr is not None
    captures = {proc.stdout.fileno(): _Capture(bytearray()), proc.stderr.fileno(): _Capture(bytearray())}
    status_bytes = bytearray()
    timed_out = False
    exited_at: float | None = None
    with selectors.DefaultSelector() as selector:
        for fd in (*captures, status_fd):
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = not _has_exited(proc.pid) or not status_bytes
                break
            if _has_exited(proc.pid):
                exited_at = exited_at or now
                if now - exited_at > 0.2:
                    break
            for key, _ in selector.select(timeout=min(0.05, deadline - now)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                elif key.fd == status_fd:
                    status_bytes.extend(chunk[:4096])
                else:
                    captures[key.fd].add(chunk, cap)
    try:
        status = json.loads(status_bytes.decode()) if status_bytes else {}
    except ValueError:
        status = {"setup_error": f"unreadable status {bytes(status_bytes)[:80]!r}"}
    return _Ended(captures[proc.stdout.fileno()], captures[proc.stderr.fileno()], status, timed_out)
