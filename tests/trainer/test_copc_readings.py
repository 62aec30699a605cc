"""COPC's two readings (R0: docs/formulas.md#r0, R1: docs/formulas.md#r1) and the one-channel arms of the
2 x 2 (issue 32).

- golden values of R1's policy loss and of the advantage channel, worked by hand;
- the degenerate checks of docs/formulas.md#r1 through the whole trainer step: an infinite band and a
  zero advantage clip give async PPO 3a bit for bit (parameters, losses); each one-channel arm equals 3a
  in the channel it does not touch;
- R1 with one actor minibatch and ``old_forward_reuse`` runs no actor forward beyond 3a's.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from tests.trainer.test_trainer import TOKENIZER, params, synthetic_trajectories

from copc.channels import AdvantageChannelConfig, PolicyInputs, compute_advantages, policy_loss
from copc.channels.methods import COPC_READING, MethodConfig, get_method
from copc.models import build_tiny_model
from copc.models.hf import ValueModel
from copc.trainer.batching import collate
from copc.trainer.config import TrainerConfig
from copc.trainer.trainer import ActorCriticTrainer


# ------------------------------------------------------------------------------------------ golden
def _loss_of(method: MethodConfig, log_r: list[float], adv: list[float]) -> tuple[float, list[float]]:
    """Token-mean actor loss and d loss / d cur of ``method``'s policy channel on one row, mu = log 0.5."""
    mu = torch.full((1, len(log_r)), math.log(0.5))
    cur = (mu + torch.tensor([log_r])).requires_grad_(True)
    mask = torch.ones(1, len(log_r), dtype=torch.bool)
    out = policy_loss(method.policy, PolicyInputs(
        logp=cur, logp_old=cur.detach(), logp_behav=mu, advantages=torch.tensor([adv]), action_mask=mask,
        num_tokens=None,
    ))
    (grad,) = torch.autograd.grad(out.loss, cur)
    return float(out.loss.detach()), grad[0].tolist()


def test_r1_policy_channel_golden() -> None:
    # r = cur/mu = [0.4, 1.0, 2.5], A = [1, 1, -1], PPO clip [0.8, 1.28], dual clip 3, band [0.5, 2].
    # 3a (no band): t0 max(-0.4, -0.8) = -0.4 (unclipped: grad -A r = -0.4); t1 -1 (grad -1);
    #   t2 (A < 0) max(2.5, 1.28) = 2.5, dual min(2.5, 3) = 2.5 (grad -A r = 2.5). Mean (-0.4 - 1 + 2.5)/3.
    # R1 mask (band [0.5, 2]): t0 and t2 leave the band -> 0; t1 stays: loss -1/3, grad [0, -1/3, 0].
    log_r = [math.log(0.4), 0.0, math.log(2.5)]
    adv = [1.0, 1.0, -1.0]
    loss, grad = _loss_of(get_method("async_ppo"), log_r, adv)
    assert math.isclose(loss, 1.1 / 3, rel_tol=1e-6)
    assert all(math.isclose(g, w / 3, rel_tol=1e-6) for g, w in zip(grad, [-0.4, -1.0, 2.5], strict=True))
    for arm in ("async_ppo_mask", "copc_behaviour"):
        loss, grad = _loss_of(get_method(arm), log_r, adv)
        assert math.isclose(loss, -1 / 3, rel_tol=1e-6), arm
        assert grad[0] == 0.0 and grad[2] == 0.0 and math.isclose(grad[1], -1 / 3, rel_tol=1e-6), arm


