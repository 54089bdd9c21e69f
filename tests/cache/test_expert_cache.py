"""ExpertCache: sizing, pins, eviction policies, prefetch bands, counters."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from issuer_fixtures import PatternExperts

from pdflash.cache import (
    CacheTooSmallError,
    ExpertCache,
    LFUPolicy,
    LRUPolicy,
    RouteAheadPolicy,
    make_policy,
)
from pdflash.metrics import NotMeasured
from pdflash.protocols import Band, CopyIssuer

NBYTES = 64


class Source(PatternExperts):
    """Experts with recognisable bytes: expert g is filled with g % 251."""

    def __init__(self, layers: int = 3, experts: int = 4) -> None:
        super().__init__(layers, experts, NBYTES)


def _cache(issuer: Any, slots: int = 4, **kw: Any) -> ExpertCache:
    kw.setdefault("top_k", 2)
    kw.setdefault("max_batch_tokens", 1)
    return ExpertCache(Source(), issuer, num_slots=slots, **kw)


def test_fake_issuer_satisfies_the_protocol(fake_issuer: Any) -> None:
    assert isinstance(fake_issuer, CopyIssuer)


def test_sizing_by_bytes_fraction_and_too_small(fake_issuer: Any) -> None:
    src = Source()
    assert (
        ExpertCache(
            src, fake_issuer, capacity_bytes=5 * NBYTES + 7, top_k=2, max_batch_tokens=1
        ).num_slots
        == 5
    )
    assert ExpertCache(src, fake_issuer, fraction=0.5, top_k=2, max_batch_tokens=1).num_slots == 6
    assert ExpertCache(src, fake_issuer, fraction=1.0, top_k=4, max_batch_tokens=99).num_slots == 12
    with pytest.raises(
        CacheTooSmallError,
        match=r"3 slots .* needs min\(num_experts=4, top_k=2 x max_batch_tokens=2\) = 4 slots",
    ):
        ExpertCache(src, fake_issuer, num_slots=3, top_k=2, max_batch_tokens=2)
    with pytest.raises(ValueError, match="exactly one"):
        ExpertCache(src, fake_issuer, num_slots=3, fraction=0.5, top_k=2)
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\]"):
        ExpertCache(src, fake_issuer, fraction=1.5, top_k=2)


def test_ensure_resident_copies_the_right_bytes_and_counts(fake_issuer: Any) -> None:
    cache = _cache(fake_issuer)
    slots = cache.ensure_resident([5, 2])
    for g, s in zip([5, 2], slots.tolist(), strict=True):
        assert torch.all(cache.slot_tensor(s) == g)
    assert [b for _, b in fake_issuer.submitted] == [Band.ON_DEMAND] * 2
    cache.release([5, 2])
    cache.ensure_resident([2, 7])
    cache.release([2, 7])
    st_ = cache.stats()
    assert (st_["hits"], st_["misses"], st_["copies"], st_["bytes_in"]) == (1, 3, 3, 3 * NBYTES)
    assert st_["hit_rate"] == pytest.approx(0.25)
    assert st_["useful_byte_fraction"] == pytest.approx(1.0)


def test_reset_stats_keeps_earlier_copies_out_of_the_byte_books(fake_issuer: Any) -> None:
    # Regression: an expert copied before reset_stats() and used after it
    # counted in bytes_used but not in bytes_in (useful_byte_fraction > 1).
    cache = _cache(fake_issuer)
    cache.prefetch([0, 1], Band.ROUTE_AHEAD)
    fake_issuer.wait(cache.ticket[cache.ticket >= 0])
    cache.reset_stats()
    cache.ensure_resident([0, 2])  # 0 was copied before the reset; 2 after
    cache.release([0, 2])
    cache.ensure_resident([3, 4, 5])  # evicts 1 (never used, copied before the reset)
    cache.release([3, 4, 5])
    st_ = cache.stats()
    assert st_["bytes_in"] == 4 * NBYTES and st_["bytes_used"] == 4 * NBYTES
    assert st_["bytes_evicted_unused"] == 0
    assert st_["useful_byte_fraction"] == pytest.approx(1.0)


def test_empty_ratios_are_not_measured(fake_issuer: Any) -> None:
    st_ = _cache(fake_issuer).stats()
    assert isinstance(st_["hit_rate"], NotMeasured) and isinstance(
        st_["useful_byte_fraction"], NotMeasured
    )


def test_pinned_experts_are_never_evicted_and_overflow_is_rejected(fake_issuer: Any) -> None:
    cache = _cache(fake_issuer)
    cache.ensure_resident([0, 1, 2])  # pinned
    before = (cache.slot_of.copy(), cache.pins.copy(), cache.misses)
    with pytest.raises(CacheTooSmallError, match="2 distinct experts requested but only 1"):
        cache.ensure_resident([3, 4])
    assert np.array_equal(cache.slot_of, before[0]) and np.array_equal(cache.pins, before[1])
    assert cache.misses == before[2]  # state unchanged by the rejected call
    cache.ensure_resident([3])
    cache.release([3])
    cache.ensure_resident([4])  # must evict 3, the only unpinned expert
    assert cache.is_resident([0, 1, 2, 4]).all() and not cache.is_resident([3])[0]
    with pytest.raises(ValueError, match="expert 9 is not pinned"):
        cache.release([9])


def test_lru_evicts_least_recently_used(fake_issuer: Any) -> None:
    cache = _cache(fake_issuer, policy="lru")
    for g in [0, 1, 2, 3]:
        cache.ensure_resident([g])
        cache.release([g])
    cache.ensure_resident([0])
    cache.release([0])
    cache.ensure_resident([4])
    assert not cache.is_resident([1])[0] and cache.is_resident([0, 2, 3, 4]).all()


def test_lfu_evicts_least_frequently_used(fake_issuer: Any) -> None:
    cache = _cache(fake_issuer, policy=LFUPolicy())
    for g, times in [(0, 3), (1, 1), (2, 2), (3, 2)]:
        for _ in range(times):
            cache.ensure_resident([g])
            cache.release([g])
    cache.ensure_resident([4])
    assert not cache.is_resident([1])[0]


def test_route_ahead_policy_protects_predicted(fake_issuer: Any) -> None:
    policy = RouteAheadPolicy(LRUPolicy())
    cache = _cache(fake_issuer, policy=policy)
    for g in [0, 1, 2, 3]:
        cache.ensure_resident([g])
        cache.release([g])
    cache.set_predicted([0, 1])
    cache.ensure_resident([4])  # LRU alone would evict 0
    assert not cache.is_resident([2])[0] and cache.is_resident([0, 1]).all()
    cache.release([4])
    cache.set_predicted([0, 1, 3, 4])
    cache.ensure_resident([5])  # everything unpinned is predicted: falls back to LRU order
    assert not cache.is_resident([0])[0]
    with pytest.raises(TypeError, match="does not take predictions"):
        _cache(fake_issuer, policy="lfu").set_predicted([1])
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        make_policy("mru")


def test_a_wait_on_a_miss_copy_is_told_from_a_wait_on_prefetches(fake_issuer: Any) -> None:
    cache = _cache(fake_issuer)
    ahead = cache.prefetch([1, 2], Band.ROUTE_AHEAD)
    _, tickets = cache.acquire([2, 3])  # 2 in flight from the prefetch, 3 missing
    assert tickets[0] == ahead[1] and tickets[1] not in ahead
    assert cache.miss_copies(tickets).tolist() == [False, True]
    assert not cache.miss_copies(ahead).any()
    assert cache.miss_copies([-1, tickets[1]]).tolist() == [False, True]
    cache.release([2, 3])


def test_prefetch_then_on_demand_promotes_the_same_copy(fake_issuer: Any) -> None:
    cache = _cache(fake_issuer)
    tickets = cache.prefetch([1, 2], Band.ROUTE_AHEAD)
    assert (tickets >= 0).all() and not fake_issuer.poll(tickets).any()  # in flight
    slots = cache.ensure_resident([2])
    assert torch.all(cache.slot_tensor(int(slots[0])) == 2)
    key2 = fake_issuer.submitted[1][0]
    assert fake_issuer.submitted[-1] == (key2, Band.ON_DEMAND)  # promoted, not a new key
    assert cache.copies == 2 and cache.hits == 1 and cache.inflight_hits == 1
    cache.release([2])
    # resident and done: prefetch returns -1 and copies nothing
    assert cache.prefetch([2]).tolist() == [-1]
    assert cache.copies == 2


def test_prefetch_never_evicts_pinned_or_inflight_and_counts_waste(fake_issuer: Any) -> None:
    cache = _cache(fake_issuer)
    cache.ensure_resident([0, 1])
    cache.prefetch([2, 3], Band.BACKGROUND)  # fills the cache; in flight
    t = cache.prefetch([4, 5], Band.ROUTE_AHEAD)
    assert t.tolist() == [-1, -1] and cache.prefetch_dropped == 2
    fake_issuer.wait(cache.ticket[cache.ticket >= 0])
    t = cache.prefetch([4], Band.ROUTE_AHEAD)  # now 2 or 3 may go (done, unpinned, never used)
    assert t[0] >= 0 and cache.evictions == 1
    assert cache.bytes_evicted_unused == NBYTES and cache.prefetch_bytes_evicted_unused == NBYTES
    assert cache.stats()["useful_byte_fraction"] == pytest.approx(2 / 5)


def test_failed_copy_leaves_no_pin_and_no_residency(fake_issuer: Any) -> None:
    cache = _cache(fake_issuer)
    fake_issuer.fail_keys.add(0)
    with pytest.raises(RuntimeError, match="copy 0 failed"):
        cache.ensure_resident([6])
    assert not cache.is_resident([6])[0] and int(cache.pins.sum()) == 0
    fake_issuer.fail_keys.clear()
    slots = cache.ensure_resident([6])
    assert torch.all(cache.slot_tensor(int(slots[0])) == 6)


def test_out_of_range_ids(fake_issuer: Any) -> None:
    cache = _cache(fake_issuer)
    with pytest.raises(ValueError, match=r"expert id 12 out of range \[0, 12\)"):
        cache.ensure_resident([12])
    with pytest.raises(ValueError, match="expert id -1"):
        cache.prefetch([-1])


@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["use", "prefetch", "complete", "predict"]),
            st.lists(st.integers(0, 11), min_size=1, max_size=4),
            st.sampled_from(list(Band)),
        ),
        max_size=40,
    ),
    policy=st.sampled_from(["lru", "lfu", "route_ahead"]),
    slots=st.integers(4, 8),
)
def test_cache_invariants_under_random_traffic(
    fake_issuer_cls: Any, ops: list[Any], policy: str, slots: int
) -> None:
    issuer = fake_issuer_cls()
    cache = _cache(issuer, slots=slots, policy=policy)
    pinned: list[list[int]] = []
    for op, ids, band in ops:
        if op == "use":
            before_pinned = set(cache.expert_of[cache.pins > 0].tolist())
            snapshot = (cache.slot_of.copy(), cache.pins.copy(), cache.copies, cache.hits)
            try:
                got = cache.ensure_resident(ids)
            except CacheTooSmallError:
                # rejected (pinned / in-flight slots): nothing changed
                assert np.array_equal(cache.slot_of, snapshot[0])
                assert np.array_equal(cache.pins, snapshot[1])
                assert (cache.copies, cache.hits) == snapshot[2:]
                continue
            for g, s in zip(ids, got.tolist(), strict=True):
                assert torch.all(cache.slot_tensor(s) == g)  # the right bytes, readable now
            assert before_pinned <= set(cache.expert_of[cache.pins > 0].tolist())
            pinned.append(ids)
            if len(pinned) > 2:
                cache.release(pinned.pop(0))
        elif op == "prefetch":
            pinned_before = set(cache.expert_of[cache.pins > 0].tolist())
            cache.prefetch(ids, band)
            assert pinned_before <= set(cache.expert_of[cache.pins > 0].tolist())
        elif op == "complete":
            issuer.wait(list(issuer.queue))
        elif policy == "route_ahead":
            cache.set_predicted(ids)
        # residency maps are inverse of each other
        res = np.flatnonzero(cache.slot_of >= 0)
        assert np.array_equal(cache.expert_of[cache.slot_of[res]], res)
        occupied = np.flatnonzero(cache.expert_of >= 0)
        assert np.array_equal(cache.slot_of[cache.expert_of[occupied]], occupied)
        assert (cache.pins >= 0).all() and (cache.pins[cache.expert_of < 0] == 0).all()
        assert cache.bytes_in == cache.copies * NBYTES
        assert cache.bytes_used + cache.bytes_evicted_unused <= cache.bytes_in
        assert cache.hits + cache.misses >= cache.inflight_hits


def test_cancelled_prefetch_is_fetched_again_not_read_as_garbage() -> None:
    from pdflash.h2d import H2DIssuer

    src = PatternExperts(3, 4, 1 << 20)
    # an emulated 0.2 GB/s link keeps most of the 8 MiB of prefetches queued
    issuer = H2DIssuer(
        backend="host", chunk_bytes=1 << 20, window_bytes=1 << 20, emulated_link_gbps=0.2
    )
    issuer.register_source(src.buffer.data_ptr(), src.buffer.numel())  # a valid copy source
    try:
        cache = ExpertCache(src, issuer, num_slots=8, top_k=2, max_batch_tokens=1)
        cache.prefetch(range(8), Band.ROUTE_AHEAD)
        cancelled = issuer.cancel(Band.ROUTE_AHEAD)
        slots = cache.ensure_resident(range(8))
        for g, s in enumerate(slots.tolist()):
            assert torch.all(cache.slot_tensor(s) == g)
        assert cache.failed_copies == cancelled > 0
        assert cache.misses == cancelled and cache.hits == 8 - cancelled
        cache.release(range(8))
    finally:
        issuer.close()


def test_forward_waits_for_inflight_prefetches_when_no_slot_is_free(
    tiny_checkpoints: Any, fake_issuer: Any
) -> None:
    from pdflash.models import load_adapter

    ad = load_adapter(
        tiny_checkpoints["mixtral"], issuer=fake_issuer, cache_slots=4, max_batch_tokens=2
    )
    assert ad.cache is not None
    ad.cache.prefetch([12, 13, 14, 15], Band.BACKGROUND)  # fills every slot, copies held in flight
    assert ad.cache.free_capacity() == 0
    x = torch.randn(3, ad.hidden_size)
    with torch.no_grad():
        out = ad.moe(0, x)  # layer 0 needs slots: drains the prefetches, then evicts them
        want = ad.resident_block(0)(x[None])[0]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    assert ad.cache.prefetch_bytes_evicted_unused > 0


def test_refused_submit_leaves_nothing_pinned(fake_issuer: Any) -> None:
    cache = _cache(fake_issuer)
    cache.ensure_resident([0])
    cache.release([0])

    def refuse(*_a: Any, **_k: Any) -> Any:
        raise ValueError("source 0x1 is pageable")

    fake_issuer.submit = refuse
    with pytest.raises(ValueError, match="pageable"):
        cache.ensure_resident([0, 5])
    assert int(cache.pins.sum()) == 0 and not cache.is_resident([5])[0]
    assert (cache.hits, cache.misses) == (0, 1)  # the refused call is not counted


def test_quiesce_cancels_and_waits_for_each_copy_in_flight() -> None:
    """Before a slab is freed: every queued copy cancelled, then every copy
    in flight waited for on its own, so one that fails does not skip the
    others (the transformers handle, the serving stack and the bench run all
    tear down through it)."""
    from types import SimpleNamespace

    from pdflash.cache.expert_cache import quiesce

    calls: list[object] = []

    class Issuer:
        def cancel(self, band: object = None) -> int:
            calls.append(("cancel", band))
            raise RuntimeError("issuer closed")  # a failing cancel does not stop the waits

        def wait(self, tickets: object, timeout_s: float | None = None) -> None:
            got = [int(t) for t in np.asarray(tickets)]
            calls.append(("wait", got))
            if got == [7]:
                raise RuntimeError("copy 7 failed")

    cache = SimpleNamespace(ticket=np.array([-1, 7, -1, 3, 9], dtype=np.int64))
    quiesce(Issuer(), cache)  # type: ignore[arg-type]
    assert calls == [("cancel", None), ("wait", [7]), ("wait", [3]), ("wait", [9])]
    calls.clear()
    quiesce(Issuer(), SimpleNamespace(ticket=np.full(4, -1, dtype=np.int64)))  # type: ignore[arg-type]
    assert calls == [("cancel", None)]


@pytest.mark.parametrize("settle", [False, True])
def test_settled_choices_do_not_depend_on_how_fast_copies_land(
    fake_issuer_cls: Any, settle: bool
) -> None:
    """An in-flight copy is never evictable, so the experts a prefetch or a
    miss evicts depend on which copies have landed; within ``settled()`` the
    cache waits for them first and ends with the same resident set whether
    copies land at once (eager) or only when waited for."""
    resident = []
    for eager in (True, False):
        cache = _cache(fake_issuer_cls(eager=eager), slots=4)
        with cache.settled() if settle else contextlib.nullcontext():
            cache.prefetch([0, 1, 2, 3], Band.BACKGROUND)
            cache.prefetch([4, 5], Band.BACKGROUND)  # evicts two of 0..3 once they landed
        cache.drain_inflight()
        resident.append(sorted(np.flatnonzero(cache.slot_of >= 0).tolist()))
        assert not cache.settle_copies
    if settle:
        assert resident[0] == resident[1]
    else:  # the timing dependence the settled warm-up removes
        assert resident[0] != resident[1]


def test_pin_layers_equals_pin_layer_per_layer(fake_issuer_cls: Any) -> None:
    """The one-pass pins of a replayed step against the per-layer calls they
    replace: same ids, tickets, pins, promotions; refused with nothing
    pinned when a layer is not resident."""
    caches = []
    for _ in range(2):
        cache = _cache(fake_issuer_cls(), slots=12)  # 3 layers x 4 experts
        cache.prefetch(range(12), Band.BACKGROUND)  # in flight: pinning promotes them
        caches.append(cache)
    one, loop = caches
    both = one.pin_layers(range(3))
    per = [loop.pin_layer(layer) for layer in range(3)]
    for (ids_a, t_a), (ids_b, t_b) in zip(both, per, strict=True):
        assert ids_a.tolist() == ids_b.tolist() and t_a.tolist() == t_b.tolist()
    np.testing.assert_array_equal(one.pins, loop.pins)
    np.testing.assert_array_equal(one.band, loop.band)
    assert one.all_resident() and one.layer_resident(2)
    one.unpin_layers(range(3))
    for layer in range(3):
        loop.unpin_layer(layer)
    np.testing.assert_array_equal(one.pins, loop.pins)
    assert int(one.pins.sum()) == 0
    with pytest.raises(ValueError, match="not all pinned"):
        one.unpin_layers([0])
    partial = _cache(fake_issuer_cls(), slots=8)
    partial.prefetch(range(6), Band.BACKGROUND)
    assert not partial.all_resident()
    with pytest.raises(ValueError, match="layer 1 is not fully resident"):
        partial.pin_layers(range(3))
    assert int(partial.pins.sum()) == 0


def test_defer_accesses_equals_defer_access_per_layer(fake_issuer_cls: Any) -> None:
    """One record of every layer's routing (a replayed step's books) against
    the per-layer calls it replaces: the same clock, counters (in-flight
    hits included) and policy records once flushed; a routing count that
    is not the layer count is refused with nothing recorded."""
    gen = torch.Generator().manual_seed(5)
    routing = torch.randint(0, 4, (3, 6, 2), generator=gen)
    caches = []
    for _ in range(2):
        cache = _cache(fake_issuer_cls(), slots=12, policy=LRUPolicy())
        cache.prefetch(range(8), Band.BACKGROUND)  # layers 0-1 in flight, layer 2 later
        caches.append(cache)
    one, loop = caches
    for cache in caches:
        cache.drain_inflight()
        cache.prefetch(range(8, 12), Band.BACKGROUND)  # still in flight when booked
    one.defer_accesses(range(3), routing)
    one.defer_accesses([2, 0], routing[1:])  # some layers, in any order
    for layer in range(3):
        loop.defer_access(layer, routing[layer].reshape(-1))
    for layer, r in zip([2, 0], routing[1:], strict=True):
        loop.defer_access(layer, r.reshape(-1))
    assert one.clock == loop.clock
    with pytest.raises(ValueError, match="2 routings for 3 layers"):
        one.defer_accesses(range(3), routing[:2])
    assert one.clock == loop.clock and len(one._deferred) == 2
    assert one.stats() == loop.stats()
    assert one.stats()["hits"] > 0 and one.stats()["inflight_hits"] > 0
    np.testing.assert_array_equal(one.used, loop.used)
    np.testing.assert_array_equal(one.policy.last_use, loop.policy.last_use)  # type: ignore[attr-defined]


def test_deferred_accesses_are_applied_once_they_hold_too_many_ids(
    fake_issuer_cls: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that never asks for its books (every expert resident, no stats
    read) must not keep every step's routing on the device: past
    MAX_DEFERRED_IDS the deferred records are applied, with the same books
    as applying them at the end."""
    import pdflash.cache.expert_cache as ec

    monkeypatch.setattr(ec, "MAX_DEFERRED_IDS", 20)
    gen = torch.Generator().manual_seed(7)
    routing = torch.randint(0, 4, (3, 4, 2), generator=gen)  # 8 ids per layer
    bounded = _cache(fake_issuer_cls(), slots=12, policy=LRUPolicy())
    bounded.prefetch(range(12), Band.BACKGROUND)
    bounded.drain_inflight()
    bounded.defer_accesses(range(2), routing[:2])  # 16 ids: kept
    assert len(bounded._deferred) == 1
    bounded.defer_access(2, routing[2].reshape(-1))  # 24 > 20: applied now
    assert bounded._deferred == [] and bounded._deferred_ids == 0
    bounded.defer_access(0, routing[0].reshape(-1))
    assert len(bounded._deferred) == 1
    monkeypatch.setattr(ec, "MAX_DEFERRED_IDS", 1 << 22)
    plain = _cache(fake_issuer_cls(), slots=12, policy=LRUPolicy())
    plain.prefetch(range(12), Band.BACKGROUND)
    plain.drain_inflight()
    plain.defer_accesses(range(2), routing[:2])
    plain.defer_access(2, routing[2].reshape(-1))
    plain.defer_access(0, routing[0].reshape(-1))
    assert len(plain._deferred) == 3
    assert bounded.stats() == plain.stats() and bounded.stats()["hits"] > 0
    np.testing.assert_array_equal(bounded.policy.last_use, plain.policy.last_use)  # type: ignore[attr-defined]


