"""Slow per-token oracles for ``copc.ops.advantages``: one row at a time, plain Python floats.

Each function walks the row's action tokens explicitly (indices ``idx``), bridges tool-output spans by
taking "the next state" to be the next *action* token, and reads the formulas of docs/formulas.md#ppo,
#v-trace, #r0, #variants and #brace literally (V-trace and BRACE as direct double sums, not recursions).
Outputs are lists of length T with 0.0 at non-action positions.
"""

from __future__ import annotations

import math

Row = list[float]


def actions(mask: list[bool]) -> list[int]:
    return [t for t, m in enumerate(mask) if m]


def _scatter(idx: list[int], vals: list[float], length: int) -> Row:
    out = [0.0] * length
    for i, v in zip(idx, vals, strict=True):
        out[i] = v
    return out


def _weights(log_rho: Row, idx: list[int]) -> list[float]:
    return [math.exp(min(20.0, max(-20.0, log_rho[t]))) for t in idx]


def bridged_deltas(rewards: Row, values: Row, mask: list[bool], gamma: float, boot: float) -> list[float]:
    """delta_j = r_j + gamma V(next action token) - V_j; after the last action token V = boot."""
    idx = actions(mask)
    out = []
    for j, t in enumerate(idx):
        v_next = values[idx[j + 1]] if j + 1 < len(idx) else boot
        out.append(rewards[t] + gamma * v_next - values[t])
    return out


def gae_row(rewards: Row, values: Row, mask: list[bool], gamma: float, lam: float,
            boot: float = 0.0) -> tuple[Row, Row]:
    idx = actions(mask)
    deltas = bridged_deltas(rewards, values, mask, gamma, boot)
    adv = [0.0] * len(idx)
    running = 0.0
    for j in reversed(range(len(idx))):
        running = deltas[j] + gamma * lam * running
        adv[j] = running
    ret = [a + values[t] for a, t in zip(adv, idx, strict=True)]
    return _scatter(idx, adv, len(mask)), _scatter(idx, ret, len(mask))


def vtrace_row(
    rewards: Row, values: Row, log_rho: Row, mask: list[bool], *, gamma: float, lam: float,
    rho_bar: float, c_bar: float, pg_rho_bar: float, boot: float = 0.0, rho_last_one: bool = False,
) -> tuple[Row, Row]:
    """Direct n-step form: v_s = V_s + sum_{t>=s} gamma^(t-s) (prod_{i<t} c_i) rho_t delta_t."""
    idx = actions(mask)
    n = len(idx)
    w = _weights(log_rho, idx)
    deltas = bridged_deltas(rewards, values, mask, gamma, boot)
    rho = [min(rho_bar, x) for x in w]
    if rho_last_one and n:
        rho[-1] = 1.0
    c = [lam * min(c_bar, x) for x in w]
    vs = []
    for s in range(n):
        total, prod = 0.0, 1.0
        for t in range(s, n):
            total += gamma ** (t - s) * prod * rho[t] * deltas[t]
            prod *= c[t]
        vs.append(values[idx[s]] + total)
    pg = []
    for s in range(n):
        v_next = vs[s + 1] if s + 1 < n else boot
        pg.append(min(pg_rho_bar, w[s]) * (rewards[idx[s]] + gamma * v_next - values[idx[s]]))
    return _scatter(idx, vs, len(mask)), _scatter(idx, pg, len(mask))


def brace_excess_row(deltas: list[float], rho: list[float], c: list[float], gamma: float,
                     k: int) -> list[float]:
    """V_targ(s) - V(s) = sum_{t=s}^{j-1} g^(t-s) P(s,t) rho_t d_t + P(s,j) sum_{t=j}^{T} g^(t-s) d_t."""
    n = len(deltas)
    out = []
    for s in range(n):
        j = min(s + k, n - 1)
        total, prod = 0.0, 1.0
        for t in range(s, j):
            total += gamma ** (t - s) * prod * rho[t] * deltas[t]
            prod *= c[t]
        total += prod * sum(gamma ** (t - s) * deltas[t] for t in range(j, n))
        out.append(total)
    return out


