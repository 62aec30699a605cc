"""Tests for copc.channels.methods: the presets match the spec's defaults, build, override and run end to end."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from copc.channels import compute_advantages, policy_loss, value_loss
from copc.channels.methods import MethodConfig, get_method, method_names
from copc.registry import RegistryError
from reference.batches import step_batch

PRESETS = ("ppo", "async_ppo", "async_ppo_recompute", "vtrace", "dapo", "sao", "areal", "icepop", "brace", "copc")


def test_all_presets_are_registered() -> None:
    assert set(method_names()) == set(PRESETS)


def test_misspelt_name_lists_valid_ones_with_a_hint() -> None:
    with pytest.raises(RegistryError, match=r"unknown method 'ipecop' .*valid: areal, async_ppo"):
        get_method("ipecop")
    with pytest.raises(RegistryError, match=r"did you mean 'async_ppo'\?"):
        get_method("asyncppo")


def test_spec_defaults_per_preset() -> None:
    # spec section 2: dual clip 3 only in the verl-based baselines.
    for name in PRESETS:
        want = 3.0 if name in ("ppo", "async_ppo", "async_ppo_recompute", "dapo") else None
        assert get_method(name).policy.dual_clip_c == want, name
    # section 9.6 / per-method sections: actor minibatches and critic updates per step.
    minibatches = {"vtrace": 1, "brace": 1, "dapo": 16, "areal": 4, "copc": 4}
    for name, n in minibatches.items():
        assert get_method(name).policy.minibatches == n, name
    assert get_method("sao").critic is not None and get_method("sao").critic.updates_per_step == 2  # type: ignore[union-attr]
    assert get_method("copc").critic.updates_per_step == 1  # type: ignore[union-attr]
    # objectives and estimators
    copc = get_method("copc")
    assert (copc.policy.objective, copc.policy.mask_low, copc.policy.mask_high) == ("copc", 0.5, 2.0)
    assert (copc.advantage.estimator, copc.advantage.ratio_low, copc.advantage.ratio_high) == ("clipped_td", 0.8, 1.2)
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
    no_old = {"async_ppo", "sao"}
    no_critic = {"dapo", "icepop"}
    for name in PRESETS:
        m = get_method(name)
        assert m.needs_old_forward == (name not in no_old), name
        assert m.needs_critic == (name not in no_critic), name


def test_override_field_by_field_revalidates() -> None:
    m = get_method("copc")
    m2 = replace(m, policy=replace(m.policy, mask_low=0.2, mask_high=5.0), advantage=replace(m.advantage, advantage_window=100))
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
    adv = compute_advantages(
        m.advantage, rewards=d["rewards"], values=values, log_w=log_w, action_mask=d["action_mask"],
        scores=d["scores"], group_ids=d["group_ids"],
    )
    logp = d["logp"].clone().requires_grad_(True)
    out = policy_loss(
        m.policy, logp=logp, logp_old=logp_old, logp_behav=d["logp_behav"], advantages=adv.advantages,
        action_mask=d["action_mask"], num_tokens=d["action_mask"].sum(), num_seqs=d["action_mask"].any(-1).sum(),
    )
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert grad.abs().sum() > 0 and torch.equal(grad[~d["action_mask"]], torch.zeros_like(grad[~d["action_mask"]]))
    if m.critic is not None:
        v = (d["values"] + 0.3).requires_grad_(True)
        vl = value_loss(m.critic, values=v, values_old=d["values"], returns=adv.returns, action_mask=d["action_mask"], num_tokens=d["action_mask"].sum())
        (gv,) = torch.autograd.grad(vl.loss, v)
        assert torch.isfinite(vl.loss) and gv.abs().sum() > 0
