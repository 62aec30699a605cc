"""The advantage channel: GAE, V-trace, COPC clipped-ratio TD sums, BRACE, group advantages.

Notation: ``B`` sequences, ``T`` token positions, ``action_mask: [B, T] bool`` True on tokens the policy
sampled (prompt and tool-output tokens False). ``values[b, t]`` is the pre-update ``V(s_t)`` of the state
before token ``t``; ``log_rho = logp_old - logp_behav`` (so ``w = pi_old / mu``). All inputs float32.

Every recursion runs over action tokens only and *bridges* tool-output spans: the value after the last
action token of a turn is the value at the first action token of the next turn (verl multi-turn GAE,
SAO skip-observation). Discounting and every horizon (lam, k, k_A) count action tokens only. The value
after a row's last action token is 0 (terminal) or ``bootstrap_value[b]`` (``truncation = bootstrap``).
Rewards, values and log-ratios at non-action positions are ignored (fold rewards first with
:func:`fold_rewards`); outputs are exactly 0 there. Weights are detached; ratios come from a log-ratio
clamped to +-20, in float32.

Implementation: the bridge needs ``V`` at the next action token, which one running arg-max of the
flipped mask and one gather give in token layout (:func:`_next_action_values`). With ``gamma * lam ==
1`` (the default) the recursion over action tokens is a plain reverse cumulative sum of residuals that
are 0 off action tokens, so the default GAE and ``clipped_td`` paths never compact. Discounts below 1
count powers in action tokens: there each row's action tokens are compacted to the left (scatter by
``cumsum`` index) and a blocked matrix scan runs on the dense array. The ratio-product trace paths
(V-trace, BRACE, ``clipped_td(trace="vtrace")``) take Python steps: a blocked scan of ~2 sqrt(T)
batch-vectorised steps, and BRACE's k window offsets.
"""

from __future__ import annotations

import warnings
from typing import Literal, NamedTuple

import torch

from copc.ops.importance import LOG_RATIO_CLAMP
from copc.ops.masked import check_bt, check_mask

__all__ = [
    "BraceOutput",
    "ClippedTDOutput",
    "GAEOutput",
    "GroupMode",
    "TraceKind",
    "VTraceOutput",
    "brace",
    "broadcast_to_tokens",
    "clipped_td",
    "discounted_reverse_cumsum",
    "fold_rewards",
    "gae",
    "group_advantages",
    "vtrace",
]

TraceKind = Literal["none", "vtrace", "brace"]
GroupMode = Literal["grpo", "drgrpo", "rloo"]
_CHUNK = 64  # block length of the matrix scan: powers g^0..g^64 never overflow, any g in [0, 1]


class GAEOutput(NamedTuple):
    advantages: torch.Tensor  # [B, T] float32, 0 off action tokens
    returns: torch.Tensor  # [B, T] float32 critic target G = A + V, 0 off action tokens


class VTraceOutput(NamedTuple):
    vs: torch.Tensor  # [B, T] float32 value targets, 0 off action tokens
    pg_advantages: torch.Tensor  # [B, T] float32, 0 off action tokens


class ClippedTDOutput(NamedTuple):
    advantages: torch.Tensor  # [B, T] float32 (not whitened), 0 off action tokens
    returns: torch.Tensor  # [B, T] float32 critic target G = V + D, 0 off action tokens


class BraceOutput(NamedTuple):
    advantages: torch.Tensor  # [B, T] float32, 0 off action tokens
    returns: torch.Tensor  # [B, T] float32 V_targ, 0 off action tokens


# ----------------------------------------------------------------------------------------------
# Scans


