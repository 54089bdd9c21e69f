"""The hybrid miss service's cost when it hosts nothing: a switched-off
service's split reads nothing and plans nothing, and the forward clock's
terms, computed once per change of its samples, equal the terms computed
from the samples on every read (random sequences of marks)."""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdflash.hybrid import ForcedHostPlanner
from pdflash.hybrid.planner import LinkState, MissPlan
from pdflash.hybrid.service import ForwardClock, HostExpertService


class IdleExecutor:
    """An executor that must never be asked for anything (also the stream
    split tests')."""

    workers = 1
    intra_op_threads = 1
    thread_ids: tuple[int, ...] = ()

    def submit(self, *args: Any, **kw: Any) -> Any:
        raise AssertionError("nothing is hosted")

    def close(self) -> None:
        pass


class _Cache:
    """A cache whose residency a split reads (``slot_of``, ``ticket``),
    counting the reads."""

    def __init__(self, num_ids: int, held: list[int]) -> None:
        self._slot_of = np.full(num_ids, -1, dtype=np.int64)
        self._slot_of[held] = np.arange(len(held))
        self._ticket = np.full(max(1, len(held)), -1, dtype=np.int64)
        self.reads = 0

    @property
    def slot_of(self) -> np.ndarray:
        self.reads += 1
        return self._slot_of

    @property
    def ticket(self) -> np.ndarray:
        self.reads += 1
        return self._ticket


class _CountingPlanner(ForcedHostPlanner):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.plans = 0

    def plan(self, layer: int, missed: Any, tokens: Any, link: LinkState) -> MissPlan:
        self.plans += 1
        return super().plan(layer, missed, tokens, link)


def _service(planner: Any, num_experts: int = 8) -> HostExpertService:
    return HostExpertService(
        IdleExecutor(),  # type: ignore[arg-type]
        planner,
        num_experts=num_experts,
        expert_nbytes=1024,
        link_bytes_per_s=1e9,
    )


def test_a_switched_off_service_reads_and_plans_nothing() -> None:
    planner = _CountingPlanner(every=None, ids=())
    svc = _service(planner)
    cache = _Cache(4 * 8, held=[0, 1])
    ids = np.array([8, 9, 12], dtype=np.int64)  # layer 1: all missed
    tok = np.array([1, 2, 3], dtype=np.int64)
    svc.enabled = False
    out = svc.split(1, ids, tok, cache, routed=(0.0, 1e-6))
    assert out.dtype == np.bool_ and out.shape == (3,) and not out.any()
    assert planner.plans == 0 and cache.reads == 0 and svc.books.planned_layers == 0
    # the clock still hears the layer (its dispatch samples stay current)
    assert svc.clock._last is not None and svc.clock._last.layer == 1
    # on again: the same call plans (and reads the residency)
    svc.enabled = True
    assert not svc.split(1, ids, tok, cache).any()
    assert planner.plans == 1 and cache.reads > 0 and svc.books.planned_layers == 1


def test_a_switched_off_service_still_counts_an_old_ahead_plan() -> None:
    """An ahead plan made before the switch is still seen by its layer (its
    books), as before; nothing is hosted."""
    planner = _CountingPlanner(every=None, ids=())
    svc = _service(planner)
    ahead = np.zeros((4, 8), dtype=np.bool_)
    ahead[1, [0, 4]] = True
    svc._ahead = ahead
    svc.enabled = False
    out = svc.split(1, np.array([8, 12, 13]), np.array([1, 1, 1]), _Cache(32, []))
    assert not out.any() and planner.plans == 0
    assert (svc.books.ahead_seen, svc.books.ahead_routed, svc.books.ahead_hosted) == (2, 2, 0)


# ------------------------------------------------------------ the clock's terms
def _reference_terms(clock: ForwardClock) -> tuple[float, float, float]:
    """The terms computed from the samples, as the clock did on every read."""

    def med(values: list[float]) -> float:
        return float(statistics.median(values)) if len(values) >= clock.min_samples else 0.0

    dispatch = list(clock._dispatch)
    after_copy = [d for d, h in dispatch if not h]
    after_host = [d for d, h in dispatch if h]
    hidden = (
        med(after_copy) if len(after_copy) >= clock.min_samples else med([d for d, _ in dispatch])
    )
    lead = med(list(clock._lead))
    own = med(list(clock._overhead))
    if len(after_host) < clock.min_samples or len(after_copy) < clock.min_samples:
        overhead = own
    else:
        overhead = own + max(0.0, med(after_host) - med(after_copy))
    return hidden, lead, overhead


_MARK = st.tuples(
    st.sampled_from(["routed", "hosted", "collected", "sync", "read"]),
    st.integers(0, 5),
    st.floats(0.0, 1e-3),
    st.floats(0.0, 1e-3),
)


@settings(max_examples=60, deadline=None)
@given(
    marks=st.lists(_MARK, min_size=1, max_size=120),
    window=st.integers(1, 16),
    min_samples=st.integers(1, 5),
)
def test_clock_terms_equal_the_terms_recomputed_on_every_read(
    marks: list[tuple[str, int, float, float]], window: int, min_samples: int
) -> None:
    clock = ForwardClock(window=window, min_samples=min_samples)
    now = 0.0
    for kind, layer, a, b in marks:
        now += a + 1e-6
        if kind == "routed":
            clock.routed(layer, now, now + b)
            now += b
        elif kind == "hosted":
            clock.hosted(a - 5e-4)  # negative overheads clip to 0
        elif kind == "collected":
            clock.collected(a, b, a - b)
        elif kind == "sync":
            clock.sync(now)
        want = _reference_terms(clock)
        assert clock.terms() == pytest.approx(want, abs=0.0)
        assert (clock.hidden_s, clock.host_lead_s, clock.host_overhead_s) == want
        link = _service(ForcedHostPlanner(every=1)).link_state()
        assert link.hidden_s == 0.0  # the makespan planner sees no clock terms
