"""Group baselines: per-sequence group-relative advantages (GRPO, Dr. GRPO, RLOO) and their broadcast.

Sequence-level, critic-free: ``scores: [B] float32`` per sequence in, ``[B]`` advantages out, then
copied onto the action tokens of each row. Re-exported by :mod:`copc.ops.advantages`.
"""

from __future__ import annotations

from typing import Literal

import torch

from copc.ops.masked import check_mask
from copc.ops.scans import check_float32

__all__ = ["GroupMode", "broadcast_to_tokens", "group_advantages"]

GroupMode = Literal["grpo", "drgrpo", "rloo"]


def group_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, *, mode: GroupMode, eps: float = 1e-6
) -> torch.Tensor:
    """Per-sequence group-relative advantages. ``scores: [B] float32``, ``group_ids: [B]`` integer.

    ::

        grpo:    (R_i - mean_g) / (std_g + eps)     (Bessel-corrected std, as torch.std / verl)
        drgrpo:  R_i - mean_g                       (Dr. GRPO: no std division)
        rloo:    R_i - (sum_g - R_i) / (n_g - 1)    (leave-one-out mean)

    A group of one sequence has no baseline: its advantage is 0 in every mode. Returns ``[B] float32``.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be [B], got shape {tuple(scores.shape)}")
    check_float32("scores", scores)
    if group_ids.shape != scores.shape or group_ids.is_floating_point():
        raise ValueError(f"group_ids must be an integer [B] tensor like scores, got {group_ids.dtype} {tuple(group_ids.shape)}")
    if mode not in ("grpo", "drgrpo", "rloo"):
        raise ValueError(f"unknown group advantage mode {mode!r}; valid: grpo, drgrpo, rloo")
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    zeros = torch.zeros(uniq.numel(), dtype=scores.dtype, device=scores.device)
    count = zeros.index_add(0, inverse, torch.ones_like(scores))
    total = zeros.index_add(0, inverse, scores)
    n_i, sum_i = count[inverse], total[inverse]
    mean_i = sum_i / n_i
    centred = scores - mean_i
    single = n_i < 2
    if mode == "drgrpo":
        adv = centred
    elif mode == "rloo":
        adv = scores - (sum_i - scores) / (n_i - 1).clamp(min=1)
    else:
        sq = zeros.index_add(0, inverse, centred * centred)
        std_i = torch.sqrt(sq[inverse] / (n_i - 1).clamp(min=1))
        adv = centred / (std_i + eps)
    return torch.where(single, torch.zeros_like(adv), adv)


def broadcast_to_tokens(per_seq: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """``per_seq: [B]`` copied onto every action token of its row; exactly 0 elsewhere. ``[B, T]``."""
    check_mask("action_mask", action_mask)
    if per_seq.shape != action_mask.shape[:1]:
        raise ValueError(f"per_seq must be [B] = {tuple(action_mask.shape[:1])}, got {tuple(per_seq.shape)}")
    return torch.where(action_mask, per_seq[:, None], torch.zeros((), dtype=per_seq.dtype))
