"""Slow per-token Python loops for every actor and critic loss: the oracles of tests/ops.

Each function walks the batch token by token in Python floats (double precision), straight from the
formulas of docs/formulas.md, with no tensor ops shared with src/copc. Returns ``(loss, per_token)``
where ``per_token`` is a nested list ``[B][T]`` (0.0 outside the mask / on masked-out tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

CLAMP = 20.0


def _lists(*tensors: torch.Tensor | None) -> list[list[list[float]] | None]:
    return [None if t is None else t.detach().double().tolist() for t in tensors]


def _ratio(num: float, den: float) -> float:
    return math.exp(max(-CLAMP, min(CLAMP, num - den)))


def ppo_term(u: float, a: float, clip_low: float, clip_high: float, dual: float | None) -> float:
    """max(-A u, -A clip(u)), then min with -A c_dual when A < 0 (docs/formulas.md#ppo)."""
    clipped_u = min(max(u, 1.0 - clip_low), 1.0 + clip_high)
    term = max(-a * u, -a * clipped_u)
    if dual is not None and a < 0:
        term = min(term, -a * dual)
    return term


def aggregate(
    per_token: list[list[float]],
    counted: list[list[bool]],
    mode: str,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_length: float | None = None,
) -> float:
    """The four aggregation modes of docs/formulas.md#notation, written out with loops."""
    rows = len(per_token)
    if mode == "token-mean":
        total = sum(per_token[b][t] for b in range(rows) for t in range(len(per_token[b])) if counted[b][t])
        n = sum(sum(1 for c in row if c) for row in counted) if num_tokens is None else num_tokens
        return total / max(n, 1)
    seq_values = []
    for b in range(rows):
        n_b = sum(1 for c in counted[b] if c)
        if n_b == 0:
            continue
        s = sum(per_token[b][t] for t in range(len(per_token[b])) if counted[b][t])
        seq_values.append(s / n_b if mode == "seq-mean-token-mean" else s)
    seqs = len(seq_values) if num_seqs is None else num_seqs
    total = sum(seq_values) / max(seqs, 1)
    if mode == "seq-mean-token-sum-norm":
        length = len(per_token[0]) if norm_length is None else norm_length
        return total / length
    return total


WeightRule = Callable[[float, float, float], tuple[float, bool]]
"""(cur, old, mu) -> (omega, kept)."""


def weighted_ppo(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    rule: WeightRule | None = None,
    logp_behav: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual: float | None = None,
    mode: str = "token-mean",
    denominator: str = "all",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[float, list[list[float]]]:
    """l_t = omega_t * ppo_term(exp(cur - old), A); omega from ``rule`` (default 1)."""
    cur, old, adv, mu = _lists(logp, logp_old, advantages, logp_behav)
    m = mask.tolist()
    per_token = [[0.0] * len(row) for row in m]
    counted = [[False] * len(row) for row in m]
    for b, row in enumerate(m):
        for t, valid in enumerate(row):
            if not valid:
                continue
            omega, kept = (1.0, True) if rule is None else rule(cur[b][t], old[b][t], mu[b][t])
            counted[b][t] = kept or denominator == "all"
            if kept:
                u = _ratio(cur[b][t], old[b][t])
                per_token[b][t] = omega * ppo_term(u, adv[b][t], clip_low, clip_high, dual)
    return aggregate(per_token, counted, mode, num_tokens, num_seqs), per_token


def rule_decoupled(cap: float, cap_mode: str) -> WeightRule:
    """AReaL: w = old/mu; mask (w > cap -> 0) or clip (min(w, cap), TIS)."""

    def rule(cur: float, old: float, mu: float) -> tuple[float, bool]:
        w = _ratio(old, mu)
        if cap_mode == "clip":
            return min(w, cap), True
        return (w, True) if w <= cap else (0.0, False)

    return rule


def rule_band(low: float, high: float, *, binary: bool, select_current: bool,
              weight_current: bool) -> WeightRule:
    """COPC / IcePop: M = 1[low <= s <= high], s = old/mu or cur/mu; omega = M*w (or M)."""

    def rule(cur: float, old: float, mu: float) -> tuple[float, bool]:
        s = _ratio(cur if select_current else old, mu)
        w = _ratio(cur if weight_current else old, mu)
        if low <= s <= high:
            return (1.0 if binary else w), True
        return 0.0, False

    return rule


def dis(
    logp: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float,
    high: float,
    mode: str = "token-mean",
    denominator: str = "all",
    num_tokens: float | None = None,
) -> tuple[float, list[list[float]]]:
    """SAO: l_t = -r_t A_t if low < r_t < high (strict) else 0; r = exp(cur - mu)."""
    cur, mu, adv = _lists(logp, logp_behav, advantages)
    m = mask.tolist()
    per_token = [[0.0] * len(row) for row in m]
    counted = [[False] * len(row) for row in m]
    for b, row in enumerate(m):
        for t, valid in enumerate(row):
            if not valid:
                continue
            r = _ratio(cur[b][t], mu[b][t])
            kept = low < r < high
            counted[b][t] = kept or denominator == "all"
            if kept:
                per_token[b][t] = -r * adv[b][t]
    return aggregate(per_token, counted, mode, num_tokens), per_token


def pg(
    logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, mode: str = "token-mean"
) -> tuple[float, list[list[float]]]:
    """l_t = -A_t * cur_t."""
    cur, adv = _lists(logp, advantages)
    m = mask.tolist()
    per_token = [[(-adv[b][t] * cur[b][t]) if m[b][t] else 0.0 for t in range(len(m[b]))] for b in range(len(
        m))]
    return aggregate(per_token, m, mode), per_token


def value(
    values: torch.Tensor,
    values_old: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float | None,
    kind: str = "mse",
    delta: float = 1.0,
    mode: str = "token-mean",
) -> tuple[float, list[list[float]]]:
    """max(f(V - G), f(V_clip - G)) with f = d^2/2 or Huber(delta)."""

    def f(d: float) -> float:
        if kind == "mse" or abs(d) <= delta:
            return 0.5 * d * d
        return delta * (abs(d) - 0.5 * delta)

    v, v_old, g = _lists(values, values_old, returns)
    m = mask.tolist()
    per_token = [[0.0] * len(row) for row in m]
    for b, row in enumerate(m):
        for t, valid in enumerate(row):
            if not valid:
                continue
            loss = f(v[b][t] - g[b][t])
            if clip_eps is not None:
                v_clip = v_old[b][t] + min(max(v[b][t] - v_old[b][t], -clip_eps), clip_eps)
                loss = max(loss, f(v_clip - g[b][t]))
            per_token[b][t] = loss
    return aggregate(per_token, m, mode), per_token
