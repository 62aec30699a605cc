"""``copc sweep FILE.yaml``: run a grid of ``copc train`` configurations and keep one record per run.

    copc sweep experiments/kv_search_testbed.yaml --dry-run     # the plan and its estimated hours
    copc sweep experiments/kv_search_testbed.yaml --jobs 1      # run the missing cells, one at a time
    copc sweep experiments/kv_search_testbed.yaml --report      # the table of the finished records

The YAML file (``experiments/*.yaml`` are the committed ones)::

    experiment: kv_search_testbed        # results/<experiment>/, runs/sweep/<experiment>/
    description: sync PPO vs async PPO at lag 16 on kv_search hard
    seeds: [0, 1, 2]                     # or a count: 3 -> 0, 1, 2
    shared: [task=kv_search, steps=300]  # copc train overrides of every cell
    axes:                                # axis -> level -> overrides of that level
      method:
        ppo_sync: [method=ppo, driver.kind=sync]
        async_ppo: [method=async_ppo, driver.kind=sync, staleness.mode=fixed_lag]
      s: {key: staleness.staleness, values: [8, 16]}   # shorthand: level "8" = [staleness.staleness=8]
    grids:                               # optional (default: every axis crossed with every other)
      - {method: [ppo_sync]}             # axes a grid leaves out are not applied
      - {method: [async_ppo], s: all}
    baseline: {method: ppo_sync}         # what --report pairs the other cells with
    accepted_records:                    # optional: a record made by an earlier spelling of a cell's config
      method=ppo_sync__seed0: {config_hash: 0123456789abcdef, why: "the same computation: ..."}
    report: [eval_last_half, eval_final] # the record figures --report tabulates (optional)
    heatmap:                             # optional, a joint sweep (copc.experiments.interaction)
      rows: method                       # two axes crossed in every panel, one panel per level of
      cols: s                            # `panels` (optional); `lab:` (optional) sets the lab's exact
                                         # prediction beside it: {json, rows: {level: c}, cols: {level:
                                         eps_A}}

A cell is one grid point and one seed, its id ``axis=level__axis=level__seedN``; it runs as
``nice -n 10 python -m copc.cli train`` with one torch thread into ``runs/sweep/<experiment>/<cell-id>``
(log beside it). When it finishes, its record (copc.experiments.results) is written atomically to
``results/<experiment>/<cell-id>.json`` (``--commit``: and committed to git alone). Next time a cell with a
record is skipped, a finished run without a record gets its record, one with a checkpoint is resumed
(``resume=true``; a larger ``steps`` extends it), one without starts again. A run directory or record
made by a different config is never reused: the sweep stops and names it, and ``--report`` leaves it
out and names it (unless ``accepted_records`` accepts that record, with a reason ``--dry-run`` prints).
``--experiment`` runs the grid again under another name (e.g. from another warm start, pinned in
``<results>/warmstarts``).

Cells run ``--jobs`` at a time; by default as many as a short CPU probe finds the machine has free
cores for (each added process must add at least :data:`PROBE_MIN_GAIN` of a core's throughput).

Estimates (``--dry-run``) come from ``results/step_times.json``: per task setting, method and driver,
the seconds of one training step and of one evaluation, filled from every finished record and, with
``--measure``, from a short probe run of each missing kind. A kind never measured borrows the closest
measured one (same task and method, then same task) and the plan says so.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from copc.config import ConfigError, load_yaml, to_dict
from copc.experiments.results import (
    build_record,
    commit_alone,
    config_hash,
    machine_info,
    read_record,
    recorded_config,
    write_record,
)
from copc.experiments.step_times import (
    STEP_TIMES,
    episodes,
    estimate_seconds,
    load_step_times,
    store_step_time,
    timing_from_record,
    timing_key,
)
from copc.experiments.sweep_spec import Cell, SpecError, SweepSpec, expand
from copc.run.build import run_dir_holder
from copc.run.config import RunConfig, load_run_config
from copc.trainer.checkpoint import list_checkpoints

__all__ = ["cell_state", "estimate_seconds", "report_records", "resolve", "run_cells"]

#: An added parallel process must raise the probe's total throughput by this fraction of one process.
PROBE_MIN_GAIN = 0.6


def resolve(cell: Cell, run_dir: Path) -> RunConfig:
    """The RunConfig the cell trains with (fails with a ConfigError naming the cell)."""
    try:
        return load_run_config(None, [*cell.overrides, f"seed={cell.seed}", f"run_dir={run_dir}"])
    except ConfigError as err:
        raise ConfigError(f"cell {cell.cell_id}: {' '.join(str(err).split())}") from None


# ---------------------------------------------------------------------------------- state of a cell
def _saved_config(run_dir: Path) -> dict[str, object] | None:
    try:
        return to_dict(load_yaml(RunConfig, run_dir / "config.yaml"))  # type: ignore[return-value]
    except (OSError, ConfigError, ValueError):
        return None


def _same_except_steps(a: Mapping[str, object], b: Mapping[str, object]) -> bool:
    return config_hash({**a, "steps": 0}) == config_hash({**b, "steps": 0})


def cell_state(config: Mapping[str, object], run_dir: Path, record_path: Path,
               accepted: tuple[str, str] | None = None) -> tuple[str, str]:
    """``(state, detail)``: ``recorded``, ``finished`` (run done, record missing), ``resume`` (from a
    checkpoint), ``fresh``, or ``conflict`` (record or run directory of a different config).

    ``accepted``: ``(config hash, why)`` from the sweep file's ``accepted_records``: a record made by that
    hash is the cell's (``recorded``, the detail says so and why), and no other differing one is.

    A record or run of the same config with fewer ``steps`` is extended: resumed from its last checkpoint
    (the record is replaced when the longer run ends). The extended run trains exactly as a longer run
    from that checkpoint would, and keeps the shorter run's final evaluation (a resume keeps the history);
    its record has a direct run's evaluations (copc.experiments.results.build_record: that evaluation is
    relabelled, or set apart when off the schedule) and says ``extended_from``.
    """
    want, steps = config_hash(config), int(config["steps"])  # type: ignore[call-overload]
    saved = _saved_config(run_dir)
    checkpoints = list_checkpoints(run_dir)
    if record_path.is_file():
        try:
            record = read_record(record_path)
        except ValueError as err:
            return "conflict", str(err)
        recorded = recorded_config(record)
        if record.get("config_hash") == want or (recorded is not None and config_hash(recorded) == want):
            return "recorded", ""
        if accepted is not None and record.get("config_hash") == accepted[0]:
            return "recorded", f"accepted: made by config {accepted[0]} ({accepted[1]})"
        shorter = recorded is not None and _same_except_steps(recorded, config)
        if not (shorter and int(record["steps"]) < steps  # type: ignore[call-overload]
                and saved is not None and checkpoints):
            return "conflict", (
                f"{record_path} was made by config {record.get('config_hash')}, the file now gives "
                                f"{want}; move the record away to re-run the cell")
    if saved is None:
        return "fresh", ""
    if config_hash(saved) == want and (run_dir / "summary.json").is_file():
        try:
            done = int(json.loads((run_dir / "summary.json").read_text()).get("steps", -1))
        except (OSError, ValueError):
            done = -1
        if done == steps:
            return "finished", ""
    if checkpoints and _same_except_steps(saved, config) and max(checkpoints) <= steps:
        return "resume", f"from step {max(checkpoints)}"
    if checkpoints:
        return "conflict", f"{run_dir} holds a run of another config; move it away to re-run the cell"
    return "fresh", "restart (no checkpoint)"


def report_records(spec: SweepSpec, cells: Sequence[Cell],
                   paths: Paths) -> tuple[list[dict[str, object]], list[str]]:
    """``(records, left out)``: the records of ``cells`` that are the cells' own (state ``recorded``:
    made by the config the file gives now, or accepted by its ``accepted_records``), and one line for
    every record file of the experiment that is not: made by another config, shorter than the file's
    ``steps`` (being extended), unreadable, or no cell's (e.g. an arm since removed, or outside
    ``--only``)."""
    folder = paths.results / spec.experiment
    records: list[dict[str, object]] = []
    left_out: list[str] = []
    mine = set()
    for cell in cells:
        path = paths.record(spec.experiment, cell)
        mine.add(path.name)
        if not path.is_file():
            continue
        run_dir = paths.run_dir(cell)
        state, detail = cell_state(to_dict(resolve(cell, run_dir)), run_dir, path,
                                   spec.accepted.get(cell.cell_id))
        if state != "recorded":
            reason = (detail if state == "conflict"
                      else f"the record is shorter than the file's steps ({state} {detail})")
            left_out.append(f"left out: {cell.cell_id}: {reason}")
            continue
        records.append(read_record(path))
    if folder.is_dir():
        others = sorted(p.name for p in folder.glob("*.json") if not p.name.startswith(
            ".") and p.name not in mine)
        if others:
            shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
            left_out.append(f"left out: {len(others)} record(s) of no cell "
                            f"{'selected' if len(cells) < len(expand(spec)) else 'of the file'}: {shown}")
    return records, left_out


# ---------------------------------------------------------------------------------------- step times
_PROBE = ("import time\nt=time.perf_counter()\nx=0\nfor i in range(3_000_000): "
          "x+=i*i\nprint(time.perf_counter()-t)")


def measure_capacity(max_jobs: int | None = None) -> int:
    """How many CPU-bound processes the machine runs now at nearly full speed each.

    Runs a ~0.3 s pure-Python loop in 1, 2, ... processes at once; ``k`` processes are accepted while
    the total throughput keeps rising by at least :data:`PROBE_MIN_GAIN` of one process per process
    added. On a shared machine the answer is a snapshot; ``--jobs`` overrides it.
    """
    limit = max(1, min(max_jobs or os.cpu_count() or 1, os.cpu_count() or 1))
    throughput, best = [], 1
    for k in range(1, limit + 1):
        procs = [subprocess.Popen([sys.executable, "-c", _PROBE], stdout=subprocess.PIPE,
                                  text=True) for _ in range(k)]
        seconds = [float(p.communicate(timeout=120)[0]) for p in procs]
        throughput.append(k / max(seconds))
        if k > 1 and throughput[-1] < throughput[-2] + PROBE_MIN_GAIN * throughput[0]:
            break
        best = k
    return best


# --------------------------------------------------------------------------------------------- running
@dataclass
class Paths:
    results: Path
    runs: Path

    def run_dir(self, cell: Cell) -> Path:
        return self.runs / cell.cell_id

    def record(self, experiment: str, cell: Cell) -> Path:
        return self.results / experiment / f"{cell.cell_id}.json"


def train_command(cell: Cell, run_dir: Path, *, resume: bool, nice: int) -> list[str]:
    """``nice -n K python -m copc.cli train --no-progress ...`` of one cell, K raising this process's
    niceness to ``nice`` (the sweep itself may already run under ``nice``)."""
    raise_by = nice - os.nice(0)
    prefix = ["nice", "-n", str(raise_by)] if raise_by > 0 and shutil.which("nice") else []
    return [*prefix, sys.executable, "-m", "copc.cli", "train", "--no-progress", *cell.overrides,
            f"seed={cell.seed}", f"run_dir={run_dir}", f"resume={'true' if resume else 'false'}"]


def _dies_with(parent: int) -> Callable[[], None]:
    """``preexec_fn`` of a cell's process: it gets SIGTERM when the sweep ``parent`` dies, even by SIGKILL
    (Linux ``prctl(PR_SET_PDEATHSIG)``, kept across exec), so a killed sweep leaves no orphan training a
    cell that a restarted sweep would then skip; SIGTERM makes the cell stop at a checkpoint."""

    def arm() -> None:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # not Linux: the sweep's own cleanup (SIGTERM, Ctrl-C) still runs
            return
        if os.getppid() != parent:  # the sweep died before the signal was armed
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def _add_wall(run_dir: Path, seconds: float) -> float:
    """Accumulate the wall seconds of the run's processes in ``run_dir/sweep_wall.json``; the total."""
    path = run_dir / "sweep_wall.json"
    try:
        total = float(json.loads(path.read_text())["wall_seconds"])
    except (OSError, ValueError, KeyError):
        total = 0.0
    total += seconds
    path.write_text(json.dumps({"wall_seconds": total}))
    return total


