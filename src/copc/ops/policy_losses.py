"""Actor (policy-channel) losses without a behaviour correction, and the one PPO formula they all share.

Notation (docs/formulas.md#notation): ``B`` sequences, ``T`` tokens; all tensors ``[B, T]``.
``logp`` = cur_t (pi_theta, carries the gradient), ``logp_old`` = old_t (trainer forward at the step
start), ``logp_behav`` = mu_t (the sampler's log-probs), ``advantages`` = A_t (constants),
``action_mask: bool`` True on the tokens the policy sampled. Ratios::

    u_t = exp(cur_t - old_t)     PPO trust-region ratio
    w_t = exp(old_t - mu_t)      behaviour ratio (staleness + train/infer mismatch), detached
    r_t = exp(cur_t - mu_t)      total ratio (bypass PPO, SAO, IcePop/COPC "current" variants)

Every PPO-family loss is ONE formula, :func:`weighted_ppo_loss`::

    l_t = omega_t * max(-A_t * u_t, -A_t * clip(u_t, 1 - eps_low, 1 + eps_high))
    if A_t < 0 and c_dual is set:  l_t = omega_t * min(max(...), -A_t * c_dual)      (dual clip)

with a detached per-token weight ``omega_t`` (1, min(w, C), or w / 1 inside a band and 0 outside)
that the behaviour-corrected losses of :mod:`copc.ops.corrected_policy_losses` build from the
behaviour ratio. The clip is given as a :class:`ClipSpec`, the aggregation as a
:class:`~copc.ops.masked.AggSpec` (named tuples of scalars). Which tokens sit in the denominator is
decided by ``denominator``: ``"all"`` (default, AReaL: masked tokens contribute 0 but still count, so
the step shrinks as the mask rate grows) or ``"kept"`` (verl / slime #657: survivors renormalised).
Every micro-batch must be given the GLOBAL counts of its minibatch in its ``AggSpec``; then
micro-batch losses sum to the full-minibatch loss (gradient accumulation).

All ratios come from log-ratios clamped to +-20 (:mod:`copc.ops.importance`); weights and masks are
detached; masks are applied with ``torch.where`` so NaN/inf at masked positions never reach an output
or a gradient. No ``.item()``, no in-place writes, no config objects.

This module defines the shared pieces (:func:`weighted_ppo_loss`, :func:`clipped_surrogate`,
:func:`aggregate_policy_loss`, :func:`policy_stats`, :func:`check_loss_inputs`) and the losses
without a behaviour correction (:func:`ppo_clip_loss`, which is also async PPO's bypass variant 3a when
given ``logp_behav`` as its centre, and :func:`pg_loss`).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from copc.ops.importance import k3_from_log, log_ratio, ratio_from_log
from copc.ops.masked import (
    TOKEN_MEAN,
    AggSpec,
    at_least_float32,
    check_bt,
    check_mask,
    masked_mean,
    zero_where_not,
)

__all__ = [
    "CLIP_HIGHER",
    "PPO_CLIP",
    "ClipSpec",
    "Denominator",
    "PolicyLossOutput",
    "SurrogateTerms",
    "aggregate_policy_loss",
    "check_loss_inputs",
    "clipped_surrogate",
    "pg_loss",
    "policy_stats",
    "ppo_clip_loss",
    "weighted_ppo_loss",
]

Denominator = Literal["all", "kept"]


class ClipSpec(NamedTuple):
    """PPO's clip of the trust-region ratio: ``[1 - low, 1 + high]``, and the dual-clip constant."""

    #: eps_low in [0, 1): the ratio is clipped at 1 - low.
    low: float = 0.2
    #: eps_high >= 0 (clip-higher, DAPO 0.28): the ratio is clipped at 1 + high.
    high: float = 0.2
    #: c_dual > 1 for A < 0 (verl 3.0), or None (off).
    dual_c: float | None = None


#: PPO's symmetric clip [0.8, 1.2], no dual clip.
PPO_CLIP = ClipSpec()
#: Clip-higher (DAPO): [0.8, 1.28], no dual clip.
CLIP_HIGHER = ClipSpec(0.2, 0.28)


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


