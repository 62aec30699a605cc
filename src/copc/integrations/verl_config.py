"""verl's config -> copc's channel configs, checked at start-up; and copc's Hydra config for verl.

The copc trainers read their options from verl's composed config: verl's own fields where verl has one
(``algorithm.gamma``, ``algorithm.lam``, the actor's clip and aggregation), and a top-level ``copc``
section for the rest (``copc.channels``, ``copc.policy.{mask_low, mask_high, weight_mode}``,
``copc.advantage.<field>``). Every problem fails before any worker starts, with one line naming the
option to set. :func:`hydra_config_node` is the ``copc_ppo_trainer`` config (verl's ``ppo_trainer``
plus a ``copc`` section listing every option), registered by the plugin in Hydra's config store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

from verl.trainer.ppo.utils import need_critic

from copc.channels import AdvantageChannelConfig, PolicyChannelConfig
from copc.channels.methods import get_method

__all__ = [
    "CHANNELS",
    "CONFIG_NAME",
    "ESTIMATORS",
    "MISSING_OLD",
    "MISSING_ROLLOUT",
    "MISSING_VALUES",
    "CopcChannels",
    "channels_from_verl_config",
    "check_verl_config",
    "hydra_config_node",
]

#: ``algorithm.adv_estimator`` -> the copc preset whose advantage channel (and defaults) it runs.
ESTIMATORS: dict[str, str] = {"copc_clipped_td": "copc", "copc_vtrace": "vtrace", "copc_brace": "brace"}

# One line per missing input, naming the verl option that provides it.
MISSING_ROLLOUT = (
    "copc needs the sampler's log-probs (rollout_log_probs): set actor_rollout_ref.rollout.calculate_log_probs=True"
)
MISSING_VALUES = (
    "copc's advantage channel (algorithm.adv_estimator=copc_*) needs a critic: set critic.enable=True, "
    "or run the COPC policy channel alone on verl's own advantages (copc.channels=policy, algorithm.adv_estimator=grpo)"
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


class CopcChannels(NamedTuple):
    """The channel configs a copc trainer runs in verl (built once at start-up)."""

    policy: PolicyChannelConfig
    #: None: the COPC policy channel alone (``copc.channels=policy``), verl's estimator gives the advantages.
    advantage: AdvantageChannelConfig | None


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


def _overrides(section: dict[str, Any], name: str, allowed: tuple[str, ...] | None, elsewhere: dict[str, str]) -> dict[str, Any]:
    """The ``copc.<name>`` values that were set (null means the preset's value: ``copc_ppo_trainer`` lists them all)."""
    for key in section:
        if key in elsewhere:
            raise ValueError(f"copc.{name}.{key} is verl's {elsewhere[key]}; set it there instead")
        if allowed is not None and key not in allowed:
            raise ValueError(f"copc.{name}.{key} is not a copc option in verl; valid: {', '.join(allowed)}")
    return {key: value for key, value in section.items() if value is not None}


def channels_from_verl_config(config: Any) -> CopcChannels:
    """copc's channel configs from verl's full config; fails at start-up with one line per problem.

    Policy channel: copc's ``copc`` preset with ``copc.policy.{mask_low, mask_high, weight_mode}``.
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
            f"unknown copc section(s) {unknown} in verl's config; valid: copc.channels, copc.policy, copc.advantage"
        )
    which = str(section.get("channels") or "both")
    if which not in CHANNELS:
        raise ValueError(f"copc.channels={which!r}: valid are {', '.join(CHANNELS)}")
    policy_over = _overrides(_plain(section.get("policy")), "policy", _POLICY_FIELDS, _POLICY_ELSEWHERE)
    adv_over = _overrides(_plain(section.get("advantage")), "advantage", None, _ADVANTAGE_ELSEWHERE)
    policy = dataclasses.replace(get_method("copc").policy, **policy_over)
    if which == "policy":
        if estimator in ESTIMATORS:
            raise ValueError(
                f"copc.channels=policy runs the COPC policy channel alone on verl's own advantages: set "
                f"algorithm.adv_estimator to a verl estimator such as grpo (got {estimator!r}), or copc.channels=both"
            )
        if adv_over:
            raise ValueError(f"copc.advantage.{next(iter(adv_over))} is unused with copc.channels=policy: remove it")
        return CopcChannels(policy, None)
    if estimator not in ESTIMATORS:
        raise ValueError(
            f"copc's trainer runs copc's advantage channel: set algorithm.adv_estimator to one of "
            f"{', '.join(ESTIMATORS)} (got {estimator!r}), or copc.channels=policy for the COPC policy channel "
            f"alone on {estimator or 'a verl estimator'}'s advantages"
        )
    lam = float(_get(config, "algorithm.lam", 1.0))
    defaults = {"gamma": float(_get(config, "algorithm.gamma", 1.0)), "lam_critic": lam, "lam_actor": lam}
    try:
        advantage = dataclasses.replace(get_method(ESTIMATORS[estimator]).advantage, **{**defaults, **adv_over})
    except TypeError as exc:  # an unknown field name
        raise ValueError(f"copc.advantage: {exc}; see copc.channels.AdvantageChannelConfig for the fields") from None
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
                f"copc's policy channel replaces verl's rollout correction: set algorithm.rollout_correction.{key}=null"
            )
    return channels


#: Hydra primary config: verl's ``ppo_trainer`` plus a ``copc`` section listing every copc option, so a
#: run started with ``--config-name copc_ppo_trainer`` sets ``copc.*`` without Hydra's ``+``.
CONFIG_NAME = "copc_ppo_trainer"


def hydra_config_node() -> dict[str, Any]:
    """``copc_ppo_trainer``: the copc preset's policy band; advantage fields null (= the estimator's preset)."""
    policy = get_method("copc").policy
    advantage = [f.name for f in dataclasses.fields(AdvantageChannelConfig) if f.name not in _ADVANTAGE_ELSEWHERE]
    return {
        "defaults": ["ppo_trainer", "_self_"],
        "copc": {
            "channels": CHANNELS[0],
            "policy": {name: getattr(policy, name) for name in _POLICY_FIELDS},
            "advantage": dict.fromkeys(advantage),
        },
    }
