"""Warm-start SFT: demo encoding, the action-only loss (against a per-token loop), the cache, the CLI.

The full default builds (about 1.5 minutes of CPU each) run only in the slow end-to-end test.
"""

import math
import os
from pathlib import Path

import pytest
import torch

from copc.models.tiny import build_tiny_tokenizer
from copc.run.warmstart import (
    DEFAULT_SFT,
    MARKER,
    PINNED_ENV,
    SFTConfig,
    action_nll,
    build_warmstart,
    cli_request,
    encode_demo,
    is_complete,
    load_warmstart,
    measure_accuracy,
    pin_warmstart,
    sft_cli,
    shuffled_batches,
    warmstart_dir,
    warmstart_info,
)
from copc.tasks import get_task
from copc.tasks.base import Demo, Segment

TINY_SFT = SFTConfig(n_examples=48, steps=3, batch_size=8, warmup_steps=1)
SMALL_TASK = {"eval_size": 20, "train_size": 50}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def test_encode_demo_masks_prompt_and_observations(tokenizer):
    demo = Demo(
        (Segment("What is 2*3?\n", False), Segment("<python>print(2*3)</python>", True),
         Segment("<output>6</output>", False), Segment("<answer>6</answer>", True)),
        kind="tool",
    )
    encoded = encode_demo(tokenizer, demo)
    tokens = tokenizer.convert_ids_to_tokens(encoded.token_ids.tolist())
    assert tokens[0] == "<bos>" and tokenizer.decode(encoded.token_ids[1:]) == demo.text
    # bos + 13 prompt characters; <python> + 10 characters + </python>; <output> 6 </output>; <answer> 6
    # </answer>.
    expected = [False] * 14 + [True] * 12 + [False] * 3 + [True] * 3
    assert encoded.action_mask.tolist() == expected
    assert [t for t, m in zip(tokens, expected, strict=True) if m][-3:] == ["<answer>", "6", "</answer>"]


def test_action_nll_matches_a_per_token_loop():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11)
    ids = torch.randint(0, 11, (3, 7))
    action = torch.rand(3, 7) < 0.5
    action[2] = False  # an all-masked row contributes nothing
    total, count = 0.0, 0
    for b in range(3):
        for t in range(1, 7):
            if action[b, t]:
                total -= torch.log_softmax(logits[b, t - 1].double(), -1)[ids[b, t]].item()
                count += 1
    # float32 log-softmax over 11 logits against float64: agreement to ~1e-6 relative.
    assert action_nll(logits, ids, action).item() == pytest.approx(total / count, rel=1e-5)


def test_action_nll_golden_and_mask_invariance():
    # Uniform logits over V = 8: every target has log-prob -log 8, so the loss is log 8 exactly.
    ids = torch.tensor([[1, 2, 3, 4]])
    action = torch.tensor([[False, True, False, True]])
    assert action_nll(torch.zeros(1, 4, 8), ids, action).item() == pytest.approx(math.log(8), abs=1e-6)
    # Logits at positions that predict non-action tokens (and NaN there) change nothing.
    logits = torch.randn(1, 4, 8)
    poisoned = logits.clone()
    poisoned[0, 1] = float("nan")  # predicts token 2 (not an action)
    poisoned[0, 3] = 1e4  # the last position predicts nothing
    assert torch.equal(action_nll(poisoned, ids, action), action_nll(logits, ids, action))


def test_batches_cover_each_index_once_in_a_seeded_order():
    batches = shuffled_batches(203, 8, torch.Generator().manual_seed(1))
    flat = [i for batch in batches for i in batch]
    assert len(flat) == len(set(flat)) == 200 and all(len(b) == 8 for b in batches)  # 3 dropped
    assert batches == shuffled_batches(203, 8, torch.Generator().manual_seed(1))
    assert batches != shuffled_batches(203, 8, torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="cannot fill one batch"):
        shuffled_batches(5, 8, torch.Generator())


def _build(tmp_path, **kwargs):
    return build_warmstart("arith_tool", task_config=SMALL_TASK, sft=TINY_SFT, **kwargs)


