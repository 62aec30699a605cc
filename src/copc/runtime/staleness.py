"""Staleness policies, as small pure functions (no I/O, no threads), and realized-staleness statistics.

Versions and steps (docs/formulas.md#staleness). The trainer starts at version 0 (the warm start).
Training step ``n`` (0-based) runs with the weights of version ``n`` and publishes version ``n + 1``,
so "the step index" and "the trainer version when the batch is consumed" are the same number ``n``.
Every generated token carries the version ``v_t`` that sampled it.

Two modes share one admission formula and differ in which stored trajectories a step may consume:

- ``fixed_lag`` (controlled sweeps, reproducible): step ``n`` consumes trajectories of version exactly
  ``source_version(n) = max(0, n - s)``. The first ``s`` steps have no version ``n - s < 0``, so the warm
  start (version 0) supplies the first ``s + 1`` batches, as a FIFO of ``s`` batches pre-filled at
  version 0 would. A multi-version trajectory (partial rollout) is filed under ``min_t v_t``.
- ``bounded`` (AReaL-style, throughput): any stored trajectory may be consumed, oldest first
  (smallest ``min_t v_t``, then arrival); nothing is dropped for age. The lag is bounded by pacing
  generation: with current version ``i``, batch size ``B`` and ``N_r`` trajectories requested so far
  (the new request would be the ``N_r``-th, 0-based), the request is admitted only if

      floor(N_r / B) <= i + s.

  Request ``N_r`` belongs to batch ``j = floor(N_r / B)``, consumed at step ``j``; it is sampled by a
  version ``>= i``, so its lag is at most ``j - i <= s``. This is AReaL's ``floor((N_r - 1)/B) <= i + η``
  with ``N_r`` counting the new request itself. ``s = 0`` admits exactly one batch per version
  (synchronous). A trajectory finishing out of order can still be consumed a step or two late; that
  lag above ``s`` is not hidden: :func:`realized_staleness` reports it per token.

The same formula paces ``fixed_lag`` generation. There batch ``j`` must be sampled by version exactly
``max(0, j - s)``, and the formula admits batch ``j`` from version ``i = j - s`` on, i.e. exactly when
the weights it needs are published; :func:`fixed_lag_quota` says how many trajectories each version
generates (``(s + 1)·B`` for version 0, ``B`` after).

Realized staleness of a trajectory consumed at version ``n`` (PACE's split, docs/formulas.md#staleness):
``s_max = n - min_t v_t`` (what AReaL/BRACE/DORA bound), ``s_gen = max_t v_t - min_t v_t`` (generation
staleness: versions picked up while it was generated, > 0 only with partial rollouts),
``s_wait = n - max_t v_t`` (waiting staleness: versions that passed after its last sampled token).
Per-token staleness is ``n - v_t``.

**PACE filter** (``filter="pace"``, bounded only; docs/algorithms.md "PACE" for what is reconstructed):
the effective-staleness score of a trajectory is

    score = s_wait + beta * g,    g = (1/T) sum_t (max_u v_u - v_t)   (sampled tokens t = 1..T)

so with ``beta = 1`` it is the token-mean staleness ``n - mean_t v_t``, not the oldest token's
``n - min_t v_t``; a long partial rollout whose first few tokens are old scores little more than a fresh one.
The pool occupancy ``P`` (completed trajectories stored when step ``n`` takes its batch, that batch
included) above a target ``C = target_batches * B`` becomes the step's rejection budget

    budget = min(floor(gain * max(0, P - C)), floor(max_reject_frac * |batch|))

and whole groups (all samples of one prompt, so group baselines stay well formed) are rejected in
decreasing group score (mean of its members'; ties: smaller group id first) while they fit in the
budget, skipping groups scoring below ``min_score`` and never the last group of a batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from copc.config import check_one_of
from copc.types import Trajectory

StalenessMode = Literal["fixed_lag", "bounded"]
StalenessFilter = Literal["none", "pace"]
STALENESS_MODES: tuple[str, ...] = get_args(StalenessMode)
STALENESS_FILTERS: tuple[str, ...] = get_args(StalenessFilter)


@dataclass(frozen=True)
class PaceConfig:
    """Parameters of the PACE filter (module docstring; reconstructed, docs/algorithms.md)."""

    gen_weight: float = 1.0
    """beta: weight of the prefix-aware generation staleness g in the score (1 = token-mean staleness)."""
    target_batches: float = 1.0
    """C / B: pool occupancy (completed trajectories, in batches) above which rejection starts."""
    gain: float = 1.0
    """Trajectories of rejection budget per trajectory of pool occupancy above the target."""
    max_reject_frac: float = 0.5
    """At most this fraction of one step's batch is rejected."""
    min_score: float = 1.0
    """Groups whose score is below this [versions] are never rejected."""

    def __post_init__(self) -> None:
        for name in ("gen_weight", "target_batches", "gain", "min_score"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"staleness.pace.{name} must be finite and >= 0, got {getattr(self, name)}")
        if not 0 <= self.max_reject_frac < 1:
            raise ValueError(f"staleness.pace.max_reject_frac must be in [0, 1), got {self.max_reject_frac}")


