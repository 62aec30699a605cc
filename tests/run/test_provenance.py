"""Provenance: the commit and dirty flag of the code, library versions, the resolved method, the stated lag,
and their path from a run's summary.json into a sweep record (old records without them still read)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from copc.channels.methods import MethodConfig
from copc.config import from_dict
from copc.experiments.report import code_text
from copc.experiments.results import build_record, load_records, read_record, write_record
from copc.experiments.tables import report_text
from copc.run.config import load_run_config, resolve_method
from copc.run.provenance import code_commit, lag_text, library_versions, run_provenance, stated_lag
from copc.run.train import train_cli
from copc.runtime.staleness import StalenessConfig

REPO = Path(__file__).resolve().parents[2]
OLD_RECORDS = REPO / "results" / "confirm_maths_s16"

TINY = [
    "model.policy=tiny", "task_options={train_size: 100, eval_size: 8}", "steps=2", "checkpoint_every=1",
    "rollout.prompts_per_batch=2", "rollout.group_size=2", "rollout.max_new_tokens_per_turn=8",
    "rollout.max_total_tokens=12", "eval.prompts=4", "eval.samples=2", "driver.kind=sync",
    "trainer.critic_warmup_steps=0", "plots=false",
]


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()


def _repo_with_package(root: Path) -> Path:
    """A git repository holding one committed package folder ``pkg``; the folder."""
    package = root / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("x = 1\n")
    _git(root, "init", "-q")
    _git(root, "add", "pkg")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "pkg")
    return package


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_commit_is_head_and_clean_when_the_package_matches_it(tmp_path: Path) -> None:
    package = _repo_with_package(tmp_path / "clean")
    assert code_commit(package) == {"commit": _git(package, "rev-parse", "HEAD"), "commit_dirty": False,
                                    "dirty_paths": []}


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_dirty_flag_names_changed_and_untracked_package_files_only(tmp_path: Path) -> None:
    package = _repo_with_package(tmp_path / "dirty")
    (package / "__init__.py").write_text("x = 2\n")  # a tracked change
    (package / "new.py").write_text("")  # an untracked module is code too
    (tmp_path / "dirty" / "notes.txt").write_text("")  # outside the package: not the run's code
    found = code_commit(package)
    assert found["commit"] == _git(package, "rev-parse", "HEAD") and found["commit_dirty"] is True
    assert sorted(found["dirty_paths"]) == ["pkg/__init__.py", "pkg/new.py"]  # type: ignore[arg-type]


def test_outside_a_checkout_commit_is_none_and_the_version_remains(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    assert code_commit(tmp_path / "pkg") == {"commit": None, "commit_dirty": None, "dirty_paths": None}
    # a folder the repository around it does not track: no evidence either
    if shutil.which("git") is not None:
        _repo_with_package(tmp_path / "repo")
        (tmp_path / "repo" / "site").mkdir()
        (tmp_path / "repo" / "site" / "m.py").write_text("")
        assert code_commit(tmp_path / "repo" / "site")["commit"] is None
    versions = library_versions()
    assert set(versions) == {"python", "torch", "transformers", "numpy", "copc"}
    assert versions["copc"] and versions["torch"] and versions["numpy"]


def test_stated_lag_golden() -> None:
    # the sync driver samples with the current weights under ``bounded``: lag 0 whatever the bound
    assert stated_lag(driver="sync", staleness=StalenessConfig(mode="bounded", staleness=8)) == {
        "rule": "sync driver: current weights", "nominal": 0, "at_most": 0}
    assert stated_lag(driver="sync", staleness=StalenessConfig(mode="fixed_lag", staleness=16)) == {
        "rule": "fixed_lag", "nominal": 16, "at_most": 16}
    fixed = StalenessConfig(mode="fixed_lag", staleness=4)
    assert stated_lag(driver="async", staleness=fixed)["nominal"] == 4
    assert stated_lag(driver="async", staleness=StalenessConfig(mode="bounded", staleness=8)) == {
        "rule": "bounded, async driver", "nominal": None, "at_most": 8}
    bounded = StalenessConfig(mode="bounded", staleness=8)
    assert lag_text(stated_lag(driver="sync", staleness=bounded)) == "lag 0 (sync driver: current weights)"
    assert lag_text(stated_lag(driver="ray", staleness=bounded)) == "lag <= 8 (bounded, ray driver)"


@pytest.mark.parametrize("overrides", [
    ["method=ppo"],
    ["method=copc_proximal", "method_overrides.policy.mask_low=0.0",
     "method_overrides.policy.mask_high=.inf"],
    ["method=dapo"],  # no critic: critic None round-trips too
])
def test_resolved_method_round_trips_through_a_record(overrides: list[str], tmp_path: Path) -> None:
    cfg = load_run_config(None, overrides)
    path = write_record(tmp_path / "r.json", {"version": 1, **run_provenance(cfg)})
    fields = read_record(path)["method_resolved"]
    assert isinstance(fields, dict) and set(fields) >= {"name", "policy", "advantage", "critic"}
    assert from_dict(MethodConfig, fields) == resolve_method(cfg)


def test_a_fresh_sync_run_names_its_commit_and_lag_0_in_summary_and_record(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # bounded 8 by default
    assert train_cli(["--no-progress", f"run_dir={run_dir}", *TINY, "method=ppo"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["staleness_mode"] == "bounded" and summary["staleness"] == 8  # the section as configured
    head = _git(REPO, "rev-parse", "HEAD") if shutil.which("git") and (REPO / ".git").exists() else None
    if head is None:
        assert summary["commit"] is None
    elif summary["commit"] != head:  # asked once per process: another commit may have landed since
        assert subprocess.run(["git", "merge-base", "--is-ancestor", str(summary["commit"]), head], cwd=REPO,
                              timeout=30).returncode == 0, summary["commit"]
    cfg = load_run_config(None, [*TINY, "method=ppo", f"run_dir={run_dir}"])
    record = build_record(run_dir, experiment="x", cell_id="c", levels={}, config=_config(cfg), machine={})
    assert record["provenance_from"] == "run" and record["commit"] == summary["commit"]
    assert record["commit_dirty"] == summary["commit_dirty"] and record["versions"] == summary["versions"]
    assert from_dict(MethodConfig, record["method_resolved"]) == resolve_method(cfg)  # type: ignore[arg-type]
    lag = record["lag"]
    assert isinstance(lag, dict)
    assert (lag["nominal"], lag["at_most"], lag["realized_max"], lag["realized_mean"]) == (0, 0, 0.0, 0.0)


def _config(cfg: object) -> dict[str, object]:
    from copc.config import to_dict

    return to_dict(cfg)  # type: ignore[return-value]


def test_a_record_of_a_run_older_than_provenance_says_whose_provenance_it_holds(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward/mean": 0.5, "staleness/mean": 16.0,
                                                       "staleness/max": 16.0}) + "\n")
    (run_dir / "summary.json").write_text(json.dumps({"steps": 1, "wall_seconds": 1.0}))  # no commit key
    cfg = load_run_config(None, ["method=async_ppo", "driver.kind=sync", "staleness.mode=fixed_lag",
                                 "staleness.staleness=16"])
    record = build_record(run_dir, experiment="x", cell_id="c", levels={}, config=_config(cfg), machine={})
    assert record["provenance_from"] == "record writer" and "commit" in record
    assert record["lag"] == {"rule": "fixed_lag", "nominal": 16, "at_most": 16, "realized_mean": 16.0,
                             "realized_max": 16.0}
    assert from_dict(MethodConfig, record["method_resolved"]) == resolve_method(cfg)  # type: ignore[arg-type]


@pytest.mark.skipif(not OLD_RECORDS.is_dir(), reason="needs the committed confirmation records")
def test_records_made_before_provenance_still_load_and_report(tmp_path: Path) -> None:
    old = sorted(OLD_RECORDS.glob("arm=ppo_sync__seed20[01].json")) + sorted(OLD_RECORDS.glob(
        "arm=async_ppo__seed20[01].json"))
    assert len(old) == 4 and all("commit" not in json.loads(p.read_text()) for p in old)
    folder = tmp_path / "mixed"
    folder.mkdir()
    for path in old:
        shutil.copy(path, folder / path.name)
    fresh = {**json.loads(old[0].read_text()), "commit": "a" * 40, "commit_dirty": True}
    write_record(folder / "arm=ppo_sync__seed202.json", fresh)
    records = load_records(folder)
    assert len(records) == 5
    assert code_text(records) == f"code: {'a' * 12}+dirty (1 record), unknown (4 records)"
    table = report_text(records, ["eval_last_half"], {"arm": "async_ppo"})
    assert "arm=ppo_sync" in table and "arm=async_ppo" in table  # the tables read old and new alike


def test_testbed_report_names_each_runs_commit(tmp_path: Path) -> None:
    from copc.experiments.testbed import run_commits

    new, old, unfinished = tmp_path / "new", tmp_path / "old", tmp_path / "unfinished"
    for folder in (new, old, unfinished):
        folder.mkdir()
    (new / "summary.json").write_text(json.dumps({"steps": 1, "commit": "b" * 40, "commit_dirty": False}))
    (old / "summary.json").write_text(json.dumps({"steps": 1}))
    found = run_commits([new, old, unfinished])
    assert found["runs"] == {str(new): {"commit": "b" * 40, "commit_dirty": False},
                             str(old): {"commit": None, "commit_dirty": None},
                             str(unfinished): {"commit": None, "commit_dirty": None}}
    assert set(found["analysed_by"]) == {"commit", "commit_dirty", "dirty_paths",
                                         "versions"}  # type: ignore[arg-type]
