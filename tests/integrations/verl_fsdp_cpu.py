"""verl's own actor and critic workers (FSDP2 engine) on CPU with copc's loss and advantages; run as a script.

``python tests/integrations/verl_fsdp_cpu.py OUT.json`` (a fresh process: it sets verl's platform and
starts a one-rank gloo process group, which must not leak into pytest's process). It writes what
``test_verl_fsdp_workers.py`` asserts on. Real verl code: ``ActorRolloutRefWorker(role="actor")`` and its
``init_model`` (verl's ``TrainingWorker`` + ``FSDPEngine`` with ``strategy=fsdp2``, its optimizer and its
``ppo_loss`` bound to the actor config), the critic ``TrainingWorker`` built as verl's v1 trainer builds it
(``value_loss``), ``compute_log_prob`` / ``infer_batch`` / ``update_actor`` / ``train_mini_batch``, and the
trainer's padded -> no-padding conversions. A second actor worker runs R1
(``policy_loss.loss_mode=copc_behaviour`` with the band as ``policy_loss.rollout_correction``), on the batch
R1's trainer writes (``old_log_probs = mu``, no weight). copc's: the plugin's ``copc_advantage_step``.
Stand-ins (``verl_cpu``): the CPU platform and the SDPA value-head loader. The rollout is a stand-in too:
responses are random tokens, and the sampler's log-probs are verl's recomputed ones plus noise (the staleness
COPC corrects), because verl 0.9.1 has no CPU rollout engine.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from verl_cpu import install_cpu_platform, tiny_model_dir

install_cpu_platform()  # before any verl worker is built: it reads its device, engine and group from here

from functools import partial  # noqa: E402

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.workers.config import TrainingWorkerConfig  # noqa: E402
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker  # noqa: E402
from verl.workers.utils.losses import value_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

import copc.integrations.verl as plugin  # noqa: E402
from copc.ops import ClipSpec, CorrectedInputs, behaviour_ppo_loss, copc_policy_loss  # noqa: E402

B, P, T = 8, 6, 10  # sequences, prompt and response widths
CRITIC_UPDATES = 4


#: The R1 actor: verl's bypass-mode loss with R1's band [0.5, 2] on cur/mu (Hydra's ``+``: not in verl's
#: yaml).
R1 = [
    "actor_rollout_ref.actor.policy_loss.loss_mode=copc_behaviour",
    "+actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_rs=token_k1",
    "+actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_rs_threshold=0.5_2.0",
]


def verl_config(model_dir: Path, extra: tuple[str, ...] | list[str] = ()) -> DictConfig:
    """verl's composed ``copc_ppo_trainer`` config for one CPU rank and the tiny model (``extra`` last)."""
    import verl

    model = [
        f"model.path={model_dir}", "model.use_remove_padding=False",
        "model.override_config.attn_implementation=sdpa",
    ]
    overrides = [
        *(f"+actor_rollout_ref.{m}" if "override" in m else f"actor_rollout_ref.{m}" for m in model),
        *(f"+critic.{m}" if "override" in m else f"critic.{m}" for m in model),
        "trainer.device=cpu", "trainer.n_gpus_per_node=1",
        "algorithm.adv_estimator=copc_clipped_td", "trainer.v1.trainer_mode=copc",
        "actor_rollout_ref.rollout.calculate_log_probs=True", "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.policy_loss.loss_mode=copc",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={B}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.actor.clip_ratio_c=1e9",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "critic.enable=True", "critic.strategy=fsdp2", f"critic.ppo_mini_batch_size={B}",
        "critic.ppo_micro_batch_size_per_gpu=4", "critic.optim.lr=1e-3", "critic.optim.weight_decay=0.0",
        "critic.cliprange_value=0.5",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer/config"),
                               version_base=None):
        return compose(config_name=plugin.CONFIG_NAME, overrides=overrides)


