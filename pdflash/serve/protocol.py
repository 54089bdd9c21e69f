"""OpenAI request validation and response bodies (completions and chat).

Parsing turns a JSON body into a :class:`ParsedRequest` or raises
:class:`ApiError` with the HTTP status and OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}``. Fields pdflash cannot
honour (``n > 1``, ``logprobs``, penalties, ``logit_bias``, tools, ``echo``,
``best_of``, ``suffix``) are refused with 400 rather than ignored; unknown
fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdflash.engine.sampling import SamplingParams

MAX_STOP_STRINGS = 4


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class ParsedRequest:
    kind: str  # "completion" | "chat"
    model: str
    prompt_text: str | None  # None when the prompt came as token ids
    prompt_ids: list[int] | None
    messages: list[dict[str, str]] | None
    max_tokens: int | None  # None: the rest of the context
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(f"'{name}' must be a number, got {type(v).__name__}", name)
    if not lo <= float(v) <= hi:
        raise bad(f"'{name}' must be in [{lo:g}, {hi:g}], got {v}", name)
    return float(v)


def _int(body: dict[str, Any], name: str, lo: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{name}' must be an integer, got {type(v).__name__}", name)
    if lo is not None and v < lo:
        raise bad(f"'{name}' must be >= {lo}, got {v}", name)
    return v


def _refuse_unsupported(body: dict[str, Any], kind: str) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise bad("only n=1 is supported", "n", "unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v not in (None, 0, 0.0):
            raise bad(f"'{name}' is not supported (must be 0)", name, "unsupported_parameter")
    if body.get("logit_bias"):
        raise bad("'logit_bias' is not supported", "logit_bias", "unsupported_parameter")
    if kind == "completion":
        if body.get("logprobs") not in (None, 0):
            raise bad("'logprobs' is not supported", "logprobs", "unsupported_parameter")
        if body.get("echo"):
            raise bad("'echo' is not supported", "echo", "unsupported_parameter")
        if body.get("best_of") not in (None, 1):
            raise bad("'best_of' must be 1", "best_of", "unsupported_parameter")
        if body.get("suffix"):
            raise bad("'suffix' is not supported", "suffix", "unsupported_parameter")
    else:
        if body.get("logprobs") or body.get("top_logprobs"):
            raise bad("'logprobs' is not supported", "logprobs", "unsupported_parameter")
        for name in ("tools", "functions"):
            if body.get(name):
                raise bad(
                    f"'{name}' (tool calling) is not supported", name, "unsupported_parameter"
                )
        fmt = body.get("response_format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise bad(
                "only response_format {'type': 'text'} is supported",
                "response_format",
                "unsupported_parameter",
            )


def _seed(body: dict[str, Any]) -> int | None:
    seed = _int(body, "seed")
    if seed is not None and not -(1 << 63) <= seed < (1 << 64):
        raise bad("'seed' must fit in 64 bits", "seed")
    return seed


def _stop(body: dict[str, Any]) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
    return list(stops)


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a 'role'", "messages")
        role = m["role"]
        if role not in ("system", "developer", "user", "assistant"):
            raise bad(f"messages[{i}]: role {role!r} is not supported", "messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text":
                    raise bad(f"messages[{i}]: only text content parts are supported", "messages")
                parts.append(str(p.get("text", "")))
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad(f"messages[{i}]: 'content' must be a string or text parts", "messages")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def parse_request(body: Any, kind: str) -> ParsedRequest:
    """Validate an OpenAI completions (``kind="completion"``) or chat body."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required (a string)", "model")
    _refuse_unsupported(body, kind)
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    messages = None
    if kind == "completion":
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            prompt_text = p
        elif (
            isinstance(p, list)
            and p
            and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        ):
            prompt_ids = [int(t) for t in p]
        elif isinstance(p, list) and len(p) > 1:
            raise bad("batched prompts are not supported: send one prompt per request", "prompt")
        else:
            raise bad("'prompt' must be a string or a list of token ids", "prompt")
        max_tokens = _int(body, "max_tokens", 1)
        if max_tokens is None:
            max_tokens = 16  # OpenAI's default for completions
    else:
        messages = _messages(body)
        max_tokens = _int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens", 1)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0.0:
        raise bad("'top_p' must be > 0", "top_p")
    top_k = _int(body, "top_k", -1)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=max(0, top_k or 0))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    return ParsedRequest(
        kind=kind,
        model=model,
        prompt_text=prompt_text,
        prompt_ids=prompt_ids,
        messages=messages,
        max_tokens=max_tokens,
        params=params,
        stop=_stop(body),
        seed=_seed(body),
        stream=stream,
        include_usage=bool(opts.get("include_usage", False)),
    )


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def openai_finish_reason(reason: str) -> str:
    """The engine's finish reason in OpenAI's words."""
    return {"stop": "stop", "length": "length"}.get(reason, reason)


def completion_body(
    rid: str, created: int, model: str, text: str, finish: str | None, use: dict[str, int] | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
    if use is not None:
        body["usage"] = use
    return body


def chat_body(
    rid: str, created: int, model: str, text: str, finish: str, use: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
        ],
        "usage": use,
    }


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish: str | None,
    use: dict[str, int] | None = None,
    with_choice: bool = True,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": (
            [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
            if with_choice
            else []
        ),
    }
    if use is not None:
        body["usage"] = use
    return body
