"""``Runner``: runs model-written code in a warm, jailed fork server, one isolated child per run.

:class:`~copc.tools.sandbox.python_sandbox.PythonSandbox` is the public face (it refuses to start
without the required protections); the probe uses a ``Runner`` directly.

Per sandbox (lazily, and again if it dies): machine-wide uid leases (one per concurrent run), a cgroup
per uid slot, and the fork server under ``bwrap``. Per run: a slot (bounded wait: its uid and its
cgroup, empty since the slot's previous run's namespace emptied), a memfd with
the code and three pipes, handed to the server; the caller's thread reads the pipes until the run's
status arrives or ``timeout_s + 0.5`` s pass after the launch, then returns. Everything else (the kill of a
run that overran, waiting for its namespace to empty, releasing its slot) happens on the
listener thread or in the kernel, off the caller's path. ``docs/sandbox.md`` has the threat model.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from copc.tools.sandbox.cgroups import CgroupPool, open_pool
from copc.tools.sandbox.config import Fault, SandboxConfig, SandboxResult, SandboxUnavailable
from copc.tools.sandbox.identity import UidLeases
from copc.tools.sandbox.jail import CGROUP_MOUNT, bwrap_command, find_bwrap, find_interpreter, seccomp_program
from copc.tools.sandbox.pool import Ended, ForkServer, Slots, pump

#: Seconds the caller waits past ``timeout_s`` for the run's own report before giving up on it.
BACKSTOP_S = 0.5
SERVER_START_TIMEOUT_S = 60.0
ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8", "HOME": "/tmp"}

_RUN_IDS = itertools.count(1)
T = TypeVar("T")


class _OwnerThread:
    """One thread per process that lives as long as the process and starts every fork server.

    bwrap's ``--die-with-parent`` (``PR_SET_PDEATHSIG``) fires when the *thread* that started it exits,
    not the process. The first tool call of a round usually runs on a thread pool's thread, which ends
    with the round: a server started there died after every round (measured: a new server per round of
    tool calls). Started from here, it lives until the process ends (or the sandbox closes it).
    """

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue[tuple[Callable[[], object], Future[object]]] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="copc-sandbox-owner", daemon=True).start()

    def _serve(self) -> None:
        while True:
            call, result = self.calls.get()
            try:
                result.set_result(call())
            except BaseException as exc:  # handed to the caller, who raises it
                result.set_exception(exc)


_OWNER: _OwnerThread | None = None
_OWNER_LOCK = threading.Lock()


def _forget_owner() -> None:
    """In a forked child: the parent's owner thread does not exist here, and its lock may be held."""
    global _OWNER, _OWNER_LOCK
    _OWNER, _OWNER_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_owner)


def on_owner_thread(call: Callable[[], T], timeout_s: float = 2 * SERVER_START_TIMEOUT_S) -> T:
    """``call()`` run on this process's owner thread (:class:`_OwnerThread`); its result or its exception
    (:class:`SandboxUnavailable` when it has not returned within ``timeout_s``)."""
    global _OWNER
    with _OWNER_LOCK:
        if _OWNER is None:
            _OWNER = _OwnerThread()
        owner = _OWNER
    result: Future[object] = Future()
    owner.calls.put((call, result))
    try:
        return result.result(timeout=timeout_s)  # type: ignore[return-value]
    except FutureTimeout:
        raise SandboxUnavailable(f"the sandbox fork server was not started within {timeout_s:.0f}s") from None


