"""Route-ahead bookkeeping: how well predictions matched what verify routed.

Per step the engine hands :class:`RouteAheadStats` the predicted set P, the
routed set U (per request, or one set for the step) and the set resident on
the device before the step R. Two scopes are kept, per layer:

* **request** — each request's own P_r against its own U_r, summed over
  requests: the predictor's quality. hits |P_r∩U_r|, wasted |P_r∖U_r|,
  missed |U_r∖P_r|.
* **batch** — the union over the step's requests, which is what the copy
  engine moves: the same three counts on ∪P_r and ∪U_r, plus copies against
  the resident set: ``resident_routed`` |U∩R|, ``prefetch_issued`` |P∖R|,
  ``prefetch_used`` |(P∖R)∩U|, ``prefetch_unused`` |(P∖R)∖U|,
  ``demand_loads`` |U∖P∖R| (stalls), ``late_used`` (a prefetch left unused
  by its step and routed by a later one) and ``evicted_before_use`` (a
  prefetch evicted before any step routed it, see :meth:`record_eviction`).

Each count has a byte twin. Counters only grow; :meth:`RouteAheadStats.reset`
is the one way to zero them. The hot update runs in
``pdflash_native._routeahead``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from pdflash._native import load_native
from pdflash.metrics import Metric, metrics_to_json, ratio

if TYPE_CHECKING:
    # mypy types every call against the checked stub (_routeahead.pyi)
    from pdflash.protocols import MoEModelAdapter, RouteStatsSink
    from pdflash_native import _routeahead as _native
else:
    _native = load_native("_routeahead")

_NO_ROUTED = "no routed experts observed"
_NO_PREDICTED = "no predicted experts observed"
_NO_ROUTED_BYTES = "no routed expert bytes observed"
_NO_PREDICTED_BYTES = "no predicted expert bytes observed"
_NO_PREFETCH = "no prefetches issued"


@dataclass(frozen=True)
class SetCounts:
    """Predicted against routed expert sets, for one layer or all layers."""

    predicted: int
    routed: int
    hits: int
    wasted: int
    missed: int
    predicted_bytes: int
    routed_bytes: int
    hits_bytes: int
    wasted_bytes: int
    missed_bytes: int

    @property
    def coverage(self) -> Metric:
        """Σ|P∩U| / Σ|U|: the share of routed experts that were predicted."""
        return ratio(self.hits, self.routed, _NO_ROUTED)

    @property
    def precision(self) -> Metric:
        """Σ|P∩U| / Σ|P|: the share of predicted experts that were routed."""
        return ratio(self.hits, self.predicted, _NO_PREDICTED)

    @property
    def coverage_bytes(self) -> Metric:
        return ratio(self.hits_bytes, self.routed_bytes, _NO_ROUTED_BYTES)

    @property
    def precision_bytes(self) -> Metric:
        return ratio(self.hits_bytes, self.predicted_bytes, _NO_PREDICTED_BYTES)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = dict(asdict(self))
        out.update(
            metrics_to_json(
                {
                    "coverage": self.coverage,
                    "precision": self.precision,
                    "coverage_bytes": self.coverage_bytes,
                    "precision_bytes": self.precision_bytes,
                }
            )
        )
        return out


@dataclass(frozen=True)
class CopyCounts:
    """The batch-scope sets against the resident set (counts and bytes)."""

    resident_routed: int
    prefetch_issued: int
    prefetch_used: int
    prefetch_unused: int
    demand_loads: int
    late_used: int
    evicted_before_use: int
    resident_routed_bytes: int
    prefetch_issued_bytes: int
    prefetch_used_bytes: int
    prefetch_unused_bytes: int
    demand_loads_bytes: int
    late_used_bytes: int
    evicted_before_use_bytes: int

    @property
    def prefetch_use_rate(self) -> Metric:
        """Prefetched bytes routed in their own step / prefetched bytes."""
        return ratio(self.prefetch_used_bytes, self.prefetch_issued_bytes, _NO_PREFETCH)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = dict(asdict(self))
        out.update(metrics_to_json({"prefetch_use_rate": self.prefetch_use_rate}))
        return out


_SET_FIELDS = ("predicted", "routed", "hits", "wasted", "missed")
_COPY_FIELDS = (
    "resident_routed",
    "prefetch_issued",
    "prefetch_used",
    "prefetch_unused",
    "demand_loads",
    "late_used",
    "evicted_before_use",
)


@dataclass(frozen=True)
class RouteAheadSnapshot:
    """Counters at one instant. ``request``/``batch``/``copies`` are totals
    over layers; the ``*_layers`` tuples hold one entry per layer."""

    steps: int
    requests: int
    request: SetCounts
    batch: SetCounts
    copies: CopyCounts
    request_layers: tuple[SetCounts, ...]
    batch_layers: tuple[SetCounts, ...]
    copies_layers: tuple[CopyCounts, ...]

    @property
    def coverage(self) -> Metric:
        """The predictor's coverage (request scope), over all layers."""
        return self.request.coverage

    @property
    def precision(self) -> Metric:
        """The predictor's precision (request scope), over all layers."""
        return self.request.precision

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; unmeasured ratios are ``null`` with a reason
        under ``"not_measured"`` (see :func:`pdflash.metrics.metrics_to_json`)."""
        return {
            "steps": self.steps,
            "requests": self.requests,
            "request": self.request.to_json(),
            "batch": self.batch.to_json(),
            "copies": self.copies.to_json(),
            "request_layers": [c.to_json() for c in self.request_layers],
            "batch_layers": [c.to_json() for c in self.batch_layers],
            "copies_layers": [c.to_json() for c in self.copies_layers],
        }


def _set_counts(
    table: dict[str, npt.NDArray[np.int64]], prefix: str, layer: int | None
) -> SetCounts:
    def pick(name: str) -> int:
        row = table[prefix + name]
        return int(row.sum() if layer is None else row[layer])

    kwargs = {f: pick(f) for f in _SET_FIELDS}
    kwargs.update({f"{f}_bytes": pick(f"{f}_bytes") for f in _SET_FIELDS})
    return SetCounts(**kwargs)


def _copy_counts(table: dict[str, npt.NDArray[np.int64]], layer: int | None) -> CopyCounts:
    def pick(name: str) -> int:
        row = table[name]
        return int(row.sum() if layer is None else row[layer])

    kwargs = {f: pick(f) for f in _COPY_FIELDS}
    kwargs.update({f"{f}_bytes": pick(f"{f}_bytes") for f in _COPY_FIELDS})
    return CopyCounts(**kwargs)


class RouteAheadStats:
    """Accumulates route-ahead hits, waste and misses (see the module doc).

    ``expert_nbytes``: one int, or an int ``(num_layers, num_experts)``
    array. ``decay`` in (0, 1]: per-step factor of the frequency estimate
    (``freq = decay * freq + requests routing the expert this step``).
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        expert_nbytes: int | npt.ArrayLike,
        *,
        decay: float = 0.9,
    ) -> None:
        self._acc = _native.RouteAheadAccumulator(num_layers, num_experts, expert_nbytes, decay)

    @classmethod
    def for_adapter(cls, adapter: MoEModelAdapter, *, decay: float = 0.9) -> RouteAheadStats:
        """Stats sized for a model adapter (uniform ``adapter.expert_nbytes``)."""
        return cls(adapter.num_layers, adapter.num_experts, adapter.expert_nbytes, decay=decay)

    @property
    def num_layers(self) -> int:
        return self._acc.num_layers

    @property
    def num_experts(self) -> int:
        return self._acc.num_experts

    @property
    def steps(self) -> int:
        return self._acc.steps

    def update(
        self,
        predicted: npt.ArrayLike,
        routed: npt.ArrayLike,
        resident: npt.ArrayLike | None = None,
    ) -> None:
        """Record one verify step from bool/uint8 masks.

        ``predicted``, ``routed``: ``(L, E)`` for the step, or ``(R, L, E)``
        per request (row r is request r in both). ``resident``: ``(L, E)``
        resident before the step, or None (nothing resident). A batch of zero
        requests records nothing. Invalid input raises and records nothing.
        """
        self._acc.update_masks(predicted, routed, resident)

    def update_bitsets(
        self,
        predicted: npt.ArrayLike,
        routed: npt.ArrayLike,
        resident: npt.ArrayLike | None = None,
    ) -> None:
        """:meth:`update` from uint64 bitsets ``(.., L, ceil(E / 64))``
        (expert e is bit e % 64 of word e // 64); see :func:`pack_masks` and
        :func:`routed_bitsets_from_topk`."""
        self._acc.update_bitsets(predicted, routed, resident)

    def record_eviction(self, flat_ids: npt.ArrayLike) -> int:
        """Experts (flat ids) the cache just evicted. Those prefetched and not
        yet routed count as evicted before use; returns their bytes."""
        return int(self._acc.record_eviction(flat_ids))

    def frequency(self) -> npt.NDArray[np.float32]:
        """Decayed per-expert routing counts, float32 ``(L, E)`` (a copy)."""
        return self._acc.frequency()

    def pending_prefetch(self) -> npt.NDArray[np.bool_]:
        """``(L, E)``: prefetched and not yet routed by any step."""
        return self._acc.pending()

    def snapshot(self) -> RouteAheadSnapshot:
        table = dict(zip(_native.COUNTER_NAMES, self._acc.counters(), strict=True))
        layers = range(self.num_layers)
        return RouteAheadSnapshot(
            steps=self._acc.steps,
            requests=self._acc.requests,
            request=_set_counts(table, "req_", None),
            batch=_set_counts(table, "", None),
            copies=_copy_counts(table, None),
            request_layers=tuple(_set_counts(table, "req_", layer) for layer in layers),
            batch_layers=tuple(_set_counts(table, "", layer) for layer in layers),
            copies_layers=tuple(_copy_counts(table, layer) for layer in layers),
        )

    def to_json(self) -> dict[str, Any]:
        return self.snapshot().to_json()

    def reset(self) -> None:
        """Zero all counters, the frequency estimate and the pending set."""
        self._acc.reset()


