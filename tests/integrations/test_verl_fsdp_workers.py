"""verl's own FSDP2 actor and critic workers on CPU, updated with copc's loss and copc's returns.

Real verl code (run by ``verl_fsdp_cpu.py`` in a fresh process, about 25 s): verl's composed
``copc_ppo_trainer`` Hydra config; ``ActorRolloutRefWorker(role="actor").init_model()`` building verl's
``TrainingWorker`` with the ``FSDPEngine`` (``strategy=fsdp2``, its AdamW, grad clipping, micro-batching)
and ``ppo_loss`` bound to the actor config, which looks copc's loss up in verl's registry and hands it
``rollout_is_weights``; the critic ``TrainingWorker`` with verl's ``value_loss``, built as verl's v1 trainer
builds it; ``compute_log_prob``, ``infer_batch``, ``update_actor``, ``train_mini_batch``; the trainer's
padded <-> no-padding conversions. copc's: the plugin's ``copc_advantage_step`` (advantages, critic
targets, omega) and ``copc_policy_loss`` as the reference.

Stand-ins, and why: verl 0.9.1 has no CPU platform, so ``verl_cpu`` registers one with verl's
``set_platform`` (device ``cpu``, backend ``gloo``), registers verl's FSDP engines for it, starts the
one-rank gloo group, and loads the critic with SDPA (verl's value-head loader asks for flash attention).
There is no CPU rollout engine in verl 0.9.1, so the rollout is random tokens and the sampler's
log-probs are verl's recomputed ones plus noise (the staleness COPC corrects). The model is copc's tiny
2-layer Qwen3 saved to a temporary directory (nothing downloaded).

Tolerance of the loss check: the trainer's forward at the step start and verl's first training forward
see the same parameters and the same micro-batches, so the ratio is 1 up to float32 rounding in the
summed loss: rtol 1e-5.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

verl = pytest.importorskip("verl", reason="verl is not installed (make test-verl builds .venv-verl)")
pytestmark = pytest.mark.verl

SCRIPT = Path(__file__).with_name("verl_fsdp_cpu.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("verl_fsdp") / "result.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True, timeout=400, check=False,
        env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **os.environ},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_actor_update_through_verls_fsdp2_worker_changes_every_parameter(run: dict[str, Any]) -> None:
    # weight decay is 0: only gradients move them
    assert run["actor_params"] > 0 and run["actor_unchanged"] == []
    assert run["actor_metrics"]["grad_norm"] > 0


def test_actor_loss_in_verls_worker_is_copcs_policy_loss(run: dict[str, Any]) -> None:
    metrics = run["actor_metrics"]
    assert metrics["actor/pg_loss"] == pytest.approx(run["expected_pg_loss"], rel=1e-5)
    assert 0.0 < run["expected_mask_frac"] < 1.0  # the band removes some tokens: omega is not all ones
    # copc's loss metrics arrive in verl's returned metrics (the trainer prefixes them with actor/)
    for name in ("mask_frac", "weight_mean", "clip_frac_low", "clip_frac_high", "dual_clip_frac",
                 "approx_kl"):
        assert f"copc/policy/{name}" in metrics
    assert 0.0 < metrics["copc/policy/mask_frac"] < 1.0
    assert metrics["copc/policy/approx_kl"] == pytest.approx(0.0, abs=1e-6)  # the first update starts at old


def test_r1_actor_in_verls_worker_is_copcs_own_r1_loss(run: dict[str, Any]) -> None:
    """R1 (``policy_loss.loss_mode=copc_behaviour``): verl's worker reads the band from the composed config
    and its loss, on the batch R1's trainer writes (old_log_probs = mu), is copc's own R1 actor loss."""
    assert run["r1_policy"] == ["bypass_ppo", 0.5, 2.0]
    assert run["r1_same_start"] and run["r1_actor_unchanged"] == []
    metrics = run["r1_actor_metrics"]
    assert 0.0 < run["r1_expected_mask_frac"] < 1.0  # the band binds at the step start (old/mu)
    assert metrics["actor/pg_loss"] == pytest.approx(run["r1_expected_pg_loss"], rel=1e-5)
    # verl's rejection metric is the share of tokens R1's band removes in the first micro-batches' mean
    assert metrics["rollout_corr/rollout_rs_token_k1_masked_fraction"] > 0.0


def test_critic_regresses_onto_copcs_returns(run: dict[str, Any]) -> None:
    assert run["critic_params"] > 0 and run["critic_unchanged"] == []
    assert {"critic/vf_loss", "critic/vf_clipfrac", "grad_norm"} <= set(run["critic_metric_keys"])
    losses = run["critic_losses"]
    assert losses[-1] < 0.6 * losses[0], losses  # verl's value loss against copc's returns falls
    assert run["mse_after"] < 0.5 * run["mse_before"]  # and the values themselves move onto the returns
    assert run["old_finite"]
