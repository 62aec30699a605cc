"""Rollout worker processes and their transport: shared-memory weights, one pipe per worker, deaths.

This module moves requests, weights and batches between the trainer and worker processes; it decides
nothing. Which batch a worker is asked for, and what happens when one dies, is the driver's policy
(:mod:`copc.runtime.async_local`); a Ray driver can reuse that policy over another transport.

- **Weight ring** (:class:`WeightRing`): ``R`` slots of shared-memory tensors, each tagged with the
  version it holds (``-1`` while being written). The trainer (the only writer) publishes version ``v``
  into slot ``v mod R``; a worker copies a slot and reads its tag before and after the copy (a
  seqlock): a torn or overwritten read is detected and retried. There is no lock, so a worker killed in
  the middle of a read cannot block the trainer. ``R`` is the driver's choice
  (:func:`copc.runtime.async_local.ring_slots`: ``s + 2`` keeps every version a ``fixed_lag`` request can
  still ask for; 3 when workers only read the newest). The copy a worker reads is dropped as soon as its
  generator has loaded it, so a worker holds one set of weights between batches.
- **Workers** (``forkserver`` start method: fresh processes like ``spawn``, forked from a server that
  imported torch and copc once): each builds its generator, then serves requests ``(j, version)`` from
  its own duplex pipe and sends back ``("ok", batch bytes)`` or ``("error", traceback)``. With partial
  rollouts (``WorkerSpec.partial_chunk_tokens``) a worker also reads the ring's newest version between
  decode chunks of the batch it is generating (:func:`newest_weights`).
- **Dying with the trainer.** A worker exits by itself (``os._exit``, whatever its main thread is doing,
  a blocked pipe write included) as soon as the trainer is gone: a watchdog thread waits on a pipe whose
  write end only the trainer holds (EOF when it dies) and checks the trainer's pid. Its request pipe has
  a single reader, the trainer, so a write to a dead trainer fails with ``EPIPE`` instead of blocking.
  ``PR_SET_PDEATHSIG`` (Linux) kills it if the fork server dies first. Once the workers are gone the
  fork server sees EOF on its own liveness pipe and exits, and so does the resource tracker.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import multiprocessing.context
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Protocol, runtime_checkable

import torch
import torch.multiprocessing as mp

from copc.rollout.generator import RolloutConfig, RolloutGenerator
from copc.runtime.buffer import encode_batch

__all__ = [
    "ReportsActivity", "Transport", "TransportFactory", "WeightRing", "WeightStore", "WorkerEvent",
    "WorkerPool",
    "WorkerSpec", "WorkerStartError", "build_generator", "local_transport", "newest_weights", "process_gone",
]

#: Modules the fork server imports once; every worker forks from it with them loaded (torch, transformers
#: and the tasks take 5-15 s to import on a busy 2-core machine).
_PRELOAD = ["copc.runtime.workers", "copc.models", "copc.tasks", "copc.rollout.episode"]
_WATCHDOG_S = 0.5
_PR_SET_PDEATHSIG = 1


def _context() -> multiprocessing.context.ForkServerContext:
    """``forkserver``: each worker is a fresh process as with ``spawn`` (nothing inherited from the
    trainer: no threads, no CUDA state), but forked from a server that has already imported the heavy
    modules, so starting a worker costs milliseconds after the first one."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


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
    nice: int = 0
    """Niceness the worker process adds to itself (``os.nice``; its tool subprocesses inherit it, and the
    sandbox gives its cpu cgroup the same weight, ``tools/sandbox/cgroups.py``)."""
    device: str = "cpu"
    """Where the worker's generator runs (``cuda`` for a Ray actor given a GPU)."""

    partial_chunk_tokens: int | None = None
    """Partial rollouts: pick up the newest published weights every this many decode steps and at turn
    boundaries, inside the running batch (0 = turn boundaries only); None = one version per batch."""