def rollout_batch(seed: int) -> TensorDict:
    """Left-padded prompts, right-padded responses, as verl's agent loop hands them to the trainer."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(2, P + 1, (B,), generator=g)
    resp_len = torch.randint(3, T + 1, (B,), generator=g)
    resp_len[0] = T
    pos = torch.arange(P + T)
    prompt_att = (pos[None, :P] >= P - prompt_len[:, None]).long()
    resp_att = (pos[None, :T] < resp_len[:, None]).long()
    attention_mask = torch.cat([prompt_att, resp_att], dim=1)
    input_ids = torch.randint(4, 100, (B, P + T), generator=g) * attention_mask
    response_mask = resp_att.clone()
    response_mask[1, 3:5] = 0  # a tool-output span in a multi-turn row
    return TensorDict(
        {
            "prompts": input_ids[:, :P], "responses": input_ids[:, P:], "input_ids": input_ids,
            "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "response_mask": response_mask,
        },
        batch_size=B,
    )


def infer(worker_call: Any, batch: TensorDict, key: str, **meta: Any) -> torch.Tensor:
    """verl's trainer steps around a forward-only call: no-padding in, padded response tensor out."""
    td = left_right_2_no_padding(batch.clone())
    tu.assign_non_tensor(td, compute_loss=False, temperature=1.0, **meta)
    out = worker_call(td)
    return no_padding_2_padding(tu.get(out, key), td).float()


def train_td(batch: TensorDict, fields: dict[str, torch.Tensor], **meta: Any) -> TensorDict:
    td = batch.clone()
    for name, value in fields.items():
        td[name] = value
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, global_batch_size=B, mini_batch_size=B, epochs=1, seed=0,
                         dataloader_kwargs={"shuffle": False}, temperature=1.0, **meta)
    return td


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            local = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = local.detach().clone()
    return out


def build_workers(cfg: DictConfig) -> tuple[ActorRolloutRefWorker, TrainingWorker]:
    """verl's actor worker (``init_model``) and its critic ``TrainingWorker``, as verl's v1 trainer builds
    them."""
    actor = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    actor.init_model()
    critic_cfg = omega_conf_to_dataclass(cfg.critic)
    critic_cfg.engine.infer_max_token_len_per_gpu = critic_cfg.ppo_infer_max_token_len_per_gpu
    critic_cfg.engine.max_token_len_per_gpu = critic_cfg.ppo_infer_max_token_len_per_gpu
    critic = TrainingWorker(TrainingWorkerConfig(
        model_type="value_model", model_config=critic_cfg.model, engine_config=critic_cfg.engine,
        optimizer_config=critic_cfg.optim, checkpoint_config=critic_cfg.checkpoint,
    ))
    critic.reset()
    critic.set_loss_fn(partial(value_loss, config=critic_cfg))
    return actor, critic


