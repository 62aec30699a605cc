"""The ``copc`` command line: dispatch, one-line errors, ``copc plot``, ``copc bench``."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

import copc
from copc import cli
from copc import tracking as m
from copc.run.tracker import Tracker


def test_version_and_help(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == copc.__version__
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for name in ("train", "eval", "sft", "lab", "plot", "bench"):
        assert f"  {name} " in out


@pytest.mark.parametrize("argv", [
    ["train", "--bogus"], ["eval", "--bogus"], ["export"], ["convert-gguf"], ["make-critic"], ["sft",
                                                                                               "--bogus"],
    ["lab"], ["lab", "sweep", "--bogus"], ["testbed", "--bogus"], ["sweep"], ["plot"], ["--bogus"],
])
def test_a_command_line_error_is_one_line_that_points_to_help(capsys, argv):
    """CLI review item 19: argparse printed its usage block (up to 8 lines) before the error line."""
    try:
        code = cli.main(argv)
    except SystemExit as stop:
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and ": error: " in err and "--help" in err, err
    assert err.startswith("copc"), err


def test_unknown_command_names_valid_ones(capsys):
    assert cli.main(["trian"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "did you mean 'train'" in err and "valid commands: train, eval" in err


_FIXTURE = textwrap.dedent(
    """
    from copc.config import apply_overrides
    from copc.runtime.staleness import StalenessConfig

    def fake_cli(argv):
        apply_overrides(StalenessConfig(), list(argv))
        return 0
    """
)


def test_config_error_from_a_subcommand_is_one_line(tmp_path, monkeypatch, capsys):
    """A ConfigError escaping a subcommand prints one line naming the valid choices, no traceback."""
    (tmp_path / "cli_fixture_mod.py").write_text(_FIXTURE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.DELEGATED, "train", ("cli_fixture_mod", "fake_cli", "test"))
    assert cli.main(["train", "mode=fixed_lag"]) == 0
    assert cli.main(["train", "mode=lagged"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("copc train: error:") and "valid choices: 'fixed_lag', 'bounded'" in err


def test_missing_subcommand_module_is_reported(monkeypatch, capsys):
    monkeypatch.setitem(cli.DELEGATED, "sft", ("copc.not_there", "sft_cli", "test"))
    assert cli.main(["sft", "--task", "x"]) == 2
    assert "not available in this install" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("copc.run.train") is None, reason="copc.run.train not built yet")
def test_real_train_bad_config_fails_in_one_line(capsys):
    code = cli.main(["train", "staleness.mode=lagged"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "'fixed_lag', 'bounded'" in err


def test_plot_command(tmp_path, capsys):
    run = tmp_path / "run_seed0"
    with Tracker(run, tensorboard=False) as tracker:
        for step in range(3):
            tracker.log(step, {m.REWARD_MEAN: step / 2, m.STALENESS_MEAN: 1.0})
    assert cli.main(["plot", str(run)]) == 0
    printed = capsys.readouterr().out.split()
    assert len(printed) == 4 and all(p.endswith(".png") for p in printed)
    assert (run / "plots" / "reward.png").is_file()
    assert cli.main(["plot", str(tmp_path / "missing")]) == 2
    assert "copc run directory" in capsys.readouterr().err


def test_bench_command(tmp_path, monkeypatch, capsys):
    assert cli.main(["bench", "no_such_bench"]) == 2
    assert "no benchmarks/no_such_bench.py" in capsys.readouterr().err
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "echo.py").write_text("import sys\nprint('args', sys.argv[1:])\nsys.exit(3)\n")
    monkeypatch.chdir(tmp_path)
    assert cli.find_benchmark("echo") == bench / "echo.py"
    assert cli.main(["bench", "echo", "--repeats", "2"]) == 3  # its exit code is passed through


def test_copc_fixes_the_allocator_threshold_for_itself_and_its_children(monkeypatch) -> None:
    # issue 35 (1): glibc's rising mmap threshold kept GBs of freed logits in the heap
    import os

    from copc.cli import MMAP_THRESHOLD, lean_allocator

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    lean_allocator()
    assert os.environ["MALLOC_MMAP_THRESHOLD_"] == str(MMAP_THRESHOLD)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4194304")  # a user's own value is kept
    lean_allocator()
    assert os.environ["MALLOC_MMAP_THRESHOLD_"] == "4194304"


def test_eval_samples_out_onto_a_folder_is_refused_before_the_evaluation(tmp_path, capsys):
    """It was an IsADirectoryError traceback after the whole evaluation had run, its metrics never printed."""
    from copc.run.eval import eval_cli

    assert eval_cli(["--checkpoint", str(tmp_path / "no_run"), "--samples-out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--samples-out" in err and "is a folder" in err
