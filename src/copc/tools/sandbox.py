"""A Python sandbox for model-written code (tool-integrated reasoning).

Every call runs the code in a *fresh* interpreter started with ``subprocess`` (never a fork of the
trainer), under these layers, outermost first (``docs/sandbox.md`` has the threat model):

1. **Wall clock**, enforced by the caller's thread with a deadline on a ``selectors`` loop; at the
   deadline the whole process group is sent SIGKILL. No signals or alarms in the caller, so it is safe
   under threads, asyncio and Ray.
2. **Linux namespaces** via ``unshare`` (when available): a new network namespace (only a downed
   loopback: no network at all), a new PID namespace (the code cannot see or signal the caller; when the
   namespace's init exits every process in it dies), a new mount namespace with private tmpfs over the
   world-writable directories (``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``).
3. **An unprivileged uid** (when the caller is root): a uid from a private range, unique per concurrent
   run, so file permissions protect the host and ``RLIMIT_NPROC`` is actually enforced (it is not for
   root). Leftover processes of that uid are killed after each run.
4. **rlimits**: CPU seconds, address space, file size, process count, open files, no core dumps.
5. **A clean environment** (no variable of the caller is passed), isolated interpreter (``-I -S``),
   a temporary working directory removed afterwards, output read through pipes with a byte cap. Work
   directories live under one parent per caller process (``copc-sbx-<pid>-*``); parents left by a
   caller killed with SIGKILL are removed by the next sandbox created on the machine.

Which layers are actually in force on this machine is measured once by running a probe program through
the same pipeline: :func:`active_protections`.

The process machinery (bootstrap program, namespace probing, sandbox uids, work directories, output
pumping) lives in :mod:`copc.tools.sandbox_isolation`; this module holds the user-facing side.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass

# The process machinery lives in sandbox_isolation; ``_session_dir`` and ``reap_orphan_workdirs`` stay
# importable from here.
from copc.tools.sandbox_isolation import (
    _BOOTSTRAP,
    _UID_POOL,
    _WORLD_WRITABLE_DIRS,
    _Ended,
    _kill_uid,
    _pick_python,
    _pump,
    _session_dir,
    _unshare_prefix,
)
from copc.tools.sandbox_isolation import reap_orphan_workdirs as reap_orphan_workdirs  # re-export


@dataclass(frozen=True)
class SandboxConfig:
    """Limits for one run of model-written code. All limits apply to every run."""

    timeout_s: float = 5.0
    """Wall-clock limit in seconds, enforced by the caller (kills the whole process group)."""
    cpu_s: int | None = None
    """CPU-time limit in whole seconds (RLIMIT_CPU; SIGXCPU, then SIGKILL a second later); None = ceil(timeout_s)."""
    memory_mb: int = 512
    """Address-space limit in MiB (RLIMIT_AS); allocations beyond it raise MemoryError."""
    max_output_bytes: int = 4096
    """Bytes kept from each of stdout and stderr; the rest is discarded with a marker."""
    max_file_bytes: int = 16 * 1024 * 1024
    """Largest file the code may write (RLIMIT_FSIZE), in bytes."""
    max_procs: int = 32
    """Processes + threads the sandbox uid may own (RLIMIT_NPROC); enforced only for a non-root uid."""
    max_open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    tmpfs_mb: int = 64
    """Size of each private tmpfs (/tmp, /var/tmp, ...) inside the mount namespace, in MiB."""
    network: bool = False
    """Allow network access. False puts the code in a new network namespace (when available)."""
    namespaces: bool = True
    """Use Linux namespaces (network, PID, mount) when ``unshare`` works here; False disables them."""
    drop_privileges: bool = True
    """When the caller is root, run the code as an unprivileged uid from ``uid_base``."""
    uid_base: int = 200_000
    """First uid of the private range (``uid_base + [0, 65536)``); must not belong to real users."""
    python_executable: str = ""
    """Interpreter for the code; "" picks one the sandbox uid can execute (sys.executable or python3)."""
    site_packages: bool = False
    """Let the code import the interpreter's site-packages (drops ``-S``); stdlib only by default."""

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str]] = [
            (0 < self.timeout_s <= 3600, f"timeout_s={self.timeout_s} must be in (0, 3600] seconds"),
            (self.cpu_s is None or 1 <= self.cpu_s <= 3600, f"cpu_s={self.cpu_s} must be None or an integer in [1, 3600]"),
            (32 <= self.memory_mb <= 1 << 20, f"memory_mb={self.memory_mb} must be in [32, 1048576]"),
            (self.max_output_bytes >= 64, f"max_output_bytes={self.max_output_bytes} must be >= 64"),
            (self.max_file_bytes >= 1024, f"max_file_bytes={self.max_file_bytes} must be >= 1024"),
            (1 <= self.max_procs <= 4096, f"max_procs={self.max_procs} must be in [1, 4096]"),
            (16 <= self.max_open_files <= 65536, f"max_open_files={self.max_open_files} must be in [16, 65536]"),
            (1 <= self.tmpfs_mb <= 65536, f"tmpfs_mb={self.tmpfs_mb} must be in [1, 65536]"),
            (1000 <= self.uid_base <= 2**31 - 65536, f"uid_base={self.uid_base} must be in [1000, 2**31-65536]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"SandboxConfig: {message}; fix the value in your config")
        if self.python_executable and not os.path.isfile(self.python_executable):
            raise ValueError(
                f"SandboxConfig: python_executable={self.python_executable!r} is not a file; "
                'give an absolute path to a python3 binary or "" to pick one automatically'
            )


    @property
    def cpu_limit_s(self) -> int:
        """The CPU-time limit in force: ``cpu_s``, or the wall timeout rounded up."""
        return self.cpu_s if self.cpu_s is not None else max(1, math.ceil(self.timeout_s))


@dataclass(frozen=True)
class SandboxResult:
    """What one run produced. ``error`` is None only when the code exited 0 with untruncated output."""

    stdout: str
    stderr: str
    #: Exit status of the code; None when it was killed (timeout or signal) or never started.
    exit_code: int | None
    timed_out: bool
    #: Short human message: "timeout after 5.0s", "memory limit", "killed by signal 9 (SIGKILL)" ...
    error: str | None
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.error is None


def format_observation(result: SandboxResult, max_chars: int = 2000) -> str:
    """The text fed back to the model: stdout, then stderr, then the tool error, at most ``max_chars``.

    When too long, the head and the tail are kept (a traceback's useful line is last) around a marker.
    """
    if max_chars < 64:
        raise ValueError(f"format_observation: max_chars={max_chars} must be >= 64")
    parts = [result.stdout.rstrip("\n")]
    if result.stderr.strip():
        parts.append(result.stderr.rstrip("\n"))
    if result.error is not None:
        parts.append(f"[tool error: {result.error}]")
    text = "\n".join(p for p in parts if p)
    if len(text) <= max_chars:
        return text
    marker = f"\n[... {len(text) - max_chars} chars truncated ...]\n"
    keep = max_chars - len(marker)
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head) :]


