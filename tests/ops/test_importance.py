"""Tests for copc.ops.importance: golden values, invariances and NaN safety."""

from __future__ import annotations

import math

import pytest
import torch

from copc.ops.importance import (
    band_mask,
    clip_fractions,
    clip_ratio,
    importance_diagnostics,
    kl_estimators,
    log_ratio,
    mask_fraction,
    mean_abs_log_ratio,
    ratio_from_log,
    sequence_band_mask,
    sequence_ess,
    token_ess,
    truncated_is,
)

# Row 0: three action tokens with w = 0.5, 1, 4 and one prompt token carrying NaN; row 1: no action token.
W = torch.tensor([[float("nan"), 0.5, 1.0, 4.0], [2.0, 3.0, 1.0, 1.0]])
MASK = torch.tensor([[False, True, True, True], [False, False, False, False]])


def test_log_ratio_clamps_and_zeroes_masked_positions() -> None:
    num = torch.tensor([[0.0, 30.0, -1.0]])
    den = torch.tensor([[float("nan"), 0.0, 29.0]])
    mask = torch.tensor([[False, True, True]])
    assert torch.equal(log_ratio(num, den, mask), torch.tensor([[0.0, 20.0, -20.0]]))
    assert torch.equal(ratio_from_log(torch.tensor([[float("inf"), 0.0, 1.0]]), mask)[0, 0],
                       torch.tensor(1.0))


def test_clip_ratio_two_sided_and_infinite_bounds() -> None:
    out = clip_ratio(W, MASK, low=0.8, high=1.2)
    assert torch.equal(out, torch.tensor([[1.0, 0.8, 1.0, 1.2], [1.0, 1.0, 1.0, 1.0]]))
    assert torch.equal(clip_ratio(W, MASK, low=-math.inf, high=math.inf)[0, 1:], W[0, 1:])
    with pytest.raises(ValueError, match="low <= high"):
        clip_ratio(W, MASK, low=1.2, high=0.8)


def test_band_mask_is_inclusive_and_false_off_actions() -> None:
    keep = band_mask(W, MASK, low=0.5, high=1.0)  # 0.5 and 1.0 sit exactly on the bounds: kept
    assert keep.tolist() == [[False, True, True, False], [False] * 4]
    assert band_mask(W, MASK, low=0.0, high=math.inf).tolist() == MASK.tolist()


def test_truncated_is_caps_from_above_only() -> None:
    assert torch.equal(truncated_is(W, MASK, cap=2.0)[0], torch.tensor([1.0, 0.5, 1.0, 2.0]))


