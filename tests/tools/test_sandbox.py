"""The Python sandbox: normal runs, whose fault a failure is, and a battery of hostile programs.

Every hostile program must end with a clear tool error (or be harmlessly contained) within the
timeout plus one second, with the test process intact and the host untouched. The default config
requires every protection, so on a machine that lacks one these tests fail at the fixture with the
sandbox's one-line refusal (that is the point: nothing runs unprotected without being asked).
The fork-server and isolation checks that need two processes live in ``test_sandbox_isolation.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from copc.tools.sandbox import (
    PROTECTIONS,
    PythonSandbox,
    SandboxConfig,
    SandboxResult,
    active_protections,
    format_observation,
    write_protections,
)
from copc.tools.sandbox.pool import Capture, Ended
from copc.tools.sandbox.runner import classify

# Small limits keep the battery fast: each hostile run is bounded by TIMEOUT_S.
CONFIG = SandboxConfig(timeout_s=3.0, cpu_s=2, memory_mb=256, max_output_bytes=1024, max_procs=16,
                       max_files=512)
TIMEOUT_S = CONFIG.timeout_s
SLACK_S = 1.0  # the bound: run() returns within timeout + 1 s, whatever the code does
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    return PythonSandbox(CONFIG)


def _bounded(result: SandboxResult) -> None:
    assert result.duration_s < TIMEOUT_S + SLACK_S, f"took {result.duration_s:.2f}s: {result}"


def _code_fault(result: SandboxResult) -> None:
    """The code's fault, however loaded the machine: a limit it met is its own outcome."""
    assert result.fault == "code", result


def _still_works(sandbox: PythonSandbox) -> None:
    again = sandbox.run("print(6 * 7)")
    assert again.ok and again.stdout == "42\n", again


