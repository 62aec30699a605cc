"""Where a step's proximal ("old") log-probs come from: ``trainer.proximal`` (docs/algorithms.md, "Proximal
sources").

Notation as in :mod:`copc.trainer.trainer`: ``n`` = the trainer's version at the step start (the weights
after ``n`` updates, which the driver published as version ``n``), ``v_t`` = ``policy_version`` of token
``t`` (the version that sampled it), ``mu`` = behaviour log-probs, ``cur`` = the policy being optimised.

- ``recompute`` (default): ``old_t = log pi_n(a_t | s_t)``, one no-grad forward of the step-start policy.
- ``snapshot``: ``old_t = log pi_{v_t}(a_t | s_t)``, the exact training-side log-prob of each token's own
  behaviour version (the trainer keeps the weights of the recent versions, :class:`SnapshotStore`): one
  forward per distinct version of the batch over the rows that hold it. With staleness 0 it is
  ``recompute``. It separates the training-inference discrepancy (``old - mu``, ~0 here where sampler and
  trainer are the same float32 model) from the policy change since sampling (``cur - old`` in the clip).
- ``ewma``: PPO-EWMA (Hilton et al. 2021, "Batch size-invariance for policy optimization"): the proximal
  policy is a bias-corrected exponential moving average of the policy weights,
  ``W_k = beta W_{k-1} + 1``, ``theta_bar_k = (beta W_{k-1} theta_bar_{k-1} + theta_k) / W_k`` after every
  actor optimizer step ``k`` (``W_0 = 1``, ``theta_bar_0 = theta_0``; so ``theta_bar_k = sum_j beta^(k-j)
  theta_j / sum_j beta^(k-j)``), and ``old`` = one no-grad forward of ``theta_bar`` at the step start.
  Deviation from the paper: the paper evaluates the EWMA network before every minibatch; here the step-
  start EWMA serves the whole step, because the advantage channel and the step-start mask need ``old``
  before any update (the EWMA still moves after every optimizer step, and carries across steps).
- ``loglinear``: AReaL's A-3PO approximation (areal/trainer/ppo/actor.py,
  ``compute_prox_logp_approximations`` and the prox_approx page of its docs): no forward;
  ``old_t = mu_t + alpha_t (sg(cur_t) - mu_t)`` with ``alpha_t = clamp((v_prox - v_t) / (v_theta - v_t), 0,
  1)`` (0 where ``v_theta = v_t`` or the token was not sampled), ``v_theta = n`` (AReaL's engine version
  during the update) and ``v_prox = n - 1``. So tokens of staleness ``d = n - v_t <= 1`` get ``old = mu`` and
  a token of staleness ``d >= 2`` gets ``alpha = (d - 1) / d``. ``cur`` is the micro-batch's own forward in
  the actor update (as AReaL), so ``old`` moves with the minibatches; methods whose advantage channel
  reads ``log w = old - mu`` at the step start (copc, brace, vtrace) need ``cur`` before any update, which
  costs the one forward ``loglinear`` exists to save (documented there).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from typing import Literal, get_args

import torch
from torch import nn

from copc.ops import zero_where_not

__all__ = [
    "PROXIMAL_SOURCES",
    "EwmaWeights",
    "ProximalSource",
    "SnapshotMissingError",
    "SnapshotStore",
    "ewma_update",
    "loglinear_alpha",
    "loglinear_logp",
    "train_eval_equivalent",
    "weights_nbytes",
]

ProximalSource = Literal["recompute", "snapshot", "ewma", "loglinear"]
PROXIMAL_SOURCES: tuple[str, ...] = get_args(ProximalSource)

StateDict = dict[str, torch.Tensor]


def weights_nbytes(weights: Mapping[str, torch.Tensor]) -> int:
    """Bytes of a state dict's tensors (each counted once, even if two keys share storage)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in weights.values():
        key = (tensor.data_ptr(), tensor.numel())
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


