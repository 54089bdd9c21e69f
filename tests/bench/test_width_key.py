"""Every (label, width) run of the matrix verifies at exactly the width asked
for, its row records that width as requested and as run, and the resume
key, the report's key and its series labels cannot mislabel a run; the
process-wide compressed-GEMM mode is part of every run's key."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pdflash.bench import cli
from pdflash.bench.engine_run import RunSpec
from pdflash.bench.suites import matrix

from pdflash.models.compressed_gemm import set_compressed_gemm
from pdflash.report.schema import BASELINES, resolved_width, row_key, series_labels

POINT: dict[str, Any] = {
    "arch": "tiny",
    "block_size": 16,
    "concurrency": 4,
    "cache_fraction": 0.2,
    "repeat": 0,
}


@pytest.fixture
def process_mode(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The compressed-GEMM mode read from the environment (set per test)."""
    set_compressed_gemm(None)
    monkeypatch.delenv("PDFLASH_COMPRESSED_GEMM", raising=False)
    yield
    set_compressed_gemm(None)


def _plan(argv: str) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser()
    matrix.add_arguments(parser)
    return matrix.plan(parser.parse_args(argv.split()))


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_cpu_matrix_runs_each_label_at_the_width_it_is_labelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, process_mode: None
) -> None:
    """The real engine: B2 and PD at auto (B2's full, PD's adaptive),
    fixed:1, adaptive and full. Each row verifies at its spec's width,
    records it as requested and as run, and the report labels it by that
    width."""
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "m"
    argv = "matrix --arch tiny --baselines B2,PD --verify-width auto,fixed:1,adaptive,full"
    argv += " --concurrency 2 --cache-fraction 0.5 --block-sizes 6 --repeats 1 --device cpu"
    argv += " --prompt-len 6 --max-new-tokens 8 --acceptance forced --mean-tau 3"
    argv += " --emulated-link-gbps 0.5 --no-progress --no-report --json --out " + str(out)
    assert cli.main(argv.split()) == 0
    rows = _rows(out / "rows.jsonl")
    ran = sorted((r["baseline"], r["verify_width"]["setting"]) for r in rows)
    assert ran == [
        ("B2", "adaptive"),
        ("B2", "fixed:1"),
        ("B2", "full"),
        ("PD", "adaptive"),
        ("PD", "fixed:1"),
        ("PD", "full"),
    ]
    for r in rows:
        vw = r["verify_width"]
        assert vw["requested"] == vw["setting"] == r["spec"]["verify_width"], r["baseline"]
        assert vw["ran"] == vw["setting"]  # cache 0.5: nothing switched
        if vw["setting"] == "full":
            assert vw["policy"] is None  # every draft verified, no policy consulted
        else:
            assert vw["policy"] == vw["setting"]
    labels = series_labels(rows)
    assert sorted(labels[id(r)] for r in rows) == [
        "B2 [verify_width=adaptive]",
        "B2 [verify_width=fixed:1]",
        "B2 [verify_width=full]",
        "PD [verify_width=adaptive]",
        "PD [verify_width=fixed:1]",
        "PD [verify_width=full]",
    ]
    assert len({row_key(r) for r in rows}) == 6
    # the same command again: every run is recorded already
    assert cli.main(argv.split()) == 0
    assert len(_rows(out / "rows.jsonl")) == 6


def test_an_explicit_width_and_an_auto_that_is_another_are_keyed_apart() -> None:
    def key(spec: dict[str, Any], **width: str) -> tuple[Any, ...]:
        return matrix.spec_key({**spec, **width})

    # PD and PD+host: auto is adaptive, full another run
    for label in ("PD", "PD+host"):
        spec = {**POINT, "baseline": label}
        assert RunSpec(arch="tiny", baseline=label).width_setting == "adaptive"
        assert key(spec, verify_width="full") != key(spec, verify_width="auto")
        assert key(spec) == key(spec, verify_width="auto") == key(spec, verify_width="adaptive")
    # full-width labels, the full-width arm's included: no width, auto and
    # full are one run, fixed:1 and adaptive others
    for label in ("B2", "PD-full-width"):
        spec = {**POINT, "baseline": label}
        assert RunSpec(arch="tiny", baseline=label).width_setting == "full"
        assert key(spec) == key(spec, verify_width="auto") == key(spec, verify_width="full")
        assert key(spec, verify_width="fixed:1") != key(spec)
        assert key(spec, verify_width="adaptive") != key(spec)
    # B0 drafts nothing: every width is full
    b0 = {**POINT, "baseline": "B0"}
    assert key(b0, verify_width="fixed:1") == key(b0, verify_width="full") == key(b0)
    for label in BASELINES:
        assert RunSpec(arch="tiny", baseline=label).width_setting == resolved_width("auto", label)


