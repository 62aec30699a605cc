"""``copc sweep``'s command line: parse the arguments, then plan, run or report a sweep
(:mod:`copc.experiments.sweep` says what a sweep does; its docstring is this command's help)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from copc.config import CommandParser
from copc.experiments import sweep
from copc.experiments.contrasts import load_contrasts
from copc.experiments.report import print_report
from copc.experiments.results import known_metric, metric_names
from copc.experiments.step_times import load_step_times, timing_key
from copc.experiments.sweep import (
    Paths,
    measure_capacity,
    plan_text,
    prepare_warmstarts,
    probe_step_time,
    report_records,
    resolve,
    run_cells,
)
from copc.experiments.sweep_spec import SpecError, SweepSpec, expand, load_spec
from copc.experiments.tables import report_text

#: The options only ``--report`` reads, as (flag, metavar, what it does); their help says so.
_REPORT_OPTIONS: tuple[tuple[str, str, str], ...] = (
    ("--collapse", "METRIC[,MARGIN[,PATIENCE]]",
     "count each group's collapses (E4: greedy_accuracy,0.1,3 = three evaluations in a row more than 0.1 "
     "below the run's best so far)"),
    ("--plot", "DIR", "also draw <experiment>_curves.png and _summary.png into DIR, and _diagnostics.png and "
                      "_oracle.png where the records have those curves"),
    ("--metrics", "NAME[,NAME]",
     "tabulate these instead of the file's report list (a summary figure, or mean:<curve> for a "
     "diagnostic curve's run mean, e.g. mean:drift)"),
    ("--contrasts", "FILE",
     "the pre-registered contrasts in FILE, each with its paired interval and verdict "
     "(copc.experiments.contrasts says the format)"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="copc sweep", description=sweep.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", help="sweep YAML (experiments/*.yaml)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan and its estimated hours; run nothing")
    parser.add_argument("--measure", type=int, default=0, metavar="STEPS",
                        help="with --dry-run: probe each unmeasured task/method/driver for STEPS steps first")
    parser.add_argument("--report", action="store_true", help="print the table of the finished records")
    for flag, metavar, text in _REPORT_OPTIONS:
        parser.add_argument(flag, default=None, metavar=metavar, help=f"with --report: {text}")
    parser.add_argument("--markdown", action="store_true",
                        help="with --report: the tables and contrasts as Markdown tables (what "
                             "docs/results.md quotes)")
    parser.add_argument("--baseline", default=None, metavar="AXIS=LEVEL[,AXIS=LEVEL]",
                        help="the cells --report pairs the others with (default: the file's baseline)")
    parser.add_argument("--jobs", type=int, default=0,
                        help="cells at a time (default: the measured capacity)")
    parser.add_argument("--nice", type=int, default=10, help="niceness of the train processes (0: none)")
    parser.add_argument("--results", default="results",
                        help="results folder (records under <results>/<experiment>)")
    parser.add_argument("--runs", default=None, help="run directories (default runs/sweep/<experiment>)")
    parser.add_argument("--steps", type=int, default=0, help="train every cell for this many steps instead "
                        "(a later run with more steps extends the runs from their checkpoints)")
    parser.add_argument("--commit", action="store_true",
                        help="git-commit each record as it is written, alone")
    parser.add_argument("--experiment", default=None,
                        help="records and runs under this name (the grid again, apart)")
    parser.add_argument("--only", default=None, metavar="SUBSTRING[,SUBSTRING]",
                        help="only the cells whose id contains one of these (e.g. "
                             "method=copc,method=async_ppo)")
    return parser


def _collapse_rule(text: str) -> tuple[str, float, int]:
    """``METRIC[,MARGIN[,PATIENCE]]`` of ``--collapse`` (defaults 0.1 and 3); SpecError naming the fix."""
    parts = text.split(",")
    try:
        metric = parts[0]
        margin = float(parts[1]) if len(parts) > 1 else 0.1
        patience = int(parts[2]) if len(parts) > 2 else 3
    except ValueError:
        raise SpecError(
            f"--collapse {text!r}: expected METRIC[,MARGIN[,PATIENCE]], e.g. greedy_accuracy,0.1,3") from None
    if len(parts) > 3 or not metric or margin <= 0 or patience < 1:
        raise SpecError(
            f"--collapse {text!r}: expected METRIC[,MARGIN[,PATIENCE]] with MARGIN > 0 and PATIENCE >= 1, "
                        "e.g. greedy_accuracy,0.1,3")
    return metric, margin, patience


def _baseline(text: str | None, spec: SweepSpec) -> dict[str, str]:
    if text is None:
        return spec.baseline
    pairs = [p.split("=", 1) for p in text.split(",") if p]
    if not pairs or any(len(p) != 2 for p in pairs):
        raise SpecError(f"--baseline {text!r}: expected axis=level[,axis=level]")
    for axis, level in pairs:  # a name no cell has paired nothing, and the report went out without its column
        if axis not in spec.axes:
            raise SpecError(f"--baseline {text!r}: no axis {axis!r}; axes: {', '.join(spec.axes)}")
        if level not in spec.axes[axis]:
            raise SpecError(f"--baseline {text!r}: axis {axis!r} has no level {level!r}; "
                            f"levels: {', '.join(spec.axes[axis])}")
    return {a: lv for a, lv in pairs}


def sweep_cli(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    if args.jobs < 0 or args.measure < 0 or args.steps < 0:
        print("copc sweep: error: --jobs, --measure and --steps must be >= 0", file=sys.stderr)
        return 2
    report_only = [flag for flag, given in (("--collapse", args.collapse), ("--plot", args.plot),
                                            ("--metrics", args.metrics), ("--contrasts", args.contrasts),
                                            ("--markdown", args.markdown), ("--baseline",
                                                                            args.baseline)) if given]
    if report_only and not args.report:
        print(f"copc sweep: error: {', '.join(report_only)} only apply to --report; add --report",
              file=sys.stderr)
        return 2
    collapse = _collapse_rule(args.collapse) if args.collapse else None
    spec = load_spec(args.file)
    spec = replace(spec, experiment=args.experiment or spec.experiment)
    if args.metrics:
        metrics = tuple(x for x in args.metrics.split(",") if x)
        unknown = [x for x in metrics if not known_metric(x)]
        if unknown or not metrics:
            raise SpecError(f"--metrics {args.metrics!r}: {repr(unknown[0]) if unknown else 'nothing'} is no "
                            f"report metric; valid: {metric_names()}")
        spec = replace(spec, report=metrics)
    cells = expand(spec)
    if args.steps:
        cells = [replace(c, overrides=(*c.overrides, f"steps={args.steps}")) for c in cells]
    if args.only:
        wanted = [w for w in args.only.split(",") if w]
        cells = [c for c in cells if any(w in c.cell_id for w in wanted)]
        if not cells:
            print(f"copc sweep: error: no cell id contains any of {', '.join(map(repr, wanted))}",
                  file=sys.stderr)
            return 2
    paths = Paths(Path(args.results),
                  Path(args.runs) if args.runs else Path("runs") / "sweep" / spec.experiment)
    if args.report:
        try:
            contrasts = load_contrasts(args.contrasts) if args.contrasts else None
            print_report(spec, cells, paths, baseline=_baseline(args.baseline, spec),
                         collapse=collapse, plot_dir=Path(args.plot) if args.plot else None,
                         contrasts=contrasts,
                         markdown=args.markdown)
        # e.g. the heatmap's lab JSON missing (its path is relative to the working dir)
        except ValueError as err:
            print(f"copc sweep: error: {err}", file=sys.stderr)
            return 2
        except OSError as err:  # e.g. --plot names a file, not a folder
            print(f"copc sweep: error: {err.filename or args.plot}: {err.strerror or err}"
                  + ("; --plot takes a folder" if args.plot else ""), file=sys.stderr)
            return 2
        return 0
    if args.dry_run:
        if args.measure:
            from copc.run.build import quiet_transformers

            quiet_transformers()
            table = load_step_times(paths.results)
            prepare_warmstarts(cells, paths)
            for cell in cells:
                key = timing_key(resolve(cell, paths.run_dir(cell)))
                if key not in table:
                    table[key] = probe_step_time(cell, paths, steps=args.measure, nice=args.nice)
        print(plan_text(spec, cells, paths, args.jobs or 1))
        return 0
    if args.nice > os.nice(0):
        os.nice(args.nice - os.nice(0))  # the warm-start builds below run in this process
    jobs = args.jobs or measure_capacity()
    paths.runs.mkdir(parents=True, exist_ok=True)
    print(f"[sweep] {spec.experiment}: {len(cells)} cells, {jobs} at a time", flush=True)
    prepare_warmstarts(cells, paths, log=lambda s: print(s, flush=True))
    failures = run_cells(spec, cells, paths, jobs=jobs, nice=args.nice, log=lambda s: print(s, flush=True),
                         commit=args.commit)
    if failures:
        print(f"copc sweep: error: cells failed: {', '.join(failures)}; re-run to resume them",
              file=sys.stderr)
        return 1
    records, left_out = report_records(spec, cells, paths)
    print("\n".join([*left_out, report_text(records, spec.report, spec.baseline or None)]))
    return 0