class Runner:
    """Runs code under the limits of a :class:`SandboxConfig`, with whatever protections it gets.
    Thread-safe."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._parts: _Parts | None = None

    def run(self, code: str) -> SandboxResult:
        """Run ``code`` as a script; never raises for anything the code does. Waits at most ``timeout_s``
        for a free slot, then returns within ``timeout_s + 0.5`` s of the launch (plus reading the pipes):
        the wait for a slot never shortens the code's own wall time."""
        start = time.monotonic()
        for attempt in (1, 2):  # a second time only when the fork server was found dead
            try:
                parts = self._get_parts()
            except (OSError, SandboxUnavailable) as exc:
                return _infra(f"sandbox could not start: {exc}", start)
            got, uid = parts.slots.acquire(max(0.0, start + self.config.timeout_s - time.monotonic()))
            if not got:
                return _infra(f"machine overloaded: no free sandbox slot within {self.config.timeout_s}s",
                              start)
            run_id = next(_RUN_IDS)
            before = parts.cgroups.limit_events(_group(uid)) if parts.cgroups else {}
            try:
                ended = self._launch(parts, run_id, uid, code)
            except OSError as exc:  # the machine, not the code: out of pids, fds, memory ...
                parts.finish(run_id, uid, None)
                if attempt == 1 and not parts.server.alive:
                    continue
                return _infra(f"sandbox setup failed: {type(exc).__name__}: {exc}", start)
            after = parts.cgroups.limit_events(_group(uid)) if parts.cgroups else {}
            hits = {name: after[name] - before.get(name, 0) for name in after}
            return describe(ended, self.config, hits.get("oom_kill", 0), time.monotonic() - start,
                            limit_hits=hits)
        raise AssertionError("unreachable")

    def uids(self) -> list[int]:
        """The uids this sandbox holds leases on (empty before its first run, or when uids are not
        dropped)."""
        parts = self._parts
        return parts.leases.uids if parts is not None and parts.leases is not None else []

    def cgroups_reason(self) -> str:
        """Why this sandbox's runs have no cgroups (empty when they have, or before its first run)."""
        parts = self._parts
        return parts.cgroups_reason if parts is not None else ""

    def server_cpu_s(self) -> float:
        """CPU seconds the fork server's process tree (every run so far included) has used; 0 before it
        starts."""
        parts = self._parts
        return parts.server.cpu_s() if parts is not None else 0.0

    def close(self) -> None:
        """End the fork server and release the uids and cgroups (also done when the process exits)."""
        with self._lock:
            parts, self._parts = self._parts, None
        if parts is not None:
            parts.close()

    def _get_parts(self) -> _Parts:
        with self._lock:
            if self._parts is None or not self._parts.server.alive or self._parts.pid != os.getpid():
                if self._parts is not None and self._parts.pid == os.getpid():
                    self._parts.close()
                self._parts = _Parts(self.config)
            return self._parts

    def _launch(self, parts: _Parts, run_id: int, uid: int | None, code: str) -> Ended:
        cfg = self.config
        start = time.monotonic()
        request: dict[str, object] = {
            "uid": uid,
            "cgroup": _group(uid),
            "wall_s": cfg.timeout_s,
            "disk_kb": cfg.disk_mb * 1024,
            "max_files": cfg.max_files,
            "env": ENV,
            # (name, soft, hard): the CPU soft limit sends SIGXCPU (reported as such), the hard one SIGKILL.
            "rlimits": [
                ("RLIMIT_CPU", cfg.cpu_limit_s, cfg.cpu_limit_s + 1),
                ("RLIMIT_AS", cfg.memory_mb << 20, cfg.memory_mb << 20),
                ("RLIMIT_FSIZE", cfg.max_file_bytes, cfg.max_file_bytes),
                ("RLIMIT_NOFILE", cfg.max_open_files, cfg.max_open_files),
                ("RLIMIT_CORE", 0, 0),
                *([("RLIMIT_NPROC", cfg.max_procs, cfg.max_procs)] if uid is not None else []),
            ],
        }
        code_fd = os.memfd_create("code", os.MFD_CLOEXEC)
        pipes: list[tuple[int, int]] = []
        try:
            # errors="replace": a lone surrogate in generated text becomes "?" instead of an exception here.
            os.write(code_fd, code.encode("utf-8", errors="replace"))
            os.lseek(code_fd, 0, os.SEEK_SET)
            pipes += [os.pipe() for _ in range(3)]
            parts.server.submit(run_id, request, [code_fd, *(w for _, w in pipes)],
                                lambda error: parts.finish(run_id, uid, error))
        except OSError:
            for r, _ in pipes:
                os.close(r)
            raise
        finally:
            os.close(code_fd)
            for _, w in pipes:
                os.close(w)
        (out_r, _), (err_r, _), (status_r, _) = pipes
        try:
            ended = pump(out_r, err_r, status_r, start + cfg.timeout_s + BACKSTOP_S, cfg.max_output_bytes)
        finally:
            for fd in (out_r, err_r, status_r):
                os.close(fd)
        if not ended.status:  # no word from the run's init: end it from outside, without waiting
            parts.server.kill(run_id)
            if parts.cgroups is not None:
                parts.cgroups.kill(_group(uid))
        return ended


