"""The ``copc`` command line: ``copc train | eval | export | convert-gguf | make-critic | sft | lab | testbed
| sweep | plot | bench``.

    copc train [--config FILE.yaml] [key.sub=value ...]   train (no arguments: the embedded default)
    copc eval --checkpoint RUN_DIR|HF_DIR [--task NAME]   avg@k, unbiased pass@k, greedy accuracy
    copc export RUN_DIR OUT [--step N]                    a run's policy as an HF folder (transformers loads
    it) copc convert-gguf DIR FILE.gguf OUT                   a GGUF model as an HF folder (model.policy=OUT)
    copc make-critic POLICY OUT --layers K                a smaller critic: the policy's first K layers
    copc sft --task NAME                                  build the warm-started tiny policy
    copc lab explain|sweep|analyse ...                    exact bias/variance lab on small MDPs
    copc testbed [--seeds 3 --steps 200 --staleness 16]   sync PPO vs uncorrected async PPO, curves
    copc sweep FILE.yaml [--dry-run | --report]           a grid of copc train runs, one record each
    copc plot RUN_DIR... [--out DIR] [--mean-seeds]       redraw one run, or overlay several
    copc bench NAME [ARGS...]                             run benchmarks/NAME.py

Subcommands are wired lazily: each one imports its module only when it runs, so ``copc --version`` and
``copc plot`` do not load models. A bad config fails in one line that names the valid choices (a
:class:`copc.config.ConfigError` is printed, never a traceback).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from copc.config import CommandParser, ConfigError

#: subcommand -> (module, function taking the remaining argv and returning an exit code, one-line help)
DELEGATED: dict[str, tuple[str, str, str]] = {
    "train": (
        "copc.run.train",
        "train_cli",
        "train a policy: copc train [--config FILE.yaml] [key.sub=value ...]",
    ),
    "eval": ("copc.run.eval", "eval_cli", "evaluate a checkpoint: avg@k, unbiased pass@k, greedy accuracy"),
    "export": ("copc.run.export", "export_cli",
               "write a run's policy to an HF folder: copc export RUN_DIR OUT [--step N]"),
    "convert-gguf": ("copc.run.export", "convert_cli",
                     "GGUF model -> HF folder: copc convert-gguf DIR FILE.gguf OUT"),
    "make-critic": ("copc.run.export", "critic_cli",
                    "a K-layer critic cut from the policy: copc make-critic POLICY OUT --layers K"),
    "sft": ("copc.run.warmstart", "sft_cli", "build the warm-started tiny policy for a built-in task"),
    "lab": ("copc.lab.cli", "lab_cli", "exact bias/variance decomposition on small MDPs"),
    "testbed": (
        "copc.experiments.testbed",
        "testbed_cli",
        "does staleness hurt here? sync PPO vs uncorrected async PPO at fixed lag, several seeds",
    ),
    "sweep": ("copc.experiments.sweep_cli", "sweep_cli",
              "run a grid of copc train runs from a YAML, one record each"),
}
LOCAL = {
    "plot": "redraw a run's plots, or overlay several runs: copc plot RUN_DIR... [--out DIR]",
    "bench": "run a benchmark script: copc bench NAME [ARGS...] (benchmarks/NAME.py)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="copc",
        description="Asynchronous RL post-training with Coupled Off-Policy Correction.",
        epilog="\n".join(f"  {name:<6} {text}" for name, text in _help_lines()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="copc [--version] "
              "{train,eval,export,convert-gguf,make-critic,sft,lab,testbed,sweep,plot,bench} ...",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    return parser


def _help_lines() -> list[tuple[str, str]]:
    return [(name, spec[2]) for name, spec in DELEGATED.items()] + list(LOCAL.items())


def build_plot_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="copc plot", description=LOCAL["plot"])
    parser.add_argument("runs", nargs="+", help="run directories (each holds metrics.jsonl)")
    parser.add_argument("--out", default=None, help="output folder (default: RUN_DIR/plots for one run)")
    parser.add_argument(
        "--mean-seeds",
        action="store_true",
        help="average runs named *seedN into one curve with a min-max band",
    )
    parser.add_argument("--smooth", type=int, default=1, help="trailing moving-average window (points)")
    return parser


def plot_cli(argv: Sequence[str]) -> int:
    """``copc plot RUN_DIR... [--out DIR] [--mean-seeds] [--smooth N]``."""
    args = build_plot_parser().parse_args(list(argv))
    from copc.run.plots import plot_runs

    out = args.out
    if out is None and len(args.runs) > 1:
        out = "plots-overlay"
    try:
        written = plot_runs(args.runs, out, mean_seeds=args.mean_seeds, smooth_window=args.smooth)
    except (FileNotFoundError, ValueError) as err:
        print(f"copc plot: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # e.g. --out names a file
        print(f"copc plot: error: {err.filename or out}: {err.strerror or err}; --out takes a folder",
              file=sys.stderr)
        return 2
    for path in written:
        print(path)
    _say_what_was_plotted(args.runs)
    return 0


def _say_what_was_plotted(runs: Sequence[str]) -> None:
    """To stderr, per run: each line of its metrics.jsonl that is not a whole record (being written, or
    cut by a kill; not plotted), then which records were plotted and whether the run is training."""
    from copc.run.readers import record_notes, run_state
    from copc.tracking import read_metrics

    for run in runs:
        path = Path(run) / "metrics.jsonl"
        for note in record_notes(path):
            print(note, file=sys.stderr)
        steps = [int(r["step"]) for r in read_metrics(path)]
        span = f", steps {min(steps)}-{max(steps)}" if steps else ""
        print(f"{run}: {len(steps)} records{span}; the run is {run_state(Path(run))}", file=sys.stderr)


def find_benchmark(name: str) -> Path | None:
    """``benchmarks/NAME.py`` in the current directory or in the source checkout copc runs from."""
    file_name = name if name.endswith(".py") else f"{name}.py"
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        candidate = root / "benchmarks" / file_name
        if candidate.is_file():
            return candidate
    return None


def bench_cli(argv: Sequence[str]) -> int:
    """``copc bench NAME [ARGS...]``: run ``benchmarks/NAME.py`` with ARGS in a fresh interpreter."""
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: copc bench NAME [ARGS...]   (e.g. copc bench step_time)")
        return 0 if argv else 2
    script = find_benchmark(argv[0])
    if script is None:
        print(
            f"copc bench: error: no benchmarks/{argv[0]}.py here or in the copc checkout; "
            "run it from the repository root",
            file=sys.stderr,
        )
        return 2
    return subprocess.call([sys.executable, str(script), *argv[1:]])


def _delegate(name: str) -> Callable[[list[str]], int] | None:
    module_name, function_name, _ = DELEGATED[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (err.name == module_name or module_name.startswith(err.name + ".")):
            print(f"copc {name}: not available in this install ({module_name} is missing)", file=sys.stderr)
            return None
        raise
    function: Callable[[list[str]], int] = getattr(module, function_name)
    return function


#: glibc's mmap threshold for the copc processes (bytes): allocations this large are mapped and handed back
#: to the system when freed. glibc's default starts at 128 KiB and rises with every large free (to 32 MiB),
#: after which freed logits and activations stay in the heap: a 135M-parameter run's RSS grew by ~6 GB
#: over a run. A value already in MALLOC_MMAP_THRESHOLD_ is kept.
MMAP_THRESHOLD = 1 << 20


def lean_allocator() -> None:
    """Fix glibc's mmap threshold in this process (``mallopt``) and, through the environment, in every
    process it starts (rollout workers, sweep cells); a no-op where the C library is not glibc."""
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, int(os.environ["MALLOC_MMAP_THRESHOLD_"]))  # -3 = M_MMAP_THRESHOLD
    except (OSError, AttributeError, ValueError):
        return


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    lean_allocator()
    parser = build_parser()
    if not argv or argv[0].startswith("-"):
        args = parser.parse_args(argv)
        if args.version:
            from copc import __version__

            print(__version__)
            return 0
        parser.print_help()
        return 0
    command, rest = argv[0], argv[1:]
    try:
        if command in DELEGATED:
            function = _delegate(command)
            return 2 if function is None else int(function(rest) or 0)
        if command == "plot":
            return plot_cli(rest)
        if command == "bench":
            return bench_cli(rest)
    except ConfigError as err:
        print(f"copc {command}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"copc {command}: interrupted", file=sys.stderr)
        return 130
    names = [*DELEGATED, *LOCAL]
    hint = difflib.get_close_matches(command, names, n=1)
    did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
    print(
        f"copc: error: unknown command {command!r}{did_you_mean}; valid commands: {', '.join(names)}",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
