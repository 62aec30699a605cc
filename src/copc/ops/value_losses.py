"""Critic losses: PPO value clipping around the pre-update values, with an MSE or Huber penalty.

Notation: ``B`` sequences, ``T`` tokens; ``values = V_phi(s_t)`` (with gradient), ``values_old`` =
the pre-update values the targets were built from (V_old), ``returns = G_t`` (critic target,
constants), ``action_mask: [B, T] bool`` (policy tokens; the critic is never masked by a policy-channel
correction, docs/formulas.md#r0). docs/formulas.md#ppo / verl ``compute_value_loss``::

    V_clip = V_old + clip(V_phi - V_old, -eps_v, +eps_v)
    l_t    = max(f(V_phi - G), f(V_clip - G))         (value clipping; eps_v = None -> l_t = f(V_phi - G))
    f(d)   = d^2 / 2                                  ("mse": L_V = 1/2 agg(max(...)))
    f(d)   = d^2 / 2 if |d| <= delta else delta (|d| - delta/2)   ("huber", AReaL ppo_critic_loss_fn)

Aggregated with :func:`copc.ops.masked.agg_loss` through an :class:`~copc.ops.masked.AggSpec`
(token-mean over all policy tokens by default; give the GLOBAL minibatch count under gradient
accumulation). :func:`explained_variance` is the one definition of the critic's explained variance. Pure: no
``.item()``, no in-place writes.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from copc.ops.masked import TOKEN_MEAN, AggSpec, check_bt, check_mask, masked_mean, masked_var, zero_where_not

__all__ = [
    "EXPLAINED_VAR_MIN_VAR",
    "ValueLossOutput",
    "ValuePenalty",
    "clipped_value_loss",
    "explained_variance",
    "huber_value_loss",
    "mse_value_loss",
    "value_penalty",
]

ValuePenalty = Literal["mse", "huber"]

#: Below this Var(G) the explained variance is undefined (targets that do not vary, e.g. every reward
#: equal) and reported as 0 instead of a ratio of rounding noise.
EXPLAINED_VAR_MIN_VAR = 1e-8


class ValueLossOutput(NamedTuple):
    """What every critic loss returns."""

    #: scalar float32, differentiable w.r.t. ``values``.
    loss: torch.Tensor
    #: ``[B, T]`` float32 per-token loss, exactly 0 outside ``action_mask``.
    per_token: torch.Tensor
    #: detached diagnostics over this micro-batch's tokens (``value/...`` namespace).
    stats: dict[str, torch.Tensor]


def value_penalty(diff: torch.Tensor, *, kind: ValuePenalty = "mse",
                  huber_delta: float = 1.0) -> torch.Tensor:
    """Elementwise ``f(d)``: ``d^2/2`` (``mse``) or the Huber loss with threshold ``huber_delta``."""
    if kind == "mse":
        return 0.5 * diff * diff
    if kind == "huber":
        if huber_delta <= 0:
            raise ValueError(f"huber_delta must be > 0 (e.g. 1.0), got {huber_delta}")
        absd = diff.abs()
        return torch.where(absd <= huber_delta, 0.5 * diff * diff, huber_delta * (absd - 0.5 * huber_delta))
    raise ValueError(f"value loss kind must be 'mse' or 'huber', got {kind!r}")


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var(G - V) / Var(G)`` over ``mask`` (Bessel-corrected variances), 0-d float32, detached.

    0 where ``Var(G) <= EXPLAINED_VAR_MIN_VAR`` (undefined). ``returns``, ``values``: ``[B, T]`` float.
    """
    check_mask("mask", mask, returns)
    g = returns.detach().to(torch.float32)
    var_g = masked_var(g, mask)
    explained = 1.0 - masked_var(g - values.detach().to(torch.float32),
                                 mask) / var_g.clamp(min=EXPLAINED_VAR_MIN_VAR)
    return torch.where(var_g > EXPLAINED_VAR_MIN_VAR, explained, torch.zeros_like(explained))


def clipped_value_loss(
    values: torch.Tensor,
    values_old: torch.Tensor | None,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip_eps: float | None = 0.5,
    kind: ValuePenalty = "mse",
    huber_delta: float = 1.0,
    agg: AggSpec = TOKEN_MEAN,
) -> ValueLossOutput:
    """PPO value loss ``max(f(V - G), f(V_clip - G))`` (see module docstring), aggregated.

    Args:
        values: ``[B, T]`` float V_phi(s_t), with gradient.
        values_old: ``[B, T]`` float pre-update V_old (detached); may be None only if ``clip_eps`` is None.
        returns: ``[B, T]`` float targets G_t (detached; never whitened).
        action_mask: ``[B, T]`` bool.
        clip_eps: eps_v (0.5 in verl and BRACE); None disables value clipping.
        kind, huber_delta: the penalty f.
        agg: the aggregation and the GLOBAL counts (:class:`~copc.ops.masked.AggSpec`).

    Stats: ``value/clip_frac`` (the clipped branch is strictly larger), ``value/mean_abs_err``,
    ``value/explained_var`` (:func:`explained_variance` over this micro-batch).
    """
    check_mask("action_mask", action_mask)
    check_bt("values", values, action_mask)
    check_bt("returns", returns, action_mask)
    dtype = torch.promote_types(values.dtype, torch.float32)
    v = zero_where_not(action_mask, values.to(dtype))
    g = zero_where_not(action_mask, returns.detach().to(dtype))
    per_token = value_penalty(v - g, kind=kind, huber_delta=huber_delta)
    clipped_frac = torch.zeros((), dtype=torch.float32)
    if clip_eps is not None:
        if clip_eps < 0:
            raise ValueError(f"clip_eps must be >= 0 (eps_v, e.g. 0.5) or None, got {clip_eps}")
        if values_old is None:
            raise ValueError("values_old is required for value clipping; pass it or set clip_eps=None")
        check_bt("values_old", values_old, action_mask)
        v_old = zero_where_not(action_mask, values_old.detach().to(dtype))
        v_clip = v_old + (v - v_old).clamp(-clip_eps, clip_eps)
        clipped = value_penalty(v_clip - g, kind=kind, huber_delta=huber_delta)
        clipped_frac = masked_mean((clipped.detach() > per_token.detach()).to(torch.float32), action_mask)
        per_token = torch.maximum(per_token, clipped)
    per_token = zero_where_not(action_mask, per_token)
    loss = agg.reduce(per_token, action_mask)
    err = (g - v).detach().to(torch.float32)
    stats = {
        "value/clip_frac": clipped_frac,
        "value/mean_abs_err": masked_mean(err.abs(), action_mask),
        "value/explained_var": explained_variance(g, v, action_mask),
    }
    return ValueLossOutput(loss, per_token, stats)


def mse_value_loss(
    values: torch.Tensor, returns: torch.Tensor, action_mask: torch.Tensor, *, agg: AggSpec = TOKEN_MEAN
) -> ValueLossOutput:
    """Unclipped ``1/2 agg((V - G)^2)`` (IMPALA's baseline loss, docs/formulas.md#v-trace)."""
    return clipped_value_loss(values, None, returns, action_mask, clip_eps=None, agg=agg)


def huber_value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    huber_delta: float = 1.0,
    agg: AggSpec = TOKEN_MEAN,
) -> ValueLossOutput:
    """Unclipped Huber loss ``agg(huber_delta(V - G))``."""
    return clipped_value_loss(values, None, returns, action_mask, clip_eps=None, kind="huber",
                              huber_delta=huber_delta, agg=agg)
