"""One-off H200 experiment (not part of the package): what a chunk boundary
costs on one copy stream. Copies ``total`` bytes host->device as back-to-back
chunks of one size on a single non-blocking stream, everything enqueued
before the first chunk can finish, with 0, 1 or 2 CUDA events recorded per
chunk (timing on or off). Prints one JSON line: per (chunk size, event mode)
the achieved GB/s and the per-chunk gap in microseconds against the
64 MiB-chunk, no-event rate measured in the same run.

    python bench/h200/stream_gap.py
"""

from __future__ import annotations

import json
import statistics
import time

import torch

MiB = 1 << 20


def run(src: torch.Tensor, dst: torch.Tensor, chunk: int, mode: str, reps: int = 5) -> float:
    stream = torch.cuda.Stream()
    n = src.numel() // chunk
    timing = mode.endswith("timing")
    per_chunk = 2 if mode.startswith("start+end") else (1 if mode.startswith("end") else 0)
    events = [[torch.cuda.Event(enable_timing=timing) for _ in range(per_chunk)] for _ in range(n)]
    rates = []
    for _ in range(reps):
        torch.cuda.synchronize()
        # NOTE: a long kernel-free wait so the whole batch is enqueued before
        # the first copy finishes: the host's enqueue cost is not measured.
        gate = torch.cuda.Event()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(max(2_000_000, n * 40_000))  # >= the host's enqueue time
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for i in range(n):
                if per_chunk == 2:
                    events[i][0].record(stream)
                dst[i * chunk : (i + 1) * chunk].copy_(src[i * chunk : (i + 1) * chunk], True)
                if per_chunk >= 1:
                    events[i][-1].record(stream)
            end.record(stream)
            gate.record(stream)
        gate.synchronize()
        rates.append(n * chunk / (start.elapsed_time(end) * 1e-3) / 1e9)
    return statistics.median(rates)


def main() -> None:
    total = 512 * MiB
    src = torch.empty(total, dtype=torch.uint8).pin_memory()
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    src.fill_(1)
    run(src, dst, 64 * MiB, "none", reps=2)  # warm-up
    peak = run(src, dst, 64 * MiB, "none")
    rows = []
    for chunk_mib in (1, 2, 4, 8):
        chunk = chunk_mib * MiB
        for mode in ("none", "end-notiming", "end-timing", "start+end-timing"):
            gbps = run(src, dst, chunk, mode)
            ideal_us = chunk / (peak * 1e9) * 1e6
            actual_us = chunk / (gbps * 1e9) * 1e6
            rows.append(
                {
                    "chunk_mib": chunk_mib,
                    "events": mode,
                    "gbps": round(gbps, 2),
                    "fraction_of_peak": round(gbps / peak, 4),
                    "gap_us_per_chunk": round(actual_us - ideal_us, 2),
                }
            )
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(),
                "peak_gbps_64mib_no_events": round(peak, 2),
                "rows": rows,
                "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        )
    )


if __name__ == "__main__":
    main()
