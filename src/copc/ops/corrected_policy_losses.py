"""Actor losses with a behaviour-policy correction: decoupled (AReaL; TIS), COPC (IcePop), SAO's DIS.

Each builds a detached per-token weight and keep mask from the behaviour ratio ``w_t = exp(old_t -
mu_t)`` or the total ratio ``r_t = exp(cur_t - mu_t)`` (masked above a cap, truncated at it, or kept
inside a band as in :func:`band_weight`) and hands it to the one PPO formula
:func:`~copc.ops.policy_losses.weighted_ppo_loss`; SAO's DIS drops the PPO clip and weights ``-r_t
A_t`` directly. The PPO-family losses take the three policies' log-probs, the advantages and the
mask as one :class:`CorrectedInputs`; notation, :class:`~copc.ops.policy_losses.ClipSpec`,
:class:`~copc.ops.masked.AggSpec` and the denominator rules as in :mod:`copc.ops.policy_losses`.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from copc.ops.importance import band_mask, log_ratio, ratio_from_log, truncated_is
from copc.ops.masked import TOKEN_MEAN, AggSpec, at_least_float32, check_mask, zero_where_not
from copc.ops.policy_losses import (
    CLIP_HIGHER,
    PPO_CLIP,
    ClipSpec,
    Denominator,
    PolicyLossOutput,
    aggregate_policy_loss,
    check_loss_inputs,
    policy_stats,
    weighted_ppo_loss,
)

__all__ = [
    "CapMode",
    "CorrectedInputs",
    "MaskSource",
    "WeightMode",
    "band_weight",
    "behaviour_ppo_loss",
    "copc_policy_loss",
    "decoupled_ppo_loss",
    "dis_loss",
]

WeightMode = Literal["masked_is", "binary"]
MaskSource = Literal["step_start", "current"]
CapMode = Literal["mask", "clip"]

class CorrectedInputs(NamedTuple):
    """The per-token tensors of a behaviour-corrected PPO loss, all ``[B, T]`` (module notation)."""

    #: float cur_t = log pi_theta, carries the gradient.
    logp: torch.Tensor
    #: float old_t, the trainer's forward at the step start (detached here).
    logp_old: torch.Tensor
    #: float mu_t, the sampler's log-probs (detached here).
    logp_behav: torch.Tensor
    #: float A_t (constants).
    advantages: torch.Tensor
    #: bool, True on the tokens the policy sampled.
    action_mask: torch.Tensor


def band_weight(
    log_w: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    low: float,
    high: float,
    mode: WeightMode = "masked_is",
    strict: bool = False,
    log_select: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token mask and weight from a ratio band (IcePop / COPC / AReaL cap / SAO), detached.

    ``M_t = 1[low <= s_t <= high]`` (``strict``: ``low < s_t < high``) with ``s_t = exp(log_select)``
    (default ``log_select = log_w``); ``omega_t = M_t * exp(log_w)`` (``masked_is``) or ``M_t``
    (``binary``). ``high = inf`` removes the upper edge.

    Returns: ``(omega [B, T] float, keep [B, T] bool)``; omega is 0 and keep False outside the mask.
    """
    check_mask("action_mask", action_mask, log_w)
    w = ratio_from_log(at_least_float32(log_w.detach()), action_mask)
    s = w if log_select is None else ratio_from_log(at_least_float32(log_select.detach()), action_mask)
    return _band(w, s, action_mask, low=low, high=high, mode=mode, strict=strict)


def _ratio_of_clean(log_r: torch.Tensor) -> torch.Tensor:
    """``exp(log_r)`` for a :func:`log_ratio` output (already clamped, 0 off the mask), detached.

    Equal to ``ratio_from_log(log_r, action_mask)`` bit for bit, without its mask and clamp passes.
    """
    return torch.exp(log_r.detach())


def _log_behaviour_ratio(x: CorrectedInputs, logp: torch.Tensor) -> torch.Tensor:
    """``log(pi / mu)`` for ``logp`` = old_t (the behaviour ratio ``w``) or cur_t (``r``): detached,
    clamped."""
    return log_ratio(at_least_float32(logp.detach()), at_least_float32(x.logp_behav.detach()), x.action_mask)


