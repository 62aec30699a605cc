"""Tests for copc.channels (config validation, dispatch, whitening, end-to-end reductions) and the
typed registry of copc.registry."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from copc.channels import (
    ADVANTAGE_ESTIMATORS,
    POLICY_OBJECTIVES,
    AdvantageChannelConfig,
    CriticConfig,
    PolicyChannelConfig,
    PolicyInputs,
    ValueInputs,
    compute_advantages,
    count_loss_tokens,
    policy_loss,
    value_loss,
)
from copc.channels.methods import get_method
from copc.ops.advantages import fold_rewards, gae
from copc.ops.value_losses import clipped_value_loss
from copc.registry import Registry, RegistryError
from reference.batches import step_batch


def run_step(method_name: str, d: dict[str, torch.Tensor],
             **over: object) -> tuple[torch.Tensor, torch.Tensor]:
    """compute_advantages + policy_loss for a preset; returns (advantages, actor loss)."""
    m = get_method(method_name)
    log_w = d["logp_old"] - d["logp_behav"]
    adv = compute_advantages(
        m.advantage, rewards=d["rewards"], values=d["values"], log_w=log_w, action_mask=d["action_mask"],
        scores=d["scores"], group_ids=d["group_ids"],
    )
    policy = replace(m.policy, **over) if over else m.policy  # type: ignore[arg-type]
    out = policy_loss(policy, PolicyInputs(
        logp=d["logp"], logp_old=d["logp_old"], logp_behav=d["logp_behav"], advantages=adv.advantages,
        action_mask=d["action_mask"], num_tokens=d["action_mask"].sum(),
        num_seqs=d["action_mask"].any(-1).sum(),
    ))
    return adv.advantages, out.loss


# ---------------------------------------------------------------- registry


def test_registry_rejects_duplicates_and_explains_unknown_names() -> None:
    reg: Registry[int] = Registry("thing")
    reg.add("alpha", 1)

    @reg.register("beta")
    def _beta() -> int:  # decorator form returns the entry unchanged
        return 2

    assert reg.get("alpha") == 1 and reg.names() == ("alpha", "beta") and "beta" in reg
    with pytest.raises(RegistryError, match="duplicate thing 'alpha'"):
        reg.add("alpha", 3)
    with pytest.raises(RegistryError,
                       match=r"unknown thing 'alpah' \(did you mean 'alpha'\?\); valid: alpha, beta"):
        reg.get("alpah")
    with pytest.raises(RegistryError, match=r"my\.field: unknown thing 'zzz'; valid"):
        reg.check("zzz", field="my.field")


# ---------------------------------------------------------------- config validation


def test_configs_validate_names_at_construction() -> None:
    with pytest.raises(RegistryError,
                       match=r"policy.objective: unknown policy objective 'copcc' \(did you mean 'copc'\?\)"):
        PolicyChannelConfig(objective="copcc")
    with pytest.raises(RegistryError, match=r"advantage\.estimator"):
        AdvantageChannelConfig(estimator="gea")
    with pytest.raises(RegistryError, match=r"critic\.loss"):
        CriticConfig(loss="l2")
    assert set(POLICY_OBJECTIVES.names()) == {"ppo", "bypass_ppo", "decoupled", "tis", "icepop", "copc",
                                              "dis", "pg"}
    assert set(ADVANTAGE_ESTIMATORS.names()) == {"gae", "vtrace", "clipped_td", "brace", "group", "mc_oracle"}


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: PolicyChannelConfig(clip_low=1.0), "clip_low"),
        (lambda: PolicyChannelConfig(dual_clip_c=1.0), "dual_clip_c"),
        (lambda: PolicyChannelConfig(mask_low=2.0, mask_high=1.0), "mask_low"),
        (lambda: PolicyChannelConfig(loss_agg="mean"), "loss_agg"),  # type: ignore[arg-type]
        (lambda: PolicyChannelConfig(minibatches=0), "minibatches"),
        (lambda: PolicyChannelConfig(objective="copc", denominator="kept", mask_source="current"),
         "mask_source='step_start'"),
        (lambda: PolicyChannelConfig(objective="dis", denominator="kept"), "denominator='all'"),
        (lambda: AdvantageChannelConfig(lam_actor=1.5), "lam_actor"),
        (lambda: AdvantageChannelConfig(ratio_low=1.1, ratio_high=1.2), "ratio_low"),
        (lambda: AdvantageChannelConfig(trace="vtrace"), "trace_low"),
        (lambda: AdvantageChannelConfig(trace="vtrace", trace_low=1.5, trace_high=0.5), "0 <= low <= high"),
        (lambda: AdvantageChannelConfig(trace="vtrace", trace_low=-3.0, trace_high=1.1), "0 <= low <= high"),
        (lambda: AdvantageChannelConfig(trace="brace", trace_low=0.9, trace_high=1.1), "advantage_window"),
        (lambda: AdvantageChannelConfig(estimator="group"), "whiten=False"),
        (lambda: CriticConfig(updates_per_step=0), "updates_per_step"),
        (lambda: CriticConfig(clip_eps=-0.1), "clip_eps"),
    ],
)
def test_bad_values_fail_with_the_fix(make: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()  # type: ignore[operator]


def test_needs_flags_follow_the_registry_entries() -> None:
    assert PolicyChannelConfig(objective="bypass_ppo").needs_old_forward is False
    assert PolicyChannelConfig(objective="dis").needs_old_forward is False
    assert PolicyChannelConfig(objective="copc").needs_old_forward is True
    assert AdvantageChannelConfig(estimator="gae").needs_old_forward is False
    assert AdvantageChannelConfig(estimator="clipped_td").needs_old_forward is True
    assert AdvantageChannelConfig(estimator="group", whiten=False).needs_critic is False


# ---------------------------------------------------------------- advantage channel


def test_whitening_once_over_all_action_tokens_and_never_returns() -> None:
    d = step_batch(seed=1)
    raw = compute_advantages(replace(AdvantageChannelConfig(), whiten=False), rewards=d["rewards"],
                             values=d["values"], log_w=None, action_mask=d["action_mask"])
    white = compute_advantages(AdvantageChannelConfig(), rewards=d["rewards"], values=d["values"], log_w=None,
                               action_mask=d["action_mask"])
    mask = d["action_mask"]
    a = white.advantages[mask].double()
    # mean 0 and Bessel-corrected std 1 over all action tokens (float32 rounding: 1e-5).
    assert abs(a.mean().item()) < 1e-5 and abs(a.std(unbiased=True).item() - 1.0) < 1e-5
    r = raw.advantages[mask].double()
    torch.testing.assert_close(a, ((r - r.mean()) / r.std(unbiased=True)), rtol=1e-5, atol=1e-5)
    assert torch.equal(white.returns, raw.returns)  # G is never whitened
    assert torch.equal(white.advantages[~mask], torch.zeros_like(white.advantages[~mask]))


def test_decoupled_lambdas_actor_from_lam_actor_targets_from_lam_critic() -> None:
    d = step_batch(seed=8)
    cfg = AdvantageChannelConfig(lam_critic=1.0, lam_actor=0.9, whiten=False)
    out = compute_advantages(cfg, rewards=d["rewards"], values=d["values"], log_w=None,
                             action_mask=d["action_mask"])
    r = fold_rewards(d["rewards"], d["action_mask"])
    actor = gae(r, d["values"], d["action_mask"], gamma=1.0, lam=0.9)
    critic = gae(r, d["values"], d["action_mask"], gamma=1.0, lam=1.0)
    assert torch.equal(out.advantages, actor.advantages) and torch.equal(out.returns, critic.returns)
    assert not torch.equal(actor.advantages, critic.advantages)


def test_reward_on_a_tool_token_reaches_the_return() -> None:
    # gamma = lambda = 1, V = 0: every action token's G equals the reward, even when it was placed on
    # a tool-output token after the last action token (folded onto that token first).
    mask = torch.tensor([[True, True, False, False]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 2.0]])
    out = compute_advantages(
        AdvantageChannelConfig(whiten=False), rewards=rewards, values=torch.zeros(1, 4), log_w=None,
        action_mask=mask
    )
    torch.testing.assert_close(out.returns, torch.tensor([[2.0, 2.0, 0.0, 0.0]]))


def test_group_estimator_is_not_whitened_and_needs_scores() -> None:
    d = step_batch(seed=2)
    cfg = AdvantageChannelConfig(estimator="group", whiten=False)
    out = compute_advantages(cfg, rewards=d["rewards"], values=None, log_w=None, action_mask=d["action_mask"],
                             scores=d["scores"], group_ids=d["group_ids"])
    # pairs (0,1), (2,3), (4,5): grpo with n = 2 gives +-1/sqrt(2) * 2 / ... = +-0.7071 (Bessel std of a pair
    # is |x - y| / sqrt(2), the centred value is +-|x - y| / 2).
    first = out.advantages[:, 0]
    torch.testing.assert_close(first.abs(), torch.full_like(first, 1 / math.sqrt(2)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="scores"):
        compute_advantages(cfg, rewards=d["rewards"], values=None, log_w=None, action_mask=d["action_mask"])


def test_missing_inputs_are_named() -> None:
    d = step_batch()
    with pytest.raises(ValueError, match="log_w"):
        compute_advantages(AdvantageChannelConfig(estimator="clipped_td"), rewards=d["rewards"],
                           values=d["values"], log_w=None, action_mask=d["action_mask"])
    with pytest.raises(ValueError, match="values"):
        compute_advantages(AdvantageChannelConfig(), rewards=d["rewards"], values=None, log_w=None,
                           action_mask=d["action_mask"])
    with pytest.raises(ValueError, match="logp_old"):
        policy_loss(PolicyChannelConfig(), PolicyInputs(
            logp=d["logp"], logp_old=None, logp_behav=None, advantages=d["values"],
            action_mask=d["action_mask"], num_tokens=None))


# ---------------------------------------------------------------- end-to-end reductions


def test_copc_with_unit_weights_is_ppo_plus_gae_end_to_end() -> None:
    # w = exp(old - mu) == 1: COPC's clipped_td == GAE and its masked surrogate == PPO's (same dual clip).
    d = step_batch(seed=3)
    d["logp_behav"] = d["logp_old"].clone()
    adv_copc, loss_copc = run_step("copc", d)
    adv_ppo, loss_ppo = run_step("ppo", d, dual_clip_c=None)
    torch.testing.assert_close(adv_copc, adv_ppo, rtol=0, atol=1e-6)  # same GAE, two scan paths: 1e-6
    torch.testing.assert_close(loss_copc, loss_ppo, rtol=1e-6, atol=1e-7)


def test_copc_zero_advantage_clip_is_stale_gae() -> None:
    # eps_A = 0 (rho~ = clip(w, 1, 1) = 1): COPC's advantages and targets are plain GAE whatever w is.
    d = step_batch(seed=4, stale=1.5)
    log_w = d["logp_old"] - d["logp_behav"]
    adv_cfg = replace(get_method("copc").advantage, ratio_low=1.0, ratio_high=1.0, whiten=False)
    copc = compute_advantages(adv_cfg, rewards=d["rewards"], values=d["values"], log_w=log_w,
                              action_mask=d["action_mask"])
    ref = gae(fold_rewards(d["rewards"], d["action_mask"]), d["values"], d["action_mask"], gamma=1.0, lam=1.0)
    torch.testing.assert_close(copc.advantages, ref.advantages, rtol=0, atol=1e-6)
    torch.testing.assert_close(copc.returns, ref.returns, rtol=0, atol=1e-6)
    # and the clip really acts when eps_A > 0 on stale data (the reduction above is not vacuous)
    clipped = compute_advantages(replace(adv_cfg, ratio_low=0.8, ratio_high=1.2), rewards=d["rewards"],
                                 values=d["values"], log_w=log_w, action_mask=d["action_mask"])
    assert not torch.allclose(clipped.returns, ref.returns)


def test_copc_open_band_is_3b_or_areal_on_the_same_advantages() -> None:
    # infinite band: omega = M (binary) -> recompute async PPO 3b; omega = M w -> AReaL without cap.
    d = step_batch(seed=4, stale=1.5)
    _, copc_binary = run_step_with_gae("copc", d, mask_low=0.0, mask_high=math.inf, weight_mode="binary")
    _, ppo_3b = run_step_with_gae("async_ppo_recompute", d, dual_clip_c=None)
    torch.testing.assert_close(copc_binary, ppo_3b, rtol=0, atol=0)
    _, copc_is = run_step_with_gae("copc", d, mask_low=0.0, mask_high=math.inf)
    _, areal = run_step_with_gae("areal", d, clip_high=0.28, weight_cap=math.inf)
    torch.testing.assert_close(copc_is, areal, rtol=0, atol=0)
    assert not torch.equal(copc_is, copc_binary)


def run_step_with_gae(method_name: str, d: dict[str, torch.Tensor],
                      **over: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Policy loss of a preset on the SAME (whitened GAE) advantages."""
    adv = compute_advantages(AdvantageChannelConfig(), rewards=d["rewards"], values=d["values"], log_w=None,
                             action_mask=d["action_mask"])
    policy = replace(get_method(method_name).policy, **over)  # type: ignore[arg-type]
    out = policy_loss(policy, PolicyInputs(
        logp=d["logp"], logp_old=d["logp_old"], logp_behav=d["logp_behav"], advantages=adv.advantages,
        action_mask=d["action_mask"], num_tokens=d["action_mask"].sum(),
    ))
    return adv.advantages, out.loss


