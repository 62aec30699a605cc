"""The critic's config (penalty, value clipping, aggregation, schedule) and the value-loss dispatch.

:class:`CriticConfig` names a registered penalty (mse, huber); :func:`value_loss` runs it on one
(micro-)batch through :func:`copc.ops.value_losses.clipped_value_loss`. The config and the registry
live together here, so building a config always validates against the full registry. Re-exported by
:mod:`copc.channels`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from copc.config import check_one_of
from copc.ops import LOSS_AGG_MODES, AggSpec, LossAgg, ValueLossOutput, clipped_value_loss
from copc.registry import Registry

__all__ = ["VALUE_LOSSES", "CriticConfig", "ValueInputs", "ValueLossResult", "value_loss"]

ValueLossResult = ValueLossOutput


class ValueInputs(NamedTuple):
    """One (micro-)batch for the critic loss: tensors ``[B, T]``, counts global over the minibatch."""

    #: float V(s_t) of the critic being trained, carries the gradient.
    values: torch.Tensor
    #: float pre-update V(s_t), detached: the value clip's centre (may be None only when ``clip_eps`` is
    #: None).
    values_old: torch.Tensor | None
    #: float critic targets.
    returns: torch.Tensor
    #: bool, True on the tokens that enter the loss.
    action_mask: torch.Tensor
    #: the GLOBAL action-token count of the minibatch; None = this micro-batch's own count.
    num_tokens: torch.Tensor | float | None
    #: the GLOBAL count of sequences with at least one action token (seq-* aggregations).
    num_seqs: torch.Tensor | float | None = None


VALUE_LOSSES: Registry[Callable[[CriticConfig, ValueInputs], ValueLossOutput]] = Registry("value loss")


@dataclass(frozen=True)
class CriticConfig:
    """Critic loss and schedule (docs/formulas.md#ppo, #r0, #hyper-parameters)."""

    loss: str = "mse"
    """Registered penalty: mse (1/2 d^2) or huber."""
    clip_eps: float | None = 0.5
    """PPO value clipping eps_v around the pre-update values (verl, BRACE 0.5); None = off."""
    huber_delta: float = 1.0
    """Huber threshold (loss = huber)."""
    loss_agg: LossAgg = "token-mean"
    """Aggregation over all policy tokens (never masked by the policy channel)."""
    updates_per_step: int = 1
    """K_critic: critic epochs per training step (SAO 2)."""
    warmup_steps: int = 0
    """Steps at the start of training that update only the critic (BRACE 5, SAO 10)."""

    def __post_init__(self) -> None:
        VALUE_LOSSES.check(self.loss, field="critic.loss")
        if self.clip_eps is not None and not self.clip_eps >= 0:
            raise ValueError(f"critic.clip_eps must be >= 0 (e.g. 0.5) or None, got {self.clip_eps}")
        if not (self.huber_delta > 0 and math.isfinite(self.huber_delta)):
            raise ValueError(f"critic.huber_delta must be a finite number > 0, got {self.huber_delta}")
        check_one_of("critic.loss_agg", self.loss_agg, LOSS_AGG_MODES)
        if self.updates_per_step < 1:
            raise ValueError(f"critic.updates_per_step must be >= 1, got {self.updates_per_step}")
        if self.warmup_steps < 0:
            raise ValueError(f"critic.warmup_steps must be >= 0, got {self.warmup_steps}")


def _value_penalty(kind: Literal["mse", "huber"]) -> Callable[[CriticConfig, ValueInputs], ValueLossOutput]:
    def run(cfg: CriticConfig, x: ValueInputs) -> ValueLossOutput:
        return clipped_value_loss(
            x.values, x.values_old, x.returns, x.action_mask, clip_eps=cfg.clip_eps, kind=kind,
            huber_delta=cfg.huber_delta, agg=AggSpec(cfg.loss_agg, x.num_tokens, x.num_seqs),
        )

    return run


VALUE_LOSSES.add("mse", _value_penalty("mse"))
VALUE_LOSSES.add("huber", _value_penalty("huber"))


def value_loss(cfg: CriticConfig, inputs: ValueInputs) -> ValueLossResult:
    """The critic loss of ``cfg`` on one (micro-)batch (:class:`ValueInputs`)."""
    return VALUE_LOSSES.get(cfg.loss)(cfg, inputs)
