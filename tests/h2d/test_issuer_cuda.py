"""The H2D issuer on the CUDA backend (skipped without a CUDA device).

The same properties as tests/h2d/test_issuer_*.py on real copies into
device memory: bytes arrive, band order follows the reference rule, dedup /
promotion / cancel, a failed copy carries the CUDA error text and later copies
work, stream_wait orders a torch stream without a host sync, pageable sources
are refused, only registered device memory is a destination, nothing leaks
after close.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import scaled

from pdflash._reference.issuer import LOG_PROMOTE, BandOrderModel, records_from_log
from pdflash.h2d import (
    STATE_CANCELLED,
    STATE_DONE,
    STATE_QUEUED,
    CopyCancelledError,
    H2DIssuer,
    native_live_counts,
)
from pdflash.protocols import Band

pytestmark = [pytest.mark.gpu, pytest.mark.native]

torch = pytest.importorskip("torch")

MiB = 1 << 20


@pytest.fixture
def issuer():  # type: ignore[no-untyped-def]
    iss = H2DIssuer(debug_log=True)
    yield iss
    iss.close()


def _pools(iss: H2DIssuer, nbytes: int):  # type: ignore[no-untyped-def]
    src = iss.pinned_array(nbytes)
    # a random block with a prime period (never aligned with copy slots),
    # repeated: cheap for hundreds of MiB
    block = np.random.default_rng(0).integers(0, 256, 1_048_573, dtype=np.uint8)
    src[:] = np.resize(block, nbytes)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    iss.register_destination(dst.data_ptr(), nbytes)  # forgotten at iss.close()
    return src, dst


def _slots(base: int, n: int, size: int) -> np.ndarray:
    return base + np.arange(n, dtype=np.int64) * size


def _replay(iss: H2DIssuer) -> BandOrderModel:
    return BandOrderModel(iss.chunk_bytes, iss.window_bytes, iss.max_inflight_chunks).replay(
        records_from_log(iss.debug_log())
    )


def test_auto_backend_is_cuda_and_copies_arrive(issuer: H2DIssuer) -> None:
    assert issuer.backend == "cuda"
    size = 9 * MiB + 12345
    src, dst = _pools(issuer, 8 * size)
    t = issuer.submit(
        _slots(src.ctypes.data, 8, size),
        _slots(dst.data_ptr(), 8, size),
        size,
        np.arange(8),
        Band.ROUTE_AHEAD,
    )
    issuer.wait(t, timeout_s=30)
    assert torch.equal(dst.cpu(), torch.from_numpy(src))
    stats = issuer.stats()
    assert stats["bands"]["ROUTE_AHEAD"]["copies"] == 8
    assert 0 < stats["link_busy_s"] < stats["uptime_s"]
    _replay(issuer)


def test_pageable_source_is_refused_then_registered(issuer: H2DIssuer) -> None:
    pageable = np.ones(4 * MiB, dtype=np.uint8)
    dst = torch.zeros(4 * MiB, dtype=torch.uint8, device="cuda")
    issuer.register_destination(dst.data_ptr(), dst.numel())
    before = issuer.stats()["bands"]
    with pytest.raises(ValueError, match=r"copy 0: source .* registered source region"):
        issuer.submit([pageable.ctypes.data], [dst.data_ptr()], 4 * MiB, [1], Band.ON_DEMAND)
    assert issuer.stats()["bands"] == before
    with pytest.raises(ValueError, match=r"not pinned host memory.*pageable"):
        issuer.register_source(pageable.ctypes.data, pageable.nbytes)
    issuer.register_host(pageable.ctypes.data, pageable.nbytes)
    t = issuer.submit([pageable.ctypes.data], [dst.data_ptr()], 4 * MiB, [1], Band.ON_DEMAND)
    issuer.wait(t, timeout_s=30)
    assert int(dst.sum()) == 4 * MiB
    issuer.unregister_host(pageable.ctypes.data)


def test_promotion_overtakes_the_backlog(issuer: H2DIssuer) -> None:
    size = 16 * MiB
    n = 40
    src, dst = _pools(issuer, n * size)
    s, d = _slots(src.ctypes.data, n, size), _slots(dst.data_ptr(), n, size)
    bg = issuer.submit(s, d, size, np.arange(n), Band.BACKGROUND)
    again = issuer.submit(s[30:31], d[30:31], size, [30], Band.ON_DEMAND)
    assert again[0] == bg[30]
    issuer.wait(bg, timeout_s=60)
    assert torch.equal(dst.cpu(), torch.from_numpy(src))
    model = _replay(issuer)
    assert any(e.kind == LOG_PROMOTE for e in records_from_log(issuer.debug_log()))
    first = [t for t, c, _ in model.starts if c == 0]
    assert first.index(int(bg[30])) < first.index(int(bg[29]))


def test_cancel_and_reset(issuer: H2DIssuer) -> None:
    size = 16 * MiB
    n = 32
    src, dst = _pools(issuer, n * size)
    s, d = _slots(src.ctypes.data, n, size), _slots(dst.data_ptr(), n, size)
    bg = issuer.submit(s, d, size, np.arange(n), Band.BACKGROUND)
    cancelled = issuer.cancel(Band.BACKGROUND)
    assert cancelled >= n - 4
    states = issuer.states(bg)
    assert (states == STATE_CANCELLED).sum() == cancelled
    with contextlib.suppress(CopyCancelledError):
        issuer.wait(bg, timeout_s=30)
    assert issuer.poll(bg).all()
    t = issuer.submit(s, d, size, np.arange(n), Band.ON_DEMAND)
    issuer.wait(t, timeout_s=60)
    assert torch.equal(dst.cpu(), torch.from_numpy(src))
    assert issuer.reset() == 0
    _replay(issuer)


_FAULT_SCRIPT = """
import numpy as np, torch
from pdflash.h2d import CopyFailedError, H2DIssuer
from pdflash.protocols import Band
MiB = 1 << 20
with H2DIssuer() as iss:
    src = iss.pinned_array(8 * MiB)
    src[:] = 7
    dst = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda")
    iss.register_destination(dst.data_ptr(), dst.numel())
    # a registered destination freed behind the issuer's back (its own
    # segment, returned to the driver by empty_cache): the copy fails in CUDA
    gone = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    iss.register_destination(gone.data_ptr(), gone.numel())
    gone_ptr = gone.data_ptr()
    del gone
    torch.cuda.empty_cache()
    bad = iss.submit([src.ctypes.data], [gone_ptr], MiB, [1], Band.ON_DEMAND)
    try:
        iss.wait(bad, timeout_s=30)
        raise SystemExit("the bad copy did not fail")
    except CopyFailedError as exc:
        print("FAILED-AS-EXPECTED", exc)
        assert exc.ticket == bad[0]
    good = iss.submit([src.ctypes.data], [dst.data_ptr()], 8 * MiB, [2], Band.ON_DEMAND)
    iss.wait(good, timeout_s=30)
    assert int(dst.sum()) == 7 * 8 * MiB
    assert iss.stats()["bands"]["ON_DEMAND"]["failures"] == 1
