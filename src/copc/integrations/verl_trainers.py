"""copc's verl trainers: verl's v1 trainers (sync, colocated async, separate-pool async) whose advantage
step is copc's, and the checks that the installed verl still has the hook they override (docs/verl.md,
"What the plugin registers").
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
from typing import Any, ClassVar

import transfer_queue as tq
from tensordict import TensorDict
from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import apply_kl_penalty
from verl.trainer.ppo.v1 import (
    PPOTrainerColocateAsync,
    PPOTrainerSeparateAsync,
    PPOTrainerSync,
    get_trainer_cls,
)
from verl.workers.utils.padding import response_to_nested

from copc.integrations.verl_config import MISSING_OLD, MISSING_ROLLOUT, CopcChannels, check_verl_config
from copc.integrations.verl_losses import copc_advantage_step, copc_policy_weight

__all__ = [
    "SUPPORTED_VERL",
    "TRAINERS",
    "CopcAdvantageMixin",
    "CopcTrainerColocateAsync",
    "CopcTrainerSeparateAsync",
    "CopcTrainerSync",
    "check_verl_hook",
    "check_verl_version",
]

_log = logging.getLogger("copc.integrations.verl")  # the plugin's one logger (its level is set there)


#: The verl releases whose private advantage hook copc's trainers override (pyproject's ``verl`` extra).
SUPPORTED_VERL = ">=0.9.1,<0.10"
#: ``PPOTrainer._compute_advantage``'s parameters in those releases (verl calls it as ``(batch,
#: metrics=...)``).
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
        raise RuntimeError(f"copc's verl trainers support verl{SUPPORTED_VERL}, but verl {found} is "
                           f"installed: pip install 'verl{SUPPORTED_VERL}' (or copc[verl])")


def check_verl_hook(verl_trainer: type) -> None:
    """Fail with one line if verl's ``_compute_advantage`` (the private method copc overrides) moved or
    changed."""
    hook = getattr(verl_trainer, "_compute_advantage", None)
    params = tuple(inspect.signature(hook).parameters) if callable(hook) else None
    if params != _HOOK_PARAMS:
        found = "has no _compute_advantage" if params is None else f"defines _compute_advantage{params}"
        raise RuntimeError(
            f"copc's verl trainers override {verl_trainer.__name__}._compute_advantage{_HOOK_PARAMS}, but "
            f"the installed verl {_verl_version()} {found}; copc supports verl{SUPPORTED_VERL}: "
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
            computed = super()._compute_advantage(batch, metrics)  # type: ignore[misc]
            return self._put_policy_weight(computed, metrics)
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
                proto, kl_ctrl=self.kl_ctrl_in_reward,  # type: ignore[attr-defined]
                kl_penalty=self.config.algorithm.kl_penalty,
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
        """The COPC policy channel alone: omega from the batch's old and rollout log-probs, into
        TransferQueue."""
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
