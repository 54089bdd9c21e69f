"""The hybrid miss service in the engine and its rows (CPU, tiny models).

On the CPU the "host" and the "device" are one device, but HOST experts still
go through the host executor's pool; the planner is forced (or given a slow
assumed link) so the host really serves misses."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pdflash.bench.engine_run import RunSpec, _add_eta_phys, miss_floor_s, run_spec

from pdflash.engine.config import EngineConfig
from pdflash.hybrid.cost import HostCostModel
from pdflash.hybrid.kernels import onednn_available
from pdflash.report.schema import validate_row

from .test_engine_offloaded import MAX_NEW, _stack, offloaded_checkpoint


def test_pd_host_preset_and_config_checks() -> None:
    cfg = EngineConfig.preset("PD+host")
    pd = EngineConfig.preset("PD")
    assert cfg.host_experts == "auto" and pd.host_experts == "off"
    assert cfg.replace(host_experts="off", baseline="PD") == pd
    with pytest.raises(ValueError, match="host_experts"):
        EngineConfig(host_experts="always")
    with pytest.raises(ValueError, match="all_resident"):
        EngineConfig(host_experts="auto", all_resident=True)


def test_host_ahead_min_exposed_is_a_checked_share() -> None:
    from pdflash.engine.config import DEFAULT_HOST_AHEAD_MIN_EXPOSED

    assert EngineConfig.preset("PD+host").host_ahead_min_exposed == 0.2
    assert DEFAULT_HOST_AHEAD_MIN_EXPOSED == 0.2
    for share in (0, 0.0, 0.5, 1.0):
        assert (
            EngineConfig.preset("PD+host", host_ahead_min_exposed=share).host_ahead_min_exposed
            == share
        )
    for bad in (-0.1, 1.01, float("nan"), float("inf"), True, "0.2", None):
        with pytest.raises(ValueError, match="host_ahead_min_exposed must be a share"):
            EngineConfig(host_ahead_min_exposed=bad)  # type: ignore[arg-type]


def test_run_spec_builds_its_engine_config() -> None:
    """RunSpec.engine_config: the label's preset with the spec's settings
    resolved (PD+host's host mode, the ``auto`` width, the point's limits,
    the gate)."""
    spec = _spec("PD+host", host_ahead_min_exposed=0.0)
    assert spec.engine_config() == EngineConfig.preset(
        "PD+host",
        block_size=6,
        max_running=2,
        token_budget=12,
        host_experts="auto",
        host_ahead_min_exposed=0.0,
        cuda_graphs="off",
        verify_width="adaptive",
    )
    assert _spec("PD").engine_config().verify_width == "adaptive"
    assert _spec("PD-full-width").engine_config().verify_width == "full"
    assert _spec("B3", host_experts="auto").engine_config().host_experts == "off"
    limited = _spec("PD", max_running=1, token_budget=7).engine_config()
    assert (limited.max_running, limited.token_budget) == (1, 7)


@pytest.fixture(scope="module")
def gpt_oss_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    return offloaded_checkpoint(tmp_path_factory, "gpt_oss", (5, 8), seed=1)


def _cost_model_stack(
    tmp: Path,
    ahead: str = "certain",
    ahead_from: str = "predicted",
    min_exposed: float = 0.0,
    controller: Any = None,
    own_controller: bool = False,
    host_control: str = "controller",
    issuer_kw: dict[str, Any] | None = None,
) -> tuple[Any, Any, Any, Any]:
    """A PD+host engine with PD's parts pinned on (with the unthrottled host
    link here the PD controller may rightly switch the stream off, and these
    tests are about the stream's plan-ahead skips), a configured cost model
    and a slow assumed link (1 MB/s: one copy of a tiny expert ~13 ms vs the
    host's 0.1 ms), so the planner gives the host most misses, ahead of the
    verify as well: (engine, adapter, issuer, host service). The host issuer
    here is an unthrottled memcpy: by default (``min_exposed`` 0) the engine
    plans ahead whatever share of the time forwards waited for misses.
    ``controller``: the engine's parts controller instead of PD's parts
    pinned on (the PD controller tests' scripted policies);
    ``own_controller``: the one the engine builds from its configuration
    (PD+host's PD controller, with ``host_control``); ``issuer_kw``: the
    host issuer's settings (e.g. an emulated link)."""
    from pdflash.engine.pd_controller import FixedParts
    from pdflash.hybrid import CostModelPlanner, HostCostModel

    eng, adapter, issuer = _stack(
        tmp,
        "x",
        "PD+host",
        cache_slots=6,
        controller=None if own_controller else (FixedParts() if controller is None else controller),
        block_size=5,
        max_running=2,
        token_budget=8,
        host_ahead_min_exposed=min_exposed,
        host_control=host_control,
        issuer_kw=issuer_kw,
    )
    svc = eng.host_service
    assert svc is not None
    svc.planner = CostModelPlanner(HostCostModel(1e-4, 0.0), adapter.expert_nbytes, ahead=ahead)
    svc.ahead_from = ahead_from
    svc.link_bytes_per_s = 1e6
    return eng, adapter, issuer, svc


def _assert_greedy_outputs(eng: Any, cases: list[Any]) -> None:
    """Run every case's prompt to the end; each output equals its greedy reference."""
    ids = [eng.add_request(p, max_new_tokens=MAX_NEW) for p, _ in cases]
    done = eng.run_until_done(max_steps=400)
    for rid, (_, ref) in zip(ids, cases, strict=True):
        assert done[rid].output == ref


def test_cost_model_service_keeps_greedy_output_and_plans_ahead(
    gpt_oss_case: tuple[Path, list[Any]],
) -> None:
    tmp, cases = gpt_oss_case
    eng, adapter, issuer, svc = _cost_model_stack(tmp)
    scheduled_resident: list[np.ndarray] = []
    select = eng.batcher.select

    def spy(demands: Any, resident: Any) -> Any:
        scheduled_resident.append(np.asarray(resident).copy())
        return select(demands, resident)

    eng.batcher.select = spy  # type: ignore[method-assign]
    try:
        _assert_greedy_outputs(eng, cases)
        b = svc.books
        assert b.experts > 0 and b.planned_ahead > 0
        # the gate (0) never closes: the plan ran before every verify
        gate = eng.host_ahead_gate()
        assert gate is not None and gate["min_exposed"] == 0.0
        assert gate["open"] > 1 and gate["closed"] == 0
        assert eng.stream is not None and eng.stream.skip.any()
        # the scheduler saw the host-planned experts as resident (no link bytes)
        assert eng.host_ahead is not None
        assert any((r & eng.host_ahead).any() for r in scheduled_resident)
        assert int(np.asarray(adapter.cache.pins).sum()) == 0
        assert eng.timer.host_wait_s() >= 0.0
    finally:
        svc.close()
        issuer.close()


def test_weighted_ahead_plan_keeps_greedy_output_and_learns_its_fraction(
    gpt_oss_case: tuple[Path, list[Any]],
) -> None:
    """``host_ahead="weighted"`` in the engine: the same greedy output, the
    ahead plans made, and the planner told what became of them (its routed
    fraction counts what the service's books count)."""
    tmp, cases = gpt_oss_case
    eng, adapter, issuer, svc = _cost_model_stack(tmp, ahead="weighted")
    try:
        _assert_greedy_outputs(eng, cases)
        b = svc.books
        assert b.planned_ahead > 0 and b.ahead_seen > 0
        frac = svc.describe()["ahead_fraction"]
        assert (frac["seen"], frac["routed"]) == (b.ahead_seen, b.ahead_routed)
        assert svc.describe()["planner"]["ahead"] == "weighted"
        assert int(np.asarray(adapter.cache.pins).sum()) == 0
    finally:
        svc.close()
        issuer.close()


def test_hosting_queued_copies_keeps_greedy_output(
    gpt_oss_case: tuple[Path, list[Any]],
) -> None:
    """``host_queued`` in the engine over a slow link whose window holds one
    chunk (route-ahead copies queue behind each other): the planner hosts
    experts whose copy was still queued, each such copy is given back to
    the cache, and the greedy output is unchanged."""
    tmp, cases = gpt_oss_case
    eng, adapter, issuer, svc = _cost_model_stack(
        tmp, issuer_kw={"emulated_link_gbps": 0.002, "chunk_bytes": 4096, "window_bytes": 4096}
    )
    svc.host_queued = True
    try:
        _assert_greedy_outputs(eng, cases)
        assert svc.books.queued_hosted > 0
        assert adapter.cache.given_back == svc.books.queued_hosted
        assert svc.describe()["queued_hosted"] == svc.books.queued_hosted
        assert int(np.asarray(adapter.cache.pins).sum()) == 0
    finally:
        svc.close()
        issuer.close()


def test_splitting_the_streams_copies_keeps_greedy_output(
    gpt_oss_case: tuple[Path, list[Any]],
) -> None:
    """``ahead_from="stream"`` in the engine: the same greedy output; the
    ahead plans' candidates hold the stream's fetch set, its gate lookahead
    splits next layers' copies through the planner during the forwards
    (the service books them as planned ahead), and every plan of a layer
    with misses is counted under one reason."""
    from pdflash.hybrid.planner import PLAN_REASONS

    tmp, cases = gpt_oss_case
    eng, adapter, issuer, svc = _cost_model_stack(tmp, ahead_from="stream")
    candidates: list[tuple[np.ndarray, np.ndarray]] = []
    plan_ahead = svc.plan_ahead

    def spy(expected: Any, resident: Any) -> Any:
        stream = eng.prefetch.stream
        assert stream is not None
        fetch = stream.fetch_if(
            np.concatenate(
                [r.predicted for r in eng.requests.live.values() if r.predicted is not None]
            )
        )
        candidates.append((np.asarray(expected) > 0, fetch & ~np.asarray(resident)))
        return plan_ahead(expected, resident)

    svc.plan_ahead = spy  # type: ignore[method-assign]
    try:
        _assert_greedy_outputs(eng, cases)
        d = svc.describe()
        assert d["ahead_from"] == "stream"
        # every non-resident expert the stream would copy was a candidate
        assert candidates and all((fetch & ~cand).sum() == 0 for cand, fetch in candidates)
        stream = eng.prefetch.built_stream
        assert stream is not None and stream.host_split_layers > 0
        split = d["lookahead_split"]
        assert split["layers"] == stream.host_split_layers
        assert split["planned"] == stream.host_split_experts > 0
        decisions = d["planner_decisions"]
        assert decisions["layers"] == sum(decisions[r] for r in PLAN_REASONS) >= 1
        assert decisions["ahead_layers"] == sum(decisions[f"ahead_{r}"] for r in PLAN_REASONS)
        assert decisions["split"] > 0 and svc.books.experts > 0
        assert int(np.asarray(adapter.cache.pins).sum()) == 0
        # the engine's reset starts the service's measured part: its books and
        # the planner's decisions since (the whole run's are kept)
        eng.reset_stats()
        after = svc.describe()
        assert svc.books.experts == 0 and after["planner_decisions"] == decisions
        assert set(after["planner_decisions_measured"].values()) == {0}
    finally:
        svc.close()
        issuer.close()


def test_nothing_is_planned_ahead_while_the_link_keeps_up(
    gpt_oss_case: tuple[Path, list[Any]],
) -> None:
    tmp, cases = gpt_oss_case
    # forwards never wait for the whole time between two plans
    eng, _, issuer, svc = _cost_model_stack(tmp, min_exposed=1.0)
    plans: list[int] = []
    plan_ahead = svc.plan_ahead

    def spy(expected: Any, resident: Any) -> Any:
        out = plan_ahead(expected, resident)
        plans.append(int(out.sum()))
        return out

    svc.plan_ahead = spy  # type: ignore[method-assign]
    try:
        for p, _ in cases:
            eng.add_request(p, max_new_tokens=MAX_NEW)
        eng.run_until_done(max_steps=400)
        # only the first verify (no link measurement yet: a cold cache) plans ahead
        assert len(plans) == 1 and svc.books.planned_ahead == plans[0]
        gate = eng.host_ahead_gate()
        assert gate is not None and gate["min_exposed"] == 1.0
        assert gate["open"] == 1 and gate["closed"] > 0
        assert eng.host_ahead is None
        assert eng.stream is not None and not eng.stream.skip.any()
        assert svc.books.experts > 0  # the layers' own misses still go to the host
    finally:
        svc.close()
        issuer.close()


def test_engine_refuses_auto_without_a_service(gpt_oss_case: tuple[Path, list[Any]]) -> None:
    from pdflash.engine.engine import Engine
    from pdflash.models import load_adapter

    tmp, _ = gpt_oss_case
    adapter = load_adapter(tmp / "target", device="cpu")
    cfg = EngineConfig.preset("B0", host_experts="auto")
    with pytest.raises(ValueError, match="host_service"):
        Engine(adapter, cfg, max_seq_len=32)


def test_engine_refuses_a_runtime_service_it_would_not_account(
    gpt_oss_case: tuple[Path, list[Any]],
) -> None:
    from pdflash.engine.engine import Engine

    tmp, _ = gpt_oss_case
    eng, adapter, issuer = _stack(tmp, "x", "PD+host", cache_slots=6, block_size=5)
    try:
        assert adapter.runtime.host_service is eng.host_service  # attached for the block
        cfg = EngineConfig.preset("B0")  # host_experts off
        with pytest.raises(ValueError, match="host_experts is 'off'"):
            Engine(adapter, cfg, expert_cache=adapter.cache, max_seq_len=32)
    finally:
        assert eng.host_service is not None
        eng.host_service.close()
        issuer.close()


@pytest.mark.parametrize(
    "fmt", ["out_in", "fp32_in_out", *(["onednn"] if onednn_available() else [])]
)
def test_prepared_host_format_keeps_greedy_output(
    fmt: str, gpt_oss_case: tuple[Path, list[Any]]
) -> None:
    from pdflash.hybrid import ForcedHostPlanner, build_host_service

    tmp, cases = gpt_oss_case
    eng, adapter, issuer = _stack(
        tmp, "x", "PD+host", cache_slots=6, block_size=5, max_running=2, token_budget=8
    )
    assert eng.host_service is not None
    eng.host_service.close()
    # every miss on the host, computed from the prepared (transposed,
    # de-interleaved) weights instead of the store's views
    svc = build_host_service(
        adapter,
        link_bytes_per_s=1e9,
        planner=ForcedHostPlanner(every=1),
        calibrate=False,
        host_format=fmt,
        weight_budget_bytes=1 << 30,
    )
    eng.host_service = svc
    svc.timer = eng.timer
    try:
        assert adapter.runtime.host_service is svc
        _assert_greedy_outputs(eng, cases)
        assert svc.books.experts > 0
        assert svc.describe()["host_weights"]["host_format"] == fmt
    finally:
        svc.close()
        issuer.close()


def test_miss_floor_hand_checked() -> None:
    # 10 misses of 1 MB at 1 GB/s: 10 ms over the link alone
    assert miss_floor_s(1e7, 1_000_000, 1e9, None) == pytest.approx(0.01)
    # with a host at 1 ms per expert too: the two share the work, 5 ms
    assert miss_floor_s(1e7, 1_000_000, 1e9, 1e-3) == pytest.approx(0.005)


def test_eta_phys_charges_the_host_its_one_token_cost() -> None:
    """A routed expert has at least one token: the floor's host cost per
    expert is the calibration's intercept plus one token's slope, not the
    intercept alone (a zero-token expert)."""
    row: dict[str, Any] = {"belady_bytes": 1e7, "link_gbps_measured": 1.0, "expert_nbytes": 10**6}
    cost = HostCostModel(intercept_s=0.5e-3, per_token_s=0.5e-3)
    _add_eta_phys(row, cost, wall=0.1, compute_busy=0.0)
    # 10 misses, 1 ms a copy, 1 ms a one-token host expert: 5 ms
    assert row["miss_floor_s"] == pytest.approx(0.005)
    assert row["eta_phys"] == pytest.approx(0.05)


def _spec(baseline: str, **kw: Any) -> RunSpec:
    fields: dict[str, Any] = {
        "arch": "tiny-gpt_oss",
        "baseline": baseline,
        "concurrency": 2,
        "block_size": 6,
        "max_new_tokens": 10,
        "prompt_len": 6,
        "device": "cpu",
    }
    return RunSpec(**{**fields, **kw})


#: a PD+host run whose host serves misses under the engine's own controller:
#: a link slow enough that the forwards wait well above the host gate (the
#: host part starts off and the gate switches it on after two measured
#: steps), and a run long enough to have steps after that
HOSTING = {"emulated_link_gbps": 0.002, "max_new_tokens": 24}


def test_run_spec_rows_carry_the_host_books(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    # a slow emulated link (one tiny expert: 6.4 ms, HOSTING) and no
    # break-even cap, so the calibrated planner hosts misses even when a
    # loaded 2-core CI box measured the CPU slower than one copy (the
    # makespan still pays)
    # stream asked for on the CPU: the thread hand-off runs, the reason recorded
    host = run_spec(_spec("PD+host", **HOSTING, host_max_ratio=50.0, host_handoff="stream")).row
    off = run_spec(_spec("PD", emulated_link_gbps=0.02)).row
    for row in (host, off):
        assert validate_row(row) == [], validate_row(row)
        assert row["eta_phys"] is not None and row["eta_phys_definition"]
        assert row["torch_intra_op_threads"] >= 1
    assert host["host_experts"] == "auto" and off["host_experts"] == "off"
    # the pre-verify plan's gate: its default, and every measured verify
    # whose host part was on counted as opened or closed; none without a service
    gate = host["host_ahead_gate"]
    assert gate["min_exposed"] == 0.2 and gate["open"] + gate["closed"] >= 1
    assert off["host_ahead_gate"] is None
    assert host["host_service"]["planner"]["max_host_ratio"] == 50.0
    assert host["host_service"]["planner"]["max_host_tokens"] == 16
    handoff = host["host_service"]["host_handoff"]
    assert (handoff["requested"], handoff["mode"]) == ("stream", "thread")
    assert handoff["reason"] == "the device is cpu, not cuda"
    from pdflash.report.schema import RUN_SETTINGS

    setting = next(s for s in RUN_SETTINGS if s.name == "host_handoff")
    assert (setting.of_row(host), setting.of_row(off)) == ("stream", "thread")
    # the ahead rule (default certain) and the routed fraction it measured
    assert host["host_service"]["planner"]["ahead"] == "certain"
    assert host["host_service"]["ahead_fraction"]["prior"] == 1.0
    ahead = next(s for s in RUN_SETTINGS if s.name == "host_ahead")
    assert (ahead.of_row(host), ahead.of_row(off)) == ("certain", "certain")
    min_exposed = next(s for s in RUN_SETTINGS if s.name == "host_ahead_min_exposed")
    assert (min_exposed.of_row(host), min_exposed.of_row(off)) == (0.2, 0.2)
    cal = host["host_service"]["calibration"]
    assert cal["source"] == "calibrated" and len(cal["points"]) == 4
    assert cal["intercept_s"] >= 0 and cal["per_token_s"] >= 0
    # the host weight format the calibration timed, chosen among the timed candidates
    weights = host["host_service"]["host_weights"]
    timed = {k: v for k, v in weights["format_candidates"].items() if isinstance(v, float)}
    assert weights["host_format"] == cal["host_format"] == min(timed, key=lambda k: timed[k])
    assert weights["prepared_nbytes"] >= 0 and weights["weight_budget_bytes"] >= 0
    assert host["host_served_experts"] > 0
    assert host["link_bytes_saved"] == host["host_served_experts"] * host["expert_nbytes"]
    assert host["host_busy_s"] > 0 and host["host_compute_s"] >= host["host_busy_s"]
    assert 0 < host["host_busy_fraction"] <= 1
    assert host["eta"] >= host["host_busy_s"] / host["wall_s"] - 1e-9
    # a host-served expert is a cache miss: the hit rate cannot exceed PD's by serving on the host
    assert host["expert_cache_hit_rate"] < 1.0 and host["belady_note"]
    # off: the host fields are null with a reason, never 0
    assert off["host_service"] is None
    for name in ("host_served_experts", "host_busy_s", "link_bytes_saved", "host_wait_s"):
        assert off[name] is None and off["not_measured"][name]


def test_run_spec_reuses_host_weights_and_leaves_no_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PD+host runs of one process on one model: the first prepares the
    host weights (and times the formats), later ones reuse them and say so;
    the OS thread count does not grow from run to run; each row records the
    calibration's spread and the planner's online model and decisions."""
    import os
    import time

    from pdflash.bench.engine_run import release_targets

    def threads(at_most: int | None = None) -> int:
        deadline = time.monotonic() + 3.0
        n = len(os.listdir("/proc/self/task"))
        while at_most is not None and n > at_most and time.monotonic() < deadline:
            time.sleep(0.02)  # a joined thread may take a moment to leave /proc
            n = len(os.listdir("/proc/self/task"))
        return n

    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    spec = _spec("PD+host", **HOSTING, host_max_ratio=50.0)
    try:
        rows = [run_spec(spec).row]
        after_first = threads()
        for repeat in (1, 2):
            rows.append(run_spec(dataclasses.replace(spec, repeat=repeat)).row)
            assert threads(after_first) <= after_first
    finally:
        release_targets()
    reused = [r["host_service"]["host_weights"]["reused"] for r in rows]
    assert reused == [False, True, True]
    assert [r["host_service"]["host_weights"]["uses"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert validate_row(row) == [], validate_row(row)
        svc = row["host_service"]
        cal = svc["calibration"]
        assert [p[0] for p in cal["spread"]] == [p[0] for p in cal["points"]]
        assert all(
            lo <= t <= hi for (_, t), (_, lo, hi) in zip(cal["points"], cal["spread"], strict=True)
        )
        assert svc["online_cost"]["observations"] >= 1  # it served misses: it measured them
        decisions = svc["planner_decisions"]
        assert decisions["layers"] >= decisions["split"] + decisions["probes"] >= 1
        # the measured part's decisions: a part of the whole run's (the
        # engine marks them where it resets its books, after the warm-up)
        measured = svc["planner_decisions_measured"]
        assert measured.keys() == decisions.keys()
        assert all(0 <= measured[k] <= decisions[k] for k in decisions)
        assert measured["layers"] >= 1  # the measured part served misses


def test_run_spec_rejects_bad_host_settings() -> None:
    with pytest.raises(ValueError, match="host_experts"):
        run_spec(_spec("PD", host_experts="maybe"))
    with pytest.raises(ValueError, match="host_workers"):
        run_spec(_spec("PD+host", host_workers=0))
    with pytest.raises(ValueError, match="host_max_ratio"):
        run_spec(_spec("PD+host", host_max_ratio=0.0))
    with pytest.raises(ValueError, match="host_max_tokens"):
        run_spec(_spec("PD+host", host_max_tokens=-1))
    with pytest.raises(ValueError, match="host_format"):
        run_spec(_spec("PD+host", host_format="fp16"))
    with pytest.raises(ValueError, match="host_handoff"):
        run_spec(_spec("PD+host", host_handoff="fast"))
    with pytest.raises(ValueError, match="host_ahead_from"):
        run_spec(_spec("PD+host", host_ahead_from="lookahead"))
    for bad in (-0.5, 2.0, float("nan")):
        with pytest.raises(ValueError, match="host_ahead_min_exposed must be a share"):
            run_spec(_spec("PD+host", host_ahead_min_exposed=bad))


def test_the_engine_settles_the_host_after_each_forward(
    gpt_oss_case: tuple[Path, list[Any]],
) -> None:
    """The stream hand-off's check runs after every verify (and prefill)
    forward: a failed HOST job ends the batch's requests with the error
    instead of committing what the forward computed."""
    from pdflash.hybrid import ForcedHostPlanner, HostHandoffError

    tmp, cases = gpt_oss_case
    eng, _adapter, issuer = _stack(tmp, "s", "PD+host", cache_slots=6, block_size=5)
    svc = eng.host_service
    assert svc is not None
    svc.planner = ForcedHostPlanner(every=1)
    calls: list[int] = []
    settle = svc.settle

    def failing_settle() -> None:
        settle()
        calls.append(1)
        if len(calls) == 3:  # prefill, verify, then a verify whose host job "failed"
            raise HostHandoffError("a HOST job failed: injected")

    svc.settle = failing_settle  # type: ignore[method-assign]
    try:
        rid = eng.add_request(cases[0][0], max_new_tokens=MAX_NEW)
        done = eng.run_until_done(max_steps=400)
        assert len(calls) >= 3
        assert done[rid].metrics.finish_reason == "error"
        assert "HostHandoffError" in (done[rid].error or "")
    finally:
        svc.close()
        issuer.close()


def test_a_pd_host_run_gives_torch_its_thread_count_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hybrid service sets torch's process-wide intra-op threads for its
    run (the row records them); a later run in the process must not inherit
    them, after a run that ends or one that fails."""
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    before = torch.get_num_threads()
    threads = before + 2
    row = run_spec(_spec("PD+host", emulated_link_gbps=0.02, host_threads=threads)).row
    assert row["torch_intra_op_threads"] == threads
    assert row["host_service"]["intra_op_threads"] == threads
    assert torch.get_num_threads() == before

    from pdflash.engine import engine as engine_mod

    def broken(self: Any, *a: Any, **k: Any) -> Any:
        assert torch.get_num_threads() == threads  # the service's count during its run
        raise RuntimeError("verify broke")

    monkeypatch.setattr(engine_mod.Engine, "_verify", broken)
    with pytest.raises(RuntimeError, match="verify broke"):
        run_spec(_spec("PD+host", emulated_link_gbps=0.02, host_threads=threads))
    assert torch.get_num_threads() == before