def _band(
    w: torch.Tensor, s: torch.Tensor, action_mask: torch.Tensor, *, low: float, high: float, mode: WeightMode,
    strict: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`band_weight` from the ratios themselves (``w`` weight, ``s`` selection ratio, detached)."""
    keep = band_mask(s, action_mask, low=low, high=high)
    if strict:
        keep = keep & (s > low) & (s < high)
    value = w if mode == "masked_is" else torch.ones_like(w)
    return zero_where_not(keep, value), keep


def decoupled_ppo_loss(
    x: CorrectedInputs,
    *,
    cap: float = 5.0,
    cap_mode: CapMode = "mask",
    clip: ClipSpec = PPO_CLIP,
    agg: AggSpec = TOKEN_MEAN,
    denominator: Denominator = "all",
) -> PolicyLossOutput:
    """AReaL's decoupled objective (docs/formulas.md#areal): ``l_t = omega_t * PPOclip(exp(cur - old), A)``.

    ``w_t = exp(old_t - mu_t)`` (detached). ``cap_mode="mask"`` (AReaL default): ``omega = w`` if
    ``w <= cap`` else 0 (masked tokens stay in the ``"all"`` denominator). ``cap_mode="clip"``:
    ``omega = min(w, cap)``, truncated IS (TIS, Yao et al. 2025; docs/formulas.md#masks, ``cap`` = C = 2).
    ``cap = inf``: the weight without a cap.
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0 (AReaL uses 5.0; inf disables it), got {cap}")
    check_loss_inputs(x.action_mask, logp_old=x.logp_old, logp_behav=x.logp_behav)
    log_w = _log_behaviour_ratio(x, x.logp_old)
    if cap_mode == "mask":
        w = _ratio_of_clean(log_w)
        weight, keep = _band(w, w, x.action_mask, low=0.0, high=cap, mode="masked_is", strict=False)
    elif cap_mode == "clip":
        weight = zero_where_not(x.action_mask, truncated_is(ratio_from_log(log_w, x.action_mask),
                                                            x.action_mask, cap=cap))
        keep = x.action_mask
    else:
        raise ValueError(f"cap_mode must be 'mask' (AReaL) or 'clip' (TIS), got {cap_mode!r}")
    return weighted_ppo_loss(
        x.logp, x.logp_old, x.advantages, x.action_mask, weight=weight, keep=keep, clip=clip, agg=agg,
        denominator=denominator,
    )


def copc_policy_loss(
    x: CorrectedInputs,
    *,
    mask_low: float = 0.5,
    mask_high: float = 2.0,
    weight_mode: WeightMode = "masked_is",
    mask_source: MaskSource = "step_start",
    clip: ClipSpec = CLIP_HIGHER,
    agg: AggSpec = TOKEN_MEAN,
    denominator: Denominator = "all",
) -> PolicyLossOutput:
    """COPC's token-level ratio masking on the clipped surrogate (docs/formulas.md#r0, #variants)
    [RECONSTRUCTED].

    ``w_t = exp(old_t - mu_t)``; ``M_t = 1[mask_low <= s_t <= mask_high]`` with ``s_t = w_t``
    (``mask_source="step_start"``) or ``exp(cur_t - mu_t)`` detached (``"current"``, recomputed per
    minibatch); ``omega_t = M_t * w_t`` (``masked_is``) or ``M_t`` (``binary``);
    ``l_t = omega_t * max(-A*u, -A*clip(u, 1-eps_low, 1+eps_high))``, ``u = exp(cur - old)``.
    With ``current`` and ``masked_is``: ``omega_t * u_t = M_t * exp(cur_t - mu_t)``.

    IcePop / masked IS (Ring-1T; docs/formulas.md#masks) is this loss with ``masked_is`` and the band
    ``[alpha, beta] = [0.5, 5]``, aggregated seq-mean-token-mean: its weight is ``k_t = w_t`` and its
    mask tests ``w_t`` (``step_start``, Ring-1T) or ``exp(cur_t - mu_t)`` (``current``, BRACE's IcePop
    baseline).
    """
    check_loss_inputs(x.action_mask, logp=x.logp, logp_old=x.logp_old, logp_behav=x.logp_behav)
    if mask_source not in ("step_start", "current"):
        raise ValueError(
            f"mask_source must be 'step_start' (old/mu) or 'current' (cur/mu), got {mask_source!r}")
    if weight_mode not in ("masked_is", "binary"):
        raise ValueError(
            f"weight_mode must be 'masked_is' (omega = M*w) or 'binary' (omega = M), got {weight_mode!r}")
    w = _ratio_of_clean(_log_behaviour_ratio(x, x.logp_old))
    select = w if mask_source == "step_start" else _ratio_of_clean(_log_behaviour_ratio(x, x.logp))
    weight, keep = _band(w, select, x.action_mask, low=mask_low, high=mask_high, mode=weight_mode,
                         strict=False)
    return weighted_ppo_loss(
        x.logp, x.logp_old, x.advantages, x.action_mask, weight=weight, keep=keep, clip=clip, agg=agg,
        denominator=denominator,
    )


def behaviour_ppo_loss(
    logp: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    mask_low: float = 0.0,
    mask_high: float = float("inf"),
    clip: ClipSpec = CLIP_HIGHER,
    agg: AggSpec = TOKEN_MEAN,
    denominator: Denominator = "all",
) -> PolicyLossOutput:
    """PPO anchored on the behaviour policy, with a band mask on the same ratio (docs/formulas.md#async-ppo,
    #r1).

    ``r_t = exp(cur_t - mu_t)``; ``M_t = 1[mask_low <= r_t <= mask_high]`` (detached, recomputed at
    every call, so it moves with ``cur`` during the update);
    ``l_t = M_t * max(-A*r, -A*clip(r, 1-eps_low, 1+eps_high))`` (dual clip as in :func:`clipped_surrogate`).
    The band ``[0, inf]`` keeps every action token and is async PPO 3a (verl bypass mode) bit for bit;
    a finite band is COPC's behaviour-anchored policy channel R1 [RECONSTRUCTED, docs/formulas.md#r1]. No
    ``logp_old``: the trust region and the mask are both centred on mu.
    """
    check_loss_inputs(action_mask, logp=logp, logp_behav=logp_behav, advantages=advantages)
    if not 0.0 <= mask_low < mask_high:
        raise ValueError(
            f"mask_low/mask_high need 0 <= low < high (inf allowed), got {mask_low}, {mask_high}")
    keep = None
    if mask_low > 0.0 or mask_high < float("inf"):
        r = _ratio_of_clean(log_ratio(at_least_float32(logp.detach()), at_least_float32(logp_behav.detach()),
                                      action_mask))
        keep = band_mask(r, action_mask, low=mask_low, high=mask_high)
    return weighted_ppo_loss(
        logp, logp_behav, advantages, action_mask, keep=keep, clip=clip, agg=agg, denominator=denominator
    )


def dis_loss(
    logp: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    mask_low: float = 0.7,
    mask_high: float = 6.0,
    agg: AggSpec = TOKEN_MEAN,
    denominator: Denominator = "all",
) -> PolicyLossOutput:
    """SAO's direct double-sided IS (docs/formulas.md#sao): ``l_t = -M_t * r_t(theta) * A_t``, no PPO clip.

    ``r_t = exp(cur_t - mu_t)``; ``M_t = 1[mask_low < r_t < mask_high]`` (strict, detached). The
    gradient ``-M_t r_t A_t grad(cur_t)`` equals that of the paper's ``f(r) A log pi`` with ``f(r)``
    read as a stop-gradient coefficient [interpretation, docs/formulas.md#disagreements]. Defaults: band (0.7,
    6.0). No ``logp_old`` (so no :class:`CorrectedInputs`): the ratio is taken against mu alone.
    """
    check_loss_inputs(action_mask, logp=logp, logp_behav=logp_behav, advantages=advantages)
    log_r = log_ratio(at_least_float32(logp), at_least_float32(logp_behav.detach()), action_mask)
    _, keep = band_weight(log_r, action_mask, low=mask_low, high=mask_high, mode="binary", strict=True)
    adv = zero_where_not(action_mask, at_least_float32(advantages.detach()))
    r = ratio_from_log(log_r, action_mask).to(adv.dtype)
    per_token = zero_where_not(keep, -r * adv)
    loss = aggregate_policy_loss(per_token, action_mask, keep, agg=agg, denominator=denominator)
    weight = zero_where_not(keep, r.detach())
    return PolicyLossOutput(loss, per_token, policy_stats(None, None, weight, keep, action_mask), keep)
