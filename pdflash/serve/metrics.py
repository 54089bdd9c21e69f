"""Live serving metrics in the Prometheus text exposition format (0.0.4).

Written by hand (no client library needed). Observations come from the
engine thread; :meth:`ServeMetrics.render` reads them under a lock. Engine,
expert-cache and issuer statistics are copied into a snapshot on the engine
thread (every ~0.5 s and when idle), never read from the server thread.

A figure that has not been measured (no token yet, no expert requested, no
copy started) is left out of the output, never exported as 0.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque
from typing import Any

from pdflash.metrics import NotMeasured

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
ACCEPT_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
SCHED_US_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RATE_WINDOW_S = 10.0


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = []
        acc = 0
        for b, c in zip(self.buckets, self.counts, strict=False):
            acc += c
            out.append(f'{name}_bucket{{le="{_num(b)}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {_num(self.sum)}")
        out.append(f"{name}_count {self.count}")
        return out


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


def _measured(v: Any) -> float | None:
    if v is None or isinstance(v, NotMeasured):
        return None
    f = float(v)
    return None if math.isnan(f) else f


class ServeMetrics:
    """Counters, histograms and the engine snapshot behind ``/metrics``."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.started = clock()
        self.requests: dict[str, int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.acceptance = Histogram(ACCEPT_BUCKETS)
        self.scheduler_us = Histogram(SCHED_US_BUCKETS)
        self.step_s = Histogram(STEP_BUCKETS)
        self.speculative: bool | None = None
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) for tokens/s
        self.snapshot: dict[str, Any] = {}

    # ---------------------------------------------------------- engine thread
    def observe_arrival(self, prompt_tokens: int) -> None:
        with self.lock:
            self.prompt_tokens += int(prompt_tokens)

    def observe_tokens(self, n: int) -> None:
        now = self.clock()
        with self.lock:
            self.generation_tokens += int(n)
            self._recent.append((now, int(n)))
            self._trim(now)

    def observe_step(self, step_s: float, scheduler_us: float | None) -> None:
        with self.lock:
            self.step_s.observe(step_s)
            if scheduler_us is not None:
                self.scheduler_us.observe(scheduler_us)

    def observe_finish(self, reason: str, m: Any) -> None:
        """A request ended; ``m`` is its :class:`~pdflash.engine.RequestMetrics`."""
        with self.lock:
            self.requests[reason] = self.requests.get(reason, 0) + 1
            ttft = m.ttft_s
            if ttft is not None:
                self.ttft.observe(ttft)
            lat = m.latency_s
            if ttft is not None and lat is not None and m.output_tokens > 1:
                self.tpot.observe((lat - ttft) / (m.output_tokens - 1))
            if self.speculative:
                for n in m.acceptance_lengths:
                    self.acceptance.observe(n)

    def snapshot_engine(self, engine: Any, cache: Any, issuer: Any) -> None:
        snap: dict[str, Any] = {
            "running": engine.num_running,
            "waiting": len(engine._waiting),
            "kv_pages_used": engine.kv.used_pages,
            "kv_pages_total": engine.kv.num_pages,
        }
        cs = cache.stats() if cache is not None else {}
        snap["cache_hit_rate"] = _measured(cs.get("hit_rate"))
        snap["cache_hits"] = cs.get("hits")
        snap["cache_misses"] = cs.get("misses")
        if issuer is not None:
            st = issuer.stats()
            bands = st.get("bands", {})
            snap["h2d_bytes"] = float(sum(b.get("bytes", 0) for b in bands.values()))
            up = float(st.get("uptime_s", 0.0) or 0.0)
            snap["link_busy_fraction"] = float(st.get("link_busy_s", 0.0)) / up if up > 0 else None
            snap["queue_delay"] = {
                (band, q): _measured(b.get(f"queue_delay_{q}_s"))
                for band, b in bands.items()
                for q in ("p50", "p99")
            }
        host = getattr(engine, "host_service", None)
        if host is not None:  # PD+host: what the hybrid miss service did since start
            books = host.books
            snap["host"] = {
                "experts": books.experts,
                "bytes_saved": books.bytes_saved,
                "busy_s": books.busy_s,
                "wait_s": books.wait_s,
                "queued_hosted": books.queued_hosted,
            }
            parts = getattr(engine, "parts", None)
            on = getattr(getattr(parts, "policy", None), "parts", None)
            snap["host_part_on"] = None if on is None else bool(on.host_experts)
        with self.lock:
            self.speculative = bool(getattr(engine.config, "speculative", False))
            self.snapshot = snap

    # ------------------------------------------------------------ any thread
    def _trim(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()

    def render(self) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, body: list[str]) -> None:
            if body:
                lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *body])

        def scalar(name: str, kind: str, help_: str, value: float) -> None:
            metric(name, kind, help_, [f"{name} {_num(value)}"])

        with self.lock:
            now = self.clock()
            self._trim(now)
            snap = dict(self.snapshot)
            metric(
                "pdflash_requests_finished_total",
                "counter",
                "Requests ended, by finish reason (stop, length, abort, error).",
                [
                    f'pdflash_requests_finished_total{{finish_reason="{r}"}} {n}'
                    for r, n in sorted(self.requests.items())
                ],
            )
            scalar(
                "pdflash_prompt_tokens_total",
                "counter",
                "Prompt tokens of admitted requests.",
                self.prompt_tokens,
            )
            scalar(
                "pdflash_generation_tokens_total",
                "counter",
                "Tokens generated.",
                self.generation_tokens,
            )
            window = min(RATE_WINDOW_S, now - self.started)
            if self._recent and window > 0:
                tps = sum(n for _, n in self._recent) / window
                scalar(
                    "pdflash_generation_tokens_per_second",
                    "gauge",
                    f"Tokens generated per second over the last {RATE_WINDOW_S:g} s.",
                    tps,
                )
            for name, hist, help_ in (
                ("pdflash_time_to_first_token_seconds", self.ttft, "Time to first token."),
                (
                    "pdflash_time_per_output_token_seconds",
                    self.tpot,
                    "Time per output token after the first (per request).",
                ),
                (
                    "pdflash_acceptance_length",
                    self.acceptance,
                    "Tokens committed per verify round (speculative decoding).",
                ),
                (
                    "pdflash_scheduler_step_microseconds",
                    self.scheduler_us,
                    "Verify scheduler time per engine step.",
                ),
                ("pdflash_engine_step_seconds", self.step_s, "Engine step wall time."),
            ):
                if hist.count:
                    metric(name, "histogram", help_, hist.lines(name))
            gen = self.generation_tokens
        for key, name, help_ in (
            ("running", "pdflash_requests_running", "Requests decoding."),
            ("waiting", "pdflash_requests_waiting", "Requests queued in the engine."),
            ("kv_pages_used", "pdflash_kv_pages_used", "KV cache pages in use."),
            ("kv_pages_total", "pdflash_kv_pages_total", "KV cache pages."),
            (
                "cache_hit_rate",
                "pdflash_expert_cache_hit_rate",
                "Expert lookups found resident (or in flight), since start.",
            ),
            (
                "link_busy_fraction",
                "pdflash_h2d_link_busy_fraction",
                "Fraction of the issuer's uptime the host-to-device link was copying.",
            ),
        ):
            v = snap.get(key)
            if v is not None:
                scalar(name, "gauge", help_, float(v))
        h2d = snap.get("h2d_bytes")
        if h2d is not None:
            scalar("pdflash_h2d_bytes_total", "counter", "Expert bytes copied host-to-device.", h2d)
            if gen > 0:
                scalar(
                    "pdflash_h2d_bytes_per_token",
                    "gauge",
                    "Expert bytes copied per generated token, since start.",
                    h2d / gen,
                )
        host = snap.get("host")
        if host is not None:
            for key, name, help_ in (
                (
                    "experts",
                    "pdflash_host_experts_total",
                    "Missed experts computed on the host CPU (one per expert per layer per "
                    "forward) instead of copied.",
                ),
                (
                    "bytes_saved",
                    "pdflash_host_link_bytes_saved_total",
                    "Expert bytes the host-computed experts did not copy.",
                ),
                ("busy_s", "pdflash_host_busy_seconds_total", "Host pool time on expert work."),
                (
                    "wait_s",
                    "pdflash_host_wait_seconds_total",
                    "Forward time spent waiting for host-computed outputs.",
                ),
                (
                    "queued_hosted",
                    "pdflash_host_queued_experts_total",
                    "Host-computed experts whose copy was still queued and was given back "
                    "(--host-queued).",
                ),
            ):
                scalar(name, "counter", help_, float(host[key]))
            on = snap.get("host_part_on")
            if on is not None:
                scalar(
                    "pdflash_host_part_on",
                    "gauge",
                    "1 while PD's controller runs the hybrid miss service, else 0.",
                    int(on),
                )
        delays = [
            f'pdflash_h2d_queue_delay_seconds{{band="{band}",quantile="0.{q[1:]}"}} {_num(v)}'
            for (band, q), v in sorted(snap.get("queue_delay", {}).items())
            if v is not None
        ]
        metric(
            "pdflash_h2d_queue_delay_seconds",
            "gauge",
            "Issuer queue delay (submit to first chunk) per priority band, p50/p99.",
            delays,
        )
        return "\n".join(lines) + "\n"
