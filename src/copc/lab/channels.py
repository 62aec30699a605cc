"""The two correction channels of the lab, as thin adapters over the trainer's own ``copc.ops``.

Nothing here re-implements a formula: the advantage channel calls ``copc.ops.advantages`` (GAE,
V-trace, COPC clipped TD) and the policy channel differentiates the per-token loss of
``copc.ops.policy_losses`` with autograd. This is the only module of :mod:`copc.lab` that imports them,
so a change of their signatures is fixed in one place.

Per-token form of the actor update (spec 9.2): at the start of a step the trainer's policy is the
proximal one (``cur = old = pi``), so for every loss here

    -d l_t / d cur_t = omega_t · Â_t,

which defines the policy weight ``omega_t`` of the channel (``u = 1`` sits inside every PPO clip range;
bypass PPO's ratio ``exp(cur - mu)`` does not, which is its policy-channel error). Every loss is
positively homogeneous in ``Â`` (``l(c·Â) = c·l(Â)`` for ``c > 0``), so ``omega_t`` is the coefficient
computed with the unit advantage ``sign(Â_t)`` (``+1`` where ``Â_t = 0``); a test checks
``omega·Â`` against the coefficient of the loss at the actual ``Â``.

Whitening of advantages is not applied: it depends on the batch (so the estimator is no longer a sum
over i.i.d. trajectories) and only rescales/shifts ``Â``; the lab studies the unwhitened channels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from copc import ops
from copc.ops import importance

POLICY_CHANNELS: tuple[str, ...] = ("none", "ppo_clip", "mask_band", "masked_is", "decoupled")
ADVANTAGE_CHANNELS: tuple[str, ...] = ("gae", "vtrace", "clipped_td")


@dataclass(frozen=True)
class PolicyChannel:
    """Which per-token weight ``omega_t`` multiplies ``Â_t · grad log pi`` (spec 3, 7, 8, 9.3).

    ``none``: async PPO 3b (ratio against the recomputed old policy; ``omega = 1``).
    ``ppo_clip``: async PPO 3a (clip centred on mu; ``omega = w`` unless the clip is active, then 0).
    ``mask_band``: ``omega = M`` (binary mask, SkyRL style). ``masked_is``: ``omega = M·w`` (COPC,
    IcePop). ``decoupled``: AReaL, ``omega = w·1[w <= cap]``.
    """

    kind: str = "masked_is"
    """One of :data:`POLICY_CHANNELS`."""
    mask_low: float = 0.5
    """Lower edge ``1 - eps_P^-`` of the mask band (``mask_band``, ``masked_is``)."""
    mask_high: float = 2.0
    """Upper edge ``1 + eps_P^+`` of the mask band (``inf`` = no upper edge)."""
    clip_eps: float = 0.2
    """PPO clip eps (both sides) of ``ppo_clip``; inert at ``u = 1`` for the other channels."""
    cap: float = 5.0
    """AReaL's mask cap on ``w`` (``decoupled``; ``inf`` = uncapped)."""

    def __post_init__(self) -> None:
        if self.kind not in POLICY_CHANNELS:
            raise ValueError(f"unknown policy channel {self.kind!r}; valid: {', '.join(POLICY_CHANNELS)}")
        if not 0.0 <= self.mask_low <= 1.0 <= self.mask_high:
            raise ValueError(f"mask band needs 0 <= low <= 1 <= high, got ({self.mask_low}, {self.mask_high})")
        if not 0.0 <= self.clip_eps < 1.0:
            raise ValueError(f"clip_eps must be in [0, 1), got {self.clip_eps}")
        if not self.cap > 0:
            raise ValueError(f"cap must be > 0 (inf disables it), got {self.cap}")


