"""Chunk (turn-level) advantages: a hand-worked example, the slow per-token loop, and invariants."""

from __future__ import annotations

import torch

from copc.ops import chunk_advantages, chunk_errors, chunk_means


def _slow_chunk_advantages(rewards, chunk_ids, action_mask, values, num_chunks):
    """One row and one chunk at a time: A_k = R_k + V_{k+1} - V_k, V_K = 0."""
    b, t = rewards.shape
    out = torch.zeros(b, t)
    for row in range(b):
        k_n = int(num_chunks[row])
        for k in range(k_n):
            r_k = sum(float(rewards[row, i]) for i in range(t) if int(chunk_ids[row, i]) == k)
            v_next = float(values[row, k + 1]) if k + 1 < k_n else 0.0
            a_k = r_k + v_next - float(values[row, k])
            for i in range(t):
                if int(chunk_ids[row, i]) == k and bool(action_mask[row, i]):
                    out[row, i] = a_k
    return out


def test_hand_worked_three_turn_episode():
    # prompt (2 tokens) | turn 0 (2 action) + obs (1) | turn 1 (1 action) + obs (1) | turn 2 (2 action),
    # reward 1 at the end
    chunk_ids = torch.tensor([[-1, -1, 0, 0, 0, 1, 1, 2, 2]])
    action = torch.tensor([[False, False, True, True, False, True, False, True, True]])
    rewards = torch.zeros(1, 9)
    rewards[0, 8] = 1.0
    values = torch.tensor([[0.5, 0.25, 0.75]])  # V at the prompt, after turn 0, after turn 1
    out = chunk_advantages(rewards, chunk_ids, action, values, torch.tensor([3]))
    # A_0 = 0 + 0.25 - 0.5 = -0.25; A_1 = 0 + 0.75 - 0.25 = 0.5; A_2 = 1 + 0 - 0.75 = 0.25
    expected = torch.tensor([[0, 0, -0.25, -0.25, 0, 0.5, 0, 0.25, 0.25]])
    assert torch.equal(out, expected)
    # the chunk advantages sum to the return minus the prompt's value: -0.25 + 0.5 + 0.25 = 1 - 0.5
    means, counts = chunk_means(out, chunk_ids, action, 3)
    assert torch.allclose(means.sum(), torch.tensor(0.5))
    assert counts.tolist() == [[2, 1, 2]]


def test_matches_the_slow_loop_on_ragged_rows():
    gen = torch.Generator().manual_seed(0)
    b, t, k = 5, 17, 4
    num_chunks = torch.tensor([4, 1, 3, 0, 2])
    chunk_ids = torch.full((b, t), -1, dtype=torch.long)
    for row in range(b):
        n = int(num_chunks[row])
        if n:
            cuts = sorted(torch.randperm(t - 3, generator=gen)[: n - 1].add(3).tolist())
            starts = [2, *cuts]
            for j, s in enumerate(starts):
                end = starts[j + 1] if j + 1 < n else t - int(torch.randint(0, 3, (1,), generator=gen))
                chunk_ids[row, s:end] = j
    action = (torch.rand(b, t, generator=gen) > 0.3) & (chunk_ids >= 0)
    rewards = torch.where(torch.rand(b, t, generator=gen) > 0.8, torch.randn(b, t, generator=gen), 0.0)
    values = torch.randn(b, k, generator=gen)
    fast = chunk_advantages(rewards, chunk_ids, action, values, num_chunks)
    slow = _slow_chunk_advantages(rewards, chunk_ids, action, values, num_chunks)
    assert torch.allclose(fast, slow, atol=1e-6)
    assert torch.equal(fast[3], torch.zeros(t))  # a row with no chunk gets nothing


def test_values_past_the_last_chunk_change_nothing():
    chunk_ids = torch.tensor([[-1, 0, 0, 1, 1]])
    action = torch.tensor([[False, True, False, True, True]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 2.0]])
    a = chunk_advantages(rewards, chunk_ids, action, torch.tensor([[1.0, 3.0, 7.0]]), torch.tensor([2]))
    b = chunk_advantages(rewards, chunk_ids, action, torch.tensor([[1.0, 3.0, -9.0]]), torch.tensor([2]))
    assert torch.equal(a, b)


def test_errors_golden():
    est = torch.tensor([1.0, 2.0, 3.0])
    ref = torch.tensor([1.0, 1.0, 1.0])
    err = chunk_errors(est, ref)
    assert err.n == 3
    assert torch.isclose(err.bias, torch.tensor(1.0))  # (0 + 1 + 2) / 3
    assert torch.isclose(err.mse, torch.tensor(5.0 / 3.0))  # (0 + 1 + 4) / 3
    assert float(err.corr) == 0.0  # a constant reference has no correlation
    assert torch.isclose(chunk_errors(est, 2 * est + 1).corr, torch.tensor(1.0))