# --------------------------------------------------------------------------------------------------
# Running code.


def _describe(ended: _Ended, config: SandboxConfig) -> tuple[int | None, str | None]:
    """(exit_code, error message) from how the run ended; the message is short and for people."""
    status, stderr = ended.status, ended.stderr.kept.decode("utf-8", errors="replace")
    truncated = bool(ended.stdout.dropped or ended.stderr.dropped)
    if ended.timed_out:
        return None, f"timeout after {config.timeout_s}s"
    if "setup_error" in status:
        return None, f"sandbox setup failed: {status['setup_error']}"
    if "signal" in status:
        sig = int(status["signal"])
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and "MemoryError" not in stderr and not truncated):
            hint = f" (cpu time limit {config.cpu_limit_s}s)" if sig == signal.SIGXCPU else ""
            return None, f"killed by signal {sig} ({name}){hint}"
        if sig == signal.SIGXFSZ:
            return None, f"file size limit ({config.max_file_bytes} bytes)"
        return None, f"killed by signal {sig} ({name})"
    if "exit" not in status:
        return None, "sandbox ended without a status (killed from outside?)"
    code = int(status["exit"])
    if "MemoryError" in stderr:
        return code, f"memory limit ({config.memory_mb} MB)"
    if "[Errno 27] File too large" in stderr:  # Python ignores SIGXFSZ, so the write fails with EFBIG
        return code, f"file size limit ({config.max_file_bytes} bytes)"
    if code != 0:
        last = [line for line in stderr.strip().splitlines() if line.strip()]
        detail = f": {last[-1].strip()[:200]}" if last else ""
        return code, f"exit code {code}{detail}"
    if truncated:
        return code, f"output truncated to {config.max_output_bytes} bytes"
    return code, None


