"""Evaluation with hand-computed expectations.

The fixture matrix has tokens/s B0 10c, B1 20c, B2 25c, PD 38c, B3 40c at
concurrency c, so PD closes (38 − 20)/(40 − 20) = 0.9 of the gap; PD's busy
times are link 0.5 s / compute 1.0 s (compute-bound), η = 0.95 and
bytes/token = 1000 vs Belady's 900 (ratio 1.111).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pdflash.report.evaluate import evaluate, gap_closed, hide_inequality

Row = dict[str, Any]


def _set(rows: list[Row], baseline: str, **values: Any) -> list[Row]:
    for r in rows:
        if r["baseline"] == baseline:
            r.update(values)
    return rows


def _targets(ev: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [t for t in ev["targets"] if t["target"].startswith(name)]


def test_gap_closed_hand_computed() -> None:
    assert gap_closed(38.0, 20.0, 40.0) == (pytest.approx(0.9), "")
    assert gap_closed(20.0, 20.0, 40.0)[0] == 0.0
    value, reason = gap_closed(30.0, 40.0, 40.0)
    assert value is None and "no B1→B3 gap" in reason
    value, reason = gap_closed(None, 20.0, None)
    assert value is None and reason == "no tokens/s for PD, B3"


def test_good_matrix_is_go(matrix_rows: Callable[..., list[Row]]) -> None:
    ev = evaluate(matrix_rows(repeats=3))
    assert ev["valid"]
    assert ev["verdict"]["label"] == "GO", ev["verdict"]["reasons"]
    assert [o["holds"] for o in ev["ordering"]] == [True, True]
    assert ev["ordering"][1]["tokens_per_s"] == {
        "B0": 40.0,
        "B1": 80.0,
        "B2": 100.0,
        "B3": 160.0,
        "PD": 152.0,
    }
    (summary,) = ev["gap_by_cache_fraction"]
    assert summary["gap_closed_min"] == pytest.approx(0.9)
    (regime,) = ev["regime"]
    assert regime["bound"] == "compute"
    assert regime["link_to_compute_busy"] == pytest.approx(0.5)
    # Belady need: 90000 B / 1 GB/s = 9e-5 s over 1.0 s of compute
    assert regime["belady_link_to_compute"] == pytest.approx(9e-5)
    # 2 points x (eta, belady, beats B1, beats B2, gap)
    assert len(ev["targets"]) == 10 and all(t["met"] for t in ev["targets"])
    belady = _targets(ev, "PD bytes/token")
    assert belady[0]["value"] == pytest.approx(1000 / 900)
    beats_b2 = _targets(ev, "PD beats B2")
    assert beats_b2[0]["value"] == pytest.approx(38 / 25)


def test_misses_are_reported_with_their_size(matrix_rows: Callable[..., list[Row]]) -> None:
    rows = matrix_rows(repeats=3)
    for r in rows:
        if r["baseline"] == "PD":
            r["output_tokens_per_s"] = 22.0 * r["concurrency"]  # above B1, below B2
            r["eta"] = 0.75
            r["bytes_per_token_vs_belady"] = 1.5
    ev = evaluate(rows)
    assert ev["verdict"]["label"] == "NO-GO"
    eta = _targets(ev, "PD eta")[0]
    assert (eta["met"], eta["miss"]) == (False, pytest.approx(0.15))
    bel = _targets(ev, "PD bytes/token")[0]
    assert (bel["met"], bel["miss"]) == (False, pytest.approx(0.2))
    b1 = _targets(ev, "PD beats B1")[0]
    assert b1["met"] and b1["value"] == pytest.approx(1.1)
    b2 = _targets(ev, "PD beats B2")[0]
    # 22/25 = 0.88: missed by 0.12
    assert (b2["met"], b2["miss"]) == (False, pytest.approx(0.12))
    gap = _targets(ev, "PD closes")[0]
    # (22 − 20)/(40 − 20) = 0.1, 0.8 short of 0.9
    assert gap["value"] == pytest.approx(0.1) and gap["miss"] == pytest.approx(0.8)
    reasons = " ".join(ev["verdict"]["reasons"])
    assert (
        "'PD beats B2 (tokens/s, 95% intervals separate)' missed at tiny/blk16/c1/cf0.2: 0.88"
        in reasons
    )
    assert "missed by 0.15" in reasons
    # each miss says why, from the measured figures at that point
    assert "Why: PD wall 1.05 s: compute busy 1 s, link busy 0.5 s; 0.05 s of the wall" in reasons
    # no forward timings in these rows: where the uncovered time went is n/a
    assert "n/a outside forwards" in reasons
    assert "Why: tokens/s PD 22 vs B2 25; exposed fetch PD 0.01 s vs 0.01 s" in reasons
    broken = ev["ordering"][0]["checks"]
    assert [c["holds"] for c in broken] == [True, True, False, True]


def test_gap_target_does_not_apply_when_link_bound(matrix_rows: Callable[..., list[Row]]) -> None:
    rows = _set(matrix_rows(repeats=3), "PD", link_busy_s=2.0, compute_busy_s=1.0)
    for r in rows:
        if r["baseline"] == "PD":
            r["output_tokens_per_s"] = 26.0 * r["concurrency"]  # gap 0.3
    ev = evaluate(rows)
    assert ev["regime"][0]["bound"] == "link"
    gap = _targets(ev, "PD closes")
    assert all(g["applies"] is False and g["met"] is None for g in gap)
    assert gap[0]["value"] == pytest.approx(0.3)  # still reported
    assert ev["verdict"]["label"] == "GO", ev["verdict"]["reasons"]


def test_unmeasured_target_is_no_go_with_reason(matrix_rows: Callable[..., list[Row]]) -> None:
    rows = _set(matrix_rows(), "PD", eta=None, not_measured={"eta": "no CUDA events on CPU"})
    ev = evaluate(rows)
    assert ev["valid"]
    assert ev["verdict"]["label"] == "NO-GO"
    assert any(
        "cannot judge 'PD eta >= 0.9' at tiny/blk16/c1/cf0.2: no CUDA events on CPU" in r
        for r in ev["verdict"]["reasons"]
    )


def test_invalid_rows_are_no_go(matrix_rows: Callable[..., list[Row]]) -> None:
    rows = [r for r in matrix_rows() if r["baseline"] != "B2"]
    ev = evaluate(rows)
    assert not ev["valid"]
    assert ev["verdict"]["label"] == "NO-GO"
    assert ev["verdict"]["reasons"][0].startswith("invalid input: 2 validation problem(s)")


def test_repeats_use_the_median(matrix_rows: Callable[..., list[Row]]) -> None:
    rows = matrix_rows(concurrency=(1,))
    pd = next(r for r in rows if r["baseline"] == "PD")
    rows += [
        dict(pd, repeat=1, output_tokens_per_s=30.0),
        dict(pd, repeat=2, output_tokens_per_s=34.0),
    ]
    ev = evaluate(rows)
    assert ev["ordering"][0]["tokens_per_s"]["PD"] == 34.0  # median of 38, 30, 34
    assert ev["gap"][0]["gap_closed"] == pytest.approx((34 - 20) / 20)


def test_pairs_call_a_steady_loss_the_repeats_spread_hides(
    matrix_rows: Callable[..., list[Row]],
) -> None:
    """PD 5% below B1 in each of three interleaved repeats whose levels
    spread 20%: the two tokens/s intervals overlap ("within noise"), the
    pairs' interval lies below 1, so by the pairs B1 is faster; the markdown
    shows both."""
    from pdflash.report.writers import lead_sections

    rows = matrix_rows(concurrency=(1,))
    pd = next(r for r in rows if r["baseline"] == "PD")
    b1 = next(r for r in rows if r["baseline"] == "B1")
    b1_tps = [30.0, 36.0, 33.0]
    rows = [r for r in rows if r["baseline"] not in ("PD", "B1")]
    for k, tps in enumerate(b1_tps):
        rows += [
            dict(b1, repeat=k, output_tokens_per_s=tps),
            dict(pd, repeat=k, output_tokens_per_s=0.95 * tps),
        ]
    ev = evaluate(rows)
    (v,) = [v for v in ev["verdicts"] if (v["a"], v["b"]) == ("PD", "B1")]
    assert v["verdict"] == "within noise"
    pairs = v["pairs"]
    assert pairs["repeats"] == [0, 1, 2] and pairs["n"] == 3
    assert pairs["ratios"] == pytest.approx([0.95] * 3)
    assert pairs["verdict"] == "B1"
    assert pairs["high"] < 1
    md = "\n".join(lead_sections(ev))
    assert "| B1 faster | 0.95 [0.95, 0.95] (n=3) |" in md
    # one repeat pairs nothing: not called, with the reason
    (single,) = [v for v in evaluate(matrix_rows(concurrency=(1,)))["verdicts"] if v["b"] == "B1"]
    assert single["pairs"]["verdict"] is None and "nothing to pair" in single["pairs"]["reason"]


def test_ablation_pairs_see_what_a_part_costs_inside_the_spread(
    matrix_rows: Callable[..., list[Row]],
) -> None:
    """PD 4% faster than PD-no-stream in every repeat, bytes per token 10%
    fewer: the intervals overlap, the pairs call PD better on both (fewer
    bytes is better), and the markdown's last column says so."""
    from pdflash.report.ablation import ablation_markdown, ablation_table

    rows = matrix_rows(concurrency=(1,))
    pd = next(r for r in rows if r["baseline"] == "PD")
    rows = [r for r in rows if r["baseline"] != "PD"]
    for k, tps in enumerate([30.0, 36.0, 33.0]):
        rows += [
            dict(pd, repeat=k, output_tokens_per_s=1.04 * tps, bytes_per_token=0.9e6 * (k + 1)),
            dict(
                pd,
                baseline="PD-no-stream",
                repeat=k,
                output_tokens_per_s=tps,
                bytes_per_token=1e6 * (k + 1),
            ),
        ]
    (entry,) = ablation_table(rows)
    tps = entry["output_tokens_per_s"]
    assert tps["verdict"] == "within noise"
    assert tps["pairs"]["ratios"] == pytest.approx([1.04] * 3)
    assert tps["pairs"]["verdict"] == "PD"
    assert entry["bytes_per_token"]["pairs"]["verdict"] == "PD"  # fewer bytes: PD better
    assert "1.04 [1.04, 1.04] (n=3): PD better |" in ablation_markdown([entry])


