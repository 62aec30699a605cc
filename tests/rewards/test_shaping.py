"""DAPO's soft overlong punishment: golden values worked by hand, continuity, bad input."""

from __future__ import annotations

import pytest

from copc.rewards.shaping import overlong_penalty


@pytest.mark.parametrize(
    ("length", "want"),
    [
        # L_max = 20, L_cache = 5: no penalty up to L_max - L_cache = 15, then linear down to -1 at 20.
        (0, 0.0),
        (15, 0.0),
        (16, -0.2),  # (15 - 16) / 5
        (18, -0.6),  # (15 - 18) / 5
        (20, -1.0),  # (15 - 20) / 5: the line meets the -1 branch at L_max (continuous)
        (21, -1.0),  # beyond L_max
        (500, -1.0),
    ],
)
def test_golden_values(length: int, want: float) -> None:
    assert overlong_penalty(length, max_len=20, cache_len=5) == pytest.approx(want, abs=1e-12)


def test_paper_settings() -> None:
    # DAPO: L_max = 20480, L_cache = 4096; 18432 tokens is half-way into the interval: (16384 - 18432) / 4096.
    assert overlong_penalty(16384, max_len=20480, cache_len=4096) == 0.0
    assert overlong_penalty(18432, max_len=20480, cache_len=4096) == -0.5


def test_factor_scales_the_penalty() -> None:
    assert overlong_penalty(18, max_len=20, cache_len=5, factor=0.5) == pytest.approx(-0.3, abs=1e-12)
    assert overlong_penalty(30, max_len=20, cache_len=5, factor=0.5) == -0.5
    assert overlong_penalty(18, max_len=20, cache_len=5, factor=0.0) == 0.0


def test_cache_equal_to_budget_penalises_from_the_first_token() -> None:
    assert overlong_penalty(1, max_len=4, cache_len=4) == -0.25


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_len": 10, "cache_len": 11}, "cache_len <= max_len"),
        ({"max_len": 10, "cache_len": 0}, "cache_len <= max_len"),
        ({"max_len": 10, "cache_len": 2, "factor": -1.0}, "factor"),
    ],
)
def test_bad_settings_fail_with_the_rule(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        overlong_penalty(5, **kwargs)  # type: ignore[arg-type]
