"""The issuer never touches memory it was not given (issue 12, item 3).

Every copy's source range must lie inside one source region (the issuer's
pinned buffers, ``register_host``, ``register_source``) and its destination
range inside one destination region (``register_destination``; on the host
backend also the issuer's pinned buffers), checked before anything of the
batch is queued. Before this rule an unmapped source pointer killed the
process (SIGSEGV on the worker) and a length past a pinned buffer's end
copied the heap memory beyond it.
"""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pdflash._reference.issuer import CopyRegions
from pdflash.h2d import (
    STATE_CANCELLED,
    STATE_DONE,
    STATE_RUNNING,
    CopyCancelledError,
    H2DIssuer,
    native_live_counts,
)
from pdflash.protocols import Band

pytestmark = pytest.mark.native

CHUNK = 64 << 10
# Page 1 of the address space: never mapped on Linux (mmap_min_addr >= 4096).
UNMAPPED = 0x1000


@pytest.fixture
def issuer() -> Iterator[H2DIssuer]:
    iss = H2DIssuer(backend="host", chunk_bytes=CHUNK, window_bytes=2 * CHUNK)
    yield iss
    iss.close()


def _wait_for(cond: Callable[[], object], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def _bands(iss: H2DIssuer) -> dict[str, dict[str, object]]:
    # the counters a rejected batch must leave alone (queue delays are NaN-free
    # NotMeasured objects or floats; compare the integer counters)
    return {
        name: {k: v for k, v in band.items() if isinstance(v, int)}
        for name, band in iss.stats()["bands"].items()
    }


_UNMAPPED_SCRIPT = f"""
import numpy as np
from pdflash.h2d import H2DIssuer
from pdflash.protocols import Band
with H2DIssuer(backend="host") as iss:
    dst = iss.pinned_array(4096)
    try:
        t = iss.submit([{UNMAPPED}], [dst.ctypes.data], 4096, [-1], Band.ON_DEMAND)
        iss.wait(t, timeout_s=10)
        print("ACCEPTED")
    except ValueError as exc:
        print("REJECTED", exc)
"""


def test_an_unmapped_source_pointer_is_rejected_instead_of_crashing_the_process() -> None:
    # NOTE: in a subprocess: before the rule the copy was queued and the
    # worker's memcpy read page 1 (SIGSEGV, the whole process died).
    proc = subprocess.run(
        [sys.executable, "-P", "-c", _UNMAPPED_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"the process died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    assert "REJECTED copy 0: source [0x1000, +4096)" in proc.stdout, proc.stdout


def test_a_length_past_a_pinned_buffers_end_is_rejected(issuer: H2DIssuer) -> None:
    # NOTE: 1000 bytes (the host backend rounds the allocation to a page), so
    # the unchecked code read past the buffer's end without faulting.
    src = issuer.pinned_array(1000)
    dst = issuer.pinned_array(2000)
    src[:] = 5
    with pytest.raises(ValueError, match=r"copy 0: source \[0x[0-9a-f]+, \+1001\)") as err:
        issuer.submit([src.ctypes.data], [dst.ctypes.data], 1001, [-1], Band.ON_DEMAND)
    assert "ending 1 bytes short of its end" in str(err.value)
    with pytest.raises(ValueError, match=r"copy 0: source"):  # one byte in, to the end + 1
        issuer.submit([src.ctypes.data + 1], [dst.ctypes.data], 1000, [-1], Band.ON_DEMAND)
    with pytest.raises(ValueError, match=r"copy 0: destination"):
        issuer.submit([src.ctypes.data], [dst.ctypes.data + 1001], 1000, [-1], Band.ON_DEMAND)
    assert (dst == 0).all()
    t = issuer.submit([src.ctypes.data], [dst.ctypes.data + 1000], 1000, [-1], Band.ON_DEMAND)
    issuer.wait(t, timeout_s=10)
    assert (dst[1000:] == 5).all() and (dst[:1000] == 0).all()


def test_a_destination_outside_registered_destinations_is_rejected(issuer: H2DIssuer) -> None:
    src = issuer.pinned_array(CHUNK)
    src[:] = 3
    target = np.zeros(2 * CHUNK, dtype=np.uint8)  # the caller's memory, never registered
    with pytest.raises(ValueError, match=r"copy 0: destination .*register_destination"):
        issuer.submit([src.ctypes.data], [target.ctypes.data], CHUNK, [-1], Band.ON_DEMAND)
    assert issuer.stats()["bands"]["ON_DEMAND"]["submitted"] == 0
    issuer.register_destination(target.ctypes.data, CHUNK)
    t = issuer.submit([src.ctypes.data], [target.ctypes.data], CHUNK, [-1], Band.ON_DEMAND)
    issuer.wait(t, timeout_s=10)
    assert (target[:CHUNK] == 3).all()
    with pytest.raises(ValueError, match="destination"):  # the registered range only
        issuer.submit([src.ctypes.data], [target.ctypes.data + CHUNK], CHUNK, [-1], Band.ON_DEMAND)
    assert issuer.unregister_destination(target.ctypes.data) == 0
    with pytest.raises(ValueError, match="destination"):
        issuer.submit([src.ctypes.data], [target.ctypes.data], CHUNK, [-1], Band.ON_DEMAND)
    assert (target[CHUNK:] == 0).all()


def test_a_batch_with_one_bad_copy_queues_nothing(issuer: H2DIssuer) -> None:
    size = 4096
    src = issuer.pinned_array(8 * size)
    dst = issuer.pinned_array(8 * size)
    src[:] = 9
    s = src.ctypes.data + np.arange(8, dtype=np.int64) * size
    d = dst.ctypes.data + np.arange(8, dtype=np.int64) * size
    issuer._native.test_hold_link(True)
    try:
        live = issuer.submit(s[:2], d[:2], size, [100, 101], Band.BACKGROUND)
        # both in the held window: nothing changes on its own from here
        _wait_for(lambda: (issuer.states(live) == STATE_RUNNING).all())
        before = _bands(issuer)
        queued = issuer.stats()["queued_copies"]
        states = issuer.states(live)
        bad_s = s.copy()
        bad_s[5] = src.ctypes.data + 8 * size - size // 2  # straddles the pool's end
        keys = np.arange(8) + 200
        keys[0] = 100  # a dedup hit that would promote the live copy
        with pytest.raises(ValueError, match=r"^copy 5: source"):
            issuer.submit(bad_s, d, size, keys, Band.ON_DEMAND)
        assert _bands(issuer) == before
        assert issuer.stats()["queued_copies"] == queued
        assert (issuer.states(live) == states).all()
        # the batch's new keys are not live: the same keys with other
        # addresses are no conflict
        t = issuer.submit(s[::-1][:6], d[::-1][:6], size, keys[1:7], Band.ON_DEMAND)
        assert issuer.stats()["bands"]["ON_DEMAND"]["dedup_hits"] == 0
        assert issuer.stats()["bands"]["ON_DEMAND"]["promotions"] == 0
    finally:
        issuer._native.test_hold_link(False)
    issuer.wait(np.concatenate([live, t]), timeout_s=10)
    assert (dst == 9).all()


def test_rejections_name_the_copy_pointer_length_and_nearest_region(issuer: H2DIssuer) -> None:
    # the only source region: the middle page of `host` (a pinned buffer
    # would also be one)
    host = np.zeros(3 * 4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    base = host.ctypes.data + 4096
    issuer.register_source(base, 4096)
    issuer.register_destination(dst.ctypes.data, dst.nbytes)
    with pytest.raises(ValueError) as err:
        issuer.submit([base, base - 100], [dst.ctypes.data] * 2, 16, [-1, -1], Band.ON_DEMAND)
    msg = str(err.value)
    assert msg.startswith(f"copy 1: source [{hex(base - 100)}, +16)")
    assert f"nearest: [{hex(base)}, {hex(base + 4096)}) of 4096 bytes" in msg
    assert "beginning 100 bytes after it" in msg
    with pytest.raises(ValueError, match=r"ending 4 bytes before it"):
        issuer.submit([base + 4100], [dst.ctypes.data], 16, [-1], Band.ON_DEMAND)


def test_a_copy_across_two_adjacent_regions_is_rejected(issuer: H2DIssuer) -> None:
    # NOTE: one region must hold the whole copy: releasing either half must
    # find every copy that touches it.
    host = np.full(2 * CHUNK, 4, dtype=np.uint8)
    dst = issuer.pinned_array(2 * CHUNK)
    issuer.register_source(host.ctypes.data, CHUNK)
    issuer.register_source(host.ctypes.data + CHUNK, CHUNK)
    with pytest.raises(ValueError, match="copy 0: source"):
        issuer.submit(
            [host.ctypes.data + CHUNK // 2], [dst.ctypes.data], CHUNK, [-1], Band.ON_DEMAND
        )
    t = issuer.submit(
        host.ctypes.data + np.array([0, CHUNK]), dst.ctypes.data + np.array([0, CHUNK]),
        CHUNK, [-1, -1], Band.ON_DEMAND,
    )  # fmt: skip
    issuer.wait(t, timeout_s=10)
    assert (dst == 4).all()
    assert issuer.unregister_source(host.ctypes.data) == 0
    with pytest.raises(ValueError, match="copy 0: source"):
        issuer.submit([host.ctypes.data], [dst.ctypes.data], 16, [-1], Band.ON_DEMAND)
    issuer.submit([host.ctypes.data + CHUNK], [dst.ctypes.data], 16, [-1], Band.ON_DEMAND)


def test_nested_and_repeated_regions_hold_copies_inside_any_of_them(issuer: H2DIssuer) -> None:
    host = np.arange(4 * CHUNK, dtype=np.uint64).view(np.uint8)[: 4 * CHUNK].copy()
    dst = issuer.pinned_array(4 * CHUNK)
    base = host.ctypes.data
    issuer.register_source(base, 4 * CHUNK)
    issuer.register_source(base + 16, 32)  # a small region inside the large one
    # starts after the small region's start, ends past it: the large one holds it
    t = issuer.submit([base + 20], [dst.ctypes.data], 3 * CHUNK, [-1], Band.ON_DEMAND)
    issuer.wait(t, timeout_s=10)
    assert (dst[: 3 * CHUNK] == host[20 : 20 + 3 * CHUNK]).all()
    assert issuer.unregister_source(base) == 0  # the small one stays
    issuer.submit([base + 16], [dst.ctypes.data], 32, [-1], Band.ON_DEMAND)
    with pytest.raises(ValueError, match="ending 1 bytes short"):
        issuer.submit([base + 16], [dst.ctypes.data], 33, [-1], Band.ON_DEMAND)


def test_region_registration_errors(issuer: H2DIssuer) -> None:
    host = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(ValueError, match="empty or wrapping"):
        issuer.register_destination(host.ctypes.data, 0)
    with pytest.raises(ValueError, match="empty or wrapping"):
        issuer.register_source(0, 16)
    with pytest.raises(ValueError, match="empty or wrapping"):
        issuer.register_source((1 << 64) - 16, 32)
    registrations = native_live_counts()["registrations"]
    with pytest.raises(ValueError, match="empty or wrapping"):
        issuer.register_host((1 << 64) - 16, 32)
    assert native_live_counts()["registrations"] == registrations
    issuer.register_destination(host.ctypes.data, 4096)
    with pytest.raises(ValueError, match="already registered"):
        issuer.register_destination(host.ctypes.data, 4096)
    with pytest.raises(ValueError, match="not registered"):
        issuer.unregister_destination(host.ctypes.data + 1)
    with pytest.raises(ValueError, match="not registered"):
        issuer.unregister_source(host.ctypes.data)
    issuer.unregister_destination(host.ctypes.data)


def test_a_wrapping_range_is_rejected(issuer: H2DIssuer) -> None:
    src = issuer.pinned_array(4096)
    dst = issuer.pinned_array(4096)
    huge = (1 << 63) - 1  # src + huge wraps past the end of the address space
    with pytest.raises(ValueError, match="copy 0: source"):
        issuer.submit([src.ctypes.data], [dst.ctypes.data], huge, [-1], Band.ON_DEMAND)


def test_unregistering_a_destination_cancels_queued_copies_and_waits_for_started_ones() -> None:
    with H2DIssuer(
        backend="host", chunk_bytes=CHUNK, window_bytes=CHUNK, emulated_link_gbps=1.0
    ) as iss:
        src = iss.pinned_array(4 * CHUNK)
        src[:] = 2
        target = np.zeros(4 * CHUNK, dtype=np.uint8)
        iss.register_destination(target.ctypes.data, target.nbytes)
        slots = np.arange(4, dtype=np.int64) * CHUNK
        iss._native.test_hold_link(True)
        t = iss.submit(src.ctypes.data + slots, target.ctypes.data + slots, CHUNK, [-1] * 4, 2)
        _wait_for(lambda: iss.states(t)[0] == STATE_RUNNING)
        result: list[int] = []
        releaser = threading.Thread(
            target=lambda: result.append(iss.unregister_destination(target.ctypes.data))
        )
        releaser.start()
        _wait_for(lambda: (iss.states(t)[1:] == STATE_CANCELLED).all())
        assert releaser.is_alive()  # waits for the started copy
        iss._native.test_hold_link(False)
        releaser.join(timeout=30)
        assert not releaser.is_alive() and result == [3]
        assert iss.states(t)[0] == STATE_DONE
        assert (target[:CHUNK] == 2).all() and (target[CHUNK:] == 0).all()
        with pytest.raises(CopyCancelledError, match="destination region was unregistered"):
            iss.wait(t[1:])


def test_freeing_a_pinned_destination_cancels_the_copies_into_it() -> None:
    with H2DIssuer(
        backend="host", chunk_bytes=CHUNK, window_bytes=CHUNK, emulated_link_gbps=1.0
    ) as iss:
        src = iss.pinned_array(4 * CHUNK)
        dst = iss.alloc_pinned(4 * CHUNK)
        slots = np.arange(4, dtype=np.int64) * CHUNK
        iss._native.test_hold_link(True)
        t = iss.submit(src.ctypes.data + slots, dst.ptr + slots, CHUNK, [-1] * 4, 2)
        _wait_for(lambda: iss.states(t)[0] == STATE_RUNNING)
        releaser = threading.Thread(target=dst.free)
        releaser.start()
        _wait_for(lambda: (iss.states(t)[1:] == STATE_CANCELLED).all())
        iss._native.test_hold_link(False)
        releaser.join(timeout=30)
        assert not releaser.is_alive()
        with pytest.raises(CopyCancelledError, match="destination region was released"):
            iss.wait(t[1:])
        with pytest.raises(ValueError, match="copy 0: destination"):  # forgotten with the buffer
            iss.submit(src.ctypes.data + slots[:1], slots[:1] + 4096, CHUNK, [-1], 2)


def test_close_forgets_source_and_destination_registrations() -> None:
    iss = H2DIssuer(backend="host")
    host = np.zeros(4096, dtype=np.uint8)
    iss.register_source(host.ctypes.data, 2048)
    iss.register_destination(host.ctypes.data + 2048, 2048)
    iss.close()
    iss.close()
    with pytest.raises(RuntimeError, match="closed"):
        iss.submit([host.ctypes.data], [host.ctypes.data + 2048], 16, [-1], Band.ON_DEMAND)


def test_the_expert_cache_registers_its_slab_as_a_destination() -> None:
    from pdflash.cache.expert_cache import ExpertCache

    class Source:
        num_layers, num_experts, expert_nbytes = 2, 4, 256

        def __init__(self, iss: H2DIssuer) -> None:
            self.buf = iss.pinned_array(2 * 4 * 256)
            self.buf[:] = np.repeat(np.arange(8, dtype=np.uint8), 256)

        def host_ptrs(self, flat_ids: np.ndarray) -> np.ndarray:
            return self.buf.ctypes.data + np.asarray(flat_ids, dtype=np.int64) * 256

    with H2DIssuer(backend="host") as iss:
        cache = ExpertCache(Source(iss), iss, num_slots=4, top_k=1, max_batch_tokens=4)
        slab_ptr = cache.slab.data_ptr()
        slots, tickets = cache.acquire([5, 6])
        cache.wait_ready(tickets)
        assert (cache.slab[slots[0]] == 5).all() and (cache.slab[slots[1]] == 6).all()
        cache.release([5, 6])
        src = iss.pinned_array(16)
        iss.wait(iss.submit([src.ctypes.data], [slab_ptr], 16, [-1], Band.ON_DEMAND))
        del cache
        gc.collect()
        # the slab is no longer a destination once the cache is gone
        with pytest.raises(ValueError, match="copy 0: destination"):
            iss.submit([src.ctypes.data], [slab_ptr], 16, [-1], Band.ON_DEMAND)


# ---------------------------------------------------------------- differential
# Regions live in real memory (one source pool, one destination pool, each cut
# into regions, some adjacent, one nested), so an accepted batch really copies.

_POOL = 1 << 16


def _region_layout(base: int) -> list[tuple[int, int]]:
    # two adjacent regions, one after a gap, and one nested in the first
    return [(base, 4096), (base + 4096, 4096), (base + 12288, 8192), (base + 1024, 512)]


_EDGES = [0, 1024, 1536, 4096, 8192, 12288, 20480, _POOL]


@st.composite
def _pointer(draw: st.DrawFn, nbytes: int) -> tuple[str, int]:
    # ("pool", offset) or ("unmapped", offset in page 1); mostly a range
    # inside one region, else around region edges (straddling an end, before
    # a start, across the two adjacent regions) or unmapped
    mode = draw(st.sampled_from(["inside"] * 9 + ["edge"] * 2 + ["unmapped"]))
    if mode == "unmapped":
        return "unmapped", draw(st.integers(0, 4095))
    if mode == "inside":
        fits = [(b, n) for b, n in _region_layout(0) if n >= nbytes]
        if fits:
            b, n = draw(st.sampled_from(fits))
            return "pool", b + draw(st.integers(0, n - nbytes))
    return "pool", max(0, draw(st.sampled_from(_EDGES)) + draw(st.integers(-64, 64)))


@st.composite
def _batches(draw: st.DrawFn) -> list[tuple[tuple[str, int], tuple[str, int], int]]:
    sizes = [1, 16, 511, 512, 513, 4096, 4097, 8192, 9000]
    out = []
    for _ in range(draw(st.integers(1, 6))):
        n = draw(st.sampled_from([0] + sizes * 6))  # zero-length now and then
        out.append((draw(_pointer(n)), draw(_pointer(n)), n))
    return out


class _Differential:
    """One host issuer and the reference, with the same regions registered."""

    def __init__(self) -> None:
        self.issuer = H2DIssuer(backend="host")
        self.src = np.zeros(_POOL, dtype=np.uint8)
        self.dst = np.zeros(_POOL, dtype=np.uint8)
        self.model = CopyRegions()
        for b, n in _region_layout(self.src.ctypes.data):
            self.issuer.register_source(b, n)
            self.model.add_source(b, n)
        for b, n in _region_layout(self.dst.ctypes.data):
            self.issuer.register_destination(b, n)
            self.model.add_destination(b, n)


@pytest.fixture(scope="module")
def differential() -> Iterator[_Differential]:
    diff = _Differential()
    yield diff
    diff.issuer.close()


@settings(max_examples=150, deadline=None)
@given(batch=_batches())
def test_native_accepts_and_rejects_batches_as_the_reference(
    differential: _Differential, batch: list[tuple[tuple[str, int], tuple[str, int], int]]
) -> None:
    iss = differential.issuer
    src_base, dst_base = differential.src.ctypes.data, differential.dst.ctypes.data
    src, dst, nbytes = [], [], []
    for (s_kind, s_off), (d_kind, d_off), n in batch:
        src.append(UNMAPPED + s_off if s_kind == "unmapped" else src_base + s_off)
        dst.append(UNMAPPED + d_off if d_kind == "unmapped" else dst_base + d_off)
        nbytes.append(n)
    want = differential.model.check(src, dst, nbytes)
    try:
        t = iss.submit(np.array(src), np.array(dst), np.array(nbytes), [-1] * len(src), 2)
    except ValueError as exc:
        m = re.match(r"copy (\d+): (source|destination|nbytes|null)", str(exc))
        assert m is not None, str(exc)
        assert want == (int(m.group(1)), m.group(2)), str(exc)
        event(f"rejected: {m.group(2)}")
        return
    event("accepted")
    assert want is None, f"native accepted a batch the reference rejects at {want}"
    iss.wait(t, timeout_s=30)


def test_an_expert_store_from_the_callers_allocator_becomes_a_source(tmp_path: Path) -> None:
    import json

    import torch
    from transformers import AutoConfig

    from pdflash.models import get_adapter_class, write_synthetic_checkpoint
    from pdflash.models.store import ExpertStore

    path = write_synthetic_checkpoint(tmp_path / "olmoe", "olmoe", "tiny", dtype=torch.float32)
    cls = get_adapter_class(json.loads((path / "config.json").read_text())["model_type"])
    config = AutoConfig.from_pretrained(path)
    with H2DIssuer(backend="host") as iss:
        store = ExpertStore(
            path,
            cls.expert_layout(config, torch.float32),
            cls.expert_formats(config),
            config.num_hidden_layers,
            cls.num_experts_of(config),
            allocator=lambda n: torch.zeros(n, dtype=torch.uint8),
        )
        store.register_with(iss)  # as the adapter's attach_cache does
        ptr, n = store.buffer.data_ptr(), store.expert_nbytes
        dst = iss.pinned_array(n)
        iss.wait(iss.submit([ptr], [dst.ctypes.data], n, [-1], Band.ON_DEMAND), timeout_s=10)
        assert (dst == store.buffer[:n].numpy()).all()
        store.close()  # forgotten as a source; the caller's bytes stay valid
        assert store.pinned
        with pytest.raises(ValueError, match="copy 0: source"):
            iss.submit([ptr], [dst.ctypes.data], n, [-1], Band.ON_DEMAND)
