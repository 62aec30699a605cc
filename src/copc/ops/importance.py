"""Importance ratios, clipping, token and sequence masks, truncated IS, and their diagnostics.

All ratios are computed in float32 from a log-ratio clamped to +-``LOG_RATIO_CLAMP`` (verl clamps to
+-20), so ``exp`` never overflows; outputs are 0 (log-ratio) or 1 (ratio) at positions outside
``action_mask``.
"""

from __future__ import annotations

import torch

from copc.ops.masked import check_bt, check_mask

LOG_RATIO_CLAMP = 20.0


def log_ratio(
    logp_num: torch.Tensor,
    logp_den: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clamp: float = LOG_RATIO_CLAMP,
) -> torch.Tensor:
    """``clamp(logp_num - logp_den, -clamp, clamp)`` on action tokens, 0 elsewhere. ``[B, T] float32``."""
    check_bt("logp_num", logp_num)
    check_bt("logp_den", logp_den, logp_num)
    check_mask("action_mask", action_mask, logp_num)
    diff = (logp_num.float() - logp_den.float()).clamp(-clamp, clamp)
    return torch.where(action_mask, diff, torch.zeros_like(diff))


def ratio_from_log(log_r: torch.Tensor, action_mask: torch.Tensor, *, clamp: float = LOG_RATIO_CLAMP) -> torch.Tensor:
    """``exp(clamp(log_r))`` on action tokens, exactly 1 elsewhere. ``[B, T] float32``."""
    check_mask("action_mask", action_mask, log_r)
    safe = torch.where(action_mask, log_r.float(), torch.zeros_like(log_r, dtype=torch.float32))
    return torch.exp(safe.clamp(-clamp, clamp))
