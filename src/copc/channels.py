"""The two channels of an actor-critic update, as configs, and the dispatch the trainer calls.

Every method is a *policy channel* (which ratio, clip, mask or weight multiplies the actor's per-token
term) plus an *advantage channel* (how advantages and critic targets come from rewards, values and the
behaviour ratio ``w = exp(old - mu)``), plus an optional critic (spec/algorithms.md, "Decisions").
The trainer calls, once per step and per (micro-)batch::

    adv = compute_advantages(method.advantage, rewards=..., values=..., log_w=..., action_mask=...)
    n = count_loss_tokens(method.policy, logp_old=..., logp_behav=..., action_mask=...)  # per micro-batch,
                                                                                       # summed = global
    out = policy_loss(method.policy, logp=..., logp_old=..., logp_behav=..., advantages=adv.advantages,
                      action_mask=..., num_tokens=N_global, num_seqs=S_global)
    vl = value_loss(method.critic, values=..., values_old=..., returns=adv.returns, action_mask=...,
                    num_tokens=N_global)

Names in configs are checked against the registries (``POLICY_OBJECTIVES``, ``ADVANTAGE_ESTIMATORS``,
``VALUE_LOSSES``) when the config is built (a typo fails at start-up with the valid names); dispatch
goes through registry entries that all share one signature, so no caller compares names. ``needs_old_forward`` / ``needs_critic`` tell the trainer what to compute.

The code lives in one module per channel, each holding its config, its registry and the registry's
entries (so a config is always validated against the full registry): :mod:`copc.policy_channel`
(:class:`PolicyChannelConfig`, :func:`policy_loss`, :func:`count_loss_tokens`),
:mod:`copc.advantage_channel` (:class:`AdvantageChannelConfig`, :func:`compute_advantages`) and
:mod:`copc.critic_loss` (:class:`CriticConfig`, :func:`value_loss`). This module re-exports them, so
callers import everything from here.
"""

from __future__ import annotations

from copc.advantage_channel import (
    ADVANTAGE_ESTIMATORS,
    AdvantageChannelConfig,
    AdvantageEstimator,
    AdvantageInputs,
    AdvantageResult,
    compute_advantages,
)
from copc.critic_loss import VALUE_LOSSES, CriticConfig, ValueLossResult, value_loss

# Also importable from here, outside __all__ (as before the split).
from copc.critic_loss import ValueInputs as ValueInputs
from copc.policy_channel import (
    POLICY_OBJECTIVES,
    PolicyChannelConfig,
    PolicyInputs,
    PolicyLossResult,
    PolicyObjective,
    count_loss_tokens,
    policy_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "POLICY_OBJECTIVES",
    "VALUE_LOSSES",
    "AdvantageChannelConfig",
    "AdvantageEstimator",
    "AdvantageInputs",
    "AdvantageResult",
    "CriticConfig",
    "PolicyChannelConfig",
    "PolicyInputs",
    "PolicyLossResult",
    "PolicyObjective",
    "ValueLossResult",
    "compute_advantages",
    "count_loss_tokens",
    "policy_loss",
    "value_loss",
]
