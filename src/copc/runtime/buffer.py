"""The trajectory buffer between rollout workers and the trainer, governed by a staleness policy.

Two paths. **Whole batches** (the async driver): :meth:`TrajectoryBuffer.put_batch` stores generated
batch ``j`` and :meth:`TrajectoryBuffer.take_batch` hands step ``j`` exactly that batch, whatever its
size (a generator that filters groups returns fewer than ``B``) and including trajectories without a
sampled token (counted in ``buffer/empty_kept``), so a step never waits for a trajectory that will not
come and groups are never split. **Single trajectories**: producers call :meth:`TrajectoryBuffer.put`
and the trainer :meth:`TrajectoryBuffer.get_batch` (``None`` = not ready yet, wait) or
:meth:`wait_batch`, which select ``B`` by the policy rules, the pure functions of
:mod:`copc.runtime.staleness`:

- ``fixed_lag``: trajectories are grouped by version (``min_t v_t``); step ``n`` takes ``B`` of version
  ``max(0, n - s)`` in arrival order. Trajectories of a version no later step can consume are counted
  as dropped (``unscheduled``), never removed silently.
- ``bounded``: step ``n`` takes the ``B`` oldest (smallest ``min_t v_t``, then arrival); nothing is
  dropped for age. A trajectory consumed with lag ``n - min_t v_t > s`` (it finished late) is counted
  in ``over_bound``, and its lag shows in the realized staleness.

With ``staleness.filter=pace`` (bounded), :meth:`TrajectoryBuffer.take_batch` rejects the stalest whole
groups of the batch it hands out when the pool is overfull (:func:`~copc.runtime.staleness.pace_select`,
budget from :func:`~copc.runtime.staleness.pace_budget`); they are counted in ``buffer/dropped_pace`` and
``staleness/pace_rejected`` and their prompts are not generated again (admission is unchanged).

Generation pacing (bounded admission, ``floor(N_r/B) <= i + s``) goes through :meth:`admit`, which
also records the admitted prompts as *in flight* until their trajectory arrives, so a checkpoint holds
both the stored trajectories and the prompts still being generated (:meth:`state_dict`). After
:meth:`load_state_dict`, the prompts that were in flight are handed back by :meth:`take_requeued`
(and counted in ``requeued``) so the driver generates them again: no prompt is lost on resume.

Data order is arrival order within the policy's ordering; a driver that needs bit-for-bit
reproducibility (fixed_lag sweeps, async s=0 == sync) must put trajectories in a deterministic order.

Thread-safe: every method takes one lock; :meth:`wait_batch` sleeps on a condition notified by
:meth:`put`.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from copc import tracking as m
from copc.rollout.generator import GeneratedBatch
from copc.runtime.staleness import (
    StalenessConfig,
    admits_request,
    effective_staleness,
    eligible,
    expired,
    pace_budget,
    pace_select,
    request_capacity,
)
from copc.types import Prompt, StopReason, Trajectory

#: Reasons a trajectory can leave the buffer other than being consumed; each one is a counter.
DROP_REASONS: tuple[str, ...] = ("unscheduled", "empty", "rejected", "timeout", "error", "pace")


@dataclass
class _Entry:
    seq: int  # arrival order, unique and increasing
    version: int  # min_t v_t over sampled tokens (the batch's version when none were sampled)
    trajectory: Trajectory
    batch: int = -1  # the generated batch it belongs to (put_batch), -1 = put one by one


class TrajectoryBuffer:
    """Stores finished trajectories and hands the trainer batches that the staleness policy allows.

    Args:
        config: the staleness policy (mode and ``s``).
        batch_size: ``B``, trajectories per training step (used by admission control).
    """

    def __init__(self, config: StalenessConfig, batch_size: int) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        self.config = config
        self.batch_size = batch_size
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._entries: list[_Entry] = []
        self._next_seq = 0
        self._in_flight: list[Prompt] = []
        self._requeued: list[Prompt] = []
        self._num_requested = 0
        self._consumed = 0
        self._over_bound = 0
        self._dropped: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        self._requeued_total = 0
        self._empty_kept = 0
        self._pace_last: dict[str, float] = {}  # the last step's PACE figures (staleness/pace_* metrics)

    # ----------------------------------------------------------------------------------- producers
    def admit(self, version: int, prompts: Sequence[Prompt]) -> list[Prompt]:
        """Admit the longest prefix of ``prompts`` that admission control allows at ``version``.

        Each admitted prompt is one generation request (one trajectory; submit a prompt ``G`` times
        for a group of ``G``) and stays *in flight* until :meth:`put` receives a trajectory with its id.
        """
        with self._lock:
            room = request_capacity(
                version=version,
                batch_size=self.batch_size,
                num_requested=self._num_requested,
                staleness=self.config.staleness,
            )
            admitted = list(prompts[:room])
            self._num_requested += len(admitted)
            self._in_flight.extend(admitted)
            return admitted

    def can_request(self, version: int) -> bool:
        """Whether one more generation request would be admitted at ``version`` (no side effect)."""
        with self._lock:
            return admits_request(
                version=version,
                batch_size=self.batch_size,
                num_requested=self._num_requested,
                staleness=self.config.staleness,
            )

    def put(self, trajectories: Iterable[Trajectory]) -> None:
        """Store finished trajectories; each clears one in-flight request with the same prompt id."""
        with self._lock:
            for traj in trajectories:
                self._clear_in_flight(traj.prompt_id)
                version = traj.min_version
                if version < 0:
                    self._dropped["empty"] += 1  # nothing sampled: no token to train on
                    continue
                self._entries.append(_Entry(self._next_seq, version, traj))
                self._next_seq += 1
            self._ready.notify_all()

    def put_batch(
        self, index: int, version: int, trajectories: Sequence[Trajectory], *, requests: Sequence[Prompt] = ()
    ) -> None:
        """Store generated batch ``index`` whole, for :meth:`take_batch` (the async driver's path).

        Every trajectory is kept, also one without a sampled token (a prompt that fills the context):
        it is filed under the batch's ``version`` and counted in ``buffer/empty_kept``; the trainer
        sees it as a row without action tokens. The batch may hold any number of trajectories (a
        generator that filters groups returns fewer). ``requests`` are the generation requests admitted
        for this batch: each clears one in-flight entry, whatever the generator kept.
        """
        with self._lock:
            for prompt in requests:
                self._clear_in_flight(prompt.id)
            for traj in trajectories:
                if traj.min_version < 0:
                    self._empty_kept += 1
                filed = traj.min_version if traj.min_version >= 0 else version
                self._entries.append(_Entry(self._next_seq, filed, traj, batch=index))
                self._next_seq += 1
            self._ready.notify_all()

    def take_batch(self, step: int, *, timeout_s: float = 0.0) -> list[Trajectory] | None:
        """The trajectories of batch ``step`` (stored by :meth:`put_batch`), or None after ``timeout_s``.

        Step ``n`` consumes batch ``n`` whole, so a batch of any size is one step and groups are never
        split. Under ``fixed_lag`` its version must be ``max(0, n - s)`` (a driver bug otherwise);
        under ``bounded`` a lag above ``s`` is counted in ``buffer/over_bound``.
        """
        deadline = time.monotonic() + timeout_s
        with self._ready:
            while True:
                chosen = [e for e in self._entries if e.batch == step]
                if chosen:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._ready.wait(timeout=remaining)
            mode, s = self.config.mode, self.config.staleness
            for e in chosen:
                if self.config.fixed_lag and not eligible(mode, step=step, staleness=s,
                                                          min_version=e.version):
                    raise RuntimeError(
                        f"batch {step} was sampled by version {e.version}, but fixed_lag s={s} needs "
                        f"version {step - s if step > s else 0}: the driver requested it wrongly"
                    )
            if self.config.filter == "pace":
                chosen = self._pace_filter(step, chosen)
            self._entries = [e for e in self._entries if e.batch != step]
            self._consumed += len(chosen)
            self._over_bound += sum(1 for e in chosen if step - e.version > s)
            return [e.trajectory for e in chosen]

    def _pace_filter(self, step: int, chosen: list[_Entry]) -> list[_Entry]:
        """Batch ``step`` without the groups PACE rejects (module docstring; caller holds the lock)."""
        pace = self.config.pace
        scores = [effective_staleness(e.trajectory, step, gen_weight=pace.gen_weight, filed_version=e.version)
                  for e in chosen]
        groups: dict[int, list[int]] = {}  # group id -> positions in chosen, in first-appearance order
        for i, e in enumerate(chosen):
            groups.setdefault(e.trajectory.group, []).append(i)
        members = list(groups.values())
        budget = pace_budget(pool=len(self._entries), target=pace.target_batches * self.batch_size,
                             batch=len(chosen), gain=pace.gain, max_reject_frac=pace.max_reject_frac)
        rejected = pace_select([sum(scores[i] for i in g) / len(g) for g in members],
                               [len(g) for g in members],
                               budget=budget, min_score=pace.min_score)
        out = {i for k in rejected for i in members[k]}
        self._dropped["pace"] += len(out)
        self._pace_last = {
            m.STALENESS_PACE_REJECT_RATE: len(out) / len(chosen),
            m.STALENESS_PACE_BUDGET: float(budget),
            m.STALENESS_PACE_POOL: float(len(self._entries)),
            m.STALENESS_PACE_SCORE_MEAN: sum(scores) / len(scores),
        }
        return [e for i, e in enumerate(chosen) if i not in out]

    def record_drop(self, reason: str, count: int = 1, prompts: Sequence[Prompt] = ()) -> None:
        """Count trajectories a producer discarded (``rejected``, ``timeout``, ``error``) and clear
        their in-flight prompts; the counters show up in :meth:`metrics`, so no drop is silent."""
        if reason not in self._dropped:
            raise ValueError(f"unknown drop reason {reason!r}; use one of {', '.join(DROP_REASONS)}")
        with self._lock:
            self._dropped[reason] += count
            for prompt in prompts:
                self._clear_in_flight(prompt.id)

    def take_requeued(self) -> list[Prompt]:
        """Prompts that were in flight at the checkpoint we resumed from: generate them again first.

        They were already counted as requested, so re-submitting them does not go through :meth:`admit`
        again; they are in flight again from now on.
        """
        with self._lock:
            prompts, self._requeued = self._requeued, []
            self._in_flight.extend(prompts)
            return prompts

    def _clear_in_flight(self, prompt_id: str) -> None:
        for i, prompt in enumerate(self._in_flight):
            if prompt.id == prompt_id:
                del self._in_flight[i]
                return

    # ------------------------------------------------------------------------------------- trainer
    def get_batch(self, step: int, batch_size: int | None = None) -> list[Trajectory] | None:
        """The trajectories training step ``step`` consumes, or ``None`` if not enough are stored yet.

        Args:
            step: ``n``, the trainer version the batch is consumed at (0-based step index).
            batch_size: ``B`` (defaults to the buffer's).
        """
        with self._lock:
            return self._take(step, batch_size or self.batch_size)

    def wait_batch(
        self, step: int, batch_size: int | None = None, timeout_s: float | None = None
    ) -> list[Trajectory] | None:
        """Like :meth:`get_batch`, but waits up to ``timeout_s`` (None = forever) for a producer."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._ready:
            while True:
                batch = self._take(step, batch_size or self.batch_size)
                if batch is not None:
                    return batch
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._ready.wait(timeout=remaining)

    def _take(self, step: int, batch_size: int) -> list[Trajectory] | None:
        mode, s = self.config.mode, self.config.staleness
        kept = [e for e in self._entries if not expired(mode, step=step, staleness=s, min_version=e.version)]
        self._dropped["unscheduled"] += len(self._entries) - len(kept)
        self._entries = kept
        candidates = [
            e for e in self._entries if eligible(mode, step=step, staleness=s, min_version=e.version)
        ]
        if len(candidates) < batch_size:
            return None
        chosen = sorted(candidates, key=lambda e: (e.version, e.seq))[:batch_size]
        if self.config.fixed_lag:
            chosen.sort(key=lambda e: e.seq)
        taken = {e.seq for e in chosen}
        self._entries = [e for e in self._entries if e.seq not in taken]
        self._consumed += len(chosen)
        self._over_bound += sum(1 for e in chosen if step - e.version > s)
        return [e.trajectory for e in chosen]

    # ------------------------------------------------------------------------------------ metrics
    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def num_requested(self) -> int:
        with self._lock:
            return self._num_requested

    def in_flight(self) -> list[Prompt]:
        """Prompts admitted whose trajectory has not arrived yet (a copy)."""
        with self._lock:
            return list(self._in_flight)

    def metrics(self) -> dict[str, float]:
        """Counters under the ``buffer/`` namespace (cumulative since the run started)."""
        with self._lock:
            out = {
                m.BUFFER_SIZE: float(len(self._entries)),
                m.BUFFER_IN_FLIGHT: float(len(self._in_flight)),
                m.BUFFER_CONSUMED: float(self._consumed),
                m.BUFFER_OVER_BOUND: float(self._over_bound),
                m.BUFFER_REQUEUED: float(self._requeued_total),
                m.BUFFER_DROPPED: float(sum(self._dropped.values())),
                m.BUFFER_EMPTY_KEPT: float(self._empty_kept),
            }
            out.update({f"buffer/dropped_{k}": float(v) for k, v in self._dropped.items()})
            if self.config.filter == "pace":
                out[m.STALENESS_PACE_REJECTED] = float(self._dropped["pace"])
                out.update(self._pace_last)
            return out

    # --------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, object]:
        """Everything needed to resume: stored trajectories (in order), in-flight prompts, counters.

        Holds only tensors, str, int, float, bool, lists and dicts (loadable with
        ``torch.load(weights_only=True)``).
        """
        with self._lock:
            return {
                "entries": [
                    {"seq": e.seq, "batch": e.batch, "version": e.version,
                     "trajectory": trajectory_to_dict(e.trajectory)}
                    for e in self._entries
                ],
                "next_seq": self._next_seq,
                "in_flight": [prompt_to_dict(p) for p in self._in_flight + self._requeued],
                "num_requested": self._num_requested,
                "consumed": self._consumed,
                "over_bound": self._over_bound,
                "dropped": dict(self._dropped),
                "requeued_total": self._requeued_total,
                "empty_kept": self._empty_kept,
            }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore from :meth:`state_dict`; in-flight prompts become requeued (see :meth:`take_requeued`)."""
        with self._lock:
            entries = [_as_dict(d) for d in _as_list(state["entries"])]
            self._entries = []
            for entry in entries:
                traj = trajectory_from_dict(_as_dict(entry["trajectory"]))
                version = int(_num(entry.get("version", traj.min_version)))
                batch = int(_num(entry.get("batch", -1)))
                self._entries.append(_Entry(int(_num(entry["seq"])), version, traj, batch=batch))
            self._next_seq = int(_num(state["next_seq"]))
            self._requeued = [prompt_from_dict(_as_dict(p)) for p in _as_list(state["in_flight"])]
            self._in_flight = []
            self._num_requested = int(_num(state["num_requested"]))
            self._consumed = int(_num(state["consumed"]))
            self._over_bound = int(_num(state["over_bound"]))
            dropped = _as_dict(state["dropped"])
            self._dropped = {k: int(_num(dropped.get(k, 0))) for k in DROP_REASONS}
            self._requeued_total = int(_num(state["requeued_total"])) + len(self._requeued)
            self._empty_kept = int(_num(state.get("empty_kept", 0)))
            self._ready.notify_all()


# ---------------------------------------------------------------------------- plain-data records
_TENSOR_FIELDS = ("token_ids", "action_mask", "logp_behav", "policy_version", "token_rewards")


def trajectory_to_dict(traj: Trajectory) -> dict[str, object]:
    """A :class:`Trajectory` as plain data (tensors cloned, enum as its value)."""
    out: dict[str, object] = {name: getattr(traj, name).detach().clone() for name in _TENSOR_FIELDS}
    out.update(
        prompt_id=traj.prompt_id,
        prompt_len=traj.prompt_len,
        reward=float(traj.reward),
        stop_reason=traj.stop_reason.value,
        info={k: float(v) for k, v in traj.info.items()},
        group=traj.group,
    )
    return out


def trajectory_from_dict(data: Mapping[str, object]) -> Trajectory:
    """Inverse of :func:`trajectory_to_dict`."""
    tensors = {name: data[name] for name in _TENSOR_FIELDS}
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"trajectory record field {name!r} must be a tensor, got {type(value).__name__}")
    return Trajectory(
        prompt_id=str(data["prompt_id"]),
        prompt_len=int(_num(data["prompt_len"])),
        reward=float(_num(data["reward"])),
        stop_reason=StopReason(str(data["stop_reason"])),
        info={str(k): float(_num(v)) for k, v in _as_dict(data["info"]).items()},
        group=int(_num(data["group"])),
        **tensors,  # type: ignore[arg-type]
    )


def prompt_to_dict(prompt: Prompt) -> dict[str, object]:
    return {"id": prompt.id, "text": prompt.text, "answers": list(prompt.answers), "meta": dict(prompt.meta)}


def prompt_from_dict(data: Mapping[str, object]) -> Prompt:
    meta = _as_dict(data.get("meta", {}))
    return Prompt(
        id=str(data["id"]),
        text=str(data["text"]),
        answers=tuple(str(a) for a in _as_list(data["answers"])),
        meta={str(k): v for k, v in meta.items() if isinstance(v, (str, int, float))},
    )


def _as_list(value: object) -> list[object]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"buffer state: expected a list, got {type(value).__name__}")
    return list(value)


def _as_dict(value: object) -> dict[str, object]:
    if not isinstance(value, Mapping):
        raise ValueError(f"buffer state: expected a mapping, got {type(value).__name__}")
    return dict(value)


def _num(value: object) -> float | int:
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise ValueError(f"buffer state: expected a number, got {value!r}")


# -------------------------------------------------------------- a generated batch as bytes (pipes, journal)
def encode_batch(batch: GeneratedBatch) -> bytes:
    """A generated batch as bytes (``torch.save`` of plain data; loadable with ``weights_only``)."""
    buf = io.BytesIO()
    torch.save(
        {
            "index": batch.index,
            "version": batch.version,
            "generate_s": batch.generate_s,
            "info": dict(batch.info),
            "trajectories": [trajectory_to_dict(t) for t in batch.trajectories],
            "rejected": [prompt_to_dict(p) for p in batch.rejected],
        },
        buf,
    )
    return buf.getvalue()


def decode_batch(payload: bytes) -> GeneratedBatch:
    """Inverse of :func:`encode_batch`."""
    data = torch.load(io.BytesIO(payload), weights_only=True)
    return GeneratedBatch(
        index=int(data["index"]),
        version=int(data["version"]),
        trajectories=[trajectory_from_dict(d) for d in data["trajectories"]],
        generate_s=float(data["generate_s"]),
        info={str(k): float(v) for k, v in dict(data.get("info", {})).items()},
        rejected=[prompt_from_dict(p) for p in data.get("rejected", [])],
    )
