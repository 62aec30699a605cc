"""verl's TransferQueue pipeline on CPU: verl's old-log-prob and value steps, then copc's advantage step.

``python tests/integrations/verl_tq_cpu.py OUT.json`` (a fresh process: local Ray, verl's CPU platform
and a one-rank gloo group must not leak into pytest's). Real verl and TransferQueue code: a local Ray
with TransferQueue started by ``tq.init`` from verl's ``transfer_queue`` config section (its controller
and SimpleStorage unit are Ray actors); rows put into it as verl's agent loop puts them
(``_agent_loop_postprocess``: unpadded ``prompts``, ``responses``, ``input_ids``, ``position_ids``,
``response_mask``/``loss_mask``, ``rm_scores``, ``rollout_log_probs`` per key ``{uid}_{session}_{i}``);
the copc trainer's inherited ``_compute_old_log_prob`` and ``_compute_values`` (verl's own methods)
calling verl's actor and critic workers, whose ``tqbridge`` decorators read and write TransferQueue;
then copc's ``_compute_advantage`` reading the batch back. The same rows under fresh keys then go through
a copc trainer built from the R1 config, whose advantage step overwrites ``old_log_probs`` with ``mu`` in
TransferQueue. It writes what ``test_verl_tq_pipeline.py`` asserts on.

Stand-ins, and why: the workers are called in this process instead of through Ray worker groups (a Ray
worker group places them on GPUs); the critic's group is a two-line adapter giving ``infer_batch`` the
``futures`` attribute the trainer waits on. The CPU platform and the rollout are as in
``verl_fsdp_cpu.py``: random responses, sampler log-probs = verl's log-probs plus noise.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import ray
import torch
import transfer_queue as tq
from omegaconf import OmegaConf
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1 import get_trainer_cls
from verl.utils.tensordict_utils import list_of_dict_to_tensordict
from verl_cpu import tiny_model_dir
from verl_fsdp_cpu import R1, B, P, build_workers, infer, rollout_batch, verl_config

import copc.integrations.verl as plugin
from copc.channels import compute_advantages
from copc.ops import band_weight, log_ratio

PARTITION = "train"


class CriticGroup:
    """The critic ``RayWorkerGroup`` in one process: verl's trainer waits on ``infer_batch(...).futures``."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def infer_batch(self, batch: KVBatchMeta) -> Any:
        self.worker.infer_batch(batch)  # verl's tqbridge writes the values into TransferQueue
        return SimpleNamespace(futures=[])


def agent_loop_rows(batch: Any, mu: torch.Tensor, rewards: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """One dict per trajectory, the fields verl's ``AgentLoopWorkerTQ._agent_loop_postprocess`` stores."""
    rows = []
    for i in range(B):
        att = batch["attention_mask"][i]
        prompt = batch["prompts"][i][att[:P].bool()]
        n = int(att[P:].sum())
        response = batch["responses"][i, :n]
        input_ids = torch.cat([prompt, response])
        mask = batch["response_mask"][i, :n]
        rows.append({
            "prompts": prompt, "responses": response, "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids), "position_ids": torch.arange(len(input_ids)),
            "response_mask": mask, "loss_mask": mask,
            "rm_scores": rewards[i, :n], "rollout_log_probs": mu[i, :n],
        })
    return rows


def main(out_path: str) -> None:
    t0 = time.perf_counter()
    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp(prefix="copc_verl_tq_"))
    model_dir = tiny_model_dir(tmp / "tiny")
    cfg = verl_config(model_dir)
    cfg_r1 = verl_config(model_dir, R1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="copc_verl_tq")
    try:
        run(cfg, cfg_r1, out_path, t0)
    finally:
        ray.shutdown()  # the local Ray (and TransferQueue's actors) started above