def build_generator(spec: WorkerSpec) -> RolloutGenerator:
    """The worker's generator: policy (architecture and tokenizer of ``spec.model_path``), task and tools."""
    torch.set_num_threads(spec.num_threads)
    if spec.nice:
        os.nice(spec.nice)
    from transformers.utils import logging as hf_logging

    from copc.models import load_policy
    from copc.tasks import get_task

    hf_logging.disable_progress_bar()
    model, tokenizer = load_policy(spec.model_path, device=spec.device)
    task = get_task(spec.task, **spec.task_options)  # type: ignore[arg-type]
    return RolloutGenerator(model, tokenizer, task, spec.rollout, seed=spec.seed)


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

    def _views(self, slot: int) -> dict[str, torch.Tensor]:
        views = {}
        for name, key, shape, offset in self.layout:
            numel = int(torch.Size(shape).numel())
            views[name] = self.buffers[slot][key][offset : offset + numel].view(shape)
        return views

    def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Write ``version`` into its slot (single writer: the trainer)."""
        slot = version % len(self.buffers)
        self.tags[slot] = -1
        for name, view in self._views(slot).items():
            view.copy_(weights[name])
        self.tags[slot] = version
        self.latest.value = max(self.latest.value, version)

    def read(self, version: int | None, *, timeout_s: float = 60.0) -> tuple[int, dict[str, torch.Tensor]]:
        """A private copy of ``version`` (None = the newest) and its tag (seqlock: retried if torn)."""
        deadline = time.monotonic() + timeout_s
        while True:
            wanted = self.latest.value if version is None else version
            slot = wanted % len(self.buffers)
            before = self.tags[slot]
            if wanted < 0 or (before != wanted and before != -1):
                raise RuntimeError(
                    f"weights of version {wanted} are not in the ring (slot holds {before}); "
                    "the ring is too small for this staleness"
                )
            if before == wanted:
                copy = {k: v.clone() for k, v in self._views(slot).items()}
                if self.tags[slot] == wanted:
                    return wanted, copy
            if time.monotonic() > deadline:
                raise RuntimeError(f"weights of version {wanted} stayed mid-write for {timeout_s:.0f} s")
            time.sleep(0.001)


# ------------------------------------------------------------------------------ the worker process
def newest_weights(ring: WeightRing, generator: RolloutGenerator, *, limit: int) -> Callable[[], bool]:
    """A partial-rollout refresh: load the ring's newest version into ``generator`` if it is newer.

    ``limit`` is the batch index: batch ``j`` is consumed by step ``j``, which trains version ``j``, so a
    newer version cannot exist before it is consumed; the cap keeps a bookkeeping error from stamping a
    token with a version newer than the step that trains on it.
    """

    def refresh() -> bool:
        latest = min(int(ring.latest.value), limit)
        if latest <= generator.version:
            return False
        version, weights = ring.read(latest)
        generator.load(weights, version)
        return True

    return refresh


def process_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (absent, or a zombie nobody has reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):  # no procfs: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def _watch_trainer(trainer_alive: Connection, trainer_pid: int) -> None:
    """Daemon thread: ``os._exit`` the worker once the trainer is gone (module docstring)."""

    def watch() -> None:
        while True:
            try:
                if trainer_alive.poll(_WATCHDOG_S):  # readable = EOF: the trainer's end is closed
                    os._exit(0)
            except (OSError, EOFError):
                os._exit(0)
            if process_gone(trainer_pid):
                os._exit(0)

    threading.Thread(target=watch, name="copc-trainer-watchdog", daemon=True).start()


def _die_with_parent() -> None:
    """``PR_SET_PDEATHSIG = SIGKILL`` (Linux; elsewhere the watchdog alone does the job)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _worker_main(spec: WorkerSpec, ring: WeightRing, conn: Connection, trainer_alive: Connection,
                 trainer_pid: int) -> None:
    """Worker process: build a generator, then serve ``(batch_index, version | None)`` requests.

    A ``None`` request ends it. Any exception is sent to the trainer as ``("error", traceback)``; a hard
    crash (segfault) prints its traceback to stderr through :mod:`faulthandler`.
    """
    _die_with_parent()
    _watch_trainer(trainer_alive, trainer_pid)
    faulthandler.enable()
    try:
        generator = build_generator(spec)
        while True:
            message = conn.recv()
            if message is None:
                return
            index, wanted = message
            version, weights = ring.read(wanted)
            generator.load(weights, version)
            del weights  # the generator's model holds them now: no second copy while generating
            if spec.partial_chunk_tokens is None:
                batch = generator.generate(index)
            else:
                refresh = newest_weights(ring, generator, limit=index)
                batch = generator.generate(index, refresh=refresh, chunk_tokens=spec.partial_chunk_tokens)
            conn.send(("ok", encode_batch(batch)))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        os._exit(0)  # the trainer is gone: nobody to report to
    except Exception:  # a worker failure must reach the trainer, never hang it
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))


