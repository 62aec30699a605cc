"""Tests for copc.ops.masked: golden values, NaN safety and micro-batch invariance of agg_loss."""

from __future__ import annotations

import pytest
import torch

from copc.ops.masked import agg_loss, check_mask, masked_mean, masked_sum, masked_var, masked_whiten

NAN = float("nan")
X = torch.tensor([[1.0, 2.0, NAN], [3.0, float("inf"), 5.0]])
M = torch.tensor([[True, True, False], [True, False, True]])


def test_masked_reductions_golden_and_nan_safe() -> None:
    # kept values 1, 2, 3, 5: sum 11, mean 2.75, Bessel variance ((1.75^2+0.75^2+0.25^2+2.25^2)/3) = 8.75/3.
    assert masked_sum(X, M).item() == 11.0
    assert masked_mean(X, M).item() == 2.75
    assert masked_var(X, M).item() == pytest.approx(8.75 / 3, rel=1e-6)
    assert masked_mean(X, M, dim=-1).tolist() == [1.5, 4.0]
    assert masked_mean(X, torch.zeros_like(M)).item() == 0.0


def test_masked_whiten_zero_mean_unit_variance_and_zero_outside() -> None:
    out = masked_whiten(X, M)
    assert masked_mean(out, M).abs().item() < 1e-6
    assert masked_var(out, M).item() == pytest.approx(1.0, rel=1e-5)
    assert out[0, 2].item() == 0.0 and out[1, 1].item() == 0.0


def test_nan_at_masked_positions_gives_finite_zero_gradient() -> None:
    x = X.clone().requires_grad_(True)
    masked_whiten(x, M).pow(2).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert x.grad[~M].abs().sum().item() == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
def test_agg_loss_micro_batches_sum_to_full_batch(mode: str) -> None:
    gen = torch.Generator().manual_seed(1)
    loss = torch.randn(4, 6, generator=gen)
    mask = torch.rand(4, 6, generator=gen) > 0.4
    mask[:, 0] = True
    full = agg_loss(loss, mask, mode)  # type: ignore[arg-type]
    parts = sum(
        agg_loss(loss[i : i + 2], mask[i : i + 2], mode, num_tokens=mask.sum(),
                 num_seqs=4)  # type: ignore[arg-type]
        for i in (0, 2)
    )
    assert torch.allclose(full, parts, rtol=1e-6)


def test_agg_loss_golden_and_errors() -> None:
    loss = torch.tensor([[1.0, 3.0, NAN], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(2.0)  # (1+3+2)/3
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(2.0)  # (2+2)/2
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(3.0)  # (4+2)/2
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(1.0)  # 6/(2*3)
    with pytest.raises(ValueError, match="valid"):
        agg_loss(loss, mask, "mean")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"mask must be torch\.bool"):
        check_mask("mask", mask.float())
