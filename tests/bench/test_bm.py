"""BM suite: dispatch, absent-with-reason on CPU, the overlap arithmetic."""

from __future__ import annotations

import json

import pytest
from pdflash.bench import cli
from pdflash.bench.suites import bm


def test_interval_overlap_hand_computed() -> None:
    copies = [(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]  # union [0, 2] + [3, 4]
    compute = [(1.5, 3.5)]
    # both busy: [1.5, 2.0] and [3.0, 3.5]
    assert bm.interval_overlap(copies, compute) == pytest.approx(1.0)
    assert bm.interval_overlap(compute, copies) == pytest.approx(1.0)
    assert bm.interval_overlap([(0.0, 1.0)], [(1.0, 2.0)]) == 0.0
    assert bm.interval_overlap([], compute) == 0.0


def test_bm_needs_a_routine(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bm"])
    assert exc.value.code == 2
    assert "--routine" in capsys.readouterr().err


def test_bm4_on_cpu_is_absent_with_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bm4", "--device", "cpu", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["routine"] == "bm4" and result["measured"] is False
    assert "CUDA" in result["reason"]
    assert not any(k.endswith("_s") or k.endswith("fraction") for k in result)
    assert captured.err.strip() == "BM4: NOT MEASURED — " + result["reason"]


def test_routine_option_and_subcommand_agree(capsys: pytest.CaptureFixture[str]) -> None:
    cli.main(["bm", "--routine", "bm4", "--device", "cpu", "--json"])
    a = json.loads(capsys.readouterr().out)
    cli.main(["bm4", "--device", "cpu", "--json"])
    b = json.loads(capsys.readouterr().out)
    assert a == b


def test_bm2_on_host_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bm2", "--device", "cpu", "--iters", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["measured"] is True and result["backend"] == "host"
    assert result["copies"] == 768
    assert result["issue_us_768"] > 0 and result["naive_issue_us_768"] > 0
    assert result["issue_speedup"] == pytest.approx(
        result["naive_issue_us_768"] / result["issue_us_768"]
    )
    assert result["pass"] == (result["issue_us_768"] <= 25.0)


def test_bm3_on_host_backend(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bm3", "--device", "cpu", "--iters", "4", "--on-demand-mib", "1"]
    assert cli.main([*argv, "--emulated-link-gbps", "1", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["measured"] is True and result["background_backlog_nbytes"] == 8 << 20
    # without bands the on-demand copy queues behind the 8 MiB backlog (8 ms at 1 GB/s)
    assert result["bands_off_under_load_us"] > result["on_demand_alone_us"]
    assert result["bands_on_slowdown"] == pytest.approx(
        result["bands_on_under_load_us"] / result["on_demand_alone_us"]
    )
    assert captured.err.startswith("BM3: PASS" if result["pass"] else "BM3: FAIL")


def test_bm1_tiny_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bm1", "--device", "cpu", "--iters", "3", "--block-size", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["measured"] is True and result["synthetic_preset"] == "tiny"
    assert result["block_size"] == 8
    assert result["router_pass_us"] > 0 and result["verify_forward_us"] > 0
    assert result["router_to_verify"] == pytest.approx(
        result["router_pass_us"] / result["verify_forward_us"]
    )
    assert result["pass"] == (result["router_to_verify"] < 1)


def test_bm5_native_matches_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bm5", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    part = result["parts"]["routeahead"]
    assert part["measured"] and part["counters_compared"] >= 2
    assert part["differing_counters"] == [] and result["pass"] is True
    sched = result["parts"]["scheduler"]
    assert sched["measured"] is True and sched["identical"] is True
    assert sched["items_scheduled"] > sched["steps"]  # batches of several requests
    assert 0 < part["coverage"] < 1  # the generated predictions are imperfect
    assert part["wasted_bytes"] > 0
    # acceptance has no native path: said so, not compared, not counted as a pass
    assert "no native path" in result["not_compared"]["acceptance"]


def test_bm5_reports_a_planted_difference(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pdflash._reference import routeahead as ref

    original = ref.RouteAheadReference.record_eviction

    def off_by_one(self: ref.RouteAheadReference, flat_ids: object) -> int:
        # drop the first evicted expert: the reference diverges on evictions
        import numpy as np

        return int(original(self, np.asarray(flat_ids)[1:]))

    monkeypatch.setattr(ref.RouteAheadReference, "record_eviction", off_by_one)
    cli.main(["bm5", "--json"])
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["pass"] is False
    assert captured.err.startswith("BM5: FAIL — routeahead DIFFERS")


def test_bm5_fails_when_a_token_grant_differs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The grants that cap acceptance are what BM5 compares for it: a
    reference that grants one token less somewhere fails the scheduler part."""
    import dataclasses

    from pdflash._reference import scheduler as ref

    original = ref.ReferenceScheduler.step

    def trim_one(self: ref.ReferenceScheduler) -> ref.ReferenceStep:
        out = original(self)
        grants = list(out.token_grants)
        for i, g in enumerate(grants):
            if g > 1:
                grants[i] = g - 1
                break
        return dataclasses.replace(out, token_grants=grants)

    monkeypatch.setattr(ref.ReferenceScheduler, "step", trim_one)
    cli.main(["bm5", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["pass"] is False
    assert result["parts"]["scheduler"]["identical"] is False
    assert result["parts"]["routeahead"]["identical"] is True
