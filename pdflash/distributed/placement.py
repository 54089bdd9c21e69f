"""Which rank owns each expert.

:class:`ExpertPlacement` is the seam: the exchange, each rank's cache and the
per-rank byte cost read only :meth:`ExpertPlacement.owner_table`. Two
policies:

* :class:`RoundRobinPlacement` (the fallback when nothing is measured): expert
  ``e`` of layer ``l`` goes to rank ``(e + l) % N``, so every rank owns the
  same number of experts per layer (within one) and in total.
* :class:`FrequencyBalancedPlacement`: static, balanced by measured routing
  frequency (route stats or a trace). Layer by layer, experts in decreasing
  frequency go to the rank with the least routed load so far (all layers
  placed until then, so a layer's imbalance is evened out by the next) among
  those holding fewer than ``ceil(E / N)`` of the layer's experts (ties: the
  lower rank). The count cap keeps each rank's slot demand even per layer;
  the load rule spreads the hot experts, so each link carries a similar
  share of the misses over a forward.

Placements are static per run: computed once, before the model is loaded,
from the grid and (for the balanced one) a measured frequency. Each rank
packs only its own experts into host memory
(:func:`owned_experts_of`, ``load_adapter(owned_experts=...)``), so nothing
re-places experts while a run is live: a new placement means loading the
ranks again (re-reading the checkpoint for the new share).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt


@runtime_checkable
class ExpertPlacement(Protocol):
    """An assignment of every (layer, expert) to one rank."""

    @property
    def num_ranks(self) -> int: ...

    def owner_table(self) -> npt.NDArray[np.int64]:
        """``[layers, experts]`` int64: the owning rank of each expert."""
        ...


def owned_mask(placement: ExpertPlacement, rank: int) -> npt.NDArray[np.bool_]:
    """``[layers, experts]`` bool: the experts ``rank`` owns."""
    if not 0 <= rank < placement.num_ranks:
        raise ValueError(f"rank {rank} out of range for {placement.num_ranks} ranks")
    return np.asarray(placement.owner_table() == rank, dtype=np.bool_)


def ranks_without_experts(placement: ExpertPlacement) -> list[int]:
    """The ranks ``placement`` gives no expert of any layer (more ranks than
    the grid spreads over: e.g. round robin on more than ``layers + experts
    - 1`` ranks)."""
    table = placement.owner_table()
    owned = np.bincount(table.reshape(-1), minlength=placement.num_ranks)
    return [int(r) for r in np.flatnonzero(owned == 0)]


def check_every_rank_owns_experts(placement: ExpertPlacement, purpose: str) -> None:
    """Raise ``ValueError`` naming the ranks that own no expert, the grid and
    the placement, for a ``purpose`` that needs experts on every rank (a
    rank's host computes only the experts it owns)."""
    empty = ranks_without_experts(placement)
    if not empty:
        return
    layers, experts = placement.owner_table().shape
    name = getattr(placement, "name", type(placement).__name__)
    which = ", ".join(str(r) for r in empty)
    raise ValueError(
        f"{purpose}: rank{'s' if len(empty) > 1 else ''} {which} of {placement.num_ranks} "
        f"own{'' if len(empty) > 1 else 's'} none of the {layers} layers x {experts} experts "
        f"under the {name} placement (only {placement.num_ranks - len(empty)} ranks own "
        "experts): run on fewer ranks, or without host experts"
    )


def check_owner_table(table: npt.ArrayLike, num_ranks: int) -> npt.NDArray[np.int64]:
    """Validate a ``[layers, experts]`` owner table (every entry a rank)."""
    arr = np.asarray(table)
    if arr.ndim != 2 or arr.size == 0:
        raise ValueError(
            f"owner table must be a non-empty [layers, experts] array, got {arr.shape}"
        )
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"owner table must hold integers, got {arr.dtype}")
    if arr.min() < 0 or arr.max() >= num_ranks:
        raise ValueError(f"owner table names ranks outside [0, {num_ranks})")
    return arr.astype(np.int64)


def _check_ranks(num_ranks: int) -> int:
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int | np.integer):
        raise TypeError(f"num_ranks must be an int, got {type(num_ranks).__name__}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    return int(num_ranks)


class _TablePlacement:
    """A placement held as its ``[layers, experts]`` owner table over
    :attr:`num_ranks` ranks (each placement below computes ``_table`` once)."""

    _n: int
    _table: npt.NDArray[np.int64]

    @property
    def num_ranks(self) -> int:
        return self._n

    def owner_table(self) -> npt.NDArray[np.int64]:
        result: npt.NDArray[np.int64] = self._table.copy()
        return result


class RoundRobinPlacement(_TablePlacement):
    """Expert ``e`` of layer ``l`` on rank ``(e + l) % N`` (uniform)."""

    name = "round_robin"

    def __init__(self, num_layers: int, num_experts: int, num_ranks: int) -> None:
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"need >= 1 layer and expert, got {num_layers}x{num_experts}")
        self._n = _check_ranks(num_ranks)
        layers = np.arange(num_layers, dtype=np.int64)[:, None]
        experts = np.arange(num_experts, dtype=np.int64)[None, :]
        self._table = (experts + layers) % self._n


