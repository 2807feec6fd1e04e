"""The OpenAI API as ``kvrows serve`` speaks it: request bodies in, response bodies out.

:func:`parse_chat` and :func:`parse_completion` check a request body (the JSON of
``POST /v1/chat/completions`` and ``POST /v1/completions``) and return a
:class:`Generation`, or raise :class:`ApiError` naming the field that is wrong, with the
HTTP status and the OpenAI error ``type`` and ``code`` it maps to (``spec/server.md`` §3).
The response builders (:func:`completion_body`, :func:`chunk_body`, :func:`usage_body`)
write the objects OpenAI's clients read. Nothing here touches the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "IGNORED_FIELDS",
    "MAX_STOP_STRINGS",
    "REFUSED_FIELDS",
    "ApiError",
    "Generation",
    "chunk_body",
    "completion_body",
    "error_body",
    "parse_chat",
    "parse_completion",
    "usage_body",
]

Kind = Literal["chat", "completion"]

#: Fields that change nothing here and are accepted and ignored (OpenAI's bookkeeping).
IGNORED_FIELDS = frozenset(
    {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key"}
)
#: Fields that would change the result and are not supported, with the value that is
#: still accepted (the field's no-op) where there is one: anything else is refused (400).
REFUSED_FIELDS: dict[str, tuple[object, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "logprobs": (False, None),
    "top_logprobs": (None, 0),
    "echo": (False,),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}
#: The most stop strings a request may give (OpenAI's limit).
MAX_STOP_STRINGS = 4
_COMMON_FIELDS = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
    }
)
_FIELDS: dict[Kind, frozenset[str]] = {
    "chat": _COMMON_FIELDS | {"messages", "max_completion_tokens"},
    "completion": _COMMON_FIELDS | {"prompt"},
}


class ApiError(Exception):
    """A request the server refuses: the HTTP ``status``, OpenAI's error ``kind`` (its
    ``type``), the ``param`` at fault and a ``code``; ``headers`` go on the response
    (``Retry-After`` on a 429)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind
        self.headers = dict(headers or {})


def error_body(error: ApiError) -> dict[str, Any]:
    """The JSON of an OpenAI error response."""
    return {
        "error": {
            "message": error.message,
            "type": error.kind,
            "param": error.param,
            "code": error.code,
        }
    }


def _invalid(field: str, message: str) -> ApiError:
    return ApiError(400, f"{field}: {message}", param=field, code="invalid_value")


