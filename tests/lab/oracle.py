"""Slow per-token loops of the advantage estimators as the spec states them (oracles for the lab tests).

They walk each row backwards in Python floats, every token being a policy token (the lab's MDPs have no
observation tokens), terminal value 0. Spec sections 2 (GAE), 4 (V-trace), 9.3 (COPC clipped TD, trace
"none", own residual unweighted, window infinite).
"""

from __future__ import annotations

import math

import torch


def _rows(*tensors: torch.Tensor) -> list[list[list[float]]]:
    return [t.double().tolist() for t in tensors]


def gae_loop(rewards, values, *, gamma, lam):
    """``Â_t = δ_t + γλ Â_{t+1}``, ``δ_t = r_t + γ V_{t+1} − V_t``; returns (advantages, returns)."""
    r_all, v_all = _rows(rewards, values)
    adv, ret = [], []
    for r, v in zip(r_all, v_all, strict=True):
        T = len(r)
        a = [0.0] * T
        nxt = 0.0
        for t in range(T - 1, -1, -1):
            v_next = v[t + 1] if t + 1 < T else 0.0
            delta = r[t] + gamma * v_next - v[t]
            nxt = delta + gamma * lam * nxt
            a[t] = nxt
        adv.append(a)
        ret.append([a[t] + v[t] for t in range(T)])
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


def vtrace_loop(rewards, values, log_rho, *, gamma, lam, rho_bar, c_bar, pg_rho_bar):
    """IMPALA: ``v_s − V_s = ρ_s δ_s + γ c_s (v_{s+1} − V_{s+1})``; ``A^pg_s = ρ^pg_s (r_s + γ v_{s+1} − V_s)``."""
    r_all, v_all, l_all = _rows(rewards, values, log_rho)
    vs_all, pg_all = [], []
    for r, v, lr in zip(r_all, v_all, l_all, strict=True):
        T = len(r)
        w = [math.exp(x) for x in lr]
        vs = [0.0] * T
        diff_next = 0.0
        for t in range(T - 1, -1, -1):
            v_next = v[t + 1] if t + 1 < T else 0.0
            delta = min(rho_bar, w[t]) * (r[t] + gamma * v_next - v[t])
            diff = delta + gamma * lam * min(c_bar, w[t]) * diff_next
            vs[t] = v[t] + diff
            diff_next = diff
        pg = []
        for t in range(T):
            vs_next = vs[t + 1] if t + 1 < T else 0.0
            pg.append(min(pg_rho_bar, w[t]) * (r[t] + gamma * vs_next - v[t]))
        vs_all.append(vs)
        pg_all.append(pg)
    return torch.tensor(vs_all, dtype=torch.float64), torch.tensor(pg_all, dtype=torch.float64)


def clipped_td_loop(rewards, values, log_rho, *, gamma, lam_critic, lam_actor, low, high):
    """COPC 9.3: ``ρ̃ = clip(w, low, high)``; ``E_t = ρ̃_t δ_t + γλ_a E_{t+1}``; ``Â_t = δ_t + γλ_a E_{t+1}``;
    ``D_t = ρ̃_t δ_t + γλ_c D_{t+1}``; ``G_t = V_t + D_t``. Returns (advantages, returns)."""
    r_all, v_all, l_all = _rows(rewards, values, log_rho)
    adv_all, ret_all = [], []
    for r, v, lr in zip(r_all, v_all, l_all, strict=True):
        T = len(r)
        a, g = [0.0] * T, [0.0] * T
        e_next = d_next = 0.0
        for t in range(T - 1, -1, -1):
            rho = min(max(math.exp(lr[t]), low), high)
            v_next = v[t + 1] if t + 1 < T else 0.0
            delta = r[t] + gamma * v_next - v[t]
            a[t] = delta + gamma * lam_actor * e_next
            e_next = rho * delta + gamma * lam_actor * e_next
            d_next = rho * delta + gamma * lam_critic * d_next
            g[t] = v[t] + d_next
        adv_all.append(a)
        ret_all.append(g)
    return torch.tensor(adv_all, dtype=torch.float64), torch.tensor(ret_all, dtype=torch.float64)
