"""One running episode's record and the ways the episode loop ends it.

:class:`RunningEpisode` grows token by token as :mod:`copc.rollout.episode` appends policy turns and
observations (the layout its module docstring gives); the functions here end an episode (a turn cut by a
token limit, a budget the loop enforces, an env that raised) and turn the record into a
:class:`~copc.types.Trajectory`. :func:`truncation_stats` reads the loop's ``info`` counters back as
per-turn and per-episode truncation rates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from copc.rollout.engine import FinishReason, Generation, PrefixKV
from copc.types import Env, EnvStep, StopReason, Trajectory

__all__ = [
    "RunningEpisode",
    "TruncationStats",
    "TurnCut",
    "call_env",
    "cut_by_limit",
    "end_by_loop",
    "end_cut_turn",
    "to_trajectory",
    "truncation_stats",
]

logger = logging.getLogger(__name__)


@dataclass
class RunningEpisode:
    """Mutable state of one running episode (lists grow token by token)."""

    index: int
    env: Env
    ids: list[int]
    prompt_len: int
    mask: list[bool] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    version: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    reward: float = 0.0
    info: dict[str, float] = field(default_factory=dict)
    turns: int = 0
    generated: int = 0
    stop: StopReason | None = None
    #: Keys/values of the tokens fed so far (from the last turn), so the next turn feeds only new tokens.
    kv: PrefixKV | None = None

    def __post_init__(self) -> None:
        n = len(self.ids)
        self.mask, self.logp, self.version, self.rewards = [False] * n, [0.0] * n, [-1] * n, [0.0] * n
        self.info = {
            "policy_turns": 0.0, "gen_tokens": 0.0, "obs_tokens": 0.0, "env_errors": 0.0, "cut_turns": 0.0,
            "turn_cut": 0.0,
        }

    def add_turn(self, gen: Generation) -> None:
        tokens = gen.token_ids.tolist()
        self.ids += tokens
        self.mask += [True] * len(tokens)
        self.logp += gen.logp.tolist()
        self.version += gen.versions.tolist()
        self.rewards += [0.0] * len(tokens)
        self.turns += 1
        self.generated += len(tokens)
        self.info["policy_turns"] += 1
        self.info["gen_tokens"] += len(tokens)

    def add_observation(self, tokens: list[int]) -> None:
        self.ids += tokens
        self.mask += [False] * len(tokens)
        self.logp += [0.0] * len(tokens)
        self.version += [-1] * len(tokens)
        self.rewards += [0.0] * len(tokens)
        self.info["obs_tokens"] += len(tokens)

    def add_reward(self, result: EnvStep) -> None:
        """Put the env's reward on the latest token and take its counters (running totals)."""
        self.rewards[-1] += float(result.reward)
        self.reward += float(result.reward)
        self.info.update({k: float(v) for k, v in result.info.items()})


class TurnCut(NamedTuple):
    """A turn that hit a token limit before it stopped on its own (such a turn is not stepped)."""

    reason: StopReason
    #: True when the turn reached the per-turn limit (``max_new_tokens_per_turn``), also when the
    #: episode's token budget or the context window ran out at the same token.
    per_turn: bool


def cut_by_limit(
    ep: RunningEpisode, gen: Generation, *, max_new_tokens_per_turn: int, max_total_tokens: int,
    context_limit: int,
) -> TurnCut | None:
    """How this turn was cut (call after ``add_turn``), None when it stopped on its own (stop string, EOS)."""
    if gen.finish is not FinishReason.LENGTH:
        return None
    per_turn = len(gen.token_ids) >= max_new_tokens_per_turn
    if ep.generated >= max_total_tokens:
        return TurnCut(StopReason.MAX_TOKENS, per_turn=per_turn)
    if len(ep.ids) >= context_limit:
        return TurnCut(StopReason.CONTEXT_LIMIT, per_turn=per_turn)
    return TurnCut(StopReason.MAX_TOKENS, per_turn=True)


def end_cut_turn(ep: RunningEpisode, cut: TurnCut) -> None:
    ep.info["cut_turns"] += 1
    ep.info["turn_cut"] = float(cut.per_turn)
    end_by_loop(ep, cut.reason)


def end_by_loop(ep: RunningEpisode, reason: StopReason) -> None:
    """The loop stops the episode: ``env.finish(reason)`` grades it."""
    ep.kv = None
    result = call_env(ep, lambda: ep.env.finish(reason))
    if result is not None:
        ep.add_reward(result)
        ep.stop = reason


def call_env(ep: RunningEpisode, call: Callable[[], EnvStep]) -> EnvStep | None:
    """Run an env method; on an exception end the episode (reward 0, ``env_errors`` = 1) and return None."""
    try:
        result = call()
        if not isinstance(result, EnvStep):
            raise TypeError(f"env returned {type(result).__name__}, expected EnvStep")
        return result
    except Exception:
        logger.exception("env of episode %d raised; the episode ends with reward 0", ep.index)
        ep.rewards = [0.0] * len(ep.ids)
        ep.reward = 0.0
        ep.info["env_errors"] += 1
        ep.stop, ep.kv = StopReason.ENV_ERROR, None
        return None


def to_trajectory(
    ep: RunningEpisode, group_ids: Sequence[int] | None, prompt_ids: Sequence[str] | None
) -> Trajectory:
    return Trajectory(
        prompt_id=prompt_ids[ep.index] if prompt_ids is not None else str(ep.index),
        token_ids=torch.tensor(ep.ids, dtype=torch.long),
        prompt_len=ep.prompt_len,
        action_mask=torch.tensor(ep.mask, dtype=torch.bool),
        logp_behav=torch.tensor(ep.logp, dtype=torch.float32),
        policy_version=torch.tensor(ep.version, dtype=torch.long),
        reward=ep.reward,
        token_rewards=torch.tensor(ep.rewards, dtype=torch.float32),
        stop_reason=ep.stop if ep.stop is not None else StopReason.EOS,
        info=dict(ep.info),
        group=group_ids[ep.index] if group_ids is not None else 0,
    )


class TruncationStats(NamedTuple):
    """How often budgets cut episodes (fractions in [0, 1]; 0 for an empty list)."""

    #: Episodes cut by any budget (turns, tokens, context): ``StopReason.truncated``.
    episode_frac: float
    #: Policy turns cut by a token limit before they stopped on their own.
    turn_frac: float
    #: Episodes whose last turn reached the per-turn limit ``max_new_tokens_per_turn`` (also when another
    #: budget ran out at the same token).
    turn_limit_frac: float


def truncation_stats(trajectories: Sequence[Trajectory]) -> TruncationStats:
    """Per-episode and per-turn truncation rates from the loop's ``info`` counters (module docstring)."""
    if not trajectories:
        return TruncationStats(0.0, 0.0, 0.0)
    n = len(trajectories)
    turns = sum(t.info.get("policy_turns", 0.0) for t in trajectories)
    cut = sum(t.info.get("cut_turns", 0.0) for t in trajectories)
    return TruncationStats(
        episode_frac=sum(t.truncated for t in trajectories) / n,
        turn_frac=cut / turns if turns else 0.0,
        turn_limit_frac=sum(t.info.get("turn_cut", 0.0) for t in trajectories) / n,
    )
