"""From a list of :class:`~copc.types.Trajectory` to padded ``[B, T]`` tensors, and how a step's batch is cut.

Notation: ``B`` trajectories, ``T`` the longest trajectory of the batch (rows are right-padded).

Right padding is used because every trajectory starts at position 0, so a causal LM's default position
ids (``0..T-1``) are correct for every row; padded positions have ``attention_mask`` False and
``action_mask`` False, so they never count in a loss, a statistic or a gradient.

A step's batch is cut in two levels (verl / TRL convention):

- **minibatches**: one optimizer step each (``actor_minibatches`` / ``critic_minibatches`` per step);
- **micro-batches**: pieces of a minibatch whose gradients are accumulated before that optimizer step.
  Every micro-batch divides its loss by the **global** token count of its minibatch
  (:attr:`Minibatch.num_tokens`), so the accumulated gradient equals the gradient of the whole
  minibatch's token-mean loss whatever the micro-batch size (tested: 1 x 8 == 8 x 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from copc.types import Trajectory

__all__ = ["Minibatch", "TrainBatch", "collate", "micro_batches", "split_minibatches"]


@dataclass(frozen=True)
class TrainBatch:
    """A padded batch of trajectories.

    Attributes:
        input_ids: ``[B, T] int64``, token ids, right-padded with the tokenizer's pad id.
        attention_mask: ``[B, T] bool``, True on real tokens.
        action_mask: ``[B, T] bool``, True exactly on tokens the policy sampled (the trainable ones).
        logp_behav: ``[B, T] float32``, behaviour log-probs mu_t; 0 off ``action_mask``.
        policy_version: ``[B, T] int64``, weight version that sampled each token; -1 off ``action_mask``.
        token_rewards: ``[B, T] float32``, rewards where the environment put them (folded later).
        scores: ``[B] float32``, episode rewards (group baselines, reward metrics).
        truncated: ``[B] bool``, True when the episode was cut (docs/formulas.md#notation, ``truncation``).
        group_ids: ``[B] int64``, prompt group of each row (group-normalised baselines).
        void: ``[B] bool``, True when the episode had a void turn (``info["void_turn"]``: neither a tool
            call nor an answer; ``trainer.void_turns = mask`` leaves such rows out of the losses).
        oracle_advantages: ``[B, T] float32``, the Monte-Carlo oracle's chunk advantages under the weights
            being trained (``mc_oracle`` estimator; copc.rollout.oracle), None when not computed.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    logp_behav: torch.Tensor
    policy_version: torch.Tensor
    token_rewards: torch.Tensor
    scores: torch.Tensor
    truncated: torch.Tensor
    group_ids: torch.Tensor
    void: torch.Tensor
    oracle_advantages: torch.Tensor | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.input_ids.shape)
        if len(shape) != 2:
            raise ValueError(f"TrainBatch.input_ids must be [B, T], got {shape}")
        for name in ("attention_mask", "action_mask", "logp_behav", "policy_version", "token_rewards"):
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(
                    f"TrainBatch.{name} has shape {tuple(getattr(self, name).shape)}, expected {shape}")
        for name in ("scores", "truncated", "group_ids", "void"):
            if tuple(getattr(self, name).shape) != (shape[0],):
                raise ValueError(f"TrainBatch.{name} must be [B] = ({shape[0]},)")
        if self.oracle_advantages is not None and tuple(self.oracle_advantages.shape) != shape:
            raise ValueError(f"TrainBatch.oracle_advantages has shape {tuple(self.oracle_advantages.shape)}, "
                             f"expected {shape}")
        for name in ("attention_mask", "action_mask", "truncated", "void"):
            if getattr(self, name).dtype != torch.bool:
                raise TypeError(f"TrainBatch.{name} must be torch.bool")

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_action_tokens(self) -> int:
        return int(self.action_mask.sum())

    def rows(self, index: torch.Tensor) -> TrainBatch:
        """The rows ``index`` (``[b] int64``) of every field, in that order (same ``T``)."""
        picked = {f.name: None if (v := getattr(self, f.name)) is None else v[index] for f in fields(self)}
        return TrainBatch(**picked)  # type: ignore[arg-type]  # only oracle_advantages may be None


