"""Small token-level MDPs that can be enumerated exactly, with tabular softmax policies.

Notation: ``H`` tokens per sequence, ``K`` vocabulary size, ``M = K**H`` complete sequences, ``S`` prefix
states (all prefixes of length ``t < H``: ``S = sum_{t<H} K**t``), ``P = S*K`` policy parameters.

* A sequence is ``(a_0, ..., a_{H-1})``; state ``s_t`` is its prefix of length ``t``. Sequences are
  enumerated in base-K order with the first token most significant, so the ``K**(t+1)`` prefixes of
  length ``t+1`` are contiguous blocks of ``K**(H-t-1)`` sequences (used to condition on a prefix by a
  reshape). The prefix states of length ``t`` occupy rows ``offset_t .. offset_t + K**t - 1`` of the
  logits table ``theta: [S, K]`` (``offset_t = sum_{i<t} K**i``); child ``a`` of prefix ``p`` at length
  ``t`` is prefix ``p*K + a`` at length ``t+1``.
* The reward is terminal: ``r_t = R(sequence)·1[t = H-1]``; ``V(s_H) = 0``.
* A policy is ``pi(a|s) = softmax(theta[s])``; ``d/dtheta[s] log pi(a|s) = onehot(a) - pi(.|s)``.

Exact values by backward induction over prefix length::

    Q_{H-1}(s, a) = R(s + a),   V_t(s) = sum_a pi(a|s) Q_t(s, a),   Q_{t-1}(s, a) = gamma · V_t(s + a)

``J(pi) = V_0(root)`` and ``grad J = d^pi(s) · pi(a|s) · A^pi(s, a)`` per table entry (policy-gradient
theorem for a tabular softmax; ``d^pi(s) = gamma^t · pi(prefix s)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

REWARD_FAMILIES: tuple[str, ...] = ("sparse", "dense", "deceptive")
DTYPE = torch.float64


def num_states(horizon: int, vocab: int) -> int:
    """``S = sum_{t<H} K**t``: the number of prefix states (every prefix shorter than ``H``)."""
    return sum(vocab**t for t in range(horizon))


def level_offset(t: int, vocab: int) -> int:
    """First row of the prefixes of length ``t`` in the ``[S, K]`` logits table."""
    return sum(vocab**i for i in range(t))


def enumerate_sequences(horizon: int, vocab: int) -> torch.Tensor:
    """All ``K**H`` sequences in base-K order (first token most significant). ``[M, H] int64``."""
    codes = torch.arange(vocab**horizon)
    powers = vocab ** torch.arange(horizon - 1, -1, -1)
    return (codes[:, None] // powers[None, :]) % vocab


def prefix_states(seqs: torch.Tensor, vocab: int) -> torch.Tensor:
    """Row of the logits table for the state before each token. ``seqs: [B, H]`` -> ``[B, H] int64``."""
    horizon = seqs.shape[1]
    out = torch.zeros_like(seqs)
    code = torch.zeros(seqs.shape[0], dtype=seqs.dtype)
    for t in range(horizon):
        out[:, t] = level_offset(t, vocab) + code
        code = code * vocab + seqs[:, t]
    return out


MAX_SEQUENCES = 1 << 16


def check_size(horizon: int, vocab: int) -> None:
    """Fail unless the ``K**H`` sequences can be enumerated (at most :data:`MAX_SEQUENCES`)."""
    if vocab**horizon > MAX_SEQUENCES:
        raise ValueError(
            f"K**H = {vocab}**{horizon} sequences is too many to enumerate; use K**H <= {MAX_SEQUENCES}"
        )


@dataclass(frozen=True, eq=False)
class TokenMDP:
    """A terminal-reward token MDP over ``H`` tokens and ``K`` symbols (``M = K**H`` sequences)."""

    horizon: int
    """H: tokens per sequence (every sequence has exactly H policy tokens)."""
    vocab: int
    """K: number of actions per state."""
    rewards: torch.Tensor
    """``[M] float64``: terminal reward of each sequence, in base-K order."""
    family: str = "custom"
    """Name of the reward family (for reports)."""
    gamma: float = 1.0
    """Discount per token."""

    def __post_init__(self) -> None:
        if self.horizon < 1 or self.vocab < 2:
            raise ValueError(f"need horizon >= 1 and vocab >= 2, got H={self.horizon}, K={self.vocab}")
        check_size(self.horizon, self.vocab)
        if tuple(self.rewards.shape) != (self.vocab**self.horizon,):
            raise ValueError(f"rewards must have shape [K**H] = [{self.vocab**self.horizon}]")
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma}")

    @property
    def num_states(self) -> int:
        return num_states(self.horizon, self.vocab)

    @property
    def num_sequences(self) -> int:
        return self.vocab**self.horizon

    def sequences(self) -> torch.Tensor:
        """``[M, H] int64``, base-K order."""
        return enumerate_sequences(self.horizon, self.vocab)

    def states(self) -> torch.Tensor:
        """``[M, H] int64``: logits row of the state before each token of each enumerated sequence."""
        return prefix_states(self.sequences(), self.vocab)

    def reward_of(self, seqs: torch.Tensor) -> torch.Tensor:
        """Terminal reward of arbitrary sequences ``[B, H]`` -> ``[B] float64``."""
        powers = self.vocab ** torch.arange(self.horizon - 1, -1, -1)
        return self.rewards[(seqs * powers).sum(dim=1)]


def make_mdp(family: str, horizon: int, vocab: int, *, seed: int = 0, gamma: float = 1.0) -> TokenMDP:
    """Build a reward family over all ``K**H`` sequences.

    * ``sparse``: ``R = 1`` iff at least ``H - 1`` tokens equal a target symbol (chosen by ``seed``),
      else 0: rare success, credit spread over the whole sequence.
    * ``dense``: ``R = (1/H) sum_t c[t, a_t]`` with scores ``c ~ U(0, 1)`` (seeded): every token matters.
    * ``deceptive``: ``R = (number of symbol 0)/H``, except the single sequence ``(K-1, ..., K-1)`` which
      earns 2: the local gradient pulls away from the optimum.
    """
    check_size(horizon, vocab)
    seqs = enumerate_sequences(horizon, vocab)
    gen = torch.Generator().manual_seed(seed)
    if family == "sparse":
        target = int(torch.randint(vocab, (1,), generator=gen))
        hits = (seqs == target).sum(dim=1)
        rewards = (hits >= horizon - 1).to(DTYPE)
    elif family == "dense":
        scores = torch.rand(horizon, vocab, generator=gen, dtype=DTYPE)
        rewards = scores[torch.arange(horizon)[None, :], seqs].mean(dim=1)
    elif family == "deceptive":
        rewards = (seqs == 0).to(DTYPE).mean(dim=1)
        rewards[-1] = 2.0
    else:
        raise ValueError(f"unknown reward family {family!r}; valid: {', '.join(REWARD_FAMILIES)}")
    return TokenMDP(horizon=horizon, vocab=vocab, rewards=rewards, family=family, gamma=gamma)


def random_logits(mdp: TokenMDP, *, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    """Tabular logits ``theta ~ scale · N(0, 1)``. ``[S, K] float64``."""
    gen = torch.Generator().manual_seed(seed)
    return scale * torch.randn(mdp.num_states, mdp.vocab, generator=gen, dtype=DTYPE)


class ExactValues(NamedTuple):
    """Exact values of one policy, gathered along every enumerated sequence (``[M, H] float64``)."""

    v: torch.Tensor
    """V(s_t): value of the state before token t."""
    q: torch.Tensor
    """Q(s_t, a_t) = r_t + gamma · V(s_{t+1})."""
    adv: torch.Tensor
    """A(s_t, a_t) = Q - V."""
    state_v: torch.Tensor
    """``[S]``: V of every prefix state (row order of the logits table)."""
    j: torch.Tensor
    """Scalar: J = V(root) (differentiable w.r.t. the logits)."""


def level_tables(mdp: TokenMDP, logits: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-level ``V_t: [K**t]`` and ``Q_t: [K**t, K]`` by backward induction (module docstring)."""
    k, h = mdp.vocab, mdp.horizon
    vs: list[torch.Tensor] = [torch.empty(0)] * h
    qs: list[torch.Tensor] = [torch.empty(0)] * h
    q = mdp.rewards.reshape(k ** (h - 1), k)
    for t in range(h - 1, -1, -1):
        off = level_offset(t, k)
        probs = torch.softmax(logits[off : off + k**t], dim=-1)
        qs[t] = q
        vs[t] = (probs * q).sum(dim=-1)
        if t > 0:
            q = mdp.gamma * vs[t].reshape(k ** (t - 1), k)
    return vs, qs


