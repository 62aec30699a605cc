"""The lab's two-channel corrections: production's channel configs, run through production's channels.

A :class:`Correction` is a pair of the trainer's own configs, :class:`copc.channels.PolicyChannelConfig`
(any objective of :data:`copc.channels.POLICY_OBJECTIVES`: ppo, bypass_ppo, decoupled, tis, icepop,
copc, dis, pg) and :class:`copc.channels.AdvantageChannelConfig` (any estimator of
:data:`copc.channels.ADVANTAGE_ESTIMATORS` that reads a critic and is not group-normalised: gae,
vtrace, clipped_td, brace). Nothing here re-implements a formula or compares a name: Â is
:func:`copc.channels.compute_advantages` and the policy weight is differentiated from
:func:`copc.channels.policy_loss`, the entry points the trainer calls.

Per-token form of the actor update (docs/formulas.md#two-channels): at the start of a step the trainer's
policy is the proximal one (``cur = old = pi``), so for every objective

    -d l_t / d cur_t = omega_t · Â_t,

which defines the policy weight ``omega_t`` of the channel (``u = 1`` sits inside every PPO clip range;
bypass PPO's ratio ``exp(cur - mu)`` does not, which is its policy-channel error). Every objective is
positively homogeneous in ``Â`` (``l(c·Â) = c·l(Â)`` for ``c > 0``), so ``omega_t`` is the coefficient
computed with the unit advantage ``sign(Â_t)`` (``+1`` where ``Â_t = 0``); a test checks
``omega·Â`` against the coefficient of the loss at the actual ``Â``.

Which config fields matter: one token's coefficient does not depend on the aggregation
(``loss_agg``, ``denominator``, ``norm_length``) or on ``minibatches``; the lab uses the per-token loss.
Whitening (``advantage.whiten``) must be off: it depends on the batch (so the estimator is no longer a
sum over i.i.d. trajectories) and only rescales/shifts ``Â``; the lab studies the unwhitened channels.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from copc import ops
from copc.channels import (
    ADVANTAGE_ESTIMATORS,
    AdvantageChannelConfig,
    PolicyChannelConfig,
    PolicyInputs,
    compute_advantages,
    policy_loss,
)


def _lab_estimator(name: str) -> bool:
    """The lab gives every estimator an exact critic and single i.i.d. trajectories (no groups)."""
    entry = ADVANTAGE_ESTIMATORS.get(name)
    return entry.needs_critic and not entry.group_normalised


LAB_ADVANTAGE_ESTIMATORS: tuple[str, ...] = tuple(n for n in ADVANTAGE_ESTIMATORS.names()
                                                  if _lab_estimator(n))
"""Production estimators the lab can decompose (chosen by the registry's flags, not by name)."""

POLICY_LABEL_FIELDS: Mapping[str, tuple[str, ...]] = {
    "ppo": ("clip_low", "clip_high"),
    "bypass_ppo": ("clip_low", "clip_high", "mask_low", "mask_high"),
    "decoupled": ("weight_cap", "cap_mode"),
    "tis": ("weight_cap",),
    "icepop": ("mask_low", "mask_high", "mask_source"),
    "copc": ("mask_low", "mask_high", "weight_mode"),
    "dis": ("mask_low", "mask_high"),
    "pg": (),
}
"""The :class:`PolicyChannelConfig` fields that shape ``omega`` at ``cur = old``, per production
objective (labels only; a test checks the keys are exactly :data:`POLICY_OBJECTIVES`)."""

ADVANTAGE_LABEL_FIELDS: Mapping[str, tuple[str, ...]] = {
    "gae": ("lam_actor",),
    "vtrace": ("lam_critic", "rho_bar", "c_bar", "pg_rho_bar"),
    "clipped_td": ("ratio_low", "ratio_high", "lam_actor"),
    "brace": ("lam_critic", "rho_bar", "c_bar", "brace_k"),
}
"""The :class:`AdvantageChannelConfig` fields that shape ``Â``, per production estimator the lab runs
(labels only; a test checks the keys are exactly :data:`LAB_ADVANTAGE_ESTIMATORS`)."""


def _fields_label(name: str, config: object, fields: tuple[str, ...]) -> str:
    def show(value: object) -> str:
        return f"{value:g}" if isinstance(value, float) else str(value)

    return f"{name}(" + ", ".join(f"{f}={show(getattr(config, f))}" for f in fields) + ")"


@dataclass(frozen=True)
class Correction:
    """A two-channel correction: the policy weight and the advantage estimator, as the trainer configures
    them."""

    policy: PolicyChannelConfig = field(
        default_factory=lambda: PolicyChannelConfig(objective="copc", mask_low=0.5, mask_high=2.0)
    )
    """Policy channel (omega): any registered objective."""
    advantage: AdvantageChannelConfig = field(
        default_factory=lambda: AdvantageChannelConfig(estimator="clipped_td", whiten=False)
    )
    """Advantage channel (Â): one of :data:`LAB_ADVANTAGE_ESTIMATORS`, with ``whiten=False``."""

    def __post_init__(self) -> None:
        if not _lab_estimator(self.advantage.estimator):
            raise ValueError(
                f"advantage.estimator={self.advantage.estimator!r} needs groups or no critic, which the "
                f"lab's single enumerated trajectories do not have; use one of "
                f"{', '.join(LAB_ADVANTAGE_ESTIMATORS)}"
            )
        if self.advantage.whiten:
            raise ValueError(
                "advantage.whiten=True depends on the batch, so the "
                "lab cannot decompose it exactly; set whiten=False"
            )

    def label(self) -> str:
        p, a = self.policy, self.advantage
        pol = _fields_label(p.objective, p, POLICY_LABEL_FIELDS[p.objective])
        return f"{pol} x {_fields_label(a.estimator, a, ADVANTAGE_LABEL_FIELDS[a.estimator])}"


def advantage_estimates(
    config: AdvantageChannelConfig,
    rewards: torch.Tensor,
    values: torch.Tensor,
    log_rho: torch.Tensor,
    action_mask: torch.Tensor,
) -> torch.Tensor:
    """``Â`` of the advantage channel through :func:`copc.channels.compute_advantages`. ``[B, T] float64``.

    Args:
        rewards: ``[B, T]`` float, terminal reward on the last token.
        values: ``[B, T]`` float, critic value of the state before each token (terminal value 0).
        log_rho: ``[B, T]`` float, ``log pi - log mu`` per token (step-start ratio, ``old = pi``).
        action_mask: ``[B, T]`` bool.
    """
    # The channels take float32 (the trainer's dtype): the lab's figures carry float32 round-off
    # (relative ~1e-7) from this point on.
    out = compute_advantages(
        config, rewards=rewards.float(), values=values.float(), log_w=log_rho.float(), action_mask=action_mask
    )
    return out.advantages.to(torch.float64)


def update_coefficients(
    config: PolicyChannelConfig,
    logp: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
) -> torch.Tensor:
    """``c_t = -d l_t / d cur_t`` of :func:`copc.channels.policy_loss` at ``cur = old``. ``[B, T] float64``.

    ``ĝ = sum_t c_t · grad log pi(a_t|s_t)``: the per-token coefficient of the update direction.
    """
    cur = logp.detach().clone().requires_grad_(True)
    out = policy_loss(config, PolicyInputs(
        logp=cur,
        logp_old=logp.detach(),
        logp_behav=logp_behav.detach(),
        advantages=advantages,
        action_mask=action_mask,
        num_tokens=None,
    ))
    (grad,) = torch.autograd.grad(out.per_token.sum(), cur)
    return (-grad).detach().to(torch.float64)


class ChannelOutputs(NamedTuple):
    """Per-token outputs of the two channels (``[B, T] float64``)."""

    omega: torch.Tensor
    """Policy weight (coefficient at unit advantage of the same sign)."""
    advantages: torch.Tensor
    """Advantage estimate Â."""
    coef: torch.Tensor
    """``omega · Â``: the coefficient of ``grad log pi`` in the update."""


def run_channels(
    correction: Correction,
    rewards: torch.Tensor,
    values: torch.Tensor,
    logp: torch.Tensor,
    logp_behav: torch.Tensor,
) -> ChannelOutputs:
    """Both channels on a ``[B, T]`` batch in which every token is a policy token."""
    mask = torch.ones(logp.shape, dtype=torch.bool)
    log_rho = (logp - logp_behav).detach()
    adv = advantage_estimates(correction.advantage, rewards, values, log_rho, mask)
    unit = torch.where(adv < 0, -torch.ones_like(adv), torch.ones_like(adv))
    omega = update_coefficients(correction.policy, logp, logp_behav, unit, mask) * unit
    return ChannelOutputs(omega=omega, advantages=adv, coef=omega * adv)


CriticTargetRatio = Callable[[AdvantageChannelConfig, torch.Tensor, torch.Tensor], torch.Tensor]
"""``rho(config, w, mask)``: the per-action weight of an estimator's critic target (``[S, K]`` float32)."""

CRITIC_TARGET_RATIOS: Mapping[str, CriticTargetRatio] = {
    "gae": lambda cfg, w, mask: torch.ones_like(w),
    "vtrace": lambda cfg, w, mask: ops.clip_ratio(w, mask, low=0.0, high=cfg.rho_bar),
    "clipped_td": lambda cfg, w, mask: ops.clip_ratio(w, mask, low=cfg.ratio_low, high=cfg.ratio_high),
}
"""Per production estimator, the ``rho`` whose ``pi~ ∝ mu·rho`` has the value a critic regressed on the
estimator's returns converges to (docs/formulas.md#v-trace, #r0); a test checks every key is in
:data:`ADVANTAGE_ESTIMATORS` and that ``V^{pi~}`` zeroes the expected weighted TD residual."""


def critic_target_policy(
    config: AdvantageChannelConfig, pi_logits: torch.Tensor, mu_logits: torch.Tensor
) -> torch.Tensor:
    """Logits of the policy whose value is the fixed point of the channel's own critic target.

    A critic regressed on the channel's returns converges to ``V`` of ``pi~(a|s) ∝ mu(a|s)·rho(a|s)``
    (docs/formulas.md#v-trace and #r0): ``rho = 1`` for GAE (``V^mu``), ``min(rho_bar, w)`` for V-trace,
    ``clip(w, ratio_low, ratio_high)`` for clipped TD (``V^mu`` at eps_A = 0, ``V^pi`` without a clip).
    The clip goes through the ops helpers, treating the ``[S, K]`` table as a ``[B, T]`` batch (float32).

    Args:
        pi_logits, mu_logits: ``[S, K]`` float64 tabular logits.

    Returns: ``[S, K]`` float64 logits ``log mu + log rho`` (softmax normalises them).
    """
    target_ratio = CRITIC_TARGET_RATIOS.get(config.estimator)
    if target_ratio is None:
        raise ValueError(
            f"critic 'fitted' needs the fixed point of the estimator's critic target, known here for "
            f"{', '.join(CRITIC_TARGET_RATIOS)}, not {config.estimator!r}; use critic 'mu' or 'pi'"
        )
    log_mu = torch.log_softmax(mu_logits.detach(), dim=-1)
    log_w = torch.log_softmax(pi_logits.detach(), dim=-1) - log_mu
    mask = torch.ones(log_w.shape, dtype=torch.bool)
    rho = target_ratio(config, ops.ratio_from_log(log_w, mask), mask)
    return log_mu + torch.log(rho.to(torch.float64))
