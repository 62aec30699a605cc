"""The asynchronous driver on one machine: rollout worker processes generate while the trainer trains.

Pieces (all in this module, over the shared components of :mod:`copc.runtime.sync`):

- **Weight ring** (:class:`WeightRing`): ``R`` slots of shared-memory tensors, each tagged with the
  version it holds (``-1`` while being written). The trainer publishes version ``v`` into slot
  ``v mod R``; a worker copies the slot it needs under the ring's lock and checks the tag, so a torn or
  overwritten read is impossible. ``R = s + 2`` keeps every version a ``fixed_lag`` request can still
  ask for (request ``j`` needs ``max(0, j - s)``, and the trainer cannot publish ``j - s + R`` before
  consuming batch ``j``).
- **Workers** (``torch.multiprocessing``, ``forkserver`` start method: fresh processes like ``spawn``,
  forked from a server that imported torch and copc once): each loads the policy and the task, then loops: take a
  request ``(j, version)``, copy those weights (``fixed_lag``: exactly ``max(0, j - s)``; ``bounded``:
  the newest), generate batch ``j`` (:class:`~copc.runtime.sync.RolloutGenerator`), send it back.
- **Admission** (main process): batch ``j`` is requested once the buffer's admission rule allows it,
  ``floor(N_r / B) <= i + s`` with ``N_r = j·B`` (:mod:`copc.runtime.staleness`), so the trainer
  waits only when the batch it needs is not generated yet.
- **Receiver thread**: writes each finished batch to the journal (``rollouts/batch_XXXXXXXX.pt``,
  written to a temp file then ``os.replace``: never half-written), then hands batches to the
  :class:`~copc.runtime.buffer.TrajectoryBuffer` in batch order (so data order does not depend on
  which worker finished first).

**Checkpoint and resume.** :meth:`AsyncSource.state_dict` holds the weight versions still needed by
unconsumed ``fixed_lag`` batches, the buffer (stored trajectories, prompts in flight) and the request
counters. On resume, journaled batches the checkpoint did not hold are restored (a batch completed
after the last checkpoint is not lost), and only batches that were still being generated are requested
again, with the same seeds and versions, so a resumed ``fixed_lag`` run is identical to an
uninterrupted one. Journal files of consumed batches are deleted once a checkpoint covers them.
"""

from __future__ import annotations

import io
import multiprocessing.context
import os
import queue
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.multiprocessing as mp

from copc.rollout.generator import GeneratedBatch, RolloutConfig, RolloutGenerator, batch_prompts
from copc.runtime.buffer import (
    TrajectoryBuffer,
    prompt_from_dict,
    prompt_to_dict,
    trajectory_from_dict,
    trajectory_to_dict,
)
from copc.runtime.staleness import StalenessConfig, source_version

__all__ = ["AsyncSource", "WeightRing", "WorkerSpec"]

_POLL_S = 0.05
#: Modules the fork server imports once; every worker forks from it with them loaded (torch, transformers
#: and the tasks take 5-15 s to import on a busy 2-core machine).
_PRELOAD = ["copc.runtime.async_local", "copc.models", "copc.tasks", "copc.rollout.episode"]


