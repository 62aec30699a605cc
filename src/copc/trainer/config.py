"""``TrainerConfig``: the optimisation settings of :class:`~copc.trainer.trainer.ActorCriticTrainer` (the
method's maths lives in the method, :mod:`copc.channels.methods`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from copc.config import check_at_least
from copc.trainer.proximal import PROXIMAL_SOURCES, ProximalSource

__all__ = ["TRUNCATION_MODES", "TrainerConfig", "Truncation"]

Truncation = Literal["terminal", "bootstrap", "mask"]
TRUNCATION_MODES: tuple[str, ...] = get_args(Truncation)


@dataclass(frozen=True)
class TrainerConfig:
    """Optimisation settings of the trainer (module docstring)."""

    optimizer: Literal["adamw", "sgd"] = "adamw"
    """adamw (default) or plain sgd (linear in the gradient: used by the accumulation-invariance test)."""
    actor_lr: float = 1e-5
    """Learning rate of the policy."""
    critic_lr: float = 1e-4
    """Learning rate of the value model."""
    weight_decay: float = 0.0
    """AdamW weight decay (both models)."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    max_grad_norm: float = 1.0
    """Actor gradient-norm clip (<= 0 disables clipping; the norm is still logged)."""
    critic_max_grad_norm: float = 1.0
    """Critic gradient-norm clip (<= 0 disables clipping)."""
    micro_batch_size: int = 16
    """Rows per forward/backward; gradients of a minibatch are accumulated over its micro-batches."""
    micro_batch_by_length: bool = False
    """Sort each minibatch's rows by length before cutting micro-batches (less padding in each trimmed
    micro-batch; the same sums up to float rounding, so not bit-identical to off)."""
    actor_minibatches: int = 0
    """Actor optimizer steps per epoch; 0 = the method preset's (policy.minibatches)."""
    critic_updates: int = 0
    """Critic epochs K_critic per step; 0 = the method preset's (critic.updates_per_step)."""
    critic_minibatches: int = 1
    """Critic optimizer steps per critic epoch."""
    ppo_epochs: int = 1
    """Passes over the actor minibatches per step."""
    critic_warmup_steps: int = -1
    """First steps during which only the critic trains (actor frozen, version advances); -1 = preset's."""
    kl_coef: float = 0.0
    """Weight of the k3 KL(pi || pi_ref) loss on action tokens; needs a reference model when > 0."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the actor loss)."""
    temperature: float = 1.0
    """The sampler's temperature, under which log-probs are computed (docs/formulas.md#pitfalls); in copc
    train it follows rollout.temperature (set that one)."""
    top_p: float = 1.0
    """The sampler's top-p (1 = off): log-probs come from the same truncated, renormalised distribution;
    follows rollout.top_p in copc train."""
    top_k: int = 0
    """The sampler's top-k (0 = off), as top_p; follows rollout.top_k in copc train."""
    truncation: Truncation = "terminal"
    """How truncated episodes end: terminal | bootstrap | mask (docs/formulas.md#notation)."""
    void_turns: Literal["keep", "mask"] = "keep"
    """Episodes with a void turn (neither a tool call nor an answer): keep them as failures, or mask them out
    of the actor and critic losses (SimpleTIR's filter); counted in batch/void_frac either way."""
    shuffle: bool = True
    """Shuffle rows into minibatches (seeded by (seed, step, epoch))."""
    seed: int = 0
    """Seed of the minibatch shuffles."""
    proximal: ProximalSource = "recompute"
    """Where old log-probs come from: recompute | snapshot | ewma | loglinear (copc.trainer.proximal)."""
    proximal_decay: float = 0.75
    """ewma: decay beta per actor optimizer step (center of mass beta / (1 - beta) = 3 steps back)."""
    proximal_max_bytes: int = 32 << 20
    """snapshot: bound of the stored versions (memory and checkpoints) [bytes]; needs (staleness + 1) x
    one."""
    old_forward_reuse: bool = False
    """recompute: take old of the first actor minibatch's rows from their own first forward (one no-grad
    forward fewer; docs/algorithms.md, "Old log-probs from the first forward")."""
    gradient_checkpointing: Literal["auto", "always", "never"] = "auto"
    """Recompute each layer's activations in the backward pass instead of keeping them (the policy's and the
    critic's updates): the same gradients, less memory, about one more forward of time. always | never |
    auto: on for a model of at least 50M parameters (real models, where activations dominate the update's
        memory), off
    below (copc.trainer.memory). It changes nothing a run computes, so it may change on resume and is left
    out of sweep records' config hash."""
    critic_forward_reuse: bool = False
    """Take V_old of the first critic minibatch's rows from their own first critic forward (train mode, with
    grad, kept for that minibatch's update): one critic forward fewer per step; the kept activations live
    until the update."""

    def __post_init__(self) -> None:
        for name in ("actor_lr", "critic_lr", "temperature"):
            if not getattr(self, name) > 0:
                raise ValueError(f"trainer.{name} must be > 0, got {getattr(self, name)}")
        check_at_least("trainer", 1, micro_batch_size=self.micro_batch_size,
                       critic_minibatches=self.critic_minibatches, ppo_epochs=self.ppo_epochs)
        if self.critic_warmup_steps < -1:
            raise ValueError(f"trainer.critic_warmup_steps must be >= 0 (or -1 = preset), got "
                             f"{self.critic_warmup_steps}")
        check_at_least("trainer", 0, actor_minibatches=self.actor_minibatches,
                       critic_updates=self.critic_updates,
                       weight_decay=self.weight_decay, kl_coef=self.kl_coef, entropy_coef=self.entropy_coef)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"trainer.top_p must be in (0, 1] (1 = off; use the rollout's), "
                             f"got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"trainer.top_k must be >= 0 (0 = off; use the rollout's), got {self.top_k}")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"trainer.optimizer must be adamw or sgd, got {self.optimizer!r}")
        if self.proximal not in PROXIMAL_SOURCES:
            raise ValueError(f"trainer.proximal must be one of {', '.join(PROXIMAL_SOURCES)}, got "
                             f"{self.proximal!r}")
        if not 0.0 <= self.proximal_decay < 1.0:
            raise ValueError(f"trainer.proximal_decay must be in [0, 1) (e.g. 0.75), got "
                             f"{self.proximal_decay}")
        check_at_least("trainer", 1, proximal_max_bytes=self.proximal_max_bytes)
        if self.void_turns not in ("keep", "mask"):
            raise ValueError(f"trainer.void_turns must be keep or mask, got {self.void_turns!r}")
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(
                f"trainer.truncation must be one of {', '.join(TRUNCATION_MODES)}, got {self.truncation!r}"
            )
