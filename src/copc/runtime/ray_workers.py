"""Rollout workers as Ray actors: the async driver's transport across machines (``driver.kind=ray``).

The driver's policy (admission, assignment, restarts, journal, checkpoint and resume) is
:class:`~copc.runtime.async_local.AsyncSource`, unchanged; this module only moves weights, requests and
batches, like :mod:`copc.runtime.workers` does for local processes. ``ray`` is imported here only, when a
Ray driver is built (``pip install 'copc[ray]'``).

- **Actors** (:class:`RolloutWorker`): each builds its own generator from the
  :class:`~copc.runtime.workers.WorkerSpec` (policy architecture, task, tools), on the CPUs and GPUs of
  ``driver.ray_cpus_per_worker`` / ``driver.ray_gpus_per_worker`` (as many torch threads as whole CPUs;
  a GPU actor generates on ``cuda``). A
  request is one actor call ``generate(batch index, version, weights ref)``; it returns the batch encoded
  (:func:`~copc.runtime.buffer.encode_batch`), the same bytes the local workers send and the journal keeps.
- **Weights** (:class:`RayWeights`): each published version is put into the object store once
  (``ray.put`` of ``{"version", "weights"}``); the newest ``slots`` versions are kept, as the local ring
  does. An actor fetches a version only when it is not the one it already samples with, so each actor
  reads each version it uses once.
- **Deaths**: an actor killed (``ray.kill``, SIGKILL of its process, its node lost) or whose call raised
  makes its pending call fail; :meth:`RayWorkerPool.wait` reports that as the slot's error, and the
  policy restarts the slot (a new actor) and requests the batch again. Actors are created with
  ``max_restarts=0``: restarting is the policy's decision, counted in ``runtime/worker_restarts``. An
  idle actor's death is seen too: each actor holds one call that never returns (:meth:`RolloutWorker.watch`,
  on its second thread), and it fails when the actor dies.
- **The cluster**: ``driver.address`` None starts a local Ray with this machine's CPUs (shut down when the
  driver closes); ``auto`` or ``host:port`` connects to a running cluster (``ray start --head``). A Ray
  already initialised in this process (a test fixture, a notebook) is used as it is and left running.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from copc.config import ConfigError
from copc.runtime.buffer import encode_batch
from copc.runtime.workers import TransportFactory, WorkerEvent, WorkerSpec, build_generator

__all__ = ["RayOptions", "RayWeights", "RayWorkerPool", "RolloutWorker", "check_resources", "connect",
           "ray_transport"]


def _ray() -> Any:
    """The ``ray`` module, imported on first use (never at copc import time)."""
    try:
        import ray
    except ImportError:
        raise ImportError("driver.kind=ray needs Ray: pip install 'copc[ray]'") from None
    return ray


@dataclass(frozen=True)
class RayOptions:
    """Where the actors run and what each one reserves (``driver.address`` / ``driver.ray_*``)."""

    address: str | None = None
    """None: start a local Ray with this machine's CPUs; ``auto`` or ``host:port``: join that cluster."""
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0


def connect(address: str | None) -> bool:
    """Initialise Ray for this process (module docstring); True when this call started it."""
    ray = _ray()
    if ray.is_initialized():
        return False
    if address is None:
        # "local": a new instance even where a `ray start` cluster runs on this machine (plain init would join
        # it)
        ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False)
    else:
        ray.init(address=address)
    return True


class RolloutWorker:
    """One rollout actor: its generator, and the weight versions it fetched (one fetch per version)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.generator = build_generator(spec)
        self.fetched: list[int] = []

    def pid(self) -> int:
        return os.getpid()

    def watch(self) -> None:
        """Never returns: the driver holds this call to learn of the actor's death (module docstring)."""
        threading.Event().wait()

    def fetched_versions(self) -> list[int]:
        return list(self.fetched)

    def generate(self, index: int, version: int, weights: list[Any]) -> bytes:
        """Batch ``index`` sampled by ``version``; ``weights[0]`` is that version's object ref (in a list,
        so Ray passes the ref instead of fetching the weights for every call)."""
        if version != self.generator.version:
            tagged = _ray().get(weights[0])
            if int(tagged["version"]) != version:
                raise RuntimeError(f"the object store gave weights of version {tagged['version']}, not "
                                   f"{version}")
            self.generator.load(tagged["weights"], version)
            self.fetched.append(version)
        return encode_batch(self.generator.generate(index))


