"""COPC inside verl: both channels as a verl plugin, loaded by ``import verl`` in every process.

``pip install copc[verl]`` registers this module under verl's ``verl.plugins`` entry-point group
(``copc = "copc.integrations.verl"``); verl imports it at the end of ``import verl`` (driver, TaskRunner
and every Ray worker), and importing it registers, through verl's own registries:

- the policy loss ``copc`` (``actor_rollout_ref.actor.policy_loss.loss_mode=copc``): COPC's masked
  policy channel as reconstructed in R0 (spec 9.3),
  ``l_t = omega_t * PPOclip(exp(cur_t - old_t), A_t)`` (copc ``weighted_ppo_loss``),
  aggregated by verl's own ``agg_loss(..., **config.global_batch_info)`` so verl's data-parallel
  normalisation and every ``loss_agg_mode`` hold. PPO clip, dual clip and aggregation come from verl's
  actor config (``clip_ratio_low``/``clip_ratio_high``, ``clip_ratio_c``, ``loss_agg_mode``,
  ``loss_scale_factor``); entropy and KL are added by verl after the call.
- the trainers ``copc`` (verl's sync trainer), ``copc_colocate_async`` and ``copc_separate_async``
  (``trainer.v1.trainer_mode=...``): verl's v1 trainers whose advantage step is copc's advantage
  channel on verl's batch, once per step: ``log_w = clamp(old - mu, +-20)`` from ``old_log_probs`` and
  ``rollout_log_probs``; advantages and critic targets from copc's estimator (``clipped_td``, ``vtrace``
  or ``brace``) on ``token_level_rewards``, the critic's ``values`` and ``response_mask`` (tool tokens
  of multi-turn rollouts are False there and are bridged, as verl's GAE does); and the policy weight
  ``omega = M * w`` (``M = 1[mask_low <= w <= mask_high]``, spec 9.3) written as verl's
  ``rollout_is_weights``, which verl hands to the actor loss. Both channels read the same ``log_w``.
  Each runs as the verl trainer it extends in every mode-dependent decision (verl's mode string is
  handed to verl's base code; see :class:`CopcAdvantageMixin`). ``copc.channels=policy`` runs the
  COPC policy channel alone (not COPC): verl's own advantage step (e.g. GRPO, no critic), then omega.
- the policy loss ``copc_behaviour`` (``policy_loss.loss_mode=copc_behaviour``): COPC R1 (spec 9.7). The
  trainers then run the same advantage channel on ``old - mu`` and write ``old_log_probs =
  rollout_log_probs`` and no weight; the loss is verl's own bypass-mode loss
  (``compute_policy_loss_bypass_mode``), which clips ``r = exp(cur - mu)`` and rejects the tokens whose
  ``r`` leaves R1's band (``policy_loss.rollout_correction.rollout_rs=token_k1``) at every micro-batch.
  copc adds one thing: a micro-batch with no loss token (verl's synthetic padding rows) gives 0, where
  verl's rejection step raises.
- the advantage estimators ``copc_clipped_td``, ``copc_vtrace``, ``copc_brace``
  (``algorithm.adv_estimator=...``) choose copc's estimator. verl calls a registered estimator with
  rewards and a mask only (no values, no log-probs), so these entries only say, if a plain verl trainer
  calls them, to set ``trainer.v1.trainer_mode`` to a copc trainer.

How R0 deviates from copc's own trainer: the band mask is fixed at the step start (verl's actor loss
never sees ``rollout_log_probs``, so ``policy.mask_source='current'`` is refused); masked tokens stay
in the denominator (``policy.denominator='all'``: verl's global token counts include them); the dual
clip is verl's ``clip_ratio_c`` (copc's preset has it off). copc options that verl's config has no
field for live in a top-level ``copc`` section of verl's config (``copc.policy.mask_high=5``,
``copc.advantage.ratio_low=0.9`` with ``--config-name copc_ppo_trainer``, which lists them all; with
verl's own config name, ``+copc...``) and are validated by copc's own config checks at start-up; gamma
and lambda are verl's ``algorithm.gamma`` / ``algorithm.lam``. docs/verl.md has a full command.

verl logs a plugin that fails to import only at debug level, so this module logs every failure at
ERROR (with the traceback) before re-raising. Metrics: the driver logs ``copc/...`` (advantage and ratio
diagnostics, policy mask rate), the actor ``actor/copc/policy/...`` (clip and mask fractions).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import os
from typing import Any, ClassVar, NamedTuple

import torch

# copc names used here (one block, so a move of copc's layout is one edit).
from copc.channels import PolicyChannelConfig, compute_advantages
from copc.ops import ClipSpec, band_weight, log_ratio, masked_mean, weighted_ppo_loss

_log = logging.getLogger(__name__)
# As verl's own modules do: verl's basic config leaves the root at WARNING, so INFO needs the logger's level.
_log.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))


def _fail_loud(what: str) -> None:
    """Log the exception being handled at ERROR (verl would log it at debug and go on without copc)."""
    _log.error(
        "copc's verl plugin failed to %s; policy_loss.loss_mode=copc and trainer.v1.trainer_mode=copc* "
        "will be unknown to verl. Fix the error below (pip install 'copc[verl]' installs what it needs).",
        what,
        exc_info=True,
    )


try:
    import transfer_queue as tq
    from hydra.core.config_store import ConfigStore
    from tensordict import TensorDict
    from verl.protocol import DataProto
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.ray_trainer import apply_kl_penalty
    from verl.trainer.ppo.v1 import (
        PPOTrainerColocateAsync,
        PPOTrainerSeparateAsync,
        PPOTrainerSync,
        get_trainer_cls,
        register_trainer,
    )
    from verl.workers.utils.padding import response_to_nested

    from copc.integrations.verl_config import (
        BEHAVIOUR_LOSS,
        CONFIG_NAME,
        ESTIMATORS,
        MISSING_OLD,
        MISSING_ROLLOUT,
        MISSING_VALUES,
        CopcChannels,
        channels_from_verl_config,
        check_verl_config,
        hydra_config_node,
    )
except Exception:
    _fail_loud("import verl's v1 trainer")
    raise

__all__ = [
    "BEHAVIOUR_LOSS",
    "CONFIG_NAME",
    "ESTIMATORS",
    "LOSS_NAME",
    "SUPPORTED_VERL",
    "TRAINERS",
    "CopcAdvantageMixin",
    "CopcChannels",
    "CopcPolicyWeight",
    "CopcStep",
    "channels_from_verl_config",
    "check_verl_config",
    "check_verl_hook",
    "check_verl_version",
    "copc_advantage_step",
    "copc_behaviour_loss",
    "copc_policy_loss",
    "copc_policy_weight",
]

#: verl's name of copc's policy loss (``actor_rollout_ref.actor.policy_loss.loss_mode``).
LOSS_NAME = "copc"
_TRAINER_HINT = "set trainer.v1.trainer_mode=copc (or copc_colocate_async / copc_separate_async)"
MISSING_WEIGHTS = f"policy_loss.loss_mode=copc needs the weights copc's trainer writes (rollout_is_weights): {_TRAINER_HINT}"


class CopcStep(NamedTuple):
    """What copc's advantage step writes into verl's batch; all ``[B, T]`` float32, 0 off the mask."""

    advantages: torch.Tensor
    returns: torch.Tensor
    rollout_is_weights: torch.Tensor | None  # R0: omega = M * w (or M), the policy channel's weight; R1: None
    old_log_probs: torch.Tensor | None  # R1: mu, the actor's trust-region centre from now on; R0: None (unchanged)
    metrics: dict[str, torch.Tensor]  # detached scalars, ``copc/...``


class CopcPolicyWeight(NamedTuple):
    """The policy channel's per-token weight at the step start; ``[B, T]``, 0 off the mask."""

    log_w: torch.Tensor  # float32, log(old / mu), clamped to +-20
    rollout_is_weights: torch.Tensor  # float32, omega = M * w (or M)
    metrics: dict[str, torch.Tensor]  # detached scalars, ``copc/policy/...``


