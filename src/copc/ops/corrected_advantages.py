"""Off-policy corrected advantage estimators: COPC's clipped-ratio TD sums and BRACE.

Both weight the bridged TD residuals by clipped (COPC) or capped (BRACE) behaviour ratios ``w = pi_old /
mu`` (``log_rho = logp_old - logp_behav``). Notation and conventions (action tokens only, tool spans
bridged, outputs 0 off action tokens, detached weights from a log-ratio clamped to +-20) as in
:mod:`copc.ops.advantages`; the shared scans and compaction live in :mod:`copc.ops.scans`.
"""

from __future__ import annotations

import warnings
from typing import Literal, NamedTuple

import torch

from copc.ops.advantages import gae
from copc.ops.scans import (
    PackedTD,
    action_sums,
    check_lambda,
    clean_log_rho,
    discounted_reverse_cumsum,
    on_actions,
    pack_td,
    reverse_linear_scan,
    shift_left,
    td_residuals,
    truncated_traces,
    unpack,
)

__all__ = ["BraceOutput", "ClippedTDOutput", "TraceKind", "brace", "clipped_td"]

TraceKind = Literal["none", "vtrace", "brace"]


class ClippedTDOutput(NamedTuple):
    advantages: torch.Tensor  # [B, T] float32 (not whitened), 0 off action tokens
    returns: torch.Tensor  # [B, T] float32 critic target G = V + D, 0 off action tokens


class BraceOutput(NamedTuple):
    advantages: torch.Tensor  # [B, T] float32, 0 off action tokens
    returns: torch.Tensor  # [B, T] float32 V_targ, 0 off action tokens


def _windowed(x: torch.Tensor, discount: float, window: int | None) -> torch.Tensor:
    """``sum_{u=t}^{t+k-1} discount^(u-t) x_u`` (``k = window``; ``None`` = to the end), loop-free.

    Difference of discounted reverse cumulative sums: ``S_t - discount^k S_{t+k}``.
    """
    total = discounted_reverse_cumsum(x, discount)
    if window is None or window >= x.shape[1]:
        return total
    later = torch.nn.functional.pad(total[:, window:], (0, window))
    return total - (discount**window) * later