def test_sequence_band_mask_uses_geometric_mean() -> None:
    # Row 0: log w = (log 2, log 8) -> geometric mean exp((log 2 + log 8) / 2) = 4, product 16.
    log_r = torch.tensor([[math.log(2.0), math.log(8.0), 99.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [False, False, False]])
    # Row 1 has no action token: kept whatever the band (nothing to reject).
    assert sequence_band_mask(log_r, mask, low=3.9, high=4.1).tolist() == [True, True]
    assert sequence_band_mask(log_r, mask, low=0.5, high=3.9).tolist() == [False, True]


def test_token_ess_golden() -> None:
    # w = (0.5, 1, 4): (sum w)^2 / (N sum w^2) = 5.5^2 / (3 * 17.25) = 30.25 / 51.75.
    assert torch.allclose(token_ess(W, MASK), torch.tensor(30.25 / 51.75), rtol=1e-6)
    assert token_ess(torch.full((2, 3), 7.0), torch.ones(2, 3, dtype=torch.bool)).item() == pytest.approx(1.0)
    assert token_ess(W, torch.zeros_like(MASK)).item() == 1.0


def test_sequence_ess_golden_and_stable_for_long_rows() -> None:
    # Row sums of log w: L = (log 2, log 1) -> W = (2, 1): ESS = 9 / (2 * 5) = 0.9.
    log_r = torch.tensor([[math.log(2.0), 0.0], [0.5, -0.5]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    assert sequence_ess(log_r, mask).item() == pytest.approx(0.9, rel=1e-6)
    # 4000 tokens of log w = +-0.5 give L = +-2000: exp overflows, log space does not.
    # W = (e^2000, e^-2000): ESS = (e^2000)^2 / (2 e^4000) = 0.5 up to e^-4000.
    long_r = torch.stack([torch.full((4000,), 0.5), torch.full((4000,), -0.5)])
    ess = sequence_ess(long_r, torch.ones(2, 4000, dtype=torch.bool))
    assert ess.item() == pytest.approx(0.5, rel=1e-5)
    # Rows without action tokens do not count: one row -> ESS 1.
    assert sequence_ess(log_r, torch.tensor([[True, True], [False, False]])).item() == pytest.approx(1.0)


def test_mask_and_clip_fractions() -> None:
    keep = torch.tensor([[True, True, False, False], [False] * 4])
    assert mask_fraction(keep, MASK).item() == pytest.approx(2 / 3)  # tokens 2, 3 of row 0 removed
    fr = clip_fractions(W, MASK, low=0.8, high=1.2)
    assert fr.low.item() == pytest.approx(1 / 3)
    assert fr.high.item() == pytest.approx(1 / 3)


def test_kl_estimators_golden() -> None:
    # log r = (log 2, -log 2): k1 mean = 0; k2 = 1/2 (log 2)^2; k3 mean = ((2-1-log2) + (0.5-1+log2))/2 =
    # 0.25.
    log_r = torch.tensor([[math.log(2.0), -math.log(2.0), float("nan")]])
    mask = torch.tensor([[True, True, False]])
    kl = kl_estimators(log_r, mask)
    assert kl.k1.item() == pytest.approx(0.0, abs=1e-7)
    assert kl.k2.item() == pytest.approx(0.5 * math.log(2.0) ** 2, rel=1e-6)
    assert kl.k3.item() == pytest.approx(0.25, rel=1e-6)
    assert mean_abs_log_ratio(log_r, mask).item() == pytest.approx(math.log(2.0), rel=1e-6)


def test_k1_k3_unbiased_for_kl_of_sampler() -> None:
    # Tokens drawn from p = Bernoulli(0.3); other policy q = Bernoulli(0.6); KL(p||q) closed form.
    gen = torch.Generator().manual_seed(0)
    draws = torch.rand(1, 200_000, generator=gen) < 0.3
    p = torch.where(draws, torch.tensor(0.3), torch.tensor(0.7))
    q = torch.where(draws, torch.tensor(0.6), torch.tensor(0.4))
    kl = kl_estimators(torch.log(q) - torch.log(p), torch.ones_like(draws))
    exact = 0.3 * math.log(0.3 / 0.6) + 0.7 * math.log(0.7 / 0.4)
    # Monte-Carlo error with 2e5 samples is ~1e-3; 5e-3 leaves 5 sigma.
    assert kl.k1.item() == pytest.approx(exact, abs=5e-3)
    assert kl.k3.item() == pytest.approx(exact, abs=5e-3)


def test_zero_staleness_gives_unit_weights_and_ideal_diagnostics() -> None:
    logp = torch.randn(3, 5)
    mask = torch.rand(3, 5) > 0.3
    mask[0, 0] = True
    log_r = log_ratio(logp, logp, mask)
    assert torch.equal(ratio_from_log(log_r, mask), torch.ones(3, 5))
    stats = importance_diagnostics(log_r, mask, clip_low=0.8, clip_high=1.2, keep_mask=mask)
    assert stats["ratio/ess_tok"].item() == pytest.approx(1.0)
    assert stats["ratio/ess_seq"].item() == pytest.approx(1.0)
    for key in ("ratio/clip_low_frac", "ratio/clip_high_frac", "ratio/mean_abs_log", "ratio/mask_frac",
                "ratio/kl_k1", "ratio/kl_k2", "ratio/kl_k3"):
        assert stats[key].item() == 0.0, key


def test_diagnostics_are_detached_and_ignore_masked_garbage() -> None:
    log_r = torch.randn(2, 6, requires_grad=True)
    mask = torch.tensor([[True, True, False, True, False, False], [False, True, True, False, False, True]])
    clean = importance_diagnostics(log_r, mask, clip_low=0.8, clip_high=1.2)
    garbage = torch.where(mask, log_r.detach(), torch.tensor(float("nan")))
    noisy = importance_diagnostics(garbage, mask, clip_low=0.8, clip_high=1.2)
    for key, value in clean.items():
        assert not value.requires_grad and value.dtype == torch.float32 and value.dim() == 0
        assert torch.equal(value, noisy[key]), key


def test_diagnostics_equal_the_separate_functions_bit_for_bit() -> None:
    # importance_diagnostics shares one masked, clamped log-ratio between all statistics; each value
    # must be exactly what the public function computes on its own (garbage off the mask, a row
    # without tokens, log-ratios beyond the +-20 clamp).
    gen = torch.Generator().manual_seed(4)
    mask = torch.rand(5, 300, generator=gen) < 0.5
    mask[1] = False
    log_r = torch.randn(5, 300, generator=gen) * 8.0
    log_r = torch.where(mask, log_r, torch.tensor(float("nan")))
    keep = mask & (torch.rand(5, 300, generator=gen) < 0.8)
    got = importance_diagnostics(log_r, mask, clip_low=0.8, clip_high=1.2, keep_mask=keep)
    ratio = ratio_from_log(log_r, mask)
    clips = clip_fractions(ratio, mask, low=0.8, high=1.2)
    kl = kl_estimators(log_r, mask)
    want = {
        "ratio/ess_tok": token_ess(ratio, mask),
        "ratio/ess_seq": sequence_ess(log_r, mask),
        "ratio/clip_low_frac": clips.low,
        "ratio/clip_high_frac": clips.high,
        "ratio/mean_abs_log": mean_abs_log_ratio(log_r, mask),
        "ratio/kl_k1": kl.k1,
        "ratio/kl_k2": kl.k2,
        "ratio/kl_k3": kl.k3,
        "ratio/mask_frac": mask_fraction(keep, mask),
    }
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
