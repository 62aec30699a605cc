"""Tests for copc.channels.methods: the presets match the spec's defaults, build, override and run end to
end."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from copc.channels import PolicyInputs, ValueInputs, compute_advantages, policy_loss, value_loss
from copc.channels.methods import MethodConfig, get_method, method_names
from copc.registry import RegistryError
from reference.batches import step_batch

PRESETS = (
    "ppo", "async_ppo", "async_ppo_recompute", "vtrace", "dapo", "sao", "areal", "areal_critic", "icepop",
    "brace",
    "copc", "copc_proximal", "copc_behaviour", "async_ppo_mask", "async_ppo_advantage", "async_ppo_oracle",
)


def test_all_presets_are_registered() -> None:
    assert set(method_names()) == set(PRESETS)


def test_misspelt_name_lists_valid_ones_with_a_hint() -> None:
    with pytest.raises(RegistryError,
                       match=r"unknown method 'ipecop' .*valid: areal, areal_critic, async_ppo"):
        get_method("ipecop")
    with pytest.raises(RegistryError, match=r"did you mean 'async_ppo'\?"):
        get_method("asyncppo")


def test_spec_defaults_per_preset() -> None:
    # docs/formulas.md#ppo: dual clip 3 only in the verl-based baselines, and in the arms built on async PPO
    # 3a's actor (docs/formulas.md#r1: R1 and the one-channel arms differ from 3a only in their two channels).
    on_3a = ("copc_behaviour", "async_ppo_mask", "async_ppo_advantage", "async_ppo_oracle")
    for name in PRESETS:
        want = 3.0 if name in ("ppo", "async_ppo", "async_ppo_recompute", "dapo", *on_3a) else None
        assert get_method(name).policy.dual_clip_c == want, name
    # section 9.6 / per-method sections: actor minibatches and critic updates per step.
    minibatches = {"vtrace": 1, "brace": 1, "dapo": 16, "areal": 4, "areal_critic": 4, "copc": 4}
    for name, n in minibatches.items():
        assert get_method(name).policy.minibatches == n, name
    assert get_method("sao").critic is not None and get_method(
        "sao").critic.updates_per_step == 2  # type: ignore[union-attr]
    assert get_method("copc").critic.updates_per_step == 1  # type: ignore[union-attr]
    # objectives and estimators
    copc = get_method("copc")
    assert (copc.policy.objective, copc.policy.mask_low, copc.policy.mask_high) == ("copc", 0.5, 2.0)
    assert (copc.advantage.estimator, copc.advantage.ratio_low, copc.advantage.ratio_high) == ("clipped_td",
                                                                                               0.8, 1.2)
    assert copc.advantage.advantage_window is None and copc.advantage.trace == "none"
    assert get_method("async_ppo").policy.objective == "bypass_ppo"
    assert get_method("areal").policy.weight_cap == 5.0 and get_method("areal").policy.cap_mode == "mask"
    assert (get_method("sao").policy.mask_low, get_method("sao").policy.mask_high) == (0.7, 6.0)
    assert get_method("icepop").policy.loss_agg == "seq-mean-token-mean"
    brace = get_method("brace").advantage
    assert (brace.rho_bar, brace.c_bar, brace.brace_k) == (1.2, 1.1, 100)
    # whitening: never in group-normalised presets
    for name in PRESETS:
        m = get_method(name)
        assert m.advantage.whiten == (m.advantage.estimator != "group"), name


def test_needs_old_forward_and_critic() -> None:
    no_old = {"async_ppo", "sao", "async_ppo_mask", "async_ppo_oracle"}
    no_critic = {"dapo", "icepop", "areal", "async_ppo_oracle"}
    for name in PRESETS:
        m = get_method(name)
        assert m.needs_old_forward == (name not in no_old), name
        assert m.needs_critic == (name not in no_critic), name


def test_dapo_is_dapo() -> None:
    # docs/formulas.md#dapo: clip-higher 0.2 / 0.28, token-level aggregation, critic-free group z-scores, and
    # the two rollout-side pieces (dynamic sampling, overlong shaping) switched on; no other preset has them.
    dapo = get_method("dapo")
    assert (dapo.policy.objective, dapo.policy.clip_low, dapo.policy.clip_high) == ("ppo", 0.2, 0.28)
    assert dapo.policy.loss_agg == "token-mean"
    assert (dapo.advantage.estimator, dapo.advantage.group_mode, dapo.critic) == ("group", "grpo", None)
    assert dapo.dynamic_sampling and dapo.overlong_shaping
    for name in PRESETS:
        if name != "dapo":
            assert not get_method(name).dynamic_sampling and not get_method(name).overlong_shaping, name


def test_areal_follows_the_paper_and_keeps_the_critic_variant() -> None:
    # docs/formulas.md#areal: the AReaL paper ran critic-free with group-normalised advantages, gamma = lambda
    # = 1; the decoupled objective (old/mu weight, masked above 5, PPO clip 0.2 around old) is shared.
    areal, critic = get_method("areal"), get_method("areal_critic")
    assert areal.critic is None and areal.advantage.estimator == "group" and not areal.needs_critic
    assert critic.critic is not None and critic.advantage.estimator == "gae"
    assert (critic.advantage.gamma, critic.advantage.lam_actor, critic.advantage.lam_critic) == (1.0, 1.0,
                                                                                                 1.0)
    assert areal.policy == critic.policy
    p = areal.policy
    assert (p.objective, p.clip_low, p.clip_high, p.weight_cap, p.cap_mode) == ("decoupled", 0.2, 0.2, 5.0,
                                                                                "mask")
    assert areal.needs_old_forward and critic.needs_old_forward


def test_override_field_by_field_revalidates() -> None:
    m = get_method("copc")
    m2 = replace(m, policy=replace(m.policy, mask_low=0.2, mask_high=5.0),
                 advantage=replace(m.advantage, advantage_window=100))
    assert m2.policy.mask_high == 5.0 and m2.advantage.advantage_window == 100 and m.policy.mask_high == 2.0
    with pytest.raises(ValueError, match="mask_low"):
        replace(m.policy, mask_low=3.0)
    with pytest.raises(ValueError, match="critic=None"):
        replace(get_method("dapo"), critic=get_method("ppo").critic)
    with pytest.raises(ValueError, match="CriticConfig"):
        MethodConfig("x", critic=None)


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_runs_a_step_on_a_random_batch(name: str) -> None:
    m = get_method(name)
    d = step_batch(b=6, t=12, seed=7)
    logp_old = d["logp_old"] if m.needs_old_forward else None
    log_w = None if logp_old is None else logp_old - d["logp_behav"]
    values = d["values"] if m.needs_critic else None
    oracle = torch.randn(d["rewards"].shape, generator=torch.Generator().manual_seed(3))  # given by the run
    adv = compute_advantages(
        m.advantage, rewards=d["rewards"], values=values, log_w=log_w, action_mask=d["action_mask"],
        scores=d["scores"], group_ids=d["group_ids"], oracle=oracle if m.advantage.needs_oracle else None,
    )
    logp = d["logp"].clone().requires_grad_(True)
    out = policy_loss(m.policy, PolicyInputs(
        logp=logp, logp_old=logp_old, logp_behav=d["logp_behav"], advantages=adv.advantages,
        action_mask=d["action_mask"], num_tokens=d["action_mask"].sum(),
        num_seqs=d["action_mask"].any(-1).sum(),
    ))
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert grad.abs().sum() > 0 and torch.equal(grad[~d["action_mask"]],
                                                torch.zeros_like(grad[~d["action_mask"]]))
    if m.critic is not None:
        v = (d["values"] + 0.3).requires_grad_(True)
        vl = value_loss(m.critic, ValueInputs(
            values=v, values_old=d["values"], returns=adv.returns, action_mask=d["action_mask"],
            num_tokens=d["action_mask"].sum()))
        (gv,) = torch.autograd.grad(vl.loss, v)
        assert torch.isfinite(vl.loss) and gv.abs().sum() > 0
