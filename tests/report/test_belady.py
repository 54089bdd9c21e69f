"""Belady replay: hand-computed traces, exhaustive search, LRU as an upper bound."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdflash.report.belady import (
    belady,
    bytes_per_token_vs_belady,
    free_start_loads,
    lru,
    trace_metrics,
)


def brute_force_loads(
    trace: list[list[int]], slots: int, initial: frozenset[int] = frozenset()
) -> int:
    """Exhaustive optimum under the model of pdflash.report.belady: the cache
    after step t is any set of <= slots experts drawn from (resident before t)
    ∪ (step t's experts) that contains all of step t's experts when they fit;
    the step costs its experts that were not resident."""
    steps = [frozenset(s) for s in trace]

    @functools.cache
    def best(t: int, resident: frozenset[int]) -> int:
        if t == len(steps):
            return 0
        need = steps[t]
        cost = len(need - resident)
        pool = sorted(resident | need)
        options = []
        if len(need) <= slots:
            others = [g for g in pool if g not in need]
            room = slots - len(need)
            for k in range(min(room, len(others)) + 1):
                for keep in itertools.combinations(others, k):
                    options.append(need | frozenset(keep))
        else:
            for keep in itertools.combinations(pool, slots):
                options.append(frozenset(keep))
        return cost + min(best(t + 1, s) for s in options)

    return best(0, initial)


def test_classic_textbook_trace() -> None:
    # 3 slots, one expert per step: a b c d a b e a b c d e.
    # Belady: a b c miss (3), d evicts c (farthest) (4), a b hit, e evicts d... 7 loads.
    names = "abcdabeabcde"
    trace = [[ord(c) - ord("a")] for c in names]
    result = belady(trace, slots=3, expert_nbytes=10)
    assert result.loads == 7
    assert result.bytes_moved == 70
    assert result.accesses == 12
    assert result.distinct_experts == 5
    assert result.hit_rate == pytest.approx(5 / 12)
    assert lru(trace, slots=3, expert_nbytes=10).loads == 10  # LRU does worse here


def test_step_sets_are_resident_together() -> None:
    # 2 slots; step 1 needs {0, 1} together; step 2 needs {2}; step 3 {0}.
    # Step 2 must evict 0 or 1: Belady evicts 1 (never used again) -> 3 + 1 loads = 3?
    # loads: 0,1 (2), 2 (3), 0 hit -> 3.
    trace = [[0, 1], [2], [0]]
    assert belady(trace, slots=2, expert_nbytes=1).loads == 3
    assert brute_force_loads(trace, 2) == 3


def test_duplicates_in_a_step_count_once() -> None:
    trace = [np.array([3, 3, 3]), np.array([3])]
    result = belady(trace, slots=1, expert_nbytes=5)
    assert (result.loads, result.accesses) == (1, 2)


def test_oversized_step_streams_every_missing_expert() -> None:
    # 2 slots, a step of 3 experts: 3 loads; afterwards keep the 2 used soonest (1, 2).
    trace = [[0, 1, 2], [1], [2], [0]]
    assert belady(trace, slots=2, expert_nbytes=1).loads == 4
    assert brute_force_loads(trace, 2) == 4


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="slots"):
        belady([[0]], slots=0, expert_nbytes=1)
    with pytest.raises(ValueError, match="expert_nbytes"):
        belady([[0]], slots=1, expert_nbytes=-1)
    with pytest.raises(ValueError, match="negative expert id -2"):
        belady([[0], [-2]], slots=1, expert_nbytes=1)


def test_empty_trace() -> None:
    result = belady([], slots=4, expert_nbytes=8)
    assert (result.loads, result.bytes_moved, result.accesses) == (0, 0, 0)
    assert result.hit_rate is None


traces = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4), min_size=0, max_size=7)


@given(trace=traces, slots=st.integers(1, 4))
def test_belady_matches_exhaustive_search(trace: list[list[int]], slots: int) -> None:
    assert belady(trace, slots, 1).loads == brute_force_loads(trace, slots)


@given(trace=traces, slots=st.integers(1, 4))
def test_belady_never_worse_than_lru_and_at_least_compulsory(
    trace: list[list[int]], slots: int
) -> None:
    opt = belady(trace, slots, 3)
    assert opt.loads <= lru(trace, slots, 3).loads
    assert opt.loads >= opt.distinct_experts
    assert opt.bytes_moved == 3 * opt.loads


def test_long_trace_heap_path() -> None:
    # A gpt-oss-20b-shaped run: 24 layers x 32 experts, 2016 forward-layers of
    # up to 32 experts each (~40k accesses), 20% cache: exercises the heap's
    # stale-entry compaction on a realistic length (speed is for the bench).
    rng = np.random.default_rng(0)
    trace = [
        layer * 32 + np.unique(rng.integers(0, 32, size=rng.integers(4, 33)))
        for layer in np.tile(np.arange(24), 84)
    ]
    result = belady(trace, slots=154, expert_nbytes=1 << 20)
    assert result.distinct_experts == 24 * 32
    assert result.distinct_experts <= result.loads <= lru(trace, 154, 1 << 20).loads
    assert result.accesses == sum(len(s) for s in trace)


def test_initial_resident_set_hand_computed() -> None:
    # 2 slots holding {0, 1} at the start: steps {0}, {2}, {1} -> one load (2, evicting 0)
    trace = [[0], [2], [1]]
    assert belady(trace, 2, 1, initial=[0, 1]).loads == 1
    assert belady(trace, 2, 1).loads == 3
    # LRU evicts 1 (0 was just used) and then misses it: 2 loads
    assert lru(trace, 2, 1, initial=[0, 1]).loads == 2
    with pytest.raises(ValueError, match="3 experts, more than 2 slots"):
        belady(trace, 2, 1, initial=[0, 1, 2])


@given(
    trace=traces,
    slots=st.integers(1, 4),
    initial=st.frozensets(st.integers(0, 6), max_size=4),
)
def test_belady_from_a_warm_cache_matches_exhaustive_search(
    trace: list[list[int]], slots: int, initial: frozenset[int]
) -> None:
    initial = frozenset(sorted(initial)[:slots])
    assert belady(trace, slots, 1, initial=sorted(initial)).loads == brute_force_loads(
        trace, slots, initial
    )


@given(trace=traces, slots=st.integers(1, 3))
def test_free_start_is_the_best_initial_set(trace: list[list[int]], slots: int) -> None:
    # only steps that fit the cache: the streamed-step model has no free-start formula
    trace = [step for step in trace if len(set(step)) <= slots]
    universe = sorted({g for step in trace for g in step})
    best = min(
        brute_force_loads(trace, slots, frozenset(start))
        for k in range(min(slots, len(universe)) + 1)
        for start in itertools.combinations(universe, k)
    )
    assert free_start_loads(belady(trace, slots, 1)) == best


def test_trace_metrics_start_from_the_engine_cache_hand_computed() -> None:
    # 2 slots, 10-byte experts, steps {0}, {2}, {1}; 5 tokens committed.
    # From {0, 1}: one load (2, evicting 0) -> 10 B, 2 B/token. From empty: 3 loads.
    # Free start: 3 cold loads - min(2 slots, 3 distinct) = 1 load -> 10 B.
    trace = [[0], [2], [1]]
    warm = trace_metrics(trace, 2, 10, 5, initial_resident=np.array([1, 0]))
    assert warm["routed_expert_bytes"] == 30.0
    assert warm["belady_bytes"] == 10.0
    assert warm["belady_bytes_per_token"] == 2.0
    assert warm["belady_free_start_bytes"] == 10.0
    assert warm["belady_initial_state"] == "engine"
    assert warm["initial_resident_experts"] == 2
    assert "not_measured" not in warm
    cold = trace_metrics(trace, 2, 10, 5)
    assert cold["belady_bytes"] == 30.0 and cold["belady_initial_state"] == "empty"
    assert cold["initial_resident_experts"] is None
    assert cold["not_measured"] == {
        "initial_resident_experts": "the engine did not report its starting cache"
    }
    # an empty starting set is a report (the engine's cache was empty), not "empty"
    assert trace_metrics(trace, 2, 10, 5, initial_resident=[])["belady_initial_state"] == "engine"
    with pytest.raises(ValueError, match="3 experts, more than 2 slots"):
        trace_metrics(trace, 2, 10, 5, initial_resident=[0, 1, 2])


def test_trace_metrics_without_steps_or_tokens_report_why() -> None:
    empty = trace_metrics([], 4, 10, 5, initial_resident=[0])
    assert empty["routed_expert_bytes"] == 0.0 and empty["belady_bytes"] is None
    assert empty["belady_initial_state"] == "none"
    assert "empty routing trace" in empty["not_measured"]["belady_bytes"]  # type: ignore[index]
    no_tokens = trace_metrics([[0, 1]], 4, 10, 0, initial_resident=[0])
    assert no_tokens["belady_bytes"] == 10.0 and no_tokens["belady_bytes_per_token"] is None
    assert bytes_per_token_vs_belady(30.0, 20.0) == (1.5, None)
    assert bytes_per_token_vs_belady(30.0, 0.0) == (None, "Belady moves no bytes for this trace")
    assert bytes_per_token_vs_belady(None, 20.0) == (None, "bytes_per_token not measured")


def test_belady_and_lru_count_the_trace_alike() -> None:
    """Both replays report the trace's accesses (distinct per step), its
    distinct experts, the slots and loads x bytes through one accounting;
    only the loads differ by policy. Hand-computed: steps {0,1}, {1,2}, {3}
    (the repeated 1 counts once) are 5 accesses of 4 experts."""
    trace = [[0, 1], [1, 1, 2], [3]]
    for start in (None, [2]):
        opt = belady(trace, 2, 10, initial=start)
        ref = lru(trace, 2, 10, initial=start)
        for r in (opt, ref):
            assert (r.accesses, r.distinct_experts, r.slots) == (5, 4, 2)
            assert r.bytes_moved == 10 * r.loads
        assert (opt.policy, ref.policy) == ("belady", "lru")
    # empty cache: 0,1 | 2 replaces 0 | 3 replaces one: 4 loads under either
    assert belady(trace, 2, 10).loads == lru(trace, 2, 10).loads == 4
    # 3 slots holding 2 at the start: it stays for step 1, so 0, 1 and 3 load
    assert belady(trace, 3, 10, initial=[2]).loads == lru(trace, 3, 10, initial=[2]).loads == 3
    empty = lru([], 3, 10)
    assert (empty.accesses, empty.distinct_experts, empty.loads) == (0, 0, 0)