def finish_cell(spec: SweepSpec, cell: Cell, paths: Paths, config: Mapping[str, object], *,
                commit: bool = False,
                log: Callable[[str], None] = print) -> Path:
    """Write the record of the cell's finished run directory; its path. ``commit``: then commit the
    experiment's records and the step-time table to git, alone
    (:func:`~copc.experiments.results.commit_alone`)."""
    run_dir = paths.run_dir(cell)
    try:
        wall: float | None = float(json.loads((run_dir / "sweep_wall.json").read_text())["wall_seconds"])
    except (OSError, ValueError, KeyError):
        wall = None
    record = build_record(run_dir, experiment=spec.experiment, cell_id=cell.cell_id, levels=dict(cell.levels),
                          config=config, wall_seconds=wall, machine=machine_info())
    path = write_record(paths.record(spec.experiment, cell), record)
    cfg = resolve(cell, run_dir)
    timing = timing_from_record(record, cfg)
    if timing is not None:
        store_step_time(paths.results, timing_key(cfg), timing)
    if commit:
        count = len(list(path.parent.glob("*.json")))
        commit_alone([path.parent, paths.results / STEP_TIMES],
                     f"results: {spec.experiment} records ({count} so far)", log)
    return path


STOP_GRACE_SECONDS = 60.0  # how long a stopped sweep waits for a cell to exit on SIGTERM before SIGKILL


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_cells(spec: SweepSpec, cells: Sequence[Cell], paths: Paths, *, jobs: int, nice: int,
              log: Callable[[str], None] = print, commit: bool = False) -> list[str]:
    """Run or record every cell not yet recorded, ``jobs`` at a time; returns the ids that failed.
    ``commit``: commit each record to git as it is written.

    A cell's state is read again when its turn comes, so two sweeps over one grid (two queues, two
    machines on one shared checkout) never run a cell twice: one that the other has started since this
    sweep began is skipped, one it has finished is recorded or left as it is."""
    pending = [cell for cell in cells if _launch_state(spec, cell, paths, commit=commit, log=log) is not None]
    running: list[tuple[Cell, dict[str, object], subprocess.Popen[bytes], float]] = []
    failures: list[str] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    # SIGTERM (a queue stopped with kill) unwinds like Ctrl-C, so the cleanup below stops the children and
    # counts their wall time; by default it would end the process with neither.
    on_main = threading.current_thread() is threading.main_thread()  # only there can a handler be set
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm) if on_main else None
    try:
        while pending or running:
            while pending and len(running) < jobs:
                cell = pending.pop(0)
                state = _launch_state(spec, cell, paths, commit=commit, log=log)  # again: time has passed
                if state is None:
                    continue
                config, resume = state
                run_dir = paths.run_dir(cell)
                run_dir.mkdir(parents=True, exist_ok=True)
                command = train_command(cell, run_dir, resume=resume, nice=nice)
                with (paths.runs / f"{cell.cell_id}.log").open("ab") as out:
                    proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                            preexec_fn=_dies_with(os.getpid()))
                log(f"[sweep] start {cell.cell_id}{' (resume)' if resume else ''} pid {proc.pid}")
                running.append((cell, config, proc, time.perf_counter()))
            time.sleep(1.0)
            for item in list(running):
                cell, config, proc, start = item
                if proc.poll() is None:
                    continue
                running.remove(item)
                took = time.perf_counter() - start
                _add_wall(paths.run_dir(cell), took)
                if proc.returncode == 0:
                    record = finish_cell(spec, cell, paths, config, commit=commit, log=log)
                    log(f"[sweep] done  {cell.cell_id} in {took / 60:.1f} min: {record}")
                else:
                    failures.append(cell.cell_id)
                    log(f"[sweep] FAILED {cell.cell_id} (exit {proc.returncode}); see "
                        f"{paths.runs / cell.cell_id}.log")
    finally:
        for _, _, proc, _ in running:  # interrupted: stop our children, keep their checkpoints
            proc.terminate()
        for cell, _, proc, start in running:
            try:
                proc.wait(timeout=STOP_GRACE_SECONDS)
            except subprocess.TimeoutExpired:  # stuck where no signal handler runs (a C call holding the GIL)
                proc.kill()
                proc.wait()
                log(f"[sweep] {cell.cell_id}: still running {STOP_GRACE_SECONDS:.0f} s after SIGTERM, "
                    "killed; it resumes from its last checkpoint")
            _add_wall(paths.run_dir(cell), time.perf_counter() - start)
        if on_main:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    return failures


