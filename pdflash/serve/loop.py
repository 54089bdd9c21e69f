"""The engine's own thread: every Engine / ExpertCache / issuer call happens
on it (the engine is single-threaded); requests and aborts reach it through a
thread-safe queue, tokens and finishes leave it through each request's
:class:`RequestSink` (the server's sink hands them to the asyncio loop with
``call_soon_threadsafe``).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pdflash.engine.engine import RequestState
from pdflash.engine.sampling import SamplingParams
from pdflash.serve.metrics import ServeMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")


class QueueFullError(RuntimeError):
    """The server already holds ``max_queue`` live requests."""


@dataclass(frozen=True)
class Finish:
    """How a request ended: ``reason`` is the engine's (``stop`` on a stop
    token, ``length``, ``abort``) or ``error`` with ``message``."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    engine_request_id: int | None
    message: str | None = None


class RequestSink(Protocol):
    """Receives one request's output; called on the engine thread, must not block."""

    def on_tokens(self, tokens: list[int]) -> None: ...

    def on_finish(self, finish: Finish) -> None: ...


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop_ids: tuple[int, ...]
    sink: RequestSink
    seed: int | None = None


@dataclass
class _Live:
    request: GenerationRequest
    engine_id: int
    buffer: list[int]


class EngineLoop:
    """Runs an engine built by ``factory`` (on the loop's thread) until :meth:`stop`.

    ``factory()`` returns an object with ``.engine`` (an :class:`Engine`),
    ``.cache``, ``.issuer``, ``close()`` and ``resource_counts()`` (an
    :class:`~pdflash.serve.build.EngineBundle`).
    """

    def __init__(
        self,
        factory: Callable[[], Any],
        *,
        max_queue: int = 256,
        metrics: ServeMetrics | None = None,
        idle_wait_s: float = 0.05,
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.factory = factory
        self.max_queue = max_queue
        self.metrics = metrics or ServeMetrics()
        self.idle_wait_s = idle_wait_s
        self.bundle: Any = None
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._handles = itertools.count(1)
        self._lock = threading.Lock()
        self._outstanding = 0  # submitted and not yet finished (guarded by _lock)
        self._live: dict[int, _Live] = {}  # handle -> live request (engine thread only)
        self._by_engine_id: dict[int, int] = {}
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="pdflash-engine", daemon=True)
        #: the engine's output ids of ended requests, by handle
        #: (kept only when ``record_outputs``; tests compare streams to it)
        self.record_outputs = False
        self.outputs: dict[int, list[int]] = {}

    # ------------------------------------------------------------ any thread
    def start(self, timeout_s: float | None = None) -> None:
        """Start the thread and wait until the engine is built (re-raises its error)."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError("the engine was not built in time")
        if self._error is not None:
            raise RuntimeError(f"building the engine failed: {self._error}") from self._error

    def stop(self, timeout_s: float = 30.0) -> None:
        """Abort live requests, close the engine's resources, join the thread."""
        self._stopping.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    @property
    def outstanding(self) -> int:
        with self._lock:
            return self._outstanding

    def submit(self, request: GenerationRequest) -> int:
        """Queue a request; returns its handle. Raises :class:`QueueFullError`."""
        if self._stopping.is_set() or not self._thread.is_alive():
            raise RuntimeError("the engine loop is not running")
        with self._lock:
            if self._outstanding >= self.max_queue:
                raise QueueFullError(
                    f"the server holds {self._outstanding} requests (--max-queue {self.max_queue})"
                )
            self._outstanding += 1
        handle = next(self._handles)
        self._inbox.put(("add", (handle, request)))
        return handle

    def abort(self, handle: int) -> None:
        """Abort a request (no-op once it finished); its sink gets ``abort``."""
        self._inbox.put(("abort", handle))

    def call(self, fn: Callable[[Any], T], timeout_s: float = 30.0) -> T:
        """Run ``fn(bundle)`` on the engine thread and return its result."""
        fut: Future[T] = Future()
        self._inbox.put(("call", (fn, fut)))
        return fut.result(timeout_s)

    # ----------------------------------------------------------- engine thread
    def _main(self) -> None:
        try:
            self.bundle = self.factory()
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        # acceptance lengths mean something only when the engine drafts
        self.metrics.speculative = bool(getattr(self.bundle.engine.config, "speculative", False))
        self._ready.set()
        try:
            self._run()
        finally:
            for handle in list(self._live):
                self._abort(handle, "abort", "the server is shutting down")
            self._drain_rejecting()
            try:
                self.bundle.close()
            except Exception:  # pragma: no cover - best effort at shutdown
                log.exception("closing the engine failed")

    def _run(self) -> None:
        last_snapshot = 0.0
        while not self._stopping.is_set():
            try:
                stepped = self._iteration()
            except Exception as e:
                # NOTE: a failure outside the step (bookkeeping, a sink) must
                # not kill the thread and strand every waiting client
                log.exception("the engine loop failed")
                self._fail_live(f"engine loop failed: {e}")
                continue
            now = time.monotonic()
            if stepped and now - last_snapshot > 0.5:
                self._snapshot()
                last_snapshot = now
        self._snapshot()

    def _iteration(self) -> bool:
        """Take new work and abort requests, then one engine step if there is
        work; True if a step ran."""
        engine = self.bundle.engine
        self._drain(block=not engine.has_work)
        if self._stopping.is_set() or not engine.has_work:
            return False
        t0 = time.perf_counter()
        try:
            report = engine.step()
        except Exception as e:
            log.exception("engine step failed")
            self._fail_live(f"engine step failed: {e}")
            return False
        self.metrics.observe_step(
            time.perf_counter() - t0, report.scheduler_us if report.verified else None
        )
        self._deliver()
        return True

    def _fail_live(self, message: str) -> None:
        for handle in list(self._live):
            self._abort(handle, "error", message)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            if block:
                self._snapshot()
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_rejecting(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                _handle, req = arg
                self._done(req.sink, Finish("abort", len(req.prompt_ids), 0, None, "shutdown"))
            elif kind == "call":
                arg[1].set_exception(RuntimeError("the engine loop stopped"))

    def _handle(self, kind: str, arg: Any) -> None:
        engine = self.bundle.engine
        if kind == "add":
            handle, req = arg
            live = _Live(req, -1, [])
            try:
                rid = engine.add_request(
                    req.prompt_ids,
                    req.params,
                    max_new_tokens=req.max_tokens,
                    stop_ids=req.stop_ids,
                    seed=req.seed,
                    on_token=lambda _rid, tok, live=live: live.buffer.append(tok),
                )
            except Exception as e:  # validation: nothing was queued
                self._done(req.sink, Finish("error", len(req.prompt_ids), 0, None, str(e)))
                return
            live.engine_id = rid
            self._live[handle] = live
            self._by_engine_id[rid] = handle
            self.metrics.observe_arrival(len(req.prompt_ids))
        elif kind == "abort":
            if arg in self._live:
                self._abort(arg, "abort", None)
        elif kind == "call":
            fn, fut = arg
            try:
                fut.set_result(fn(self.bundle))
            except BaseException as e:
                fut.set_exception(e)

    def _abort(self, handle: int, reason: str, message: str | None) -> None:
        """End a live request (engine abort); its sink always hears of it."""
        live = self._live.pop(handle)
        self._by_engine_id.pop(live.engine_id, None)
        engine = self.bundle.engine
        output: list[int] = []
        try:
            engine.abort(live.engine_id)
            req = engine.request(live.engine_id)
            output = list(req.output)
            engine.finished.pop(live.engine_id, None)  # a server must not keep every request
            self.metrics.observe_finish(reason, req.metrics)
        except Exception:
            log.exception("aborting request %d failed", live.engine_id)
        if live.buffer:
            self.metrics.observe_tokens(len(live.buffer))
            live.request.sink.on_tokens(live.buffer)
            live.buffer = []
        self._record(handle, output)
        self._done(
            live.request.sink,
            Finish(reason, len(live.request.prompt_ids), len(output), live.engine_id, message),
        )

    def _deliver(self) -> None:
        engine = self.bundle.engine
        for handle, live in list(self._live.items()):
            if live.buffer:
                tokens, live.buffer = live.buffer, []
                self.metrics.observe_tokens(len(tokens))
                live.request.sink.on_tokens(tokens)
            req = engine.request(live.engine_id)
            if req.state in (RequestState.FINISHED, RequestState.ABORTED):
                del self._live[handle]
                self._by_engine_id.pop(live.engine_id, None)
                reason = req.metrics.finish_reason or "abort"
                message = getattr(req, "error", None) or getattr(req.metrics, "error", None)
                engine.finished.pop(live.engine_id, None)
                self._record(handle, req.output)
                self.metrics.observe_finish(reason, req.metrics)
                self._done(
                    live.request.sink,
                    Finish(
                        reason,
                        len(live.request.prompt_ids),
                        len(req.output),
                        live.engine_id,
                        None if message is None else str(message),
                    ),
                )

    def _record(self, handle: int, output: list[int]) -> None:
        if self.record_outputs:
            self.outputs[handle] = list(output)

    def _done(self, sink: RequestSink, finish: Finish) -> None:
        with self._lock:
            self._outstanding -= 1
        try:
            sink.on_finish(finish)
        except Exception:
            log.exception("a request sink failed")

    def _snapshot(self) -> None:
        b = self.bundle
        # NOTE: the engine keeps per-forward traces for benchmarks; a server
        # running for days must not, so they are dropped with each snapshot.
        for name in ("routing_trace", "trace_kinds", "scheduler_us"):
            trace = getattr(b.engine, name, None)
            if isinstance(trace, list):
                trace.clear()
        try:
            self.metrics.snapshot_engine(b.engine, b.cache, b.issuer)
        except Exception:
            log.exception("reading engine statistics failed")
