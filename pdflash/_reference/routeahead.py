"""A pure-Python route-ahead accumulator, independent of the native one.

It mirrors :class:`pdflash_native._routeahead.RouteAheadAccumulator`'s
semantics with Python sets of expert indices, so a differential test can
compare the two counter by counter. Slow on purpose (it is the baseline the
benchmark's ``speedup`` is measured against); never used at run time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

_COUNT_NAMES: tuple[str, ...] = (
    "req_predicted",
    "req_routed",
    "req_hits",
    "req_wasted",
    "req_missed",
    "predicted",
    "routed",
    "hits",
    "wasted",
    "missed",
    "resident_routed",
    "prefetch_issued",
    "prefetch_used",
    "prefetch_unused",
    "demand_loads",
    "late_used",
    "evicted_before_use",
)
COUNTER_NAMES: tuple[str, ...] = _COUNT_NAMES + tuple(f"{n}_bytes" for n in _COUNT_NAMES)

ExpertSets = list[list[set[int]]]  # [request][layer] -> experts


class RouteAheadReference:
    """Same constructor, update, eviction and readout API as the native
    accumulator; state held in Python ints, floats and sets."""

    def __init__(
        self, num_layers: int, num_experts: int, expert_nbytes: Any, decay: float = 0.9
    ) -> None:
        if num_layers <= 0 or num_experts <= 0:
            raise ValueError(f"bad shape ({num_layers}, {num_experts})")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.decay = decay
        nb = np.asarray(expert_nbytes)
        if nb.ndim == 0:
            self._nbytes = [[int(nb)] * num_experts for _ in range(num_layers)]
        else:
            self._nbytes = [[int(v) for v in row] for row in nb.tolist()]
        self.reset()

    def reset(self) -> None:
        self._counts: dict[str, list[int]] = {n: [0] * self.num_layers for n in COUNTER_NAMES}
        self._freq = [[0.0] * self.num_experts for _ in range(self.num_layers)]
        self._pending: list[set[int]] = [set() for _ in range(self.num_layers)]
        self.steps = 0
        self.requests = 0

    # ---------------------------------------------------------------- input

    def _sets_from_mask_rows(self, mask: npt.ArrayLike) -> ExpertSets:
        arr = np.asarray(mask)
        rows: Any = (arr[None] if arr.ndim == 2 else arr).tolist()
        return [[{e for e, v in enumerate(row) if v} for row in req] for req in rows]

    def _sets_from_bitsets(self, bits: npt.ArrayLike) -> ExpertSets:
        arr = np.asarray(bits)
        rows: Any = (arr[None] if arr.ndim == 2 else arr).tolist()
        out: ExpertSets = []
        for req in rows:
            layers = []
            for words in req:
                value = sum(int(w) << (64 * i) for i, w in enumerate(words))
                layers.append({e for e in range(self.num_experts) if value >> e & 1})
            out.append(layers)
        return out

    def update_masks(
        self, predicted: npt.ArrayLike, routed: npt.ArrayLike, resident: npt.ArrayLike | None = None
    ) -> None:
        res = None if resident is None else self._sets_from_mask_rows(resident)[0]
        self._step(self._sets_from_mask_rows(predicted), self._sets_from_mask_rows(routed), res)

    def update_bitsets(
        self, predicted: npt.ArrayLike, routed: npt.ArrayLike, resident: npt.ArrayLike | None = None
    ) -> None:
        res = None if resident is None else self._sets_from_bitsets(resident)[0]
        self._step(self._sets_from_bitsets(predicted), self._sets_from_bitsets(routed), res)

    # ----------------------------------------------------------------- step

    def _bytes(self, layer: int, experts: Iterable[int]) -> int:
        row = self._nbytes[layer]
        return sum(row[e] for e in experts)

    def _add(self, name: str, layer: int, experts: set[int]) -> None:
        self._counts[name][layer] += len(experts)
        self._counts[f"{name}_bytes"][layer] += self._bytes(layer, experts)

    def _step(
        self, predicted: ExpertSets, routed: ExpertSets, resident: Sequence[set[int]] | None
    ) -> None:
        if len(predicted) != len(routed):
            raise ValueError("predicted and routed differ in requests")
        if not predicted:  # a step without requests is not a step (as native)
            return
        L = self.num_layers
        union_p: list[set[int]] = [set() for _ in range(L)]
        union_u: list[set[int]] = [set() for _ in range(L)]
        step_counts = [[0] * self.num_experts for _ in range(L)]
        for p_req, u_req in zip(predicted, routed, strict=True):
            for layer in range(L):
                p, u = p_req[layer], u_req[layer]
                self._add("req_predicted", layer, p)
                self._add("req_routed", layer, u)
                self._add("req_hits", layer, p & u)
                self._add("req_wasted", layer, p - u)
                self._add("req_missed", layer, u - p)
                union_p[layer] |= p
                union_u[layer] |= u
                for e in u:
                    step_counts[layer][e] += 1
        for layer in range(L):
            p, u = union_p[layer], union_u[layer]
            res = set() if resident is None else resident[layer]
            issued = p - res
            self._add("predicted", layer, p)
            self._add("routed", layer, u)
            self._add("hits", layer, p & u)
            self._add("wasted", layer, p - u)
            self._add("missed", layer, u - p)
            self._add("resident_routed", layer, u & res)
            self._add("prefetch_issued", layer, issued)
            self._add("prefetch_used", layer, issued & u)
            self._add("prefetch_unused", layer, issued - u)
            self._add("demand_loads", layer, u - p - res)
            self._add("late_used", layer, self._pending[layer] & u)
            self._pending[layer] = (self._pending[layer] - u) | (issued - u)
            for e in range(self.num_experts):
                self._freq[layer][e] = self._freq[layer][e] * self.decay + step_counts[layer][e]
        self.steps += 1
        self.requests += len(predicted)

    def record_eviction(self, flat_ids: npt.ArrayLike) -> int:
        total = 0
        for g in np.asarray(flat_ids).reshape(-1).tolist():
            layer, e = divmod(int(g), self.num_experts)
            if not 0 <= layer < self.num_layers:
                raise ValueError(f"expert id {g} out of range")
            if e in self._pending[layer]:
                self._pending[layer].discard(e)
                self._add("evicted_before_use", layer, {e})
                total += self._nbytes[layer][e]
        return total

    # --------------------------------------------------------------- output

    def counters(self) -> npt.NDArray[np.int64]:
        return np.array([self._counts[n] for n in COUNTER_NAMES], dtype=np.int64)

    def frequency(self) -> npt.NDArray[np.float64]:
        return np.array(self._freq, dtype=np.float64)

    def pending(self) -> npt.NDArray[np.bool_]:
        out = np.zeros((self.num_layers, self.num_experts), dtype=np.bool_)
        for layer, experts in enumerate(self._pending):
            for e in experts:
                out[layer, e] = True
        return out
