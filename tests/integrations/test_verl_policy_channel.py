"""The COPC policy channel alone in verl (``copc.channels=policy``): verl's GRPO advantages, copc's omega.

This is not COPC (no advantage channel, no critic): verl's own advantage step runs unchanged and the copc
trainer adds ``rollout_is_weights = omega = M * w``, ``w = exp(old - mu)``, ``M = 1[0.5 <= w <= 2]``.
Trainers are built with verl's real constructor from verl's composed Hydra config; TransferQueue (a
service verl's TaskRunner starts) is an in-memory fake that serves one batch and records what is
written back. Tolerances: the same float32 formula, so exact or 1e-6.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is not installed (make test-verl builds .venv-verl)")
pytestmark = pytest.mark.verl

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from tensordict import NonTensorData, NonTensorStack, TensorDict  # noqa: E402
from transfer_queue import KVBatchMeta  # noqa: E402
from verl.trainer.ppo.v1 import get_trainer_cls  # noqa: E402
from verl.trainer.ppo.v1 import trainer_base as verl_trainer_base  # noqa: E402

import copc.integrations.verl as plugin  # noqa: E402
import copc.integrations.verl_trainers as verl_trainers  # noqa: E402
from copc.channels.methods import get_method  # noqa: E402

CONFIG_DIR = str(Path(verl.__file__).parent / "trainer/config")
GRPO = [
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=3",
    "actor_rollout_ref.rollout.calculate_log_probs=True",
    "actor_rollout_ref.actor.policy_loss.loss_mode=copc",
]


def verl_cfg(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


def one_line_error(overrides: list[str]) -> str:
    with pytest.raises(ValueError) as err:
        plugin.check_verl_config(verl_cfg(*overrides))
    assert "\n" not in str(err.value)
    return str(err.value)


def test_policy_channel_alone_needs_no_critic_and_keeps_verls_estimator() -> None:
    cfg = verl_cfg(*GRPO, "+copc.channels=policy", "+copc.policy.mask_high=3.0")
    channels = plugin.check_verl_config(cfg)
    assert channels.advantage is None
    assert channels.policy.mask_high == 3.0 and channels.policy.objective == get_method(
        "copc").policy.objective


def test_copcs_advantage_channel_without_a_critic_fails_and_says_it_needs_one() -> None:
    message = one_line_error(["algorithm.adv_estimator=copc_clipped_td", "critic.enable=False", *GRPO[1:]])
    assert "needs a critic: set critic.enable=True" in message and "copc.channels=policy" in message


def test_grpo_under_copcs_trainer_without_copc_channels_policy_says_how_to_get_the_policy_channel() -> None:
    message = one_line_error(GRPO)
    assert "set algorithm.adv_estimator to one of copc_clipped_td" in message
    assert "copc.channels=policy for the COPC policy channel alone on grpo's advantages" in message


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["algorithm.adv_estimator=copc_vtrace", "+copc.channels=policy"],
         "set algorithm.adv_estimator to a verl estimator such as grpo"),
        (["+copc.channels=policy", "+copc.advantage.ratio_low=0.9"],
         "copc.advantage.ratio_low is unused with copc.channels=policy"),
        (["+copc.channels=critic"], "copc.channels='critic': valid are both, policy"),
    ],
)
def test_bad_policy_channel_configs_fail_with_one_line(overrides: list[str], says: str) -> None:
    assert says in one_line_error([*GRPO, *overrides])


# --- the trainer's step: verl's GRPO, then copc's omega ------------------------------------------------


class FakeTQ:
    """One batch of jagged fields; kv_batch_get serves the fields asked for, kv_batch_put records."""

    def __init__(self, fields: dict[str, Any], n: int) -> None:
        self.fields, self.n = fields, n
        self.puts: list[dict[str, torch.Tensor]] = []

    def kv_batch_get(self, keys: list[str], partition_id: str, select_fields: list[str]) -> TensorDict:
        assert len(keys) == self.n
        return TensorDict({k: self.fields[k] for k in select_fields if k in self.fields}, batch_size=self.n)

    def kv_batch_put(self, keys: list[str], partition_id: str, fields: TensorDict) -> KVBatchMeta:
        self.puts.append(dict(fields.to_padded_tensor().items()))
        return KVBatchMeta(partition_id=partition_id, keys=keys, tags=[{}] * len(keys))


def grpo_batch(seed: int = 0, B: int = 6,
               T: int = 9) -> tuple[dict[str, Any], list[str], torch.Tensor, torch.Tensor]:
    """Two prompts x 3 samples, as verl's agent loop leaves them in TransferQueue before step 7."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = -2.0 * torch.rand(B, T, generator=g)
    mu = old + 0.7 * torch.randn(B, T, generator=g)
    scores = torch.zeros(B, T)
    scores[torch.arange(B), lengths - 1] = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    uids = ["p0"] * 3 + ["p1"] * 3

    def nested(x: torch.Tensor) -> torch.Tensor:
        return torch.nested.as_nested_tensor([x[i, : int(n)] for i, n in enumerate(lengths)],
                                             layout=torch.jagged)

    fields: dict[str, Any] = {
        "response_mask": nested(mask.float()),
        "rm_scores": nested(scores),
        "old_log_probs": nested(old),
        "rollout_log_probs": nested(mu),
        "uid": NonTensorStack(*[NonTensorData(u) for u in uids]),
    }
    keys = [f"{u}_{i}_0" for i, u in enumerate(uids)]  # verl's {uid}_{session}_{index}
    return fields, keys, mask, torch.where(mask, old - mu, torch.zeros(()))