def clipped_td(
    rewards: torch.Tensor,
    values: torch.Tensor,
    log_rho: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    gamma: float,
    lam_critic: float,
    lam_actor: float,
    low: float,
    high: float,
    trace: TraceKind = "none",
    trace_low: float | None = None,
    trace_high: float | None = None,
    advantage_window: int | None = None,
    weight_own_residual: bool = False,
    bootstrap_value: torch.Tensor | None = None,
) -> ClippedTDOutput:
    """COPC's two-sided clipped-ratio weighted TD sums (docs/formulas.md#r0, #variants). [RECONSTRUCTED]

    ::

        rho~_t = clip(w_t, low, high)                       (low, high bound the ratio, e.g. 0.8, 1.2)
        D_t = rho~_t delta_t + gamma lam_c c_t D_{t+1}      G_t = V(s_t) + D_t
        E_t = rho~_t delta_t + gamma lam_a c_t E_{t+1}
        A_t = delta_t + gamma lam_a E_{t+1}                 (own residual not reweighted; default)
        A_t = E_t                                           (weight_own_residual=True)

    ``trace="none"``: ``c_t = 1`` (loop-free). With ``advantage_window = k_A`` the clip weight applies
    only to residuals ``u < t + k_A`` (weight 1 beyond): ``D_t = GAE_t + sum_{u<t+k_A} (gl)^(u-t)
    (rho~_u - 1) delta_u``, as differences of cumulative sums. ``trace="vtrace"``: ``c_t =
    clip(w_t, trace_low, trace_high)`` (warns unless ``trace_low <= low`` and ``trace_high <= high``).
    ``trace="brace"``: D and E are BRACE targets (:func:`brace`) with ``rho = rho~``, ``c = lam *
    clip(w, trace_low, trace_high)`` and ``k = advantage_window`` (required). Advantages are not whitened.

    Returns: ``ClippedTDOutput(advantages, returns)``, ``[B, T] float32``, 0 off action tokens.
    """
    check_lambda("lam_critic", lam_critic)
    check_lambda("lam_actor", lam_actor)
    if not low <= high:
        raise ValueError(f"clipped_td needs low <= high (e.g. 0.8, 1.2), got low={low}, high={high}")
    if advantage_window is not None and advantage_window < 0:
        raise ValueError(f"advantage_window must be >= 0 or None (infinite), got {advantage_window}")
    if trace not in ("none", "vtrace", "brace"):
        raise ValueError(f"unknown trace {trace!r}; valid: none, vtrace, brace")
    if trace == "none" and low == high == 1.0:
        # rho~ = 1 everywhere: D and E are GAE (the window only moves weight-(rho~ - 1) = 0 terms), so the
        # estimator IS async PPO's; computing it with gae() makes the degenerate check of docs/formulas.md#r1
        # exact.
        critic_gae = gae(rewards, values, action_mask, gamma=gamma, lam=lam_critic,
                         bootstrap_value=bootstrap_value)
        actor_gae = critic_gae if lam_actor == lam_critic else gae(
            rewards, values, action_mask, gamma=gamma, lam=lam_actor, bootstrap_value=bootstrap_value
        )
        return ClippedTDOutput(actor_gae.advantages, critic_gae.returns)
    delta = td_residuals(rewards, values, action_mask, gamma=gamma, bootstrap_value=bootstrap_value)
    log_w = clean_log_rho(log_rho, action_mask, rewards)
    if trace == "none" and advantage_window is None:  # token layout, no compaction when gamma * lam == 1
        weighted = log_w.exp_().clamp_(min=low, max=high).mul_(delta)  # rho~ delta, 0 off action tokens
        need_after = not weight_own_residual
        d_sums = action_sums(weighted, action_mask, gamma * lam_critic,
                             after=need_after and lam_actor == lam_critic)
        e_sums = d_sums if lam_actor == lam_critic else action_sums(weighted, action_mask, gamma * lam_actor,
                                                                    after=need_after)
        del log_w, weighted  # fewer live [B, T] temporaries: see benchmarks/ops_bench.py on the allocator
        adv = e_sums.here if e_sums.after is None else e_sums.after.mul_(gamma * lam_actor).add_(delta)
        advantages = on_actions(action_mask, adv)  # before d_sums.here (maybe adv) is updated in place
        del delta, e_sums, adv
        return ClippedTDOutput(advantages, on_actions(action_mask, d_sums.here.add_(values)))
    pk = pack_td(delta, log_w, action_mask)
    d_c, e_c = _clipped_compact(pk, gamma, lam_critic, lam_actor, low, high, trace, trace_low, trace_high,
                                advantage_window)
    adv_c = e_c if weight_own_residual else shift_left(e_c).mul_(gamma * lam_actor).add_(pk.delta)
    return ClippedTDOutput(unpack(adv_c, pk.cp), on_actions(action_mask, unpack(d_c, pk.cp) + values))


