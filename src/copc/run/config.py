"""The run config of ``copc train``: one frozen dataclass per section, the embedded default, loading a
YAML file with ``key.sub=value`` overrides, and checking what it names (task and its options, the paths
the task reads, method preset) before anything is built.

``task_options`` belong to ``task``: an override ``task=X`` that changes the task resets them to X's
run defaults (:func:`task_defaults`) before later overrides apply, and a YAML file that names a task but
no ``task_options`` gets that task's defaults, so ``copc train task=math_tool task_options.data=x.jsonl``
means what it says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from copc.channels.methods import MethodConfig, get_method
from copc.config import (
    ConfigError,
    ConfigValue,
    apply_overrides,
    check_at_least,
    check_one_of,
    from_dict,
    load_yaml,
    parse_override,
    to_dict,
)
from copc.eval.evaluate import EvalConfig
from copc.rollout.generator import RolloutConfig
from copc.run.oracle import OracleConfig
from copc.runtime.staleness import StalenessConfig
from copc.tasks.kv_chain import ROLLOUT_DEFAULTS as KV_CHAIN_ROLLOUT
from copc.trainer.config import TrainerConfig
from copc.trainer.old_sources import check_proximal_source

__all__ = [
    "DriverConfig",
    "EvalConfig",
    "ModelConfig",
    "RunConfig",
    "apply_run_overrides",
    "default_config",
    "load_run_config",
    "resolve_method",
    "resolve_rollout",
    "task_defaults",
    "validate_names",
]

#: ``task_options`` a run starts from when it names the task without options (other tasks: their config
#: class's own defaults). arith_tool's are the embedded default's level-1 problems.
TASK_RUN_DEFAULTS: dict[str, dict[str, ConfigValue]] = {"arith_tool": {"difficulty": 1, "train_size": 5000}}


#: ``rollout`` budgets a task needs beyond the defaults (its episodes are longer): set when a run names
#: the task (``task=X`` or a YAML file's ``task``); a later override or the file's own ``rollout`` wins.
TASK_RUN_ROLLOUT: dict[str, dict[str, int]] = {"kv_chain": KV_CHAIN_ROLLOUT}


def task_defaults(task: str) -> dict[str, str | int | float | bool | None]:
    """The ``task_options`` of a run of ``task`` that sets none (a fresh copy)."""
    return dict(TASK_RUN_DEFAULTS.get(task, {}))  # type: ignore[arg-type]


def _with_task_rollout(cfg: RunConfig, keep: Sequence[str] = ()) -> RunConfig:
    """``cfg`` with its task's :data:`TASK_RUN_ROLLOUT` budgets, except the ``keep`` keys set elsewhere."""
    budgets: dict[str, Any] = {k: v for k, v in TASK_RUN_ROLLOUT.get(cfg.task, {}).items() if k not in keep}
    return replace(cfg, rollout=replace(cfg.rollout, **budgets)) if budgets else cfg


@dataclass(frozen=True)
class ModelConfig:
    """Where the policy and the critic come from."""

    policy: str = "warmstart"
    """'warmstart' (the task's cached warm-started tiny policy), 'tiny' (random tiny model), or an HF
    folder."""
    tiny_seed: int = 0
    """Initialisation seed when policy = 'tiny'."""
    warmstart_seed: int = 0
    """Seed of the warm start when policy = 'warmstart' (built once, then cached)."""
    warmstart_sft: dict[str, int | float] = field(default_factory=lambda: {"batch_size": 16, "steps": 3000})
    """Overrides of the task's default warm-start SFT settings (copc.run.warmstart.SFTConfig), e.g. {steps:
    3000}."""
    critic: str = "policy"
    """'policy' (the critic's backbone is a copy of the policy's) or an HF folder of a causal LM sharing the
    policy's tokenizer (e.g. a smaller model of the same family: less memory and a cheaper critic step)."""


