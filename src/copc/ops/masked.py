"""Masked reductions, whitening and the one loss aggregator.

Notation: ``B`` sequences, ``T`` tokens. ``mask: [B, T] bool`` is True on tokens that count.
Masks are applied with ``torch.where``, never by multiplication, so a NaN or inf at a masked
position never reaches an output or a gradient (``nan * 0 == nan``).
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch

__all__ = [
    "ADVANTAGE_NORMS",
    "LOSS_AGG_MODES",
    "TOKEN_MEAN",
    "AdvantageNorm",
    "AggSpec",
    "LossAgg",
    "agg_loss",
    "at_least_float32",
    "check_bt",
    "check_mask",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "normalize_advantages",
    "zero_where_not",
]

AdvantageNorm = Literal["whiten", "scale", "center", "none"]
ADVANTAGE_NORMS: tuple[str, ...] = get_args(AdvantageNorm)
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAgg)


class AggSpec(NamedTuple):
    """How a per-token loss becomes a scalar: :func:`agg_loss`'s mode and the minibatch's GLOBAL counts.

    Give every micro-batch the counts of its whole minibatch (all micro-batches, all ranks); then the
    micro-batch losses sum to the minibatch loss (gradient accumulation).
    """

    #: token-mean, seq-mean-token-mean, seq-mean-token-sum or seq-mean-token-sum-norm.
    mode: LossAgg = "token-mean"
    #: action tokens of the minibatch (token-mean); None = this batch's own count.
    num_tokens: float | torch.Tensor | None = None
    #: sequences with at least one counted token (seq-* modes); None = this batch's own count.
    num_seqs: float | torch.Tensor | None = None
    #: the constant of seq-mean-token-sum-norm (Dr. GRPO); None = T.
    norm_length: float | None = None

    def reduce(self, loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """:func:`agg_loss` of ``loss`` over ``mask`` with this spec."""
        return agg_loss(
            loss, mask, self.mode, num_tokens=self.num_tokens, num_seqs=self.num_seqs,
            norm_length=self.norm_length
        )


#: The default aggregation: token-mean over this batch's own tokens (no accumulation).
TOKEN_MEAN = AggSpec()


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """float32 for lower precisions; float64 stays float64 (so ``gradcheck`` runs in double precision)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def check_bt(name: str, tensor: torch.Tensor, like: torch.Tensor | None = None) -> None:
    """Fail with a message naming ``name`` unless ``tensor`` is 2-D (and shaped like ``like``)."""
    if tensor.dim() != 2:
        raise ValueError(f"{name} must be [B, T], got shape {tuple(tensor.shape)}")
    if like is not None and tensor.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(like.shape)}")


def check_mask(name: str, mask: torch.Tensor, like: torch.Tensor | None = None) -> None:
    """Fail unless ``mask`` is a ``[B, T] bool`` tensor (shaped like ``like``)."""
    check_bt(name, mask, like)
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be torch.bool (True = token counts), got {mask.dtype}")


def zero_where_not(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask`` is True, exactly 0 elsewhere (NaN-safe, gradient-safe)."""
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` over positions where ``mask`` is True (over all, or along ``dim``)."""
    kept = zero_where_not(mask, values)
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over masked-in positions; 0 (not NaN) where no position counts."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    total = masked_sum(values, mask, dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_var(values: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = True) -> torch.Tensor:
    """Variance over all masked-in positions (Bessel-corrected by default); 0 with fewer than 2 tokens."""
    values = zero_where_not(mask, values)  # a NaN at a masked position must not reach the gradient
    mean = masked_mean(values, mask)
    count = mask.sum().to(values.dtype)
    sq = masked_sum((values - mean) ** 2, mask)
    denom = count - 1 if unbiased else count
    return torch.where(denom > 0, sq / denom.clamp(min=1), torch.zeros_like(sq))


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps: float = 1e-8,
    shift_mean: bool = True,
    std_floor: float = 0.0,
) -> torch.Tensor:
    """``(x - m) * rsqrt(max(v + eps, floor^2))`` with m, v the masked mean and Bessel-corrected variance.

    That is ``(x - m) / max(sqrt(v + eps), std_floor)``: with a floor, a batch whose advantages barely
    vary (every reward equal, only critic noise left) is not blown up to unit scale. Statistics come
    from every masked-in token of the tensor (the whole step's batch: docs/formulas.md#r0); the result is 0 at
    masked-out positions. ``shift_mean=False`` only rescales. ``std_floor = 0``: plain whitening.
    """
    check_mask("mask", mask, values)
    if not std_floor >= 0:
        raise ValueError(f"std_floor must be >= 0 (0 = no floor), got {std_floor}")
    values = zero_where_not(mask, values)  # NaN-safe forward *and* backward at masked positions
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    centred = values - mean if shift_mean else values
    return zero_where_not(mask, centred * torch.rsqrt((var + eps).clamp(min=std_floor * std_floor)))


