"""Exact two-channel decomposition: identities, reductions, and agreement with Monte-Carlo sampling.

Tolerances: the channels run in float32 inside ``copc.ops`` (the trainer's dtype), so figures that pass
through them carry relative round-off ~1e-7; identities that are algebraic on the same float64 tensors
hold to ~1e-15. Monte-Carlo checks use k = 4 standard errors computed from the EXACT covariance (not
estimated): for a mean of 4,000 bounded i.i.d. terms the CLT is accurate, and P(|z| > 4) ~ 6e-5 per
check, so the ~40 checks below have a family-wise false-alarm rate < 0.3 % (seeds are fixed anyway,
so a pass is reproducible; a bug that moves a figure by more than ~4 SE fails).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from copc.channels import (
    POLICY_OBJECTIVES,
    AdvantageChannelConfig,
    PolicyChannelConfig,
    PolicyInputs,
    policy_loss,
)
from copc.lab.corrections import (
    LAB_ADVANTAGE_ESTIMATORS,
    Correction,
    critic_target_policy,
    update_coefficients,
)
from copc.lab.exact import (
    Critic,
    batch_terms,
    conditional_mean,
    decompose,
    enumerate_terms,
    per_trajectory_gradients,
    weighted_gradient,
)
from copc.lab.mdp import (
    exact_values,
    gradient_path,
    level_offset,
    level_tables,
    make_mdp,
    prefix_states,
    random_logits,
    sample_sequences,
    token_logp,
)
from lab.oracle import brace_loop, clipped_td_loop, gae_loop, vtrace_loop

#: Every production objective, plus COPC's pure-mask variant (weight_mode="binary").
POLICIES: list[tuple[str, str]] = [(name, "masked_is") for name in POLICY_OBJECTIVES.names()] + [("copc",
                                                                                                  "binary")]
POLICY_IDS = [name if mode == "masked_is" else f"{name}-{mode}" for name, mode in POLICIES]


@pytest.fixture(scope="module")
def setup():
    """Dense-reward MDP (H=4, K=3), pi 12 exact gradient steps in, mu = pi 6 steps earlier."""
    mdp = make_mdp("dense", 4, 3, seed=0)
    path = gradient_path(mdp, random_logits(mdp, scale=0.5, seed=1), steps=12, lr=8.0)
    return mdp, path[-1], path[-7]


def _corr(policy: str, advantage: str, weight_mode: str = "masked_is") -> Correction:
    pol = PolicyChannelConfig(
        objective=policy, mask_low=0.7, mask_high=1.3, weight_mode=weight_mode, clip_low=0.2, clip_high=0.2
    )
    adv = AdvantageChannelConfig(
        estimator=advantage, lam_critic=0.9, lam_actor=0.9, ratio_low=0.8, ratio_high=1.2, rho_bar=1.2,
        c_bar=1.0,
        brace_k=2, whiten=False,
    )
    return Correction(pol, adv)


def per_token_loss(cfg, logp, logp_behav, advantages, mask):
    """The trainer's per-token actor loss at the step start (old = cur), straight from production."""
    out = policy_loss(cfg, PolicyInputs(
        logp=logp, logp_old=logp.detach(), logp_behav=logp_behav, advantages=advantages, action_mask=mask,
        num_tokens=None,
    ))
    return out.per_token


def _dense_cov(mdp, pi, terms, prob):
    g = per_trajectory_gradients(pi, terms.seqs, terms.states, terms.coef)
    mean = (prob[:, None] * g).sum(dim=0)
    centred = g - mean
    return mean, (prob[:, None] * centred).T @ centred


