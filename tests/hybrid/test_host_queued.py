"""HostExpertService.host_queued: a layer's routed experts whose copy is
still queued (not started) are offered to the planner with the misses; one
it hosts has its copy cancelled and its slot given back, one whose copy
started stays a copy; off (the default), such experts are never offered."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from issuer_fixtures import PatternExperts

from pdflash.cache import ExpertCache
from pdflash.h2d import STATE_QUEUED, H2DIssuer
from pdflash.hybrid import ForcedHostPlanner, HostExpertExecutor, HostExpertService, LinkState
from pdflash.protocols import Band

NBYTES = 64
EXPERTS = 8


@dataclass
class _AllHost(ForcedHostPlanner):
    """Every offered expert HOST; keeps what each plan was offered."""

    offered: list[list[int]] = field(default_factory=list)
    links: list[LinkState] = field(default_factory=list)

    def plan(self, layer, missed, tokens, link):  # type: ignore[no-untyped-def]
        self.offered.append(sorted(int(i) for i in missed))
        self.links.append(link)
        return super().plan(layer, missed, tokens, link)


@pytest.fixture
def held() -> Iterator[tuple[ExpertCache, H2DIssuer]]:
    """A cache over the host issuer, whose window holds one copy, with the
    link held: of the route-ahead copies of experts 1, 2, 3 (layer 0) the
    first has started, the others are queued."""
    issuer = H2DIssuer(backend="host", chunk_bytes=NBYTES, window_bytes=NBYTES)
    src = PatternExperts(2, EXPERTS, NBYTES)
    issuer.register_source(src.buffer.data_ptr(), src.buffer.numel())
    cache = ExpertCache(src, issuer, num_slots=6, top_k=2, max_batch_tokens=1)
    issuer._native.test_hold_link(True)
    ahead = cache.prefetch([1, 2, 3], Band.ROUTE_AHEAD)
    deadline = time.monotonic() + 10
    while issuer.states(ahead[:1])[0] == STATE_QUEUED:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert (issuer.states(ahead[1:]) == STATE_QUEUED).all()
    try:
        yield cache, issuer
    finally:
        issuer._native.test_hold_link(False)
        cache.drain_inflight()
        issuer.close()


def _service(planner: _AllHost) -> HostExpertService:
    ex = HostExpertExecutor(
        lambda g: {"w": torch.tensor(float(g + 1))},
        lambda x, w: x * w["w"],
        dtype=torch.float32,
        workers=1,
    )
    return HostExpertService(
        ex, planner, num_experts=EXPERTS, expert_nbytes=NBYTES, link_bytes_per_s=1e3
    )


def test_queued_copies_are_offered_and_given_back_where_hosted(
    held: tuple[ExpertCache, H2DIssuer],
) -> None:
    cache, _ = held
    planner = _AllHost(every=1)
    svc = _service(planner)
    svc.host_queued = True
    ids, tok = np.array([1, 2, 3, 5]), np.array([1, 1, 1, 1])  # 5 misses
    try:
        out = svc.split(0, ids, tok, cache)
    finally:
        svc.executor.close()
    # 1 started (stays a copy, not offered); 2, 3 queued and 5 missing: hosted
    assert planner.offered == [[2, 3, 5]]
    assert out.tolist() == [False, True, True, True]
    # the link ahead of the layer's copies: only the started one
    assert planner.links[0].ahead_bytes == NBYTES
    assert not cache.is_resident([2, 3]).any() and cache.is_resident([1])[0]
    assert svc.books.queued_hosted == 2 and cache.given_back == 2
    described = svc.describe()
    assert described["host_queued"] is True and described["queued_hosted"] == 2


def test_off_queued_copies_stay_copies(held: tuple[ExpertCache, H2DIssuer]) -> None:
    cache, _ = held
    planner = _AllHost(every=1)
    svc = _service(planner)
    try:
        out = svc.split(0, np.array([1, 2, 3, 5]), np.array([1, 1, 1, 1]), cache)
    finally:
        svc.executor.close()
    assert planner.offered == [[5]] and out.tolist() == [False, False, False, True]
    assert planner.links[0].ahead_bytes == 3 * NBYTES
    assert cache.is_resident([1, 2, 3]).all() and cache.given_back == 0
    assert svc.describe()["host_queued"] is False


def test_a_pinned_queued_copy_is_not_offered(held: tuple[ExpertCache, H2DIssuer]) -> None:
    cache, _ = held
    cache.acquire([2])  # a forward holds it: its copy must land
    planner = _AllHost(every=1)
    svc = _service(planner)
    svc.host_queued = True
    try:
        out = svc.split(0, np.array([2, 3]), np.array([1, 1]), cache)
    finally:
        svc.executor.close()
        cache.release([2])
    assert planner.offered == [[3]] and out.tolist() == [False, True]
    assert cache.is_resident([2])[0] and not cache.is_resident([3])[0]