def brace_row(
    rewards: Row, values: Row, log_rho: Row, mask: list[bool], *, gamma: float, lam: float,
    rho_bar: float, c_bar: float, k: int, boot: float = 0.0,
) -> tuple[Row, Row]:
    idx = actions(mask)
    w = _weights(log_rho, idx)
    deltas = bridged_deltas(rewards, values, mask, gamma, boot)
    excess = brace_excess_row(deltas, [min(rho_bar, x) for x in w], [lam * min(c_bar, x) for x in w], gamma,
                              k)
    vt = [values[t] + e for t, e in zip(idx, excess, strict=True)]
    adv = []
    for s, t in enumerate(idx):
        v_next = vt[s + 1] if s + 1 < len(idx) else boot  # V_targ(s_{T+1}) = V(s_{T+1})
        adv.append(rewards[t] + gamma * v_next - values[t])
    return _scatter(idx, adv, len(mask)), _scatter(idx, vt, len(mask))


def clipped_td_row(
    rewards: Row, values: Row, log_rho: Row, mask: list[bool], *, gamma: float, lam_critic: float,
    lam_actor: float, low: float, high: float, trace: str = "none", trace_low: float = 0.0,
    trace_high: float = 0.0, window: int | None = None, weight_own: bool = False, boot: float = 0.0,
) -> tuple[Row, Row]:
    """COPC 9.3: D_t = rho~ d_t + g l_c c_t D_{t+1}; E likewise with l_a; A_t = d_t + g l_a E_{t+1}."""
    idx = actions(mask)
    n = len(idx)
    w = _weights(log_rho, idx)
    deltas = bridged_deltas(rewards, values, mask, gamma, boot)
    rho = [min(high, max(low, x)) for x in w]
    c = [min(trace_high, max(trace_low, x)) if trace != "none" else 1.0 for x in w]

    def recursion(lam: float) -> list[float]:
        if trace == "brace":
            assert window is not None
            return brace_excess_row(deltas, rho, [lam * x for x in c], gamma, window)
        if window is not None:  # D_t = GAE_t + sum_{u=t}^{t+k-1} (g l)^(u-t) (rho~_u - 1) d_u (c = 1)
            gae = [sum((gamma * lam) ** (u - s) * deltas[u] for u in range(s, n)) for s in range(n)]
            return [gae[s] + sum((gamma * lam) ** (u - s) * (rho[u] - 1) * deltas[u]
                                 for u in range(s, min(s + window, n))) for s in range(n)]
        out, running = [0.0] * n, 0.0
        for j in reversed(range(n)):
            running = rho[j] * deltas[j] + gamma * lam * c[j] * running
            out[j] = running
        return out

    d = recursion(lam_critic)
    e = recursion(lam_actor)
    if weight_own:
        adv = e
    else:
        adv = [deltas[j] + gamma * lam_actor * (e[j + 1] if j + 1 < n else 0.0) for j in range(n)]
    ret = [values[t] + d[j] for j, t in enumerate(idx)]
    return _scatter(idx, adv, len(mask)), _scatter(idx, ret, len(mask))


def fold_rewards_row(rewards: Row, mask: list[bool]) -> Row:
    idx = actions(mask)
    out = [0.0] * len(mask)
    if not idx:
        return out
    for t, r in enumerate(rewards):
        before = [i for i in idx if i <= t]
        out[before[-1] if before else idx[0]] += r
    return out


def group_row(scores: list[float], groups: list[int], mode: str, eps: float = 1e-6) -> list[float]:
    out = []
    for i, s in enumerate(scores):
        mates = [scores[j] for j in range(len(scores)) if groups[j] == groups[i]]
        n = len(mates)
        if n < 2:
            out.append(0.0)
            continue
        mean = sum(mates) / n
        if mode == "drgrpo":
            out.append(s - mean)
        elif mode == "rloo":
            out.append(s - (sum(mates) - s) / (n - 1))
        else:
            std = math.sqrt(sum((m - mean) ** 2 for m in mates) / (n - 1))
            out.append((s - mean) / (std + eps))
    return out
