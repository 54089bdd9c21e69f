"""PD's switchable parts (issue 15's ablation): the presets switch exactly one
part off, and the one-band variant really submits every copy in one band,
which the native issuer (host backend) then serves FIFO."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from pdflash._reference.issuer import LOG_START, LOG_SUBMIT, records_from_log
from pdflash.cache import ExpertCache
from pdflash.engine.config import ABLATIONS, BASELINES, EngineConfig
from pdflash.h2d import H2DIssuer
from pdflash.protocols import Band

NBYTES = 4096
LAYERS, EXPERTS = 2, 8


class Source:
    """Host experts in one buffer registered with the issuer as a source."""

    def __init__(self, issuer: H2DIssuer) -> None:
        self.num_layers, self.num_experts, self.expert_nbytes = LAYERS, EXPERTS, NBYTES
        n = LAYERS * EXPERTS
        self.buffer = (torch.arange(n) % 251).to(torch.uint8).repeat_interleave(NBYTES)
        issuer.register_source(self.buffer.data_ptr(), self.buffer.numel())

    def host_ptrs(self, flat_ids: Any) -> np.ndarray:
        return self.buffer.data_ptr() + np.asarray(flat_ids, dtype=np.int64) * NBYTES


def _wait_for(cond: Callable[[], object], timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        time.sleep(1e-3)


def _run(single_band: Band | None) -> tuple[list[int], list[int], int, ExpertCache]:
    """Queue six prefetches behind a held link, then one on-demand miss;
    returns (bands of the submits, tickets in chunk-start order, the
    on-demand ticket, the cache)."""
    # one chunk per expert, two chunks in flight: four prefetches stay queued
    with H2DIssuer(
        backend="host", chunk_bytes=NBYTES, window_bytes=2 * NBYTES, debug_log=True
    ) as iss:
        cache = ExpertCache(
            Source(iss),
            iss,
            num_slots=LAYERS * EXPERTS,
            top_k=2,
            max_batch_tokens=1,
            single_band=single_band,
        )
        iss._native.test_hold_link(True)
        cache.prefetch(np.arange(6, dtype=np.int64), Band.ROUTE_AHEAD)
        _wait_for(lambda: iss.stats()["inflight_chunks"] == 2)
        slots, tickets = cache.acquire([10])
        iss._native.test_hold_link(False)
        cache.wait_ready(tickets)
        for g, s in zip([10], slots.tolist(), strict=True):
            assert torch.all(cache.slot_tensor(s) == g)  # the bytes arrived
        cache.release([10])
        cache.drain_inflight()
        log = records_from_log(iss.debug_log())
    submits = [r.band for r in log if r.kind == LOG_SUBMIT]
    starts = [r.ticket for r in log if r.kind == LOG_START]
    return submits, starts, int(tickets[0]), cache


def test_one_band_submits_every_copy_in_one_band_and_is_fifo() -> None:
    submits, starts, od, cache = _run(Band.ON_DEMAND)
    assert submits and set(submits) == {int(Band.ON_DEMAND)}
    # FIFO: the on-demand miss starts after all six prefetches queued before it
    assert starts.index(od) == 6
    assert starts == sorted(starts)
    # the books still tell prefetched from on-demand bytes
    assert cache.stats()["prefetch_bytes_in"] == 6 * NBYTES


def test_with_bands_the_on_demand_miss_overtakes_queued_prefetches() -> None:
    submits, starts, od, _ = _run(None)
    assert set(submits) == {int(Band.ROUTE_AHEAD), int(Band.ON_DEMAND)}
    # only the two prefetch chunks already in the window start before it
    assert starts.index(od) == 2


def test_single_band_must_be_a_band() -> None:
    with H2DIssuer(backend="host") as iss, pytest.raises(TypeError, match="single_band"):
        ExpertCache(Source(iss), iss, num_slots=4, top_k=2, max_batch_tokens=1, single_band=0)  # type: ignore[arg-type]


def test_ablation_presets_switch_one_part_each() -> None:
    pd = EngineConfig.preset("PD")
    assert set(ABLATIONS) <= set(BASELINES)
    diffs = {}
    for label in ABLATIONS:
        cfg = EngineConfig.preset(label)
        diffs[label] = {
            f
            for f in (
                "route_ahead",
                "streaming_prefetch",
                "bands",
                "batching",
                "host_experts",
                "parts_controller",
                "verify_width",
            )
            if getattr(cfg, f) != getattr(pd, f)
        }
    # PD runs its parts under the controller; every ablation runs them as configured
    off = "parts_controller"
    assert pd.parts_controller
    assert diffs == {
        "PD-all-on": {off},
        "PD-no-route-ahead": {"route_ahead", "streaming_prefetch", off},
        "PD-one-band": {"bands", off},
        "PD-token-sched": {"batching", off},
        "PD-no-stream": {"streaming_prefetch", off},
        # PD, controller included, verifying every draft
        "PD-full-width": {"verify_width"},
    }
    assert EngineConfig.preset("PD-token-sched").batching == "deficit_tokens"
    assert pd.bands and not EngineConfig.preset("PD-one-band").bands


@pytest.mark.parametrize("label", ABLATIONS)
def test_each_ablation_runs_end_to_end_and_its_row_says_what_is_off(
    label: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdflash.bench.engine_run import RunSpec, run_spec

    from pdflash.report.schema import validate_row

    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    spec = RunSpec(
        arch="tiny",
        baseline=label,
        concurrency=2,
        block_size=6,
        max_new_tokens=8,
        prompt_len=6,
        device="cpu",
        emulated_link_gbps=0.5,
    )
    row = run_spec(spec).row
    assert validate_row(row) == []
    assert row["baseline"] == label and row["committed_tokens"] == 16
    expect = {
        "PD-all-on": ("parts_controller", False),
        "PD-no-route-ahead": ("route_ahead", False),
        "PD-one-band": ("bands", False),
        "PD-token-sched": ("batching", "deficit_tokens"),
        "PD-no-stream": ("streaming_prefetch", False),
        "PD-full-width": ("verify_width", "full"),
    }[label]
    got = row[expect[0]]
    assert (got["setting"] if expect[0] == "verify_width" else got) == expect[1]
    if label == "PD-no-route-ahead":
        assert row["routeahead_coverage"] is None and row["not_measured"]["routeahead_coverage"]
    if label == "PD-all-on":
        # the controller's books with every part on, and no switch
        parts = row["pd_parts"]
        assert parts["policy"] == "fixed" and parts["switches"] == 0
        assert parts["on_fraction"] == {"stream": 1.0, "route_ahead": 1.0, "scheduler_2d": 1.0}
    elif label == "PD-full-width":
        # PD's controller runs as in PD; only the width differs: every
        # draft verified, no width policy consulted
        assert row["pd_parts"]["policy"] == "paired-steps"
        assert row["verify_width"]["policy"] is None
        assert row["verify_width"]["ran"] == "full"
    else:
        assert row["pd_parts"] is None
        # the adaptive width, as PD's
        assert row["verify_width"]["setting"] == row["verify_width"]["ran"] == "adaptive"
        assert row["verify_width"]["policy"] == "adaptive"


def test_engine_refuses_a_cache_whose_bands_disagree_with_its_config() -> None:
    from pdflash.engine.engine import Engine

    class Adapter:
        num_layers, num_experts, top_k, hidden_size, vocab_size = LAYERS, EXPERTS, 2, 8, 16

    with H2DIssuer(backend="host") as iss:
        one = ExpertCache(
            Source(iss), iss, num_slots=4, top_k=2, max_batch_tokens=1, single_band=Band.ON_DEMAND
        )
        banded = ExpertCache(Source(iss), iss, num_slots=4, top_k=2, max_batch_tokens=1)
        cfg = EngineConfig(speculative=False, block_size=1)
        with pytest.raises(ValueError, match="one band"):
            Engine(Adapter(), cfg, expert_cache=one)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="bands is False"):
            Engine(Adapter(), cfg.replace(bands=False), expert_cache=banded)  # type: ignore[arg-type]


def test_pd_host_runs_with_a_byte_budget_from_the_verify(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verify calibration runs without the hybrid service and gives it
    back (an engine with host_experts off refused the runtime holding it)."""
    from pdflash.bench.engine_run import RunSpec, run_spec

    from pdflash.report.schema import validate_row

    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    spec = RunSpec(
        arch="tiny",
        baseline="PD+host",
        concurrency=2,
        block_size=6,
        max_new_tokens=8,
        prompt_len=6,
        device="cpu",
        emulated_link_gbps=0.5,
        max_running=4,
        byte_budget_from="verify",
    )
    row = run_spec(spec).row
    assert validate_row(row) == []
    assert row["byte_budget_from"] == "verify" and row["byte_budget_verify_compute_s"] > 0
    assert row["host_experts"] == "auto" and row["host_served_experts"] is not None
