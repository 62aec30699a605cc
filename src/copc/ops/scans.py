"""The shared TD/trace machinery of the advantage channel: scans, the tool-span bridge, compaction.

The kernels under :mod:`copc.ops.advantages` (GAE, V-trace) and :mod:`copc.ops.corrected_advantages`
(``clipped_td``, BRACE); only :func:`discounted_reverse_cumsum` is part of the ``copc.ops`` facade.
Notation and conventions as in :mod:`copc.ops.advantages`: ``[B, T]``
float32 tensors, ``action_mask`` True on sampled tokens, and every recursion runs over action tokens
only, bridging tool-output spans.

Implementation: the bridge needs ``V`` at the next action token, which one running arg-max of the
flipped mask and one gather give in token layout (:func:`next_action_values`). With ``gamma * lam ==
1`` (the default) the recursion over action tokens is a plain reverse cumulative sum of residuals that
are 0 off action tokens, so the default GAE and ``clipped_td`` paths never compact. Discounts below 1
count powers in action tokens: there each row's action tokens are compacted to the left (scatter by
``cumsum`` index) and a blocked matrix scan runs on the dense array. The ratio-product trace paths
(V-trace, BRACE, ``clipped_td(trace="vtrace")``) take Python steps: a blocked scan of ~2 sqrt(T)
batch-vectorised steps, and BRACE's k window offsets.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from copc.ops.importance import LOG_RATIO_CLAMP
from copc.ops.masked import check_bt, check_mask

__all__ = [
    "ActionSums",
    "Compaction",
    "PackedTD",
    "action_sums",
    "check_float32",
    "check_lambda",
    "clean_log_rho",
    "compact_actions",
    "discounted_reverse_cumsum",
    "next_action_values",
    "on_actions",
    "pack",
    "pack_td",
    "reverse_linear_scan",
    "shift_left",
    "td_residuals",
    "truncated_traces",
    "unpack",
]

_CHUNK = 64  # block length of the matrix scan: powers g^0..g^64 never overflow, any g in [0, 1]


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


def reverse_linear_scan(x: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
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


def check_float32(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype != torch.float32:
        raise TypeError(
            f"{name} must be float32 (cast with .float() before the advantage channel), got {tensor.dtype}")


def on_actions(action_mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x`` on action tokens, exactly 0 elsewhere (NaN-safe forward and backward)."""
    return torch.where(action_mask, x, 0.0)


def next_action_values(values: torch.Tensor, action_mask: torch.Tensor,
                       terminal: torch.Tensor) -> torch.Tensor:
    """``V(s_next(t))`` on action tokens: ``values`` at the first action token after ``t``, else
    ``terminal[b]``.

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


def td_residuals(
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
    check_float32("rewards", rewards)
    check_bt("values", values, rewards)
    check_float32("values", values)
    check_mask("action_mask", action_mask, rewards)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}")
    if bootstrap_value is None:
        terminal = values.new_zeros(values.shape[0])
    else:
        if bootstrap_value.shape != rewards.shape[:1]:
            raise ValueError(f"bootstrap_value must be [B] = {tuple(rewards.shape[:1])}, got "
                             f"{tuple(bootstrap_value.shape)}")
        check_float32("bootstrap_value", bootstrap_value)
        terminal = bootstrap_value
    value_next = next_action_values(values, action_mask, terminal)
    return on_actions(action_mask, value_next.mul_(gamma).add_(rewards).sub_(values))  # own temporary


def clean_log_rho(log_rho: torch.Tensor, action_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``clamp(log_rho, +-20)`` on action tokens, 0 elsewhere; detached ``[B, T] float32``."""
    check_bt("log_rho", log_rho, like)
    check_float32("log_rho", log_rho)
    return on_actions(action_mask, log_rho.detach()).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


