"""The planner's ``queue`` rule (pdflash.hybrid.planner, "The link's queue"):
synthetic link and CPU states at the gpt-oss-20b shape's scale, each against
the ``makespan`` rule as the service runs it by default (it is given the
link's rate and the layer's own copies in flight only); no device."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdflash.hybrid import CostModelPlanner, HostCostModel, HostExpertExecutor, LinkState
from pdflash.hybrid.planner import PLAN_REASONS
from pdflash.hybrid.service import ForwardClock, HostExpertService

MS = 1e-3
RATE = 52e9  # the H200 machine's link, bytes/s
NBYTES = 49_800_000  # one gpt-oss-20b bf16 expert: 0.958 ms over the link
COPY_S = NBYTES / RATE
# the host: 1.1 ms + 0.02 ms per token per expert (r ~ 1.2 at a few tokens),
# 0.3 ms round trip per hosting layer
COST = HostCostModel(1.1 * MS, 0.02 * MS, roundtrip_s=0.3 * MS)


def _planner(rule: str, **kw: object) -> CostModelPlanner:
    return CostModelPlanner(COST, NBYTES, online=False, rule=rule, **kw)  # type: ignore[arg-type]


def _ids(n: int) -> np.ndarray:
    return np.arange(100, 100 + n, dtype=np.int64)


# a compute-bound step: the forward's thread works 3.3 ms per layer, a HOST
# part costs it 1 ms of its own dispatch, the device work it does before
# asking for the host's result is 0.5 ms; nothing is queued on the link
COMPUTE_BOUND = LinkState(
    RATE, hidden_s=3.3 * MS, host_lead_s=0.5 * MS, host_overhead_s=1.0 * MS, later_s=5 * 3.3 * MS
)


def test_rule_is_checked_and_recorded() -> None:
    with pytest.raises(ValueError, match="rule"):
        _planner("fastest")
    assert _planner("queue").params()["rule"] == "queue"
    assert _planner("makespan").params()["rule"] == "makespan"
    assert _planner("queue").wants_link_queue and not _planner("makespan").wants_link_queue
    for name in ("later_s", "host_queue_s"):
        with pytest.raises(ValueError, match=name):
            LinkState(RATE, **{name: -1.0})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backlog_bytes"):
        LinkState(RATE, backlog_bytes=-1)


def test_idle_link_compute_bound_step_copies_every_miss() -> None:
    tokens = np.array([1, 2, 1], dtype=np.int64)
    # the makespan rule (as the service runs it: the link's rate only) hosts
    # one of three: 2 copies (1.9 ms) against 1.4 ms of host beat 2.9 ms
    old = _planner("makespan")
    assert old.plan(0, _ids(3), tokens, LinkState(RATE)).host.size >= 1
    # the queue rule sees the copies land within the thread's own 3.3 ms:
    # a HOST part could only add its dispatch and its wait
    new = _planner("queue")
    plan = new.plan(0, _ids(3), tokens, COMPUTE_BOUND)
    assert plan.host.size == 0 and plan.copy.size == 3
    assert plan.modeled_copy_only_s == 0.0
    assert new.decisions["copy_hidden"] == 1 and new.decisions["split"] == 0


def test_idle_link_ahead_plan_copies_every_predicted_expert() -> None:
    layers, experts = 8, 32
    exp = np.zeros((layers, experts))
    exp[:, :3] = 1.0  # three predicted, non-resident experts per layer, a token each
    res = np.zeros((layers, experts), dtype=np.bool_)
    old = _planner("makespan").plan_ahead(exp, res, LinkState(RATE))
    assert (old.sum(axis=1) >= 1).all()  # every layer plans a HOST expert
    # the queue rule follows the copies down the layers: layer i's land by
    # 2.9 (i + 1) ms, the forward reaches it after 3.3 i ms and then works
    # 3.3 ms more: every copy is there in time
    new = _planner("queue")
    assert not new.plan_ahead(exp, res, COMPUTE_BOUND).any()
    assert new.decisions["ahead_layers"] == layers == new.decisions["ahead_copy_hidden"]
    # with the per-layer work not measured yet the ahead plan is the
    # makespan rule's (nothing to follow the copies with)
    unmeasured = _planner("queue").plan_ahead(exp, res, LinkState(RATE))
    assert np.array_equal(unmeasured, old)


def test_ahead_plan_hosts_where_the_link_falls_behind_the_forward() -> None:
    layers, experts = 8, 32
    exp = np.zeros((layers, experts))
    exp[:, :12] = 2.0  # twelve predicted experts per layer: 11.5 ms of copies each
    res = np.zeros((layers, experts), dtype=np.bool_)
    # the forward works 3.3 ms per layer: the link falls behind by ~8 ms a
    # layer unless the host takes some; deeper layers find more owed ahead
    # of their copies and host more than the first
    plan = _planner("queue").plan_ahead(exp, res, COMPUTE_BOUND)
    per_layer = plan.sum(axis=1)
    assert per_layer[0] > 0 and per_layer[1:].min() > per_layer[0]
    # the makespan rule plans every layer with the link idle: fewer in all
    old = _planner("makespan").plan_ahead(exp, res, LinkState(RATE))
    assert (old.sum(axis=1) == old.sum(axis=1)[0]).all()
    assert int(plan.sum()) > int(old.sum())


def _finish_times(m: int, tokens: np.ndarray, link: LinkState) -> tuple[float, float]:
    """(the forward thread's HOST finish, the link's finish) after the plan
    hosts the ``m`` cheapest misses: the queue rule's model written out."""
    n = tokens.size
    host = COST.roundtrip_s + float(np.sort(COST.expert_s(tokens))[:m].sum()) + link.host_queue_s
    thread = link.hidden_s + link.host_overhead_s + max(0.0, host - link.host_lead_s)
    excess = max(0.0, link.backlog_bytes / RATE - link.later_s)
    return thread, link.ahead_bytes / RATE + excess + (n - m) * COPY_S


