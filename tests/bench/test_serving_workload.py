"""Serving workloads through the bench contract: arrivals, engine limits, the
byte budget derived from the verify step, and the 2-D vs token-only record."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pdflash.bench.engine_run import RunSpec, run_spec

from pdflash.engine.batching import BatchDecision, DeficitBatcher, ShadowComparison, VerifyDemand
from pdflash.report.schema import validate_row


def test_poisson_run_admits_by_arrival_and_reports_serving_latency(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    spec = RunSpec(
        arch="tiny",
        layers=2,
        baseline="PD",
        concurrency=4,
        cache_fraction=0.3,
        arrivals="poisson",
        rate_per_s=50.0,
        num_requests=10,
        prompt_len=8,
        prompt_len_max=16,
        max_new_tokens=6,
        max_new_tokens_max=20,
        max_running=6,
        token_budget=12,  # block 16: fewer tokens than one request's block
        block_size=16,
        byte_budget_from="verify",
        emulated_link_gbps=0.05,
        verify_width="adaptive",  # F follows its step-time fit (a full width keeps none)
    )
    result = run_spec(spec)
    row = result.row
    assert validate_row(row) == []
    assert row["max_running"] == 6 and row["token_budget"] == 12
    assert row["workload"]["arrivals"] == "poisson"
    assert row["workload"]["output_len"] == "uniform [6, 20]"
    # the verify-derived M: measured link bytes/s x measured verify compute s
    verify_s = row["byte_budget_verify_compute_s"]
    assert verify_s > 0 and row["byte_budget_from"] == "verify"
    assert row["byte_budget"] == max(1, int(row["link_gbps_measured"] * 1e9 * verify_s))
    # the marginal rule (on by default): F = link bytes/s x the calibration's
    # compute per step, at least the verify's
    assert row["marginal_rule"] == "verify"
    step_s = row["fixed_step_compute_s"]
    assert step_s >= verify_s
    assert row["fixed_step_bytes"] == int(row["link_gbps_measured"] * 1e9 * step_s)
    # then F follows the adaptive width's step-time fit once it is identified
    book = row["fixed_step_fit"]
    assert book["followed"] and book["calibration_bytes"] == row["fixed_step_bytes"]
    if row["fixed_step_bytes_source"] == "online_fit":
        assert book["fitted_steps"] > 0 and book["t_fixed_s"] > 0
        fitted = int(row["link_gbps_measured"] * 1e9 * book["t_fixed_s"])
        assert 0 <= row["fixed_step_bytes_final"] <= fitted
    else:
        assert row["fixed_step_bytes_source"] == "calibration"
        assert book["fitted_steps"] == 0 and sum(book["kept"].values()) > 0
        assert row["fixed_step_bytes_final"] == row["fixed_step_bytes"]
    # every request finished with its planned length, admitted after arriving
    outs = [r["output_tokens"] for r in result.requests]
    assert len(outs) == 10 and all(6 <= n <= 20 for n in outs)
    assert all(r["queue_delay_s"] >= 0 for r in result.requests)
    assert row["tpot_p50_s"] > 0 and row["tpot_p99_s"] >= row["tpot_p50_s"]
    assert row["queue_delay_p99_s"] >= row["queue_delay_p50_s"] >= 0
    assert 0.0 <= row["token_only_differing_step_fraction"] <= 1.0
    assert row["batch_missing_bytes_2d"] >= 0


def test_closed_loop_run_sends_exactly_num_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    spec = RunSpec(
        arch="tiny",
        layers=2,
        baseline="B1",
        concurrency=2,
        arrivals="closed",
        users=2,
        think_s=0.001,
        num_requests=5,
        prompt_len=6,
        max_new_tokens=4,
    )
    result = run_spec(spec)
    assert validate_row(result.row) == []
    assert len(result.requests) == 5
    assert all(r["output_tokens"] == 4 for r in result.requests)
    assert result.row["not_measured"]["token_only_differing_step_fraction"].startswith(
        "baseline B1"
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"arrivals": "poisson"}, "rate_per_s"),
        ({"arrivals": "closed"}, "users"),
        ({"arrivals": "uniform"}, "arrivals"),
        ({"max_new_tokens_max": 1}, "max_new_tokens_max"),
        ({"max_running": 0}, "max_running"),
        ({"byte_budget_from": "guess"}, "byte_budget_from"),
        ({"think_s": -1.0}, "think_s"),
    ],
)
def test_bad_serving_specs_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RunSpec(arch="tiny", baseline="PD", **kwargs).validate()  # type: ignore[arg-type]


def _deficit(
    byte_budget: int | None,
    kind: type[DeficitBatcher] = DeficitBatcher,
    grant_uncontended: bool = True,
) -> DeficitBatcher:
    return kind(
        token_budget=32,
        byte_budget=byte_budget,
        num_layers=1,
        num_experts=8,
        expert_nbytes=100,
        grant_uncontended=grant_uncontended,
    )


def test_shadow_comparison_counts_steps_where_the_byte_budget_changed_the_batch() -> None:
    # two requests with disjoint predicted experts, 300 bytes each: M = 400
    # lets the 2-D scheduler take one of them per step, the token-only both
    shadow = ShadowComparison(_deficit(400), _deficit(None), expert_nbytes=100)
    for rid in (1, 2):
        shadow.add(rid)
    demands = [
        VerifyDemand(1, 4, np.array([0, 1, 2], dtype=np.int64)),
        VerifyDemand(2, 4, np.array([3, 4, 5], dtype=np.int64)),
    ]
    decision = shadow.select(demands, np.zeros((1, 8), dtype=np.bool_))
    assert len(decision.grants) == 1
    assert shadow.steps == 1 and shadow.differing_steps == 1
    assert shadow.primary_missing_bytes == 300
    assert shadow.shadow_missing_bytes == 600
    # resident experts are not missing: nothing left to separate them
    resident = np.zeros((1, 8), dtype=np.bool_)
    resident[0, :6] = True
    decision = shadow.select(demands, resident)
    assert len(decision.grants) == 2
    assert shadow.steps == 2 and shadow.differing_steps == 1
    assert shadow.primary_missing_bytes == 300


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("byte_budget", [250, None])
def test_the_resident_set_is_sent_only_while_a_pending_demand_names_predicted_experts(
    seed: int, byte_budget: int | None
) -> None:
    """Differential: a batcher that skips the resident set while no pending
    demand names a predicted expert chooses exactly what one that always
    sends it chooses (grants and missing union), over steps with and
    without predictions, a changing resident set and requests whose
    earlier, ungranted demand (with predictions) stays pending without a
    new one; the skip happens."""

    class AlwaysResident(DeficitBatcher):
        def select(self, demands: list[VerifyDemand], resident: np.ndarray | None) -> BatchDecision:
            for d in demands:  # None: a demand that names no expert
                self.scheduler.update_demand(d.request_id, d.tokens - 1, d.predicted)
            if resident is not None:
                self.scheduler.set_resident(resident)
            result = self.scheduler.step()
            grants = list(
                zip(result.request_ids.tolist(), result.token_grants.tolist(), strict=True)
            )
            return BatchDecision(grants=grants, missing=np.array(result.union_ids, np.int64))

    rng = np.random.default_rng(seed)
    # both consult the scheduler every step (tests/engine/test_batching_uncontended.py
    # checks the steps granted without it)
    lean = _deficit(byte_budget, grant_uncontended=False)
    full = _deficit(byte_budget, AlwaysResident, grant_uncontended=False)
    sent = 0
    set_resident = lean.scheduler.set_resident

    def counting(experts: np.ndarray) -> None:
        nonlocal sent
        sent += 1
        set_resident(experts)

    lean.scheduler.set_resident = counting  # type: ignore[method-assign]
    for rid in range(4):
        lean.add(rid)
        full.add(rid)
    with_predictions = 0
    for _ in range(60):
        predicting = bool(rng.random() < 0.5)
        demands = [
            VerifyDemand(
                rid,
                int(rng.integers(1, 17)),
                rng.choice(8, size=int(rng.integers(1, 5)), replace=False).astype(np.int64)
                if predicting
                else None,
            )
            for rid in range(4)
            if rng.random() < 0.8
        ]
        if any(d.predicted is not None for d in demands):
            with_predictions += 1
        resident = rng.random((1, 8)) < 0.4
        a, b = lean.select(demands, resident), full.select(demands, resident)
        assert a.grants == b.grants
        assert a.missing.tolist() == b.missing.tolist()
    # sent on every step with predictions, and on some without (an older
    # demand with predictions still pending), never on all
    assert 0 < with_predictions <= sent < 60


def test_set_byte_budget_only_between_workloads() -> None:
    b = _deficit(1000)
    b.set_byte_budget(200)
    assert b.byte_budget == 200
    b.add(7)
    with pytest.raises(RuntimeError, match="live requests"):
        b.set_byte_budget(300)
    b.remove(7)
    b.set_byte_budget(300)
    assert b.byte_budget == 300
    with pytest.raises(ValueError, match="token-only"):
        _deficit(None).set_byte_budget(10)


@pytest.mark.parametrize("marginal_rule", ["off", "verify"])
def test_an_explicit_m_with_and_without_the_marginal_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, marginal_rule: str
) -> None:
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="marginal_rule must be off or verify"):
        RunSpec(arch="tiny", baseline="PD", marginal_rule="on").validate()
    row = run_spec(
        RunSpec(
            arch="tiny",
            layers=2,
            baseline="PD",
            concurrency=2,
            num_requests=3,
            prompt_len=6,
            max_new_tokens=4,
            byte_budget=40_000,
            marginal_rule=marginal_rule,
            emulated_link_gbps=0.05,
        )
    ).row
    assert validate_row(row) == []
    assert row["byte_budget"] == 40_000  # an explicit M stays as given
    assert row["marginal_rule"] == marginal_rule
    if marginal_rule == "off":
        assert row["fixed_step_bytes"] is None
        assert row["not_measured"]["fixed_step_bytes"].startswith("marginal rule off")
        assert row["fixed_step_bytes_final"] is None and row["fixed_step_bytes_source"] is None
    else:  # F calibrated even though M is given
        assert row["fixed_step_bytes"] > 0 and row["fixed_step_compute_s"] > 0
        assert "byte_budget_verify_compute_s" not in row or (
            row["byte_budget_verify_compute_s"] is None
        )
