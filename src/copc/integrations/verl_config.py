"""verl's config -> copc's channel configs, checked at start-up; and copc's Hydra config for verl.

The copc trainers read their options from verl's composed config: verl's own fields where verl has one
(``algorithm.gamma``, ``algorithm.lam``, the actor's clip and aggregation), and a top-level ``copc``
section for the rest (``copc.channels``, ``copc.policy.{mask_low, mask_high, weight_mode}``,
``copc.advantage.<field>``). The actor's loss picks the reading of COPC: ``policy_loss.loss_mode=copc``
is R0 (docs/formulas.md#r0, band and PPO clip on the step-start ``old``);
``policy_loss.loss_mode=copc_behaviour`` is
R1 (docs/formulas.md#r1): verl's own behaviour-anchored (bypass-mode) loss, whose token rejection
``rollout_rs=token_k1`` is R1's band. Every problem fails before any worker starts, with one line
naming the option to set. :func:`hydra_config_node` is the ``copc_ppo_trainer`` config (verl's
``ppo_trainer`` plus a ``copc`` section listing every option), registered by the plugin in Hydra's
config store.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from verl.trainer.ppo.utils import need_critic

from copc.channels import AdvantageChannelConfig, PolicyChannelConfig
from copc.channels.methods import get_method

__all__ = [
    "BEHAVIOUR_LOSS",
    "CHANNELS",
    "CONFIG_NAME",
    "ESTIMATORS",
    "MISSING_OLD",
    "MISSING_ROLLOUT",
    "MISSING_VALUES",
    "VERL_BYPASS_LOSS",
    "CopcChannels",
    "behaviour_band",
    "channels_from_verl_config",
    "check_verl_config",
    "hydra_config_node",
]

#: ``algorithm.adv_estimator`` -> the copc preset whose advantage channel (and defaults) it runs.
ESTIMATORS: dict[str, str] = {"copc_clipped_td": "copc", "copc_vtrace": "vtrace", "copc_brace": "brace"}

# One line per missing input, naming the verl option that provides it.
MISSING_ROLLOUT = (
    "copc needs the sampler's log-probs (rollout_log_probs): set "
    "actor_rollout_ref.rollout.calculate_log_probs=True"
)
MISSING_VALUES = (
    "copc's advantage channel (algorithm.adv_estimator=copc_*) needs a critic: set critic.enable=True, "
    "or run the COPC policy channel alone on verl's own advantages (copc.channels=policy, "
    "algorithm.adv_estimator=grpo)"
)
MISSING_OLD = (
    "copc needs the recomputed old_log_probs: set algorithm.rollout_correction.bypass_mode=False"
)

# copc.policy fields verl's config has no place for; the rest of COPC's policy channel is verl's actor config.
_POLICY_FIELDS = ("mask_low", "mask_high", "weight_mode")
_POLICY_ELSEWHERE = {
    "clip_low": "actor_rollout_ref.actor.clip_ratio_low",
    "clip_high": "actor_rollout_ref.actor.clip_ratio_high",
    "dual_clip_c": "actor_rollout_ref.actor.clip_ratio_c",
    "loss_agg": "actor_rollout_ref.actor.loss_agg_mode",
    "norm_length": "actor_rollout_ref.actor.loss_scale_factor",
    "minibatches": "actor_rollout_ref.actor.ppo_mini_batch_size",
    "objective": "actor_rollout_ref.actor.policy_loss.loss_mode",
}
_ADVANTAGE_ELSEWHERE = {
    "estimator": "algorithm.adv_estimator",
    "gamma": "algorithm.gamma",
    "lam_critic": "algorithm.lam",
}


#: ``copc.channels``: ``both`` is COPC (policy channel + copc's advantage channel on a critic);
#: ``policy`` is the COPC policy channel alone, on the advantages of a verl estimator (grpo, rloo, gae, ...).
CHANNELS = ("both", "policy")


#: ``actor_rollout_ref.actor.policy_loss.loss_mode`` that makes a copc trainer run COPC's behaviour-anchored
#: reading R1 (docs/formulas.md#r1): verl's own bypass-mode loss, PPO clip on ``r = exp(cur - mu)`` with the
#: tokens whose ``r`` leaves the band rejected (``rollout_rs=token_k1``), recomputed at every micro-batch.
BEHAVIOUR_LOSS = "copc_behaviour"
#: verl's own name of that loss: under a copc trainer it would clip on the recomputed ``old``, so it is
#: refused.
VERL_BYPASS_LOSS = "bypass_mode"
#: Where verl's bypass-mode loss reads its options (not in verl's yaml: set them with Hydra's ``+``).
ACTOR_CORRECTION = "actor_rollout_ref.actor.policy_loss.rollout_correction"


class CopcChannels(NamedTuple):
    """The channel configs a copc trainer runs in verl (built once at start-up)."""

    policy: PolicyChannelConfig
    #: None: the COPC policy channel alone (``copc.channels=policy``), verl's estimator gives the advantages.
    advantage: AdvantageChannelConfig | None

    @property
    def behaviour(self) -> bool:
        """True for R1 (``policy_loss.loss_mode=copc_behaviour``): the actor's ratio and band are centred on
        mu."""
        return self.policy.objective == "bypass_ppo"


def _get(config: Any, dotted: str, default: Any = None) -> Any:
    node = config
    for key in dotted.split("."):
        if node is None or not hasattr(node, "get"):
            return default
        node = node.get(key, None)
    return default if node is None else node


def _plain(section: Any) -> dict[str, Any]:
    """A config section (OmegaConf node or mapping) as a plain dict."""
    if section is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(section, DictConfig):
            return dict(OmegaConf.to_container(section, resolve=True))  # type: ignore[arg-type]
    except ImportError:  # pragma: no cover - verl depends on omegaconf
        pass
    if not isinstance(section, Mapping):
        raise ValueError(f"the copc section of verl's config must be a mapping, got {section!r}")
    return dict(section)


def _overrides(section: dict[str, Any], name: str, allowed: tuple[str, ...] | None,
               elsewhere: dict[str, str]) -> dict[str, Any]:
    """The ``copc.<name>`` values that were set (null means the preset's value: ``copc_ppo_trainer`` lists
    them all)."""
    for key in section:
        if key in elsewhere:
            raise ValueError(f"copc.{name}.{key} is verl's {elsewhere[key]}; set it there instead")
        if allowed is not None and key not in allowed:
            raise ValueError(f"copc.{name}.{key} is not a copc option in verl; valid: {', '.join(allowed)}")
    return {key: value for key, value in section.items() if value is not None}


def _positive(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise ValueError(f"{where}: {text!r} is not a positive number; R1's band [0.5, 2] is "
                         f"rollout_rs_threshold=0.5_2.0")
    return value


def behaviour_band(config: Any) -> tuple[float, float]:
    """R1's band on ``r = cur/mu`` from verl's bypass-mode options (``ACTOR_CORRECTION``), checked.

    verl's ``token_k1`` keeps a token when ``lower <= mu/cur <= upper`` (its statistic is ``log(mu/cur)``,
    threshold ``"lower_upper"``, or ``"upper"`` for ``lower = 1/upper``): that is ``1/upper <= r <= 1/lower``.
    ``rollout_rs=null`` is no band, ``(0, inf)``: async PPO 3a's actor (COPC's advantage channel alone).
    """
    section = _get(config, ACTOR_CORRECTION)
    loss_type = str(_get(section, "loss_type", "ppo_clip"))
    if loss_type != "ppo_clip":
        raise ValueError(
            f"{ACTOR_CORRECTION}.loss_type={loss_type}: COPC R1 in verl is its PPO form (ppo_clip); "
            "R1's DIS form has no verl path"
        )
    option = _get(section, "rollout_rs")
    if option is None:
        return 0.0, math.inf
    if str(option).strip() != "token_k1":
        raise ValueError(
            f"{ACTOR_CORRECTION}.rollout_rs={option}: R1's mask is verl's token-level band on the ratio, "
            "rollout_rs=token_k1 (or null for no band)"
        )
    spec = _get(section, "rollout_rs_threshold")
    where = f"{ACTOR_CORRECTION}.rollout_rs_threshold"
    if spec is None:
        raise ValueError(f"{where} is not set: R1's band [0.5, 2] is +{where}=0.5_2.0")
    text = str(spec).strip()
    if "_" in text:
        lower_text, upper_text = text.split("_", 1)
        lower, upper = _positive(lower_text, where), _positive(upper_text, where)
    else:
        upper = _positive(text, where)
        lower = 1.0 / upper
    if not lower < upper:
        read_as_number = "" if isinstance(spec, str) else (
            " (Hydra reads digits around an underscore as one "
            "number: 0.5_2 is 0.52; write 0.5_2.0 or quote it)"
        )
        raise ValueError(f"{where}={text}: the band needs lower < upper (lower_upper, e.g. "
                         f"0.5_2.0){read_as_number}")
    return 1.0 / upper, 1.0 / lower


def channels_from_verl_config(config: Any) -> CopcChannels:
    """copc's channel configs from verl's full config; fails at start-up with one line per problem.

    Policy channel, by the actor's ``policy_loss.loss_mode``: ``copc_behaviour`` runs R1, copc's
    ``copc_behaviour`` preset with the band of :func:`behaviour_band` (verl's own ``bypass_mode`` is
    refused); any other loss (``copc``) runs R0,
    copc's ``copc`` preset with ``copc.policy.{mask_low, mask_high, weight_mode}``, whose weight omega the
    trainer hands to the loss.
    Advantage channel (``copc.channels=both``, the default): the preset named by
    ``algorithm.adv_estimator`` (``copc_clipped_td`` -> ``copc``, ``copc_vtrace`` -> ``vtrace``,
    ``copc_brace`` -> ``brace``) with gamma = ``algorithm.gamma``, lambda (critic and actor) =
    ``algorithm.lam`` and any ``copc.advantage.<field>``. ``copc.channels=policy``: none (the COPC policy
    channel alone; ``algorithm.adv_estimator`` must then be one of verl's, e.g. ``grpo``).
    """
    estimator = str(_get(config, "algorithm.adv_estimator", ""))
    section = _plain(_get(config, "copc"))
    unknown = sorted(set(section) - {"policy", "advantage", "channels"})
    if unknown:
        raise ValueError(
            f"unknown copc section(s) {unknown} in verl's config; "
            "valid: copc.channels, copc.policy, copc.advantage"
        )
    which = str(section.get("channels") or "both")
    if which not in CHANNELS:
        raise ValueError(f"copc.channels={which!r}: valid are {', '.join(CHANNELS)}")
    policy_over = _overrides(_plain(section.get("policy")), "policy", _POLICY_FIELDS, _POLICY_ELSEWHERE)
    adv_over = _overrides(_plain(section.get("advantage")), "advantage", None, _ADVANTAGE_ELSEWHERE)
    loss_mode = str(_get(config, "actor_rollout_ref.actor.policy_loss.loss_mode", ""))
    if loss_mode == VERL_BYPASS_LOSS:
        raise ValueError(
            f"policy_loss.loss_mode={VERL_BYPASS_LOSS} under a copc trainer would clip on verl's recomputed "
            f"old: set loss_mode={BEHAVIOUR_LOSS} for COPC R1 (verl's bypass-mode loss on the sampler's "
            f"log-probs), or copc for R0"
        )
    if loss_mode == BEHAVIOUR_LOSS:
        if policy_over:
            raise ValueError(
                f"copc.policy.{next(iter(policy_over))} is R0's (policy_loss.loss_mode=copc); with loss_mode="
                f"{BEHAVIOUR_LOSS} (R1) the band is verl's {ACTOR_CORRECTION}.rollout_rs_threshold: remove it"
            )
        if which == "policy":
            raise ValueError(
                f"copc.channels=policy with policy_loss.loss_mode={BEHAVIOUR_LOSS} is verl's own bypass mode "
                "(async PPO 3a + mask): run verl's trainer (trainer.v1.trainer_mode=sync, colocate_async or "
                "separate_async) with algorithm.rollout_correction.bypass_mode=True (it writes old_log_probs "
                "= rollout_log_probs itself); or copc.channels=both for COPC R1"
            )
        if str(_get(config, "actor_rollout_ref.actor.loss_agg_mode", "")) == "seq-mean-token-mean":
            raise ValueError(
                f"actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean with loss_mode={BEHAVIOUR_LOSS} "
                "divides each sequence by the tokens the band keeps, not by all its tokens (R1, "
                "docs/formulas.md#r1): use token-mean, "
                "seq-mean-token-sum or seq-mean-token-sum-norm"
            )
        low, high = behaviour_band(config)
        policy = dataclasses.replace(get_method("copc_behaviour").policy, mask_low=low, mask_high=high)
    else:
        policy = dataclasses.replace(get_method("copc").policy, **policy_over)
    if which == "policy":
        if estimator in ESTIMATORS:
            raise ValueError(
                f"copc.channels=policy runs the COPC policy channel alone on verl's own advantages: set "
                "algorithm.adv_estimator to a verl estimator such "
                f"as grpo (got {estimator!r}), or copc.channels=both"
            )
        if adv_over:
            raise ValueError(f"copc.advantage.{next(iter(adv_over))} is unused with copc.channels=policy: "
                             f"remove it")
        return CopcChannels(policy, None)
    if estimator not in ESTIMATORS:
        raise ValueError(
            f"copc's trainer runs copc's advantage channel: set algorithm.adv_estimator to one of "
            f"{', '.join(ESTIMATORS)} (got {estimator!r}), or copc.channels=policy for the COPC policy "
            f"channel alone on {estimator or 'a verl estimator'}'s advantages"
        )
    lam = float(_get(config, "algorithm.lam", 1.0))
    defaults = {"gamma": float(_get(config, "algorithm.gamma", 1.0)), "lam_critic": lam, "lam_actor": lam}
    try:
        advantage = dataclasses.replace(get_method(ESTIMATORS[estimator]).advantage, **{**defaults,
                                                                                        **adv_over})
    except TypeError as exc:  # an unknown field name
        raise ValueError(f"copc.advantage: {exc}; see copc.channels.AdvantageChannelConfig for the "
                         "fields") from None
    return CopcChannels(policy, advantage)


def check_verl_config(config: Any) -> CopcChannels:
    """Everything a copc trainer needs from verl's config, checked before any worker starts."""
    channels = channels_from_verl_config(config)
    if channels.advantage is not None and not need_critic(config):
        raise ValueError(MISSING_VALUES)
    if not _get(config, "actor_rollout_ref.rollout.calculate_log_probs", False):
        raise ValueError(MISSING_ROLLOUT)
    correction = _get(config, "algorithm.rollout_correction")
    if _get(correction, "bypass_mode", False):
        raise ValueError(MISSING_OLD)
    for key in ("rollout_is", "rollout_rs"):
        if _get(correction, key) is not None:
            raise ValueError(
                f"copc's policy channel replaces verl's rollout correction: set "
                f"algorithm.rollout_correction.{key}=null"
            )
    return channels


#: Hydra primary config: verl's ``ppo_trainer`` plus a ``copc`` section listing every copc option, so a
#: run started with ``--config-name copc_ppo_trainer`` sets ``copc.*`` without Hydra's ``+``.
CONFIG_NAME = "copc_ppo_trainer"


def hydra_config_node() -> dict[str, Any]:
    """``copc_ppo_trainer``: every copc option, null meaning the preset's value (R0's band for
    ``copc.policy``, the estimator's preset for ``copc.advantage``), so an option set by the user can be told
    from a default."""
    advantage = [f.name for f in dataclasses.fields(AdvantageChannelConfig)
                 if f.name not in _ADVANTAGE_ELSEWHERE]
    return {
        "defaults": ["ppo_trainer", "_self_"],
        "copc": {
            "channels": CHANNELS[0],
            "policy": dict.fromkeys(_POLICY_FIELDS),
            "advantage": dict.fromkeys(advantage),
        },
    }