# a link-bound step: 40 ms of other layers' copies owed, 34 ms of the
# forward's own work left to hide them behind; an idle CPU
SATURATED = LinkState(
    RATE,
    hidden_s=1.0 * MS,
    host_lead_s=0.5 * MS,
    host_overhead_s=0.2 * MS,
    backlog_bytes=int(40 * MS * RATE),
    later_s=34 * MS,
)


def test_saturated_link_idle_cpu_hosts_until_the_finish_times_meet() -> None:
    tokens = np.full(8, 2, dtype=np.int64)  # a few tokens per expert
    per_expert = float(COST.expert_s(2))
    new = _planner("queue").plan(0, _ids(8), tokens, SATURATED)
    m = new.host.size
    thread, link = _finish_times(m, tokens, SATURATED)
    # balanced: one expert more or less would move the later finish past
    # the other one's, and the two are within one expert's time
    assert abs(thread - link) <= per_expert
    assert max(*_finish_times(m + 1, tokens, SATURATED)) >= max(thread, link)
    assert max(*_finish_times(m - 1, tokens, SATURATED)) >= max(thread, link)
    assert new.modeled_s == pytest.approx(max(thread, link) - SATURATED.hidden_s)
    # the makespan rule, blind to the backlog, hosts fewer and leaves the
    # link finishing far after the host
    old = _planner("makespan").plan(0, _ids(8), tokens, LinkState(RATE)).host.size
    assert old < m
    old_thread, old_link = _finish_times(old, tokens, SATURATED)
    assert old_link - old_thread > per_expert
    # the same link with the CPU pool still busy 10 ms: fewer HOST experts
    busy = LinkState(**{**SATURATED.__dict__, "host_queue_s": 10 * MS})
    assert _planner("queue").plan(0, _ids(8), tokens, busy).host.size < m


