"""The maths of copc's verl plugin, as functions of verl's tensors: the advantage step (both channels'
step-start quantities) and the two policy losses verl calls (docs/verl.md, "Which COPC the plugin runs").
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from verl.trainer.ppo import core_algos

from copc.channels import PolicyChannelConfig, compute_advantages
from copc.integrations.verl_config import MISSING_OLD, MISSING_ROLLOUT, MISSING_VALUES, CopcChannels
from copc.ops import ClipSpec, band_weight, log_ratio, masked_mean, weighted_ppo_loss

__all__ = [
    "LOSS_NAME",
    "MISSING_WEIGHTS",
    "TRAINER_HINT",
    "CopcPolicyWeight",
    "CopcStep",
    "copc_advantage_step",
    "copc_behaviour_loss",
    "copc_policy_loss",
    "copc_policy_weight",
]

#: verl's name of copc's policy loss (``actor_rollout_ref.actor.policy_loss.loss_mode``).
LOSS_NAME = "copc"
#: What to set when a copc piece is used without copc's trainer.
TRAINER_HINT = "set trainer.v1.trainer_mode=copc (or copc_colocate_async / copc_separate_async)"
MISSING_WEIGHTS = ("policy_loss.loss_mode=copc needs the weights copc's trainer writes (rollout_is_weights): "
                   f"{TRAINER_HINT}")


class CopcStep(NamedTuple):
    """What copc's advantage step writes into verl's batch; all ``[B, T]`` float32, 0 off the mask."""

    advantages: torch.Tensor
    returns: torch.Tensor
    rollout_is_weights: torch.Tensor | None  # R0: omega = M * w (or M), the policy channel's weight; R1: None
    # R1: mu, the actor's trust-region centre from now on; R0: None (unchanged)
    old_log_probs: torch.Tensor | None
    metrics: dict[str, torch.Tensor]  # detached scalars, ``copc/...``


class CopcPolicyWeight(NamedTuple):
    """The policy channel's per-token weight at the step start; ``[B, T]``, 0 off the mask."""

    log_w: torch.Tensor  # float32, log(old / mu), clamped to +-20
    rollout_is_weights: torch.Tensor  # float32, omega = M * w (or M)
    metrics: dict[str, torch.Tensor]  # detached scalars, ``copc/policy/...``


def copc_policy_weight(
    policy: PolicyChannelConfig, *, old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
    mask: torch.Tensor
) -> CopcPolicyWeight:
    """``omega = M * w`` (``binary``: ``M``), ``w = exp(old - mu)``, ``M = 1[mask_low <= w <= mask_high]``.

    Args:
        policy: copc's policy channel config (band and weight mode).
        old_log_probs: ``[B, T]`` float, verl's recomputed proximal log-probs (old_t).
        rollout_log_probs: ``[B, T]`` float, the sampler's log-probs (mu_t).
        mask: ``[B, T]`` bool, True on sampled tokens.
    """
    log_w = log_ratio(old_log_probs.float(), rollout_log_probs.float(), mask)
    weight, keep = band_weight(log_w, mask, low=policy.mask_low, high=policy.mask_high,
                               mode=policy.weight_mode)
    metrics = {
        "copc/policy/mask_frac": masked_mean((mask & ~keep).float(), mask),
        "copc/policy/weight_mean": masked_mean(weight, mask),
    }
    return CopcPolicyWeight(log_w, weight.detach(), metrics)


