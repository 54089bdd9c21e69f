"""Which host-memory calls wait for a pending device wait (the stream
hand-off's flake: a ring's page-locked free in the thread that owed a
pending wait its flag). For each call: a device wait is enqueued on a
mapped ring, a thread stores its flag after DELAY_S, and the call runs
meanwhile on this thread; its duration near DELAY_S means it waited for the
device (an implicit device synchronization), near 0 that it did not. One
JSON line; every figure measured here (perf_counter seconds, CUDA device 0).
Usage: python3 bench/h200/handoff_free_sync.py"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from pdflash._native import load_native

DELAY_S = 0.3
TIMEOUT_NS = 5 * 10**9


def timed_while_pending(ring: Any, call: Callable[[], object]) -> dict[str, Any]:
    """``call``'s seconds while a wait on ``ring`` is pending, and how the
    wait ended."""
    stream = torch.cuda.current_stream()
    slot, seq = ring.acquire(10**9)
    ring.enqueue_wait(slot, seq, stream.cuda_stream, TIMEOUT_NS)

    def store() -> None:
        time.sleep(DELAY_S)
        ring.signal(slot, seq, False)

    t = threading.Thread(target=store)
    t.start()
    t0 = time.perf_counter()
    call()
    call_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    t.join()
    names: dict[int, str] = load_native("_hostsignal").OUTCOME_NAMES
    return {"call_s": round(call_s, 4), "wait_error": names[int(ring.error_code)]}


def main() -> int:
    hs = load_native("_hostsignal")
    why = hs.unavailable(0)
    if why:
        print(json.dumps({"error": f"no device wait: {why}"}))
        return 1
    ring = hs.SignalRing(8, True, 0)
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    holder: list[Any] = [hs.SignalRing(2, True, 0)]
    rows: dict[str, Any] = {"delay_s": DELAY_S}
    # a mapped ring's free (cudaFreeHost; the binding drops the GIL for it)
    rows["free_mapped_ring"] = timed_while_pending(ring, holder.clear)
    unmapped = hs.SignalRing(2, True, 0)
    unmapped.unmap()
    holder.append(unmapped)
    del unmapped
    rows["free_unmapped_ring"] = timed_while_pending(ring, holder.clear)
    rows["alloc_mapped_ring"] = timed_while_pending(
        ring, lambda: holder.append(hs.SignalRing(2, True, 0))
    )
    # unmap frees the page-locked words too (StreamSignals synchronizes first)
    rows["unmap_mapped_ring"] = timed_while_pending(ring, holder[0].unmap)
    # torch's pinned allocator on a size it has not cached (a new block)
    rows["torch_pin_new_block"] = timed_while_pending(
        ring, lambda: torch.empty(123_457 * 64, dtype=torch.uint8, pin_memory=True)
    )
    rows["verdict"] = {
        name: ("waits for the device" if r["call_s"] > DELAY_S / 2 else "does not wait")
        for name, r in rows.items()
        if isinstance(r, dict) and "call_s" in r
    }
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
