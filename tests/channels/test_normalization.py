"""Advantage normalisation in the advantage channel (issue 10): whiten | scale | center | none with a
std floor, V-trace's rho^pg outside the normalisation, and the statistics over the loss tokens only."""

from __future__ import annotations

import math

import pytest
import torch

from copc.channels import AdvantageChannelConfig, compute_advantages
from copc.ops import normalize_advantages

# x = (1, 2, 3, 4): m = 2.5, Bessel v = (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3, s = sqrt(5/3) = 1.2909944.
X = torch.tensor([[1.0, 2.0, 3.0, 4.0, 99.0]])
M = torch.tensor([[True, True, True, True, False]])
S = math.sqrt(5.0 / 3.0)


@pytest.mark.parametrize(
    ("mode", "floor", "want"),
    [
        ("whiten", 0.0, [(x - 2.5) / S for x in (1, 2, 3, 4)]),
        ("scale", 0.0, [x / S for x in (1, 2, 3, 4)]),
        ("center", 0.0, [-1.5, -0.5, 0.5, 1.5]),
        ("none", 0.0, [1.0, 2.0, 3.0, 4.0]),
        ("whiten", 2.0, [-0.75, -0.25, 0.25, 0.75]),  # s = max(1.29, 2) = 2
        ("scale", 2.0, [0.5, 1.0, 1.5, 2.0]),
        ("whiten", 1.0, [(x - 2.5) / S for x in (1, 2, 3, 4)]),  # floor below s: inactive
        ("center", 2.0, [-1.5, -0.5, 0.5, 1.5]),  # the floor only enters a division
    ],
)
def test_normalize_golden(mode: str, floor: float, want: list[float]) -> None:
    got = normalize_advantages(X, M, mode=mode, std_floor=floor)  # type: ignore[arg-type]
    # eps = 1e-8 inside the sqrt moves s by ~3e-9 relative: far below float32 tolerance.
    torch.testing.assert_close(got, torch.tensor([[*want, 0.0]]), rtol=1e-6, atol=1e-6)