class PythonSandbox:
    """Runs model-written Python code under the limits of a :class:`SandboxConfig`. Thread-safe."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._drop_uid = self.config.drop_privileges and os.geteuid() == 0
        self._python = _pick_python(self.config, self._drop_uid)
        self._prefix = _unshare_prefix(self.config)

    def run(self, code: str) -> SandboxResult:
        """Run ``code`` as a script in a fresh interpreter; never raises for anything the code does."""
        start = time.monotonic()
        try:
            with contextlib.ExitStack() as stack:
                uid = stack.enter_context(_UID_POOL.slot(self.config.uid_base)) if self._drop_uid else None
                workdir = stack.enter_context(
                    tempfile.TemporaryDirectory(prefix="run-", dir=_session_dir(), ignore_cleanup_errors=True)
                )
                self._prepare_workdir(workdir, code, uid)
                ended = self._launch(workdir, uid, start)
        except OSError as exc:  # the machine, not the code: out of pids, fds, disk ...
            message = f"sandbox setup failed: {type(exc).__name__}: {exc}"
            return SandboxResult("", "", None, False, message, time.monotonic() - start)
        exit_code, error = _describe(ended, self.config)
        return SandboxResult(
            stdout=ended.stdout.text(),
            stderr=ended.stderr.text(),
            exit_code=exit_code,
            timed_out=ended.timed_out,
            error=error,
            duration_s=time.monotonic() - start,
        )

    def active_protections(self) -> dict[str, bool]:
        """Which protections are in force for this config on this machine (probed once, cached)."""
        return active_protections(self.config)

    def _prepare_workdir(self, workdir: str, code: str, uid: int | None) -> None:
        script = os.path.join(workdir, "main.py")
        # errors="replace": a lone surrogate in generated text becomes "?" (then maybe a SyntaxError
        # the model can read) instead of an exception in the caller.
        with open(script, "w", encoding="utf-8", errors="replace") as handle:
            handle.write(code)
        if uid is not None:
            for path in (workdir, script):
                os.chown(path, uid, uid)

    def _launch(self, workdir: str, uid: int | None, start: float) -> _Ended:
        cfg = self.config
        read_fd, write_fd = os.pipe()
        params = {
            "status_fd": write_fd,
            "workdir": workdir,
            "tmpfs_dirs": list(_WORLD_WRITABLE_DIRS) if self._prefix else [],
            "tmpfs_kb": cfg.tmpfs_mb * 1024,
            "uid": uid,
            "gid": uid,
            "python": self._python,
            "argv": [self._python, "-I", *([] if cfg.site_packages else ["-S"]), "-B", "-X", "utf8", "main.py"],
            "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"},
            # (name, soft, hard): the CPU soft limit sends SIGXCPU (reported as such), the hard one SIGKILL.
            "rlimits": [
                ("RLIMIT_CPU", cfg.cpu_limit_s, cfg.cpu_limit_s + 1),
                ("RLIMIT_AS", cfg.memory_mb << 20, cfg.memory_mb << 20),
                ("RLIMIT_FSIZE", cfg.max_file_bytes, cfg.max_file_bytes),
                ("RLIMIT_NPROC", cfg.max_procs, cfg.max_procs),
                ("RLIMIT_NOFILE", cfg.max_open_files, cfg.max_open_files),
                ("RLIMIT_CORE", 0, 0),
            ],
        }
        command = [*self._prefix, self._python, "-I", "-S", "-c", _BOOTSTRAP, json.dumps(params)]
        try:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(write_fd,),
                start_new_session=True,
                env={"PATH": "/usr/bin:/bin"},
                cwd=workdir,
            )
        except OSError:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        try:
            return _pump(proc, read_fd, start + cfg.timeout_s, cfg.max_output_bytes)
        finally:
            os.close(read_fd)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            assert proc.stdout is not None and proc.stderr is not None
            proc.stdout.close()
            proc.stderr.close()
            if uid is not None:
                _kill_uid(uid)


# --------------------------------------------------------------------------------------------------
# What is actually in force here: measured by running a probe through the real pipeline.

_PROBE = r"""
import json, os, resource, socket, time
status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
no_caps = int(status["CapEff"].split()[0], 16) == 0 and int(status["CapPrm"].split()[0], 16) == 0
uid_map = [l.split() for l in open("/proc/self/uid_map")]
host_uid = next(int(h) + os.getuid() - int(i) for i, h, n in map(lambda r: r[:3], uid_map)
                if int(i) <= os.getuid() < int(i) + int(n))
