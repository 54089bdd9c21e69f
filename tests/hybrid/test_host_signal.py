"""Host-to-stream signals (``pdflash_native._hostsignal``) and the ``stream``
hand-off on the CPU: the native ring and its host stand-in of the device
wait against the pure-Python reference, the flag stored on success and on
failure, and the service's hand-off with the device wait emulated by a
host thread running the native loop (the GPU path: test_handoff_gpu.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import scaled

from pdflash._native import load_native
from pdflash._reference import hostsignal as ref
from pdflash.hybrid import ForcedHostPlanner, HostExpertExecutor, HostExpertService
from pdflash.hybrid.handoff import HostHandoffError, StreamSignals, stream_unavailable

hs = load_native("_hostsignal")


def test_encoding_matches_the_reference() -> None:
    for seq in (1, 2, 12345, ref.SEQ_MASK - 1, ref.SEQ_MASK):
        for failed in (False, True):
            assert hs.encode(seq, failed) == ref.signal_value(seq, failed)
        assert hs.next_seq(seq) == ref.next_seq(seq)
    assert hs.next_seq(ref.SEQ_MASK) == 1  # never 0: a fresh slot is pending for every seq
    assert ref.signal_state(0, 1) == ref.PENDING
    assert ref.signal_state(ref.signal_value(7, True), 7) == ref.FAILED
    assert ref.signal_state(ref.signal_value(7, False), 8) == ref.PENDING


def test_the_reference_loop_polls_until_the_flag_or_the_deadline() -> None:
    values = iter([0, 0, ref.signal_value(3, False)])
    now = iter([0, 5, 9])  # t0, then one clock read per pending poll
    polls: list[int] = []
    out = ref.wait_signal(lambda: next(values), lambda: next(now), lambda: polls.append(1), 3, 10)
    assert out == ref.OUTCOME_DONE and len(polls) == 2
    failed = iter([0, ref.signal_value(3, True)])
    now = iter([0, 5])
    assert ref.wait_signal(lambda: next(failed), lambda: next(now), lambda: None, 3, 10) == (
        ref.OUTCOME_FAILED
    )
    now = iter([0, 5, 10])  # pending at the deadline: timed out, after one pause
    polls.clear()
    out = ref.wait_signal(lambda: 0, lambda: next(now), lambda: polls.append(1), 3, 10)
    assert out == ref.OUTCOME_TIMED_OUT and len(polls) == 1


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("acquire")),
        st.tuples(st.just("signal"), st.integers(-1, 4), st.integers(0, 3), st.booleans()),
        st.tuples(st.just("wait"), st.integers(-1, 4), st.integers(0, 3)),
        st.tuples(st.just("unmap")),
    ),
    max_size=40,
)


def _call(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except (RuntimeError, IndexError) as exc:
        return type(exc).__name__, None


@settings(max_examples=scaled(150), deadline=None)
@given(capacity=st.integers(1, 4), ops=_OPS)
def test_native_ring_equals_the_reference(capacity: int, ops: list[tuple[Any, ...]]) -> None:
    """Op by op: tickets (with a reuse wait of 0), stores, the host
    stand-in's wait (timeout 0: a pending flag times out at once), acks,
    the sticky error, the errors raised, and unmap (the words move, no
    value changes)."""
    native, model = hs.SignalRing(capacity), ref.SignalRingRef(capacity)
    issued: list[int] = [0]  # seqs given out (0: never a job's)
    for op in ops:
        if op[0] == "acquire":
            got, want = _call(native.acquire, 0), _call(model.acquire)
            if want[0] == "ok":
                issued.append(want[1][1])
        elif op[0] == "unmap":
            got, want = _call(native.unmap), _call(model.unmap)
        elif op[0] == "signal":
            _, slot, pick, failed = op
            seq = issued[min(pick, len(issued) - 1)]
            got = _call(native.signal, slot, seq, failed)
            want = _call(model.signal, slot, seq, failed)
        else:
            _, slot, pick = op
            seq = issued[min(pick, len(issued) - 1)]
            got = _call(native.wait_host, slot, seq, 0)
            want = _call(model.wait, slot, seq, 0, time.monotonic_ns)
        assert got == want, op
        assert [native.flag(i) for i in range(capacity)] == model.flags
        assert [native.ack(i) for i in range(capacity)] == model.acks
        assert (native.error_code, native.error_seq) == (model.error_code, model.error_seq)


def test_a_slot_is_reused_only_after_its_wait_acknowledged() -> None:
    ring = hs.SignalRing(2)
    a, b = ring.acquire(0), ring.acquire(0)
    with pytest.raises(RuntimeError, match="has not run"):
        ring.acquire(1_000_000)  # slot 0's wait never ran: refused after 1 ms
    ring.signal(a[0], a[1], False)
    assert ring.wait_host(a[0], a[1], 10**9) == hs.OUTCOME_DONE
    assert ring.acquire(0)[0] == 0  # acknowledged: reusable
    assert b[0] == 1 and ring.error_code == hs.OUTCOME_NONE


def test_host_stand_in_waits_across_threads_and_records_a_failure() -> None:
    ring = hs.SignalRing(8)
    tickets = [ring.acquire(0) for _ in range(8)]
    outcomes: dict[int, int] = {}

    def wait(slot: int, seq: int) -> None:
        outcomes[slot] = ring.wait_host(slot, seq, 10 * 10**9)

    waiters = [threading.Thread(target=wait, args=t) for t in tickets]
    for w in waiters:
        w.start()
    time.sleep(0.01)
    for i, (slot, seq) in enumerate(tickets):
        ring.signal(slot, seq, i == 5)
    for w in waiters:
        w.join(timeout=10)
    assert all(not w.is_alive() for w in waiters)
    assert [outcomes[s] for s, _ in tickets] == [
        hs.OUTCOME_FAILED if i == 5 else hs.OUTCOME_DONE for i in range(8)
    ]
    assert (ring.error_code, ring.error_seq) == (hs.OUTCOME_FAILED, tickets[5][1])
    with pytest.raises(RuntimeError, match="failed"):
        ring.acquire(0)  # sticky: the ring is unusable


def test_stores_from_other_threads_survive_unmap() -> None:
    """signal() from workers races unmap() moving the words: every store
    lands (in the old words before the move, in the new ones after)."""
    ring = hs.SignalRing(64)
    tickets = [ring.acquire(0) for _ in range(64)]
    start = threading.Barrier(5)

    def store(part: int) -> None:
        start.wait()
        for slot, seq in tickets[part::4]:
            ring.signal(slot, seq, slot % 3 == 0)

    workers = [threading.Thread(target=store, args=(p,)) for p in range(4)]
    for w in workers:
        w.start()
    start.wait()
    for _ in range(200):
        ring.unmap()
    for w in workers:
        w.join(timeout=10)
    assert [ring.flag(s) for s, _ in tickets] == [hs.encode(q, s % 3 == 0) for s, q in tickets]
    assert not ring.mapped
    with pytest.raises(RuntimeError, match="mapped"):
        ring.enqueue_wait(0, tickets[0][1], 0, 10**6)


def test_mapped_ring_and_device_wait_need_cuda() -> None:
    if not torch.cuda.is_available():
        assert hs.unavailable(0) != ""
        with pytest.raises(RuntimeError, match="unavailable"):
            hs.SignalRing(4, True, 0)
        reason = stream_unavailable(torch.device("cuda", 0))
        assert reason is not None and reason != ""
    ring = hs.SignalRing(4)  # host memory: no device wait
    slot, seq = ring.acquire(0)
    with pytest.raises(RuntimeError, match="mapped"):
        ring.enqueue_wait(slot, seq, 0, 10**6)
    with pytest.raises(IndexError):
        ring.signal(4, 1, False)
    with pytest.raises(ValueError):
        hs.SignalRing(0)
    with pytest.raises(RuntimeError, match="not initialised"):
        hs.SignalRing.__new__(hs.SignalRing).acquire(0)
    assert stream_unavailable(torch.device("cpu")) == "the device is cpu, not cuda"


# -- the job's completion and the service's stream hand-off ----------------------


def _executor(delay_s: float = 0.0, fail_on: int | None = None, workers: int = 1) -> Any:
    def fn(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        time.sleep(delay_s)
        if fail_on is not None and int(w["g"]) == fail_on:
            raise ValueError("host kernel failed")
        return x * (w["g"] + 1)

    return HostExpertExecutor(
        lambda g: {"g": torch.tensor(float(g))}, fn, dtype=torch.float32, workers=workers
    )


@pytest.mark.parametrize("workers", [1, 3])
def test_on_done_fires_once_after_every_worker(workers: int) -> None:
    with _executor(delay_s=0.01, workers=workers) as ex:
        calls: list[bool] = []
        job = ex.submit(np.array([0, 1, 2]), torch.ones(3, 2), [1, 1, 1])
        job.on_done(calls.append)
        job.wait()
        time.sleep(0.01)  # the callback runs in the last worker, after its future is set
        assert calls == [False]
        late: list[bool] = []
        job.on_done(late.append)  # already done: called at once
        assert late == [False]
    with _executor(fail_on=1, workers=workers) as ex:
        calls = []
        job = ex.submit(np.array([0, 1, 2]), torch.ones(3, 2), [1, 1, 1])
        job.on_done(calls.append)
        job.wait()
        time.sleep(0.01)
        assert calls == [True]
        with pytest.raises(ValueError, match="host kernel failed"):
            job.collect()


class _HostWaitRing:
    """The native ring in host memory, its device wait emulated by a thread
    running the native loop (wait_host) per enqueue."""

    def __init__(self, capacity: int = 4) -> None:
        self.native = hs.SignalRing(capacity)
        self.waiters: list[threading.Thread] = []

    capacity = property(lambda self: self.native.capacity)
    error_code = property(lambda self: self.native.error_code)
    error_seq = property(lambda self: self.native.error_seq)

    def acquire(self, reuse_wait_ns: int = 10**9) -> tuple[int, int]:
        slot, seq = self.native.acquire(reuse_wait_ns)
        return int(slot), int(seq)

    def signal(self, slot: int, seq: int, failed: bool) -> None:
        self.native.signal(slot, seq, failed)

    def enqueue_wait(self, slot: int, seq: int, stream: int, timeout_ns: int) -> None:
        t = threading.Thread(target=self.native.wait_host, args=(slot, seq, timeout_ns))
        t.start()
        self.waiters.append(t)

    def unmap(self) -> None:
        # the emulated device waits must be done first, as the device's are
        for w in self.waiters:
            w.join()
        self.native.unmap()
        self.unmaps += 1

    unmaps = 0


def _stream_service(ex: Any, timeout_s: float = 10.0) -> tuple[HostExpertService, list[Any]]:
    svc = HostExpertService(
        ex, ForcedHostPlanner(every=1), num_experts=4, expert_nbytes=100, link_bytes_per_s=1e3
    )
    rings: list[_HostWaitRing] = []

    def factory() -> _HostWaitRing:
        rings.append(_HostWaitRing())
        return rings[-1]

    signals = StreamSignals(torch.device("cpu"), timeout_s=timeout_s, ring_factory=factory)
    svc.set_handoff("stream", "cpu", signals=signals)
    assert svc.handoff == "stream" and svc.handoff_reason is None
    return svc, rings


def test_stream_handoff_does_not_block_and_books_the_job_later() -> None:
    with _executor(delay_s=0.2) as ex:
        svc, rings = _stream_service(ex)
        x = torch.arange(6.0).reshape(3, 2)
        job = svc.start(np.array([1, 2]), x, [2, 1])
        t0 = time.perf_counter()
        out = svc.finish_on_stream(job)
        assert time.perf_counter() - t0 < 0.1 and not job.done()  # the thread went on
        assert svc.books.wait_s == 0.0 and svc.books.compute_s == 0.0  # not yet booked
        svc.settle()
        want = ex.compute(np.array([1, 2]), x, [2, 1])
        assert torch.equal(out, want)
        assert svc.books.compute_s > 0.15 and svc.books.wait_s == 0.0
        for w in rings[0].waiters:
            w.join(timeout=5)
        assert rings[0].native.ack(0) == 1 and rings[0].error_code == hs.OUTCOME_NONE
        d = svc.describe()["host_handoff"]
        assert d["mode"] == "stream" and d["device_waits"] == 1
        svc.close()


def test_a_failed_host_job_raises_at_settle_and_the_ring_is_renewed() -> None:
    with _executor(fail_on=2) as ex:
        svc, rings = _stream_service(ex)
        job = svc.start(np.array([2]), torch.ones(1, 2), [1])
        svc.finish_on_stream(job)
        with pytest.raises(HostHandoffError, match="HOST job failed"):
            svc.settle()
        for w in rings[0].waiters:
            w.join(timeout=5)
        # the emulated device wait saw the failure value: sticky on the old ring
        assert rings[0].error_code == hs.OUTCOME_FAILED
        assert len(rings) == 2 and svc.describe()["host_handoff"]["renewed"] == 1
        job = svc.start(np.array([1]), torch.ones(1, 2), [1])  # the next forward is clean
        out = svc.finish_on_stream(job)
        svc.settle()
        assert torch.equal(out, torch.full((1, 2), 2.0))
        svc.close()


def test_close_and_renew_unmap_the_ring_a_job_still_holds() -> None:
    """A ring outlives its StreamSignals (the failed job's callback holds
    it, and the job's error holds the job): renew and close free its
    page-locked words themselves, once the device is done, instead of
    whichever thread drops the last reference later (freeing page-locked
    memory synchronizes the device: in a worker that owes a pending wait
    its flag, that wait times out)."""
    with _executor(fail_on=2) as ex:
        svc, rings = _stream_service(ex)
        failed_job = svc.start(np.array([2]), torch.ones(1, 2), [1])
        svc.finish_on_stream(failed_job)
        with pytest.raises(HostHandoffError, match="HOST job failed"):
            svc.settle()
        assert rings[0].unmaps == 1  # at the renew, not when the job goes
        assert rings[0].error_code == hs.OUTCOME_FAILED  # still readable after the move
        # a callback that fires after the renew stores into the moved words, harmlessly
        rings[0].native.signal(0, 1, False)
        assert rings[0].native.flag(0) == hs.encode(1, False)
        job = svc.start(np.array([1]), torch.ones(1, 2), [1])
        svc.finish_on_stream(job)
        svc.settle()
        assert rings[1].unmaps == 0
        svc.close()
        assert rings[1].unmaps == 1 and rings[0].unmaps == 1
        svc.close()  # idempotent: nothing unmapped twice
        assert rings[1].unmaps == 1


def test_a_timed_out_device_wait_raises_at_settle() -> None:
    with _executor(delay_s=0.3) as ex:
        svc, rings = _stream_service(ex, timeout_s=0.02)
        job = svc.start(np.array([1]), torch.ones(1, 2), [1])
        svc.finish_on_stream(job)
        for w in rings[0].waiters:
            w.join(timeout=5)
        assert rings[0].error_code == hs.OUTCOME_TIMED_OUT  # bounded: the wait gave up
        with pytest.raises(HostHandoffError, match="timed out"):
            svc.settle()
        svc.close()


def test_set_handoff_falls_back_with_a_reason_and_checks_its_input() -> None:
    with _executor() as ex:
        svc = HostExpertService(
            ex, ForcedHostPlanner(every=1), num_experts=4, expert_nbytes=100, link_bytes_per_s=1e3
        )
        assert svc.describe()["host_handoff"] == {
            "requested": "thread",
            "mode": "thread",
            "reason": None,
            "device_waits": None,
            "timeout_s": None,
            "renewed": None,
        }
        svc.set_handoff("stream", "cpu")
        d = svc.describe()["host_handoff"]
        assert (d["requested"], d["mode"]) == ("stream", "thread")
        assert d["reason"] == "the device is cpu, not cuda"
        with pytest.raises(ValueError, match="host handoff"):
            svc.set_handoff("bogus", "cpu")
        assert svc.handoff_requested == "stream"  # unchanged
        with pytest.raises(ValueError, match="stream hand-off only"):
            svc.set_handoff(
                "thread",
                "cpu",
                signals=StreamSignals(torch.device("cpu"), ring_factory=_HostWaitRing),
            )
        svc.settle()  # the thread hand-off: nothing pending, no error
        svc.close()
    with pytest.raises(ValueError, match="timeout_s"):
        StreamSignals(torch.device("cpu"), timeout_s=0, ring_factory=_HostWaitRing)


def test_run_settings_key_the_handoff() -> None:
    from pdflash.report.schema import RUN_SETTINGS

    setting = next(s for s in RUN_SETTINGS if s.name == "host_handoff")
    assert setting.default == "thread"
    assert setting.recorded is not None
    assert setting.recorded({}) == "thread"
    row = {"host_service": {"host_handoff": {"requested": "stream", "mode": "thread"}}}
    assert setting.recorded(row) == "stream"
    assert setting.recorded({"host_service": {"planner": {}}}) == "thread"
