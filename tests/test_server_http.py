"""``kvrows serve``'s HTTP side on a fake engine (``server_helpers.FakeEngine``): OpenAI's
client against a live server on 127.0.0.1, streaming and not, usage and cached tokens,
refusals with their statuses, a client that goes away, a flood past the queue, draining,
and ``/metrics`` against what the clients saw. Every server runs in a thread, on a free
port, and stops with its test."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from openai.types.chat import ChatCompletionMessageParam
from server_helpers import FakeEngine, live_server

from kvrows.app.checkpoints import train_tokenizer
from kvrows.app.engine import Request
from kvrows.app.server import KvRowsServer

MODEL = "tiny:llama"
TIMEOUT = 10.0


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return TokenizerWrapper(train_tokenizer())


def _server(tokenizer: Any, **engine_options: Any) -> KvRowsServer:
    context = engine_options.pop("context_length", 512)
    drain = engine_options.pop("drain_timeout", 5.0)
    engine = FakeEngine(len(tokenizer.get_vocab()), tokenizer.decode, **engine_options)
    return KvRowsServer(
        engine,
        tokenizer,
        model_name=MODEL,
        context_length=context,
        drain_timeout=drain,
    )


@pytest.fixture(scope="module")
def served(tokenizer: Any) -> Iterator[tuple[KvRowsServer, str]]:
    server = _server(tokenizer)
    with live_server(server) as url:
        yield server, url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


def _metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    pattern = rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _offline(server: KvRowsServer, prompt: list[int], max_tokens: int) -> Any:
    """The same request through a fresh engine's ``run`` (the offline oracle)."""
    engine = FakeEngine(server.vocabulary, server.tokenizer.decode)
    request = Request("offline", tuple(prompt), max_tokens, stop=server.eos)
    return engine.run([request])[0][0]


def test_chat_and_completion_match_the_offline_engine(served: tuple[KvRowsServer, str]) -> None:
    server, url = served
    client = _client(url)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Tell me a short story."}
    ]
    prompt = server.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    oracle = _offline(server, prompt, 6)

    whole = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
    )
    assert whole.choices[0].message.content == oracle.text
    assert whole.choices[0].finish_reason == oracle.finish_reason
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(prompt)
    assert whole.usage.completion_tokens == len(oracle.tokens)

    pieces = []
    usage = None
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == oracle.text
    assert usage is not None and usage.completion_tokens == len(oracle.tokens)
    # The second identical prompt reuses the first one's prefix.
    assert usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens_details.cached_tokens or 0) > 0

    text = "Once upon a time"
    ids = server.tokenizer.encode(text, add_special_tokens=False)
    oracle = _offline(server, ids, 5)
    completion = client.completions.create(model=MODEL, prompt=text, max_tokens=5, temperature=0)
    assert completion.choices[0].text == oracle.text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=ids, max_tokens=5, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == oracle.text
    assert [m.id for m in client.models.list()] == [MODEL]


def test_stop_strings_cut_the_text(served: tuple[KvRowsServer, str]) -> None:
    server, url = served
    client = _client(url)
    prompt = "Count from one to ten:"
    ids = server.tokenizer.encode(prompt, add_special_tokens=False)
    full = _offline(server, ids, 8).text
    assert len(full) > 3
    stop = full[2:4]
    answer = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=[stop]
    )
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].text == full[: full.index(stop)]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=stop, stream=True
        )
        if c.choices
    )
    assert streamed == full[: full.index(stop)]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL, "prompt": "hi", "n": 2}, 400, "n"),
        ({"model": MODEL, "prompt": "hi", "logprobs": 3}, 400, "logprobs"),
        ({"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo"),
        ({"model": MODEL, "prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
        ({"model": MODEL, "prompt": "hi", "stop": [1]}, 400, "stop"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt"),
        ({"model": MODEL, "prompt": [999999]}, 400, "prompt"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "word " * 600}, 400, "prompt"),
        ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
        ({"prompt": "hi"}, 400, "model"),
        ([1, 2], 400, None),
    ],
)
def test_refusals_are_openai_errors(
    served: tuple[KvRowsServer, str], body: Any, status: int, param: str | None
) -> None:
    _, url = served
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param
    assert error["message"] and "Traceback" not in reply.text


def test_chat_refusals_and_ignored_fields(served: tuple[KvRowsServer, str]) -> None:
    _, url = served
    chat = f"{url}/v1/chat/completions"
    good = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for field, value in (("tools", [{"type": "function"}]), ("logprobs", True), ("n", 3)):
        reply = httpx.post(chat, json={**good, field: value}, timeout=TIMEOUT)
        assert reply.status_code == 400
        assert reply.json()["error"]["param"] == field
    reply = httpx.post(chat, json={**good, "messages": []}, timeout=TIMEOUT)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"
    for raw in (b"{not json", b"\xff\xfe", b""):
        reply = httpx.post(
            chat, content=raw, headers={"content-type": "application/json"}, timeout=TIMEOUT
        )
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"
    ignored = {**good, "user": "someone", "metadata": {"a": "b"}, "n": 1, "logprobs": False}
    reply = httpx.post(chat, json=ignored, timeout=TIMEOUT)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["role"] == "assistant"
    assert httpx.get(f"{url}/nowhere", timeout=TIMEOUT).json()["error"]["type"] == "not_found"
    assert httpx.get(f"{url}/health", timeout=TIMEOUT).json() == {"status": "ok"}


def test_a_client_that_goes_away_releases_its_row(tokenizer: Any) -> None:
    server = _server(tokenizer, step_seconds=0.02)
    with live_server(server) as url:
        body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as reply:
            events = 0
            for line in reply.iter_lines():
                events += line.startswith("data: ")
                if events >= 3:
                    assert _metric(url, "kvrows_requests_running") == 1
                    assert _metric(url, "kvrows_http_requests_open") == 1
                    break  # closing the iterator closes the connection
        for _ in range(200):  # the cancel lands at the engine's next step boundary
            if _metric(url, "kvrows_requests_running") == 0:
                break
            threading.Event().wait(0.02)
        assert _metric(url, "kvrows_requests_running") == 0
        assert _metric(url, "kvrows_kv_bytes_held") == 0
        assert _metric(url, "kvrows_http_requests_open") == 0
        # and the server still answers
        answer = _client(url).completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert answer.choices[0].finish_reason in ("stop", "length")


def test_a_flood_past_the_queue_gets_429_then_recovers(tokenizer: Any) -> None:
    server = _server(tokenizer, max_batch=1, max_waiting=2, step_seconds=0.01)
    with live_server(server) as url:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 20}

        def post(_: int) -> httpx.Response:
            return httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)

        with ThreadPoolExecutor(12) as pool:
            replies = list(pool.map(post, range(12)))
        statuses = sorted(r.status_code for r in replies)
        assert 200 in statuses and 429 in statuses, statuses
        refused = next(r for r in replies if r.status_code == 429)
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert post(0).status_code == 200  # the queue emptied: served again
        assert _metric(url, "kvrows_requests_total", '{endpoint="/v1/completions",outcome="429"}')