def test_cache_builds_once_and_is_deterministic(tmp_path, monkeypatch):
    monkeypatch.setenv("COPC_CACHE", str(tmp_path / "cache"))
    path = _build(tmp_path)
    assert path == warmstart_dir("arith_tool", task_config=SMALL_TASK, sft=TINY_SFT)
    assert path.parent == tmp_path / "cache" / "warmstart" and path.name.startswith("arith_tool-")
    assert is_complete(path) and not list(path.parent.glob("*.tmp-*"))
    info = warmstart_info(path)
    assert info["sft"]["steps"] == 3 and info["task"] == "arith_tool" and set(info["demo_mix"]) <= {
        "tool", "direct", "operand_error", "output_error"}
    stamp = (path / MARKER).stat().st_mtime_ns
    assert _build(tmp_path) == path and (path / MARKER).stat().st_mtime_ns == stamp  # not retrained
    other = _build(tmp_path, out_dir=tmp_path / "again")
    model_a, _ = load_warmstart(path)
    model_b, _ = load_warmstart(other)
    for (name, a), (_, b) in zip(model_a.state_dict().items(), model_b.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert _build(tmp_path, seed=1) != path  # the seed is part of the cache key


def test_directory_without_marker_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("COPC_CACHE", str(tmp_path / "cache"))
    path = warmstart_dir("arith_tool", task_config=SMALL_TASK, sft=TINY_SFT)
    path.mkdir(parents=True)
    (path / "model.safetensors").write_text("half-written")  # a killed build
    assert not is_complete(path)
    with pytest.raises(FileNotFoundError, match="not a completed warm start"):
        load_warmstart(path)
    assert _build(tmp_path) == path and is_complete(path)
    load_warmstart(path)  # loads: the junk was replaced
    stamp = (path / MARKER).stat().st_mtime_ns
    _build(tmp_path, force=True)
    assert (path / MARKER).stat().st_mtime_ns != stamp


def test_a_pinned_warm_start_is_used_instead_of_building(tmp_path, monkeypatch):
    """A warm start built on one machine and pinned (copied to $COPC_WARMSTART_PINNED, committed with the
    records) is what every later machine starts from: no rebuild, the same weights bit for bit."""
    monkeypatch.setenv("COPC_CACHE", str(tmp_path / "cache"))
    built = _build(tmp_path)
    monkeypatch.delenv(PINNED_ENV, raising=False)
    assert pin_warmstart(built) is None  # nothing pinned without a pinned folder
    monkeypatch.setenv(PINNED_ENV, str(tmp_path / "pinned"))
    pinned = pin_warmstart(built)
    assert pinned == tmp_path / "pinned" / built.name and is_complete(pinned)
    assert pin_warmstart(pinned) == pinned  # already there: kept as it is
    monkeypatch.setenv("COPC_CACHE", str(tmp_path / "another_machine"))  # an empty cache elsewhere
    assert warmstart_dir("arith_tool", task_config=SMALL_TASK, sft=TINY_SFT) == pinned
    assert _build(tmp_path) == pinned and not (tmp_path / "another_machine").exists()  # not rebuilt
    model_a, _ = load_warmstart(built)
    model_b, _ = load_warmstart(pinned)
    for (name, a), (_, b) in zip(model_a.state_dict().items(), model_b.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_only_builtin_tasks_have_demos():
    with pytest.raises(ValueError, match="no warm-start demonstrations"):
        build_warmstart("math_tool", task_config={"data": "x.jsonl"})


def test_cli(tmp_path, capsys):
    assert sft_cli(["--task", "nope"]) == 2
    assert "unknown task 'nope'; valid: arith_tool" in capsys.readouterr().out
    done = _build(tmp_path, out_dir=tmp_path / "ws")
    # --out-dir on a completed checkpoint returns at once (the default SFT config is not re-run).
    assert sft_cli(["--task", "arith_tool", "--out-dir", str(done)]) == 0
    assert f"warm start ready: {done}" in capsys.readouterr().out


def test_cli_builds_the_warm_start_the_default_run_uses(tmp_path, monkeypatch):
    # `copc sft --task arith_tool` must prepare the default `copc train` run: same task config, SFT
    # settings and seed, so the same cache entry. Both entry points call build_warmstart: record the calls.
    import copc.run.warmstart as ws
    from copc.run.build import policy_path
    from copc.run.config import default_config

    calls = []

    def record(task_name, **kwargs):
        calls.append((task_name, kwargs["seed"], dict(kwargs["task_config"]), kwargs["sft"]))
        raise ValueError("recorded")

    monkeypatch.setattr(ws, "build_warmstart", record)
    with pytest.raises(ValueError, match="recorded"):
        policy_path(default_config(), tmp_path)
    assert sft_cli(["--task", "arith_tool"]) == 2
    assert len(calls) == 2 and calls[0] == calls[1]
    assert calls[0][2] == default_config().task_options and calls[0][3].steps == default_config(
        ).model.warmstart_sft["steps"]
    # another task keeps its own defaults (the default run's task options name arith_tool's fields)
    assert cli_request("kv_search") == ws.WarmstartRequest("kv_search", 0, {}, DEFAULT_SFT["kv_search"])


@pytest.mark.slow
@pytest.mark.parametrize("task_name", ["arith_tool", "kv_search"])
def test_warm_start_lands_in_the_target_band(task_name):
    """End to end: the default warm start plays the task through the engine, tools and reward.

    Targets (tasks brief): sampled (temperature 1) accuracy in [0.2, 0.6] and greedy below 0.8 on 200
    eval prompts, so RL has room. Uses $COPC_CACHE (a second run reuses the checkpoint).
    """
    path = build_warmstart(task_name)
    assert is_complete(Path(path)) and os.environ.get("COPC_CACHE", "") in str(path)
    scores = measure_accuracy(task_name, path, n=200)
    assert 0.2 <= scores["eval/accuracy"] <= 0.6, scores
    assert scores["eval/greedy_accuracy"] < 0.8, scores
    # the policy sometimes calls the tool, sometimes not
    assert 0.1 < scores["eval/tool_use_rate"] < 0.95, scores
    assert get_task(task_name).prompts("eval", 1)  # the eval split exists for the RL side
