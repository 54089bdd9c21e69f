"""What a per-step reader of the link pays: ``H2DIssuer.stats()`` against
``H2DIssuer.link_state()`` on the host backend, as the issuer's queue-delay
windows fill (up to 65536 samples a band), 64-byte copies in batches of
1000, each band in turn.

    python3 -P bench/results/cpu/link-state-2026-12-06/link_state_cost.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from pdflash.h2d import H2DIssuer
from pdflash.protocols import Band


def per_call_us(fn: Callable[[], object], calls: int = 50) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    issuer = H2DIssuer(backend="host")
    src = np.zeros(1 << 16, np.uint8)
    dst = np.zeros(1 << 16, np.uint8)
    issuer.register_source(src.ctypes.data, src.nbytes)
    issuer.register_destination(dst.ctypes.data, dst.nbytes)
    key, batch = 0, 1000
    print("copies per band | stats() us | link_state() us")
    for band in (Band.ON_DEMAND, Band.ROUTE_AHEAD, Band.BACKGROUND):
        for _ in range(70):
            keys = np.arange(key, key + batch, dtype=np.int64)
            tickets = issuer.submit(
                np.full(batch, src.ctypes.data, np.int64),
                np.full(batch, dst.ctypes.data, np.int64),
                64,
                keys,
                band,
            )
            issuer.wait(tickets)
            key += batch
        print(
            f"{band.name} filled (70000) | {per_call_us(issuer.stats):.1f} | "
            f"{per_call_us(issuer.link_state):.2f}"
        )
    issuer.close()


if __name__ == "__main__":
    main()
