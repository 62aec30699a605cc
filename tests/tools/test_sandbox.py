"""The Python sandbox: normal runs, limits, and a battery of hostile programs.

Every hostile program must end with a clear tool error (or be harmlessly contained), within the
timeout plus a small slack, with the test process intact and the host untouched. Where a kernel
protection is not available on the machine, the test says which fallback contains the attack or skips
with the reason (``active_protections()`` tells which layers are in force).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import threading
import uuid
from pathlib import Path

import pytest

from copc.tools.sandbox import (
    PythonSandbox,
    SandboxConfig,
    SandboxResult,
    active_protections,
    format_observation,
)

# Small limits keep the battery fast: each hostile run is bounded by TIMEOUT_S.
CONFIG = SandboxConfig(timeout_s=3.0, cpu_s=2, memory_mb=256, max_output_bytes=1024, max_procs=16)
TIMEOUT_S = CONFIG.timeout_s
# Start-up (~0.15 s), killing and reaping take well under a second even on a loaded 2-vCPU box.
SLACK_S = 2.0
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    return PythonSandbox(CONFIG)


@pytest.fixture(scope="module")
def protections() -> dict[str, bool]:
    return active_protections(CONFIG)


def _bounded(result: SandboxResult) -> None:
    assert result.duration_s < TIMEOUT_S + SLACK_S, f"took {result.duration_s:.2f}s: {result}"


def _still_works(sandbox: PythonSandbox) -> None:
    again = sandbox.run("print(6 * 7)")
    assert again.ok and again.stdout == "42\n", again


def test_hello_world(sandbox: PythonSandbox) -> None:
    result = sandbox.run("import math\nprint(math.factorial(20))\n")
    assert result.ok and result.exit_code == 0 and not result.timed_out
    assert result.stdout == "2432902008176640000\n" and result.stderr == ""


def test_exception_reports_last_traceback_line(sandbox: PythonSandbox) -> None:
    result = sandbox.run("print('before')\n1 / 0\n")
    assert result.exit_code == 1 and result.stdout == "before\n"
    assert result.error == "exit code 1: ZeroDivisionError: division by zero"


def _unshare_works() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    flags = ["--net", "--mount", "--pid", "--fork"] if os.geteuid() == 0 else ["--user", "--map-root-user", "--net"]
    return subprocess.run([unshare, *flags, "true"], capture_output=True, timeout=10).returncode == 0


def test_protections_report_on_this_machine(protections: dict[str, bool]) -> None:
    """Wall timeout, output cap, clean env and the rlimits hold everywhere; the rest follow the machine.

    Checked against what the machine allows, found independently of the sandbox: root can always drop
    to an unprivileged uid, and ``unshare`` either works here or not.
    """
    for always in ("wall_timeout", "output_cap", "clean_environment", "rlimit_cpu", "rlimit_as", "rlimit_fsize"):
        assert protections[always], (always, protections)
    if os.geteuid() == 0:
        assert protections["unprivileged_uid"] and protections["no_capabilities"] and protections["rlimit_nproc"]
    if _unshare_works():
        assert protections["network_namespace"] and protections["pid_namespace"] and protections["private_tmp"]
    print("active protections:", protections)


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or not os.access("/usr/bin/python3", os.X_OK),
    reason="needs root (to become an ordinary user), setpriv and /usr/bin/python3",
)
def test_non_root_caller_still_contains_code() -> None:
    """A trainer running as an ordinary user (CI): the sandbox falls back to a user namespace or less."""
    script = (
        # copc.tools/__init__ imports the retriever (bm25s): register bare packages so that only the
        # sandbox modules (standard library only) are imported by the system interpreter.
        "import json, sys, types\n"
        # an unreadable checkout raises PermissionError here (skipped below), not a confusing import error
        f"open({str(REPO / 'src/copc/tools/sandbox.py')!r}).close()\n"
        f"for name, path in (('copc', {str(REPO / 'src/copc')!r}), ('copc.tools', {str(REPO / 'src/copc/tools')!r})):\n"
        "    pkg = types.ModuleType(name); pkg.__path__ = [path]; sys.modules[name] = pkg\n"
        "import copc.tools.sandbox as m\n"
        "sb = m.PythonSandbox(m.SandboxConfig(timeout_s=2.0, cpu_s=1))\n"
        "loop = sb.run('while True: pass')\n"
        "hello = sb.run('print(6 * 7)')\n"
        "print(json.dumps({'protections': m.active_protections(sb.config), 'loop': loop.error,"
        " 'hello': hello.stdout}))\n"
    )
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-I", "-c", script]
    done = subprocess.run(nobody, capture_output=True, text=True, timeout=60, cwd="/")
    if done.returncode != 0 and "Permission denied" in done.stderr:
        pytest.skip(f"the repository is not readable by uid 65534: {done.stderr[-200:]}")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["hello"] == "42\n" and report["loop"] is not None
    assert report["protections"]["clean_environment"] and report["protections"]["rlimit_cpu"]
    assert not report["protections"]["unprivileged_uid"] or report["protections"]["no_capabilities"]
    print("non-root caller protections:", report["protections"])


def test_disabling_namespaces_is_reported() -> None:
    found = active_protections(SandboxConfig(namespaces=False))
    assert not found["network_namespace"] and not found["pid_namespace"] and not found["private_tmp"]


def test_infinite_loop(sandbox: PythonSandbox) -> None:
    result = sandbox.run("while True:\n    pass\n")
    _bounded(result)
    assert result.exit_code is None and result.error is not None
    # Either the CPU rlimit (2 s of CPU) or the wall clock (3 s) ends it, whichever comes first.
    assert "SIGXCPU" in result.error or result.timed_out, result.error
    _still_works(sandbox)


def test_sleep_hits_wall_timeout(sandbox: PythonSandbox) -> None:
    """No CPU is used, so only the caller's wall-clock deadline can stop it."""
    result = sandbox.run("import time\nprint('start', flush=True)\ntime.sleep(60)\n")
    _bounded(result)
    assert result.timed_out and result.error == f"timeout after {TIMEOUT_S}s"
    assert result.stdout == "start\n"  # output produced before the kill is kept