class _Parts:
    """What one sandbox holds while it runs: leases, cgroups, the server, the slots."""

    def __init__(self, config: SandboxConfig) -> None:
        self.pid = os.getpid()
        as_root = os.geteuid() == 0
        self.cgroups: CgroupPool | None = None
        self.cgroups_reason = "the caller is not root" if os.geteuid() else ""
        """Why ``cgroups`` is None (empty when it is not)."""
        self.leases = UidLeases(config.uid_base, config.max_concurrent) if as_root else None
        try:
            self.server = on_owner_thread(lambda: self._start(config, as_root))
        except BaseException:
            self._release()
            raise
        uids: list[int | None] = list(self.leases.uids) if self.leases else [None] * config.max_concurrent
        self.slots = Slots(uids)
        atexit.register(self.close)

    def _start(self, config: SandboxConfig, as_root: bool) -> ForkServer:
        if self.leases is not None:
            pool, self.cgroups_reason = open_pool(self.leases.uids[0])
            self.cgroups = pool
            if pool is not None:
                for uid in self.leases.uids:
                    # + 2: the run's own R and I (the sandbox's) are in the cgroup beside the code's
                    # processes.
                    pool.create_group(_group(uid), memory_bytes=config.memory_mb << 20,
                                      max_procs=config.max_procs + 2)
        interpreter = find_interpreter(config.python_executable)
        seccomp = seccomp_program()
        cgroup_dirs = {path: name for name, path in (self.cgroups.dirs.items() if self.cgroups else [])}
        bwrap = find_bwrap()
        if bwrap is not None:
            prefix = bwrap_command(bwrap, interpreter, network=config.network, as_root=as_root,
                                   site_packages=config.site_packages, cgroup_dirs=cgroup_dirs)
            inside = [f"{CGROUP_MOUNT}/{name}" for name in cgroup_dirs.values()]
            hide = list(inside)
        else:  # degraded, only when allowed by name: the server runs on the host's filesystem
            prefix, inside, hide = [], list(cgroup_dirs), []
        params: dict[str, object] = {
            "preload": list(config.preload),
            "seccomp_bpf": seccomp.hex() if seccomp else "",
            "cgroup_dirs": inside,
            "hide": hide,
            "site_paths": list(interpreter.site_dirs) if config.site_packages else [],
            "netns_per_run": not config.network,
        }
        return ForkServer(prefix, interpreter.executable, params, SERVER_START_TIMEOUT_S)

    def finish(self, run_id: int, uid: int | None, error: str | None) -> None:
        """The run's namespace is empty (or it never started, or the server died): free its slot."""
        if error is not None and self.cgroups is not None:
            self.cgroups.kill(_group(uid))  # whatever is left of it, before its uid and cgroup are reused
        self.slots.release(uid)

    def close(self) -> None:
        if os.getpid() != self.pid:  # a forked child inherited this: the parent's to close
            return
        self.server.close()
        self._release()

    def _release(self) -> None:
        if self.cgroups is not None:
            self.cgroups.close()
        if self.leases is not None:
            self.leases.release()


# --------------------------------------------------------------------------------------------------
# Whose fault, and a message for people.


def _group(uid: int | None) -> str:
    """The cgroup of a slot (cgroups exist only with leased uids, i.e. a root caller)."""
    return f"s{uid}"


def _infra(message: str, start: float) -> SandboxResult:
    return SandboxResult("", "", None, False, message, time.monotonic() - start, fault="infra")


def _signal_name(sig: int) -> str:
    return signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)


