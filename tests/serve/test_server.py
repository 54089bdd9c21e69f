"""``pdflash serve`` through the real ``openai`` client on a loopback port:
completions and chat, streaming and not, stop strings, max_tokens, a client
that disconnects mid-stream, 4xx answers, /health, /v1/models, /metrics."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pdflash.serve.app import BackgroundServer
from pdflash.serve.loop import EngineLoop

from .conftest import idle_counts, start_server, wait_until

pytestmark = pytest.mark.timeout(120)

ZERO = {
    "kv_pages": 0,
    "draft_kv_pages": 0,
    "promised_pages": 0,
    "running": 0,
    "waiting": 0,
    "expert_pins": 0,
    "copies_in_flight": 0,
}


def client(srv: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def handle_of(response_id: str) -> int:
    return int(response_id.rsplit("-", 1)[1])


def engine_text(srv: BackgroundServer, loop: EngineLoop, response_id: str) -> str:
    ids = loop.outputs[handle_of(response_id)]
    text: str = srv.state.tokenizer.decode(ids, skip_special_tokens=True)
    return text


def test_models_and_health(server: tuple[BackgroundServer, EngineLoop]) -> None:
    srv, _ = server
    models = client(srv).models.list()
    assert [m.id for m in models.data] == ["target"]
    r = httpx.get(srv.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_completion_greedy_max_tokens(server: tuple[BackgroundServer, EngineLoop]) -> None:
    srv, loop = server
    c = client(srv)
    r = c.completions.create(model="target", prompt="Hello world", max_tokens=12, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 12
    prompt_ids = srv.state.tokenizer("Hello world")["input_ids"]
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.choices[0].text == engine_text(srv, loop, r.id)
    assert len(loop.outputs[handle_of(r.id)]) == 12
    # greedy is deterministic: the same request gives the same text
    again = c.completions.create(model="target", prompt="Hello world", max_tokens=12, temperature=0)
    assert again.choices[0].text == r.choices[0].text


def test_completion_stream_equals_engine_output(
    server: tuple[BackgroundServer, EngineLoop],
) -> None:
    srv, loop = server
    stream = client(srv).completions.create(
        model="target",
        prompt="The quick brown fox",
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finishes, usage, rid = [], [], None, ""
    for chunk in stream:
        rid = chunk.id
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.text)
            finishes.append(ch.finish_reason)
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert usage is not None and usage.completion_tokens == 20
    assert "".join(pieces) == engine_text(srv, loop, rid)


def test_chat_stream_and_not(server: tuple[BackgroundServer, EngineLoop]) -> None:
    srv, loop = server
    c = client(srv)
    msgs: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    full = c.chat.completions.create(model="target", messages=msgs, max_tokens=16, temperature=0)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    assert full.choices[0].message.content == engine_text(srv, loop, full.id)
    # the chat template was applied: the prompt is longer than the raw text
    assert full.usage is not None and full.usage.prompt_tokens > len("Be brief.Hi!")
    stream = c.chat.completions.create(
        model="target", messages=msgs, max_tokens=16, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert text == full.choices[0].message.content


def test_stop_strings(server: tuple[BackgroundServer, EngineLoop]) -> None:
    srv, _ = server
    c = client(srv)
    base = c.completions.create(model="target", prompt="abc", max_tokens=40, temperature=0)
    text = base.choices[0].text
    assert len(text) >= 12, text
    stop = text[8:11]
    cut = text.find(stop)
    expected = text[:cut]
    r = c.completions.create(
        model="target", prompt="abc", max_tokens=40, temperature=0, stop=[stop, "\x00never"]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == expected
    stream = c.completions.create(
        model="target", prompt="abc", max_tokens=40, temperature=0, stop=stop, stream=True
    )
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sampling_parameters_and_seed(server: tuple[BackgroundServer, EngineLoop]) -> None:
    srv, _ = server
    c = client(srv)
    kw: Any = dict(model="target", prompt="seeded", max_tokens=16, temperature=0.9, top_p=0.9)
    a = c.completions.create(seed=7, extra_body={"top_k": 20}, **kw)
    b = c.completions.create(seed=7, extra_body={"top_k": 20}, **kw)
    assert a.choices[0].text == b.choices[0].text  # same seed, same sample
    texts = {c.completions.create(seed=s, **kw).choices[0].text for s in range(4)}
    assert len(texts) > 1  # sampling does sample


def test_disconnect_mid_stream_aborts(server: tuple[BackgroundServer, EngineLoop]) -> None:
    srv, loop = server
    before = srv.state.loop.metrics.requests.get("abort", 0)
    body = {
        "model": "target",
        "prompt": "long one",
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
    }
    # a raw socket, so the disconnect is abrupt (no graceful stream close)
    host, port = srv.url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    got = b""
    while got.count(b"data: ") < 3:
        got += sock.recv(4096)
    sock.close()
    wait_until(lambda: srv.state.loop.metrics.requests.get("abort", 0) > before, what="the abort")
    handle = int(re.search(rb'"id": "cmpl-(\d+)"', got).group(1))  # type: ignore[union-attr]
    wait_until(lambda: handle in loop.outputs, what="the engine's record of the request")
    assert 0 < len(loop.outputs[handle]) < 200, "the request was not cut short"
    assert idle_counts(loop) == ZERO
    assert loop.outstanding == 0


def test_bad_requests_answer_4xx(server: tuple[BackgroundServer, EngineLoop]) -> None:
    srv, loop = server
    url = srv.url + "/v1/completions"
    r = httpx.post(url, content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert "not valid JSON" in err["message"] and err["type"] == "invalid_request_error"
    assert set(err) == {"message", "type", "param", "code"}

    c = client(srv)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.completions.create(model="nope", prompt="x", max_tokens=2)
    long_prompt = "word " * 400  # > 256 tokens: the tiny model's context
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256"):
        c.completions.create(model="target", prompt=long_prompt, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        c.completions.create(model="target", prompt="short", max_tokens=1000)
    with pytest.raises(openai.BadRequestError, match="n=1"):
        c.completions.create(model="target", prompt="x", max_tokens=2, n=2)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        c.chat.completions.create(
            model="target", messages=[{"role": "user", "content": "x"}], logprobs=True
        )
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model="target", prompt="x", max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        c.completions.create(model="target", prompt=[1, 2, 100000], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="seed"):
        c.completions.create(model="target", prompt="x", max_tokens=2, seed=1 << 70)
    with pytest.raises(openai.BadRequestError, match="messages"):
        c.chat.completions.create(model="target", messages=[])
    r = httpx.get(srv.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert idle_counts(loop) == ZERO


def test_full_queue_answers_429(tiny_model: tuple[Path, Path]) -> None:
    target, draft = tiny_model
    srv, loop = start_server(target, draft, max_queue=2, block_size=4, max_running=2)
    try:
        body = {"model": "target", "prompt": "x", "max_tokens": 200, "stream": True}
        with httpx.Client(timeout=30) as h:
            streams = [h.stream("POST", srv.url + "/v1/completions", json=body) for _ in range(2)]
            opened = [s.__enter__() for s in streams]
            for resp in opened:
                assert resp.status_code == 200
            wait_until(lambda: loop.outstanding == 2, what="two live requests")
            r = h.post(srv.url + "/v1/completions", json={**body, "stream": False})
            assert r.status_code == 429
            assert r.json()["error"]["code"] == "queue_full"
            for s in streams:
                s.__exit__(None, None, None)
        assert idle_counts(loop) == ZERO
    finally:
        srv.stop()
        loop.stop()


def test_metrics_prometheus_text(server: tuple[BackgroundServer, EngineLoop]) -> None:
    srv, _ = server
    client(srv).completions.create(model="target", prompt="metrics", max_tokens=8, temperature=0)
    time.sleep(0.2)  # the engine thread snapshots its statistics when idle
    resp = httpx.get(srv.url + "/metrics")
    assert resp.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = resp.text
    for name in (
        "pdflash_generation_tokens_total",
        "pdflash_time_to_first_token_seconds_bucket",
        "pdflash_time_per_output_token_seconds_count",
        "pdflash_acceptance_length_sum",
        "pdflash_scheduler_step_microseconds_count",
        "pdflash_expert_cache_hit_rate",
        "pdflash_h2d_bytes_per_token",
        "pdflash_h2d_link_busy_fraction",
    ):
        assert name in text, name
    assert "nan" not in text.lower()
    # PD has no hybrid miss service: no host figure is exported, not even a 0
    assert "pdflash_host_" not in text
    samples = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples["pdflash_generation_tokens_total"] >= 8
    assert 0.0 <= samples["pdflash_expert_cache_hit_rate"] <= 1.0
    # every histogram's +Inf bucket equals its count
    for key, v in samples.items():
        if key.endswith('_bucket{le="+Inf"}'):
            assert v == samples[key.split("_bucket")[0] + "_count"]


def test_engine_failure_answers_500_and_frees_everything(tiny_model: tuple[Path, Path]) -> None:
    """A step that raises ends its live requests with an error (500, or an
    error event mid-stream), frees their resources, and the server goes on."""
    import dataclasses

    from pdflash.serve.app import make_state
    from pdflash.serve.build import ServeModelConfig, build_engine

    target, draft = tiny_model
    config = ServeModelConfig(model=str(target), draft=str(draft), block_size=4)
    fail_next = {"n": 0}

    def factory() -> Any:
        bundle = build_engine(config)
        step = bundle.engine.step

        def flaky_step() -> Any:
            if fail_next["n"] > 0:
                fail_next["n"] -= 1
                raise RuntimeError("injected failure")
            return step()

        bundle.engine.step = flaky_step
        return bundle

    loop = EngineLoop(factory)
    loop.start(timeout_s=120)
    state = dataclasses.replace(make_state(loop, str(target)), stop_ids=())
    srv = BackgroundServer(state).start()
    try:
        c = client(srv)
        fail_next["n"] = 1
        with pytest.raises(openai.InternalServerError, match="injected failure"):
            c.completions.create(model="target", prompt="x", max_tokens=8, temperature=0)
        fail_next["n"] = 1
        stream = c.completions.create(
            model="target", prompt="x", max_tokens=8, temperature=0, stream=True
        )
        with pytest.raises(openai.APIError, match="injected failure"):
            list(stream)
        ok = c.completions.create(model="target", prompt="x", max_tokens=8, temperature=0)
        assert ok.usage is not None and ok.usage.completion_tokens == 8
        assert idle_counts(loop) == ZERO
        assert loop.metrics.requests.get("error") == 2
        # with the engine loop gone the server says so instead of hanging
        loop.stop()
        assert httpx.get(srv.url + "/health").status_code == 503
        with pytest.raises(openai.APIStatusError, match="not running") as info:
            c.completions.create(model="target", prompt="x", max_tokens=2)
        assert info.value.status_code == 503
    finally:
        srv.stop()
        loop.stop()