def main(out_path: str) -> None:
    t0 = time.perf_counter()
    torch.manual_seed(0)  # the critic's new value head is initialised from torch's global generator
    tmp = Path(tempfile.mkdtemp(prefix="copc_verl_cpu_"))
    cfg = verl_config(tiny_model_dir(tmp / "tiny"))

    actor, critic = build_workers(cfg)
    t_init = time.perf_counter() - t0

    batch = rollout_batch(seed=0)
    mask = batch["response_mask"].bool()
    old = infer(actor.compute_log_prob, batch, "log_probs", calculate_entropy=True)
    values = infer(critic.infer_batch, batch, "values")
    g = torch.Generator().manual_seed(1)
    mu = torch.where(mask, old + 0.5 * torch.randn(old.shape, generator=g), torch.zeros(()))
    rewards = torch.zeros(B, T)
    last = batch["attention_mask"][:, P:].sum(-1) - 1
    rewards[torch.arange(B), last] = (torch.rand(B, generator=g) > 0.5).float()
    step = plugin.copc_advantage_step(
        plugin.check_verl_config(cfg), token_level_rewards=rewards, values=values,
        old_log_probs=old, rollout_log_probs=mu, response_mask=batch["response_mask"],
    )

    actor_module = actor.actor.engine.module
    before = snapshot(actor_module)
    actor_out = actor.update_actor(train_td(
        batch,
        {"old_log_probs": old, "advantages": step.advantages, "rollout_is_weights": step.rollout_is_weights},
        calculate_entropy=False, compute_loss=True,
    ))
    after = snapshot(actor_module)
    actor_metrics = tu.get(actor_out, "metrics")

    # R1: a fresh actor (the same weights), the batch as R1's trainer leaves it in TransferQueue.
    r1_cfg = verl_config(tmp / "tiny", R1)
    r1_channels = plugin.check_verl_config(r1_cfg)
    r1_step = plugin.copc_advantage_step(
        r1_channels, token_level_rewards=rewards, values=values,
        old_log_probs=old, rollout_log_probs=mu, response_mask=batch["response_mask"],
    )
    r1_actor = ActorRolloutRefWorker(config=r1_cfg.actor_rollout_ref, role="actor")
    r1_actor.init_model()
    r1_before = snapshot(r1_actor.actor.engine.module)
    r1_out = r1_actor.update_actor(train_td(
        batch, {"old_log_probs": r1_step.old_log_probs, "advantages": r1_step.advantages},
        calculate_entropy=False, compute_loss=True,
    ))
    r1_after = snapshot(r1_actor.actor.engine.module)
    r1_metrics = tu.get(r1_out, "metrics")

    critic_before = snapshot(critic.engine.module)
    critic_losses, critic_metrics = [], {}
    for _ in range(CRITIC_UPDATES):  # critic.ppo_epochs steps on the same targets, as verl's critic warm-up
        out = critic.train_mini_batch(train_td(batch, {"values": values, "returns": step.returns}))
        critic_metrics = tu.get(out, "metrics")
        critic_losses.append(float(sum(critic_metrics["loss"])))
    critic_after = snapshot(critic.engine.module)
    values_after = infer(critic.infer_batch, batch, "values")

    def mse(v: torch.Tensor) -> float:
        return float(((v - step.returns)[mask] ** 2).mean())

    def scalar(v: Any) -> float:
        v = v[0] if isinstance(v, list) else v
        return float(v.aggregate()) if hasattr(v, "aggregate") else float(v)

    # The first mini-batch starts at old's parameters (ratio 1): copc's own loss on the same tokens.
    expected = copc_policy_loss(
        CorrectedInputs(old, old, mu, step.advantages, mask), mask_low=0.5, mask_high=2.0,
        clip=ClipSpec(0.2, 0.28, 1e9)
    )
    # R1's first mini-batch also starts at old's parameters: copc's own R1 loss, band and clip on old/mu.
    expected_r1 = behaviour_ppo_loss(
        old, mu, r1_step.advantages, mask, mask_low=r1_channels.policy.mask_low,
        mask_high=r1_channels.policy.mask_high, clip=ClipSpec(0.2, 0.28, 1e9),
    )
    result = {
        "r1_policy": [r1_channels.policy.objective, r1_channels.policy.mask_low,
                      r1_channels.policy.mask_high],
        "r1_expected_pg_loss": float(expected_r1.loss),
        "r1_expected_mask_frac": float(expected_r1.stats["policy/mask_frac"]),
        "r1_actor_metrics": {k: scalar(v) for k, v in r1_metrics.items()},
        "r1_actor_unchanged": [n for n in r1_before if torch.equal(r1_before[n], r1_after[n])],
        "r1_same_start": all(torch.equal(before[n], r1_before[n]) for n in before),
        "expected_pg_loss": float(expected.loss),
        "expected_mask_frac": float(expected.stats["policy/mask_frac"]),
        "seconds": {"init": t_init, "total": time.perf_counter() - t0},
        "actor_unchanged": [n for n in before if torch.equal(before[n], after[n])],
        "actor_params": len(before),
        "critic_unchanged": [n for n in critic_before if torch.equal(critic_before[n], critic_after[n])],
        "critic_params": len(critic_before),
        "actor_metrics": {k: scalar(v) for k, v in actor_metrics.items()},
        "critic_metric_keys": sorted(critic_metrics),
        "critic_losses": critic_losses,
        "mse_before": mse(values),
        "mse_after": mse(values_after),
        "step_metrics": {k: float(v) for k, v in step.metrics.items()},
        "old_finite": bool(torch.isfinite(old[mask]).all()),
    }
    Path(out_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