#: Â of each estimator from the per-token loops of tests/reference, with _corr's parameters.
ADVANTAGE_ORACLES = {
    "gae": lambda r, v, lr: gae_loop(r, v, gamma=1.0, lam=0.9)[0],
    "vtrace": lambda r, v, lr: vtrace_loop(r, v, lr, gamma=1.0, lam=0.9, rho_bar=1.2, c_bar=1.0,
                                           pg_rho_bar=1.0)[1],
    "clipped_td": lambda r, v, lr: clipped_td_loop(
        r, v, lr, gamma=1.0, lam_critic=0.9, lam_actor=0.9, low=0.8, high=1.2
    )[0],
    "brace": lambda r, v, lr: brace_loop(r, v, lr, gamma=1.0, lam=0.9, rho_bar=1.2, c_bar=1.0, k=2)[0],
}


def test_every_lab_estimator_has_an_oracle():
    assert set(ADVANTAGE_ORACLES) == set(LAB_ADVANTAGE_ESTIMATORS)


def test_advantages_through_the_channel_match_the_spec_loops(setup):
    # Â of every enumerated row vs the per-token Python loops of the spec (float32 channel: abs 2e-6 on
    # values of size <= ~2).
    mdp, pi, mu = setup
    critic = Critic(base="mu", noise_std=0.1, draws=2, seed=3)
    for kind in LAB_ADVANTAGE_ESTIMATORS:
        terms, _ = enumerate_terms(mdp, pi, mu, _corr("ppo", kind), critic)
        logp = token_logp(pi, terms.seqs, terms.states)
        log_rho = logp - token_logp(mu, terms.seqs, terms.states)
        rewards = torch.zeros_like(logp)
        rewards[:, -1] = mdp.reward_of(terms.seqs)
        # the critic values, rebuilt as batch_terms does (V^mu + the draw's noise)
        draw = torch.arange(2).repeat(mdp.num_sequences)
        values = exact_values(mdp, mu).state_v[terms.states] + critic.noise(
            mdp.num_states)[draw[:, None], terms.states]
        want = ADVANTAGE_ORACLES[kind](rewards, values, log_rho)
        torch.testing.assert_close(terms.adv, want, rtol=0, atol=2e-6, msg=kind)


@pytest.mark.parametrize(("policy", "weight_mode"), POLICIES, ids=POLICY_IDS)
def test_analytic_update_equals_autograd_of_the_channel_loss(setup, policy, weight_mode):
    # Per-row ĝ from the per-token coefficients x tabular score == -grad_theta of the row's summed
    # policy_loss, with the log-probs computed from theta by log_softmax (float32 inside: rel 1e-6).
    mdp, pi, mu = setup
    corr = _corr(policy, "clipped_td", weight_mode)
    terms, _ = enumerate_terms(mdp, pi, mu, corr, Critic())
    # omega · Â == coefficient of the loss at the actual Â (homogeneity of every loss in Â)
    logp = token_logp(pi, terms.seqs, terms.states)
    logp_mu = token_logp(mu, terms.seqs, terms.states)
    coef = update_coefficients(corr.policy, logp, logp_mu, terms.adv.float(),
                               torch.ones_like(logp, dtype=torch.bool))
    torch.testing.assert_close(coef, terms.coef, rtol=1e-6, atol=1e-9)
    dense = per_trajectory_gradients(pi, terms.seqs, terms.states, terms.coef)
    mask = torch.ones(1, mdp.horizon, dtype=torch.bool)
    for b in range(0, len(terms.seqs), 7):
        theta = pi.clone().requires_grad_(True)
        row_logp = token_logp(theta, terms.seqs[b : b + 1], terms.states[b : b + 1])
        loss = per_token_loss(corr.policy, row_logp, logp_mu[b : b + 1], terms.adv[b : b + 1].float(),
                              mask).sum()
        (grad,) = torch.autograd.grad(-loss, theta)
        torch.testing.assert_close(dense[b], grad.reshape(-1), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("policy", "weight_mode"), POLICIES, ids=POLICY_IDS)