FORK_BOMB = (
        "import os, time\n"
        "n = 0\n"
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()\n"  # try to escape the process group
        "        n += 1\n"
        "    except OSError:\n"
        "        time.sleep(0.01)\n"
)


def _sandbox_uid_pids() -> list[int]:
    """Live host processes owned by the sandbox uids of this test process (other processes' sandboxes,
    e.g. another test run on the machine, use other uids: ``uid_base + (pid mod 1024) * 64 + slot``)."""
    low = SandboxConfig().uid_base + (os.getpid() % 1024) * 64
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and low <= _uid_of(p) < low + 64]


def _uid_of(proc_dir: Path) -> int:
    try:
        for line in (proc_dir / "status").read_text().splitlines():
            if line.startswith("State:") and "Z" in line.split()[1]:
                return -1  # zombies hold no resources but their slot in the table
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


@pytest.mark.parametrize("namespaces", [True, False], ids=["pid-namespace", "uid-sweep"])
def test_fork_bomb(protections: dict[str, bool], namespaces: bool) -> None:
    """Forks that setsid() out of the process group are still killed: by the PID namespace's end, or
    (no namespace) by killing every process of the run's private uid. Neither exists for a non-root
    caller without namespaces, and there the escaped forks would outlive the test: not run."""
    if namespaces and not protections["pid_namespace"]:
        pytest.skip("no PID namespace on this machine")
    if not namespaces and os.geteuid() != 0:
        pytest.skip("the uid sweep needs a root caller (it runs the code as a private uid)")
    sandbox = PythonSandbox(SandboxConfig(timeout_s=TIMEOUT_S, cpu_s=2, max_procs=16, namespaces=namespaces))
    result = sandbox.run(FORK_BOMB)
    _bounded(result)
    assert result.error is not None
    assert _sandbox_uid_pids() == [], "forks of the bomb survived the run"
    _still_works(sandbox)


