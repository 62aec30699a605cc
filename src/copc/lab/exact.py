"""Exact bias and variance of a two-channel actor update on an enumerable token MDP
(docs/formulas.md#two-channels).

Notation (as :mod:`copc.lab.mdp`): ``H`` tokens, ``K`` symbols, ``M = K**H`` sequences, ``S`` prefix
states, ``J`` critic-noise draws, ``B = M·J`` enumerated (sequence, draw) rows, row ``b = m·J + j``.

The estimator of one trajectory ``tau ~ mu`` (with critic draw ``j``, uniform and independent) is

    ĝ(tau) = sum_t omega_t · Â_t · grad log pi(a_t|s_t),     grad log pi(a|s) = onehot(a) - pi(.|s) in row s

with ``omega`` and ``Â`` from the trainer's channels (:mod:`copc.lab.corrections`); a batch update is the mean
of ``N`` i.i.d. trajectories, so ``E[ĝ_N] = E[ĝ]`` and ``Cov[ĝ_N] = Cov[ĝ]/N``. All expectations are
exact sums over the ``B`` rows with probability ``mu(tau)/J``.

Bias (every term exact; the four sum to ``E[ĝ] - g*`` by construction, and a test checks it)::

    w = pi/mu (exact token ratio),  A = A^pi(s_t, a_t),  e^omega = omega - w,  e^A = Â - A
    g_tok      = E_mu[sum_t w·A·grad]                  per-token target of docs/formulas.md#two-channels
    state      = g_tok - g*                            state-distribution term (d^mu instead of d^pi;
                                                       no token-level method corrects it)
    policy     = E_mu[sum_t e^omega·A·grad]            policy channel
    advantage  = E_mu[sum_t w·e^A·grad]                advantage channel
    cross      = E_mu[sum_t e^omega·e^A·grad]          multiplicative interaction

Variance (trace of ``Cov[ĝ]`` of one trajectory). Each time step owns its own block of parameters
(the prefix states of length t), so ``X_t = omega_t Â_t grad_t`` of different steps are orthogonal and
``tr Cov[ĝ] = sum_t tr Cov[X_t]`` exactly (the cross-token covariances of docs/formulas.md#two-channels vanish
here, they are not omitted). With ``h_t`` = the prefix through ``a_t`` (the token and everything before it),
the law of total variance splits each step::

    amp = sum_t E[ ||grad_t||² · Var(omega_t Â_t | h_t) ]    = E[omega² Var(Â|h) ||grad||²] when omega
                                                               is a function of h_t (every objective but
                                                               bypass_ppo under critic noise)
    tok = sum_t tr Cov( omega_t E[Â_t|h_t] grad_t )          token/weight sampling variance

``amp`` is the squared-weight term of docs/formulas.md#two-channels ("squared policy weights amplify advantage
uncertainty"); ``amp_unweighted`` is the same with ``omega := 1``, so ``amp / amp_unweighted`` is the
amplification.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from copc.config import check_one_of, check_positive
from copc.lab.corrections import Correction, critic_target_policy, run_channels
from copc.lab.mdp import DTYPE, TokenMDP, exact_values, prefix_states, sequence_kl, token_logp, true_gradient

CRITIC_BASES: tuple[str, ...] = ("mu", "pi", "fitted")


@dataclass(frozen=True)
class Critic:
    """The critic V(s) the advantage channel is given (not :class:`copc.channels.CriticConfig`, which
    configures the value loss that trains a critic: the lab trains none).

    ``base = mu``: exact ``V^mu`` (what regression on behaviour data converges to;
    docs/formulas.md#async-ppo). ``base = pi``: exact ``V^pi`` (an oracle critic). ``base = fitted``: the
    exact fixed point of the advantage channel's own critic target (``V`` of ``pi~ ∝ mu·rho``;
    :func:`copc.lab.corrections.critic_target_policy`), i.e. a critic fully fitted to the same clipped
    returns, as COPC trains it. ``noise_std > 0``: ``V = V^base + noise_std · xi_j(s)`` with ``J`` fixed draws
    per state (seeded Gaussians, centred over the draws and rescaled by ``sqrt(J/(J-1))``, so that for every
    state the error has mean exactly 0 and expected square ``noise_std²``); each trajectory sees one draw
    uniformly at random, independently of the others. The expectation over the critic error is the exact
    average over the ``J`` draws. Centring makes the noise pure variance: the estimators are linear in V, so
    with weights that do not depend on Â it leaves E[ĝ] unchanged.
    """

    base: str = "mu"
    """``mu``, ``pi`` or ``fitted``."""
    noise_std: float = 0.0
    """Standard deviation of the per-state critic error."""
    draws: int = 1
    """J: number of enumerated noise draws (1 when noise_std is 0)."""
    seed: int = 0
    """Seed of the noise draws."""

    def __post_init__(self) -> None:
        check_one_of("critic.base", self.base, CRITIC_BASES)
        check_positive("critic", draws=self.draws)
        if self.noise_std < 0:
            raise ValueError(f"critic.noise_std must be >= 0 (0 = exact), got {self.noise_std}")
        if self.noise_std == 0 and self.draws != 1:
            raise ValueError("a noise-free critic has exactly one draw: set draws=1 or noise_std > 0")
        if self.noise_std > 0 and self.draws < 2:
            raise ValueError("a noisy critic needs draws >= 2 (the draws are centred per state), e.g. 4")

    def noise(self, num_states: int) -> torch.Tensor:
        """``[J, S]`` float64 critic errors (zeros without noise)."""
        if self.noise_std == 0:
            return torch.zeros(1, num_states, dtype=DTYPE)
        gen = torch.Generator().manual_seed(self.seed + 104729)
        xi = torch.randn(self.draws, num_states, generator=gen, dtype=DTYPE)
        xi = (xi - xi.mean(dim=0)) * math.sqrt(self.draws / (self.draws - 1))
        return self.noise_std * xi


class UpdateTerms(NamedTuple):
    """Per-token ingredients of ĝ on a batch of rows (``[B, H]`` unless stated)."""

    seqs: torch.Tensor
    """``[B, H] int64`` tokens."""
    states: torch.Tensor
    """``[B, H] int64`` logits row of the state before each token."""
    w: torch.Tensor
    """Exact ratio pi/mu."""
    adv_true: torch.Tensor
    """A^pi(s_t, a_t)."""
    omega: torch.Tensor
    """Policy weight from the ops loss."""
    adv: torch.Tensor
    """Â from the ops estimator."""
    coef: torch.Tensor
    """omega · Â."""
    score_sq: torch.Tensor
    """``||grad log pi(a_t|s_t)||² = 1 - 2 pi(a_t|s_t) + ||pi(.|s_t)||²``."""


def batch_terms(
    mdp: TokenMDP,
    pi_logits: torch.Tensor,
    mu_logits: torch.Tensor,
    seqs: torch.Tensor,
    draw: torch.Tensor,
    correction: Correction,
    critic: Critic,
) -> UpdateTerms:
    """Run both channels on given sequences ``[B, H]`` with critic draws ``draw: [B] int64``."""
    if correction.advantage.gamma != mdp.gamma:
        raise ValueError(
            f"advantage.gamma={correction.advantage.gamma:g} differs from the MDP's gamma={mdp.gamma:g}, "
            "which the exact values and g* discount with; set them equal"
        )
    states = prefix_states(seqs, mdp.vocab)
    logp = token_logp(pi_logits.detach(), seqs, states)
    logp_mu = token_logp(mu_logits.detach(), seqs, states)
    base_logits = {"mu": mu_logits, "pi": pi_logits}.get(critic.base)
    if base_logits is None:
        base_logits = critic_target_policy(correction.advantage, pi_logits, mu_logits)
    base = exact_values(mdp, base_logits).state_v
    values = base[states] + critic.noise(mdp.num_states)[draw[:, None], states]
    rewards = torch.zeros(seqs.shape, dtype=DTYPE)
    rewards[:, -1] = mdp.reward_of(seqs)
    out = run_channels(correction, rewards, values, logp, logp_mu)
    values_pi = exact_values(mdp, pi_logits)
    probs = torch.softmax(pi_logits.detach(), dim=-1)
    p_tok = logp.exp()
    score_sq = 1.0 - 2.0 * p_tok + (probs**2).sum(dim=-1)[states]
    adv_true = _gather_adv(mdp, values_pi.state_v, seqs, states)
    return UpdateTerms(
        seqs, states, (logp - logp_mu).exp(), adv_true, out.omega, out.advantages, out.coef, score_sq
    )


def _gather_adv(mdp: TokenMDP, state_v: torch.Tensor, seqs: torch.Tensor,
                states: torch.Tensor) -> torch.Tensor:
    """``A(s_t, a_t) = r_t + gamma V(s_{t+1}) - V(s_t)`` from the table of state values."""
    v = state_v[states]
    v_next = torch.zeros_like(v)
    v_next[:, :-1] = v[:, 1:]
    r = torch.zeros_like(v)
    r[:, -1] = mdp.reward_of(seqs)
    return r + mdp.gamma * v_next - v


def enumerate_terms(
    mdp: TokenMDP, pi_logits: torch.Tensor, mu_logits: torch.Tensor, correction: Correction, critic: Critic
) -> tuple[UpdateTerms, torch.Tensor]:
    """All ``B = M·J`` rows (row ``m·J + j``) and their probabilities ``mu(seq_m)/J`` (``[B]``)."""
    j = critic.draws if critic.noise_std > 0 else 1
    seqs = mdp.sequences().repeat_interleave(j, dim=0)
    draw = torch.arange(j).repeat(mdp.num_sequences)
    terms = batch_terms(mdp, pi_logits, mu_logits, seqs, draw, correction, critic)
    logp_mu = token_logp(mu_logits.detach(), seqs, terms.states).sum(dim=1)
    return terms, logp_mu.exp() / j


def weighted_gradient(
    pi_logits: torch.Tensor, seqs: torch.Tensor, states: torch.Tensor, coef: torch.Tensor, prob: torch.Tensor
) -> torch.Tensor:
    """``sum_b prob_b sum_t coef_bt (onehot(a_bt) - pi(.|s_bt))`` in the logits table. ``[S, K]``."""
    probs = torch.softmax(pi_logits.detach(), dim=-1)
    c = (prob[:, None] * coef).reshape(-1)
    rows = states.reshape(-1)
    out = torch.zeros_like(probs)
    out.index_put_((rows, seqs.reshape(-1)), c, accumulate=True)
    out.index_add_(0, rows, -c[:, None] * probs[rows])
    return out


def per_trajectory_gradients(
    pi_logits: torch.Tensor, seqs: torch.Tensor, states: torch.Tensor, coef: torch.Tensor
) -> torch.Tensor:
    """Dense ``ĝ`` of every row, flattened ``[B, S·K]`` (for covariance checks on small MDPs)."""
    probs = torch.softmax(pi_logits.detach(), dim=-1)
    s, k = probs.shape
    b, h = seqs.shape
    out = torch.zeros(b, s, k, dtype=DTYPE)
    idx = torch.arange(b)[:, None].expand(b, h)
    out.index_put_((idx.reshape(-1), states.reshape(-1), seqs.reshape(-1)), coef.reshape(-1), accumulate=True)
    out[idx.reshape(-1), states.reshape(-1)] -= coef.reshape(-1)[:, None] * probs[states.reshape(-1)]
    return out.reshape(b, s * k)


def conditional_mean(x: torch.Tensor, prob: torch.Tensor, block: int) -> torch.Tensor:
    """``E[x | row's block]`` over contiguous blocks of ``block`` rows, broadcast back. ``[B]``.

    Rows sharing a prefix of length ``t+1`` are contiguous blocks of ``K**(H-t-1)·J`` rows.
    """
    px = (prob * x).reshape(-1, block).sum(dim=1)
    p = prob.reshape(-1, block).sum(dim=1)
    return (px / p).repeat_interleave(block)


@dataclass(frozen=True, eq=False)
class Decomposition:
    """Exact bias and variance of one correction on one (mdp, pi, mu, critic). Vectors are ``[S, K]``."""

    g_star: torch.Tensor
    """True gradient grad J(pi)."""
    mean_update: torch.Tensor
    """E[ĝ] for one trajectory."""
    state_term: torch.Tensor
    """g_tok - g*: state-distribution mismatch."""
    policy_term: torch.Tensor
    """E[e^omega · A · grad]."""
    advantage_term: torch.Tensor
    """E[w · e^A · grad]."""
    cross_term: torch.Tensor
    """E[e^omega · e^A · grad]."""
    var_amp: float
    """sum_t E[||grad||² Var(omega Â | h_t)]: squared-weight x advantage-uncertainty term."""
    var_tok: float
    """sum_t tr Cov(omega E[Â|h_t] grad): token and weight sampling term."""
    var_amp_unweighted: float
    """var_amp with omega := 1 (advantage uncertainty before weighting)."""
    batch_size: int
    """N trajectories per update."""
    kl: float
    """KL(pi || mu) over whole sequences (nats)."""
    mask_rate: float
    """E_mu fraction of tokens with omega = 0."""
    mean_omega_sq: float
    """E_mu token mean of omega²."""

    @property
    def bias(self) -> torch.Tensor:
        return self.mean_update - self.g_star

    @property
    def var_trace(self) -> float:
        """tr Cov[ĝ] of one trajectory (= var_amp + var_tok exactly)."""
        return self.var_amp + self.var_tok

    @property
    def mse(self) -> float:
        """``E||ĝ_N - g*||² = ||bias||² + tr Cov[ĝ]/N``."""
        return float(self.bias.pow(2).sum()) + self.var_trace / self.batch_size

    @property
    def cosine(self) -> float:
        """cos(E[ĝ], g*); 0 when either is 0."""
        den = float(self.mean_update.norm() * self.g_star.norm())
        return float((self.mean_update * self.g_star).sum()) / den if den > 0 else 0.0

    def summary(self) -> dict[str, float]:
        """Every scalar figure, JSON-ready."""
        g2 = float(self.g_star.pow(2).sum())
        norm = lambda v: float(v.norm())  # noqa: E731
        return {
            "g_star_norm": math.sqrt(g2),
            "mean_update_norm": norm(self.mean_update),
            "bias_norm": norm(self.bias),
            "state_norm": norm(self.state_term),
            "policy_norm": norm(self.policy_term),
            "advantage_norm": norm(self.advantage_term),
            "cross_norm": norm(self.cross_term),
            "var_trace": self.var_trace,
            "var_amp": self.var_amp,
            "var_tok": self.var_tok,
            "var_amp_unweighted": self.var_amp_unweighted,
            "batch_size": float(self.batch_size),
            "mse": self.mse,
            "relative_mse": self.mse / g2 if g2 > 0 else math.inf,
            "cosine": self.cosine,
            "kl": self.kl,
            "mask_rate": self.mask_rate,
            "mean_omega_sq": self.mean_omega_sq,
        }


def _variance_split(
    mdp: TokenMDP, pi_logits: torch.Tensor, terms: UpdateTerms, prob: torch.Tensor, j: int
) -> tuple[float, float, float]:
    """(amp, tok, amp_unweighted) by the per-step law of total variance (module docstring)."""
    amp = tok = amp_unw = 0.0
    for t in range(mdp.horizon):
        block = mdp.vocab ** (mdp.horizon - t - 1) * j
        c, s2, a = terms.coef[:, t], terms.score_sq[:, t], terms.adv[:, t]
        c_mean = conditional_mean(c, prob, block)
        a_mean = conditional_mean(a, prob, block)
        amp += float((prob * s2 * (c - c_mean) ** 2).sum())
        amp_unw += float((prob * s2 * (a - a_mean) ** 2).sum())
        coef_t = torch.zeros_like(terms.coef)
        coef_t[:, t] = c
        mean_t = weighted_gradient(pi_logits, terms.seqs, terms.states, coef_t, prob)
        tok += float((prob * s2 * c_mean**2).sum()) - float(mean_t.pow(2).sum())
    return amp, tok, amp_unw


def decompose(
    mdp: TokenMDP,
    pi_logits: torch.Tensor,
    mu_logits: torch.Tensor,
    correction: Correction,
    critic: Critic | None = None,
    *,
    batch_size: int = 64,
) -> Decomposition:
    """Exact E[ĝ], its four-way bias split and the variance split (module docstring)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    critic = Critic() if critic is None else critic
    terms, prob = enumerate_terms(mdp, pi_logits, mu_logits, correction, critic)
    j = critic.draws if critic.noise_std > 0 else 1
    grad = lambda coef: weighted_gradient(pi_logits, terms.seqs, terms.states, coef, prob)  # noqa: E731
    e_w, e_a = terms.omega - terms.w, terms.adv - terms.adv_true
    g_star = true_gradient(mdp, pi_logits)
    amp, tok, amp_unw = _variance_split(mdp, pi_logits, terms, prob, j)
    masked = (terms.omega == 0).to(DTYPE)
    return Decomposition(
        g_star=g_star,
        mean_update=grad(terms.coef),
        state_term=grad(terms.w * terms.adv_true) - g_star,
        policy_term=grad(e_w * terms.adv_true),
        advantage_term=grad(terms.w * e_a),
        cross_term=grad(e_w * e_a),
        var_amp=amp,
        var_tok=tok,
        var_amp_unweighted=amp_unw,
        batch_size=batch_size,
        kl=sequence_kl(mdp, pi_logits, mu_logits),
        mask_rate=float((prob[:, None] * masked).sum()) / mdp.horizon,
        mean_omega_sq=float((prob[:, None] * terms.omega**2).sum()) / mdp.horizon,
    )
