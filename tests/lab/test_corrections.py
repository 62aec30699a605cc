"""The lab's corrections speak production's vocabulary: its tables name registry entries, its weights
are those of the production objectives, and configs the lab cannot decompose exactly are refused."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from copc.channels import ADVANTAGE_ESTIMATORS, POLICY_OBJECTIVES, AdvantageChannelConfig, PolicyChannelConfig
from copc.lab.corrections import (
    ADVANTAGE_LABEL_FIELDS,
    CRITIC_TARGET_RATIOS,
    LAB_ADVANTAGE_ESTIMATORS,
    POLICY_LABEL_FIELDS,
    Correction,
    critic_target_policy,
    run_channels,
)
from copc.lab.exact import Critic, decompose
from copc.lab.mdp import make_mdp, random_logits


def test_lab_tables_are_keyed_by_production_registry_names():
    # A renamed or added production entry fails here, so the lab cannot drift into a second vocabulary.
    assert set(POLICY_LABEL_FIELDS) == set(POLICY_OBJECTIVES.names())
    assert set(LAB_ADVANTAGE_ESTIMATORS) <= set(ADVANTAGE_ESTIMATORS.names())
    assert set(ADVANTAGE_LABEL_FIELDS) == set(LAB_ADVANTAGE_ESTIMATORS)
    assert set(CRITIC_TARGET_RATIOS) <= set(LAB_ADVANTAGE_ESTIMATORS)
    assert "group" not in LAB_ADVANTAGE_ESTIMATORS  # needs groups of samples, not single trajectories
    policy_fields = {f.name for f in dataclasses.fields(PolicyChannelConfig)}
    advantage_fields = {f.name for f in dataclasses.fields(AdvantageChannelConfig)}
    assert all(set(fields) <= policy_fields for fields in POLICY_LABEL_FIELDS.values())
    assert all(set(fields) <= advantage_fields for fields in ADVANTAGE_LABEL_FIELDS.values())


def test_label_uses_production_names():
    assert Correction().label() == (
        "copc(mask_low=0.5, mask_high=2, weight_mode=masked_is) x "
        "clipped_td(ratio_low=0.8, ratio_high=1.2, lam_actor=1)"
    )
    bypass = Correction(PolicyChannelConfig(objective="bypass_ppo", clip_low=0.1, clip_high=0.1),
                        Correction().advantage)
    assert bypass.label().startswith("bypass_ppo(clip_low=0.1, clip_high=0.1, mask_low=0, mask_high=inf) x ")


# omega_t at cur = old as a function of the exact ratio w = pi/mu and the sign of Â, worked from each
# objective's formula (docs/formulas.md) with mask (0.7, 1.3), PPO clip 0.2 both sides and weight cap 1.5:
#   ppo, pg: 1 (u = 1 inside the clip; pg has no ratio);
#   bypass_ppo: max(-A r, -A clip(r)) with r = w is flat where the clip binds, and r outside the band is
#     masked (COPC R1): w·1[0.7 <= w <= 1.3] if (A >= 0, w <= 1.2) or (A < 0, w >= 0.8), else 0;
#   decoupled (mask above the cap): w·1[w <= 1.5]; tis: min(w, 1.5);
#   icepop, copc (masked IS): w·1[0.7 <= w <= 1.3]; copc binary: 1[0.7 <= w <= 1.3];
#   dis: w·1[0.7 < w < 1.3] (strict band, no clip).
def _band(w):
    return ((w >= 0.7) & (w <= 1.3)).double()


OMEGA = {
    "ppo": lambda w, pos: torch.ones_like(w),
    "pg": lambda w, pos: torch.ones_like(w),
    "bypass_ppo": lambda w, pos: w * torch.where(pos, w <= 1.2, w >= 0.8).double() * _band(w),
    "decoupled": lambda w, pos: w * (w <= 1.5).double(),
    "tis": lambda w, pos: w.clamp(max=1.5),
    "icepop": lambda w, pos: w * _band(w),
    "copc": lambda w, pos: w * _band(w),
    "dis": lambda w, pos: w * ((w > 0.7) & (w < 1.3)).double(),
}


def test_every_production_objective_has_a_worked_weight():
    assert set(OMEGA) == set(POLICY_OBJECTIVES.names())


@pytest.mark.parametrize(("objective", "weight_mode"),
                         [(n, "masked_is") for n in sorted(OMEGA)] + [("copc", "binary")])
def test_policy_weight_of_each_objective_matches_its_formula(objective, weight_mode):
    # Random ratios spanning every band edge (w = exp(N(0, 0.4²))), advantages of both signs and size;
    # omega from autograd of production's policy_loss in float32: rel 1e-6.
    gen = torch.Generator().manual_seed(0)
    logp_mu = -torch.rand(6, 40, generator=gen, dtype=torch.float64) * 3
    logp = logp_mu + 0.4 * torch.randn(6, 40, generator=gen, dtype=torch.float64)
    adv = torch.randn(6, 40, generator=gen, dtype=torch.float64)
    rewards = torch.zeros_like(adv)
    cfg = PolicyChannelConfig(
        objective=objective, mask_low=0.7, mask_high=1.3, weight_mode=weight_mode,
        clip_low=0.2, clip_high=0.2, weight_cap=1.5,
    )
    # gae with lam = 1 and values = -adv on a one-token row gives Â = r - V = adv exactly.
    corr = Correction(cfg, AdvantageChannelConfig(estimator="gae", whiten=False))
    out = run_channels(corr, rewards.reshape(-1, 1), -adv.reshape(-1, 1), logp.reshape(-1, 1),
                       logp_mu.reshape(-1, 1))
    torch.testing.assert_close(out.advantages.reshape(adv.shape), adv, rtol=1e-6, atol=1e-7)
    w = (logp - logp_mu).exp()
    want = OMEGA[objective](w, adv >= 0)
    if weight_mode == "binary":
        want = _band(w)
    torch.testing.assert_close(out.omega.reshape(w.shape), want, rtol=1e-6, atol=1e-7)
    # edges are crossed
    assert 0 < float((want == 0).double().mean()) < 1 or objective in ("ppo", "pg", "tis")


def test_configs_the_lab_cannot_decompose_are_refused():
    with pytest.raises(ValueError, match="whiten=False"):
        Correction(PolicyChannelConfig(), AdvantageChannelConfig(estimator="gae"))
    with pytest.raises(ValueError, match="groups or no critic"):
        Correction(PolicyChannelConfig(), AdvantageChannelConfig(estimator="group", whiten=False))
    brace = AdvantageChannelConfig(estimator="brace", advantage_window=None, whiten=False)
    with pytest.raises(ValueError, match="critic 'mu' or 'pi'"):
        critic_target_policy(brace, torch.zeros(1, 2, dtype=torch.float64), torch.zeros(1, 2,
                                                                                        dtype=torch.float64))
    mdp = make_mdp("dense", 2, 2, seed=0)
    pi = random_logits(mdp, scale=0.5, seed=0)
    discounted = Correction(PolicyChannelConfig(), AdvantageChannelConfig(estimator="gae", gamma=0.9,
                                                                          whiten=False))
    with pytest.raises(ValueError, match="MDP's gamma"):
        decompose(mdp, pi, pi, discounted, Critic())
    assert math.isfinite(decompose(mdp, pi, pi, Correction(), Critic()).mse)
