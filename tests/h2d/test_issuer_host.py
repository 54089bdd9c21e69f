"""The native H2D issuer on the host backend: copies, dedup/promotion,
cancel/reset, faults, concurrency, shutdown and leaks, input validation."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import pdflash
from pdflash._reference.issuer import (
    LOG_PROMOTE,
    LOG_START,
    BandOrderModel,
    records_from_log,
)
from pdflash.h2d import (
    STATE_CANCELLED,
    STATE_DONE,
    STATE_FAILED,
    STATE_QUEUED,
    STATE_RUNNING,
    CopyCancelledError,
    CopyFailedError,
    H2DIssuer,
    native_live_counts,
)
from pdflash.metrics import NotMeasured
from pdflash.protocols import Band, CopyIssuer, LinkState, link_state_of

pytestmark = pytest.mark.native

CHUNK = 64 << 10


@pytest.fixture
def issuer() -> Iterator[H2DIssuer]:
    iss = H2DIssuer(
        backend="host",
        chunk_bytes=CHUNK,
        window_bytes=2 * CHUNK,
        emulated_link_gbps=4.0,
        debug_log=True,
    )
    yield iss
    iss.close()


def _buffers(iss: H2DIssuer, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    src = iss.pinned_array(nbytes)
    dst = iss.pinned_array(nbytes)
    src[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    return src, dst


def _slots(arr: np.ndarray, n: int, size: int) -> np.ndarray:
    return arr.ctypes.data + np.arange(n, dtype=np.int64) * size


def _replay(iss: H2DIssuer) -> BandOrderModel:
    return BandOrderModel(iss.chunk_bytes, iss.window_bytes, iss.max_inflight_chunks).replay(
        records_from_log(iss.debug_log())
    )


def test_is_a_copy_issuer_and_selects_host_here() -> None:
    with H2DIssuer(backend="host") as iss:
        assert isinstance(iss, CopyIssuer)
        assert iss.backend == "host"
    assert pdflash.H2DIssuer is H2DIssuer
    # Without a CUDA device, auto-selection must say host.
    from pdflash.h2d import cuda_available

    if not cuda_available():
        with H2DIssuer() as iss:
            assert iss.backend == "host"
        with pytest.raises(RuntimeError, match="cuda"):
            H2DIssuer(backend="cuda")


def test_copies_bytes_in_one_batched_call(issuer: H2DIssuer) -> None:
    size = 200_000  # not a multiple of the chunk: a short last chunk
    src, dst = _buffers(issuer, 8 * size)
    t = issuer.submit(
        _slots(src, 8, size), _slots(dst, 8, size), size, np.arange(8), Band.BACKGROUND
    )
    assert t.dtype == np.int64 and t.shape == (8,) and len(set(t.tolist())) == 8
    issuer.wait(t, timeout_s=30)
    assert issuer.poll(t).all()
    assert np.array_equal(src, dst)
    stats = issuer.stats()
    bg = stats["bands"]["BACKGROUND"]
    assert bg["copies"] == 8 and bg["bytes"] == 8 * size
    assert stats["chunks"] == 8 * 4  # ceil(200000 / 65536) = 4 chunks each
    assert stats["link_busy_s"] > 0
    assert isinstance(stats["bands"]["ON_DEMAND"]["queue_delay_p50_s"], NotMeasured)
    assert bg["queue_delay_p99_s"] >= bg["queue_delay_p50_s"] >= 0
    _replay(issuer)


def test_dedup_returns_the_live_ticket_and_promotes(issuer: H2DIssuer) -> None:
    size = 3 * CHUNK
    src, dst = _buffers(issuer, 6 * size)
    issuer._native.test_hold_link(True)
    bg = issuer.submit(
        _slots(src, 6, size), _slots(dst, 6, size), size, np.arange(6), Band.BACKGROUND
    )
    # key 4 again, more urgent: same ticket, promoted ahead of keys 1..3, 5
    again = issuer.submit(
        _slots(src, 6, size)[4:5], _slots(dst, 6, size)[4:5], size, [4], Band.ON_DEMAND
    )
    assert again[0] == bg[4]
    # key 2 again in the same band: same ticket, no promotion
    same = issuer.submit(
        _slots(src, 6, size)[2:3], _slots(dst, 6, size)[2:3], size, [2], Band.BACKGROUND
    )
    assert same[0] == bg[2]
    issuer._native.test_hold_link(False)
    issuer.wait(bg, timeout_s=30)
    assert np.array_equal(src, dst)
    stats = issuer.stats()["bands"]
    assert stats["ON_DEMAND"]["promotions"] == 1
    assert stats["ON_DEMAND"]["dedup_hits"] == 1 and stats["BACKGROUND"]["dedup_hits"] == 1
    assert stats["BACKGROUND"]["submitted"] == 6
    log = records_from_log(issuer.debug_log())
    assert sum(e.kind == LOG_PROMOTE for e in log) == 1
    model = _replay(issuer)
    # the promoted copy started right after what was already in the window
    # (copy 0's first two chunks), before any other background copy
    order = [t for t, chunk, _ in model.starts if chunk == 0]
    assert order.index(int(bg[4])) < order.index(int(bg[1]))
    # a finished key is copied again when resubmitted
    t2 = issuer.submit(
        _slots(src, 6, size)[:1], _slots(dst, 6, size)[:1], size, [0], Band.BACKGROUND
    )
    assert t2[0] != bg[0]
    issuer.wait(t2, timeout_s=30)


def test_rejected_submit_changes_nothing(issuer: H2DIssuer) -> None:
    src, dst = _buffers(issuer, 4 * CHUNK)
    s, d = _slots(src, 4, CHUNK), _slots(dst, 4, CHUNK)
    issuer._native.test_hold_link(True)
    t = issuer.submit(s[:1], d[:1], CHUNK, [7], Band.BACKGROUND)
    _wait_for(lambda: issuer.states(t)[0] != STATE_QUEUED)  # nothing moves after this
    before = issuer.stats()
    n_log = len(issuer.debug_log())
    with pytest.raises(ValueError, match="copy 1: nbytes must be > 0, got 0"):
        issuer.submit(s[:2], d[:2], [CHUNK, 0], [1, 2], Band.ON_DEMAND)
    with pytest.raises(ValueError, match="key 7 is already live with a different"):
        issuer.submit(s[1:2], d[1:2], CHUNK, [7], Band.ON_DEMAND)
    with pytest.raises(ValueError, match="copy 2: key 3 is already live"):
        issuer.submit(s[:3], d[:3], CHUNK, [3, 4, 3], Band.ON_DEMAND)  # in-batch conflict
    with pytest.raises(ValueError, match="one length"):
        issuer.submit(s[:2], d[:1], CHUNK, [1, 2], Band.ON_DEMAND)
    with pytest.raises(ValueError, match="band"):
        issuer.submit(s[:1], d[:1], CHUNK, [1], 5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="null src"):
        issuer.submit([0], d[:1], CHUNK, [1], Band.ON_DEMAND)
    with pytest.raises(ValueError, match="unknown ticket 12345"):
        issuer.wait([12345])
    with pytest.raises(ValueError, match="unknown ticket"):
        issuer.poll([int(t[0]) + (1 << 24)])
    after = issuer.stats()
    assert after["bands"] == before["bands"]
    assert len(issuer.debug_log()) == n_log
    # keys 3 and 4 (from the rejected batch) were not left behind: usable now
    t2 = issuer.submit(s[1:3], d[1:3], CHUNK, [3, 4], Band.ON_DEMAND)
    issuer._native.test_hold_link(False)
    issuer.wait(np.concatenate([t, t2]), timeout_s=30)
    assert np.array_equal(src[: 3 * CHUNK], dst[: 3 * CHUNK])


def test_cancel_band_and_reset_keep_the_issuer_usable(issuer: H2DIssuer) -> None:
    size = 2 * CHUNK
    src, dst = _buffers(issuer, 8 * size)
    s, d = _slots(src, 8, size), _slots(dst, 8, size)
    issuer._native.test_hold_link(True)
    bg = issuer.submit(s[:4], d[:4], size, np.arange(4), Band.BACKGROUND)
    # The worker starts bg[0]'s two chunks (the window): not cancellable.
    _wait_for(lambda: issuer.states(bg)[0] != STATE_QUEUED)
    ra = issuer.submit(s[4:6], d[4:6], size, [4, 5], Band.ROUTE_AHEAD)
    assert issuer.cancel(Band.BACKGROUND) == 3
    assert (issuer.states(bg[1:]) == STATE_CANCELLED).all()
    assert issuer.cancel(Band.ON_DEMAND) == 0
    assert issuer.reset() == 2  # both route-ahead copies
    issuer._native.test_hold_link(False)
    issuer.wait(bg[:1], timeout_s=30)
    with pytest.raises(CopyCancelledError, match=f"ticket {ra[1]}"):
        issuer.wait(ra[1:], timeout_s=30)
    with pytest.raises(CopyCancelledError):
        issuer.wait(bg[2:3])
    assert issuer.poll(np.concatenate([bg, ra])).all()  # terminal
    stats = issuer.stats()["bands"]
    assert stats["BACKGROUND"]["cancellations"] == 3 and stats["ROUTE_AHEAD"]["cancellations"] == 2
    # cancelled keys are free again; the issuer still copies
    t = issuer.submit(s, d, size, np.arange(8), Band.ON_DEMAND)
    issuer.wait(t, timeout_s=30)
    assert np.array_equal(src, dst)
    _replay(issuer)


def test_cancel_unstarted_cancels_only_the_named_copies_not_yet_started(
    issuer: H2DIssuer,
) -> None:
    size = 2 * CHUNK
    src, dst = _buffers(issuer, 6 * size)
    s, d = _slots(src, 6, size), _slots(dst, 6, size)
    issuer._native.test_hold_link(True)
    ra = issuer.submit(s[:4], d[:4], size, np.arange(4), Band.ROUTE_AHEAD)
    # the worker starts ra[0] (the window): it runs on
    _wait_for(lambda: issuer.states(ra)[0] != STATE_QUEUED)
    with pytest.raises(ValueError, match="unknown ticket"):
        issuer.cancel_unstarted([int(ra[2]), 12345])
    assert (issuer.states(ra[1:]) == STATE_QUEUED).all()  # the bad call cancelled nothing
    assert issuer.cancel_unstarted(ra[[0, 2]]).tolist() == [False, True]
    assert issuer.cancel_unstarted(ra[2:3]).tolist() == [False]  # already cancelled
    assert issuer.cancel_unstarted(np.zeros(0, dtype=np.int64)).size == 0
    # its key is free again: the expert can be copied anew
    again = issuer.submit(s[2:3], d[2:3], size, [2], Band.ON_DEMAND)
    issuer._native.test_hold_link(False)
    issuer.wait(np.concatenate([ra[[0, 1, 3]], again]), timeout_s=30)
    with pytest.raises(CopyCancelledError, match=f"ticket {ra[2]}"):
        issuer.wait(ra[2:3], timeout_s=30)
    assert np.array_equal(src[: 4 * size], dst[: 4 * size])
    assert issuer.stats()["bands"]["ROUTE_AHEAD"]["cancellations"] == 1


def test_failed_copy_fails_its_ticket_and_later_copies_work(issuer: H2DIssuer) -> None:
    size = 3 * CHUNK
    src, dst = _buffers(issuer, 4 * size)
    s, d = _slots(src, 4, size), _slots(dst, 4, size)
    issuer._native.test_hold_link(True)
    t = issuer.submit(s[:2], d[:2], size, [0, 1], Band.ROUTE_AHEAD)
    assert issuer._native.test_inject_failures(1, "cudaErrorInvalidValue: injected")
    issuer._native.test_hold_link(False)
    with pytest.raises(CopyFailedError, match="cudaErrorInvalidValue: injected") as info:
        issuer.wait(t, timeout_s=30)
    assert info.value.ticket == t[0]
    assert issuer.states(t).tolist() == [STATE_FAILED, STATE_DONE]
    assert issuer.poll(t).all()
    assert np.array_equal(src[size : 2 * size], dst[size : 2 * size])
    t2 = issuer.submit(s[2:], d[2:], size, [2, 0], Band.ON_DEMAND)  # key 0 free again
    issuer.wait(t2, timeout_s=30)
    assert np.array_equal(src[2 * size :], dst[2 * size :])
    assert issuer.stats()["bands"]["ROUTE_AHEAD"]["failures"] == 1
    model = _replay(issuer)
    assert model.finished[int(t[0])] is False


def test_wait_timeout_and_blocked_time(issuer: H2DIssuer) -> None:
    src, dst = _buffers(issuer, CHUNK)
    issuer._native.test_hold_link(True)
    t = issuer.submit([src.ctypes.data], [dst.ctypes.data], CHUNK, [1], Band.ON_DEMAND)
    with pytest.raises(TimeoutError, match=f"ticket {t[0]}"):
        issuer.wait(t, timeout_s=0.01)
    with pytest.raises(TimeoutError):
        issuer.stream_wait(t, 0, timeout_s=0.01)  # host backend: waits on the host
    with pytest.raises(ValueError, match="timeout_s"):
        issuer.wait(t, timeout_s=-1)
    issuer._native.test_hold_link(False)
    issuer.stream_wait(t, 0)
    assert issuer.poll(t).all()
    assert issuer.stats()["bands"]["ON_DEMAND"]["blocked_wait_s"] >= 0.02


def test_concurrent_submitters(issuer: H2DIssuer) -> None:
    n_threads, per_thread, size = 4, 24, 40_000
    n = n_threads * per_thread
    src, dst = _buffers(issuer, n * size)
    s, d = _slots(src, n, size), _slots(dst, n, size)
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(n_threads)

    def work(k: int) -> None:
        try:
            barrier.wait()
            mine: list[int] = []
            for j in range(0, per_thread, 3):
                # every thread also resubmits key 0..2: shared keys dedup
                idx = np.arange(k * per_thread + j, k * per_thread + j + 3)
                band = Band(j % 3)
                mine += issuer.submit(s[idx], d[idx], size, idx, band).tolist()
                shared = issuer.submit(s[:3], d[:3], size, np.arange(3), band)
                mine += shared.tolist()
            issuer.wait(mine, timeout_s=60)
            results[k] = mine
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert np.array_equal(src, dst)
    stats = issuer.stats()["bands"]
    done = sum(b["copies"] for b in stats.values())
    submitted = sum(b["submitted"] for b in stats.values())
    assert done == submitted >= n
    _replay(issuer)


def test_shutdown_with_work_queued_and_in_flight_frees_everything() -> None:
    gc.collect()
    base = native_live_counts()
    iss = H2DIssuer(
        backend="host", chunk_bytes=CHUNK, window_bytes=2 * CHUNK, emulated_link_gbps=1.0
    )
    src, dst = _buffers(iss, 64 * CHUNK)
    region = np.zeros(3 * CHUNK, dtype=np.uint8)
    iss.register_host(region.ctypes.data, region.nbytes)
    iss._native.test_hold_link(True)  # nothing can finish before close()
    t = iss.submit(
        _slots(src, 64, CHUNK), _slots(dst, 64, CHUNK), CHUNK, np.arange(64), Band.BACKGROUND
    )
    counts = native_live_counts()
    assert counts["issuers"] == base["issuers"] + 1
    assert counts["threads"] == base["threads"] + 2  # worker + host link engine
    assert counts["pinned_allocations"] == base["pinned_allocations"] + 2
    assert counts["registrations"] == base["registrations"] + 1
    iss.close()  # returns while copies are queued and in flight
    iss.close()  # idempotent
    assert iss.closed
    states = iss.states(t)
    assert set(states.tolist()) <= {STATE_DONE, STATE_CANCELLED}
    assert (states == STATE_CANCELLED).any()
    with pytest.raises(CopyCancelledError):
        iss.wait(t)
    with pytest.raises(RuntimeError, match="closed"):
        iss.submit(_slots(src, 1, CHUNK), _slots(dst, 1, CHUNK), CHUNK, [0], Band.ON_DEMAND)
    assert native_live_counts()["threads"] == base["threads"]
    assert native_live_counts()["registrations"] == base["registrations"]
    del iss, src, dst, t
    gc.collect()
    assert native_live_counts() == base


def test_pinned_array_views_and_torch_wraps_it(issuer: H2DIssuer) -> None:
    arr = issuer.pinned_array((4, 1000), np.float32)
    assert arr.shape == (4, 1000) and arr.dtype == np.float32
    assert arr.ctypes.data % 4096 == 0
    arr[:] = 1.5
    buf = issuer.alloc_pinned(1 << 16)
    view = np.frombuffer(buf, dtype=np.uint8)
    with pytest.raises(BufferError):
        buf.free()  # a view is alive
    del view
    buf.free()
    assert buf.ptr == 0
    torch = pytest.importorskip("torch")
    tensor = torch.from_numpy(arr)
    assert tensor.data_ptr() == arr.ctypes.data
    assert float(tensor.sum()) == 1.5 * 4000


def _wait_for(cond: Callable[[], object], timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        time.sleep(1e-3)


def test_window_holds_at_most_its_bytes(issuer: H2DIssuer) -> None:
    src, dst = _buffers(issuer, 16 * CHUNK)
    issuer._native.test_hold_link(True)
    t = issuer.submit(
        _slots(src, 4, 4 * CHUNK),
        _slots(dst, 4, 4 * CHUNK),
        4 * CHUNK,
        np.arange(4),
        Band.BACKGROUND,
    )
    _wait_for(lambda: issuer.stats()["inflight_chunks"] == 2)
    stats = issuer.stats()
    assert stats["inflight_bytes"] == issuer.window_bytes
    assert stats["queued_copies"] == 4
    assert stats["queued_bytes"] == 14 * CHUNK
    log = records_from_log(issuer.debug_log())
    assert sum(e.kind == LOG_START for e in log) == 2
    issuer._native.test_hold_link(False)
    issuer.wait(t, timeout_s=30)
    _replay(issuer)


def test_close_wakes_a_blocked_waiter() -> None:
    iss = H2DIssuer(backend="host", chunk_bytes=CHUNK, window_bytes=2 * CHUNK)
    src, dst = _buffers(iss, 8 * CHUNK)
    iss._native.test_hold_link(True)
    t = iss.submit(
        _slots(src, 8, CHUNK), _slots(dst, 8, CHUNK), CHUNK, np.arange(8), Band.ON_DEMAND
    )
    raised: list[BaseException] = []

    def waiter() -> None:
        try:
            iss.wait(t, timeout_s=60)
        except BaseException as exc:
            raised.append(exc)

    th = threading.Thread(target=waiter)
    th.start()
    _wait_for(lambda: iss.stats()["inflight_chunks"] == 2)
    iss.close()
    th.join(timeout=30)
    assert not th.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], CopyCancelledError)
    # the two chunks already in the window ran to completion before close returned
    assert (iss.states(t)[:2] == STATE_DONE).all()
    assert np.array_equal(src[: 2 * CHUNK], dst[: 2 * CHUNK])


def test_dedup_map_survives_many_keys_and_erasures(issuer: H2DIssuer) -> None:
    # Thousands of live keys force rehashes and long probe chains in the
    # native open-addressing key map; cancelling every third copy erases keys
    # from the middle of those chains while the others stay live.
    n, size = 3000, 256
    src, dst = _buffers(issuer, n * size)
    s, d = _slots(src, n, size), _slots(dst, n, size)
    keys = np.arange(n, dtype=np.int64) * 1024  # strided keys collide more
    victims = np.arange(0, n, 3)
    keep = np.setdiff1d(np.arange(n), victims)
    issuer._native.test_hold_link(True)
    kept = issuer.submit(s[keep], d[keep], size, keys[keep], Band.ROUTE_AHEAD)
    # tiny copies: the window holds max_inflight_chunks of them
    _wait_for(lambda: issuer.stats()["inflight_chunks"] == issuer.max_inflight_chunks)
    doomed = issuer.submit(s[victims], d[victims], size, keys[victims], Band.BACKGROUND)
    assert np.array_equal(issuer.submit(s[keep], d[keep], size, keys[keep], Band.ROUTE_AHEAD), kept)
    assert issuer.cancel(Band.BACKGROUND) == victims.size
    assert (issuer.states(doomed) == STATE_CANCELLED).all()
    again = issuer.submit(s, d, size, keys, Band.ON_DEMAND)
    assert np.array_equal(again[keep], kept)  # still live: deduplicated (and promoted)
    assert not np.isin(again[victims], doomed).any()  # erased: copied anew
    started = issuer.max_inflight_chunks
    assert issuer.stats()["bands"]["ON_DEMAND"]["promotions"] == keep.size - started
    issuer._native.test_hold_link(False)
    issuer.wait(again, timeout_s=60)
    assert np.array_equal(src, dst)
    _replay(issuer)


def test_just_in_time_issue_keeps_order_and_copies() -> None:
    """With a lead, chunks are queued late but still by the band rule, the
    link rate is estimated from finished chunks, and every byte arrives."""
    with H2DIssuer(
        backend="host",
        chunk_bytes=CHUNK,
        window_bytes=2 * CHUNK,
        emulated_link_gbps=1.0,
        debug_log=True,
        issue_lead_us=100.0,
    ) as iss:
        src, dst = _buffers(iss, 48 * CHUNK)
        bg = iss.submit(
            _slots(src, 12, 3 * CHUNK),
            _slots(dst, 12, 3 * CHUNK),
            3 * CHUNK,
            np.arange(12),
            Band.BACKGROUND,
        )
        od = iss.submit(
            _slots(src, 16, 3 * CHUNK)[12:],
            _slots(dst, 16, 3 * CHUNK)[12:],
            3 * CHUNK,
            np.arange(12, 16),
            Band.ON_DEMAND,
        )
        iss.wait(np.concatenate([bg, od]), timeout_s=60)
        assert np.array_equal(src, dst)
        rate = iss.stats()["link_rate_estimate_bps"]
        assert 0 < rate <= 1.0e9 * 1.001  # never above the emulated 1 GB/s
        _replay(iss)
    with pytest.raises(ValueError, match="issue_lead_us"):
        H2DIssuer(backend="host", issue_lead_us=-1.0)


def test_a_failing_copy_is_not_a_dedup_target() -> None:
    # A very slow link: after the first chunk fails, the second (already in
    # the window) takes ~130 ms, during which the copy is failed but live.
    with H2DIssuer(
        backend="host",
        chunk_bytes=CHUNK,
        window_bytes=2 * CHUNK,
        emulated_link_gbps=0.0005,
        debug_log=True,
    ) as iss:
        src, dst = _buffers(iss, 3 * CHUNK)
        iss._native.test_hold_link(True)
        first = iss.submit([src.ctypes.data], [dst.ctypes.data], 3 * CHUNK, [1], Band.BACKGROUND)
        _wait_for(lambda: iss.stats()["inflight_chunks"] == 2)
        iss._native.test_inject_failures(1, "injected")
        iss._native.test_hold_link(False)
        _wait_for(lambda: any(e.kind == 4 and not e.ok for e in records_from_log(iss.debug_log())))
        assert iss.states(first)[0] == STATE_RUNNING  # failed, its 2nd chunk still in flight
        again = iss.submit([src.ctypes.data], [dst.ctypes.data], 3 * CHUNK, [1], Band.ON_DEMAND)
        assert again[0] != first[0]
        with pytest.raises(CopyFailedError, match="injected"):
            iss.wait(first, timeout_s=30)
        iss.cancel()  # the new copy need not crawl over the slow link
        _replay(iss)


def test_defaults_split_copies_equally_and_keep_two_chunks_in_flight() -> None:
    """Default sizes (8 MiB chunks, 16 MiB window): a 9 MiB copy is two
    4.5 MiB chunks (not 8 + 1), a 16 MiB copy two 8 MiB chunks, and the
    window holds two chunks however small the copy's chunks are."""
    mib = 1 << 20
    with H2DIssuer(backend="host", debug_log=True) as iss:
        assert (iss.chunk_bytes, iss.window_bytes) == (8 * mib, 16 * mib)
        assert iss.issue_lead_us == 0.0  # no just-in-time lead without an emulated link
        src, dst = _buffers(iss, 4 * 9 * mib + 16 * mib)
        iss._native.test_hold_link(True)
        bg = iss.submit(_slots(src, 4, 9 * mib), _slots(dst, 4, 9 * mib), 9 * mib, [1, 2, 3, 4], 2)
        _wait_for(lambda: iss.stats()["inflight_chunks"] == 2)
        stats = iss.stats()
        assert stats["inflight_bytes"] == 9 * mib  # a third 4.5 MiB chunk would fit 16 MiB
        od_at = 4 * 9 * mib
        od = iss.submit(
            [src.ctypes.data + od_at], [dst.ctypes.data + od_at], 16 * mib, [9], Band.ON_DEMAND
        )
        iss._native.test_hold_link(False)
        iss.wait(np.concatenate([bg, od]), timeout_s=60)
        assert np.array_equal(src, dst)
        model = _replay(iss)
        sizes: dict[int, list[int]] = {}
        for e in records_from_log(iss.debug_log()):
            if e.kind == LOG_START:
                sizes.setdefault(e.ticket, []).append(e.nbytes)
        assert [sizes[int(t)] for t in bg] == [[9 * mib // 2] * 2] * 4
        assert sizes[int(od[0])] == [8 * mib, 8 * mib]
        # the on-demand copy went ahead of the background chunks still queued
        assert [t for t, c, _ in model.starts].index(int(od[0])) == 2


@pytest.mark.parametrize(
    ("nbytes", "chunk", "pieces"),
    [
        (9 << 20, 8 << 20, [9 << 19] * 2),
        (16 << 20, 8 << 20, [8 << 20] * 2),
        (8 << 20, 8 << 20, [8 << 20]),
        ((8 << 20) + 1, 8 << 20, [(4 << 20) + (64 << 10), (4 << 20) - (64 << 10) + 1]),
        (200_000, 64 << 10, [65536, 65536, 65536, 3392]),  # alignment = the chunk itself
        (100, 48, [48, 48, 4]),  # 48 aligns to 16: ceil(100 / 3) = 34 -> 48
        (90_000, 17 << 10, [15360] * 5 + [13200]),  # 17 KiB aligns to 1 KiB
    ],
)
def test_native_chunk_sizes_match_the_reference_split(
    nbytes: int, chunk: int, pieces: list
) -> None:
    from pdflash._reference.issuer import next_chunk_size

    ref, issued = [], 0
    while issued < nbytes:
        ref.append(next_chunk_size(nbytes, issued, chunk))
        issued += ref[-1]
    assert ref == pieces
    with H2DIssuer(
        backend="host", chunk_bytes=chunk, window_bytes=2 * chunk, debug_log=True
    ) as iss:
        src, dst = _buffers(iss, nbytes)
        t = iss.submit([src.ctypes.data], [dst.ctypes.data], nbytes, [-1], Band.BACKGROUND)
        iss.wait(t, timeout_s=30)
        assert np.array_equal(src, dst)
        log = records_from_log(iss.debug_log())
        assert [e.nbytes for e in log if e.kind == LOG_START] == pieces
        _replay(iss)


@pytest.mark.parametrize("window_chunks", [1, 32])
def test_submits_meeting_a_busy_or_idle_worker_are_never_lost(window_chunks: int) -> None:
    # Issue 4: submit() skips the wake-up call when the worker is busy (it
    # sees new work on its own). Blocks pipelined two deep, then waited one
    # by one, meet the worker copying (window full or with room), between
    # chunks and parked; a lost wake-up would hang wait(), caught by the
    # timeout. Every byte must arrive.
    n, size = 64, 4096
    with H2DIssuer(
        backend="host",
        chunk_bytes=size,
        window_bytes=size,
        max_inflight_chunks=window_chunks,
        emulated_link_gbps=0.5,
    ) as iss:
        src = iss.pinned_array(n * size)
        dst = iss.pinned_array(n * size)
        offsets = np.arange(n, dtype=np.int64) * size
        s_ptr = src.ctypes.data + offsets
        d_ptr = dst.ctypes.data + offsets
        key = 1
        previous = None
        for block in range(12):
            src[:] = block + 1
            tickets = iss.submit(s_ptr, d_ptr, size, np.arange(key, key + n), Band.ROUTE_AHEAD)
            key += n
            if block % 3 == 2:  # idle worker at the next submit
                iss.wait(tickets, timeout_s=30)
                assert (dst == block + 1).all()
                previous = None
                continue
            if previous is not None:
                iss.wait(previous, timeout_s=30)
            previous = tickets
        if previous is not None:
            iss.wait(previous, timeout_s=30)
        assert iss.poll(previous if previous is not None else tickets).all()


def test_one_nbytes_value_applies_to_every_copy(issuer: H2DIssuer) -> None:
    size = 3 * CHUNK
    src, dst = _buffers(issuer, 4 * size)
    for nbytes in (size, np.int64(size), np.array([size])):
        dst[:] = 0
        t = issuer.submit(
            _slots(src, 4, size), _slots(dst, 4, size), nbytes, [-1] * 4, Band.BACKGROUND
        )
        issuer.wait(t, timeout_s=30)
        assert np.array_equal(src, dst)
    with pytest.raises(ValueError, match="one length"):
        issuer.submit(
            _slots(src, 4, size), _slots(dst, 4, size), [size] * 2, [-1] * 4, Band.BACKGROUND
        )


def test_freeing_a_pinned_source_cancels_queued_copies_and_waits_for_started_ones() -> None:
    with H2DIssuer(
        backend="host", chunk_bytes=CHUNK, window_bytes=2 * CHUNK, emulated_link_gbps=1.0
    ) as iss:
        src = iss.alloc_pinned(8 * CHUNK)
        dst = iss.pinned_array(8 * CHUNK)
        np.frombuffer(src, dtype=np.uint8)[:] = 7
        slots = src.ptr + np.arange(4, dtype=np.int64) * 2 * CHUNK
        iss._native.test_hold_link(True)
        t = iss.submit(slots, _slots(dst, 4, 2 * CHUNK), 2 * CHUNK, [-1] * 4, Band.BACKGROUND)
        _wait_for(lambda: iss.states(t)[0] == STATE_RUNNING)
        started = iss.states(t) == STATE_RUNNING
        assert started[0] and not started[-1]  # the window holds the first copy's chunks
        releaser = threading.Thread(target=src.free)
        releaser.start()
        releaser.join(timeout=0.5)
        assert releaser.is_alive()  # blocked on the started copy (the link is held)
        assert (iss.states(t)[~started] == STATE_CANCELLED).all()
        iss._native.test_hold_link(False)
        releaser.join(timeout=30)
        assert not releaser.is_alive() and src.ptr == 0
        assert (iss.states(t)[started] == STATE_DONE).all()
        assert (dst[: 2 * CHUNK] == 7).all()  # the started copy read live memory
        with pytest.raises(CopyCancelledError, match="source region was released"):
            iss.wait(t)


def test_unregister_host_cancels_queued_copies_from_the_region() -> None:
    with H2DIssuer(
        backend="host", chunk_bytes=CHUNK, window_bytes=CHUNK, emulated_link_gbps=1.0
    ) as iss:
        region = np.ones(4 * CHUNK, dtype=np.uint8)
        dst = iss.pinned_array(4 * CHUNK)
        iss.register_host(region.ctypes.data, region.nbytes)
        iss._native.test_hold_link(True)
        t = iss.submit(_slots(region, 4, CHUNK), _slots(dst, 4, CHUNK), CHUNK, [-1] * 4, 2)
        _wait_for(lambda: iss.states(t)[0] == STATE_RUNNING)
        releaser = threading.Thread(target=iss.unregister_host, args=(region.ctypes.data,))
        releaser.start()
        _wait_for(lambda: (iss.states(t)[1:] == STATE_CANCELLED).all())
        assert releaser.is_alive()  # waits for the started copy
        iss._native.test_hold_link(False)
        releaser.join(timeout=30)
        assert not releaser.is_alive()
        assert iss.states(t)[0] == STATE_DONE
        assert (dst[:CHUNK] == 1).all() and (dst[CHUNK:] == 0).all()
        with pytest.raises(ValueError, match="not registered"):
            iss.unregister_host(region.ctypes.data)


def test_shutdown_names_copies_cut_off_after_they_started() -> None:
    iss = H2DIssuer(backend="host", chunk_bytes=CHUNK, window_bytes=CHUNK, emulated_link_gbps=1.0)
    src, dst = _buffers(iss, 8 * CHUNK)
    iss._native.test_hold_link(True)
    t = iss.submit(_slots(src, 1, 8 * CHUNK), _slots(dst, 1, 8 * CHUNK), 8 * CHUNK, [5], 2)
    _wait_for(lambda: iss.states(t)[0] == STATE_RUNNING)
    iss.close()
    with pytest.raises(CopyCancelledError, match=r"shut down after \d+ of 524288 bytes"):
        iss.wait(t)


def test_ticket_states_are_kept_for_a_bounded_number_of_later_copies() -> None:
    # NOTE: the native ring keeps final states for the last 2**22 copies, so a
    # server does not grow one byte per copy forever; older tickets expire.
    ring = 1 << 22
    with H2DIssuer(backend="host", chunk_bytes=CHUNK, emulated_link_gbps=1.0) as iss:
        src, dst = _buffers(iss, CHUNK)
        n = 1 << 16
        srcs, dsts = np.full(n, src.ctypes.data), np.full(n, dst.ctypes.data)
        first = iss.submit(srcs[:1], dsts[:1], 8, [-1], Band.BACKGROUND)
        iss.wait(first)
        last = first
        for i in range(ring // n):
            if i == ring // n - 1:
                assert iss.states(first)[0] == STATE_DONE  # fewer than 2**22 copies later
            last = iss.submit(srcs, dsts, 8, np.full(n, -1), Band.BACKGROUND)
            iss.cancel()
        with contextlib.suppress(CopyCancelledError):
            iss.wait(last)
        assert iss.states(last)[-1] == STATE_CANCELLED  # recent: still known
        with pytest.raises(ValueError, match="expired ticket"):
            iss.states(first)
        with pytest.raises(ValueError, match="unknown ticket"):
            iss.states([int(last[-1]) + (1 << 24)])


def test_chunk_size_is_bounded() -> None:
    with pytest.raises(ValueError, match="1 GiB"):
        H2DIssuer(backend="host", chunk_bytes=(1 << 30) + 1, window_bytes=4 << 30)
    with H2DIssuer(backend="host", chunk_bytes=1 << 30, window_bytes=1 << 30) as iss:
        assert iss.chunk_bytes == 1 << 30


def test_a_rejected_batch_undoes_its_promotions_and_new_keys(issuer: H2DIssuer) -> None:
    size = 3 * CHUNK
    src, dst = _buffers(issuer, 6 * size)
    s, d = _slots(src, 6, size), _slots(dst, 6, size)
    issuer._native.test_hold_link(True)
    bg = issuer.submit(s[:3], d[:3], size, [1, 7, 2], Band.BACKGROUND)
    _wait_for(lambda: issuer.states(bg)[0] == STATE_RUNNING)  # the window is full now
    before = issuer.stats()["bands"]
    # key 7 would be promoted and key 8 created before copy 2 (key 8 with
    # another destination) rejects the batch
    with pytest.raises(ValueError, match="copy 2: key 8 is already live"):
        issuer.submit(
            np.array([s[1], s[3], s[3]]),
            np.array([d[1], d[3], d[4]]),
            size,
            [7, 8, 8],
            Band.ON_DEMAND,
        )
    assert issuer.stats()["bands"] == before
    # key 8 is free again (another destination is fine), and key 7 is still
    # BACKGROUND: a ROUTE_AHEAD copy submitted now starts before it
    ra = issuer.submit(s[3:5], d[3:5], size, [8, 9], Band.ROUTE_AHEAD)
    issuer._native.test_hold_link(False)
    issuer.wait(np.concatenate([bg, ra]), timeout_s=30)
    assert np.array_equal(src[: 5 * size], dst[: 5 * size])
    log = records_from_log(issuer.debug_log())
    assert not any(e.kind == LOG_PROMOTE for e in log)
    order = [t for t, chunk, _ in _replay(issuer).starts if chunk == 0]
    assert order.index(int(ra[1])) < order.index(int(bg[1]))


def test_host_default_lead_is_a_tenth_of_a_chunk_on_the_emulated_link() -> None:
    # 2 MiB at 0.5 GB/s = 4194.304 us per chunk -> 419.43 us
    with H2DIssuer(
        backend="host", chunk_bytes=2 << 20, window_bytes=4 << 20, emulated_link_gbps=0.5
    ) as iss:
        assert iss.issue_lead_us == pytest.approx(419.4304)
    with H2DIssuer(backend="host", emulated_link_gbps=0.5, issue_lead_us=0.0) as iss:
        assert iss.issue_lead_us == 0.0


def test_a_ticket_with_a_foreign_record_index_is_answered_safely(issuer: H2DIssuer) -> None:
    # A ticket is (seq << 24 | record); once its copy finished only the seq
    # matters, and no record index may be read out of range.
    src, dst = _buffers(issuer, CHUNK)
    t = issuer.submit(_slots(src, 1, CHUNK), _slots(dst, 1, CHUNK), CHUNK, [-1], Band.BACKGROUND)
    issuer.wait(t, timeout_s=30)
    forged = np.array([(int(t[0]) >> 24 << 24) | ((1 << 24) - 1)], dtype=np.int64)
    assert issuer.states(forged)[0] == STATE_DONE
    issuer.wait(forged, timeout_s=1)


def test_an_uninitialised_native_issuer_raises_instead_of_crashing() -> None:
    from pdflash_native._issuer import NativeIssuer

    bare = NativeIssuer.__new__(NativeIssuer)
    with pytest.raises(RuntimeError, match="not initialised"):
        bare.stats()
    with pytest.raises(RuntimeError, match="not initialised"):
        bare.cancel()
    with pytest.raises(RuntimeError, match="not initialised"):
        _ = bare.closed
    with pytest.raises(RuntimeError, match="not initialised"):
        bare.submit(np.array([1]), np.array([1]), 8, np.array([-1]), 2)


def test_link_probe_reads_the_emulated_link() -> None:
    import torch

    from pdflash.h2d import measure_link_gbps

    with H2DIssuer(backend="host", emulated_link_gbps=0.05) as issuer:
        gbps = measure_link_gbps(issuer, torch.device("cpu"))
        # a throttled link cannot be read faster than its throttle
        assert 0 < gbps <= 0.05 * 1.1
        # and about a quarter second's worth of bytes moved: not a 0 s pass
        assert gbps > 0.05 / 10


def _state_from_stats(iss: H2DIssuer) -> LinkState:
    raw = iss.stats()
    rate = raw["link_rate_estimate_bps"]
    return LinkState(raw["queued_copies"], raw["inflight_chunks"], rate if rate > 0 else None)


def test_link_state_reads_what_stats_says_of_the_link(issuer: H2DIssuer) -> None:
    """Differential: ``link_state()`` equals the queue, in-flight and rate
    fields of ``stats()`` before any copy, with copies held queued and in
    flight, and after they landed; ``link_state_of`` reads the same from
    the issuer and from a stats-only double of it."""
    assert issuer.link_state() == LinkState(0, 0, None) == _state_from_stats(issuer)
    assert issuer.link_state().idle
    size = 3 * CHUNK
    src, dst = _buffers(issuer, 6 * size)
    issuer._native.test_hold_link(True)
    tickets = issuer.submit(
        _slots(src, 6, size), _slots(dst, 6, size), size, np.arange(6), Band.BACKGROUND
    )
    # the issuer's thread fills the window after the submit returns: compare
    # once it is full (with the link held nothing moves after that)
    window = issuer.window_bytes // CHUNK
    _wait_for(lambda: issuer.link_state().inflight_chunks == window)
    held = issuer.link_state()
    assert held == _state_from_stats(issuer) and held.queued_copies > 0 and not held.idle
    issuer._native.test_hold_link(False)
    issuer.wait(tickets, timeout_s=30)
    done = issuer.link_state()
    assert done == _state_from_stats(issuer) and done.idle
    assert done.link_rate_estimate_bps is not None and done.link_rate_estimate_bps > 0

    class StatsOnly:
        def stats(self) -> dict[str, object]:
            return issuer.stats()

    assert link_state_of(issuer) == link_state_of(StatsOnly()) == done
    assert link_state_of(None) is None and link_state_of(object()) is None

    class WrongState:
        def link_state(self) -> tuple[int, int, float]:
            return (0, 0, 1.0)

    with pytest.raises(TypeError, match=r"WrongState.link_state\(\) returned tuple"):
        link_state_of(WrongState())
