"""The owners of the engine's step and their contracts: the request table
(states, the admission ledger, its invariants), the verifier (returns
outcomes, commits nothing), the prefetch planner (its own counters, failures
counted not raised, the stream's plan set once per step), reset_stats (a
fresh engine's counters) and the adapter's one expert-cache factory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pdflash.engine.config import EngineConfig
from pdflash.engine.engine import Engine, StepReport
from pdflash.engine.prefetch import ExpertPrefetcher
from pdflash.engine.requests import Request, RequestMetrics, RequestState, RequestTable
from pdflash.engine.sampling import SamplingParams
from pdflash.protocols import Band, PrefetchPlanner

from .conftest import greedy_reference, make_batcher_and_predictor, write_target_and_drafter

# ---------------------------------------------------------------- requests


def _request(rid: int) -> Request:
    return Request(
        request_id=rid,
        prompt=[1, 2],
        params=SamplingParams(),
        max_new_tokens=4,
        stop_ids=frozenset(),
        on_token=None,
        metrics=RequestMetrics(rid, 2, arrival_s=0.0),
        generator=torch.Generator(),
    )


def test_request_table_moves_requests_and_keeps_the_ledger() -> None:
    table = RequestTable(max_finished=1)
    a, b = _request(table.next_id()), _request(table.next_id())
    table.add(a)
    table.add(b)
    assert table.head() is a and list(table.waiting) == [0, 1]
    table.admit(a, 3)
    assert a.state == RequestState.PREFILL and a.kv_pages_promised == 3
    assert table.promised_pages == 3 and table.running == [0] and table.head() is b
    table.requeue(a)  # a failed prefill: back at the head, pages released
    assert list(table.waiting) == [0, 1] and table.promised_pages == 0
    assert a.state == RequestState.WAITING and a.kv_pages_promised == 0
    table.admit(a, 3)
    a.state = RequestState.DRAFT
    table.check()
    assert table.in_state(RequestState.DRAFT) == [a]
    # a waiting request ends (an abort): out of the queue, kept as finished
    assert table.end(b, "abort", 1.0)
    assert b.state == RequestState.ABORTED and b.metrics.finish_reason == "abort"
    assert not table.end(b, "abort", 2.0)  # ending twice does nothing
    assert b.metrics.finish_s == 1.0
    table.retire(b)
    assert list(table.waiting) == [] and table.get(1) is b
    assert table.end(a, "length", 3.0)
    assert table.promised_pages == 0 and table.running == []
    table.retire(a)
    assert list(table.finished) == [0]  # max_finished=1 dropped the older one
    with pytest.raises(KeyError):
        table.get(1)
    table.check()
    assert table.pop_finished() == {0: a} and not table.finished


def test_request_table_check_catches_a_broken_ledger() -> None:
    table = RequestTable()
    req = _request(table.next_id())
    table.add(req)
    table.admit(req, 2)
    req.state = RequestState.VERIFY
    table.check()
    table.promised_pages += 1  # a page promised to nobody
    with pytest.raises(AssertionError):
        table.check()
    table.promised_pages -= 1
    table.waiting.append(req.request_id)  # both waiting and running
    with pytest.raises(AssertionError):
        table.check()


# ---------------------------------------------------------------- verifier


def test_the_verifier_returns_outcomes_and_commits_nothing(
    adapter: Any, drafter: Any, hf_target: Any
) -> None:
    config = EngineConfig.preset("B1", block_size=4, max_running=2, token_budget=8)
    eng = Engine(adapter, config, drafter=drafter, max_seq_len=48)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (5, 7)]
    ids = [eng.add_request(p, max_new_tokens=8) for p in prompts]
    # the step's stages up to the verify: admit, prefill, draft
    report = StepReport()
    eng._prefill_admitted(eng._admit(), report)
    eng._draft_stage(report)
    assert report.admitted == 2 and report.drafted == 2 and not report.errors
    reqs = [eng.request(r) for r in ids]
    assert all(r.state == RequestState.VERIFY for r in reqs)
    batch = [(r, 1 + int(r.drafts.numel())) for r in reqs]  # type: ignore[union-attr]
    before = [
        (list(r.output), r.anchor, r.drafts.clone(), eng.kv.length(r.request_id))  # type: ignore[union-attr]
        for r in reqs
    ]
    traced = len(eng.routing_trace)  # the prefill's
    result = eng.verifier.run(batch)
    assert [o.request for o in result.outcomes] == reqs
    for (req, grant), (output, anchor, drafts, length), o in zip(
        batch, before, result.outcomes, strict=True
    ):
        # nothing committed: state, tokens, anchor and drafts as before
        assert req.state == RequestState.VERIFY and req.output == output
        assert req.anchor == anchor and torch.equal(req.drafts, drafts)  # type: ignore[arg-type]
        # the forward appended the block; committing truncates to kv_length
        assert o.start == length and eng.kv.length(req.request_id) == length + grant
        assert o.error is None and not o.forced
        assert len(o.tokens) == o.accepted + 1 and 0 <= o.accepted <= grant - 1
        assert o.kv_length == length + o.accepted + 1
        # greedy: the accepted tokens are the reference continuation
        ref = greedy_reference(hf_target, req.prompt, len(output) + len(o.tokens))
        assert list(o.tokens) == ref[len(output) :]
    # the books are the engine's to keep
    assert eng.verify_forwards == 0 and len(eng.routing_trace) == traced


# ---------------------------------------------------------------- planner


class _FakeIssuer:
    def __init__(self) -> None:
        self.idle = True

    def stats(self) -> dict[str, int]:
        return {"queued_copies": 0 if self.idle else 1, "inflight_chunks": 0}


class _FakeCache:
    """Resident set and prefetch log of an expert cache (no copies)."""

    def __init__(self, layers: int, experts: int, slots: int, nbytes: int = 100) -> None:
        self.resident = np.zeros(layers * experts, dtype=np.bool_)
        self.num_slots = slots
        self.expert_nbytes = nbytes
        self.issuer = _FakeIssuer()
        self.single_band = None
        self.calls: list[tuple[list[int], Band]] = []
        self.fail = False

    def is_resident(self, ids: Any) -> np.ndarray:
        return self.resident[np.asarray(ids, dtype=np.int64)]

    def resident_mask(self) -> np.ndarray:
        return self.resident.copy()

    @property
    def expert_of(self) -> np.ndarray:
        """Per slot: the expert it holds (the resident ones in id order), -1: empty."""
        ids = np.flatnonzero(self.resident)
        out = np.full(self.num_slots, -1, dtype=np.int64)
        out[: ids.size] = ids
        return out

    def free_capacity(self, protect: Any = None) -> int:
        return self.num_slots - int(self.resident.sum())

    def prefetch(self, ids: Any, band: Band = Band.ROUTE_AHEAD, **_: Any) -> np.ndarray:
        if self.fail:
            raise RuntimeError("copy engine down")
        ids = np.asarray(ids, dtype=np.int64)
        self.calls.append((ids.tolist(), Band(band)))
        self.resident[ids] = True
        return np.arange(ids.size)


def _shape(layers: int = 2, experts: int = 4) -> Any:
    class Shape:
        num_layers = layers
        num_experts = experts
        top_k = 2

    return Shape()


def test_the_planner_counts_its_own_bytes_and_failures() -> None:
    cache = _FakeCache(2, 4, slots=8)
    config = EngineConfig.preset("PD-no-stream", lookahead=False)
    planner = ExpertPrefetcher(_shape(), cache, config)  # type: ignore[arg-type]
    assert isinstance(planner, PrefetchPlanner)
    assert planner.stream is None and planner.lookahead is None
    # route-ahead: the scheduler's missing list, at most half the free slots
    planner.before_verify([np.array([0, 1, 5])], np.array([0, 1, 5]))
    assert cache.calls == [([0, 1, 5], Band.ROUTE_AHEAD)]
    assert planner.bytes_submitted == {Band.ROUTE_AHEAD: 300, Band.BACKGROUND: 0}
    # background: the routing prior's most frequent missing experts, with the
    # byte budget left (half the cache = 400 bytes, 300 used by route-ahead)
    routed = np.zeros((2, 4), dtype=np.bool_)
    routed[1, 3] = routed[0, 2] = True
    planner.observe_routing(routed)
    planner.observe_routing(routed & (np.arange(4) == 3))
    planner.background()
    assert cache.calls[-1] == ([7], Band.BACKGROUND)
    assert planner.bytes_submitted[Band.BACKGROUND] == 100
    # a busy link: no background copies
    cache.issuer.idle = False
    planner.observe_routing(routed)
    planner.background()
    assert len(cache.calls) == 2
    # a failing copy is counted, not raised
    cache.fail = True
    planner.before_verify([np.array([3])], np.array([3]))
    assert planner.failures == 1
    freq = planner.route_freq.copy()
    planner.reset_stats()
    assert planner.bytes_submitted == {Band.ROUTE_AHEAD: 0, Band.BACKGROUND: 0}
    assert planner.failures == 0
    np.testing.assert_array_equal(planner.route_freq, freq)  # what it learned stays


def test_background_on_a_full_cache_returns_before_its_timed_stage() -> None:
    cache = _FakeCache(2, 4, slots=4)
    cache.resident[[4, 5]] = True
    config = EngineConfig.preset("PD-no-stream", lookahead=False)
    planner = ExpertPrefetcher(_shape(), cache, config)  # type: ignore[arg-type]
    routed = np.zeros((2, 4), dtype=np.bool_)
    routed[1, 3] = routed[0, 2] = True
    planner.observe_routing(routed)
    # route-ahead's bytes are the step's (half the free slots: one copy) ...
    planner.before_verify([np.array([0, 1])], np.array([0, 1]))
    assert planner._step_route_ahead_bytes == 100
    # ... and with the cache full, cleared by the background's early return
    cache.resident[6] = True
    stages = dict(planner.stage_s)
    planner.background()
    assert cache.calls == [([0], Band.ROUTE_AHEAD)]
    assert planner._step_route_ahead_bytes == 0
    assert planner.stage_s.get("background_prefetch") == stages.get("background_prefetch")
    # a slot given back: the background copies into it (the prior's first)
    cache.resident[6] = False
    planner.background()
    assert cache.calls[-1] == ([2], Band.BACKGROUND)
    assert planner.stage_s["background_prefetch"] > 0.0


def test_the_planner_without_a_cache_does_nothing() -> None:
    planner = ExpertPrefetcher(_shape(), None, EngineConfig.preset("PD"))  # type: ignore[arg-type]
    planner.on_predicted([np.array([1])])
    planner.before_verify([np.array([1])], np.array([1]))
    planner.after_verify(np.ones((2, 4), dtype=np.bool_), None)
    planner.background()
    assert planner.stream is None and planner.failures == 0
    assert planner.bytes_submitted == {Band.ROUTE_AHEAD: 0, Band.BACKGROUND: 0}


# ------------------------------------------------------- offloaded engines


@pytest.fixture(scope="module")
def offloaded_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("owners")
    write_target_and_drafter(tmp, "qwen3_moe", 3)
    return tmp


def _offloaded_pd(tmp: Path, issuer: Any, slots: int = 12, full_cache: str = "auto") -> Engine:
    from pdflash.engine.drafter import load_drafter
    from pdflash.models import load_adapter
    from pdflash.routeahead import RouteAheadStats

    adapter = load_adapter(tmp / "target", device="cpu")
    cache = adapter.attach_new_cache(issuer, num_slots=slots, policy="layer_cyclic")
    config = EngineConfig.preset(
        "PD", block_size=4, max_running=3, token_budget=12, full_cache=full_cache
    )
    batcher, predictor = make_batcher_and_predictor(config, adapter)
    return Engine(
        adapter,
        config,
        drafter=load_drafter(tmp / "drafter"),
        batcher=batcher,
        predictor=predictor,
        expert_cache=cache,
        route_stats=RouteAheadStats.for_adapter(adapter),
        max_seq_len=48,
    )


def _counters(eng: Engine) -> dict[str, Any]:
    # the stream PD was built with (the PD controller may have it switched off)
    stream = eng.prefetch.built_stream
    assert stream is not None and eng.expert_cache is not None and eng.route_stats is not None
    cache_stats = eng.expert_cache.stats()  # type: ignore[attr-defined]
    return {
        "steps": eng.steps,
        "verify_forwards": eng.verify_forwards,
        "predict_s": eng.predict_s,
        "routing_trace": len(eng.routing_trace),
        "trace_kinds": len(eng.trace_kinds),
        "scheduler_us": len(eng.scheduler_us),
        "prefetch_bytes": dict(eng.prefetch_bytes),
        "prefetch_failures": eng.prefetch_failures,
        "stream": (stream.copies_submitted, stream.bytes_submitted, stream.cancelled),
        "stall_s": eng.timer.stall_s(),
        "cache_hits": cache_stats["hits"],
        "cache_misses": cache_stats["misses"],
        "route_stats_steps": eng.route_stats.snapshot().steps,  # type: ignore[attr-defined]
    }


def test_reset_stats_restores_a_fresh_engines_counters(offloaded_checkpoint: Path) -> None:
    from pdflash.h2d import H2DIssuer

    issuer = H2DIssuer(backend="host")
    try:
        fresh = _counters(_offloaded_pd(offloaded_checkpoint, issuer))
        eng = _offloaded_pd(offloaded_checkpoint, issuer)
        for n in (4, 6, 5):
            eng.add_request(list(range(1, n + 1)), max_new_tokens=9)
        eng.run_until_done(max_steps=100)
        used = _counters(eng)
        assert used["steps"] > 0 and used["verify_forwards"] > 0
        assert used["routing_trace"] > 0 and used["prefetch_bytes"][Band.ROUTE_AHEAD] > 0
        assert used["cache_misses"] > 0 and used["route_stats_steps"] > 0
        eng.reset_stats()
        assert _counters(eng) == fresh
        assert len(eng.finished) == 3  # requests are not measurements
    finally:
        issuer.close()


def test_the_streams_predicted_plan_is_set_once_per_step(offloaded_checkpoint: Path) -> None:
    from pdflash.h2d import H2DIssuer

    issuer = H2DIssuer(backend="host")
    try:
        # room for every expert, filled on demand (full_cache off: else the
        # engine fills it and runs no stream, nothing being able to miss)
        eng = _offloaded_pd(offloaded_checkpoint, issuer, slots=30, full_cache="off")
        stream = eng.stream
        assert stream is not None
        sets: list[tuple[int, str]] = []
        set_plan = stream.set_plan

        def spy(ids: Any, source: str = "predicted", **kw: Any) -> None:
            sets.append((eng.steps, source))
            set_plan(ids, source, **kw)

        stream.set_plan = spy  # type: ignore[method-assign]
        # a byte budget every batch fits: every waiting request is batched
        eng.batcher.set_byte_budget(1 << 40)  # type: ignore[attr-defined]
        for n in (4, 6):
            eng.add_request(list(range(1, n + 1)), max_new_tokens=9)
        eng.run_until_done(max_steps=100)
        predicted = [step for step, source in sets if source == "predicted"]
        assert predicted and len(predicted) == len(set(predicted))
        assert eng.prefetch_failures == 0
    finally:
        issuer.close()


def test_the_adapters_one_cache_factory(offloaded_checkpoint: Path) -> None:
    from pdflash.cache.eviction import LayerCyclicPolicy
    from pdflash.h2d import H2DIssuer
    from pdflash.models import load_adapter

    issuer = H2DIssuer(backend="host")
    try:
        adapter = load_adapter(offloaded_checkpoint / "target", device="cpu")
        first = adapter.attach_new_cache(issuer, num_slots=5, policy="layer_cyclic")
        assert isinstance(first.policy, LayerCyclicPolicy)
        assert (first.policy.num_layers, first.policy.num_experts) == (
            adapter.num_layers,
            adapter.num_experts,
        )
        assert first.num_slots == 5 and adapter.cache is first
        assert all(b.runtime is adapter.runtime for b in adapter.blocks)
        second = adapter.attach_new_cache(issuer, fraction=1.0)
        assert adapter.cache is second and second.num_slots == adapter.num_layers * (
            adapter.num_experts
        )
        adapter.detach_cache()
        assert adapter.cache is None and adapter.runtime is None
        assert all(b.runtime is None for b in adapter.blocks)
    finally:
        issuer.close()


class _Interrupt(BaseException):
    """Stands for a KeyboardInterrupt raised inside a stream callback."""


def test_an_interrupt_while_committing_rolls_back_only_the_uncommitted(
    adapter: Any, drafter: Any, hf_target: Any
) -> None:
    """The verifier decided every outcome; an interrupt while the engine
    commits request i leaves requests before i committed and rolls i.. back
    to the step's start, so stepping on is still lossless."""
    config = EngineConfig.preset("B1", block_size=4, max_running=3, token_budget=12)
    eng = Engine(adapter, config, drafter=drafter, max_seq_len=48)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (4, 6, 5)]
    armed = [False]

    def on_token(rid: int, tok: int) -> None:
        if armed[0] and rid == ids[1]:
            armed[0] = False
            raise _Interrupt()

    ids = [eng.add_request(p, max_new_tokens=10, on_token=on_token) for p in prompts]
    eng.step()  # prefill, draft, verify: every request has committed tokens
    report = StepReport()
    eng._draft_stage(report)
    outputs = [list(eng.request(r).output) for r in ids]
    lengths = [eng.kv.length(r) for r in ids]
    armed[0] = True
    batch, _ = eng._schedule_stage(report)
    assert [r.request_id for r, _ in batch] == ids
    result = eng._verify_stage(batch, None, report)
    assert result is not None
    with pytest.raises(_Interrupt):
        eng._commit_verified(result, report)
    first, second, third = (eng.request(r) for r in ids)
    assert len(first.output) > len(outputs[0])  # committed before the interrupt
    assert first.state == RequestState.DRAFT
    # the interrupt came from the callback of the interrupted request's first
    # new token (appended before its callback ran); the one after it is untouched
    assert second.output[:-1] == outputs[1] and len(second.output) == len(outputs[1]) + 1
    assert third.output == outputs[2] and third.state == RequestState.VERIFY
    assert eng.kv.length(ids[2]) == lengths[2]
    eng.run_until_done(max_steps=100)
    for rid, prompt in zip(ids, prompts, strict=True):
        assert eng.request(rid).output == greedy_reference(hf_target, prompt, 10)
