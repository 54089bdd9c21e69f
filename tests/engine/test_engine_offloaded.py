"""The engine over pdflash.models' offloaded adapters: lossless for every
baseline with a tiny expert cache, gpt-oss attention (sinks, sliding window),
aborts under load leave no KV pages or expert pins behind, run_spec rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pdflash.engine.config import BASELINES, EngineConfig
from pdflash.engine.drafter import load_drafter
from pdflash.engine.engine import Engine, RequestState
from pdflash.protocols import Band

from .conftest import greedy_cases, oracle_drafts, write_target_and_drafter

MAX_NEW = 14


def host_started_on(baseline: str) -> Any:
    """PD+host's PD controller with the host part started on (None for the
    other baselines: the engine's own). The engine's gated controller starts
    it off until the forwards wait for copies, which the unthrottled CPU
    copies never make them do: a test that needs the host to serve misses
    starts it on (the gate's probe may then switch it off)."""
    if baseline != "PD+host":
        return None
    from pdflash.engine.pd_controller import ALL_ON, HOST_GATE_EXPOSED, HOST_PART, PDController

    return PDController(host_gate=HOST_GATE_EXPOSED, initial=ALL_ON.with_part(HOST_PART, True))


def _stack(
    tmp: Path,
    arch: str,
    baseline: str,
    cache_slots: int,
    controller: Any = None,
    width: Any = None,
    issuer_kw: dict[str, Any] | None = None,
    **cfg: Any,
) -> tuple[Engine, Any, Any]:
    from pdflash.engine.batching import DeficitBatcher
    from pdflash.engine.predict import BatchedUnionPredictor
    from pdflash.h2d import H2DIssuer
    from pdflash.models import load_adapter
    from pdflash.routeahead import (
        ApproxRouterPredictor,
        PreviousRoundPredictor,
        RouteAheadStats,
    )

    issuer = H2DIssuer(backend="host", **(issuer_kw or {}))
    if baseline == "B3":
        cache_slots = 1 << 20  # every expert (the cache clamps to the model's count)
    from pdflash.cache import ExpertCache
    from pdflash.cache.eviction import LayerCyclicPolicy

    adapter = load_adapter(tmp / "target", device="cpu")
    # every offloaded baseline runs the layer-cyclic eviction policy (as run_spec's "auto")
    policy = LayerCyclicPolicy(adapter.num_layers, adapter.num_experts)
    cache = ExpertCache(
        adapter.store,
        issuer,
        device="cpu",
        num_slots=cache_slots,
        top_k=adapter.top_k,
        max_batch_tokens=1,
        policy=policy,
        # the PD-one-band ablation: every copy in one FIFO band
        single_band=None if EngineConfig.preset(baseline).bands else Band.ON_DEMAND,
    )
    adapter.attach_cache(cache)
    drafter = load_drafter(tmp / "drafter")
    config = EngineConfig.preset(baseline, **cfg)
    batcher = None
    if config.batching != "fcfs":
        budget = (
            None
            if config.batching == "deficit_tokens"
            else cache.num_slots * cache.expert_nbytes // 2
        )
        batcher = DeficitBatcher(
            token_budget=config.token_budget,
            byte_budget=budget,
            num_layers=adapter.num_layers,
            num_experts=adapter.num_experts,
            expert_nbytes=cache.expert_nbytes,
        )
    predictor = None
    if config.route_ahead:
        predictor = BatchedUnionPredictor(
            [
                (ApproxRouterPredictor(adapter), 1.0),
                (PreviousRoundPredictor(adapter.num_layers, adapter.num_experts), 0.5),
            ]
        )
    host_service = None
    if config.host_experts != "off":
        from pdflash.hybrid import ForcedHostPlanner, build_host_service

        # every other miss on the host, whatever the cost model would say
        host_service = build_host_service(
            adapter, link_bytes_per_s=1e9, planner=ForcedHostPlanner(every=2), calibrate=False
        )
    eng = Engine(
        adapter,
        config,
        drafter=drafter,
        batcher=batcher,
        predictor=predictor,
        expert_cache=cache,
        route_stats=RouteAheadStats.for_adapter(adapter),
        host_service=host_service,
        max_seq_len=64,
        controller=controller,
        width=width,
    )
    return eng, adapter, issuer


def offloaded_checkpoint(
    tmp_path_factory: pytest.TempPathFactory,
    arch: str,
    prompt_lens: tuple[int, ...] = (3, 9, 6),
    seed: int = 0,
) -> tuple[Path, list[Any]]:
    """A tiny 4-layer ``arch`` target and drafter under a fresh folder, and
    prompts of ``prompt_lens`` tokens with their plain greedy continuations
    (the test modules' checkpoint fixtures)."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp(arch)
    write_target_and_drafter(tmp, arch, 4)
    # default prompts longer than gpt-oss tiny's sliding window of 4
    return tmp, greedy_cases(tmp / "target", prompt_lens, MAX_NEW, seed=seed)


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[Any]]:
    return offloaded_checkpoint(tmp_path_factory, request.param)


@pytest.mark.parametrize("baseline", BASELINES)
def test_lossless_offloaded_every_baseline(
    baseline: str, checkpoint: tuple[Path, list[Any]]
) -> None:
    tmp, cases = checkpoint
    # 6 slots: fewer than the 2 layers x 8 experts two consecutive layers route to
    eng, adapter, issuer = _stack(
        tmp,
        "x",
        baseline,
        cache_slots=6,
        controller=host_started_on(baseline),
        block_size=5,
        max_running=2,
        token_budget=8,
    )
    try:
        ids = [eng.add_request(p, max_new_tokens=MAX_NEW) for p, _ in cases]
        # drafts = the reference continuation corrupted at a random position:
        # long accepted prefixes, mid-block rejections and KV rollback under offloading
        oracle_drafts(eng, {rid: ref for rid, (_, ref) in zip(ids, cases, strict=True)}, seed=5)
        done = eng.run_until_done(max_steps=400)
        for rid, (_, ref) in zip(ids, cases, strict=True):
            assert done[rid].output == ref, (baseline, rid)
        stats = adapter.cache.stats()
        if baseline != "B3":
            assert stats["misses"] > 0 and stats["evictions"] > 0  # offloading really happened
        assert int(np.asarray(adapter.cache.pins).sum()) == 0
        assert eng.kv.used_pages == 0
        if baseline != "B0":
            assert max(a for r in done.values() for a in r.metrics.acceptance_lengths) > 2
        if eng.host_service is not None:  # PD+host: the host really served misses
            assert eng.host_service.books.experts > 0
    finally:
        if eng.host_service is not None:
            eng.host_service.close()
        issuer.close()


def test_pd_hundred_requests_with_aborts_release_everything(
    checkpoint: tuple[Path, list[Any]],
) -> None:
    tmp, _ = checkpoint
    eng, adapter, issuer = _stack(
        tmp, "x", "PD", cache_slots=6, block_size=4, max_running=100, token_budget=64
    )
    rng = np.random.default_rng(9)
    try:
        ids = [
            eng.add_request(
                rng.integers(0, adapter.vocab_size, size=int(rng.integers(2, 8))).tolist(),
                max_new_tokens=int(rng.integers(2, 12)),
            )
            for _ in range(100)
        ]
        aborted = set()
        steps = 0
        while eng.has_work:
            eng.step()
            steps += 1
            assert steps < 500
            for rid in ids:
                st = eng.request(rid).state
                if st not in (RequestState.FINISHED, RequestState.ABORTED) and rng.random() < 0.05:
                    eng.abort(rid)
                    aborted.add(rid)
        assert aborted
        for rid in ids:
            assert eng.request(rid).state == (
                RequestState.ABORTED if rid in aborted else RequestState.FINISHED
            )
        assert eng.kv.used_pages == 0 and eng.draft_kv is not None and eng.draft_kv.used_pages == 0
        assert int(np.asarray(adapter.cache.pins).sum()) == 0
        snap = eng.route_stats.snapshot()
        assert snap.request.routed > 0 and snap.request.predicted > 0
        assert 0.0 < snap.request.coverage <= 1.0  # route-ahead really predicted verify's experts
        assert eng.prefetch_bytes[Band.ROUTE_AHEAD] > 0
    finally:
        issuer.close()
