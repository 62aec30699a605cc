"""Phase peaks of the training process (copc.trainer.memory): an allocation is charged to the phase it
happens in, what happens between phases to ``other``, and a real run logs every phase of its steps."""

from __future__ import annotations

import numpy as np
import pytest

from copc import tracking as m
from copc.trainer import memory
from copc.trainer.memory import PhasePeaks

pytestmark = pytest.mark.skipif(not PhasePeaks()._start(), reason="needs /proc/self/clear_refs (Linux)")

MIB_300 = 300 * 2**20


def touch(nbytes: int) -> np.ndarray:
    block = np.ones(nbytes // 8)  # written, so resident
    return block


def test_an_allocation_is_charged_to_its_phase_and_between_phases_to_other():
    peaks = PhasePeaks()
    with peaks.phase("warm"):
        pass
    base = peaks.take()[f"{m.MEMORY_PEAK}_warm"]
    with peaks.phase("big"):
        block = touch(MIB_300)
        del block
    with peaks.phase("small"):
        pass
    between = touch(MIB_300)  # neither phase: start-up, evaluation, checkpoints are charged to `other`
    del between
    with peaks.phase("small"):
        pass
    out = peaks.take()
    assert out[f"{m.MEMORY_PEAK}_big"] >= base + 0.28
    assert out[f"{m.MEMORY_PEAK}_small"] < base + 0.1  # freed before the phase: not charged to it
    assert out[f"{m.MEMORY_PEAK}_other"] >= base + 0.28
    assert out[m.MEMORY_PEAK] == max(v for k, v in out.items() if k != m.MEMORY_PEAK)
    assert peaks.take() == {}  # cleared


def test_nested_phases_charge_the_outer_one():
    peaks = PhasePeaks()
    with peaks.phase("outer"), peaks.phase("inner"):
        block = touch(MIB_300)
        del block
    out = peaks.take()
    assert f"{m.MEMORY_PEAK}_inner" not in out and f"{m.MEMORY_PEAK}_outer" in out


def test_no_metric_where_the_mark_cannot_be_reset(monkeypatch):
    monkeypatch.setattr(memory, "_reset_hwm", lambda: False)
    peaks = PhasePeaks()
    with peaks.phase("actor"):
        pass
    assert peaks.take() == {} and peaks.enabled is False


def test_a_run_logs_the_peak_of_every_phase_of_its_steps(tmp_path):
    from copc.run.train import train_cli
    from copc.tracking import is_known, read_metrics

    run = tmp_path / "run"
    assert train_cli(["--no-progress", "model.policy=tiny", "driver.kind=sync", "steps=2", "eval.prompts=2",
                      "plots=false", "trainer.critic_warmup_steps=0", f"run_dir={run}"]) == 0
    steps = [r for r in read_metrics(run) if m.TIME_STEP in r]
    assert len(steps) == 2
    for record in steps:
        phases = {k for k in record if k.startswith(m.MEMORY_PEAK)}
        assert {f"{m.MEMORY_PEAK}_{p}" for p in ("batch", "prepare", "critic", "actor", "publish",
                                                 "other")} <= phases
        assert all(is_known(k) for k in phases)
        assert record[m.MEMORY_PEAK] == max(record[k] for k in phases if k != m.MEMORY_PEAK) > 0.1


# ------------------------------------------------------------------------------ gradient checkpointing
@pytest.mark.parametrize("method", ["copc", "copc_behaviour", "ppo"])
def test_gradient_checkpointing_trains_bit_for_bit_like_keeping_the_activations(method):
    """Recomputing each layer's activations in the backward pass gives the same update, parameter for
    parameter and metric for metric, over two steps (policy and critic both recomputed)."""
    import torch
    from tests.trainer.test_trainer import TOKENIZER, make_trainer, synthetic_trajectories

    from copc.trainer.batching import collate

    runs = []
    for setting in ("never", "always"):
        trainer = make_trainer(method, gradient_checkpointing=setting)
        assert trainer.checkpointing == ((True, trainer.critic is not None) if setting == "always" else (
            False, False))
        metrics = []
        for step in range(2):
            batch = collate(synthetic_trajectories(trainer.policy, seed=step), pad_id=TOKENIZER.pad_token_id)
            metrics.append({k: v for k, v in trainer.step(batch).items() if not k.startswith((
                "time/", "perf/", "memory/"))})
        models = [trainer.policy, *([trainer.critic] if trainer.critic is not None else [])]
        runs.append((metrics, [{k: v.detach().clone() for k, v in mod.named_parameters()} for mod in models]))
    (metrics_off, weights_off), (metrics_on, weights_on) = runs
    assert saved_bytes("always") < 0.6 * saved_bytes("never")  # it is really on: far fewer activations kept
    assert metrics_on == metrics_off
    for off, on in zip(weights_off, weights_on, strict=True):
        for name in off:
            assert torch.equal(off[name], on[name]), name


def test_auto_turns_checkpointing_on_for_models_of_50m_parameters_and_more(monkeypatch):
    from copc.models import build_tiny_model, build_tiny_tokenizer
    from copc.models.hf import ValueModel

    model = build_tiny_model(build_tiny_tokenizer())
    critic = ValueModel.from_policy(model)
    assert not memory.use_gradient_checkpointing(model, "auto") and not is_checkpointing(model)
    assert not memory.use_gradient_checkpointing(model, "never") and not is_checkpointing(model)
    monkeypatch.setattr(memory, "CHECKPOINTING_MIN_PARAMS", 1)  # the tiny model counts as large
    assert memory.use_gradient_checkpointing(model, "auto") and is_checkpointing(model)
    assert memory.use_gradient_checkpointing(critic, "auto") and is_checkpointing(critic)
    assert not memory.use_gradient_checkpointing(torch_linear(), "always")  # no HF switch: left alone
    assert not memory.use_gradient_checkpointing(None, "always")


def torch_linear():
    import torch

    return torch.nn.Linear(2, 2)


def saved_bytes(setting: str) -> int:
    """Bytes of the tensors autograd keeps for the backward of one training forward of the tiny policy."""
    import torch
    from tests.trainer.test_trainer import make_trainer

    from copc.models.hf import token_logprobs

    trainer = make_trainer("ppo", gradient_checkpointing=setting)
    trainer.policy.train()
    total = 0

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    ids = torch.randint(4, 100, (4, 64))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        token_logprobs(trainer.policy, ids, torch.ones_like(ids, dtype=torch.bool)).logp.sum().backward()
    return total


def test_checkpointing_may_change_on_resume_and_a_run_from_before_it_existed_resumes(tmp_path):
    from copc.config import ConfigError, to_dict
    from copc.run.config import load_run_config
    from copc.run.resume import check_resume_config

    saved = to_dict(load_run_config(None, ["method=copc"]))
    del saved["trainer"]["gradient_checkpointing"]  # a checkpoint written before the field existed
    check_resume_config(load_run_config(None, ["method=copc", "trainer.gradient_checkpointing=always"]),
                        saved, tmp_path, tmp_path)
    # a setting that changes the run still may not
    with pytest.raises(ConfigError, match=r"trainer\.actor_lr"):
        check_resume_config(load_run_config(None, ["method=copc", "trainer.actor_lr=3e-4"]), saved, tmp_path,
                            tmp_path)


def is_checkpointing(model) -> bool:
    """Whether ``model`` (or copc's critic's backbone) recomputes its activations in training (the flag's
    name changed in transformers 5.x)."""
    target = getattr(model, "backbone", model)
    return bool(getattr(target, "is_activation_checkpointing",
                        None) or getattr(target, "is_gradient_checkpointing", False))
