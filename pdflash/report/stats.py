"""Repeat statistics for benchmark rows: a median with a 95% interval per
point, and a comparison that calls a difference only where intervals separate.

Two interval methods, both stated on every result:

* ``t``: Student's t interval of the mean, ``mean ± t(0.975, n−1)·s/√n``.
  With the three to five repeats a GPU lease allows, it is the usable one:
  it widens honestly as n shrinks.
* ``bootstrap``: the percentile interval of the median over seeded
  resamples (deterministic for a given seed). With few samples it collapses
  towards ``[min, max]``, so it is offered for n >= 8 only.

:func:`compare` says ``"a"`` or ``"b"`` (which is larger) only when the two
intervals do not overlap, and ``"within noise"`` otherwise. Non-overlap of
two 95% intervals is stricter than a 5% test; a benchmark that claims a win
should be the stricter side.

Interleaved repeats pair: repeat ``k`` of two configurations ran on the same
machine state, so :func:`paired` divides them repeat by repeat and
:func:`ratio_verdict` calls a difference where the ratios' interval excludes
1 (the rule the results READMEs state). It sees a steady few-percent
difference that the repeats' own spread hides from :func:`compare`, a loss
as well as a win.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Method = Literal["t", "bootstrap"]
Verdict = Literal["a", "b", "within noise"]

#: Two-sided 95% quantiles t(0.975, df) for df = 1..30 (standard tables).
_T975 = (
    12.706204736,
    4.302652730,
    3.182446305,
    2.776445105,
    2.570581836,
    2.446911851,
    2.364624252,
    2.306004135,
    2.262157163,
    2.228138852,
    2.200985160,
    2.178812830,
    2.160368656,
    2.144786688,
    2.131449546,
    2.119905299,
    2.109815578,
    2.100922040,
    2.093024054,
    2.085963447,
    2.079613845,
    2.073873068,
    2.068657610,
    2.063898562,
    2.059538553,
    2.055529439,
    2.051830516,
    2.048407142,
    2.045229642,
    2.042272456,
)

#: Below this many samples a bootstrap interval is refused (it degenerates).
MIN_BOOTSTRAP_SAMPLES = 8


def t_quantile_975(df: int) -> float:
    """t(0.975, df): the table above for df <= 30, else a Cornish-Fisher
    expansion around the normal quantile (error < 1e-4 for df > 30)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = statistics.NormalDist().inv_cdf(0.975)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3


@dataclass(frozen=True)
class Interval:
    """A point's repeats summarised: the median, a 95% interval, how many
    samples and which method made the interval."""

    median: float
    low: float
    high: float
    n: int
    method: Method

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "median": self.median,
            "low": self.low,
            "high": self.high,
            "n": self.n,
            "method": self.method,
        }


def _finite(samples: Sequence[float]) -> list[float]:
    values = [float(v) for v in samples]
    if not values:
        raise ValueError("an interval needs at least one sample")
    bad = [v for v in values if not math.isfinite(v)]
    if bad:
        raise ValueError(f"samples must be finite, got {bad}")
    return values


def t_interval(samples: Sequence[float]) -> Interval:
    """Median of ``samples`` with the 95% t interval of their mean. Needs two
    or more samples: one sample has no spread to measure."""
    values = _finite(samples)
    n = len(values)
    if n < 2:
        raise ValueError("a t interval needs at least two samples (one has no spread)")
    mean = statistics.fmean(values)
    half = t_quantile_975(n - 1) * statistics.stdev(values) / math.sqrt(n)
    return Interval(statistics.median(values), mean - half, mean + half, n, "t")


def bootstrap_interval(
    samples: Sequence[float], *, resamples: int = 2000, seed: int = 0
) -> Interval:
    """Median of ``samples`` with the 95% percentile-bootstrap interval of the
    median (``resamples`` seeded resamples with replacement)."""
    values = _finite(samples)
    n = len(values)
    if n < MIN_BOOTSTRAP_SAMPLES:
        raise ValueError(
            f"a bootstrap interval needs >= {MIN_BOOTSTRAP_SAMPLES} samples, got {n}; "
            "use the t interval"
        )
    if resamples < 100:
        raise ValueError(f"resamples must be >= 100, got {resamples}")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    lo = medians[math.floor(0.025 * (resamples - 1))]
    hi = medians[math.ceil(0.975 * (resamples - 1))]
    return Interval(statistics.median(values), lo, hi, n, "bootstrap")


