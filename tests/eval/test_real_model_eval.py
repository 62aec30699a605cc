"""benchmarks/real_model_eval.py: per-prompt shares, the interval of avg@k, the paired gain, and a base-rate
evaluation of a few word-problem rows end to end (the tiny model stands in for the real one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from real_model_eval import paired_gain, per_prompt_accuracy, summarise  # noqa: E402

from copc.models.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402


def test_per_prompt_shares_are_prompt_major():
    # prompt 0: samples T, F -> 1/2; prompt 1: T, T -> 1
    assert per_prompt_accuracy([True, False, True, True], 2, 2) == [0.5, 1.0]
    with pytest.raises(ValueError, match="expected 2 x 2"):
        per_prompt_accuracy([True, False, True], 2, 2)


def test_interval_and_paired_gain_hand_worked():
    # shares 0.5, 1.0: mean 0.75, sd sqrt(0.125) = 0.35355, se 0.25, t(0.975, df 1) = 12.7062 -> +-3.17655
    out = summarise([0.5, 1.0])
    assert out["accuracy"] == pytest.approx(0.75)
    assert out["ci_low"] == pytest.approx(0.75 - 3.17655, abs=1e-4)
    assert out["ci_high"] == pytest.approx(0.75 + 3.17655, abs=1e-4)
    # before 0, 0.5; after 1, 0.5: differences 1, 0 -> mean 0.5, sd 0.70711, se 0.5 -> +-6.3531
    gain = paired_gain([0.0, 0.5], [1.0, 0.5])
    assert gain["gain"] == pytest.approx(0.5)
    assert gain["gain_ci_low"] == pytest.approx(0.5 - 6.3531, abs=1e-3)
    assert gain["gain_ci_high"] == pytest.approx(0.5 + 6.3531, abs=1e-3)
    with pytest.raises(ValueError, match="same prompts"):
        paired_gain([0.0], [1.0, 0.5])


def test_base_rate_of_a_few_rows_end_to_end(tmp_path: Path):
    tokenizer = build_tiny_tokenizer()
    folder = tmp_path / "tiny"
    build_tiny_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    script = ROOT / "benchmarks/real_model_eval.py"
    common = [sys.executable, str(script), "--checkpoint", str(folder), "--prompts", "3", "--samples", "2",
              "--chunk", "2",
              "rollout.max_new_tokens_per_turn=8", "rollout.max_total_tokens=16"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, pair in (("before", []), ("after", ["--pair", str(tmp_path / "before.json")])):
        done = subprocess.run([*common, "--out", str(tmp_path / f"{name}.json"), *pair], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    after = json.loads((tmp_path / "after.json").read_text())
    assert after["prompts"] == 3 and len(after["per_prompt"]) == 3
    assert after["prompt_ids"] == [f"math_tool/eval/{i}" for i in range(3)]
    assert after["accuracy"] == pytest.approx(sum(after["per_prompt"]) / 3)
    assert after["gain"] == 0.0  # the same model and seeds: the same episodes


@pytest.mark.slow  # a copc train on the async driver and two evaluations: minutes on a loaded machine
def test_a_run_of_the_recipe_is_paired_with_the_base(tmp_path: Path):
    # The learning run's own path: copc train with the recipe (async PPO, the async driver) writes a
    # checkpoint; the evaluation of the run directory (its config, its latest checkpoint) pairs with the
    # base model's over the same held-out prompts and writes every reply.
    from real_model_recipe import TRAIN_RECIPE

    tokenizer = build_tiny_tokenizer()
    folder = tmp_path / "tiny"
    build_tiny_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    small = ["rollout.max_new_tokens_per_turn=8", "rollout.max_total_tokens=16"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = tmp_path / "run"
    train = [sys.executable, "-m", "copc.cli", "train", "--no-progress", *TRAIN_RECIPE, *small,
             f"model.policy={folder}", f"run_dir={run}", "steps=1", "checkpoint_every=1", "plots=false",
             "rollout.prompts_per_batch=2", "rollout.group_size=2"]
    done = subprocess.run(train, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    script = str(ROOT / "benchmarks/real_model_eval.py")
    common = [sys.executable, script, "--prompts", "2", "--samples", "1", "--chunk", "2"]
    base = [*common, "--checkpoint", str(folder), "--out", str(tmp_path / "base.json"), *small]
    done = subprocess.run(base, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    done = subprocess.run([*common, "--checkpoint", str(run), "--out", str(tmp_path / "after.json"),
                           "--pair", str(tmp_path / "base.json"), "--replies", str(tmp_path / "r.jsonl")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    after = json.loads((tmp_path / "after.json").read_text())
    assert after["step"] == 1 and after["complete"]
    assert after["prompt_ids"] == ["math_tool/eval/0", "math_tool/eval/1"]
    assert {"gain", "gain_ci_low", "gain_ci_high"} <= set(after)
    replies = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["prompt_id"] for r in replies] == after["prompt_ids"]
