"""Pure tensor maths of copc: estimators, ratios, masks and losses (torch only).

Every function takes ``[B, T]`` tensors (``B`` sequences, ``T`` tokens) and a bool ``action_mask``
(True on tokens the policy sampled), keyword-only scalars, and returns tensors or named tuples. The
formulas as implemented are in docs/algorithms.md. The three estimators with a fixed public API:

- ``gae(rewards, values, action_mask, *, gamma, lam) -> (advantages, returns)``
- ``vtrace(rewards, values, log_rho, action_mask, *, gamma, lam, rho_bar, c_bar, pg_rho_bar)
  -> (vs, pg_advantages)``
- ``clipped_td(rewards, values, log_rho, action_mask, *, gamma, lam_critic, lam_actor, low, high, ...)
  -> (advantages, returns)``
"""

from copc.ops.advantages import *  # noqa: F403
from copc.ops.advantages import __all__ as _advantages_all
from copc.ops.importance import *  # noqa: F403
from copc.ops.importance import __all__ as _importance_all
from copc.ops.masked import *  # noqa: F403
from copc.ops.masked import __all__ as _masked_all
from copc.ops.policy_losses import *  # noqa: F403
from copc.ops.policy_losses import __all__ as _policy_all
from copc.ops.value_losses import *  # noqa: F403
from copc.ops.value_losses import __all__ as _value_all

__all__ = [
    *_advantages_all,
    *_importance_all,
    *_masked_all,
    *_policy_all,
    *_value_all,
]
