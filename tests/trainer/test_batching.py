"""Tests for copc.trainer.batching: padding layout, neutral values off the action mask, global counts."""

from __future__ import annotations

import torch

from copc.trainer.batching import collate, micro_batches, split_minibatches
from copc.types import StopReason, Trajectory


def make_traj(prompt: list[int], turns: list[tuple[list[int], bool]], *, version: int, reward: float,
              group: int = 0, stop: StopReason = StopReason.ANSWER) -> Trajectory:
    """Prompt tokens, then spans that are either sampled (True) or inserted tool output (False)."""
    ids = list(prompt)
    mask = [False] * len(prompt)
    for span, sampled in turns:
        ids += span
        mask += [sampled] * len(span)
    n = len(ids)
    action = torch.tensor(mask, dtype=torch.bool)
    logp = torch.where(action, -0.5, 0.0)
    versions = torch.where(action, version, -1)
    rewards = torch.zeros(n)
    rewards[-1] = reward
    return Trajectory(prompt_id="p", token_ids=torch.tensor(ids), prompt_len=len(prompt), action_mask=action,
                      logp_behav=logp, policy_version=versions, reward=reward, token_rewards=rewards,
                      stop_reason=stop, group=group)


def test_collate_right_pads_with_neutral_values() -> None:
    a = make_traj([1, 2], [([3, 4], True), ([5], False), ([6], True)], version=3, reward=1.0, group=0)
    b = make_traj([1], [([7], True)], version=2, reward=0.0, group=1, stop=StopReason.MAX_TOKENS)
    batch = collate([a, b], pad_id=99)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6], [1, 7, 99, 99, 99, 99]]
    assert batch.attention_mask.tolist() == [[True] * 6, [True, True] + [False] * 4]
    assert batch.action_mask.tolist() == [[False, False, True, True, False, True],
                                          [False, True] + [False] * 4]
    assert batch.policy_version.tolist() == [[-1, -1, 3, 3, -1, 3], [-1, 2, -1, -1, -1, -1]]
    assert batch.logp_behav.tolist() == [[0, 0, -0.5, -0.5, 0, -0.5], [0, -0.5, 0, 0, 0, 0]]
    assert batch.token_rewards[0, -1] == 1.0 and batch.token_rewards.sum() == 1.0
    assert batch.truncated.tolist() == [False, True]
    assert batch.group_ids.tolist() == [0, 1]
    assert batch.scores.tolist() == [1.0, 0.0]
    assert batch.num_action_tokens == 4
    sub = batch.rows(torch.tensor([1]))
    assert sub.input_ids.tolist() == [[1, 7, 99, 99, 99, 99]]


def test_minibatches_partition_rows_with_global_counts() -> None:
    mask = torch.zeros(7, 5, dtype=torch.bool)
    for row in range(7):
        mask[row, : row % 4] = True  # rows 0 and 4 have no action token
    gen = torch.Generator().manual_seed(0)
    mbs = split_minibatches(mask, 3, generator=gen)
    assert sorted(torch.cat([m.index for m in mbs]).tolist()) == list(range(7))
    assert sorted(len(m.index) for m in mbs) == [2, 2, 3]
    for mb in mbs:
        assert mb.num_tokens == int(mask[mb.index].sum())
        assert mb.num_seqs == int(mask[mb.index].any(-1).sum())
    assert sum(m.num_tokens for m in mbs) == int(mask.sum())
    # Same seed, same cut; no generator keeps the order.
    again = split_minibatches(mask, 3, generator=torch.Generator().manual_seed(0))
    assert [m.index.tolist() for m in again] == [m.index.tolist() for m in mbs]
    assert split_minibatches(mask, 1)[0].index.tolist() == list(range(7))
    assert [c.tolist() for c in micro_batches(torch.arange(5), 2)] == [[0, 1], [2, 3], [4]]


def test_micro_batches_by_length_cover_the_index_once_with_less_padding() -> None:
    """Sorted by length (stable: ties keep the index's order), the pieces still cover the index once, and
    the rectangles they pad to (each piece trimmed to its longest row) hold fewer cells."""
    lengths = torch.tensor([9, 2, 7, 2, 9, 3, 1, 8])
    index = torch.tensor([7, 3, 0, 5, 1, 6])  # a minibatch's rows, in shuffled order
    pieces = micro_batches(index, 2, lengths)
    assert [p.tolist() for p in pieces] == [[6, 3], [1, 5], [7, 0]]  # lengths 1, 2 | 2, 3 | 8, 9
    assert sorted(torch.cat(pieces).tolist()) == sorted(index.tolist())

    def cells(ps: list[torch.Tensor]) -> int:
        return sum(len(p) * int(lengths[p].max()) for p in ps)

    assert (cells(pieces), cells(micro_batches(index, 2))) == (28, 38)
    assert [p.tolist() for p in micro_batches(index, 4, lengths)] == [[6, 3, 1, 5], [7, 0]]