# ---------------------------------------------------------------- counts and accumulation


def test_kept_denominator_counts_and_micro_batches_sum_to_full_batch() -> None:
    d = step_batch(b=8, seed=5, stale=1.0)
    policy = PolicyChannelConfig(objective="copc", mask_low=0.5, mask_high=2.0, denominator="kept")
    n_all = count_loss_tokens(replace(policy, denominator="all"), logp_old=d["logp_old"],
                              logp_behav=d["logp_behav"], action_mask=d["action_mask"])
    assert n_all == d["action_mask"].sum()
    w = torch.exp(d["logp_old"] - d["logp_behav"])
    want_kept = (d["action_mask"] & (w >= 0.5) & (w <= 2.0)).sum()
    chunks = (slice(0, 3), slice(3, 4), slice(4, 8))
    n_kept = sum(
        count_loss_tokens(policy, logp_old=d["logp_old"][c], logp_behav=d["logp_behav"][c],
                          action_mask=d["action_mask"][c])
        for c in chunks
    )
    assert n_kept == want_kept and 0 < n_kept < n_all
    adv = torch.randn(d["logp"].shape, generator=torch.Generator().manual_seed(0))
    full = policy_loss(policy, PolicyInputs(
        logp=d["logp"], logp_old=d["logp_old"], logp_behav=d["logp_behav"], advantages=adv,
        action_mask=d["action_mask"], num_tokens=n_kept))
    parts = sum(
        policy_loss(policy, PolicyInputs(
            logp=d["logp"][c], logp_old=d["logp_old"][c], logp_behav=d["logp_behav"][c], advantages=adv[c],
            action_mask=d["action_mask"][c], num_tokens=n_kept)).loss
        for c in chunks
    )
    torch.testing.assert_close(parts, full.loss, rtol=1e-6, atol=1e-7)


def test_value_loss_dispatch_matches_the_op() -> None:
    d = step_batch(seed=6)
    returns = d["values"] + torch.randn(d["values"].shape, generator=torch.Generator().manual_seed(1))
    values = d["values"] + 0.7
    for cfg in (CriticConfig(), CriticConfig(loss="huber", clip_eps=None, huber_delta=0.5)):
        got = value_loss(cfg, ValueInputs(values=values, values_old=d["values"], returns=returns,
                                          action_mask=d["action_mask"], num_tokens=None))
        want = clipped_value_loss(values, d["values"], returns, d["action_mask"], clip_eps=cfg.clip_eps,
                                  kind=cfg.loss, huber_delta=cfg.huber_delta)  # type: ignore[arg-type]
        assert torch.equal(got.loss, want.loss)
