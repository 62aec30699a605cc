"""The training loop every driver shares: take batch ``step`` from a :class:`BatchSource`, train on it,
publish the new weights; plus the rollout metrics (realized staleness, episode statistics) of each batch.

Guards (docs/reliability.md): a batch without a single sampled token is refused (:class:`RunError`;
some empty rows are fine and counted in ``rollout/empty_frac``); a step whose loss, gradient norm or
new weights are not finite stops the run before those weights are published or checkpointed
(:class:`NonFiniteError`); Ctrl-C and SIGTERM (:class:`StopSignals`) stop at the next step boundary,
so whatever is saved afterwards is a consistent state; a step that never ends (a grader or env step that
hangs) ends the process after ``stall_timeout_s`` (:class:`~copc.runtime.stall.StallWatchdog`).
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from types import FrameType
from typing import Protocol

import torch

from copc import tracking as m
from copc.rollout.episode_state import truncation_stats
from copc.rollout.generator import GeneratedBatch
from copc.runtime.staleness import realized_staleness
from copc.runtime.stall import StallWatchdog
from copc.trainer.batching import TrainBatch, collate
from copc.trainer.memory import PEAKS
from copc.trainer.trainer import ActorCriticTrainer

__all__ = [
    "BatchSource", "Interrupted", "LoopResult", "NonFiniteError", "RunError", "StopSignals",
    "rollout_metrics",
    "run_loop",
]


class RunError(RuntimeError):
    """A run cannot go on; the message is for people (what happened, what to do)."""


class NonFiniteError(RunError):
    """A step produced a non-finite loss, gradient norm or weight (its weights are not published)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM. ``clean``: raised at a step boundary (the trainer's state is consistent)."""

    def __init__(self, signal_name: str, *, clean: bool) -> None:
        super().__init__(signal_name)
        self.signal_name, self.clean = signal_name, clean


class StopSignals:
    """SIGINT and SIGTERM as one clean stop: immediate between steps, deferred to the end of a step.

    A second signal stops at once (``clean=False``: nothing may be saved from a half-done step).
    :meth:`install` only works in the main thread (signal handlers live there); elsewhere it is a no-op.
    """

    def __init__(self) -> None:
        self.received: str | None = None
        self._in_step = False
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            if handler is not None:  # None: installed from C; nothing Python can put back
                signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            raise Interrupted(name, clean=False)
        self.received = name
        if not self._in_step:
            raise Interrupted(name, clean=True)

    @contextmanager
    def step(self) -> Iterator[None]:
        """The body of one step: a signal received inside it takes effect when it ends."""
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False
        if self.received is not None:
            raise Interrupted(self.received, clean=True)


#: ``(step, batch, collated) -> (collated, metrics)``, called before each step (copc.run.oracle).
BeforeStep = Callable[[int, GeneratedBatch, TrainBatch], tuple[TrainBatch, dict[str, float]]]


class BatchSource(Protocol):
    """What a run needs from a driver: batches by step, the weights it should sample with, its state for
    checkpoints, and the counters of its background work (0 for a driver that has none)."""

    #: A batch wait's own limit [s] (None: none, so the stall watchdog bounds the wait).
    batch_timeout_s: float | None

    def start(self) -> None: ...

    def checkpointed(self, state: Mapping[str, object]) -> None: ...

    def counters(self) -> dict[str, int]: ...

    def next_batch(self, step: int) -> tuple[GeneratedBatch, float]: ...

    def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> None: ...

    def state_dict(self) -> dict[str, object]: ...

    def load_state_dict(self, state: Mapping[str, object]) -> None: ...

    def close(self) -> None: ...

    def metrics(self) -> dict[str, float]: ...


def rollout_metrics(batch: GeneratedBatch, version: int) -> dict[str, float]:
    """Realized staleness (docs/formulas.md#staleness) and episode statistics of a consumed batch."""
    trajs = batch.trajectories
    st = realized_staleness(trajs, version)
    calls = [t.info.get("tool_calls", 0.0) for t in trajs]
    cuts = truncation_stats(trajs)
    out = {
        m.STALENESS_MEAN: st.token_mean,
        m.STALENESS_MAX: float(st.token_max),
        m.STALENESS_SEQ_MAX_MEAN: st.s_max_mean,
        m.STALENESS_GENERATION_MEAN: st.s_gen_mean,
        m.STALENESS_GENERATION_MAX: float(st.s_gen_max),
        m.STALENESS_WAITING_MEAN: st.s_wait_mean,
        m.STALENESS_WAITING_MAX: float(st.s_wait_max),
        m.ROLLOUT_VERSIONS_PER_TRAJ: st.versions_mean,
        m.ROLLOUT_VERSIONS_PER_TRAJ_MAX: float(st.versions_max),
        m.ROLLOUT_ACCURACY: sum(t.info.get("correct", float(t.reward > 0)) for t in trajs) / len(trajs),
        m.ROLLOUT_TOOL_USE_RATE: sum(c > 0 for c in calls) / len(trajs),
        m.ROLLOUT_TOOL_CALLS: sum(calls) / len(trajs),
        m.ROLLOUT_TOOL_INFRA_ERRORS: sum(t.info.get("tool_infra_errors", 0.0) for t in trajs) / len(trajs),
        m.ROLLOUT_ENV_ERROR_FRAC: sum(t.info.get("env_errors", 0.0) > 0 for t in trajs) / len(trajs),
        m.ROLLOUT_GRADE_FAILURE_FRAC: sum(t.info.get("grade_failures", 0.0) > 0 for t in trajs) / len(trajs),
        m.ROLLOUT_RESPONSE_TOKENS: sum(t.num_action_tokens for t in trajs) / len(trajs),
        m.ROLLOUT_TRUNCATED_FRAC: sum(t.truncated for t in trajs) / len(trajs),
        m.ROLLOUT_VERSION: float(batch.version),
        m.ROLLOUT_EMPTY_FRAC: sum(t.num_action_tokens == 0 for t in trajs) / len(trajs),
        m.ROLLOUT_TRUNCATED_TURN_FRAC: cuts.turn_frac,
        m.ROLLOUT_TURN_LIMIT_FRAC: cuts.turn_limit_frac,
    }
    out.update(batch.info)  # the generator's counters (dynamic sampling, overlong penalty)
    return out


def check_finite(step: int, metrics: Mapping[str, float], weights: Mapping[str, torch.Tensor]) -> None:
    """Raise :class:`NonFiniteError` if a loss, a gradient norm or a weight of ``step`` is not finite."""
    bad = [k for k, v in metrics.items() if k.startswith(("loss/", "grad/")) and not math.isfinite(v)]
    if bad:
        raise NonFiniteError(
            f"step {step}: {bad[0]} is {metrics[bad[0]]} (not finite); stopped before publishing or saving "
            "these weights (the last checkpoint is the last good "
            "state); lower the learning rate or check the data"
        )
    for name, tensor in weights.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise NonFiniteError(
                f"step {step}: weight {name} is not finite; stopped before publishing or saving it "
                "(the last checkpoint is the last good state); lower the learning rate"
            )


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
    signals: StopSignals | None = None,
    watchdog: StallWatchdog | None = None,
    wait_bounded: bool = False,
    before_step: BeforeStep | None = None,
) -> LoopResult:
    """Steps ``start_step .. steps-1``: get batch ``step``, train on it, publish version ``step + 1``.

    The same loop serves every driver; only ``source`` differs. Time per step is split into generation
    (seconds spent producing the batch, in whichever process), waiting (seconds the trainer blocked on
    the source), training and publication. Each step (``on_step`` included) is one ``watchdog`` phase;
    ``wait_bounded``: ``source.next_batch`` only waits for other processes under its own limit (the async
    driver's ``batch_timeout_s``), so the watchdog is paused during it.
    """
    history: list[dict[str, float]] = []
    signals = signals or StopSignals()
    watchdog = watchdog or StallWatchdog(0)
    for step in range(start_step, steps):
        with watchdog.phase(f"step {step}"):
            _one_step(trainer, source, step, pad_id, on_step, signals, watchdog, wait_bounded, history,
                      before_step)
    return LoopResult(steps=steps, history=history)


