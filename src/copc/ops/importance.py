"""Importance ratios, clipping, token and sequence masks, truncated IS, and their diagnostics.

Notation: ``B`` sequences, ``T`` tokens. ``action_mask: [B, T] bool`` is True on tokens the policy
sampled. A log-ratio ``log_r = logp_other - logp_sample`` defines the ratio ``r = pi_other / pi_sample``
of a policy ``pi_other`` (e.g. the proximal policy ``old``) to the policy that sampled the token
(e.g. the behaviour policy ``mu``), so that ``E_sample[r] = 1`` (docs/formulas.md#notation, #masks,
#one-step).

All ratios are computed in float32 from a log-ratio clamped to +-``LOG_RATIO_CLAMP`` (verl clamps to
+-20), so ``exp`` never overflows; outputs are 0 (log-ratio) or 1 (ratio) at positions outside
``action_mask``. Weights, masks and diagnostics are detached: no gradient flows through them.
Diagnostics return 0-d float32 tensors (never ``.item()``), so callers decide when to synchronise.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from copc.ops.masked import at_least_float32, check_bt, check_mask, masked_mean, zero_where_not

__all__ = [
    "LOG_RATIO_CLAMP",
    "ClipFractions",
    "KLEstimates",
    "band_mask",
    "clip_fractions",
    "clip_ratio",
    "importance_diagnostics",
    "k3_from_log",
    "kl_estimators",
    "log_ratio",
    "mask_fraction",
    "mean_abs_log_ratio",
    "ratio_from_log",
    "sequence_band_mask",
    "sequence_ess",
    "sequence_log_weights",
    "token_ess",
    "truncated_is",
]

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
    diff = (at_least_float32(logp_num) - at_least_float32(logp_den)).clamp(-clamp, clamp)
    return torch.where(action_mask, diff, torch.zeros_like(diff))


def ratio_from_log(log_r: torch.Tensor, action_mask: torch.Tensor, *,
                   clamp: float = LOG_RATIO_CLAMP) -> torch.Tensor:
    """``exp(clamp(log_r))`` on action tokens, exactly 1 elsewhere. ``[B, T] float32``."""
    check_mask("action_mask", action_mask, log_r)
    log_r = at_least_float32(log_r)
    safe = torch.where(action_mask, log_r, torch.zeros_like(log_r))
    return torch.exp(safe.clamp(-clamp, clamp))


def _check_bounds(low: float, high: float, what: str) -> None:
    if math.isnan(low) or math.isnan(high) or low > high:
        raise ValueError(f"{what} needs low <= high (inf allowed), got low={low}, high={high}")


def clip_ratio(ratio: torch.Tensor, action_mask: torch.Tensor, *, low: float, high: float) -> torch.Tensor:
    """Two-sided clip ``clip(w, low, high)`` on action tokens, 1 elsewhere; detached ``[B, T] float32``.

    ``low``/``high`` bound the ratio itself (e.g. 0.8, 1.2 for ``1 - eps^-``, ``1 + eps^+``); either may
    be infinite (``-inf``/``0`` for no lower clip, ``inf`` for none above).
    """
    check_bt("ratio", ratio)
    check_mask("action_mask", action_mask, ratio)
    _check_bounds(low, high, "clip_ratio")
    clipped = ratio.detach().float().clamp(min=low, max=high)
    return torch.where(action_mask, clipped, torch.ones_like(clipped))


def band_mask(ratio: torch.Tensor, action_mask: torch.Tensor, *, low: float, high: float) -> torch.Tensor:
    """Token mask ``M_t = 1[low <= w_t <= high]`` (inclusive bounds, inf allowed) on action tokens.

    Returns ``[B, T] bool``: True where the token is an action token inside the band (docs/formulas.md#r0
    ``M_t``); False on non-action tokens. A NaN ratio is outside every band.
    """
    check_bt("ratio", ratio)
    check_mask("action_mask", action_mask, ratio)
    _check_bounds(low, high, "band_mask")
    w = ratio.detach()
    return action_mask & (w >= low) & (w <= high)


def sequence_log_weights(log_r: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """``L_i = sum_t clamp(log_r_it)`` over action tokens: the log of ``W_i = prod_t w_it``. ``[B] float32``.

    Summed in float64 (thousands of terms) and returned as float32.
    """
    check_bt("log_r", log_r)
    check_mask("action_mask", action_mask, log_r)
    clamped = log_r.detach().double().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return zero_where_not(action_mask, clamped).sum(dim=-1).float()


def sequence_band_mask(
    log_r: torch.Tensor, action_mask: torch.Tensor, *, low: float, high: float
) -> torch.Tensor:
    """Sequence mask from the geometric mean ``g_i = exp(mean_t log w_it)`` over action tokens (Geo-RS).

    Returns ``[B] bool``: True where ``low <= g_i <= high``. The geometric mean is length-invariant,
    unlike the product (docs/formulas.md#masks). A row without action tokens is kept (True: nothing to
    reject). Broadcast to tokens with ``action_mask & keep[:, None]``.
    """
    _check_bounds(low, high, "sequence_band_mask")
    count = action_mask.sum(dim=-1)
    geo = torch.exp(sequence_log_weights(log_r, action_mask) / count.clamp(min=1).to(torch.float32))
    return ((geo >= low) & (geo <= high)) | (count == 0)


def truncated_is(ratio: torch.Tensor, action_mask: torch.Tensor, *, cap: float) -> torch.Tensor:
    """Truncated importance weight ``min(w, C)`` (TIS) on action tokens, 1 elsewhere; detached ``[B, T]``."""
    if not cap > 0:
        raise ValueError(f"truncated_is cap must be > 0 (e.g. 2.0), got {cap}")
    return clip_ratio(ratio, action_mask, low=-math.inf, high=cap)


def token_ess(ratio: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Normalised token effective sample size ``(sum w)^2 / (N sum w^2)`` over action tokens, in (0, 1].

    ``w`` unclipped, float32; 1 when there is no action token (nothing degenerate to report).
    """
    check_bt("ratio", ratio)
    check_mask("action_mask", action_mask, ratio)
    return _token_ess_of(zero_where_not(action_mask, ratio.detach().float()), action_mask.sum())


