"""The one convention for metrics that might not have been observed.

A metric is either a finite number that was measured, or :class:`NotMeasured`
with the reason. There is no 0.0 or 1.0 placeholder anywhere in pdflash:
a ratio whose denominator is empty is ``NotMeasured("no routed experts
observed")``, and in JSON it is ``null`` with the reason stored beside it
under ``"not_measured"``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class NotMeasured:
    """A metric that has no value, and why."""

    reason: str

    def __bool__(self) -> bool:  # a missing metric is never truthy
        return False


Metric = float | NotMeasured


def ratio(numerator: float, denominator: float, reason: str) -> Metric:
    """``numerator / denominator``, or ``NotMeasured(reason)`` if the denominator is 0."""
    if denominator == 0:
        return NotMeasured(reason)
    return numerator / denominator


def is_measured(value: object) -> bool:
    """True for a finite number, False for :class:`NotMeasured`, None or NaN."""
    # numbers.Real covers numpy scalars (np.float32, np.int64) too
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def metrics_to_json(metrics: Mapping[str, Metric]) -> dict[str, object]:
    """Flatten metrics to JSON: numbers stay, missing ones become ``null``
    with their reasons collected under ``"not_measured"``."""
    out: dict[str, object] = {}
    reasons: dict[str, str] = {}
    for name, value in metrics.items():
        if isinstance(value, NotMeasured):
            out[name] = None
            reasons[name] = value.reason
        elif not is_measured(value):
            # NOTE: JSON has no NaN/inf; a value that is not a finite number
            # is reported as missing, with why, never passed through
            out[name] = None
            reasons[name] = f"not a finite number ({value!r})"
        else:
            out[name] = float(value)
    if reasons:
        out["not_measured"] = reasons
    return out