def test_draining_finishes_in_flight_and_refuses_new(tokenizer: Any) -> None:
    server = _server(tokenizer, step_seconds=0.01)
    with live_server(server) as url:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 30, "stream": True}
        lines: list[str] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as reply:
            iterator = reply.iter_lines()
            lines.append(next(iterator))
            drained = threading.Thread(target=asyncio.run, args=(server.drain(),))
            drained.start()
            for _ in range(100):
                if server.draining:
                    break
                threading.Event().wait(0.01)
            refused = httpx.post(
                f"{url}/v1/completions", json={**body, "stream": False}, timeout=TIMEOUT
            )
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "server_draining"
            assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 503
            lines.extend(iterator)
            drained.join(TIMEOUT)
        data = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert data[-1]["choices"][0]["finish_reason"] == "length"
        assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
        assert not server.engine_alive


def test_drain_timeout_ends_streams_with_a_reason(tokenizer: Any) -> None:
    server = _server(tokenizer, step_seconds=0.02, drain_timeout=0.2)
    with live_server(server) as url:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as reply:
            iterator = reply.iter_lines()
            next(iterator)
            asyncio.run(server.drain())
            rest = [x for x in iterator if x.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["error"]["code"] == "cancelled"


def test_32_streaming_clients_share_prefixes_and_metrics_agree(tokenizer: Any) -> None:
    server = _server(tokenizer, max_batch=8)
    systems = ["You are a helpful assistant who answers briefly.", "You tell stories about cats."]
    with live_server(server) as url:
        client = _client(url)
        baseline = _metric(url, "kvrows_completion_tokens_total")

        def talk(index: int) -> tuple[str, Any]:
            messages: list[ChatCompletionMessageParam] = [
                {"role": "system", "content": systems[index % 2]},
                {"role": "user", "content": f"Question number {index}?"},
            ]
            text, usage, finish = "", None, None
            for chunk in client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
                seed=index,
            ):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                usage = chunk.usage or usage
            assert finish in ("stop", "length")
            return text, usage

        first = talk(0)  # warms one system prompt
        with ThreadPoolExecutor(32) as pool:
            answers = [first, *pool.map(talk, range(1, 32))]
        usages = [u for _, u in answers]
        assert all(u is not None for u in usages)
        cached = [
            (u.prompt_tokens_details.cached_tokens or 0) if u.prompt_tokens_details else 0
            for u in usages
        ]
        assert sum(c > 0 for c in cached) >= 16, cached
        completion = sum(u.completion_tokens for u in usages)
        assert _metric(url, "kvrows_completion_tokens_total") - baseline == completion
        assert _metric(url, "kvrows_cached_prompt_tokens_total") == sum(cached)
        assert _metric(url, "kvrows_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
        assert _metric(url, "kvrows_time_to_first_token_seconds_count") == 32
        assert _metric(url, "kvrows_prefix_hit_tokens_total") == sum(cached)
        assert _metric(url, "kvrows_requests_running") == 0
