"""The run config of ``copc train``: one frozen dataclass per section, the embedded default, loading a
YAML file with ``key.sub=value`` overrides, and checking the names it holds (task, method preset).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from copc.channels.methods import MethodConfig, get_method
from copc.config import ConfigError, apply_overrides, load_yaml
from copc.eval.evaluate import EvalConfig
from copc.rollout.generator import RolloutConfig
from copc.runtime.staleness import StalenessConfig
from copc.trainer.trainer import TrainerConfig

__all__ = [
    "DriverConfig",
    "EvalConfig",
    "ModelConfig",
    "RunConfig",
    "default_config",
    "load_run_config",
    "resolve_method",
    "resolve_rollout",
    "validate_names",
]


@dataclass(frozen=True)
class ModelConfig:
    """Where the policy and the critic come from."""

    policy: str = "warmstart"
    """'warmstart' (the task's cached warm-started tiny policy), 'tiny' (random tiny model), or an HF folder."""
    tiny_seed: int = 0
    """Initialisation seed when policy = 'tiny'."""
    warmstart_seed: int = 0
    """Seed of the warm start when policy = 'warmstart' (built once, then cached)."""
    warmstart_sft: dict[str, int | float] = field(default_factory=lambda: {"batch_size": 16, "steps": 3000})
    """Overrides of the task's default warm-start SFT settings (copc.run.warmstart.SFTConfig), e.g. {steps: 3000}."""


@dataclass(frozen=True)
class DriverConfig:
    """Which driver runs the loop."""

    kind: Literal["sync", "async"] = "async"
    """sync: generate then train; async: rollout worker processes generate while the trainer trains."""
    num_workers: int = 1
    """Rollout worker processes (async driver)."""
    trainer_threads: int = 1
    """torch threads of the trainer process (each worker uses one)."""
    max_worker_restarts: int = 3
    """Rollout worker failures survived (restart, batch requested again); one more ends the run."""
    batch_timeout_s: float = 3600.0
    """A worker holding one batch longer than this is restarted (counts as a failure); 0 = no limit."""

    def __post_init__(self) -> None:
        if self.kind not in ("sync", "async"):
            raise ValueError(f"driver.kind must be one of sync, async; got {self.kind!r}")
        if self.num_workers < 1 or self.trainer_threads < 1:
            raise ValueError("driver.num_workers and driver.trainer_threads must be >= 1")
        if self.max_worker_restarts < 0 or not 0 <= self.batch_timeout_s < float("inf"):
            raise ValueError("driver.max_worker_restarts must be >= 0 and driver.batch_timeout_s finite and >= 0")


@dataclass(frozen=True)
class RunConfig:
    """Everything ``copc train`` builds (one section per component)."""

    task: str = "arith_tool"
    """Task name (copc.tasks registry)."""
    task_options: dict[str, str | int | float | bool | None] = field(
        default_factory=lambda: {"difficulty": 1, "train_size": 5000}
    )
    """Task config values (e.g. {hard: true}); default: arith_tool level 1 (2x2-digit products)."""
    method: str = "copc"
    """Method preset (copc.channels.methods registry)."""
    steps: int = 60
    """Training steps."""
    seed: int = 0
    """Run seed: prompts and sampling seeds of every batch, minibatch shuffles, initialisation."""
    run_dir: str = ""
    """Run directory ('' = runs/<time>-<method>-<task>)."""
    resume: bool = False
    """Continue from the latest checkpoint in run_dir (needs run_dir; no checkpoint yet: start at step 0)."""
    overwrite: bool = False
    """Replace a run already in run_dir (without it, an existing run there is an error)."""
    checkpoint_every: int = 20
    """Checkpoint every this many steps (and at the end); 0 = only at the end."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk."""
    plots: bool = True
    """Draw the PNG plots into run_dir/plots at the end."""
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(actor_lr=1e-4, critic_lr=1e-3))
    staleness: StalenessConfig = field(default_factory=lambda: StalenessConfig(mode="bounded", staleness=8))
    driver: DriverConfig = field(default_factory=DriverConfig)
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(every=20))

    def __post_init__(self) -> None:
        if self.steps < 0 or self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise ValueError("steps and checkpoint_every must be >= 0, keep_checkpoints >= 1")


def default_config() -> RunConfig:
    """The embedded default of ``copc train`` (the field defaults of :class:`RunConfig`).

    Measured (2-vCPU machine, warm start cached): eval avg@1 0.34 -> 0.895 (greedy 0.415 -> 1.00, tool
    use 0.49 -> 0.98) in 60 steps, 143 s; seed 1: 0.27 -> 0.92. Building the warm start adds ~210 s.

    How the defaults were chosen (the learning-rate measurements): docs/reproduce.md, "Tuning history".
    """
    return RunConfig()


def resolve_method(cfg: RunConfig) -> MethodConfig:
    """The method preset named by ``cfg.method`` (``get_method`` fails with the valid names)."""
    return get_method(cfg.method)


def resolve_rollout(cfg: RunConfig) -> RolloutConfig:
    """``cfg.rollout`` with the method preset's rollout-side choices (dynamic sampling, overlong shaping)
    filled in where the rollout config leaves them ``None``: what every driver's generator samples with."""
    method = resolve_method(cfg)
    return cfg.rollout.with_method_defaults(
        dynamic_sampling=method.dynamic_sampling, overlong_shaping=method.overlong_shaping
    )


def load_run_config(config_path: str | None, overrides: Sequence[str]) -> RunConfig:
    """The default config, or ``config_path`` (YAML), with ``key.sub=value`` overrides applied."""
    cfg = load_yaml(RunConfig, config_path) if config_path else default_config()
    cfg = apply_overrides(cfg, list(overrides))
    validate_names(cfg)
    return cfg


def validate_names(cfg: RunConfig) -> None:
    """Fail with a :class:`ConfigError` naming the valid choices if the task or method is unknown."""
    from copc.tasks import task_names

    if cfg.task not in task_names():
        raise ConfigError(f"task: unknown task {cfg.task!r}; valid tasks: {', '.join(task_names())}")
    try:
        resolve_method(cfg)
    except (KeyError, ValueError) as err:
        raise ConfigError(f"method: {' '.join(str(err).split())}") from None
    try:
        resolve_rollout(cfg)
    except ValueError as err:
        raise ConfigError(f"rollout (with method {cfg.method!r}): {' '.join(str(err).split())}") from None