class RayWeights:
    """Published weights as object refs, one ``ray.put`` per version; the newest ``slots`` versions kept."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.refs: dict[int, Any] = {}
        self.latest = -1
        self._lock = threading.Lock()

    def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        ref = _ray().put({"version": version, "weights": {k: v.detach().cpu() for k, v in weights.items()}})
        with self._lock:
            self.refs[version] = ref
            self.latest = max(self.latest, version)
            self.refs = {v: r for v, r in self.refs.items() if v > self.latest - self.slots}

    def get(self, version: int | None) -> tuple[int, Any]:
        """``(version, ref)`` of ``version`` (None = the newest)."""
        with self._lock:
            wanted = self.latest if version is None else version
            if wanted not in self.refs:
                raise RuntimeError(
                    f"weights of version {wanted} are no longer published (kept: {sorted(self.refs)}); "
                    "the store is too small for this staleness"
                )
            return wanted, self.refs[wanted]

    def clear(self) -> None:
        with self._lock:
            self.refs = {}


class RayWorkerPool:
    """``num_workers`` :class:`RolloutWorker` actors, one call in flight each (the policy's decision)."""

    def __init__(self, spec: WorkerSpec, weights: RayWeights, num_workers: int, options: RayOptions,
                 *, owns_ray: bool = False) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        ray = _ray()
        self.spec = replace(spec, num_threads=max(1, int(options.cpus_per_worker)),
                            device="cuda" if options.gpus_per_worker > 0 else spec.device)
        self.weights, self.options, self.owns_ray = weights, options, owns_ray
        self._actor_class = ray.remote(RolloutWorker)
        self.actors: list[Any | None] = [None] * num_workers
        self.names: list[str | None] = [None] * num_workers
        self._pid_refs: list[Any | None] = [None] * num_workers
        self._watches: dict[int, Any] = {}  # slot -> its actor's watch call (fails when the actor dies)
        self._calls: dict[int, Any] = {}  # slot -> its call in flight
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.actors)

    def start(self, slot: int) -> None:
        """Start (or restart) the actor of ``slot`` (a new actor; the old one is killed)."""
        self._drop(slot)
        name = f"RolloutWorker-{slot}-{uuid.uuid4().hex[:8]}"
        actor = self._actor_class.options(
            name=name, num_cpus=self.options.cpus_per_worker, num_gpus=self.options.gpus_per_worker,
            max_restarts=0, max_task_retries=0, max_concurrency=2,  # generate + watch
        ).remote(self.spec)
        with self._lock:
            self.actors[slot], self.names[slot] = actor, name
            self._pid_refs[slot] = actor.pid.remote()  # queued first: answered as soon as the actor is built
            self._watches[slot] = actor.watch.remote()

    def started(self, slot: int) -> bool:
        return self.actors[slot] is not None

    def send(self, slot: int, index: int, version: int | None) -> bool:
        """Call ``generate`` on ``slot``'s actor (None = the newest version now); False if it has none."""
        with self._lock:
            actor = self.actors[slot]
            if actor is None:
                return False
            resolved, ref = self.weights.get(version)
            self._calls[slot] = actor.generate.remote(index, resolved, [ref])
        return True

    def wait(self, timeout_s: float) -> list[WorkerEvent]:
        """Batches and deaths of the next ``timeout_s`` seconds (returns early on the first event)."""
        ray = _ray()
        with self._lock:
            calls, watches = dict(self._calls), dict(self._watches)
        refs = [*calls.values(), *watches.values()]
        if not refs:
            time.sleep(timeout_s)
            return []
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout_s)
        if not ready:
            return []
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        events = []
        for slot, ref in calls.items():
            with self._lock:
                if ref not in ready or self._calls.get(slot) != ref:
                    continue  # not finished, or the slot was restarted meanwhile: not its call any more
                del self._calls[slot]
            events.append(self._result(slot, ref))
        for slot, ref in watches.items():
            with self._lock:
                if ref not in ready or self._watches.get(slot) != ref:
                    continue
            events.append(self._result(slot, ref))  # a watch only returns by failing: the actor died
        return events

    def _result(self, slot: int, ref: Any) -> WorkerEvent:
        ray = _ray()
        try:
            payload = ray.get(ref)
            if not isinstance(payload, bytes):
                raise RuntimeError(f"rollout actor {slot} returned {type(payload).__name__}, not batch bytes")
            return WorkerEvent(slot, payload=payload)
        except ray.exceptions.RayTaskError as err:  # generate raised: its traceback
            self._drop(slot)
            return WorkerEvent(slot, error=str(err))
        # the actor died (killed, crashed, node lost) or lost the result
        except ray.exceptions.RayError as err:
            self._drop(slot)
            return WorkerEvent(slot, error=f"its actor died ({type(err).__name__}): {err}")

    def pid(self, slot: int, timeout_s: float = 0.0) -> int | None:
        """The process id of ``slot``'s actor once it has been built (waits up to ``timeout_s``), else
        None."""
        ref = self._pid_refs[slot]
        if ref is None:
            return None
        ray = _ray()
        ready, _ = ray.wait([ref], timeout=timeout_s)
        if not ready:
            return None
        try:
            return int(ray.get(ref))
        except ray.exceptions.RayError:
            return None

    def _drop(self, slot: int) -> None:
        with self._lock:
            actor = self.actors[slot]
            self.actors[slot], self.names[slot], self._pid_refs[slot] = None, None, None
            self._calls.pop(slot, None)
            self._watches.pop(slot, None)
        if actor is not None:
            ray = _ray()
            with contextlib.suppress(ray.exceptions.RayError, ValueError):  # already gone
                ray.kill(actor, no_restart=True)

    def close(self) -> None:
        """Kill every actor (in-flight calls are abandoned) and wait up to 10 s until Ray reports them dead;
        shut Ray down if this driver started it."""
        with self._lock:
            watches = list(self._watches.values())
        for slot in range(len(self.actors)):
            self._drop(slot)
        if watches:
            _ray().wait(watches, num_returns=len(watches), timeout=10)
        self.weights.clear()
        if self.owns_ray:
            _ray().shutdown()


