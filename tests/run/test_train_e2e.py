"""``copc train`` / ``copc eval`` end to end: config errors, the run directory, and (slow) the default run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from copc.run.config import load_run_config
from copc.run.eval import eval_cli
from copc.run.train import train_cli

TINY = [
    "model.policy=tiny", "task_options={train_size: 100, eval_size: 8}", "steps=2", "checkpoint_every=1",
    "rollout.prompts_per_batch=2", "rollout.group_size=2", "rollout.max_new_tokens_per_turn=8",
    "rollout.max_total_tokens=12", "eval.prompts=4", "eval.samples=2", "driver.kind=sync",
    "trainer.critic_warmup_steps=0",
]


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("trainer.actor_lrr=1e-3", "actor_lr"),  # unknown key: names the valid ones
        ("trainer.actor_lr=-1", "actor_lr"),  # out of range
        ("method=copcc", "copc"),  # unknown method: names the valid ones
        ("task=arith", "arith_tool"),  # unknown task
        ("driver.kind=ray2", "sync"),  # unknown driver
        ("staleness.mode=fixed", "fixed_lag"),
    ],
)
def test_bad_config_fails_in_one_clear_line(override: str, needle: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert train_cli(["--no-progress", override]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert needle in err, err


def test_default_config_is_the_documented_embedded_default() -> None:
    cfg = load_run_config(None, [])
    assert (cfg.task, cfg.method, cfg.driver.kind, cfg.staleness.staleness) == ("arith_tool", "copc", "async",
                                                                                8)
    assert cfg.model.policy == "warmstart"


def test_tiny_run_writes_a_complete_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    assert train_cli(["--no-progress", f"run_dir={run_dir}", *TINY, "samples.every=1", "samples.per_log=2",
                      "trainer.critic_warmup_steps=1"]) == 0
    out, err = capsys.readouterr()
    assert "first 1 steps (critic warm-up; the actor is frozen)" in err  # a frozen actor is announced
    assert "eval accuracy" in out and str(run_dir) in out  # the summary table and the run dir
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("eval_accuracy_before", "eval_accuracy_after", "steps", "wall_seconds", "method", "staleness",
                "eval_seconds_this_process", "checkpoint_seconds_this_process", "step_seconds_median"):
        assert key in summary, key
    assert summary["steps"] == 2 and summary["method"] == "copc"
    assert (run_dir / "config.yaml").exists()
    protections = json.loads((run_dir / "sandbox_protections.json").read_text())  # arith_tool runs code
    assert "minimal_filesystem" in protections["active"] and "seccomp" in protections["active"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss/value" in r] == [0, 1]
    assert any("eval/accuracy" in r for r in rows)
    assert list((run_dir / "tb").iterdir()), "no TensorBoard events"
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    # evaluations before (step 0) and after (step 2), the two training batches (logged at steps 0 and 1)
    assert [(s["source"], s["step"]) for s in samples] == [("eval", 0)] * 2 + [("train", 0)] * 2 + [
        ("train", 1)] * 2 + [("eval", 2)] * 2
    assert all(s["prompt"] and s["turns"] and s["turns"][0]["source"] == "policy" for s in samples)
    assert all({"reward", "stop_reason", "truncated"} <= s.keys() for s in samples)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert list((run_dir / "plots").glob("*.png"))
    # copc eval on the run directory (its latest checkpoint).
    assert eval_cli(["--checkpoint", str(run_dir), "--prompts", "3", "--samples", "2"]) == 0
    table = capsys.readouterr().out
    assert "pass_at_k" in table and "greedy_accuracy" in table and "accuracy" in table


@pytest.mark.slow
def test_default_run_raises_eval_accuracy_by_a_quarter(tmp_path: Path) -> None:
    """The acceptance of issue 4: `copc train` with no arguments (only the run dir moved)."""
    assert train_cli(["--no-progress", f"run_dir={tmp_path / 'default'}"]) == 0
    summary = json.loads((tmp_path / "default" / "summary.json").read_text())
    assert summary["eval_accuracy_after"] - summary["eval_accuracy_before"] >= 0.25, summary
    assert summary["wall_seconds"] <= 600, summary


def test_a_missing_sandbox_protection_refuses_the_run_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import copc.tools.sandbox as sandbox

    def missing(config: object) -> dict[str, bool]:
        raise sandbox.SandboxUnavailable("sandbox refuses to start, missing protection(s) seccomp: test")

    monkeypatch.setattr(sandbox, "require_protections", missing)
    assert train_cli(["--no-progress", f"run_dir={tmp_path / 'run'}", *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: sandbox refuses to start, missing protection(s) seccomp: test"]
    assert not (tmp_path / "run" / "checkpoints").exists()
