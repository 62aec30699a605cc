"""Typed records that flow between the rollout side and the trainer.

Notation: ``L`` is the length of one trajectory in tokens (prompt + everything generated or inserted).
Every per-token field of a :class:`Trajectory` has length ``L`` and the same alignment: index ``i``
describes token ``token_ids[i]``.

Three policies appear in copc (CONTRIBUTING.md#policy-naming):

- the *behaviour* policy mu, whose log-probs ``logp_behav`` the sampler recorded token by token;
- the *old* (proximal) policy, recomputed by the trainer at the start of a step;
- the *current* policy pi_theta, being optimised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch


class StopReason(str, Enum):
    """Why an episode ended. Every trajectory carries exactly one."""

    ANSWER = "answer"  # the policy gave a final answer (the environment said done)
    EOS = "eos"  # the policy emitted end-of-sequence without an answer
    MAX_TURNS = "max_turns"  # the turn budget ran out
    MAX_TOKENS = "max_tokens"  # the generated-token budget ran out (truncated)
    CONTEXT_LIMIT = "context_limit"  # the model's context window is full (truncated)
    ENV_ERROR = "env_error"  # the environment itself failed (a bug, not a tool error): reward 0

    @property
    def truncated(self) -> bool:
        """True when the episode was cut rather than finished (docs/formulas.md#notation, `truncation`)."""
        return self in (StopReason.MAX_TURNS, StopReason.MAX_TOKENS, StopReason.CONTEXT_LIMIT)


@dataclass(frozen=True)
class Prompt:
    """One task instance: the text shown to the policy and what the reward needs to grade it."""

    id: str
    text: str
    #: Gold answers (one or several); graded by the task's reward.
    answers: tuple[str, ...]
    #: Free-form, JSON-serialisable metadata (difficulty, number of hops, source row ...).
    meta: dict[str, str | int | float] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvStep:
    """What an environment returns after one policy turn."""

    #: Text to insert as non-action tokens before the policy continues (tool output); None when done.
    observation: str | None
    done: bool
    #: Reward for this turn; the final reward arrives with ``done=True``. Folded onto policy tokens later.
    reward: float = 0.0
    #: Counters for metrics, e.g. {"tool_calls": 1, "tool_errors": 0, "correct": 1.0}.
    info: dict[str, float] = field(default_factory=dict)


class Env(Protocol):
    """A single-use episode (tinker-cookbook style): made for one prompt, stepped until done."""

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Strings that end a policy turn (e.g. ``"</python>"``); the stop string is kept in the action."""
        ...

    def initial_text(self) -> str:
        """The prompt text the policy sees first."""
        ...

    def step(self, action_text: str) -> EnvStep:
        """Consume the text of one policy turn (including its stop string, if any)."""
        ...

    def finish(self, reason: StopReason) -> EnvStep:
        """Grade an episode the loop ended without ``done`` (budget exhausted, EOS): the final reward."""
        ...


@dataclass
class Trajectory:
    """One finished episode, token by token.

    Attributes:
        prompt_id: id of the :class:`Prompt` it answers.
        token_ids: ``[L] int64``, prompt, sampled tokens and inserted tool output, in order.
        prompt_len: number of leading prompt tokens.
        action_mask: ``[L] bool``, True exactly on tokens the policy sampled.
        logp_behav: ``[L] float32``, log mu(token | prefix) under the sampling distribution actually
            used (after the temperature / top-k / top-p transform); 0 where ``action_mask`` is False.
        policy_version: ``[L] int64``, weight version that sampled the token; -1 where not sampled.
        reward: scalar episode reward (sum of the environment's rewards).
        token_rewards: ``[L] float32``, rewards where the environment gave them (usually only the last
            token); estimators fold them onto policy tokens (docs/formulas.md#notation).
        stop_reason: why the episode ended.
        info: counters for metrics (tool calls, tool errors, correctness ...).
        group: index of the prompt group this sample belongs to (group-normalised baselines).
    """

    prompt_id: str
    token_ids: torch.Tensor
    prompt_len: int
    action_mask: torch.Tensor
    logp_behav: torch.Tensor
    policy_version: torch.Tensor
    reward: float
    token_rewards: torch.Tensor
    stop_reason: StopReason
    info: dict[str, float] = field(default_factory=dict)
    group: int = 0

    def __post_init__(self) -> None:
        length = self.token_ids.shape[0]
        for name in ("action_mask", "logp_behav", "policy_version", "token_rewards"):
            tensor = getattr(self, name)
            if tensor.shape != (length,):
                raise ValueError(
                    f"Trajectory.{name} has shape {tuple(tensor.shape)}, expected ({length},) like token_ids"
                )
        if self.action_mask.dtype != torch.bool:
            raise ValueError("Trajectory.action_mask must be torch.bool (True = sampled by the policy)")

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_action_tokens(self) -> int:
        return int(self.action_mask.sum())

    @property
    def min_version(self) -> int:
        """Oldest policy version that sampled a token of this trajectory (-1 if none did)."""
        versions = self.policy_version[self.action_mask]
        return int(versions.min()) if versions.numel() else -1

    @property
    def max_version(self) -> int:
        versions = self.policy_version[self.action_mask]
        return int(versions.max()) if versions.numel() else -1

    @property
    def truncated(self) -> bool:
        return self.stop_reason.truncated