@dataclass(frozen=True)
class AdvantageChannel:
    """How ``Â_t`` is estimated from rewards, critic values and behaviour ratios (spec 2, 4, 9.3).

    ``gae``: stale GAE (no ratio). ``vtrace``: IMPALA ``pg_advantage`` (its ``min(rho_pg, w)`` weight
    is part of ``Â`` here). ``clipped_td``: COPC, residuals weighted by ``clip(w, clip_low, clip_high)``
    (own residual unweighted, trace ``none``, window infinite).
    """

    kind: str = "clipped_td"
    """One of :data:`ADVANTAGE_CHANNELS`."""
    lam: float = 1.0
    """lambda (actor and critic)."""
    clip_low: float = 0.8
    """``1 - eps_A^-`` of ``clipped_td`` (0 = no lower clip)."""
    clip_high: float = 1.2
    """``1 + eps_A^+`` of ``clipped_td`` (``inf`` = no upper clip)."""
    rho_bar: float = 1.0
    """V-trace rho-bar."""
    c_bar: float = 1.0
    """V-trace c-bar."""
    pg_rho_bar: float = 1.0
    """V-trace rho-bar of the policy-gradient advantage."""

    def __post_init__(self) -> None:
        if self.kind not in ADVANTAGE_CHANNELS:
            raise ValueError(
                f"unknown advantage channel {self.kind!r}; valid: {', '.join(ADVANTAGE_CHANNELS)}"
            )
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam must be in [0, 1], got {self.lam}")
        if not 0.0 <= self.clip_low <= 1.0 <= self.clip_high:
            raise ValueError(
                f"advantage clip needs 0 <= low <= 1 <= high, got ({self.clip_low}, {self.clip_high})"
            )
        if min(self.rho_bar, self.c_bar, self.pg_rho_bar) <= 0:
            raise ValueError("V-trace rho_bar, c_bar and pg_rho_bar must be > 0")


@dataclass(frozen=True)
class Correction:
    """A two-channel correction: the policy weight and the advantage estimator."""

    policy: PolicyChannel = PolicyChannel()
    """Policy channel (omega)."""
    advantage: AdvantageChannel = AdvantageChannel()
    """Advantage channel (Â)."""

    def label(self) -> str:
        p, a = self.policy, self.advantage
        pol = {
            "none": "none",
            "ppo_clip": f"ppo_clip(eps={p.clip_eps:g})",
            "mask_band": f"mask_band[{p.mask_low:g},{p.mask_high:g}]",
            "masked_is": f"masked_is[{p.mask_low:g},{p.mask_high:g}]",
            "decoupled": f"decoupled(cap={p.cap:g})",
        }[p.kind]
        adv = {
            "gae": f"gae(lam={a.lam:g})",
            "vtrace": f"vtrace(rho={a.rho_bar:g},c={a.c_bar:g},pg={a.pg_rho_bar:g})",
            "clipped_td": f"clipped_td[{a.clip_low:g},{a.clip_high:g}](lam={a.lam:g})",
        }[a.kind]
        return f"{pol} x {adv}"


def advantage_estimates(
    channel: AdvantageChannel,
    rewards: torch.Tensor,
    values: torch.Tensor,
    log_rho: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    gamma: float,
) -> torch.Tensor:
    """``Â`` of the advantage channel through ``copc.ops.advantages`` (computed in float32). ``[B, T] float64``.

    Args:
        rewards: ``[B, T]`` float, terminal reward on the last token.
        values: ``[B, T]`` float, critic value of the state before each token (terminal value 0).
        log_rho: ``[B, T]`` float, ``log pi - log mu`` per token (step-start ratio).
        action_mask: ``[B, T]`` bool.
    """
    a = channel
    # The advantage ops take float32 (the trainer's dtype): the lab's figures carry float32 round-off
    # (relative ~1e-7) from this point on.
    rewards, values, log_rho = rewards.float(), values.float(), log_rho.float()
    if a.kind == "gae":
        result = ops.gae(rewards, values, action_mask, gamma=gamma, lam=a.lam).advantages
    elif a.kind == "vtrace":
        result = ops.vtrace(
            rewards,
            values,
            log_rho,
            action_mask,
            gamma=gamma,
            lam=a.lam,
            rho_bar=a.rho_bar,
            c_bar=a.c_bar,
            pg_rho_bar=a.pg_rho_bar,
        ).pg_advantages
    else:
        result = ops.clipped_td(
            rewards,
            values,
            log_rho,
            action_mask,
            gamma=gamma,
            lam_critic=a.lam,
            lam_actor=a.lam,
            low=a.clip_low,
            high=a.clip_high,
        ).advantages
    return result.detach().to(torch.float64)


