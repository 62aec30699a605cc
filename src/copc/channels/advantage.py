"""The advantage channel: the estimator config, its registry and the dispatch to ``copc.ops``.

:class:`AdvantageChannelConfig` names a registered estimator (gae, vtrace, clipped_td, brace, group)
and its parameters; :func:`compute_advantages` folds rewards onto action tokens, runs the estimator
once per step on the whole batch, normalises the advantages as configured (whiten | scale | center |
none, with an optional std floor) and returns them with the critic targets and diagnostics. The config, the
registry and its entries live together here, so building a config always validates against the full registry.
Re-exported by :mod:`copc.channels`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from copc import tracking as m
from copc.config import check_one_of
from copc.ops import (
    ADVANTAGE_NORMS,
    AdvantageNorm,
    GAEOutput,
    brace,
    broadcast_to_tokens,
    check_mask,
    clipped_td,
    discounted_reverse_cumsum,
    fold_rewards,
    gae,
    group_advantages,
    importance_diagnostics,
    masked_mean,
    masked_var,
    normalize_advantages,
    vtrace,
)
from copc.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageChannelConfig",
    "AdvantageEstimator",
    "AdvantageInputs",
    "AdvantageResult",
    "Estimate",
    "compute_advantages",
]


class AdvantageInputs(NamedTuple):
    """Everything an estimator may read; ``[B, T]`` unless stated; None where not computed."""

    rewards: torch.Tensor  # folded onto action tokens
    values: torch.Tensor | None  # pre-update V(s_t)
    log_w: torch.Tensor | None  # old - mu, detached
    action_mask: torch.Tensor
    scores: torch.Tensor | None  # [B] sequence scores (group estimators)
    group_ids: torch.Tensor | None  # [B] integer prompt ids
    bootstrap_value: torch.Tensor | None  # [B] V(s_{T+1}) of truncated rows
    oracle: torch.Tensor | None = None  # the Monte-Carlo oracle's chunk advantages (copc.rollout.oracle)


class AdvantageResult(NamedTuple):
    """Advantages (whitened if configured) for the actor, returns (never whitened) for the critic."""

    advantages: torch.Tensor  # [B, T] float32, 0 off action tokens
    returns: torch.Tensor  # [B, T] float32 critic targets, 0 off action tokens
    stats: dict[str, torch.Tensor]  # detached scalars


class Estimate(NamedTuple):
    """What an estimator returns: advantages before normalisation, critic targets, an IS factor."""

    advantages: torch.Tensor  # [B, T] float32, 0 off action tokens (before is_weight)
    returns: torch.Tensor  # [B, T] float32 critic targets, 0 off action tokens
    #: [B, T] detached factor applied AFTER normalisation (V-trace's rho^pg), None = 1: a normalisation
    #: shift then sits inside the importance weight, as the baseline V(s_t) does.
    is_weight: torch.Tensor | None = None


EstimatorFn = Callable[["AdvantageChannelConfig", AdvantageInputs], Estimate]


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: ``fn(cfg, inputs) -> Estimate`` and what it reads."""

    fn: EstimatorFn
    needs_critic: bool
    needs_log_w: bool
    group_normalised: bool
    doc: str
    #: Reads the oracle's advantages, which the run computes for every batch before the step.
    needs_oracle: bool = False


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
_TRACES = ("none", "vtrace", "brace")