@dataclass(frozen=True)
class StalenessConfig:
    """How stale the data a training step consumes may be."""

    mode: StalenessMode = "bounded"
    """fixed_lag: step n consumes version exactly max(0, n - s); bounded: lag <= s by admission control."""
    staleness: int = 8
    """s: the lag (fixed_lag) or the lag bound (bounded), in trainer versions; 0 = synchronous."""
    filter: StalenessFilter = "none"
    """none: train on every consumed trajectory; pace: reject the stalest groups when the pool is overfull
    (bounded)."""
    pace: PaceConfig = field(default_factory=PaceConfig)
    """PACE parameters (used with filter=pace)."""

    def __post_init__(self) -> None:
        check_one_of("staleness.filter", self.filter, STALENESS_FILTERS)
        if self.filter == "pace" and self.mode != "bounded":
            raise ValueError("staleness.filter=pace needs staleness.mode=bounded (fixed_lag prescribes every "
                             "batch); set staleness.mode=bounded or staleness.filter=none")
        if self.mode not in STALENESS_MODES:
            raise ValueError(f"staleness.mode must be one of {', '.join(STALENESS_MODES)}, got {self.mode!r}")
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, int) or self.staleness < 0:
            raise ValueError(
                f"staleness.staleness must be an integer >= 0 (0 = synchronous), got {self.staleness!r}"
            )

    @property
    def fixed_lag(self) -> bool:
        """Every batch's sampling version is prescribed (``mode = fixed_lag``), not only bounded."""
        return self.mode == "fixed_lag"

    def wanted_version(self, batch_index: int) -> int | None:
        """The version that must sample batch ``batch_index`` (fixed_lag); None when any may (bounded)."""
        return source_version(batch_index, self.staleness) if self.fixed_lag else None

    def oldest_needed(self, version: int) -> int:
        """The oldest version a driver keeps at ``version``: ``max(0, version - s)`` under fixed_lag (the
        batches still to sample need them), ``version`` itself under bounded."""
        return max(0, version - self.staleness) if self.fixed_lag else version


