"""The policy channel: the actor-loss config, its registry of objectives and the dispatch to ``copc.ops``.

:class:`PolicyChannelConfig` names a registered objective (ppo, bypass_ppo, decoupled, tis, icepop,
copc, dis, pg) and its clip / band / weight / aggregation parameters; :func:`policy_loss` runs that
objective on one (micro-)batch and :func:`count_loss_tokens` gives the batch's share of the actor
denominator. Every objective shares one signature ``fn(cfg, inputs)``, so no caller compares names.
The config, the registry and its entries live together here, so building a config always validates
against the full registry. Re-exported by :mod:`copc.channels`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple

import torch

from copc.config import check_one_of
from copc.ops import (
    LOSS_AGG_MODES,
    AggSpec,
    ClipSpec,
    CorrectedInputs,
    LossAgg,
    PolicyLossOutput,
    behaviour_ppo_loss,
    check_mask,
    copc_policy_loss,
    decoupled_ppo_loss,
    dis_loss,
    pg_loss,
    ppo_clip_loss,
)
from copc.registry import Registry

__all__ = [
    "POLICY_OBJECTIVES",
    "PolicyChannelConfig",
    "PolicyInputs",
    "PolicyLossResult",
    "PolicyObjective",
    "count_loss_tokens",
    "policy_loss",
]

PolicyLossResult = PolicyLossOutput


class PolicyInputs(NamedTuple):
    """One (micro-)batch for the actor loss: tensors ``[B, T]``, counts global over the minibatch."""

    #: float cur = log pi_theta, carries the gradient.
    logp: torch.Tensor
    #: float old, the trainer's forward at the step start (None for objectives that do not read it).
    logp_old: torch.Tensor | None
    #: float mu, the sampler's log-probs (None for objectives that do not read it).
    logp_behav: torch.Tensor | None
    #: float A_t (constants).
    advantages: torch.Tensor
    #: bool, True on the tokens that enter the loss.
    action_mask: torch.Tensor
    #: the GLOBAL actor denominator of the minibatch (all micro-batches, all ranks): the sum of
    #: :func:`count_loss_tokens` over its micro-batches; None = this micro-batch's own count.
    num_tokens: torch.Tensor | float | None
    #: the GLOBAL count of sequences with at least one action token (seq-* aggregations).
    num_seqs: torch.Tensor | float | None = None


@dataclass(frozen=True)
class PolicyObjective:
    """A registered actor loss: ``fn(cfg, inputs)`` plus what it needs from the trainer."""

    fn: Callable[[PolicyChannelConfig, PolicyInputs], PolicyLossOutput]
    #: needs ``logp_old`` (one no-grad actor forward per step).
    needs_old: bool
    #: its keep-mask moves with ``logp`` during the update (then the "kept" denominator is undefined).
    current_mask: Callable[[PolicyChannelConfig], bool]
    #: one line for docs and ``copc --help``.
    doc: str


POLICY_OBJECTIVES: Registry[PolicyObjective] = Registry("policy objective")


@dataclass(frozen=True)
class PolicyChannelConfig:
    """Actor loss: objective, PPO clip, behaviour-ratio mask/weight, aggregation (docs/formulas.md)."""

    INFINITE_OK: ClassVar[tuple[str, ...]] = ("mask_high", "weight_cap")  # inf = no bound (copc.config)
    objective: str = "ppo"
    """Registered actor loss: ppo, bypass_ppo, decoupled, tis, icepop, copc, dis, pg."""
    clip_low: float = 0.2
    """PPO eps_low: the ratio is clipped at 1 - clip_low."""
    clip_high: float = 0.28
    """PPO eps_high (clip-higher, DAPO 0.28): the ratio is clipped at 1 + clip_high."""
    dual_clip_c: float | None = None
    """Dual-clip constant c_dual > 1 for negative advantages (verl 3.0); None = off."""
    mask_low: float = 0.0
    """Lower edge of the ratio band (copc 1 - eps_P^-, icepop alpha, dis 1 - eps_l); 0 = no lower edge."""
    mask_high: float = float("inf")
    """Upper edge of the band (copc 1 + eps_P^+, icepop beta, dis 1 + eps_h); inf = no upper edge."""
    weight_mode: Literal["masked_is", "binary"] = "masked_is"
    """copc: omega = M * w (masked IS) or M (pure mask)."""
    mask_source: Literal["step_start", "current"] = "step_start"
    """copc/icepop: band tested on old/mu (step start) or cur/mu (recomputed every minibatch)."""
    weight_cap: float = 5.0
    """decoupled: cap on w = old/mu (AReaL 5, the default); tis: the truncation C (TIS uses 2: set it, the
    default is 5)."""
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
                "policy.mask_low/mask_high need 0 <= low < high (inf "
                f"allowed), got {self.mask_low}, {self.mask_high}"
            )
        if not self.weight_cap > 0:
            raise ValueError(f"policy.weight_cap must be > 0 (AReaL 5, TIS 2; inf = no cap), got "
                             f"{self.weight_cap}")
        check_one_of("policy.weight_mode", self.weight_mode, ("masked_is", "binary"))
        check_one_of("policy.mask_source", self.mask_source, ("step_start", "current"))
        check_one_of("policy.cap_mode", self.cap_mode, ("mask", "clip"))
        check_one_of("policy.loss_agg", self.loss_agg, LOSS_AGG_MODES)
        check_one_of("policy.denominator", self.denominator, ("all", "kept"))
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


def _agg(cfg: PolicyChannelConfig, x: PolicyInputs) -> AggSpec:
    return AggSpec(cfg.loss_agg, x.num_tokens, x.num_seqs, cfg.norm_length)


def _clip(cfg: PolicyChannelConfig) -> ClipSpec:
    return ClipSpec(cfg.clip_low, cfg.clip_high, cfg.dual_clip_c)


def _req(x: torch.Tensor | None, name: str, objective: str) -> torch.Tensor:
    if x is None:
        raise ValueError(f"policy objective {objective!r} needs {name}; compute it (see needs_old_forward) "
                         f"and pass it")
    return x


def _corrected(x: PolicyInputs, objective: str) -> CorrectedInputs:
    """``x`` as a behaviour-corrected loss's inputs; ``logp_old`` and ``logp_behav`` required (in that
    order)."""
    old, mu = _req(x.logp_old, "logp_old", objective), _req(x.logp_behav, "logp_behav", objective)
    return CorrectedInputs(x.logp, old, mu, x.advantages, x.action_mask)


def _objective(name: str, *, needs_old: bool, doc: str,
               current_mask: Callable[[PolicyChannelConfig], bool] | None = None) -> Callable[
    [Callable[[PolicyChannelConfig, PolicyInputs], PolicyLossOutput]],
    Callable[[PolicyChannelConfig, PolicyInputs], PolicyLossOutput],
]:
    def decorate(
        fn: Callable[[PolicyChannelConfig, PolicyInputs], PolicyLossOutput],
    ) -> Callable[[PolicyChannelConfig, PolicyInputs], PolicyLossOutput]:
        POLICY_OBJECTIVES.add(name, PolicyObjective(fn, needs_old, current_mask or (lambda cfg: False), doc))
        return fn

    return decorate


@_objective("ppo", needs_old=True, doc="PPO clip on u = exp(cur - old) (sync PPO; async 3b)")
def _ppo(cfg: PolicyChannelConfig, x: PolicyInputs) -> PolicyLossOutput:
    old = _req(x.logp_old, "logp_old", "ppo")
    return ppo_clip_loss(x.logp, old, x.advantages, x.action_mask, clip=_clip(cfg), agg=_agg(cfg, x))


def _band_is_finite(cfg: PolicyChannelConfig) -> bool:
    return cfg.mask_low > 0.0 or cfg.mask_high < float("inf")


@_objective(
    "bypass_ppo", needs_old=False, current_mask=_band_is_finite,
    doc="PPO clip on r = exp(cur - mu), tokens with r outside the band masked (no band: async PPO 3a; band: "
        "COPC R1)",
)
def _bypass(cfg: PolicyChannelConfig, x: PolicyInputs) -> PolicyLossOutput:
    mu = _req(x.logp_behav, "logp_behav", "bypass_ppo")
    return behaviour_ppo_loss(
        x.logp, mu, x.advantages, x.action_mask, mask_low=cfg.mask_low, mask_high=cfg.mask_high,
        clip=_clip(cfg),
        agg=_agg(cfg, x), denominator=cfg.denominator,
    )


@_objective("decoupled", needs_old=True,
            doc="AReaL: w = old/mu (masked above weight_cap) times PPO clip on cur/old")
def _decoupled(cfg: PolicyChannelConfig, x: PolicyInputs) -> PolicyLossOutput:
    return decoupled_ppo_loss(
        _corrected(x, "decoupled"), cap=cfg.weight_cap, cap_mode=cfg.cap_mode, clip=_clip(cfg), agg=_agg(cfg,
                                                                                                         x),
        denominator=cfg.denominator,
    )


@_objective("tis", needs_old=True, doc="min(old/mu, weight_cap) times PPO clip on cur/old (TIS)")
def _tis(cfg: PolicyChannelConfig, x: PolicyInputs) -> PolicyLossOutput:
    return decoupled_ppo_loss(_corrected(x, "tis"), cap=cfg.weight_cap, cap_mode="clip", clip=_clip(cfg),
                              agg=_agg(cfg, x))


def _moves_with_source(cfg: PolicyChannelConfig) -> bool:
    return cfg.mask_source == "current"


@_objective("icepop", needs_old=True, current_mask=_moves_with_source,
            doc="masked IS k = old/mu, band on old/mu or cur/mu (mask_source), times PPO clip")
def _icepop(cfg: PolicyChannelConfig, x: PolicyInputs) -> PolicyLossOutput:
    return copc_policy_loss(
        _corrected(x, "icepop"), mask_low=cfg.mask_low, mask_high=cfg.mask_high, weight_mode="masked_is",
        mask_source=cfg.mask_source, clip=_clip(cfg), agg=_agg(cfg, x), denominator=cfg.denominator,
    )


@_objective("copc", needs_old=True, current_mask=_moves_with_source,
            doc="COPC: omega = M*w (or M), M = band on old/mu, times PPO clip on cur/old")
def _copc(cfg: PolicyChannelConfig, x: PolicyInputs) -> PolicyLossOutput:
    return copc_policy_loss(
        _corrected(x, "copc"), mask_low=cfg.mask_low, mask_high=cfg.mask_high, weight_mode=cfg.weight_mode,
        mask_source=cfg.mask_source, clip=_clip(cfg), agg=_agg(cfg, x), denominator=cfg.denominator,
    )


@_objective("dis", needs_old=False, current_mask=lambda cfg: True,
            doc="SAO DIS: -M r A with r = cur/mu, M = strict band, no PPO clip")
def _dis(cfg: PolicyChannelConfig, x: PolicyInputs) -> PolicyLossOutput:
    mu = _req(x.logp_behav, "logp_behav", "dis")
    return dis_loss(
        x.logp, mu, x.advantages, x.action_mask, mask_low=cfg.mask_low, mask_high=cfg.mask_high,
        agg=_agg(cfg, x), denominator=cfg.denominator,
    )


@_objective("pg", needs_old=False, doc="-sg(A) * cur (V-trace: A = pg_advantages, rho^pg inside)")
def _pg(cfg: PolicyChannelConfig, x: PolicyInputs) -> PolicyLossOutput:
    return pg_loss(x.logp, x.advantages, x.action_mask, agg=_agg(cfg, x))


def policy_loss(cfg: PolicyChannelConfig, inputs: PolicyInputs) -> PolicyLossResult:
    """The actor loss of ``cfg`` on one (micro-)batch (:class:`PolicyInputs`; see the module docstring).

    Returns ``(loss, per_token, stats, keep)``.
    """
    return POLICY_OBJECTIVES.get(cfg.objective).fn(cfg, inputs)


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
            cfg, PolicyInputs(logp=anchor, logp_old=logp_old, logp_behav=logp_behav, advantages=zeros,
                              action_mask=action_mask, num_tokens=None),
        )
    return out.keep.sum()