def test_pin_layers_ids_are_made_once_and_follow_the_owned_set(fake_issuer_cls: Any) -> None:
    """The layer ids a replayed step pins every step are read-only and
    reused; restricting the cache to a share makes them again."""
    cache = _cache(fake_issuer_cls(), slots=12)
    cache.prefetch(range(12), Band.BACKGROUND)
    first = cache.pin_layers(range(3))
    cache.unpin_layers(range(3))
    again = cache.pin_layers(range(3))
    cache.unpin_layers(range(3))
    assert all(a is b for (a, _), (b, _) in zip(first, again, strict=True))
    assert not first[0][0].flags.writeable
    per_layer, tickets = cache.pin_layers_joined(range(3))  # the same pins, joined tickets
    assert [a is b for a, (b, _) in zip(per_layer, first, strict=True)] == [True] * 3
    assert tickets.tolist() == np.concatenate([t for _, t in again]).tolist()
    assert int(cache.pins.sum()) == 12
    cache.unpin_layers(range(3))
    owned = np.zeros((3, 4), dtype=np.bool_)
    owned[:, :2] = True
    share = _cache(fake_issuer_cls(), slots=12)
    share.pin_layers([])  # nothing pinned, memo of the empty sequence
    share.restrict_to(owned)
    share.prefetch([0, 1, 4, 5, 8, 9], Band.BACKGROUND)
    got = share.pin_layers(range(3))
    assert [ids.tolist() for ids, _ in got] == [[0, 1], [4, 5], [8, 9]]
    share.unpin_layers(range(3))
    assert int(share.pins.sum()) == 0


