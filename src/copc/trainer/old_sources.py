"""The proximal ("old") log-prob sources of ``trainer.proximal`` as a registry of small classes, each
owning its ``old`` log-probs, its updates, its state and its metrics (the maths and the stores they keep
are in :mod:`copc.trainer.proximal`; the formulas in docs/algorithms.md, "Proximal sources").
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import nn

from copc import tracking as m
from copc.channels.methods import MethodConfig
from copc.ops import zero_where_not
from copc.registry import Registry
from copc.trainer.batching import TrainBatch
from copc.trainer.common import eval_mode
from copc.trainer.forwards import Forwards
from copc.trainer.proximal import EwmaWeights, SnapshotStore, loglinear_alpha, loglinear_logp

__all__ = [
    "SOURCES",
    "Ewma",
    "Loglinear",
    "LogpFn",
    "OldInputs",
    "OldLogp",
    "OldSource",
    "Recompute",
    "Snapshot",
    "check_proximal_source",
    "make_source",
]

# ---------------------------------------------------------------------------------------- the sources
#: ``logp_fn(model, rows)``: no-grad eval-mode log-probs ``[len(rows), t] float32`` of ``rows``
#: (``[b] int64``), ``t`` trimmed to the rows' longest length (the trainer's forwards).
LogpFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class OldInputs:
    """What a source reads at the step start.

    Attributes:
        batch: the step's rows.
        policy: the policy being trained (its weights are version ``version``).
        version: ``n``, the trainer's version at the step start.
        fwd: the trainer's forwards (the sampler's transform, micro-batches).
        advantage_reads_old: the advantage channel reads ``log w = old - mu`` before any update.
        policy_logp: the step-start policy's log-probs ``[B, T] float32`` and the rows taken from the
            first actor forward (the trainer's ``old_forward_reuse``).
    """

    batch: TrainBatch
    policy: nn.Module
    version: int
    fwd: Forwards
    advantage_reads_old: bool
    policy_logp: Callable[[], tuple[torch.Tensor, int]]


class OldLogp(NamedTuple):
    """A source's step-start answer: ``logp`` ``[B, T] float32`` (0 off the action mask); ``alpha``, A-3PO's
    weights when ``old`` moves with each micro-batch's own forward; rows whose ``old`` is their first actor
    forward."""

    logp: torch.Tensor
    alpha: torch.Tensor | None = None
    reused_rows: int = 0


class OldSource:
    """One ``trainer.proximal`` choice: its ``old`` log-probs, its updates, its state and its metrics.

    Every source is built as ``cls(policy, version=..., decay=..., max_bytes=...)`` (the trainer's config
    values) and registered in :data:`SOURCES`; the trainer never compares source names.
    """

    #: the name in :data:`SOURCES` (and in checkpoints).
    name: ClassVar[str] = ""
    #: ``old`` is not the step-start policy, so only a method that reads ``old`` can use it.
    needs_proximal_method: ClassVar[bool] = True
    #: ``old`` moves with every minibatch (``policy.denominator = kept`` is then undefined).
    moves_per_minibatch: ClassVar[bool] = False

    def __init__(self, policy: nn.Module, *, version: int, decay: float, max_bytes: int) -> None:
        del policy, version, decay, max_bytes

    def old(self, x: OldInputs) -> OldLogp:
        raise NotImplementedError

    def after_actor_update(self, policy: nn.Module) -> None:
        """After every actor optimizer step."""

    def after_step(self, version: int, policy: nn.Module) -> None:
        """After the step (``version`` = the new one)."""

    def metrics(self) -> dict[str, float]:
        return {}

    def payload(self) -> object | None:
        """The source's own checkpoint state (None: it keeps none)."""
        return None

    def restore(self, payload: object | None, policy: nn.Module, *, version: int) -> None:
        """Restore from :meth:`payload`'s value, or start afresh from ``policy`` when it is None."""

    def state_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"source": self.name}
        if (payload := self.payload()) is not None:
            out[self.name] = payload
        return out

    def load_state_dict(self, state: Mapping[str, object] | None, policy: nn.Module, *, version: int) -> None:
        """Restore; a checkpoint without this source's state (older copc, another source) starts it afresh
        from the loaded policy: the EWMA restarts at the current weights, the store holds only ``version``."""
        matches = state is not None and state.get("source") == self.name
        payload = state.get(self.name) if state is not None and matches else None
        self.restore(payload, policy, version=version)


SOURCES: Registry[type[OldSource]] = Registry("proximal source")


def _source(cls: type[OldSource]) -> type[OldSource]:
    return SOURCES.add(cls.name, cls)


def make_source(name: str, policy: nn.Module, *, version: int, decay: float, max_bytes: int) -> OldSource:
    """The source ``trainer.proximal = name`` for ``policy`` at ``version``."""
    return SOURCES.get(name)(policy, version=version, decay=decay, max_bytes=max_bytes)


@_source
class Recompute(OldSource):
    """``old_t = log pi_n(a_t | s_t)``: one no-grad forward of the step-start policy."""

    name = "recompute"
    needs_proximal_method = False

    def old(self, x: OldInputs) -> OldLogp:
        logp, reused = x.policy_logp()
        return OldLogp(zero_where_not(x.batch.action_mask, logp), None, reused)