def classify(ended: Ended, config: SandboxConfig, oom_kills: int,
             limit_hits: Mapping[str, int] | None = None) -> tuple[int | None, bool, str | None, Fault]:
    """(exit_code, timed_out, error, fault) from how the run ended; the error is one short line.

    Whose fault is decided by the stage the run reached, never by how loaded the machine was: before
    the code's process said ``code_started`` (its last step before running the code) every failure is
    the sandbox's (``infra``); after it, every limit the program met (its CPU budget, the wall cap,
    memory, processes, files, output) is its own outcome (``code``). The one exception after the start
    is the sandbox's own part failing while the program had met no limit: the run's init raised, or died
    without a report (its status pipe closed: the code cannot kill it, it is the namespace's pid 1 under
    another uid; the fork server's death kills it).
    ``limit_hits``: the run's cgroup counters during the run (:meth:`CgroupPool.limit_events`).
    """
    hits = dict(limit_hits or {})
    status, stderr = ended.status, ended.stderr.kept.decode("utf-8", errors="replace")
    cpu = float(status.get("cpu_s", 0.0))  # type: ignore[arg-type]
    memory_hit = bool(oom_kills or hits.get("memory_max", 0))
    if not status.get("code_started"):  # the sandbox never got to the code: nothing of it is the code's
        if "setup_error" in status:
            return None, False, f"sandbox setup failed: {status['setup_error']}", "infra"
        if "sandbox setup failed in the code process" in stderr:
            return None, False, stderr.strip().splitlines()[-1][:300], "infra"
        return None, bool(status.get("timeout")) or not status, (
            f"sandbox did not start the code within {config.timeout_s}s (machine overloaded?)"), "infra"
    procs = f" (process limit {config.max_procs} reached)" if hits.get("pids_max", 0) else ""
    if oom_kills and (status.get("signal") == signal.SIGKILL or "exit" not in status):
        return None, False, f"memory limit ({config.memory_mb} MB for the whole run)", "code"
    if "setup_error" in status or not ("timeout" in status or "signal" in status or "exit" in status):
        if memory_hit:
            return None, False, f"memory limit ({config.memory_mb} MB for the whole run)", "code"
        if "setup_error" in status or ended.status_closed:  # the sandbox's init failed or died
            detail = status.get("setup_error") or "the run's init died without a report"
            return None, False, f"sandbox failed after the code started: {detail}", "infra"
        # The init lives but had not reported by the backstop: the code was still running at the wall cap.
        return None, True, f"timeout after {config.timeout_s}s{procs}", "code"
    if status.get("timeout"):
        return None, True, f"timeout after {config.timeout_s}s{procs}", "code"
    if "signal" in status:
        sig = int(status["signal"])  # type: ignore[call-overload]
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= config.cpu_limit_s):
            why = f"killed by signal {sig} ({_signal_name(sig)}) (cpu time limit {config.cpu_limit_s}s)"
            return None, False, why, "code"
        if sig == signal.SIGXFSZ:
            return None, False, f"file size limit ({config.max_file_bytes} bytes)", "code"
        return None, False, f"killed by signal {sig} ({_signal_name(sig)}){procs}", "code"
    code = int(status["exit"])  # type: ignore[call-overload]
    if "MemoryError" in stderr:
        return code, False, f"memory limit ({config.memory_mb} MB)", "code"
    if "[Errno 27] File too large" in stderr:  # Python ignores SIGXFSZ, so the write fails with EFBIG
        return code, False, f"file size limit ({config.max_file_bytes} bytes)", "code"
    if "[Errno 28] No space left on device" in stderr:
        return code, False, f"scratch disk full ({config.disk_mb} MB, {config.max_files} files)", "code"
    if code != 0:
        last = [line for line in stderr.strip().splitlines() if line.strip()]
        detail = f": {last[-1].strip()[:200]}" if last else ""
        return code, False, f"exit code {code}{detail}", "code"
    if ended.stdout.dropped or ended.stderr.dropped:
        return code, False, f"output truncated to {config.max_output_bytes} bytes", "code"
    return code, False, None, "none"


def describe(ended: Ended, config: SandboxConfig, oom_kills: int, duration_s: float,
             limit_hits: Mapping[str, int] | None = None) -> SandboxResult:
    exit_code, timed_out, error, fault = classify(ended, config, oom_kills, limit_hits)
    return SandboxResult(
        stdout=ended.stdout.text(),
        stderr=ended.stderr.text(),
        exit_code=exit_code,
        timed_out=timed_out,
        error=error,
        duration_s=duration_s,
        fault=fault,
        cpu_s=float(ended.status.get("cpu_s", 0.0)),  # type: ignore[arg-type]
    )