@pytest.fixture
def one_copy_issuer() -> Any:
    """The real issuer (host backend) whose window holds one expert's copy."""
    from pdflash.h2d import H2DIssuer

    issuer = H2DIssuer(backend="host", chunk_bytes=NBYTES, window_bytes=NBYTES)
    yield issuer
    issuer.close()


def test_give_back_unstarted_frees_queued_copies_only(one_copy_issuer: Any) -> None:
    """Copies in flight and not started are cancelled and their slots freed
    (the experts absent again, their bytes in no book); a started copy, a
    pinned expert, a resident one and an absent one are left as they are."""
    from pdflash.h2d import STATE_QUEUED

    host_issuer = one_copy_issuer
    src = Source()
    host_issuer.register_source(src.buffer.data_ptr(), src.buffer.numel())
    cache = ExpertCache(src, host_issuer, num_slots=6, top_k=2, max_batch_tokens=1)
    host_issuer._native.test_hold_link(True)
    try:
        ahead = cache.prefetch([1, 2, 3, 4], Band.ROUTE_AHEAD)
        deadline = time.monotonic() + 10
        while host_issuer.states(ahead[:1])[0] == STATE_QUEUED:  # the worker takes copy 1
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert (host_issuer.states(ahead[1:]) == STATE_QUEUED).all()
        cache.acquire([4])  # pinned while in flight
        copies, bytes_in, prefetch_in = cache.copies, cache.bytes_in, cache.prefetch_bytes_in
        assert cache.unstarted_copies([1, 2, 3, 4, 7]).tolist() == [False, True, True, False, False]
        out = cache.give_back_unstarted([1, 2, 3, 4, 7])
        assert out.tolist() == [False, True, True, False, False]
        assert cache.is_resident([1, 4]).all() and not cache.is_resident([2, 3]).any()
        assert cache.given_back == 2 and cache.stats()["given_back"] == 2
        assert (cache.copies, cache.bytes_in) == (copies - 2, bytes_in - 2 * NBYTES)
        assert cache.prefetch_bytes_in == prefetch_in - 2 * NBYTES
        assert cache.give_back_unstarted([2]).tolist() == [False]  # absent now
    finally:
        host_issuer._native.test_hold_link(False)
    # a given-back expert is copied anew when a forward asks for it
    slots = cache.ensure_resident([3])
    assert torch.all(cache.slot_tensor(int(slots[0])) == 3)
    cache.release([3])
    cache.release([4])
    cache.drain_inflight()
    assert cache.failed_copies == 0
    assert not cache.give_back_unstarted([1, 3, 4]).any()  # resident: nothing to give back


def test_give_back_unstarted_needs_a_per_ticket_cancel(fake_issuer: Any) -> None:
    cache = _cache(fake_issuer)
    cache.prefetch([1, 2], Band.ROUTE_AHEAD)
    assert not cache.unstarted_copies([1, 2]).any()
    assert not cache.give_back_unstarted([1, 2]).any()
    assert cache.is_resident([1, 2]).all()
