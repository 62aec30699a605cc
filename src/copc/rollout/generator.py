"""Rollout generation shared by every driver: the rollout config and the batch generator.

**Batch identity.** Batch ``j`` (the batch training step ``j`` consumes) is a pure function of
``(run seed, j)`` and of the weights that sample it: its prompts are drawn by
:func:`batch_prompts` and its sampling generator is seeded by :func:`batch_seed`. So whichever process
generates it, and in whatever order, batch ``j`` sampled by version ``v`` is the same list of
trajectories; this is what makes ``async`` with ``s = 0`` equal to ``sync``, and a resumed
``fixed_lag`` run equal to the uninterrupted one. Which version samples batch ``j`` is the drivers'
business (``copc.runtime``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from copc.rollout.chat import chat_format
from copc.rollout.engine import Engine, SamplingConfig
from copc.rollout.episode import run_episodes
from copc.tasks.base import Task
from copc.types import Prompt, Trajectory

__all__ = ["GeneratedBatch", "RolloutConfig", "RolloutGenerator", "batch_prompts", "batch_seed"]


@dataclass(frozen=True)
class RolloutConfig:
    """How a training batch is generated."""

    prompts_per_batch: int = 16
    """Distinct prompts per training batch."""
    group_size: int = 4
    """Samples per prompt (group baselines need > 1); batch size B = prompts_per_batch * group_size."""
    max_turns: int = 3
    """Policy turns per episode (tool calls + answer)."""
    max_new_tokens_per_turn: int = 48
    """Token budget of one policy turn (a turn cut by it is not graded: the episode ends truncated)."""
    max_total_tokens: int = 128
    """Generated-token budget of one episode (truncated beyond)."""
    context_limit: int = 512
    """Total tokens (prompt + generated + tool output) an episode may hold."""
    temperature: float = 1.0
    """Sampling temperature (the trainer uses the same transform for log-probs)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    chat_template: str = "auto"
    """Chat template: 'auto' (the tokenizer's, if it has one), 'none' (raw text) or a Jinja template file."""

    def __post_init__(self) -> None:
        for name in ("prompts_per_batch", "group_size", "max_turns", "max_new_tokens_per_turn",
                     "max_total_tokens", "context_limit"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if not self.temperature > 0:
            raise ValueError(f"rollout.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"rollout.top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def batch_size(self) -> int:
        return self.prompts_per_batch * self.group_size

    def sampling(self, *, greedy: bool = False) -> SamplingConfig:
        """The engine's sampling settings (greedy = top-k 1)."""
        return SamplingConfig(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=1 if greedy else self.top_k,
            max_new_tokens=self.max_new_tokens_per_turn,
        )


def batch_seed(seed: int, batch_index: int) -> int:
    """Sampling seed of batch ``j``: a fixed mix of the run seed and ``j`` (order-independent)."""
    return (seed * 1_000_003 + batch_index * 7_919 + 12_345) % (2**63 - 1)


def batch_prompts(pool: Sequence[Prompt], seed: int, batch_index: int, count: int) -> list[Prompt]:
    """``count`` distinct prompts of batch ``j``, drawn from ``pool`` by a generator seeded with ``(seed, j)``."""
    if count > len(pool):
        raise ValueError(f"a batch needs {count} distinct prompts but the train split has {len(pool)}")
    rng = random.Random(batch_seed(seed, batch_index) ^ 0x5EED)
    return [pool[i] for i in rng.sample(range(len(pool)), count)]


@dataclass
class GeneratedBatch:
    """One generated training batch: its index, the version that sampled it and timing."""

    index: int
    version: int
    trajectories: list[Trajectory]
    generate_s: float
    info: dict[str, float] = field(default_factory=dict)


class RolloutGenerator:
    """Generates batch ``j`` with given weights: prompts, envs, the engine and the episode loop.

    Owns its own copy of the policy (an engine model); :meth:`load` replaces its weights.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        task: Task,
        config: RolloutConfig,
        *,
        seed: int,
    ) -> None:
        self.task, self.config, self.seed = task, config, seed
        self.engine = Engine(model, tokenizer, version=0)
        self.pool = task.prompts("train")
        self.chat = chat_format(tokenizer, config.chat_template)

    @property
    def version(self) -> int:
        return self.engine.version

    def load(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Sample with ``weights`` (version ``version``) from now on; versions never go back."""
        if version == self.engine.version:
            return  # already loaded (the model starts as version 0)
        if version < self.engine.version:
            raise RuntimeError(f"asked to sample with version {version} after version {self.engine.version}")
        self.engine.load_weights(weights, version)

    def generate(self, batch_index: int) -> GeneratedBatch:
        start = time.perf_counter()
        prompts = batch_prompts(self.pool, self.seed, batch_index, self.config.prompts_per_batch)
        group = self.config.group_size
        envs = [self.task.make_env(p) for p in prompts for _ in range(group)]
        trajectories = run_episodes(
            self.engine,
            envs,
            sampling=self.config.sampling(),
            seed=batch_seed(self.seed, batch_index),
            max_turns=self.config.max_turns,
            max_new_tokens_per_turn=self.config.max_new_tokens_per_turn,
            max_total_tokens=self.config.max_total_tokens,
            context_limit=self.config.context_limit,
            group_ids=[batch_index * self.config.prompts_per_batch + i // group for i in range(len(envs))],
            prompt_ids=[p.id for p in prompts for _ in range(group)],
            chat=self.chat,
        )
        return GeneratedBatch(batch_index, self.version, trajectories, time.perf_counter() - start)