def _clone(weights: Mapping[str, torch.Tensor]) -> StateDict:
    """Detached CPU copies; keys that share storage (tied embeddings) keep sharing it."""
    copies: dict[tuple[int, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
    out: StateDict = {}
    for key, tensor in weights.items():
        ident = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        if ident not in copies:
            copies[ident] = tensor.detach().to("cpu", copy=True)
        out[key] = copies[ident]
    return out


# ---------------------------------------------------------------------------------------- loglinear
def loglinear_alpha(policy_version: torch.Tensor, action_mask: torch.Tensor, *, version: int) -> torch.Tensor:
    """A-3PO's interpolation weight ``alpha_t`` (module docstring), ``[B, T] float32``.

    Args:
        policy_version: ``[B, T] int64``, the version that sampled each token (-1 where none did).
        action_mask: ``[B, T] bool``, True on sampled tokens.
        version: ``n``, the trainer's version at the step start (``v_theta = n``, ``v_prox = n - 1``).
    """
    if policy_version.shape != action_mask.shape:
        raise ValueError(f"policy_version {tuple(policy_version.shape)} and action_mask "
                         f"{tuple(action_mask.shape)} differ")
    v_behav = policy_version.double()
    v_theta, v_prox = float(version), float(version - 1)
    diff = v_theta - v_behav
    live = action_mask & (diff > 0)
    alpha = torch.where(live, (v_prox - v_behav) / torch.where(live, diff, 1.0), 0.0)
    return alpha.clamp(0.0, 1.0).float()


def loglinear_logp(logp_behav: torch.Tensor, logp_cur: torch.Tensor, alpha: torch.Tensor,
                   action_mask: torch.Tensor) -> torch.Tensor:
    """``mu + alpha (sg(cur) - mu)`` on sampled tokens, 0 elsewhere (all ``[b, t] float32``; ``cur``
    detached)."""
    return zero_where_not(action_mask, logp_behav + alpha * (logp_cur.detach().float() - logp_behav))


# ---------------------------------------------------------------------------------------- ewma
@torch.no_grad()
def ewma_update(average: StateDict, weights: Mapping[str, torch.Tensor], *, total: float,
                decay: float) -> float:
    """One bias-corrected EWMA step in place on ``average`` (module docstring); returns the new total ``W_k``.

    ``theta_bar <- (beta W theta_bar + theta) / (beta W + 1)``; floating-point tensors only (integer
    buffers are copied); a tensor that two keys share (tied embeddings) is updated once.
    """
    new_total = decay * total + 1.0
    keep = decay * total / new_total
    done: set[int] = set()
    for key, avg in average.items():
        if avg.data_ptr() in done:
            continue
        done.add(avg.data_ptr())
        value = weights[key].detach().to(avg.device)
        if avg.is_floating_point():
            avg.mul_(keep).add_(value.to(avg.dtype), alpha=1.0 / new_total)
        else:
            avg.copy_(value)
    return new_total


class EwmaWeights:
    """The PPO-EWMA proximal weights and the model that evaluates them (a copy of the policy's module)."""

    def __init__(self, policy: nn.Module, *, decay: float) -> None:
        self.decay = decay
        self.model = copy.deepcopy(policy).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.total = 1.0
        self.updates = 0

    def weights(self) -> StateDict:
        return {k: v for k, v in self.model.state_dict().items()}

    def update(self, policy: nn.Module) -> None:
        self.total = ewma_update(self.weights(), policy.state_dict(), total=self.total, decay=self.decay)
        self.updates += 1

    def state_dict(self) -> dict[str, object]:
        return {"weights": _clone(self.model.state_dict()), "total": self.total, "updates": self.updates}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self.model.load_state_dict(state["weights"])  # type: ignore[arg-type]
        self.total = float(state["total"])  # type: ignore[arg-type]
        self.updates = int(state["updates"])  # type: ignore[call-overload]


# ---------------------------------------------------------------------------------------- snapshot
class SnapshotMissingError(RuntimeError):
    """A token's behaviour version is not in the snapshot store (evicted by the memory bound, or never
    seen)."""


class SnapshotStore:
    """Policy weights by version, the newest that fit in ``max_bytes``, oldest evicted first.

    Holding ``K`` versions serves every batch whose tokens are at most ``K - 1`` versions stale (batch
    ``n`` needs versions ``n - s .. n``); so ``max_bytes >= (s + 1) x`` one version's bytes for
    ``staleness = s``. A token of an evicted version raises :class:`SnapshotMissingError` (one line: the
    version, what the store holds, the bound and the fix); nothing falls back silently.
    """

    def __init__(self, *, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._versions: OrderedDict[int, StateDict] = OrderedDict()
        self._bytes: dict[int, int] = {}
        self.evicted = 0

    @property
    def versions(self) -> tuple[int, ...]:
        return tuple(self._versions)

    @property
    def nbytes(self) -> int:
        return sum(self._bytes.values())

    def add(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Store a copy of ``weights`` as ``version`` (newer than every stored one); evict to the bound."""
        if self._versions and version <= next(reversed(self._versions)):
            raise ValueError(f"snapshot version {version} is not newer than the stored {self.versions[-1]}")
        copied = _clone(weights)
        size = weights_nbytes(copied)
        if size > self.max_bytes:
            raise ValueError(
                f"trainer.proximal_max_bytes={self.max_bytes} cannot hold one policy version ({size} bytes); "
                f"raise it to at least (staleness + 1) x {size}"
            )
        self._versions[version] = copied
        self._bytes[version] = size
        while self.nbytes > self.max_bytes:
            old, _ = self._versions.popitem(last=False)
            del self._bytes[old]
            self.evicted += 1

    def get(self, version: int) -> StateDict:
        if version not in self._versions:
            held = f"{self.versions[0]}..{self.versions[-1]}" if self._versions else "nothing"
            per = max(self._bytes.values(), default=0)
            raise SnapshotMissingError(
                f"trainer.proximal=snapshot: a token of policy version {version} is in the batch but the "
                f"snapshot store holds versions {held} (trainer.proximal_max_bytes={self.max_bytes}, {per} "
                f"bytes per version, so {self.max_bytes // max(per, 1)} versions fit); raise "
                f"proximal_max_bytes to (staleness + "
                f"1) x {per} or lower staleness.staleness"
            )
        return self._versions[version]

    def state_dict(self) -> dict[str, object]:
        return {"max_bytes": self.max_bytes, "evicted": self.evicted,
                "versions": {int(v): dict(w) for v, w in self._versions.items()}}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self._versions.clear()
        self._bytes.clear()
        versions = state["versions"]
        assert isinstance(versions, Mapping)
        for version in sorted(versions):
            self._versions[int(version)] = _clone(versions[version])
            self._bytes[int(version)] = weights_nbytes(self._versions[int(version)])
        self.evicted = int(state.get("evicted", 0))  # type: ignore[call-overload]
        while self.nbytes > self.max_bytes and len(self._versions) > 1:  # a smaller bound after resume
            old, _ = self._versions.popitem(last=False)
            del self._bytes[old]
            self.evicted += 1


# ---------------------------------------------------------------------------------------- reuse check
_DROPOUT_TYPES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                  nn.FeatureAlphaDropout)
_NORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def train_eval_equivalent(model: nn.Module) -> bool:
    """True if a train-mode forward computes what an eval-mode forward does: no dropout with p > 0 (as a
    module or a float ``*dropout*`` attribute, as HF attention layers keep it) and no batch norm."""
    for module in model.modules():
        if isinstance(module, _DROPOUT_TYPES) and module.p > 0:
            return False
        if isinstance(module, _NORM_TYPES):
            return False
        for name, value in vars(module).items():
            if "dropout" in name and isinstance(value, float) and value > 0:
                return False
    return True
