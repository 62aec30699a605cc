"""The shared per-token reference loops (``tests/reference/advantages.py``) applied to the lab's rows.

The lab's MDPs have no observation tokens, so every position is a policy token (an all-True mask) and
the terminal value is 0. One oracle per estimator lives in ``reference``; this module only adapts shapes.
"""

from __future__ import annotations

import torch

from reference.advantages import brace_row, clipped_td_row, gae_row, vtrace_row


def _rows(*tensors: torch.Tensor) -> list[list[list[float]]]:
    return [t.double().tolist() for t in tensors]


def _stack(pairs: list[tuple[list[float], list[float]]]) -> tuple[torch.Tensor, torch.Tensor]:
    first = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
    second = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
    return first, second


def gae_loop(rewards, values, *, gamma, lam):
    """GAE over every token of each row; returns (advantages, returns)."""
    r_all, v_all = _rows(rewards, values)
    return _stack([gae_row(r, v, [True] * len(r), gamma, lam) for r, v in zip(r_all, v_all, strict=True)])


def vtrace_loop(rewards, values, log_rho, *, gamma, lam, rho_bar, c_bar, pg_rho_bar):
    """V-trace over every token of each row; returns (vs, pg_advantages)."""
    rows = _rows(rewards, values, log_rho)
    return _stack([
        vtrace_row(r, v, lr, [True] * len(r), gamma=gamma, lam=lam, rho_bar=rho_bar, c_bar=c_bar,
                   pg_rho_bar=pg_rho_bar)
        for r, v, lr in zip(*rows, strict=True)
    ])


def clipped_td_loop(rewards, values, log_rho, *, gamma, lam_critic, lam_actor, low, high):
    """COPC clipped TD (trace none, window infinite, own residual unweighted); returns (advantages,
    returns)."""
    rows = _rows(rewards, values, log_rho)
    return _stack([
        clipped_td_row(r, v, lr, [True] * len(r), gamma=gamma, lam_critic=lam_critic, lam_actor=lam_actor,
                       low=low, high=high)
        for r, v, lr in zip(*rows, strict=True)
    ])


def brace_loop(rewards, values, log_rho, *, gamma, lam, rho_bar, c_bar, k):
    """BRACE k-capped targets over every token of each row; returns (advantages, returns)."""
    rows = _rows(rewards, values, log_rho)
    return _stack([
        brace_row(r, v, lr, [True] * len(r), gamma=gamma, lam=lam, rho_bar=rho_bar, c_bar=c_bar, k=k)
        for r, v, lr in zip(*rows, strict=True)
    ])
