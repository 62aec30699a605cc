"""Memory and process-count limits for a run's whole process tree, with cgroups (v2, or v1's memory
and pids hierarchies), and, where the cpu controller is writable too, one CPU share per run.

Each sandbox owns one pool directory per controller (``copc-sbx-u<uid>``, named after the first uid
it leases, so unique machine-wide; under the caller's own cgroup so the caller's limits still hold)
and one child cgroup per slot (``s<uid>``), reused by the slot's runs one after another: a slot is
reused only once its previous run's PID namespace is empty, so its cgroup is empty too. A run's first
process joins it from inside the jail before it runs anything, and every process it forks inherits
it; only root can move a process out, and the code is never root. Pool directories of callers that
died (SIGKILL) are removed by the next sandbox (a pool is stale when nobody holds the lease of its uid),
and the one a new sandbox finds under the uid it has just leased is replaced (its holder is dead).

A process's niceness does not reach past a cpu cgroup: the pool competes with its siblings by the
group's weight, whatever the nice of the processes inside. So the pool's weight is set to the weight
of the opener's niceness (the kernel's nice-to-weight table): the tool calls of a worker that runs at
nice 5 to leave the trainer the CPU weigh together like one nice-5 process (without this they weighed
like one nice-0 process, as much as the trainer). The caller's niceness is read on the sandbox's owner
thread, which inherits it from the thread that starts the sandbox.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from dataclasses import dataclass

from copc.tools.sandbox.identity import lease_is_free

POOL_PREFIX = "copc-sbx-u"
# The kernel's sched_prio_to_weight, nice -20 .. 19 (nice 0 = 1024 = cgroup v1's default cpu.shares).
NICE_WEIGHTS = (
    88761, 71755, 56483, 46273, 36291, 29154, 23254, 18705, 14949, 11916,
    9548, 7620, 6100, 4904, 3906, 3121, 2501, 1991, 1586, 1277,
    1024, 820, 655, 526, 423, 335, 272, 215, 172, 137,
    110, 87, 70, 56, 45, 36, 29, 23, 18, 15,
)
_POOL_RE = re.compile(rf"^{POOL_PREFIX}(\d+)$")


def _read(path: str) -> str:
    with open(path) as handle:
        return handle.read()


def _write(path: str, value: str) -> None:
    with open(path, "w") as handle:
        handle.write(value)


def _own_paths() -> dict[str, str]:
    """controller (or "" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    paths: dict[str, str] = {}
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _mounts() -> dict[str, str]:
    """controller (or "" for the v2 unified hierarchy) -> mount point, from /proc/self/mountinfo."""
    found: dict[str, str] = {}
    for line in _read("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        fstype, _, options = right.split(" ")[:3]
        mount_point = left.split(" ")[4]
        if fstype == "cgroup2":
            found.setdefault("", mount_point)
        elif fstype == "cgroup":
            for option in options.split(","):
                if option in ("memory", "pids", "cpu"):
                    found.setdefault(option, mount_point)
    return found


def _remove_tree(path: str) -> bool:
    """rmdir ``path`` and its child cgroups, deepest first; False when some still hold processes."""
    ok = True
    with contextlib.suppress(OSError):
        for name in os.listdir(path):
            child = os.path.join(path, name)
            if os.path.isdir(child):
                ok = _remove_tree(child) and ok
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        ok = False
    return ok


@dataclass
class CgroupPool:
    """One sandbox's cgroup directories: ``dirs`` maps a controller name to its host directory."""

    version: str
    """"v2" (one directory, both controllers) or "v1" (a memory and a pids directory)."""
    dirs: dict[str, str]

    def create_group(self, run: str, *, memory_bytes: int, max_procs: int) -> None:
        """A slot's cgroup in every directory, with its limits (no swap: the memory cap is real)."""
        for controller, base in self.dirs.items():
            path = os.path.join(base, run)
            os.mkdir(path)
            if self.version == "v2":
                _write(f"{path}/memory.max", str(memory_bytes))
                with contextlib.suppress(OSError):
                    _write(f"{path}/memory.swap.max", "0")
                _write(f"{path}/pids.max", str(max_procs))
            elif controller == "memory":
                _write(f"{path}/memory.limit_in_bytes", str(memory_bytes))
                with contextlib.suppress(OSError):
                    _write(f"{path}/memory.memsw.limit_in_bytes", str(memory_bytes))
            elif controller == "pids":
                _write(f"{path}/pids.max", str(max_procs))
            # "cpu": no limit, only grouping: the scheduler shares the CPU between runs (and between
            # sandboxes), not between processes, so a fork bomb of 16 spinners gets one run's share.

    def oom_kills(self, run: str) -> int:
        """Processes of the group the kernel killed for hitting the memory cap (cumulative)."""
        base = self.dirs["unified" if self.version == "v2" else "memory"]
        name = "memory.events" if self.version == "v2" else "memory.oom_control"
        try:
            text = _read(os.path.join(base, run, name))
        except OSError:
            return 0
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def limit_events(self, run: str) -> dict[str, int]:
        """How often the group hit its limits (cumulative counters): ``oom_kill`` (processes the kernel
        killed at the memory cap), ``memory_max`` (allocations that met the memory cap: v2
        ``memory.events max``, v1 ``memory.failcnt``), ``pids_max`` (forks refused by ``pids.max``)."""
        v2 = self.version == "v2"
        memory = self.dirs["unified" if v2 else "memory"]
        pids = self.dirs["unified" if v2 else "pids"]
        events = {"oom_kill": self.oom_kills(run), "memory_max": 0, "pids_max": 0}
        sources = [(os.path.join(pids, run, "pids.events"), "max", "pids_max")]
        if v2:
            sources.append((os.path.join(memory, run, "memory.events"), "max", "memory_max"))
        for path, key, name in sources:
            with contextlib.suppress(OSError, ValueError):
                for line in _read(path).splitlines():
                    field, _, value = line.partition(" ")
                    if field == key:
                        events[name] = int(value)
        if not v2:
            with contextlib.suppress(OSError, ValueError):
                events["memory_max"] = int(_read(os.path.join(memory, run, "memory.failcnt")))
        return events

    def kill(self, run: str) -> None:
        """SIGKILL every process of the run (host pids), whatever the fork server does."""
        base = self.dirs["unified" if self.version == "v2" else "pids"]
        path = os.path.join(base, run)
        if self.version == "v2" and os.path.exists(f"{path}/cgroup.kill"):
            with contextlib.suppress(OSError):
                _write(f"{path}/cgroup.kill", "1")
                return
        for _ in range(8):  # the tree may fork while it is killed; pids.max bounds how much
            try:
                pids = [int(p) for p in _read(f"{path}/cgroup.procs").split()]
            except OSError:
                return
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        for base in self.dirs.values():
            _remove_tree(base)


def _clear_stale(path: str) -> None:
    """Remove the pool directory ``path`` a previous holder of this uid left (it died before removing
    it); the caller holds the uid's lease, so nobody else owns it. Its processes, orphans of a dead
    sandbox, are killed first. Raises ``OSError`` when it cannot be removed."""
    if not os.path.isdir(path):
        return
    for _ in range(8):
        with contextlib.suppress(OSError):
            for root, _dirs, files in os.walk(path):
                if "cgroup.procs" in files:
                    for pid in _read(os.path.join(root, "cgroup.procs")).split():
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.kill(int(pid), signal.SIGKILL)
        if _remove_tree(path):
            return
        time.sleep(0.05)  # killed processes leave their cgroup when the kernel has reaped them
    raise OSError(f"a stale {path} of a dead sandbox still holds processes")


def _weigh_like_caller(version: str, path: str) -> None:
    """Give the cpu group at ``path`` the weight of this thread's niceness (nothing to do at nice 0:
    it is the default). Best effort, like the cpu controller itself."""
    with contextlib.suppress(OSError):
        nice = os.getpriority(os.PRIO_PROCESS, 0)  # on Linux: this thread's
        if nice == 0:
            return
        if version == "v1":
            _write(f"{path}/cpu.shares", str(NICE_WEIGHTS[nice + 20]))
        else:
            _write(f"{path}/cpu.weight.nice", str(nice))


def reap_stale_pools() -> list[str]:
    """Remove pool directories whose uid lease nobody holds (their caller is gone); returns what was
    removed."""
    removed: list[str] = []
    try:
        mounts, own = _mounts(), _own_paths()
    except OSError:
        return removed
    for controller, mount_point in mounts.items():
        parent = mount_point + own.get(controller, "/")
        with contextlib.suppress(OSError):
            for name in os.listdir(parent):
                match = _POOL_RE.match(name)
                if match and lease_is_free(int(match.group(1))):
                    path = os.path.join(parent, name)
                    if _remove_tree(path):
                        removed.append(path)
    return removed


def open_pool(uid: int) -> tuple[CgroupPool | None, str]:
    """A fresh pool named after ``uid`` (a lease this process holds), or (None, why not) when the
    machine gives no usable cgroups."""
    try:
        mounts, own = _mounts(), _own_paths()
    except OSError as exc:
        return None, f"cannot read the cgroup setup: {exc}"
    reap_stale_pools()
    name = f"{POOL_PREFIX}{uid}"
    if "memory" in mounts and "pids" in mounts:
        dirs = {c: os.path.join(mounts[c] + own.get(c, "/"), name) for c in ("memory", "pids")}
        made: list[str] = []
        try:
            for path in dirs.values():
                _clear_stale(path)
                os.mkdir(path)
                made.append(path)
            if "cpu" in mounts:  # optional: fair CPU shares per run where the hierarchy is writable
                cpu_dir = os.path.join(mounts["cpu"] + own.get("cpu", "/"), name)
                with contextlib.suppress(OSError):
                    _clear_stale(cpu_dir)
                    os.mkdir(cpu_dir)
                    dirs["cpu"] = cpu_dir
                    _weigh_like_caller("v1", cpu_dir)
            return CgroupPool("v1", dirs), ""
        except OSError as exc:
            for path in made:
                _remove_tree(path)
            reason = f"cgroup v1 memory/pids not writable here ({exc})"
    else:
        reason = "no cgroup v1 memory and pids hierarchies"
    if "" in mounts:
        parent = mounts[""] + own.get("", "/")
        try:
            available = _read(f"{parent}/cgroup.controllers").split()
            if not {"memory", "pids"} <= set(available):
                return None, f"{reason}; cgroup v2 at {parent} offers {available}, not memory and pids"
            path = os.path.join(parent, name)
            _clear_stale(path)
            os.mkdir(path)
            try:
                _write(f"{path}/cgroup.subtree_control", "+memory +pids")
            except OSError:
                _remove_tree(path)
                raise
            if "cpu" in available:  # optional, as for v1
                with contextlib.suppress(OSError):
                    _write(f"{path}/cgroup.subtree_control", "+cpu")
                _weigh_like_caller("v2", path)
            return CgroupPool("v2", {"unified": path}), ""
        except OSError as exc:
            return None, f"{reason}; cgroup v2 at {parent} cannot delegate memory and pids ({exc})"
    return None, reason