# ------------------------------------------------------------------------------ the trainer's side
class WorkerStartError(RuntimeError):
    """A rollout worker could not be started (its fork server is gone): no restart can help."""


@dataclass(frozen=True)
class WorkerEvent:
    """Something a worker did: sent a batch (``payload``) or died (``error``: its traceback or exit)."""

    slot: int
    payload: bytes | None = None
    error: str | None = None


def describe_exit(code: int | None) -> str:
    """``exit code 3`` / ``killed by SIGKILL`` / ``still running``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class WorkerPool:
    """``num_workers`` worker processes, each with its own pipe; started, restarted and stopped here.

    :meth:`wait` returns what happened since the last call (batches received, deaths); which batch to
    send where, and whether to restart a dead worker, is the caller's decision.
    """

    def __init__(self, spec: WorkerSpec, ring: WeightRing, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.spec, self.ring = spec, ring
        self._ctx = _context()
        self._alive_r, self._alive_w = self._ctx.Pipe(duplex=False)
        self.procs: list[multiprocessing.process.BaseProcess | None] = [None] * num_workers
        self.conns: list[Connection | None] = [None] * num_workers
        self.started_at: list[float] = [0.0] * num_workers
        """``time.monotonic()`` at each slot's last (re)start."""

    def __len__(self) -> int:
        return len(self.procs)

    def start(self, slot: int) -> None:
        """Start (or restart) the worker of ``slot``."""
        self._drop(slot)
        mine, theirs = self._ctx.Pipe(duplex=True)
        for attempt in (1, 2):
            proc = self._ctx.Process(
                target=_worker_main, args=(self.spec, self.ring, theirs, self._alive_r, os.getpid()),
                daemon=True,
                name=f"copc-rollout-{slot}",
            )
            try:
                proc.start()
                break
            except (OSError, EOFError) as exc:  # the fork server that starts workers is gone
                if attempt == 2:
                    mine.close()
                    theirs.close()
                    raise WorkerStartError(
                        f"rollout worker {slot} cannot be started: the worker fork server (the process that "
                        f"starts every rollout worker) is gone ({type(exc).__name__}: {exc})"
                    ) from None
                # multiprocessing starts a new fork server once the dead one is reaped: one more try
                time.sleep(0.5)
        theirs.close()  # the worker holds the only other end: its writes fail at once if we die
        self.procs[slot], self.conns[slot] = proc, mine
        self.started_at[slot] = time.monotonic()

    def send(self, slot: int, index: int, version: int | None) -> bool:
        """Ask ``slot`` for batch ``index`` sampled by ``version`` (None = newest); False if it is dead."""
        conn = self.conns[slot]
        if conn is None:
            return False
        try:
            conn.send((index, version))
        except OSError:
            return False
        return True

    def wait(self, timeout_s: float) -> list[WorkerEvent]:
        """Batches and deaths of the next ``timeout_s`` seconds (returns early on the first event)."""
        handles: dict[object, int] = {}
        for slot, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True)):
            if proc is not None and conn is not None:
                handles[conn] = slot
                handles[proc.sentinel] = slot
        if not handles:
            time.sleep(timeout_s)
            return []
        events: list[WorkerEvent] = []
        seen: set[int] = set()
        for ready in wait(list(handles), timeout=timeout_s):  # type: ignore[arg-type]
            slot = handles[ready]
            if slot in seen:
                continue
            seen.add(slot)
            events.append(self._read(slot))
        return [e for e in events if e.payload is not None or e.error is not None]

    def _read(self, slot: int) -> WorkerEvent:
        conn, proc = self.conns[slot], self.procs[slot]
        assert conn is not None and proc is not None
        try:
            if conn.poll():
                kind, body = conn.recv()
                if kind == "ok":
                    return WorkerEvent(slot, payload=body)
                self._drop(slot)
                return WorkerEvent(slot, error=str(body))
        except (EOFError, OSError) as err:
            proc.join(timeout=5)
            self._drop(slot)
            return WorkerEvent(slot, error=f"its pipe broke ({type(err).__name__}); "
                                           f"{describe_exit(proc.exitcode)}")
        if not proc.is_alive():
            proc.join(timeout=5)
            code = proc.exitcode
            self._drop(slot)
            return WorkerEvent(slot, error=f"it died ({describe_exit(code)}) without reporting an error")
        return WorkerEvent(slot)

    def pid(self, slot: int) -> int | None:
        proc = self.procs[slot]
        return proc.pid if proc is not None else None

    def activity(self, slot: int) -> tuple[float, bool] | None:
        """(CPU seconds the worker of ``slot`` and its process tree have used, whether the worker is
        stopped, e.g. by SIGSTOP), read from ``/proc``; None when it has no live process or /proc cannot
        tell. The tree counts: a worker waiting on its tool sandbox (its fork server, a child) is busy."""
        pid = self.pid(slot)
        if pid is None:
            return None
        tick = os.sysconf("SC_CLK_TCK")
        total, stopped, todo = 0.0, False, [pid]
        while todo:
            current = todo.pop()
            try:
                with open(f"/proc/{current}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
                total += sum(int(v) for v in fields[11:15]) / tick  # utime stime cutime cstime
                stopped = stopped or (current == pid and fields[0] in ("T", "t"))
                for task in os.listdir(f"/proc/{current}/task"):
                    with open(f"/proc/{current}/task/{task}/children") as handle:
                        todo += [int(c) for c in handle.read().split()]
            except (OSError, IndexError, ValueError):
                if current == pid:
                    return None
        return total, stopped

    def started(self, slot: int) -> bool:
        """Whether ``slot`` has a worker (it may have died since: :meth:`wait` reports that)."""
        return self.procs[slot] is not None

    def _drop(self, slot: int) -> None:
        proc, conn = self.procs[slot], self.conns[slot]
        if conn is not None:
            conn.close()
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
        self.procs[slot], self.conns[slot] = None, None

    def close(self) -> None:
        """Ask every worker to stop, then kill what is left; nothing survives this call."""
        for conn in self.conns:
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send(None)
        deadline = time.monotonic() + 5
        for proc in self.procs:
            if proc is not None:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for slot in range(len(self.procs)):
            self._drop(slot)
        self._alive_w.close()
        self._alive_r.close()


# ------------------------------------------------------------------------------ the transport seam
class WeightStore(Protocol):
    """Where the trainer publishes versioned weights for the workers (:class:`WeightRing` here)."""

    def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> None: ...


@runtime_checkable
class ReportsActivity(Protocol):
    """A transport that can tell whether a worker is making progress (:class:`WorkerPool`; not Ray's)."""

    def activity(self, slot: int) -> tuple[float, bool] | None: ...

    def pid(self, slot: int) -> int | None: ...


class Transport(Protocol):
    """What the async driver's policy asks of its workers (:class:`WorkerPool` here; a Ray pool in
    :mod:`copc.runtime.ray_workers`): start or restart a slot, send it a request, report batches and
    deaths."""

    def __len__(self) -> int: ...

    def start(self, slot: int) -> None: ...

    def started(self, slot: int) -> bool: ...

    def send(self, slot: int, index: int, version: int | None) -> bool: ...

    def wait(self, timeout_s: float) -> list[WorkerEvent]: ...

    def close(self) -> None: ...


#: ``(spec, initial weights, weight slots, num_workers) -> (weights, workers)``; nothing started yet.
TransportFactory = Callable[[WorkerSpec, Mapping[str, torch.Tensor], int, int], tuple[WeightStore, Transport]]


def local_transport(
    spec: WorkerSpec, initial_weights: Mapping[str, torch.Tensor], slots: int, num_workers: int
) -> tuple[WeightRing, WorkerPool]:
    """Worker processes on this machine, weights in a shared-memory ring of ``slots`` versions."""
    ring = WeightRing(initial_weights, slots=slots)
    return ring, WorkerPool(spec, ring, num_workers)