def test_memory_bomb(sandbox: PythonSandbox) -> None:
    result = sandbox.run("chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))\n")
    _bounded(result)
    assert result.error == f"memory limit ({CONFIG.memory_mb} MB)", result


def test_write_outside_workdir(sandbox: PythonSandbox, protections: dict[str, bool]) -> None:
    """/tmp is world-writable: only the private tmpfs keeps it clean; the repo needs the unprivileged uid."""
    tmp_target = f"/tmp/owned-{uuid.uuid4().hex}"
    repo_target = REPO / f"owned-{uuid.uuid4().hex}"
    code = (
        f"for path in [{tmp_target!r}, {str(repo_target)!r}]:\n"
        "    try:\n"
        "        open(path, 'w').write('owned')\n"
        "        print('wrote', path)\n"
        "    except OSError as e:\n"
        "        print('blocked', type(e).__name__)\n"
        "open('inside.txt', 'w').write('fine')\n"
        "print(open('inside.txt').read())\n"
    )
    result = sandbox.run(code)
    try:
        assert result.exit_code == 0 and result.stdout.endswith("fine\n"), result
        if protections["unprivileged_uid"]:
            assert not repo_target.exists(), "the unprivileged uid must not write to the repository"
        if protections["private_tmp"]:
            assert not os.path.exists(tmp_target), "the private tmpfs must hide the host /tmp"
        else:
            pytest.skip("no mount namespace: /tmp is world-writable and the write cannot be stopped here")
    finally:
        for path in (tmp_target, str(repo_target)):
            if os.path.exists(path):
                os.remove(path)


def test_delete_files_outside(sandbox: PythonSandbox, tmp_path: Path, protections: dict[str, bool]) -> None:
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    victim.chmod(0o666)  # even world-writable: the directory is what protects it
    code = f"import os, shutil\nfor f in [os.remove, shutil.rmtree]:\n    try:\n        f({str(victim)!r})\n    except OSError as e:\n        print('blocked', type(e).__name__)\n"
    result = sandbox.run(code)
    assert result.exit_code == 0, result
    if not (protections["unprivileged_uid"] or protections["private_tmp"]):
        pytest.skip("code runs as root without a mount namespace: host files are not protected")
    assert victim.read_text() == "keep me"


def test_no_network(sandbox: PythonSandbox, protections: dict[str, bool]) -> None:
    if not protections["network_namespace"]:
        pytest.skip("no network namespace here (unshare unavailable): network is NOT blocked")
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


def _isolated_from_caller(protections: dict[str, bool]) -> bool:
    """The code can neither see the caller's processes nor act as the caller's uid."""
    return protections["pid_namespace"] or protections["unprivileged_uid"]