def _one_step(
    trainer: ActorCriticTrainer,
    source: BatchSource,
    step: int,
    pad_id: int,
    on_step: Callable[[int, dict[str, float], GeneratedBatch], None] | None,
    signals: StopSignals,
    watchdog: StallWatchdog,
    wait_bounded: bool,
    history: list[dict[str, float]],
    before_step: BeforeStep | None = None,
) -> None:
    start = time.perf_counter()
    with watchdog.paused() if wait_bounded else nullcontext(), PEAKS.phase("batch"):
        batch, waited = source.next_batch(step)
    with signals.step():
        if trainer.version != step:
            raise RunError(f"trainer version {trainer.version} != step {step}: checkpoint and run disagree")
        if not batch.trajectories or all(t.num_action_tokens == 0 for t in batch.trajectories):
            raise RunError(
                f"step {step}: none of the {len(batch.trajectories)} trajectories of batch {step} has a "
                "sampled token (every prompt fills rollout.context_limit?); nothing to train on: raise "
                "rollout.context_limit or remove the long rows"
            )
        train_batch = collate(batch.trajectories, pad_id=pad_id)
        metrics = rollout_metrics(batch, trainer.version)
        if before_step is not None:  # e.g. the Monte-Carlo oracle, under the weights about to be trained
            train_batch, extra = before_step(step, batch, train_batch)
            metrics.update(extra)
        metrics.update(trainer.step(train_batch))
        published = time.perf_counter()
        with PEAKS.phase("publish"):
            weights = trainer.policy_weights()
            check_finite(step, metrics, weights)
            source.publish(trainer.version, weights)
        step_s = time.perf_counter() - start
        metrics.update({
            m.TIME_GENERATE: batch.generate_s,
            m.TIME_WAIT: waited,
            m.TIME_PUBLISH: time.perf_counter() - published,
            m.TIME_STEP: step_s,
            m.PERF_TOKENS_PER_S: int(train_batch.attention_mask.sum()) / max(step_s, 1e-9),
        })
        metrics.update(source.metrics())
        metrics.update(PEAKS.take())
        history.append(metrics)
        if on_step is not None:
            on_step(step, metrics, batch)
