"""Named method presets: each is a policy channel + an advantage channel + an optional critic.

Presets are plain frozen configs (docs/formulas.md#hyper-parameters; docs/algorithms.md has
the formulas as implemented). Get one by name and override any field with ``dataclasses.replace``::

    from dataclasses import replace
    from copc.channels.methods import get_method

    m = get_method("copc")
    m = replace(m, policy=replace(m.policy, mask_low=0.2, mask_high=5.0),
                advantage=replace(m.advantage, advantage_window=100))

The two rollout-side switches (``dynamic_sampling``, ``overlong_shaping``: DAPO's data choices) are data
like the rest: the generator reads them through ``RolloutConfig.with_method_defaults``, and the run
config's ``rollout.dynamic_sampling.enabled`` / ``rollout.overlong.enabled`` override them for any method.

Every replaced config is re-validated (``__post_init__``), so an invalid combination fails at once.
``get_method("copcc")`` fails with the valid names and a "did you mean 'copc'?" hint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from copc.channels.advantage import AdvantageChannelConfig
from copc.channels.critic import CriticConfig
from copc.channels.policy import PolicyChannelConfig
from copc.registry import Registry

__all__ = ["COPC_READING", "METHODS", "MethodConfig", "get_method", "method_names"]


@dataclass(frozen=True)
class MethodConfig:
    """A complete update rule: what the actor minimises, how advantages/targets are built, the critic."""

    name: str
    """Preset name (free text once overridden)."""
    policy: PolicyChannelConfig = field(default_factory=PolicyChannelConfig)
    """Actor loss (policy channel)."""
    advantage: AdvantageChannelConfig = field(default_factory=AdvantageChannelConfig)
    """Advantage / critic-target estimator (advantage channel)."""
    critic: CriticConfig | None = field(default_factory=CriticConfig)
    """Critic loss and schedule; None for critic-free (group-normalised) methods."""
    doc: str = ""
    """One paragraph: what the preset reproduces and from where."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling on the rollout side (copc.rollout.generator);
    ``rollout.dynamic_sampling.enabled`` wins when set."""
    overlong_shaping: bool = False
    """DAPO soft overlong punishment of the reward (copc.rewards.shaping); ``rollout.overlong.enabled`` wins
    when set."""

    def __post_init__(self) -> None:
        if self.advantage.needs_critic and self.critic is None:
            raise ValueError(
                f"method {self.name!r}: advantage.estimator={self.advantage.estimator!r} reads values; "
                "give a CriticConfig or use estimator='group'"
            )
        if not self.advantage.needs_critic and self.critic is not None:
            raise ValueError(
                f"method {self.name!r}: advantage.estimator={self.advantage.estimator!r} "
                "does not use a critic; set critic=None"
            )

    @property
    def needs_old_forward(self) -> bool:
        """True if the step needs ``logp_old`` (one no-grad actor forward): for the loss or the ratio
        ``w``."""
        return self.policy.needs_old_forward or self.advantage.needs_old_forward

    @property
    def needs_critic(self) -> bool:
        """True if a value model is trained and its pre-update values are computed each step."""
        return self.critic is not None


METHODS: Registry[Callable[[], MethodConfig]] = Registry("method")


def get_method(name: str) -> MethodConfig:
    """The preset called ``name``; fails with the valid names (and a close match) on a typo."""
    return METHODS.get(name)()


def method_names() -> tuple[str, ...]:
    """All preset names, sorted."""
    return METHODS.names()


# Shared pieces. PPO clip 0.2 / 0.28 (DAPO, BRACE, docs/formulas.md#hyper-parameters) unless the source
# says otherwise; gamma = lambda = 1 (verl, AReaL, BRACE); value clip 0.5 (verl, BRACE); critic warm-up
# 5 steps (BRACE).
_GAE = AdvantageChannelConfig(estimator="gae", gamma=1.0, lam_critic=1.0, lam_actor=1.0)
_GROUP = AdvantageChannelConfig(estimator="group", group_mode="grpo", whiten=False)
_CRITIC = CriticConfig(loss="mse", clip_eps=0.5, updates_per_step=1, warmup_steps=5)


def _ppo_policy(objective: str) -> PolicyChannelConfig:
    """The PPO policy channel of ppo / async_ppo / async_ppo_recompute: clip-higher 0.2 / 0.28, dual clip 3,
    4 minibatches; they differ only in what the ratio is taken against (``objective``)."""
    return PolicyChannelConfig(objective=objective, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0,
                               minibatches=4)



@METHODS.register("ppo")
def _ppo() -> MethodConfig:
    return MethodConfig(
        "ppo",
        _ppo_policy("ppo"),
        _GAE,
        _CRITIC,
        "Synchronous PPO + GAE with a value model (docs/formulas.md#ppo; "
        "verl compute_policy_loss_vanilla, dual clip 3).",
    )


@METHODS.register("async_ppo")
def _async_ppo() -> MethodConfig:
    return MethodConfig(
        "async_ppo",
        _ppo_policy("bypass_ppo"),
        _GAE,
        _CRITIC,
        "Async PPO 3a: clip on exp(cur - mu), no old forward, GAE "
        "on stale data (docs/formulas.md#async-ppo; verl bypass).",
    )


@METHODS.register("async_ppo_recompute")
def _async_ppo_recompute() -> MethodConfig:
    return MethodConfig(
        "async_ppo_recompute",
        _ppo_policy("ppo"),
        _GAE,
        _CRITIC,
        "Async PPO 3b: old recomputed at the step start, clip on exp(cur - old), mu never used "
        "(docs/formulas.md#async-ppo).",
    )


@METHODS.register("vtrace")
def _vtrace() -> MethodConfig:
    return MethodConfig(
        "vtrace",
        PolicyChannelConfig(objective="pg", minibatches=1),
        AdvantageChannelConfig(estimator="vtrace", rho_bar=1.0, c_bar=1.0, pg_rho_bar=1.0, whiten=True),
        CriticConfig(loss="mse", clip_eps=None, updates_per_step=1, warmup_steps=5),
        "IMPALA V-trace with pi = old: -sg(A_pg) log pi, critic 1/2 (vs - V)^2, one minibatch "
        "(docs/formulas.md#v-trace).",
    )


@METHODS.register("dapo")
def _dapo() -> MethodConfig:
    return MethodConfig(
        "dapo",
        PolicyChannelConfig(objective="ppo", clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, minibatches=16),
        _GROUP,
        None,
        dynamic_sampling=True,
        overlong_shaping=True,
        doc="DAPO: clip-higher 0.2/0.28, group z-scores, token-mean, 16 minibatches, dynamic sampling (equal-"
        "reward groups dropped and resampled) and the soft overlong "
        "penalty (docs/formulas.md#dapo; verl adds dual clip 3).",
    )


@METHODS.register("sao")
def _sao() -> MethodConfig:
    return MethodConfig(
        "sao",
        PolicyChannelConfig(objective="dis", mask_low=0.7, mask_high=6.0, minibatches=4),
        _GAE,
        CriticConfig(loss="mse", clip_eps=0.5, updates_per_step=2, warmup_steps=10),
        "SAO: DIS -M r A with r = cur/mu in (0.7, 6) strict, skip-observation GAE, K_critic = 2 "
        "(docs/formulas.md#sao). Length-adaptive lambda_actor is not implemented (lambda_a = 1).",
    )


_AREAL_POLICY = PolicyChannelConfig(
    objective="decoupled", clip_low=0.2, clip_high=0.2, weight_cap=5.0, cap_mode="mask", minibatches=4
)


@METHODS.register("areal")
def _areal() -> MethodConfig:
    return MethodConfig(
        "areal",
        _AREAL_POLICY,
        _GROUP,
        None,
        doc="AReaL paper: decoupled objective exp(old - mu) (masked above 5) times PPO clip 0.2 on cur/old, "
        "4 minibatches, critic-free group-normalised advantages, gamma = lambda = 1 "
        "(docs/formulas.md#areal). Not AReaL-code's "
        "rejection_sampling=None (no weight).",
    )


@METHODS.register("areal_critic")
def _areal_critic() -> MethodConfig:
    return MethodConfig(
        "areal_critic",
        _AREAL_POLICY,
        _GAE,
        _CRITIC,
        doc="AReaL's decoupled objective (as areal) with a value model and GAE (gamma = lambda = 1, value "
            "clip "
        "0.5) instead of group advantages: AReaL's code supports a critic; its paper ran without one "
        "(docs/formulas.md#areal).",
    )


@METHODS.register("icepop")
def _icepop() -> MethodConfig:
    return MethodConfig(
        "icepop",
        PolicyChannelConfig(
            objective="icepop", mask_low=0.5, mask_high=5.0, mask_source="step_start",
            loss_agg="seq-mean-token-mean", minibatches=4
        ),
        _GROUP,
        None,
        "IcePop (Ring-1T): k = old/mu kept in [0.5, 5] times PPO clip, group advantages, "
        "seq-mean-token-mean (docs/formulas.md#masks); mask_source='current' gives BRACE's cur/mu baseline.",
    )


@METHODS.register("brace")
def _brace() -> MethodConfig:
    return MethodConfig(
        "brace",
        PolicyChannelConfig(objective="ppo", clip_low=0.2, clip_high=0.28, minibatches=1),
        AdvantageChannelConfig(estimator="brace", rho_bar=1.2, c_bar=1.1, brace_k=100, whiten=True),
        CriticConfig(loss="mse", clip_eps=0.5, updates_per_step=1, warmup_steps=5),
        "BRACE: k = 100 capped, MC-anchored critic targets (rho_bar 1.2, c_bar 1.1), PPO clip 0.2/0.28, "
        "1 minibatch, value clip 0.5 (docs/formulas.md#brace).",
    )


# COPC, two readings of "token-level ratio masking" (docs/formulas.md#r0 vs docs/formulas.md#r1). Both keep
# the same advantage channel (two-sided clipped-ratio weighted TD residuals, clip(old/mu, 0.8, 1.2),
# k_A = inf) and critic.
_COPC_ADVANTAGE = AdvantageChannelConfig(
    estimator="clipped_td", ratio_low=0.8, ratio_high=1.2, trace="none", advantage_window=None, whiten=True
)
#: R1's band on r = cur/mu (1 - eps_P^-, 1 + eps_P^+): the starting point of
#: docs/formulas.md#hyper-parameters, fixed before any run of R1. Development runs decide whether it changes
#: (docs/results.md#issue-32-which-copc-pre-registration).
_R1_BAND = (0.5, 2.0)
#: R1's policy channel: async PPO 3a's actor with the band on r = cur/mu (copc_behaviour, async_ppo_mask).
_R1_POLICY = replace(_ppo_policy("bypass_ppo"), mask_low=_R1_BAND[0], mask_high=_R1_BAND[1])


@METHODS.register("copc_proximal")
def _copc_proximal() -> MethodConfig:
    return MethodConfig(
        "copc_proximal",
        PolicyChannelConfig(
            objective="copc", clip_low=0.2, clip_high=0.28, mask_low=0.5, mask_high=2.0,
            weight_mode="masked_is", mask_source="step_start", minibatches=4,
        ),
        _COPC_ADVANTAGE,
        _CRITIC,
        "COPC, proximal reading R0 [RECONSTRUCTED, docs/formulas.md#r0]: omega = M w with M = 1[0.5 <= "
        "old/mu <= 2] on PPO clip 0.2/0.28 centred on old; advantages and targets from TD residuals weighted "
        "by clip(old/mu, 0.8, 1.2).",
    )


@METHODS.register("copc_behaviour")
def _copc_behaviour() -> MethodConfig:
    low, high = _R1_BAND
    return MethodConfig(
        "copc_behaviour",
        _R1_POLICY,
        _COPC_ADVANTAGE,
        _CRITIC,
        "COPC, behaviour-anchored reading R1 [RECONSTRUCTED, docs/formulas.md#r1]: async PPO 3a's actor "
        f"(clip 0.2/0.28 and dual clip 3 on r = cur/mu, 4 minibatches) with tokens whose r leaves [{low:g}, "
        f"{high:g}] masked; advantages and targets as copc_proximal. DIS form: "
        "method_overrides.policy.objective=dis "
        "(strict band, no PPO clip).",
    )


@METHODS.register("async_ppo_mask")
def _async_ppo_mask() -> MethodConfig:
    low, high = _R1_BAND
    return MethodConfig(
        "async_ppo_mask",
        _R1_POLICY,
        _GAE,
        _CRITIC,
        "COPC R1's policy channel alone (docs/formulas.md#r1, eps_A = 0): async PPO 3a with tokens whose r "
        f"= cur/mu leaves [{low:g}, {high:g}] masked; plain GAE on stale data.",
    )


@METHODS.register("async_ppo_advantage")
def _async_ppo_advantage() -> MethodConfig:
    return MethodConfig(
        "async_ppo_advantage",
        _ppo_policy("bypass_ppo"),
        _COPC_ADVANTAGE,
        _CRITIC,
        "COPC's advantage channel alone (docs/formulas.md#r1, eps_P = inf): async PPO 3a's actor with "
        "advantages and critic targets from TD residuals weighted by clip(old/mu, 0.8, 1.2).",
    )


@METHODS.register("async_ppo_oracle")
def _async_ppo_oracle() -> MethodConfig:
    return MethodConfig(
        "async_ppo_oracle",
        _ppo_policy("bypass_ppo"),
        AdvantageChannelConfig(estimator="mc_oracle", whiten=True),
        None,
        "Async PPO 3a's actor on the current policy's Monte-Carlo oracle advantages (chunk advantages from "
        "oracle.samples continuations per turn boundary; no "
        "critic): what no advantage-side correction can beat.",
    )


#: The reading the name ``copc`` stands for. R0 (fidelity to docs/formulas.md#r0) until a pre-registered
#: confirmation on fresh seeds shows another reading beats async PPO 3a (docs/results.md, docs/algorithms.md).
COPC_READING = "copc_proximal"


@METHODS.register("copc")
def _copc() -> MethodConfig:
    return replace(METHODS.get(COPC_READING)(), name="copc")
