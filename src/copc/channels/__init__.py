"""What a method is: the config -> ops dispatch of the two channels and the critic, and the presets.

- :mod:`copc.channels.policy`: the policy channel (which ratio, clip, mask or weight multiplies the
  actor's per-token term);
- :mod:`copc.channels.advantage`: the advantage channel (advantages and critic targets from rewards,
  values and the behaviour ratio);
- :mod:`copc.channels.critic`: the value loss;
- :mod:`copc.channels.methods`: the named presets (ppo, async_ppo, vtrace, dapo, sao, areal, copc ...),
  data over the three configs.
"""

from copc.channels.advantage import (
    ADVANTAGE_ESTIMATORS,
    AdvantageChannelConfig,
    AdvantageEstimator,
    AdvantageInputs,
    AdvantageResult,
    compute_advantages,
)
from copc.channels.critic import VALUE_LOSSES, CriticConfig, ValueInputs, ValueLossResult, value_loss
from copc.channels.methods import METHODS, MethodConfig, get_method, method_names
from copc.channels.policy import (
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
    "METHODS",
    "POLICY_OBJECTIVES",
    "VALUE_LOSSES",
    "AdvantageChannelConfig",
    "AdvantageEstimator",
    "AdvantageInputs",
    "AdvantageResult",
    "CriticConfig",
    "MethodConfig",
    "PolicyChannelConfig",
    "PolicyInputs",
    "PolicyLossResult",
    "PolicyObjective",
    "ValueInputs",
    "ValueLossResult",
    "compute_advantages",
    "count_loss_tokens",
    "get_method",
    "method_names",
    "policy_loss",
    "value_loss",
]