class FrequencyBalancedPlacement(_TablePlacement):
    """Static placement balanced by measured routing frequency (module doc).

    ``frequency``: ``[layers, experts]`` non-negative routed counts or rates
    (e.g. :func:`frequency_from_topk` of a trace, or an engine's
    ``route_freq``). All-zero layers fall back to round robin."""

    name = "frequency_balanced"

    def __init__(self, frequency: npt.ArrayLike, num_ranks: int) -> None:
        freq = np.asarray(frequency, dtype=np.float64)
        if freq.ndim != 2 or freq.size == 0:
            raise ValueError(f"frequency must be a [layers, experts] array, got {freq.shape}")
        if not np.all(np.isfinite(freq)) or (freq < 0).any():
            raise ValueError("frequency must be finite and non-negative")
        self._n = _check_ranks(num_ranks)
        num_layers, num_experts = freq.shape
        cap = -(-num_experts // self._n)
        table = RoundRobinPlacement(num_layers, num_experts, self._n).owner_table()
        load = np.zeros(self._n, dtype=np.float64)  # over the layers placed so far
        for layer in range(num_layers):
            row = freq[layer]
            if not row.any():
                continue
            count = np.zeros(self._n, dtype=np.int64)
            for e in np.argsort(-row, kind="stable").tolist():
                open_ranks = np.flatnonzero(count < cap)
                r = int(open_ranks[np.argmin(load[open_ranks])])
                table[layer, e] = r
                load[r] += row[e]
                count[r] += 1
        self._table = table
        self.frequency = freq

    def rank_load(self) -> npt.NDArray[np.float64]:
        """``[ranks]``: the measured frequency each rank owns (all layers)."""
        load = np.bincount(
            self._table.reshape(-1), weights=self.frequency.reshape(-1), minlength=self._n
        )
        return np.asarray(load, dtype=np.float64)


def frequency_from_topk(topk: npt.ArrayLike, num_experts: int) -> npt.NDArray[np.float64]:
    """``[layers, experts]`` routed counts of a ``[tokens, layers, k]`` top-k
    array (a trace's ``token_topk`` or ``verify_topk``)."""
    arr = np.asarray(topk)
    if arr.ndim != 3:
        raise ValueError(f"top-k must be [tokens, layers, k], got shape {arr.shape}")
    num_layers = arr.shape[1]
    ids = arr.astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise ValueError(f"top-k ids outside [0, {num_experts})")
    flat = (np.arange(num_layers, dtype=np.int64)[None, :, None] * num_experts + ids).reshape(-1)
    counts = np.bincount(flat, minlength=num_layers * num_experts)
    return counts.reshape(num_layers, num_experts).astype(np.float64)


def frequency_from_trace(path: Any) -> npt.NDArray[np.float64]:
    """Routed counts (prompt and verify tokens) of a proxy trace file."""
    from pdflash.engine.replay import load_replay_trace

    trace = load_replay_trace(path)
    num_experts = int(trace.provenance["num_experts"])
    freq = frequency_from_topk(trace.token_topk, num_experts)
    if np.asarray(trace.verify_topk).size:
        freq = freq + frequency_from_topk(trace.verify_topk, num_experts)
    return freq


def placement_for(
    name: str,
    num_layers: int,
    num_experts: int,
    num_ranks: int,
    frequency: npt.ArrayLike | None = None,
) -> ExpertPlacement:
    """``round_robin`` or ``frequency`` (needs ``frequency``; falls back to
    round robin, by name, when none was measured: ``frequency=None``)."""
    if name == "round_robin" or (name == "frequency" and frequency is None):
        return RoundRobinPlacement(num_layers, num_experts, num_ranks)
    if name == "frequency":
        assert frequency is not None
        freq = np.asarray(frequency, dtype=np.float64)
        if freq.shape != (num_layers, num_experts):
            raise ValueError(f"frequency shape {freq.shape} != ({num_layers}, {num_experts})")
        return FrequencyBalancedPlacement(freq, num_ranks)
    raise ValueError(f"unknown placement {name!r} (round_robin, frequency)")


def owned_experts_of(
    name: str,
    rank: int,
    num_ranks: int,
    frequency: npt.ArrayLike | None = None,
) -> Callable[[int, int], npt.NDArray[np.bool_]]:
    """``load_adapter``'s ``owned_experts`` for ``rank`` of the placement
    ``name`` (as :func:`placement_for`): given the model's ``(layers,
    experts)`` grid, the experts ``rank`` owns, so its host store packs only
    those. The placement is recomputed from the same inputs once the adapter
    is loaded (it is deterministic), so the store and the runtime agree."""
    if not 0 <= rank < _check_ranks(num_ranks):
        raise ValueError(f"rank {rank} out of range for {num_ranks} ranks")

    def owned(num_layers: int, num_experts: int) -> npt.NDArray[np.bool_]:
        placement = placement_for(name, num_layers, num_experts, num_ranks, frequency)
        return owned_mask(placement, rank)

    return owned
