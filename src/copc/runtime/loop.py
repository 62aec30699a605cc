"""The training loop every driver shares: take batch ``step`` from a :class:`BatchSource`, train on it,
publish the new weights; plus the rollout metrics (realized staleness, episode statistics) of each batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from copc import tracking as m
from copc.rollout.generator import GeneratedBatch
from copc.runtime.staleness import realized_staleness
from copc.trainer.batching import collate
from copc.trainer.trainer import ActorCriticTrainer

__all__ = ["BatchSource", "LoopResult", "rollout_metrics", "run_loop"]


class BatchSource(Protocol):
    """What the loop needs from a driver: batches by step, and the weights it should sample with."""

    def next_batch(self, step: int) -> tuple[GeneratedBatch, float]: ...

    def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> None: ...

    def state_dict(self) -> dict[str, object]: ...

    def load_state_dict(self, state: Mapping[str, object]) -> None: ...

    def close(self) -> None: ...


def rollout_metrics(batch: GeneratedBatch, version: int) -> dict[str, float]:
    """Realized staleness (spec section 1) and episode statistics of a consumed batch."""
    trajs = batch.trajectories
    st = realized_staleness(trajs, version)
    calls = [t.info.get("tool_calls", 0.0) for t in trajs]
    out = {
        m.STALENESS_MEAN: st.token_mean,
        m.STALENESS_MAX: float(st.token_max),
        m.STALENESS_SEQ_MAX_MEAN: st.s_max_mean,
        m.ROLLOUT_ACCURACY: sum(t.info.get("correct", float(t.reward > 0)) for t in trajs) / len(trajs),
        m.ROLLOUT_TOOL_USE_RATE: sum(c > 0 for c in calls) / len(trajs),
        m.ROLLOUT_TOOL_CALLS: sum(calls) / len(trajs),
        m.ROLLOUT_RESPONSE_TOKENS: sum(t.num_action_tokens for t in trajs) / len(trajs),
        m.ROLLOUT_TRUNCATED_FRAC: sum(t.truncated for t in trajs) / len(trajs),
        m.ROLLOUT_VERSION: float(batch.version),
    }
    out.update(batch.info)  # the generator's counters (dynamic sampling, overlong penalty)
    return out


@dataclass
class LoopResult:
    steps: int
    history: list[dict[str, float]]


def run_loop(
    trainer: ActorCriticTrainer,
    source: BatchSource,
    *,
    start_step: int,
    steps: int,
    pad_id: int,
    on_step: Callable[[int, dict[str, float], GeneratedBatch], None] | None = None,
) -> LoopResult:
    """Steps ``start_step .. steps-1``: get batch ``step``, train on it, publish version ``step + 1``.

    The same loop serves every driver; only ``source`` differs. Time per step is split into generation
    (seconds spent producing the batch, in whichever process), waiting (seconds the trainer blocked on
    the source) and training.
    """
    history = []
    for step in range(start_step, steps):
        start = time.perf_counter()
        batch, waited = source.next_batch(step)
        if trainer.version != step:
            raise RuntimeError(f"trainer version {trainer.version} != step {step}: checkpoint and run disagree")
        train_batch = collate(batch.trajectories, pad_id=pad_id)
        metrics = rollout_metrics(batch, trainer.version)
        metrics.update(trainer.step(train_batch))
        source.publish(trainer.version, trainer.policy_weights())
        step_s = time.perf_counter() - start
        metrics.update({
            m.TIME_GENERATE: batch.generate_s,
            m.TIME_WAIT: waited,
            m.TIME_STEP: step_s,
            m.PERF_TOKENS_PER_S: int(train_batch.attention_mask.sum()) / max(step_s, 1e-9),
        })
        history.append(metrics)
        if on_step is not None:
            on_step(step, metrics, batch)
    return LoopResult(steps=steps, history=history)
