"""Reward shaping applied to a finished episode's reward before any estimator reads it.

**Soft overlong punishment** (DAPO, Yu et al. 2025, arXiv 2503.14476, eq. 13; docs/formulas.md#dapo). With
``L_max`` the generation budget and ``L_cache`` the punishment interval below it, a response of
``|y|`` generated tokens gets, on top of its correctness reward::

    R_len(y) = 0                                    if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
             = -1                                   if |y| > L_max

times ``factor`` (verl's ``overlong_buffer.penalty_factor``; 1 in the paper). The paper used
``L_max = 20480``, ``L_cache = 4096``; copc scales both to the task's budget (``L_max`` = the rollout's
``max_total_tokens``, ``L_cache = L_max // 5``, the paper's ratio), see
:class:`copc.rollout.generator.OverlongShapingConfig`. Reference code: verl
``workers/reward_manager/dapo.py`` (the same line, without the ``-1`` branch because verl never
generates past ``L_max``) and AReaL ``functional.py::reward_overlong_penalty``.
"""

from __future__ import annotations

__all__ = ["overlong_penalty"]


def overlong_penalty(length: int, *, max_len: int, cache_len: int, factor: float = 1.0) -> float:
    """DAPO's ``R_len`` (module docstring) of a response of ``length`` generated tokens; <= 0.

    Args:
        length: ``|y|``, tokens the policy generated (tool output and prompt excluded).
        max_len: ``L_max`` (>= 1).
        cache_len: ``L_cache``, the punishment interval (1 <= cache_len <= max_len).
        factor: scale of the penalty (>= 0); the penalty reaches ``-factor`` at ``L_max``.
    """
    if max_len < 1 or not 1 <= cache_len <= max_len:
        raise ValueError(f"overlong_penalty needs 1 <= cache_len <= max_len, got cache_len={cache_len}, "
                         f"max_len={max_len}")
    if factor < 0:
        raise ValueError(f"overlong_penalty factor must be >= 0, got {factor}")
    if length < 0:
        raise ValueError(f"overlong_penalty: length must be >= 0, got {length}")
    expected = max_len - cache_len
    if length <= expected:
        return 0.0
    if length <= max_len:
        return factor * (expected - length) / cache_len
    return -factor