def test_b3_is_shared_across_cache_fractions(matrix_rows: Callable[..., list[Row]]) -> None:
    rows = matrix_rows(concurrency=(4,), fractions=(0.2, 0.8))
    assert sum(r["baseline"] == "B3" for r in rows) == 1
    ev = evaluate(rows)
    assert ev["valid"], ev["problems"]
    assert [o["tokens_per_s"]["B3"] for o in ev["ordering"]] == [160.0, 160.0]
    assert [g["cache_fraction"] for g in ev["gap_by_cache_fraction"]] == [0.2, 0.8]


def test_hide_inequality_hand_computed(make_row: Callable[..., Row]) -> None:
    row = make_row(draft_busy_s=0.3, router_busy_s=0.1, verify_overlap_window_s=0.2)
    h = hide_inequality(row)
    # fetch = (1 − 0.5) · 200000 B / (1 GB/s) = 1e-4 s; window = 0.6 s
    assert h["fetch_s"] == pytest.approx(1e-4)
    assert h["window_s"] == pytest.approx(0.6)
    assert h["margin_s"] == pytest.approx(0.6 - 1e-4)
    assert h["holds"] is True
    tight = hide_inequality(
        make_row(draft_busy_s=0.0, router_busy_s=0.0, verify_overlap_window_s=5e-5)
    )
    assert tight["holds"] is False and tight["margin_s"] == pytest.approx(-5e-5)


