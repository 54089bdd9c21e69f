"""CLI smoke tests on CPU: matrix / default with a fake engine (the real one is
exercised in test_default_real.py), report on fixture folders with planted
bad rows."""

from __future__ import annotations

import argparse
import gzip
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pdflash.bench import cli
from pdflash.bench.suites import default, matrix

from pdflash.report.belady import belady

Row = dict[str, Any]


def _rows(path: Path) -> list[Row]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_rows(folder: Path, rows: list[Row]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "rows.jsonl", "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")


def test_matrix_with_fake_engine_appends_and_resumes(
    tmp_path: Path,
    fake_engine: Callable[..., Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec_cls, engine = fake_engine()
    out = tmp_path / "m"
    argv = ["matrix", "--arch", "tiny", "--concurrency", "1,2", "--cache-fraction", "0.2,0.5"]
    argv += ["--slo", "2", "--out", str(out), "--no-progress", "--json", "--repeats", "3"]
    assert cli.main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # 3 repeats x (2 fractions x 2 concurrencies x 4 offloading baselines + B3
    # once per concurrency)
    assert summary["ran"] == 54 and summary["planned"] == 54
    assert summary["verdict"] == "GO" and summary["valid"]
    rows = _rows(out / "rows.jsonl")
    assert len(rows) == 54
    assert {r["cache_fraction"] for r in rows if r["baseline"] == "B3"} == {1.0}
    # Belady figures come from the run's own trace
    pd = next(r for r in rows if r["baseline"] == "PD")
    spec = spec_cls(**pd["spec"])
    res = engine.__class__()(spec)
    replay = belady(res.routing_trace, res.cache_slots, res.expert_nbytes)
    assert pd["belady_bytes"] == replay.bytes_moved
    assert pd["belady_bytes_per_token"] == pytest.approx(
        replay.bytes_moved / pd["committed_tokens"]
    )
    assert pd["bytes_per_token_vs_belady"] == pytest.approx(
        pd["bytes_per_token"] / pd["belady_bytes_per_token"]
    )
    assert pd["routed_expert_bytes"] == 12 * 2 * 4096
    for name in (
        "report.md",
        "report.json",
        "rows.csv",
        "money_plot.png",
        "tokens_vs_concurrency.png",
    ):
        assert (out / name).stat().st_size > 0, name
    assert (out / "money_plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the same command again: nothing re-run, nothing rewritten
    before = (out / "rows.jsonl").read_text()
    assert cli.main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["ran"] == 0 and summary["skipped_already_recorded"] == 54
    assert (out / "rows.jsonl").read_text() == before
    # one more repeat appends only the new runs
    assert cli.main([*argv, "--repeats", "4"]) == 0
    assert len(_rows(out / "rows.jsonl")) == 72
    assert (out / "rows.jsonl").read_text().startswith(before)


def test_matrix_failure_is_recorded_and_fails_the_command(
    tmp_path: Path, fake_engine: Callable[..., Any]
) -> None:
    fake_engine(fail_on="B2")
    out = tmp_path / "m"
    code = cli.main(
        [
            "matrix",
            "--concurrency",
            "1",
            "--cache-fraction",
            "0.2",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 1
    errors = _rows(out / "errors.jsonl")
    assert [e["spec"]["baseline"] for e in errors] == ["B2"]
    assert "planted failure for B2" in errors[0]["error"]
    report = json.loads((out / "report.json").read_text())
    assert "missing baseline(s) B2 at tiny/blk16/c1/cf0.2" in report["problems"]
    assert report["verdict"]["label"] == "NO-GO"


def test_matrix_budget_stops_and_resumes(tmp_path: Path, fake_engine: Callable[..., Any]) -> None:
    fake_engine()
    specs = [
        {
            "arch": "tiny",
            "baseline": b,
            "block_size": 16,
            "concurrency": 1,
            "cache_fraction": 0.2,
            "repeat": 0,
        }
        for b in ("B0", "B1", "B2", "PD")
    ]
    summary = matrix.run_matrix(specs, tmp_path, budget_s=0.0, show_progress=False)
    # a zero budget still starts nothing after the clock has moved
    assert summary["ran"] + summary["not_started_budget"] == 4
    summary2 = matrix.run_matrix(specs, tmp_path, show_progress=False)
    assert summary["failed"] == summary2["failed"] == 0
    assert summary["ran"] + summary2["ran"] == 4
    assert len(_rows(tmp_path / "rows.jsonl")) == 4


def test_matrix_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in (
        ["--arch", "llama"],
        ["--cache-fraction", "1.5"],
        ["--baselines", "B1,B7"],
        ["--concurrency", "0"],
    ):
        with pytest.raises(SystemExit) as exc:
            cli.main(["matrix", *bad])
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown 'llama'" in err and "1.5 is not in (0, 1]" in err and "unknown 'B7'" in err


def test_default_quick_with_fake_engine(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fake_engine: Callable[..., Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, engine = fake_engine()
    monkeypatch.setattr(cli, "DEFAULT_SUITE", "default")
    monkeypatch.chdir(tmp_path)
    # no arguments at all: the default suite, into a folder it names
    monkeypatch.setattr("sys.argv", ["pdflash-bench"])
    monkeypatch.setenv("PDFLASH_BENCH_QUICK", "1")
    assert cli.main() == 0
    out = capsys.readouterr().out
    assert "results folder: pdflash-bench-results/" in out
    # one repeat on the CPU: no noise measured, so "PD beats X" is not called
    assert "| arch | baseline |" in out and "verdict: NO-GO" in out and "one repeat" in out
    (folder,) = (tmp_path / "pdflash-bench-results").iterdir()
    assert sorted(p.name for p in folder.iterdir()) == [
        "money_plot.png",
        "report.json",
        "report.md",
        "rows.csv",
        "rows.jsonl",
        "tokens_vs_concurrency.png",
    ]
    # every baseline at concurrency 1 and 4, CPU with an emulated link
    assert sorted((s.baseline, s.concurrency) for s in engine.specs) == sorted(
        (b, c) for b in ("B0", "B1", "B2", "B3", "PD") for c in (1, 4)
    )
    import torch

    if torch.cuda.is_available():
        assert {(s.device, s.emulated_link_gbps) for s in engine.specs} == {("cuda", None)}
    else:
        assert {(s.device, s.emulated_link_gbps) for s in engine.specs} == {
            ("cpu", default.CPU_EMULATED_LINK_GBPS)
        }


# ---------------------------------------------------------------- report


def test_report_on_valid_folder(
    tmp_path: Path, matrix_rows: Callable[..., list[Row]], capsys: pytest.CaptureFixture[str]
) -> None:
    _write_rows(tmp_path, matrix_rows(concurrency=(1, 4, 16), fractions=(0.2, 0.8), repeats=3))
    assert cli.main(["report", str(tmp_path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["valid"] and result["verdict"] == "GO" and result["problems"] == []
    md = (tmp_path / "report.md").read_text()
    assert "## Verdict: **GO**" in md and "![money_plot](money_plot.png)" in md
    csv_lines = (tmp_path / "rows.csv").read_text().splitlines()
    assert len(csv_lines) == 1 + 3 * (4 * 3 * 2 + 3)
    assert csv_lines[0].startswith("arch,baseline,weights_source")


def test_report_rejects_planted_bad_rows(
    tmp_path: Path, matrix_rows: Callable[..., list[Row]], capsys: pytest.CaptureFixture[str]
) -> None:
    rows = matrix_rows()
    rows = [r for r in rows if not (r["baseline"] == "B1" and r["concurrency"] == 4)]
    pd = next(r for r in rows if r["baseline"] == "PD" and r["concurrency"] == 1)
    pd["output_tokens_per_s"] = math.nan  # non-finite
    b0 = next(r for r in rows if r["baseline"] == "B0")
    b0["routeahead_coverage"] = 0.9  # vacuous: B0 predicts nothing
    del b0["not_measured"]["routeahead_coverage"]
    b2 = next(r for r in rows if r["baseline"] == "B2")
    b2["h2d_bytes"] = -5.0  # negative
    b3 = next(r for r in rows if r["baseline"] == "B3")
    b3["committed_tokens"] = 0  # acceptance with nothing observed
    b3["output_tokens_per_s"] = 0.0
    folder = tmp_path / "bad"
    folder.mkdir()
    with open(folder / "rows.jsonl", "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")  # json writes NaN as NaN
    assert cli.main(["report", str(folder), "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["verdict"] == "NO-GO" and not result["valid"]
    text = "\n".join(result["problems"])
    assert "output_tokens_per_s is non-finite" in text
    assert "routeahead_coverage reported for baseline B0, which predicts nothing (vacuous)" in text
    assert "h2d_bytes is negative (-5.0)" in text
    assert "acceptance_length_mean reported with no committed tokens (vacuous)" in text
    assert "missing baseline(s) B1 at tiny/blk16/c4/cf0.2" in text
    assert len(result["problems"]) == 5
    assert "## Validation problems" in (folder / "report.md").read_text()


def test_report_on_unreadable_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["report", str(tmp_path / "nowhere"), "--json"]) == 2
    assert "does not exist" in capsys.readouterr().out
    (tmp_path / "rows.jsonl").write_text('{"arch": "tiny"}\nnot json\n')
    assert cli.main(["report", str(tmp_path), "--json"]) == 2
    assert "rows.jsonl:2: not JSON" in capsys.readouterr().out


def test_matrix_plan_shares_b0_and_b3() -> None:
    args = cli.build_parser().parse_args(
        [
            *("matrix", "--arch", "tiny,olmoe", "--block-sizes", "8,16", "--concurrency", "1,4"),
            *("--cache-fraction", "0.2,0.5,0.8", "--repeats", "2", "--layers", "4"),
        ]
    )
    specs = matrix.plan(args)
    count = {b: sum(s["baseline"] == b for s in specs) for b in ("B0", "B1", "B2", "B3", "PD")}
    # per arch x repeat: B1/B2/PD 2 blocks x 2 conc x 3 fractions; B0 2 conc x 3
    # fractions (one block); B3 2 blocks x 2 conc (one fraction, 1.0)
    assert count == {"B0": 24, "B1": 48, "B2": 48, "B3": 16, "PD": 48}
    assert {s["block_size"] for s in specs if s["baseline"] == "B0"} == {8}
    assert {s["cache_fraction"] for s in specs if s["baseline"] == "B3"} == {1.0}
    assert {s["layers"] for s in specs} == {4}
    assert len({matrix.spec_key(s) for s in specs}) == len(specs)


def test_report_combines_rows_files_and_skips_errors(
    tmp_path: Path, matrix_rows: Callable[..., list[Row]], capsys: pytest.CaptureFixture[str]
) -> None:
    rows = matrix_rows(concurrency=(1, 4))
    with open(tmp_path / "rows-a.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows if r["concurrency"] == 1)
    with open(tmp_path / "rows-b.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows if r["concurrency"] == 4)
    (tmp_path / "errors.jsonl").write_text('{"spec": {}, "error": "boom"}\n')
    assert cli.main(["report", str(tmp_path), "--json", "--no-plots"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["rows"] == len(rows) and result["valid"]


def test_matrix_dry_run_counts_what_is_left(
    tmp_path: Path,
    fake_engine: Callable[..., Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["matrix", "--concurrency", "1,4", "--cache-fraction", "0.2", "--out", str(tmp_path)]
    assert cli.main([*argv, "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["planned"], plan["to_run"]) == (10, 10)
    assert plan["command"].startswith("pdflash-bench matrix --arch tiny ")
    assert not (tmp_path / "rows.jsonl").exists()  # nothing ran
    fake_engine()
    assert cli.main([*argv, "--baselines", "B0,B1", "--no-progress", "--no-report"]) == 0
    capsys.readouterr()
    assert cli.main([*argv, "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["already_recorded"], plan["to_run"]) == (4, 6)
    assert plan["to_run_per_baseline"] == {"B2": 2, "B3": 2, "PD": 2}


def test_matrix_replays_belady_from_the_engine_starting_cache(make_row: Any) -> None:
    from types import SimpleNamespace

    # 2 slots, steps {0}, {2}, {1}; the engine started holding {0, 1}: the
    # optimum loads only expert 2 (10 B), not 3 experts as from an empty cache
    row = make_row(committed_tokens=5, bytes_per_token=4.0)
    for name in ("routed_expert_bytes", "belady_bytes", "belady_bytes_per_token"):
        row.pop(name)
    row.pop("bytes_per_token_vs_belady")
    result = SimpleNamespace(
        routing_trace=[[0], [2], [1]], cache_slots=2, expert_nbytes=10, initial_resident=[0, 1]
    )
    out = matrix.augment_row(row, result, {"slo_s": 2.0})
    assert out["belady_initial_state"] == "engine" and out["initial_resident_experts"] == 2
    assert out["belady_bytes"] == 10.0 and out["belady_bytes_per_token"] == 2.0
    assert out["bytes_per_token_vs_belady"] == 2.0
    assert out["routed_expert_bytes"] == 30.0
    # an engine row that carries its own trace figures keeps them
    carried = dict(out)
    carried.pop("spec")
    again = matrix.augment_row(carried, SimpleNamespace(), {"slo_s": 2.0})
    assert {k: again[k] for k in carried} == carried


def test_matrix_plans_pd_host_and_the_host_switch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["matrix", "--concurrency", "1", "--cache-fraction", "0.2", "--out", str(tmp_path)]
    assert cli.main([*argv, "--baselines", "pd,PD+HOST", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["to_run_per_baseline"] == {"PD": 1, "PD+host": 1}
    assert "--baselines PD,PD+host" in plan["command"]
    assert "--host-experts" not in plan["command"]  # off: the default, not spelled out
    specs = matrix.plan(
        cli.build_parser().parse_args(
            [*argv, "--baselines", "B1,PD", "--host-experts", "auto", "--host-threads", "3"]
        )
    )
    assert {s["host_experts"] for s in specs} == {"auto"} and {
        s["host_threads"] for s in specs
    } == {3}
    # a run with the service and one without are different runs to the resume logic
    off = matrix.plan(cli.build_parser().parse_args([*argv, "--baselines", "B1,PD"]))
    assert "host_experts" not in off[0]
    assert matrix.spec_key(specs[0]) != matrix.spec_key(off[0])


def test_matrix_refuses_to_resume_into_gzipped_rows(
    tmp_path: Path, fake_engine: Callable[..., Any]
) -> None:
    fake_engine()
    out = tmp_path / "m"
    out.mkdir()
    (out / "rows.jsonl.gz").write_bytes(gzip.compress(b""))
    with pytest.raises(ValueError, match="gunzip -k"):
        matrix.run_matrix([], out, show_progress=False)
    assert not (out / "rows.jsonl").exists()


def test_matrix_cli_names_gzipped_rows(tmp_path: Path, fake_engine: Callable[..., Any]) -> None:
    fake_engine()
    out = tmp_path / "m"
    out.mkdir()
    (out / "rows.jsonl.gz").write_bytes(gzip.compress(b""))
    argv = ["matrix", "--arch", "tiny", "--out", str(out), "--no-progress", "--json"]
    with pytest.raises(SystemExit, match="gunzip -k"):
        cli.main(argv)


def test_verify_width_takes_every_adaptive_option_the_engine_parses() -> None:
    """``--verify-width`` checks the form without the engine; every option
    :func:`pdflash.engine.verify_width.parse_width` takes passes it, and the
    engine's parser then checks the values."""
    from pdflash.bench.suites._common import verify_width, verify_widths

    from pdflash.engine.verify_width import ADAPTIVE_OPTION_KEYS, parse_width

    # one valid value per option: an option the engine gains fails here
    # until the bench's form (ADAPTIVE_OPTIONS) takes it too
    valid = {"shrink": "8", "z": "1", "cal": "1", "union": "hyperbolic", "beta": "marginal"}
    valid.update(row="wall", explore="0", reach="1", voi="0", cost="0")
    assert set(valid) == set(ADAPTIVE_OPTION_KEYS)
    for key, value in valid.items():
        text = f"adaptive:{key}={value}"
        assert verify_width(text) == text and str(parse_width(text, 16)) == text
    for text in (
        "adaptive:shrink=16",
        "adaptive:z=1",
        "adaptive:cal=1",
        "adaptive:union=hyperbolic",
        "adaptive:cal=1:union=hyperbolic:shrink=8:z=0.5",
        "adaptive:beta=marginal:cal=1",
        "adaptive:row=wall:beta=marginal",
    ):
        assert verify_width(text) == text
        assert str(parse_width(text, 16)) == str(parse_width(verify_width(text), 16))
    assert verify_widths("adaptive,adaptive:cal=1,fixed:1") == [
        "adaptive",
        "adaptive:cal=1",
        "fixed:1",
    ]
    for bad in ("adaptive:", "adaptive:beta", "wide"):
        with pytest.raises(argparse.ArgumentTypeError, match="verify-width"):
            verify_width(bad)