def copc_policy_weight(
    policy: PolicyChannelConfig, *, old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor
) -> CopcPolicyWeight:
    """``omega = M * w`` (``binary``: ``M``), ``w = exp(old - mu)``, ``M = 1[mask_low <= w <= mask_high]``.

    Args:
        policy: copc's policy channel config (band and weight mode).
        old_log_probs: ``[B, T]`` float, verl's recomputed proximal log-probs (old_t).
        rollout_log_probs: ``[B, T]`` float, the sampler's log-probs (mu_t).
        mask: ``[B, T]`` bool, True on sampled tokens.
    """
    log_w = log_ratio(old_log_probs.float(), rollout_log_probs.float(), mask)
    weight, keep = band_weight(log_w, mask, low=policy.mask_low, high=policy.mask_high, mode=policy.weight_mode)
    metrics = {
        "copc/policy/mask_frac": masked_mean((mask & ~keep).float(), mask),
        "copc/policy/weight_mean": masked_mean(weight, mask),
    }
    return CopcPolicyWeight(log_w, weight.detach(), metrics)


def copc_advantage_step(
    channels: CopcChannels,
    *,
    token_level_rewards: torch.Tensor,
    values: torch.Tensor | None,
    old_log_probs: torch.Tensor | None,
    rollout_log_probs: torch.Tensor | None,
    response_mask: torch.Tensor,
) -> CopcStep:
    """Both channels' step-start quantities on verl's padded batch (``[B, T]``, right-padded responses).

    Args:
        token_level_rewards: ``[B, T]`` float, verl's rewards (score on the last response token, KL
            penalty on every token if ``use_kl_in_reward``); rewards off the mask are folded back.
        values: ``[B, T]`` float, the critic's pre-update V(s_t) at response positions.
        old_log_probs: ``[B, T]`` float, verl's recomputed proximal log-probs (old_t).
        rollout_log_probs: ``[B, T]`` float, the sampler's log-probs (mu_t).
        response_mask: ``[B, T]`` bool or 0/1, True on sampled tokens (tool output False).
    """
    if rollout_log_probs is None:
        raise ValueError(MISSING_ROLLOUT)
    if values is None:
        raise ValueError(MISSING_VALUES)
    if old_log_probs is None:
        raise ValueError(MISSING_OLD)
    if channels.advantage is None:
        raise ValueError("copc.channels=policy has no advantage channel: verl's estimator computes the advantages")
    mask = response_mask.bool()
    policy = copc_policy_weight(
        channels.policy, old_log_probs=old_log_probs, rollout_log_probs=rollout_log_probs, mask=mask
    )
    adv = compute_advantages(
        channels.advantage, rewards=token_level_rewards.float(), values=values.float(), log_w=policy.log_w, action_mask=mask
    )
    metrics = {f"copc/{name}": value for name, value in adv.stats.items()}
    if not channels.behaviour:
        return CopcStep(adv.advantages, adv.returns, policy.rollout_is_weights, None, metrics | policy.metrics)
    # R1: the band is tested on r = cur/mu by verl's loss at every micro-batch; at the step start r = old/mu.
    metrics["copc/policy/mask_frac_step_start"] = policy.metrics["copc/policy/mask_frac"]
    # as verl's bypass mode writes it: the sampler's log-probs, verbatim
    return CopcStep(adv.advantages, adv.returns, None, rollout_log_probs, metrics)


