"""The planner's critical-path terms and the forward clock that measures them
(hand-checked values, fake costs; no device)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdflash.hybrid import (
    CostModelPlanner,
    ForcedHostPlanner,
    HostCostModel,
    HostExpertExecutor,
    HostExpertService,
    LinkState,
)
from pdflash.hybrid.service import ForwardClock

MS = 1e-3
IDS = np.array([10, 11, 12, 13], dtype=np.int64)
ONE_TOKEN = np.ones(4, dtype=np.int64)


def _planner(a: float = 0.5 * MS, **kw: object) -> CostModelPlanner:
    # one copy = 1 ms at 1 GB/s; the host 0.5 ms per expert
    return CostModelPlanner(HostCostModel(a, 0.0), expert_nbytes=1_000_000, **kw)  # type: ignore[arg-type]


def test_link_state_rejects_bad_terms() -> None:
    for name in ("hidden_s", "host_lead_s", "host_overhead_s"):
        with pytest.raises(ValueError, match=name):
            LinkState(1e9, **{name: -1.0})  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=name):
            LinkState(1e9, **{name: float("nan")})  # type: ignore[arg-type]


def test_copies_where_the_forward_hides_the_link() -> None:
    p = _planner()
    # 4 misses = 4 ms of link: with nothing hidden the makespan rule hosts 3
    exposed = p.plan(0, IDS, ONE_TOKEN, LinkState(1e9))
    assert exposed.host.size == 3
    # the forward's own work after the plan is 5 ms: every copy lands
    # unseen, all-COPY costs nothing and any HOST part only adds
    hidden = p.plan(0, IDS, ONE_TOKEN, LinkState(1e9, hidden_s=5 * MS))
    assert hidden.host.size == 0
    assert hidden.modeled_copy_only_s == 0.0 and hidden.modeled_s == 0.0


def test_hosts_where_the_copy_would_be_exposed() -> None:
    p = _planner()
    # 4 ms of link, 1 ms hidden: all-COPY exposes 3 ms. Host m: thread
    # 1 + 0.1 + 0.5 m, link 4 - m -> m = 2: max(2.1, 2) - 1 = 1.1 ms
    link = LinkState(1e9, hidden_s=1 * MS, host_overhead_s=0.1 * MS)
    plan = p.plan(0, IDS, ONE_TOKEN, link)
    assert plan.modeled_copy_only_s == pytest.approx(3 * MS)
    assert plan.host.size == 2
    assert plan.modeled_s == pytest.approx(1.1 * MS)


def test_overhead_larger_than_the_exposure_copies() -> None:
    p = _planner()
    # 4 ms of link, 3.5 ms hidden: 0.5 ms exposed, but a HOST part adds 0.6 ms
    link = LinkState(1e9, hidden_s=3.5 * MS, host_overhead_s=0.6 * MS)
    assert p.plan(0, IDS, ONE_TOKEN, link).host.size == 0
    # the same exposure with a cheap HOST part: one expert goes to the host
    # (m = 1: max(3.5 + 0.05 + 0.5, 3) - 3.5 = 0.55 > 0.5 - so still COPY)
    cheap = LinkState(1e9, hidden_s=3.5 * MS, host_overhead_s=0.05 * MS)
    assert p.plan(0, IDS, ONE_TOKEN, cheap).host.size == 0
    # with the host's time hidden behind the device dispatch (lead 0.5 ms):
    # m = 1 costs max(3.55, 3) - 3.5 = 0.05 ms against 0.5 ms
    lead = LinkState(1e9, hidden_s=3.5 * MS, host_overhead_s=0.05 * MS, host_lead_s=0.5 * MS)
    plan = p.plan(0, IDS, ONE_TOKEN, lead)
    assert plan.host.size == 1 and plan.modeled_s == pytest.approx(0.05 * MS)


def test_queue_ahead_counts_against_the_hidden_time() -> None:
    p = _planner()
    # 2 misses (2 ms) hide behind 3 ms of the forward's work ...
    two = IDS[:2]
    assert p.plan(0, two, ONE_TOKEN[:2], LinkState(1e9, hidden_s=3 * MS)).host.size == 0
    # ... unless 3 ms of this layer's copies are already queued ahead of
    # them: 2 ms exposed; one HOST expert: max(3 + 0.5, 4) - 3 = 1 ms
    queued = LinkState(1e9, ahead_bytes=3_000_000, hidden_s=3 * MS)
    plan = p.plan(0, two, ONE_TOKEN[:2], queued)
    assert plan.modeled_copy_only_s == pytest.approx(2 * MS)
    assert plan.host.size == 1 and plan.modeled_s == pytest.approx(1 * MS)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 8),
    host_ms=st.floats(0.05, 2.0),
    hidden_ms=st.floats(0.0, 10.0),
    overhead_ms=st.floats(0.0, 3.0),
    lead_ms=st.floats(0.0, 3.0),
    ahead=st.integers(0, 4),
)
def test_a_split_never_models_worse_than_all_copy(
    n: int, host_ms: float, hidden_ms: float, overhead_ms: float, lead_ms: float, ahead: int
) -> None:
    p = _planner(host_ms * MS, max_host_ratio=10.0)
    link = LinkState(
        1e9,
        ahead_bytes=ahead * 1_000_000,
        hidden_s=hidden_ms * MS,
        host_overhead_s=overhead_ms * MS,
        host_lead_s=lead_ms * MS,
    )
    ids = np.arange(n, dtype=np.int64)
    plan = p.plan(0, ids, np.ones(n, dtype=np.int64), link)
    copy_link = (ahead + n) * MS
    assert plan.modeled_copy_only_s == pytest.approx(max(0.0, copy_link - hidden_ms * MS))
    assert plan.modeled_s is not None and plan.modeled_copy_only_s is not None
    if plan.host.size:
        # taken only with a saving of at least margin x the layer's copy time
        assert plan.modeled_copy_only_s - plan.modeled_s > p.margin * copy_link - 1e-12
        # and never where the whole link time hides behind the forward
        assert copy_link > hidden_ms * MS
    # hosting can only help where a copy is exposed by more than the overhead
    if copy_link - hidden_ms * MS <= overhead_ms * MS:
        assert plan.host.size == 0


def test_probe_is_skipped_where_no_host_could_pay() -> None:
    # a pessimistic calibration (host 10 ms): nothing is hosted, so the
    # online planner probes every 2nd layer with misses ...
    p = _planner(10 * MS, probe_every=2, max_host_ratio=100.0)
    exposed = LinkState(1e9)
    plans = [p.plan(0, IDS, ONE_TOKEN, exposed) for _ in range(4)]
    assert [pl.host.size for pl in plans] == [0, 1, 0, 1]
    # ... but not where the copies hide behind the forward anyway
    q = _planner(10 * MS, probe_every=2, max_host_ratio=100.0)
    hidden = LinkState(1e9, hidden_s=5 * MS)
    assert all(q.plan(0, IDS, ONE_TOKEN, hidden).host.size == 0 for _ in range(6))
    assert q.decisions["probes"] == 0


def test_plan_ahead_uses_the_critical_path_terms() -> None:
    p = _planner()
    expected = np.zeros((1, 8))
    expected[0, :4] = 1.0
    resident = np.zeros((1, 8), dtype=np.bool_)
    assert p.plan_ahead(expected, resident, LinkState(1e9)).sum() == 3
    hidden = LinkState(1e9, hidden_s=5 * MS, ahead_bytes=7)
    assert p.plan_ahead(expected, resident, hidden).sum() == 0


# ------------------------------------------------------------------ the clock
def test_forward_clock_hand_checked() -> None:
    clock = ForwardClock(min_samples=2)
    assert (clock.hidden_s, clock.host_lead_s, clock.host_overhead_s) == (0.0, 0.0, 0.0)
    # one forward: routing reads end at 1.0, 4.0, 7.5; layer 1 hosts
    clock.routed(0, 0.9, 1.0)
    clock.routed(1, 3.0, 4.0)  # dispatch of layer 0: 3.0 - 1.0 = 2.0
    clock.hosted(0.25)
    clock.collected(lead_s=0.5, wait_s=0.25, overhead_s=0.25)
    clock.routed(2, 7.0, 7.5)  # layer 1: 7.0 - 4.0 - wait 0.25 - own 0.5 = 2.25
    assert clock.hidden_s == pytest.approx(2.125)
    assert clock.host_lead_s == 0.0  # one sample of two
    # the next forward starts at layer 0 again: the gap is not a dispatch
    clock.routed(0, 20.0, 20.5)
    clock.routed(1, 22.5, 23.0)  # 2.0 after a COPY-only layer
    clock.hosted(0.75)
    clock.collected(lead_s=1.5, wait_s=0.0, overhead_s=0.25)
    clock.routed(2, 26.0, 26.0)  # 26.0 - 23.0 - 1.0 = 2.0 after a HOST part
    j = clock.to_json()
    assert j["dispatch_samples"] == 4 and j["dispatch_after_host_samples"] == 2
    assert clock.hidden_s == pytest.approx(2.0)
    assert clock.host_lead_s == pytest.approx(1.0)
    # the HOST parts' own time (0.5 and 1.0), and the thread's dispatch
    # after them (2.25, 2.0) less that after COPY-only layers (2.0, 2.0)
    assert clock.host_overhead_s == pytest.approx(0.75 + 0.125)
    # layers after a HOST part take 1 s longer on the thread: counted
    clock.routed(0, 40.0, 40.0)
    clock.routed(1, 42.0, 42.0)  # 2.0 after COPY
    clock.hosted(0.0)
    clock.routed(2, 45.0, 45.0)  # 3.0 after HOST
    clock.hosted(0.0)
    clock.routed(3, 48.0, 48.0)  # 3.0 after HOST
    # after-host dispatch [2.25, 2.0, 3.0, 3.0] median 2.625, after-copy 2.0
    assert clock.host_overhead_s == pytest.approx(np.median([0.5, 1.0, 0.0, 0.0]) + 0.625)
    with pytest.raises(ValueError, match="window"):
        ForwardClock(window=0)


def _linear_executor() -> HostExpertExecutor:
    return HostExpertExecutor(
        lambda g: {"w": torch.tensor(float(g + 1))},
        lambda x, w: x * w["w"],
        dtype=torch.float32,
        workers=1,
    )


class _Cache:
    def __init__(self, n: int) -> None:
        self.slot_of = np.full(n, -1, dtype=np.int64)
        self.ticket = np.zeros(0, dtype=np.int64)


@dataclass
class _SpyPlanner(ForcedHostPlanner):
    """Every missed expert HOST; keeps the LinkState each plan was given."""

    seen: list[LinkState] = field(default_factory=list)

    def plan(self, layer, missed, tokens, link):  # type: ignore[no-untyped-def]
        self.seen.append(link)
        return super().plan(layer, missed, tokens, link)


def _spied_service(ex: HostExpertExecutor) -> tuple[HostExpertService, list[LinkState]]:
    """A service over ``ex`` whose planner records its LinkStates (the
    returned list), with a clock that reports after one sample."""
    spy = _SpyPlanner(every=1)
    svc = HostExpertService(ex, spy, num_experts=4, expert_nbytes=100, link_bytes_per_s=1e3)
    svc.clock = ForwardClock(min_samples=1)
    return svc, spy.seen


def test_service_passes_the_clock_to_the_planner_and_can_be_switched_off() -> None:
    with _linear_executor() as ex:
        svc, seen = _spied_service(ex)
        svc.critical_path = True
        cache = _Cache(12)
        ids, tok = np.array([4, 5]), np.array([1, 1])
        assert svc.split(1, ids, tok, cache, routed=(0.0, 1.0)).all()
        job = svc.start(np.array([4, 5]), torch.ones(2, 2), [1, 1])
        assert job.started_at is not None
        svc.finish(job)
        svc.split(2, ids + 4, tok, cache, routed=(3.0, 3.0))
        assert seen[0].hidden_s == 0.0  # nothing measured before the first layer
        assert seen[1].hidden_s == svc.clock.hidden_s > 0.0
        assert seen[1].host_overhead_s == svc.clock.host_overhead_s
        assert svc.describe()["critical_path"]["dispatch_samples"] == 1
        # switched off: every miss is copied, the planner is not asked,
        # nothing is planned ahead; the clock still runs
        svc.enabled = False
        n = len(seen)
        assert not svc.split(1, ids, tok, cache, routed=(10.0, 10.0)).any()
        assert len(seen) == n
        ahead = svc.plan_ahead(np.ones((2, 4)), np.zeros((2, 4), dtype=np.bool_))
        assert ahead.shape == (2, 4) and not ahead.any()
        assert svc.describe()["enabled_at_end"] is False


def test_a_sync_mark_ends_the_dispatch() -> None:
    clock = ForwardClock(min_samples=1)
    clock.routed(0, 0.0, 1.0)
    clock.sync(0.5)  # before the layer's routing read ended: not its dispatch
    clock.sync(2.0)  # the lookahead after layer 0 may wait on the device
    clock.sync(2.5)  # only the first mark counts
    clock.routed(1, 3.0, 4.0)
    assert clock.hidden_s == pytest.approx(1.0)
    # no mark and no next layer in the same forward: nothing recorded
    clock.routed(0, 9.0, 9.5)
    assert clock.to_json()["dispatch_samples"] == 1


def test_copy_samples_are_asked_for_only_while_missing() -> None:
    clock = ForwardClock(min_samples=2, sample_every=3)
    asks = [clock.wants_copy_sample() for _ in range(9)]
    assert asks == [False, False, True] * 3
    # two dispatch samples after COPY-only layers: no more asks
    clock.routed(0, 0.0, 0.0)
    clock.routed(1, 1.0, 1.0)
    clock.routed(2, 2.0, 2.0)
    assert not any(clock.wants_copy_sample() for _ in range(9))
    with pytest.raises(ValueError, match="sample_every"):
        ForwardClock(sample_every=0)


def test_the_service_copies_a_hosting_layer_to_sample_the_dispatch() -> None:
    with _linear_executor() as ex:
        svc = HostExpertService(
            ex, ForcedHostPlanner(every=1), num_experts=4, expert_nbytes=100, link_bytes_per_s=1e3
        )
        svc.clock = ForwardClock(min_samples=1, sample_every=2)
        cache = _Cache(8)
        ids, tok = np.array([4, 5]), np.array([1, 1])
        # the default plans the makespan: no layer is copied to sample the clock
        assert all(bool(svc.split(1, ids, tok, cache).any()) for _ in range(4))
        assert svc.books.copy_sampled == 0
        svc.critical_path = True
        hosted = [bool(svc.split(1, ids, tok, cache).any()) for _ in range(4)]
        assert hosted == [True, False, True, False]
        assert svc.books.copy_sampled == 2


def test_the_planner_sees_the_makespan_unless_the_critical_path_is_on() -> None:
    with _linear_executor() as ex:
        svc, seen = _spied_service(ex)
        cache = _Cache(16)
        ids, tok = np.array([4, 5]), np.array([1, 1])
        svc.split(1, ids, tok, cache, routed=(0.0, 1.0))
        svc.split(2, ids + 4, tok, cache, routed=(3.0, 3.0))
        assert svc.clock.hidden_s > 0.0  # measured ...
        assert seen[-1].hidden_s == 0.0 and seen[-1].host_overhead_s == 0.0  # ... not planned
        assert svc.describe()["critical_path_planned"] is False
        svc.critical_path = True
        svc.split(3, ids + 8, tok, cache, routed=(5.0, 5.0))
        assert seen[-1].hidden_s == svc.clock.hidden_s > 0.0
        assert svc.describe()["critical_path_planned"] is True