names = [n for _, n in socket.if_nameindex()]
def lim(name, want):
    return resource.getrlimit(getattr(resource, name))[0] == want
def fork_capped(limit):
    # Fork sleeping children until fork fails; the limit holds when it fails at or before `limit`.
    children, capped = [], False
    for _ in range(limit + 4):
        try:
            pid = os.fork()
        except OSError:
            capped = True
            break
        if pid == 0:
            time.sleep(5)
            os._exit(0)
        children.append(pid)
    for pid in children:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    return capped
print(json.dumps({
    "unprivileged_uid": host_uid not in (0, __CALLER_UID__) and os.getuid() != 0,
    "no_capabilities": no_caps and host_uid != 0,
    "network_namespace": names == ["lo"],
    "pid_namespace": not os.path.exists("/proc/%d" % __PARENT_PID__),
    "private_tmp": not os.path.exists("__MARKER__"),
    "clean_environment": set(os.environ) <= {"PATH", "LC_ALL", "LANG", "HOME", "LC_CTYPE"},
    "rlimit_cpu": lim("RLIMIT_CPU", __CPU__),
    "rlimit_as": lim("RLIMIT_AS", __AS__),
    "rlimit_fsize": lim("RLIMIT_FSIZE", __FSIZE__),
    "rlimit_nproc": lim("RLIMIT_NPROC", __NPROC__) and fork_capped(__NPROC__),
}))
"""

_PROTECTIONS_CACHE: dict[SandboxConfig, dict[str, bool]] = {}
_PROTECTIONS_LOCK = threading.Lock()


def active_protections(config: SandboxConfig | None = None) -> dict[str, bool]:
    """Run a probe in the sandbox once per config and report which protections hold, by name.

    Keys: ``wall_timeout`` and ``output_cap`` (enforced by the caller: always True), ``clean_environment``,
    ``rlimit_cpu``, ``rlimit_as``, ``rlimit_fsize`` (the limit is set), ``rlimit_nproc`` (measured:
    forking past ``max_procs`` fails; the kernel ignores it for host root), ``unprivileged_uid`` (the
    code runs as its own uid: neither root, on the host or in its namespace, nor the caller's uid),
    ``no_capabilities`` (no capabilities and not host root), ``network_namespace`` (only loopback; False also when ``network=True``),
    ``pid_namespace`` (the caller's pid is invisible), ``private_tmp`` (a file the caller made in /tmp is
    invisible). A probe that fails reports every kernel protection as False.
    """
    config = config or SandboxConfig()
    with _PROTECTIONS_LOCK:
        if config in _PROTECTIONS_CACHE:
            return dict(_PROTECTIONS_CACHE[config])
    with tempfile.NamedTemporaryFile(prefix="copc-sbx-marker-") as marker:
        source = (
            _PROBE.replace("__PARENT_PID__", str(os.getpid()))
            .replace("__CALLER_UID__", str(os.geteuid()))
            .replace("__MARKER__", marker.name)
            .replace("__CPU__", str(config.cpu_limit_s))
            .replace("__AS__", str(config.memory_mb * 1024 * 1024))
            .replace("__FSIZE__", str(config.max_file_bytes))
            .replace("__NPROC__", str(config.max_procs))
        )
        result = PythonSandbox(config).run(source)
    keys = (
        "unprivileged_uid",
        "no_capabilities",
        "network_namespace",
        "pid_namespace",
        "private_tmp",
        "clean_environment",
        "rlimit_cpu",
        "rlimit_as",
        "rlimit_fsize",
        "rlimit_nproc",
    )
    try:
        probed = json.loads(result.stdout) if result.ok else {}
    except ValueError:
        probed = {}
    found = {"wall_timeout": True, "output_cap": True} | {k: bool(probed.get(k, False)) for k in keys}
    with _PROTECTIONS_LOCK:
        _PROTECTIONS_CACHE[config] = found
    return dict(found)
