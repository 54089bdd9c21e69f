"""The expert cache's native books (:mod:`pdflash_native._cachebooks`)
against their pure-Python reference (:mod:`pdflash._reference.cachebooks`).

A hypothesis state machine drives two caches, one on each implementation,
with the same calls (acquire, release, prefetch, abort, ensure_resident,
layer pins, deferred accesses, copies that land, fail or are cancelled,
refused submissions, eviction under pressure, ``CacheTooSmallError``) and
after every step compares every array, counter and error, the copies
submitted (in order, with their bands) and the policy's calls."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from hypothesis_budget import scaled

from pdflash._reference.cachebooks import CacheBooks as ReferenceBooks
from pdflash._reference.cachebooks import layer_cyclic_lru_victims as reference_victims
from pdflash.cache import ExpertCache
from pdflash.cache.eviction import LayerCyclicPolicy, make_policy
from pdflash.protocols import Band, TicketState
from pdflash_native._cachebooks import CacheBooks as NativeBooks
from pdflash_native._cachebooks import layer_cyclic_lru_victims as native_victims

LAYERS, EXPERTS, NBYTES = 3, 5, 16
NUM_IDS = LAYERS * EXPERTS
QUEUED, DONE, FAILED, CANCELLED = (
    int(TicketState.QUEUED),
    int(TicketState.DONE),
    int(TicketState.FAILED),
    int(TicketState.CANCELLED),
)


class _Source:
    num_layers, num_experts, expert_nbytes = LAYERS, EXPERTS, NBYTES

    def host_ptrs(self, flat_ids: Any) -> np.ndarray:
        return (1 << 20) + np.asarray(flat_ids, dtype=np.int64) * NBYTES


class _Issuer:
    """Records every submission (destinations relative to the cache's
    slab); copies land, fail or are cancelled only when the test says so."""

    def __init__(self) -> None:
        self.slab = 0
        self.log: list[tuple[Any, ...]] = []
        self.state: dict[int, int] = {}
        self.ticket_of_key: dict[int, int] = {}
        self.refuse_next = False

    def submit(self, src: Any, dst: Any, nbytes: Any, keys: Any, band: Band) -> np.ndarray:
        if self.refuse_next:
            self.refuse_next = False
            raise RuntimeError("submission refused")
        arrays = [np.asarray(a, dtype=np.int64).reshape(-1) for a in (src, dst, nbytes, keys)]
        self.log.append(
            (
                tuple(arrays[0].tolist()),
                tuple((arrays[1] - self.slab).tolist()),
                tuple(arrays[2].tolist()),
                tuple(arrays[3].tolist()),
                int(band),
            )
        )
        out = []
        for k in arrays[3].tolist():
            t = self.ticket_of_key.get(k)
            if t is None or self.state[t] >= DONE:
                t = len(self.state)
                self.state[t] = QUEUED
                self.ticket_of_key[k] = t
            out.append(t)
        return np.asarray(out, dtype=np.int64)

    def poll(self, tickets: Any) -> np.ndarray:
        return np.asarray([self.state[int(t)] >= DONE for t in np.asarray(tickets).reshape(-1)])

    def wait(self, tickets: Any, timeout_s: float | None = None) -> None:
        for t in np.asarray(tickets, dtype=np.int64).reshape(-1).tolist():
            if self.state[t] == QUEUED:
                self.state[t] = DONE
            elif self.state[t] > DONE:
                raise RuntimeError(f"copy {t} failed or was cancelled")

    def cancel(self, band: Band | None = None) -> int:
        return 0

    def pending(self) -> list[int]:
        return sorted(t for t, s in self.state.items() if s == QUEUED)


class _StatesIssuer(_Issuer):
    def states(self, tickets: Any) -> np.ndarray:
        return np.asarray(
            [self.state[int(t)] for t in np.asarray(tickets).reshape(-1)], dtype=np.uint8
        )


class _LoggedPolicy:
    """Wraps a policy and logs every call (arguments and victims chosen)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.log: list[tuple[Any, ...]] = []

    def reset(self, num_ids: int) -> None:
        self.log.append(("reset", num_ids))
        self.inner.reset(num_ids)

    def on_access(self, flat_ids: Any, clock: int) -> None:
        self.log.append(("access", tuple(np.asarray(flat_ids).tolist()), clock))
        self.inner.on_access(flat_ids, clock)

    def on_insert(self, flat_ids: Any, clock: int) -> None:
        self.log.append(("insert", tuple(np.asarray(flat_ids).tolist()), clock))
        self.inner.on_insert(flat_ids, clock)

    def on_evict(self, flat_ids: Any) -> None:
        self.log.append(("evict", tuple(np.asarray(flat_ids).tolist())))
        self.inner.on_evict(flat_ids)

    def victims(self, candidates: Any, n: int) -> Any:
        got = self.inner.victims(candidates, n)
        self.log.append(("victims", tuple(np.asarray(candidates).tolist()), n, tuple(got.tolist())))
        return got

    def set_predicted(self, flat_ids: Any) -> None:
        self.log.append(("predicted", tuple(np.asarray(flat_ids).tolist())))
        self.inner.set_predicted(flat_ids)

    def before_layer(self, layer: int) -> None:
        self.inner.before_layer(layer)


