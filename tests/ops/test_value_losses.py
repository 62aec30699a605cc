"""Tests for copc.ops.value_losses: golden values, the per-token oracle, NaN safety, gradcheck and
micro-batch accumulation."""

from __future__ import annotations

import math

import pytest
import torch

from copc.ops import AggSpec, clipped_value_loss, huber_value_loss, mse_value_loss
from reference import losses as ref

# float32 ops vs float64 oracle on O(1) values: 1e-5 relative is ~100 ulps.
TOL = {"rtol": 1e-5, "atol": 1e-6}


def batch(b: int, t: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]) & (torch.rand(b, t, generator=g) > 0.2)
    if b > 2:
        mask[1] = False
    v_old = torch.randn(b, t, generator=g)
    values = v_old + 0.8 * torch.randn(b, t, generator=g)
    returns = torch.randn(b, t, generator=g) * 1.5
    return {"values": values, "values_old": v_old, "returns": returns, "action_mask": mask}


def test_clipped_mse_golden() -> None:
    # eps_v = 0.5, V_old = 0, G = 1.
    #   t0: V = 2   -> V_clip = 0.5: max((2-1)^2, (0.5-1)^2)/2 = max(1, 0.25)/2 = 0.5
    #   t1: V = 0.2 -> V_clip = 0.2: 0.64/2 = 0.32 (not clipped)
    #   t2: V = -1  -> V_clip = -0.5: max(4, 2.25)/2 = 2
    #   t3: V = 1.4 -> V_clip = 0.5: max(0.16, 0.25)/2 = 0.125 (clipped branch larger)
    # token-mean: (0.5 + 0.32 + 2 + 0.125)/4 = 0.73625; clip_frac = 1/4.
    values = torch.tensor([[2.0, 0.2, -1.0, 1.4]])
    out = clipped_value_loss(values, torch.zeros(1, 4), torch.ones(1, 4), torch.ones(1, 4, dtype=torch.bool))
    torch.testing.assert_close(out.per_token, torch.tensor([[0.5, 0.32, 2.0, 0.125]]))
    torch.testing.assert_close(out.loss, torch.tensor(0.73625))
    assert out.stats["value/clip_frac"] == 0.25


def test_mse_and_huber_golden() -> None:
    # d = V - G = (0.5, -3): mse d^2/2 = (0.125, 4.5) -> 2.3125;
    # huber(delta=1): (0.125, 1*(3 - 0.5) = 2.5) -> 1.3125.
    values = torch.tensor([[1.5, -2.0]])
    returns = torch.tensor([[1.0, 1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    torch.testing.assert_close(mse_value_loss(values, returns, mask).loss, torch.tensor(2.3125))
    torch.testing.assert_close(huber_value_loss(values, returns, mask).loss, torch.tensor(1.3125))


@pytest.mark.parametrize("b", [1, 6])
@pytest.mark.parametrize("kind", ["mse", "huber"])
@pytest.mark.parametrize("clip_eps", [None, 0.2, 0.5])
def test_matches_per_token_oracle(b: int, kind: str, clip_eps: float | None) -> None:
    for seed in range(3):
        d = batch(b, 8, seed)
        for mode in ("token-mean", "seq-mean-token-mean"):
            out = clipped_value_loss(**d, clip_eps=clip_eps, kind=kind,
                                     agg=AggSpec(mode))  # type: ignore[arg-type]
            want, tok = ref.value(d["values"], d["values_old"], d["returns"], d["action_mask"],
                                  clip_eps=clip_eps, kind=kind, mode=mode)
            torch.testing.assert_close(out.per_token, torch.tensor(tok, dtype=torch.float32), **TOL)
            torch.testing.assert_close(out.loss, torch.tensor(want, dtype=torch.float32), **TOL)


def test_nan_at_masked_positions_never_leaks() -> None:
    d = batch(6, 8, 3)
    dirty = dict(d)
    for key in ("values", "values_old", "returns"):
        dirty[key] = torch.where(d["action_mask"], d[key], torch.full_like(d[key], math.nan))
    dirty["returns"] = torch.where(d["action_mask"], d["returns"], torch.full_like(d["returns"], math.inf))
    xa = d["values"].clone().requires_grad_(True)
    xb = dirty["values"].clone().requires_grad_(True)
    a = clipped_value_loss(xa, d["values_old"], d["returns"], d["action_mask"])
    b = clipped_value_loss(xb, dirty["values_old"], dirty["returns"], d["action_mask"])
    assert torch.isfinite(b.loss) and torch.equal(a.loss, b.loss)
    ga, gb = torch.autograd.grad(a.loss, xa)[0], torch.autograd.grad(b.loss, xb)[0]
    assert torch.isfinite(gb).all() and torch.equal(ga, gb)
    assert all(torch.isfinite(v) for v in b.stats.values())


@pytest.mark.parametrize("kind", ["mse", "huber"])
def test_gradcheck_wrt_values(kind: str) -> None:
    # value losses keep float64 end to end, so the default (tight) gradcheck tolerances apply;
    # values are placed away from the clip and Huber kinks by construction of the seed.
    d = batch(2, 5, 4)
    d = {k: (v.double() if v.is_floating_point() else v) for k, v in d.items()}
    x = d["values"].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda v: clipped_value_loss(v, d["values_old"], d["returns"], d["action_mask"], kind=kind).loss,
        (x,)  # type: ignore[arg-type]
    )


def test_micro_batches_sum_to_full_batch() -> None:
    d = batch(6, 8, 5)
    n_tok = d["action_mask"].sum()
    x = d["values"].clone().requires_grad_(True)
    full = clipped_value_loss(x, d["values_old"], d["returns"], d["action_mask"],
                              agg=AggSpec(num_tokens=n_tok)).loss
    g_full = torch.autograd.grad(full, x)[0]
    total, grads = torch.zeros(()), []
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        xm = d["values"][rows].clone().requires_grad_(True)
        part = clipped_value_loss(xm, d["values_old"][rows], d["returns"][rows], d["action_mask"][rows],
                                  agg=AggSpec(num_tokens=n_tok)).loss
        total = total + part.detach()
        grads.append(torch.autograd.grad(part, xm)[0])
    torch.testing.assert_close(total, full.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.cat(grads), g_full, rtol=1e-6, atol=1e-8)


def test_clipping_needs_values_old() -> None:
    d = batch(2, 4, 0)
    with pytest.raises(ValueError, match="values_old"):
        clipped_value_loss(d["values"], None, d["returns"], d["action_mask"], clip_eps=0.5)
