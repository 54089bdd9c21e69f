"""The engine's typed seams: the concrete cache, route stats and horizon are
instances of the Protocols the engine and the streaming prefetcher take
(mypy checks the signatures; this checks the members at run time)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pdflash.cache import ExpertCache
from pdflash.protocols import ExpertCacheView, HorizonPolicy, RouteStatsSink
from pdflash.routeahead import AcceptanceHorizon, RouteAheadStats


class _Source:
    num_layers, num_experts, expert_nbytes = 2, 4, 16

    def host_ptrs(self, flat_ids: Any) -> np.ndarray:
        return np.zeros(np.asarray(flat_ids).size, dtype=np.int64)


def test_expert_cache_is_a_cache_view(fake_issuer: Any) -> None:
    cache = ExpertCache(_Source(), fake_issuer, num_slots=4, top_k=2, max_batch_tokens=1)
    assert isinstance(cache, ExpertCacheView)


def test_route_ahead_stats_is_a_route_stats_sink() -> None:
    assert isinstance(RouteAheadStats(2, 4, 16), RouteStatsSink)


def test_acceptance_horizon_is_a_horizon_policy() -> None:
    assert isinstance(AcceptanceHorizon(4), HorizonPolicy)


@pytest.mark.parametrize("protocol", [ExpertCacheView, RouteStatsSink, HorizonPolicy])
def test_an_object_missing_the_members_is_refused(protocol: type) -> None:
    assert not isinstance(object(), protocol)