def pack_masks(masks: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    """``(..., E)`` bool/uint8 masks -> ``(..., ceil(E / 64))`` uint64 bitsets."""
    return _native.pack_masks(masks)


def routed_bitsets_from_topk(
    topk_ids: npt.ArrayLike, token_request: npt.ArrayLike, num_requests: int, num_experts: int
) -> npt.NDArray[np.uint64]:
    """Per-request routed bitsets ``(R, L, W)`` from a forward's top-k ids
    ``(L, T, k)`` int64 and each token's request index ``(T,)`` int64 (-1: skip)."""
    return _native.routed_bitsets_from_topk(topk_ids, token_request, num_requests, num_experts)


def unpack_bitsets(bits: npt.ArrayLike, num_experts: int) -> npt.NDArray[np.bool_]:
    """``(..., ceil(E / 64))`` uint64 bitsets -> ``(..., E)`` bool masks
    (the inverse of :func:`pack_masks`)."""
    arr = np.ascontiguousarray(bits)
    if arr.dtype != np.uint64:
        raise TypeError(f"bits must be uint64, got dtype {arr.dtype}")
    words = (num_experts + 63) // 64
    if arr.ndim < 1 or arr.shape[-1] != words:
        raise ValueError(
            f"bits must end in {words} words for {num_experts} experts, got shape {arr.shape}"
        )
    # NOTE: bit e of word w is byte (8w + e // 8), bit e % 8 on a little-endian
    # host, which the native packer also assumes (it refuses to build otherwise).
    flat = np.unpackbits(arr.view(np.uint8), axis=-1, bitorder="little")
    return flat[..., :num_experts].astype(np.bool_)


if TYPE_CHECKING:
    # mypy: RouteAheadStats is the engine's route-stats sink
    def _is_route_stats_sink(stats: RouteAheadStats) -> RouteStatsSink:
        return stats
