"""Serving workloads: when requests arrive and how long they are.

A :class:`Workload` is a seeded description; :func:`open_loop` turns it into
the whole list of requests with their arrival times (Poisson arrivals at
``rate_per_s``), and :class:`ClosedLoop` gives each of ``users`` clients its
next request when its previous one finished plus an exponential think time.
Lengths come from a :class:`LengthDist` (fixed, uniform or log-normal,
clipped to ``[low, high]``); outputs default to 128-512 tokens so a run lasts
long enough for batching to matter.

Everything is a pure function of the seed: the same workload gives the same
requests on every machine, and every row can state the workload it ran.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

LengthKind = Literal["fixed", "uniform", "lognormal"]


#: how a benchmark run warms up before its clock (``RunSpec.warmup``):
#: ``short`` one 2-token request; ``workload`` the run's own shape once, per
#: run; ``shared`` the workload warm-up once per process and shape (every
#: run of the same spec but its repeat and request rate reuses it, on a
#: throwaway cache) and a short one per run; ``auto`` shared on CUDA, short
#: on CPU
WARMUP_CHOICES = ("auto", "short", "workload", "shared")


@dataclass(frozen=True)
class LengthDist:
    """Token lengths: ``fixed`` (always ``low``), ``uniform`` on
    ``[low, high]``, or ``lognormal`` with median ``median`` and log-space
    standard deviation ``sigma``, rounded and clipped to ``[low, high]``."""

    kind: LengthKind = "uniform"
    low: int = 1
    high: int = 1
    median: float | None = None
    sigma: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise ValueError(f"length kind must be fixed, uniform or lognormal, got {self.kind!r}")
        if isinstance(self.low, bool) or isinstance(self.high, bool):
            raise TypeError("length bounds must be integers, not bool")
        if self.low < 1 or self.high < self.low:
            raise ValueError(f"need 1 <= low <= high, got low={self.low}, high={self.high}")
        if self.kind == "lognormal":
            if self.median is None or not self.median > 0:
                raise ValueError(f"lognormal lengths need median > 0, got {self.median}")
            if self.sigma is None or not self.sigma >= 0:
                raise ValueError(f"lognormal lengths need sigma >= 0, got {self.sigma}")

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, self.low, dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(self.low, self.high + 1, size=n, dtype=np.int64)
        assert self.median is not None and self.sigma is not None
        raw = rng.lognormal(mean=math.log(self.median), sigma=self.sigma, size=n)
        return np.clip(np.rint(raw), self.low, self.high).astype(np.int64)

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed {self.low}"
        if self.kind == "uniform":
            return f"uniform [{self.low}, {self.high}]"
        return (
            f"lognormal median {self.median} sigma {self.sigma} clipped [{self.low}, {self.high}]"
        )


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a workload: its index, arrival (seconds after the
    run's start; None in a closed loop, where it depends on completions), and
    lengths."""

    index: int
    arrival_s: float | None
    prompt_len: int
    max_new_tokens: int
    user: int | None = None


