"""Actor (policy-channel) losses: PPO clip, bypass, decoupled (AReaL), TIS, IcePop, SAO's DIS, COPC.

Notation (spec/algorithms.md section 0): ``B`` sequences, ``T`` tokens; all tensors ``[B, T]``.
``logp`` = cur_t (pi_theta, carries the gradient), ``logp_old`` = old_t (trainer forward at the step
start), ``logp_behav`` = mu_t (the sampler's log-probs), ``advantages`` = A_t (constants),
``action_mask: bool`` True on the tokens the policy sampled. Ratios::

    u_t = exp(cur_t - old_t)     PPO trust-region ratio
    w_t = exp(old_t - mu_t)      behaviour ratio (staleness + train/infer mismatch), detached
    r_t = exp(cur_t - mu_t)      total ratio (bypass PPO, SAO, IcePop/COPC "current" variants)

Every PPO-family loss here is ONE formula, :func:`weighted_ppo_loss`::

    l_t = omega_t * max(-A_t * u_t, -A_t * clip(u_t, 1 - eps_low, 1 + eps_high))
    if A_t < 0 and c_dual is set:  l_t = omega_t * min(max(...), -A_t * c_dual)      (dual clip)

with a detached per-token weight ``omega_t`` (1, min(w, C), or w / 1 inside a band and 0 outside) that
the named losses build from the behaviour ratio. Which tokens sit in the denominator is decided by
``denominator``: ``"all"`` (default, AReaL: masked tokens contribute 0 but still count, so the step
shrinks as the mask rate grows) or ``"kept"`` (verl / slime #657: survivors renormalised). Every
micro-batch must be given the GLOBAL counts of its minibatch (``num_tokens``, ``num_seqs``); then
micro-batch losses sum to the full-minibatch loss (gradient accumulation).

All ratios come from log-ratios clamped to +-20 (:mod:`copc.ops.importance`); weights and masks are
detached; masks are applied with ``torch.where`` so NaN/inf at masked positions never reach an output
or a gradient. No ``.item()``, no in-place writes, no config objects.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from copc.ops.importance import band_mask, log_ratio, ratio_from_log, truncated_is
from copc.ops.masked import LossAgg, agg_loss, check_bt, check_mask, masked_mean, zero_where_not

__all__ = [
    "Denominator",
    "PolicyLossOutput",
    "SurrogateTerms",
    "band_weight",
    "bypass_ppo_loss",
    "clipped_surrogate",
    "copc_policy_loss",
    "decoupled_ppo_loss",
    "dis_loss",
    "icepop_loss",
    "pg_loss",
    "ppo_clip_loss",
    "tis_ppo_loss",
    "weighted_ppo_loss",
]

Denominator = Literal["all", "kept"]
WeightMode = Literal["masked_is", "binary"]
MaskSource = Literal["step_start", "current"]
CapMode = Literal["mask", "clip"]


class PolicyLossOutput(NamedTuple):
    """What every actor loss returns."""

    #: scalar float32, aggregated with the given global counts (differentiable w.r.t. ``logp``).
    loss: torch.Tensor
    #: ``[B, T]`` float32 per-token loss, exactly 0 outside ``action_mask`` and on masked tokens.
    per_token: torch.Tensor
    #: detached scalar diagnostics over this micro-batch's action tokens (``policy/...`` namespace).
    stats: dict[str, torch.Tensor]
    #: ``[B, T]`` bool, action tokens that survived the correction mask (the ``"kept"`` denominator).
    keep: torch.Tensor


class SurrogateTerms(NamedTuple):
    """The PPO clipped term and which branch was active, per token (``[B, T]``)."""

    #: ``max(-A*u, -A*clip(u))`` (dual-clipped for A < 0); 0 outside the mask.
    per_token: torch.Tensor
    #: A < 0 and u < 1 - eps_low: the lower clip is active (no gradient).
    clipped_low: torch.Tensor
    #: A > 0 and u > 1 + eps_high: the upper clip is active (no gradient).
    clipped_high: torch.Tensor
    #: A < 0 and -A*c_dual < max(...): the dual clip is active (no gradient).
    dual_clipped: torch.Tensor


def _fp(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (float64 stays float64, so ``gradcheck`` runs in double precision)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _check_inputs(action_mask: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    check_mask("action_mask", action_mask)
    for name, tensor in tensors.items():
        if tensor is not None:
            check_bt(name, tensor, action_mask)


def _check_clip(clip_low: float, clip_high: float, dual_clip_c: float | None) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1) (PPO eps_low, e.g. 0.2), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0 (PPO eps_high, e.g. 0.28), got {clip_high}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (verl uses 3.0) or None to disable, got {dual_clip_c}")


def clipped_surrogate(
    log_u: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None = None,
) -> SurrogateTerms:
    """PPO's clipped term with clip-higher and optional dual clip (spec section 2; verl).

    ``l = max(-A*u, -A*clip(u, 1-eps_low, 1+eps_high))``; for ``A < 0`` with ``c_dual`` set,
    ``l = min(l, -A*c_dual)`` (Ye et al. 2020 dual clip). ``u = exp(clamp(log_u, +-20))``.

    Args:
        log_u: ``[B, T]`` float log trust-region ratio (carries the gradient), 0 outside the mask.
        advantages: ``[B, T]`` float, constants (detached here).
        action_mask: ``[B, T]`` bool.
    """
    check_mask("action_mask", action_mask, log_u)
    adv = zero_where_not(action_mask, _fp(advantages.detach()))
    u = ratio_from_log(log_u, action_mask).to(adv.dtype)
    unclipped = -adv * u
    clipped = -adv * u.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    u_det = u.detach()
    clipped_low = action_mask & (adv < 0) & (u_det < 1.0 - clip_low)
    clipped_high = action_mask & (adv > 0) & (u_det > 1.0 + clip_high)
    dual_clipped = torch.zeros_like(action_mask)
    if dual_clip_c is not None:
        cap = -adv * dual_clip_c
        dual_clipped = action_mask & (adv < 0) & (cap < loss.detach())
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    return SurrogateTerms(zero_where_not(action_mask, loss), clipped_low, clipped_high, dual_clipped)


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


def _policy_stats(
    log_u: torch.Tensor | None,
    terms: SurrogateTerms | None,
    weight: torch.Tensor,
    keep: torch.Tensor,
    action_mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Detached diagnostics over the micro-batch's action tokens."""
    frac = lambda b: masked_mean(b.to(torch.float32), action_mask)  # noqa: E731
    stats = {
        "policy/mask_frac": frac(action_mask & ~keep),
        "policy/weight_mean": masked_mean(weight.detach().to(torch.float32), action_mask),
    }
    if terms is not None:
        stats["policy/clip_frac_low"] = frac(terms.clipped_low)
        stats["policy/clip_frac_high"] = frac(terms.clipped_high)
        stats["policy/dual_clip_frac"] = frac(terms.dual_clipped)
    if log_u is not None:
        # k3 estimator of KL(old || cur): u - 1 - log u >= 0 (Schulman's approx KL).
        lu = log_u.detach().to(torch.float32)
        stats["policy/approx_kl"] = masked_mean(torch.expm1(lu) - lu, action_mask)
    return stats


