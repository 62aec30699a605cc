"""The checks of the kill torture (``benchmarks/kill_torture.py``) on a run that finished after kills:
bit-for-bit equality with the reference (sync), no batch lost or trained twice (async), a valid chain
of checkpoints (both); where a kill landed, read from a ``py-spy dump`` of the trainer; and which
processes of the trainer's tree a kill of each kind goes to."""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from copc.trainer.checkpoint import CheckpointError, list_checkpoints, load_latest, verify_checkpoint

VOLATILE = ("time/", "perf/", "memory/")
TIMING = ("wall_seconds", "step_seconds_median", "wall_seconds_this_process", "eval_seconds_this_process",
          "checkpoint_seconds_this_process", "run_dir")
#: Where the code came from (the git commit, files edited since): the same computation in another checkout.
PROVENANCE = ("commit", "dirty_paths")


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                out.append(int(entry))
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def victims(trainer: int, target: str) -> list[int]:
    """Processes of ``target`` kind in the trainer's tree (trainer, worker, forkserver, sandbox)."""
    if target == "trainer":
        return [trainer]
    servers = [p for p in _children(trainer) if "multiprocessing.forkserver" in _cmdline(p)]
    if target == "forkserver":
        return servers
    if target == "worker":
        return [w for s in servers for w in _children(s)]
    # the tool sandbox's warm fork server runs under bwrap: the python process whose parent is a bwrap (its
    # own command line holds the word too, so its children, the code runs, are told apart by the program)
    return [p for p in _tree(trainer) if "python" in _cmdline(p)
            and _cmdline(_parent(p)).split(" ", 1)[0].endswith("/bwrap")]


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


#: (substring of a py-spy frame line, phase): a frame anywhere in the main thread's stack names the phase,
#: the innermost of these winning (a checkpoint's weights are written by copc/trainer/weight_files.py).
ENCLOSING = (
    ("save_checkpoint (copc/trainer/checkpoint.py", "checkpoint write"),
    ("copc/runtime/journal.py", "journal append"),
    ("copc/run/plots.py", "plots"),
    ("_evaluate (copc/run/train.py", "evaluation"),
    ("_summary (copc/run/train.py", "summary"),
)
#: Then the innermost frame that names one of these.
PHASES = (
    ("copc/trainer/checkpoint.py", "start-up (build, load)"),
    ("copc/run/tracker.py", "metrics write"),
    ("copc/trainer/", "train step"),
    ("next_batch (copc/runtime/async_local.py", "waiting for a batch"),
    ("copc/runtime/sync.py", "rollout"),
    ("copc/rollout/", "rollout"),
    ("run_loop (copc/runtime/loop.py", "loop"),
    ("copc/run/train.py", "start-up (build, load)"),
)


def phase_of(dump: str) -> str:
    """The phase a py-spy dump of the trainer shows (module docstring)."""
    if not dump:
        return "unknown"
    threads = dump.split("\nThread ")
    for thread in threads[1:]:  # a journal write in the receiver thread is the rarest, most telling moment
        if "copc/runtime/journal.py" in thread and "write (" in thread:
            return "journal append"
    main = next((t for t in threads[1:] if '"MainThread"' in t.splitlines()[0]), "")
    if main and "train (copc/run/train.py" not in main:  # copc train's own code has not started yet
        return "start-up (imports)"
    frames = main.splitlines()[1:]
    for line in frames:
        for key, phase in ENCLOSING:
            if key in line:
                return phase
    for line in frames:
        for key, phase in PHASES:
            if key in line:
                return phase
    if main:
        return "start-up (imports)"
    return "exit (no main thread)" if len(threads) > 1 else "unknown"


def spy(pid: int) -> str:
    tool = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(tool).exists():
        return ""
    try:
        return subprocess.run([tool, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True,
                              text=True, timeout=20).stdout
    except (subprocess.TimeoutExpired, OSError):
        return ""


def training_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss/value" in r]


def stable(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if k != "time" and not k.startswith(VOLATILE)} for r in rows]