def discounted_reverse_cumsum(x: torch.Tensor, discount: float) -> torch.Tensor:
    """``y_t = sum_{u >= t} discount^(u - t) x_u`` along the last dim of ``x: [B, T]``, loop-free.

    ``discount == 1``: ``flip(cumsum(flip(x)))``. Otherwise a two-level blocked scan: inside blocks of
    64, ``y = x @ M^T`` with ``M[j, u] = g^(u - j)`` (u >= j); across blocks the block heads obey the
    same recursion with factor ``g^64`` (a second, small matrix). Every power is <= 1, so nothing
    overflows for any ``g`` in [0, 1]; accuracy stays at float32 rounding for T = 4096.
    """
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must lie in [0, 1] (gamma * lam), got {discount}")
    if discount == 1.0:  # y_t = total - sum_{u<t} x_u: one full-size temporary fewer than flip/cumsum/flip
        prefix = torch.cumsum(x, dim=-1)
        return torch.sub(x, prefix).add_(prefix[:, -1:])
    batch, length = x.shape
    n_blocks = max(1, -(-length // _CHUNK))
    pad = n_blocks * _CHUNK - length
    padded = (torch.nn.functional.pad(x, (0, pad)) if pad else x).reshape(batch, n_blocks, _CHUNK)
    idx = torch.arange(_CHUNK, dtype=torch.float64, device=x.device)
    lag = idx[None, :] - idx[:, None]  # lag[j, u] = u - j
    intra = torch.where(lag >= 0, discount ** lag.clamp(min=0), 0.0).to(x.dtype)
    local = padded @ intra.T  # local[b, c, j] = sum_{u >= j in block c} g^(u-j) x_u
    bidx = torch.arange(n_blocks, dtype=torch.float64, device=x.device)
    blag = bidx[None, :] - bidx[:, None]
    inter = torch.where(blag >= 0, (discount**_CHUNK) ** blag.clamp(min=0), 0.0).to(x.dtype)
    heads = local[:, :, 0] @ inter.T  # y at each block's first position
    next_heads = torch.nn.functional.pad(heads[:, 1:], (0, 1))  # y at the next block's head, 0 past T
    to_next = (discount ** (_CHUNK - idx)).to(x.dtype)  # g^(64 - j): from position j to the next head
    y = local.add_(to_next[None, None, :] * next_heads[:, :, None])  # own temporary
    return y.reshape(batch, n_blocks * _CHUNK)[:, :length]


def _reverse_linear_scan(x: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """``y_t = x_t + coef_t * y_{t+1}``, ``y_T = x_T``, for per-token coefficients (ratio traces).

    Blocked: inside blocks of 64 a loop over the 64 offsets (vectorised over rows and blocks) gives the
    block-local sums ``y^loc`` and products ``P_j = prod_{i=j}^{end} coef_i``; a loop over blocks
    carries the heads; then ``y_j = y^loc_j + P_j * y_{next head}``. About 2 * sqrt(T) Python steps
    instead of T; a zero coefficient cuts the sum exactly (products, never divisions or logs).
    Entries past a row's last action token must have ``x = 0``.
    """
    batch, length = x.shape
    n_blocks = max(1, -(-length // _CHUNK))
    pad = n_blocks * _CHUNK - length
    xb = torch.nn.functional.pad(x, (0, pad)).view(batch, n_blocks, _CHUNK)
    cb = torch.nn.functional.pad(coef, (0, pad)).view(batch, n_blocks, _CHUNK)
    local_cols: list[torch.Tensor] = []
    prod_cols: list[torch.Tensor] = []
    local = torch.zeros_like(xb[:, :, 0])
    prod = torch.ones_like(xb[:, :, 0])
    for j in range(_CHUNK - 1, -1, -1):
        local = xb[:, :, j] + cb[:, :, j] * local
        prod = cb[:, :, j] * prod
        local_cols.append(local)
        prod_cols.append(prod)
    y_loc = torch.stack(local_cols[::-1], dim=2)
    prods = torch.stack(prod_cols[::-1], dim=2)
    heads: list[torch.Tensor] = []
    head = torch.zeros_like(x[:, 0])
    for c in range(n_blocks - 1, -1, -1):
        heads.append(head)  # y at the head of block c + 1 (0 past the end)
        head = y_loc[:, c, 0] + prods[:, c, 0] * head
    next_head = torch.stack(heads[::-1], dim=1)
    y = y_loc + prods * next_head[:, :, None]
    return y.reshape(batch, n_blocks * _CHUNK)[:, :length]


# ----------------------------------------------------------------------------------------------
# The bridge over tool-output spans, in token layout


def _check_float(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (cast with .float() before the advantage channel), got {tensor.dtype}")


def _on_actions(action_mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x`` on action tokens, exactly 0 elsewhere (NaN-safe forward and backward)."""
    return torch.where(action_mask, x, 0.0)


def _next_action_values(values: torch.Tensor, action_mask: torch.Tensor, terminal: torch.Tensor) -> torch.Tensor:
    """``V(s_next(t))`` on action tokens: ``values`` at the first action token after ``t``, else ``terminal[b]``.

    No compaction. Flip time (flipped position ``q`` is time ``T - 1 - q``) and shift by one: the latest
    True at or before ``q`` is then the first action token after ``t``, found as the running arg-max of
    the mask (``cummax`` reports the latest index among ties on CPU and CUDA alike: tested), at time
    ``T - index``; one gather reads the values. Each row's last action token (the first True of the
    flipped mask: ``argmax`` returns the first maximum) gets ``terminal[b]``. Entries off action tokens
    are unspecified (they read arbitrary positions); no non-action entry reaches an action token.
    Temporaries are released early (peak ~3 MiB extra at [64, 4096]: see benchmarks/ops_bench.py).
    """
    batch, length = values.shape
    flipped = action_mask.flip(1)
    shifted = torch.cat([flipped.new_zeros(batch, 1), flipped[:, :-1]], dim=1)  # shifted[q] = flipped[q - 1]
    index = shifted.cummax(dim=1).indices  # [B, T] int64, flipped order
    del shifted
    index.neg_().add_(length).clamp_(max=length - 1)  # own temporary: time of that token (garbage if none)
    out = values.gather(1, index)
    del index
    out = out.flip(1)
    last = (length - 1) - flipped.view(torch.uint8).argmax(dim=1, keepdim=True)
    return out.scatter_(1, last, terminal[:, None])


def _prepare(
    rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    gamma: float,
    bootstrap_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Check inputs; return the bridged TD residuals ``delta_t = r_t + gamma V(s_next(t)) - V(s_t)``.

    ``[B, T] float32`` in token layout, exactly 0 off action tokens; ``V`` after a row's last action
    token is ``bootstrap_value[b]`` (0 without it).
    """
    check_bt("rewards", rewards)
    _check_float("rewards", rewards)
    check_bt("values", values, rewards)
    _check_float("values", values)
    check_mask("action_mask", action_mask, rewards)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}")
    if bootstrap_value is None:
        terminal = values.new_zeros(values.shape[0])
    else:
        if bootstrap_value.shape != rewards.shape[:1]:
            raise ValueError(f"bootstrap_value must be [B] = {tuple(rewards.shape[:1])}, got {tuple(bootstrap_value.shape)}")
        _check_float("bootstrap_value", bootstrap_value)
        terminal = bootstrap_value
    value_next = _next_action_values(values, action_mask, terminal)
    return _on_actions(action_mask, value_next.mul_(gamma).add_(rewards).sub_(values))  # own temporary


def _clean_log_rho(log_rho: torch.Tensor, action_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``clamp(log_rho, +-20)`` on action tokens, 0 elsewhere; detached ``[B, T] float32``."""
    check_bt("log_rho", log_rho, like)
    _check_float("log_rho", log_rho)
    return _on_actions(action_mask, log_rho.detach()).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


class _Sums(NamedTuple):
    here: torch.Tensor  # [B, T] y_t = sum_{u >= t} g^(k) x_u over action tokens u (garbage off action tokens)
    after: torch.Tensor | None  # [B, T] y at the next action token after t (0 after the last), if asked


def _action_sums(x: torch.Tensor, action_mask: torch.Tensor, discount: float, *, after: bool = False) -> _Sums:
    """Discounted reverse sums over action tokens: ``y_t = x_t + discount * y_{next(t)}``, token layout.

    ``x: [B, T]`` must be exactly 0 off action tokens. ``discount == 1``: a zero changes no sum, so
    ``y`` is one reverse cumulative sum, ``after_t = total - prefix_t`` and ``here_t = after_t + x_t``
    (no compaction). ``discount < 1`` counts powers in action tokens only: compact, scan
    (:func:`discounted_reverse_cumsum`), shift, scatter back. Entries off action tokens are unspecified.
    ``after`` is computed only when asked for.
    """
    if discount == 1.0:
        prefix = torch.cumsum(x, dim=1)
        total = prefix[:, -1:].clone()
        here = torch.sub(x, prefix).add_(total)
        return _Sums(here, prefix.neg_().add_(total) if after else None)  # own temporary: sum_{u > t} x_u
    # A lean :func:`_compaction` (entries off action tokens are unspecified here): only the int32
    # running count stays alive across the scan, to keep the heap small.
    length = x.shape[1]
    count = action_mask.cumsum(dim=1, dtype=torch.int32).sub_(1)  # compact slot of each action token
    dest = torch.where(action_mask, count, length).long()  # non-action entries land in a dropped slot
    packed = _pack(x, dest)
    del dest
    here_c = discounted_reverse_cumsum(packed, discount)
    del packed
    slot = count.clamp_(min=0).long()
    del count
    return _Sums(here_c.gather(1, slot), _shift_left(here_c).gather(1, slot) if after else None)


# ----------------------------------------------------------------------------------------------
# Compaction of action tokens, for recursions that count action tokens (discounts < 1, traces, windows)


class _Compact(NamedTuple):
    pos: torch.Tensor  # [B, T] long: compact index of each action token (clamped >= 0)
    valid: torch.Tensor  # [B, T] bool: compact index < number of action tokens of the row
    last: torch.Tensor  # [B, T] bool: the compact slot of each row's last action token
    off: torch.Tensor  # [B, T] bool: ~action_mask (token layout)
    n_actions: torch.Tensor  # [B] long


def _compaction(action_mask: torch.Tensor) -> tuple[_Compact, torch.Tensor]:
    """The compaction and the scatter destinations ``[B, T]`` long (T for non-action tokens).

    Index arithmetic in int32 (an int64 cumsum is ~10x slower on CPU); only the gather/scatter index
    tensors are widened to int64. Drop the destinations once packed (fewer live temporaries).
    """
    length = action_mask.shape[1]
    cum = action_mask.cumsum(dim=1, dtype=torch.int32)
    n_actions = cum[:, -1:].clone()
    dest = torch.where(action_mask, cum - 1, length).long()
    pos = cum.sub_(1).clamp_(min=0).long()  # own temporary (count is read below: a separate copy)
    slots = torch.arange(length, device=action_mask.device, dtype=torch.int32)[None, :]
    return _Compact(pos, slots < n_actions, slots == n_actions - 1, ~action_mask, n_actions[:, 0].long()), dest


def _pack(x: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """Action-token entries of ``x`` (exactly 0 elsewhere) moved left in order; 0 in the padding."""
    return x.new_zeros(x.shape[0], x.shape[1] + 1).scatter_(1, dest, x)[:, :-1]


def _unpack(xc: torch.Tensor, cp: _Compact) -> torch.Tensor:
    """Inverse of :func:`_pack`: compact entries back to their token positions, exactly 0 elsewhere."""
    return xc.gather(1, cp.pos).masked_fill_(cp.off, 0.0)  # fills a fresh tensor: NaN-safe, no input touched


def _shift_left(xc: torch.Tensor) -> torch.Tensor:
    """``y_j = x_{j+1}``, 0 past the end (the value of the next action token)."""
    return torch.nn.functional.pad(xc[:, 1:], (0, 1))


class _Packed(NamedTuple):
    cp: _Compact
    delta: torch.Tensor  # [B, T] compact delta_j
    weight: torch.Tensor  # [B, T] compact w_j = exp(clamp(log_rho)), detached; 1 in the padding


def _packed(delta: torch.Tensor, log_w: torch.Tensor, action_mask: torch.Tensor) -> _Packed:
    """Compact ``delta`` and ``exp(log_w)`` (both exactly 0 off action tokens in token layout)."""
    cp, dest = _compaction(action_mask)
    return _Packed(cp, _pack(delta, dest), _pack(log_w, dest).exp_())


def _check_lambda(name: str, lam: float) -> None:
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {lam}")


# ----------------------------------------------------------------------------------------------
# Estimators


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    bootstrap_value: torch.Tensor | None = None,
) -> GAEOutput:
    """Generalised advantage estimation over action tokens, bridging tool spans (spec section 2).

    ::

        delta_t = r_t + gamma V(s_{t+1}) - V(s_t)       (V(s_{T+1}) = 0 or bootstrap_value)
        A_t     = delta_t + gamma lam A_{t+1},  A_{T+1} = 0
        G_t     = A_t + V(s_t)

    Args:
        rewards: ``[B, T] float32`` (already folded onto action tokens).
        values: ``[B, T] float32`` pre-update ``V(s_t)``.
        action_mask: ``[B, T] bool``.
        gamma, lam: discount and GAE lambda in [0, 1].
        bootstrap_value: optional ``[B] float32`` ``V(s_{T+1})`` of truncated rows.

    Returns: ``GAEOutput(advantages, returns)``, both ``[B, T] float32``, 0 off action tokens.
    """
    _check_lambda("lam", lam)
    delta = _prepare(rewards, values, action_mask, gamma=gamma, bootstrap_value=bootstrap_value)
    adv = _action_sums(delta, action_mask, gamma * lam).here
    del delta  # fewer live [B, T] temporaries: see benchmarks/ops_bench.py on the allocator
    return GAEOutput(_on_actions(action_mask, adv), _on_actions(action_mask, adv.add_(values)))


def vtrace(
    rewards: torch.Tensor,
    values: torch.Tensor,
    log_rho: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    rho_bar: float,
    c_bar: float,
    pg_rho_bar: float,
    bootstrap_value: torch.Tensor | None = None,
) -> VTraceOutput:
    """V-trace targets and policy-gradient advantages (IMPALA, arXiv 1802.01561; spec section 4).

    ::

        rho_t = min(rho_bar, w_t),   c_t = lam min(c_bar, w_t),   w_t = exp(clamp(log_rho_t))
        v_s - V(s_s) = rho_s delta_s + gamma c_s (v_{s+1} - V(s_{s+1})),   v_{T+1} = V(s_{T+1})
        A^pg_s = min(pg_rho_bar, w_s) (r_s + gamma v_{s+1} - V(s_s))

    Args: as :func:`gae`, plus ``log_rho: [B, T] float32`` ``= logp_old - logp_behav`` (detached).

    Returns: ``VTraceOutput(vs, pg_advantages)``, ``[B, T] float32``, 0 off action tokens.
    """
    _check_lambda("lam", lam)
    delta = _prepare(rewards, values, action_mask, gamma=gamma, bootstrap_value=bootstrap_value)
    pk = _packed(delta, _clean_log_rho(log_rho, action_mask, rewards), action_mask)
    rho = pk.weight.clamp(max=rho_bar)
    trace = lam * pk.weight.clamp(max=c_bar)
    excess = _reverse_linear_scan(rho * pk.delta, gamma * trace)  # v_s - V(s_s)
    pg = pk.weight.clamp(max=pg_rho_bar) * (pk.delta + gamma * _shift_left(excess))
    cp = pk.cp
    return VTraceOutput(_on_actions(action_mask, _unpack(excess, cp) + values), _unpack(pg, cp))


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
    """COPC's two-sided clipped-ratio weighted TD sums (spec 9.3, variants 9.4). [RECONSTRUCTED]

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
    _check_lambda("lam_critic", lam_critic)
    _check_lambda("lam_actor", lam_actor)
    if not low <= high:
        raise ValueError(f"clipped_td needs low <= high (e.g. 0.8, 1.2), got low={low}, high={high}")
    if advantage_window is not None and advantage_window < 0:
        raise ValueError(f"advantage_window must be >= 0 or None (infinite), got {advantage_window}")
    if trace not in ("none", "vtrace", "brace"):
        raise ValueError(f"unknown trace {trace!r}; valid: none, vtrace, brace")
    delta = _prepare(rewards, values, action_mask, gamma=gamma, bootstrap_value=bootstrap_value)
    log_w = _clean_log_rho(log_rho, action_mask, rewards)
    if trace == "none" and advantage_window is None:  # token layout, no compaction when gamma * lam == 1
        weighted = log_w.exp_().clamp_(min=low, max=high).mul_(delta)  # rho~ delta, 0 off action tokens
        need_after = not weight_own_residual
        d_sums = _action_sums(weighted, action_mask, gamma * lam_critic, after=need_after and lam_actor == lam_critic)
        e_sums = d_sums if lam_actor == lam_critic else _action_sums(weighted, action_mask, gamma * lam_actor, after=need_after)
        del log_w, weighted  # fewer live [B, T] temporaries: see benchmarks/ops_bench.py on the allocator
        adv = e_sums.here if e_sums.after is None else e_sums.after.mul_(gamma * lam_actor).add_(delta)
        advantages = _on_actions(action_mask, adv)  # before d_sums.here (maybe adv) is updated in place
        del delta, e_sums, adv
        return ClippedTDOutput(advantages, _on_actions(action_mask, d_sums.here.add_(values)))
    pk = _packed(delta, log_w, action_mask)
    d_c, e_c = _clipped_compact(pk, gamma, lam_critic, lam_actor, low, high, trace, trace_low, trace_high, advantage_window)
    adv_c = e_c if weight_own_residual else _shift_left(e_c).mul_(gamma * lam_actor).add_(pk.delta)
    return ClippedTDOutput(_unpack(adv_c, pk.cp), _on_actions(action_mask, _unpack(d_c, pk.cp) + values))


def _clipped_compact(
    pk: _Packed,
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
        return d_c, discounted_reverse_cumsum(pk.delta, gamma * lam_a) + _windowed(extra, gamma * lam_a, window)
    if trace_low is None or trace_high is None:
        raise ValueError(f"trace={trace!r} needs trace_low and trace_high (bounds on the ratio)")
    if not (trace_low <= low and trace_high <= high):
        warnings.warn(
            f"trace bounds [{trace_low}, {trace_high}] are not inside the advantage clip [{low}, {high}]: "
            "c_t can exceed rho~_t (spec 9.4 asks trace_low <= low and trace_high <= high)",
            stacklevel=3,
        )
    c = pk.weight.clamp(min=trace_low, max=trace_high)
    if trace == "vtrace":
        if window is not None:
            raise ValueError("advantage_window needs trace='none' (c_t = 1) or 'brace'; got trace='vtrace'")
        d_c = _reverse_linear_scan(rho * pk.delta, gamma * lam_c * c)
        return d_c, _reverse_linear_scan(rho * pk.delta, gamma * lam_a * c)
    if window is None:
        raise ValueError("trace='brace' needs advantage_window = k (e.g. 100)")
    return _brace_excess(pk, rho, lam_c * c, gamma, window), _brace_excess(pk, rho, lam_a * c, gamma, window)


def _brace_excess(pk: _Packed, rho: torch.Tensor, trace: torch.Tensor, gamma: float, k: int) -> torch.Tensor:
    """BRACE ``V_targ(s_s) - V(s_s)`` on compact arrays (spec 10.2), ``j = min(s + k, T)``::

        sum_{t=s}^{j-1} gamma^(t-s) P(s,t) rho_t delta_t + P(s,j) sum_{t=j}^{T} gamma^(t-s) delta_t

    with ``P(s,t) = prod_{i=s}^{t-1} c_i`` (``c`` includes lambda); the unweighted tail telescopes to the
    Monte-Carlo return ``gamma^(T-s) R - gamma^(j-s) V(s_j)``. For ``k >= T`` it is the V-trace
    recursion with the last token's rho set to 1; otherwise a loop over the k window offsets.
    """
    valid, last, length = pk.cp.valid, pk.cp.last, pk.delta.shape[1]
    mc = discounted_reverse_cumsum(pk.delta, gamma)  # sum_{t>=j} gamma^(t-j) delta_t
    if k >= length - 1:
        rho_last_one = torch.where(last, torch.ones_like(rho), rho)
        return _reverse_linear_scan(rho_last_one * pk.delta, gamma * trace)
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
    """BRACE capped, Monte-Carlo-anchored targets (arXiv 2609.09783; spec 10.2).

    ::

        rho_t = min(rho_bar, w_t),  c_i = lam min(c_bar, w_i),  j = min(s + k, T)
        V_targ(s_s) = V(s_s) + sum_{t=s}^{j-1} gamma^(t-s) (prod_{i=s}^{t-1} c_i) rho_t delta_t
                      + prod_{i=s}^{j-1} c_i [gamma^(T-s) R - gamma^(j-s) V(s_j)]
        A_s = r_s + gamma V_targ(s_{s+1}) - V(s_s),   V_targ(s_{T+1}) = V(s_{T+1}) (0 if terminal)

    ``k`` counts action tokens; ``k = 0`` gives the Monte-Carlo target ``gamma^(T-s) R``; ``k >= T``
    gives V-trace with ``rho_T := 1``. With ``bootstrap_value``, ``R`` becomes ``R + gamma V(s_{T+1})``.

    Returns: ``BraceOutput(advantages, returns)``, ``[B, T] float32``, 0 off action tokens.
    """
    _check_lambda("lam", lam)
    if k < 0:
        raise ValueError(f"brace horizon k must be >= 0 (BRACE default 100), got {k}")
    delta = _prepare(rewards, values, action_mask, gamma=gamma, bootstrap_value=bootstrap_value)
    pk = _packed(delta, _clean_log_rho(log_rho, action_mask, rewards), action_mask)
    excess = _brace_excess(pk, pk.weight.clamp(max=rho_bar), lam * pk.weight.clamp(max=c_bar), gamma, k)
    adv = pk.delta + gamma * _shift_left(excess)
    cp = pk.cp
    return BraceOutput(_unpack(adv, cp), _on_actions(action_mask, _unpack(excess, cp) + values))


# ----------------------------------------------------------------------------------------------
# Rewards and group baselines


def fold_rewards(token_rewards: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Move every reward onto an action token (spec section 0). ``[B, T] float32`` in and out.

    A reward on a non-action token is added to the nearest *preceding* action token; one before the
    first action token goes to the first action token; a row without action tokens drops its rewards.
    """
    check_bt("token_rewards", token_rewards)
    _check_float("token_rewards", token_rewards)
    check_mask("action_mask", action_mask, token_rewards)
    length = token_rewards.shape[1]
    slots = torch.arange(length, device=token_rewards.device).expand_as(action_mask)
    last_action = torch.where(action_mask, slots, torch.full_like(slots, -1)).cummax(dim=1).values
    first_action = action_mask.long().argmax(dim=1, keepdim=True).expand_as(slots)
    target = torch.where(last_action >= 0, last_action, first_action)
    has_action = action_mask.any(dim=1, keepdim=True)
    kept = torch.where(has_action, token_rewards, torch.zeros_like(token_rewards))
    folded = torch.zeros_like(kept).scatter_add(1, target, kept)
    return torch.where(action_mask, folded, torch.zeros_like(folded))


def group_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, *, mode: GroupMode, eps: float = 1e-6
) -> torch.Tensor:
    """Per-sequence group-relative advantages. ``scores: [B] float32``, ``group_ids: [B]`` integer.

    ::

        grpo:    (R_i - mean_g) / (std_g + eps)     (Bessel-corrected std, as torch.std / verl)
        drgrpo:  R_i - mean_g                       (Dr. GRPO: no std division)
        rloo:    R_i - (sum_g - R_i) / (n_g - 1)    (leave-one-out mean)

    A group of one sequence has no baseline: its advantage is 0 in every mode. Returns ``[B] float32``.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be [B], got shape {tuple(scores.shape)}")
    _check_float("scores", scores)
    if group_ids.shape != scores.shape or group_ids.is_floating_point():
        raise ValueError(f"group_ids must be an integer [B] tensor like scores, got {group_ids.dtype} {tuple(group_ids.shape)}")
    if mode not in ("grpo", "drgrpo", "rloo"):
        raise ValueError(f"unknown group advantage mode {mode!r}; valid: grpo, drgrpo, rloo")
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    zeros = torch.zeros(uniq.numel(), dtype=scores.dtype, device=scores.device)
    count = zeros.index_add(0, inverse, torch.ones_like(scores))
    total = zeros.index_add(0, inverse, scores)
    n_i, sum_i = count[inverse], total[inverse]
    mean_i = sum_i / n_i
    centred = scores - mean_i
    single = n_i < 2
    if mode == "drgrpo":
        adv = centred
    elif mode == "rloo":
        adv = scores - (sum_i - scores) / (n_i - 1).clamp(min=1)
    else:
        sq = zeros.index_add(0, inverse, centred * centred)
        std_i = torch.sqrt(sq[inverse] / (n_i - 1).clamp(min=1))
        adv = centred / (std_i + eps)
    return torch.where(single, torch.zeros_like(adv), adv)


def broadcast_to_tokens(per_seq: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """``per_seq: [B]`` copied onto every action token of its row; exactly 0 elsewhere. ``[B, T]``."""
    check_mask("action_mask", action_mask)
    if per_seq.shape != action_mask.shape[:1]:
        raise ValueError(f"per_seq must be [B] = {tuple(action_mask.shape[:1])}, got {tuple(per_seq.shape)}")
    return torch.where(action_mask, per_seq[:, None], torch.zeros((), dtype=per_seq.dtype))