def _aggregate(
    per_token: torch.Tensor,
    action_mask: torch.Tensor,
    keep: torch.Tensor,
    *,
    loss_agg: LossAgg,
    denominator: Denominator,
    num_tokens: float | torch.Tensor | None,
    num_seqs: float | torch.Tensor | None,
    norm_length: float | None,
) -> torch.Tensor:
    """``agg_loss`` over the denominator's tokens: all action tokens, or only the kept ones."""
    if denominator not in ("all", "kept"):
        raise ValueError(f"denominator must be 'all' (AReaL) or 'kept' (verl/slime), got {denominator!r}")
    counted = action_mask if denominator == "all" else keep
    return agg_loss(
        per_token, counted, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length
    )


def weighted_ppo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    loss_agg: LossAgg = "token-mean",
    denominator: Denominator = "all",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    norm_length: float | None = None,
) -> PolicyLossOutput:
    """``l_t = omega_t * PPOclip(u_t, A_t)`` with ``u_t = exp(cur_t - old_t)``: the one PPO formula.

    Args:
        logp: ``[B, T]`` float cur_t, with gradient.
        logp_old: ``[B, T]`` float, the ratio's centre (old_t; mu_t for bypass PPO), detached.
        advantages: ``[B, T]`` float A_t (constants).
        action_mask: ``[B, T]`` bool, trainable tokens.
        weight: ``[B, T]`` float omega_t (detached); None = 1.
        keep: ``[B, T]`` bool, tokens that survived a correction mask (None = all); they define the
            ``"kept"`` denominator and ``policy/mask_frac``.
        clip_low, clip_high: eps_low, eps_high of the clip ``[1 - eps_low, 1 + eps_high]``.
        dual_clip_c: c_dual (> 1) for A < 0, or None.
        loss_agg, num_tokens, num_seqs, norm_length: see :func:`copc.ops.masked.agg_loss`; give the
            GLOBAL counts of the minibatch under gradient accumulation.
        denominator: ``"all"`` action tokens (default) or only ``"kept"`` ones.
    """
    _check_inputs(action_mask, logp=logp, logp_old=logp_old, advantages=advantages, weight=weight, keep=keep)
    _check_clip(clip_low, clip_high, dual_clip_c)
    keep_ = action_mask if keep is None else action_mask & keep
    log_u = log_ratio(_fp(logp), _fp(logp_old.detach()), action_mask)
    terms = clipped_surrogate(
        log_u, advantages, action_mask, clip_low=clip_low, clip_high=clip_high, dual_clip_c=dual_clip_c
    )
    if weight is None:
        omega = zero_where_not(keep_, torch.ones_like(terms.per_token))
    else:
        omega = zero_where_not(keep_, _fp(weight.detach()).to(terms.per_token.dtype))
    per_token = zero_where_not(keep_, omega * terms.per_token)
    loss = _aggregate(
        per_token,
        action_mask,
        keep_,
        loss_agg=loss_agg,
        denominator=denominator,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_length=norm_length,
    )
    return PolicyLossOutput(loss, per_token, _policy_stats(log_u, terms, omega, keep_, action_mask), keep_)


