"""Repeat statistics: hand-checked intervals and the "within noise" verdict."""

from __future__ import annotations

import math

import pytest

from pdflash.report.stats import (
    Interval,
    bootstrap_interval,
    by_repeat,
    compare,
    interval,
    pair_summary,
    relative_spread,
    t_interval,
    t_quantile_975,
)


def test_t_interval_hand_checked() -> None:
    # mean 2, s = 1, n = 3: half-width = t(0.975, 2) / sqrt(3) = 4.302653 / 1.732051
    iv = t_interval([1.0, 2.0, 3.0])
    assert iv.median == 2.0
    assert iv.n == 3 and iv.method == "t"
    assert iv.low == pytest.approx(2.0 - 2.484138, abs=1e-6)
    assert iv.high == pytest.approx(2.0 + 2.484138, abs=1e-6)


def test_t_interval_median_differs_from_mean() -> None:
    # mean 4, median 2, s = sqrt(((1-4)^2 + (2-4)^2 + (9-4)^2) / 2) = sqrt(19)
    iv = t_interval([9.0, 1.0, 2.0])
    assert iv.median == 2.0
    half = 4.302652730 * math.sqrt(19.0) / math.sqrt(3.0)
    assert iv.low == pytest.approx(4.0 - half)
    assert iv.high == pytest.approx(4.0 + half)


def test_t_quantile_table_and_expansion_agree_at_the_seam() -> None:
    assert t_quantile_975(1) == pytest.approx(12.7062, abs=1e-4)
    assert t_quantile_975(30) == pytest.approx(2.0423, abs=1e-4)
    # the expansion beyond the table: t(0.975, 60) = 2.000298, t(0.975, 120) = 1.979930
    assert t_quantile_975(60) == pytest.approx(2.000298, abs=1e-4)
    assert t_quantile_975(120) == pytest.approx(1.979930, abs=1e-4)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile_975(0)


def test_bad_samples_are_refused() -> None:
    with pytest.raises(ValueError, match="at least two"):
        t_interval([1.0])
    with pytest.raises(ValueError, match="at least one"):
        t_interval([])
    with pytest.raises(ValueError, match="finite"):
        t_interval([1.0, math.nan])
    with pytest.raises(ValueError, match=">= 8 samples"):
        bootstrap_interval([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="method"):
        interval([1.0, 2.0], method="z")  # type: ignore[arg-type]


def test_bootstrap_is_seeded_and_brackets_the_median() -> None:
    samples = [10.0, 11.0, 9.5, 10.2, 10.8, 9.9, 10.1, 10.4, 30.0]
    a = bootstrap_interval(samples, seed=3)
    b = bootstrap_interval(samples, seed=3)
    assert a == b
    assert a.method == "bootstrap" and a.n == 9
    assert a.low <= a.median == 10.2 <= a.high
    # the median's interval ignores the outlier: it stays inside the bulk
    assert a.high < 30.0
    assert min(samples) <= a.low


def test_compare_calls_a_difference_only_where_intervals_separate() -> None:
    fast = Interval(10.0, 9.5, 10.5, 3, "t")
    slow = Interval(8.0, 7.5, 8.5, 3, "t")
    overlapping = Interval(9.0, 8.4, 9.6, 3, "t")
    assert compare(fast, slow) == "a"
    assert compare(slow, fast) == "b"
    assert compare(fast, overlapping) == "within noise"
    assert compare(overlapping, slow) == "within noise"
    # touching intervals are not separated
    assert compare(Interval(2.0, 1.0, 2.0, 3, "t"), Interval(3.0, 2.0, 3.0, 3, "t")) == (
        "within noise"
    )


def test_noisy_repeats_are_within_noise_and_tight_ones_are_not() -> None:
    # the same two medians (100 vs 110) with +-20% and +-1% repeat noise
    noisy = compare(t_interval([80.0, 100.0, 120.0]), t_interval([88.0, 110.0, 132.0]))
    tight = compare(t_interval([99.0, 100.0, 101.0]), t_interval([109.0, 110.0, 111.0]))
    assert noisy == "within noise"
    assert tight == "b"


def test_relative_spread() -> None:
    assert relative_spread(Interval(10.0, 9.0, 11.0, 3, "t")) == pytest.approx(0.1)
    assert relative_spread(Interval(0.0, -1.0, 1.0, 3, "t")) is None
    assert t_interval([5.0, 5.0, 5.0]).as_dict() == {
        "median": 5.0,
        "low": 5.0,
        "high": 5.0,
        "n": 3,
        "method": "t",
    }


def test_repeats_pair_by_number_and_a_shared_number_cannot_pair() -> None:
    a = by_repeat(
        [
            {"repeat": 0, "x": 10.0},
            {"repeat": 2, "x": 12.0},
            {"repeat": 1, "x": float("nan")},
            {"repeat": 3, "x": True},  # a flag is not a measurement
        ],
        "x",
    )
    b = by_repeat([{"repeat": 0, "x": 8.0}, {"repeat": 2, "x": 10.0}, {"repeat": 4, "x": 1.0}], "x")
    assert a == {0: 10.0, 2: 12.0} and b == {0: 8.0, 2: 10.0, 4: 1.0}
    s = pair_summary(a, b)
    assert s["repeats"] == [0, 2] and s["ratios"] == [1.25, 1.2] and s["called"] == "within noise"
    assert s["low"] < 1 < s["high"]  # two pairs: a wide interval
    assert pair_summary(a, {0: 8.0})["called"] is None  # one pair: nothing called
    shared = by_repeat([{"repeat": 0, "x": 1.0}, {"repeat": 0, "x": 2.0}], "x")
    assert shared is None
    assert "share a repeat" in pair_summary(shared, b)["reason"]
