"""The one PPO formula every actor loss composes, and what all actor losses share.

:func:`weighted_ppo_loss` (``l_t = omega_t * PPOclip(u_t, A_t)``) on top of :func:`clipped_surrogate`,
the :class:`PolicyLossOutput` every actor loss returns, the denominator-aware aggregation and the
``policy/...`` diagnostics. Notation, ratios and the denominator rules are described in
:mod:`copc.ops.policy_losses`, which re-exports everything public here.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from copc.ops.importance import log_ratio, ratio_from_log
from copc.ops.masked import LossAgg, agg_loss, check_bt, check_mask, masked_mean, zero_where_not

__all__ = ["Denominator", "PolicyLossOutput", "SurrogateTerms", "clipped_surrogate", "weighted_ppo_loss"]

Denominator = Literal["all", "kept"]


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
