"""A cache with a slot for every expert (``EngineConfig.full_cache``): every
offloaded engine fills it when built, as B3's, and runs none of the parts
that only serve a miss (no predictor, no stream, no lookahead, no background
copies, no PD controller, no 2-D scheduler, no hybrid service, no adaptive
verify width: every draft verified), so PD does per step exactly what B3
does (counted: function calls and aten ops); lossless; a ``fixed:K`` width
is kept; a smaller cache, or ``full_cache="off"``, runs as configured."""

from __future__ import annotations

import functools
import gc
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from pdflash.engine import Engine, EngineConfig
from pdflash.engine.batching import (
    DeficitBatcher,
    DelegatingBatcher,
    FCFSBatcher,
    ShadowComparison,
    VerifyDemand,
)
from pdflash.engine.config import NOTHING_TO_MISS
from pdflash.engine.engine import _without_2d_scheduler
from pdflash.engine.verify_width import AdaptiveWidth, FixedWidth

from .conftest import oracle_drafts
from .test_engine_offloaded import MAX_NEW, _stack, offloaded_checkpoint

#: more slots than experts (the cache clamps to the model's count)
FULL = 1 << 20
#: the parts each preset has on that only serve a miss
MISS_PARTS = {
    "PD": set(NOTHING_TO_MISS) - {"host_experts"},
    "PD+host": set(NOTHING_TO_MISS),
    "B1": {"lookahead"},
    "B2": {"lookahead"},
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    return offloaded_checkpoint(tmp_path_factory, "gpt_oss")


def _outputs(eng: Engine, cases: list[Any]) -> list[list[int]]:
    ids = [eng.add_request(p, max_new_tokens=MAX_NEW) for p, _ in cases]
    oracle_drafts(eng, {rid: ref for rid, (_, ref) in zip(ids, cases, strict=True)}, seed=5)
    done = eng.run_until_done(max_steps=400)
    return [list(done[rid].output) for rid in ids]


def _every_expert(adapter: Any) -> int:
    return int(adapter.num_layers * adapter.num_experts)


@pytest.mark.parametrize("baseline", ["PD", "PD+host", "B1", "B2"])
def test_full_cache_is_filled_when_built_and_runs_no_miss_machinery(
    baseline: str, checkpoint: tuple[Path, list[Any]]
) -> None:
    tmp, cases = checkpoint
    eng, adapter, issuer = _stack(
        tmp, "x", baseline, cache_slots=FULL, block_size=5, max_running=2, token_budget=8
    )
    try:
        cache = adapter.cache
        assert int(cache.num_slots) == _every_expert(adapter)
        # filled before the first request, as B3's
        assert np.asarray(cache.resident_mask(), dtype=bool).all()
        filled = int(cache.stats()["bytes_in"])
        assert filled == _every_expert(adapter) * int(cache.expert_nbytes)
        state = eng.full_cache_state()
        assert state["state"] == "filled" and state["by"] == "full_cache"
        assert set(state["switched_off"]) == MISS_PARTS[baseline]
        assert all(state["switched_off"].values())  # each with its reason
        # none of the parts that only serve a miss is built
        assert eng.predictor is None and eng.horizon is None and eng.parts is None
        assert eng.prefetch.built_stream is None and eng.prefetch.lookahead is None
        runtime = adapter.runtime
        assert not eng.runner.routed_hooks and not runtime.route_hooks
        # PD's 2-D scheduler gives way to B3's FCFS; B2 keeps its token-only one
        want = "deficit_tokens" if baseline == "B2" else "fcfs"
        assert eng.config.batching == eng.batcher.name == want
        # PD+host's service (attached to the runtime when built) is detached
        assert eng.host_service is None and runtime.host_service is None
        assert eng.config.host_experts == "off"
        # filled in layer order: each layer's experts in one span of the slab,
        # so every layer call runs B3's all-resident path over its own window
        assert runtime.path == "grouped"
        per_layer = adapter.num_experts
        assert [runtime._resident_window(layer) for layer in range(adapter.num_layers)] == [
            (layer * per_layer, per_layer) for layer in range(adapter.num_layers)
        ]

        outputs = _outputs(eng, cases)

        # lossless: plain greedy's tokens
        assert outputs == [ref for _, ref in cases]
        stats = cache.stats()
        # nothing copied after the fill, nothing missed
        assert int(stats["bytes_in"]) == filled and stats["misses"] == 0
        # no prediction, router pass, route-ahead, stream or background work ran
        assert eng.predict_s == 0.0 and eng.timer.kind_s("predict") == 0.0
        assert eng.prefetch.stage_s == {}
        assert all(v == 0 for v in eng.prefetch_bytes.values())
        assert int(np.asarray(cache.pins).sum()) == 0
        # every layer call of every forward took the all-resident path
        recorded = runtime.resident_graphs.stats.as_dict()
        assert sum(recorded["eager"].values()) == len(eng.routing_trace) > 0
    finally:
        issuer.close()


def test_pd_at_full_cache_equals_b3_and_plain_greedy(
    checkpoint: tuple[Path, list[Any]],
) -> None:
    tmp, cases = checkpoint
    got: dict[str, list[list[int]]] = {}
    for baseline in ("PD", "B3"):
        eng, _, issuer = _stack(
            tmp, "x", baseline, cache_slots=FULL, block_size=5, max_running=2, token_budget=8
        )
        try:
            got[baseline] = _outputs(eng, cases)
        finally:
            issuer.close()
    assert got["PD"] == got["B3"] == [ref for _, ref in cases]


class _StepWork:
    """Each step's work, counted: calls of pdflash's functions (by file and
    name: ``sys.setprofile``) and aten ops (by name: every op that reaches
    the dispatcher, device syncs such as ``item()`` included)."""

    def __init__(self) -> None:
        self.steps: list[tuple[Counter[tuple[str, str]], Counter[str]]] = []

    def run(self, eng: Engine, cases: list[Any]) -> None:
        ids = [eng.add_request(p, max_new_tokens=MAX_NEW) for p, _ in cases]
        oracle_drafts(eng, {rid: ref for rid, (_, ref) in zip(ids, cases, strict=True)}, seed=5)
        # no collection inside a counted step: an earlier engine's finalizers
        # (its cache's, its store's) would count as this step's calls
        gc.collect()
        gc.disable()
        try:
            self._count_steps(eng)
        finally:
            gc.enable()

    def _count_steps(self, eng: Engine) -> None:
        while eng.has_work:
            calls: Counter[tuple[str, str]] = Counter()
            ops: Counter[str] = Counter()
            sys.setprofile(functools.partial(_count_call, calls))
            try:
                with _OpCounter(ops):
                    eng.step()
            finally:
                sys.setprofile(None)
            self.steps.append((calls, ops))
            assert len(self.steps) < 400


def _count_call(calls: Counter[tuple[str, str]], frame: FrameType, event: str, arg: Any) -> None:
    code = frame.f_code
    if event == "call" and "pdflash" in code.co_filename:
        calls[(code.co_filename.rsplit("pdflash", 1)[-1], code.co_name)] += 1


class _OpCounter(TorchDispatchMode):
    def __init__(self, ops: Counter[str]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("baseline", ["PD", "PD+host", "B1"])
def test_at_full_cache_each_step_does_what_b3_does(
    baseline: str, checkpoint: tuple[Path, list[Any]]
) -> None:
    """Per step, the same calls of pdflash's functions and the same aten ops
    as B3 (so the same host syncs): nothing but B3's work, no scheduler,
    hook, timing or host-service call of its own."""
    tmp, cases = checkpoint

    def work(label: str) -> _StepWork:
        eng, _, issuer = _stack(
            tmp, "x", label, cache_slots=FULL, block_size=5, max_running=3, token_budget=15
        )
        counted = _StepWork()
        try:
            counted.run(eng, cases)
        finally:
            issuer.close()
        return counted

    work("B3")  # first calls in the process (lazy imports, memoized lookups) land here
    label, b3 = work(baseline), work("B3")
    assert len(label.steps) == len(b3.steps) > 2
    for i, ((calls, ops), (b3_calls, b3_ops)) in enumerate(zip(label.steps, b3.steps, strict=True)):
        assert calls == b3_calls, (i, _diff(calls, b3_calls))
        assert ops == b3_ops, (i, _diff(ops, b3_ops))
    # PD at full cache without the switch-over would differ: its 2-D scheduler
    # is counted (the check sees the difference it guards against)
    if baseline == "PD":
        eng, _, issuer = _stack(
            tmp, "x", "PD", cache_slots=FULL, block_size=5, max_running=3, token_budget=15
        )
        try:
            eng.batcher = DeficitBatcher(
                token_budget=15,
                byte_budget=1 << 30,
                num_layers=eng.adapter.num_layers,
                num_experts=eng.adapter.num_experts,
                expert_nbytes=1,
            )
            with_2d = _StepWork()
            with_2d.run(eng, cases)
        finally:
            issuer.close()
        scheduler_calls = sum(
            n for (path, _), n in with_2d.steps[-1][0].items() if "scheduler" in path
        )
        assert scheduler_calls > 0


def _diff(a: Counter[Any], b: Counter[Any]) -> dict[Any, tuple[int, int]]:
    return {k: (a[k], b[k]) for k in set(a) | set(b) if a[k] != b[k]}


def test_a_2d_batcher_gives_way_to_fcfs_and_a_wrapper_keeps_wrapping() -> None:
    def deficit(byte_budget: int | None) -> DeficitBatcher:
        return DeficitBatcher(
            token_budget=8, byte_budget=byte_budget, num_layers=2, num_experts=4, expert_nbytes=1
        )

    assert _without_2d_scheduler(None, 8) is None
    assert _without_2d_scheduler(deficit(100), 8) is None  # the engine builds FCFS
    token_only = deficit(None)
    assert _without_2d_scheduler(token_only, 8) is token_only
    fcfs = FCFSBatcher(8)
    assert _without_2d_scheduler(fcfs, 8) is fcfs

    class Wrapper:  # a DelegatingBatcher, e.g. expert-parallel ranks' ExpertParallelBatcher
        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.name = inner.name
            self.swaps = 0

        def with_inner(self, inner: Any) -> Wrapper:
            self.inner, self.name = inner, inner.name
            self.swaps += 1
            return self

        def add(self, request_id: int, weight: float = 1.0) -> None: ...

        def remove(self, request_id: int) -> None: ...

        def select(self, demands: Any, resident: Any) -> Any: ...

    wrapped = Wrapper(deficit(100))
    assert isinstance(wrapped, DelegatingBatcher)
    kept: Any = _without_2d_scheduler(wrapped, 8)
    assert kept is wrapped and isinstance(kept.inner, FCFSBatcher) and kept.name == "fcfs"
    assert kept.inner.token_budget == 8 and wrapped.swaps == 1
    # one delegating to a batcher that runs no 2-D scheduler is kept as it is
    plain = Wrapper(token_only)
    assert _without_2d_scheduler(plain, 8) is plain and plain.swaps == 0
    # nested: the inner one delegates too, FCFS innermost
    nested = Wrapper(Wrapper(deficit(100)))
    assert _without_2d_scheduler(nested, 8) is nested and nested.name == "fcfs"
    assert isinstance(nested.inner.inner, FCFSBatcher)

    class Opaque:  # an ``inner`` without the seam: never changed behind its back
        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.name = inner.name

        def add(self, request_id: int, weight: float = 1.0) -> None: ...

        def remove(self, request_id: int) -> None: ...

        def select(self, demands: Any, resident: Any) -> Any: ...

    opaque = Opaque(deficit(100))
    with pytest.raises(ValueError, match="Opaque still runs the 2-D deficit scheduler"):
        _without_2d_scheduler(opaque, 8)
    assert opaque.inner.name == "deficit_2d"
    # anything else that would still run the 2-D scheduler is refused
    shadow = ShadowComparison(deficit(100), deficit(None), 1)
    with pytest.raises(ValueError, match="2-D deficit scheduler"):
        _without_2d_scheduler(shadow, 8)


def test_expert_parallel_batcher_delegates_through_the_seam() -> None:
    """ExpertParallelBatcher is a DelegatingBatcher: at a full cache it keeps
    wrapping (the same object: the caller keeps reading its books), FCFS
    inside; once it has run a step its inner batcher stays."""
    from pdflash.distributed import (
        BusiestRankByteCost,
        ExpertParallelBatcher,
        RoundRobinPlacement,
    )

    class View:
        def sync_residency(self) -> Any:
            return np.ones((2, 4), dtype=np.bool_)

    inner = DeficitBatcher(
        token_budget=8, byte_budget=100, num_layers=2, num_experts=4, expert_nbytes=1
    )
    cost = BusiestRankByteCost(RoundRobinPlacement(2, 4, 2), 1)
    ep = ExpertParallelBatcher(inner, View(), cost)  # type: ignore[arg-type]
    assert isinstance(ep, DelegatingBatcher) and ep.name == "deficit_2d"
    assert _without_2d_scheduler(ep, 8) is ep
    assert isinstance(ep.inner, FCFSBatcher) and ep.name == "fcfs"
    assert ep.inner.token_budget == 8
    ep.add(1)
    ep.select([VerifyDemand(1, 3)], None)
    with pytest.raises(RuntimeError, match="after a step"):
        ep.with_inner(FCFSBatcher(4))
    assert ep.inner.token_budget == 8


def test_full_cache_off_runs_pd_as_configured(checkpoint: tuple[Path, list[Any]]) -> None:
    """The A/B arm: the cache fills on demand, PD's parts run."""
    tmp, cases = checkpoint
    eng, adapter, issuer = _stack(
        tmp,
        "x",
        "PD",
        cache_slots=FULL,
        block_size=5,
        max_running=2,
        token_budget=8,
        full_cache="off",
    )
    try:
        assert not np.asarray(adapter.cache.resident_mask(), dtype=bool).any()
        state = eng.full_cache_state()
        assert state["state"] == "off" and "full_cache off" in state["why_off"]
        assert eng.predictor is not None and eng.parts is not None
        assert eng.config == EngineConfig.preset(
            "PD", block_size=5, max_running=2, token_budget=8, full_cache="off"
        )
        assert _outputs(eng, cases) == [ref for _, ref in cases]
        assert adapter.cache.stats()["misses"] > 0
        assert "route_ahead" in eng.prefetch.stage_s
    finally:
        issuer.close()


def test_half_cache_runs_pd_unchanged(checkpoint: tuple[Path, list[Any]]) -> None:
    tmp, cases = checkpoint
    probe, adapter, issuer = _stack(tmp, "x", "B3", cache_slots=FULL)
    issuer.close()
    half = _every_expert(adapter) // 2
    eng, adapter, issuer = _stack(
        tmp, "x", "PD", cache_slots=half, block_size=5, max_running=2, token_budget=8
    )
    try:
        # not filled, nothing switched off: the preset as given
        assert not np.asarray(adapter.cache.resident_mask(), dtype=bool).any()
        assert eng.config == EngineConfig.preset("PD", block_size=5, max_running=2, token_budget=8)
        state = eng.full_cache_state()
        assert state["state"] == "off"
        assert state["why_off"] == (
            f"the expert cache has {half} slots for {_every_expert(adapter)} experts"
        )
        assert eng.predictor is not None and eng.parts is not None
        assert eng.prefetch.built_stream is not None
        assert _outputs(eng, cases) == [ref for _, ref in cases]
        assert "route_ahead" in eng.prefetch.stage_s and eng.timer.kind_s("predict") > 0
    finally:
        issuer.close()
    del probe


def test_b3_state_and_config_validation() -> None:
    with pytest.raises(ValueError, match="full_cache"):
        EngineConfig(full_cache="on")
    pd = EngineConfig.preset("PD+host", byte_budget=1 << 20)
    cfg, off = pd.without_miss_parts()
    assert set(off) == set(NOTHING_TO_MISS)
    flags = set(NOTHING_TO_MISS) - {"scheduler_2d", "host_experts", "verify_width"}
    assert not any(getattr(cfg, part) for part in flags)
    # the 2-D scheduler gives way to B3's FCFS, the host service is off, and
    # PD's adaptive width verifies every draft
    assert pd.verify_width == "adaptive"
    assert cfg.batching == "fcfs" and cfg.byte_budget is None
    assert cfg.host_experts == "off" and cfg.verify_width == "full"
    # what differs from B3's configuration is the label and B3's own switch
    b3 = EngineConfig.preset("B3")
    assert cfg.replace(baseline="B3", all_resident=True) == b3
    _, pd_off = EngineConfig.preset("PD").without_miss_parts()
    assert set(pd_off) == set(NOTHING_TO_MISS) - {"host_experts"}
    b3_cfg, none = b3.without_miss_parts()
    assert none == {} and b3_cfg == b3
    # a width asked for, fixed:K, is kept; full stays full
    for width in ("fixed:2", "full"):
        kept, kept_off = EngineConfig.preset("PD", verify_width=width).without_miss_parts()
        assert kept.verify_width == width and "verify_width" not in kept_off
    # the full-width arm differs from PD only by its label there
    full_arm, full_arm_off = EngineConfig.preset("PD-full-width").without_miss_parts()
    assert full_arm == cfg.replace(baseline="PD-full-width", host_experts="off")
    assert set(full_arm_off) == set(pd_off) - {"verify_width"}
    # B2's token-only scheduler is its own part: kept
    b2, b2_off = EngineConfig.preset("B2").without_miss_parts()
    assert b2.batching == "deficit_tokens" and set(b2_off) == {"lookahead"}


def test_an_adaptive_width_verifies_every_draft_at_a_full_cache(
    checkpoint: tuple[Path, list[Any]],
) -> None:
    """PD's adaptive width narrows a verify only to save copies; where every
    expert is resident there is none to save: no width policy runs (every
    draft verified, as B3's), and the state says why. ``fixed:K`` was asked
    for: kept. A smaller cache, or ``full_cache="off"``, keeps the adaptive
    width."""
    tmp, cases = checkpoint
    sizes = {"block_size": 5, "max_running": 2, "token_budget": 8}
    assert EngineConfig.preset("PD").verify_width == "adaptive"
    eng, adapter, issuer = _stack(tmp, "x", "PD", cache_slots=FULL, **sizes)
    try:
        assert eng.config.verify_width == "full" and eng.width is None
        why = eng.full_cache_state()["switched_off"]["verify_width"]
        assert why == NOTHING_TO_MISS["verify_width"] and "every draft" in why
        assert _outputs(eng, cases) == [ref for _, ref in cases]
    finally:
        issuer.close()
    half = _every_expert(adapter) // 2
    for slots, full_cache in ((FULL, "off"), (half, "auto")):
        eng, _, issuer = _stack(tmp, "x", "PD", cache_slots=slots, full_cache=full_cache, **sizes)
        try:
            assert eng.config.verify_width == "adaptive"
            assert eng.width is not None and isinstance(eng.width.policy, AdaptiveWidth)
            assert "verify_width" not in eng.full_cache_state().get("switched_off", {})
        finally:
            issuer.close()
    # fixed:K: the engine keeps the width it was asked for
    eng, _, issuer = _stack(tmp, "x", "PD", cache_slots=FULL, verify_width="fixed:2", **sizes)
    try:
        assert eng.config.verify_width == "fixed:2"
        assert "verify_width" not in eng.full_cache_state()["switched_off"]
        assert eng.width is not None and isinstance(eng.width.policy, FixedWidth)
        assert _outputs(eng, cases) == [ref for _, ref in cases]
        stats = eng.width.policy.stats()
        assert stats["decisions"] > 0 and stats["mean_width_drafts"] <= 2
    finally:
        issuer.close()


def test_a_passed_timing_driven_width_policy_is_dropped_at_a_full_cache(
    checkpoint: tuple[Path, list[Any]],
) -> None:
    """A width policy handed to the engine (as a controller is): one that
    decides from measured timing is not used where nothing can miss (the
    reason recorded even where the configuration said ``full``); a
    ``fixed:K`` one is kept."""
    tmp, cases = checkpoint
    sizes = {"block_size": 5, "max_running": 2, "token_budget": 8}
    adaptive = AdaptiveWidth(block_size=5, num_layers=4, num_experts=8, top_k=2, expert_bytes=1)
    eng, _, issuer = _stack(tmp, "x", "PD-full-width", cache_slots=FULL, width=adaptive, **sizes)
    try:
        assert eng.width is None
        assert "verify_width" in eng.full_cache_state()["switched_off"]
    finally:
        issuer.close()
    fixed = FixedWidth(1, 5)
    eng, _, issuer = _stack(tmp, "x", "PD", cache_slots=FULL, width=fixed, **sizes)
    try:
        # the passed fixed policy is what the caller asked for: it runs,
        # and nothing says the width was switched off
        assert eng.width is not None and eng.width.policy is fixed
        assert "verify_width" not in eng.full_cache_state()["switched_off"]
        assert _outputs(eng, cases) == [ref for _, ref in cases]
        assert fixed.stats()["mean_width_drafts"] <= 1
    finally:
        issuer.close()