@_source
class Snapshot(OldSource):
    """``old_t = log pi_{v_t}(a_t | s_t)`` from the stored weights of each token's own version."""

    name = "snapshot"

    def __init__(self, policy: nn.Module, *, version: int, decay: float, max_bytes: int) -> None:
        self.store = SnapshotStore(max_bytes=max_bytes)
        self._scratch: nn.Module | None = None
        self._scratch_version: int | None = None
        self.version_forwards = 0
        self.store.add(version, policy.state_dict())

    def old(self, x: OldInputs) -> OldLogp:
        batch = x.batch
        with eval_mode(x.policy):
            return OldLogp(self.snapshot_logp(
                lambda model, rows: x.fwd.logp(model, batch, rows), x.policy, batch.policy_version,
                batch.action_mask, version=x.version, micro_batch_size=x.fwd.micro_batch_size,
            ))

    def after_step(self, version: int, policy: nn.Module) -> None:
        """The store takes the published weights."""
        self.store.add(version, policy.state_dict())

    @torch.no_grad()
    def snapshot_logp(
        self, logp_fn: LogpFn, policy: nn.Module, policy_version: torch.Tensor, action_mask: torch.Tensor,
        *, version: int, micro_batch_size: int,
    ) -> torch.Tensor:
        """``old_t = log pi_{v_t}(a_t | s_t)`` for every sampled token, ``[B, T] float32`` (0 elsewhere).

        One forward per distinct version over the rows holding a token of it; version ``n`` (the step
        start) runs on ``policy`` itself, others on a scratch copy loaded with the stored weights.
        """
        out = torch.zeros(policy_version.shape, dtype=torch.float32)
        versions = torch.unique(policy_version[action_mask]).tolist()
        self.version_forwards = len(versions)
        for v in versions:
            if v > version:
                raise ValueError(f"a token carries policy version {v} > the trainer's {version}: "
                                 "version tags are wrong upstream")
            model = policy if v == version else self._scratch_at(int(v), policy)
            hit = action_mask & (policy_version == v)
            rows = torch.nonzero(hit.any(dim=-1)).squeeze(1)
            for piece in rows.split(micro_batch_size):
                logp = logp_fn(model, piece).float()
                width = logp.shape[1]
                region = hit[piece, :width]
                out[piece, :width] = torch.where(region, logp, out[piece, :width])
        return out

    def _scratch_at(self, version: int, policy: nn.Module) -> nn.Module:
        weights = self.store.get(version)
        if self._scratch is None:
            self._scratch = copy.deepcopy(policy).eval()
            for p in self._scratch.parameters():
                p.requires_grad_(False)
        if self._scratch_version != version:
            self._scratch.load_state_dict(weights)
            self._scratch_version = version
        return self._scratch

    def metrics(self) -> dict[str, float]:
        return {
            m.PROXIMAL_SNAPSHOT_BYTES: float(self.store.nbytes),
            m.PROXIMAL_SNAPSHOT_VERSIONS: float(len(self.store.versions)),
            m.PROXIMAL_VERSION_FORWARDS: float(self.version_forwards),
        }

    def payload(self) -> object | None:
        return self.store.state_dict()

    def restore(self, payload: object | None, policy: nn.Module, *, version: int) -> None:
        self.store = SnapshotStore(max_bytes=self.store.max_bytes)
        if isinstance(payload, Mapping):
            self.store.load_state_dict(payload)
        if version not in self.store.versions:
            self.store.add(version, policy.state_dict())
        self._scratch_version = None


@_source
class Ewma(OldSource):
    """PPO-EWMA: ``old`` = one no-grad forward of the bias-corrected moving average of the weights."""

    name = "ewma"

    def __init__(self, policy: nn.Module, *, version: int, decay: float, max_bytes: int) -> None:
        self.ewma = EwmaWeights(policy, decay=decay)

    def old(self, x: OldInputs) -> OldLogp:
        logp = x.fwd.full(x.fwd.logp_of(self.ewma.model), x.batch)
        return OldLogp(zero_where_not(x.batch.action_mask, logp))

    def after_actor_update(self, policy: nn.Module) -> None:
        """The EWMA moves after every optimizer step."""
        self.ewma.update(policy)

    def payload(self) -> object | None:
        return self.ewma.state_dict()

    def restore(self, payload: object | None, policy: nn.Module, *, version: int) -> None:
        self.ewma = EwmaWeights(policy, decay=self.ewma.decay)
        if isinstance(payload, Mapping):
            self.ewma.load_state_dict(payload)


@_source
class Loglinear(OldSource):
    """A-3PO: ``old = mu + alpha (sg(cur) - mu)``, no forward of its own."""

    name = "loglinear"
    moves_per_minibatch = True

    def old(self, x: OldInputs) -> OldLogp:
        batch, mask = x.batch, x.batch.action_mask
        alpha = loglinear_alpha(batch.policy_version, mask, version=x.version)
        if not x.advantage_reads_old:
            return OldLogp(batch.logp_behav, alpha)  # the actor loss interpolates with each micro-batch
        with eval_mode(x.policy):
            cur = x.fwd.full(x.fwd.logp_of(x.policy), batch)
        return OldLogp(loglinear_logp(batch.logp_behav, cur, alpha, mask), alpha)


def check_proximal_source(method: MethodConfig, source: str) -> None:
    """Fail with one line unless ``trainer.proximal = source`` fits ``method``: every source but recompute
    needs a method with a proximal policy (``needs_old_forward``); loglinear moves ``old`` with each
    minibatch, so it cannot serve ``policy.denominator = kept``."""
    cls = SOURCES.get(source)
    if cls.needs_proximal_method and not method.needs_old_forward:
        raise ValueError(
            f"trainer.proximal={source} needs a method with a proximal (old) policy; method {method.name!r} "
            "reads only cur and mu: use trainer.proximal=recompute or a method such as copc, areal, "
            "areal_critic, icepop, async_ppo_recompute"
        )
    if cls.moves_per_minibatch and method.policy.denominator == "kept":
        raise ValueError(
            f"trainer.proximal={source} moves old with every minibatch, so policy.denominator='kept' is "
            "undefined; use method_overrides.policy.denominator=all or another trainer.proximal"
        )