class ActionSums(NamedTuple):
    here: torch.Tensor  # [B, T] y_t = sum_{u >= t} g^(k) x_u over action tokens u (garbage off action tokens)
    after: torch.Tensor | None  # [B, T] y at the next action token after t (0 after the last), if asked


def action_sums(x: torch.Tensor, action_mask: torch.Tensor, discount: float, *,
                after: bool = False) -> ActionSums:
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
        # own temporary: sum_{u > t} x_u
        return ActionSums(here, prefix.neg_().add_(total) if after else None)
    # A lean :func:`compact_actions` (entries off action tokens are unspecified here): only the int32
    # running count stays alive across the scan, to keep the heap small.
    length = x.shape[1]
    count = action_mask.cumsum(dim=1, dtype=torch.int32).sub_(1)  # compact slot of each action token
    dest = torch.where(action_mask, count, length).long()  # non-action entries land in a dropped slot
    packed = pack(x, dest)
    del dest
    here_c = discounted_reverse_cumsum(packed, discount)
    del packed
    slot = count.clamp_(min=0).long()
    del count
    return ActionSums(here_c.gather(1, slot), shift_left(here_c).gather(1, slot) if after else None)


# ----------------------------------------------------------------------------------------------
# Compaction of action tokens, for recursions that count action tokens (discounts < 1, traces, windows)


class Compaction(NamedTuple):
    pos: torch.Tensor  # [B, T] long: compact index of each action token (clamped >= 0)
    valid: torch.Tensor  # [B, T] bool: compact index < number of action tokens of the row
    last: torch.Tensor  # [B, T] bool: the compact slot of each row's last action token
    off: torch.Tensor  # [B, T] bool: ~action_mask (token layout)
    n_actions: torch.Tensor  # [B] long


def compact_actions(action_mask: torch.Tensor) -> tuple[Compaction, torch.Tensor]:
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
    return Compaction(pos, slots < n_actions, slots == n_actions - 1, ~action_mask,
                      n_actions[:, 0].long()), dest


def pack(x: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """Action-token entries of ``x`` (exactly 0 elsewhere) moved left in order; 0 in the padding."""
    return x.new_zeros(x.shape[0], x.shape[1] + 1).scatter_(1, dest, x)[:, :-1]


def unpack(xc: torch.Tensor, cp: Compaction) -> torch.Tensor:
    """Inverse of :func:`pack`: compact entries back to their token positions, exactly 0 elsewhere."""
    return xc.gather(1, cp.pos).masked_fill_(cp.off, 0.0)  # fills a fresh tensor: NaN-safe, no input touched


def shift_left(xc: torch.Tensor) -> torch.Tensor:
    """``y_j = x_{j+1}``, 0 past the end (the value of the next action token)."""
    return torch.nn.functional.pad(xc[:, 1:], (0, 1))


class PackedTD(NamedTuple):
    cp: Compaction
    delta: torch.Tensor  # [B, T] compact delta_j
    weight: torch.Tensor  # [B, T] compact w_j = exp(clamp(log_rho)), detached; 1 in the padding


def pack_td(delta: torch.Tensor, log_w: torch.Tensor, action_mask: torch.Tensor) -> PackedTD:
    """Compact ``delta`` and ``exp(log_w)`` (both exactly 0 off action tokens in token layout)."""
    cp, dest = compact_actions(action_mask)
    return PackedTD(cp, pack(delta, dest), pack(log_w, dest).exp_())


def truncated_traces(pk: PackedTD, *, lam: float, rho_bar: float,
                     c_bar: float) -> tuple[torch.Tensor, torch.Tensor]:
    """IMPALA's truncated weights on the compact ratios (V-trace, BRACE): ``(rho, c)`` with
    ``rho_j = min(rho_bar, w_j)`` and the trace ``c_j = lam * min(c_bar, w_j)``."""
    return pk.weight.clamp(max=rho_bar), lam * pk.weight.clamp(max=c_bar)


def check_lambda(name: str, lam: float) -> None:
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {lam}")