def _launch_state(spec: SweepSpec, cell: Cell, paths: Paths, *, commit: bool, log: Callable[[str], None]
                  ) -> tuple[dict[str, object], bool] | None:
    """``(config, resume)`` when ``cell`` is to be trained now; ``None`` when it is recorded, held by
    another process, or finished (its record is then written here)."""
    run_dir = paths.run_dir(cell)
    holder = run_dir_holder(run_dir)
    if holder is not None:  # another sweep (or a hand-started copc train) is running this cell
        log(f"[sweep] {cell.cell_id}: skipped, pid {holder} is training in {run_dir}")
        return None
    config: dict[str, object] = dict(to_dict(resolve(cell, run_dir)))
    state, detail = cell_state(config, run_dir, paths.record(spec.experiment, cell),
                               spec.accepted.get(cell.cell_id))
    if state == "conflict":
        raise SpecError(f"cell {cell.cell_id}: {detail}")
    if state == "recorded":
        return None
    if state == "finished":
        log(f"[sweep] {cell.cell_id}: finished run, record "
            f"{finish_cell(spec, cell, paths, config, commit=commit, log=log)}")
        return None
    if state == "fresh" and run_dir.exists():
        shutil.rmtree(run_dir)  # no checkpoint: nothing to resume, and a half metrics.jsonl would mix in
    return config, state == "resume"