def summary_of(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    return {k: v for k, v in summary.items() if k not in TIMING + PROVENANCE}


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def chain_problems(run_dir: Path, steps: int) -> list[str]:
    problems = []
    for step in list_checkpoints(run_dir):
        try:
            verify_checkpoint(run_dir / "checkpoints" / f"step_{step:08d}")
        except CheckpointError as err:
            problems.append(str(err))
    latest = load_latest(run_dir)
    if latest is None or latest[0] != steps:
        problems.append(f"the latest checkpoint is {latest and latest[0]}, not step {steps}")
    else:
        version = int(latest[1]["trainer"]["version"])  # type: ignore[index,call-overload]
        if version != steps:
            problems.append(f"the trainer's version is {version}, not {steps}")
    return problems


def train_samples(run_dir: Path) -> dict[int, list[str]]:
    out: dict[int, list[str]] = collections.defaultdict(list)
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("source") == "train":
            out[int(row["step"])].append(json.dumps({k: row[k] for k in ("prompt_id", "turns", "reward")}))
    return out


def journal_snapshot(run_dir: Path, tokenizer: object) -> dict[int, list[str]]:
    """Batches the journal holds past the last checkpoint's ``next_put``, rendered like training samples."""
    from copc.rollout.samples import render_episode
    from copc.runtime.journal import Journal, JournalDamage

    latest = load_latest(run_dir)
    next_put = int(latest[1]["source"]["next_put"]) if latest else 0  # type: ignore[index,call-overload]
    if not (run_dir / "rollouts").is_dir():
        return {}
    journal, out = Journal(run_dir / "rollouts"), {}
    for index in journal.indices():
        if index < next_put:
            continue
        try:
            batch = journal.read(index)
        except JournalDamage:
            continue
        rendered = [render_episode(t, tokenizer) for t in batch.trajectories[:4]]  # type: ignore[arg-type]
        out[index] = [json.dumps({k: e[k] for k in ("prompt_id", "turns", "reward")}) for e in rendered]
    return out


def check_async(run_dir: Path, steps: int,
                snapshots: list[dict[int, list[str]]]) -> tuple[int, int, list[str]]:
    rows = training_rows(run_dir)
    counts = collections.Counter(int(r["step"]) for r in rows)
    lost = sum(1 for s in range(steps) if counts[s] == 0)
    duplicated = sum(c - 1 for c in counts.values() if c > 1)
    problems = [f"row of step {r['step']} has train/version {r['train/version']}" for r in rows
                if int(r["train/version"]) != int(r["step"]) + 1]
    samples = train_samples(run_dir)
    for snapshot in snapshots:
        for index, episodes in snapshot.items():
            if index < steps and samples.get(index) != episodes:
                lost += 1
                problems.append(f"batch {index} was journaled but step {index} trained other episodes")
    seen: dict[str, int] = {}
    for step, episodes in samples.items():
        key = "\n".join(episodes)
        if key in seen:
            duplicated += 1
            problems.append(f"steps {seen[key]} and {step} trained the same episodes")
        seen[key] = step
    return lost, duplicated, problems + chain_problems(run_dir, steps)


def check_sync(reference: Path, run_dir: Path, steps: int) -> list[str]:
    problems = []
    if stable(run_dir) != stable(reference):
        problems.append("metrics.jsonl differs")
    if (run_dir / "samples.jsonl").read_text() != (reference / "samples.jsonl").read_text():
        problems.append("samples.jsonl differs")
    if summary_of(run_dir) != summary_of(reference):
        problems.append("summary.json differs")
    ref, got = load_latest(reference), load_latest(run_dir)
    if got is None or ref is None or not same(ref[1]["trainer"], got[1]["trainer"]):
        problems.append("final weights or optimizer state differ")
    return problems + chain_problems(run_dir, steps)


