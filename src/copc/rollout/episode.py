"""The multi-turn tool loop: many episodes advanced together, one batched engine call per turn.

Each episode's token sequence is built by appending, never by re-tokenising text, so the ids of a
:class:`~copc.types.Trajectory` are exactly what the model saw. Raw text (no chat format)::

    prompt   = tokenizer(env.initial_text())              (special tokens added, e.g. BOS)
    turn k   = the tokens the engine sampled               action_mask True, logp_behav, version per token
    obs k    = tokenizer(observation, no special tokens)   action_mask False, logp 0, version -1

With a :class:`~copc.rollout.chat.ChatFormat` (``rollout.chat_template``) the prompt is the template's
user turn plus its generation prompt, and ``obs k`` is the template's end of the assistant message, the
observation as a tool (or user) turn and the next generation prompt, all forced (action_mask False): the
decoded trajectory equals ``apply_chat_template`` of the conversation. An EOS then ends the assistant
*message*, not the episode: a tool call that ends with EOS still gets its observation.

One round: every unfinished episode generates its next turn in the same ``Engine.generate`` call (stop
strings from its env, its own token budget; with ``reuse_kv`` the keys/values of what the episode was
already fed are passed back, so only the last sampled token and the observation are fed). Then, per
episode:

- the turn hit a token limit without stopping on its own (the per-turn limit
  ``max_new_tokens_per_turn`` or the episode's ``max_total_tokens`` -> ``MAX_TOKENS``, the context window
  -> ``CONTEXT_LIMIT``): it is not stepped (a cut turn is neither an answer nor a void turn), the episode
  ends with ``env.finish(reason)`` and is truncated; ``info["turn_cut"] = 1`` says the turn reached the
  per-turn limit (also when the episode's budget or the context ran out at the same token);
- otherwise ``env.step(turn_text)`` (also after EOS: the env grades or rejects a turn that ended with
  end-of-sequence). ``done`` -> the episode ends with StopReason.ANSWER ("the environment said done").
  Not done after an EOS turn -> ``env.finish(EOS)`` (raw text; with a chat format only when there is no
  observation). Otherwise the observation is appended (cut at the context window), and the episode ends
  with ``env.finish(...)`` if the turn budget, the token budget or the context window is now exhausted,
  else it goes on to the next round.

Rewards: a ``step`` reward lands on the last token of the turn that produced it; a ``finish`` reward
on the last token of the trajectory (the trainer folds rewards onto policy tokens, docs/formulas.md#notation);
``reward`` is their sum. ``info`` holds the env's counters (an env reports running totals, so the
latest value of each key wins) plus the loop's own: ``policy_turns``, ``gen_tokens``, ``obs_tokens``,
``env_errors``, ``cut_turns`` (turns cut by any token limit: 0 or 1, a cut ends the episode) and
``turn_cut`` (1 when that cut was the per-turn limit).
:func:`~copc.rollout.episode_state.truncation_stats` turns them into the per-turn and per-episode
truncation rates.

:func:`continue_episodes` replays a recorded episode's first turns through a fresh env (checking every
observation) and samples the rest: Monte-Carlo continuations from a turn boundary (copc.rollout.oracle).

An exception raised by ``env.step`` or ``env.finish`` ends that episode only: reward 0, ``env_errors``
= 1, stop reason ENV_ERROR, and the traceback is logged. Other episodes carry on. ``env.step`` calls of
one round run concurrently in a thread pool (``env_workers``); envs must be independent of each other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from copc.rollout.chat import ChatFormat
from copc.rollout.engine import Engine, FinishReason, Generation
from copc.rollout.episode_state import (
    RunningEpisode,
    TurnCut,
    call_env,
    cut_by_limit,
    end_by_loop,
    end_cut_turn,
    to_trajectory,
)
from copc.rollout.sampling import SamplingConfig
from copc.rollout.turns import ReplayError, recorded_turn, turn_end
from copc.types import Env, EnvStep, StopReason, Trajectory


def _turn_seed(seed: int, episode: int, turn: int) -> int:
    """Independent 63-bit seed per (run seed, episode, turn): same seed -> same trajectories."""
    return int(np.random.SeedSequence([seed, episode, turn]).generate_state(1, dtype=np.uint64)[0]) >> 1


def _check_limits(
    max_turns: int, max_new_tokens_per_turn: int, max_total_tokens: int, context_limit: int
) -> None:
    for name, value in (
        ("max_turns", max_turns),
        ("max_new_tokens_per_turn", max_new_tokens_per_turn),
        ("max_total_tokens", max_total_tokens),
        ("context_limit", context_limit),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1 (got {value})")


def run_episodes(
    engine: Engine,
    envs: Sequence[Env],
    *,
    max_turns: int,
    max_new_tokens_per_turn: int,
    max_total_tokens: int,
    context_limit: int,
    group_ids: Sequence[int] | None = None,
    prompt_ids: Sequence[str] | None = None,
    sampling: SamplingConfig | None = None,
    seed: int | None = None,
    reuse_kv: bool = True,
    env_workers: int = 8,
    chat: ChatFormat | None = None,
    refresh: Callable[[], bool] | None = None,
    chunk_tokens: int = 0,
    on_round: Callable[[int], None] | None = None,
) -> list[Trajectory]:
    """Run every env to the end, batching all active episodes in each engine call (module docstring).

    Args:
        engine: the sampler; every sampled token is stamped with ``engine.version`` at sampling time.
        envs: fresh single-use environments, one per episode.
        max_turns: policy turns per episode.
        max_new_tokens_per_turn: tokens one turn may generate.
        max_total_tokens: tokens the policy may generate over the whole episode.
        context_limit: most tokens (prompt + turns + observations) a trajectory may hold.
        group_ids: ``Trajectory.group`` per episode (default 0).
        prompt_ids: ``Trajectory.prompt_id`` per episode (default: the episode's index as a string).
        sampling: temperature / top-k / top-p (its ``max_new_tokens`` and ``stop_strings`` are replaced
            per episode by the budgets above and the env's stop strings). Default: plain sampling at 1.
        seed: with a seed, episode i's turn k draws from its own generator seeded by (seed, i, k), so the
            same seed gives the same trajectories whatever the batch composition; None uses torch's
            global RNG.
        reuse_kv: keep each episode's keys/values between turns so a turn only feeds the last sampled
            token and the observation (same tokens and log-probs as recomputing, up to float rounding;
            dropped automatically when the engine's weights change between turns).
        env_workers: threads that run one round's ``env.step`` calls concurrently (1 = sequential).
        chat: render the prompt and the observations through this chat format (module docstring);
            None: raw text.
        refresh: partial rollouts: called at every turn boundary and every ``chunk_tokens`` decode steps
            inside a turn; it may load newer weights into ``engine`` (True when it did), and the running
            episodes continue with them (``Engine.generate``). Each token keeps the version that sampled it.
        chunk_tokens: decode steps between refreshes inside a turn (0: turn boundaries only).
        on_round: called after each round of turns with the number of episodes finished so far (progress
            reports; it changes nothing sampled).

    Returns:
        One :class:`Trajectory` per env, in order.
    """
    _check_limits(max_turns, max_new_tokens_per_turn, max_total_tokens, context_limit)
    n = len(envs)
    for name, values in (("group_ids", group_ids), ("prompt_ids", prompt_ids)):
        if values is not None and len(values) != n:
            raise ValueError(f"{name} has {len(values)} entries for {n} envs; give one per env")
    episodes = [_start(engine, i, env, context_limit, chat) for i, env in enumerate(envs)]
    _play(engine, episodes, _Budgets(max_turns, max_new_tokens_per_turn, max_total_tokens, context_limit),
          sampling=sampling or SamplingConfig(), seed=seed, reuse_kv=reuse_kv, env_workers=env_workers,
          chat=chat, refresh=refresh, chunk_tokens=chunk_tokens, on_round=on_round)
    return [to_trajectory(ep, group_ids, prompt_ids) for ep in episodes]


class _Budgets(NamedTuple):
    max_turns: int
    max_new_tokens_per_turn: int
    max_total_tokens: int
    context_limit: int


def _play(
    engine: Engine, episodes: list[RunningEpisode], limits: _Budgets, *, sampling: SamplingConfig,
    seed: int | None, reuse_kv: bool, env_workers: int, chat: ChatFormat | None,
    refresh: Callable[[], bool] | None = None, chunk_tokens: int = 0,
    on_round: Callable[[int], None] | None = None,
) -> None:
    """Advance every unfinished episode, one batched engine call per round, until all have ended."""
    max_turns, max_new_tokens_per_turn, max_total_tokens, context_limit = limits
    while active := [ep for ep in episodes if ep.stop is None]:
        budgets = [
            min(max_new_tokens_per_turn, max_total_tokens - ep.generated, context_limit - len(ep.ids))
            for ep in active
        ]
        gens = engine.generate(
            [ep.ids for ep in active],
            sampling,
            seeds=None if seed is None else [_turn_seed(seed, ep.index, ep.turns) for ep in active],
            max_new_tokens=budgets,
            stop_strings=[tuple(ep.env.stop_strings) for ep in active],
            prefix_kv=[ep.kv for ep in active] if reuse_kv else None,
            return_kv=reuse_kv,
            refresh=refresh,
            chunk_tokens=chunk_tokens,
        )
        for ep, gen in zip(active, gens, strict=True):
            ep.add_turn(gen)
            ep.kv = gen.kv
        cuts = [
            cut_by_limit(ep, gen, max_new_tokens_per_turn=max_new_tokens_per_turn,
                         max_total_tokens=max_total_tokens, context_limit=context_limit)
            for ep, gen in zip(active, gens, strict=True)
        ]
        results = _step_envs(active, gens, cuts, workers=env_workers)
        for ep, gen, cut, result in zip(active, gens, cuts, results, strict=True):
            if cut is not None:
                end_cut_turn(ep, cut)
            elif result is not None:  # None: the env raised and call_env already ended the episode
                _after_turn(engine, chat, ep, gen, result, max_turns=max_turns,
                            max_total_tokens=max_total_tokens, context_limit=context_limit)
        if on_round is not None:
            on_round(sum(ep.stop is not None for ep in episodes))


def continue_episodes(
    engine: Engine,
    envs: Sequence[Env],
    prefixes: Sequence[Trajectory],
    turns: Sequence[int],
    *,
    max_turns: int,
    max_new_tokens_per_turn: int,
    max_total_tokens: int,
    context_limit: int,
    indices: Sequence[int] | None = None,
    sampling: SamplingConfig | None = None,
    seed: int | None = None,
    reuse_kv: bool = True,
    env_workers: int = 8,
    chat: ChatFormat | None = None,
) -> list[Trajectory]:
    """Replay the first ``turns[i]`` policy turns of ``prefixes[i]`` through a fresh ``envs[i]``, then let
    ``engine`` sample the rest of the episode (Monte-Carlo continuations from a turn boundary).

    Replay feeds each recorded turn's text to ``env.step`` exactly as the loop did and checks that the
    prompt and every observation come back token for token (:class:`ReplayError` otherwise: the
    environment is not deterministic, or the prefix was recorded under other settings). Replayed tokens
    keep their recorded behaviour log-probs and versions; the budgets count them, so a continuation ends
    where the original episode would have. ``indices[i]`` (default ``i``) names episode i's sampling
    stream under ``seed``: give each continuation of one prefix its own index.

    Returns:
        One whole :class:`Trajectory` per env (prefix then continuation), in order; the continuation's
        tokens start at the prefix's length, :func:`boundary_lengths` of the recorded trajectory.
    """
    _check_limits(max_turns, max_new_tokens_per_turn, max_total_tokens, context_limit)
    n = len(envs)
    if len(prefixes) != n or len(turns) != n or (indices is not None and len(indices) != n):
        raise ValueError(f"continue_episodes: give one prefix, turn count (and index) per env ({n} envs)")
    limits = _Budgets(max_turns, max_new_tokens_per_turn, max_total_tokens, context_limit)
    episodes = []
    for i, (env, prefix, k) in enumerate(zip(envs, prefixes, turns, strict=True)):
        ep = _start(engine, i if indices is None else indices[i], env, context_limit, chat)
        _replay(engine, chat, ep, prefix, k, limits)
        episodes.append(ep)
    _play(engine, episodes, limits, sampling=sampling or SamplingConfig(), seed=seed, reuse_kv=reuse_kv,
          env_workers=env_workers, chat=chat)
    return [replace(to_trajectory(ep, None, None), prompt_id=prefix.prompt_id, group=prefix.group)
            for ep, prefix in zip(episodes, prefixes, strict=True)]


def _replay(engine: Engine, chat: ChatFormat | None, ep: RunningEpisode, prefix: Trajectory, turns: int,
            limits: _Budgets) -> None:
    """Feed ``prefix``'s first ``turns`` policy turns to ``ep``'s env; raise :class:`ReplayError` on a
    mismatch."""
    recorded = prefix.token_ids.tolist()
    if ep.ids != recorded[: len(ep.ids)] or len(ep.ids) != prefix.prompt_len:
        raise ReplayError(f"prompt of {prefix.prompt_id!r} tokenises differently from the recorded one")
    mask = prefix.action_mask.tolist()
    stops = tuple(ep.env.stop_strings)
    for turn in range(turns):
        start = len(ep.ids)
        if start >= len(recorded) or not mask[start] or ep.stop is not None:
            raise ReplayError(
                f"{prefix.prompt_id!r} has no policy turn {turn + 1} to replay after {start} tokens")
        end = turn_end(engine, recorded, mask, start, stops)
        gen = recorded_turn(engine, recorded[start:end], prefix, start, stops)
        ep.add_turn(gen)
        result = call_env(ep, lambda gen=gen: ep.env.step(gen.text_to_stop))  # type: ignore[misc]
        if result is None or result.done:
            raise ReplayError(f"{prefix.prompt_id!r}: turn {turn + 1} ended the episode; replay at most the "
                              f"turns that were followed by another")
        _after_turn(engine, chat, ep, gen, result, max_turns=limits.max_turns,
                    max_total_tokens=limits.max_total_tokens, context_limit=limits.context_limit)
        if ep.ids != recorded[: len(ep.ids)]:
            raise ReplayError(f"{prefix.prompt_id!r}: the observation after turn {turn + 1} differs from the "
                              f"recorded one; the environment must answer the same call the same way")


def _start(
    engine: Engine, index: int, env: Env, context_limit: int, chat: ChatFormat | None
) -> RunningEpisode:
    text = env.initial_text()
    if chat is not None:
        ids = chat.prompt_ids(text)
    else:
        ids = list(engine.tokenizer(text, add_special_tokens=True)["input_ids"])
    if not ids:
        raise ValueError(
            f"env {index} has an empty prompt and the tokenizer adds no BOS: give it prompt text")
    ep = RunningEpisode(index=index, env=env, ids=ids, prompt_len=len(ids))
    if len(ids) >= context_limit:  # no room to generate a single token
        end_by_loop(ep, StopReason.CONTEXT_LIMIT)
    return ep


def _step_envs(
    active: list[RunningEpisode], gens: list[Generation], cuts: list[TurnCut | None], *, workers: int
) -> list[EnvStep | None]:
    """``env.step`` for every turn that was not cut, concurrently: tools (a sandboxed interpreter, a
    retriever) wait on other processes or I/O, so a round costs about one tool call, not one per episode.
    Results keep the episodes' order, so the outcome does not depend on scheduling."""
    todo = [i for i, cut in enumerate(cuts) if cut is None]
    results: list[EnvStep | None] = [None] * len(active)

    def step(i: int) -> EnvStep | None:
        ep, gen = active[i], gens[i]
        return call_env(ep, lambda: ep.env.step(gen.text_to_stop))

    if workers <= 1 or len(todo) <= 1:
        stepped = [step(i) for i in todo]
    else:
        with ThreadPoolExecutor(max_workers=min(workers, len(todo))) as pool:
            stepped = list(pool.map(step, todo))
    for i, result in zip(todo, stepped, strict=True):
        results[i] = result
    return results


def _after_turn(
    engine: Engine,
    chat: ChatFormat | None,
    ep: RunningEpisode,
    gen: Generation,
    result: EnvStep,
    *,
    max_turns: int,
    max_total_tokens: int,
    context_limit: int,
) -> None:
    """Apply the env's answer to a turn that stopped on its own; append the observation or end the episode."""
    ep.add_reward(result)
    if result.done:
        ep.stop, ep.kv = StopReason.ANSWER, None
        return None
    if gen.finish is FinishReason.EOS and (chat is None or not result.observation):
        return end_by_loop(ep, StopReason.EOS)
    if result.observation:
        obs = _observation_ids(engine, chat, gen, result.observation)
        ep.add_observation(obs[: max(context_limit - len(ep.ids), 0)])
    if ep.turns >= max_turns:
        return end_by_loop(ep, StopReason.MAX_TURNS)
    if ep.generated >= max_total_tokens:
        return end_by_loop(ep, StopReason.MAX_TOKENS)
    if len(ep.ids) >= context_limit:
        return end_by_loop(ep, StopReason.CONTEXT_LIMIT)
    return None


def _observation_ids(engine: Engine, chat: ChatFormat | None, gen: Generation, observation: str) -> list[int]:
    if chat is None:
        return list(engine.tokenizer(observation, add_special_tokens=False)["input_ids"])
    eos_text = None
    if gen.finish is FinishReason.EOS:
        eos_text = str(engine.tokenizer.decode(gen.token_ids[-1:].tolist(), skip_special_tokens=False))
    return chat.observation_ids(observation, eos_text=eos_text)


