"""A Monte-Carlo oracle of the current policy's turn-level advantages on recorded episodes.

For a recorded trajectory with policy turns ``0 .. K-1``, chunk ``k`` starts at the boundary before turn
``k`` (the prompt, then the end of each turn's observation; :func:`copc.rollout.episode.boundary_lengths`).
From each chunk start the oracle replays the recorded turns through a fresh environment
(:func:`copc.rollout.episode.continue_episodes`, which checks that every observation comes back token for
token) and samples ``samples`` continuations with the engine's weights, the *current* policy. The mean
return of the continuations after the boundary is ``V_k`` (an unbiased estimate of the current policy's
value there; its variance over the continuations, divided by their number, is kept as ``value_var``), and
:func:`copc.ops.chunk_advantages` turns the values into ``A_k = R_k + V_{k+1} - V_k``.

Nothing sampled here is trained on. The cost is ``samples`` partial episodes per turn of every trajectory
scored: about ``samples * K / 2`` whole episodes per trajectory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from copc.ops import chunk_advantages
from copc.rollout.chat import ChatFormat
from copc.rollout.engine import Engine
from copc.rollout.episode import continue_episodes
from copc.rollout.sampling import SamplingConfig
from copc.rollout.turns import ReplayError, boundary_lengths
from copc.types import Env, Trajectory

__all__ = ["OracleEstimate", "chunk_ids_of", "mc_oracle"]


class OracleEstimate(NamedTuple):
    """The oracle's view of one trajectory (``T`` its tokens, ``K`` its policy turns)."""

    chunk_ids: torch.Tensor  # [T] int64, chunk of each token (-1 for the prompt)
    values: torch.Tensor  # [K] float32, V_k at each chunk's start, mean of the continuations' returns
    value_var: torch.Tensor  # [K] float32, variance of that mean (sample variance / samples)
    advantages: torch.Tensor  # [T] float32, A_k on chunk k's action tokens, 0 elsewhere


def chunk_ids_of(bounds: Sequence[int], length: int) -> torch.Tensor:
    """``[length] int64``: chunk ``k`` from ``bounds[k]`` to ``bounds[k+1]``, -1 before ``bounds[0]``."""
    ids = torch.full((length,), -1, dtype=torch.long)
    for k, start in enumerate(bounds[:-1]):
        ids[start : bounds[k + 1]] = k
    return ids


def mc_oracle(
    engine: Engine,
    make_env: Callable[[Trajectory], Env],
    trajectories: Sequence[Trajectory],
    *,
    samples: int,
    max_turns: int,
    max_new_tokens_per_turn: int,
    max_total_tokens: int,
    context_limit: int,
    sampling: SamplingConfig | None = None,
    seed: int | None = None,
    chat: ChatFormat | None = None,
    env_workers: int = 8,
) -> list[OracleEstimate | None]:
    """Oracle values and chunk advantages of each trajectory under ``engine``'s weights (module docstring).

    ``make_env(trajectory)`` gives a fresh environment for the trajectory's prompt. Continuation ``m`` from
    chunk ``k`` of trajectory ``i`` samples with its own stream under ``seed``. A trajectory whose prefix
    cannot be replayed (:class:`~copc.rollout.episode.ReplayError`) or that has no policy turn gets None.
    """
    if samples < 1:
        raise ValueError(f"mc_oracle: samples must be >= 1, got {samples}")
    stops_of = [tuple(make_env(t).stop_strings) for t in trajectories]
    bounds = [boundary_lengths(engine, t, stops) for t, stops in zip(trajectories, stops_of, strict=True)]
    jobs = [(i, k) for i, b in enumerate(bounds) for k in range(len(b) - 1)]
    returns: dict[tuple[int, int], list[float]] = {}
    failed: set[int] = set()
    budgets: dict[str, Any] = {"max_turns": max_turns, "max_new_tokens_per_turn": max_new_tokens_per_turn,
                               "max_total_tokens": max_total_tokens, "context_limit": context_limit}
    try:
        rows = [(i, k, m) for i, k in jobs for m in range(samples)]
        played = continue_episodes(
            engine, [make_env(trajectories[i]) for i, _, _ in rows], [trajectories[i] for i, _, _ in rows],
            [k for _, k, _ in rows], indices=[(i * 1024 + k) * 1024 + m for i, k, m in rows],
            sampling=sampling,
            seed=seed, chat=chat, env_workers=env_workers, **budgets,
        )
    except ReplayError:
        played = None
    if played is None:  # find the rows that fail one trajectory at a time, keep the others
        played_rows: list[Trajectory | None] = []
        for i, k in jobs:
            try:
                got = continue_episodes(
                    engine, [make_env(trajectories[i]) for _ in range(samples)], [trajectories[i]] * samples,
                    [k] * samples, indices=[(i * 1024 + k) * 1024 + m for m in range(samples)],
                    sampling=sampling,
                    seed=seed, chat=chat, env_workers=env_workers, **budgets,
                )
                played_rows += got
            except ReplayError:
                failed.add(i)
                played_rows += [None] * samples
        rows_out: Sequence[Trajectory | None] = played_rows
    else:
        rows_out = played
    for (i, k, _), traj in zip(((i, k, m) for i, k in jobs for m in range(samples)), rows_out, strict=True):
        if traj is None:
            continue
        start = bounds[i][k]
        returns.setdefault((i, k), []).append(float(traj.token_rewards[start:].sum()))
    out: list[OracleEstimate | None] = []
    for i, traj in enumerate(trajectories):
        k_n = len(bounds[i]) - 1
        if i in failed or k_n == 0:
            out.append(None)
            continue
        per = torch.tensor([returns[(i, k)] for k in range(k_n)], dtype=torch.float64)  # [K, samples]
        values = per.mean(dim=1).float()
        var = (per.var(dim=1, unbiased=True) / samples).float() if samples > 1 else torch.zeros(k_n)
        ids = chunk_ids_of(bounds[i], traj.num_tokens)
        adv = chunk_advantages(
            traj.token_rewards[None].float(), ids[None], traj.action_mask[None], values[None],
            torch.tensor([k_n])
        )[0]
        out.append(OracleEstimate(ids, values, var, adv))
    return out
