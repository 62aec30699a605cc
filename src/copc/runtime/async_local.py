"""The asynchronous driver on one machine: rollout worker processes generate while the trainer trains.

This module is the driver's *policy*: which batch to request, from which worker, and what a death
means. Processes, pipes and shared-memory weights are the transport of :mod:`copc.runtime.workers`.

- **Admission** (main thread): batch ``j`` is requested once the buffer's admission rule allows it,
  ``floor(N_r / B) <= i + s`` with ``N_r = j·B`` (:mod:`copc.runtime.staleness`); ``fixed_lag`` asks
  for version exactly ``max(0, j - s)``, ``bounded`` for the newest at the time a worker starts it.
- **Partial rollouts** (``WorkerSpec.partial_chunk_tokens``, ``bounded`` only): a worker picks up newer
  weights between decode chunks of the batch it is generating, so one trajectory's tokens may carry
  several versions (:func:`~copc.runtime.workers.newest_weights`; never a version newer than the batch
  index, the step that consumes it). Under ``fixed_lag`` they are refused: each batch there has one
  prescribed version.
- **Assignment**: requests wait in a queue and go to an idle worker, one at a time per worker. A worker
  whose weights are newer than a ``fixed_lag`` request's version cannot take it (a generator's versions
  never go back); a freshly started worker (version 0) can take any.
- **Receiver thread**: journals each finished batch (:mod:`copc.runtime.journal`; a failed write ends
  the run with its one-line reason), then hands batches to the buffer in batch order, so data order
  does not depend on which worker finished first. Step ``n`` consumes batch ``n`` whole
  (:meth:`~copc.runtime.buffer.TrajectoryBuffer.take_batch`): a batch of any size, empty trajectories
  included, is one step.
- **Deaths**: a worker that dies, reports an error, or holds a batch longer than ``batch_timeout_s`` is
  restarted and its batch requested again (same index, so the same prompts and seeds; same version
  under ``fixed_lag``, the newest under ``bounded``). Restarts are counted
  (``runtime/worker_restarts``); the ``max_restarts + 1``-th failure ends the run with the worker's
  own error (its traceback, or how it exited).
- **Silent workers**: a worker that holds a batch and uses no CPU (stopped by SIGSTOP, blocked) for
  ``silent_warn_s`` gets one warning naming it, its batch and how long; after ``silent_restart_s`` it is
  restarted like a dead one (local workers only: the check reads ``/proc``).
- **A worker that cannot be started** (the fork server that starts workers is gone) ends the run with
  one line naming what died and the resume command; nothing a restart could fix.
- **Nothing waits forever**: :meth:`AsyncSource.next_batch` raises when the receiver thread has
  failed or stopped, and when batch ``n`` is neither stored, nor being generated, nor queued.

**Checkpoint and resume.** :meth:`AsyncSource.state_dict` holds the weight versions still needed by
unconsumed ``fixed_lag`` batches, the buffer (stored trajectories, prompts in flight) and the request
counters. On resume, journaled batches the checkpoint did not hold are restored (a batch completed
after the last checkpoint is not lost); a damaged journal entry is set aside (``*.damaged``), named on
stderr and generated again; batches that were still being generated are requested again with the same
seeds and versions, so a resumed ``fixed_lag`` run is identical to an uninterrupted one. A run that
starts without a checkpoint clears the journal (entries of an earlier attempt belong to no timeline).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Mapping
from pathlib import Path

import torch

from copc import tracking as m
from copc.rollout.generator import GeneratedBatch, batch_prompts, sampler_weights
from copc.runtime.buffer import TrajectoryBuffer, decode_batch
from copc.runtime.journal import Journal, JournalDamage, JournalError
from copc.runtime.loop import RunError
from copc.runtime.staleness import StalenessConfig, source_version
from copc.runtime.workers import (
    ReportsActivity,
    TransportFactory,
    WorkerSpec,
    WorkerStartError,
    local_transport,
)
from copc.trainer.weight_files import Weights
from copc.types import Prompt

__all__ = ["AsyncSource", "RolloutError"]

_POLL_S = 0.05


def ring_slots(staleness: StalenessConfig, *, partial: bool) -> int:
    """Weight versions the transport keeps: every one a request can still name.

    ``fixed_lag`` batch ``j`` asks for version ``j - s`` (``s + 1`` versions live, one more being
    written); so does a partial rollout's refresh, capped at its batch index, up to ``s`` behind the
    newest. Otherwise (``bounded``) a worker always reads the newest version: that one, the one being
    written, and one spare for a slow reader (a read torn by a publication is retried anyway).
    """
    return staleness.staleness + 2 if staleness.fixed_lag or partial else 3


class RolloutError(RunError):
    """The async driver cannot go on (a worker failed too often, a thread died, a journal write failed)."""


class AsyncSource:
    """The async driver's batch source (module docstring).

    Args:
        spec: how workers build their generator.
        staleness: the staleness policy (mode and ``s``).
        initial_weights: version-0 policy weights (the trainer's starting point).
        num_workers: rollout processes.
        journal_dir: where finished batches are journaled (None = no journal, nothing survives a kill).
        max_restarts: worker failures survived (restart + re-request); one more ends the run.
        batch_timeout_s: a worker holding one batch longer than this is killed and restarted (None = no
            limit).
        silent_warn_s: a worker holding a batch that has used no CPU for this long gets a warning (None =
            never).
        silent_restart_s: ... for this long is killed and restarted, a failure like a death (None = never).
        transport: builds the weight store and the workers (local processes by default; Ray actors:
            :func:`copc.runtime.ray_workers.ray_transport`). The policy here is the same for every transport.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        staleness: StalenessConfig,
        initial_weights: Mapping[str, torch.Tensor],
        *,
        num_workers: int = 1,
        journal_dir: str | os.PathLike[str] | None = None,
        max_restarts: int = 3,
        batch_timeout_s: float | None = None,
        silent_warn_s: float | None = None,
        silent_restart_s: float | None = None,
        transport: TransportFactory = local_transport,
    ) -> None:
        from copc.tasks import get_task

        if spec.partial_chunk_tokens is not None and staleness.fixed_lag:
            raise ValueError(
                "partial rollouts need staleness.mode=bounded: fixed_lag prescribes one version per batch; "
                "set staleness.mode=bounded or driver.partial_rollouts=false"
            )
        self.spec, self.staleness = spec, staleness
        self.batch_size = spec.rollout.batch_size
        self.buffer = TrajectoryBuffer(staleness, self.batch_size)
        self.pool = get_task(spec.task, **spec.task_options).prompts("train")  # type: ignore[arg-type]
        self.dtype = getattr(torch, spec.rollout.dtype)  # the sampler's: copies kept here are in it too
        self.ring, self.workers = transport(spec, sampler_weights(initial_weights, self.dtype),
                                            ring_slots(staleness,
                                                       partial=spec.partial_chunk_tokens is not None),
                                            num_workers)
        self.journal = Journal(journal_dir) if journal_dir is not None else None
        self.max_restarts, self.batch_timeout_s = max_restarts, batch_timeout_s
        self.silent_warn_s, self.silent_restart_s = silent_warn_s, silent_restart_s
        # slot -> (assigned since, CPU seconds last seen, when they last grew, warned): see _check_silence
        self._heard: dict[int, tuple[float, float, float, bool]] = {}
        self._next_silence_check = 0.0
        self.version = 0
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.next_request = 0  # first batch index not requested yet
        self.next_put = 0  # first batch index not handed to the buffer yet
        self.pending: dict[int, GeneratedBatch] = {}  # received out of order, waiting for next_put
        self.prefetched: dict[int, GeneratedBatch] = {}  # journaled beyond the checkpoint's requests
        self.generate_s: dict[int, float] = {}
        self.batch_info: dict[int, dict[str, float]] = {}  # the generator's counters, by batch index
        # journaled batches restored on resume, over the run (the checkpoint's count + this one's)
        self.restored = 0
        self.damaged: list[str] = []  # journal entries this process set aside on resume
        # damaged entries set aside on resume over the run: the ``*.damaged`` files its journal keeps (so a
        # process killed after setting one aside still counts), counted when this process resumed
        self.journal_damaged = 0
        self.restarts = 0
        self._resumed = False
        self._fatal: str | None = None
        self._lock = threading.RLock()
        self._queue: deque[tuple[int, int | None]] = deque()  # requests no worker has taken yet
        self._assigned: dict[int, tuple[int, int | None, float]] = {}  # slot -> (index, version, since)
        self._worker_version = [0] * num_workers
        self._stop = threading.Event()
        self._receiver = threading.Thread(target=self._receive, name="copc-receiver", daemon=True)
        self._started = False
        self._publish_local(0, initial_weights)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the workers and the receiver, and issue the first admitted requests."""
        if self.journal is not None and not self._resumed:
            self.journal.clear()
        for slot in range(len(self.workers)):
            self._start_worker(slot)
        self._started = True
        self._receiver.start()
        self._admit()

    def close(self) -> None:
        """Stop the receiver and every worker (in-flight batches are abandoned; the journal keeps finished
        ones)."""
        if not self._started:
            return
        self._stop.set()
        self._receiver.join(timeout=10)
        self.workers.close()
        self._started = False

    # ------------------------------------------------------------------ weights and admission
    def _publish_local(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        self.version = version
        self.ring.publish(version, weights)
        snapshot = sampler_weights(weights, self.dtype, copy=True)
        self.snapshots[version] = snapshot
        oldest = self.staleness.oldest_needed(version)
        self.snapshots = {v: w for v, w in self.snapshots.items() if v >= oldest}

    def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Make ``version`` available to workers, then admit the requests it unlocks."""
        self._publish_local(version, weights)
        self._admit()

    def _requests_of(self, index: int) -> list[Prompt]:
        prompts = batch_prompts(self.pool, self.spec.seed, index, self.spec.rollout.prompts_per_batch)
        return [p for p in prompts for _ in range(self.spec.rollout.group_size)]

    def _admit(self) -> None:
        while self.buffer.can_request(self.version):
            admitted = self.buffer.admit(self.version, self._requests_of(self.next_request))
            if len(admitted) != self.batch_size:
                raise RolloutError(f"admission split batch {self.next_request}: {len(admitted)} of "
                                   f"{self.batch_size}")
            if self.next_request in self.prefetched:  # finished before a crash: journaled, not regenerated
                self._accept(self.prefetched.pop(self.next_request))
            else:
                self._request(self.next_request)
            self.next_request += 1

    def _request(self, index: int, *, first: bool = False) -> None:
        wanted = self.staleness.wanted_version(index)
        with self._lock:
            if first:
                self._queue.appendleft((index, wanted))
            else:
                self._queue.append((index, wanted))
            if self._started:
                self._dispatch()

    def _dispatch(self) -> None:
        """Give queued requests to idle workers (caller holds the lock)."""
        for slot in range(len(self.workers)):
            if slot in self._assigned or not self.workers.started(slot):
                continue
            for k, (index, wanted) in enumerate(self._queue):
                if wanted is None or wanted >= self._worker_version[slot]:
                    del self._queue[k]
                    if self.workers.send(slot, index, wanted):
                        self._assigned[slot] = (index, wanted, time.monotonic())
                    else:  # died meanwhile: the receiver sees the death and restarts it
                        self._queue.appendleft((index, wanted))
                    break

    # ------------------------------------------------------------------ results
    def _receive(self) -> None:
        try:
            while not self._stop.is_set():
                for event in self.workers.wait(_POLL_S):
                    if event.payload is not None:
                        self._on_batch(event.slot, event.payload)
                    elif event.error is not None:
                        self._on_failure(event.slot, event.error)
                self._check_timeouts()
                with self._lock:
                    self._dispatch()
        except RolloutError as err:
            self._fatal = str(err)
        except BaseException:  # any failure of this thread must end the run, with its traceback)
            self._fatal = f"the receiver thread failed:\n{traceback.format_exc()}"

    def _on_batch(self, slot: int, payload: bytes) -> None:
        batch = decode_batch(payload)
        if self.journal is not None:
            try:
                self.journal.write(batch.index, payload)
            except JournalError as err:
                raise RolloutError(f"rollout journal: {err}") from None
        with self._lock:  # one step: the batch is never "neither assigned nor stored" (see _coming)
            self._accept(batch)
            self._assigned.pop(slot, None)
            # partial rollouts swap
            newest = max([batch.version] + [t.max_version for t in batch.trajectories])
            self._worker_version[slot] = max(self._worker_version[slot], newest)

    def _on_failure(self, slot: int, error: str) -> None:
        with self._lock:
            lost = self._assigned.pop(slot, None)
            self.restarts += 1
            what = f"batch {lost[0]}" if lost else "no batch"
            if self.restarts > self.max_restarts:
                raise RolloutError(
                    f"rollout worker {slot} failed ({what}), restart limit driver.max_worker_restarts="
                    f"{self.max_restarts} reached; its error:\n{error.rstrip()}"
                )
            last = error.strip().splitlines()[-1] if error.strip() else "no message"
            print(f"warning: rollout worker {slot} failed ({last}); restarting it "
                  f"({self.restarts} of {self.max_restarts} restarts), {what} requested again",
                  file=sys.stderr, flush=True)
            if lost is not None:  # queued first: the batch is never "neither assigned nor queued"
                self._queue.appendleft((lost[0], lost[1]))
            self._start_worker(slot)
            self._worker_version[slot] = 0
            self._dispatch()

    def _start_worker(self, slot: int) -> None:
        """(Re)start ``slot``; a worker that cannot be started ends the run in one line (no restart helps)."""
        self._heard.pop(slot, None)
        try:
            self.workers.start(slot)
        except WorkerStartError as err:
            where = f" run_dir={self.journal.directory.parent}" if self.journal is not None else ""
            raise RolloutError(
                f"{err}. The run cannot go on; its checkpoints are kept: copc train resume=true{where} "
                "continues it from the last one"
            ) from None

    def _check_silence(self) -> None:
        """Warn about, then restart, a worker that holds a batch and has used no CPU (module docstring)."""
        if (self.silent_warn_s is None and self.silent_restart_s is None) or not isinstance(self.workers,
                                                                                            ReportsActivity):
            return
        now = time.monotonic()
        if now < self._next_silence_check:
            return
        self._next_silence_check = now + 0.25
        for slot, (index, _, since) in list(self._assigned.items()):
            seen = self.workers.activity(slot)
            if seen is None:
                continue  # no live process: the death is reported as such
            cpu, stopped = seen
            heard = self._heard.get(slot)
            if heard is None or heard[0] != since or cpu > heard[1]:
                if heard is not None and heard[0] == since and heard[3]:
                    print(f"rollout worker {slot} is running again after {now - heard[2]:.0f} s of silence",
                          file=sys.stderr, flush=True)
                self._heard[slot] = (since, cpu, now, False)
                continue
            silent = now - heard[2]
            state = "has been stopped (SIGSTOP?)" if stopped else "has used no CPU"
            if self.silent_restart_s is not None and silent > self.silent_restart_s:
                self._on_failure(slot,
                                 f"silent while generating batch {index}: it {state} for {silent:.0f} s "
                                       f"(driver.silent_worker_restart_s={self.silent_restart_s:g})")
            elif self.silent_warn_s is not None and silent > self.silent_warn_s and not heard[3]:
                then = (f"; it is restarted after {self.silent_restart_s:g} s "
                        f"(driver.silent_worker_restart_s)"
                        if self.silent_restart_s is not None else "")
                print(f"warning: rollout worker {slot} (pid {self.workers.pid(slot)}) "
                      f"{state} for {silent:.0f} s while generating batch {index}; the run waits for "
                      f"it{then}",
                      file=sys.stderr, flush=True)
                self._heard[slot] = (*heard[:3], True)

    def _check_timeouts(self) -> None:
        self._check_silence()
        if self.batch_timeout_s is None:
            return
        now = time.monotonic()
        for slot, (index, _, since) in list(self._assigned.items()):
            if now - since > self.batch_timeout_s:
                self._on_failure(slot, f"no batch {index} after {self.batch_timeout_s:.0f} s "
                                       f"(driver.batch_timeout_s)")

    def _accept(self, batch: GeneratedBatch) -> None:
        with self._lock:
            if batch.index < self.next_put or batch.index in self.pending:
                return  # already have it (restored from the journal and generated again)
            self.pending[batch.index] = batch
            while self.next_put in self.pending:
                ready = self.pending.pop(self.next_put)
                self.generate_s[ready.index] = ready.generate_s
                self.batch_info[ready.index] = ready.info
                self.buffer.put_batch(ready.index, ready.version, ready.trajectories,
                                      requests=self._requests_of(ready.index))
                if ready.rejected:  # groups dynamic sampling dropped (their requests are cleared above)
                    self.buffer.record_drop("rejected", len(ready.rejected))
                self.next_put += 1

    def _coming(self, step: int) -> bool:
        """Whether batch ``step`` is stored, pending, being generated or queued (else nothing brings it)."""
        with self._lock:
            return (
                step < self.next_put
                or step in self.pending
                or any(index == step for index, _, _ in self._assigned.values())
                or any(index == step for index, _ in self._queue)
            )

    def next_batch(self, step: int) -> tuple[GeneratedBatch, float]:
        """Batch ``step`` (blocking, with liveness checks) and the seconds the trainer waited for it."""
        start = time.perf_counter()
        while True:
            if self._fatal is not None:
                raise RolloutError(self._fatal)
            if not self._started:
                raise RolloutError("next_batch before start(): the async source is not running")
            trajectories = self.buffer.take_batch(step, timeout_s=_POLL_S)
            if trajectories is not None:
                break
            if not self._receiver.is_alive():
                raise RolloutError(self._fatal or "the receiver thread stopped; no batch can arrive")
            if not self._coming(step):
                raise RolloutError(
                    f"batch {step} is neither stored nor requested (next request {self.next_request}, "
                    f"next put {self.next_put}): the driver cannot make progress"
                )
        waited = time.perf_counter() - start
        sampled = [t.min_version for t in trajectories if t.min_version >= 0]
        version = min(sampled) if sampled else source_version(step, self.staleness.staleness)
        info = self.batch_info.pop(step, {})
        return GeneratedBatch(step, version, trajectories, self.generate_s.pop(step, 0.0), info), waited

    def metrics(self) -> dict[str, float]:
        """Buffer counters and driver counters (cumulative)."""
        out = self.buffer.metrics()
        out[m.RUNTIME_WORKER_RESTARTS] = float(self.restarts)
        out[m.RUNTIME_JOURNAL_DAMAGED] = float(self.journal_damaged)
        return out

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, object]:
        with self._lock:
            return {
                "snapshots": {version: Weights(w) for version, w in self.snapshots.items()},
                "version": self.version,
                "next_request": self.next_request,
                "next_put": self.next_put,
                "buffer": self.buffer.state_dict(),
                "restarts": self.restarts,
                "restored": self.restored,
                # the generation time and counters of the batches the buffer holds, logged when consumed
                "generate_s": dict(self.generate_s),
                "batch_info": {index: dict(info) for index, info in self.batch_info.items()},
            }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore before :meth:`start`: weights, buffer, journaled batches; re-request the rest."""
        if self._started:
            raise RuntimeError("load_state_dict must run before start()")
        self._resumed = True
        snapshots: dict[int, dict[str, torch.Tensor]]
        snapshots = dict(state["snapshots"])  # type: ignore[call-overload]
        for version in sorted(snapshots):
            self.ring.publish(version, snapshots[version])
        self.snapshots = snapshots
        self.version = int(state["version"])  # type: ignore[call-overload]
        self.restarts = int(state.get("restarts", 0))  # type: ignore[call-overload]
        self.restored = int(state.get("restored", 0))  # type: ignore[call-overload]
        self.generate_s.update(state.get("generate_s", {}))  # type: ignore[call-overload]
        self.batch_info.update(state.get("batch_info", {}))  # type: ignore[call-overload]
        self.buffer.load_state_dict(state["buffer"])  # type: ignore[arg-type]
        self.buffer.take_requeued()  # regenerated below by batch index (same prompts, same seeds)
        self.next_put = int(state["next_put"])  # type: ignore[call-overload]
        requested = int(state["next_request"])  # type: ignore[call-overload]
        if self.journal is not None:
            self._restore_journal(requested)
        for index in range(self.next_put, requested):
            if index not in self.pending:
                self._request(index)
        self.next_request = requested

    def _restore_journal(self, requested: int) -> None:
        assert self.journal is not None
        self.journal.remove_temps()
        for index in self.journal.indices():
            if index < self.next_put:
                continue  # consumed or held by the checkpointed buffer already
            try:
                batch = self.journal.read(index)
            except JournalDamage as err:
                moved = self.journal.set_aside(index)
                self.damaged.append(str(moved))
                print(f"warning: {err}; set aside as {moved.name}, batch {index} will be generated again",
                      file=sys.stderr, flush=True)
                continue
            self.restored += 1
            if index < requested:
                self._accept(batch)
            else:  # requested after the checkpoint: handed over when admission reaches it
                self.prefetched[index] = batch
        self.journal_damaged = len(self.journal.damaged())

    def prune_journal(self, consumed_before: int) -> None:
        """Delete journaled batches ``< consumed_before`` (a checkpoint at that step covers them)."""
        if self.journal is not None:
            self.journal.prune(consumed_before)

    def checkpointed(self, state: Mapping[str, object]) -> None:
        """A checkpoint holding ``state`` (:meth:`state_dict`) is on disk: the batches it covers leave the
        journal."""
        self.prune_journal(int(state["next_put"]))  # type: ignore[call-overload]

    def counters(self) -> dict[str, int]:
        """Journaled batches restored on resume, worker restarts, damaged journal files (the run's
        summary)."""
        return {"restored_batches": self.restored, "worker_restarts": self.restarts,
                "journal_damaged": self.journal_damaged}

    @property
    def journal_dir(self) -> Path | None:
        return self.journal.directory if self.journal is not None else None
