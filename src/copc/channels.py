"""The two channels of an actor-critic update, as configs, and the dispatch the trainer calls.

Every method is a *policy channel* (which ratio, clip, mask or weight multiplies the actor's per-token
term) plus an *advantage channel* (how advantages and critic targets come from rewards, values and the
behaviour ratio ``w = exp(old - mu)``), plus an optional critic (spec/algorithms.md, "Decisions").
The trainer calls, once per step and per (micro-)batch::

    adv = compute_advantages(method.advantage, rewards=..., values=..., log_w=..., action_mask=...)
    n = count_loss_tokens(method.policy, logp_old=..., logp_behav=..., action_mask=...)  # per micro-batch,
                                                                                       # summed = global
    out = policy_loss(method.policy, logp=..., logp_old=..., logp_behav=..., advantages=adv.advantages,
                      action_mask=..., num_tokens=N_global, num_seqs=S_global)
    vl = value_loss(method.critic, values=..., values_old=..., returns=adv.returns, action_mask=...,
                    num_tokens=N_global)

Names in configs are checked against the registries below when the config is built (a typo fails at
start-up with the valid names); dispatch goes through registry entries that all share one signature,
so no caller compares names. ``needs_old_forward`` / ``needs_critic`` tell the trainer what to compute.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple, TypedDict

import torch

from copc.ops import advantages as adv_ops
from copc.ops import policy_losses as pl
from copc.ops.importance import importance_diagnostics
from copc.ops.masked import LOSS_AGG_MODES, LossAgg, check_mask, masked_mean, masked_var, masked_whiten
from copc.ops.registry import Registry
from copc.ops.value_losses import ValueLossOutput, clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "POLICY_OBJECTIVES",
    "VALUE_LOSSES",
    "AdvantageChannelConfig",
    "AdvantageEstimator",
    "AdvantageInputs",
    "AdvantageResult",
    "CriticConfig",
    "PolicyChannelConfig",
    "PolicyInputs",
    "PolicyLossResult",
    "PolicyObjective",
    "ValueLossResult",
    "compute_advantages",
    "count_loss_tokens",
    "policy_loss",
    "value_loss",
]

PolicyLossResult = pl.PolicyLossOutput
ValueLossResult = ValueLossOutput


def _one_of(field: str, value: object, valid: tuple[object, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{field} must be one of {', '.join(map(repr, valid))}; got {value!r}")


# ============================================================================ policy channel


class PolicyInputs(NamedTuple):
    """One (micro-)batch for the actor loss; all ``[B, T]``, counts global over the minibatch."""

    logp: torch.Tensor
    logp_old: torch.Tensor | None
    logp_behav: torch.Tensor | None
    advantages: torch.Tensor
    action_mask: torch.Tensor
    num_tokens: torch.Tensor | float | None
    num_seqs: torch.Tensor | float | None


@dataclass(frozen=True)
class PolicyObjective:
    """A registered actor loss: ``fn(cfg, inputs)`` plus what it needs from the trainer."""

    fn: Callable[[PolicyChannelConfig, PolicyInputs], pl.PolicyLossOutput]
    #: needs ``logp_old`` (one no-grad actor forward per step).
    needs_old: bool
    #: its keep-mask moves with ``logp`` during the update (then the "kept" denominator is undefined).
    current_mask: Callable[[PolicyChannelConfig], bool]
    #: one line for docs and ``copc --help``.
    doc: str


POLICY_OBJECTIVES: Registry[PolicyObjective] = Registry("policy objective")


@dataclass(frozen=True)
class PolicyChannelConfig:
    """Actor loss: objective, PPO clip, behaviour-ratio mask/weight, aggregation (spec 2-9)."""

    objective: str = "ppo"
    """Registered actor loss: ppo, bypass_ppo, decoupled, tis, icepop, copc, dis, pg."""
    clip_low: float = 0.2
    """PPO eps_low: the ratio is clipped at 1 - clip_low."""
    clip_high: float = 0.28
    """PPO eps_high (clip-higher, DAPO 0.28): the ratio is clipped at 1 + clip_high."""
    dual_clip_c: float | None = None
    """Dual-clip constant c_dual > 1 for negative advantages (verl 3.0); None = off."""
    mask_low: float = 0.5
    """Lower edge of the behaviour-ratio band (copc 1 - eps_P^-, icepop alpha, dis 1 - eps_l)."""
    mask_high: float = 2.0
    """Upper edge of the band (copc 1 + eps_P^+, icepop beta, dis 1 + eps_h); inf = no upper edge."""
    weight_mode: Literal["masked_is", "binary"] = "masked_is"
    """copc: omega = M * w (masked IS) or M (pure mask)."""
    mask_source: Literal["step_start", "current"] = "step_start"
    """copc/icepop: band tested on old/mu (step start) or cur/mu (recomputed every minibatch)."""
    weight_cap: float = 5.0
    """decoupled: cap on w = old/mu (AReaL 5); tis: the truncation C (2)."""
    cap_mode: Literal["mask", "clip"] = "mask"
    """decoupled: tokens with w > cap are masked (AReaL) or w is clipped to the cap."""
    loss_agg: LossAgg = "token-mean"
    """Aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm."""
    denominator: Literal["all", "kept"] = "all"
    """Masked tokens stay in the denominator (all, AReaL) or survivors are renormalised (kept)."""
    norm_length: float | None = None
    """Constant of seq-mean-token-sum-norm (Dr. GRPO); None = padded length T."""
    minibatches: int = 4
    """Actor optimizer steps (minibatches) per training step."""

    def __post_init__(self) -> None:
        POLICY_OBJECTIVES.check(self.objective, field="policy.objective")
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"policy.clip_low must be in [0, 1) (e.g. 0.2), got {self.clip_low}")
        if self.clip_high < 0.0:
            raise ValueError(f"policy.clip_high must be >= 0 (e.g. 0.28), got {self.clip_high}")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1.0:
            raise ValueError(f"policy.dual_clip_c must be > 1 (verl 3.0) or None, got {self.dual_clip_c}")
        if not 0.0 <= self.mask_low < self.mask_high:
            raise ValueError(
                f"policy.mask_low/mask_high need 0 <= low < high (inf allowed), got {self.mask_low}, {self.mask_high}"
            )
        if not self.weight_cap > 0:
            raise ValueError(f"policy.weight_cap must be > 0 (AReaL 5, TIS 2; inf = no cap), got {self.weight_cap}")
        _one_of("policy.weight_mode", self.weight_mode, ("masked_is", "binary"))
        _one_of("policy.mask_source", self.mask_source, ("step_start", "current"))
        _one_of("policy.cap_mode", self.cap_mode, ("mask", "clip"))
        _one_of("policy.loss_agg", self.loss_agg, LOSS_AGG_MODES)
        _one_of("policy.denominator", self.denominator, ("all", "kept"))
        if self.norm_length is not None and not self.norm_length > 0:
            raise ValueError(f"policy.norm_length must be > 0 or None (= T), got {self.norm_length}")
        if self.minibatches < 1:
            raise ValueError(f"policy.minibatches must be >= 1, got {self.minibatches}")
        if self.denominator == "kept" and POLICY_OBJECTIVES.get(self.objective).current_mask(self):
            raise ValueError(
                f"policy.denominator='kept' needs a mask fixed at the step start, but objective "
                f"{self.objective!r} with mask_source={self.mask_source!r} moves it every minibatch; "
                "use denominator='all' or mask_source='step_start'"
            )

    @property
    def needs_old_forward(self) -> bool:
        """True if the actor loss needs ``logp_old`` (a no-grad actor forward at the step start)."""
        return POLICY_OBJECTIVES.get(self.objective).needs_old


class _AggKw(TypedDict):
    loss_agg: LossAgg
    num_tokens: torch.Tensor | float | None
    num_seqs: torch.Tensor | float | None
    norm_length: float | None


class _ClipKw(TypedDict):
    clip_low: float
    clip_high: float
    dual_clip_c: float | None


def _agg(cfg: PolicyChannelConfig, x: PolicyInputs) -> _AggKw:
    return {"loss_agg": cfg.loss_agg, "num_tokens": x.num_tokens, "num_seqs": x.num_seqs, "norm_length": cfg.norm_length}


def _req(x: torch.Tensor | None, name: str, objective: str) -> torch.Tensor:
    if x is None:
        raise ValueError(f"policy objective {objective!r} needs {name}; compute it (see needs_old_forward) and pass it")
    return x


def _objective(name: str, *, needs_old: bool, doc: str, current_mask: Callable[[PolicyChannelConfig], bool] | None = None) -> Callable[
    [Callable[[PolicyChannelConfig, PolicyInputs], pl.PolicyLossOutput]],
    Callable[[PolicyChannelConfig, PolicyInputs], pl.PolicyLossOutput],
]:
    def decorate(
        fn: Callable[[PolicyChannelConfig, PolicyInputs], pl.PolicyLossOutput],
    ) -> Callable[[PolicyChannelConfig, PolicyInputs], pl.PolicyLossOutput]:
        POLICY_OBJECTIVES.add(name, PolicyObjective(fn, needs_old, current_mask or (lambda cfg: False), doc))
        return fn

    return decorate


def _clip(cfg: PolicyChannelConfig) -> _ClipKw:
    return {"clip_low": cfg.clip_low, "clip_high": cfg.clip_high, "dual_clip_c": cfg.dual_clip_c}


@_objective("ppo", needs_old=True, doc="PPO clip on u = exp(cur - old) (sync PPO; async 3b)")
def _ppo(cfg: PolicyChannelConfig, x: PolicyInputs) -> pl.PolicyLossOutput:
    old = _req(x.logp_old, "logp_old", "ppo")
    return pl.ppo_clip_loss(x.logp, old, x.advantages, x.action_mask, **_clip(cfg), **_agg(cfg, x))


@_objective("bypass_ppo", needs_old=False, doc="PPO clip on r = exp(cur - mu) (async PPO 3a)")
def _bypass(cfg: PolicyChannelConfig, x: PolicyInputs) -> pl.PolicyLossOutput:
    mu = _req(x.logp_behav, "logp_behav", "bypass_ppo")
    return pl.bypass_ppo_loss(x.logp, mu, x.advantages, x.action_mask, **_clip(cfg), **_agg(cfg, x))


@_objective("decoupled", needs_old=True, doc="AReaL: w = old/mu (masked above weight_cap) times PPO clip on cur/old")
def _decoupled(cfg: PolicyChannelConfig, x: PolicyInputs) -> pl.PolicyLossOutput:
    old, mu = _req(x.logp_old, "logp_old", "decoupled"), _req(x.logp_behav, "logp_behav", "decoupled")
    return pl.decoupled_ppo_loss(
        x.logp, old, mu, x.advantages, x.action_mask, cap=cfg.weight_cap, cap_mode=cfg.cap_mode,
        denominator=cfg.denominator, **_clip(cfg), **_agg(cfg, x),
    )


@_objective("tis", needs_old=True, doc="min(old/mu, weight_cap) times PPO clip on cur/old (TIS)")
def _tis(cfg: PolicyChannelConfig, x: PolicyInputs) -> pl.PolicyLossOutput:
    old, mu = _req(x.logp_old, "logp_old", "tis"), _req(x.logp_behav, "logp_behav", "tis")
    return pl.tis_ppo_loss(x.logp, old, mu, x.advantages, x.action_mask, cap=cfg.weight_cap, **_clip(cfg), **_agg(cfg, x))


def _moves_with_source(cfg: PolicyChannelConfig) -> bool:
    return cfg.mask_source == "current"


@_objective("icepop", needs_old=True, current_mask=_moves_with_source, doc="masked IS k (old/mu or cur/mu) in [mask_low, mask_high] times PPO clip")
def _icepop(cfg: PolicyChannelConfig, x: PolicyInputs) -> pl.PolicyLossOutput:
    old, mu = _req(x.logp_old, "logp_old", "icepop"), _req(x.logp_behav, "logp_behav", "icepop")
    return pl.icepop_loss(
        x.logp, old, mu, x.advantages, x.action_mask, mask_low=cfg.mask_low, mask_high=cfg.mask_high,
        ratio_source=cfg.mask_source, denominator=cfg.denominator, **_clip(cfg), **_agg(cfg, x),
    )


@_objective("copc", needs_old=True, current_mask=_moves_with_source, doc="COPC: omega = M*w (or M), M = band on old/mu, times PPO clip on cur/old")
def _copc(cfg: PolicyChannelConfig, x: PolicyInputs) -> pl.PolicyLossOutput:
    old, mu = _req(x.logp_old, "logp_old", "copc"), _req(x.logp_behav, "logp_behav", "copc")
    return pl.copc_policy_loss(
        x.logp, old, mu, x.advantages, x.action_mask, mask_low=cfg.mask_low, mask_high=cfg.mask_high,
        weight_mode=cfg.weight_mode, mask_source=cfg.mask_source, denominator=cfg.denominator,
        **_clip(cfg), **_agg(cfg, x),
    )


@_objective("dis", needs_old=False, current_mask=lambda cfg: True, doc="SAO DIS: -M r A with r = cur/mu, M = strict band, no PPO clip")
def _dis(cfg: PolicyChannelConfig, x: PolicyInputs) -> pl.PolicyLossOutput:
    mu = _req(x.logp_behav, "logp_behav", "dis")
    return pl.dis_loss(
        x.logp, mu, x.advantages, x.action_mask, mask_low=cfg.mask_low, mask_high=cfg.mask_high,
        denominator=cfg.denominator, **_agg(cfg, x),
    )


@_objective("pg", needs_old=False, doc="-sg(A) * cur (V-trace: A = pg_advantages, rho^pg inside)")
def _pg(cfg: PolicyChannelConfig, x: PolicyInputs) -> pl.PolicyLossOutput:
    return pl.pg_loss(x.logp, x.advantages, x.action_mask, **_agg(cfg, x))


def policy_loss(
    cfg: PolicyChannelConfig,
    *,
    logp: torch.Tensor,
    logp_old: torch.Tensor | None,
    logp_behav: torch.Tensor | None,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    num_tokens: torch.Tensor | float | None,
    num_seqs: torch.Tensor | float | None = None,
) -> PolicyLossResult:
    """The actor loss of ``cfg`` on one (micro-)batch (all tensors ``[B, T]``; see the module docstring).

    ``num_tokens`` / ``num_seqs`` are the GLOBAL counts of the minibatch (all micro-batches, all ranks):
    ``num_tokens`` from :func:`count_loss_tokens` summed over micro-batches; ``num_seqs`` = sequences
    with at least one action token (seq-* aggregations). Returns ``(loss, per_token, stats, keep)``.
    """
    entry = POLICY_OBJECTIVES.get(cfg.objective)
    return entry.fn(cfg, PolicyInputs(logp, logp_old, logp_behav, advantages, action_mask, num_tokens, num_seqs))


def count_loss_tokens(
    cfg: PolicyChannelConfig,
    *,
    logp_old: torch.Tensor | None,
    logp_behav: torch.Tensor | None,
    action_mask: torch.Tensor,
) -> torch.Tensor:
    """Tokens in the actor denominator of this (micro-)batch; sum it over micro-batches and ranks.

    ``denominator="all"``: action tokens. ``"kept"``: action tokens the step-start mask keeps (the
    loss evaluated at ``logp = logp_old``, or ``logp_behav`` without an old forward; the config
    guarantees the mask does not move with ``logp``). Returns a 0-d long tensor.
    """
    check_mask("action_mask", action_mask)
    if cfg.denominator == "all":
        return action_mask.sum()
    anchor = logp_old if logp_old is not None else logp_behav
    if anchor is None:
        raise ValueError("count_loss_tokens with denominator='kept' needs logp_old or logp_behav")
    zeros = torch.zeros_like(anchor, dtype=torch.float32)
    with torch.no_grad():
        out = policy_loss(
            cfg, logp=anchor, logp_old=logp_old, logp_behav=logp_behav, advantages=zeros,
            action_mask=action_mask, num_tokens=None,
        )
    return out.keep.sum()


# ============================================================================ advantage channel


class AdvantageInputs(NamedTuple):
    """Everything an estimator may read; ``[B, T]`` unless stated; None where not computed."""

    rewards: torch.Tensor  # folded onto action tokens
    values: torch.Tensor | None  # pre-update V(s_t)
    log_w: torch.Tensor | None  # old - mu, detached
    action_mask: torch.Tensor
    scores: torch.Tensor | None  # [B] sequence scores (group estimators)
    group_ids: torch.Tensor | None  # [B] integer prompt ids
    bootstrap_value: torch.Tensor | None  # [B] V(s_{T+1}) of truncated rows


class AdvantageResult(NamedTuple):
    """Advantages (whitened if configured) for the actor, returns (never whitened) for the critic."""

    advantages: torch.Tensor  # [B, T] float32, 0 off action tokens
    returns: torch.Tensor  # [B, T] float32 critic targets, 0 off action tokens
    stats: dict[str, torch.Tensor]  # detached scalars


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: ``fn(cfg, inputs) -> (advantages, returns)`` and what it reads."""

    fn: Callable[[AdvantageChannelConfig, AdvantageInputs], tuple[torch.Tensor, torch.Tensor]]
    needs_critic: bool
    needs_log_w: bool
    group_normalised: bool
    doc: str


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
_TRACES = ("none", "vtrace", "brace")


