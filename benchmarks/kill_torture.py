"""Kill torture: SIGKILL ``copc train`` at random moments, resume it until it finishes, check the result.

    python benchmarks/kill_torture.py --kills 100 --driver sync  [--out results/kill_torture/sync]
    python benchmarks/kill_torture.py --kills 100 --driver async [--out results/kill_torture/async]

A reference run of a deliberately small config (the random tiny model, 10 steps, an evaluation every
3 steps, a checkpoint every 2 (sync) or every step (async), plots, every training episode written to
``samples.jsonl``) is run to the end in a process of its own; its wall time ``T`` sets the window.
Then runs of the same config are started in fresh run directories; each process is SIGKILLed at a
moment drawn uniformly from ``[0, T]`` and resumed with ``copc train run_dir=R resume=true``, one to
three kills per run, until the run finishes (the last process is never killed).

Where a kill landed: just before the SIGKILL the trainer is stopped (SIGSTOP) and its Python stacks
read with ``py-spy dump`` (when installed); the innermost copc frame names the phase (start-up, rollout,
train step, evaluation, metrics write, checkpoint write, journal append, plots, summary). Without
py-spy the phase is ``unknown``.

Checks after each run ends:

- ``sync`` (one deterministic process): final weights and optimizer state (the last checkpoint's
  trainer payload), ``metrics.jsonl`` (time, ``time/``, ``perf/`` and ``memory/`` fields aside),
  ``samples.jsonl`` and ``summary.json`` (wall times and the run directory aside) equal the reference's
  bit for bit; any difference is a divergence.
- ``async`` (bounded staleness, not deterministic): besides trainer kills, a rollout worker, the
  multiprocessing fork server that starts workers, or the tool sandbox's fork server is SIGKILLed at
  times; the run must continue or end in one ``error:`` line (no traceback) and resume. Then: one
  training row per step 0..steps-1 (a missing step is lost, a repeated one duplicated), ``train/version``
  of row ``n`` is ``n + 1`` and the last checkpoint's version is ``steps``; every batch the journal held
  after a kill past the checkpoint's ``next_put`` was trained as journaled (its episodes are the training
  samples of that step; a regenerated one is lost); no two steps trained the same episodes (duplicated);
  every checkpoint left verifies. A run that does not finish in 12 processes, or breaks a rule other than
  lost / duplicated, is a divergence.

The last line is ``kills=N divergences=D lost=L duplicated=U``; ``--out`` also gets ``kills.jsonl`` (one
line per kill: run, attempt, target, seconds, phase) and ``summary.json`` (the histogram by phase).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from copc.trainer.checkpoint import CheckpointError, list_checkpoints, load_latest, verify_checkpoint

COPC = [sys.executable, "-m", "copc.cli"]
VOLATILE = ("time/", "perf/", "memory/")
TIMING = ("wall_seconds", "step_seconds_median", "wall_seconds_this_process", "eval_seconds_this_process",
          "checkpoint_seconds_this_process", "run_dir")
#: Where the code came from (the git commit, files edited since): the same computation in another checkout.
PROVENANCE = ("commit", "dirty_paths")
MAX_ATTEMPTS = 12
#: PYTHONPATH of the copy of src/copc every process runs (a checkout edited during the torture would
#: otherwise change the code between the reference and the runs).
SNAPSHOT: dict[str, str] = {}


def config_yaml(driver: str, steps: int) -> str:
    every = 1 if driver == "async" else 2
    mode = "bounded" if driver == "async" else "fixed_lag"
    return f"""task: arith_tool
task_options: {{train_size: 200, eval_size: 8}}
method: copc
steps: {steps}
seed: 5
checkpoint_every: {every}
plots: true
model: {{policy: tiny}}
rollout: {{prompts_per_batch: 2, group_size: 2, max_turns: 2, max_new_tokens_per_turn: 8, max_total_tokens: 12,
  context_limit: 96}}