@pytest.mark.parametrize("advantage", LAB_ADVANTAGE_ESTIMATORS)
def test_bias_terms_sum_to_the_bias(setup, policy, weight_mode, advantage):
    # state + policy + advantage + cross == E[ĝ] - g*: exact algebra on the same float64 tensors.
    mdp, pi, mu = setup
    d = decompose(mdp, pi, mu, _corr(policy, advantage, weight_mode), Critic(noise_std=0.05, draws=3))
    total = d.state_term + d.policy_term + d.advantage_term + d.cross_term
    torch.testing.assert_close(total, d.bias, rtol=0, atol=1e-15)


@pytest.mark.parametrize("policy", ["ppo", "bypass_ppo", "copc"])
def test_variance_split_matches_dense_covariance(setup, policy):
    # tr Cov[ĝ] from the dense [B, P] per-row gradients == amp + tok (per-step law of total variance and
    # orthogonal time blocks); float64 on both sides, rel 1e-10.
    mdp, pi, mu = setup
    corr = _corr(policy, "clipped_td")
    critic = Critic(noise_std=0.1, draws=3, seed=1)
    d = decompose(mdp, pi, mu, corr, critic)
    terms, prob = enumerate_terms(mdp, pi, mu, corr, critic)
    mean, cov = _dense_cov(mdp, pi, terms, prob)
    torch.testing.assert_close(mean.reshape(d.mean_update.shape), d.mean_update, rtol=0, atol=1e-15)
    assert d.var_trace == pytest.approx(float(cov.trace()), rel=1e-10)
    assert d.var_amp > 0 and d.var_tok > 0


def test_squared_weight_term_is_omega_squared_times_advantage_variance(setup):
    # For copc (masked IS), omega is a function of (s_t, a_t), so amp = sum_t E[omega² Var(Â|h_t) ||grad||²];
    # computed here with an independent per-prefix loop (dictionary of prefixes).
    mdp, pi, mu = setup
    corr = _corr("copc", "clipped_td")
    critic = Critic(noise_std=0.2, draws=2, seed=5)
    d = decompose(mdp, pi, mu, corr, critic)
    terms, prob = enumerate_terms(mdp, pi, mu, corr, critic)
    amp = 0.0
    for t in range(mdp.horizon):
        groups: dict[tuple[int, ...], list[int]] = {}
        for b in range(len(prob)):
            groups.setdefault(tuple(terms.seqs[b, : t + 1].tolist()), []).append(b)
        for rows in groups.values():
            p = prob[rows]
            a = terms.adv[rows, t]
            var = float((p * (a - (p * a).sum() / p.sum()) ** 2).sum() / p.sum())
            om, s2 = float(terms.omega[rows[0], t]), float(terms.score_sq[rows[0], t])
            amp += float(p.sum()) * om**2 * var * s2
    assert d.var_amp == pytest.approx(amp, rel=1e-10)


def test_on_policy_reinforce_with_any_baseline_is_unbiased(setup):
    # mu = pi, omega = 1, GAE(lambda = 1, gamma = 1): Â_t = R - V(s_t), and a baseline that depends only
    # on the state (even a noisy one) adds no bias: E[ĝ] = g*, every bias term 0 (float32 Â: atol 1e-8
    # on entries of size ~1e-2).
    mdp, pi, _ = setup
    corr = Correction(PolicyChannelConfig(objective="ppo"), AdvantageChannelConfig(estimator="gae",
                                                                                   whiten=False))
    for critic in (Critic(base="pi"), Critic(base="mu", noise_std=0.3, draws=4)):
        d = decompose(mdp, pi, pi, corr, critic)
        torch.testing.assert_close(d.mean_update, d.g_star, rtol=0, atol=1e-8)
        assert d.kl == 0.0 and d.mask_rate == 0.0
    with_noise = decompose(mdp, pi, pi, corr, Critic(base="pi", noise_std=0.3, draws=4))
    exact = decompose(mdp, pi, pi, corr, Critic(base="pi"))
    assert with_noise.var_amp > exact.var_amp  # the noisy baseline only adds variance