def test_many_tokens_per_expert_stay_copied_however_long_the_queue() -> None:
    # 32 tokens per expert: over max_host_tokens, the caps still hold
    tokens = np.full(8, 32, dtype=np.int64)
    p = _planner("queue")
    assert p.plan(0, _ids(8), tokens, SATURATED).host.size == 0
    assert p.decisions["copy_ineligible"] == 1


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(1, 24), min_size=1, max_size=16),
    queue_ms=st.lists(st.floats(0.0, 80.0), min_size=2, max_size=6),
    hidden_ms=st.floats(0.0, 6.0),
    lead_ms=st.floats(0.0, 2.0),
    overhead_ms=st.floats(0.0, 2.0),
    later_ms=st.floats(0.0, 30.0),
    own_inflight=st.integers(0, 4),
)
def test_host_count_is_monotone_in_the_link_queue(
    tokens: list[int],
    queue_ms: list[float],
    hidden_ms: float,
    lead_ms: float,
    overhead_ms: float,
    later_ms: float,
    own_inflight: int,
) -> None:
    tok = np.asarray(tokens, dtype=np.int64)
    counts = []
    for i, q in enumerate(sorted(queue_ms)):
        link = LinkState(
            RATE,
            # the layer's own copies in flight are queue too: grown with it
            ahead_bytes=(own_inflight + i) * NBYTES,
            hidden_s=hidden_ms * MS,
            host_lead_s=lead_ms * MS,
            host_overhead_s=overhead_ms * MS,
            backlog_bytes=int(q * MS * RATE),
            later_s=later_ms * MS,
        )
        counts.append(_planner("queue").plan(0, _ids(tok.size), tok, link).host.size)
    assert counts == sorted(counts)


def test_more_copies_in_flight_never_take_a_host_expert_back() -> None:
    # one eligible miss (3 tokens; 17 and 19 are over the token cap): hosting
    # it saves one copy however long the queue. The makespan rule takes its
    # margin of the whole queue's time, so with 7 of the layer's copies in
    # flight the same saving no longer counts; the queue rule takes it of
    # the layer's own copies and keeps the expert on the host
    tokens = np.array([3, 17, 19], dtype=np.int64)

    def hosted(rule: str) -> list[int]:
        return [
            _planner(rule)
            .plan(0, _ids(3), tokens, LinkState(RATE, ahead_bytes=k * NBYTES))
            .host.size
            for k in range(8)
        ]

    assert hosted("queue") == [1] * 8
    assert hosted("makespan")[-1] == 0 < hosted("makespan")[0]


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.lists(st.integers(1, 24), min_size=1, max_size=16),
    backlog_ms=st.floats(0.0, 80.0),
    lead_ms=st.floats(0.0, 2.0),
    overhead_ms=st.floats(0.0, 2.0),
)
def test_unmeasured_forward_plans_as_the_makespan_rule(
    tokens: list[int], backlog_ms: float, lead_ms: float, overhead_ms: float
) -> None:
    # the forward's per-layer work not measured yet (hidden_s 0), no copy of
    # the layer in flight, the pool idle: the backlog is not judged, and the
    # queue rule chooses what the makespan rule does
    tok = np.asarray(tokens, dtype=np.int64)
    link = LinkState(
        RATE,
        host_lead_s=lead_ms * MS,
        host_overhead_s=overhead_ms * MS,
        backlog_bytes=int(backlog_ms * MS * RATE),
        later_s=3 * MS,
    )
    new = _planner("queue").plan(0, _ids(tok.size), tok, link)
    old = _planner("makespan").plan(0, _ids(tok.size), tok, link)
    assert np.array_equal(new.host, old.host)


def test_a_longer_queue_moves_the_choice_to_the_host() -> None:
    # the same layer hosts nothing with the link idle and more the longer
    # the backlog (the makespan rule does not see it: the same at any length)
    tokens = np.full(8, 2, dtype=np.int64)
    counts, old = [], []
    for q in (0.0, 20.0, 40.0, 80.0):
        link = LinkState(**{**COMPUTE_BOUND.__dict__, "backlog_bytes": int(q * MS * RATE)})
        counts.append(_planner("queue").plan(0, _ids(8), tokens, link).host.size)
        old.append(_planner("makespan").plan(0, _ids(8), tokens, link).host.size)
    assert counts == sorted(counts) and counts[-1] > counts[0]
    assert len(set(old)) == 1