@dataclass(frozen=True)
class Generation:
    """One checked request: what to generate and how to answer."""

    kind: Kind
    model: str
    prompt: tuple[int, ...]
    #: None: as many as the context leaves (the server's default cap).
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _number(body: Mapping[str, Any], field: str, default: float, low: float, high: float) -> float:
    value = body.get(field, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _invalid(field, f"expected a number, got {type(value).__name__}")
    if not low <= value <= high:
        raise _invalid(field, f"must be between {low:g} and {high:g}, got {value}")
    return float(value)


def _integer(body: Mapping[str, Any], field: str, low: int) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(field, f"expected an integer, got {type(value).__name__}")
    if value < low:
        raise _invalid(field, f"must be >= {low}, got {value}")
    return value


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise _invalid("stop", "expected a string or a list of strings")
    if len(strings) > MAX_STOP_STRINGS:
        raise _invalid("stop", f"at most {MAX_STOP_STRINGS} strings, got {len(strings)}")
    if any(not s for s in strings):
        raise _invalid("stop", "a stop string is empty")
    return tuple(strings)


def _check_fields(body: Mapping[str, Any], kind: Kind) -> None:
    for field, value in body.items():
        if field in _FIELDS[kind] or field in IGNORED_FIELDS:
            continue
        accepted = REFUSED_FIELDS.get(field)
        if accepted is None:
            raise ApiError(
                400,
                f"unrecognized request field {field!r}",
                param=field,
                code="unsupported_parameter",
            )
        if not any(_same(value, ok) for ok in accepted):
            raise ApiError(
                400,
                f"{field}={value!r} is not supported by this server "
                f"(accepted: {', '.join(repr(ok) for ok in accepted)})",
                param=field,
                code="unsupported_parameter",
            )


def _same(value: object, accepted: object) -> bool:
    """``value`` is the accepted no-op (``True`` is not ``1``, ``1.0`` is)."""
    if isinstance(value, bool) != isinstance(accepted, bool):
        return False
    return value is None if accepted is None else value == accepted


def _common(body: Any, kind: Kind) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    _check_fields(body, kind)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _invalid("model", "expected the model's name (a string; GET /v1/models)")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _invalid("stream", "expected true or false")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _invalid("stream_options", "expected an object")
        if not stream:
            raise _invalid("stream_options", "only with stream: true")
        unknown = set(options) - {"include_usage", "continuous_usage_stats"}
        if unknown:
            raise _invalid("stream_options", f"unknown option {sorted(unknown)[0]!r}")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise _invalid("stream_options.include_usage", "expected true or false")
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise _invalid("top_p", "must be > 0")
    return {
        "model": model,
        "stream": stream,
        "include_usage": include_usage,
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": top_p,
        "seed": _integer(body, "seed", -(2**63)),
        "stop": _stop(body),
    }


def _message_text(index: int, message: Any) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _invalid(where, "expected an object with role and content")
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant"):
        raise _invalid(
            f"{where}.role", f"expected system, developer, user or assistant, got {role!r}"
        )
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part_index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _invalid(f"{where}.content[{part_index}]", "only text parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise _invalid(f"{where}.content[{part_index}].text", "expected a string")
            texts.append(text)
        content = "".join(texts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise _invalid(f"{where}.content", "expected a string or a list of text parts")
    extra = set(message) - {"role", "content", "name"}
    if extra:
        field = sorted(extra)[0]
        raise ApiError(
            400,
            f"{where}.{field} is not supported by this server",
            param=f"{where}.{field}",
            code="unsupported_parameter",
        )
    return {"role": "system" if role == "developer" else role, "content": content}


def parse_chat(
    body: Any, apply_template: Callable[[list[dict[str, str]]], Sequence[int]]
) -> Generation:
    """A ``/v1/chat/completions`` body; ``apply_template`` turns the messages into prompt
    tokens (the tokenizer's chat template, with the generation prompt)."""
    common = _common(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages", "expected a non-empty list of messages")
    checked = [_message_text(i, m) for i, m in enumerate(messages)]
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    prompt = tuple(int(t) for t in apply_template(checked))
    return Generation(kind="chat", prompt=prompt, max_tokens=max_tokens, **common)


def parse_completion(
    body: Any, encode: Callable[[str], Sequence[int]], vocabulary: int
) -> Generation:
    """A ``/v1/completions`` body: ``prompt`` is a string (``encode``d) or a list of token
    ids below ``vocabulary`` (a list of one of either is taken as that one)."""
    common = _common(body, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise _invalid("prompt", "the prompt is empty")
        tokens = tuple(int(t) for t in encode(prompt))
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        bad = [t for t in prompt if not 0 <= t < vocabulary]
        if bad:
            raise _invalid(
                "prompt", f"token {bad[0]} is outside the vocabulary (0..{vocabulary - 1})"
            )
        tokens = tuple(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(
            400,
            "prompt: one prompt per request (a batch of prompts is not supported)",
            param="prompt",
            code="unsupported_parameter",
        )
    else:
        raise _invalid("prompt", "expected a non-empty string or a list of token ids")
    if not tokens:
        raise _invalid("prompt", "the prompt encodes to no tokens")
    return Generation(
        kind="completion", prompt=tokens, max_tokens=_integer(body, "max_tokens", 1), **common
    )


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _object(kind: Kind, chunk: bool) -> str:
    if kind == "chat":
        return "chat.completion.chunk" if chunk else "chat.completion"
    return "text_completion"


def completion_body(
    kind: Kind,
    rid: str,
    model: str,
    text: str,
    finish_reason: str,
    usage: dict[str, Any],
    created: int | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) answer."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        "id": rid,
        "object": _object(kind, chunk=False),
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def chunk_body(
    kind: Kind,
    rid: str,
    model: str,
    created: int,
    *,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chunk: new ``text`` (with the assistant ``role`` on a chat's first),
    the ``finish_reason`` on the last choice chunk, or only ``usage`` (no choices)."""
    body: dict[str, Any] = {
        "id": rid,
        "object": _object(kind, chunk=True),
        "created": created,
        "model": model,
    }
    if usage is not None and text is None and finish_reason is None and not role:
        body["choices"] = []
        body["usage"] = usage
        return body
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    body["choices"] = [choice]
    return body