trainer: {{actor_lr: 0.001, critic_lr: 0.001, micro_batch_size: 4, critic_warmup_steps: 2}}
staleness: {{mode: {mode}, staleness: 1}}
driver: {{kind: {driver}, num_workers: 1}}
eval: {{prompts: 2, samples: 1, greedy: false, every: 3}}
samples: {{per_log: 4, every: 1}}
"""


# ------------------------------------------------------------------------------------ processes
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
    # the tool sandbox's warm fork server runs under bwrap: the python process below a bwrap
    return [p for p in _tree(trainer) if "python" in _cmdline(p) and "bwrap" in _cmdline(_parent(p))]


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


#: (substring of a py-spy frame line, phase), tried on each frame from the innermost outwards.
PHASES = (
    ("copc/trainer/checkpoint.py", "checkpoint write"),
    ("copc/runtime/journal.py", "journal append"),
    ("copc/run/plots.py", "plots"),
    ("_evaluate (copc/run/train.py", "evaluation"),
    ("copc/run/tracker.py", "metrics write"),
    ("copc/trainer/", "train step"),
    ("next_batch (copc/runtime/async_local.py", "waiting for a batch"),
    ("copc/runtime/sync.py", "rollout"),
    ("copc/rollout/", "rollout"),
    ("_summary (copc/run/train.py", "summary"),
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
    for line in main.splitlines()[1:]:
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
        return subprocess.run([tool, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=20).stdout
    except (subprocess.TimeoutExpired, OSError):
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


# ------------------------------------------------------------------------------------ one process
def run_process(args: list[str], log: Path, kill_at: float | None, target: str) -> tuple[int, dict | None, str]:
    """Start ``copc train args``; at ``kill_at`` seconds SIGKILL ``target``; wait for the end.
    Returns (exit code, the kill's record or None, stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **SNAPSHOT}
    start = time.monotonic()
    with log.open("w") as err:
        proc = subprocess.Popen([*COPC, "train", "--no-progress", *args], stdout=subprocess.DEVNULL, stderr=err,
                                env=env, start_new_session=True)
    kill = None
    try:
        if kill_at is not None:
            while proc.poll() is None and time.monotonic() - start < kill_at:
                time.sleep(0.005)
            if proc.poll() is None:
                kill = _deliver(proc.pid, target, time.monotonic() - start)
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # the workers, fork servers and sandbox go by themselves within seconds (docs/reliability.md)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _group(proc.pid):
        time.sleep(0.1)
    for pid in _group(proc.pid):  # never leave anything behind, but say so
        kill = kill or {}
        kill["left_behind"] = kill.get("left_behind", 0) + 1
        os.kill(pid, signal.SIGKILL)
    return code, kill, log.read_text(errors="replace")


def _group(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid and _alive(int(entry)):
                    out.append(int(entry))
            except OSError:
                continue
    return out


def _deliver(trainer: int, target: str, seconds: float) -> dict | None:
    pids = victims(trainer, target)
    if not pids:
        return {"absent": target}
    victim = random.choice(pids)
    if target == "trainer":
        os.kill(trainer, signal.SIGSTOP)  # the moment is now: read where it is, then kill it there
        dump = spy(trainer)
        phase = phase_of(dump)
        os.kill(trainer, signal.SIGKILL)
        os.kill(trainer, signal.SIGCONT)
    else:
        dump = spy(trainer)
        phase = phase_of(dump)
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:  # it ended between the listing and the kill (a worker restarting)
            return {"absent": target}
    # the stacks, so that the phase can be read again: frames of copc and the innermost three of each thread
    frames = [line.strip() for line in dump.splitlines() if "copc/" in line or line.startswith("Thread")]
    return {"target": target, "seconds": round(seconds, 3), "phase": phase, "stack": frames[:60],
            "innermost": [line.strip() for line in dump.splitlines()[3:6]]}


# ------------------------------------------------------------------------------------ checks
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
    elif int(latest[1]["trainer"]["version"]) != steps:  # type: ignore[index,call-overload]
        problems.append(f"the trainer's version is {latest[1]['trainer']['version']}, not {steps}")  # type: ignore[index]
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


def check_async(run_dir: Path, steps: int, snapshots: list[dict[int, list[str]]]) -> tuple[int, int, list[str]]:
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


# ------------------------------------------------------------------------------------ main
def command(cfg: Path, run_dir: Path, attempt: int) -> list[str]:
    """The first process starts the run; later ones resume it as a user would: ``run_dir=R resume=true``
    once the run has its ``config.yaml``; before that (killed in start-up) the first command again,
    with ``resume=true`` when the directory exists (a fresh start refuses a directory in use)."""
    if attempt > 0 and (run_dir / "config.yaml").is_file():
        return [f"run_dir={run_dir}", "resume=true"]
    first = ["--config", str(cfg), f"run_dir={run_dir}"]
    return [*first, "resume=true"] if run_dir.exists() else first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--driver", choices=("sync", "async"), default="sync")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument("--out", default=None, help="folder for kills.jsonl and summary.json")
    parser.add_argument("--work", default=None, help="folder for the run directories (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    random.seed(args.seed)
    work = Path(args.work or tempfile.mkdtemp(prefix="kill_torture-"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "kills.jsonl").write_text("")
    source = Path(__file__).resolve().parents[1] / "src" / "copc"
    shutil.rmtree(work / "src", ignore_errors=True)
    shutil.copytree(source, work / "src" / "copc", ignore=shutil.ignore_patterns("__pycache__"))
    SNAPSHOT["PYTHONPATH"] = str(work / "src")
    cfg = work / "config.yaml"
    cfg.write_text(config_yaml(args.driver, args.steps))
    reference = work / "reference"
    shutil.rmtree(reference, ignore_errors=True)
    began = time.monotonic()
    code, _, err = run_process(["--config", str(cfg), f"run_dir={reference}"], work / "reference.log", None, "")
    window = time.monotonic() - began
    if code != 0:
        print(err, file=sys.stderr)
        print(f"the reference run failed (exit {code})", file=sys.stderr)
        return 1
    print(f"reference: {window:.1f} s; kills drawn uniformly in [0, {window:.1f}] s", flush=True)
    tokenizer = None
    if args.driver == "async":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(reference / "tiny_init"))
    kills = divergences = lost = duplicated = resumes = runs = unclean = 0
    phases: collections.Counter[str] = collections.Counter()
    targets: collections.Counter[str] = collections.Counter()
    absent: collections.Counter[str] = collections.Counter()  # a target with no process at its moment
    while kills < args.kills:
        run_dir = work / f"run_{runs:04d}"
        shutil.rmtree(run_dir, ignore_errors=True)
        planned, snapshots, finished, problems = rng.randint(1, 3), [], False, []
        for attempt in range(MAX_ATTEMPTS):
            start = command(cfg, run_dir, attempt)
            kill_at, target = None, "trainer"
            if planned > 0 and kills < args.kills:
                kill_at = rng.uniform(0.0, window)
                if args.driver == "async":
                    target = rng.choices(("trainer", "worker", "forkserver", "sandbox"), (6, 2, 1, 1))[0]
            code, kill, err = run_process(start, work / f"{run_dir.name}.{attempt}.log", kill_at, target)
            if attempt > 0:
                resumes += 1
            if kill is not None and "target" in kill:
                kills += 1
                planned -= 1
                phases[kill["phase"]] += 1
                targets[kill["target"]] += 1
                kill.update(run=runs, attempt=attempt, exit=code)
                if out is not None:
                    with (out / "kills.jsonl").open("a") as handle:
                        handle.write(json.dumps(kill) + "\n")
            if kill is not None and "absent" in kill:
                absent[kill["absent"]] += 1
            if kill is not None and kill.get("left_behind"):
                problems.append(f"attempt {attempt}: {kill['left_behind']} processes left behind")
            if code not in (0, -signal.SIGKILL) and (code != 1 or "Traceback" in err.split("error:", 1)[0]
                                                      or not err.strip()):
                unclean += 1
                problems.append(f"attempt {attempt}: exit {code}: {err.strip()[-400:]}")
            if code != 0 and tokenizer is not None and (run_dir / "rollouts").is_dir():
                snapshots.append(journal_snapshot(run_dir, tokenizer))
            if code == 0:
                finished = True
                break
        if not finished:
            problems.append(f"did not finish in {MAX_ATTEMPTS} processes")
        elif args.driver == "sync":
            problems += check_sync(reference, run_dir, args.steps)
        else:
            run_lost, run_dup, more = check_async(run_dir, args.steps, snapshots)
            lost, duplicated = lost + run_lost, duplicated + run_dup
            problems += more
        if problems:
            divergences += 1
            print(f"run {runs}: " + "; ".join(problems), flush=True)
        elif not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
        runs += 1
        print(f"run {runs}: kills so far {kills}", flush=True)
    summary = {"driver": args.driver, "kills": kills, "runs": runs, "resumes": resumes, "divergences": divergences,
               "lost": lost, "duplicated": duplicated, "unclean_exits": unclean, "reference_seconds": window,
               "phases": dict(phases.most_common()), "targets": dict(targets), "absent_targets": dict(absent), "seed": args.seed,
               "steps": args.steps, "wall_seconds": time.monotonic() - began}
    print(json.dumps(summary), flush=True)
    if out is not None:
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not args.keep and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    print(f"kills={kills} divergences={divergences} lost={lost} duplicated={duplicated}")
    return 0 if divergences == lost == duplicated == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