@dataclass(frozen=True)
class AdvantageChannelConfig:
    """Advantage / critic-target estimator and its parameters (spec 2, 4, 5, 9.3, 9.4, 10.2)."""

    estimator: str = "gae"
    """Registered estimator: gae, vtrace, clipped_td (COPC), brace, group."""
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
    """Whiten advantages once per step over all policy tokens (never with group estimators)."""

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
        _one_of("advantage.trace", self.trace, _TRACES)
        if self.trace != "none" and (self.trace_low is None or self.trace_high is None):
            raise ValueError(f"advantage.trace={self.trace!r} needs trace_low and trace_high (e.g. 0.9, 1.1)")
        if self.trace == "vtrace" and self.advantage_window is not None:
            raise ValueError("advantage.advantage_window needs trace='none' or 'brace'; set it to None for trace='vtrace'")
        if self.trace == "brace" and self.advantage_window is None:
            raise ValueError("advantage.trace='brace' needs advantage_window = k (e.g. 100)")
        if self.advantage_window is not None and self.advantage_window < 0:
            raise ValueError(f"advantage.advantage_window must be >= 0 or None (infinite), got {self.advantage_window}")
        for name in ("rho_bar", "c_bar", "pg_rho_bar"):
            if not getattr(self, name) > 0:
                raise ValueError(f"advantage.{name} must be > 0, got {getattr(self, name)}")
        if self.brace_k < 0:
            raise ValueError(f"advantage.brace_k must be >= 0 (BRACE 100), got {self.brace_k}")
        _one_of("advantage.group_mode", self.group_mode, ("grpo", "drgrpo", "rloo"))
        if not self.group_eps > 0:
            raise ValueError(f"advantage.group_eps must be > 0, got {self.group_eps}")
        if self.whiten and ADVANTAGE_ESTIMATORS.get(self.estimator).group_normalised:
            raise ValueError(
                f"advantage.estimator={self.estimator!r} is already group-normalised; set advantage.whiten=False"
            )

    @property
    def needs_critic(self) -> bool:
        """True if the estimator reads values V(s_t) (so a critic must be trained)."""
        return ADVANTAGE_ESTIMATORS.get(self.estimator).needs_critic

    @property
    def needs_old_forward(self) -> bool:
        """True if the estimator reads the behaviour ratio ``log_w = old - mu``."""
        return ADVANTAGE_ESTIMATORS.get(self.estimator).needs_log_w


