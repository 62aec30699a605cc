"""Exact MDP machinery of the lab: enumeration, values, true gradient, staleness constructors."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from copc.lab.mdp import (
    REWARD_FAMILIES,
    TokenMDP,
    behaviour_at_kl,
    enumerate_sequences,
    exact_values,
    gradient_path,
    make_mdp,
    objective,
    policy_gradient_theorem,
    prefix_states,
    random_logits,
    sample_sequences,
    sequence_kl,
    sequence_log_probs,
    true_gradient,
)


def test_enumeration_and_prefix_rows_golden():
    # H=2, K=2: sequences 00, 01, 10, 11; states: root = row 0, prefix "0" = row 1, prefix "1" = row 2.
    seqs = enumerate_sequences(2, 2)
    assert seqs.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert prefix_states(seqs, 2).tolist() == [[0, 1], [0, 1], [0, 2], [0, 2]]


def test_values_golden_two_token_mdp():
    # R(00)=1, R(01)=0.5, R(10)=0, R(11)=2; pi(1|root) = 1/2 (logits 0, 0), pi(1|"0") = e/(1+e) =: p,
    # pi(1|"1") = 1/2. V("0") = 1·(1 - p) + 0.5·p; V("1") = (0 + 2)/2 = 1;
    # J = V(root) = (V("0") + V("1"))/2; A(root, 1) = V("1") - J.
    mdp = TokenMDP(horizon=2, vocab=2, rewards=torch.tensor([1.0, 0.5, 0.0, 2.0], dtype=torch.float64))
    logits = torch.tensor([[0.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    p = math.e / (1 + math.e)
    v0 = 1 - p + 0.5 * p
    j = (v0 + 1.0) / 2
    vals = exact_values(mdp, logits)
    assert float(vals.j) == pytest.approx(j, abs=1e-15)
    assert vals.state_v.tolist() == pytest.approx([j, v0, 1.0], abs=1e-15)
    # sequence 11: A(root, 1) = V("1") - J; A("1", 1) = R(11) - V("1") = 1.
    assert vals.adv[3].tolist() == pytest.approx([1.0 - j, 1.0], abs=1e-15)
    assert float(objective(mdp, logits)) == pytest.approx(j, abs=1e-15)


@pytest.mark.parametrize("family", REWARD_FAMILIES)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_true_gradient_matches_policy_gradient_theorem(family, gamma):
    # autograd through the exact backward induction vs d^pi(s) pi(a|s) A(s, a): float64 round-off only.
    mdp = make_mdp(family, 4, 3, seed=1, gamma=gamma)
    logits = random_logits(mdp, scale=1.0, seed=2)
    torch.testing.assert_close(true_gradient(mdp, logits), policy_gradient_theorem(mdp, logits), rtol=0,
                               atol=1e-14)


def test_true_gradient_matches_finite_differences():
    # central differences, step 1e-6: truncation error O(h²) ~ 1e-12 and round-off ~1e-16/1e-6 = 1e-10.
    mdp = make_mdp("deceptive", 3, 2, seed=0)
    logits = random_logits(mdp, seed=3)
    g = true_gradient(mdp, logits)
    h = 1e-6
    for s, a in [(0, 0), (1, 1), (5, 0), (6, 1)]:
        plus, minus = logits.clone(), logits.clone()
        plus[s, a] += h
        minus[s, a] -= h
        fd = (objective(mdp, plus) - objective(mdp, minus)) / (2 * h)
        assert float(fd) == pytest.approx(float(g[s, a]), abs=1e-9)


def test_sampler_matches_enumerated_probabilities():
    # 20,000 sequences of a K^H = 27 MDP: every count within 5 binomial standard errors of n·p
    # (27 cells; P(|z| > 5) ~ 6e-7 per cell, fixed seed).
    mdp = make_mdp("dense", 3, 3, seed=0)
    logits = random_logits(mdp, scale=1.0, seed=4)
    n = 20_000
    seqs = sample_sequences(mdp, logits, n, generator=torch.Generator().manual_seed(0))
    codes = (seqs * torch.tensor([9, 3, 1])).sum(dim=1)
    counts = torch.bincount(codes, minlength=27).double()
    p = sequence_log_probs(mdp, logits).exp()
    assert float(p.sum()) == pytest.approx(1.0, abs=1e-12)
    se = (n * p * (1 - p)).sqrt()
    assert bool(((counts - n * p).abs() <= 5 * se).all())


def test_exact_values_match_monte_carlo_returns():
    # V^pi(root) = E_pi[R]: 20,000 rollouts, tolerance 4 standard errors of the sample mean.
    mdp = make_mdp("sparse", 4, 2, seed=0)
    logits = random_logits(mdp, scale=1.0, seed=5)
    seqs = sample_sequences(mdp, logits, 20_000, generator=torch.Generator().manual_seed(1))
    r = mdp.reward_of(seqs)
    assert abs(float(r.mean() - exact_values(mdp, logits).j)) <= 4 * float(r.std()) / math.sqrt(len(r))


def test_behaviour_at_kl_hits_the_target():
    mdp = make_mdp("dense", 4, 3, seed=0)
    pi = random_logits(mdp, seed=6)
    for target in (0.01, 0.1, 0.5):
        mu = behaviour_at_kl(mdp, pi, target, seed=1)
        assert sequence_kl(mdp, pi, mu) == pytest.approx(target, rel=1e-4)
    assert torch.equal(behaviour_at_kl(mdp, pi, 0.0), pi)


def test_gradient_path_increases_the_objective_and_grows_staleness():
    mdp = make_mdp("deceptive", 4, 3, seed=0)
    path = gradient_path(mdp, random_logits(mdp, scale=0.5, seed=1), steps=12, lr=2.0)
    js = [float(objective(mdp, theta)) for theta in path]
    assert all(b > a for a, b in itertools.pairwise(js))
    kls = [sequence_kl(mdp, path[-1], path[-1 - s]) for s in (1, 4, 12)]
    assert kls[0] < kls[1] < kls[2]


def test_bad_inputs_say_what_to_do():
    with pytest.raises(ValueError, match="reward family"):
        make_mdp("nope", 3, 2)
    with pytest.raises(ValueError, match="too many"):
        make_mdp("dense", 12, 4)