def copc_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl policy loss ``copc``: ``omega_t * PPOclip(u_t, A_t)`` per token, aggregated by verl.

    verl's ``PolicyLossFn`` signature; all tensors ``[B, T]`` (a micro-batch). ``rollout_is_weights``
    is omega from :func:`copc_advantage_step` (written by copc's trainer). Returns ``(loss, metrics)``
    with metrics as 0-d tensors (verl's ``Metric`` reads them).
    """
    if config is None:
        raise ValueError("policy loss copc needs verl's actor config (config=...)")
    if rollout_is_weights is None:
        raise ValueError(MISSING_WEIGHTS)
    mask = response_mask.bool()
    clip = config.get("clip_ratio", 0.2)
    clip_low = config.get("clip_ratio_low", None)
    clip_high = config.get("clip_ratio_high", None)
    weight = torch.where(mask, rollout_is_weights.float(), torch.zeros((), device=mask.device))
    out = weighted_ppo_loss(
        log_prob,
        old_log_prob,
        advantages,
        mask,
        weight=weight,
        keep=weight > 0,
        clip=ClipSpec(
            low=clip if clip_low is None else clip_low,
            high=clip if clip_high is None else clip_high,
            dual_c=config.get("clip_ratio_c", 3.0),
        ),
    )
    loss = core_algos.agg_loss(
        loss_mat=out.per_token, loss_mask=mask, loss_agg_mode=loss_agg_mode, **config.get("global_batch_info", {})
    )
    return loss, {f"copc/{name}": value for name, value in out.stats.items()}


def copc_behaviour_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl policy loss ``copc_behaviour``: COPC R1's actor loss, which is verl's bypass-mode loss.

    ``old_log_prob`` is mu (copc's trainer wrote ``old_log_probs = rollout_log_probs`` after its advantage
    step). verl's ``compute_policy_loss_bypass_mode`` does the work, reading R1's band from
    ``config.policy_loss.rollout_correction``; a micro-batch without a loss token (verl's padding rows)
    returns 0 with a zero gradient, where verl's rejection step raises.
    """
    if not bool(response_mask.bool().any()):
        return (log_prob * 0.0).sum(), {}
    return core_algos.compute_policy_loss_bypass_mode(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask,
        loss_agg_mode=loss_agg_mode, config=config, rollout_is_weights=rollout_is_weights,
    )


def _estimator_stub(name: str) -> Any:
    def estimator(**_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise ValueError(f"algorithm.adv_estimator={name} needs critic values and log-probs: {_TRAINER_HINT}")

    estimator.__name__ = f"{name}_needs_copc_trainer"
    return estimator


_STUBS = {name: _estimator_stub(name) for name in ESTIMATORS}


#: The verl releases whose private advantage hook copc's trainers override (pyproject's ``verl`` extra).
SUPPORTED_VERL = ">=0.9.1,<0.10"
#: ``PPOTrainer._compute_advantage``'s parameters in those releases (verl calls it as ``(batch, metrics=...)``).
_HOOK_PARAMS = ("self", "batch", "metrics")


def _verl_version() -> str:
    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a source checkout of verl
        return str(getattr(__import__("verl"), "__version__", "unknown"))


def check_verl_version(version: str | None = None) -> None:
    """Fail with one line if the installed verl (or ``version``) is outside :data:`SUPPORTED_VERL`: copc's
    trainers extend verl's v1 trainers and override a private method, which verl may change in any release."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    found = version or _verl_version()
    try:
        supported = Version(found) in SpecifierSet(SUPPORTED_VERL)
    except InvalidVersion:
        supported = False
    if not supported:
        raise RuntimeError(f"copc's verl trainers support verl{SUPPORTED_VERL}, but verl {found} is installed: "
                           f"pip install 'verl{SUPPORTED_VERL}' (or copc[verl])")


def check_verl_hook(verl_trainer: type) -> None:
    """Fail with one line if verl's ``_compute_advantage`` (the private method copc overrides) moved or changed."""
    hook = getattr(verl_trainer, "_compute_advantage", None)
    params = tuple(inspect.signature(hook).parameters) if callable(hook) else None
    if params != _HOOK_PARAMS:
        found = "has no _compute_advantage" if params is None else f"defines _compute_advantage{params}"
        raise RuntimeError(
            f"copc's verl trainers override {verl_trainer.__name__}._compute_advantage{_HOOK_PARAMS}, but the "
            f"installed verl {_verl_version()} {found}; copc supports verl{SUPPORTED_VERL}: "
            f"pip install 'verl{SUPPORTED_VERL}'"
        )


class CopcAdvantageMixin:
    """Replaces a verl v1 trainer's advantage step with copc's; put it before the verl trainer class.

    verl picks its trainer's behaviour from the string ``trainer.v1.trainer_mode`` (the replay buffer,
    the dataloader's ``gen_batch_size``, TransferQueue checkpoints, ``parameter_sync_step`` and every
    ``trainer.v1.<mode>.*`` setting), so a copc trainer, looked up by verl under copc's name, hands
    verl's base code the mode of the verl trainer it extends (``verl_mode``): it rewrites
    ``trainer.v1.trainer_mode`` in the config it is given, in place, before verl's ``__init__`` reads
    it. Everything downstream (verl's trainer, its skip manager, the agent loop started from the same
    config) then sees exactly what verl's own trainer would see; copc's name stays in ``copc_mode``.
    """

    #: The verl trainer mode this copc trainer runs as: its ``trainer.v1.<verl_mode>`` settings apply.
    verl_mode: ClassVar[str]
    config: Any
    copc_mode: str
    _copc: CopcChannels

    def __init__(self, config: Any) -> None:
        check_verl_version()
        check_verl_hook(get_trainer_cls(self.verl_mode))
        self._copc = check_verl_config(config)  # before any worker or Ray actor starts
        v1 = config.trainer.v1
        self.copc_mode = str(v1.trainer_mode)
        if self.copc_mode != self.verl_mode and v1.get(self.copc_mode, None) is not None:
            raise ValueError(
                f"trainer.v1.{self.copc_mode} is not read: the copc trainer runs as verl's {self.verl_mode} "
                f"trainer, set those options under trainer.v1.{self.verl_mode} instead"
            )
        v1.trainer_mode = self.verl_mode
        _log.info("copc trainer %s (verl's %s trainer): %s", self.copc_mode, self.verl_mode, self._copc)
        super().__init__(config)  # type: ignore[call-arg]

    def _compute_advantage(self, batch: Any, metrics: dict[str, Any]) -> Any:
        """verl's step 7 (``PPOTrainer._compute_advantage``) with copc's two channels.

        Reads the step's batch from TransferQueue, applies verl's in-reward KL if configured, and writes
        back ``advantages``, ``returns`` (critic targets) and, for R0, ``rollout_is_weights`` (omega); for
        R1 (``policy_loss.loss_mode=copc_behaviour``) ``old_log_probs = rollout_log_probs`` instead, after the
        advantage weights have read the recomputed ``old`` (nothing after this step reads it but the
        actor). With ``copc.channels=policy`` verl's own step runs first (its estimator, e.g. GRPO, writes
        the advantages) and only omega is added.
        """
        if self._copc.advantage is None:
            return self._put_policy_weight(super()._compute_advantage(batch, metrics), metrics)  # type: ignore[misc]
        use_kl = bool(self.config.algorithm.use_kl_in_reward)
        fields = ["response_mask", "rm_scores", "rollout_log_probs", "old_log_probs", "values"]
        if use_kl:
            fields.append("ref_log_prob")
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        nested_mask = data["response_mask"]
        proto = DataProto(batch=data.to_padded_tensor())
        proto.batch["token_level_scores"] = proto.batch["rm_scores"]
        if use_kl:
            proto, kl_metrics = apply_kl_penalty(
                proto, kl_ctrl=self.kl_ctrl_in_reward, kl_penalty=self.config.algorithm.kl_penalty  # type: ignore[attr-defined]
            )
            metrics.update(kl_metrics)
        else:
            proto.batch["token_level_rewards"] = proto.batch["token_level_scores"]
        padded = proto.batch
        step = copc_advantage_step(
            self._copc,
            token_level_rewards=padded["token_level_rewards"],
            values=padded.get("values", None),
            old_log_probs=padded.get("old_log_probs", None),
            rollout_log_probs=padded.get("rollout_log_probs", None),
            response_mask=padded["response_mask"],
        )
        metrics.update({name: float(value) for name, value in step.metrics.items()})
        out = {"advantages": step.advantages, "returns": step.returns}
        if step.rollout_is_weights is not None:
            out["rollout_is_weights"] = step.rollout_is_weights
        if step.old_log_probs is not None:
            out["old_log_probs"] = step.old_log_probs
        if use_kl:
            out["token_level_rewards"] = padded["token_level_rewards"]
        nested = {name: response_to_nested(value, nested_mask) for name, value in out.items()}
        return tq.kv_batch_put(
            keys=batch.keys, partition_id=batch.partition_id, fields=TensorDict(nested, batch_size=len(batch))
        )


    def _put_policy_weight(self, batch: Any, metrics: dict[str, Any]) -> Any:
        """The COPC policy channel alone: omega from the batch's old and rollout log-probs, into TransferQueue."""
        fields = ["response_mask", "rollout_log_probs", "old_log_probs"]
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        nested_mask = data["response_mask"]
        padded = data.to_padded_tensor()
        old, mu = padded.get("old_log_probs", None), padded.get("rollout_log_probs", None)
        if mu is None:
            raise ValueError(MISSING_ROLLOUT)
        if old is None:
            raise ValueError(MISSING_OLD)
        policy = copc_policy_weight(
            self._copc.policy, old_log_probs=old, rollout_log_probs=mu, mask=padded["response_mask"].bool()
        )
        metrics.update({name: float(value) for name, value in policy.metrics.items()})
        weights = response_to_nested(policy.rollout_is_weights, nested_mask)
        return tq.kv_batch_put(
            keys=batch.keys,
            partition_id=batch.partition_id,
            fields=TensorDict({"rollout_is_weights": weights}, batch_size=len(batch)),
        )


class CopcTrainerSync(CopcAdvantageMixin, PPOTrainerSync):
    """verl's synchronous v1 trainer with copc's advantage step (``trainer.v1.trainer_mode=copc``)."""

    verl_mode = "sync"


class CopcTrainerColocateAsync(CopcAdvantageMixin, PPOTrainerColocateAsync):
    """verl's colocated async trainer (partial rollouts) with copc's advantage step."""

    verl_mode = "colocate_async"


class CopcTrainerSeparateAsync(CopcAdvantageMixin, PPOTrainerSeparateAsync):
    """verl's separate-pool async trainer (``parameter_sync_step``) with copc's advantage step."""

    verl_mode = "separate_async"


#: ``trainer.v1.trainer_mode`` -> copc trainer class.
TRAINERS: dict[str, type[CopcAdvantageMixin]] = {
    "copc": CopcTrainerSync,
    "copc_colocate_async": CopcTrainerColocateAsync,
    "copc_separate_async": CopcTrainerSeparateAsync,
}


def _register() -> None:
    """Register the loss, the estimators' stubs and the trainers in verl's registries (idempotent)."""
    for name, loss in ((LOSS_NAME, copc_policy_loss), (BEHAVIOUR_LOSS, copc_behaviour_loss)):
        existing = core_algos.POLICY_LOSS_REGISTRY.get(name)
        if existing is not None and existing is not loss:
            # verl's register_policy_loss overwrites silently; never replace someone else's loss.
            raise ValueError(f"verl already has a policy loss named {name!r} ({existing!r}); copc will not overwrite it")
        core_algos.register_policy_loss(name)(loss)
    for name, stub in _STUBS.items():
        core_algos.register_adv_est(name)(stub)  # verl rejects a different function under the same name
    for name, cls in TRAINERS.items():
        verl_cls = get_trainer_cls(cls.verl_mode)
        if not issubclass(cls, verl_cls):  # verl renamed or re-registered a mode: copc would run the wrong one
            raise ValueError(f"verl's trainer mode {cls.verl_mode!r} is {verl_cls.__name__}, not a base of {cls.__name__}")
        register_trainer(name)(cls)
    # Hydra's structured:// source is on every search path, so verl's main_ppo finds it by name.
    ConfigStore.instance().store(name=CONFIG_NAME, node=hydra_config_node())


try:
    _register()
except Exception:
    _fail_loud("register with verl")
    raise
