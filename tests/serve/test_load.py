"""64 concurrent streaming clients (a quarter of them hang up mid-stream):
every request finishes or is aborted, no token is lost or duplicated (each
finished stream's text equals the engine's output for that request, each
aborted stream's text is a prefix of it), and KV pages, expert pins and
in-flight copies return to zero."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from pdflash.serve.app import BackgroundServer
from pdflash.serve.loop import EngineLoop

from .conftest import idle_counts
from .test_server import ZERO, handle_of

pytestmark = pytest.mark.timeout(180)

CLIENTS = 64
MAX_TOKENS = 10


async def _one(
    c: openai.AsyncOpenAI, i: int, hang_up: bool
) -> tuple[str, str, str | None, int | None]:
    """(response id, streamed text, finish reason or None if we hung up, usage tokens)."""
    kwargs = {"stream_options": {"include_usage": True}}
    if i % 2:
        stream = await c.chat.completions.create(
            model="target",
            messages=[{"role": "user", "content": f"client {i} says hi"}],
            max_tokens=MAX_TOKENS,
            temperature=0 if i % 3 else 0.8,
            seed=i,
            stream=True,
            **kwargs,  # type: ignore[arg-type]
        )
    else:
        stream = await c.completions.create(  # type: ignore[assignment]
            model="target",
            prompt=f"prompt number {i}: ",
            max_tokens=MAX_TOKENS,
            temperature=0 if i % 3 else 0.8,
            seed=i,
            stream=True,
            **kwargs,  # type: ignore[arg-type]
        )
    rid, text, finish, usage, chunks = "", "", None, None, 0
    async for chunk in stream:
        rid = chunk.id
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for ch in chunk.choices:
            piece = ch.delta.content if hasattr(ch, "delta") else ch.text  # type: ignore[union-attr]
            text += piece or ""
            finish = ch.finish_reason or finish
        if hang_up and chunks >= 3:
            await stream.close()
            return rid, text, None, None
    return rid, text, finish, usage


def test_64_concurrent_streams(server: tuple[BackgroundServer, EngineLoop]) -> None:
    srv, loop = server
    before = set(loop.outputs)
    ended_before = dict(loop.metrics.requests)

    async def main() -> list[tuple[str, str, str | None, int | None]]:
        http = httpx.AsyncClient(limits=httpx.Limits(max_connections=CLIENTS + 4), timeout=120)
        c = openai.AsyncOpenAI(
            base_url=srv.url + "/v1", api_key="unused", max_retries=0, http_client=http
        )
        try:
            return await asyncio.gather(*(_one(c, i, hang_up=i % 4 == 3) for i in range(CLIENTS)))
        finally:
            await c.close()

    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    tok = srv.state.tokenizer
    assert len({rid for rid, *_ in results}) == CLIENTS
    finished = aborted = 0
    for rid, text, finish, usage in results:
        handle = handle_of(rid)
        # the engine reports every request once it ended (finished or aborted)
        deadline = time.monotonic() + 20
        while handle not in loop.outputs and time.monotonic() < deadline:
            time.sleep(0.02)
        engine_ids = loop.outputs[handle]
        engine_text = tok.decode(engine_ids, skip_special_tokens=True)
        if finish is None:  # we hung up: what we saw is a prefix of what was made
            assert engine_text.startswith(text)
            aborted += 1
        else:
            assert finish == "length"
            assert text == engine_text
            assert usage == len(engine_ids) == MAX_TOKENS
            finished += 1
    assert finished == CLIENTS - CLIENTS // 4 and aborted == CLIENTS // 4
    assert len(set(loop.outputs) - before) == CLIENTS
    assert idle_counts(loop) == ZERO
    assert loop.outstanding == 0
    assert elapsed < 120
    # every request ended exactly once, as finished or aborted, and the
    # hang-ups were seen by the server (cut short, not run to max_tokens)
    ended = {k: v - ended_before.get(k, 0) for k, v in loop.metrics.requests.items()}
    assert ended.get("length", 0) + ended.get("abort", 0) == CLIENTS
    assert ended.get("abort", 0) >= 1
    cut = [
        r for r, _, f, _ in results if f is None and len(loop.outputs[handle_of(r)]) < MAX_TOKENS
    ]
    assert cut