def _context() -> multiprocessing.context.ForkServerContext:
    """``forkserver``: each worker is a fresh process as with ``spawn`` (nothing inherited from the
    trainer: no threads, no CUDA state), but forked from a server that has already imported the heavy
    modules, so starting a worker costs milliseconds after the first one."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx

_ORPHAN_CHECK_S = 0.5


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to build its generator (picklable)."""

    model_path: str
    """HF directory of the policy (architecture and tokenizer; weights come from the ring)."""
    task: str
    """Task name for ``copc.tasks.get_task``."""
    task_options: dict[str, str | int | float | bool | None] = field(default_factory=dict)
    """Task config values."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    seed: int = 0
    num_threads: int = 1
    """torch threads per worker process."""


class WeightRing:
    """Versioned policy weights in shared memory (module docstring).

    Each slot is one flat shared buffer per dtype (tensors are views into it), so passing the ring to a
    worker sends a handful of file descriptors, not one per parameter tensor per slot.
    """

    def __init__(self, template: Mapping[str, torch.Tensor], slots: int) -> None:
        ctx = _context()
        self.layout: list[tuple[str, str, tuple[int, ...], int]] = []  # name, dtype, shape, offset
        sizes: dict[str, int] = {}
        for name, tensor in template.items():
            key = str(tensor.dtype)
            self.layout.append((name, key, tuple(tensor.shape), sizes.get(key, 0)))
            sizes[key] = sizes.get(key, 0) + tensor.numel()
        dtypes = {str(t.dtype): t.dtype for t in template.values()}
        self.buffers = [
            {key: torch.zeros(size, dtype=dtypes[key]).share_memory_() for key, size in sizes.items()}
            for _ in range(slots)
        ]
        self.tags = ctx.Array("q", [-1] * slots, lock=False)
        self.latest = ctx.Value("q", -1, lock=False)
        self.lock = ctx.Lock()

    def _views(self, slot: int) -> dict[str, torch.Tensor]:
        views = {}
        for name, key, shape, offset in self.layout:
            numel = int(torch.Size(shape).numel())
            views[name] = self.buffers[slot][key][offset : offset + numel].view(shape)
        return views

    def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        slot = version % len(self.buffers)
        with self.lock:
            self.tags[slot] = -1
            for name, view in self._views(slot).items():
                view.copy_(weights[name])
            self.tags[slot] = version
            self.latest.value = max(self.latest.value, version)

    def read(self, version: int | None) -> tuple[int, dict[str, torch.Tensor]]:
        """A private copy of ``version`` (None = the newest) and its tag."""
        with self.lock:
            wanted = self.latest.value if version is None else version
            slot = wanted % len(self.buffers)
            if wanted < 0 or self.tags[slot] != wanted:
                raise RuntimeError(
                    f"weights of version {wanted} are not in the ring (slot holds {self.tags[slot]}); "
                    "the ring is too small for this staleness"
                )
            return wanted, {k: v.clone() for k, v in self._views(slot).items()}


def _encode(batch: GeneratedBatch) -> bytes:
    buf = io.BytesIO()
    torch.save(
        {
            "index": batch.index,
            "version": batch.version,
            "generate_s": batch.generate_s,
            "trajectories": [trajectory_to_dict(t) for t in batch.trajectories],
            "info": dict(batch.info),
            "rejected": [prompt_to_dict(p) for p in batch.rejected],
        },
        buf,
    )
    return buf.getvalue()


def _decode(payload: bytes) -> GeneratedBatch:
    data = torch.load(io.BytesIO(payload), weights_only=True)
    return GeneratedBatch(
        index=int(data["index"]),
        version=int(data["version"]),
        trajectories=[trajectory_from_dict(d) for d in data["trajectories"]],
        generate_s=float(data["generate_s"]),
        info={str(k): float(v) for k, v in data.get("info", {}).items()},
        rejected=[prompt_from_dict(p) for p in data.get("rejected", [])],
    )


def _worker_main(
    spec: WorkerSpec, ring: WeightRing, requests: mp.Queue, results: mp.Queue, trainer_alive: Connection
) -> None:
    """Worker process: build a generator, then serve ``(batch_index, version | None)`` requests.

    Exits on a ``None`` request, or by itself when the trainer has died: ``trainer_alive`` is the read
    end of a pipe only the trainer holds open, so it reads EOF once the trainer is gone (a SIGKILLed
    trainer cannot tell it to stop; an orphan must not keep a CPU busy).
    """
    try:
        torch.set_num_threads(spec.num_threads)
        from transformers.utils import logging as hf_logging

        from copc.models import load_policy

        hf_logging.disable_progress_bar()
        from copc.tasks import get_task

        model, tokenizer = load_policy(spec.model_path)
        task = get_task(spec.task, **spec.task_options)  # type: ignore[arg-type]
        generator = RolloutGenerator(model, tokenizer, task, spec.rollout, seed=spec.seed)
        while True:
            try:
                message = requests.get(timeout=_ORPHAN_CHECK_S)
            except queue.Empty:
                if trainer_alive.poll():  # EOF: the trainer's end is closed
                    return
                continue
            if message is None:
                return
            index, wanted = message
            version, weights = ring.read(wanted)
            generator.load(weights, version)
            results.put(("ok", _encode(generator.generate(index))))
    except Exception:  # a worker failure must reach the trainer, never hang it
        results.put(("error", traceback.format_exc()))


class AsyncSource:
    """The async driver's batch source (module docstring).

    Args:
        spec: how workers build their generator.
        staleness: the staleness policy (mode and ``s``).
        initial_weights: version-0 policy weights (the trainer's starting point).
        num_workers: rollout processes.
        journal_dir: where finished batches are journaled (None = no journal, nothing survives a kill).
    """

    def __init__(
        self,
        spec: WorkerSpec,
        staleness: StalenessConfig,
        initial_weights: Mapping[str, torch.Tensor],
        *,
        num_workers: int = 1,
        journal_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        from copc.tasks import get_task

        self.spec, self.staleness = spec, staleness
        self.batch_size = spec.rollout.batch_size
        self.buffer = TrajectoryBuffer(staleness, self.batch_size)
        self.pool = get_task(spec.task, **spec.task_options).prompts("train")  # type: ignore[arg-type]
        self.ring = WeightRing(initial_weights, slots=staleness.staleness + 2)
        self.journal = Path(journal_dir) if journal_dir is not None else None
        if self.journal is not None:
            self.journal.mkdir(parents=True, exist_ok=True)
        self.version = 0
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.next_request = 0  # first batch index not requested yet
        self.next_put = 0  # first batch index not handed to the buffer yet
        self.pending: dict[int, GeneratedBatch] = {}  # received out of order, waiting for next_put
        self.prefetched: dict[int, GeneratedBatch] = {}  # journaled beyond the checkpoint's requests
        self.generate_s: dict[int, float] = {}
        self.batch_info: dict[int, dict[str, float]] = {}  # the generator's counters, by batch index
        self.restored = 0
        self._error: str | None = None
        self._lock = threading.Lock()
        ctx = _context()
        self.requests: mp.Queue = ctx.Queue()
        self.results: mp.Queue = ctx.Queue()
        alive_r, self._alive_w = ctx.Pipe(duplex=False)
        self.workers = [
            ctx.Process(
                target=_worker_main, args=(spec, self.ring, self.requests, self.results, alive_r), daemon=True
            )
            for _ in range(num_workers)
        ]
        self._stop = threading.Event()
        self._receiver = threading.Thread(target=self._receive, daemon=True)
        self._started = False
        self._publish_local(0, initial_weights)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the workers and the receiver, and issue the first admitted requests."""
        for proc in self.workers:
            proc.start()
        self._receiver.start()
        self._started = True
        self._admit()

    def close(self) -> None:
        """Stop the workers (their in-flight batches are abandoned; the journal keeps finished ones)."""
        if not self._started:
            return
        for _ in self.workers:
            self.requests.put(None)
        self._stop.set()
        for proc in self.workers:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        self._receiver.join(timeout=5)
        self._started = False

    # ------------------------------------------------------------------ weights and admission
    def _publish_local(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        self.version = version
        self.ring.publish(version, weights)
        if self.staleness.mode == "fixed_lag":
            self.snapshots[version] = {k: v.detach().clone() for k, v in weights.items()}
            oldest = max(0, version - self.staleness.staleness)
            self.snapshots = {v: w for v, w in self.snapshots.items() if v >= oldest}
        else:
            self.snapshots = {version: {k: v.detach().clone() for k, v in weights.items()}}

    def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Make ``version`` available to workers, then admit the requests it unlocks."""
        self._publish_local(version, weights)
        self._admit()

    def _admit(self) -> None:
        while self.buffer.can_request(self.version):
            prompts = batch_prompts(self.pool, self.spec.seed, self.next_request, self.spec.rollout.prompts_per_batch)
            group = self.spec.rollout.group_size
            admitted = self.buffer.admit(self.version, [p for p in prompts for _ in range(group)])
            if len(admitted) != self.batch_size:
                raise RuntimeError(f"admission split batch {self.next_request}: {len(admitted)} of {self.batch_size}")
            if self.next_request in self.prefetched:  # finished before a crash: journaled, not regenerated
                self._accept(self.prefetched.pop(self.next_request))
            else:
                self._request(self.next_request)
            self.next_request += 1

    def _request(self, index: int) -> None:
        wanted = source_version(index, self.staleness.staleness) if self.staleness.mode == "fixed_lag" else None
        self.requests.put((index, wanted))

    # ------------------------------------------------------------------ results
    def _journal_path(self, index: int) -> Path:
        assert self.journal is not None
        return self.journal / f"batch_{index:08d}.pt"

    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                kind, payload = self.results.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if kind == "error":
                self._error = str(payload)
                continue
            batch = _decode(payload)
            if self.journal is not None:
                tmp = self._journal_path(batch.index).with_suffix(".tmp")
                tmp.write_bytes(payload)
                os.replace(tmp, self._journal_path(batch.index))
            self._accept(batch)

    def _accept(self, batch: GeneratedBatch) -> None:
        with self._lock:
            if batch.index < self.next_put or batch.index in self.pending:
                return  # already have it (restored from the journal and generated again)
            self.pending[batch.index] = batch
            while self.next_put in self.pending:
                ready = self.pending.pop(self.next_put)
                self.generate_s[ready.index] = ready.generate_s
                self.batch_info[ready.index] = ready.info
                self.buffer.put(ready.trajectories)
                if ready.rejected:  # dropped by dynamic sampling: clear their admitted prompts, counted
                    self.buffer.record_drop("rejected", len(ready.rejected), ready.rejected)
                self.next_put += 1

    def next_batch(self, step: int) -> tuple[GeneratedBatch, float]:
        """Batch ``step`` (blocking) and the seconds the trainer waited for it."""
        start = time.perf_counter()
        while True:
            if self._error is not None:
                raise RuntimeError(f"a rollout worker failed:\n{self._error}")
            trajectories = self.buffer.wait_batch(step, timeout_s=_POLL_S)
            if trajectories is not None:
                break
            if self._started and not any(p.is_alive() for p in self.workers):
                raise RuntimeError("every rollout worker has exited; see the error above")
        waited = time.perf_counter() - start
        version = min(t.min_version for t in trajectories)
        info = self.batch_info.pop(step, {})
        return GeneratedBatch(step, version, trajectories, self.generate_s.pop(step, 0.0), info), waited

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, object]:
        with self._lock:
            return {
                "snapshots": self.snapshots,
                "version": self.version,
                "next_request": self.next_request,
                "next_put": self.next_put,
                "buffer": self.buffer.state_dict(),
            }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore before :meth:`start`: weights, buffer, journaled batches; re-request the rest."""
        if self._started:
            raise RuntimeError("load_state_dict must run before start()")
        snapshots: dict[int, dict[str, torch.Tensor]] = dict(state["snapshots"])  # type: ignore[call-overload]
        for version in sorted(snapshots):
            self.ring.publish(version, snapshots[version])
        self.snapshots = snapshots
        self.version = int(state["version"])  # type: ignore[call-overload]
        self.buffer.load_state_dict(state["buffer"])  # type: ignore[arg-type]
        self.buffer.take_requeued()  # regenerated below by batch index (same prompts, same seeds)
        self.next_put = int(state["next_put"])  # type: ignore[call-overload]
        requested = int(state["next_request"])  # type: ignore[call-overload]
        if self.journal is not None:
            for path in sorted(self.journal.glob("batch_*.pt")):
                index = int(path.stem.split("_")[1])
                if index < self.next_put:
                    continue  # consumed or held by the checkpointed buffer already
                self.restored += 1
                batch = _decode(path.read_bytes())
                if index < requested:
                    self._accept(batch)
                else:  # requested after the checkpoint: handed over when admission reaches it
                    self.prefetched[index] = batch
        for index in range(self.next_put, requested):
            if index not in self.pending:
                self._request(index)
        self.next_request = requested

    def prune_journal(self, consumed_before: int) -> None:
        """Delete journaled batches ``< consumed_before`` (a checkpoint at that step covers them)."""
        if self.journal is None:
            return
        for path in self.journal.glob("batch_*.pt"):
            if int(path.stem.split("_")[1]) < consumed_before:
                path.unlink(missing_ok=True)