@dataclass(frozen=True)
class DriverConfig:
    """Which driver runs the loop."""

    kind: Literal["sync", "async", "ray"] = "async"
    """sync: generate then train; async: rollout worker processes generate while the trainer trains;
    ray: the async driver with Ray actors as rollout workers (docs/scaling.md; needs copc[ray])."""
    num_workers: int = 1
    """Rollout worker processes (async driver) or actors (ray driver)."""
    trainer_threads: int = 1
    """torch threads of the trainer process (each worker uses one)."""
    worker_nice: int = 5
    """Niceness of the rollout worker processes (async driver; 0-19): when trainer and workers want the
    same cores the trainer, the step's critical path, gets them first; a worker ahead of the trainer
    only fills what the trainer leaves (nothing changes in what is computed)."""
    max_worker_restarts: int = 3
    """Rollout worker failures survived (restart, batch requested again); one more ends the run."""
    batch_timeout_s: float = 3600.0
    """A worker holding one batch longer than this is restarted (counts as a failure); 0 = no limit."""
    silent_worker_warn_s: float = 30.0
    """async driver: warn (once, naming it) when a worker holding a batch has used no CPU this long; 0 =
    never."""
    silent_worker_restart_s: float = 120.0
    """async driver: restart such a silent worker after this long (a failure, like a death); 0 = never."""
    address: str | None = None
    """ray driver: None = start a local Ray with this machine's CPUs; 'auto' or 'host:port' = join that
    cluster."""
    ray_cpus_per_worker: float = 1.0
    """ray driver: CPUs each rollout actor reserves."""
    ray_gpus_per_worker: float = 0.0
    """ray driver: GPUs each rollout actor reserves (> 0: it generates on cuda)."""
    partial_rollouts: bool = False
    """Interruptible rollouts (async, staleness.mode=bounded): workers pick up newer weights inside running
    episodes, every token stamped with the version that sampled it."""
    partial_chunk_tokens: int = 8
    """Partial rollouts: decode steps between weight pick-ups inside a turn (0 = turn boundaries only)."""

    def __post_init__(self) -> None:
        check_one_of("driver.kind", self.kind, ("sync", "async", "ray"))
        check_at_least("driver", 1, num_workers=self.num_workers, trainer_threads=self.trainer_threads)
        if not 0 <= self.worker_nice <= 19:
            raise ValueError(f"driver.worker_nice must be in [0, 19] (0 = the trainer's priority), got "
                             f"{self.worker_nice}")
        check_at_least("driver", 0, max_worker_restarts=self.max_worker_restarts)
        if not 0 <= self.batch_timeout_s < float("inf"):
            raise ValueError(f"driver.batch_timeout_s must be >= 0 and finite, got {self.batch_timeout_s!r}")
        for key, value in (("silent_worker_warn_s", self.silent_worker_warn_s),
                           ("silent_worker_restart_s", self.silent_worker_restart_s)):
            if not 0 <= value < float("inf"):
                raise ValueError(f"driver.{key} must be finite and >= 0 seconds (0 = off), got {value!r}")
        if 0 < self.silent_worker_restart_s <= self.silent_worker_warn_s:
            raise ValueError(
                f"driver.silent_worker_restart_s={self.silent_worker_restart_s:g} must be above "
                f"driver.silent_worker_warn_s={self.silent_worker_warn_s:g} "
                "(the warning comes first), or 0 (never restart)"
            )
        for key, value in (("ray_cpus_per_worker", self.ray_cpus_per_worker),
                           ("ray_gpus_per_worker", self.ray_gpus_per_worker)):
            if not 0 <= value < float("inf"):
                raise ValueError(f"driver.{key} must be >= 0 and finite, got {value!r}")
        if self.address is not None and not self.address.strip():
            raise ValueError("driver.address must be 'auto', 'host:port' or null (start a local Ray), got ''")
        if self.address is not None and self.kind != "ray":
            raise ValueError(f"driver.address={self.address!r} is for driver.kind=ray (got "
                             f"driver.kind={self.kind})")
        if self.partial_chunk_tokens < 0:
            raise ValueError(f"driver.partial_chunk_tokens must be >= 0 (0 = turn boundaries only), "
                             f"got {self.partial_chunk_tokens}")
        if self.partial_rollouts and self.kind != "async":
            raise ValueError("driver.partial_rollouts=true needs driver.kind=async (the sync driver never "
                             "swaps weights inside a batch)")


@dataclass(frozen=True)
class SamplesConfig:
    """Rendered episodes kept in the run directory (``samples.jsonl`` and TensorBoard's text tab)."""

    per_log: int = 4
    """Episodes written each time (the first ones of the batch or of the sampled evaluation); 0 = none."""
    every: int = 25
    """Write training episodes every this many steps (0 = only evaluation episodes); every evaluation writes
    too."""

    def __post_init__(self) -> None:
        check_at_least("samples", 0, per_log=self.per_log, every=self.every)


