"""What ``copc train`` and ``copc eval`` say while they run (issue 35, item 6): a plain line per step when
stdout is not a terminal, a dash for an evaluation not made, one warning when no reward has been non-zero
for ``no_signal_steps`` steps, and ``copc eval``'s progress on stderr."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from copc.config import to_dict
from copc.eval.evaluate import EvalConfig, evaluate
from copc.experiments.results import config_hash
from copc.models import build_tiny_model, build_tiny_tokenizer
from copc.rollout.generator import RolloutConfig
from copc.run.config import RunConfig
from copc.run.eval import EvalProgress
from copc.run.train import train_cli
from copc.tasks import get_task

TINY = [
    "model.policy=tiny", "task_options={train_size: 100, eval_size: 8}", "rollout.prompts_per_batch=2",
    "rollout.group_size=2", "rollout.max_new_tokens_per_turn=8", "rollout.max_total_tokens=12",
    "driver.kind=sync", "trainer.critic_warmup_steps=0", "plots=false",
]


def test_without_a_terminal_each_step_is_a_line_and_no_signal_is_said_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: under nohup the progress came at the end only, eval.prompts=0 printed ``None`` in the summary,
    and an untrained model's all-zero rewards went unremarked. (capsys: stdout is not a terminal.)"""
    assert train_cli([f"run_dir={tmp_path / 'run'}", *TINY, "steps=3", "eval.prompts=0",
                      "no_signal_steps=2"]) == 0
    out, err = capsys.readouterr()
    for done in (1, 3):  # the first line at once, the last always; at most one per 10 s between
        assert re.search(rf"^train {done}/3  reward 0\.000  acc 0\.000  stale \d\.\d  \d+s$", out, re.M), out
    assert "None" not in out and re.search(r"eval accuracy \(avg@k\) \W+ - \W+ - ", out), out
    assert err.count(
        "warning: no learning signal: every train reward has been 0 for the last 2 steps (to step 2)") == 1


def test_no_signal_steps_is_left_out_of_the_config_hash() -> None:
    """A record made before the field existed (its config lacks it) still matches the same config now."""
    now = to_dict(RunConfig())
    before = {k: v for k, v in now.items() if k != "no_signal_steps"}
    assert config_hash(before) == config_hash(now) == config_hash({**now, "no_signal_steps": 5})


def test_evaluate_reports_episodes_done_and_changes_nothing() -> None:
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    task = get_task("arith_tool", eval_size=8)
    rollout = RolloutConfig(max_turns=2, max_new_tokens_per_turn=8, max_total_tokens=12, context_limit=96)
    cfg = EvalConfig(prompts=3, samples=2, greedy=True)
    calls: list[tuple[int, int]] = []
    reported = evaluate(model, tokenizer, task, rollout, cfg, seed=1, progress=lambda d, n: calls.append((d,
                                                                                                          n)))
    assert calls[-1] == (9, 9) and all(n == 9 for _, n in calls)  # 3 prompts x 2 samples + 3 greedy
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert evaluate(model, tokenizer, task, rollout, cfg, seed=1) == reported


def test_eval_progress_speaks_while_a_round_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with EvalProgress(every_s=0.05) as report:
        report.update(4, 10)
        time.sleep(0.3)  # one long round of turns: no update comes, the line still does
        report.update(10, 10)
    lines = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"eval: 4/10 episodes done, \d+s", lines[0]), lines
    assert re.fullmatch(r"eval: 10/10 episodes done, \d+s", lines[-1]), lines