def _token_ess_of(w: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Token ESS from weights ``w`` that are already 0 off the action tokens, and their ``count``."""
    n = count.to(torch.float32)
    sum_sq = (w * w).sum()
    ess = w.sum() ** 2 / (n * sum_sq).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.where(n > 0, ess, torch.ones_like(ess))


def sequence_ess(log_r: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Sequence ESS ``(sum_i W_i)^2 / (B' sum_i W_i^2)`` with ``W_i = exp(sum_t log w_it)`` (VCPO).

    Computed in log space: with ``m = max_i L_i`` the ratio is unchanged by ``W_i -> exp(L_i - m)``, so
    products of thousands of ratios neither overflow nor underflow (the largest shifted weight is 1).
    ``B'`` counts rows with at least one action token; 1 when there is none.
    """
    check_bt("log_r", log_r)
    check_mask("action_mask", action_mask, log_r)
    clamped = log_r.detach().double().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return _sequence_ess_of(zero_where_not(action_mask, clamped).sum(dim=-1), action_mask)


def _sequence_ess_of(seq_log: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Sequence ESS from the float64 per-row log-weights ``L_i`` (``[B]``)."""
    has_tokens = action_mask.any(dim=-1)
    n_rows = has_tokens.sum().to(torch.float64)
    kept = torch.where(has_tokens, seq_log, torch.full_like(seq_log, -math.inf))
    top = torch.where(has_tokens.any(), kept.max(), torch.zeros((), dtype=torch.float64))
    shifted = torch.exp(kept - top)  # exactly 0 for rows without tokens
    ess = shifted.sum() ** 2 / (n_rows * (shifted * shifted).sum()).clamp(min=1e-300)
    return torch.where(n_rows > 0, ess, torch.ones_like(ess)).float()


def mask_fraction(keep_mask: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Fraction of action tokens that ``keep_mask`` removes (``ratio/mask_frac``); 0 with no tokens."""
    check_mask("keep_mask", keep_mask)
    check_mask("action_mask", action_mask, keep_mask)
    return _fraction(~keep_mask, action_mask, action_mask.sum())


def _fraction(selected: torch.Tensor, action_mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Share of the ``count`` action tokens where ``selected`` holds; 0 with none. 0-d float32.

    An integer count divided once: the same value as ``masked_mean(selected.float(), action_mask)``
    (float32 sums of 0/1 are exact below 2^24 tokens) without a float copy and a masked pass.
    """
    hits = (selected & action_mask).sum().to(torch.float32)
    return hits / count.clamp(min=1).to(torch.float32)


class ClipFractions(NamedTuple):
    """Fractions of action tokens clipped from below (``w < low``) and from above (``w > high``)."""

    low: torch.Tensor
    high: torch.Tensor


def clip_fractions(
    ratio: torch.Tensor, action_mask: torch.Tensor, *, low: float, high: float
) -> ClipFractions:
    """Fractions of action tokens with ``w < low`` and with ``w > high``, separately. 0-d float32 each."""
    check_bt("ratio", ratio)
    check_mask("action_mask", action_mask, ratio)
    _check_bounds(low, high, "clip_fractions")
    w = ratio.detach()
    count = action_mask.sum()
    return ClipFractions(low=_fraction(w < low, action_mask, count), high=_fraction(w > high, action_mask,
                                                                                    count))


def mean_abs_log_ratio(log_r: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """``mean_t |log w_t|`` over action tokens (log-ratio clamped to +-20); 0 with no tokens."""
    check_bt("log_r", log_r)
    check_mask("action_mask", action_mask, log_r)
    clamped = log_r.detach().float().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return masked_mean(clamped.abs(), action_mask)


def _clean(log_r: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """``clamp(log_r, +-20)`` on action tokens, exactly 0 elsewhere; detached float32 (a fresh tensor)."""
    return zero_where_not(action_mask, log_r.detach().float()).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _mean_of(values: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``masked_mean`` for ``values`` already 0 off the mask, given the mask's ``count``."""
    return values.sum() / count.clamp(min=1).to(values.dtype)


class KLEstimates(NamedTuple):
    """Token means of the k1/k2/k3 estimators of ``KL(pi_sample || pi_other)`` (Schulman's notation)."""

    k1: torch.Tensor
    k2: torch.Tensor
    k3: torch.Tensor


def k3_from_log(log_r: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator ``r - 1 - log r = expm1(log r) - log r >= 0`` (Schulman's approx KL).

    ``log_r: [B, T]`` a clean log-ratio (clamped, 0 off the action tokens: :func:`log_ratio`), so the
    result is 0 off the action tokens. Elementwise; the gradient flows when ``log_r`` carries one.
    """
    return torch.expm1(log_r) - log_r


def kl_estimators(log_r: torch.Tensor, action_mask: torch.Tensor) -> KLEstimates:
    """Means over action tokens of three estimators of ``KL(pi_sample || pi_other)``.

    Convention: ``log_r = log(pi_other / pi_sample)`` at a token drawn from ``pi_sample`` (so
    ``E_sample[r] = 1``). With ``r = exp(log_r)``::

        k1 = -log r                (unbiased, can be negative)
        k2 = 1/2 (log r)^2         (biased, low variance; verl's "k2")
        k3 = r - 1 - log r         (unbiased and >= 0; verl's "k3", the "low_var_kl")

    For ``log_r = old - mu`` this is ``KL(mu || pi_old)``. Log-ratios are clamped to +-20.
    """
    check_bt("log_r", log_r)
    check_mask("action_mask", action_mask, log_r)
    return _kl_of(_clean(log_r, action_mask), action_mask.sum())


def _kl_of(lr: torch.Tensor, count: torch.Tensor) -> KLEstimates:
    """k1/k2/k3 token means from a clean log-ratio (clamped, 0 off the ``count`` action tokens)."""
    k1 = _mean_of(-lr, count)
    k2 = _mean_of(0.5 * lr * lr, count)
    k3 = _mean_of(k3_from_log(lr), count)  # 0 off the mask: expm1(0) - 0
    return KLEstimates(k1=k1, k2=k2, k3=k3)


def importance_diagnostics(
    log_r: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    keep_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """All ratio diagnostics of docs/formulas.md#one-step step 6 as detached 0-d float32 tensors, keyed by
    metric name.

    Args:
        log_r: ``[B, T] float32`` log-ratio ``log(pi_other / pi_sample)`` (e.g. ``old - mu``).
        action_mask: ``[B, T] bool``.
        clip_low, clip_high: the advantage-channel clip band on the ratio (for clip rates).
        keep_mask: optional ``[B, T] bool`` policy-channel mask (True = token kept) for ``mask_frac``.

    Keys: ``ratio/ess_tok``, ``ratio/ess_seq``, ``ratio/clip_low_frac``, ``ratio/clip_high_frac``,
    ``ratio/mean_abs_log``, ``ratio/kl_k1``, ``ratio/kl_k2``, ``ratio/kl_k3`` and, with ``keep_mask``,
    ``ratio/mask_frac``.
    """
    check_bt("log_r", log_r)
    check_mask("action_mask", action_mask, log_r)
    # One masked, clamped float32 copy of the log-ratio feeds every statistic (each public function
    # above would mask and clamp again): for float32 inputs the values equal calling them one by one
    # bit for bit (tested); wider inputs are rounded to float32 first.
    lr = _clean(log_r, action_mask)
    count = action_mask.sum()
    ratio = torch.exp(lr)  # == ratio_from_log(log_r, action_mask): 1 off the mask
    clips = clip_fractions(ratio, action_mask, low=clip_low, high=clip_high)
    kl = _kl_of(lr, count)
    stats = {
        "ratio/ess_tok": _token_ess_of(zero_where_not(action_mask, ratio), count),
        "ratio/ess_seq": _sequence_ess_of(lr.sum(dim=-1, dtype=torch.float64), action_mask),
        "ratio/clip_low_frac": clips.low,
        "ratio/clip_high_frac": clips.high,
        "ratio/mean_abs_log": _mean_of(lr.abs(), count),
        "ratio/kl_k1": kl.k1,
        "ratio/kl_k2": kl.k2,
        "ratio/kl_k3": kl.k3,
    }
    if keep_mask is not None:
        stats["ratio/mask_frac"] = mask_fraction(keep_mask, action_mask)
    return stats