def _policy(name: str) -> Any:
    if name == "layer_cyclic":
        return LayerCyclicPolicy(LAYERS, EXPERTS)
    return make_policy(name)


_ARRAYS = (
    "slot_of",
    "expert_of",
    "pins",
    "ticket",
    "key",
    "band",
    "used",
    "counted",
    "by_prefetch",
)
_COUNTERS = (
    "_hits",
    "_inflight_hits",
    "_bytes_used",
    "misses",
    "evictions",
    "copies",
    "bytes_in",
    "bytes_evicted_unused",
    "prefetch_bytes_in",
    "prefetch_bytes_evicted_unused",
    "prefetch_dropped",
    "failed_copies",
    "clock",
    "_next_key",
    "_deferred_ids",
    "_table_dirty",
)

ids_st = st.lists(st.integers(0, NUM_IDS - 1), max_size=6)
bad_ids_st = st.lists(st.integers(-2, NUM_IDS + 1), min_size=1, max_size=4)


def _outcome(fn: Any, cache: ExpertCache) -> Any:
    try:
        got = fn(cache)
    except Exception as exc:  # the same error, message included, on both sides
        return ("raised", type(exc).__name__, str(exc))
    if isinstance(got, tuple):
        return tuple(np.asarray(g).tolist() if isinstance(g, np.ndarray) else g for g in got)
    if isinstance(got, np.ndarray):
        return got.tolist()
    if isinstance(got, list):
        return [_outcome(lambda _c, g=g: g, cache) for g in got]
    return got


class BooksMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(["lru", "lfu", "route_ahead", "layer_cyclic"]),
        slots=st.integers(EXPERTS, EXPERTS + 4),  # small: evictions under pressure
        with_states=st.booleans(),
        single_band=st.sampled_from([None, Band.BACKGROUND]),
    )
    def setup(self, policy: str, slots: int, with_states: bool, single_band: Band | None) -> None:
        self.caches: list[ExpertCache] = []
        self.issuers: list[_Issuer] = []
        self.policies: list[_LoggedPolicy] = []
        for books in (NativeBooks, ReferenceBooks):
            issuer = _StatesIssuer() if with_states else _Issuer()
            pol = _LoggedPolicy(_policy(policy))
            cache = ExpertCache(
                _Source(),
                issuer,
                num_slots=slots,
                top_k=1,
                max_batch_tokens=EXPERTS,
                policy=pol,  # type: ignore[arg-type]
                single_band=single_band,
                books=books,
            )
            issuer.slab = cache.slab.data_ptr()
            self.caches.append(cache)
            self.issuers.append(issuer)
            self.policies.append(pol)
        self.held: list[list[int]] = []  # acquired id lists not yet released
        self.layers_pinned: list[int] = []

    def both(self, fn: Any) -> Any:
        native, reference = (_outcome(fn, c) for c in self.caches)
        assert native == reference
        return native

    # -- entry points ------------------------------------------------------

    @rule(ids=ids_st)
    def acquire(self, ids: list[int]) -> None:
        got = self.both(lambda c: c.acquire(ids))
        if not (isinstance(got, tuple) and got and got[0] == "raised"):
            self.held.append(ids)

    @rule(ids=bad_ids_st)
    def acquire_bad_ids(self, ids: list[int]) -> None:
        self.both(lambda c: c.acquire(ids))

    @rule(ids=ids_st)
    def ensure_resident(self, ids: list[int]) -> None:
        got = self.both(lambda c: c.ensure_resident(ids))
        if not (isinstance(got, tuple) and got and got[0] == "raised"):
            self.held.append(ids)

    @rule(data=st.data())
    def release_held(self, data: st.DataObject) -> None:
        if self.held:
            ids = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
            self.both(lambda c: c.release(ids))

    @rule(ids=ids_st)
    def release_any(self, ids: list[int]) -> None:  # mostly "not pinned" errors
        self.both(lambda c: c.release(ids))

    @rule(data=st.data())
    def abort_held(self, data: st.DataObject) -> None:
        if self.held:
            ids = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
            self.both(lambda c: c.abort(ids))

    @rule(
        ids=ids_st,
        band=st.sampled_from([Band.ON_DEMAND, Band.ROUTE_AHEAD, Band.BACKGROUND]),
        protect=st.one_of(st.none(), ids_st),
    )
    def prefetch(self, ids: list[int], band: Band, protect: list[int] | None) -> None:
        self.both(lambda c: c.prefetch(ids, band, protect=protect))

    @rule(protect=st.one_of(st.none(), ids_st, bad_ids_st))
    def free_capacity(self, protect: list[int] | None) -> None:
        self.both(lambda c: c.free_capacity(protect))

    @rule(layer=st.integers(0, LAYERS - 1))
    def layer_resident(self, layer: int) -> None:
        self.both(lambda c: c.layer_resident(layer))

    @rule(layer=st.integers(0, LAYERS - 1))
    def pin_layer(self, layer: int) -> None:
        got = self.both(lambda c: c.pin_layer(layer))
        if got[0] != "raised":
            self.layers_pinned.append(layer)

    @rule(layer=st.integers(0, LAYERS - 1))
    def unpin_layer(self, layer: int) -> None:
        got = self.both(lambda c: c.unpin_layer(layer))
        if not (isinstance(got, tuple) and got[0] == "raised") and layer in self.layers_pinned:
            self.layers_pinned.remove(layer)

    @rule(layers=st.lists(st.integers(0, LAYERS - 1), max_size=LAYERS + 1))  # repeats too
    def pin_and_unpin_layers(self, layers: list[int]) -> None:
        got = self.both(lambda c: c.pin_layers(layers))
        if not (isinstance(got, tuple) and got and got[0] == "raised"):
            self.both(lambda c: c.unpin_layers(layers))

    @rule(
        layer=st.integers(-1, LAYERS),
        routed=st.lists(st.integers(0, EXPERTS - 1), min_size=1, max_size=6),
    )
    def defer_access(self, layer: int, routed: list[int]) -> None:
        self.both(lambda c: c.defer_access(layer, torch.tensor(routed, dtype=torch.int64)))

    @rule(routed=st.lists(st.integers(0, EXPERTS - 1), min_size=LAYERS * 2, max_size=LAYERS * 2))
    def defer_accesses(self, routed: list[int]) -> None:
        rows = torch.tensor(routed, dtype=torch.int64).reshape(LAYERS, 2)
        self.both(lambda c: c.defer_accesses(range(LAYERS), rows))

    @rule()
    def stats(self) -> None:  # applies the deferred accesses
        self.both(lambda c: c.stats())

    @rule()
    def reset_stats(self) -> None:
        self.both(lambda c: c.reset_stats())

    @rule(layer=st.integers(0, LAYERS - 1))
    def before_layer(self, layer: int) -> None:
        for pol in self.policies:
            if isinstance(pol.inner, LayerCyclicPolicy):
                pol.before_layer(layer)

    @rule(ids=ids_st)
    def set_predicted(self, ids: list[int]) -> None:
        self.both(lambda c: c.set_predicted(ids))

    @rule()
    def drain_inflight(self) -> None:
        self.both(lambda c: c.drain_inflight())

    # -- the copies' fate --------------------------------------------------

    @rule(data=st.data(), outcome=st.sampled_from([DONE, DONE, FAILED, CANCELLED]))
    def copy_finishes(self, data: st.DataObject, outcome: int) -> None:
        pending = self.issuers[0].pending()
        assert pending == self.issuers[1].pending()
        if pending:
            t = pending[data.draw(st.integers(0, len(pending) - 1))]
            for issuer in self.issuers:
                issuer.state[t] = outcome

    @rule()
    def refuse_next_submit(self) -> None:
        for issuer in self.issuers:
            issuer.refuse_next = True

    # -- the same state after every step --------------------------------------

    @invariant()
    def same_books(self) -> None:
        if not hasattr(self, "caches"):
            return
        a, b = self.caches
        for name in _ARRAYS:
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
        for name in _COUNTERS:
            assert getattr(a, name) == getattr(b, name), name
        assert [(k, f) for k, _, f, _ in a._deferred] == [(k, f) for k, _, f, _ in b._deferred]
        for (_, ra, _, ia), (_, rb, _, ib) in zip(a._deferred, b._deferred, strict=True):
            assert torch.equal(ra, rb) and np.array_equal(ia, ib)
        assert self.issuers[0].log == self.issuers[1].log
        assert self.issuers[0].state == self.issuers[1].state
        assert self.policies[0].log == self.policies[1].log
        # the books' own invariants: slot_of and expert_of are inverse maps
        held = np.flatnonzero(a.expert_of >= 0)
        assert np.array_equal(a.slot_of[a.expert_of[held]], held)
        assert int((a.slot_of >= 0).sum()) == held.size
        assert (a.pins >= 0).all()


