"""Kill torture: SIGKILL ``copc train`` at random moments, resume it until it finishes, check the result.

    python benchmarks/kill_torture.py --kills 100 --driver sync  [--out results/kill_torture/sync]
    python benchmarks/kill_torture.py --kills 100 --driver async [--out results/kill_torture/async]
        [--schedule uniform|post-import|writes] [--work DIR --resume]

A reference run of a deliberately small config (the random tiny model, 10 steps, an evaluation every
3 steps, a checkpoint every 2 (sync) or every step (async), plots, every training episode written to
``samples.jsonl``) is run to the end in a process of its own; its wall time ``T`` sets the window.
Then runs of the same config are started in fresh run directories; each process is SIGKILLed at a
moment given by ``--schedule`` and resumed with ``copc train run_dir=R resume=true``, one to three kills
per run, until the run finishes (the last process is never killed). ``uniform``: a moment drawn from
``[0, T]`` (most land in the imports of a short process); ``post-import``: drawn from the part of the
process after its imports; ``writes``: a few ms after the process starts a checkpoint write or journal
append, as its run directory shows (see :func:`schedule`).

Resumable: ``--out`` gets one line per finished run (``runs.jsonl``) as it finishes; ``--resume`` with the
same ``--out`` and ``--work`` counts those runs, reuses the reference and goes on to ``--kills`` in all
(a run cut short by the interruption starts again). Run ``i``'s kill schedule is seeded by ``(seed, i)``.

Where a kill landed: just before the SIGKILL the trainer is stopped (SIGSTOP) and its Python stacks
read with ``py-spy dump`` (when installed); a frame of a checkpoint write, journal append, plot,
evaluation or summary anywhere in the stack names the phase, else the innermost copc frame does
(start-up, rollout, train step, metrics write, waiting for a batch). Without py-spy it is ``unknown``.

``--policy warmstart`` trains arith_tool's warm-started tiny policy, which calls its Python tool, so that
the sandbox's fork server runs and ``--targets sandbox`` finds it (the random tiny model never calls it).

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
line per kill: run, attempt, target, seconds, phase), ``settings.json`` and ``summary.json`` (the
histogram by phase).
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
from collections.abc import Callable
from pathlib import Path

from kill_checks import check_async, check_sync, journal_snapshot, phase_of, spy, victims

COPC = [sys.executable, "-m", "copc.cli"]
MAX_ATTEMPTS = 12
CHECKPOINT_EVERY = {"sync": 2, "async": 1}
#: How often each kind of process is the one an async kill goes to, among those --targets names.
TARGET_WEIGHTS = {"trainer": 6, "worker": 2, "forkserver": 1, "sandbox": 1}
#: PYTHONPATH of the copy of src/copc every process runs (a checkout edited during the torture would
#: otherwise change the code between the reference and the runs).
SNAPSHOT: dict[str, str] = {}


def config_yaml(driver: str, steps: int, policy: str = "tiny") -> str:
    """The torture's config. ``policy: warmstart``: arith_tool's cached warm-started tiny policy (default
    task options, so the cache built once serves), long enough turns to write and run Python: the tool
    sandbox's fork server starts and can be killed (the random tiny model never calls its tool)."""
    every = CHECKPOINT_EVERY[driver]
    mode = "bounded" if driver == "async" else "fixed_lag"
    if policy == "warmstart":
        model = """model: {policy: warmstart}
rollout: {prompts_per_batch: 2, group_size: 2, max_turns: 2, max_new_tokens_per_turn: 40,
  max_total_tokens: 120}"""
    else:
        model = """task_options: {train_size: 200, eval_size: 8}
model: {policy: tiny}
rollout: {prompts_per_batch: 2, group_size: 2, max_turns: 2, max_new_tokens_per_turn: 8,
  max_total_tokens: 12, context_limit: 96}"""
    return f"""task: arith_tool
method: copc
steps: {steps}
seed: 5
checkpoint_every: {every}
plots: true
{model}
trainer: {{actor_lr: 0.001, critic_lr: 0.001, micro_batch_size: 4, critic_warmup_steps: 2}}
staleness: {{mode: {mode}, staleness: 1}}
driver: {{kind: {driver}, num_workers: 1}}
eval: {{prompts: 2, samples: 1, greedy: false, every: 3}}
samples: {{per_log: 4, every: 1}}
"""