def test_exact_critic_and_full_is_leave_only_the_state_term(setup):
    # Critic V^pi with no clip and per-token IS weights: Â has E[Â|h_t] = A^pi only for the last token,
    # but the policy channel error vanishes: omega = w exactly (copc masked IS with an infinite band).
    mdp, pi, mu = setup
    corr = Correction(
        PolicyChannelConfig(objective="copc", mask_low=0.0, mask_high=float("inf")),
        AdvantageChannelConfig(estimator="gae", whiten=False),
    )
    d = decompose(mdp, pi, mu, corr, Critic(base="pi"))
    assert float(d.policy_term.abs().max()) < 1e-7 * float(d.g_star.abs().max()) + 1e-12
    assert float(d.state_term.norm()) > 0  # d^mu != d^pi: no token-level weight removes it


def _mc_rows(mdp, pi, mu, corr, critic, n, seed):
    gen = torch.Generator().manual_seed(seed)
    seqs = sample_sequences(mdp, mu, n, generator=gen)
    j = critic.draws if critic.noise_std > 0 else 1
    draw = torch.randint(j, (n,), generator=gen)
    return batch_terms(mdp, pi, mu, seqs, draw, corr, critic)


@pytest.mark.parametrize(
    ("policy", "advantage", "critic"),
    [
        ("copc", "clipped_td", Critic(base="mu", noise_std=0.2, draws=4, seed=2)),
        ("bypass_ppo", "gae", Critic(base="mu")),
        ("decoupled", "vtrace", Critic(base="pi", noise_std=0.1, draws=3, seed=4)),
    ],
)
def test_exact_figures_match_monte_carlo(setup, policy, advantage, critic):
    mdp, pi, mu = setup
    corr = _corr(policy, advantage)
    n = 4000
    d = decompose(mdp, pi, mu, corr, critic, batch_size=n)
    terms, prob = enumerate_terms(mdp, pi, mu, corr, critic)
    mean, cov = _dense_cov(mdp, pi, terms, prob)
    sample = _mc_rows(mdp, pi, mu, corr, critic, n, seed=11)

    # 1. Mean update by autograd of the ops loss on the sampled batch: -grad (sum of losses) / n.
    theta = pi.clone().requires_grad_(True)
    states = prefix_states(sample.seqs, mdp.vocab)
    logp = token_logp(theta, sample.seqs, states)
    logp_mu = token_logp(mu, sample.seqs, states)
    mask = torch.ones(logp.shape, dtype=torch.bool)
    loss = per_token_loss(corr.policy, logp, logp_mu, sample.adv.float(), mask).sum() / n
    (g_mc,) = torch.autograd.grad(-loss, theta)
    gen = torch.Generator().manual_seed(0)
    directions = [d.g_star, d.mean_update, *[torch.randn(d.g_star.shape, generator=gen,
                                                         dtype=torch.float64) for _ in range(3)]]
    for v in directions:
        v = v.reshape(-1)
        se = float(v @ cov @ v / n) ** 0.5
        assert abs(float(v @ (g_mc.reshape(-1) - d.mean_update.reshape(-1)))) <= 4 * se

    # 2. Each bias term: sample means of its per-row integrand vs the exact vector, along g*.
    rows = per_trajectory_gradients
    e_w, e_a = sample.omega - sample.w, sample.adv - sample.adv_true
    exact_e_w, exact_e_a = terms.omega - terms.w, terms.adv - terms.adv_true
    for name, mc_coef, ex_coef, exact in [
        ("policy", e_w * sample.adv_true, exact_e_w * terms.adv_true, d.policy_term),
        ("advantage", sample.w * e_a, terms.w * exact_e_a, d.advantage_term),
        ("cross", e_w * e_a, exact_e_w * exact_e_a, d.cross_term),
    ]:
        per_row = rows(pi, sample.seqs, sample.states, mc_coef) @ d.g_star.reshape(-1)
        ex_rows = rows(pi, terms.seqs, terms.states, ex_coef) @ d.g_star.reshape(-1)
        ex_mean = float((prob * ex_rows).sum())
        assert ex_mean == pytest.approx(float((exact * d.g_star).sum()), rel=1e-9, abs=1e-15), name
        sd = float((prob * (ex_rows - ex_mean) ** 2).sum()) ** 0.5
        assert abs(float(per_row.mean()) - ex_mean) <= 4 * sd / n**0.5 + 1e-15, name

    # 3. Variance: Y = ||ĝ - E ĝ||² has E[Y] = tr Cov exactly; its exact spread gives the SE.
    y_mc = (rows(pi, sample.seqs, sample.states, sample.coef) - mean).pow(2).sum(dim=1)
    y_ex = (rows(pi, terms.seqs, terms.states, terms.coef) - mean).pow(2).sum(dim=1)
    sd_y = float((prob * (y_ex - d.var_trace) ** 2).sum()) ** 0.5
    assert abs(float(y_mc.mean()) - d.var_trace) <= 4 * sd_y / n**0.5


