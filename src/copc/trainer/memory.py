"""Memory of the training process: where it goes (phase peaks) and activation recomputation.

**Gradient checkpointing** (``trainer.gradient_checkpointing``): a Hugging Face model keeps, for its
backward pass, every layer's activations of the rows in a forward; for a real model they outweigh the
logits (SmolLM2-135M, 2 rows of 1000 tokens: about 2.5 GiB with SDPA attention). With checkpointing each
layer's are recomputed in the backward pass from its input (``torch.utils.checkpoint``, non-reentrant):
the gradients are the same, computed again in the same order, at about one more forward of time.
``auto`` turns it on for models of at least :data:`CHECKPOINTING_MIN_PARAMS` parameters (the critic
follows its own size) and leaves small models, whose activations are small, as they are.

**Phase peaks** (metrics ``memory/peak_<phase>``).

The kernel keeps one high-water mark of a process's resident set (``VmHWM`` in ``/proc/self/status``)
and lets the process reset it to the current RSS (``5`` written to ``/proc/self/clear_refs``). Reading
the mark at the end of a phase and resetting it there gives the peak of that phase alone; what runs
between phases (start-up and model loading, evaluation, checkpoints, logging) is read when the next
phase begins and reported as ``memory/peak_other``. So a step's metrics say where its memory goes:

- ``batch``: getting the step's batch (generation, in process, under the sync driver; a wait under the
  async one, whose workers are other processes);
- ``prepare``: the no-grad forwards (``old``, reference, values) and the advantage channel;
- ``critic`` / ``actor``: the critic's and the actor's updates (forward, backward, optimizer);
- ``publish``: the finiteness check and the weights' hand-over;
- ``other``: everything since the previous step's last phase;
- ``memory/peak``: the largest of these, the process's peak over the step (``other`` included).

All in GiB. Only this process is measured (rollout workers and the sandbox are their own processes:
``benchmarks/real_model_memory.py`` adds up the tree). The reset changes what ``getrusage`` reports as
the process's ``ru_maxrss``; nothing else reads it. Where ``/proc/self/clear_refs`` cannot be written
(not Linux, a restricted container) nothing is measured and no metric is emitted.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from copc import tracking as m

__all__ = ["CHECKPOINTING_MIN_PARAMS", "PEAKS", "PhasePeaks", "use_gradient_checkpointing"]

#: ``trainer.gradient_checkpointing=auto`` turns it on for models of at least this many parameters.
CHECKPOINTING_MIN_PARAMS = 50_000_000

_GIB = 2.0**20  # VmHWM is in KiB


def _read_hwm_kib() -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


class PhasePeaks:
    """The phase peaks of this process since the last :meth:`take` (module docstring)."""

    def __init__(self) -> None:
        self.enabled: bool | None = None  # decided on first use
        self._peaks: dict[str, float] = {}
        self._active: str | None = None

    def _start(self) -> bool:
        if self.enabled is None:
            start_up = _read_hwm_kib()  # the peak so far (imports, model loading): the first `other`
            self.enabled = start_up is not None and _reset_hwm()
            if self.enabled and start_up is not None:
                self._peaks["other"] = start_up / _GIB
        return self.enabled

    def _record(self, name: str) -> None:
        hwm = _read_hwm_kib()
        if hwm is not None:
            self._peaks[name] = max(self._peaks.get(name, 0.0), hwm / _GIB)
        _reset_hwm()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute the memory peak inside the block to ``name`` (phases do not nest)."""
        if self._active is not None or not self._start():
            yield
            return
        self._record("other")
        self._active = name
        try:
            yield
        finally:
            self._record(name)
            self._active = None

    def take(self) -> dict[str, float]:
        """The metrics of the phases since the last call (``memory/peak_<phase>`` and ``memory/peak``),
        cleared."""
        if not self._peaks:
            return {}
        out = {f"{m.MEMORY_PEAK}_{name}": peak for name, peak in self._peaks.items()}
        out[m.MEMORY_PEAK] = max(self._peaks.values())
        self._peaks = {}
        return out


#: The process's tracker: the high-water mark is one per process, so there is one tracker per process.
PEAKS = PhasePeaks()


def use_gradient_checkpointing(model: nn.Module | None, setting: str) -> bool:
    """Turn on activation recomputation in ``model`` (a Hugging Face model, or copc's critic with its
    ``backbone``) when ``setting`` says so (always; auto and a model of at least CHECKPOINTING_MIN_PARAMS
    parameters); True when it is on. A model without Hugging Face's switch is left alone (False)."""
    if model is None or setting == "never":
        return False
    target: Any = getattr(model, "backbone", model)
    if not getattr(target, "supports_gradient_checkpointing", False):
        return False
    if setting == "auto" and sum(p.numel() for p in model.parameters()) < CHECKPOINTING_MIN_PARAMS:
        return False
    if hasattr(target, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        target.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return True

