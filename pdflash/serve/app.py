"""The OpenAI-compatible HTTP server (aiohttp).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``"stream": true`` as server-sent events: ``data: {chunk}`` lines and a final
``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text). Each request's tokens come from the :class:`EngineLoop`
thread through an asyncio queue; a client that disconnects cancels its
handler (``handler_cancellation``), which aborts its engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from pdflash.serve.loop import EngineLoop, Finish, GenerationRequest, QueueFullError
from pdflash.serve.protocol import (
    ApiError,
    ParsedRequest,
    bad,
    chat_body,
    chat_chunk,
    completion_body,
    openai_finish_reason,
    parse_request,
    usage,
)
from pdflash.text import IncrementalDetokenizer, StopStringMatcher

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    loop: EngineLoop
    tokenizer: Any
    model_name: str
    model_path: str
    stop_ids: tuple[int, ...]
    max_model_len: int
    vocab_size: int
    created: int = 0

    def knows_model(self, name: str) -> bool:
        return name in (self.model_name, self.model_path, str(Path(self.model_path).resolve()))


STATE = web.AppKey("state", ServerState)


class _AsyncSink:
    """Hands the engine thread's output to the request's asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def _put(self, item: tuple[str, Any]) -> None:
        # the event loop may have closed at shutdown: nothing left to tell
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def on_tokens(self, tokens: list[int]) -> None:
        self._put(("tokens", tokens))

    def on_finish(self, finish: Finish) -> None:
        self._put(("finish", finish))


class _Generation:
    """One request's text stream: detokenized, stop strings applied."""

    def __init__(self, state: ServerState, parsed: ParsedRequest) -> None:
        self.state = state
        self.parsed = parsed
        tok = state.tokenizer
        if parsed.prompt_ids is not None:
            ids = parsed.prompt_ids
            bad_ids = [t for t in ids if not 0 <= t < state.vocab_size]
            if bad_ids:
                raise bad(
                    f"prompt token id {bad_ids[0]} is outside the vocabulary [0, {state.vocab_size})",
                    "prompt",
                )
        elif parsed.messages is not None:
            if getattr(tok, "chat_template", None) is None:
                raise bad("this model's tokenizer has no chat template: use /v1/completions")
            text = tok.apply_chat_template(
                parsed.messages, tokenize=False, add_generation_prompt=True
            )
            ids = list(tok(text, add_special_tokens=False)["input_ids"])
        else:
            assert parsed.prompt_text is not None
            ids = list(tok(parsed.prompt_text)["input_ids"])
        if not ids:
            raise bad(
                "the prompt is empty", "prompt" if parsed.kind == "completion" else "messages"
            )
        limit = state.max_model_len
        if len(ids) >= limit:
            raise bad(
                f"This model's maximum context length is {limit} tokens, but the prompt is "
                f"{len(ids)} tokens (at least one token must be left to generate).",
                "prompt" if parsed.kind == "completion" else "messages",
                "context_length_exceeded",
            )
        max_tokens = parsed.max_tokens if parsed.max_tokens is not None else limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise bad(
                f"This model's maximum context length is {limit} tokens; the prompt is "
                f"{len(ids)} tokens and max_tokens is {max_tokens} ({len(ids) + max_tokens} "
                "in all). Reduce the prompt or max_tokens.",
                "max_tokens",
                "context_length_exceeded",
            )
        self.prompt_ids = ids
        self.max_tokens = max_tokens
        self.detok = IncrementalDetokenizer(tok)
        self.matcher = StopStringMatcher(parsed.stop)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.handle: int | None = None
        self.sink: _AsyncSink | None = None

    def start(self) -> None:
        self.sink = _AsyncSink(asyncio.get_running_loop())
        try:
            self.handle = self.state.loop.submit(
                GenerationRequest(
                    prompt_ids=self.prompt_ids,
                    params=self.parsed.params,
                    max_tokens=self.max_tokens,
                    stop_ids=self.state.stop_ids,
                    sink=self.sink,
                    seed=self.parsed.seed,
                )
            )
        except QueueFullError as e:
            raise ApiError(429, str(e), type_="rate_limit_error", code="queue_full") from None
        except RuntimeError as e:
            raise ApiError(503, str(e), type_="server_error", code="engine_stopped") from None

    async def next_text(self) -> str | None:
        """The next piece of text ('' possible), or None after the end."""
        if self.finish_reason is not None:
            return None
        assert self.sink is not None
        kind, arg = await self.sink.queue.get()
        if kind == "tokens":
            self.completion_tokens += len(arg)
            text, stopped = self.matcher.feed(self.detok.add(arg))
            if stopped:
                self.finish_reason = "stop"
                self.close()  # free the engine request now
            return text
        finish: Finish = arg
        self.completion_tokens = max(self.completion_tokens, finish.completion_tokens)
        if finish.reason == "error":
            self.finish_reason = "error"
            raise ApiError(
                500,
                f"generation failed: {finish.message}",
                type_="server_error",
                code="engine_error",
            )
        text, stopped = self.matcher.feed(self.detok.flush())
        if not stopped:
            text += self.matcher.flush()
        self.finish_reason = "stop" if stopped else openai_finish_reason(finish.reason)
        return text

    def close(self) -> None:
        """Abort the engine request unless it already ended (idempotent)."""
        if self.handle is not None:
            self.state.loop.abort(self.handle)
            self.handle = None

    def finished_in_engine(self) -> None:
        self.handle = None

    def usage(self) -> dict[str, int]:
        return usage(len(self.prompt_ids), self.completion_tokens)


