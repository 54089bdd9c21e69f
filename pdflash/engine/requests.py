"""Request state: what a request is, where it stands, and the table that owns
every request of an :class:`~pdflash.engine.Engine`.

A request moves ``WAITING -> PREFILL -> DRAFT -> VERIFY -> DRAFT ... ->
FINISHED`` (or ``ABORTED`` at any point). :class:`RequestTable` keeps the
waiting queue (arrival order), the running list and the finished requests,
and the admission ledger (KV pages promised to running requests); the
engine's stages move requests between states through it.
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from pdflash.engine.sampling import SamplingParams

TokenCallback = Callable[[int, int], None]


class TokenCallbackError(RuntimeError):
    """A request's ``on_token`` callback raised (the request ends with this error)."""


class RequestState(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DRAFT = "draft"
    VERIFY = "verify"
    FINISHED = "finished"
    ABORTED = "aborted"


#: states a request is never in again once it is in one
DONE_STATES = (RequestState.FINISHED, RequestState.ABORTED)


@dataclass
class RequestMetrics:
    """Per-request measurements (seconds from the engine's clock)."""

    request_id: int
    prompt_tokens: int
    arrival_s: float
    slo_s: float | None = None
    admitted_s: float | None = None  # left the waiting queue (KV promised)
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None
    output_tokens: int = 0
    round_latencies_s: list[float] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)  # committed tokens per round
    forced_rounds: int = 0
    model_rounds: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def queue_delay_s(self) -> float | None:
        """Time waiting for admission (``max_running`` or KV pages)."""
        return None if self.admitted_s is None else self.admitted_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None below two tokens)."""
        if self.first_token_s is None or self.finish_s is None or self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def latency_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    @property
    def met_slo(self) -> bool | None:
        """Finished within its SLO (None without an SLO or before finishing)."""
        if self.slo_s is None or self.latency_s is None or self.finish_reason in ("abort", "error"):
            return None
        return self.latency_s <= self.slo_s


@dataclass
class Request:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int
    stop_ids: frozenset[int]
    on_token: TokenCallback | None
    metrics: RequestMetrics
    generator: torch.Generator
    state: RequestState = RequestState.WAITING
    #: the caller gave the seed (``add_request(seed=...)``): a sampled request
    #: must then repeat its tokens draw for draw, so its verify width may not
    #: follow measured timing (:class:`~pdflash.engine.verify_width.WidthHook`)
    seeded: bool = False
    output: list[int] = field(default_factory=list)
    anchor: int | None = None
    pending_context: torch.Tensor | None = None  # target features not yet in the drafter KV
    drafts: torch.Tensor | None = None  # [n] int64
    draft_probs: torch.Tensor | None = None  # [n, V] (sampling only)
    predicted: npt.NDArray[np.int64] | None = None
    #: route-ahead's prediction made in shadow (``Engine.route_ahead_shadow``):
    #: counted against the verify's routing, read by nothing else
    shadow_predicted: npt.NDArray[np.int64] | None = None
    draft_hidden: torch.Tensor | None = None  # [1 + drafts, hidden], for the predictor
    round_start_s: float = 0.0
    kv_pages_promised: int = 0  # worst-case KV pages reserved in the admission ledger
    #: why the request failed (``finish_reason == "error"``), else None
    error: str | None = None
    prefill_failures: int = 0  # a failed prefill is retried once, alone


class RequestTable:
    """Every request of one engine and where it stands.

    ``live`` maps the id of each waiting or running request to it;
    ``waiting`` is the admission queue (arrival order, a requeued request at
    the head); ``running`` the admitted ones (arrival order); ``finished``
    the ended ones until popped (with ``max_finished``, the oldest beyond
    that many are dropped). ``promised_pages`` is the admission ledger: the
    worst-case KV pages promised to the running requests.
    """

    def __init__(self, max_finished: int | None = None) -> None:
        self._ids = itertools.count()
        self.live: dict[int, Request] = {}
        self.waiting: deque[int] = deque()
        self.running: list[int] = []
        self.finished: OrderedDict[int, Request] = OrderedDict()
        self.max_finished = max_finished
        self.promised_pages = 0

    def next_id(self) -> int:
        return next(self._ids)

    def add(self, req: Request) -> None:
        """Queue a new request (state WAITING)."""
        self.live[req.request_id] = req
        self.waiting.append(req.request_id)

    def get(self, request_id: int) -> Request:
        req = self.live.get(request_id) or self.finished.get(request_id)
        if req is None:
            raise KeyError(f"unknown request id {request_id}")
        return req

    def head(self) -> Request | None:
        """The next request to admit, if any."""
        return self.live[self.waiting[0]] if self.waiting else None

    def in_state(self, state: RequestState) -> list[Request]:
        """The running requests in ``state``, in arrival order."""
        return [self.live[r] for r in self.running if self.live[r].state == state]

    def admit(self, req: Request, pages: int) -> None:
        """The head of the queue starts running with ``pages`` promised."""
        assert self.waiting and self.waiting[0] == req.request_id
        self.waiting.popleft()
        self.promised_pages += pages
        req.kv_pages_promised = pages
        self.running.append(req.request_id)
        req.state = RequestState.PREFILL

    def requeue(self, req: Request) -> None:
        """Undo :meth:`admit`: back at the head of the queue, pages released."""
        self.running.remove(req.request_id)
        self._release_pages(req)
        req.state = RequestState.WAITING
        self.waiting.appendleft(req.request_id)

    def end(self, req: Request, reason: str, now: float) -> bool:
        """Mark a live request ended (``reason`` ``abort``: ABORTED, else
        FINISHED) and leave the queue or the running list; False (nothing
        done) if it had ended already. :meth:`retire` moves it to
        ``finished`` once its resources are released."""
        if req.state in DONE_STATES:
            return False
        if req.state == RequestState.WAITING and req.request_id in self.waiting:
            self.waiting.remove(req.request_id)
        req.state = RequestState.ABORTED if reason == "abort" else RequestState.FINISHED
        req.metrics.finish_reason = reason
        req.metrics.finish_s = now
        if req.request_id in self.running:
            self.running.remove(req.request_id)
            self._release_pages(req)
        return True

    def retire(self, req: Request) -> None:
        self.finished[req.request_id] = self.live.pop(req.request_id)
        if self.max_finished is not None:
            while len(self.finished) > self.max_finished:
                self.finished.popitem(last=False)

    def pop_finished(self, request_ids: list[int] | None = None) -> dict[int, Request]:
        if request_ids is None:
            out = dict(self.finished)
            self.finished.clear()
            return out
        return {int(r): self.finished.pop(int(r)) for r in request_ids if int(r) in self.finished}

    def _release_pages(self, req: Request) -> None:
        self.promised_pages -= req.kv_pages_promised
        req.kv_pages_promised = 0

    def check(self) -> None:
        """The table's invariants (checked at the end of every step):
        waiting and running are disjoint live requests in the states those
        lists mean, and the ledger is the running requests' promises."""
        assert len(set(self.running)) == len(self.running)
        assert not set(self.waiting) & set(self.running)
        assert len(self.waiting) + len(self.running) == len(self.live), "a live request is lost"
        for rid in self.waiting:
            assert self.live[rid].state == RequestState.WAITING
        promised = 0
        for rid in self.running:
            req = self.live[rid]
            assert req.state in (RequestState.DRAFT, RequestState.VERIFY), (rid, req.state)
            promised += req.kv_pages_promised
        assert promised == self.promised_pages, (promised, self.promised_pages)