def _per_token_loss(
    channel: PolicyChannel,
    logp: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
) -> torch.Tensor:
    """Per-token actor loss of the channel at ``old = cur`` (``logp`` carries the gradient)."""
    p = channel
    old = logp.detach()
    if p.kind == "none":
        out = ops.ppo_clip_loss(logp, old, advantages, action_mask, clip=ops.ClipSpec(p.clip_eps, p.clip_eps))
    elif p.kind == "ppo_clip":
        out = ops.bypass_ppo_loss(
            logp, logp_behav, advantages, action_mask, clip=ops.ClipSpec(p.clip_eps, p.clip_eps)
        )
    elif p.kind == "decoupled":
        out = ops.decoupled_ppo_loss(logp, old, logp_behav, advantages, action_mask, cap=p.cap)
    else:
        out = ops.copc_policy_loss(
            logp,
            old,
            logp_behav,
            advantages,
            action_mask,
            mask_low=p.mask_low,
            mask_high=p.mask_high,
            weight_mode="binary" if p.kind == "mask_band" else "masked_is",
        )
    return out.per_token


def update_coefficients(
    channel: PolicyChannel,
    logp: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
) -> torch.Tensor:
    """``c_t = -d l_t / d cur_t`` of the channel's ops loss at ``cur = old``. ``[B, T] float64``.

    ``ĝ = sum_t c_t · grad log pi(a_t|s_t)``: the per-token coefficient of the update direction.
    """
    cur = logp.detach().clone().requires_grad_(True)
    per_token = _per_token_loss(channel, cur, logp_behav.detach(), advantages, action_mask)
    (grad,) = torch.autograd.grad(per_token.sum(), cur)
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
    *,
    gamma: float,
) -> ChannelOutputs:
    """Both channels on a ``[B, T]`` batch in which every token is a policy token."""
    mask = torch.ones(logp.shape, dtype=torch.bool)
    log_rho = (logp - logp_behav).detach()
    adv = advantage_estimates(correction.advantage, rewards, values, log_rho, mask, gamma=gamma)
    unit = torch.where(adv < 0, -torch.ones_like(adv), torch.ones_like(adv))
    omega = update_coefficients(correction.policy, logp, logp_behav, unit, mask) * unit
    return ChannelOutputs(omega=omega, advantages=adv, coef=omega * adv)


def critic_target_policy(channel: AdvantageChannel, pi_logits: torch.Tensor, mu_logits: torch.Tensor) -> torch.Tensor:
    """Logits of the policy whose value is the fixed point of the channel's own critic target.

    A critic regressed on the channel's returns converges to ``V`` of ``pi~(a|s) ∝ mu(a|s)·rho(a|s)``
    (spec 4 and 9.3): ``rho = 1`` for GAE (``V^mu``), ``min(rho_bar, w)`` for V-trace,
    ``clip(w, clip_low, clip_high)`` for clipped TD (``V^mu`` at eps_A = 0, ``V^pi`` without a clip).
    The clip goes through the ops helpers, treating the ``[S, K]`` table as a ``[B, T]`` batch (float32).

    Args:
        pi_logits, mu_logits: ``[S, K]`` float64 tabular logits.

    Returns: ``[S, K]`` float64 logits ``log mu + log rho`` (softmax normalises them).
    """
    log_mu = torch.log_softmax(mu_logits.detach(), dim=-1)
    log_w = torch.log_softmax(pi_logits.detach(), dim=-1) - log_mu
    mask = torch.ones(log_w.shape, dtype=torch.bool)
    w = importance.ratio_from_log(log_w, mask)
    a = channel
    if a.kind == "gae":
        return log_mu
    if a.kind == "vtrace":
        rho = importance.clip_ratio(w, mask, low=0.0, high=a.rho_bar)
    else:
        rho = importance.clip_ratio(w, mask, low=a.clip_low, high=a.clip_high)
    return log_mu + torch.log(rho.to(torch.float64))