@dataclass(frozen=True)
class AdvantageChannelConfig:
    """Advantage / critic-target estimator and its parameters (docs/formulas.md#ppo, #v-trace, #dapo, #r0,
    #variants, #brace)."""

    estimator: str = "gae"
    """Registered estimator: gae, vtrace, clipped_td (COPC), brace, group, mc_oracle (Monte-Carlo oracle)."""
    gamma: float = 1.0
    """Discount over policy tokens."""
    lam_critic: float = 1.0
    """lambda of the critic target (GAE lambda_c; V-trace / BRACE lambda)."""
    lam_actor: float = 1.0
    """lambda of the actor advantages (decoupled GAE lambda_a; gae and clipped_td)."""
    ratio_low: float = 0.8
    """clipped_td: lower bound of rho~ = clip(w, ratio_low, ratio_high) (1 - eps_A^-)."""
    ratio_high: float = 1.2
    """clipped_td: upper bound of rho~ (1 + eps_A^+)."""
    trace: Literal["none", "vtrace", "brace"] = "none"
    """clipped_td traces c_t: none (c = 1), vtrace (clipped ratio products), brace (k-capped)."""
    trace_low: float | None = None
    """clipped_td: lower bound of c_t = clip(w, trace_low, trace_high) when trace != none."""
    trace_high: float | None = None
    """clipped_td: upper bound of c_t when trace != none."""
    advantage_window: int | None = None
    """clipped_td: k_A policy tokens over which rho~ applies (None = infinity); BRACE-trace horizon."""
    weight_own_residual: bool = False
    """clipped_td: A_t = E_t (own residual weighted by rho~_t) instead of delta_t + gamma lam_a E_{t+1}."""
    rho_bar: float = 1.0
    """vtrace / brace: rho = min(rho_bar, w)."""
    c_bar: float = 1.0
    """vtrace / brace: c = lambda * min(c_bar, w)."""
    pg_rho_bar: float = 1.0
    """vtrace: rho^pg = min(pg_rho_bar, w) inside the policy-gradient advantage."""
    brace_k: int = 100
    """brace: ratio-product horizon k in policy tokens."""
    group_mode: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    """group: z-score (grpo), centred only (drgrpo), leave-one-out baseline (rloo)."""
    group_eps: float = 1e-6
    """group: epsilon added to the group std (grpo)."""
    whiten: bool = True
    """Normalise advantages once per step over all policy tokens (never with group estimators)."""
    normalize: AdvantageNorm = "whiten"
    """With whiten=True: whiten (A - m)/s, scale A/s (no mean shift), center A - m, or none."""
    std_floor: float = 0.0
    """s = max(std, std_floor) in whiten / scale (0 = plain std): noise-only batches stay small."""

    def __post_init__(self) -> None:
        ADVANTAGE_ESTIMATORS.check(self.estimator, field="advantage.estimator")
        for name in ("gamma", "lam_critic", "lam_actor"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"advantage.{name} must be in [0, 1], got {value}")
        if not 0.0 <= self.ratio_low <= 1.0 <= self.ratio_high:
            raise ValueError(
                f"advantage.ratio_low/ratio_high must satisfy 0 <= low <= 1 <= high (e.g. 0.8, 1.2), "
                f"got {self.ratio_low}, {self.ratio_high}"
            )
        check_one_of("advantage.trace", self.trace, _TRACES)
        if self.trace != "none" and (self.trace_low is None or self.trace_high is None):
            raise ValueError(f"advantage.trace={self.trace!r} needs trace_low and trace_high (e.g. 0.9, 1.1)")
        if self.trace != "none" and not 0.0 <= self.trace_low <= self.trace_high:  # type: ignore[operator]
            raise ValueError(  # clamp(min > max) gives every c_t the upper bound without a word
                f"advantage.trace_low/trace_high must satisfy 0 <= low <= high (e.g. 0.9, 1.1), "
                f"got {self.trace_low}, {self.trace_high}"
            )
        if self.trace == "vtrace" and self.advantage_window is not None:
            raise ValueError(
                "advantage.advantage_window needs trace='none' or 'brace'; set it to None for trace='vtrace'")
        if self.trace == "brace" and self.advantage_window is None:
            raise ValueError("advantage.trace='brace' needs advantage_window = k (e.g. 100)")
        if self.advantage_window is not None and self.advantage_window < 0:
            raise ValueError(
                f"advantage.advantage_window must be >= 0 or None (infinite), got {self.advantage_window}")
        for name in ("rho_bar", "c_bar", "pg_rho_bar"):
            if not getattr(self, name) > 0:
                raise ValueError(f"advantage.{name} must be > 0, got {getattr(self, name)}")
        if self.brace_k < 0:
            raise ValueError(f"advantage.brace_k must be >= 0 (BRACE 100), got {self.brace_k}")
        check_one_of("advantage.group_mode", self.group_mode, ("grpo", "drgrpo", "rloo"))
        check_one_of("advantage.normalize", self.normalize, ADVANTAGE_NORMS)
        if not self.std_floor >= 0:
            raise ValueError(
                f"advantage.std_floor must be >= 0 (0 = no floor, e.g. 0.1), got {self.std_floor}")
        if not self.group_eps > 0:
            raise ValueError(f"advantage.group_eps must be > 0, got {self.group_eps}")
        if self.whiten and ADVANTAGE_ESTIMATORS.get(self.estimator).group_normalised:
            raise ValueError(
                f"advantage.estimator={self.estimator!r} is already "
                "group-normalised; set advantage.whiten=False"
            )

    @property
    def normalization(self) -> AdvantageNorm:
        """The normalisation applied: ``normalize`` when ``whiten`` is on, else ``"none"``."""
        return self.normalize if self.whiten else "none"

    @property
    def needs_critic(self) -> bool:
        """True if the estimator reads values V(s_t) (so a critic must be trained)."""
        return ADVANTAGE_ESTIMATORS.get(self.estimator).needs_critic

    @property
    def needs_old_forward(self) -> bool:
        """True if the estimator reads the behaviour ratio ``log_w = old - mu``."""
        return ADVANTAGE_ESTIMATORS.get(self.estimator).needs_log_w

    @property
    def needs_oracle(self) -> bool:
        """True if the estimator reads the Monte-Carlo oracle's advantages (given with every batch)."""
        return ADVANTAGE_ESTIMATORS.get(self.estimator).needs_oracle


