"""Does the embedded default run hold up? Run ``copc train`` N times and print the gain of each run.

    .venv/bin/python benchmarks/default_robustness.py [--runs 10] [--jobs 2] [--busy 0] [--stress 0]
        [--out DIR] [overrides ...]

Each run is the embedded default (``copc train`` with no arguments except its run directory and its
seed, ``seed=i`` for run ``i``, plus any ``overrides``), in its own process with one torch thread,
``--jobs`` at a time. Beside them, optionally:

- ``--busy K``: K CPU-bound processes (small matmuls in a loop) for the whole benchmark, the load of
  another tenant on the machine;
- ``--stress K``: K processes that run a battery of hostile programs (fork bomb, memory bomb, file
  spam, busy loop, sleep past the timeout, a huge print) in copc's own Python sandbox in a loop,
  the case where a default run once learned almost nothing (issue 10, "the default run must hold up").

Prints one line per run (eval avg@1 before -> after, the gain, wall seconds, the infrastructure tool
failures per episode of the last training batches) and how many met the target gain (+0.25 by default).
Resumable: a run whose ``summary.json`` exists in ``--out`` is read instead of run again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch.multiprocessing as mp

HOSTILE = {
    "fork_bomb": "import os\nwhile True:\n    os.fork()\n",
    "memory_bomb": "x = []\nwhile True:\n    x.append(bytearray(50 * 2**20))\n",
    "file_spam": "import os\ni = 0\nwhile True:\n    open(f'f{i}', 'w').write('x' * 4096)\n    i += 1\n",
    "busy_loop": "while True:\n    pass\n",
    "sleeper": "import time\ntime.sleep(60)\n",
    "huge_print": "print('x' * (50 * 2**20))\n",
}


def busy_forever() -> None:
    """One CPU-bound tenant: small matmuls in a loop, one thread."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(192, 192)
    while True:
        a = torch.tanh(a @ a * 0.01)


def stress_forever() -> None:
    """Hostile programs in copc's sandbox, one after another, forever."""
    from copc.tools.sandbox import PythonSandbox, SandboxConfig

    sandbox = PythonSandbox(SandboxConfig(timeout_s=2.0, memory_mb=256))
    while True:
        for code in HOSTILE.values():
            sandbox.run(code)


def run_one(index: int, out: Path, overrides: Sequence[str]) -> subprocess.Popen[bytes]:
    run_dir = out / f"run_{index:02d}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "copc.cli", "train", "--no-progress", f"run_dir={run_dir}", f"seed={index}",
           *overrides]
    log = open(out / f"run_{index:02d}.log", "wb")  # noqa: SIM115 (closed when the process ends)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def tool_error_rate(run_dir: Path) -> float | None:
    """Mean ``rollout/tool_infra_errors`` over the last 10 logged steps, when the run logs it."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    values = [r["rollout/tool_infra_errors"] for r in rows if "rollout/tool_infra_errors" in r][-10:]
    return sum(values) / len(values) if values else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound tenant processes beside the runs")
    parser.add_argument("--stress", type=int, default=0, help="processes running hostile sandbox programs")
    parser.add_argument("--target", type=float, default=0.25, help="gain of eval avg@1 a run must reach")
    parser.add_argument("--out", type=Path, default=Path("runs/default_robustness"))
    parser.add_argument("overrides", nargs="*", help="copc train overrides applied to every run")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    ctx = mp.get_context("spawn")
    tenants = [ctx.Process(target=busy_forever, daemon=True) for _ in range(args.busy)]
    tenants += [ctx.Process(target=stress_forever, daemon=True) for _ in range(args.stress)]
    for p in tenants:
        p.start()
    start = time.perf_counter()
    pending = [i for i in range(args.runs) if not (args.out / f"run_{i:02d}" / "summary.json").exists()]
    running: dict[int, subprocess.Popen[bytes]] = {}
    try:
        while pending or running:
            while pending and len(running) < args.jobs:
                i = pending.pop(0)
                running[i] = run_one(i, args.out, args.overrides)
            for i, proc in list(running.items()):
                if proc.poll() is not None:
                    del running[i]
                    if proc.returncode:
                        print(f"run {i}: exit {proc.returncode}, see {args.out / f'run_{i:02d}.log'}",
                              flush=True)
            time.sleep(1.0)
    finally:
        for proc in running.values():
            proc.terminate()
        for p in tenants:
            p.terminate()
            p.join(timeout=10)

    met = 0
    print(f"default run x {args.runs} (jobs {args.jobs}, busy {args.busy}, sandbox stress {args.stress}); "
          f"{time.perf_counter() - start:.0f} s")
    for i in range(args.runs):
        run_dir = args.out / f"run_{i:02d}"
        summary_path = run_dir / "summary.json"
        if not summary_path.exists():
            print(f"  run {i}: no summary (failed)")
            continue
        s = json.loads(summary_path.read_text())
        before, after = s["eval_accuracy_before"], s["eval_accuracy_after"]
        gain = after - before
        met += gain >= args.target
        err = tool_error_rate(run_dir)
        extra = "" if err is None else f"  infra tool failures/episode {err:.3f}"
        print(f"  run {i} (seed {i}): {before:.3f} -> {after:.3f}  gain {gain:+.3f}  "
              f"{s['wall_seconds']:.0f} s{extra}")
    print(f"{met}/{args.runs} runs gained >= {args.target:+.2f}")
    return 0 if met == args.runs else 1


if __name__ == "__main__":
    raise SystemExit(main())