def admits_request(*, version: int, batch_size: int, num_requested: int, staleness: int) -> bool:
    """Whether a new generation request may start now: ``floor(N_r / B) <= i + s``.

    Args:
        version: ``i``, the latest trainer version (the weights a new request would use, at the oldest).
        batch_size: ``B``, trajectories consumed per training step.
        num_requested: ``N_r``, trajectories requested so far (0-based index of the new request).
        staleness: ``s`` >= 0.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    if staleness < 0 or version < 0 or num_requested < 0:
        raise ValueError(
            f"version, num_requested and staleness must be >= 0, got {version}, {num_requested}, {staleness}"
        )
    return num_requested // batch_size <= version + staleness


def request_capacity(*, version: int, batch_size: int, num_requested: int, staleness: int) -> int:
    """How many more requests :func:`admits_request` would admit at ``version``: ``B·(i+s+1) − N_r``, >= 0."""
    if not admits_request(
        version=version, batch_size=batch_size, num_requested=num_requested, staleness=staleness
    ):
        return 0
    return batch_size * (version + staleness + 1) - num_requested


def source_version(step: int, staleness: int) -> int:
    """The version a ``fixed_lag`` training step consumes: ``max(0, step - s)``."""
    if step < 0 or staleness < 0:
        raise ValueError(f"step and staleness must be >= 0, got {step}, {staleness}")
    return max(0, step - staleness)


def fixed_lag_quota(version: int, staleness: int, batch_size: int) -> int:
    """Trajectories version ``v`` must generate under ``fixed_lag``: ``(s+1)·B`` for v = 0, else ``B``."""
    if version < 0 or staleness < 0 or batch_size <= 0:
        raise ValueError(
            f"need version >= 0, staleness >= 0, batch_size > 0; got {version}, {staleness}, {batch_size}"
        )
    return batch_size * (staleness + 1) if version == 0 else batch_size


def eligible(mode: StalenessMode, *, step: int, staleness: int, min_version: int) -> bool:
    """Whether a trajectory filed under ``min_version`` may be consumed at ``step``.

    fixed_lag: ``min_version == source_version(step, s)``; bounded: always (oldest first is the
    caller's order; the bound comes from admission control, nothing is refused for age).
    """
    if mode == "fixed_lag":
        return min_version == source_version(step, staleness)
    return True


def expired(mode: StalenessMode, *, step: int, staleness: int, min_version: int) -> bool:
    """Whether a stored trajectory can never be consumed at ``step`` or later (fixed_lag only).

    A fixed_lag step ``n`` consumes version ``max(0, n - s)``, non-decreasing in ``n``; a trajectory of an
    older version is unreachable. The buffer counts such trajectories as dropped (``unscheduled``): this
    is a scheduling error of the producer (too many of a version), not a drop for age.
    """
    return mode == "fixed_lag" and min_version < source_version(step, staleness)


@dataclass(frozen=True)
class StalenessStats:
    """Realized staleness of one batch consumed at trainer version ``n`` (all python floats/ints).

    ``token_*`` are over sampled tokens (``n - v_t``); ``max_*`` / ``gen_*`` / ``wait_*`` are per
    trajectory (``s_max``, ``s_gen``, ``s_wait``) averaged or maxed over the batch. ``histogram[k]`` is
    the number of sampled tokens with staleness ``k`` (``k = 0..max``).
    """

    token_mean: float
    token_max: int
    s_max_mean: float
    s_max_max: int
    s_gen_mean: float
    s_gen_max: int
    s_wait_mean: float
    s_wait_max: int
    num_tokens: int
    histogram: tuple[int, ...]
    #: Distinct versions among a trajectory's sampled tokens, mean and max over the batch (1 = one version).
    versions_mean: float = 0.0
    versions_max: int = 0

    def token_values(self) -> torch.Tensor:
        """Per-token staleness values ``[N] int64`` rebuilt from the histogram (for TensorBoard)."""
        counts = torch.tensor(self.histogram, dtype=torch.int64)
        return torch.repeat_interleave(torch.arange(len(self.histogram), dtype=torch.int64), counts)


def realized_staleness(trajectories: Sequence[Trajectory], version: int) -> StalenessStats:
    """Per-token and per-trajectory staleness of a batch consumed at trainer version ``n = version``.

    Only sampled tokens count (``action_mask`` True). A trajectory with no sampled token contributes
    nothing. Negative staleness (a token from a version newer than ``n``) is a bookkeeping bug upstream
    and raises.
    """
    lags, s_max, s_gen, s_wait, distinct = [], [], [], [], []
    for traj in trajectories:
        versions_T = traj.policy_version[traj.action_mask]
        if versions_T.numel() == 0:
            continue
        lag_T = version - versions_T
        lags.append(lag_T)
        v_min, v_max = int(versions_T.min()), int(versions_T.max())
        s_max.append(version - v_min)
        s_gen.append(v_max - v_min)
        s_wait.append(version - v_max)
        distinct.append(int(torch.unique(versions_T).numel()))
    if not lags:
        return StalenessStats(0.0, 0, 0.0, 0, 0.0, 0, 0.0, 0, 0, ())
    lag_N = torch.cat(lags).to(torch.int64)
    if int(lag_N.min()) < 0:
        raise ValueError(
            f"a token was sampled by version {version - int(lag_N.min())}, newer than the consuming "
            f"trainer version {version}: policy_version tags or the step counter are wrong upstream"
        )
    histogram = torch.bincount(lag_N).tolist()
    return StalenessStats(
        token_mean=float(lag_N.double().mean()),
        token_max=int(lag_N.max()),
        s_max_mean=sum(s_max) / len(s_max),
        s_max_max=max(s_max),
        s_gen_mean=sum(s_gen) / len(s_gen),
        s_gen_max=max(s_gen),
        s_wait_mean=sum(s_wait) / len(s_wait),
        s_wait_max=max(s_wait),
        num_tokens=int(lag_N.numel()),
        histogram=tuple(int(c) for c in histogram),
        versions_mean=sum(distinct) / len(distinct),
        versions_max=max(distinct),
    )


# ------------------------------------------------------------------------------------------- PACE
def prefix_generation_staleness(policy_version: torch.Tensor, action_mask: torch.Tensor) -> float:
    """PACE's prefix-aware generation staleness ``g = (1/T) sum_t (max_u v_u - v_t)`` over sampled tokens.

    Args:
        policy_version: ``[L] int64``, the version of each token (-1 where not sampled).
        action_mask: ``[L] bool``, True on sampled tokens.

    Returns:
        ``g`` in versions: 0 for a single-version trajectory or one without sampled tokens; at most
        ``s_gen = max_t v_t - min_t v_t``, reached only when every token but the newest is oldest.
    """
    versions_T = policy_version[action_mask]
    if versions_T.numel() == 0:
        return 0.0
    return float((versions_T.max() - versions_T).double().mean())


def effective_staleness(traj: Trajectory, step: int, *, gen_weight: float, filed_version: int) -> float:
    """PACE score ``s_wait + beta * g`` of ``traj`` consumed at ``step`` (module docstring).

    ``filed_version`` is used as ``max_t v_t`` of a trajectory without sampled tokens (its batch's version).
    """
    v_end = traj.max_version if traj.max_version >= 0 else filed_version
    return float(step - v_end) + gen_weight * prefix_generation_staleness(traj.policy_version,
                                                                          traj.action_mask)


def pace_budget(*, pool: int, target: float, batch: int, gain: float, max_reject_frac: float) -> int:
    """Trajectories PACE may reject this step: ``min(floor(gain * max(0, P - C)), floor(f * |batch|))``.

    Args:
        pool: ``P``, completed trajectories stored when the batch is taken (the batch included).
        target: ``C``, the occupancy below which nothing is rejected.
        batch: trajectories in the batch being taken.
        gain: budget per trajectory of excess occupancy.
        max_reject_frac: ``f`` in [0, 1).
    """
    if pool < 0 or batch < 0 or target < 0 or gain < 0 or not 0 <= max_reject_frac < 1:
        raise ValueError(f"pace_budget: bad arguments pool={pool} batch={batch} target={target} gain={gain} "
                         f"max_reject_frac={max_reject_frac}")
    excess = max(0.0, pool - target)
    # The epsilon keeps floor(0.5 * 6) = 3 from becoming 2 through float rounding of gain * excess.
    return min(math.floor(gain * excess + 1e-9), math.floor(max_reject_frac * batch + 1e-9))


def pace_select(group_scores: Sequence[float], group_sizes: Sequence[int], *, budget: int,
                min_score: float) -> list[int]:
    """Indices of the groups PACE rejects, in rejection order (module docstring).

    Groups are taken in decreasing score (ties: smaller index first) while their size fits in what is
    left of ``budget``; the first that does not fit ends the selection. Groups scoring below
    ``min_score`` are never rejected, nor the last group left.
    """
    if len(group_scores) != len(group_sizes):
        raise ValueError(f"pace_select: {len(group_scores)} scores for {len(group_sizes)} groups")
    order = sorted(range(len(group_scores)), key=lambda k: (-group_scores[k], k))
    rejected: list[int] = []
    left = budget
    for k in order:
        if group_scores[k] < min_score or group_sizes[k] > left or len(rejected) + 1 >= len(group_scores):
            break
        rejected.append(k)
        left -= group_sizes[k]
    return rejected