def _estimator(
    name: str, *, needs_critic: bool, needs_log_w: bool, group: bool = False, oracle: bool = False, doc: str
) -> Callable[[EstimatorFn], EstimatorFn]:
    def decorate(fn: EstimatorFn) -> EstimatorFn:
        ADVANTAGE_ESTIMATORS.add(name, AdvantageEstimator(fn, needs_critic, needs_log_w, group, doc, oracle))
        return fn

    return decorate


def _off_policy(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rewards, values, log_w, action_mask)`` for an estimator that reads the critic and the ratio
    (:func:`compute_advantages` has checked that both are given)."""
    assert x.values is not None and x.log_w is not None
    return x.rewards, x.values, x.log_w, x.action_mask


@_estimator("gae", needs_critic=True, needs_log_w=False,
            doc="GAE(gamma, lambda), decoupled lambda_c / lambda_a")
def _gae(cfg: AdvantageChannelConfig, x: AdvantageInputs) -> Estimate:
    values = x.values
    assert values is not None

    def run(lam: float) -> GAEOutput:
        return gae(x.rewards, values, x.action_mask, gamma=cfg.gamma, lam=lam,
                   bootstrap_value=x.bootstrap_value)

    critic = run(cfg.lam_critic)
    if cfg.lam_actor == cfg.lam_critic:
        return Estimate(critic.advantages, critic.returns)
    return Estimate(run(cfg.lam_actor).advantages, critic.returns)


@_estimator("vtrace", needs_critic=True, needs_log_w=True,
            doc="V-trace targets vs and pg advantages (pi = old)")
def _vtrace(cfg: AdvantageChannelConfig, x: AdvantageInputs) -> Estimate:
    out = vtrace(
        *_off_policy(x), gamma=cfg.gamma, lam=cfg.lam_critic, rho_bar=cfg.rho_bar, c_bar=cfg.c_bar,
        pg_rho_bar=cfg.pg_rho_bar, bootstrap_value=x.bootstrap_value,
    )
    return Estimate(out.pg_td, out.vs, out.pg_rho)


@_estimator("clipped_td", needs_critic=True, needs_log_w=True,
            doc="COPC two-sided clipped-ratio weighted TD sums")
def _clipped_td(cfg: AdvantageChannelConfig, x: AdvantageInputs) -> Estimate:
    out = clipped_td(
        *_off_policy(x), gamma=cfg.gamma, lam_critic=cfg.lam_critic, lam_actor=cfg.lam_actor,
        low=cfg.ratio_low,
        high=cfg.ratio_high, trace=cfg.trace, trace_low=cfg.trace_low, trace_high=cfg.trace_high,
        advantage_window=cfg.advantage_window, weight_own_residual=cfg.weight_own_residual,
        bootstrap_value=x.bootstrap_value,
    )
    return Estimate(out.advantages, out.returns)


@_estimator("brace", needs_critic=True, needs_log_w=True, doc="BRACE k-capped, Monte-Carlo-anchored targets")
def _brace(cfg: AdvantageChannelConfig, x: AdvantageInputs) -> Estimate:
    out = brace(
        *_off_policy(x), gamma=cfg.gamma, lam=cfg.lam_critic, rho_bar=cfg.rho_bar, c_bar=cfg.c_bar,
        k=cfg.brace_k,
        bootstrap_value=x.bootstrap_value,
    )
    return Estimate(out.advantages, out.returns)


@_estimator("group", needs_critic=False, needs_log_w=False, group=True,
            doc="group-relative sequence advantages (GRPO/Dr.GRPO/RLOO)")
def _group(cfg: AdvantageChannelConfig, x: AdvantageInputs) -> Estimate:
    if x.scores is None or x.group_ids is None:
        raise ValueError("advantage.estimator='group' needs scores [B] and group_ids [B]; pass both")
    per_seq = group_advantages(x.scores, x.group_ids, mode=cfg.group_mode, eps=cfg.group_eps)
    return Estimate(broadcast_to_tokens(per_seq, x.action_mask), broadcast_to_tokens(x.scores.float(),
                                                                                     x.action_mask))


@_estimator("mc_oracle", needs_critic=False, needs_log_w=False, oracle=True,
            doc="the current policy's chunk advantages from Monte-Carlo continuations (copc.rollout.oracle)")
def _mc_oracle(cfg: AdvantageChannelConfig, x: AdvantageInputs) -> Estimate:
    if x.oracle is None:
        raise ValueError(
            "advantage.estimator='mc_oracle' needs the oracle's advantages with the batch; the run "
                         "computes them when the method's estimator is mc_oracle (oracle.samples >= 1)")
    returns = torch.where(x.action_mask, discounted_reverse_cumsum(x.rewards, 1.0), 0.0)  # reward-to-go
    return Estimate(torch.where(x.action_mask, x.oracle.float(), 0.0), returns)


def compute_advantages(
    cfg: AdvantageChannelConfig,
    *,
    rewards: torch.Tensor,
    values: torch.Tensor | None,
    log_w: torch.Tensor | None,
    action_mask: torch.Tensor,
    scores: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    bootstrap_value: torch.Tensor | None = None,
    stats_mask: torch.Tensor | None = None,
    oracle: torch.Tensor | None = None,
) -> AdvantageResult:
    """Advantages and critic targets for the whole step's batch, computed once before the update.

    Args:
        rewards: ``[B, T] float32`` token rewards; folded onto action tokens here (docs/formulas.md#notation).
        values: ``[B, T] float32`` pre-update V(s_t) (None only for estimators without a critic).
        log_w: ``[B, T] float32`` ``old - mu`` (None only for estimators that do not read it).
        action_mask: ``[B, T] bool``.
        scores, group_ids: ``[B]`` sequence scores and integer prompt ids (group estimator).
        bootstrap_value: ``[B]`` V(s_{T+1}) for ``truncation = bootstrap`` rows (0 = terminal).
        oracle: ``[B, T] float32`` the Monte-Carlo oracle's chunk advantages (``mc_oracle`` only).
        stats_mask: ``[B, T] bool``, the action tokens that enter the losses (default: all of
            ``action_mask``; ``truncation = mask`` drops truncated rows): the normalisation statistics
            and the diagnostics are taken over them, and advantages are 0 elsewhere.

    Advantages are normalised (``cfg.normalization``; mean / Bessel-corrected variance over ALL loss
    tokens of the batch, before any policy-channel mask); returns never are. For V-trace the
    normalisation acts on ``r_s + gamma v_{s+1} - V(s_s)`` and ``rho^pg`` multiplies the result.
    Give the whole step's batch.
    """
    check_mask("action_mask", action_mask)
    entry = ADVANTAGE_ESTIMATORS.get(cfg.estimator)
    if entry.needs_critic and values is None:
        raise ValueError(f"advantage estimator {cfg.estimator!r} needs values (pre-update critic outputs)")
    if entry.needs_log_w and log_w is None:
        raise ValueError(f"advantage estimator {cfg.estimator!r} needs log_w = logp_old - logp_behav")
    folded = fold_rewards(rewards.float(), action_mask)
    inputs = AdvantageInputs(folded, values, log_w, action_mask, scores, group_ids, bootstrap_value, oracle)
    est = entry.fn(cfg, inputs)
    counted = action_mask if stats_mask is None else action_mask & stats_mask
    raw = est.advantages if est.is_weight is None else est.is_weight * est.advantages
    stats = {
        m.ADV_RAW_MEAN: masked_mean(raw, counted).detach(),
        m.ADV_RAW_STD: masked_var(raw, counted).sqrt().detach(),
        m.RETURNS_MEAN: masked_mean(est.returns, counted).detach(),
    }
    if log_w is not None:
        stats |= importance_diagnostics(log_w, counted, clip_low=cfg.ratio_low, clip_high=cfg.ratio_high)
    advantages = normalize_advantages(est.advantages, counted, mode=cfg.normalization,
                                      std_floor=cfg.std_floor)
    if est.is_weight is not None:
        advantages = est.is_weight * advantages
    return AdvantageResult(advantages.detach(), est.returns.detach(), stats)