def test_hide_inequality_names_unmeasured_terms(make_row: Callable[..., Row]) -> None:
    h = hide_inequality(make_row(expert_cache_hit_rate=None))
    assert h["fetch_s"] is None and h["holds"] is None
    assert h["not_measured"]["fetch_s"] == "unmeasured term(s): hit_rate"
    assert h["not_measured"]["window_s"] == (
        "unmeasured term(s): draft_busy_s, router_busy_s, verify_overlap_window_s"
    )


def test_b0_at_block_one_serves_every_block(matrix_rows: Callable[..., list[Row]]) -> None:
    # the engine may record B0 (autoregressive) with block_size 1
    rows = _set(matrix_rows(concurrency=(4,)), "B0", block_size=1, acceptance_length_mean=1.0)
    ev = evaluate(rows)
    assert ev["valid"], ev["problems"]
    assert [(o["block_size"], o["tokens_per_s"]["B0"]) for o in ev["ordering"]] == [(16, 40.0)]
    assert ev["ordering"][0]["holds"] is True


def test_hide_inequality_from_engine_timings(make_row: Callable[..., Row]) -> None:
    # the engine's names: draft_s, predict_s, verify_s; overlap = verify − stall
    row = make_row(draft_s=0.2, predict_s=0.05, verify_s=0.5, exposed_fetch_s=0.1)
    h = hide_inequality(row)
    assert h["terms"]["verify_overlap_window_s"] == pytest.approx(0.4)
    assert h["overlap_source"] == "verify_s - exposed_fetch_s"
    assert h["window_s"] == pytest.approx(0.65)
    assert h["margin_s"] == pytest.approx(0.65 - 1e-4)