def test_one_channel_advantages_golden() -> None:
    # One row, gamma = lambda = 1, V = [0.5, 0.2, 0.1], terminal reward 1, w = old/mu = [2, 1, 0.5].
    # delta = [0 + 0.2 - 0.5, 0 + 0.1 - 0.2, 1 + 0 - 0.1] = [-0.3, -0.1, 0.9].
    # GAE (3a, async_ppo_mask): A = [0.5, 0.8, 0.9], G = V + A = [1, 1, 1].
    # clipped TD (async_ppo_advantage, copc_behaviour): rho~ = clip(w, 0.8, 1.2) = [1.2, 1, 0.8];
    #   E2 = 0.8 * 0.9 = 0.72, E1 = -0.1 + 0.72 = 0.62, E0 = 1.2 * -0.3 + 0.62 = 0.26;
    #   A_t = delta_t + E_{t+1} = [-0.3 + 0.62, -0.1 + 0.72, 0.9] = [0.32, 0.62, 0.9];
    #   G_t = V_t + E_t = [0.76, 0.82, 0.82].
    values = torch.tensor([[0.5, 0.2, 0.1]])
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    log_w = torch.tensor([[2.0, 1.0, 0.5]]).log()
    mask = torch.ones(1, 3, dtype=torch.bool)
    want = {
        "async_ppo": ([0.5, 0.8, 0.9], [1.0, 1.0, 1.0]),
        "async_ppo_mask": ([0.5, 0.8, 0.9], [1.0, 1.0, 1.0]),
        "async_ppo_advantage": ([0.32, 0.62, 0.9], [0.76, 0.82, 0.82]),
        "copc_behaviour": ([0.32, 0.62, 0.9], [0.76, 0.82, 0.82]),
    }
    for arm, (adv_want, ret_want) in want.items():
        cfg = replace(get_method(arm).advantage, whiten=False)
        out = compute_advantages(cfg, rewards=rewards, values=values, log_w=log_w, action_mask=mask)
        torch.testing.assert_close(out.advantages[0], torch.tensor(adv_want), rtol=0, atol=1e-6, msg=arm)
        torch.testing.assert_close(out.returns[0], torch.tensor(ret_want), rtol=0, atol=1e-6, msg=arm)


def test_presets_share_everything_but_their_channels() -> None:
    base = get_method("async_ppo")
    r1, mask_only, adv_only = get_method("copc_behaviour"), get_method("async_ppo_mask"), get_method(
        "async_ppo_advantage")
    no_band = {"mask_low": 0.0, "mask_high": math.inf}
    assert replace(r1.policy, **no_band) == base.policy == adv_only.policy
    assert mask_only.policy == r1.policy and (r1.policy.mask_low, r1.policy.mask_high) == (0.5, 2.0)
    assert mask_only.advantage == base.advantage and adv_only.advantage == r1.advantage
    assert r1.advantage == get_method("copc_proximal").advantage
    assert r1.critic == mask_only.critic == adv_only.critic == base.critic
    # ``copc`` is the reading the evidence names (R0 until a confirmation says otherwise).
    assert replace(get_method("copc"), name=COPC_READING) == get_method(COPC_READING)


# ------------------------------------------------------------------------------------ whole steps
def _trainer(method: MethodConfig, **overrides: object) -> ActorCriticTrainer:
    policy = build_tiny_model(TOKENIZER, seed=0)
    torch.manual_seed(0)
    critic = ValueModel.from_policy(policy)
    cfg = TrainerConfig(**{"actor_lr": 1e-3, "critic_lr": 1e-3, "micro_batch_size": 4,
                           "critic_warmup_steps": 0,
                           **overrides})  # type: ignore[arg-type]
    return ActorCriticTrainer(policy, critic, method, cfg)


def _two_steps(method: MethodConfig,
               **overrides: object) -> tuple[ActorCriticTrainer, list[dict[str, float]]]:
    trainer = _trainer(method, **overrides)
    metrics = []
    for seed in (0, 1):
        batch = collate(synthetic_trajectories(trainer.policy, seed=seed, behaviour_noise=0.5),
                        pad_id=TOKENIZER.pad_token_id)
        metrics.append(trainer.step(batch))
    return trainer, metrics


def _degenerate(name: str, *, band: bool, clip: bool) -> MethodConfig:
    m = get_method(name)
    if band:
        m = replace(m, policy=replace(m.policy, mask_low=0.0, mask_high=math.inf))
    if clip:
        m = replace(m, advantage=replace(m.advantage, ratio_low=1.0, ratio_high=1.0))
    return m


