"""The ``dapo`` preset end to end on the tiny model: its dynamic sampling and overlong counters reach
metrics.jsonl, and the async driver at s = 0 reproduces the sync run with dynamic sampling on (extra
rounds, padding and the rejected prompts travel through the worker pipe and the buffer).

The random tiny model never answers arith_tool correctly, so every group is all-wrong: each batch runs
every round of the cap and goes ahead padded (the path where the batch is furthest from its plain version).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from copc import tracking as m
from copc.eval.evaluate import EvalConfig
from copc.models.tiny import build_tiny_model, build_tiny_tokenizer
from copc.rollout.generator import DynamicSamplingConfig, RolloutConfig
from copc.run.config import DriverConfig, ModelConfig, RunConfig, resolve_rollout
from copc.run.train import train
from copc.runtime.async_local import AsyncSource, WorkerSpec
from copc.runtime.staleness import StalenessConfig
from copc.trainer.checkpoint import load_latest
from copc.trainer.config import TrainerConfig

DYNSAMPLE = (m.ROLLOUT_DYNSAMPLE_ROUNDS, m.ROLLOUT_DYNSAMPLE_EXTRA_GROUPS, m.ROLLOUT_DYNSAMPLE_DROPPED_GROUPS,
             m.ROLLOUT_DYNSAMPLE_PADDED_GROUPS, m.ROLLOUT_DYNSAMPLE_SHORT, m.ROLLOUT_OVERLONG_PENALTY)


def dapo_config(run_dir: Path, driver: str) -> RunConfig:
    return RunConfig(
        task="arith_tool", task_options={"train_size": 60, "eval_size": 4}, method="dapo", steps=2, seed=5,
        run_dir=str(run_dir), checkpoint_every=0, plots=False, model=ModelConfig(policy="tiny"),
        rollout=RolloutConfig(prompts_per_batch=2, group_size=2, max_turns=2, max_new_tokens_per_turn=8,
                              max_total_tokens=12, context_limit=96,
                              dynamic_sampling=DynamicSamplingConfig(max_rounds=2)),
        trainer=TrainerConfig(actor_lr=1e-3, micro_batch_size=4),
        staleness=StalenessConfig(mode="fixed_lag", staleness=0),
        driver=DriverConfig(kind=driver),  # type: ignore[arg-type]
        eval=EvalConfig(prompts=2, samples=1, greedy=False),
    )


def step_rows(run_dir: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if m.LOSS_POLICY in r]


def test_sync_dapo_run_logs_the_dynamic_sampling_and_overlong_counters(tmp_path: Path) -> None:
    train(dapo_config(tmp_path / "sync", "sync"), show_progress=False)
    rows = step_rows(tmp_path / "sync")
    assert len(rows) == 2
    for row in rows:
        for name in DYNSAMPLE:
            assert name in row, name
        # all-wrong groups: 2 rounds of 2 prompts, batch padded with round 0's 2 groups, 2 dropped
        assert row[m.ROLLOUT_DYNSAMPLE_ROUNDS] == 2.0 and row[m.ROLLOUT_DYNSAMPLE_SHORT] == 1.0
        assert (
            row[m.ROLLOUT_DYNSAMPLE_PADDED_GROUPS] == 2.0 and row[m.ROLLOUT_DYNSAMPLE_DROPPED_GROUPS] == 2.0)
        assert row[m.ROLLOUT_OVERLONG_PENALTY] <= 0.0


@pytest.mark.slow
def test_async_zero_staleness_equals_sync_with_dynamic_sampling(tmp_path: Path) -> None:
    train(dapo_config(tmp_path / "sync", "sync"), show_progress=False)
    train(dapo_config(tmp_path / "async", "async"), show_progress=False)
    volatile = ("time/", "perf/", "memory/", "buffer/")
    clean = [[{k: v for k,
               v in r.items() if not k.startswith(volatile) and k != "time"} for r in step_rows(tmp_path / d)]
             for d in ("sync", "async")]
    assert clean[0] == clean[1] and len(clean[0]) == 2
    policies = []
    for d in ("sync", "async"):
        latest = load_latest(tmp_path / d)
        assert latest is not None
        policies.append(latest[1]["trainer"]["policy"])  # type: ignore[index]
    for name in policies[0]:
        assert torch.equal(policies[0][name], policies[1][name]), name


@pytest.mark.slow
def test_async_buffer_clears_the_prompts_dynamic_sampling_dropped(tmp_path: Path) -> None:
    # Batch j's admitted prompts stay "in flight" until their trajectories arrive; dropped groups never
    # arrive, so the source hands them to the buffer as rejected (counted, no longer in flight).
    cfg = dapo_config(tmp_path, "async")
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=0)
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    spec = WorkerSpec(model_path=str(tmp_path / "tiny"), task=cfg.task, task_options=dict(cfg.task_options),
                      rollout=resolve_rollout(cfg), seed=cfg.seed)
    source = AsyncSource(spec, cfg.staleness, model.state_dict(), num_workers=1)
    try:
        source.start()
        batch, _ = source.next_batch(0)
    finally:
        source.close()
    assert len(batch.trajectories) == 4 and batch.info[m.ROLLOUT_DYNSAMPLE_DROPPED_GROUPS] == 2.0
    metrics = source.buffer.metrics()
    assert metrics["buffer/dropped_rejected"] == 4.0  # 2 dropped groups of 2
    assert metrics[m.BUFFER_IN_FLIGHT] == 0.0
