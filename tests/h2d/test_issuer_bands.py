"""Band order of the native issuer (host backend) against the pure-Python
reference rule, over random submission schedules (hypothesis).

Every chunk start in the native debug log must be the one the reference
picks (most urgent band, FIFO, window admission), and every finished copy's
bytes must have arrived.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdflash._reference.issuer import (
    LOG_START,
    BandOrderModel,
    LogRecord,
    ModelViolation,
    records_from_log,
    split_piece_bytes,
)
from pdflash.h2d import (
    STATE_CANCELLED,
    STATE_DONE,
    CopyCancelledError,
    CopyFailedError,
    H2DIssuer,
    native_live_counts,
)
from pdflash.protocols import Band

pytestmark = pytest.mark.native

SLOT = 96 << 10  # each key owns a fixed src/dst slot of this size
N_KEYS = 10
N_FREE = 24  # slots for key -1 (never deduplicated) copies


class Pools:
    def __init__(self, issuer: H2DIssuer) -> None:
        n = N_KEYS + N_FREE
        self.src = issuer.pinned_array(n * SLOT)
        self.dst = issuer.pinned_array(n * SLOT)
        rng = np.random.default_rng(1)
        self.src[:] = rng.integers(0, 256, self.src.size, dtype=np.uint8)
        self.size_of_key = [int(s) for s in rng.integers(1, SLOT, N_KEYS)]
        self.free_next = 0
        self.expected: dict[int, tuple[int, int]] = {}  # ticket -> (slot, nbytes)

    def args(self, slot: int, nbytes: int) -> tuple[int, int]:
        return self.src.ctypes.data + slot * SLOT, self.dst.ctypes.data + slot * SLOT

    def check_done(self, issuer: H2DIssuer) -> int:
        tickets = np.array(sorted(self.expected), dtype=np.int64)
        if tickets.size == 0:
            return 0
        states = issuer.states(tickets)
        checked = 0
        for t, s in zip(tickets, states, strict=True):
            if s != STATE_DONE:
                continue
            slot, n = self.expected[int(t)]
            lo = slot * SLOT
            assert np.array_equal(self.dst[lo : lo + n], self.src[lo : lo + n]), int(t)
            checked += 1
        return checked


op_submit = st.tuples(
    st.just("submit"),
    st.sampled_from(list(Band)),
    st.lists(st.integers(-1, N_KEYS - 1), min_size=1, max_size=6),
)
op_cancel = st.tuples(st.just("cancel"), st.sampled_from([None, *Band]), st.just([]))
# cancel the named copies that have not started (indices into the tickets so far)
op_cancel_unstarted = st.tuples(
    st.just("cancel_unstarted"), st.none(), st.lists(st.integers(0, 63), min_size=1, max_size=4)
)
op_hold = st.tuples(st.just("hold"), st.booleans(), st.just([]))
op_sleep = st.tuples(st.just("sleep"), st.integers(0, 3), st.just([]))
op_fail = st.tuples(st.just("fail"), st.integers(1, 2), st.just([]))
schedules = st.lists(
    st.one_of(op_submit, op_cancel, op_cancel_unstarted, op_hold, op_sleep, op_fail), max_size=14
)
configs = st.tuples(
    # chunk bytes; 17 KiB aligns pieces to 1 KiB, so copies split equally
    st.sampled_from([16 << 10, 17 << 10, 32 << 10, 64 << 10]),
    st.integers(1, 3),  # window in chunks
    st.integers(1, 4),  # max in-flight chunks
    st.sampled_from([0.0, 4.0, 20.0]),  # just-in-time issue lead (us); 0 = off
)


@given(schedule=schedules, config=configs)
def test_chunk_order_matches_reference_rule(schedule: list, config: tuple) -> None:
    chunk, window_chunks, max_inflight, lead_us = config
    issuer = H2DIssuer(
        backend="host",
        chunk_bytes=chunk,
        window_bytes=chunk * window_chunks,
        max_inflight_chunks=max_inflight,
        emulated_link_gbps=4.0,
        debug_log=True,
        issue_lead_us=lead_us,
    )
    try:
        pools = Pools(issuer)
        tickets: list[int] = []
        unstarted_cancels: set[int] = set()
        for op, arg, keys in schedule:
            if op == "submit":
                src, dst, nbytes, slots = [], [], [], []
                for k in keys:
                    if k < 0:
                        slot = N_KEYS + pools.free_next % N_FREE
                        pools.free_next += 1
                        n = SLOT - 7 * (slot % 5)
                    else:
                        slot, n = k, pools.size_of_key[k]
                    s, d = pools.args(slot, n)
                    src.append(s)
                    dst.append(d)
                    nbytes.append(n)
                    slots.append((slot, n))
                out = issuer.submit(src, dst, nbytes, keys, arg)
                for t, sn in zip(out.tolist(), slots, strict=True):
                    pools.expected[t] = sn
                tickets.extend(out.tolist())
            elif op == "cancel":
                issuer.cancel(arg)
            elif op == "cancel_unstarted" and tickets:
                named = np.asarray([tickets[i % len(tickets)] for i in keys], dtype=np.int64)
                done = issuer.cancel_unstarted(named)
                unstarted_cancels.update(named[done].tolist())
            elif op == "hold":
                issuer._native.test_hold_link(arg)
            elif op == "sleep":
                time.sleep(arg * 2e-4)
            elif op == "fail":
                issuer._native.test_inject_failures(arg, "injected fault")
        issuer._native.test_hold_link(False)
        for t in tickets:
            with contextlib.suppress(CopyCancelledError, CopyFailedError):
                issuer.wait([t], timeout_s=30)
        assert issuer.poll(tickets).all()
        pools.check_done(issuer)
        log = records_from_log(issuer.debug_log())
        model = BandOrderModel(chunk, chunk * window_chunks, max_inflight).replay(log)
        assert not model.copies  # every copy reached a terminal event
        # a copy cancel_unstarted cancelled never started a chunk, and ended cancelled
        started = {e.ticket for e in log if e.kind == LOG_START}
        assert not (unstarted_cancels & started)
        assert unstarted_cancels <= model.cancelled
        if unstarted_cancels:
            assert (issuer.states(sorted(unstarted_cancels)) == STATE_CANCELLED).all()
        assert not model.inflight
        stats = issuer.stats()
        assert stats["queued_copies"] == 0 and stats["queued_bytes"] == 0
        assert stats["inflight_chunks"] == 0 and stats["inflight_bytes"] == 0
    finally:
        issuer.close()


def test_reference_model_rejects_a_band_inversion() -> None:
    # A log where a BACKGROUND chunk starts while ON_DEMAND is queued must fail:
    # proves the check above can fail.
    events = [
        LogRecord(0, int(Band.BACKGROUND), 1 << 24, 1, 100, True),
        LogRecord(0, int(Band.ON_DEMAND), 2 << 24, 1, 100, True),
        LogRecord(LOG_START, int(Band.BACKGROUND), 1 << 24, 0, 100, True),
    ]
    with pytest.raises(ModelViolation, match="more urgent bands"):
        BandOrderModel(1024, 2048, 2).replay(events)


def test_reference_model_rejects_an_overfull_window() -> None:
    events = [
        LogRecord(0, 2, 1 << 24, 3, 3000, True),
        LogRecord(LOG_START, 2, 1 << 24, 0, 1024, True),
        LogRecord(LOG_START, 2, 1 << 24, 1, 1024, True),
        LogRecord(LOG_START, 2, 1 << 24, 2, 952, True),
    ]
    with pytest.raises(ModelViolation, match="full window"):
        BandOrderModel(1024, 2048, 8).replay(events)


def test_on_demand_waits_at_most_one_window() -> None:
    """Bounded delay: after an ON_DEMAND copy is submitted behind a long
    BACKGROUND backlog, no chunk other than those already in the window runs
    before it (counted in bytes from the log)."""
    chunk = 64 << 10
    window = 2 * chunk
    with H2DIssuer(
        backend="host",
        chunk_bytes=chunk,
        window_bytes=window,
        # ~6 ms of backlog: it outlasts the 2 ms sleep on a loaded CI machine
        emulated_link_gbps=1.0,
        debug_log=True,
    ) as issuer:
        src = issuer.pinned_array(8 << 20)
        dst = issuer.pinned_array(8 << 20)
        base_s, base_d = src.ctypes.data, dst.ctypes.data
        n_bg = 48
        bg = issuer.submit(
            base_s + np.arange(n_bg) * (128 << 10),
            base_d + np.arange(n_bg) * (128 << 10),
            128 << 10,
            np.arange(n_bg),
            Band.BACKGROUND,
        )
        time.sleep(0.002)  # the backlog is running
        od = issuer.submit(
            [base_s + (7 << 20)], [base_d + (7 << 20)], [256 << 10], [999], Band.ON_DEMAND
        )
        issuer.wait(od, timeout_s=30)
        issuer.wait(bg, timeout_s=30)
        log = records_from_log(issuer.debug_log())
        BandOrderModel(chunk, window, 32).replay(log)
        i_submit = next(i for i, e in enumerate(log) if e.kind == 0 and e.ticket == od[0])
        i_first = next(i for i, e in enumerate(log) if e.kind == LOG_START and e.ticket == od[0])
        ahead = [e for e in log[i_submit:i_first] if e.kind == LOG_START]
        assert sum(e.nbytes for e in ahead) <= window
        # ...and the backlog was still queued when it went ahead (not trivial)
        later_bg = [e for e in log[i_first:] if e.kind == LOG_START and e.band == 2]
        assert later_bg
        assert np.array_equal(dst[: n_bg * (128 << 10)], src[: n_bg * (128 << 10)])
    assert native_live_counts()["threads"] == 0


@given(
    nbytes=st.integers(1, 1 << 34),
    chunk=st.one_of(st.integers(1, 1 << 30), st.sampled_from([8 << 20, 4 << 20, 3 << 20])),
)
def test_reference_split_is_equal_aligned_and_bounded(nbytes: int, chunk: int) -> None:
    piece = split_piece_bytes(nbytes, chunk)
    k = -(-nbytes // chunk)
    if k == 1:
        assert piece == nbytes
        return
    align = min(chunk & -chunk, 64 << 10)
    last = nbytes - (k - 1) * piece
    assert piece <= chunk and piece % align == 0
    assert 0 < last <= piece  # exactly k chunks, none larger than the first
    assert piece - -(-nbytes // k) < align  # as equal as the alignment allows


def test_band_definitions_agree() -> None:
    """One band list: issuer.h's kNumBands, the binding's names, the Python
    ``Band`` enum (values are the native band ids) and the reference model."""
    from pdflash._native import load_native
    from pdflash._reference import issuer as reference

    issuer_mod: Any = load_native("_issuer")
    assert issuer_mod.NUM_BANDS == len(Band) == reference.NUM_BANDS
    assert tuple(b.name for b in Band) == issuer_mod.BAND_NAMES
    assert [int(b) for b in Band] == list(range(issuer_mod.NUM_BANDS))
