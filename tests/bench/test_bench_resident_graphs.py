"""The engine bench's ``resident_graphs`` run setting (recorded all-resident
layer calls, :mod:`pdflash.models.resident_graphs`): it reaches the layers
for the run and is put back after (also after a failing run), rows carry
the recorder's counters, a run with it on commits the tokens a run with it
off does, and it is a run setting of the row key and of issue16's arms.
The recorder runs over the eager stand-in backend (the CUDA one on a GPU)."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from bench_fixtures import load_bench_script
from pdflash.bench import engine_run
from pdflash.bench.engine_run import RunSpec, run_spec

from pdflash.engine.graphs import EagerBackend
from pdflash.models import offload, resident_graphs
from pdflash.models.resident_graphs import (
    ResidentGraphs,
    resident_graphs_mode,
    set_resident_graphs,
)


@pytest.fixture
def eager_recorder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Targets loaded from here on record over the eager stand-in backend;
    the process's cached targets are dropped before and after (none keeps
    the stand-in)."""
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    monkeypatch.delenv("PDFLASH_RESIDENT_GRAPHS", raising=False)
    monkeypatch.setattr(
        offload, "ResidentGraphs", partial(ResidentGraphs, lambda _d: EagerBackend())
    )
    set_resident_graphs(None)
    engine_run.release_targets()
    yield
    engine_run.release_targets()
    set_resident_graphs(None)


def _spec(**kw: Any) -> RunSpec:
    # cache 1.0: every layer's experts resident once copied (all-resident
    # calls); full width: no width chosen from measured step times, so two
    # runs verify the same rows
    common: dict[str, Any] = {"arch": "tiny", "baseline": "PD", "device": "cpu"}
    common |= {"verify_width": "full"}
    common |= {"concurrency": 3, "num_requests": 4, "block_size": 4, "warmup": "short"}
    common |= {"max_new_tokens": 12, "prompt_len": 5, "prompt_len_max": 8}
    common |= {"cache_fraction": 1.0}
    return RunSpec(**(common | kw))


def test_rows_carry_the_recorder_and_on_commits_what_off_does(eager_recorder: None) -> None:
    off, on = (run_spec(_spec(resident_graphs=m)) for m in ("off", "on"))
    rec_off, rec_on = off.row["resident_graphs"], on.row["resident_graphs"]
    assert rec_off["setting"] == "off" and rec_off["state"] == "off"
    assert rec_off["captures"] == rec_off["replays"] == 0
    # with it off, the all-resident calls there were, all eager for that reason
    assert set(rec_off["eager"]) == {"off"} and rec_off["eager"]["off"] > 0
    assert rec_on["setting"] == "on" and rec_on["state"] == "on"
    assert rec_on["captures"] > 0 and rec_on["replays"] > 0 and rec_on["mismatches"] == 0
    assert rec_on["validated"] == rec_on["captures"] and rec_on["capture_failures"] == 0
    assert rec_on["capture_s"] > 0 and rec_on["graphs_held"] >= 1
    assert "off" not in rec_on["eager"] and rec_on["eager"].get("warming", 0) > 0
    assert rec_on["distinct_keys"] >= rec_on["captures"]
    # the same all-resident calls, each replayed or eager
    calls_on = rec_on["replays"] + rec_on["captures"] + sum(rec_on["eager"].values())
    assert calls_on == rec_off["eager"]["off"]
    from pdflash.report.schema import row_key, validate_row

    assert validate_row(on.row) == [] and validate_row(off.row) == []
    assert row_key(on.row) != row_key(off.row)
    # greedy (forced acceptance, temperature 0): the same tokens and routing
    for name in ("committed_tokens", "steps", "verify_forwards", "acceptance_length_mean"):
        assert off.row[name] == on.row[name], name
    assert [r.get("output_tokens") for r in off.requests] == [
        r.get("output_tokens") for r in on.requests
    ]
    assert len(off.routing_trace) == len(on.routing_trace)
    for a, b in zip(off.routing_trace, on.routing_trace, strict=True):
        assert (a == b).all()
    assert resident_graphs._mode is None  # unset before: unset after


def test_the_setting_reaches_the_layers_and_is_put_back(
    eager_recorder: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_resident_graphs("on")
    row = run_spec(_spec(resident_graphs="off")).row["resident_graphs"]
    assert set(row["eager"]) == {"off"} and row["replays"] == 0  # the spec's, not the process's
    assert resident_graphs_mode() == "on"
    # a failing run: the mode it ran in was the spec's, and the one before is back
    seen: list[str] = []

    def failing(*_a: Any, **_k: Any) -> Any:
        seen.append(resident_graphs_mode())
        raise RuntimeError("workload failed")

    monkeypatch.setattr(engine_run, "_workload", failing)
    set_resident_graphs("off")
    with pytest.raises(RuntimeError, match="workload failed"):
        run_spec(_spec(resident_graphs="on"))
    assert seen == ["on"] and resident_graphs_mode() == "off"


def test_the_setting_is_checked_and_is_a_run_setting() -> None:
    with pytest.raises(ValueError, match="resident_graphs must be one of"):
        RunSpec(arch="tiny", baseline="PD", resident_graphs="auto").validate()
    from pdflash.report.schema import RUN_SETTINGS, row_settings

    names = [s.name for s in RUN_SETTINGS]
    assert "resident_graphs" in names
    i = names.index("resident_graphs")
    # rows from before the setting ran with the switch off
    assert row_settings({"baseline": "PD"})[i] == "off"
    assert row_settings({"resident_graphs": {"setting": "on"}})[i] == "on"
    assert row_settings({"spec": {"resident_graphs": "on"}})[i] == "on"


def test_issue16_arms_and_the_clis_take_it() -> None:
    issue16 = load_bench_script("issue16.py")
    arms = issue16.parse_arms("PD,graphs=PD:resident_graphs=on")
    assert arms[1].overrides() == {"resident_graphs": "on"}
    base = {"arch": "tiny", "cache_fraction": 0.5, "concurrency": 1}
    issue16.check_arms(arms, base, ["tiny"])
    with pytest.raises(ValueError, match="resident_graphs must be one of"):
        issue16.check_arms(issue16.parse_arms("PD,g=PD:resident_graphs=yes"), base, ["tiny"])

    import argparse

    from pdflash.bench.suites import engine, matrix

    for suite in (engine, matrix):
        parser = argparse.ArgumentParser()
        suite.add_arguments(parser)
        assert parser.parse_args(["--resident-graphs", "on"]).resident_graphs == "on"
        assert parser.parse_args([]).resident_graphs == "off"