def exact_values(mdp: TokenMDP, logits: torch.Tensor) -> ExactValues:
    """V, Q, A of ``softmax(logits)`` for every enumerated sequence and token."""
    k, h = mdp.vocab, mdp.horizon
    vs, qs = level_tables(mdp, logits)
    seqs = mdp.sequences()
    states = prefix_states(seqs, k)
    v = torch.empty(seqs.shape, dtype=DTYPE)
    q = torch.empty(seqs.shape, dtype=DTYPE)
    for t in range(h):
        local = states[:, t] - level_offset(t, k)
        v[:, t] = vs[t][local]
        q[:, t] = qs[t][local, seqs[:, t]]
    return ExactValues(v=v, q=q, adv=q - v, state_v=torch.cat(vs), j=vs[0][0])


def token_logp(logits: torch.Tensor, seqs: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[s_t, a_t]`` for each token. ``[B, H]`` (differentiable)."""
    return torch.log_softmax(logits, dim=-1)[states, seqs]


def sequence_log_probs(mdp: TokenMDP, logits: torch.Tensor) -> torch.Tensor:
    """``log pi(sequence)`` of every enumerated sequence. ``[M] float64``."""
    return token_logp(logits, mdp.sequences(), mdp.states()).sum(dim=1)


def objective(mdp: TokenMDP, logits: torch.Tensor) -> torch.Tensor:
    """``J(pi) = E_pi[gamma**(H-1) · R]`` by backward induction (differentiable scalar)."""
    vs, _ = level_tables(mdp, logits)
    return vs[0][0]


def true_gradient(mdp: TokenMDP, logits: torch.Tensor) -> torch.Tensor:
    """``g* = grad_theta J(pi)`` by autograd through the exact J. ``[S, K] float64``."""
    theta = logits.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(objective(mdp, theta), theta)
    return grad


def policy_gradient_theorem(mdp: TokenMDP, logits: torch.Tensor) -> torch.Tensor:
    """``g*[s, a] = gamma**t · pi(prefix s) · pi(a|s) · A^pi(s, a)``, analytic. ``[S, K] float64``.

    Used to check :func:`true_gradient` (they must agree to float64 round-off).
    """
    k, h = mdp.vocab, mdp.horizon
    vs, qs = level_tables(mdp, logits)
    rows = []
    reach = torch.ones(1, dtype=DTYPE)  # gamma**t · pi(prefix) for prefixes of length t
    for t in range(h):
        off = level_offset(t, k)
        probs = torch.softmax(logits[off : off + k**t], dim=-1)
        rows.append(reach[:, None] * probs * (qs[t] - vs[t][:, None]))
        reach = mdp.gamma * (reach[:, None] * probs).reshape(-1)
    return torch.cat(rows)


def sequence_kl(mdp: TokenMDP, logits_p: torch.Tensor, logits_q: torch.Tensor) -> float:
    """``KL(p || q) = sum_seq p(seq) log(p(seq)/q(seq))`` over whole sequences, in nats."""
    lp = sequence_log_probs(mdp, logits_p)
    lq = sequence_log_probs(mdp, logits_q)
    return float((lp.exp() * (lp - lq)).sum())


def behaviour_at_kl(
    mdp: TokenMDP, pi_logits: torch.Tensor, target_kl: float, *, seed: int = 0, tol: float = 1e-6
) -> torch.Tensor:
    """``mu = softmax(theta_pi + alpha·Delta)`` with ``KL(pi || mu) = target_kl`` (sequence level).

    ``Delta ~ N(0, 1)`` per logit (seeded); ``alpha >= 0`` by bisection (the KL grows with alpha for
    the small alphas used; the bracket doubles until it passes the target). ``target_kl = 0`` gives pi.
    """
    if target_kl < 0:
        raise ValueError(f"target_kl must be >= 0, got {target_kl}")
    if target_kl == 0:
        return pi_logits.clone()
    gen = torch.Generator().manual_seed(seed + 7919)
    delta = torch.randn(pi_logits.shape, generator=gen, dtype=DTYPE)

    def kl_at(alpha: float) -> float:
        return sequence_kl(mdp, pi_logits, pi_logits + alpha * delta)

    hi = 0.1
    while kl_at(hi) < target_kl:
        hi *= 2.0
        if hi > 1e4:
            raise ValueError(f"could not reach KL {target_kl}; choose a smaller target")
    lo = 0.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if kl_at(mid) < target_kl:
            lo = mid
        else:
            hi = mid
        if hi - lo < tol * max(hi, 1e-12):
            break
    return pi_logits + 0.5 * (lo + hi) * delta


def gradient_path(
    mdp: TokenMDP, logits0: torch.Tensor, *, steps: int, lr: float, normalize: bool = False
) -> torch.Tensor:
    """Exact policy-gradient ascent ``theta_{k+1} = theta_k + lr · grad J(theta_k)``.

    ``normalize=True`` takes steps of fixed length ``lr`` along the exact gradient
    (``lr · g/||g||``), so that "s steps of staleness" means the same parameter distance whatever the
    reward scale of the family.

    Returns the whole path ``[steps + 1, S, K]``: with ``pi = path[-1]``, ``mu = path[-1 - s]`` is pi as
    it was ``s`` gradient steps earlier (the staleness of a fixed-lag asynchronous trainer).
    """
    if steps < 0 or lr <= 0 or not math.isfinite(lr):
        raise ValueError(f"need steps >= 0 and a finite lr > 0, got steps={steps}, lr={lr}")
    path = [logits0.detach().clone()]
    for _ in range(steps):
        g = true_gradient(mdp, path[-1])
        if normalize:
            g = g / g.norm().clamp(min=1e-300)
        path.append(path[-1] + lr * g)
    return torch.stack(path)


def sample_sequences(
    mdp: TokenMDP,
    logits: torch.Tensor,
    n: int,
    *,
    generator: torch.Generator,
    prefix: torch.Tensor | None = None,
) -> torch.Tensor:
    """Roll out ``n`` sequences token by token from ``softmax(logits)``. ``[n, H] int64``.

    ``prefix: [n, t] int64`` (optional): keep these first ``t`` tokens and sample only the continuation.
    """
    seqs = torch.zeros(n, mdp.horizon, dtype=torch.int64)
    code = torch.zeros(n, dtype=torch.int64)
    start = 0 if prefix is None else prefix.shape[1]
    for t in range(start):
        assert prefix is not None
        seqs[:, t] = prefix[:, t]
        code = code * mdp.vocab + seqs[:, t]
    probs = torch.softmax(logits.detach(), dim=-1)
    for t in range(start, mdp.horizon):
        rows = probs[level_offset(t, mdp.vocab) + code]
        seqs[:, t] = torch.multinomial(rows, 1, generator=generator).squeeze(1)
        code = code * mdp.vocab + seqs[:, t]
    return seqs