def _estimator(name: str, *, needs_critic: bool, needs_log_w: bool, group: bool = False, doc: str) -> Callable[
    [Callable[[AdvantageChannelConfig, AdvantageInputs], tuple[torch.Tensor, torch.Tensor]]],
    Callable[[AdvantageChannelConfig, AdvantageInputs], tuple[torch.Tensor, torch.Tensor]],
]:
    def decorate(
        fn: Callable[[AdvantageChannelConfig, AdvantageInputs], tuple[torch.Tensor, torch.Tensor]],
    ) -> Callable[[AdvantageChannelConfig, AdvantageInputs], tuple[torch.Tensor, torch.Tensor]]:
        ADVANTAGE_ESTIMATORS.add(name, AdvantageEstimator(fn, needs_critic, needs_log_w, group, doc))
        return fn

    return decorate


@_estimator("gae", needs_critic=True, needs_log_w=False, doc="GAE(gamma, lambda), decoupled lambda_c / lambda_a")
def _gae(cfg: AdvantageChannelConfig, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.values is not None
    critic = adv_ops.gae(x.rewards, x.values, x.action_mask, gamma=cfg.gamma, lam=cfg.lam_critic, bootstrap_value=x.bootstrap_value)
    if cfg.lam_actor == cfg.lam_critic:
        return critic.advantages, critic.returns
    actor = adv_ops.gae(x.rewards, x.values, x.action_mask, gamma=cfg.gamma, lam=cfg.lam_actor, bootstrap_value=x.bootstrap_value)
    return actor.advantages, critic.returns


@_estimator("vtrace", needs_critic=True, needs_log_w=True, doc="V-trace targets vs and pg advantages (pi = old)")
def _vtrace(cfg: AdvantageChannelConfig, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.values is not None and x.log_w is not None
    out = adv_ops.vtrace(
        x.rewards, x.values, x.log_w, x.action_mask, gamma=cfg.gamma, lam=cfg.lam_critic, rho_bar=cfg.rho_bar,
        c_bar=cfg.c_bar, pg_rho_bar=cfg.pg_rho_bar, bootstrap_value=x.bootstrap_value,
    )
    return out.pg_advantages, out.vs


@_estimator("clipped_td", needs_critic=True, needs_log_w=True, doc="COPC two-sided clipped-ratio weighted TD sums")
def _clipped_td(cfg: AdvantageChannelConfig, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.values is not None and x.log_w is not None
    out = adv_ops.clipped_td(
        x.rewards, x.values, x.log_w, x.action_mask, gamma=cfg.gamma, lam_critic=cfg.lam_critic,
        lam_actor=cfg.lam_actor, low=cfg.ratio_low, high=cfg.ratio_high, trace=cfg.trace,
        trace_low=cfg.trace_low, trace_high=cfg.trace_high, advantage_window=cfg.advantage_window,
        weight_own_residual=cfg.weight_own_residual, bootstrap_value=x.bootstrap_value,
    )
    return out.advantages, out.returns


@_estimator("brace", needs_critic=True, needs_log_w=True, doc="BRACE k-capped, Monte-Carlo-anchored targets")
def _brace(cfg: AdvantageChannelConfig, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.values is not None and x.log_w is not None
    out = adv_ops.brace(
        x.rewards, x.values, x.log_w, x.action_mask, gamma=cfg.gamma, lam=cfg.lam_critic, rho_bar=cfg.rho_bar,
        c_bar=cfg.c_bar, k=cfg.brace_k, bootstrap_value=x.bootstrap_value,
    )
    return out.advantages, out.returns


@_estimator("group", needs_critic=False, needs_log_w=False, group=True, doc="group-relative sequence advantages (GRPO/Dr.GRPO/RLOO)")
def _group(cfg: AdvantageChannelConfig, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    if x.scores is None or x.group_ids is None:
        raise ValueError("advantage.estimator='group' needs scores [B] and group_ids [B]; pass both")
    per_seq = adv_ops.group_advantages(x.scores, x.group_ids, mode=cfg.group_mode, eps=cfg.group_eps)
    return adv_ops.broadcast_to_tokens(per_seq, x.action_mask), adv_ops.broadcast_to_tokens(x.scores.float(), x.action_mask)


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
) -> AdvantageResult:
    """Advantages and critic targets for the whole step's batch, computed once before the update.

    Args:
        rewards: ``[B, T] float32`` token rewards; folded onto action tokens here (spec section 0).
        values: ``[B, T] float32`` pre-update V(s_t) (None only for estimators without a critic).
        log_w: ``[B, T] float32`` ``old - mu`` (None only for estimators that do not read it).
        action_mask: ``[B, T] bool``.
        scores, group_ids: ``[B]`` sequence scores and integer prompt ids (group estimator).
        bootstrap_value: ``[B]`` V(s_{T+1}) for ``truncation = bootstrap`` rows (0 = terminal).

    Advantages are whitened (mean / Bessel-corrected variance over ALL action tokens of the batch,
    before any policy-channel mask) if ``cfg.whiten``; returns never are. Give the whole step's batch.
    """
    check_mask("action_mask", action_mask)
    entry = ADVANTAGE_ESTIMATORS.get(cfg.estimator)
    if entry.needs_critic and values is None:
        raise ValueError(f"advantage estimator {cfg.estimator!r} needs values (pre-update critic outputs)")
    if entry.needs_log_w and log_w is None:
        raise ValueError(f"advantage estimator {cfg.estimator!r} needs log_w = logp_old - logp_behav")
    folded = adv_ops.fold_rewards(rewards.float(), action_mask)
    inputs = AdvantageInputs(folded, values, log_w, action_mask, scores, group_ids, bootstrap_value)
    advantages, returns = entry.fn(cfg, inputs)
    raw_var = masked_var(advantages, action_mask)
    stats = {
        "adv/raw_mean": masked_mean(advantages, action_mask).detach(),
        "adv/raw_std": raw_var.sqrt().detach(),
        "returns/mean": masked_mean(returns, action_mask).detach(),
    }
    if log_w is not None:
        stats |= importance_diagnostics(log_w, action_mask, clip_low=cfg.ratio_low, clip_high=cfg.ratio_high)
    if cfg.whiten:
        advantages = masked_whiten(advantages, action_mask)
    return AdvantageResult(advantages.detach(), returns.detach(), stats)


# ============================================================================ critic


class ValueInputs(NamedTuple):
    """One (micro-)batch for the critic loss."""

    values: torch.Tensor
    values_old: torch.Tensor | None
    returns: torch.Tensor
    action_mask: torch.Tensor
    num_tokens: torch.Tensor | float | None
    num_seqs: torch.Tensor | float | None


VALUE_LOSSES: Registry[Callable[[CriticConfig, ValueInputs], ValueLossOutput]] = Registry("value loss")


@dataclass(frozen=True)
class CriticConfig:
    """Critic loss and schedule (spec 2, 9.3, 9.6)."""

    loss: str = "mse"
    """Registered penalty: mse (1/2 d^2) or huber."""
    clip_eps: float | None = 0.5
    """PPO value clipping eps_v around the pre-update values (verl, BRACE 0.5); None = off."""
    huber_delta: float = 1.0
    """Huber threshold (loss = huber)."""
    loss_agg: LossAgg = "token-mean"
    """Aggregation over all policy tokens (never masked by the policy channel)."""
    updates_per_step: int = 1
    """K_critic: critic epochs per training step (SAO 2)."""
    warmup_steps: int = 0
    """Steps at the start of training that update only the critic (BRACE 5, SAO 10)."""

    def __post_init__(self) -> None:
        VALUE_LOSSES.check(self.loss, field="critic.loss")
        if self.clip_eps is not None and not self.clip_eps >= 0:
            raise ValueError(f"critic.clip_eps must be >= 0 (e.g. 0.5) or None, got {self.clip_eps}")
        if not (self.huber_delta > 0 and math.isfinite(self.huber_delta)):
            raise ValueError(f"critic.huber_delta must be a finite number > 0, got {self.huber_delta}")
        _one_of("critic.loss_agg", self.loss_agg, LOSS_AGG_MODES)
        if self.updates_per_step < 1:
            raise ValueError(f"critic.updates_per_step must be >= 1, got {self.updates_per_step}")
        if self.warmup_steps < 0:
            raise ValueError(f"critic.warmup_steps must be >= 0, got {self.warmup_steps}")


def _value_penalty(kind: Literal["mse", "huber"]) -> Callable[[CriticConfig, ValueInputs], ValueLossOutput]:
    def run(cfg: CriticConfig, x: ValueInputs) -> ValueLossOutput:
        return clipped_value_loss(
            x.values, x.values_old, x.returns, x.action_mask, clip_eps=cfg.clip_eps, kind=kind,
            huber_delta=cfg.huber_delta, loss_agg=cfg.loss_agg, num_tokens=x.num_tokens, num_seqs=x.num_seqs,
        )

    return run


VALUE_LOSSES.add("mse", _value_penalty("mse"))
VALUE_LOSSES.add("huber", _value_penalty("huber"))


def value_loss(
    cfg: CriticConfig,
    *,
    values: torch.Tensor,
    values_old: torch.Tensor | None,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    num_tokens: torch.Tensor | float | None,
    num_seqs: torch.Tensor | float | None = None,
) -> ValueLossResult:
    """The critic loss of ``cfg`` on one (micro-)batch; ``num_tokens`` = global action-token count."""
    fn = VALUE_LOSSES.get(cfg.loss)
    return fn(cfg, ValueInputs(values, values_old, returns, action_mask, num_tokens, num_seqs))