def check_loss_inputs(action_mask: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Fail unless ``action_mask`` is ``[B, T] bool`` and every given tensor is shaped like it."""
    check_mask("action_mask", action_mask)
    for name, tensor in tensors.items():
        if tensor is not None:
            check_bt(name, tensor, action_mask)


def _check_clip(clip: ClipSpec) -> None:
    if not 0.0 <= clip.low < 1.0:
        raise ValueError(f"clip.low must be in [0, 1) (PPO eps_low, e.g. 0.2), got {clip.low}")
    if clip.high < 0.0:
        raise ValueError(f"clip.high must be >= 0 (PPO eps_high, e.g. 0.28), got {clip.high}")
    if clip.dual_c is not None and clip.dual_c <= 1.0:
        raise ValueError(f"clip.dual_c must be > 1 (verl uses 3.0) or None to disable, got {clip.dual_c}")


def clipped_surrogate(
    log_u: torch.Tensor, advantages: torch.Tensor, action_mask: torch.Tensor, *, clip: ClipSpec
) -> SurrogateTerms:
    """PPO's clipped term with clip-higher and optional dual clip (docs/formulas.md#ppo; verl).

    ``l = max(-A*u, -A*clip(u, 1-eps_low, 1+eps_high))``; for ``A < 0`` with ``c_dual`` set,
    ``l = min(l, -A*c_dual)`` (Ye et al. 2020 dual clip). ``u = exp(clamp(log_u, +-20))``.

    Args:
        log_u: ``[B, T]`` float log trust-region ratio (carries the gradient), 0 outside the mask.
        advantages: ``[B, T]`` float, constants (detached here).
        action_mask: ``[B, T]`` bool.
        clip: eps_low, eps_high and c_dual.
    """
    check_mask("action_mask", action_mask, log_u)
    adv = zero_where_not(action_mask, at_least_float32(advantages.detach()))
    u = ratio_from_log(log_u, action_mask).to(adv.dtype)
    unclipped = -adv * u
    clipped = -adv * u.clamp(1.0 - clip.low, 1.0 + clip.high)
    loss = torch.maximum(unclipped, clipped)
    u_det = u.detach()
    clipped_low = action_mask & (adv < 0) & (u_det < 1.0 - clip.low)
    clipped_high = action_mask & (adv > 0) & (u_det > 1.0 + clip.high)
    dual_clipped = torch.zeros_like(action_mask)
    if clip.dual_c is not None:
        cap = -adv * clip.dual_c
        dual_clipped = action_mask & (adv < 0) & (cap < loss.detach())
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    return SurrogateTerms(zero_where_not(action_mask, loss), clipped_low, clipped_high, dual_clipped)


def policy_stats(
    log_u: torch.Tensor | None,
    terms: SurrogateTerms | None,
    weight: torch.Tensor,
    keep: torch.Tensor,
    action_mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The ``policy/...`` diagnostics of an actor loss over the micro-batch's action tokens, detached.

    ``policy/mask_frac`` (action tokens outside ``keep``), ``policy/weight_mean`` (mean omega), the clip
    fractions of ``terms`` and ``policy/approx_kl`` (k3 of ``log_u``: u - 1 - log u) when given.
    """
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
        stats["policy/approx_kl"] = masked_mean(k3_from_log(log_u.detach().to(torch.float32)), action_mask)
    return stats


def aggregate_policy_loss(
    per_token: torch.Tensor, action_mask: torch.Tensor, keep: torch.Tensor, *, agg: AggSpec,
    denominator: Denominator
) -> torch.Tensor:
    """:func:`~copc.ops.masked.agg_loss` over the denominator's tokens: all action tokens, or the kept
    ones."""
    if denominator not in ("all", "kept"):
        raise ValueError(f"denominator must be 'all' (AReaL) or 'kept' (verl/slime), got {denominator!r}")
    return agg.reduce(per_token, action_mask if denominator == "all" else keep)


def weighted_ppo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    clip: ClipSpec = PPO_CLIP,
    agg: AggSpec = TOKEN_MEAN,
    denominator: Denominator = "all",
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
        clip: eps_low, eps_high of the clip ``[1 - eps_low, 1 + eps_high]`` and c_dual.
        agg: the aggregation and the GLOBAL counts of the minibatch (:class:`~copc.ops.masked.AggSpec`).
        denominator: ``"all"`` action tokens (default) or only ``"kept"`` ones.
    """
    check_loss_inputs(action_mask, logp=logp, logp_old=logp_old, advantages=advantages, weight=weight,
                      keep=keep)
    _check_clip(clip)
    keep_ = action_mask if keep is None else action_mask & keep
    log_u = log_ratio(at_least_float32(logp), at_least_float32(logp_old.detach()), action_mask)
    terms = clipped_surrogate(log_u, advantages, action_mask, clip=clip)
    if weight is None:
        omega = zero_where_not(keep_, torch.ones_like(terms.per_token))
    else:
        omega = zero_where_not(keep_, at_least_float32(weight.detach()).to(terms.per_token.dtype))
    per_token = zero_where_not(keep_, omega * terms.per_token)
    loss = aggregate_policy_loss(per_token, action_mask, keep_, agg=agg, denominator=denominator)
    return PolicyLossOutput(loss, per_token, policy_stats(log_u, terms, omega, keep_, action_mask), keep_)


def ppo_clip_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip: ClipSpec = PPO_CLIP,
    agg: AggSpec = TOKEN_MEAN,
) -> PolicyLossOutput:
    """PPO clip (docs/formulas.md#ppo; async PPO 3b when ``logp_old`` is recomputed on stale data).

    ``l_t = max(-A*u, -A*clip(u, 1-eps_low, 1+eps_high))``, ``u = exp(cur - old)``; dual clip
    ``min(l, -A*c_dual)`` for ``A < 0``. Arguments as in :func:`weighted_ppo_loss`. Async PPO 3a
    (bypass: verl ``bypass_mode`` + ``ppo_clip``, AReaL "naive PPO") is this loss with the behaviour
    log-probs mu_t as ``logp_old``: the clip on ``r = exp(cur - mu)``, no old forward, no extra weight.
    """
    return weighted_ppo_loss(logp, logp_old, advantages, action_mask, clip=clip, agg=agg)


def pg_loss(
    logp: torch.Tensor, advantages: torch.Tensor, action_mask: torch.Tensor, *, agg: AggSpec = TOKEN_MEAN
) -> PolicyLossOutput:
    """Plain policy gradient with a detached coefficient: ``l_t = -sg(A_t) * cur_t``.

    For V-trace (docs/formulas.md#v-trace) ``A_t`` is ``pg_advantage = rho^pg_t (r_t + gamma v_{t+1} - V_t)``,
    the truncated IS weight already inside it.
    """
    check_loss_inputs(action_mask, logp=logp, advantages=advantages)
    adv = zero_where_not(action_mask, at_least_float32(advantages.detach()))
    cur = zero_where_not(action_mask, at_least_float32(logp)).to(adv.dtype)
    per_token = zero_where_not(action_mask, -adv * cur)
    loss = agg.reduce(per_token, action_mask)
    ones = zero_where_not(action_mask, torch.ones_like(adv))
    return PolicyLossOutput(loss, per_token, policy_stats(None, None, ones, action_mask, action_mask),
                            action_mask)