@dataclass(frozen=True)
class Workload:
    """A seeded serving workload.

    ``arrivals="poisson"``: ``num_requests`` requests with exponential
    inter-arrival gaps of mean ``1 / rate_per_s`` (open loop: arrivals do
    not wait for the server). ``arrivals="closed"``: ``users`` clients, each
    sending its next request ``think_s`` (mean of an exponential) after its
    previous one finished, until ``num_requests`` have been sent.
    ``arrivals="burst"``: all requests at time 0 (the old fixed-concurrency
    runs).
    """

    arrivals: Literal["poisson", "closed", "burst"] = "poisson"
    num_requests: int = 64
    rate_per_s: float | None = None
    users: int | None = None
    think_s: float = 0.0
    prompt_len: LengthDist = field(default_factory=lambda: LengthDist("uniform", 32, 128))
    output_len: LengthDist = field(default_factory=lambda: LengthDist("uniform", 128, 512))
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arrivals not in ("poisson", "closed", "burst"):
            raise ValueError(f"arrivals must be poisson, closed or burst, got {self.arrivals!r}")
        if isinstance(self.num_requests, bool) or self.num_requests < 1:
            raise ValueError(f"num_requests must be an integer >= 1, got {self.num_requests!r}")
        rate = self.rate_per_s
        if self.arrivals == "poisson" and (rate is None or not (math.isfinite(rate) and rate > 0)):
            raise ValueError(f"poisson arrivals need rate_per_s > 0, got {rate}")
        users = self.users
        if self.arrivals == "closed" and (users is None or isinstance(users, bool) or users < 1):
            raise ValueError(f"a closed loop needs users >= 1, got {users!r}")
        if not (math.isfinite(self.think_s) and self.think_s >= 0):
            raise ValueError(f"think_s must be finite and >= 0, got {self.think_s}")

    def describe(self) -> dict[str, Any]:
        """The workload as JSON-able fields, for result rows."""
        d = asdict(self)
        d["prompt_len"] = self.prompt_len.describe()
        d["output_len"] = self.output_len.describe()
        return d

    def _rng(self, stream: int) -> np.random.Generator:
        # independent streams for gaps, prompt lengths, output lengths
        return np.random.default_rng([self.seed, stream])

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        prompts = self.prompt_len.draw(self._rng(1), self.num_requests)
        outputs = self.output_len.draw(self._rng(2), self.num_requests)
        return prompts, outputs


def open_loop(w: Workload) -> list[PlannedRequest]:
    """Every request of an open-loop (``poisson``) or ``burst`` workload,
    in arrival order."""
    if w.arrivals == "closed":
        raise ValueError("a closed loop's arrivals depend on completions; use ClosedLoop")
    prompts, outputs = w.lengths()
    if w.arrivals == "burst":
        arrivals = np.zeros(w.num_requests)
    else:
        assert w.rate_per_s is not None
        gaps = w._rng(0).exponential(1.0 / w.rate_per_s, size=w.num_requests)
        arrivals = np.cumsum(gaps) - gaps[0]  # the first request arrives at t = 0
    return [
        PlannedRequest(i, float(arrivals[i]), int(prompts[i]), int(outputs[i]))
        for i in range(w.num_requests)
    ]


class ClosedLoop:
    """``users`` clients that each wait for their request to finish, think,
    and send the next, until the workload's ``num_requests`` are sent.

    Call :meth:`start` once for the first wave (one request per user, at
    time 0), then :meth:`finished` with each completion's user and time; it
    returns that user's next request and when to send it, or None when the
    workload is spent.
    """

    def __init__(self, w: Workload) -> None:
        if w.arrivals != "closed":
            raise ValueError(f"ClosedLoop needs a closed workload, got {w.arrivals!r}")
        assert w.users is not None
        self.workload = w
        self._prompts, self._outputs = w.lengths()
        self._think = w._rng(0)
        self._sent = 0

    def _next(self, user: int, at_s: float) -> PlannedRequest | None:
        if self._sent >= self.workload.num_requests:
            return None
        i = self._sent
        self._sent += 1
        return PlannedRequest(i, at_s, int(self._prompts[i]), int(self._outputs[i]), user)

    def start(self) -> list[PlannedRequest]:
        if self._sent:
            raise RuntimeError("ClosedLoop.start() was already called")
        assert self.workload.users is not None
        first = (self._next(u, 0.0) for u in range(self.workload.users))
        return [r for r in first if r is not None]

    def finished(self, user: int, at_s: float) -> PlannedRequest | None:
        assert self.workload.users is not None
        if not 0 <= user < self.workload.users:
            raise ValueError(f"user must be in [0, {self.workload.users}), got {user}")
        think = (
            float(self._think.exponential(self.workload.think_s)) if self.workload.think_s else 0.0
        )
        return self._next(user, at_s + think)

    @property
    def sent(self) -> int:
        return self._sent