def test_conditional_mean_golden():
    # two blocks of two rows: E[x | block] = (0.1·1 + 0.3·3)/0.4 = 2.5 and (0.2·5 + 0.4·7)/0.6 = 19/3.
    x = torch.tensor([1.0, 3.0, 5.0, 7.0], dtype=torch.float64)
    p = torch.tensor([0.1, 0.3, 0.2, 0.4], dtype=torch.float64)
    got = conditional_mean(x, p, 2)
    torch.testing.assert_close(got, torch.tensor([2.5, 2.5, 19 / 3, 19 / 3], dtype=torch.float64))


def test_weighted_gradient_golden():
    # one row, H=1, K=2, pi(.|root) = (1/2, 1/2), token 1 with coefficient 2 and probability 1:
    # 2·(onehot(1) - pi) = (-1, 1).
    logits = torch.zeros(1, 2, dtype=torch.float64)
    seqs = torch.tensor([[1]])
    got = weighted_gradient(logits, seqs, torch.zeros_like(seqs), torch.tensor([[2.0]], dtype=torch.float64),
                            torch.ones(1, dtype=torch.float64))
    torch.testing.assert_close(got, torch.tensor([[-1.0, 1.0]], dtype=torch.float64))


def test_zero_mean_critic_noise_changes_only_the_variance(setup):
    # The J draws are centred per state and every estimator is linear in V, while the copc (masked IS)
    # weight does not depend on Â: E[ĝ] is that of the exact critic (float32 Â: abs error <= ~1e-7 per
    # token, a probability-weighted sum of them: atol 5e-8),
    # and the squared-weight variance term grows.
    mdp, pi, mu = setup
    corr = _corr("copc", "clipped_td")
    exact = decompose(mdp, pi, mu, corr, Critic())
    noisy = decompose(mdp, pi, mu, corr, Critic(noise_std=0.2, draws=3, seed=7))
    torch.testing.assert_close(noisy.mean_update, exact.mean_update, rtol=0, atol=5e-8)
    noise = Critic(noise_std=0.2, draws=3, seed=7).noise(mdp.num_states)
    torch.testing.assert_close(noise.mean(dim=0), torch.zeros(mdp.num_states, dtype=torch.float64), rtol=0,
                               atol=1e-15)
    assert noisy.var_amp > exact.var_amp and noisy.var_tok == pytest.approx(exact.var_tok, rel=1e-5)