def test_parent_environment_is_invisible(
    sandbox: PythonSandbox, protections: dict[str, bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("COPC_TEST_SECRET", secret)
    # The child searches itself (its output is capped, so it must not just print everything).
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
    assert result.exit_code == 0 and not result.stdout.count("[... output truncated"), result
    assert "leak-env False" in result.stdout, result.stdout
    if not _isolated_from_caller(protections):
        pytest.skip("same uid as the caller and no PID namespace: /proc/<caller>/environ is readable here")
    assert "True" not in result.stdout and secret not in result.stdout + result.stderr, result.stdout


def test_cannot_signal_the_caller(sandbox: PythonSandbox, protections: dict[str, bool]) -> None:
    """If any of these kills reached pytest, this test (and the run) would die."""
    if not _isolated_from_caller(protections):
        pytest.skip("same uid as the caller and no PID namespace: the code could kill the test runner")
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


def test_huge_print_is_truncated(sandbox: PythonSandbox) -> None:
    result = sandbox.run("import sys\nsys.stdout.write('x' * (100 * 2**20))\n")
    _bounded(result)
    assert result.stdout.startswith("x" * CONFIG.max_output_bytes)
    assert "[... output truncated:" in result.stdout
    assert len(result.stdout) < CONFIG.max_output_bytes + 100
    assert result.error is not None and "output truncated" in result.error


def test_os_exit(sandbox: PythonSandbox) -> None:
    result = sandbox.run("import os\nprint('bye', flush=True)\nos._exit(3)\n")
    assert result.exit_code == 3 and result.stdout == "bye\n" and result.error == "exit code 3"


def test_recursion_bomb(sandbox: PythonSandbox) -> None:
    code = "import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1) + 1\nf(0)\n"
    result = sandbox.run(code)
    _bounded(result)
    assert result.error is not None and result.exit_code != 0, result
    _still_works(sandbox)


def test_file_size_limit() -> None:
    sandbox = PythonSandbox(SandboxConfig(timeout_s=3.0, max_file_bytes=4096))
    result = sandbox.run("open('big', 'wb').write(b'0' * 100000)\n")
    assert result.error is not None and "file size limit" in result.error, result


def test_concurrent_runs_are_independent(sandbox: PythonSandbox) -> None:
    results: dict[int, SandboxResult] = {}

    def work(i: int) -> None:
        results[i] = sandbox.run(f"import time\ntime.sleep(0.3)\nprint({i} ** 2)\n")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {i: r.stdout for i, r in results.items()} == {i: f"{i * i}\n" for i in range(4)}


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
    assert SandboxConfig(timeout_s=2.5).cpu_limit_s == 3 and SandboxConfig(timeout_s=2.5, cpu_s=1).cpu_limit_s == 1


def test_undecodable_code_is_a_tool_error_not_an_exception(sandbox: PythonSandbox) -> None:
    result = sandbox.run("print('a\udcff')\n")  # a lone surrogate, as broken generated text can hold
    assert result.exit_code == 0 and result.stdout == "a?\n"  # the encoder's replacement character


def test_machine_failure_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    sandbox = PythonSandbox(CONFIG)

    def no_more_processes(*args: object, **kwargs: object) -> None:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(subprocess, "Popen", no_more_processes)
    result = sandbox.run("print(1)")
    assert result.exit_code is None and result.error is not None
    assert result.error.startswith("sandbox setup failed: BlockingIOError")


def test_config_round_trips_through_json() -> None:
    config = SandboxConfig(timeout_s=7.5, cpu_s=3, network=True, max_procs=8)
    assert SandboxConfig(**json.loads(json.dumps(dataclasses.asdict(config)))) == config


def test_config_validation_says_how_to_fix() -> None:
    with pytest.raises(ValueError, match=r"timeout_s=0 must be in \(0, 3600\]"):
        SandboxConfig(timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb=8"):
        SandboxConfig(memory_mb=8)
    with pytest.raises(ValueError, match="python_executable"):
        SandboxConfig(python_executable="/nonexistent/python")


def test_work_dirs_of_a_killed_caller_are_reaped(tmp_path):
    """A caller killed by SIGKILL leaves its work-dir parent behind; the next sandbox removes it, and
    never the parent of a live process."""
    import signal
    import subprocess
    import sys

    from copc.tools.sandbox import _session_dir, reap_orphan_workdirs

    code = (
        "import os, signal, sys\n"
        "from copc.tools.sandbox import PythonSandbox, _session_dir\n"
        "assert PythonSandbox().run('print(1)').stdout == '1\\n'\n"
        "print(_session_dir(), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    live = _session_dir()  # created (and orphans reaped) before the caller below is killed
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    orphan = proc.stdout.strip()
    assert os.path.isdir(orphan) and os.path.basename(orphan).startswith("copc-sbx-")
    removed = reap_orphan_workdirs(os.path.dirname(orphan))
    assert orphan in removed and not os.path.exists(orphan)
    assert os.path.isdir(live) and live not in removed
    # unrelated names are left alone
    (tmp_path / "copc-sbx-marker-abc").mkdir()
    (tmp_path / "copc-sbx-12ab").mkdir()
    assert reap_orphan_workdirs(str(tmp_path)) == []
