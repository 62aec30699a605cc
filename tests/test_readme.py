"""README's Python examples run as written (a review found one that raised on unpacking)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_examples():
    assert _python_blocks(), "README.md lost its Python examples"


def test_readme_python_examples_run():
    batch, length = 3, 6
    gen = torch.Generator().manual_seed(0)
    action_mask = torch.ones(batch, length, dtype=torch.bool)
    action_mask[:, :2] = False  # a prompt of two tokens
    rewards = torch.zeros(batch, length)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0])
    namespace = {
        "rewards": rewards,
        "values": torch.rand(batch, length, generator=gen),
        "log_rho": 0.1 * torch.randn(batch, length, generator=gen),
        "action_mask": action_mask,
    }
    for block in _python_blocks():
        exec(compile(block, str(README), "exec"), namespace)
    assert namespace["vt"].vs.shape == (batch, length)
    assert namespace["adv"].shape == (batch, length)