def ppo_clip_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    loss_agg: LossAgg = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    norm_length: float | None = None,
) -> PolicyLossOutput:
    """PPO clip (spec section 2; async PPO 3b when ``logp_old`` is recomputed on stale data).

    ``l_t = max(-A*u, -A*clip(u, 1-eps_low, 1+eps_high))``, ``u = exp(cur - old)``; dual clip
    ``min(l, -A*c_dual)`` for ``A < 0``. Arguments as in :func:`weighted_ppo_loss`.
    """
    return weighted_ppo_loss(
        logp,
        logp_old,
        advantages,
        action_mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip_c=dual_clip_c,
        loss_agg=loss_agg,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_length=norm_length,
    )


def bypass_ppo_loss(
    logp: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    loss_agg: LossAgg = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    norm_length: float | None = None,
) -> PolicyLossOutput:
    """Async PPO 3a (bypass): the PPO clip centred on the behaviour policy, ``r = exp(cur - mu)``.

    No ``old`` forward and no extra weight (verl ``bypass_mode`` + ``ppo_clip``; AReaL "naive PPO").
    """
    return ppo_clip_loss(
        logp,
        logp_behav,
        advantages,
        action_mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip_c=dual_clip_c,
        loss_agg=loss_agg,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_length=norm_length,
    )


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


def pg_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    loss_agg: LossAgg = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    norm_length: float | None = None,
) -> PolicyLossOutput:
    """Plain policy gradient with a detached coefficient: ``l_t = -sg(A_t) * cur_t``.

    For V-trace (spec section 4) ``A_t`` is ``pg_advantage = rho^pg_t (r_t + gamma v_{t+1} - V_t)``,
    the truncated IS weight already inside it.
    """
    _check_inputs(action_mask, logp=logp, advantages=advantages)
    adv = zero_where_not(action_mask, _fp(advantages.detach()))
    cur = zero_where_not(action_mask, _fp(logp)).to(adv.dtype)
    per_token = zero_where_not(action_mask, -adv * cur)
    loss = agg_loss(
        per_token, action_mask, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length
    )
    ones = zero_where_not(action_mask, torch.ones_like(adv))
    return PolicyLossOutput(loss, per_token, _policy_stats(None, None, ones, action_mask, action_mask), action_mask)
