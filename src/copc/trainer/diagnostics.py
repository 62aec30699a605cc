"""What the trainer reports about a batch: step-start diagnostics and the ratio statistics of ``cur / mu``.

Notation as in :mod:`copc.trainer.trainer`. Metric names are the :mod:`copc.tracking` constants (the
``ratio/...`` keys come from :func:`copc.ops.importance_diagnostics`, checked against them in tests).
"""

from __future__ import annotations

import torch

from copc import tracking as m
from copc.ops import explained_variance, importance_diagnostics, log_ratio, masked_mean, zero_where_not
from copc.trainer.batching import TrainBatch

__all__ = ["current_ratio_stats", "step_diagnostics"]


@torch.no_grad()
def step_diagnostics(
    batch: TrainBatch, *, loss_mask: torch.Tensor, returns: torch.Tensor, values_old: torch.Tensor, log_w: torch.Tensor
) -> dict[str, float]:
    """Step-start diagnostics of the batch (spec 9.5, step 6), before any update (``[B, T]`` tensors).

    - ``critic/explained_var = 1 - Var(G - V_old) / Var(G)`` over loss tokens;
    - ``critic/value_bias`` ``b = E_pi[R] - E_mu[R]`` and ``critic/value_bias_gap`` ``g = |v1 - E_pi[R]|``
      (BRACE eq. 7) with ``E_pi[R] = sum_i W_i R_i / sum_i W_i``, ``W_i = exp(sum_t log w_it)`` (self-
      normalised, computed as a softmax in log space) and ``v1`` the batch mean of V at each row's first
      action token;
    - ``rollout/entropy_mc``: mean ``-log mu`` over loss tokens, a Monte-Carlo estimate of the behaviour
      policy's per-token entropy (entropy collapse shows here without a vocabulary-wide pass);
    - realized staleness is computed by the driver, which knows the consuming version.
    """
    mask = loss_mask
    rows = mask.any(dim=-1)
    out: dict[str, float] = {
        m.REWARD_MEAN: float(batch.scores.mean()),
        m.BATCH_ACTION_TOKENS: float(batch.num_action_tokens),
        m.BATCH_SEQUENCES: float(batch.batch_size),
        m.BATCH_TRUNCATED_FRAC: float(batch.truncated.float().mean()),
    }
    # Undefined when the targets do not vary (e.g. every reward 0): reported as 0 (ops.explained_variance).
    out[m.CRITIC_EXPLAINED_VAR] = float(explained_variance(returns, values_old, mask))
    out[m.CRITIC_VALUES_MEAN] = float(masked_mean(values_old, mask))
    out[m.CRITIC_RETURNS_MEAN] = float(masked_mean(returns, mask))
    # -log mu of the sampled tokens averages to mu's entropy (free, unlike the vocabulary-wide entropy)
    out[m.ROLLOUT_ENTROPY_MC] = float(masked_mean(-batch.logp_behav, mask))
    if bool(rows.any()):
        seq_log_w = zero_where_not(batch.action_mask, log_w).sum(dim=-1)[rows]
        weights = torch.softmax(seq_log_w.double(), dim=0)
        scores = batch.scores[rows].double()
        e_pi = float((weights * scores).sum())
        first = batch.action_mask.float().argmax(dim=-1)[rows]
        v1 = float(values_old[rows].gather(1, first[:, None]).mean())
        out[m.CRITIC_VALUE_BIAS] = e_pi - float(scores.mean())
        out[m.CRITIC_VALUE_BIAS_GAP] = abs(v1 - e_pi)
    return out


@torch.no_grad()
def current_ratio_stats(
    logp: torch.Tensor, logp_behav: torch.Tensor, loss_mask: torch.Tensor, *, clip_low: float, clip_high: float
) -> dict[str, float]:
    """``ratio/...`` statistics of ``log(cur / mu)`` (``[b, T]`` rows of one minibatch), for methods without
    an ``old`` forward.

    Their ``old := mu`` makes ``log w = 0`` (ESS 1, KL 0) whatever the staleness; measured before the
    minibatch's optimizer step, ``cur`` is the step-start policy, so these are the statistics ``old / mu``
    would have had on these rows (issue 10 defect 5).
    """
    stats = importance_diagnostics(log_ratio(logp, logp_behav, loss_mask), loss_mask, clip_low=clip_low, clip_high=clip_high)
    return {k: float(v) for k, v in stats.items()}
