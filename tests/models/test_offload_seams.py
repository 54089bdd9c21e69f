"""The offloaded block's typed seams to its cache and its grouped MLP: the
optional capabilities (booking every layer in one call, the host slot table,
the fused slab MLP) are checked once, where the collaborator is attached
(:attr:`OffloadedMoE.cache`, :attr:`OffloadedMoE.grouped`), and a
collaborator without them runs the per-layer fallback."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from pdflash.cache import ExpertCache
from pdflash.engine.timing import ComputeTimer, StallTimedCache
from pdflash.h2d import H2DIssuer
from pdflash.models import offload
from pdflash.models.offload import FusableGroupedExperts, OffloadedMoE
from pdflash.protocols import (
    LayerBookingCache,
    SlabCache,
    SlotTableCache,
    layer_booking,
    offers,
    slot_table,
)

LAYERS, EXPERTS, NBYTES = 2, 4, 8
BOOKING = ("all_resident", "pin_layers_joined", "unpin_layers", "defer_accesses")


class PerLayerCache:
    """A cache with the per-layer calls only (no one-call booking, no slot
    table, no slab); records every call."""

    num_layers, num_experts, expert_nbytes = LAYERS, EXPERTS, NBYTES
    num_slots = LAYERS * EXPERTS

    def __init__(self, resident: Sequence[bool] = (True,) * LAYERS) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.resident = list(resident)
        self._slots = torch.zeros((self.num_slots, NBYTES), dtype=torch.uint8)

    def _ids(self, layer: int) -> npt.NDArray[np.int64]:
        return np.arange(layer * EXPERTS, (layer + 1) * EXPERTS, dtype=np.int64)

    def slot_tensor(self, slot: int) -> torch.Tensor:
        return self._slots[slot]

    def layer_resident(self, layer: int) -> bool:
        self.calls.append(("layer_resident", layer))
        return self.resident[layer]

    def pin_layer(self, layer: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        self.calls.append(("pin_layer", layer))
        return self._ids(layer), np.full(EXPERTS, -1, dtype=np.int64)

    def unpin_layer(self, layer: int) -> None:
        self.calls.append(("unpin_layer", layer))

    def defer_access(self, layer: int, routed: torch.Tensor) -> None:
        self.calls.append(("defer_access", layer))

    def wait_ready(self, tickets: Any) -> None:
        self.calls.append(("wait_ready", None))

    def abort(self, flat_ids: Any) -> None:
        self.calls.append(("abort", None))

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


class BookingCache(PerLayerCache):
    """:class:`PerLayerCache` that also books every layer in one call and
    has a host slot table (expert ``g`` in slot ``g``)."""

    def __init__(self, resident: Sequence[bool] = (True,) * LAYERS) -> None:
        super().__init__(resident)
        self.slot_of = np.arange(LAYERS * EXPERTS, dtype=np.int64)

    def all_resident(self) -> bool:
        self.calls.append(("all_resident", None))
        return all(self.resident)

    def pin_layers_joined(
        self, layers: Sequence[int]
    ) -> tuple[list[npt.NDArray[np.int64]], npt.NDArray[np.int64]]:
        self.calls.append(("pin_layers_joined", list(layers)))
        per_layer = [self._ids(layer) for layer in layers]
        return per_layer, np.full(EXPERTS * len(per_layer), -1, dtype=np.int64)

    def unpin_layers(self, layers: Sequence[int]) -> None:
        self.calls.append(("unpin_layers", list(layers)))

    def defer_accesses(self, layers: Sequence[int], routed: torch.Tensor) -> None:
        self.calls.append(("defer_accesses", list(layers)))


def _store() -> Any:
    return SimpleNamespace(
        expert_nbytes=NBYTES,
        num_experts=EXPERTS,
        layout=SimpleNamespace(views=lambda t: {"w": t}),
    )


def _block(cache: Any) -> OffloadedMoE:
    moe = OffloadedMoE(_store(), cache, lambda x, w: x)
    # a dense grouped MLP (set through the setter: the fakes have no slab),
    # so graph_blocker reaches its residency check
    moe.grouped = SimpleNamespace(compressed=False)  # type: ignore[assignment]
    return moe


def _topk() -> torch.Tensor:
    return torch.zeros((LAYERS, 3, 2), dtype=torch.int64)


# -- the capability checks -----------------------------------------------------


class _Src:
    num_layers, num_experts, expert_nbytes = LAYERS, EXPERTS, NBYTES

    def host_ptrs(self, flat_ids: Any) -> npt.NDArray[np.int64]:
        return np.zeros(np.asarray(flat_ids).size, dtype=np.int64)


def test_the_expert_cache_offers_every_optional_capability() -> None:
    with H2DIssuer(backend="host") as issuer:
        cache = ExpertCache(_Src(), issuer, num_slots=4, top_k=2, max_batch_tokens=1)
        assert layer_booking(cache) is cache and isinstance(cache, LayerBookingCache)
        assert slot_table(cache) is cache and isinstance(cache, SlotTableCache)
        assert isinstance(cache, SlabCache)
        # through the engine's stall timer (it delegates by __getattr__)
        wrapped = StallTimedCache(cache, ComputeTimer(torch.device("cpu")))
        assert layer_booking(wrapped) is wrapped
        assert slot_table(wrapped) is wrapped


@pytest.mark.parametrize("missing", BOOKING)
@pytest.mark.parametrize("how", ["absent", "none"])
def test_a_cache_missing_one_booking_call_is_not_a_booking_cache(missing: str, how: str) -> None:
    cache: Any
    if how == "absent":
        cls = type("Partial", (BookingCache,), {missing: None})
        # a class attribute set to None blocks the method, as for isinstance
        cache = cls()
    else:
        cache = BookingCache()
        setattr(cache, missing, None)
    assert layer_booking(cache) is None and not offers(cache, LayerBookingCache)
    if how == "absent":
        assert not isinstance(cache, LayerBookingCache)
    # (isinstance of a methods-only Protocol looks at the class only, so it
    # misses a call switched off on the instance; offers does not)
    # the others are still there: one missing call is enough to refuse
    assert layer_booking(BookingCache()) is not None


def test_a_cache_without_any_capability_is_refused() -> None:
    cache = PerLayerCache()
    assert layer_booking(cache) is None and slot_table(cache) is None
    assert not isinstance(cache, LayerBookingCache)
    wrapped = StallTimedCache(cache, ComputeTimer(torch.device("cpu")))
    assert layer_booking(wrapped) is None and slot_table(wrapped) is None


# -- the fallback: a cache without the one-call booking --------------------------


def test_a_cache_without_one_call_booking_books_layer_by_layer() -> None:
    cache = PerLayerCache()
    moe = _block(cache)
    assert moe.graph_blocker() is None
    assert cache.names() == ["layer_resident"] * LAYERS
    cache.calls.clear()
    pinned = moe.pin_resident()
    assert [p.tolist() for p in pinned] == [cache._ids(i).tolist() for i in range(LAYERS)]
    assert cache.calls == [("pin_layer", 0), ("pin_layer", 1)]
    cache.calls.clear()
    moe.unpin_resident()
    assert cache.calls == [("unpin_layer", 0), ("unpin_layer", 1)]
    cache.calls.clear()
    moe.book_resident(_topk())
    assert cache.calls == [
        ("defer_access", 0),
        ("unpin_layer", 0),
        ("defer_access", 1),
        ("unpin_layer", 1),
    ]
    # no slot table: no resident window (the masked grouped calls run)
    assert moe._resident_window(1) is None


def test_a_cache_without_one_call_booking_still_refuses_a_missing_layer() -> None:
    cache = PerLayerCache(resident=(True, False))
    assert _block(cache).graph_blocker() == "experts_not_resident"


# -- a cache with it: one call each, checked once --------------------------------


def test_a_booking_cache_books_every_layer_in_one_call() -> None:
    cache = BookingCache()
    moe = _block(cache)
    assert moe.graph_blocker() is None
    assert cache.names() == ["all_resident"]
    cache.calls.clear()
    assert len(moe.pin_resident()) == LAYERS
    assert cache.calls == [("pin_layers_joined", [0, 1])]
    cache.calls.clear()
    moe.unpin_resident()
    assert cache.calls == [("unpin_layers", [0, 1])]
    cache.calls.clear()
    moe.book_resident(_topk())
    assert cache.calls == [("defer_accesses", [0, 1]), ("unpin_layers", [0, 1])]
    cache.calls.clear()
    # a list of routings: recorded per layer, unpinned in one pass
    moe.book_resident(list(_topk()))
    assert cache.calls == [("defer_access", 0), ("defer_access", 1), ("unpin_layers", [0, 1])]
    assert moe._resident_window(1) == (EXPERTS, EXPERTS)
    assert BookingCache(resident=(False, True)).all_resident() is False
    assert _block(BookingCache(resident=(False, True))).graph_blocker() == "experts_not_resident"


def test_the_cache_capabilities_are_checked_once_per_attached_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checks: list[object] = []
    real = offload.layer_booking

    def counting(cache: object) -> LayerBookingCache | None:
        checks.append(cache)
        return real(cache)

    monkeypatch.setattr(offload, "layer_booking", counting)
    booking = BookingCache()
    moe = _block(booking)
    for _ in range(3):
        moe.graph_blocker()
        moe.book_resident(_topk())
        moe.pin_resident()
        moe.unpin_resident()
    assert checks == [booking]
    # the engine's stall timer wraps the attached cache: checked again, once,
    # and the wrapped cache's one-call booking is still used through it
    wrapped = StallTimedCache(booking, ComputeTimer(torch.device("cpu")))
    moe.cache = wrapped  # type: ignore[assignment]
    assert checks == [booking, wrapped]
    booking.calls.clear()
    moe.pin_resident()
    assert booking.calls == [("pin_layers_joined", [0, 1])]
    # a cache without it, attached later: the per-layer fallback from then on
    plain = PerLayerCache()
    moe.cache = plain  # type: ignore[assignment]
    assert len(checks) == 3
    moe.pin_resident()
    assert plain.names() == ["pin_layer", "pin_layer"]
    assert booking.calls == [("pin_layers_joined", [0, 1])]


# -- the grouped MLP's fused slab MLP ---------------------------------------------


def test_the_fused_slab_mlp_is_read_at_each_call_of_a_fusable_mlp() -> None:
    moe = _block(PerLayerCache())
    assert moe.compressed_gemm is None  # dense
    plain = SimpleNamespace(compressed=True)  # no `fused`: never fused
    moe.grouped = plain  # type: ignore[assignment]
    assert not isinstance(plain, FusableGroupedExperts)
    assert moe.compressed_gemm == "dequant"
    fusable = SimpleNamespace(compressed=True, fused=None)
    moe.grouped = fusable  # type: ignore[assignment]
    assert moe.compressed_gemm == "dequant"
    # switched after it was attached (as the fused-vs-dequant tests and the
    # bench do): seen at the next call
    fusable.fused = object()
    assert moe.compressed_gemm == "fused"
    fusable.fused = None
    assert moe.compressed_gemm == "dequant"
    moe.grouped = None
    assert moe.path == "loop" and moe.compressed_gemm is None
