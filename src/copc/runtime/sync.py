"""The synchronous driver: generate batch ``j`` with the current weights, then train on it.

**Which version samples batch j.** ``fixed_lag``: exactly ``max(0, j - s)`` (docs/formulas.md#staleness; the
warm start samples the first ``s + 1`` batches). ``bounded``: the newest weights when generation starts.
The synchronous driver has no concurrency: under ``fixed_lag`` it *simulates* the lag by keeping the
last ``s + 1`` weight versions and sampling batch ``j`` with version ``max(0, j - s)`` (identical data
to the async driver, see :mod:`copc.rollout.generator` for why); under ``bounded`` it samples with the
current weights (lag 0 <= s).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from copc.rollout.generator import GeneratedBatch, RolloutGenerator, sampler_weights
from copc.runtime.staleness import StalenessConfig
from copc.trainer.weight_files import Weights

__all__ = ["SyncSource"]


class SyncSource:
    """The synchronous driver's batch source: batch ``j`` is generated when step ``j`` asks for it.

    Args:
        generator: the in-process rollout generator.
        staleness: ``fixed_lag`` simulates a lag of exactly ``s`` by sampling with the weights of
            version ``max(0, j - s)``; ``bounded`` samples with the current weights.
    """

    #: generation runs inside ``next_batch``: the wait has no limit of its own.
    batch_timeout_s: float | None = None

    def __init__(self, generator: RolloutGenerator, staleness: StalenessConfig) -> None:
        self.generator, self.staleness = generator, staleness
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.version = 0

    def publish(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Record version ``version`` (keep the snapshots a future fixed_lag batch still needs)."""
        self.version = version
        self.snapshots[version] = sampler_weights(weights, self.generator.dtype, copy=True)
        keep = self._needed_versions(version)
        self.snapshots = {v: w for v, w in self.snapshots.items() if v in keep}

    def _needed_versions(self, version: int) -> set[int]:
        return set(range(self.staleness.oldest_needed(version), version + 1))

    def _sampling_version(self, batch_index: int) -> int:
        wanted = self.staleness.wanted_version(batch_index)
        return self.version if wanted is None else wanted

    def next_batch(self, step: int) -> tuple[GeneratedBatch, float]:
        """Batch ``step`` and the seconds spent waiting for it (0: it is generated right here)."""
        version = self._sampling_version(step)
        if version not in self.snapshots:
            raise RuntimeError(f"batch {step} needs weights of version {version}, which were not kept")
        self.generator.load(self.snapshots[version], version)
        return self.generator.generate(step), 0.0

    def state_dict(self) -> dict[str, object]:
        return {"snapshots": {version: Weights(w) for version, w in self.snapshots.items()},
                "version": self.version}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self.snapshots = dict(state["snapshots"])  # type: ignore[call-overload]
        self.version = int(state["version"])  # type: ignore[call-overload]

    def metrics(self) -> dict[str, float]:
        """No counters: every batch is generated in process, nothing is buffered or dropped."""
        return {}

    def start(self) -> None:
        """Nothing runs in the background."""

    def checkpointed(self, state: Mapping[str, object]) -> None:
        """No journal: a checkpoint covers nothing kept here."""

    def counters(self) -> dict[str, int]:
        return {"restored_batches": 0, "worker_restarts": 0, "journal_damaged": 0}

    def close(self) -> None:
        """Nothing runs in the background."""