@dataclass(frozen=True)
class RunConfig:
    """Everything ``copc train`` builds (one section per component)."""

    task: str = "arith_tool"
    """Task name (copc.tasks registry)."""
    task_options: dict[str, str | int | float | bool | None] = field(
        default_factory=lambda: task_defaults("arith_tool"))
    """Task config values (e.g. task_options.data=rows.jsonl); task=X resets them to X's defaults."""
    method: str = "copc"
    """Method preset (copc.channels.methods registry)."""
    method_overrides: dict[str, dict[str, str | int | float | bool | None]] = field(default_factory=dict)
    """Changes to the preset's sections, e.g. method_overrides.policy.mask_high=1.5 (sections: policy,
    advantage, critic)."""
    steps: int = 60
    """Training steps."""
    seed: int = 0
    """Run seed: prompts and sampling seeds of every batch, minibatch shuffles, initialisation."""
    run_dir: str = ""
    """Run directory ('' = runs/<time>-<method>-<task>)."""
    resume: bool = False
    """Continue the run in run_dir from its latest checkpoint, configured as run_dir/config.yaml says
    (command-line overrides on top; one that would change what the run computes is refused); no checkpoint
    yet: step 0."""
    overwrite: bool = False
    """Replace a run already in run_dir (without it, an existing run there is an error)."""
    checkpoint_every: int = 20
    """Checkpoint every this many steps (and at the end); 0 = only at the end."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk."""
    checkpoint_optimizer: bool = True
    """Keep the optimizers' state (AdamW moments, 2x the weights) in checkpoints; false: weights only, and a
    resume restarts the moments from zero (said on stderr; not bit-identical to an uninterrupted run)."""
    plots: bool = True
    """Draw the PNG plots into run_dir/plots at the end."""
    stall_timeout_s: float = 3600.0
    """A training step or an evaluation that lasts longer than this ends the process (exit 124, every thread's
    stack on stderr; checkpoints kept, continue with resume=true): a grader or env step that hangs cannot hold
    the run for ever. The async driver's wait for a batch has its own limit (driver.batch_timeout_s; when that
    is 0 this one bounds the wait). 0 = no limit."""
    no_signal_steps: int = 20
    """Say once on stderr when every train reward has been 0 for this many consecutive steps (no learning
    signal: the advantages are all 0); 0 = never. Changes nothing the run computes."""
    wandb: bool = False
    """Mirror the metrics to Weights & Biases too (pip install 'copc[wandb]'; WANDB_MODE=offline works without
    a network); metrics.jsonl and TensorBoard are written either way. Changes nothing the run computes."""
    wandb_project: str = "copc"
    """W&B project of the mirrored run (its name is the run directory's)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(actor_lr=1e-4, critic_lr=1e-3))
    staleness: StalenessConfig = field(default_factory=lambda: StalenessConfig(mode="bounded", staleness=8))
    driver: DriverConfig = field(default_factory=DriverConfig)
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(every=20))
    samples: SamplesConfig = field(default_factory=SamplesConfig)
    oracle: OracleConfig = field(default_factory=OracleConfig)

    def __post_init__(self) -> None:
        check_at_least("", 0, steps=self.steps, checkpoint_every=self.checkpoint_every)
        check_at_least("", 1, keep_checkpoints=self.keep_checkpoints)
        if self.no_signal_steps < 0:
            raise ValueError(f"no_signal_steps must be >= 0 (0 = never warn), got {self.no_signal_steps}")
        if not 0 <= self.stall_timeout_s < float("inf"):
            raise ValueError(f"stall_timeout_s must be finite and >= 0 (0 = no limit), got "
                             f"{self.stall_timeout_s!r}")
        if self.driver.partial_rollouts and self.staleness.fixed_lag:
            raise ValueError("driver.partial_rollouts=true needs staleness.mode=bounded (fixed_lag "
                             "prescribes one version per batch); set staleness.mode=bounded or "
                             "driver.partial_rollouts=false")
        if self.staleness.filter == "pace" and self.driver.kind != "async":
            raise ValueError("staleness.filter=pace filters the async driver's buffer; the sync driver has "
                             "none: set driver.kind=async or staleness.filter=none")


def default_config() -> RunConfig:
    """The embedded default of ``copc train`` (the field defaults of :class:`RunConfig`).

    Measured (2-vCPU machine, warm start cached): eval avg@1 0.34 -> 0.895 (greedy 0.415 -> 1.00, tool
    use 0.49 -> 0.98) in 60 steps, 143 s; seed 1: 0.27 -> 0.92. Building the warm start adds ~210 s.

    How the defaults were chosen (the learning-rate measurements): docs/reproduce.md, "Tuning history".
    """
    return RunConfig()


#: The sections of a method preset that ``method_overrides`` may change.
METHOD_SECTIONS = ("policy", "advantage", "critic")


def resolve_method(cfg: RunConfig) -> MethodConfig:
    """The method preset named by ``cfg.method`` with ``cfg.method_overrides`` applied (checked by each
    section's own config; ``get_method`` fails with the valid names)."""
    method = get_method(cfg.method)
    changes: dict[str, Any] = {}  # section name -> its changed config
    for section, values in cfg.method_overrides.items():
        if section not in METHOD_SECTIONS:
            raise ConfigError(
                f"method_overrides.{section}: unknown section; valid: {', '.join(METHOD_SECTIONS)}"
            )
        current = getattr(method, section)
        if current is None:
            raise ConfigError(f"method_overrides.{section}: method {cfg.method!r} has no {section} to change")
        try:
            changes[section] = from_dict(type(current), {**to_dict(current), **values},
                                         section=f"method_overrides.{section}")
        except ConfigError as err:
            raise ConfigError(f"method {cfg.method!r}: {err}") from None
    return replace(method, **changes) if changes else method


def resolve_rollout(cfg: RunConfig) -> RolloutConfig:
    """``cfg.rollout`` with the method preset's rollout-side choices (dynamic sampling, overlong shaping)
    filled in where the rollout config leaves them ``None``: what every driver's generator samples with."""
    method = resolve_method(cfg)
    return cfg.rollout.with_method_defaults(
        dynamic_sampling=method.dynamic_sampling, overlong_shaping=method.overlong_shaping
    )


def load_run_config(config_path: str | None, overrides: Sequence[str], *, strict: bool = True) -> RunConfig:
    """The default config, or ``config_path`` (YAML), with ``key.sub=value`` overrides applied and checked:
    with ``strict`` by :func:`validate_names` (task options and every path the task reads included),
    else only the task and method names (to print a config that is not complete yet)."""
    cfg = _load_yaml_run_config(config_path) if config_path else default_config()
    cfg = absolute_paths(sampling_from_rollout(apply_run_overrides(cfg, overrides)))
    validate_names(cfg, check_options=strict, check_paths=strict)
    return cfg


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().absolute())