def _error_response(e: ApiError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


async def _parse(request: web.Request, state: ServerState, kind: str) -> ParsedRequest:
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from None
    parsed = parse_request(body, kind)
    if not state.knows_model(parsed.model):
        raise ApiError(
            404,
            f"The model '{parsed.model}' does not exist; this server serves '{state.model_name}'.",
            param="model",
            code="model_not_found",
        )
    return parsed


def _sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    state: ServerState = request.app[STATE]
    try:
        parsed = await _parse(request, state, kind)
        gen = _Generation(state, parsed)
        gen.start()
    except ApiError as e:
        return _error_response(e)
    rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{gen.handle}"
    created = int(time.time())
    model = state.model_name
    try:
        if not parsed.stream:
            parts: list[str] = []
            try:
                while (text := await gen.next_text()) is not None:
                    parts.append(text)
            except ApiError as e:
                return _error_response(e)
            gen.finished_in_engine()
            finish = gen.finish_reason or "stop"
            if kind == "completion":
                return web.json_response(
                    completion_body(rid, created, model, "".join(parts), finish, gen.usage())
                )
            return web.json_response(
                chat_body(rid, created, model, "".join(parts), finish, gen.usage())
            )
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        if kind == "chat":
            await resp.write(
                _sse(chat_chunk(rid, created, model, {"role": "assistant", "content": ""}, None))
            )
        try:
            while (text := await gen.next_text()) is not None:
                if not text:
                    continue
                if kind == "completion":
                    chunk = completion_body(rid, created, model, text, None, None)
                else:
                    chunk = chat_chunk(rid, created, model, {"content": text}, None)
                await resp.write(_sse(chunk))
        except ApiError as e:
            await resp.write(_sse(e.body()))
            await resp.write(_sse("[DONE]"))
            return resp
        gen.finished_in_engine()
        finish = gen.finish_reason or "stop"
        if kind == "completion":
            await resp.write(_sse(completion_body(rid, created, model, "", finish, None)))
        else:
            await resp.write(_sse(chat_chunk(rid, created, model, {}, finish)))
        if parsed.include_usage:
            use = gen.usage()
            if kind == "completion":
                tail = completion_body(rid, created, model, "", None, use)
                tail["choices"] = []
            else:
                tail = chat_chunk(rid, created, model, {}, None, use, with_choice=False)
            await resp.write(_sse(tail))
        await resp.write(_sse("[DONE]"))
        await resp.write_eof()
        return resp
    finally:
        # a disconnect (handler cancelled, or a write to a closed socket)
        # lands here with the engine request still live: abort it
        gen.close()


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def models(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "pdflash",
                    "root": state.model_path,
                    "max_model_len": state.max_model_len,
                }
            ],
        }
    )


async def health(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    if not state.loop.alive:
        return web.json_response({"status": "engine stopped"}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    return web.Response(
        body=state.loop.metrics.render().encode(),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


@web.middleware
async def _json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error_response(ApiError(e.status, f"{e.reason}: {request.method} {request.path}"))


def make_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[_json_errors], client_max_size=32 << 20)
    app[STATE] = state
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def make_state(loop: EngineLoop, model_path: str, tokenizer: Any | None = None) -> ServerState:
    """Server state for a started :class:`EngineLoop` over ``model_path``."""
    from pdflash.text import load_tokenizer, stop_token_ids

    tok = tokenizer if tokenizer is not None else load_tokenizer(model_path)
    bundle = loop.bundle
    return ServerState(
        loop=loop,
        tokenizer=tok,
        model_name=Path(model_path).resolve().name,
        model_path=str(model_path),
        stop_ids=tuple(stop_token_ids(tok, model_path)),
        max_model_len=int(bundle.max_model_len),
        vocab_size=int(bundle.adapter.vocab_size),
        created=int(time.time()),
    )


class BackgroundServer:
    """Runs the app on its own asyncio thread (tests, embedding); ``url`` is
    ``http://host:port`` once :meth:`start` returns. Port 0 picks a free port."""

    def __init__(self, state: ServerState, host: str = "127.0.0.1", port: int = 0) -> None:
        self.state = state
        self.host = host
        self.port = port
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="pdflash-http", daemon=True
        )

    async def _start(self) -> None:
        self._runner = web.AppRunner(make_app(self.state), handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        self.port = int(sock.getsockname()[1])
        self.url = f"http://{self.host}:{self.port}"

    def start(self) -> BackgroundServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def serving(state: ServerState, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """``with serving(state) as url:`` a server on a loopback port."""
    server = BackgroundServer(state, host, port).start()
    try:
        yield server.url
    finally:
        server.stop()
