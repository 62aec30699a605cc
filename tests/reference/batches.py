"""Random training-step batches shared by the channel and method tests."""

from __future__ import annotations

import torch


def step_batch(b: int = 6, t: int = 10, seed: int = 0, stale: float = 0.6) -> dict[str, torch.Tensor]:
    """A training step's batch: ragged rows with tool-output holes, terminal reward, pre-update values."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    mask &= torch.rand(b, t, generator=g) > 0.2
    mask[:, 0] = True
    rewards = torch.zeros(b, t)
    rewards[torch.arange(b), lengths - 1] = torch.randn(b, generator=g)  # may land on a tool token
    mu = -2.0 * torch.rand(b, t, generator=g) - 0.05
    old = mu + stale * torch.randn(b, t, generator=g)
    return {
        "rewards": rewards,
        "values": 0.5 * torch.randn(b, t, generator=g),
        "logp_behav": mu,
        "logp_old": old,
        "logp": old + 0.2 * torch.randn(b, t, generator=g),
        "action_mask": mask,
        "scores": torch.randn(b, generator=g),
        "group_ids": torch.arange(b) // 2,
    }
