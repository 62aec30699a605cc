"""Each copc trainer behaves as the verl trainer it extends, through verl's real constructor.

verl chooses its trainer's behaviour from the string ``trainer.v1.trainer_mode`` (replay buffer,
``gen_batch_size``, TransferQueue checkpoints, ``parameter_sync_step``, ``trainer.v1.<mode>.*``). These
tests compose verl's real Hydra config, build ``copc`` / ``copc_colocate_async`` / ``copc_separate_async``
and verl's ``sync`` / ``colocate_async`` / ``separate_async`` with verl's real ``__init__`` (which
starts neither Ray nor workers), run the mode-dependent methods verl's ``init``/``fit`` call, and
compare what they set and do field by field.

Fakes, only for what cannot run here: TransferQueue (a service started by verl's TaskRunner) is a
recorder of the calls made to it; the actor and critic worker groups (Ray actors on GPUs) record
``save_checkpoint``; verl's dataset (which needs the model's tokenizer from the hub) is a list of
prompts, so verl's own ``_init_dataloader`` runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

verl = pytest.importorskip("verl", reason="verl is not installed (make test-verl builds .venv-verl)")
pytestmark = pytest.mark.verl

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from verl.trainer.ppo.v1 import PPOTrainer, get_trainer_cls  # noqa: E402
from verl.trainer.ppo.v1 import trainer_base as verl_trainer_base  # noqa: E402

import copc.integrations.verl as plugin  # noqa: E402
import copc.integrations.verl_trainers as verl_trainers  # noqa: E402

PAIRS = [("copc", "sync"), ("copc_colocate_async", "colocate_async"), ("copc_separate_async",
                                                                       "separate_async")]
CONFIG_DIR = str(Path(verl.__file__).parent / "trainer/config")
# A user's settings, each one read by verl under a mode-dependent key or branch (none of them verl's default).
USER = [
    "algorithm.adv_estimator=copc_clipped_td",
    "critic.enable=True",
    "actor_rollout_ref.rollout.calculate_log_probs=True",
    "data.train_batch_size=8",
    "data.gen_batch_size=4",  # kept by verl's sync trainer, forced to 1 by its async ones
    "data.shuffle=False",
    "data.dataloader_num_workers=0",  # no worker processes for a list of 16 prompts
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "trainer.v1.colocate_async.num_warmup_batches=3",
    "trainer.v1.separate_async.num_warmup_batches=2",
    "trainer.v1.separate_async.parameter_sync_step=2",  # verl's default is 4; copc's old code read 1
    # separate_async's own start-up asserts: a rollout pool and a non-naive weight-sync backend
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
]


def verl_cfg(mode: str, tmp_path: Path, *extra: str) -> DictConfig:
    overrides = [*USER, f"trainer.v1.trainer_mode={mode}", f"trainer.default_local_dir={tmp_path / mode}",
                 *extra]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


class RecordingTQ:
    """TransferQueue's module API as verl's trainer calls it, recording each call (name, what it saved)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def save_checkpoint(self, path: str, metadata: dict[str, Any]) -> None:
        self.calls.append(("save_checkpoint", (Path(path).name, metadata)))

    def load_checkpoint(self, path: str) -> None:
        self.calls.append(("load_checkpoint", Path(path).name))

    def kv_list(self, partition_id: str) -> dict[str, Any]:
        self.calls.append(("kv_list", partition_id))
        return {}


class RecordingWorkerGroup:
    def __init__(self) -> None:
        self.saved: list[tuple[str, int]] = []

    def save_checkpoint(self, local_path: str, remote_path: str | None, global_step: int, **kw: Any) -> None:
        self.saved.append((Path(local_path).name, global_step))


def fake_dataset(*args: Any, **kwargs: Any) -> list[dict[str, int]]:
    return [{"index": i} for i in range(16)]