def absolute_paths(cfg: RunConfig) -> RunConfig:
    """``cfg`` with every local path absolute (relative ones are taken from the working directory now), so
    the saved config.yaml works from any directory (``copc eval --checkpoint``, ``resume=true``): the task's
    ``PATH_OPTIONS`` (not ``hf:`` sources), model folders, a chat template file and the run directory."""
    from copc.tasks import task_names

    options = dict(cfg.task_options)
    if cfg.task in task_names():  # an unknown task fails in validate_names with the valid names
        from copc.tasks import task_config_class

        for key in getattr(task_config_class(cfg.task), "PATH_OPTIONS", ()):
            value = options.get(key)
            if isinstance(value, str) and value and not value.startswith("hf:"):
                options[key] = _absolute(value)
    model = cfg.model
    if model.policy not in ("warmstart", "tiny"):
        model = replace(model, policy=_absolute(model.policy))
    if model.critic != "policy":
        model = replace(model, critic=_absolute(model.critic))
    rollout = cfg.rollout
    if rollout.chat_template not in ("auto", "none"):
        rollout = replace(rollout, chat_template=_absolute(rollout.chat_template))
    run_dir = _absolute(cfg.run_dir) if cfg.run_dir else ""
    return replace(cfg, task_options=options, model=model, rollout=rollout, run_dir=run_dir)


#: The sampler's transform: set under ``rollout.``; ``trainer.`` mirrors it (the trainer's log-probs must
#: come from the distribution the tokens were drawn from, docs/formulas.md#pitfalls).
SAMPLING_KEYS = ("temperature", "top_p", "top_k")