def test_eta_miss_splits_uncovered_time_hand_computed(
    matrix_rows: Callable[..., list[Row]],
) -> None:
    rows = _set(
        matrix_rows(),
        "PD",
        eta=0.8,
        wall_s=2.0,
        compute_busy_s=1.0,
        link_busy_s=1.6,
        exposed_fetch_s=0.5,
        prefill_s=0.25,
        draft_s=0.25,
        verify_s=1.25,
        router_pass_s=0.125,
    )
    ev = evaluate(rows)
    why = _targets(ev, "PD eta")[0]["why"]
    # 2 - max(1, 1.6) = 0.4 uncovered; 2 - (0.25 + 0.25 + 1.25 + 0.125) = 0.125
    # outside forwards; the link idle 2 - 1.6 = 0.4 s
    assert why == (
        "PD wall 2 s: compute busy 1 s, link busy 1.6 s; 0.4 s of the wall not covered "
        "by the busier resource; 0.125 s outside forwards (host work between forwards), "
        "and inside forwards the compute stream waited 0.5 s on copies while the link "
        "was idle 0.4 s of the wall"
    )


def test_pd_host_rows_are_optional_and_shown_where_present(
    matrix_rows: Callable[..., list[Row]], tmp_path: Any
) -> None:
    from pdflash.report.plots import concurrency_plot, money_plot
    from pdflash.report.schema import validate_rows

    rows = matrix_rows()
    assert validate_rows(rows) == []  # PD+host is not required
    pd = [r for r in rows if r["baseline"] == "PD"]
    extra = [
        {**r, "baseline": "PD+host", "output_tokens_per_s": 2 * r["output_tokens_per_s"]}
        for r in pd
    ]
    both = rows + extra
    assert validate_rows(both) == []
    ev = evaluate(both)
    assert ev["ordering"][1]["tokens_per_s"]["PD+host"] == 304.0
    assert "PD+host" not in evaluate(rows)["ordering"][1]["tokens_per_s"]
    for plot in (money_plot, concurrency_plot):
        out = plot(both, tmp_path / f"{plot.__name__}.png")
        assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