def observe(trainer: PPOTrainer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """Everything verl sets or does by mode: constructor fields, dataloader, checkpoint save and resume."""
    tq = RecordingTQ()
    monkeypatch.setattr(verl_trainer_base, "tq", tq)
    monkeypatch.setattr(verl_trainer_base, "create_rl_dataset", fake_dataset)
    t: Any = trainer
    # a bound method of each trainer
    buffer = {k: v for k, v in vars(t.replay_buffer).items() if k != "refill_fn"}
    section = buffer["trainer_config"]  # trainer.v1.<mode>, or {} where verl found no such section
    buffer["trainer_config"] = OmegaConf.to_container(section) if isinstance(section,
                                                                             DictConfig) else dict(section)
    scalars = {
        k: v for k,
        v in vars(t).items() if isinstance(v, bool | int | float | str | type(None)) and k != "copc_mode"
    }
    t.tokenizer = t.processor = None
    t._init_dataloader()  # verl's own: forces gen_batch_size to 1 outside its sync trainer
    t.global_steps = 3
    t.actor_rollout_wg, t.critic_wg = RecordingWorkerGroup(), RecordingWorkerGroup()
    t._save_checkpoint()  # TransferQueue state saved in async modes only
    step_dir = Path(t.config.trainer.default_local_dir) / "global_step_3"
    (step_dir / "transfer_queue").mkdir(exist_ok=True)
    reissued = t._reissue_inflight_prompts()  # in-flight prompts resumed in async modes only
    hybrid = getattr(t, "hybrid_rollout_config", None)
    return {
        "replay buffer type": type(t.replay_buffer),
        "replay buffer fields": buffer,
        "trainer scalar fields": scalars,
        "gen_batch_size": t.config.data.gen_batch_size,
        "dataloader batch size": t.train_dataloader.batch_size,
        "TransferQueue calls": tq.calls,
        "reissued": reissued,
        "actor checkpoints": t.actor_rollout_wg.saved,
        "critic checkpoints": t.critic_wg.saved,
        "checkpoint files": sorted(p.name for p in step_dir.iterdir()),
        "hybrid rollout config": hybrid,
    }


@pytest.mark.parametrize(("copc_mode", "verl_mode"), PAIRS)
def test_copc_trainer_behaves_as_the_verl_trainer_it_extends(
    copc_mode: str, verl_mode: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    theirs = observe(get_trainer_cls(verl_mode)(verl_cfg(verl_mode, tmp_path)), monkeypatch, tmp_path)
    ours_trainer = get_trainer_cls(copc_mode)(verl_cfg(copc_mode, tmp_path))
    ours = observe(ours_trainer, monkeypatch, tmp_path)
    for field, value in theirs.items():
        assert ours[field] == value, f"{copc_mode} differs from verl's {verl_mode} in {field}"
    assert isinstance(ours_trainer, get_trainer_cls(verl_mode))
    assert ours_trainer.copc_mode == copc_mode  # type: ignore[attr-defined]


def test_the_comparison_sees_each_mode_dependent_setting(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    """The user's settings above do differ by verl mode, so the comparison could fail."""
    seen = {mode: observe(get_trainer_cls(mode)(verl_cfg(mode, tmp_path)), monkeypatch, tmp_path) for _,
            mode in PAIRS}
    sync, colocate, separate = seen["sync"], seen["colocate_async"], seen["separate_async"]
    assert sync["replay buffer type"].__name__ == "ReplayBuffer"
    assert colocate["replay buffer type"].__name__ == "ReplayBufferAsync"
    assert (sync["gen_batch_size"], colocate["gen_batch_size"]) == (4, 1)
    assert sync["TransferQueue calls"] == [] and sync["reissued"] == 0
    assert [name for name, _ in colocate["TransferQueue calls"]] == ["save_checkpoint", "kv_list"]
    assert (colocate["trainer scalar fields"]["parameter_sync_step"],
            separate["trainer scalar fields"]["parameter_sync_step"]) == (1, 2)
    assert colocate["replay buffer fields"]["trainer_config"] == {"num_warmup_batches": 3}
    assert separate["replay buffer fields"]["trainer_config"]["num_warmup_batches"] == 2
    assert separate["hybrid rollout config"] is not None


def test_settings_under_the_copc_name_fail_and_say_where_they_go(tmp_path: Path) -> None:
    cfg = verl_cfg("copc_separate_async", tmp_path, "+trainer.v1.copc_separate_async.parameter_sync_step=2")
    with pytest.raises(ValueError) as err:
        get_trainer_cls("copc_separate_async")(cfg)
    message = str(err.value)
    assert "set those options under trainer.v1.separate_async" in message and "\n" not in message


# --- the private verl method copc overrides ----------------------------------------------------------


def test_changed_advantage_hook_fails_with_one_line_naming_verls_version(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def moved(self: PPOTrainer, batch: Any, metrics: dict[str, Any], *, step: int) -> Any:
        raise AssertionError("never called")

    monkeypatch.setattr(PPOTrainer, "_compute_advantage", moved)
    with pytest.raises(RuntimeError) as err:
        get_trainer_cls("copc")(verl_cfg("copc", tmp_path))
    message = str(err.value)
    version = verl.__version__ if hasattr(verl, "__version__") else ""
    assert f"installed verl {version}" in message and "copc supports verl>=0.9.1,<0.10" in message
    assert "('self', 'batch', 'metrics', 'step')" in message and "\n" not in message


def test_missing_advantage_hook_fails_with_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delattr(PPOTrainer, "_compute_advantage")
    with pytest.raises(RuntimeError,
                       match=r"installed verl \S+ has no _compute_advantage; copc supports verl"):
        get_trainer_cls("copc_separate_async")(verl_cfg("copc_separate_async", tmp_path))


def test_the_installed_verl_passes_the_hook_check() -> None:
    for name in plugin.TRAINERS:
        plugin.check_verl_hook(get_trainer_cls(get_trainer_cls(name).verl_mode))  # type: ignore[attr-defined]


@pytest.mark.parametrize("version", ["0.10.0", "0.9.0", "1.2", "not-a-version"])
def test_a_verl_outside_the_supported_range_fails_with_one_line(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path,
                                                               version: str) -> None:
    """The version check comes first, before the hook check and before any worker starts."""
    monkeypatch.setattr(verl_trainers, "_verl_version", lambda: version)
    with pytest.raises(RuntimeError) as err:
        get_trainer_cls("copc")(verl_cfg("copc", tmp_path))
    assert str(err.value) == (
        f"copc's verl trainers support verl>=0.9.1,<0.10, but verl {version} is installed: "
                              "pip install 'verl>=0.9.1,<0.10' (or copc[verl])")


def test_the_installed_verl_is_in_the_supported_range() -> None:
    plugin.check_verl_version()
    plugin.check_verl_version("0.9.1")
    plugin.check_verl_version("0.9.7.post1")
