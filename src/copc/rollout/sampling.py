"""The distribution a token is drawn from, and the log-prob recorded for it
(:class:`~copc.rollout.engine.Engine` records exactly this number for every sampled token):

    l = logits(prefix) / tau                                  (float32, tau = temperature > 0)
    keep_k(v) = l[v] >= (k-th largest l)      if top_k > 0    (ties at the threshold are kept)
    p_k = softmax(l restricted to keep_k)
    keep_p(v) = sum of p_k over tokens ranked strictly before v (descending p_k) < top_p
    log mu(v) = l[v] - logsumexp(l over keep_k & keep_p)      (-inf outside the kept set)

so with ``top_k = 0`` and ``top_p = 1`` the behaviour log-prob is ``log_softmax(l)``, the same number
``copc.models.token_logprobs(..., temperature=tau)`` gives in a teacher-forced pass. The sampled token
is the inverse CDF (in vocabulary order) of ``mu`` at a uniform draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SamplingConfig", "sample_inverse_cdf", "truncated_logprobs"]


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn (see the module docstring for the exact distribution)."""

    temperature: float = 1.0
    """tau > 0: logits are divided by it before softmax. Greedy decoding is ``top_k=1``."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 keeps every token."""
    top_k: int = 0
    """Keep the k most likely tokens (ties kept); 0 keeps every token."""
    max_new_tokens: int = 64
    """Most tokens generated per row per call (a per-row override can only be given per call)."""
    stop_strings: tuple[str, ...] = ()
    """A row stops when the text it generated in this call ends with one of these (kept in the text)."""
    ignore_eos: bool = False
    """Keep sampling after EOS (benchmarks only: fixed lengths)."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (got {self.temperature}); for greedy use top_k=1")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p}); 1 disables nucleus sampling")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (got {self.top_k}); 0 disables top-k")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        if not isinstance(self.stop_strings, tuple) or any(not s for s in self.stop_strings):
            raise ValueError(f"stop_strings must be a tuple of non-empty strings (got {self.stop_strings!r})")


def truncated_logprobs(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """log mu over the vocabulary after temperature, top-k and top-p (module docstring formulas).

    Args:
        logits: ``[N, V]`` any float dtype.
        temperature: tau > 0.
        top_k: 0 = off, else keep tokens whose scaled logit >= the k-th largest.
        top_p: in (0, 1]; 1 = off.

    Returns:
        ``[N, V] float32``, renormalised over the kept tokens, ``-inf`` elsewhere (at least the most
        likely token is always kept).
    """
    scaled = logits.float() / temperature
    neg_inf = torch.full_like(scaled, float("-inf"))
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = torch.where(scaled >= kth, scaled, neg_inf)
    if top_p < 1.0:
        probs = torch.softmax(scaled, dim=-1)
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        keep_sorted = mass_before < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        scaled = torch.where(keep, scaled, neg_inf)
    return torch.log_softmax(scaled, dim=-1)


def sample_inverse_cdf(logp: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token whose CDF interval (vocabulary order) contains ``u``: first v with cdf(v) > u * cdf(V-1).

    The CDF is accumulated in float64. The first v where the CDF rises has probability > 0, so an
    excluded token is never drawn; when rounding puts ``u * cdf(V-1)`` at the very top, the last
    token with probability > 0 is taken (the interval that ``u -> 1`` belongs to).

    Args:
        logp: ``[N, V] float32`` log-probabilities (``-inf`` = excluded).
        uniforms: ``[N]`` in [0, 1).

    Returns:
        ``[N] int64``.
    """
    probs = logp.double().exp()
    cdf = torch.cumsum(probs, dim=-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    first_above = (cdf <= target).sum(dim=-1)
    last_positive = probs.shape[-1] - 1 - (probs > 0).flip(-1).long().argmax(dim=-1)
    return torch.minimum(first_above, last_positive)