def _none_left(uids: list[int], within_s: float = 2.0) -> bool:
    """No host process of ``uids`` is alive, or none is any more after ``within_s`` (a namespace that
    is being torn down still shows its processes for a moment)."""
    deadline = time.monotonic() + within_s
    while _live_pids_of(uids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _live_pids_of(uids)


def _live_pids_of(uids: list[int]) -> list[int]:
    """Host processes (not zombies) whose real uid is one of ``uids``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = dict(line.split(":",
                                     1) for line in (proc / "status").read_text().splitlines() if ":" in line)
        except OSError:
            continue
        if int(fields["Uid"].split()[0]) in uids and not fields["State"].strip().startswith("Z"):
            found.append(int(proc.name))
    return found


# --------------------------------------------------------------------------------------------------
# Normal runs.


def test_hello_world(sandbox: PythonSandbox) -> None:
    result = sandbox.run("import math\nprint(math.factorial(20))\n")
    assert result.ok and result.exit_code == 0 and not result.timed_out and result.fault == "none"
    assert result.stdout == "2432902008176640000\n" and result.stderr == ""


def test_exception_reports_last_traceback_line(sandbox: PythonSandbox) -> None:
    result = sandbox.run("print('before')\n1 / 0\n")
    assert result.exit_code == 1 and result.stdout == "before\n" and result.fault == "code"
    assert result.error == "exit code 1: ZeroDivisionError: division by zero"
    assert 'File "main.py", line 2' in result.stderr and "1 / 0" in result.stderr  # the line is shown


def test_exit_statuses_are_the_interpreters(sandbox: PythonSandbox) -> None:
    assert sandbox.run("import os\nprint('bye', flush=True)\nos._exit(3)\n").error == "exit code 3"
    assert sandbox.run("import sys\nsys.exit(4)\n").exit_code == 4
    message = sandbox.run("import sys\nsys.exit('no luck')\n")
    assert message.exit_code == 1 and message.stderr == "no luck\n"
    syntax = sandbox.run("print(1 +)\n")
    assert syntax.exit_code == 1 and "SyntaxError" in (syntax.error or "")
    atexit = sandbox.run("import atexit\natexit.register(lambda: print('at exit'))\nprint('main')\n")
    assert atexit.stdout == "main\nat exit\n"


def test_threads_still_work_under_seccomp(sandbox: PythonSandbox) -> None:
    """clone3 is refused with ENOSYS so that libc falls back to clone, which the filter can inspect."""
    code = ("import threading\nout = []\nt = threading.Thread(target=out.append, args=(7,))\nt.start(); "
            "t.join()\nprint(out)\n")
    assert sandbox.run(code).stdout == "[7]\n"


def test_extension_modules_subprocesses_and_spawn_work(sandbox: PythonSandbox) -> None:
    """The jail holds what the interpreter needs: its shared libraries (sqlite3 loads libsqlite3 from
    /usr/lib), its own binary (a subprocess, multiprocessing's spawn) and /dev/shm."""
    code = (  # spawn re-imports main.py in its children: everything under the guard, as usual
        "import multiprocessing as mp, sqlite3, subprocess, sys\n"
        "if __name__ == '__main__':\n"
        "    print(sqlite3.connect(':memory:').execute('select 6 * 7').fetchone()[0])\n"
        "    print(subprocess.run([sys.executable, '-c', 'print(5)'], capture_output=True, "
        "text=True).stdout.strip())\n"
        "    with mp.get_context('spawn').Pool(2) as pool:\n"
        "        print(pool.map(abs, [-1, -2]))\n"
    )
    result = sandbox.run(code)
    assert result.ok and result.stdout == "42\n5\n[1, 2]\n", result


def test_runs_do_not_see_each_other(sandbox: PythonSandbox) -> None:
    """A run's files, shared memory, processes and module state are gone for the next one."""
    first = sandbox.run(
        "import math, os\nmath.pi = 3\nopen('left.txt', 'w').write('x')\nopen('/dev/shm/seg', "
        "'w').write('x')\n"
        "if os.fork() == 0:\n    import time; time.sleep(30)\nprint(sorted(os.listdir('.')))\n"
    )
    assert first.ok, first
    second = sandbox.run(
        "import math, os\nprint(math.pi == 3, sorted(os.listdir('.')), os.listdir('/dev/shm'),"
        " sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
    )
    assert second.stdout == "False ['.shm', 'main.py'] [] [1, 2]\n", second


def test_concurrent_runs_are_independent(sandbox: PythonSandbox) -> None:
    results: dict[int, SandboxResult] = {}

    def work(i: int) -> None:
        results[i] = sandbox.run(f"import time, os\ntime.sleep(0.3)\nprint({i} ** 2, os.getuid())\n")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {i: r.stdout.split()[0] for i, r in results.items()} == {i: str(i * i) for i in range(4)}
    assert len({r.stdout.split()[1] for r in results.values()}) == 4, "concurrent runs must not share a uid"


def test_undecodable_code_is_a_tool_error_not_an_exception(sandbox: PythonSandbox) -> None:
    result = sandbox.run("print('a\udcff')\n")  # a lone surrogate, as broken generated text can hold
    assert result.exit_code == 0 and result.stdout == "a?\n"  # the encoder's replacement character


def test_format_observation_keeps_head_and_tail() -> None:
    result = SandboxResult(
        stdout="a" * 500, stderr="Traceback\nValueError: bad", exit_code=1, timed_out=False,
        error="exit code 1: ValueError: bad", duration_s=0.1,
    )
    text = format_observation(result, max_chars=200)
    assert len(text) == 200
    assert text.startswith("aaa") and text.endswith("[tool error: exit code 1: ValueError: bad]")
    assert "chars truncated" in text
    short = SandboxResult("4\n", "", 0, False, None, 0.1)
    assert format_observation(short) == "4"


def test_cpu_limit_follows_the_timeout_by_default() -> None:
    assert SandboxConfig(timeout_s=2.5).cpu_limit_s == 3 and SandboxConfig(timeout_s=2.5,
                                                                           cpu_s=1).cpu_limit_s == 1


def test_config_round_trips_through_json() -> None:
    config = SandboxConfig(timeout_s=7.5, cpu_s=3, network=True, max_procs=8, allow_missing=("seccomp",))
    assert SandboxConfig(**json.loads(json.dumps(dataclasses.asdict(config)))) == config


def test_config_validation_says_how_to_fix() -> None:
    with pytest.raises(ValueError, match=r"timeout_s=0 must be in \(0, 3600\]"):
        SandboxConfig(timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb=8"):
        SandboxConfig(memory_mb=8)
    with pytest.raises(ValueError, match="python_executable"):
        SandboxConfig(python_executable="/nonexistent/python")
    with pytest.raises(ValueError, match=r"allow_missing names unknown protections \['seccom'\]"):
        SandboxConfig(allow_missing=("seccom",))


# --------------------------------------------------------------------------------------------------
# Protections: all in force here, written down, and a missing one refuses to start.


def test_every_protection_is_in_force_for_a_root_caller() -> None:
    if os.geteuid() != 0:
        pytest.skip("a non-root caller cannot drop to other uids or make cgroups (see the non-root test)")
    found = active_protections(CONFIG)
    assert found == dict.fromkeys([*PROTECTIONS, "wall_timeout", "output_cap"], True), found


def test_protections_are_written_to_the_run_dir(tmp_path: Path) -> None:
    report = json.loads(write_protections(tmp_path, CONFIG).read_text())
    assert set(report["active"]) == set(PROTECTIONS) and report["missing"] == {}
    assert report["config"]["memory_mb"] == CONFIG.memory_mb


# --------------------------------------------------------------------------------------------------
# Hostile programs: what the code can see.


def test_checkout_eval_file_home_and_host_tmp_are_invisible(sandbox: PythonSandbox, tmp_path: Path) -> None:
    """For a policy under RL, reading the eval answers is a reward hack it can learn: nothing of the host
    but the interpreter, its stdlib and the system libraries exists inside."""
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text('{"question": "6 * 7", "answer": 42}\n')
    eval_file.chmod(0o644)
    targets = [REPO / "pyproject.toml", REPO / "src/copc/tasks/arith_tool.py", eval_file]
    code = (
        "import os\n"
        f"for path in {[str(t) for t in targets]!r}:\n"
        "    try:\n        open(path).read(); print('read', path)\n"
        "    except OSError as e:\n        print('blocked', type(e).__name__)\n"
        f"for d in [{str(REPO)!r}, {str(tmp_path)!r}, '/work', '/home', '/etc', '/var', '/opt', '/usr/bin', "
        "'/usr/share']:\n"
        "    print('listed' if os.path.exists(d) else 'blocked', d)\n"
        "print('root', sorted(os.listdir('/')))\n"
    )
    result = sandbox.run(code)
    assert result.ok, result
    assert "read" not in result.stdout and "listed" not in result.stdout, result.stdout
    root = json.loads(result.stdout.splitlines()[-1].split(" ", 1)[1].replace("'", '"'))
    assert set(root) <= {"usr", "lib", "lib64", "proc", "dev", "tmp", "run", "root"}, root


def test_write_or_delete_outside_the_scratch_dir(sandbox: PythonSandbox, tmp_path: Path) -> None:
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    victim.chmod(0o666)
    code = (
        f"import os, shutil\nfor path in ['/usr/lib/owned', '/owned', {str(REPO / 'owned')!r}]:\n"
        "    try:\n        open(path, 'w').write('x'); print('wrote', path)\n"
        "    except OSError as e:\n        print('blocked', type(e).__name__)\n"
        f"for f in [os.remove, shutil.rmtree]:\n    try:\n        f({str(victim)!r}); print('deleted')\n"
        "    except OSError as e:\n        print('blocked', type(e).__name__)\n"
        "open('inside.txt', 'w').write('fine')\nprint(open('inside.txt').read())\n"
    )
    result = sandbox.run(code)
    assert result.ok and result.stdout.count("blocked") == 5 and result.stdout.endswith("fine\n"), result
    assert victim.read_text() == "keep me" and not (REPO / "owned").exists()


def test_no_network(sandbox: PythonSandbox) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            f"for addr in [('127.0.0.1', {port}), ('8.8.8.8', 53), ('1.1.1.1', 80)]:\n"
            "    try:\n"
            "        socket.create_connection(addr, timeout=1).close()\n"
            "        print('connected', addr)\n"
            "    except OSError as e:\n"
            "        print('blocked', type(e).__name__)\n"
        )
        result = sandbox.run(code)
        _bounded(result)
        assert result.stdout.count("blocked") == 3, result
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody reached the caller's listening socket


def test_concurrent_runs_cannot_talk(sandbox: PythonSandbox) -> None:
    """Abstract Unix sockets live in the network namespace: each run has its own, so a run that
    listens is unreachable from a concurrent one."""
    name = f"\0copc-{uuid.uuid4().hex}"
    listener = threading.Thread(target=sandbox.run, args=(
        "import socket, time\ns = "
        f"socket.socket(socket.AF_UNIX)\ns.bind({name!r})\ns.listen(1)\ntime.sleep(2)\n",))
    listener.start()
    time.sleep(0.5)
    code = (
        f"import socket\ns = socket.socket(socket.AF_UNIX)\n"
        f"try:\n    s.connect({name!r}); print('connected')\nexcept OSError as e:\n    print('blocked', "
        "type(e).__name__)\n"
    )
    result = sandbox.run(code)
    listener.join()
    assert result.stdout == "blocked ConnectionRefusedError\n", result


def test_parent_environment_is_invisible(sandbox: PythonSandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("COPC_TEST_SECRET", secret)
    code = (
        "import os\n"
        f"secret = {secret!r}\n"
        "print('env', sorted(os.environ))\n"
        "print('leak-env', any(secret in k + v for k, v in os.environ.items()))\n"
        f"for pid in [os.getppid(), 1, {os.getpid()}]:\n"
        "    try:\n"
        "        print('leak-proc', secret.encode() in open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError as e:\n"
        "        print('blocked', type(e).__name__)\n"
    )
    result = sandbox.run(code)
    assert result.exit_code == 0, result
    assert "leak-env False" in result.stdout and "True" not in result.stdout, result.stdout
    assert secret not in result.stdout + result.stderr


def test_cannot_signal_the_caller(sandbox: PythonSandbox) -> None:
    """If any of these kills reached pytest, this test (and the run) would die."""
    code = (
        "import os, signal\n"
        f"for target in [os.getppid(), {os.getpid()}, -{os.getpgid(0)}, -1]:\n"
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "        print('sent', target)\n"
        "    except OSError as e:\n"
        "        print('blocked', type(e).__name__)\n"
    )
    result = sandbox.run(code)
    _bounded(result)
    # kill(-1) kills the code itself (every process it may signal): that ends the run, nothing else.
    assert result.error is None or "signal 9" in result.error, result
    _still_works(sandbox)


def test_no_user_namespaces_mounts_or_ptrace(sandbox: PythonSandbox) -> None:
    """``unshare -Ur`` made the code root in a new user namespace: kernel surface no tool code needs."""
    code = (
        "import ctypes, os, subprocess\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print('unshare-user', libc.unshare(0x10000000), ctypes.get_errno())\n"
        "print('clone-user', libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0), ctypes.get_errno())\n"
        "print('mount', libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno())\n"
        "print('ptrace', libc.ptrace(0, 0, 0, 0), ctypes.get_errno())\n"
        "try:\n    subprocess.run(['unshare', '-Ur', 'id'], capture_output=True); print('ran unshare')\n"
        "except OSError as e:\n    print('no unshare binary', type(e).__name__)\n"
    )
    result = sandbox.run(code)
    assert result.ok, result
    for call in ("unshare-user", "clone-user", "mount", "ptrace"):
        assert f"{call} -1 1\n" in result.stdout, (call, result.stdout)  # EPERM
    assert "ran unshare" not in result.stdout


# --------------------------------------------------------------------------------------------------
# Hostile programs: limits for the whole run.


def test_infinite_loop(sandbox: PythonSandbox) -> None:
    result = sandbox.run("while True:\n    pass\n")
    _bounded(result)
    assert result.exit_code is None and result.error is not None
    # The CPU budget (2 s) ends it; on a machine so loaded that it got under 2 s of CPU in 3 s of wall
    # clock, the wall cap does. Either way the code's fault: it met a limit of its own.
    _code_fault(result)
    assert "cpu time limit" in result.error or result.timed_out, result
    _still_works(sandbox)


def test_sleep_hits_wall_timeout(sandbox: PythonSandbox) -> None:
    """No CPU is used, so only the wall cap can stop it; it slept, so it is the code's fault."""
    result = sandbox.run("import time\nprint('start', flush=True)\ntime.sleep(60)\n")
    _bounded(result)
    assert result.timed_out and result.error == f"timeout after {TIMEOUT_S}s" and result.fault == "code"
    assert result.stdout == "start\n"  # output produced before the kill is kept


FORK_BOMB = (
    "import os, time\n"
    "while True:\n"
    "    try:\n"
    "        if os.fork() == 0:\n"
    "            os.setsid()\n"  # try to escape the process group
    "    except OSError:\n"
    "        time.sleep(0.01)\n"
)


def test_fork_bomb_leaves_nothing_behind(sandbox: PythonSandbox) -> None:
    result = sandbox.run(FORK_BOMB)
    _bounded(result)
    assert result.error is not None
    _still_works(sandbox)
    assert _none_left(sandbox.uids()), "forks of the bomb survived the run"


def test_double_fork_orphan_dies_with_the_run(sandbox: PythonSandbox) -> None:
    """The orphan of a double fork outlived run() before; now it dies with the run's PID namespace."""
    code = ("import os, time\nif os.fork() == 0:\n    if os.fork() == 0:\n        time.sleep(60)\n    "
            "os._exit(0)\nprint('parent done')\n")
    result = sandbox.run(code)
    assert result.ok and result.duration_s < TIMEOUT_S, result  # it did not wait for the orphan
    _still_works(sandbox)
    assert _none_left(sandbox.uids()), "the orphan outlived its run"


def test_memory_bomb(sandbox: PythonSandbox) -> None:
    result = sandbox.run("chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))\n")
    _bounded(result)
    assert result.error is not None and result.error.startswith("memory limit"), result
    assert result.fault == "code"


def test_memory_is_capped_across_processes(sandbox: PythonSandbox) -> None:
    """With a per-process cap, 6 x 100 MiB were held at once under memory_mb=256; the run's cgroup
    now holds the sum of its processes (and its tmpfs) under memory_mb."""
    code = (  # children that got and touched 100 MiB report their pid; count those alive together
        "import os, time\nr, w = os.pipe()\n"
        "for i in range(6):\n"
        "    if os.fork() == 0:\n"
        "        try:\n"
        "            b = bytearray(100 * 2**20)\n"
        "            b[::4096] = b'x' * len(b[::4096])\n"
        "            os.write(w, b'%d ' % os.getpid())\n"
        "        except MemoryError:\n"
        "            pass\n"
        "        time.sleep(3)\n"
        "        os._exit(0)\n"
        "time.sleep(1.5)\nos.set_blocking(r, False)\n"
        "try:\n    pids = [int(p) for p in os.read(r, 1000).split()]\nexcept BlockingIOError:\n    pids = "
        "[]\n"
        "while True:\n    try:\n        if os.waitpid(-1, os.WNOHANG)[0] == 0:\n            break\n"
        "    except ChildProcessError:\n        break\n"
        "alive = [p for p in pids if os.path.exists(f'/proc/{p}')]\n"
        "print('held', len(alive), flush=True)\n"
    )
    result = sandbox.run(code)
    _bounded(result)
    assert result.stdout.startswith("held "), result
    held_mib = 100 * int(result.stdout.split()[1])
    assert held_mib < CONFIG.memory_mb, f"{held_mib} MiB held at once under memory_mb={CONFIG.memory_mb}"


def test_file_count_is_capped_and_return_is_bounded(sandbox: PythonSandbox) -> None:
    """Before: ~337k files, and run() returned after 14 s at a 10 s timeout (the work dir was deleted
    on the caller's path). Now the scratch tmpfs has max_files inodes and dies with the namespace."""
    code = (
        "import os\nos.mkdir('d')\ni = 0\n"
        "try:\n    while True:\n        open(f'd/{i}', 'w').close(); i += 1\n"
        "finally:\n    print(i, flush=True)\n"
    )
    result = sandbox.run(code)
    _bounded(result)
    assert int(result.stdout.split()[0]) <= CONFIG.max_files, result
    assert result.error is not None and result.error.startswith("scratch disk full"), result


def test_scratch_disk_total_is_capped() -> None:
    """Before: 24 x 15 MiB written under a per-file cap only; now the tmpfs size caps the total."""
    sandbox = PythonSandbox(dataclasses.replace(CONFIG, disk_mb=32, memory_mb=512))
    code = (
        "written = 0\n"
        "try:\n    for i in range(24):\n        with open(f'f{i}', 'wb') as f:\n"
        "            for _ in range(15):\n                f.write(b'0' * 2**20); written += 1\n"
        "finally:\n    print(written, flush=True)\n"
    )
    result = sandbox.run(code)
    _bounded(result)
    assert int(result.stdout.split()[0]) <= 32, result
    assert result.error is not None and "scratch disk full" in result.error, result
    sandbox.close()


def test_huge_print_is_truncated(sandbox: PythonSandbox) -> None:
    result = sandbox.run("import sys\nsys.stdout.write('x' * (100 * 2**20))\n")
    _bounded(result)
    assert result.stdout.startswith("x" * CONFIG.max_output_bytes)
    assert "[... output truncated:" in result.stdout
    assert len(result.stdout) < CONFIG.max_output_bytes + 100
    assert result.error is not None and "output truncated" in result.error


def test_recursion_bomb(sandbox: PythonSandbox) -> None:
    code = "import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1) + 1\nf(0)\n"
    result = sandbox.run(code)
    _bounded(result)
    assert result.error is not None and result.exit_code != 0, result
    _code_fault(result)
    _still_works(sandbox)


def test_file_size_limit() -> None:
    sandbox = PythonSandbox(SandboxConfig(timeout_s=3.0, max_file_bytes=4096))
    result = sandbox.run("open('big', 'wb').write(b'0' * 100000)\n")
    assert result.error is not None and "file size limit" in result.error, result
    sandbox.close()


# --------------------------------------------------------------------------------------------------
# Whose fault.


def _ended(status: dict[str, object], stderr: bytes = b"") -> Ended:
    return Ended(Capture(bytearray()), Capture(bytearray(stderr)), status)


def test_whose_fault_is_the_stage_the_run_reached_not_the_machines_load() -> None:
    """Before the code started, a timeout is the sandbox's; after, the wall cap is the program's,
    however long its processes waited for a CPU (a fork bomb's forks wait for each other)."""
    config = SandboxConfig(timeout_s=2.0)
    started = {"code_started": True}
    starved = classify(_ended(started | {"timeout": True, "cpu_s": 0.3, "wait_s": 1.2}), config, 0)
    assert starved[3] == "code" and starved[2] == "timeout after 2.0s"
    slept = classify(_ended(started | {"timeout": True, "cpu_s": 0.01, "wait_s": 0.01}), config, 0)
    assert slept[3] == "code" and slept[2] == "timeout after 2.0s"
    bomb = classify(_ended(started | {"timeout": True, "cpu_s": 0.0, "wait_s": 3.0}), config, 0,
                    {"pids_max": 40})
    assert bomb[3] == "code" and bomb[2] == f"timeout after 2.0s (process limit {config.max_procs} reached)"
    never_ran = classify(_ended({"timeout": True, "cpu_s": 0.0, "wait_s": 1.9}), config, 0)
    assert never_ran[3] == "infra" and "did not start the code" in (never_ran[2] or "")


def test_how_a_run_ended_decides_the_fault() -> None:
    config = SandboxConfig()
    ran = {"code_started": True}
    died = Ended(Capture(bytearray()), Capture(bytearray()), ran, status_closed=True)
    cases = [
        (_ended(ran | {"exit": 1}, b"ValueError: x\n"), 0, {}, "code"),
        (_ended(ran | {"signal": 9, "cpu_s": 0.2}), 1, {}, "code"),  # killed by the cgroup OOM killer
        (_ended(ran | {"signal": 24, "cpu_s": 5.0}), 0, {}, "code"),  # SIGXCPU: its CPU budget
        (_ended({"setup_error": "OSError: [Errno 11] fork"}), 0, {}, "infra"),
        (_ended({}), 0, {}, "infra"),  # no word from the run by the backstop, the code never started
        (_ended(ran), 0, {}, "code"),  # its init alive but silent at the backstop: the code was still running
        (died, 0, {"memory_max": 3}, "code"),  # its init died at the memory cap the code filled
        (died, 0, {}, "infra"),  # its init died without a report and no limit was met (the server died)
        (_ended(ran | {"setup_error": "OSError: pidfd_open"}), 0, {}, "infra"),
        (_ended({"exit": 126}, b"sandbox setup failed in the code process: PermissionError: setuid\n"), 0, {},
         "infra"),
        # The code printing the sandbox's own words is still the code: it had started.
        (_ended(ran | {"exit": 126}, b"sandbox setup failed in the code process: x\n"), 0, {}, "code"),
        (_ended(ran | {"exit": 0}), 0, {}, "none"),
    ]
    for ended, oom, hits, fault in cases:
        assert classify(ended, config, oom, hits)[3] == fault, (ended.status, hits)


def test_machine_failure_is_reported_as_infra(monkeypatch: pytest.MonkeyPatch,
                                              sandbox: PythonSandbox) -> None:
    def no_memory(*args: object) -> int:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(os, "memfd_create", no_memory)
    result = sandbox.run("print(1)")
    assert result.fault == "infra" and result.infra_failed and result.exit_code is None
    assert (result.error or "").startswith("sandbox setup failed: OSError")
    monkeypatch.undo()
    _still_works(sandbox)


def test_no_free_slot_is_infra_and_bounded() -> None:
    sandbox = PythonSandbox(dataclasses.replace(CONFIG, max_concurrent=1, timeout_s=1.0, cpu_s=1))
    busy = threading.Thread(target=sandbox.run, args=("import time\ntime.sleep(5)\n",))
    busy.start()
    try:
        result = sandbox.run("print(1)")
        assert result.fault == "infra" and "no free sandbox slot" in (result.error or ""), result
        assert result.duration_s < 1.0 + SLACK_S
    finally:
        busy.join()
        sandbox.close()


def test_the_tool_loop_counts_infrastructure_failures_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sandbox failure is not the model's tool error: ToolEnv counts it as tool_infra_errors."""
    from copc.tasks.envs import PYTHON_TAGS, ToolEnv
    from copc.tasks.tooling import SandboxTool

    class Exact:
        def grade(self, answer_text: str) -> float:
            return float(answer_text == "42")

    tool = SandboxTool(timeout_s=3.0, max_output_chars=300)
    env = ToolEnv("q", syntax=PYTHON_TAGS, tool=tool, grader=Exact(), max_tool_calls=4)
    assert env.step("<python>print(6 * 7)</python>").observation == "<output>42</output>"
    code_error = env.step("<python>1 / 0</python>")
    assert code_error.info["tool_errors"] == 1 and code_error.info["tool_infra_errors"] == 0

    def no_memory(*args: object) -> int:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(os, "memfd_create", no_memory)  # the machine fails, not the code
    infra = env.step("<python>print(1)</python>")
    assert infra.info["tool_errors"] == 1 and infra.info["tool_infra_errors"] == 1
    assert "sandbox setup failed" in (infra.observation or "")


def test_protections_may_be_waived_by_name_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from copc.tools.sandbox import ALLOW_MISSING_ENV, allow_missing_from_env

    monkeypatch.setenv(ALLOW_MISSING_ENV, "seccomp, cgroup_memory")
    assert allow_missing_from_env() == ("seccomp", "cgroup_memory")
    monkeypatch.setenv(ALLOW_MISSING_ENV, "")
    assert allow_missing_from_env() == ()


def _fork_servers() -> int:
    """bwrap children of this process: one per started sandbox."""
    children = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        children += (task / "children").read_text().split()
    return sum(1 for pid in children if b"bwrap" in Path(f"/proc/{pid}/cmdline").read_bytes())


def test_tools_of_many_episodes_share_one_warm_sandbox() -> None:
    """A task makes one SandboxTool per episode: they must not start one fork server each."""
    from copc.tasks.tooling import SandboxTool

    before = _fork_servers()
    tools = [SandboxTool(timeout_s=3.5, max_output_chars=300) for _ in range(5)]
    assert [tool.call(f"print({i})").text for i, tool in enumerate(tools)] == ["0", "1", "2", "3", "4"]
    assert _fork_servers() <= before + 1


def _live_fork_servers() -> set[int]:
    """pids of this process's bwrap children that are running (not zombies)."""
    live = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        for pid in (task / "children").read_text().split():
            with contextlib.suppress(OSError):
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z" and b"bwrap" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    live.add(int(pid))
    return live


def test_the_fork_server_outlives_the_thread_that_started_it() -> None:
    """The episode loop's first tool call runs on a thread pool's thread, which exits at the end of the
    round. bwrap's ``--die-with-parent`` fires when the *thread* that started it exits, so a server
    started there would die after every round, and every round would pay a new server's start."""
    before = _live_fork_servers()
    sandbox = PythonSandbox(CONFIG)
    try:
        worker = threading.Thread(target=sandbox.run, args=("print(1)",))
        worker.start()
        worker.join()
        time.sleep(0.3)  # the parent-death signal is delivered asynchronously
        started = _live_fork_servers() - before
        assert len(started) == 1, "the fork server died with the thread that started it"
        assert sandbox.run("print(2)").stdout.strip() == "2"
        assert _live_fork_servers() - before == started  # the same server served the next run
    finally:
        sandbox.close()


# --------------------------------------------------------------------------------------------------
# Hostile programs on a loaded machine (issue 34, item 1).

HOSTILE = {
    "fork_bomb": "import os\nwhile True:\n    os.fork()\n",
    "fork_bomb_that_waits": FORK_BOMB,  # was 'machine overloaded': its own forks waited for a CPU
    "memory_bomb": "x = []\nwhile True:\n    x.append(bytearray(50 * 2**20))\n",
    "huge_print": "import sys\nsys.stdout.write('x' * (200 * 2**20))\n",
    "file_flood": "import os\ni = 0\nwhile True:\n    open(f'f{i}', 'w').write('x' * 4096)\n    i += 1\n",
    "infinite_loop": "while True:\n    pass\n",  # cpu_s > timeout_s: the wall cap ends it, under load
}


def test_hostile_programs_beside_a_cpu_hog_are_the_programs_outcome(monkeypatch: pytest.MonkeyPatch) -> None:
    """A limit the program hits is its own outcome, however loaded the machine: never an infrastructure
    failure, so ``rollout.infra_failures=drop`` (which drops a group when an episode's
    ``tool_infra_errors`` > 0) cannot let a fork bomb escape its reward. Before the fix a fork bomb and
    a busy loop beside two busy-loop processes were 'machine overloaded' (fault infra): the wall cap
    was blamed on the machine whenever the run's processes had waited for a CPU, their own included."""
    import subprocess
    import sys

    from copc.tasks import tooling
    from copc.tasks.envs import PYTHON_TAGS, ToolEnv

    # the wall cap, not the CPU budget, ends a loop
    small = dataclasses.replace(CONFIG, timeout_s=1.5, cpu_s=3)
    monkeypatch.setattr(tooling, "sandbox_config", lambda timeout_s: small)
    tool = tooling.SandboxTool(timeout_s=small.timeout_s, max_output_chars=300)

    class Never:
        def grade(self, answer_text: str) -> float:
            return 0.0

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    outcomes = {}
    try:
        for name, code in HOSTILE.items():
            env = ToolEnv("q", syntax=PYTHON_TAGS, tool=tool, grader=Never(), max_tool_calls=2)
            step = env.step(f"<python>{code}</python>")
            outcomes[name] = (step.info["tool_errors"], step.info["tool_infra_errors"], step.observation)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    infra = {name: obs for name, (_, infra_errors, obs) in outcomes.items() if infra_errors}
    assert not infra, f"limits hit by the program were scored as the machine's: {infra}"
    assert all(errors == 1 for errors, _, _ in outcomes.values()), outcomes
