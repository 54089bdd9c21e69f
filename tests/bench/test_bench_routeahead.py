"""``pdflash-bench routeahead`` runs and reports what it promises."""

from __future__ import annotations

import json

import pytest
from pdflash.bench import cli


def test_routeahead_bench_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["routeahead", "--json", "--requests", "8", "--layers", "4", "--experts", "70"]
    argv += ["--native-reps", "2", "--reference-reps", "1", "--predictor-archs", "gpt_oss"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["accumulator"]["synthetic"] is True
    assert out["accumulator"]["native_equals_reference"] is True
    assert out["accumulator"]["numpy_equals_native"] is True
    assert out["native_us_per_step"] > 0 and out["reference_us_per_step"] > 0
    assert out["speedup"] == pytest.approx(out["reference_us_per_step"] / out["native_us_per_step"])
    assert out["predictor_model"]["synthetic"] is True
    assert set(out["predictor_model"]["by_arch"]) == {"gpt_oss"}
    assert "not_measured" not in out["predictor_model"]["by_arch"]["gpt_oss"]
    expected = {"approx_router", "previous_round", "frequency_prior", "next_layer", "combined"}
    assert expected <= set(out["predictors"])
    for row in out["predictors"].values():
        assert row["predict_us"] > 0
        for key in ("coverage", "precision"):
            assert row[key] is None or 0.0 <= row[key] <= 1.0