def copc_advantage_step(
    channels: CopcChannels,
    *,
    token_level_rewards: torch.Tensor,
    values: torch.Tensor | None,
    old_log_probs: torch.Tensor | None,
    rollout_log_probs: torch.Tensor | None,
    response_mask: torch.Tensor,
) -> CopcStep:
    """Both channels' step-start quantities on verl's padded batch (``[B, T]``, right-padded responses).

    Args:
        token_level_rewards: ``[B, T]`` float, verl's rewards (score on the last response token, KL
            penalty on every token if ``use_kl_in_reward``); rewards off the mask are folded back.
        values: ``[B, T]`` float, the critic's pre-update V(s_t) at response positions.
        old_log_probs: ``[B, T]`` float, verl's recomputed proximal log-probs (old_t).
        rollout_log_probs: ``[B, T]`` float, the sampler's log-probs (mu_t).
        response_mask: ``[B, T]`` bool or 0/1, True on sampled tokens (tool output False).
    """
    if rollout_log_probs is None:
        raise ValueError(MISSING_ROLLOUT)
    if values is None:
        raise ValueError(MISSING_VALUES)
    if old_log_probs is None:
        raise ValueError(MISSING_OLD)
    if channels.advantage is None:
        raise ValueError("copc.channels=policy has no advantage channel: verl's estimator computes the "
                         "advantages")
    mask = response_mask.bool()
    policy = copc_policy_weight(
        channels.policy, old_log_probs=old_log_probs, rollout_log_probs=rollout_log_probs, mask=mask
    )
    adv = compute_advantages(
        channels.advantage, rewards=token_level_rewards.float(), values=values.float(), log_w=policy.log_w,
        action_mask=mask
    )
    metrics = {f"copc/{name}": value for name, value in adv.stats.items()}
    if not channels.behaviour:
        return CopcStep(adv.advantages, adv.returns, policy.rollout_is_weights, None,
                        metrics | policy.metrics)
    # R1: the band is tested on r = cur/mu by verl's loss at every micro-batch; at the step start r = old/mu.
    metrics["copc/policy/mask_frac_step_start"] = policy.metrics["copc/policy/mask_frac"]
    # as verl's bypass mode writes it: the sampler's log-probs, verbatim
    return CopcStep(adv.advantages, adv.returns, None, rollout_log_probs, metrics)


def copc_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl policy loss ``copc``: ``omega_t * PPOclip(u_t, A_t)`` per token, aggregated by verl.

    verl's ``PolicyLossFn`` signature; all tensors ``[B, T]`` (a micro-batch). ``rollout_is_weights``
    is omega from :func:`copc_advantage_step` (written by copc's trainer). Returns ``(loss, metrics)``
    with metrics as 0-d tensors (verl's ``Metric`` reads them).
    """
    if config is None:
        raise ValueError("policy loss copc needs verl's actor config (config=...)")
    if rollout_is_weights is None:
        raise ValueError(MISSING_WEIGHTS)
    mask = response_mask.bool()
    clip = config.get("clip_ratio", 0.2)
    clip_low = config.get("clip_ratio_low", None)
    clip_high = config.get("clip_ratio_high", None)
    weight = torch.where(mask, rollout_is_weights.float(), torch.zeros((), device=mask.device))
    out = weighted_ppo_loss(
        log_prob,
        old_log_prob,
        advantages,
        mask,
        weight=weight,
        keep=weight > 0,
        clip=ClipSpec(
            low=clip if clip_low is None else clip_low,
            high=clip if clip_high is None else clip_high,
            dual_c=config.get("clip_ratio_c", 3.0),
        ),
    )
    loss = core_algos.agg_loss(
        loss_mat=out.per_token, loss_mask=mask, loss_agg_mode=loss_agg_mode, **config.get("global_batch_info",
                                                                                          {})
    )
    return loss, {f"copc/{name}": value for name, value in out.stats.items()}


def copc_behaviour_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl policy loss ``copc_behaviour``: COPC R1's actor loss, which is verl's bypass-mode loss.

    ``old_log_prob`` is mu (copc's trainer wrote ``old_log_probs = rollout_log_probs`` after its advantage
    step). verl's ``compute_policy_loss_bypass_mode`` does the work, reading R1's band from
    ``config.policy_loss.rollout_correction``; a micro-batch without a loss token (verl's padding rows)
    returns 0 with a zero gradient, where verl's rejection step raises.
    """
    if not bool(response_mask.bool().any()):
        return (log_prob * 0.0).sum(), {}
    return core_algos.compute_policy_loss_bypass_mode(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask,
        loss_agg_mode=loss_agg_mode, config=config, rollout_is_weights=rollout_is_weights,
    )
