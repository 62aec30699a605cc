"""Advantage estimators without a clipped correction: GAE, V-trace, group baselines, reward folding.

Notation: ``B`` sequences, ``T`` token positions, ``action_mask: [B, T] bool`` True on tokens the policy
sampled (prompt and tool-output tokens False). ``values[b, t]`` is the pre-update ``V(s_t)`` of the state
before token ``t``; ``log_rho = logp_old - logp_behav`` (so ``w = pi_old / mu``). All inputs float32.

Every recursion runs over action tokens only and *bridges* tool-output spans: the value after the last
action token of a turn is the value at the first action token of the next turn (verl multi-turn GAE,
SAO skip-observation). Discounting and every horizon (lam, k, k_A) count action tokens only. The value
after a row's last action token is 0 (terminal) or ``bootstrap_value[b]`` (``truncation = bootstrap``).
Rewards, values and log-ratios at non-action positions are ignored (fold rewards first with
:func:`fold_rewards`); outputs are exactly 0 there. Weights are detached; ratios come from a log-ratio
clamped to +-20, in float32.

This module defines GAE, V-trace, the critic-free group baselines (GRPO, Dr. GRPO, RLOO) and
:func:`fold_rewards`. COPC's ``clipped_td`` and BRACE live in :mod:`copc.ops.corrected_advantages`;
the shared scans, bridge and compaction in :mod:`copc.ops.scans` (how they run is described there).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from copc.ops.masked import check_bt, check_mask
from copc.ops.scans import (
    action_sums,
    check_float32,
    check_lambda,
    clean_log_rho,
    on_actions,
    pack_td,
    reverse_linear_scan,
    shift_left,
    td_residuals,
    truncated_traces,
    unpack,
)

__all__ = [
    "GAEOutput",
    "GroupMode",
    "VTraceOutput",
    "broadcast_to_tokens",
    "fold_rewards",
    "gae",
    "group_advantages",
    "vtrace",
]

GroupMode = Literal["grpo", "drgrpo", "rloo"]


class GAEOutput(NamedTuple):
    advantages: torch.Tensor  # [B, T] float32, 0 off action tokens
    returns: torch.Tensor  # [B, T] float32 critic target G = A + V, 0 off action tokens


class VTraceOutput(NamedTuple):
    vs: torch.Tensor  # [B, T] float32 value targets, 0 off action tokens
    pg_advantages: torch.Tensor  # [B, T] float32 A^pg = pg_rho * pg_td, 0 off action tokens
    pg_rho: torch.Tensor  # [B, T] float32 rho^pg_s = min(pg_rho_bar, w_s), 0 off action tokens
    # [B, T] float32 r_s + gamma v_{s+1} - V(s_s) (A^pg before rho^pg), 0 off action tokens
    pg_td: torch.Tensor


# ----------------------------------------------------------------------------------------------
# Estimators


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    bootstrap_value: torch.Tensor | None = None,
) -> GAEOutput:
    """Generalised advantage estimation over action tokens, bridging tool spans (docs/formulas.md#ppo).

    ::

        delta_t = r_t + gamma V(s_{t+1}) - V(s_t)       (V(s_{T+1}) = 0 or bootstrap_value)
        A_t     = delta_t + gamma lam A_{t+1},  A_{T+1} = 0
        G_t     = A_t + V(s_t)

    Args:
        rewards: ``[B, T] float32`` (already folded onto action tokens).
        values: ``[B, T] float32`` pre-update ``V(s_t)``.
        action_mask: ``[B, T] bool``.
        gamma, lam: discount and GAE lambda in [0, 1].
        bootstrap_value: optional ``[B] float32`` ``V(s_{T+1})`` of truncated rows.

    Returns: ``GAEOutput(advantages, returns)``, both ``[B, T] float32``, 0 off action tokens.
    """
    check_lambda("lam", lam)
    delta = td_residuals(rewards, values, action_mask, gamma=gamma, bootstrap_value=bootstrap_value)
    adv = action_sums(delta, action_mask, gamma * lam).here
    del delta  # fewer live [B, T] temporaries: see benchmarks/ops_bench.py on the allocator
    return GAEOutput(on_actions(action_mask, adv), on_actions(action_mask, adv.add_(values)))


def vtrace(
    rewards: torch.Tensor,
    values: torch.Tensor,
    log_rho: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    rho_bar: float,
    c_bar: float,
    pg_rho_bar: float,
    bootstrap_value: torch.Tensor | None = None,
) -> VTraceOutput:
    """V-trace targets and policy-gradient advantages (IMPALA, arXiv 1802.01561; docs/formulas.md#v-trace).

    ::

        rho_t = min(rho_bar, w_t),   c_t = lam min(c_bar, w_t),   w_t = exp(clamp(log_rho_t))
        v_s - V(s_s) = rho_s delta_s + gamma c_s (v_{s+1} - V(s_{s+1})),   v_{T+1} = V(s_{T+1})
        A^pg_s = min(pg_rho_bar, w_s) (r_s + gamma v_{s+1} - V(s_s))

    Args: as :func:`gae`, plus ``log_rho: [B, T] float32`` ``= logp_old - logp_behav`` (detached).

    Returns: ``VTraceOutput(vs, pg_advantages, pg_rho, pg_td)``, ``[B, T] float32``, 0 off action
    tokens; ``pg_advantages = pg_rho * pg_td`` (the factors are returned so that a normalisation can
    act on ``pg_td`` inside the importance weight, as the baseline ``V(s_s)`` does).
    """
    check_lambda("lam", lam)
    delta = td_residuals(rewards, values, action_mask, gamma=gamma, bootstrap_value=bootstrap_value)
    pk = pack_td(delta, clean_log_rho(log_rho, action_mask, rewards), action_mask)
    rho, trace = truncated_traces(pk, lam=lam, rho_bar=rho_bar, c_bar=c_bar)
    excess = reverse_linear_scan(rho * pk.delta, gamma * trace)  # v_s - V(s_s)
    pg_rho = pk.weight.clamp(max=pg_rho_bar)
    pg_td = pk.delta + gamma * shift_left(excess)
    cp = pk.cp
    vs = on_actions(action_mask, unpack(excess, cp) + values)
    return VTraceOutput(vs, unpack(pg_rho * pg_td, cp), unpack(pg_rho, cp), unpack(pg_td, cp))


# ----------------------------------------------------------------------------------------------
# Rewards


def fold_rewards(token_rewards: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Move every reward onto an action token (docs/formulas.md#notation). ``[B, T] float32`` in and out.

    A reward on a non-action token is added to the nearest *preceding* action token; one before the
    first action token goes to the first action token; a row without action tokens drops its rewards.
    """
    check_bt("token_rewards", token_rewards)
    check_float32("token_rewards", token_rewards)
    check_mask("action_mask", action_mask, token_rewards)
    length = token_rewards.shape[1]
    slots = torch.arange(length, device=token_rewards.device).expand_as(action_mask)
    last_action = torch.where(action_mask, slots, torch.full_like(slots, -1)).cummax(dim=1).values
    first_action = action_mask.long().argmax(dim=1, keepdim=True).expand_as(slots)
    target = torch.where(last_action >= 0, last_action, first_action)
    has_action = action_mask.any(dim=1, keepdim=True)
    kept = torch.where(has_action, token_rewards, torch.zeros_like(token_rewards))
    folded = torch.zeros_like(kept).scatter_add(1, target, kept)
    return torch.where(action_mask, folded, torch.zeros_like(folded))


# ----------------------------------------------------------------------------------------------
# Group baselines: sequence-level, critic-free (``scores: [B] float32`` per sequence in, ``[B]`` out,
# then copied onto the action tokens of each row)


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
        raise ValueError(f"group_ids must be an integer [B] tensor like scores, got {group_ids.dtype} "
                         f"{tuple(group_ids.shape)}")
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