def prepare_warmstarts(cells: Sequence[Cell], paths: Paths, log: Callable[[str], None] = print) -> None:
    """Build (or find) every warm start the cells need once, before cells start, pinned in
    ``<results>/warmstarts``."""
    from copc.run.build import policy_path
    from copc.run.warmstart import PINNED_ENV, pin_warmstart
    # This sweep's results folder, not one an earlier sweep in this process set; its cells inherit it.
    os.environ[PINNED_ENV] = str((paths.results / "warmstarts").resolve())
    seen: set[str] = set()
    for cell in cells:
        cfg = resolve(cell, paths.run_dir(cell))
        key = json.dumps([cfg.task, cfg.task_options, to_dict(cfg.model)], sort_keys=True, default=str)
        if cfg.model.policy == "warmstart" and key not in seen:
            seen.add(key)
            log(f"[sweep] warm start {cfg.task}: {pin_warmstart(policy_path(cfg, paths.runs))}")


def _children_cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def probe_step_time(cell: Cell, paths: Paths, *, steps: int, nice: int, log: Callable[[str], None] = print
                    ) -> dict[str, object]:
    """Run ``cell`` for ``steps`` steps (evaluating only before and after) and measure its step and eval
    seconds; stored in ``results/step_times.json`` under the cell's timing key, with ``core_share``: the
    CPU seconds the run got per wall second (1.0 on an idle core; less on a busy shared machine)."""
    from copc.tracking import TIME_STEP, read_metrics

    cfg = resolve(cell, paths.run_dir(cell))
    key = timing_key(cfg)
    run_dir = paths.runs.parent / "_probe" / key.replace("/", "_")
    if run_dir.exists():
        shutil.rmtree(run_dir)
    probe = Cell(cell.cell_id, cell.levels, cell.seed,
                 (*cell.overrides, f"steps={steps}", "eval.every=0", "checkpoint_every=0", "plots=false"))
    run_dir.mkdir(parents=True)
    log(f"[sweep] probe {key}: {steps} steps of {cell.cell_id}")
    start, cpu_start = time.perf_counter(), _children_cpu_seconds()
    with (run_dir / "probe.log").open("wb") as out:
        code = subprocess.call(train_command(probe, run_dir, resume=False, nice=nice), stdout=out,
                               stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall, cpu = time.perf_counter() - start, _children_cpu_seconds() - cpu_start
    if code != 0:
        raise SpecError(f"probe of {cell.cell_id} failed (exit {code}); see {run_dir / 'probe.log'}")
    times = [float(r[TIME_STEP]) for r in read_metrics(run_dir) if TIME_STEP in r]
    step = sum(times) / len(times)
    entry = {"step_seconds": step, "eval_seconds": max(0.0, wall - step * len(times)) / 2,
             "source": f"probe of {steps} steps", "steps": steps, "measured": time.strftime("%Y-%m-%d %H:%M"),
             "core_share": round(cpu / wall, 3),
             **episodes(cfg)}
    store_step_time(paths.results, key, entry)
    return entry


# ------------------------------------------------------------------------------------------- the plan
def plan_text(spec: SweepSpec, cells: Sequence[Cell], paths: Paths, jobs: int) -> str:
    """One line per cell (state, steps, estimate), the step-time table used, and the totals."""
    table = load_step_times(paths.results)
    lines = [f"experiment {spec.experiment}: {len(cells)} cells ({len(spec.seeds)} seeds), "
             f"records in {paths.results / spec.experiment}, runs in {paths.runs}"]
    if spec.description:
        lines.append(f"  {spec.description}")
    total, unknown, used = 0.0, 0, {}
    counts: dict[str, int] = {}
    width = max(len(c.cell_id) for c in cells)
    for cell in cells:
        run_dir = paths.run_dir(cell)
        cfg = resolve(cell, run_dir)
        state, detail = cell_state(to_dict(cfg), run_dir, paths.record(spec.experiment, cell),
                                   spec.accepted.get(cell.cell_id))
        counts[state] = counts.get(state, 0) + 1
        start = max(list_checkpoints(run_dir), default=0) if state == "resume" else 0
        seconds, note = (0.0, "") if state in ("recorded", "finished") else estimate_seconds(cfg, table,
                                                                                             start)
        if seconds is None:
            unknown += 1
        else:
            total += seconds
        if note:
            used[timing_key(cfg)] = note
        estimate = "?" if seconds is None else f"{seconds / 3600:.2f} h"
        lines.append(f"  {cell.cell_id:<{width}}  {state:<8} {cfg.task:<10} {cfg.method:<10} "
                     f"{cfg.steps:>4} steps  {estimate:>8}  {detail}")
    lines.append("step times (results/step_times.json; s/step, s/eval):")
    for key, note in sorted(used.items()):
        entry = table.get(key)
        if note == "measured" and entry:
            step_s = float(entry["step_seconds"])  # type: ignore[arg-type]
            eval_s = float(entry["eval_seconds"])  # type: ignore[arg-type]
            core = entry.get("core_share")
            share = f", at {float(core):.0%} of a core" if core else ""  # type: ignore[arg-type]
            lines.append(f"  {key}: {step_s:.2f} s/step, {eval_s:.0f} s/eval ({entry.get('source')}{share})")
        else:
            lines.append(f"  {key}: {note}")
    lines.append(", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    lines.append(
        f"estimated {total / 3600:.1f} machine-hours of one process; {total / 3600 / jobs:.1f} h of wall "
                 f"at {jobs} at a time" + (
                     f"; {unknown} cells without an estimate (--measure)" if unknown else ""))
    return "\n".join(lines)