print("LATER-COPY-OK")
"""


def test_failed_copy_carries_cuda_error_and_later_copies_work(tmp_path: Path) -> None:
    # NOTE: in a subprocess, so that a CUDA error that turned out to be
    # sticky could not poison the other tests' context. It runs outside the
    # checkout so that it imports the installed package, not the source tree.
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _FAULT_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "FAILED-AS-EXPECTED ticket" in out and "cuda" in out, out
    assert "LATER-COPY-OK" in out, out


def test_stream_wait_orders_a_torch_stream_without_host_sync(issuer: H2DIssuer) -> None:
    size = 64 * MiB
    src, dst = _pools(issuer, size)
    expected = int(torch.from_numpy(src).to(torch.int64).sum())
    stream = torch.cuda.Stream()
    t = issuer.submit([src.ctypes.data], [dst.data_ptr()], size, [7], Band.ROUTE_AHEAD)
    issuer.stream_wait(t, stream.cuda_stream)
    with torch.cuda.stream(stream):
        total = dst.to(torch.int64).sum()
    stream.synchronize()
    assert int(total) == expected
    issuer.wait(t)


def test_concurrent_submitters(issuer: H2DIssuer) -> None:
    n_threads, per_thread, size = 4, 16, 2 * MiB
    n = n_threads * per_thread
    src, dst = _pools(issuer, n * size)
    s, d = _slots(src.ctypes.data, n, size), _slots(dst.data_ptr(), n, size)
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            idx = np.arange(k * per_thread, (k + 1) * per_thread)
            t = issuer.submit(s[idx], d[idx], size, idx, Band(k % 3))
            t2 = issuer.submit(s[:2], d[:2], size, np.arange(2), Band.ON_DEMAND)
            issuer.wait(np.concatenate([t, t2]), timeout_s=60)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert torch.equal(dst.cpu(), torch.from_numpy(src))
    _replay(issuer)


@settings(max_examples=scaled(15), deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(list(Band)), st.integers(1, 6), st.booleans()),
        min_size=1,
        max_size=8,
    )
)
def test_band_order_on_cuda(ops: list) -> None:
    size = 3 * MiB + 4096
    with H2DIssuer(chunk_bytes=MiB, window_bytes=2 * MiB, debug_log=True) as iss:
        src, dst = _pools(iss, 48 * size)
        s, d = _slots(src.ctypes.data, 48, size), _slots(dst.data_ptr(), 48, size)
        tickets = []
        for band, count, cancel in ops:
            idx = np.random.default_rng(count).choice(48, count, replace=False)
            tickets.append(iss.submit(s[idx], d[idx], size, idx, band))
            if cancel:
                iss.cancel(Band.BACKGROUND)
        for t in tickets:
            with contextlib.suppress(CopyCancelledError):
                iss.wait(t, timeout_s=60)
        all_t = np.concatenate(tickets)
        assert set(iss.states(all_t).tolist()) <= {STATE_DONE, STATE_CANCELLED}
        model = _replay(iss)
        assert not model.copies


def test_close_with_work_in_flight_frees_everything() -> None:
    gc.collect()
    base = native_live_counts()
    iss = H2DIssuer()
    src, dst = _pools(iss, 256 * MiB)
    t = iss.submit(
        _slots(src.ctypes.data, 64, 4 * MiB),
        _slots(dst.data_ptr(), 64, 4 * MiB),
        4 * MiB,
        np.arange(64),
        Band.BACKGROUND,
    )
    assert (iss.states(t) == STATE_QUEUED).any()
    iss.close()
    assert set(iss.states(t).tolist()) <= {STATE_DONE, STATE_CANCELLED}
    del iss, src, t
    gc.collect()
    assert native_live_counts() == base


def test_on_demand_waits_at_most_one_window(issuer: H2DIssuer) -> None:
    n, size = 32, 16 * MiB
    src, dst = _pools(issuer, (n + 1) * size)
    s, d = _slots(src.ctypes.data, n + 1, size), _slots(dst.data_ptr(), n + 1, size)
    bg = issuer.submit(s[:n], d[:n], size, np.arange(n), Band.BACKGROUND)
    od = issuer.submit(s[n:], d[n:], size, [n], Band.ON_DEMAND)
    issuer.wait(od, timeout_s=30)
    assert (issuer.states(bg) < STATE_DONE).any()  # the backlog was still there
    issuer.wait(bg, timeout_s=60)
    assert torch.equal(dst.cpu(), torch.from_numpy(src))
    log = records_from_log(issuer.debug_log())
    i_submit = next(i for i, e in enumerate(log) if e.kind == 0 and e.ticket == od[0])
    i_first = next(i for i, e in enumerate(log) if e.kind == 3 and e.ticket == od[0])
    ahead = sum(e.nbytes for e in log[i_submit:i_first] if e.kind == 3)
    assert ahead <= issuer.window_bytes
    _replay(issuer)


def test_cuda_defaults_to_a_just_in_time_lead() -> None:
    from pdflash.h2d import DEFAULT_CUDA_ISSUE_LEAD_US

    with H2DIssuer() as iss:
        assert iss.backend == "cuda"
        assert iss.issue_lead_us == DEFAULT_CUDA_ISSUE_LEAD_US > 0
        assert (iss.chunk_bytes, iss.window_bytes) == (8 * MiB, 16 * MiB)
    with H2DIssuer(issue_lead_us=0.0) as iss:
        assert iss.issue_lead_us == 0.0


def test_just_in_time_issue_on_cuda() -> None:
    n, size = 24, 9 * MiB
    with H2DIssuer(debug_log=True, issue_lead_us=20.0) as iss:
        src, dst = _pools(iss, (n + 2) * size)
        s, d = _slots(src.ctypes.data, n + 2, size), _slots(dst.data_ptr(), n + 2, size)
        bg = iss.submit(s[:n], d[:n], size, np.arange(n), Band.BACKGROUND)
        od = iss.submit(s[n:], d[n:], size, [n, n + 1], Band.ON_DEMAND)
        iss.wait(np.concatenate([bg, od]), timeout_s=60)
        assert torch.equal(dst.cpu(), torch.from_numpy(src))
        rate = iss.stats()["link_rate_estimate_bps"]
        assert 5e9 < rate < 200e9, rate  # a PCIe/NVLink-C2C link, measured by events
        _replay(iss)


def test_link_busy_time_covers_a_saturated_batch() -> None:
    # One event per chunk: a chunk queued behind another is timed from its
    # predecessor's end event. Busy time must cover most of a back-to-back
    # batch and can never exceed the wall time it ran in.
    with H2DIssuer() as iss:
        size = 9 * MiB
        src, dst = _pools(iss, 32 * size)
        t0 = time.perf_counter()
        t = iss.submit(
            _slots(src.ctypes.data, 32, size),
            _slots(dst.data_ptr(), 32, size),
            size,
            np.arange(32),
            Band.BACKGROUND,
        )
        iss.wait(t, timeout_s=30)
        wall = time.perf_counter() - t0
        busy = iss.stats()["link_busy_s"]
        assert 0.7 * wall < busy <= wall
        assert torch.equal(dst.cpu(), torch.from_numpy(src))


def test_freeing_a_pinned_source_waits_for_its_copies() -> None:
    with H2DIssuer() as iss:
        nbytes = 256 * MiB
        buf = iss.alloc_pinned(nbytes)
        np.frombuffer(buf, dtype=np.uint8)[:] = 3
        dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        iss.register_destination(dst.data_ptr(), nbytes)
        t = iss.submit(
            _slots(buf.ptr, 32, 8 * MiB),
            _slots(dst.data_ptr(), 32, 8 * MiB),
            8 * MiB,
            np.full(32, -1),
            Band.BACKGROUND,
        )
        deadline = time.monotonic() + 10
        while iss.states(t)[0] == STATE_QUEUED:  # the first copy has started
            assert time.monotonic() < deadline
        buf.free()  # cancels what has not started, waits for what has
        states = iss.states(t)
        assert set(states.tolist()) <= {STATE_DONE, STATE_CANCELLED}
        done = np.flatnonzero(states == STATE_DONE)
        assert done[0] == 0
        copied = dst.view(32, 8 * MiB)[torch.from_numpy(done)]
        assert bool((copied == 3).all())


def test_only_registered_device_memory_is_a_destination(issuer: H2DIssuer) -> None:
    size = 4 * MiB
    src = issuer.pinned_array(2 * size)
    src[:] = 6
    slots = torch.zeros(2 * size, dtype=torch.uint8, device="cuda")
    stranger = torch.zeros(size, dtype=torch.uint8, device="cuda")  # never registered
    issuer.register_destination(slots.data_ptr(), size)  # the first half only
    before = issuer.stats()["bands"]
    with pytest.raises(ValueError, match=r"^copy 1: destination .*register_destination"):
        issuer.submit(
            [src.ctypes.data] * 2,
            [slots.data_ptr(), stranger.data_ptr()],
            size,
            [1, 2],
            Band.ON_DEMAND,
        )
    with pytest.raises(ValueError, match=r"^copy 0: destination .*short of its end"):
        issuer.submit([src.ctypes.data], [slots.data_ptr() + 1], size, [3], Band.ON_DEMAND)
    # the issuer's own pinned buffers are no destination on CUDA (host memory)
    with pytest.raises(ValueError, match=r"^copy 0: destination"):
        issuer.submit([src.ctypes.data], [src.ctypes.data + size], size, [4], Band.ON_DEMAND)
    assert issuer.stats()["bands"] == before  # nothing was queued
    assert int(stranger.sum()) == 0
    t = issuer.submit([src.ctypes.data], [slots.data_ptr()], size, [5], Band.ON_DEMAND)
    issuer.wait(t, timeout_s=30)
    assert int(slots[:size].sum()) == 6 * size and int(slots[size:].sum()) == 0
    assert issuer.unregister_destination(slots.data_ptr()) == 0
    with pytest.raises(ValueError, match=r"^copy 0: destination"):
        issuer.submit([src.ctypes.data], [slots.data_ptr()], size, [6], Band.ON_DEMAND)


def test_host_memory_is_refused_as_a_cuda_destination(issuer: H2DIssuer) -> None:
    pinned = issuer.pinned_array(MiB)
    pageable = np.zeros(MiB, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"not device memory .*pinned host memory"):
        issuer.register_destination(pinned.ctypes.data, MiB)
    with pytest.raises(ValueError, match=r"not device memory"):
        issuer.register_destination(pageable.ctypes.data, MiB)


def test_memory_pinned_by_torch_is_a_source_once_registered(issuer: H2DIssuer) -> None:
    host = torch.full((4 * MiB,), 9, dtype=torch.uint8).pin_memory()
    dst = torch.zeros(4 * MiB, dtype=torch.uint8, device="cuda")
    issuer.register_destination(dst.data_ptr(), dst.numel())
    with pytest.raises(ValueError, match=r"^copy 0: source"):
        issuer.submit([host.data_ptr()], [dst.data_ptr()], 4 * MiB, [1], Band.ON_DEMAND)
    issuer.register_source(host.data_ptr(), host.numel())
    with pytest.raises(ValueError, match=r"^copy 0: source .*short of its end"):
        issuer.submit([host.data_ptr() + 1], [dst.data_ptr()], 4 * MiB, [1], Band.ON_DEMAND)
    t = issuer.submit([host.data_ptr()], [dst.data_ptr()], 4 * MiB, [1], Band.ON_DEMAND)
    issuer.wait(t, timeout_s=30)
    assert int(dst.sum()) == 9 * 4 * MiB
    issuer.unregister_source(host.data_ptr())


def test_an_unmapped_source_is_rejected_on_cuda(issuer: H2DIssuer) -> None:
    dst = torch.zeros(MiB, dtype=torch.uint8, device="cuda")
    issuer.register_destination(dst.data_ptr(), dst.numel())
    with pytest.raises(ValueError, match=r"^copy 0: source \[0x1000, \+4096\)"):
        issuer.submit([0x1000], [dst.data_ptr()], 4096, [-1], Band.ON_DEMAND)
    assert issuer.stats()["bands"]["ON_DEMAND"]["submitted"] == 0
