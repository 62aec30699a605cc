"""Actor losses with a behaviour-policy correction: decoupled (AReaL), TIS, COPC, IcePop, SAO's DIS.

Each builds a detached per-token weight and keep mask from the behaviour ratio ``w_t = exp(old_t -
mu_t)`` or the total ratio ``r_t = exp(cur_t - mu_t)`` (masked above a cap, truncated at it, or kept
inside a band as in :func:`band_weight`) and hands it to the one PPO formula
:func:`~copc.ops.policy_loss_core.weighted_ppo_loss`; SAO's DIS drops the PPO clip and weights ``-r_t
A_t`` directly. Notation and denominator rules as in :mod:`copc.ops.policy_losses`, which re-exports
everything here.
"""

from __future__ import annotations

from typing import Literal

import torch

from copc.ops.importance import band_mask, log_ratio, ratio_from_log, truncated_is
from copc.ops.masked import LossAgg, check_mask, zero_where_not
from copc.ops.policy_loss_core import (
    Denominator,
    PolicyLossOutput,
    _aggregate,
    _check_inputs,
    _fp,
    _policy_stats,
    weighted_ppo_loss,
)

__all__ = [
    "CapMode",
    "MaskSource",
    "WeightMode",
    "band_weight",
    "copc_policy_loss",
    "decoupled_ppo_loss",
    "dis_loss",
    "icepop_loss",
    "tis_ppo_loss",
]

WeightMode = Literal["masked_is", "binary"]
MaskSource = Literal["step_start", "current"]
CapMode = Literal["mask", "clip"]


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
    w = ratio_from_log(_fp(log_w.detach()), action_mask)
    s = w if log_select is None else ratio_from_log(_fp(log_select.detach()), action_mask)
    return _band(w, s, action_mask, low=low, high=high, mode=mode, strict=strict)


def _ratio_of_clean(log_r: torch.Tensor) -> torch.Tensor:
    """``exp(log_r)`` for a :func:`log_ratio` output (already clamped, 0 off the mask), detached.

    Equal to ``ratio_from_log(log_r, action_mask)`` bit for bit, without its mask and clamp passes.
    """
    return torch.exp(log_r.detach())


def _band(
    w: torch.Tensor, s: torch.Tensor, action_mask: torch.Tensor, *, low: float, high: float, mode: WeightMode, strict: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`band_weight` from the ratios themselves (``w`` weight, ``s`` selection ratio, detached)."""
    keep = band_mask(s, action_mask, low=low, high=high)
    if strict:
        keep = keep & (s > low) & (s < high)
    value = w if mode == "masked_is" else torch.ones_like(w)
    return zero_where_not(keep, value), keep


def decoupled_ppo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    cap: float = 5.0,
    cap_mode: CapMode = "mask",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    loss_agg: LossAgg = "token-mean",
    denominator: Denominator = "all",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    norm_length: float | None = None,
) -> PolicyLossOutput:
    """AReaL's decoupled objective (spec section 7): ``l_t = omega_t * PPOclip(exp(cur - old), A)``.

    ``w_t = exp(old_t - mu_t)`` (detached). ``cap_mode="mask"`` (AReaL default): ``omega = w`` if
    ``w <= cap`` else 0 (masked tokens stay in the ``"all"`` denominator). ``cap_mode="clip"``:
    ``omega = min(w, cap)`` (TIS). ``cap = inf``: the weight without a cap.
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0 (AReaL uses 5.0; inf disables it), got {cap}")
    _check_inputs(action_mask, logp_old=logp_old, logp_behav=logp_behav)
    log_w = log_ratio(_fp(logp_old.detach()), _fp(logp_behav.detach()), action_mask)
    if cap_mode == "mask":
        w = _ratio_of_clean(log_w)
        weight, keep = _band(w, w, action_mask, low=0.0, high=cap, mode="masked_is", strict=False)
    elif cap_mode == "clip":
        weight = zero_where_not(action_mask, truncated_is(ratio_from_log(log_w, action_mask), action_mask, cap=cap))
        keep = action_mask
    else:
        raise ValueError(f"cap_mode must be 'mask' (AReaL) or 'clip' (TIS), got {cap_mode!r}")
    return weighted_ppo_loss(
        logp,
        logp_old,
        advantages,
        action_mask,
        weight=weight,
        keep=keep,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip_c=dual_clip_c,
        loss_agg=loss_agg,
        denominator=denominator,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_length=norm_length,
    )


def tis_ppo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    cap: float = 2.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    loss_agg: LossAgg = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    norm_length: float | None = None,
) -> PolicyLossOutput:
    """Truncated IS (Yao et al. 2025; spec section 8): ``l_t = min(w_t, C) * PPOclip(u_t, A_t)``, C = 2."""
    return decoupled_ppo_loss(
        logp,
        logp_old,
        logp_behav,
        advantages,
        action_mask,
        cap=cap,
        cap_mode="clip",
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip_c=dual_clip_c,
        loss_agg=loss_agg,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_length=norm_length,
    )

