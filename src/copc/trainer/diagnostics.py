"""What the trainer reports about a batch: step-start diagnostics and the ratio statistics of ``cur / mu``.

Notation as in :mod:`copc.trainer.trainer`. Metric names are the :mod:`copc.tracking` constants (the
``ratio/...`` keys come from :func:`copc.ops.importance_diagnostics`, checked against them in tests).
"""

from __future__ import annotations

import torch

from copc import tracking as m
from copc.ops import explained_variance, importance_diagnostics, log_ratio, masked_mean, zero_where_not
from copc.ops.importance import ratio_from_log, sequence_ess, token_ess
from copc.trainer.batching import Minibatch, TrainBatch

__all__ = ["current_ratio_stats", "minibatch_ess", "step_diagnostics"]


@torch.no_grad()
def step_diagnostics(
    batch: TrainBatch, *, loss_mask: torch.Tensor, returns: torch.Tensor, values_old: torch.Tensor,
    log_w: torch.Tensor,
    critic: bool,
) -> dict[str, float]:
    """Step-start diagnostics of the batch (docs/formulas.md#one-step, step 6), before any update (``[B, T]``
    tensors).

    - ``critic/explained_var = 1 - Var(G - V_old) / Var(G)`` over loss tokens;
    - ``critic/value_bias`` ``b = E_pi[R] - E_mu[R]`` and ``critic/value_bias_gap`` ``g = |v1 - E_pi[R]|``
      (BRACE eq. 7) with ``E_pi[R] = sum_i W_i R_i / sum_i W_i``, ``W_i = exp(sum_t log w_it)`` (self-
      normalised, computed as a softmax in log space) and ``v1`` the batch mean of V at each row's first
      action token;
    - ``rollout/entropy_mc``: mean ``-log mu`` over loss tokens, a Monte-Carlo estimate of the behaviour
      policy's per-token entropy (entropy collapse shows here without a vocabulary-wide pass);
    - realized staleness is computed by the driver, which knows the consuming version.

    Without a critic (``critic=False``) the keys that describe one (explained variance, mean value, the
    bias gap ``g``) are left out rather than reported for an all-zero ``values_old``.
    """
    mask = loss_mask
    rows = mask.any(dim=-1)
    out: dict[str, float] = {
        m.REWARD_MEAN: float(batch.scores.mean()),
        m.REWARD_STD: float(batch.scores.float().std(correction=0)),
        m.BATCH_ACTION_TOKENS: float(batch.num_action_tokens),
        m.BATCH_SEQUENCES: float(batch.batch_size),
        m.BATCH_TRUNCATED_FRAC: float(batch.truncated.float().mean()),
        m.BATCH_VOID_FRAC: float(batch.void.float().mean()),
    }
    # Undefined when the targets do not vary (e.g. every reward 0): reported as 0 (ops.explained_variance).
    if critic:
        out[m.CRITIC_EXPLAINED_VAR] = float(explained_variance(returns, values_old, mask))
        out[m.CRITIC_VALUES_MEAN] = float(masked_mean(values_old, mask))
    out[m.CRITIC_RETURNS_MEAN] = float(masked_mean(returns, mask))
    # -log mu of the sampled tokens averages to mu's entropy (free, unlike the vocabulary-wide entropy)
    out[m.ROLLOUT_ENTROPY_MC] = float(masked_mean(-batch.logp_behav, mask))
    if bool(rows.any()):
        seq_log_w = zero_where_not(batch.action_mask, log_w).sum(dim=-1)[rows]
        weights = torch.softmax(seq_log_w.double(), dim=0)
        # of these weights
        out[m.RATIO_ESS_SEQ_SNIS] = float(sequence_ess(log_w[rows], batch.action_mask[rows]))
        scores = batch.scores[rows].double()
        e_pi = float((weights * scores).sum())
        out[m.CRITIC_VALUE_BIAS] = e_pi - float(scores.mean())
        if critic:
            first = batch.action_mask.float().argmax(dim=-1)[rows]
            v1 = float(values_old[rows].gather(1, first[:, None]).mean())
            out[m.CRITIC_VALUE_BIAS_GAP] = abs(v1 - e_pi)
    return out


@torch.no_grad()
@torch.no_grad()
def minibatch_ess(log_w: torch.Tensor, loss_mask: torch.Tensor,
                  minibatches: list[Minibatch]) -> dict[str, float]:
    """``ratio/ess_tok`` and ``ratio/ess_seq`` of ``log w = old - mu`` per actor minibatch, averaged over
    the minibatches that have loss tokens.

    A normalised ESS depends on how many rows it is taken over (it reads higher on fewer rows when the
    weights are heavy-tailed), and methods without an ``old`` forward can measure it only on their first
    minibatch (:func:`current_ratio_stats`), so every method reports it per minibatch: the effective
    sample size of the rows one actor step sees, on the same footing for both kinds of method. The other
    ``ratio/...`` statistics are means and stay over the whole batch.
    """
    ess_tok, ess_seq = [], []
    for mb in minibatches:
        mask, log_r = loss_mask[mb.index], log_w[mb.index]
        if bool(mask.any()):
            ess_tok.append(float(token_ess(ratio_from_log(log_r, mask), mask)))
            ess_seq.append(float(sequence_ess(log_r, mask)))
    if not ess_tok:
        return {}
    return {m.RATIO_ESS_TOKEN: sum(ess_tok) / len(ess_tok), m.RATIO_ESS_SEQ: sum(ess_seq) / len(ess_seq)}


@torch.no_grad()
def current_ratio_stats(
    logp: torch.Tensor, logp_behav: torch.Tensor, loss_mask: torch.Tensor, *, clip_low: float,
    clip_high: float
) -> dict[str, float]:
    """``ratio/...`` statistics of ``log(cur / mu)`` (``[b, T]`` rows of one minibatch), for methods without
    an ``old`` forward.

    Their ``old := mu`` makes ``log w = 0`` (ESS 1, KL 0) whatever the staleness; measured before the
    minibatch's optimizer step, ``cur`` is the step-start policy, so these are the statistics ``old / mu``
    would have had on these rows.
    """
    stats = importance_diagnostics(log_ratio(logp, logp_behav, loss_mask), loss_mask, clip_low=clip_low,
                                   clip_high=clip_high)
    return {k: float(v) for k, v in stats.items()}