def check_resources(num_workers: int, options: RayOptions, *, owns_ray: bool) -> None:
    """Refuse (a local Ray copc started) or warn about (a cluster, which an autoscaler may grow) actors the
    cluster cannot place: such an actor never starts, and the batch it is given blocks the run."""
    total = _ray().cluster_resources()
    for key, what, per, option in (("CPU", "CPUs", options.cpus_per_worker, "driver.ray_cpus_per_worker"),
                                   ("GPU", "GPUs", options.gpus_per_worker, "driver.ray_gpus_per_worker")):
        need, have = num_workers * per, float(total.get(key, 0.0))
        if need <= have + 1e-9:
            continue
        problem = (f"driver.num_workers={num_workers} x {option}={per:g} needs {need:g} {what}, "
                   f"but the Ray cluster has {have:g}")
        if owns_ray:
            raise ConfigError(f"{problem}: lower one of them, or join a larger cluster (driver.address)")
        print(f"warning: {problem}; the actors that do not fit wait until it has room (an autoscaler may add "
              f"it), and so do their batches", file=sys.stderr, flush=True)


def ray_transport(options: RayOptions) -> TransportFactory:
    """The :class:`~copc.runtime.async_local.AsyncSource` transport of Ray actors (connects to Ray now)."""

    def build(spec: WorkerSpec, initial_weights: Mapping[str, torch.Tensor], slots: int,
              num_workers: int) -> tuple[RayWeights, RayWorkerPool]:
        owns = connect(options.address)
        try:
            check_resources(num_workers, options, owns_ray=owns)
        except ConfigError:
            _ray().shutdown()  # the local Ray this call started
            raise
        weights = RayWeights(slots)
        return weights, RayWorkerPool(spec, weights, num_workers, options, owns_ray=owns)

    return build