def sampling_from_rollout(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``trainer.temperature/top_p/top_k`` equal to the rollout's: one setting, shown where it is
    used. A trainer value set apart from the rollout's is refused in one line (it would be ignored)."""
    default = TrainerConfig()
    changes = {}
    for key in SAMPLING_KEYS:
        used, given = getattr(cfg.rollout, key), getattr(cfg.trainer, key)
        if given != used and given != getattr(default, key):
            raise ConfigError(
                f"trainer.{key}={given} but rollout.{key}={used}: the trainer scores tokens under the "
                f"sampler's transform, so the setting is rollout.{key} "
                f"(trainer.{key} follows it); set rollout.{key}={given}"
            )
        changes[key] = used
    return replace(cfg, trainer=replace(cfg.trainer, **changes))


def _load_yaml_run_config(path: str) -> RunConfig:
    cfg = load_yaml(RunConfig, path)
    data = yaml.safe_load(Path(path).read_text())  # load_yaml read it without error already
    if isinstance(data, dict) and "task" in data and "task_options" not in data:
        cfg = replace(cfg, task_options=task_defaults(cfg.task))
    if isinstance(data, dict) and "task" in data:
        rollout = data.get("rollout")
        cfg = _with_task_rollout(cfg, keep=tuple(rollout) if isinstance(rollout, dict) else ())
    return cfg


def apply_run_overrides(cfg: RunConfig, overrides: Sequence[str]) -> RunConfig:
    """``apply_overrides`` one at a time; one that changes ``task`` resets ``task_options`` to its
    defaults."""
    for text in overrides:
        before = cfg.task
        cfg = apply_overrides(cfg, [text])
        if parse_override(text)[0] == ["task"] and cfg.task != before:
            cfg = _with_task_rollout(replace(cfg, task_options=task_defaults(cfg.task)))
    return cfg


def validate_names(cfg: RunConfig, *, check_options: bool = True, check_paths: bool = False) -> None:
    """Fail with a one-line :class:`ConfigError` if the task or method is unknown (naming the valid
    choices); with ``check_options`` if a task option is unknown or bad; with ``check_paths`` if a
    file the task will read is missing (``check_paths()`` of the task's config, where it has one) or
    ``rollout.chat_template`` names a missing file."""
    from copc.rollout.chat import check_chat_template_setting
    from copc.tasks import task_config_class, task_names

    if cfg.task not in task_names():
        raise ConfigError(f"task: unknown task {cfg.task!r}; valid tasks: {', '.join(task_names())}")
    if cfg.wandb:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("wandb=true needs the wandb package: pip install 'copc[wandb]' "
                              "(WANDB_MODE=offline logs without a network), or drop wandb=true")
    try:
        method = resolve_method(cfg)
    except ConfigError:
        raise  # one line already, naming the method and the section
    except (KeyError, ValueError) as err:
        raise ConfigError(f"method: {' '.join(str(err).split())}") from None
    try:
        check_proximal_source(method, cfg.trainer.proximal)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    try:
        resolve_rollout(cfg)
    except ValueError as err:
        raise ConfigError(f"rollout (with method {cfg.method!r}): {' '.join(str(err).split())}") from None
    if not (check_options or check_paths):
        return
    try:
        task_cfg: object = from_dict(task_config_class(cfg.task), dict(cfg.task_options),
                                     section="task_options")
    except ConfigError as err:
        raise ConfigError(f"task {cfg.task!r}: {err}") from None
    if not check_paths:
        return
    check = getattr(task_cfg, "check_paths", None)
    try:
        if check is not None:
            check()
    except (OSError, ValueError) as err:
        raise ConfigError(f"task_options ({cfg.task}): {' '.join(str(err).split())}") from None
    _check_rows(cfg)
    try:
        check_chat_template_setting(cfg.rollout.chat_template)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _check_policy(cfg)


def _check_rows(cfg: RunConfig) -> None:
    """Every data row of a dataset task reads (columns present, text where text is due) before anything heavy
    starts (sandbox, model, run directory): a one-line error naming the file, the line and the option."""
    from copc.tasks import get_task

    check = getattr(get_task(cfg.task, **cfg.task_options), "check_rows", None)
    if check is None:
        return
    try:
        check()
    except (OSError, ValueError) as err:
        raise ConfigError(f"task_options ({cfg.task}): {' '.join(str(err).split())}") from None


def _check_policy(cfg: RunConfig) -> None:
    """``model.policy`` names an HF folder that exists, or a warm start the task can build."""
    from copc.tasks import SupportsSFT, get_task

    policy = cfg.model.policy
    if policy == "warmstart":
        if not isinstance(get_task(cfg.task, **cfg.task_options), SupportsSFT):
            raise ConfigError(
                f"model.policy=warmstart: task {cfg.task} has no warm-start demonstrations; "
                "set model.policy to an HF model folder (or tiny)"
            )
    elif policy != "tiny" and not (Path(policy).expanduser() / "config.json").is_file():
        raise ConfigError(
            f"model.policy={policy}: not 'warmstart', 'tiny' or an HF model folder (no config.json there); "
            "give a folder written by save_pretrained"
        )

