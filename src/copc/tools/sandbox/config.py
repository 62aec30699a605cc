"""What a sandbox run is given (:class:`SandboxConfig`) and what it gives back (:class:`SandboxResult`).

Also the names of the protections (:data:`PROTECTIONS`), the error raised when a required one is
missing (:class:`SandboxUnavailable`), and :func:`format_observation`, the text shown to the model.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

#: Whose fault a failed run was, decided by the stage the run reached, not by the machine's load.
#: ``"none"``: the code exited 0 with untruncated output. ``"code"``: the code started and failed or met
#: a limit (exception, exit code, signal, its CPU budget, memory, processes, disk or file limits, output
#: cap, the wall-clock cap however long it waited for a CPU). ``"infra"``: the sandbox failed before the
#: code started (could not start, no free slot, the fork server died, setup too slow for the wall cap),
#: or its own part failed after the code had ended without meeting a limit.
Fault = Literal["none", "code", "infra"]

#: Every protection the sandbox knows, by name, with what it means. All are required unless named in
#: ``SandboxConfig.allow_missing`` (``network_namespace`` is also waived by ``network=True``).
PROTECTIONS: dict[str, str] = {
    "minimal_filesystem": "the code sees only the interpreter, its standard library and system libraries, "
    "read-only, and its own scratch dir (no checkout, datasets, home, host /tmp)",
    "network_namespace": "no network at all: a network namespace with only a downed loopback",
    "pid_namespace": "each run is its own PID namespace: it sees no other process, and all of it dies with "
                     "it",
    "private_scratch": "each run gets a fresh tmpfs for /tmp and /dev/shm, capped in bytes and files",
    "unprivileged_uid": "the code runs as a uid leased machine-wide to this run only (never root, never "
                        "shared)",
    "no_capabilities": "the code holds no capabilities (dropped, bounding set cleared, no_new_privs)",
    "seccomp": "a seccomp filter refuses new namespaces, mounts, ptrace, bpf, kernel modules, keyrings",
    "cgroup_memory": "memory (scratch tmpfs included) is capped for the run's whole process tree by a cgroup",
    "cgroup_pids": "the number of processes and threads is capped for the run's whole process tree by a "
                   "cgroup",
    "rlimits": "per-process limits: CPU seconds, address space, file size, open files, no core dumps",
    "clean_environment": "no environment variable of the caller reaches the code",
}


#: Environment variable naming protections that may be missing (comma-separated), for tool sandboxes
#: built inside tasks, where no SandboxConfig is written by hand.
ALLOW_MISSING_ENV = "COPC_SANDBOX_ALLOW_MISSING"


def allow_missing_from_env() -> tuple[str, ...]:
    """The protections named in ``$COPC_SANDBOX_ALLOW_MISSING`` (empty: every protection is required)."""
    return tuple(name.strip() for name in os.environ.get(ALLOW_MISSING_ENV, "").split(",") if name.strip())


class SandboxUnavailable(RuntimeError):
    """A required protection is missing, or the sandbox could not be started: refusing to run code."""


@dataclass(frozen=True)
class SandboxConfig:
    """Limits for one run of model-written code, and which protections may be missing."""

    timeout_s: float = 5.0
    """Wall-clock cap of one run in seconds; ``run()`` returns by ``timeout_s + 1`` after its slot came
    free."""
    cpu_s: int | None = None
    """CPU budget of the code in whole seconds (RLIMIT_CPU per process); None = ceil(timeout_s)."""
    memory_mb: int = 512
    """Memory of the whole run (all processes, plus its scratch tmpfs) in MiB; also each process's
    RLIMIT_AS."""
    max_output_bytes: int = 4096
    """Bytes kept from each of stdout and stderr; the rest is discarded with a marker."""
    max_file_bytes: int = 16 * 1024 * 1024
    """Largest file the code may write (RLIMIT_FSIZE), in bytes."""
    max_procs: int = 32
    """Processes + threads of the whole run (cgroup pids.max; also RLIMIT_NPROC of its private uid)."""
    max_open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    disk_mb: int = 64
    """Total size of the run's scratch tmpfs (/tmp, the working directory, and /dev/shm), in MiB."""
    max_files: int = 2048
    """Files and directories the run may create in its scratch tmpfs (its inode count)."""
    network: bool = False
    """Allow network access (shares the caller's network); False gives a network namespace."""
    allow_missing: tuple[str, ...] = ()
    """Protections (names of ``PROTECTIONS``) that may be missing here; any other missing one refuses to
    start."""
    max_concurrent: int = 16
    """Runs in flight at once per sandbox; each holds one leased uid. More callers wait (up to
    ``timeout_s``)."""
    uid_base: int = 200_000
    """First uid of the private range (``uid_base + [0, 65536)``); must not belong to real users."""
    python_executable: str = ""
    """Interpreter for the code; "" = the caller's interpreter (its real binary, not a venv link)."""
    site_packages: bool = False
    """Show the interpreter's site-packages to the code (read-only); stdlib only by default."""
    preload: tuple[str, ...] = ("math", "fractions", "itertools", "functools", "collections", "decimal",
                                "statistics", "random", "re", "string", "json", "heapq", "bisect", "operator")
    """Modules the warm fork server imports once, so a run that imports them pays nothing."""

    def __post_init__(self) -> None:
        for name in ("allow_missing", "preload"):  # lists from YAML/JSON: keep the config hashable
            object.__setattr__(self, name, tuple(getattr(self, name)))
        checks: list[tuple[bool, str]] = [
            (0 < self.timeout_s <= 3600, f"timeout_s={self.timeout_s} must be in (0, 3600] seconds"),
            (self.cpu_s is None or 1 <= self.cpu_s <= 3600,
             f"cpu_s={self.cpu_s} must be None or an integer in [1, 3600]"),
            (32 <= self.memory_mb <= 1 << 20, f"memory_mb={self.memory_mb} must be in [32, 1048576]"),
            (self.max_output_bytes >= 64, f"max_output_bytes={self.max_output_bytes} must be >= 64"),
            (self.max_file_bytes >= 1024, f"max_file_bytes={self.max_file_bytes} must be >= 1024"),
            (2 <= self.max_procs <= 4096, f"max_procs={self.max_procs} must be in [2, 4096]"),
            (16 <= self.max_open_files <= 65536,
             f"max_open_files={self.max_open_files} must be in [16, 65536]"),
            (1 <= self.disk_mb <= 65536, f"disk_mb={self.disk_mb} must be in [1, 65536]"),
            (16 <= self.max_files <= 10**7, f"max_files={self.max_files} must be in [16, 10**7]"),
            (1 <= self.max_concurrent <= 1024, f"max_concurrent={self.max_concurrent} must be in [1, 1024]"),
            (1000 <= self.uid_base <= 2**31 - 65536,
             f"uid_base={self.uid_base} must be in [1000, 2**31-65536]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"SandboxConfig: {message}; fix the value in your config")
        unknown = sorted(set(self.allow_missing) - set(PROTECTIONS))
        if unknown:
            raise ValueError(
                "SandboxConfig: allow_missing names unknown "
                f"protections {unknown}; valid: {sorted(PROTECTIONS)}"
            )
        if self.python_executable and not os.path.isfile(self.python_executable):
            raise ValueError(
                f"SandboxConfig: python_executable={self.python_executable!r} is not a file; "
                'give an absolute path to a python3 binary or "" to use the caller\'s interpreter'
            )

    @property
    def cpu_limit_s(self) -> int:
        """The CPU budget in force: ``cpu_s``, or the wall cap rounded up."""
        return self.cpu_s if self.cpu_s is not None else max(1, math.ceil(self.timeout_s))

    @property
    def waived(self) -> frozenset[str]:
        """Protections this config does not require: ``allow_missing``, and the network one when asked for."""
        return frozenset(self.allow_missing) | ({"network_namespace"} if self.network else frozenset())


@dataclass(frozen=True)
class SandboxResult:
    """What one run produced. ``error`` is None only when the code exited 0 with untruncated output."""

    stdout: str
    stderr: str
    #: Exit status of the code; None when it was killed (timeout or signal) or never started.
    exit_code: int | None
    timed_out: bool
    #: Short human message: "timeout after 5.0s", "memory limit (512 MB)", "exit code 1: ..." ...
    error: str | None
    duration_s: float
    #: Whose fault a failure was: see :data:`Fault`.
    fault: Fault = "none"
    #: CPU seconds the code's processes used (as far as the run's init saw them).
    cpu_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def infra_failed(self) -> bool:
        """True when the sandbox or the machine failed, not the code: do not score it as the model's error."""
        return self.fault == "infra"


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
