"""Small pieces the trainer's steps share: eval-mode forwards, row trimming, optimizers, gradient clipping."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch
from torch import nn

__all__ = ["accumulate", "clip_grad", "eval_mode", "make_optimizer", "trim_length"]


@contextmanager
def eval_mode(*modules: nn.Module | None) -> Iterator[None]:
    """Run no-grad forwards without dropout; restore each module's train/eval flag afterwards."""
    present = [mod for mod in modules if mod is not None]
    flags = [mod.training for mod in present]
    for mod in present:
        mod.eval()
    try:
        yield
    finally:
        for mod, flag in zip(present, flags, strict=True):
            mod.train(flag)


def trim_length(index: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """Length of the longest row among ``index`` (rows are right-padded, so columns past it are padding)."""
    return max(1, int(attention_mask[index].sum(dim=-1).max()))


def make_optimizer(
    model: nn.Module, kind: Literal["adamw", "sgd"], *, lr: float, weight_decay: float, eps: float
) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, eps=eps)


def clip_grad(model: nn.Module, max_norm: float) -> float:
    """Clip the gradient norm when ``max_norm > 0``; return the norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    limit = max_norm if max_norm > 0 else math.inf
    return float(torch.nn.utils.clip_grad_norm_(params, limit))


def accumulate(acc: dict[str, float], stats: dict[str, torch.Tensor], *, weight: float) -> None:
    for key, value in stats.items():
        acc[key] = acc.get(key, 0.0) + weight * float(value)