def run_step(mode: str, cfg: DictConfig,
             monkeypatch: pytest.MonkeyPatch) -> tuple[FakeTQ, dict[str, float], torch.Tensor, torch.Tensor]:
    fields, keys, mask, log_w = grpo_batch()
    fake = FakeTQ(fields, len(keys))
    monkeypatch.setattr(verl_trainer_base, "tq", fake)
    monkeypatch.setattr(verl_trainers, "tq", fake)
    trainer: Any = get_trainer_cls(mode)(cfg)
    metrics: dict[str, float] = {}
    trainer._compute_advantage(KVBatchMeta(partition_id="train", keys=keys, tags=[{}] * len(keys)),
                               metrics=metrics)
    return fake, metrics, mask, log_w


def test_trainer_writes_verls_grpo_advantages_and_copcs_policy_weight(
        monkeypatch: pytest.MonkeyPatch) -> None:
    verl_run, _, mask, log_w = run_step("sync", verl_cfg(*GRPO), monkeypatch)
    ours, metrics, _, _ = run_step("copc", verl_cfg(*GRPO, "+copc.channels=policy"), monkeypatch)
    (theirs,) = verl_run.puts
    first, second = ours.puts
    assert first.keys() == theirs.keys() and "advantages" in theirs
    for name, value in theirs.items():
        assert torch.equal(first[name], value), name  # verl's own step, unchanged
    assert float(theirs["advantages"].abs().max()) > 0  # GRPO gave non-trivial group advantages
    w = torch.exp(log_w)
    expected = torch.where(mask & (w >= 0.5) & (w <= 2.0), w, torch.zeros(()))
    # the band cuts some tokens, keeps others
    assert 0 < int((mask & (expected == 0)).sum()) < int(mask.sum())
    torch.testing.assert_close(second["rollout_is_weights"], expected, rtol=1e-6, atol=1e-6)
    assert set(second) == {"rollout_is_weights"}
    kept = (expected > 0).float()
    assert metrics["copc/policy/mask_frac"] == pytest.approx(1 - float(kept[mask].mean()), abs=1e-6)
    assert not any(name.startswith("copc/adv/") for name in metrics)  # no advantage channel ran


def policy_channel_command() -> list[str]:
    """docs/verl.md's command for the policy channel alone, as argv words ('...' stands for model and
    data)."""
    import shlex

    text = (Path(__file__).resolve().parents[2] / "docs/verl.md").read_text()
    section = text.split("## The COPC policy channel alone", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [w for w in shlex.split(block.replace("\\\n", " "), comments=True) if w != "..."]


def test_docs_policy_channel_command_composes_to_the_policy_channel_alone() -> None:
    """The documented command composes with verl's Hydra config to the policy channel alone, run by copc's
    trainer."""
    words = policy_channel_command()
    assert words[:5] == ["python3", "-m", "verl.trainer.main_ppo", "--config-name", plugin.CONFIG_NAME]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name=words[4], overrides=words[5:])
    channels = plugin.check_verl_config(cfg)
    assert channels.advantage is None and channels.policy == get_method("copc").policy
    assert get_trainer_cls(cfg.trainer.v1.trainer_mode) is plugin.CopcTrainerColocateAsync


def test_docs_policy_channel_command_through_verls_own_cli() -> None:
    """verl's ``main_ppo`` (its Hydra app, copc loaded by ``import verl``) takes the documented command as
    typed; ``--cfg job`` prints the composed config and stops before Ray or any model starts."""
    import os
    import subprocess
    import sys

    import yaml
    from omegaconf import OmegaConf

    words = policy_channel_command()
    out = subprocess.run([sys.executable, *words[1:], "--cfg", "job"], capture_output=True, text=True,
                         timeout=300,
                         check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = OmegaConf.create(yaml.safe_load(out.stdout))
    channels = plugin.check_verl_config(cfg)
    assert channels.advantage is None and channels.policy == get_method("copc").policy
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.copc.channels == "policy"
