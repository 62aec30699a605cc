"""Rollout generation shared by every driver: the rollout config and the batch generator.

**Batch identity.** Batch ``j`` (the batch training step ``j`` consumes) is a pure function of
``(run seed, j)`` and of the weights that sample it: its prompts are drawn by
:func:`batch_prompts` and its sampling generator is seeded by :func:`batch_seed`. So whichever process
generates it, and in whatever order, batch ``j`` sampled by version ``v`` is the same list of
trajectories; this is what makes ``async`` with ``s = 0`` equal to ``sync``, and a resumed
``fixed_lag`` run equal to the uninterrupted one. Which version samples batch ``j`` is the drivers'
business (``copc.runtime``).

**Dynamic sampling** (DAPO, docs/formulas.md#dapo; :class:`DynamicSamplingConfig`). A group whose rewards are
all equal (all correct or all wrong) carries no signal for a group baseline. With dynamic sampling on,
such groups are dropped and more prompts are sampled, in rounds, until the batch holds
``prompts_per_batch`` informative groups. Round 0 is the batch's own prompts with the batch's own seed
(so with dynamic sampling off, or when nothing is dropped, the batch is exactly what it was without
it); round ``r >= 1`` draws prompts not yet in the batch from a generator seeded by ``(seed, j, r)`` and
samples them with :func:`round_seed` ``(seed, j, r)``, so batch identity holds. Round ``r`` asks for the
shortfall scaled by the informative rate seen so far, at most ``prompts_per_batch`` prompts. Groups are
filtered on the task's reward, before reward shaping (verl's DAPO recipe filters on ``acc``).
After ``max_rounds`` rounds a batch that is still short goes ahead: verl raises here instead; copc
completes it with the dropped groups in generation order (they have zero group-normalised advantage, and
the batch keeps ``B`` trajectories in ``prompts_per_batch`` whole groups, which the async buffer and the
group baselines need) and counts it (``rollout/dynsample_short``, ``rollout/dynsample_padded_groups``).
Informative groups beyond ``prompts_per_batch`` are dropped like verl's ``batch[:traj_bsz]``. Every
dropped trajectory's prompt is returned in :attr:`GeneratedBatch.rejected` so a buffer can clear it.
Group ids of batch ``j`` are ``j * prompts_per_batch + k`` for its ``k``-th group, as without it.

**Overlong shaping** (DAPO's soft overlong punishment; :class:`OverlongShapingConfig`,
:func:`copc.rewards.shaping.overlong_penalty`): added to each kept trajectory's reward and to its last
token's reward (folded onto the last policy token by the advantage channel), after filtering.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from copc import tracking as m
from copc.config import check_at_least, check_one_of
from copc.rewards.shaping import overlong_penalty
from copc.rollout.chat import chat_format
from copc.rollout.engine import Engine
from copc.rollout.episode import run_episodes
from copc.rollout.sampling import SamplingConfig
from copc.tasks.base import Task
from copc.types import Prompt, Trajectory

__all__ = [
    "DynamicSamplingConfig",
    "GeneratedBatch",
    "OverlongShapingConfig",
    "RolloutConfig",
    "RolloutGenerator",
    "batch_prompts",
    "batch_seed",
    "extra_prompts",
    "round_seed",
    "sampler_weights",
]


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (module docstring): keep only groups whose rewards differ."""

    enabled: bool | None = None
    """On / off; None = the method preset's choice (``MethodConfig.dynamic_sampling``; on in dapo)."""
    max_rounds: int = 4
    """Generation rounds per batch, the first included (verl ``max_num_gen_batches``); each extra round
    samples at most ``prompts_per_batch`` prompts, so at most ``(max_rounds - 1) * prompts_per_batch``
    extra groups per batch."""

    def __post_init__(self) -> None:
        if self.max_rounds < 1:
            raise ValueError(f"rollout.dynamic_sampling.max_rounds must be >= 1 (verl uses 10), got "
                             f"{self.max_rounds}")


@dataclass(frozen=True)
class OverlongShapingConfig:
    """DAPO's soft overlong punishment (:func:`copc.rewards.shaping.overlong_penalty`)."""

    enabled: bool | None = None
    """On / off; None = the method preset's choice (``MethodConfig.overlong_shaping``; on in dapo)."""
    max_tokens: int | None = None
    """``L_max`` in generated tokens; None = ``rollout.max_total_tokens`` (the episode's budget)."""
    cache_tokens: int | None = None
    """``L_cache``, the punishment interval below ``L_max``; None = ``L_max // 5`` (DAPO: 4096 of 20480)."""
    factor: float = 1.0
    """Penalty at ``L_max`` (verl ``overlong_buffer.penalty_factor``; 1 in DAPO, whose reward is +-1)."""

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"rollout.overlong.max_tokens must be >= 1 or null (the rollout budget), got "
                             f"{self.max_tokens}")
        if self.cache_tokens is not None and self.cache_tokens < 1:
            raise ValueError(f"rollout.overlong.cache_tokens must be >= 1 or null (L_max // 5), got "
                             f"{self.cache_tokens}")
        if self.factor < 0:
            raise ValueError(f"rollout.overlong.factor must be >= 0, got {self.factor}")