@pytest.mark.parametrize(
    ("policy", "critic"),
    [("copc", Critic(base="mu", noise_std=0.2, draws=4, seed=2)), ("bypass_ppo", Critic(base="mu"))],
)
def test_variance_split_matches_monte_carlo(setup, policy, critic):
    # amp = sum_t E[||grad_t||² Var(c_t | h_t)]: for each sampled trajectory and step t, a second
    # continuation is drawn from mu after the same prefix h_t (through a_t), with a fresh critic draw;
    # ||grad_t||² (c_t - c_t')² / 2 is then unbiased for ||grad_t||² Var(c_t | h_t). tok = tr Cov - amp.
    # 3,000 trajectories; 4 standard errors of the sample mean, with the SE estimated from the sample
    # (this statistic's exact spread would need the joint law of the pair).
    mdp, pi, mu = setup
    corr = _corr(policy, "clipped_td")
    d = decompose(mdp, pi, mu, corr, critic)
    n = 3000
    gen = torch.Generator().manual_seed(21)
    j = critic.draws if critic.noise_std > 0 else 1
    first = batch_terms(mdp, pi, mu, sample_sequences(mdp, mu, n, generator=gen),
                        torch.randint(j, (n,), generator=gen), corr, critic)
    y = torch.zeros(n, dtype=torch.float64)
    for t in range(mdp.horizon):
        again = sample_sequences(mdp, mu, n, generator=gen, prefix=first.seqs[:, : t + 1])
        second = batch_terms(mdp, pi, mu, again, torch.randint(j, (n,), generator=gen), corr, critic)
        torch.testing.assert_close(second.score_sq[:, t], first.score_sq[:, t])
        y += first.score_sq[:, t] * (first.coef[:, t] - second.coef[:, t]) ** 2 / 2
    assert abs(float(y.mean()) - d.var_amp) <= 4 * float(y.std()) / n**0.5


@pytest.mark.parametrize(
    "advantage",
    [
        AdvantageChannelConfig(estimator="clipped_td", ratio_low=0.8, ratio_high=1.2, whiten=False),
        AdvantageChannelConfig(estimator="clipped_td", ratio_low=0.5, ratio_high=2.0, whiten=False),
        AdvantageChannelConfig(estimator="vtrace", rho_bar=1.0, c_bar=1.0, whiten=False),
    ],
)
def test_fitted_critic_is_the_fixed_point_of_the_channels_target(setup, advantage):
    # V of pi~ ∝ mu·rho makes the expected weighted TD residual vanish in every state:
    # E_mu[rho(a|s) (r + V(s') - V(s)) | s] = 0, checked exactly on the tables (rho in float32: 1e-6).
    mdp, pi, mu = setup
    tilde = critic_target_policy(advantage, pi, mu)
    vs, qs = level_tables(mdp, tilde)
    w = torch.softmax(pi, dim=-1) / torch.softmax(mu, dim=-1)
    rho = w.clamp(advantage.ratio_low,
                  advantage.ratio_high) if advantage.estimator == "clipped_td" else w.clamp(max=1.0)
    p_mu = torch.softmax(mu, dim=-1)
    for t in range(mdp.horizon):
        rows = slice(level_offset(t, mdp.vocab), level_offset(t + 1, mdp.vocab))
        residual = (p_mu[rows] * rho[rows] * (qs[t] - vs[t][:, None])).sum(dim=-1)
        assert float(residual.abs().max()) < 1e-6
    # degenerate ends: eps_A = 0 is V^mu, no clip is V^pi
    clip = AdvantageChannelConfig(estimator="clipped_td", whiten=False)
    gae_like = critic_target_policy(dataclasses.replace(clip, ratio_low=1.0, ratio_high=1.0), pi, mu)
    full = critic_target_policy(dataclasses.replace(clip, ratio_low=0.0, ratio_high=float("inf")), pi, mu)
    torch.testing.assert_close(torch.softmax(gae_like, -1), torch.softmax(mu, -1), rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.softmax(full, -1), torch.softmax(pi, -1), rtol=0, atol=1e-6)
    d = decompose(mdp, pi, mu, Correction(PolicyChannelConfig(objective="copc"), advantage),
                  Critic(base="fitted"))
    assert torch.isfinite(d.mean_update).all()
