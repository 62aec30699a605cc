"""The warm fork server: the program that runs *inside* the jail, standard library only.

The host starts it once per :class:`~copc.tools.sandbox.PythonSandbox` under ``bwrap`` (see
:mod:`copc.tools.sandbox.jail`): it already sees only the minimal filesystem and has no network. It
imports the preloaded modules once, then serves run requests from its control socket. Its source is
passed to the interpreter with ``-c``: the jail cannot see this file. Per request (``run``) it forks::

    fork server (warm, never runs model code)
      └─ R  unshare(mount, PID, IPC, network); joins the run's cgroups; hides the cgroup mounts; fresh tmpfs
            for /tmp (the scratch dir) and /dev/shm; waits for I
           └─ I  pid 1 of the run's PID namespace: mounts its /proc, forks C, enforces the wall cap,
                 reports how C ended on the status fd, exits (the kernel then kills what is left)
                └─ C  rlimits; drops the capability bounding set; setuid(the run's leased uid);
                      no capabilities, no_new_privs, seccomp; clean environment; runs the code

Requests carry four fds (SCM_RIGHTS): the code (a memfd), stdout, stderr and the status pipe. The
server answers ``{"op": "done", "id": n}`` once R is reaped, i.e. once the run's PID namespace is empty.
A ``kill`` request sends SIGTERM to R, which SIGKILLs I (the whole namespace dies with it).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import resource
import select
import signal
import socket
import sys
import time
import traceback
import types

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWIPC, CLONE_NEWNET = 0x00020000, 0x20000000, 0x08000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_CAPBSET_DROP, PR_SET_SECUREBITS = 1, 22, 24, 28
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 36, 38
SECBITS_NOROOT_LOCKED = 0x3  # SECBIT_NOROOT | SECBIT_NOROOT_LOCKED: execve grants uid 0 no capabilities
SECCOMP_MODE_FILTER = 2

libc = ctypes.CDLL(None, use_errno=True)
for _name in ("mount", "umount2", "unshare", "prctl", "capset"):  # resolve once, not in every run
    getattr(libc, _name)
try:
    with open("/proc/sys/kernel/cap_last_cap") as _handle:
        LAST_CAP = int(_handle.read())
except (OSError, ValueError):
    LAST_CAP = 63


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable",
                                                                                 ctypes.c_uint32)]


def check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str, target: str, fstype: str | None, flags: int, options: str | None) -> None:
    check(
        libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                   ctypes.c_ulong(flags),
                   options.encode() if options else None),
        f"mount {fstype or 'bind'} on {target}",
    )


def write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def report(fd: int, status: dict[str, object]) -> None:
    """One JSON line on the status pipe (the host merges the lines it reads)."""
    write_all(fd, json.dumps(status).encode() + b"\n")


# --------------------------------------------------------------------------------------------------
# C: the code's own process.


def drop_privileges(uid: int | None, seccomp_bpf: bytes) -> None:
    """Everything after which the process may run model code: no way back to any privilege."""
    check(libc.prctl(PR_SET_SECUREBITS, SECBITS_NOROOT_LOCKED, 0, 0, 0), "securebits")
    for cap in range(LAST_CAP + 1):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:  # EINVAL: no such cap
            check(-1, f"drop capability {cap} from the bounding set")
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    header = CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two data structs
    check(libc.capset(ctypes.byref(header), ctypes.byref((CapData * 2)())), "capset (drop all)")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    if seccomp_bpf:
        buffer = ctypes.create_string_buffer(seccomp_bpf, len(seccomp_bpf))
        program = SockFprog(len(seccomp_bpf) // 8, ctypes.addressof(buffer))
        check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0), "seccomp filter")


def exit_status(exc: SystemExit) -> int:
    """The exit status the interpreter would give for ``sys.exit(code)``."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def run_code(source: bytes) -> int:
    """Execute the code as ``__main__`` of a fresh module, as ``python main.py`` would; its exit status."""
    main = types.ModuleType("__main__")
    main.__file__ = "main.py"
    sys.modules["__main__"] = main
    sys.argv = ["main.py"]
    try:
        exec(compile(source, "main.py", "exec"), main.__dict__)
        status = 0
    except SystemExit as exc:
        status = exit_status(exc)
    except BaseException as exc:
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None  # hide this frame
        traceback.print_exception(type(exc), exc, tb)
        status = 1
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()  # join non-daemon threads, as interpreter exit does
        import atexit

        atexit._run_exitfuncs()
    except SystemExit as exc:
        status = exit_status(exc)
    except BaseException:
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            status = status or 120  # as the interpreter does when flushing stdout fails
    return status


