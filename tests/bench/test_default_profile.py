"""bench/h200/default_profile.py (``default_ab.py --profile``): a quick run of
the default's specs on the CPU with the engine's stages timed."""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import pytest
from bench_fixtures import load_bench_script

default_profile = load_bench_script("default_profile.py")


def _quick_spec(baseline: str) -> dict[str, Any]:
    from pdflash.bench.suites import default

    ns = argparse.Namespace(
        quick=True,
        concurrency=[1],
        cache_fraction=[0.25],
        device="cpu",
        emulated_link_gbps=10.0,
        marginal_rule="verify",
    )
    specs = {s["baseline"]: s for s in default.default_specs(ns, on_gpu=False)}
    return specs[baseline]


@pytest.mark.parametrize("baseline", ["B1", "PD"])
def test_every_step_is_timed_by_stage_and_the_wrappers_come_off(
    baseline: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from pdflash.engine import engine as engine_module

    step_before = engine_module.Engine._step
    reset_before = engine_module.Engine.reset_stats
    prof = default_profile.profile_arm(_quick_spec(baseline), cuda=False)
    assert engine_module.Engine._step is step_before  # unwrapped on leaving
    assert engine_module.Engine.reset_stats is reset_before
    # only the steps on the run's clock: its warm-up (and PD's verify
    # calibration) ran engine steps before it that are not counted
    assert prof["engine_steps"] == prof["measured_steps"] > 0
    host = prof["host_ms_per_engine_step"]
    calls = prof["calls_per_engine_step"]
    assert calls["Engine._step"] == 1.0
    # the stages nest inside the step: none takes longer than it
    assert all(0.0 < ms <= host["Engine._step"] for ms in host.values())
    assert host["Engine._verify"] > 0.0 and calls["Engine._draft_stage"] == 1.0
    # the forward's inner stages nest in the target's forwards
    assert 0.0 < host["OffloadedMoE.forward_routed"] <= host["TargetRunner.forward"]
    assert host["ExpertCache.acquire"] <= host["OffloadedMoE.forward_routed"]
    spans = prof["span_ms_per_measured_step"]
    assert 0.0 < spans["verify"] < spans["wall"] and 0.0 < spans["draft"] < spans["wall"]
    if baseline == "PD":  # the width and the controller run only under PD
        assert calls["WidthHook.trim"] > 0.0 and "pd_controller.after_step" in calls
    else:
        assert "WidthHook.trim" not in calls
    assert prof["syncs_per_engine_step"] is None and prof["syncs_outside_steps"] is None
    events = prof["process_events_per_engine_step"]
    # no CUDA: the allocator's counts are absent, the collections counted
    assert set(events) == {"gc_gen0", "gc_gen1", "gc_gen2", "gc_pause_ms"}
    assert all(v >= 0.0 for v in events.values())
    default_profile.print_profile(baseline, prof)
    out = capsys.readouterr().out
    assert out.startswith(f"{baseline}: ") and "Engine._verify" in out
    assert "spans, ms per measured step: wall " in out


def _fake(host: dict[str, float], syncs: dict[str, float] | None, tps: float) -> dict[str, Any]:
    return {
        "tokens_per_s": tps,
        "engine_steps": 10,
        "host_ms_per_engine_step": host,
        "calls_per_engine_step": dict.fromkeys(host, 1.0),
        "syncs_per_engine_step": syncs,
        "syncs_outside_steps": None if syncs is None else 2,
        "span_ms_per_measured_step": {"wall": host["Engine._step"]},
        "process_events_per_engine_step": {"gc_gen0": host["Engine._step"] / 10},
    }


def test_the_median_of_repeated_profiles_is_taken_stage_by_stage() -> None:
    """Medians per stage over the repeats; a stage one repeat lacks counts
    there as 0; sync counts stay absent where no repeat has them."""
    runs = [
        _fake({"Engine._step": 10.0, "WidthHook.trim": 0.3}, None, 100.0),
        _fake({"Engine._step": 14.0}, None, 80.0),
        _fake({"Engine._step": 11.0, "WidthHook.trim": 0.1}, None, 90.0),
    ]
    med = default_profile.median_profile(runs)
    assert med["repeats"] == 3 and med["tokens_per_s"] == 90.0
    assert med["host_ms_per_engine_step"] == {"Engine._step": 11.0, "WidthHook.trim": 0.1}
    assert med["span_ms_per_measured_step"] == {"wall": 11.0}
    assert med["process_events_per_engine_step"] == {"gc_gen0": pytest.approx(1.1)}
    assert med["syncs_per_engine_step"] is None and med["syncs_outside_steps"] is None
    cuda = default_profile.median_profile(
        [_fake({"Engine._step": 1.0}, {"Verifier.run": 1.0}, 1.0)]
    )
    assert cuda["syncs_per_engine_step"] == {"Verifier.run": 1.0}
    assert cuda["syncs_outside_steps"] == 2


def test_process_events_count_the_collections_that_ran_inside_steps() -> None:
    """Collections while counting and inside a step are counted by
    generation with their pauses; none outside a step or after the
    counting ends."""
    inside = [False]
    events = default_profile._ProcessEvents(cuda=False, in_step=lambda: inside[0])
    with events.counting():
        gc.collect(2)  # outside a step
        assert events.collections == [0, 0, 0]
        inside[0] = True
        gc.collect(0)
        gc.collect(2)
    gc.collect()
    assert events.collections[0] >= 1 and events.collections[2] >= 1
    assert events.pause_s > 0.0 and events.cuda_counts is None
    per = events.per_step(2)
    assert per["gc_gen2"] == events.collections[2] / 2


def test_the_cuda_api_summary_splits_the_launching_thread_from_the_copy_threads() -> None:
    record = default_profile.ApiRecord
    records = [
        record("cudaLaunchKernel", False, 7, 5.0),
        record("cudaLaunchKernel", False, 7, 7.0),
        record("cudaEventQuery", False, 7, 1.0),
        record("cudaEventQuery", False, 9, 2.0),
        record("cudaEventQuery", False, 9, 4.0),
        record("cudaMemcpyAsync", False, 9, 3.0),
        record("aten::add", False, 7, 50.0),  # an operator, not a runtime call
        record("gemm_kernel", True, 0, 400.0),
        record("Memcpy HtoD (Pinned -> Device)", True, 0, 100.0),
    ]
    out = default_profile.summarize_cuda_api(records, steps=2)
    api = out["api_per_step"]
    assert set(api) == {"cudaLaunchKernel", "cudaEventQuery", "cudaMemcpyAsync"}
    assert api["cudaLaunchKernel"] == {
        "main_calls": 1.0,
        "main_us_per_call": 6.0,
        "other_calls": 0.0,
        "other_us_per_call": None,
    }
    assert api["cudaEventQuery"]["main_calls"] == 0.5
    assert api["cudaEventQuery"]["other_calls"] == 1.0
    assert api["cudaEventQuery"]["other_us_per_call"] == 3.0
    assert out["threads_calling_cuda"] == 2
    assert out["device"] == {
        "kernel_ms_per_step": 0.2,
        "copy_ms_per_step": 0.05,
        "kernels_per_step": 0.5,
        "top_kernels_per_step": {"gemm_kernel": 0.5},
    }


def test_the_cuda_api_printout_names_the_costliest_calls_first(
    capsys: pytest.CaptureFixture[str],
) -> None:
    record = default_profile.ApiRecord
    records = [record("cudaLaunchKernel", False, 7, 5.0)] * 4 + [
        record("cudaEventQuery", False, 7, 1.0),
        record("gemm_kernel", True, 0, 400.0),
    ]
    prof = {
        "tokens_per_s": 300.0,
        "wall_ms_per_step": 10.0,
        "main_cpu_ms_per_step": 9.5,
        "thread_cpu_ms_per_step": {"main": {"threads": 1.0, "cpu_ms_per_step": 9.9}},
        **default_profile.summarize_cuda_api(records, steps=2),
    }
    default_profile.print_cuda_api("c=1 PD run 0", prof)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("c=1 PD run 0: 300.0 tok/s, wall 10.000 ms/step")
    assert "(main thread CPU 9.500)" in lines[0] and "kernels 0.200 ms (0)" in lines[0]
    assert "threads 'main'" in lines[1]
    # 2 launches a step at 5 us before 0.5 queries at 1 us
    assert lines[2].split()[0] == "cudaLaunchKernel" and lines[3].split()[0] == "cudaEventQuery"


def test_the_measured_window_opens_at_the_first_measured_step_and_counts_the_rest() -> None:
    class FakeProfiler:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def start(self) -> None:
            self.calls.append("start")

        def stop(self) -> None:
            self.calls.append("stop")

    prof = FakeProfiler()
    window = default_profile.MeasuredWindow(prof)
    window.close()  # a run that never stepped: nothing to stop
    assert prof.calls == [] and window.steps == 0
    for done in (3, 6, 9, 12):
        window(done, 12)
    window.close()
    window.close()
    # opened at the first step, closed once; the opening step is not counted
    assert prof.calls == ["start", "stop"]
    assert window.steps == 3 and window.wall_s >= 0.0 and window.main_cpu_s >= 0.0
    if window.cpu_before is not None:
        assert window.cpu_after is not None


def test_thread_cpu_time_is_read_per_thread_and_summed_by_name() -> None:
    import threading

    before = default_profile.thread_cpu_ns()
    if before is None:
        pytest.skip("no /proc/self/task here")
    main = threading.get_native_id()
    assert main in before
    stop = time.perf_counter() + 0.05
    while time.perf_counter() < stop:  # this thread runs, nothing else need
        pass
    after = default_profile.thread_cpu_ns()
    assert after is not None and after[main][1] > before[main][1]
    delta = default_profile.thread_cpu_delta(before, after, steps=10, main_tid=main)
    assert delta is not None
    # 50 ms of spinning over 10 steps: at least a few CPU ms a step
    assert delta["main"]["cpu_ms_per_step"] >= 2.0 and delta["main"]["threads"] == 1
    # a thread that started between the snapshots counts from zero; one seen
    # only before is gone
    fake_before = {1: ("gone", 5)}
    fake_after = {2: ("new", 3_000_000), 3: ("idle", 7)}
    assert default_profile.thread_cpu_delta(fake_before, fake_after, steps=3) == {
        "new": {"threads": 1.0, "cpu_ms_per_step": 1.0},
        "idle": {"threads": 1.0, "cpu_ms_per_step": 7e-6 / 3},
    }
    assert default_profile.thread_cpu_delta(None, after, steps=1) is None