def copc_policy_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    mask_low: float = 0.5,
    mask_high: float = 2.0,
    weight_mode: WeightMode = "masked_is",
    mask_source: MaskSource = "step_start",
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip_c: float | None = None,
    loss_agg: LossAgg = "token-mean",
    denominator: Denominator = "all",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    norm_length: float | None = None,
) -> PolicyLossOutput:
    """COPC's token-level ratio masking on the clipped surrogate (spec 9.3, 9.4) [RECONSTRUCTED].

    ``w_t = exp(old_t - mu_t)``; ``M_t = 1[mask_low <= s_t <= mask_high]`` with ``s_t = w_t``
    (``mask_source="step_start"``) or ``exp(cur_t - mu_t)`` detached (``"current"``, recomputed per
    minibatch); ``omega_t = M_t * w_t`` (``masked_is``) or ``M_t`` (``binary``);
    ``l_t = omega_t * max(-A*u, -A*clip(u, 1-eps_low, 1+eps_high))``, ``u = exp(cur - old)``.
    With ``current`` and ``masked_is``: ``omega_t * u_t = M_t * exp(cur_t - mu_t)``.
    IcePop (step-start ratio) is the same formula with band (0.5, 5).
    """
    _check_inputs(action_mask, logp=logp, logp_old=logp_old, logp_behav=logp_behav)
    behav = _fp(logp_behav.detach())
    log_w = log_ratio(_fp(logp_old.detach()), behav, action_mask)
    if mask_source not in ("step_start", "current"):
        raise ValueError(f"mask_source must be 'step_start' (old/mu) or 'current' (cur/mu), got {mask_source!r}")
    log_select = None if mask_source == "step_start" else log_ratio(_fp(logp.detach()), behav, action_mask)
    if weight_mode not in ("masked_is", "binary"):
        raise ValueError(f"weight_mode must be 'masked_is' (omega = M*w) or 'binary' (omega = M), got {weight_mode!r}")
    w = _ratio_of_clean(log_w)
    select = w if log_select is None else _ratio_of_clean(log_select)
    weight, keep = _band(w, select, action_mask, low=mask_low, high=mask_high, mode=weight_mode, strict=False)
    return weighted_ppo_loss(
        logp,
        logp_old,
        advantages,
        action_mask,
        weight=weight,
        keep=keep,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip_c=dual_clip_c,
        loss_agg=loss_agg,
        denominator=denominator,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_length=norm_length,
    )


def icepop_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    mask_low: float = 0.5,
    mask_high: float = 5.0,
    ratio_source: MaskSource = "step_start",
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip_c: float | None = None,
    loss_agg: LossAgg = "seq-mean-token-mean",
    denominator: Denominator = "all",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    norm_length: float | None = None,
) -> PolicyLossOutput:
    """IcePop / masked IS (Ring-1T; spec section 8): ``l_t = M(k_t) * PPOclip(exp(cur - old), A)``.

    ``k_t = exp(old_t - mu_t)`` (``ratio_source="step_start"``, Ring-1T) or ``exp(cur_t - mu_t)``
    detached (``"current"``, BRACE's IcePop baseline); ``M(k) = k`` if ``alpha <= k <= beta`` else 0,
    alpha = 0.5, beta = 5. Aggregated seq-mean-token-mean over original tokens by default.
    """
    _check_inputs(action_mask, logp=logp, logp_old=logp_old, logp_behav=logp_behav)
    if ratio_source not in ("step_start", "current"):
        raise ValueError(f"ratio_source must be 'step_start' (old/mu) or 'current' (cur/mu), got {ratio_source!r}")
    num = logp_old if ratio_source == "step_start" else logp
    log_k = log_ratio(_fp(num.detach()), _fp(logp_behav.detach()), action_mask)
    k = _ratio_of_clean(log_k)
    weight, keep = _band(k, k, action_mask, low=mask_low, high=mask_high, mode="masked_is", strict=False)
    return weighted_ppo_loss(
        logp,
        logp_old,
        advantages,
        action_mask,
        weight=weight,
        keep=keep,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip_c=dual_clip_c,
        loss_agg=loss_agg,
        denominator=denominator,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_length=norm_length,
    )


def dis_loss(
    logp: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    mask_low: float = 0.7,
    mask_high: float = 6.0,
    loss_agg: LossAgg = "token-mean",
    denominator: Denominator = "all",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    norm_length: float | None = None,
) -> PolicyLossOutput:
    """SAO's direct double-sided IS (spec section 6): ``l_t = -M_t * r_t(theta) * A_t``, no PPO clip.

    ``r_t = exp(cur_t - mu_t)``; ``M_t = 1[mask_low < r_t < mask_high]`` (strict, detached). The
    gradient ``-M_t r_t A_t grad(cur_t)`` equals that of the paper's ``f(r) A log pi`` with ``f(r)``
    read as a stop-gradient coefficient [interpretation, spec 13.7]. Defaults: band (0.7, 6.0).
    """
    _check_inputs(action_mask, logp=logp, logp_behav=logp_behav, advantages=advantages)
    log_r = log_ratio(_fp(logp), _fp(logp_behav.detach()), action_mask)
    _, keep = band_weight(log_r, action_mask, low=mask_low, high=mask_high, mode="binary", strict=True)
    adv = zero_where_not(action_mask, _fp(advantages.detach()))
    r = ratio_from_log(log_r, action_mask).to(adv.dtype)
    per_token = zero_where_not(keep, -r * adv)
    loss = _aggregate(
        per_token,
        action_mask,
        keep,
        loss_agg=loss_agg,
        denominator=denominator,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_length=norm_length,
    )
    weight = zero_where_not(keep, r.detach())
    return PolicyLossOutput(loss, per_token, _policy_stats(None, None, weight, keep, action_mask), keep)