def code_process(req: dict, code_fd: int, out_fd: int, err_fd: int, status_fd: int,
                 seccomp_bpf: bytes) -> None:
    """Set up C, then say so on the status pipe (``code_started``) and close it, then run the code.

    The line tells the host which stage the run reached: whatever happens after it (a limit, a signal,
    the wall cap) is the code's outcome; a failure before it is the sandbox's.
    """
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    chunks = []
    while chunk := os.read(code_fd, 1 << 20):
        chunks.append(chunk)
    source = b"".join(chunks)
    os.closerange(3, status_fd)
    os.closerange(status_fd + 1, 1 << 16)
    for name, soft, hard in req["rlimits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    drop_privileges(req["uid"], seccomp_bpf)
    os.chdir("/tmp")
    os.environ.clear()
    os.environ.update(req["env"])
    with open("main.py", "wb") as handle:  # for tracebacks that show the line
        handle.write(source)
    report(status_fd, {"code_started": True})
    os.close(status_fd)  # before the code runs: it cannot write a status of its own
    os._exit(run_code(source))


# --------------------------------------------------------------------------------------------------
# I: pid 1 of the run's namespace.


def tree_usage() -> tuple[float, float]:
    """(CPU seconds used, seconds spent waiting for a CPU) of every other process in this namespace."""
    tick = os.sysconf("SC_CLK_TCK")
    cpu = wait = 0.0
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == "1":
            continue
        try:
            with open(f"/proc/{name}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            cpu += sum(int(v) for v in fields[11:15]) / tick  # utime stime cutime cstime
            for task in os.listdir(f"/proc/{name}/task"):
                with open(f"/proc/{name}/task/{task}/schedstat") as handle:
                    wait += int(handle.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            continue
    return cpu, wait


def init_process(req: dict, fds: list[int], seccomp_bpf: bytes) -> None:
    code_fd, out_fd, err_fd, status_fd = fds
    # As the namespace's pid 1, only signals it handles reach it from inside: Python's SIGINT handler
    # would let code running under the same uid (no uid to drop to) end this init, an "infra" failure.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # R gone (killed) -> this namespace dies
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # the code's, as in any python
            code_process(req, code_fd, out_fd, err_fd, status_fd, seccomp_bpf)
        except BaseException as exc:
            write_all(2, f"sandbox setup failed in the code process: {type(exc).__name__}: {exc}\n".encode())
        os._exit(126)
    for fd in (code_fd, out_fd, err_fd):
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    deadline = start + req["wall_s"]
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            cpu, wait = tree_usage()
            os.kill(-1, signal.SIGKILL)  # as pid 1: every other process of this namespace
            os.waitpid(pid, 0)
            report(status_fd, {"timeout": True, "cpu_s": cpu, "wait_s": wait,
                               "wall_s": time.monotonic() - start})
            os._exit(0)
        if select.select([pidfd], [], [], min(left, 0.1))[0]:
            break
        reap_orphans(pid)
    _, status, usage = os.wait4(pid, 0)
    cpu_s = usage.ru_utime + usage.ru_stime
    ended: dict[str, object] = {"cpu_s": cpu_s, "wall_s": time.monotonic() - start}
    if os.WIFSIGNALED(status):
        ended["signal"] = os.WTERMSIG(status)
    else:
        ended["exit"] = os.WEXITSTATUS(status)
    report(status_fd, ended)
    os._exit(0)


def reap_orphans(code_pid: int) -> None:
    """Reap exited orphans (re-parented to this init) without touching the code process's status."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid == code_pid:
            return
        os.waitpid(info.si_pid, 0)


# --------------------------------------------------------------------------------------------------
# R: the run's namespaces, cgroups and scratch.


def runner(req: dict, fds: list[int], params: dict) -> None:
    # A network namespace per run too (unless the network was asked for): abstract Unix sockets live
    # in the network namespace, and would otherwise let two concurrent runs talk.
    net = CLONE_NEWNET if params["netns_per_run"] else 0
    check(libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | net), "unshare(mount, pid, ipc, net)")
    mount("none", "/", None, MS_REC | MS_PRIVATE, None)
    for directory in params["cgroup_dirs"]:  # join first: the scratch tmpfs pages are charged to it
        with open(f"{directory}/{req['cgroup']}/cgroup.procs", "w") as handle:
            handle.write("0")
    for directory in params["hide"]:
        check(libc.umount2(directory.encode(), MNT_DETACH), f"umount {directory}")
    uid = req["uid"]
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={req['disk_kb']}k,nr_inodes={req['max_files']},mode=0700{owner}")
    if os.path.isdir("/dev/shm"):
        os.mkdir("/tmp/.shm", 0o700)
        if uid is not None:
            os.chown("/tmp/.shm", uid, uid)
        mount("/tmp/.shm", "/dev/shm", None, MS_BIND, None)
    seccomp_bpf = bytes.fromhex(params["seccomp_bpf"])
    init: list[int] = []

    def on_kill(*_: object) -> None:
        """A kill request (SIGTERM) ends I, and so the namespace; before I exists, R just leaves."""
        if not init:
            os._exit(0)
        os.kill(init[0], signal.SIGKILL)

    signal.signal(signal.SIGTERM, on_kill)  # before the fork, so no kill request is lost
    pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            init_process(req, fds, seccomp_bpf)
        except BaseException as exc:
            report(fds[3], {"setup_error": f"{type(exc).__name__}: {exc}"})
        os._exit(125)
    init.append(pid)
    for fd in fds:
        os.close(fd)
    while True:
        try:
            os.waitpid(pid, 0)  # returns once the namespace is empty (its init is reaped last)
            break
        except InterruptedError:
            continue
        except ChildProcessError:
            break
    os._exit(0)


# --------------------------------------------------------------------------------------------------
# The server loop.


def start_run(req: dict, fds: list[int], params: dict) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            runner(req, fds, params)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                report(fds[3], {"setup_error": f"{type(exc).__name__}: {exc}"})
        os._exit(125)
    for fd in fds:
        os.close(fd)
    return pid


def serve(params: dict) -> None:
    sock = socket.socket(fileno=params["control_fd"])
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    runs: dict[int, int] = {}  # R pid -> run id
    by_id: dict[int, int] = {}
    sock.send(json.dumps({"op": "ready", "pid": os.getpid()}).encode())
    while True:
        readable = select.select([sock.fileno(), wake_r], [], [])[0]
        if wake_r in readable:
            while True:
                try:
                    if not os.read(wake_r, 4096):
                        break
                except BlockingIOError:
                    break
            while True:
                try:
                    pid, _ = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                if pid in runs:
                    run_id = runs.pop(pid)
                    by_id.pop(run_id, None)
                    sock.send(json.dumps({"op": "done", "id": run_id}).encode())
        if sock.fileno() in readable:
            message, fds, _, _ = socket.recv_fds(sock, 1 << 16, 8)
            if not message:  # the host is gone: end every run and ourselves
                for pid in runs:
                    os.kill(pid, signal.SIGTERM)
                os._exit(0)
            req = json.loads(message)
            if req["op"] == "run":
                try:
                    pid = start_run(req, fds, params)
                except OSError as exc:  # out of processes or memory: the machine's fault
                    for fd in fds:
                        os.close(fd)
                    sock.send(json.dumps({"op": "done", "id": req["id"], "error": str(exc)}).encode())
                    continue
                runs[pid] = req["id"]
                by_id[req["id"]] = pid
            elif req["op"] == "kill" and req["id"] in by_id:
                os.kill(by_id[req["id"]], signal.SIGTERM)


def main() -> None:
    params = json.loads(sys.argv[1])
    sys.dont_write_bytecode = True
    for path in params["site_paths"]:
        sys.path.append(path)
    for name in params["preload"]:
        __import__(name)
    # The first compile() of a process initialises the parser (~2 ms): do it once here, not per run.
    exec(compile("def f(x):\n    return [x * 2 for _ in range(2)]\nstr(f(1))\n", "warm-up", "exec"), {})
    for stream in (sys.stdout, sys.stderr):  # nothing buffered may be inherited by a run
        stream.flush()
    # Everything imported so far survives every fork unchanged: keeping it out of the collector's
    # reach spares each run the copy-on-write faults a collection would cause by touching it.
    gc.collect()
    gc.freeze()
    serve(params)


if __name__ == "__main__":
    main()
