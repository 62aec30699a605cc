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

This module defines the losses without a behaviour correction (:func:`ppo_clip_loss`,
:func:`bypass_ppo_loss`, :func:`pg_loss`) and re-exports the rest, so every actor loss imports from
here: the shared formula, output and aggregation from :mod:`copc.ops.policy_loss_core`, and the
behaviour-corrected losses (decoupled, TIS, COPC, IcePop, DIS) from :mod:`copc.ops.corrected_policy_losses`.
"""

from __future__ import annotations

import torch

# The option types of the corrected losses stay importable from here (outside __all__, as before).
from copc.ops.corrected_policy_losses import CapMode as CapMode
from copc.ops.corrected_policy_losses import MaskSource as MaskSource
from copc.ops.corrected_policy_losses import WeightMode as WeightMode
from copc.ops.corrected_policy_losses import (
    band_weight,
    copc_policy_loss,
    decoupled_ppo_loss,
    dis_loss,
    icepop_loss,
    tis_ppo_loss,
)
from copc.ops.masked import LossAgg, agg_loss, zero_where_not
from copc.ops.policy_loss_core import (
    Denominator,
    PolicyLossOutput,
    SurrogateTerms,
    _check_inputs,
    _fp,
    _policy_stats,
    clipped_surrogate,
    weighted_ppo_loss,
)

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