def test_a_recorded_row_is_keyed_by_the_width_it_ran_at(tmp_path: Path) -> None:
    """A row recorded before every spec named its width: PD's rows of that
    code ran adaptive (PD's preset then, and today's; their row says so),
    and a resume must not count them as PD at full; a PD row recorded at
    full (PD's preset for one session) is not today's auto either; rows
    recorded before widths existed ran full."""
    specs = _plan("--arch tiny --baselines B2,PD --verify-width full,adaptive --repeats 1")
    planned = {(s["baseline"], s["verify_width"]): s for s in specs}
    assert sorted(planned) == [
        ("B2", "adaptive"),
        ("B2", "full"),
        ("PD", "adaptive"),
        ("PD", "full"),
    ]

    def recorded(spec: dict[str, Any], **row: Any) -> dict[str, Any]:
        return {"spec": {k: v for k, v in spec.items() if k != "verify_width"}, **row}

    mislabelled = recorded(
        planned[("PD", "full")], verify_width={"setting": "adaptive", "requested": "auto"}
    )
    before_widths = recorded(planned[("B2", "full")])  # records no width at all
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (mislabelled, before_widths)))
    done = matrix.recorded_keys(path)
    assert matrix.spec_key(planned[("PD", "adaptive")]) in done
    assert matrix.spec_key(planned[("PD", "full")]) not in done
    assert matrix.spec_key(planned[("B2", "full")]) in done
    # recorded at full while PD's preset was full: keyed full
    full_then = recorded(planned[("PD", "full")], verify_width={"setting": "full"})
    path.write_text(json.dumps(full_then) + "\n")
    assert matrix.recorded_keys(path) == {matrix.spec_key(planned[("PD", "full")])}
    # the report labels them by what they ran at, too
    pd_full = {**planned[("PD", "full")]}
    rows = [
        {**mislabelled, "baseline": "PD"},
        {"spec": pd_full, "baseline": "PD", "verify_width": {"setting": "full"}},
    ]
    assert sorted(series_labels(rows).values()) == [
        "PD [verify_width=adaptive]",
        "PD [verify_width=full]",
    ]


def test_the_compressed_gemm_mode_is_part_of_every_runs_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, process_mode: None
) -> None:
    argv = "--arch tiny --baselines B1,PD --concurrency 4 --cache-fraction 0.5 --repeats 1"
    monkeypatch.setenv("PDFLASH_COMPRESSED_GEMM", "dequant")
    dequant = _plan(argv)
    assert {s["compressed_gemm"] for s in dequant} == {"dequant"}
    monkeypatch.setenv("PDFLASH_COMPRESSED_GEMM", "fused")
    fused = _plan(argv)
    assert {s["compressed_gemm"] for s in fused} == {"fused"}
    assert {matrix.spec_key(s) for s in dequant}.isdisjoint({matrix.spec_key(s) for s in fused})
    parser = argparse.ArgumentParser()
    matrix.add_arguments(parser)
    command = matrix.matrix_command(parser.parse_args(argv.split()), tmp_path)
    assert command.startswith("PDFLASH_COMPRESSED_GEMM=fused pdflash-bench matrix")
    # a resume in fused mode does not count the dequant runs as done, and a
    # row whose spec names no mode is keyed by the mode it recorded, else
    # dequant (the only default before specs named it)
    path = tmp_path / "rows.jsonl"
    legacy = [
        {"spec": {k: v for k, v in s.items() if k != "compressed_gemm"}, "compressed_gemm": None}
        for s in dequant
    ]
    path.write_text("".join(json.dumps({"spec": s}) + "\n" for s in dequant))
    done = matrix.recorded_keys(path)
    assert not any(matrix.spec_key(s) in done for s in fused)
    path.write_text("".join(json.dumps(r) + "\n" for r in legacy))
    assert matrix.recorded_keys(path) == {matrix.spec_key(s) for s in dequant}
    legacy_fused = [{**r, "compressed_gemm": "fused"} for r in legacy]
    path.write_text("".join(json.dumps(r) + "\n" for r in legacy_fused))
    assert matrix.recorded_keys(path) == {matrix.spec_key(s) for s in fused}
    # a spec never runs in a mode other than the one it names (state unchanged)
    spec = RunSpec(arch="tiny", baseline="B1", compressed_gemm="dequant")
    with pytest.raises(ValueError, match="runs compressed experts in 'fused'"):
        spec.validate()
    RunSpec(arch="tiny", baseline="B1", compressed_gemm="fused").validate()
    monkeypatch.setenv("PDFLASH_COMPRESSED_GEMM", "dequant")
    spec.validate()


def test_the_engine_suite_runs_each_label_once_per_width_it_resolves_to() -> None:
    from pdflash.bench.suites.engine import label_runs

    runs = label_runs(["B2", "PD"], ["off"], ["auto", "adaptive", "full", "fixed:1"])
    # B2's auto is full; PD's is adaptive: each (label, width) once, as first asked
    assert runs == [
        ("B2", "off", "auto"),
        ("B2", "off", "adaptive"),
        ("B2", "off", "fixed:1"),
        ("PD", "off", "auto"),
        ("PD", "off", "full"),
        ("PD", "off", "fixed:1"),
    ]
    # the full-width arm's auto is full, as B2's
    arm = label_runs(["PD-full-width"], ["off"], ["auto", "full", "adaptive"])
    assert [w for _, _, w in arm] == ["auto", "adaptive"]