def _same_step(a: tuple[ActorCriticTrainer, list[dict[str, float]]],
               b: tuple[ActorCriticTrainer, list[dict[str, float]]]) -> None:
    (ta, ma), (tb, mb) = a, b
    for name, value in params(ta.policy).items():
        assert torch.equal(value, params(tb.policy)[name]), name
    assert ta.critic is not None and tb.critic is not None
    for name, value in params(ta.critic).items():
        assert torch.equal(value, params(tb.critic)[name]), name
    for step_a, step_b in zip(ma, mb, strict=True):
        for key in ("loss/policy", "loss/value", "adv/raw_mean", "returns/mean"):
            assert step_a[key] == step_b[key], key


def test_infinite_band_and_zero_clip_give_async_ppo_bit_for_bit() -> None:
    reference = _two_steps(get_method("async_ppo"))
    _same_step(_two_steps(_degenerate("copc_behaviour", band=True, clip=True)), reference)
    _same_step(_two_steps(_degenerate("async_ppo_mask", band=True, clip=False)), reference)
    _same_step(_two_steps(_degenerate("async_ppo_advantage", band=False, clip=True)), reference)


def test_each_arm_moves_away_from_3a_in_its_own_channel_only() -> None:
    # The check above could pass if the arms ignored their settings; with the settings on, each arm
    # differs from 3a, and R1 equals each one-channel arm once the other channel is switched off.
    reference = _two_steps(get_method("async_ppo"))
    for arm in ("copc_behaviour", "async_ppo_mask", "async_ppo_advantage"):
        trainer, _ = _two_steps(get_method(arm))
        assert any(not torch.equal(v, params(reference[0].policy)[k]) for k,
                   v in params(trainer.policy).items()), arm
    _same_step(_two_steps(_degenerate("copc_behaviour", band=False, clip=True)),
               _two_steps(get_method("async_ppo_mask")))
    _same_step(_two_steps(_degenerate("copc_behaviour", band=True, clip=False)),
               _two_steps(get_method("async_ppo_advantage")))


def _count_actor_forwards(method: MethodConfig, **overrides: object) -> int:
    trainer = _trainer(method, **overrides)
    batch = collate(synthetic_trajectories(trainer.policy, seed=0, behaviour_noise=0.5),
                    pad_id=TOKENIZER.pad_token_id)
    calls = [0]
    handle = trainer.policy.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        trainer.step(batch)
    finally:
        handle.remove()
    return calls[0]


def test_r1_with_one_minibatch_needs_no_actor_forward_beyond_3a() -> None:
    # micro_batch_size 4 over 8 rows: 3a's update runs 2 forwards (with grad). R1 reads old = the first
    # (and only) minibatch's own forward, taken before the advantages are built (docs/formulas.md#r1); R0 / R1
    # without the reuse pay one no-grad forward over the batch more (2 micro-batches).
    one = {"actor_minibatches": 1}
    three_a = _count_actor_forwards(get_method("async_ppo"), **one)
    assert three_a == 2
    assert _count_actor_forwards(get_method("copc_behaviour"), old_forward_reuse=True, **one) == three_a
    assert _count_actor_forwards(get_method("copc_behaviour"), **one) == three_a + 2
    assert _count_actor_forwards(get_method("copc_proximal"), old_forward_reuse=True, **one) == three_a


def test_dis_form_is_an_override_of_r1() -> None:
    # SAO-like DIS form of R1 (docs/formulas.md#r1): -M sg(r) A cur with the strict band, no PPO clip.
    r1 = get_method("copc_behaviour")
    dis = replace(r1, policy=replace(r1.policy, objective="dis"))
    log_r = [math.log(0.4), 0.0, math.log(1.5)]
    loss, grad = _loss_of(dis, log_r, [1.0, 1.0, -1.0])
    # t0 out of (0.5, 2); t1 -1 * 1; t2 -(-1) * 1.5 (no clip): (-1 + 1.5) / 3
    assert math.isclose(loss, 0.5 / 3, rel_tol=1e-6) and grad[0] == 0.0
    assert isinstance(r1.advantage, AdvantageChannelConfig) and r1.needs_old_forward