def sampler_weights(weights: Mapping[str, torch.Tensor], dtype: torch.dtype, *, copy: bool = False
                    ) -> dict[str, torch.Tensor]:
    """``weights`` with floating tensors in the sampler's ``dtype`` (``rollout.dtype``): the generator casts
    every loaded weight to it anyway, so keeping the ring and the snapshots in it changes nothing the
    workers compute and halves them under bfloat16. ``copy``: never share storage with ``weights``."""
    out = {}
    for name, tensor in weights.items():
        tensor = tensor.detach()
        cast = tensor.to(dtype) if tensor.is_floating_point() else tensor
        out[name] = cast.clone() if copy and cast.data_ptr() == tensor.data_ptr() else cast
    return out


#: Episodes one step's batch may hold: every episode of a step is in memory at once (its tokens, log-probs
#: and rewards), so a count no machine can hold is refused when the config is read, not found by a rollout
#: that never returns.
MAX_BATCH_EPISODES = 2**20


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
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """DAPO dynamic sampling (drop groups with equal rewards, sample more); off unless the method or this
    turns it on."""
    overlong: OverlongShapingConfig = field(default_factory=OverlongShapingConfig)
    """DAPO soft overlong punishment of the reward; off unless the method or this turns it on."""
    chat_template: str = "auto"
    """Chat template: 'auto' (the tokenizer's, if it has one), 'none' (raw text) or a Jinja template file."""
    infra_failures: Literal["keep", "drop"] = "keep"
    """Episodes whose tool call failed for the machine, not the code: keep (counted in
    rollout/tool_infra_errors) or drop their whole group (counted in rollout/infra_dropped_groups)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Sampler weights: float32 (the trainer's) or bfloat16 (cast when loaded, as vLLM beside an fp32
    trainer): behaviour log-probs then differ from the trainer's by a real training-inference discrepancy."""

    def __post_init__(self) -> None:
        check_at_least("rollout", 1, prompts_per_batch=self.prompts_per_batch, group_size=self.group_size,
                       max_turns=self.max_turns, max_new_tokens_per_turn=self.max_new_tokens_per_turn,
                       max_total_tokens=self.max_total_tokens, context_limit=self.context_limit)
        if self.batch_size > MAX_BATCH_EPISODES:
            raise ValueError(
                f"rollout.prompts_per_batch x rollout.group_size = {self.prompts_per_batch} x "
                f"{self.group_size} episodes a step, above the {MAX_BATCH_EPISODES} one step's batch may hold"
                f" in memory; lower one of them"
            )
        if not self.temperature > 0:
            raise ValueError(f"rollout.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"rollout.top_k must be >= 0 (0 = off), got {self.top_k}")
        check_one_of("rollout.infra_failures", self.infra_failures, ("keep", "drop"))
        check_one_of("rollout.dtype", self.dtype, ("float32", "bfloat16"))
        if self.dynamic_sampling.enabled and self.group_size < 2:
            raise ValueError(
                f"rollout.dynamic_sampling needs group_size >= 2 (a group of 1 never has differing rewards), "
                f"got {self.group_size}; raise rollout.group_size or set "
                f"rollout.dynamic_sampling.enabled=false"
            )
        max_len, cache_len = self.overlong_lengths
        if cache_len > max_len:
            raise ValueError(
                f"rollout.overlong.cache_tokens ({cache_len}) must be "
                f"<= L_max ({max_len}); lower it or raise max_tokens"
            )

    @property
    def overlong_lengths(self) -> tuple[int, int]:
        """``(L_max, L_cache)`` of the overlong penalty, scaled to this rollout's budget by default."""
        max_len = self.overlong.max_tokens or self.max_total_tokens
        cache_len = self.overlong.cache_tokens or max(1, max_len // 5)
        return max_len, cache_len

    def with_method_defaults(self, *, dynamic_sampling: bool, overlong_shaping: bool) -> RolloutConfig:
        """This config with every ``enabled=None`` (= the method's choice) replaced by the method's value."""
        ds, ol = self.dynamic_sampling, self.overlong
        return replace(
            self,
            dynamic_sampling=ds if ds.enabled is not None else replace(ds, enabled=dynamic_sampling),
            overlong=ol if ol.enabled is not None else replace(ol, enabled=overlong_shaping),
        )

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
    """``count`` distinct prompts of batch ``j``, drawn from ``pool`` by a generator seeded with ``(seed,
    j)``."""
    if count > len(pool):
        raise ValueError(f"a batch needs {count} distinct prompts but the train split has {len(pool)}")
    rng = random.Random(batch_seed(seed, batch_index) ^ 0x5EED)
    return [pool[i] for i in rng.sample(range(len(pool)), count)]


def round_seed(seed: int, batch_index: int, round_index: int) -> int:
    """Sampling seed of dynamic-sampling round ``r`` of batch ``j``; round 0 is :func:`batch_seed`."""
    if round_index == 0:
        return batch_seed(seed, batch_index)
    digest = hashlib.blake2b(f"copc-round:{seed}:{batch_index}:{round_index}".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**63 - 1)


def extra_prompts(
    pool: Sequence[Prompt], seed: int, batch_index: int, round_index: int, count: int, exclude: set[str]
) -> list[Prompt]:
    """Up to ``count`` prompts of round ``r >= 1`` of batch ``j`` whose ids are not in ``exclude``,
    drawn by a generator seeded with ``(seed, j, r)`` (fewer when the pool runs out)."""
    candidates = [i for i, prompt in enumerate(pool) if prompt.id not in exclude]
    rng = random.Random(round_seed(seed, batch_index, round_index) ^ 0x5EED)
    return [pool[i] for i in rng.sample(candidates, min(count, len(candidates)))]


@dataclass
class GeneratedBatch:
    """One generated training batch: its index, the version that sampled its first tokens and timing.

    ``info`` holds the batch's rollout-side metrics (dynamic sampling counters, mean overlong penalty:
    ``copc.tracking`` names); ``rejected`` the prompt of every trajectory dynamic sampling dropped (one
    entry per trajectory), so a buffer that admitted them can clear them.
    """

    index: int
    version: int
    trajectories: list[Trajectory]
    generate_s: float
    info: dict[str, float] = field(default_factory=dict)
    rejected: list[Prompt] = field(default_factory=list)


def _informative(group: Sequence[Trajectory]) -> bool:
    """True if the group's rewards are not all equal (a group baseline gets a signal from it)."""
    return any(t.reward != group[0].reward for t in group)


class RolloutGenerator:
    """Generates batch ``j`` with given weights: prompts, envs, the engine and the episode loop.

    Owns its own copy of the policy (an engine model), cast to ``config.dtype``; :meth:`load` replaces
    its weights (cast on the way in). Dynamic sampling and overlong shaping run here (module docstring),
    so every driver gets them.
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
        if config.dtype != "float32":
            model = model.to(getattr(torch, config.dtype))  # load_state_dict casts later weights to it
        self.engine = Engine(model, tokenizer, version=0)
        self.pool = task.prompts("train")
        self._by_id = {p.id: p for p in self.pool}
        self.chat = chat_format(tokenizer, config.chat_template)
        self._refresh: Callable[[], bool] | None = None  # set for the duration of one generate() call
        self._chunk_tokens = 0

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def dtype(self) -> torch.dtype:
        """The dtype it samples in (``rollout.dtype``)."""
        return getattr(torch, self.config.dtype)  # type: ignore[no-any-return]

    def load(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Sample with ``weights`` (version ``version``) from now on; versions never go back."""
        if version == self.engine.version:
            return  # already loaded (the model starts as version 0)
        if version < self.engine.version:
            raise RuntimeError(f"asked to sample with version {version} after version {self.engine.version}")
        self.engine.load_weights(weights, version)

    def generate(
        self, batch_index: int, *, refresh: Callable[[], bool] | None = None, chunk_tokens: int = 0
    ) -> GeneratedBatch:
        """Batch ``batch_index``: ``prompts_per_batch`` groups of ``group_size`` trajectories.

        With ``refresh`` (partial rollouts, :func:`~copc.rollout.episode.run_episodes`), newer weights
        may be loaded between decode chunks of ``chunk_tokens`` tokens and at turn boundaries; the
        batch's ``version`` is then the one it started with and each token carries its own.
        """
        self._refresh, self._chunk_tokens = refresh, chunk_tokens
        try:
            return self._generate(batch_index)
        finally:
            self._refresh, self._chunk_tokens = None, 0

    def _generate(self, batch_index: int) -> GeneratedBatch:
        start = time.perf_counter()
        first_version = self.version
        num_groups = self.config.prompts_per_batch
        prompts = batch_prompts(self.pool, self.seed, batch_index, num_groups)
        groups = self._run_round(prompts, batch_index, 0)
        info: dict[str, float] = {}
        rejected: list[Prompt] = []
        if self.config.dynamic_sampling.enabled:
            groups, rejected, info = self._fill_informative(groups, prompts, batch_index)
        if self.config.infra_failures == "drop":
            failed = [any(t.info.get("tool_infra_errors", 0.0) > 0 for t in g) for g in groups]
            hit = [g for g, bad in zip(groups, failed, strict=True) if bad]
            groups = [g for g, bad in zip(groups, failed, strict=True) if not bad]
            rejected += [self._by_id[t.prompt_id] for g in hit for t in g]  # one per dropped trajectory
            info[m.ROLLOUT_INFRA_DROPPED_GROUPS] = float(len(hit))
        trajectories = [
            replace(t, group=batch_index * num_groups + k) for k, group in enumerate(groups) for t in group
        ]
        if self.config.overlong.enabled:
            trajectories, mean_penalty = self._shape_overlong(trajectories)
            info[m.ROLLOUT_OVERLONG_PENALTY] = mean_penalty
        return GeneratedBatch(batch_index, first_version, trajectories, time.perf_counter() - start, info,
                              rejected)

    def _run_round(self, prompts: Sequence[Prompt], batch_index: int,
                   round_index: int) -> list[list[Trajectory]]:
        """One group of ``group_size`` episodes per prompt, sampled with the round's seed."""
        group = self.config.group_size
        envs = [self.task.make_env(p) for p in prompts for _ in range(group)]
        trajectories = run_episodes(
            self.engine,
            envs,
            sampling=self.config.sampling(),
            seed=round_seed(self.seed, batch_index, round_index),
            max_turns=self.config.max_turns,
            max_new_tokens_per_turn=self.config.max_new_tokens_per_turn,
            max_total_tokens=self.config.max_total_tokens,
            context_limit=self.config.context_limit,
            group_ids=[batch_index * self.config.prompts_per_batch + i // group for i in range(len(envs))],
            prompt_ids=[p.id for p in prompts for _ in range(group)],
            chat=self.chat,
            refresh=self._refresh,
            chunk_tokens=self._chunk_tokens,
        )
        return [trajectories[k * group : (k + 1) * group] for k in range(len(prompts))]

    def _fill_informative(
        self, groups: list[list[Trajectory]], prompts: Sequence[Prompt], batch_index: int
    ) -> tuple[list[list[Trajectory]], list[Prompt], dict[str, float]]:
        """Dynamic sampling (module docstring): the batch's groups, the dropped prompts, the counters."""
        wanted = self.config.prompts_per_batch
        drawn = {p.id: p for p in prompts}
        kept = [g for g in groups if _informative(g)]
        flat = [g for g in groups if not _informative(g)]
        generated, rounds = len(groups), 1
        while len(kept) < wanted and rounds < self.config.dynamic_sampling.max_rounds:
            shortfall = wanted - len(kept)
            count = min(wanted, math.ceil(shortfall * generated / max(len(kept), 1)))
            new = extra_prompts(self.pool, self.seed, batch_index, rounds, count, set(drawn))
            if not new:
                break  # the train split has no prompt left that this batch has not used
            drawn.update((p.id, p) for p in new)
            for g in self._run_round(new, batch_index, rounds):
                (kept if _informative(g) else flat).append(g)
            generated += len(new)
            rounds += 1
        short = max(0, wanted - len(kept))  # <= len(flat): round 0 alone holds `wanted` groups
        batch = kept[:wanted] + flat[:short]
        dropped = kept[wanted:] + flat[short:]
        info = {
            m.ROLLOUT_DYNSAMPLE_ROUNDS: float(rounds),
            m.ROLLOUT_DYNSAMPLE_EXTRA_GROUPS: float(generated - len(groups)),
            m.ROLLOUT_DYNSAMPLE_DROPPED_GROUPS: float(len(dropped)),
            m.ROLLOUT_DYNSAMPLE_PADDED_GROUPS: float(short),
            m.ROLLOUT_DYNSAMPLE_SHORT: float(short > 0),
        }
        rejected = [drawn[t.prompt_id] for g in dropped for t in g]
        return batch, rejected, info

    def _shape_overlong(self, trajectories: list[Trajectory]) -> tuple[list[Trajectory], float]:
        """Each trajectory with DAPO's length penalty added to its reward; and the mean penalty."""
        max_len, cache_len = self.config.overlong_lengths
        shaped, total = [], 0.0
        for traj in trajectories:
            penalty = overlong_penalty(
                traj.num_action_tokens, max_len=max_len, cache_len=cache_len,
                factor=self.config.overlong.factor
            )
            total += penalty
            if penalty == 0.0:
                shaped.append(traj)
                continue
            token_rewards = traj.token_rewards.clone()
            token_rewards[-1] += penalty  # folded onto the last policy token like the terminal reward
            info = {**traj.info, "overlong_penalty": penalty}
            shaped.append(replace(traj, reward=traj.reward + penalty, token_rewards=token_rewards, info=info))
        return shaped, total / max(len(trajectories), 1)