def _clipped_compact(
    pk: PackedTD,
    gamma: float,
    lam_c: float,
    lam_a: float,
    low: float,
    high: float,
    trace: TraceKind,
    trace_low: float | None,
    trace_high: float | None,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compact D and E for a window (``trace="none"``) or ratio traces (``"vtrace"``, ``"brace"``)."""
    rho = pk.weight.clamp(min=low, max=high)
    if trace == "none":
        extra = (rho - 1.0) * pk.delta  # D = GAE + windowed sum of (rho~ - 1) delta
        d_c = discounted_reverse_cumsum(pk.delta, gamma * lam_c) + _windowed(extra, gamma * lam_c, window)
        if lam_a == lam_c:
            return d_c, d_c
        return d_c, discounted_reverse_cumsum(pk.delta, gamma * lam_a) + _windowed(extra, gamma * lam_a,
                                                                                   window)
    if trace_low is None or trace_high is None:
        raise ValueError(f"trace={trace!r} needs trace_low and trace_high (bounds on the ratio)")
    if not (trace_low <= low and trace_high <= high):
        warnings.warn(
            f"trace bounds [{trace_low}, {trace_high}] are not inside the advantage clip [{low}, {high}]: "
            "c_t can exceed rho~_t (docs/formulas.md#variants asks trace_low <= low and trace_high <= high)",
            stacklevel=3,
        )
    c = pk.weight.clamp(min=trace_low, max=trace_high)
    if trace == "vtrace":
        if window is not None:
            raise ValueError("advantage_window needs trace='none' (c_t = 1) or 'brace'; got trace='vtrace'")
        d_c = reverse_linear_scan(rho * pk.delta, gamma * lam_c * c)
        return d_c, reverse_linear_scan(rho * pk.delta, gamma * lam_a * c)
    if window is None:
        raise ValueError("trace='brace' needs advantage_window = k (e.g. 100)")
    return _brace_excess(pk, rho, lam_c * c, gamma, window), _brace_excess(pk, rho, lam_a * c, gamma, window)


def _brace_excess(pk: PackedTD, rho: torch.Tensor, trace: torch.Tensor, gamma: float, k: int) -> torch.Tensor:
    """BRACE ``V_targ(s_s) - V(s_s)`` on compact arrays (docs/formulas.md#brace), ``j = min(s + k, T)``::

        sum_{t=s}^{j-1} gamma^(t-s) P(s,t) rho_t delta_t + P(s,j) sum_{t=j}^{T} gamma^(t-s) delta_t

    with ``P(s,t) = prod_{i=s}^{t-1} c_i`` (``c`` includes lambda); the unweighted tail telescopes to the
    Monte-Carlo return ``gamma^(T-s) R - gamma^(j-s) V(s_j)``. For ``k >= T`` it is the V-trace
    recursion with the last token's rho set to 1; otherwise a loop over the k window offsets.
    """
    valid, last, length = pk.cp.valid, pk.cp.last, pk.delta.shape[1]
    mc = discounted_reverse_cumsum(pk.delta, gamma)  # sum_{t>=j} gamma^(t-j) delta_t
    if k >= length - 1:
        rho_last_one = torch.where(last, torch.ones_like(rho), rho)
        return reverse_linear_scan(rho_last_one * pk.delta, gamma * trace)
    slots = torch.arange(length, device=rho.device)[None, :]
    n_last = pk.cp.n_actions[:, None] - 1
    span = torch.minimum(slots + k, n_last).clamp(min=0) - slots  # j - s (<= 0 in the padding)
    weighted = rho * pk.delta
    acc = torch.zeros_like(weighted)
    prod = torch.ones_like(weighted)
    for m in range(k):
        active = span > m
        shifted_w = torch.nn.functional.pad(weighted[:, m:], (0, m))
        shifted_c = torch.nn.functional.pad(trace[:, m:], (0, m))
        acc = acc + torch.where(active, (gamma**m) * prod * shifted_w, 0.0)
        prod = torch.where(active, prod * shifted_c, prod)
    j_idx = (slots + span.clamp(min=0)).clamp(max=length - 1)
    tail = prod * gamma ** span.clamp(min=0).to(rho.dtype) * mc.gather(1, j_idx)
    return torch.where(valid, acc + tail, 0.0)


def brace(
    rewards: torch.Tensor,
    values: torch.Tensor,
    log_rho: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    rho_bar: float,
    c_bar: float,
    k: int,
    bootstrap_value: torch.Tensor | None = None,
) -> BraceOutput:
    """BRACE capped, Monte-Carlo-anchored targets (arXiv 2609.09783; docs/formulas.md#brace).

    ::

        rho_t = min(rho_bar, w_t),  c_i = lam min(c_bar, w_i),  j = min(s + k, T)
        V_targ(s_s) = V(s_s) + sum_{t=s}^{j-1} gamma^(t-s) (prod_{i=s}^{t-1} c_i) rho_t delta_t
                      + prod_{i=s}^{j-1} c_i [gamma^(T-s) R - gamma^(j-s) V(s_j)]
        A_s = r_s + gamma V_targ(s_{s+1}) - V(s_s),   V_targ(s_{T+1}) = V(s_{T+1}) (0 if terminal)

    ``k`` counts action tokens; ``k = 0`` gives the Monte-Carlo target ``gamma^(T-s) R``; ``k >= T``
    gives V-trace with ``rho_T := 1``. With ``bootstrap_value``, ``R`` becomes ``R + gamma V(s_{T+1})``.

    Returns: ``BraceOutput(advantages, returns)``, ``[B, T] float32``, 0 off action tokens.
    """
    check_lambda("lam", lam)
    if k < 0:
        raise ValueError(f"brace horizon k must be >= 0 (BRACE default 100), got {k}")
    delta = td_residuals(rewards, values, action_mask, gamma=gamma, bootstrap_value=bootstrap_value)
    pk = pack_td(delta, clean_log_rho(log_rho, action_mask, rewards), action_mask)
    excess = _brace_excess(pk, *truncated_traces(pk, lam=lam, rho_bar=rho_bar, c_bar=c_bar), gamma, k)
    adv = pk.delta + gamma * shift_left(excess)
    cp = pk.cp
    return BraceOutput(unpack(adv, cp), on_actions(action_mask, unpack(excess, cp) + values))