def run(cfg: Any, cfg_r1: Any, out_path: str, t0: float) -> None:
    tq_conf = OmegaConf.to_container(cfg.transfer_queue, resolve=True)
    tq_conf["backend"]["SimpleStorage"]["num_data_storage_units"] = 1  # type: ignore[index]
    tq.init(OmegaConf.create(tq_conf))
    actor, critic = build_workers(cfg)

    # The rollout (stand-in): random responses; the sampler's log-probs drift from the trainer's.
    batch = rollout_batch(seed=0)
    mask = batch["response_mask"].bool()
    g = torch.Generator().manual_seed(1)
    logp = infer(actor.compute_log_prob, batch, "log_probs", calculate_entropy=True)
    mu = torch.where(mask, logp + 0.5 * torch.randn(logp.shape, generator=g), torch.zeros(()))
    rewards = torch.zeros_like(mu)
    last = batch["attention_mask"][:, P:].sum(-1) - 1
    rewards[torch.arange(B), last] = (torch.rand(B, generator=g) > 0.5).float()
    keys = [f"u{i}_0_0" for i in range(B)]
    tags = [{"status": "success", "global_steps": 0} for _ in keys]
    tq.kv_batch_put(keys=keys, partition_id=PARTITION,
                    fields=list_of_dict_to_tensordict(agent_loop_rows(batch, mu, rewards)), tags=tags)
    meta = KVBatchMeta(keys=keys, tags=tags, partition_id=PARTITION)
    t_setup = time.perf_counter() - t0

    # the driver-side object; its worker groups are in-process
    trainer = object.__new__(get_trainer_cls("copc"))
    trainer.config = cfg
    trainer._copc = plugin.check_verl_config(cfg)
    trainer.actor_rollout_wg = actor
    trainer.critic_wg = CriticGroup(critic)
    metrics: dict[str, Any] = {}
    meta = trainer._compute_old_log_prob(meta, metrics)  # verl's own step
    meta = trainer._compute_values(meta, metrics)  # verl's own step
    meta = trainer._compute_advantage(meta, metrics)  # copc's step
    fields = ["response_mask", "rm_scores", "rollout_log_probs", "old_log_probs", "values",
              "advantages", "returns", "rollout_is_weights"]
    got = tq.kv_batch_get(keys=keys, partition_id=PARTITION, select_fields=fields).to_padded_tensor()

    # R1: the same rows under fresh keys, a trainer built from the R1 config, the same verl steps.
    r1_keys = [f"r1_{k}" for k in keys]
    tq.kv_batch_put(keys=r1_keys, partition_id=PARTITION, tags=tags,
                    fields=list_of_dict_to_tensordict(agent_loop_rows(batch, mu, rewards)))
    r1_meta = KVBatchMeta(keys=r1_keys, tags=tags, partition_id=PARTITION)
    trainer_r1 = object.__new__(get_trainer_cls("copc"))
    trainer_r1.config = cfg_r1
    trainer_r1._copc = plugin.check_verl_config(cfg_r1)
    trainer_r1.actor_rollout_wg = actor
    trainer_r1.critic_wg = CriticGroup(critic)
    r1_metrics: dict[str, Any] = {}
    r1_meta = trainer_r1._compute_old_log_prob(r1_meta, r1_metrics)
    r1_meta = trainer_r1._compute_values(r1_meta, r1_metrics)
    r1_meta = trainer_r1._compute_advantage(r1_meta, r1_metrics)
    r1_stored = tq.kv_batch_get(keys=r1_keys[:1], partition_id=PARTITION, select_fields=None)
    got_r1 = tq.kv_batch_get(
        keys=r1_keys, partition_id=PARTITION, select_fields=["old_log_probs", "advantages", "returns"]
    ).to_padded_tensor()
    T = got["response_mask"].shape[1]

    # copc's own estimator on the same rows, from tensors that never went through TransferQueue: the
    # trainer's padded-path forwards (verl's ray_trainer conversions) and the rollout's mu and rewards.
    m = got["response_mask"].bool()
    assert torch.equal(m, mask[:, :T])
    channels = plugin.check_verl_config(cfg)
    values_direct = infer(critic.infer_batch, batch, "values")[:, :T]
    log_w = log_ratio(logp[:, :T], mu[:, :T], m)
    own = compute_advantages(
        channels.advantage, rewards=rewards[:, :T], values=values_direct, log_w=log_w, action_mask=m
    )
    weight, _ = band_weight(log_w, m, low=channels.policy.mask_low, high=channels.policy.mask_high,
                            mode=channels.policy.weight_mode)

    def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.where(m, (a - b).abs(), torch.zeros(())).max())

    result = {
        "seconds": {"setup": t_setup, "total": time.perf_counter() - t0},
        "max_err": {
            "advantages": max_err(got["advantages"], own.advantages),
            "returns": max_err(got["returns"], own.returns),
            "rollout_is_weights": max_err(got["rollout_is_weights"], weight),
            "old_log_probs_vs_padded_forward": max_err(got["old_log_probs"], logp[:, :T]),
            "values_vs_padded_forward": max_err(got["values"].float(), values_direct),
            "rollout_log_probs_roundtrip": max_err(got["rollout_log_probs"], mu[:, :T]),
        },
        "tokens": int(m.sum()),
        "values_abs_mean": float(got["values"].float()[m].abs().mean()),
        "drift_abs_mean": float((got["old_log_probs"] - got["rollout_log_probs"])[m].abs().mean()),
        "advantage_std": float(got["advantages"][m].std()),
        "weights_below_one": float((got["rollout_is_weights"][m] < 1).float().mean()),
        "masked_out": float((got["rollout_is_weights"][m] == 0).float().mean()),
        "trainer_metrics": sorted(metrics),
        "r1": {
            "old_is_mu": max_err(got_r1["old_log_probs"], mu[:, :T]),
            "advantages_vs_own": max_err(got_r1["advantages"], own.advantages),
            "returns_vs_own": max_err(got_r1["returns"], own.returns),
            "fields": sorted(r1_stored.keys()),
            "metrics": sorted(r1_metrics),
        },
    }
    Path(out_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