def normalize_advantages(
    values: torch.Tensor, mask: torch.Tensor, *, mode: AdvantageNorm, std_floor: float = 0.0,
    eps: float = 1e-8
) -> torch.Tensor:
    """Advantage normalisation over the masked-in tokens (the step's batch). ``[B, T]`` in and out.

    ::

        whiten:  (A - m) / max(sqrt(v + eps), std_floor)
        scale:   A / max(sqrt(v + eps), std_floor)          (no mean shift: signs are kept)
        center:  A - m
        none:    A

    m, v: masked mean and Bessel-corrected variance (:func:`masked_whiten`); 0 at masked-out positions.
    """
    check_mask("mask", mask, values)
    if mode == "whiten" or mode == "scale":
        return masked_whiten(values, mask, eps=eps, shift_mean=mode == "whiten", std_floor=std_floor)
    values = zero_where_not(mask, values)
    if mode == "center":
        return zero_where_not(mask, values - masked_mean(values, mask))
    if mode == "none":
        return values
    raise ValueError(f"unknown advantage normalisation {mode!r}; valid: {', '.join(ADVANTAGE_NORMS)}")


def agg_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAgg,
    *,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """The one loss aggregator (verl ``agg_loss``; docs/formulas.md#notation).

    Args:
        loss: ``[B, T] float32`` per-token loss.
        mask: ``[B, T] bool``, tokens in the denominator (e.g. policy tokens *before* a correction mask:
            masked tokens carry ``loss == 0`` but still count, the AReaL convention).
        mode: ``token-mean``: sum / num_tokens. ``seq-mean-token-mean``: mean over sequences of each
            sequence's token mean. ``seq-mean-token-sum``: mean over sequences of each sequence's sum.
            ``seq-mean-token-sum-norm``: total sum / (num_seqs * norm_length) (Dr. GRPO).
        num_tokens: global token count of the minibatch (all micro-batches, all ranks) for
            ``token-mean``; defaults to ``mask.sum()`` (correct only without accumulation).
        num_seqs: global number of sequences with at least one counted token, for the ``seq-*`` modes;
            defaults to the local count.
        norm_length: the constant of ``seq-mean-token-sum-norm``; defaults to T.

    Returns: a scalar. Micro-batches given the same global counts sum to the full-batch value.
    """
    check_bt("loss", loss)
    check_mask("mask", mask, loss)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    kept = zero_where_not(mask, loss)
    if mode == "token-mean":
        denom = mask.sum() if num_tokens is None else num_tokens
        return kept.sum() / torch.as_tensor(denom, dtype=loss.dtype).clamp(min=1)
    seq_has_tokens = mask.any(dim=-1)
    seqs = seq_has_tokens.sum() if num_seqs is None else num_seqs
    seqs_t = torch.as_tensor(seqs, dtype=loss.dtype).clamp(min=1)
    per_seq_sum = kept.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq_sum / mask.sum(dim=-1).clamp(min=1).to(loss.dtype)
        return per_seq.sum() / seqs_t
    if mode == "seq-mean-token-sum":
        return per_seq_sum.sum() / seqs_t
    length = float(loss.shape[-1]) if norm_length is None else norm_length
    return per_seq_sum.sum() / (seqs_t * length)
