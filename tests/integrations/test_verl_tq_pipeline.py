"""verl's TransferQueue pipeline on CPU: verl's old-log-prob and value steps feeding copc's advantage step.

Real verl and TransferQueue code (run by ``verl_tq_cpu.py`` in a fresh process with a local Ray, about
40 s): ``tq.init`` with verl's ``transfer_queue`` config (controller and storage as Ray actors); rows put
into TransferQueue with the fields and keys verl's agent loop writes; the copc trainer's inherited
``_compute_old_log_prob`` and ``_compute_values`` (verl's methods, unchanged) calling verl's FSDP2 actor
and critic workers, whose ``tqbridge`` decorators read from and write to TransferQueue; copc's
``_compute_advantage`` reading the result back and writing advantages, returns and omega.

The reference is copc's own estimator (``copc.channels.compute_advantages`` with the same method,
``clipped_td`` from ``algorithm.adv_estimator=copc_clipped_td``) and copc's ``band_weight``, applied to
tensors that never went through TransferQueue: the same workers' forwards on the padded batch (verl's
``ray_trainer`` conversions) and the rollout's own mu and rewards.

Stand-ins, and why: the worker groups are the workers themselves, in this process (a Ray worker group
places its workers on GPUs); the critic's gets a two-line adapter for the ``futures`` the trainer waits
on. The CPU platform, the tiny model and the rollout are as in ``test_verl_fsdp_workers.py``.

Tolerance: 0 for the advantage step (the same float32 inputs reach the same copc code), and for the
log-probs and values (the same forward on the same tokens; TransferQueue only moves them). Where a
bf16 value round-trips, verl's critic already returns bf16 in both paths.
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
pytest.importorskip("ray", reason="verl's TransferQueue needs Ray")
pytestmark = pytest.mark.verl

SCRIPT = Path(__file__).with_name("verl_tq_cpu.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("verl_tq") / "result.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True, timeout=500, check=False,
        env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0", **os.environ},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_verls_steps_carry_the_trainers_log_probs_and_values_through_transfer_queue(
        run: dict[str, Any]) -> None:
    err = run["max_err"]
    assert err["old_log_probs_vs_padded_forward"] == 0.0
    assert err["values_vs_padded_forward"] == 0.0
    assert err["rollout_log_probs_roundtrip"] == 0.0
    assert run["values_abs_mean"] > 0.0 and run["drift_abs_mean"] > 0.1  # real values, stale sampler


def test_copcs_advantage_step_after_verls_steps_equals_copcs_own_estimator(run: dict[str, Any]) -> None:
    err = run["max_err"]
    assert err["advantages"] == 0.0 and err["returns"] == 0.0 and err["rollout_is_weights"] == 0.0
    assert run["advantage_std"] == pytest.approx(1.0, abs=1e-3)  # copc's clipped_td preset whitens
    assert 0.0 < run["masked_out"] < run["weights_below_one"] < 1.0  # the band and the weights both act
    assert {"copc/adv/raw_std", "copc/ratio/ess_tok", "copc/policy/mask_frac", "actor/entropy"} <= set(
        run["trainer_metrics"]
    )


def test_r1_step_overwrites_old_with_mu_in_transfer_queue_after_the_advantages_read_old(
        run: dict[str, Any]) -> None:
    """R1 (``policy_loss.loss_mode=copc_behaviour``): the advantages come from verl's recomputed old (the same
    as copc's own estimator on w = old/mu), then TransferQueue holds ``old_log_probs = mu`` for the actor, and
    no weight field is written."""
    r1 = run["r1"]
    assert r1["advantages_vs_own"] == 0.0 and r1["returns_vs_own"] == 0.0
    assert r1["old_is_mu"] == 0.0
    assert "rollout_is_weights" not in r1["fields"] and {"advantages", "returns",
                                                         "old_log_probs"} <= set(r1["fields"])
    assert ("copc/policy/mask_frac_step_start" in r1["metrics"]
            and "copc/policy/weight_mean" not in r1["metrics"])
