"""The not-measured convention of pdflash.metrics."""

from __future__ import annotations

import json
import math

import numpy as np

from pdflash.metrics import NotMeasured, is_measured, metrics_to_json, ratio


def test_ratio_with_empty_denominator_is_not_measured() -> None:
    got = ratio(0, 0, "no routed experts observed")
    assert isinstance(got, NotMeasured) and got.reason == "no routed experts observed"
    assert ratio(1, 4, "x") == 0.25


def test_numpy_scalars_are_measured_values() -> None:
    assert is_measured(np.float32(0.5)) and is_measured(np.int64(3))
    assert not is_measured(True) and not is_measured(None) and not is_measured(math.nan)


def test_json_never_carries_nan_or_a_silent_zero() -> None:
    out = metrics_to_json(
        {"a": 1.5, "b": NotMeasured("nothing copied"), "c": math.nan, "d": np.float32(2)}
    )
    assert out["a"] == 1.5 and out["d"] == 2.0
    assert out["b"] is None and out["c"] is None
    assert out["not_measured"] == {"b": "nothing copied", "c": "not a finite number (nan)"}
    json.loads(json.dumps(out, allow_nan=False))  # strict JSON