BooksMachine.TestCase.settings = settings(
    max_examples=scaled(200),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_native_books_equal_the_reference = BooksMachine.TestCase


# -- direct checks -----------------------------------------------------------


def _books(cls: Any, slots: int = 4) -> Any:
    arrays = dict(
        slot_of=np.full(NUM_IDS, -1, dtype=np.int64),
        expert_of=np.full(slots, -1, dtype=np.int64),
        pins=np.zeros(slots, dtype=np.int32),
        ticket=np.full(slots, -1, dtype=np.int64),
        key=np.full(slots, -1, dtype=np.int64),
        band=np.full(slots, -1, dtype=np.int64),
        used=np.zeros(slots, dtype=np.bool_),
        counted=np.zeros(slots, dtype=np.bool_),
        by_prefetch=np.zeros(slots, dtype=np.bool_),
    )
    return cls(*arrays.values(), EXPERTS), arrays


@pytest.mark.parametrize("cls", [NativeBooks, ReferenceBooks])
def test_books_write_into_the_cache_arrays_and_refuse_bad_indices(cls: Any) -> None:
    books, arrays = _books(cls)
    ids = np.asarray([3, 7], dtype=np.int64)
    books.load(ids, np.asarray([1, 2]), np.asarray([10, 11]), np.asarray([0, 1]), 1, True)
    assert arrays["slot_of"][3] == 1 and arrays["expert_of"][2] == 7
    assert arrays["counted"][1] and arrays["by_prefetch"][2] and not arrays["used"][1]
    assert books.inflight()[1].tolist() == [10, 11]
    books.load(np.asarray([4]), np.asarray([0]), np.asarray([12]), np.asarray([2]), 0, False)
    evicted = books.evict(np.asarray([0, 1], dtype=np.int64))  # never used: 2, prefetched: 1
    assert (evicted[0].tolist(), evicted[1], evicted[2]) == ([4, 3], 2, 1)
    assert arrays["slot_of"][[3, 4]].tolist() == [-1, -1] and books.free_slots(3).tolist() == [
        0,
        1,
        3,
    ]
    keys, dst, sizes = books.copy_args(np.asarray([2, 0], dtype=np.int64), 5, 1000, 16)
    assert (keys.tolist(), dst.tolist(), sizes.tolist()) == ([5, 6], [1032, 1000], [16, 16])
    assert books.evictable_ids(np.zeros(0, dtype=np.int64)).tolist() == []  # all in flight
    twice = np.asarray([7, 7], dtype=np.int64)  # as numpy's pins[slots] += 1: once
    assert books.pin_checked(twice)[0] == -1 and arrays["pins"][2] == 1
    assert books.unpin_checked(twice)[0] == -1 and arrays["pins"][2] == 0
    assert books.unpin_checked(twice)[0] == 0  # not pinned: refused
    before = {k: v.copy() for k, v in arrays.items()}
    with pytest.raises(IndexError):
        books.evict(np.asarray([0, 5], dtype=np.int64))  # slot 5 of 4
    with pytest.raises(IndexError):
        books.load(
            np.asarray([NUM_IDS]), np.asarray([0]), np.asarray([1]), np.asarray([2]), 0, False
        )
    with pytest.raises(ValueError):
        books.load(ids, np.asarray([0]), np.asarray([1]), np.asarray([2]), 0, False)
    with pytest.raises(ValueError):
        books.apply_access(0, np.asarray([EXPERTS], dtype=np.int64), np.zeros(EXPERTS, bool))
    for k, v in arrays.items():  # a refused call changed nothing
        assert np.array_equal(v, before[k]), k


def test_native_books_check_their_arrays() -> None:
    _, arrays = _books(NativeBooks)
    arrays["used"] = arrays["used"].astype(np.uint8)
    with pytest.raises(TypeError):
        NativeBooks(*arrays.values(), EXPERTS)
    _, arrays = _books(NativeBooks)
    arrays["pins"] = np.zeros(3, dtype=np.int32)
    with pytest.raises(ValueError):
        NativeBooks(*arrays.values(), EXPERTS)


def test_the_cache_fails_loudly_without_its_native_books(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib
    import sys

    from pdflash._native import NativeExtensionError

    monkeypatch.setitem(sys.modules, "pdflash_native._cachebooks", None)  # import fails
    monkeypatch.delitem(sys.modules, "pdflash.cache.expert_cache")
    with pytest.raises(NativeExtensionError, match="_cachebooks"):
        importlib.import_module("pdflash.cache.expert_cache")


@given(
    layers=st.integers(1, 5),
    experts=st.integers(1, 7),
    seed=st.integers(0, 2**16),
    n=st.integers(-1, 40),
    with_predictions=st.booleans(),
)
def test_native_layer_cyclic_victims_equal_the_reference(
    layers: int, experts: int, seed: int, n: int, with_predictions: bool
) -> None:
    rng = np.random.default_rng(seed)
    num_ids = layers * experts
    last_use = rng.integers(-1, 4, num_ids).astype(np.int64)  # few clocks: many ties
    predicted = rng.random(num_ids) < 0.3 if with_predictions else np.zeros(0, dtype=np.bool_)
    cand = rng.choice(num_ids, int(rng.integers(0, num_ids + 1)), replace=False).astype(np.int64)
    cur = int(rng.integers(0, layers))
    got = native_victims(cand, last_use, predicted, layers, experts, cur, n)
    want = reference_victims(cand, last_use, predicted, layers, experts, cur, n)
    assert got.dtype == np.int64 and got.tolist() == want.tolist()
