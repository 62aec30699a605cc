"""The drivers end to end on the tiny model and the real arith_tool task (tools, rewards, processes).

- async with s = 0 reproduces sync exactly (parameters and metrics, several steps);
- async fixed_lag s = 2 reproduces the synchronous lag simulation exactly (same batch identities);
- bounded mode keeps realized staleness <= s;
- resuming a fixed_lag run from a checkpoint reproduces the uninterrupted run's next steps exactly;
- (killing the trainer, workers and the journal under faults: tests/runtime/test_faults.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from copc.eval.evaluate import EvalConfig
from copc.rollout.generator import RolloutConfig
from copc.run.config import DriverConfig, ModelConfig, RunConfig
from copc.run.train import train
from copc.runtime.staleness import StalenessConfig
from copc.trainer.checkpoint import load_latest
from copc.trainer.config import TrainerConfig

#: Metrics that measure time (and so differ between runs) or depend on who generated the batch.
VOLATILE = ("time/", "perf/", "memory/", "buffer/", "runtime/")


def small_config(run_dir: Path, *, driver: str, mode: str = "fixed_lag", s: int = 0, steps: int = 3,
                 **extra: object) -> RunConfig:
    cfg = RunConfig(
        task="arith_tool",
        task_options={"train_size": 200, "eval_size": 8},
        method="copc",
        steps=steps,
        seed=3,
        run_dir=str(run_dir),
        checkpoint_every=0,
        plots=False,
        model=ModelConfig(policy="tiny"),
        rollout=RolloutConfig(prompts_per_batch=2, group_size=2, max_turns=2, max_new_tokens_per_turn=8,
                              max_total_tokens=12, context_limit=96),
        trainer=TrainerConfig(actor_lr=1e-3, critic_lr=1e-3, micro_batch_size=4),
        staleness=StalenessConfig(mode=mode, staleness=s),  # type: ignore[arg-type]
        driver=DriverConfig(kind=driver),  # type: ignore[arg-type]
        eval=EvalConfig(prompts=2, samples=1, greedy=False),
    )
    return replace(cfg, **extra)  # type: ignore[arg-type]


def step_metrics(run_dir: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss/value" in r]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE) and k != "time"} for r in steps]


def final_policy(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = load_latest(run_dir)
    assert latest is not None
    return latest[1]["trainer"]["policy"]  # type: ignore[index,return-value]


def assert_same_run(a: Path, b: Path, *, from_step: int = 0) -> None:
    ma, mb = step_metrics(a), step_metrics(b)
    assert len(ma) >= 1
    assert ma[from_step - len(ma) if from_step else 0:] == mb[from_step - len(mb) if from_step else 0:]
    pa, pb = final_policy(a), final_policy(b)
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def test_async_with_zero_staleness_equals_sync(tmp_path: Path) -> None:
    train(small_config(tmp_path / "sync", driver="sync"), show_progress=False)
    train(small_config(tmp_path / "async", driver="async"), show_progress=False)
    assert_same_run(tmp_path / "sync", tmp_path / "async")
    assert all(m["staleness/max"] == 0 for m in step_metrics(tmp_path / "async"))


def test_async_fixed_lag_equals_the_synchronous_lag_simulation(tmp_path: Path) -> None:
    train(small_config(tmp_path / "sync", driver="sync", s=2, steps=4), show_progress=False)
    train(small_config(tmp_path / "async", driver="async", s=2, steps=4), show_progress=False)
    assert_same_run(tmp_path / "sync", tmp_path / "async")
    lags = [m["staleness/max"] for m in step_metrics(tmp_path / "async")]
    assert lags == [0, 1, 2, 2]  # fixed lag min(step, s): the warm start feeds the first s + 1 batches


def test_bounded_staleness_is_respected(tmp_path: Path) -> None:
    train(small_config(tmp_path / "b", driver="async", mode="bounded", s=2, steps=4), show_progress=False)
    assert all(m["staleness/max"] <= 2 for m in step_metrics(tmp_path / "b"))


def test_resume_reproduces_the_uninterrupted_fixed_lag_run(tmp_path: Path) -> None:
    full = small_config(tmp_path / "full", driver="async", s=1, steps=4, checkpoint_every=2)
    train(full, show_progress=False)
    part = replace(full, run_dir=str(tmp_path / "part"), steps=2)
    train(part, show_progress=False)
    resumed = replace(part, steps=4, resume=True)
    train(resumed, show_progress=False)
    assert_same_run(tmp_path / "full", tmp_path / "part", from_step=2)


def test_the_samplers_copies_are_kept_in_its_dtype_and_only_as_many_as_requests_need() -> None:
    """Issue 17: the weight ring and the snapshots hold rollout.dtype weights, and bounded staleness
    (workers read the newest version) keeps 3 versions, not s + 2."""
    from copc.rollout.generator import sampler_weights
    from copc.runtime.async_local import ring_slots

    weights = {"w": torch.tensor([1.0 + 2**-10, -3.0]), "ids": torch.arange(3)}
    cast = sampler_weights(weights, torch.bfloat16)
    assert cast["w"].dtype == torch.bfloat16 and torch.equal(cast["w"], weights["w"].to(torch.bfloat16))
    # integer buffers untouched (no copy asked for)
    assert cast["ids"].data_ptr() == weights["ids"].data_ptr()
    kept = sampler_weights(weights, torch.float32, copy=True)
    assert all(kept[k].data_ptr() != weights[k].data_ptr() and torch.equal(kept[k],
                                                                           weights[k]) for k in weights)
    assert ring_slots(StalenessConfig(mode="fixed_lag", staleness=8), partial=False) == 10
    assert ring_slots(StalenessConfig(mode="bounded", staleness=8), partial=True) == 10
    assert ring_slots(StalenessConfig(mode="bounded", staleness=8), partial=False) == 3


def test_async_bfloat16_sampling_equals_sync_with_half_size_snapshots(tmp_path: Path) -> None:
    bf16 = {"rollout": replace(small_config(tmp_path, driver="sync").rollout, dtype="bfloat16")}
    train(small_config(tmp_path / "sync", driver="sync", s=1, **bf16), show_progress=False)
    train(small_config(tmp_path / "async", driver="async", s=1, **bf16), show_progress=False)
    assert_same_run(tmp_path / "sync", tmp_path / "async")
    latest = load_latest(tmp_path / "async")
    assert latest is not None
    snapshots = latest[1]["source"]["snapshots"]  # type: ignore[index]
    assert sorted(snapshots) == [2, 3]  # type: ignore[call-overload]  # versions step 3 and 4 still need
    assert {t.dtype for w in snapshots.values() for t in w.values() if t.is_floating_point(
        )} == {torch.bfloat16}  # type: ignore[attr-defined]
    assert {t.dtype for t in final_policy(tmp_path / "async").values()} == {torch.float32}  # master weights


def _worker_niceness(spec: object, out: object) -> None:
    import os

    from copc.runtime.workers import build_generator

    build_generator(spec)  # type: ignore[arg-type]
    out.put(os.nice(0))  # type: ignore[attr-defined]


def test_rollout_workers_yield_the_cpu_to_the_trainer(tmp_path: Path) -> None:
    """``driver.worker_nice``: a worker process (and so its tool subprocesses) runs that much nicer than
    the trainer, which stays at its own priority; the sync driver has no worker to renice."""
    import multiprocessing as mp
    import os

    from copc.models import build_tiny_model, build_tiny_tokenizer
    from copc.runtime.workers import WorkerSpec

    tokenizer = build_tiny_tokenizer()
    build_tiny_model(tokenizer, seed=0).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    spec = WorkerSpec(model_path=str(tmp_path / "tiny"), task="arith_tool",
                      task_options={"train_size": 50, "eval_size": 4}, nice=3)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_worker_niceness, args=(spec, out))
    proc.start()
    try:
        assert out.get(timeout=120) == os.nice(0) + 3
    finally:
        proc.join(timeout=30)
    assert DriverConfig().worker_nice == 5
    with pytest.raises(ValueError, match="worker_nice must be in"):
        DriverConfig(worker_nice=20)