def collate(trajectories: Sequence[Trajectory], *, pad_id: int) -> TrainBatch:
    """Right-pad ``trajectories`` into one :class:`TrainBatch` (row ``i`` = ``trajectories[i]``)."""
    if not trajectories:
        raise ValueError(
            "collate needs at least one trajectory; the driver handed the trainer an empty batch")
    batch, length = len(trajectories), max(t.num_tokens for t in trajectories)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.bool)
    action_mask = torch.zeros((batch, length), dtype=torch.bool)
    logp_behav = torch.zeros((batch, length), dtype=torch.float32)
    policy_version = torch.full((batch, length), -1, dtype=torch.long)
    token_rewards = torch.zeros((batch, length), dtype=torch.float32)
    for row, traj in enumerate(trajectories):
        n = traj.num_tokens
        input_ids[row, :n] = traj.token_ids.long()
        attention_mask[row, :n] = True
        action_mask[row, :n] = traj.action_mask
        # Off-action entries are forced to their neutral values whatever the producer stored there.
        logp_behav[row, :n] = torch.where(traj.action_mask, traj.logp_behav.float(), 0.0)
        policy_version[row, :n] = torch.where(traj.action_mask, traj.policy_version.long(), -1)
        token_rewards[row, :n] = traj.token_rewards.float()
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        action_mask=action_mask,
        logp_behav=logp_behav,
        policy_version=policy_version,
        token_rewards=token_rewards,
        scores=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        truncated=torch.tensor([t.truncated for t in trajectories], dtype=torch.bool),
        group_ids=torch.tensor([t.group for t in trajectories], dtype=torch.long),
        void=torch.tensor([t.info.get("void_turn", 0.0) > 0 for t in trajectories], dtype=torch.bool),
    )


@dataclass(frozen=True)
class Minibatch:
    """The rows of one optimizer step and the global counts every micro-batch divides by.

    Attributes:
        index: ``[b] int64`` row indices into the step's batch.
        num_tokens: action tokens over all rows of the minibatch (the ``token-mean`` denominator).
        num_seqs: rows of the minibatch with at least one action token (the ``seq-*`` denominators).
        loss_tokens: the actor loss's token denominator when it is not ``num_tokens`` (the kept tokens
            under ``policy.denominator = "kept"``); None = ``num_tokens``. KL, entropy and statistics
            always divide by ``num_tokens``.
    """

    index: torch.Tensor
    num_tokens: int
    num_seqs: int
    loss_tokens: int | None = None

    @property
    def actor_tokens(self) -> int:
        """The actor loss's token denominator: ``loss_tokens`` if set, else ``num_tokens``."""
        return self.num_tokens if self.loss_tokens is None else self.loss_tokens


def split_minibatches(
    action_mask: torch.Tensor, num_minibatches: int, *, generator: torch.Generator | None = None
) -> list[Minibatch]:
    """Cut the ``B`` rows into ``num_minibatches`` near-equal minibatches.

    Rows are shuffled with ``generator`` when one is given (deterministic for its seed), else kept in
    order. Sizes differ by at most one; ``num_minibatches`` larger than ``B`` is reduced to ``B``.

    Args:
        action_mask: ``[B, T] bool`` of the step's batch (for the global counts).
    """
    if num_minibatches < 1:
        raise ValueError(f"num_minibatches must be >= 1, got {num_minibatches}")
    rows = action_mask.shape[0]
    order = torch.randperm(rows, generator=generator) if generator is not None else torch.arange(rows)
    chunks = torch.tensor_split(order, min(num_minibatches, rows))
    return [
        Minibatch(
            index=chunk,
            num_tokens=int(action_mask[chunk].sum()),
            num_seqs=int(action_mask[chunk].any(dim=-1).sum()),
        )
        for chunk in chunks
    ]


def micro_batches(
    index: torch.Tensor, micro_batch_size: int, lengths: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Consecutive pieces of ``index`` of at most ``micro_batch_size`` rows (gradient accumulation); none
    for an empty ``index``. With ``lengths`` (``[B]``, every row's token count) the rows are first sorted
    by length (stable), so each piece, trimmed to its longest row, carries less padding; the pieces still
    cover ``index`` once, so their summed losses and gradients are the minibatch's, up to float rounding."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if not len(index):
        return []
    if lengths is not None:
        index = index[torch.sort(lengths[index], stable=True).indices]
    return list(torch.split(index, micro_batch_size))
