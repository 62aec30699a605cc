"""copc's verl plugin: ``import verl`` imports this module in every process (the ``verl.plugins`` entry
point of ``pip install copc[verl]``), and importing it registers copc's policy losses (``copc``,
``copc_behaviour``), its trainers (``trainer.v1.trainer_mode=copc``, ``copc_colocate_async``,
``copc_separate_async``), stubs for its advantage estimators and its Hydra config (``copc_ppo_trainer``)
in verl's own registries. What each does, how R0 and R1 map onto verl and a full command: docs/verl.md.

The pieces live by job: verl_losses.py (the advantage step and the losses, functions of tensors),
verl_trainers.py (the trainers), verl_config.py (copc's config section). verl logs a plugin that fails
to import only at debug level, so this module logs every failure at ERROR (with the traceback) before
re-raising.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

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
    from hydra.core.config_store import ConfigStore
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.v1 import get_trainer_cls, register_trainer

    from copc.integrations.verl_config import (
        BEHAVIOUR_LOSS,
        CONFIG_NAME,
        ESTIMATORS,
        CopcChannels,
        channels_from_verl_config,
        check_verl_config,
        hydra_config_node,
    )
    from copc.integrations.verl_losses import (
        LOSS_NAME,
        TRAINER_HINT,
        CopcPolicyWeight,
        CopcStep,
        copc_advantage_step,
        copc_behaviour_loss,
        copc_policy_loss,
        copc_policy_weight,
    )
    from copc.integrations.verl_trainers import (
        SUPPORTED_VERL,
        TRAINERS,
        CopcAdvantageMixin,
        CopcTrainerColocateAsync,
        CopcTrainerSeparateAsync,
        CopcTrainerSync,
        check_verl_hook,
        check_verl_version,
    )
except Exception:
    _fail_loud("import verl's v1 trainer")
    raise

#: The plugin's surface (what verl and a user of the plugin reach through this module).
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
    "CopcTrainerColocateAsync",
    "CopcTrainerSeparateAsync",
    "CopcTrainerSync",
    "channels_from_verl_config",
    "check_verl_config",
    "check_verl_hook",
    "check_verl_version",
    "copc_advantage_step",
    "copc_behaviour_loss",
    "copc_policy_loss",
    "copc_policy_weight",
]


def _estimator_stub(name: str) -> Any:
    def estimator(**_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise ValueError(f"algorithm.adv_estimator={name} needs critic values and log-probs: {TRAINER_HINT}")

    estimator.__name__ = f"{name}_needs_copc_trainer"
    return estimator


_STUBS = {name: _estimator_stub(name) for name in ESTIMATORS}


def _register() -> None:
    """Register the loss, the estimators' stubs and the trainers in verl's registries (idempotent)."""
    for name, loss in ((LOSS_NAME, copc_policy_loss), (BEHAVIOUR_LOSS, copc_behaviour_loss)):
        existing = core_algos.POLICY_LOSS_REGISTRY.get(name)
        if existing is not None and existing is not loss:
            # verl's register_policy_loss overwrites silently; never replace someone else's loss.
            raise ValueError(f"verl already has a policy loss named {name!r} ({existing!r}); copc will not "
                             f"overwrite it")
        core_algos.register_policy_loss(name)(loss)
    for name, stub in _STUBS.items():
        core_algos.register_adv_est(name)(stub)  # verl rejects a different function under the same name
    for name, cls in TRAINERS.items():
        verl_cls = get_trainer_cls(cls.verl_mode)
        # verl renamed or re-registered a mode: copc would run the wrong one
        if not issubclass(cls, verl_cls):
            raise ValueError(f"verl's trainer mode {cls.verl_mode!r} is {verl_cls.__name__}, not a base of "
                             f"{cls.__name__}")
        register_trainer(name)(cls)
    # Hydra's structured:// source is on every search path, so verl's main_ppo finds it by name.
    ConfigStore.instance().store(name=CONFIG_NAME, node=hydra_config_node())


try:
    _register()
except Exception:
    _fail_loud("register with verl")
    raise