def test_decisions_count_every_layer_by_reason() -> None:
    p = _planner("queue")
    tokens = np.full(8, 2, dtype=np.int64)
    p.plan(0, _ids(3), tokens[:3], COMPUTE_BOUND)  # hidden
    p.plan(1, _ids(8), tokens, SATURATED)  # split
    p.plan(2, _ids(8), np.full(8, 32, dtype=np.int64), SATURATED)  # over the token cap
    p.plan(3, _ids(0), np.zeros(0, dtype=np.int64), SATURATED)  # no misses: no reason
    d = p.decisions
    assert d["layers"] == 4
    assert sum(d[r] for r in PLAN_REASONS) == 3
    assert (d["copy_hidden"], d["split"], d["copy_ineligible"]) == (1, 1, 1)


# -- the service measures the queue for the queue rule --------------------------------


class _Issuer:
    def __init__(self, done: set[int]) -> None:
        self.done = done

    def poll(self, tickets: np.ndarray) -> np.ndarray:
        return np.asarray([int(t) in self.done for t in tickets], dtype=np.bool_)


class _Cache:
    """4 layers of 4 experts, 6 slots: slots 0-3 hold copies in flight
    (tickets 0-3) of layer 0's expert 1 and layer 2's experts 0, 1, 2;
    ticket 1 has landed (not refreshed yet)."""

    num_layers = 4

    def __init__(self) -> None:
        self.slot_of = np.full(16, -1, dtype=np.int64)
        self.expert_of = np.asarray([1, 8, 9, 10, -1, -1], dtype=np.int64)
        self.slot_of[self.expert_of[:4]] = np.arange(4)
        self.ticket = np.asarray([0, 1, 2, 3, -1, -1], dtype=np.int64)
        self.issuer = _Issuer({1})


@contextmanager
def _executor() -> Iterator[HostExpertExecutor]:
    ex = HostExpertExecutor(
        lambda g: {"w": torch.tensor(float(g + 1))},
        lambda x, w: x * w["w"],
        dtype=torch.float32,
        workers=1,
    )
    try:
        yield ex
    finally:
        ex.close()


class _Spy(CostModelPlanner):
    def __init__(self, rule: str) -> None:
        super().__init__(HostCostModel(1.0, 0.0), 100, online=False, rule=rule)
        self.seen: list[LinkState] = []

    def plan(self, layer, missed, tokens, link):  # type: ignore[no-untyped-def]
        self.seen.append(link)
        return super().plan(layer, missed, tokens, link)

    def plan_ahead(self, expected_tokens, resident, link):  # type: ignore[no-untyped-def]
        self.seen.append(link)
        return super().plan_ahead(expected_tokens, resident, link)


def _measured_clock(hidden_s: float) -> ForwardClock:
    clock = ForwardClock(min_samples=2)
    for i in range(4):  # three dispatches of hidden_s after copy-only layers
        clock.routed(i, i * hidden_s, i * hidden_s)
    return clock


@pytest.mark.parametrize("rule", ["makespan", "queue"])
def test_service_measures_the_backlog_only_for_the_queue_rule(rule: str) -> None:
    with _executor() as ex:
        spy = _Spy(rule)
        svc = HostExpertService(ex, spy, num_experts=4, expert_nbytes=100, link_bytes_per_s=1e3)
        svc.clock = _measured_clock(0.5)
        cache = _Cache()
        # layer 0 routes experts 1 (in flight) and 2, 3 (missed)
        svc.split(0, np.array([1, 2, 3]), np.array([1, 1, 1]), cache)
        svc.plan_ahead(np.ones((4, 4)), np.zeros((4, 4), dtype=np.bool_))
        layer, ahead = spy.seen
        assert layer.ahead_bytes == 100  # the layer's own copy in flight, either rule
        if rule == "makespan":  # as before: the link's rate and own copies only
            assert (layer.backlog_bytes, layer.later_s, layer.hidden_s) == (0, 0.0, 0.0)
            assert (ahead.backlog_bytes, ahead.hidden_s) == (0, 0.0)
            return
        # other layers' copies still on the link: layer 2's experts 0 and 2
        # (expert 1's copy has landed; layer 0's own is ahead_bytes)
        assert layer.backlog_bytes == 200
        assert layer.hidden_s == pytest.approx(0.5)
        assert layer.later_s == pytest.approx(3 * 0.5)  # three layers after layer 0
        # before a verify: every copy still on the link
        assert ahead.backlog_bytes == 300 and ahead.ahead_bytes == 0