def interval(samples: Sequence[float], method: Method = "t", *, seed: int = 0) -> Interval:
    """The interval of ``samples`` by ``method`` (``"t"`` or ``"bootstrap"``)."""
    if method == "t":
        return t_interval(samples)
    if method == "bootstrap":
        return bootstrap_interval(samples, seed=seed)
    raise ValueError(f"method must be 't' or 'bootstrap', got {method!r}")


def paired(
    num: Mapping[int, float | None], den: Mapping[int, float | None]
) -> list[tuple[int, float]]:
    """``(repeat, num / den)`` for every repeat both sides ran, in repeat
    order (a repeat with no or a zero denominator, or no numerator, is
    left out)."""
    return [
        (k, n / d)
        for k in sorted(set(num) & set(den))
        if (d := den[k]) and (n := num[k]) is not None
    ]


def by_repeat(rows: Iterable[Mapping[str, Any]], name: str) -> dict[int, float] | None:
    """``{repeat: rows' name}`` over rows with both a finite number and an
    integer ``repeat``; None where two rows share a repeat (they cannot pair)."""
    out: dict[int, float] = {}
    for row in rows:
        value, repeat = row.get(name), row.get("repeat")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value) or not isinstance(repeat, int):
            continue
        if repeat in out:
            return None
        out[repeat] = float(value)
    return out


def pair_summary(
    num: Mapping[int, float | None] | None, den: Mapping[int, float | None] | None
) -> dict[str, Any]:
    """``num`` over ``den`` repeat by repeat (:func:`paired`): ``repeats``,
    ``ratios``, ``n``, and with two or more pairs their ``median``, t
    interval ``low``/``high`` and ``called`` (:func:`ratio_verdict`); else
    ``called`` None with a ``reason``. A None side (repeats that cannot
    pair, :func:`by_repeat`) gives a reason."""
    if num is None or den is None:
        return {"called": None, "reason": "two runs of one side share a repeat number"}
    pairs = paired(num, den)
    ratios = [x for _, x in pairs]
    out: dict[str, Any] = {"repeats": [k for k, _ in pairs], "ratios": ratios, "n": len(ratios)}
    if len(ratios) < 2:
        out.update(called=None, reason=f"{len(ratios)} repeat(s) ran both: nothing to pair")
        return out
    iv = t_interval(ratios)
    out.update(
        median=statistics.median(ratios),
        low=iv.low,
        high=iv.high,
        called=ratio_verdict(iv.low, iv.high),
    )
    return out


def pairs_text(pairs: Mapping[str, Any]) -> str:
    """A called pairing's numbers as the report prints them: the ratios'
    median [t interval] (n=pairs)."""
    return f"{pairs['median']:.3g} [{pairs['low']:.3g}, {pairs['high']:.3g}] (n={pairs['n']})"


def ratio_verdict(low: float, high: float) -> str:
    """``faster`` / ``slower`` where a ratio's interval ``[low, high]``
    excludes 1 (the rule the results READMEs state), else ``within noise``."""
    if low > 1:
        return "faster"
    if high < 1:
        return "slower"
    return "within noise"


def compare(a: Interval, b: Interval) -> Verdict:
    """``"a"`` when a's interval lies wholly above b's, ``"b"`` when b's lies
    wholly above a's, else ``"within noise"``."""
    if a.low > b.high:
        return "a"
    if b.low > a.high:
        return "b"
    return "within noise"


def relative_spread(iv: Interval) -> float | None:
    """Half the interval's width over its median: the run-to-run noise a
    README can state. None when the median is zero (no relative scale)."""
    if iv.median == 0:
        return None
    return (iv.high - iv.low) / 2 / abs(iv.median)
