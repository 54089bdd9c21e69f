"""ExpertCache.restrict_to: an expert-parallel rank's cache holds only its
experts, and a layer is resident once those are."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pdflash.cache import ExpertCache
from pdflash.h2d import H2DIssuer
from pdflash.protocols import Band

NBYTES = 64


class Source:
    def __init__(self, layers: int = 2, experts: int = 4) -> None:
        self.num_layers, self.num_experts, self.expert_nbytes = layers, experts, NBYTES
        ids = torch.arange(layers * experts) % 251
        self.buffer = ids.to(torch.uint8).repeat_interleave(NBYTES)

    def host_ptrs(self, flat_ids: Any) -> np.ndarray:
        return self.buffer.data_ptr() + np.asarray(flat_ids, dtype=np.int64) * NBYTES


@pytest.fixture
def issuer() -> Any:
    iss = H2DIssuer(backend="host")
    yield iss
    iss.close()


def _cache(issuer: Any) -> ExpertCache:
    src = Source()
    issuer.register_host(src.buffer.data_ptr(), src.buffer.numel())
    cache = ExpertCache(src, issuer, num_slots=4, top_k=2, max_batch_tokens=1)
    return cache


def _owned() -> np.ndarray:
    owned = np.zeros((2, 4), dtype=np.bool_)
    owned[0, [0, 2]] = True
    owned[1, [1, 3]] = True
    return owned


def test_restricted_cache_refuses_other_experts_and_keeps_state(issuer: Any) -> None:
    cache = _cache(issuer)
    cache.restrict_to(_owned())
    with pytest.raises(ValueError, match=r"expert 1 .*restrict_to"):
        cache.acquire(np.array([0, 1]))
    with pytest.raises(ValueError, match="expert 4 "):
        cache.prefetch(np.array([4]), Band.ROUTE_AHEAD)
    assert not cache.resident_mask().any() and int(cache.pins.sum()) == 0
    slots = cache.ensure_resident(np.array([0, 2]))
    for flat, slot in zip([0, 2], slots.tolist(), strict=True):
        assert int(cache.slab[slot][0]) == flat  # the right bytes
    cache.release(np.array([0, 2]))


def test_a_layer_is_resident_once_its_owned_experts_are(issuer: Any) -> None:
    cache = _cache(issuer)
    cache.restrict_to(_owned())
    assert not cache.layer_resident(0)
    cache.ensure_resident(np.array([0, 2]))
    cache.release(np.array([0, 2]))
    assert cache.layer_resident(0) and not cache.layer_resident(1)
    ids, tickets = cache.pin_layer(0)
    assert ids.tolist() == [0, 2] and (tickets < 0).all()
    assert int(cache.pins.sum()) == 2
    cache.unpin_layer(0)
    assert int(cache.pins.sum()) == 0


def test_restrict_to_checks_its_mask_and_what_is_held(issuer: Any) -> None:
    cache = _cache(issuer)
    with pytest.raises(ValueError, match="bool"):
        cache.restrict_to(np.ones((2, 4), dtype=np.int64))
    with pytest.raises(ValueError, match="bool"):
        cache.restrict_to(np.ones((4, 2), dtype=np.bool_))
    cache.ensure_resident(np.array([1]))
    cache.release(np.array([1]))
    with pytest.raises(ValueError, match="already holds"):
        cache.restrict_to(_owned())
    assert cache.owned is None  # refused: unchanged
