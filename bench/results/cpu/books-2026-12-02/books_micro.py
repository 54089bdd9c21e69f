"""Per-call host cost of the expert cache's per-layer books, without the
model: a cache of 8 layers x 32 experts, 64 slots, LRU or layer-cyclic
eviction, an issuer whose copies land at once (no copy engine in the
timing). Median of 7 repeats of a timed loop; prints one JSON line.

    python -P books_micro.py            # the installed pdflash
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import numpy as np
import torch

from pdflash.cache import ExpertCache
from pdflash.cache.eviction import LayerCyclicPolicy

LAYERS, EXPERTS, SLOTS, NBYTES = 8, 32, 64, 64


class Source:
    num_layers, num_experts, expert_nbytes = LAYERS, EXPERTS, NBYTES

    def host_ptrs(self, flat_ids: Any) -> np.ndarray:
        return (1 << 30) + np.asarray(flat_ids, dtype=np.int64) * NBYTES


class Issuer:
    """Every copy lands at once (states: DONE)."""

    def __init__(self) -> None:
        self.next = 0

    def submit(self, src: Any, dst: Any, nbytes: Any, keys: Any, band: Any) -> np.ndarray:
        n = len(keys)
        out = np.arange(self.next, self.next + n, dtype=np.int64)
        self.next += n
        return out

    def states(self, tickets: Any) -> np.ndarray:
        return np.full(len(tickets), 2, dtype=np.uint8)

    def poll(self, tickets: Any) -> np.ndarray:
        return np.ones(len(tickets), dtype=np.bool_)

    def wait(self, tickets: Any, timeout_s: float | None = None) -> None:
        pass

    def cancel(self, band: Any = None) -> int:
        return 0

    @property
    def backend(self) -> str:
        return "host"

    def stream_wait(self, tickets: Any, stream_handle: int) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def per_call_us(fn: Any, number: int = 2000) -> float:
    runs = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(number):
            fn()
        runs.append((time.perf_counter() - t) / number)
    return 1e6 * statistics.median(runs)


def main() -> None:
    out: dict[str, float] = {}
    rng = np.random.default_rng(0)
    # all-hit layer (every expert of layer 0 resident): the resident path
    cache = ExpertCache(
        Source(),
        Issuer(),
        num_slots=SLOTS,
        top_k=4,
        max_batch_tokens=8,
        policy=LayerCyclicPolicy(LAYERS, EXPERTS),
    )
    cache.prefetch(np.arange(EXPERTS))
    cache.free_capacity()  # the copies land
    routed = torch.as_tensor(rng.integers(0, EXPERTS, 8), dtype=torch.int64)

    def resident_layer() -> None:
        if cache.layer_resident(0):
            cache.pin_layer(0)
            cache.defer_access(0, routed)
            cache.unpin_layer(0)

    out["resident_layer(layer_resident+pin_layer+defer_access+unpin_layer)"] = per_call_us(
        resident_layer
    )
    out["flush_one_deferred_layer(stats)"] = per_call_us(
        lambda: (cache.defer_access(0, routed), cache.stats()), number=1000
    )
    out["pin_layer+unpin_layer"] = per_call_us(lambda: (cache.pin_layer(0), cache.unpin_layer(0)))
    out["free_capacity"] = per_call_us(cache.free_capacity)
    ids = np.unique(rng.integers(0, EXPERTS, 8)).astype(np.int64)

    def hit_layer() -> None:
        cache.free_capacity()
        cache.acquire(ids)
        cache.release(ids)

    out["hit_layer(free_capacity+acquire+release, 8 routed)"] = per_call_us(hit_layer)

    # a miss layer: every call evicts and loads (layers cycle through 64 slots)
    layer = [1]

    def miss_layer() -> None:
        lid = layer[0] * EXPERTS + ids
        layer[0] = layer[0] % (LAYERS - 1) + 1
        cache.policy.before_layer(layer[0])  # type: ignore[attr-defined]
        cache.free_capacity()
        cache.acquire(lid)
        cache.release(lid)

    out["miss_layer(free_capacity+acquire+release, 8 misses, evictions)"] = per_call_us(
        miss_layer, number=1000
    )
    print(
        json.dumps({"what": "us per call, median of 7", **{k: round(v, 2) for k, v in out.items()}})
    )


if __name__ == "__main__":
    main()
