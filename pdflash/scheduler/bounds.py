"""The proved liveness and fairness bounds of the verify scheduler.

Both formulas and their proofs are in ``docs/scheduler.md`` (sections
"Liveness" and "Fairness"); this module only evaluates them, so tests and
users compute the same numbers the specification states.

Symbols: ``T`` token budget, ``Q`` quantum, ``w`` request weights,
``c_max`` the largest dominant cost of any item (oversize items included;
a normal item costs at most 1), ``N`` the number of distinct requests live
at some time during the interval considered.
"""

from __future__ import annotations

import math

from pdflash.scheduler.config import SchedulerConfig


def quiet_window_bound(config: SchedulerConfig, n: int, c_max: float, w_max: float) -> int:
    """``W = ceil(T * N * (c_max + 2 * w_max * Q))``: the most consecutive
    steps with live work in which no new lap is opened."""
    _check(n, c_max, w_max, w_max)
    q = config.quantum
    return math.ceil(config.token_budget * n * (c_max + 2.0 * w_max * q))


def visit_bound(config: SchedulerConfig, c_max: float, w_max: float) -> int:
    """``ceil(T * (c_max + w_max * Q)) + 2``: the most consecutive steps in
    which one request is the head, is served and keeps the head position
    (one DRR visit)."""
    _check(1, c_max, w_max, w_max)
    return math.ceil(config.token_budget * (c_max + w_max * config.quantum)) + 2


def turn_bound(config: SchedulerConfig, n: int, c_max: float, w_min: float, w_max: float) -> int:
    """``L = k * (W + 1) + ceil(T * (c_max + w_max * Q)) + 2`` with
    ``k = ceil(c_max / (w_min * Q))``: the most steps one request keeps the
    head position (its wait for credit plus its visit)."""
    _check(n, c_max, w_min, w_max)
    q = config.quantum
    k = math.ceil(c_max / (w_min * q))
    window = quiet_window_bound(config, n, c_max, w_max)
    return k * (window + 1) + visit_bound(config, c_max, w_max)


def liveness_bound(
    config: SchedulerConfig, n: int, c_max: float, w_min: float, w_max: float
) -> int:
    """``N * L + 1``: a request with pending demand is served within this
    many consecutive steps, whatever the demand of every request is.

    Args:
        n: distinct requests live at some time while it waits (itself
            included).
        c_max: the largest item cost during the wait (>= 1/T).
        w_min, w_max: smallest and largest weight any of them has during
            the wait.
    """
    return n * turn_bound(config, n, c_max, w_min, w_max) + 1


def fairness_bound(config: SchedulerConfig, c_max: float, w_a: float, w_b: float) -> float:
    """``3Q + c_max / w_a + c_max / w_b``: when every step serves one item,
    two requests continuously backlogged over an interval, with constant
    weights, differ in weighted service (``service / w``) over it by less
    than this."""
    _check(2, c_max, min(w_a, w_b), max(w_a, w_b))
    return 3.0 * config.quantum + c_max / w_a + c_max / w_b


def _check(n: int, c_max: float, w_min: float, w_max: float) -> None:
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n!r}")
    if not (math.isfinite(c_max) and c_max > 0):
        raise ValueError(f"c_max must be finite and > 0, got {c_max!r}")
    if not (0 < w_min <= w_max < math.inf):
        raise ValueError(f"need 0 < w_min <= w_max < inf, got {w_min!r}, {w_max!r}")
