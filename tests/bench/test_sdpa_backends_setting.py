"""The SDPA backends as a run setting (``sdpa_backends``): a run sets
``PDFLASH_SDPA_BACKENDS`` for its duration and restores it, so one process
can interleave runs under different backends (an A/B of cuDNN's attention);
spelled with ``+`` or ``,``, checked, keyed in one spelling, recorded in
rows, settable on an issue-16 arm."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from bench_fixtures import check_an_issue16_arm_sets
from pdflash.bench import engine_run
from pdflash.bench.engine_run import RunSpec, run_spec

from pdflash.engine.attention import SDPA_BACKENDS_ENV, canonical_sdpa_backends
from pdflash.report.schema import RUN_SETTINGS, spec_settings

(SETTING,) = [s for s in RUN_SETTINGS if s.name == "sdpa_backends"]
KW = {"arch": "tiny", "concurrency": 2, "block_size": 6, "max_new_tokens": 8, "prompt_len": 6}


def test_the_default_leaves_the_process_setting_and_bad_values_are_refused() -> None:
    assert SETTING.default is None and RunSpec(arch="tiny", baseline="PD").sdpa_backends is None
    RunSpec(arch="tiny", baseline="PD", sdpa_backends="efficient+flash+math").validate()
    for bad in ("cudnn+fast", "+", 3):
        with pytest.raises(ValueError, match=r"sdpa_backends|SDPA backends"):
            RunSpec(arch="tiny", baseline="PD", sdpa_backends=bad).validate()  # type: ignore[arg-type]
    assert canonical_sdpa_backends(" Efficient+FLASH, math") == "efficient,flash,math"


def test_a_run_sets_the_backends_for_its_duration_and_restores_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[str | None] = []

    def recording(spec: RunSpec, progress: Any) -> Any:
        seen.append(os.environ.get(SDPA_BACKENDS_ENV))
        if spec.repeat == 1:
            raise RuntimeError("the run failed")
        return None

    monkeypatch.setattr(engine_run, "_run_spec", recording)
    monkeypatch.delenv(SDPA_BACKENDS_ENV, raising=False)
    run_spec(RunSpec(arch="tiny", baseline="PD", sdpa_backends="efficient+math"))
    assert seen[-1] == "efficient,math" and SDPA_BACKENDS_ENV not in os.environ
    monkeypatch.setenv(SDPA_BACKENDS_ENV, "math")
    with pytest.raises(RuntimeError, match="the run failed"):
        run_spec(RunSpec(arch="tiny", baseline="PD", sdpa_backends="flash", repeat=1))
    assert seen[-1] == "flash" and os.environ[SDPA_BACKENDS_ENV] == "math"
    run_spec(RunSpec(arch="tiny", baseline="PD"))  # None: the process's setting, untouched
    assert seen[-1] == "math" and os.environ[SDPA_BACKENDS_ENV] == "math"


def test_specs_are_keyed_in_one_spelling() -> None:
    base = {"arch": "tiny", "baseline": "PD", "concurrency": 1, "cache_fraction": 0.2}
    plus = spec_settings({**base, "sdpa_backends": "efficient+flash+math"})
    assert plus == spec_settings({**base, "sdpa_backends": "Efficient,flash, math"})
    assert plus != spec_settings(base)
    assert spec_settings(base) == spec_settings({**base, "sdpa_backends": None})
    assert spec_settings({**base, "sdpa_backends": "auto"}) != spec_settings(base)
    for raw in ("auto", "Math", "efficient+flash+math", " cudnn, flash ", "flash+cudnn"):
        assert SETTING.of_spec({**base, "sdpa_backends": raw}) == canonical_sdpa_backends(raw)


def test_an_issue16_arm_sets_it() -> None:
    check_an_issue16_arm_sets("sdpa_backends", "efficient+flash+math", "efficient+flash+math")


def test_a_run_records_the_backends_it_ran_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    monkeypatch.delenv(SDPA_BACKENDS_ENV, raising=False)
    row = run_spec(RunSpec(baseline="PD", cache_fraction=0.5, sdpa_backends="math", **KW)).row  # type: ignore[arg-type]
    assert row["sdpa_backends"] == "math"
    assert SDPA_BACKENDS_ENV not in os.environ
