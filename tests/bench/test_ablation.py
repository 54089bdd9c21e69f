"""Issue 15: the ablation suite (fake engine), the report's intervals and
"within noise" verdicts (hand-checked), and row keys with workloads and
ablation labels."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pdflash.bench import cli
from pdflash.bench.engine_run import RunSpec
from pdflash.bench.suites import matrix

from pdflash.report.ablation import ablation_table
from pdflash.report.evaluate import B3_COMPUTE_FLOOR, evaluate
from pdflash.report.schema import (
    comparison_points,
    row_key,
    validate_rows,
    workload_label,
)

from .conftest import FakeEngine

Row = dict[str, Any]

# t(0.975, 2) = 4.302652730: the half-width of a 3-sample 95% t interval is
# 4.302652730 * sd / sqrt(3)
T2 = 4.302652730


class JitterEngine(FakeEngine):
    """The fake engine with tokens/s scaled by 0.98, 1.00, 1.02 on repeats
    0, 1, 2: a 2% spread, so intervals have width."""

    def __call__(self, spec: Any, progress: Any = None) -> Any:
        result = super().__call__(spec, progress)
        result.row["output_tokens_per_s"] *= 1 + 0.02 * (spec.repeat - 1)
        return result


def _half(values: list[float]) -> float:
    import statistics

    return T2 * statistics.stdev(values) / len(values) ** 0.5


def test_ablation_suite_interleaves_and_writes_what_each_part_buys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = JitterEngine()
    monkeypatch.setattr(matrix, "load_engine", lambda: (RunSpec, engine))
    out = tmp_path / "abl"
    argv = ["ablation", "--concurrency", "4", "--out", str(out), "--no-progress", "--json"]
    assert cli.main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    labels = [
        "PD",
        "PD-all-on",
        "PD-no-route-ahead",
        "PD-one-band",
        "PD-token-sched",
        "PD-no-stream",
        "PD-full-width",
    ]
    assert summary["ran"] == 21 and summary["valid"] and summary["failed"] == 0
    # round-robin: each repeat runs every label once, starting one later
    order = [(s.repeat, s.baseline) for s in engine.specs]
    assert [b for r, b in order if r == 0] == labels
    assert [b for r, b in order if r == 1] == labels[1:] + labels[:1]
    assert [r for r, _ in order] == [0] * 7 + [1] * 7 + [2] * 7
    table = json.loads((out / "ablation.json").read_text())["table"]
    by = {e["variant"]: e for e in table}
    assert set(by) == set(labels[1:])
    # hand-checked: PD 38 x 4 = 152 tokens/s, x 0.98 / 1.00 / 1.02
    pd = [152 * 0.98, 152.0, 152 * 1.02]
    cell = by["PD-one-band"]["output_tokens_per_s"]
    assert cell["PD"]["median"] == pytest.approx(152.0)
    assert cell["PD"]["low"] == pytest.approx(152 - _half(pd))
    assert cell["PD"]["high"] == pytest.approx(152 + _half(pd))
    assert _half(pd) == pytest.approx(T2 * 3.04 / 3**0.5)  # sd of the three is 3.04
    # one-band 34 x 4 = 136 [129.2, 142.8] below PD's [144.4, 159.6]: PD better
    assert cell["verdict"] == "PD"
    # token-sched 37 x 4 = 148 [140.6, 155.4] overlaps PD's: within noise
    assert by["PD-token-sched"]["output_tokens_per_s"]["verdict"] == "within noise"
    assert by["PD-no-route-ahead"]["part"] == "route-ahead"
    # the controller's own row: PD (38 x 4) against every part forced on (34 x 4)
    assert by["PD-all-on"]["part"] == "the PD controller (every part forced on)"
    assert by["PD-all-on"]["output_tokens_per_s"]["verdict"] == "PD"
    md = (out / "ablation.md").read_text()
    assert "| point | without |" in md and "within noise" in md and "PD better" in md
    assert "acceptance forced τ=4" in md  # inputs on its face
    report = (out / "report.md").read_text()
    assert "## What each part of PD buys" in report
    assert summary["command"].startswith("pdflash-bench ablation --arch tiny")
    assert (
        "--variants PD-all-on,PD-no-route-ahead,PD-one-band,PD-token-sched,PD-no-stream,"
        "PD-full-width" in (summary["command"])
    )
    assert "--repeats 3" in summary["command"] and summary["command"] in report


def test_ablation_rate_sweep_rows_are_distinct_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = JitterEngine()
    monkeypatch.setattr(matrix, "load_engine", lambda: (RunSpec, engine))
    out = tmp_path / "sweep"
    argv = ["ablation", "--concurrency", "4", "--variants", "PD-one-band", "--with-host"]
    argv += ["--arrivals", "poisson", "--rate", "2,8", "--max-running", "8"]
    argv += ["--token-budget", "32", "--byte-budget-from", "verify"]
    argv += ["--repeats", "3", "--out", str(out), "--no-progress", "--json"]
    assert cli.main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # 2 rates x 3 repeats x (PD, PD-one-band, PD+host)
    assert summary["ran"] == 18 and summary["valid"], summary
    assert {(s.rate_per_s, s.max_running, s.byte_budget_from) for s in engine.specs} == {
        (2.0, 8, "verify"),
        (8.0, 8, "verify"),
    }
    table = json.loads((out / "ablation.json").read_text())["table"]
    assert sorted((e["workload"], e["variant"]) for e in table) == [
        ("poisson 2/s", "PD+host"),
        ("poisson 2/s", "PD-one-band"),
        ("poisson 8/s", "PD+host"),
        ("poisson 8/s", "PD-one-band"),
    ]
    # resume: the same command runs nothing again
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ran"] == 0


def test_rows_at_different_rates_are_not_duplicates(make_row: Callable[..., Row]) -> None:
    def at(rate: float | None, baseline: str = "PD") -> Row:
        w = None if rate is None else {"arrivals": "poisson", "rate_per_s": rate}
        row = make_row(baseline=baseline)
        if w is not None:
            row["workload"] = w
        return row

    rows = [at(2.0), at(4.0)]
    assert row_key(rows[0]) != row_key(rows[1])
    assert [workload_label(r) for r in rows] == ["poisson 2/s", "poisson 4/s"]
    assert validate_rows(rows, required_baselines=("PD",)) == []
    # the same rate twice is a duplicate
    dup = validate_rows([at(2.0), at(2.0)], required_baselines=("PD",))
    assert any("duplicate" in p for p in dup)
    # old rows (no workload field) are bursts, as a burst row written now
    old, burst = at(None), at(None)
    burst["workload"] = {"arrivals": "burst", "rate_per_s": None}
    assert row_key(old) == row_key(burst)
    assert workload_label(
        make_row(workload={"arrivals": "closed", "users": 8, "think_s": 0.5})
    ) == ("closed 8u think 0.5s")
    # each rate is its own comparison point, and a baseline missing at one is named
    points = comparison_points([at(2.0), at(4.0), at(2.0, "B1")])
    assert [p[4] for p in points] == ["poisson 2/s", "poisson 4/s"]
    b1 = at(2.0, "B1")
    b1.update(routeahead_coverage=None, routeahead_precision=None)
    b1["not_measured"] = {"routeahead_coverage": "none", "routeahead_precision": "none"}
    missing = validate_rows([at(2.0), at(4.0), b1], required_baselines=("PD", "B1"))
    assert missing == ["missing baseline(s) B1 at tiny/blk16/c4/cf0.2/poisson 4/s"]


def test_ablation_labels_validate_and_stay_apart_from_pd(make_row: Callable[..., Row]) -> None:
    rows = [make_row(repeat=r, output_tokens_per_s=38.0 + r) for r in range(3)]
    rows += [
        make_row(baseline="PD-one-band", repeat=r, output_tokens_per_s=20.0 + r) for r in range(3)
    ]
    assert validate_rows(rows, required_baselines=("PD", "PD-one-band")) == []
    ev = evaluate(rows, required_baselines=("PD", "PD-one-band"))
    # PD's median is PD's own rows only (38, 39, 40), not the ablation's
    assert ev["ordering"][0]["tokens_per_s"]["PD"] == 39.0
    assert ev["ordering"][0]["tokens_per_s"]["PD-one-band"] == 21.0
    (entry,) = ablation_table(rows)
    assert entry["output_tokens_per_s"]["verdict"] == "PD"
    # route-ahead coverage from PD-no-route-ahead is vacuous
    bad = make_row(baseline="PD-no-route-ahead")
    problems = validate_rows([bad], required_baselines=())
    assert any("PD-no-route-ahead, which predicts nothing" in p for p in problems)


def test_report_intervals_and_verdicts_hand_checked(matrix_rows: Callable[..., list[Row]]) -> None:
    # PD 30, 34, 38 (mean 34, sd 4): 34 ± 4.302652730 * 4 / sqrt(3) = [24.0634, 43.9366]
    rows = matrix_rows(concurrency=(1,), repeats=3)
    for row in rows:
        if row["baseline"] == "PD":
            row["output_tokens_per_s"] = (30.0, 34.0, 38.0)[row["repeat"]]
    ev = evaluate(rows)
    (pd,) = [e for e in ev["intervals"] if e["baseline"] == "PD"]
    tps = pd["output_tokens_per_s"]
    assert tps["median"] == 34.0 and tps["n"] == 3 and tps["method"] == "t"
    assert tps["low"] == pytest.approx(24.0634, abs=1e-4)
    assert tps["high"] == pytest.approx(43.9366, abs=1e-4)
    verdicts = {v["b"]: v["verdict"] for v in ev["verdicts"]}
    # B1 20 (zero spread) lies below 24.06: PD; B2 25 lies inside: within noise;
    # B3 40 lies inside: within noise
    assert verdicts == {"B0": "PD", "B1": "PD", "B2": "within noise", "B3": "within noise"}
    beats_b2 = next(t for t in ev["targets"] if t["target"].startswith("PD beats B2"))
    assert beats_b2["met"] is False and beats_b2["verdict"] == "within noise"
    assert beats_b2["value"] == pytest.approx(34 / 25)
    assert "within noise" in beats_b2["why"]
    beats_b1 = next(t for t in ev["targets"] if t["target"].startswith("PD beats B1"))
    assert beats_b1["met"] is True
    # the measured noise: every other cell has zero spread; PD's is 9.9366 / 34
    assert ev["noise"]["cells"] == 5
    assert ev["noise"]["max"] == pytest.approx(T2 * 4 / 3**0.5 / 34)
    assert ev["noise"]["median"] == 0.0


def test_one_repeat_calls_nothing(matrix_rows: Callable[..., list[Row]]) -> None:
    ev = evaluate(matrix_rows(concurrency=(1,)))
    assert all(v["verdict"] is None and "one repeat" in v["reason"] for v in ev["verdicts"])
    beats = [t for t in ev["targets"] if t["target"].startswith("PD beats")]
    assert beats and all(t["met"] is None and t["value"] is None for t in beats)
    assert ev["noise"]["median"] is None and ev["verdict"]["label"] == "NO-GO"


def test_report_leads_with_eta_phys_and_states_the_floor(
    matrix_rows: Callable[..., list[Row]], tmp_path: Path
) -> None:
    from pdflash.report import write_report

    rows = matrix_rows(concurrency=(1,), repeats=3)
    for row in rows:
        row["eta_phys"] = 0.5 + 0.1 * row["repeat"]
        row["eta_phys_definition"] = "max(miss floor, compute floor) / wall; floor = B3's time"
    ev = write_report(rows, tmp_path, plots=False)
    (pd,) = [e for e in ev["eta_phys"]["per_point"] if e["baseline"] == "PD"]
    # 0.5, 0.6, 0.7: median 0.6, sd 0.1
    assert pd["eta_phys"] == pytest.approx(0.6)
    assert pd["eta_phys_low"] == pytest.approx(0.6 - T2 * 0.1 / 3**0.5)
    assert pd["eta"] == 0.95
    assert ev["eta_phys"]["compute_floor"] == [
        "max(miss floor, compute floor) / wall; floor = B3's time"
    ]
    md = (tmp_path / "report.md").read_text()
    lead = md.index("## Distance to the physical limit: eta_phys")
    assert lead < md.index("## Tokens/s per baseline") and lead < md.index("## Targets")
    assert "Compute floor used: max(miss floor, compute floor) / wall; floor = B3's time" in md
    assert "acceptance forced τ=4" in md and "| inputs |" in md


def test_eta_phys_takes_b3s_compute_as_the_floor_where_b3_ran(
    matrix_rows: Callable[..., list[Row]],
) -> None:
    rows = matrix_rows(concurrency=(1,), repeats=3)
    for row in rows:
        row["eta_phys"] = 0.99  # the row's own floor: ignored once B3 ran at the point
        row["miss_floor_s"] = 0.2
        row["wall_s"] = 2.0 + row["repeat"]
        if row["baseline"] == "B3":
            row["compute_busy_s"] = 0.5 + 0.1 * row["repeat"]  # median 0.6
    ev = evaluate(rows)
    (pd,) = [e for e in ev["eta_phys"]["per_point"] if e["baseline"] == "PD"]
    # max(0.2, 0.6) / wall for walls 2, 3, 4: median 0.6 / 3
    assert pd["eta_phys"] == pytest.approx(0.2)
    assert pd["compute_floor_source"] == "B3"
    assert ev["eta_phys"]["compute_floor"] == [B3_COMPUTE_FLOOR]
    # without B3 at the point the rows' own eta_phys stands, with their definition
    no_b3 = [r for r in rows if r["baseline"] != "B3"]
    for row in no_b3:
        row["eta_phys_definition"] = "own floor"
    ev = evaluate(no_b3)
    (pd,) = [e for e in ev["eta_phys"]["per_point"] if e["baseline"] == "PD"]
    assert pd["eta_phys"] == pytest.approx(0.99) and pd["compute_floor_source"] == "row"
    assert ev["eta_phys"]["compute_floor"] == ["own floor"]


def test_matrix_repeats_default_and_interleaving() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    matrix.add_arguments(parser)
    args = parser.parse_args(["--baselines", "B1,B3,PD", "--cache-fraction", "0.2,0.5"])
    args.device = "cuda"
    assert matrix.resolved_repeats(args) == matrix.GPU_REPEATS >= 3
    specs = matrix.plan(args)
    first = [s for s in specs if s["cache_fraction"] in (0.2, 1.0) and s["concurrency"] == 1]
    # interleaved and rotated: B3 repeated like the rest
    assert [(s["repeat"], s["baseline"]) for s in first] == [
        (0, "B1"),
        (0, "B3"),
        (0, "PD"),
        (1, "B3"),
        (1, "PD"),
        (1, "B1"),
        (2, "PD"),
        (2, "B1"),
        (2, "B3"),
    ]
    args.device = "cpu"
    assert matrix.resolved_repeats(args) == matrix.CPU_REPEATS


def test_default_workload_makes_the_scheduler_decide() -> None:
    import argparse

    from pdflash.bench.suites import default

    parser = argparse.ArgumentParser()
    default.add_arguments(parser)
    specs = default.default_specs(parser.parse_args([]), on_gpu=False)
    assert {s["baseline"] for s in specs} == {"B0", "B1", "B2", "B3", "PD"}
    for spec in specs:
        block, conc = spec["block_size"], spec["concurrency"]
        # the token budget (engine default: concurrency x block) takes half the live requests
        assert spec["max_running"] == 2 * conc > (conc * block) // block
        assert spec["num_requests"] > spec["max_running"] // 2
        assert spec["byte_budget_from"] == "verify"
        # M = link x verify compute: at 10 MB/s and a verify of <= 10 ms, M <= 100 KB,
        # about one step's missing experts of the tiny model (16 experts of 6 KB)
        assert spec["emulated_link_gbps"] == default.CPU_EMULATED_LINK_GBPS == 0.01


def test_a_truncation_is_its_own_point(make_row: Callable[..., Row]) -> None:
    full, cut = make_row(layers=24), make_row(layers=8)
    assert row_key(full) != row_key(cut)
    assert validate_rows([full, cut], required_baselines=("PD",)) == []
    assert [p[0] for p in comparison_points([full, cut])] == ["tiny L24", "tiny L8"]
    assert comparison_points([make_row()])[0][0] == "tiny"  # rows without a depth


def test_controller_table_reports_the_pd_controllers_decisions() -> None:
    from pdflash.report.ablation import controller_markdown, controller_table

    from .conftest import base_row

    def books(policy: str, on: dict[str, float], switches: int, why: str | None) -> dict[str, Any]:
        decisions = [{"part": "route_ahead", "switched": True, "why": why}] if why else []
        return {"policy": policy, "on_fraction": on, "switches": switches, "decisions": decisions}

    rows = [
        base_row(
            repeat=0,
            pd_parts=books(
                "ab-windows",
                {"stream": 0.2, "route_ahead": 0.3, "scheduler_2d": 1.0},
                1,
                "switched off (costs more than it saves)",
            ),
        ),
        base_row(
            repeat=1,
            pd_parts=books(
                "ab-windows", {"stream": 0.6, "route_ahead": 0.9, "scheduler_2d": 0.8}, 0, None
            ),
        ),
        base_row(
            repeat=2,
            pd_parts=books(
                "ab-windows", {"stream": 1.0, "route_ahead": 1.0, "scheduler_2d": 0.9}, 0, None
            ),
        ),
        base_row(
            baseline="PD-all-on",
            pd_parts=books(
                "fixed", {"stream": 1.0, "route_ahead": 1.0, "scheduler_2d": 1.0}, 0, None
            ),
        ),
        base_row(baseline="B1"),  # no books: not listed
    ]
    table = controller_table(rows)
    by = {e["baseline"]: e for e in table}
    assert set(by) == {"PD", "PD-all-on"}
    pd = by["PD"]
    assert pd["runs"] == 3 and pd["policy"] == "ab-windows"
    # medians of (0.2, 0.6, 1.0), (0.3, 0.9, 1.0), (1.0, 0.8, 0.9)
    assert pd["on_fraction_median"] == pytest.approx(
        {"stream": 0.6, "route_ahead": 0.9, "scheduler_2d": 0.9}
    )
    assert pd["switches_per_run"] == [1, 0, 0]
    assert pd["first_switch_why"] == "route_ahead: switched off (costs more than it saves)"
    assert (
        by["PD-all-on"]["switches_per_run"] == [0] and by["PD-all-on"]["first_switch_why"] is None
    )
    md = controller_markdown(table)
    assert "| PD | ab-windows | 3 | 0.60 | 0.90 | 0.90 | 1,0,0 |" in md
    # and the report carries it
    assert evaluate(rows, required_baselines=["PD"])["controller"] == table


def test_ablation_reads_the_matrixs_point_and_output_options(tmp_path: Path) -> None:
    """The ablation suite takes the matrix's point and output options (its
    own defaults), its dry run counts what the matrix would not rerun, and
    its labels are pdflash.labels' (one list for the engine, the schema, the
    plots and the suite)."""
    import argparse

    from pdflash.bench.suites import ablation

    from pdflash import labels
    from pdflash.engine import config
    from pdflash.report import plots, schema

    parsers = {}
    for name, suite in (("matrix", matrix), ("ablation", ablation)):
        parsers[name] = argparse.ArgumentParser()
        suite.add_arguments(parsers[name])
    m = parsers["matrix"].parse_args([])
    a = parsers["ablation"].parse_args([])
    assert (m.concurrency, m.cache_fraction) == ([1, 4], [0.2, 0.5, 0.8])
    assert (a.concurrency, a.cache_fraction) == ([4], [0.2])
    for ns in (m, a):
        assert (ns.arch, ns.block_sizes, ns.out, ns.budget_s) == (["tiny"], [16], None, None)
        assert not (ns.no_report or ns.dry_run or ns.no_progress)
    argv = ["--arch", "tiny-mixtral", "--block-sizes", "8", "--concurrency", "2,3"]
    argv += ["--cache-fraction", "0.5", "--out", str(tmp_path), "--budget-s", "9"]
    argv += ["--no-report", "--dry-run", "--no-progress"]
    for name in ("matrix", "ablation"):
        ns = parsers[name].parse_args(argv)
        assert (ns.arch, ns.block_sizes, ns.concurrency, ns.cache_fraction) == (
            ["tiny-mixtral"],
            [8],
            [2, 3],
            [0.5],
        )
        assert (ns.out, ns.budget_s, ns.no_report, ns.dry_run, ns.no_progress) == (
            tmp_path,
            9.0,
            True,
            True,
            True,
        )

    # the dry run: specs whose rows are recorded are not run again
    a = parsers["ablation"].parse_args(["--out", str(tmp_path), "--dry-run", "--repeats", "1"])
    specs = ablation.plan(a)
    assert matrix.unrecorded(specs, tmp_path / matrix.ROWS_FILE) == specs
    assert matrix.load_result_rows(tmp_path) == []
    recorded = {"spec": specs[0], "baseline": specs[0]["baseline"]}
    (tmp_path / matrix.ROWS_FILE).write_text(json.dumps(recorded) + "\n")
    assert matrix.unrecorded(specs, tmp_path / matrix.ROWS_FILE) == specs[1:]
    dry = ablation.run(a)
    assert (dry["planned"], dry["already_recorded"], dry["to_run"]) == (7, 1, 6)

    # every invocation is appended to commands.txt, stamped
    matrix.log_command(tmp_path, "first")
    matrix.log_command(tmp_path, "second")
    lines = (tmp_path / "commands.txt").read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == ["first", "second"]

    assert ablation.VARIANTS is config.ABLATIONS is schema.ABLATIONS is labels.ABLATIONS
    assert config.BASELINES is schema.BASELINES is labels.BASELINES
    assert sorted(plots.PLOT_ORDER) == sorted(schema.ROW_LABELS)
    assert (plots.PLOT_ORDER[0], plots.PLOT_ORDER[-1]) == ("B0", "B3")
