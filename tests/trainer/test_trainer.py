"""Tests for copc.trainer.trainer: one actor-critic step on synthetic trajectories and the tiny model."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from copc.channels.methods import get_method
from copc.models import build_tiny_model, build_tiny_tokenizer
from copc.models.hf import ValueModel, token_logprobs
from copc.trainer.batching import collate
from copc.trainer.trainer import ActorCriticTrainer, TrainerConfig
from copc.types import StopReason, Trajectory

TOKENIZER = build_tiny_tokenizer()


def synthetic_trajectories(model: torch.nn.Module, *, n: int = 8, seed: int = 0, behaviour_noise: float = 0.3,
                           version: int = 0) -> list[Trajectory]:
    """Prompt, a sampled span, a tool-output span (not sampled), a second sampled span; terminal reward.

    Behaviour log-probs are the model's own teacher-forced log-probs plus Gaussian noise (a stale mu);
    ``behaviour_noise = 0`` makes mu exactly the current policy.
    """
    gen = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(n):
        lens = [int(torch.randint(3, 6, (1,), generator=gen)), int(torch.randint(2, 7, (1,), generator=gen)),
                int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))]
        ids = torch.randint(4, 100, (sum(lens),), generator=gen)
        ids[0] = TOKENIZER.bos_token_id
        mask = torch.zeros(sum(lens), dtype=torch.bool)
        mask[lens[0]: lens[0] + lens[1]] = True
        mask[lens[0] + lens[1] + lens[2]:] = True
        with torch.no_grad():
            logp = token_logprobs(model, ids[None], torch.ones(1, len(ids), dtype=torch.bool))[0]
        logp = logp + behaviour_noise * torch.randn(len(ids), generator=gen)
        reward = float(i % 3 == 0)
        rewards = torch.zeros(len(ids))
        rewards[-1] = reward
        trajs.append(Trajectory(
            prompt_id=f"p{i // 2}", token_ids=ids, prompt_len=lens[0], action_mask=mask,
            logp_behav=torch.where(mask, logp, 0.0), policy_version=torch.where(mask, version, -1),
            reward=reward, token_rewards=rewards,
            stop_reason=StopReason.ANSWER if i % 4 else StopReason.MAX_TOKENS, group=i // 2,
        ))
    return trajs


def make_trainer(method: str = "copc", *, seed: int = 0, **overrides: object) -> ActorCriticTrainer:
    policy = build_tiny_model(TOKENIZER, seed=seed)
    torch.manual_seed(seed)  # the value head is initialised from the global RNG
    critic = ValueModel.from_policy(policy)
    cfg = TrainerConfig(**{"actor_lr": 1e-3, "critic_lr": 1e-3, "micro_batch_size": 4, "critic_warmup_steps": 0,
                           **overrides})  # type: ignore[arg-type]
    return ActorCriticTrainer(policy, critic, get_method(method), cfg)


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def test_every_trainable_parameter_changes_and_version_advances() -> None:
    trainer = make_trainer()
    batch = collate(synthetic_trajectories(trainer.policy), pad_id=TOKENIZER.pad_token_id)
    before_pi, before_v = params(trainer.policy), params(trainer.critic)
    metrics = trainer.step(batch)
    assert trainer.version == 1
    for name, value in trainer.policy.named_parameters():
        assert not torch.equal(value, before_pi[name]), f"policy parameter {name} did not change"
    for name, value in trainer.critic.named_parameters():  # type: ignore[union-attr]
        assert not torch.equal(value, before_v[name]), f"critic parameter {name} did not change"
    for key in ("loss/policy", "loss/value", "grad/actor_norm", "grad/critic_norm", "critic/explained_var",
                "critic/value_bias_gap", "time/train"):
        assert key in metrics and metrics[key] == metrics[key], key  # present and not NaN


def test_critic_warmup_freezes_the_actor() -> None:
    trainer = make_trainer(critic_warmup_steps=1)
    batch = collate(synthetic_trajectories(trainer.policy), pad_id=TOKENIZER.pad_token_id)
    before_pi, before_v = params(trainer.policy), params(trainer.critic)
    trainer.step(batch)
    assert all(torch.equal(v, before_pi[k]) for k, v in trainer.policy.named_parameters())
    assert not all(torch.equal(v, before_v[k]) for k, v in trainer.critic.named_parameters())  # type: ignore[union-attr]
    assert trainer.version == 1
    trainer.step(batch)  # warm-up over: the actor moves
    assert not all(torch.equal(v, before_pi[k]) for k, v in trainer.policy.named_parameters())


@pytest.mark.parametrize("method", ["copc", "ppo"])
def test_micro_batch_accumulation_is_invariant(method: str) -> None:
    """One micro-batch of 8 rows and 8 micro-batches of 1 row give the same update (global token count).

    SGD (not Adam) so the update is linear in the gradient: Adam's first step is ~lr*sign(g), which turns
    float32 summation-order noise on near-zero gradients into full-size differences. Tolerance 1e-6:
    the two gradients differ only by float32 summation order (~1e-7 relative).
    """
    trajs = synthetic_trajectories(build_tiny_model(TOKENIZER, seed=0))
    batch = collate(trajs, pad_id=TOKENIZER.pad_token_id)
    results = []
    for micro in (8, 1):
        trainer = make_trainer(method, micro_batch_size=micro, optimizer="sgd", actor_lr=0.5, critic_lr=0.5,
                               max_grad_norm=0.0, critic_max_grad_norm=0.0, actor_minibatches=1,
                               entropy_coef=0.01)
        metrics = trainer.step(batch)
        results.append((params(trainer.policy), params(trainer.critic), metrics))
    (pi_a, v_a, m_a), (pi_b, v_b, m_b) = results
    moved = 0.0
    for name in pi_a:
        torch.testing.assert_close(pi_a[name], pi_b[name], rtol=0, atol=1e-6)
    for name in v_a:
        torch.testing.assert_close(v_a[name], v_b[name], rtol=0, atol=1e-6)
    init = params(build_tiny_model(TOKENIZER, seed=0))
    moved = max(float((pi_a[k] - init[k]).abs().max()) for k in init)
    assert moved > 1e-4  # the step did something, so equality is not vacuous
    assert m_a["loss/policy"] == pytest.approx(m_b["loss/policy"], abs=1e-6)


def test_tool_and_prompt_tokens_get_no_gradient() -> None:
    """The logits that predict a non-action token (prompt, tool output, padding) get exactly zero gradient."""
    trainer = make_trainer(entropy_coef=0.01, kl_coef=0.0)
    trajs = synthetic_trajectories(trainer.policy)
    batch = collate(trajs, pad_id=TOKENIZER.pad_token_id)
    state = trainer.prepare(batch)
    captured: list[torch.Tensor] = []

    def keep(_module: torch.nn.Module, _inputs: object, output: torch.Tensor) -> None:
        output.retain_grad()
        captured.append(output)

    handle = trainer.policy.lm_head.register_forward_hook(keep)
    try:
        rows = torch.arange(batch.batch_size)
        from copc.trainer.batching import split_minibatches

        mb = split_minibatches(state.loss_mask, 1)[0]
        loss, _ = trainer._actor_loss(batch, state, rows, mb)
        loss.backward()
    finally:
        handle.remove()
    grad = captured[0].grad  # [B, T', V]: position p predicts token p + 1
    assert grad is not None
    length = grad.shape[1]
    predicts_action = batch.action_mask[:, 1:length + 1]
    predicts_action = torch.cat([predicts_action, torch.zeros(batch.batch_size, length - predicts_action.shape[1],
                                                              dtype=torch.bool)], dim=1)
    assert bool((grad[~predicts_action] == 0).all()), "a non-action token received gradient"
    assert float(grad[predicts_action].abs().sum()) > 0


def test_zero_staleness_gives_unit_behaviour_weights() -> None:
    """mu == pi_old (same weights, same forward) makes log w exactly 0 on every action token."""
    trainer = make_trainer(micro_batch_size=8)
    trajs = synthetic_trajectories(trainer.policy, behaviour_noise=0.0)
    batch = collate(trajs, pad_id=TOKENIZER.pad_token_id)
    # Recompute mu with the trainer's own padded forward so it is bit-identical to logp_old.
    with torch.no_grad():
        logp = token_logprobs(trainer.policy, batch.input_ids, batch.attention_mask)
    batch = replace(batch, logp_behav=torch.where(batch.action_mask, logp, 0.0))
    state = trainer.prepare(batch)
    assert torch.equal(state.log_w, torch.zeros_like(state.log_w))
    stale = trainer.prepare(collate(synthetic_trajectories(trainer.policy), pad_id=TOKENIZER.pad_token_id))
    assert float(stale.log_w.abs().max()) > 0.1  # noisy mu: weights differ from 1


def test_method_from_channel_configs_directly() -> None:
    """A MethodConfig assembled from channel configs (not a preset name) drives the trainer."""
    base = get_method("copc")
    custom = replace(base, name="custom", policy=get_method("ppo").policy)
    policy = build_tiny_model(TOKENIZER, seed=1)
    trainer = ActorCriticTrainer(policy, ValueModel.from_policy(policy), custom,
                                 TrainerConfig(actor_lr=1e-3, critic_warmup_steps=0))
    before = params(trainer.policy)
    trainer.step(collate(synthetic_trajectories(policy), pad_id=TOKENIZER.pad_token_id))
    assert not all(torch.equal(v, before[k]) for k, v in trainer.policy.named_parameters())


def test_state_dict_round_trip_continues_identically() -> None:
    trainer = make_trainer()
    batch = collate(synthetic_trajectories(trainer.policy), pad_id=TOKENIZER.pad_token_id)
    trainer.step(batch)
    clone = make_trainer(seed=5)
    clone.load_state_dict(copy.deepcopy(trainer.state_dict()))
    m1, m2 = trainer.step(batch), clone.step(batch)
    for name, value in trainer.policy.named_parameters():
        assert torch.equal(value, dict(clone.policy.named_parameters())[name])
    assert m1["loss/policy"] == m2["loss/policy"]