def test_normalize_rejects_bad_mode_and_floor() -> None:
    with pytest.raises(ValueError, match="valid: whiten, scale, center, none"):
        normalize_advantages(X, M, mode="zscore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="std_floor"):
        normalize_advantages(X, M, mode="whiten", std_floor=-1.0)
    with pytest.raises(ValueError, match=r"advantage\.normalize"):
        AdvantageChannelConfig(normalize="zscore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"advantage\.std_floor"):
        AdvantageChannelConfig(std_floor=-0.1)


def _all_correct_batch(noise: float = 1e-3) -> dict[str, torch.Tensor]:
    """64 rows x 8 action tokens, every reward 1 (on the last token), critic V = 1 + N(0, noise^2)."""
    g = torch.Generator().manual_seed(0)
    b, t = 64, 8
    rewards = torch.zeros(b, t)
    rewards[:, -1] = 1.0
    values = 1.0 + noise * torch.randn(b, t, generator=g)
    return {"rewards": rewards, "values": values, "action_mask": torch.ones(b, t, dtype=torch.bool)}


def _advantages(d: dict[str, torch.Tensor], **cfg: object) -> torch.Tensor:
    out = compute_advantages(AdvantageChannelConfig(**cfg), rewards=d["rewards"], values=d["values"],
                             log_w=None, action_mask=d["action_mask"])  # type: ignore[arg-type]
    return out.advantages


def test_std_floor_keeps_critic_noise_small_when_every_reward_is_equal() -> None:
    # With gamma = lam = 1 the GAE advantage is A_t = R - V_t = -noise_t: pure critic noise of 1e-3.
    d = _all_correct_batch()
    raw = _advantages(d, whiten=False)
    assert raw.abs().mean() < 2e-3
    whitened = _advantages(d)  # no floor: the noise is blown up to unit scale
    assert whitened.abs().mean() > 0.7 and (whitened < 0).float().mean() > 0.4
    for mode in ("whiten", "scale"):
        floored = _advantages(d, normalize=mode, std_floor=0.1)
        # s = max(1e-3, 0.1) = 0.1: |A| <= ~|noise| / 0.1 ~ 1e-2, a hundredth of the whitened size
        assert floored.abs().mean() < 0.02, mode
    # a real signal (rewards 0/1 in half the rows) is not touched by the floor: std ~0.5 > 0.1
    d["rewards"][::2, -1] = 0.0
    torch.testing.assert_close(_advantages(d, std_floor=0.1), _advantages(d), rtol=0, atol=0)


def test_scale_keeps_signs_and_center_keeps_scale() -> None:
    d = _all_correct_batch(noise=0.3)
    d["rewards"][::3, -1] = 0.0
    raw = _advantages(d, whiten=False)
    scaled = _advantages(d, normalize="scale")
    assert torch.equal(torch.sign(scaled), torch.sign(raw))
    torch.testing.assert_close(scaled * raw.std(unbiased=True), raw, rtol=1e-5, atol=1e-6)
    centred = _advantages(d, normalize="center")
    torch.testing.assert_close(centred, raw - raw.mean(), rtol=1e-5, atol=1e-6)
    assert torch.equal(_advantages(d, normalize="none"), raw)


def _vtrace_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    b, t = 6, 5
    rewards = torch.zeros(b, t)
    rewards[:, -1] = (torch.rand(b, generator=g) > 0.5).float()
    values = 0.5 + 0.1 * torch.randn(b, t, generator=g)
    log_w = 0.3 * torch.randn(b, t, generator=g)
    log_w[0, 2] = -20.0  # a token the target policy (old) never takes: rho^pg = e^-20 ~ 0
    return {"rewards": rewards, "values": values, "log_w": log_w, "action_mask": torch.ones(b, t,
                                                                                            dtype=torch.bool)}


def test_vtrace_normalisation_sits_inside_rho_pg() -> None:
    # A^pg_s = rho^pg_s (r_s + gamma v_{s+1} - V_s): V_s is a baseline inside the importance weight,
    # so the normalisation's mean shift must be too. A constant shift outside rho^pg adds
    # -m * sum_s grad log pi(a_s), whose mu-expectation is not 0 off-policy (E_mu[rho grad log pi] = 0 is).
    d = _vtrace_batch()
    cfg = AdvantageChannelConfig(estimator="vtrace", rho_bar=1.0, c_bar=1.0, pg_rho_bar=1.0)
    out = compute_advantages(cfg, rewards=d["rewards"], values=d["values"], log_w=d["log_w"],
                             action_mask=d["action_mask"])
    raw = compute_advantages(AdvantageChannelConfig(estimator="vtrace", whiten=False), rewards=d["rewards"],
                             values=d["values"], log_w=d["log_w"], action_mask=d["action_mask"])
    rho = torch.exp(d["log_w"]).clamp(max=1.0)
    td = raw.advantages / rho  # r + gamma v_{s+1} - V_s (rho > 0 everywhere here)
    want = rho * (td - td.mean()) / td.std(unbiased=True)
    torch.testing.assert_close(out.advantages, want, rtol=1e-4, atol=1e-6)
    # the token with rho^pg ~ 0 carries (almost) no policy gradient after whitening, as before it
    assert out.advantages[0, 2].abs() < 1e-7
    assert raw.advantages[0, 2].abs() < 1e-7
    # on-policy (rho^pg = 1 everywhere) this is plain whitening of A^pg
    zero = torch.zeros_like(d["log_w"])
    on = compute_advantages(cfg, rewards=d["rewards"], values=d["values"], log_w=zero,
                            action_mask=d["action_mask"])
    on_raw = compute_advantages(AdvantageChannelConfig(
        estimator="vtrace", whiten=False), rewards=d["rewards"], values=d["values"], log_w=zero,
        action_mask=d["action_mask"])
    a = on_raw.advantages
    torch.testing.assert_close(on.advantages, (a - a.mean()) / a.std(unbiased=True), rtol=1e-5, atol=1e-6)


def test_statistics_come_from_the_loss_tokens_only() -> None:
    # issue 10 defect 6: with truncation = mask the dropped rows must not enter the whitening statistics.
    d = _all_correct_batch(noise=0.3)
    d["rewards"][::3, -1] = 0.0
    keep = torch.ones_like(d["action_mask"])
    keep[:10] = False  # rows that leave the losses
    d["values"][:10] += 50.0  # wildly off: they would dominate the statistics
    cfg = AdvantageChannelConfig()
    out = compute_advantages(cfg, rewards=d["rewards"], values=d["values"], log_w=None,
                             action_mask=d["action_mask"], stats_mask=keep)
    a = out.advantages[keep].double()
    assert abs(a.mean().item()) < 1e-5 and abs(a.std(unbiased=True).item() - 1.0) < 1e-5
    assert torch.equal(out.advantages[~keep], torch.zeros_like(out.advantages[~keep]))
    sub = compute_advantages(cfg, rewards=d["rewards"][10:], values=d["values"][10:], log_w=None,
                             action_mask=d["action_mask"][10:])
    torch.testing.assert_close(out.advantages[10:], sub.advantages, rtol=1e-5, atol=1e-6)
