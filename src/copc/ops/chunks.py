"""Turn-level (chunk) advantages from values at turn boundaries, and their errors against an estimate.

A multi-turn episode splits into chunks: chunk ``k`` starts at the boundary before policy turn ``k`` (the
prompt for ``k = 0``, the end of turn ``k-1``'s observation after it) and runs to the next boundary.
Every token belongs to at most one chunk (``chunk_ids``; -1 for the prompt and padding). With the value
``V_k`` of the state at chunk ``k``'s start, the reward ``R_k`` of the chunk's tokens and ``V_K = 0``
after the last chunk (the episode has ended), the chunk advantage is (gamma = 1)::

    A_k = R_k + V_{k+1} - V_k            so that      sum_k A_k = sum_k R_k - V_0,

the return minus the value of the prompt. When the values are those of the current policy (estimated by
Monte-Carlo continuations sampled from each boundary, :mod:`copc.rollout.oracle`) and the environment is
deterministic, ``R_k + V_{k+1}`` is the value of taking turn ``k`` at chunk ``k``'s start, so ``A_k`` is the
current policy's advantage of that turn: the reference a stale advantage estimate is measured against.
Every action token of chunk ``k`` carries ``A_k``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from copc.ops.masked import check_mask

__all__ = ["ChunkErrors", "chunk_advantages", "chunk_errors", "chunk_means"]


def _check_chunks(chunk_ids: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(chunk_ids.shape) != shape or chunk_ids.dtype != torch.long:
        raise ValueError(
            f"chunk_ids must be [B, T] int64 like the tokens {shape}, got {tuple(chunk_ids.shape)} "
                         f"{chunk_ids.dtype}")


def chunk_advantages(
    rewards: torch.Tensor, chunk_ids: torch.Tensor, action_mask: torch.Tensor, chunk_values: torch.Tensor,
    num_chunks: torch.Tensor,
) -> torch.Tensor:
    """Per-token chunk advantages ``A_k = R_k + V_{k+1} - V_k`` (module docstring).

    Args:
        rewards: ``[B, T] float32`` token rewards (where the environment put them).
        chunk_ids: ``[B, T] int64`` chunk of each token, -1 outside every chunk.
        action_mask: ``[B, T] bool``; only action tokens receive an advantage.
        chunk_values: ``[B, K] float32`` value at each chunk's start; entries ``k >= num_chunks[b]`` unused.
        num_chunks: ``[B] int64`` chunks of each row (``V`` after the last one is 0).

    Returns:
        ``[B, T] float32``: ``A_k`` on the action tokens of chunk ``k``, exactly 0 elsewhere.
    """
    check_mask("action_mask", action_mask)
    _check_chunks(chunk_ids, tuple(action_mask.shape))
    b, k = chunk_values.shape
    if b != action_mask.shape[0] or tuple(num_chunks.shape) != (b,):
        raise ValueError(f"chunk_values must be [B, K] and num_chunks [B] with B = {action_mask.shape[0]}")
    if bool((chunk_ids >= num_chunks[:, None]).any()):
        raise ValueError("chunk_ids names a chunk at or past num_chunks of its row")
    inside = chunk_ids >= 0
    index = chunk_ids.clamp(min=0)
    chunk_rewards = torch.zeros(b, k, dtype=torch.float32).scatter_add_(
        1, index, torch.where(inside, rewards.float(), 0.0)
    )
    live = torch.arange(k)[None, :] < num_chunks[:, None]
    values = torch.where(live, chunk_values.float(), 0.0)
    following = torch.cat([values[:, 1:], torch.zeros(b, 1)], dim=1)
    per_chunk = torch.where(live, chunk_rewards + following - values, 0.0)
    return torch.where(inside & action_mask, per_chunk.gather(1, index), 0.0)


def chunk_means(
    x: torch.Tensor, chunk_ids: torch.Tensor, action_mask: torch.Tensor, num_chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of ``x`` over each chunk's action tokens: ``([B, K] float32, [B, K] int64 token counts)``;
    a chunk without an action token has mean 0 and count 0."""
    check_mask("action_mask", action_mask)
    _check_chunks(chunk_ids, tuple(action_mask.shape))
    counted = action_mask & (chunk_ids >= 0)
    index = chunk_ids.clamp(min=0)
    b = x.shape[0]
    sums = torch.zeros(b, num_chunks, dtype=torch.float32).scatter_add_(1, index, torch.where(counted,
                                                                                              x.float(), 0.0))
    counts = torch.zeros(b, num_chunks, dtype=torch.long).scatter_add_(1, index, counted.long())
    return torch.where(counts > 0, sums / counts.clamp(min=1), 0.0), counts


class ChunkErrors(NamedTuple):
    """How an estimate of chunk advantages compares with the reference, over ``n`` chunks."""

    bias: torch.Tensor  # mean(estimate - reference)
    mse: torch.Tensor  # mean((estimate - reference)^2)
    corr: torch.Tensor  # Pearson correlation (0 when either side is constant)
    n: int


def chunk_errors(estimate: torch.Tensor, reference: torch.Tensor) -> ChunkErrors:
    """Bias, mean squared error and correlation of ``estimate`` against ``reference`` (both ``[N]``)."""
    if estimate.shape != reference.shape or estimate.dim() != 1:
        raise ValueError(f"estimate and reference must both be [N], got {tuple(estimate.shape)}, "
                         f"{tuple(reference.shape)}")
    if estimate.numel() == 0:
        zero = torch.zeros(())
        return ChunkErrors(zero, zero, zero, 0)
    e, r = estimate.double(), reference.double()
    diff = e - r
    ec, rc = e - e.mean(), r - r.mean()
    denom = (ec.square().sum() * rc.square().sum()).sqrt()
    corr = torch.where(denom > 0, (ec * rc).sum() / denom.clamp(min=1e-300), 0.0)
    return ChunkErrors(diff.mean().float(), diff.square().mean().float(), corr.float(), int(e.numel()))