# ------------------------------------------------------------------------------------ processes
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


# ------------------------------------------------------------------------------------ one process
def run_process(args: list[str], log: Path, when: Callable[[float], bool] | None, target: str,
                rng: random.Random) -> tuple[int, dict | None, str]:
    """Start ``copc train args``; SIGKILL ``target`` once ``when(seconds since the start)`` is true
    (polled every 5 ms; never with ``when=None``); wait for the end.
    Returns (exit code, the kill's record or None, stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **SNAPSHOT}
    start = time.monotonic()
    with log.open("w") as err:
        proc = subprocess.Popen([*COPC, "train", "--no-progress", *args], stdout=subprocess.DEVNULL,
                                stderr=err, env=env, start_new_session=True)
    kill = None
    try:
        if when is not None:
            while proc.poll() is None and not when(time.monotonic() - start):
                time.sleep(0.005)
            # a worker, fork server or sandbox not running at that moment (a worker restarting, the sandbox
            # before the first tool call): the kill goes to the next one that starts
            while proc.poll() is None and target != "trainer" and not victims(proc.pid, target):
                time.sleep(0.05)
            if proc.poll() is None:
                kill = _deliver(proc.pid, target, time.monotonic() - start, rng)
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


def _deliver(trainer: int, target: str, seconds: float, rng: random.Random) -> dict | None:
    pids = victims(trainer, target)
    if not pids:
        return {"absent": target}
    victim = rng.choice(pids)
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
    # the stacks, so that the phase can be read again: copc's frames and the innermost three
    frames = [line.strip() for line in dump.splitlines() if "copc/" in line or line.startswith("Thread")]
    return {"target": target, "seconds": round(seconds, 3), "phase": phase, "stack": frames[:60],
            "innermost": [line.strip() for line in dump.splitlines()[3:6]]}


# ------------------------------------------------------------------------------------ schedules
class WriteWatch:
    """Fires a moment after the ``skip + 1``-th checkpoint write or journal append this process starts, as
    the run directory shows it: a new ``checkpoints/.tmp-step_*`` directory or ``rollouts/.batch_*`` temp
    file (polled every 5 ms, so the shortest writes are seen only sometimes)."""

    def __init__(self, run_dir: Path, skip: int, delay: float) -> None:
        self.places = (run_dir / "checkpoints", run_dir / "rollouts")
        self.seen = self._now()  # what an earlier process left is not this process's write
        self.skip, self.delay, self.fire_at = skip, delay, None  # type: ignore[var-annotated]

    def _now(self) -> set[str]:
        names = set()
        for place in self.places:
            try:
                names |= {n for n in os.listdir(place) if n.startswith((".tmp-step_", ".batch_"))}
            except OSError:
                continue
        return names

    def __call__(self, seconds: float) -> bool:
        if self.fire_at is None:
            new = self._now() - self.seen
            self.seen |= new
            if new and self.skip < len(new):
                self.fire_at = seconds + self.delay
            elif new:
                self.skip -= len(new)
        return self.fire_at is not None and seconds >= self.fire_at


def schedule(kind: str, rng: random.Random, timing: dict, run_dir: Path, steps: int, driver: str
             ) -> Callable[[float], bool]:
    """When to kill this process: ``uniform`` over the reference's wall time ``T``; ``post-import`` over
    the part of this process's expected span after its imports (the reference's ``ready`` seconds, then
    ``T - ready`` scaled by the share of steps left after the newest checkpoint; ``T`` follows the load:
    each whole first process of a run that was not killed moves it halfway to its own wall time);
    ``writes`` a few ms into a checkpoint write or journal append (WriteWatch)."""
    window, ready = timing["window"], timing["ready"]
    done = max((int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*")), default=0)
    if kind == "writes":  # one of the checkpoint writes left (in async, journal appends come between)
        writes_left = (steps - done) // CHECKPOINT_EVERY[driver]
        return WriteWatch(run_dir, rng.randint(0, max(writes_left - 1, 0)), rng.uniform(0.0, 0.03))
    if kind == "post-import":
        at = rng.uniform(ready, ready + (window - ready) * max(steps - done, 1) / steps)
    else:
        at = rng.uniform(0.0, window)
    return lambda seconds: seconds >= at


def reference_run(cfg: Path, reference: Path, work: Path, rng: random.Random) -> dict | None:
    """Run the reference to the end; ``window``: its wall time, ``ready``: seconds until its run directory
    appeared (the imports and the config's checks done)."""
    shutil.rmtree(reference, ignore_errors=True)
    marks: dict[str, float] = {}

    def watch(seconds: float) -> bool:
        if "ready" not in marks and reference.exists():
            marks["ready"] = seconds
        return False

    began = time.monotonic()
    code, _, err = run_process(["--config", str(cfg), f"run_dir={reference}"], work / "reference.log", watch,
                               "", rng)
    if code != 0:
        print(err, file=sys.stderr)
        print(f"the reference run failed (exit {code})", file=sys.stderr)
        return None
    window = time.monotonic() - began
    return {"window": window, "ready": marks.get("ready", 0.0)}


# ------------------------------------------------------------------------------------ main
def command(cfg: Path, run_dir: Path, attempt: int) -> list[str]:
    """The first process starts the run; later ones resume it as a user would: ``run_dir=R resume=true``
    once the run has its ``config.yaml``; before that (killed in start-up) the first command again,
    with ``resume=true`` when the directory exists (a fresh start refuses a directory in use)."""
    if attempt > 0 and (run_dir / "config.yaml").is_file():
        return [f"run_dir={run_dir}", "resume=true"]
    first = ["--config", str(cfg), f"run_dir={run_dir}"]
    return [*first, "resume=true"] if run_dir.exists() else first


def one_run(index: int, args: argparse.Namespace, cfg: Path, work: Path, timing: dict, kills_left: int,
            out: Path | None, tokenizer: object) -> dict:
    """Start run ``index``, kill it up to three times (never more than ``kills_left``), resume it until it
    finishes, check it; its record (one line of ``runs.jsonl``)."""
    rng = random.Random(f"{args.seed}:{index}")  # a run's schedule does not depend on the runs before it
    run_dir = work / f"run_{index:04d}"
    shutil.rmtree(run_dir, ignore_errors=True)
    planned, snapshots, problems = rng.randint(1, 3), [], []
    record: dict = {"run": index, "kills": 0, "resumes": 0, "unclean": 0, "lost": 0, "duplicated": 0,
                    "phases": {}, "targets": {}, "absent": {}, "finished": False}
    for attempt in range(MAX_ATTEMPTS):
        start = command(cfg, run_dir, attempt)
        when, target = None, "trainer"
        if planned > 0 and record["kills"] < kills_left:
            when = schedule(args.schedule, rng, timing, run_dir, args.steps, args.driver)
            if args.driver == "async" and args.schedule != "writes":
                target = rng.choices(args.targets, [TARGET_WEIGHTS[t] for t in args.targets])[0]
        began = time.monotonic()
        code, kill, err = run_process(start, work / f"{run_dir.name}.{attempt}.log", when, target, rng)
        if attempt == 0 and code == 0 and kill is None:  # a whole process: the window follows the load
            timing["window"] = (timing["window"] + time.monotonic() - began) / 2
        record["resumes"] += attempt > 0
        if kill is not None and "target" in kill:
            record["kills"] += 1
            planned -= 1
            for key, value in (("phases", kill["phase"]), ("targets", kill["target"])):
                record[key][value] = record[key].get(value, 0) + 1
            kill.update(run=index, attempt=attempt, exit=code, schedule=args.schedule)
            if out is not None:
                with (out / "kills.jsonl").open("a") as handle:
                    handle.write(json.dumps(kill) + "\n")
        if kill is not None and "absent" in kill:
            record["absent"][kill["absent"]] = record["absent"].get(kill["absent"], 0) + 1
        if kill is not None and kill.get("left_behind"):
            problems.append(f"attempt {attempt}: {kill['left_behind']} processes left behind")
        # a run may end in one line after a kill of its helpers: exit 1 (the run failed), or 2 when the
        # sandbox's start-up probe lost its fork server (the probe's refusal, reported as an infra fault)
        if code not in (0, -signal.SIGKILL) and (code not in (1, 2) or "Traceback" in err
                                                  or "error:" not in err):
            record["unclean"] += 1
            problems.append(f"attempt {attempt}: exit {code}: {err.strip()[-400:]}")
        if code != 0 and tokenizer is not None and (run_dir / "rollouts").is_dir():
            snapshots.append(journal_snapshot(run_dir, tokenizer))
        if code == 0:
            record["finished"] = True
            break
    if not record["finished"]:
        problems.append(f"did not finish in {MAX_ATTEMPTS} processes")
    elif args.driver == "sync":
        problems += check_sync(work / "reference", run_dir, args.steps)
    else:
        record["lost"], record["duplicated"], more = check_async(run_dir, args.steps, snapshots)
        problems += more
    record["problems"] = problems
    if not problems and not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return record


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def resume_state(out: Path, settings: dict) -> tuple[list[dict], dict | None]:
    """The finished runs of an earlier invocation with the same settings, and its reference timing;
    the kills of a run it left unfinished are dropped (that run starts again)."""
    saved = json.loads((out / "settings.json").read_text()) if (out / "settings.json").is_file() else None
    if saved is None:
        return [], None
    if {k: saved.get(k) for k in settings} != settings:
        raise SystemExit(f"error: {out} holds a torture with other settings ({saved}); give another --out "
                         f"or the same --driver/--steps/--seed/--schedule")
    runs = _jsonl(out / "runs.jsonl")
    done = {r["run"] for r in runs}
    kills = [k for k in _jsonl(out / "kills.jsonl") if k["run"] in done]
    (out / "kills.jsonl").write_text("".join(json.dumps(k) + "\n" for k in kills))
    return runs, saved.get("timing")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--driver", choices=("sync", "async"), default="sync")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument("--schedule", choices=("uniform", "post-import", "writes"), default="uniform",
                        help="when kills land (see schedule())")
    parser.add_argument("--out", default=None, help="folder for kills.jsonl, runs.jsonl and summary.json")
    parser.add_argument("--work", default=None, help="folder for the run directories (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    parser.add_argument("--resume", action="store_true",
                        help="continue the torture recorded in --out (its finished runs count)")
    parser.add_argument("--policy", choices=("tiny", "warmstart"), default="tiny",
                        help="warmstart: a policy that calls its tool, so the sandbox runs (config_yaml)")
    parser.add_argument("--targets", default=None,
                        help="async: the kinds of process a kill goes to (trainer,worker,forkserver,sandbox; "
                             "default: all, the sandbox only with --policy warmstart: the tiny model never "
                             "starts it)")
    args = parser.parse_args()
    default = [t for t in TARGET_WEIGHTS if t != "sandbox" or args.policy == "warmstart"]
    args.targets = [t for t in args.targets.split(",") if t] if args.targets else default
    if not args.targets or set(args.targets) - set(TARGET_WEIGHTS):
        print(f"error: --targets {','.join(args.targets)}: name some of {','.join(TARGET_WEIGHTS)}",
              file=sys.stderr)
        return 2
    if args.resume and (args.out is None or args.work is None):
        print("error: --resume needs the --out and --work of the torture to continue", file=sys.stderr)
        return 2
    work = Path(args.work or tempfile.mkdtemp(prefix="kill_torture-"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else None
    settings = {"driver": args.driver, "steps": args.steps, "seed": args.seed, "schedule": args.schedule}
    if args.policy != "tiny" or args.targets != default:
        settings.update(policy=args.policy, kill_targets=",".join(args.targets))
    runs, timing = resume_state(out, settings) if args.resume and out is not None else ([], None)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        if not args.resume:
            for name in ("kills.jsonl", "runs.jsonl"):
                (out / name).write_text("")
    cfg = work / "config.yaml"
    cfg.write_text(config_yaml(args.driver, args.steps, args.policy))
    if timing is None or not (work / "reference" / "summary.json").is_file():
        source = Path(__file__).resolve().parents[1] / "src" / "copc"
        shutil.rmtree(work / "src", ignore_errors=True)
        shutil.copytree(source, work / "src" / "copc", ignore=shutil.ignore_patterns("__pycache__"))
    SNAPSHOT["PYTHONPATH"] = str(work / "src")
    began = time.monotonic()
    if timing is None or not (work / "reference" / "summary.json").is_file():
        timing = reference_run(cfg, work / "reference", work, random.Random(args.seed))
        if timing is None:
            return 1
    if out is not None:
        (out / "settings.json").write_text(json.dumps({**settings, "timing": timing}, indent=1) + "\n")
    print(f"reference: {timing['window']:.1f} s, imports {timing['ready']:.1f} s; schedule {args.schedule}; "
          f"{len(runs)} runs recorded before", flush=True)
    tokenizer = None
    if args.driver == "async":
        from copc.models import build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()  # the tokenizer of the tiny model and of its warm start
    while sum(r["kills"] for r in runs) < args.kills:
        kills_left = args.kills - sum(r["kills"] for r in runs)
        record = one_run(len(runs), args, cfg, work, timing, kills_left, out, tokenizer)
        if out is not None:
            (out / "settings.json").write_text(json.dumps({**settings, "timing": timing}, indent=1) + "\n")
        runs.append(record)
        if out is not None:
            with (out / "runs.jsonl").open("a") as handle:
                handle.write(json.dumps(record) + "\n")
        if record["problems"]:
            print(f"run {record['run']}: " + "; ".join(record["problems"]), flush=True)
        print(f"run {len(runs)}: kills so far {sum(r['kills'] for r in runs)}", flush=True)
    summary = summarize(runs, settings, timing, time.monotonic() - began)
    print(json.dumps(summary), flush=True)
    if out is not None:
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not args.keep and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    print(f"kills={summary['kills']} divergences={summary['divergences']} lost={summary['lost']} "
          f"duplicated={summary['duplicated']}")
    return 0 if summary["divergences"] == summary["lost"] == summary["duplicated"] == 0 else 1


def summarize(runs: list[dict], settings: dict, timing: dict, seconds: float) -> dict:
    """The totals over every recorded run (this invocation's and those it resumed from)."""
    def count(key: str) -> dict[str, int]:
        total: collections.Counter[str] = collections.Counter()
        for r in runs:
            total.update(r[key])
        return dict(total.most_common())

    return {**settings, "kills": sum(r["kills"] for r in runs), "runs": len(runs),
            "resumes": sum(r["resumes"] for r in runs),
            "divergences": sum(1 for r in runs if r["problems"]),
            "lost": sum(r["lost"] for r in runs), "duplicated": sum(r["duplicated"] for r in runs),
            "unclean_exits": sum(r["unclean"] for r in runs), "reference_seconds": timing["window"],
            "import_seconds": timing["ready"], "phases": count("phases"), "targets": count("targets"),
            "absent_targets": count("absent"), "wall_seconds_this_invocation": seconds}


if __name__ == "__main__":
    sys.exit(main())
