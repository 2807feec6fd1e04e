"""``kvrows serve``: the online engine behind OpenAI's HTTP API (``spec/server.md``).

:class:`KvRowsServer` owns one engine (``kvrows.app.engine.Engine``: ``submit``,
``cancel``, ``serve_forever`` in its own thread) and a tokenizer (mlx-lm's
``TokenizerWrapper``: the chat template, ``encode``, the end-of-sequence tokens);
:func:`create_app` is its Starlette application: ``POST /v1/chat/completions``,
``POST /v1/completions`` (streamed as server-sent events or whole), ``GET /v1/models``,
``GET /health`` and ``GET /metrics``. The event loop never waits on the engine: a request
is submitted with a callback that hops each event onto the loop
(``call_soon_threadsafe``), so ``/health`` answers while the engine decodes.

Draining (``SIGTERM``, :meth:`KvRowsServer.drain`): new requests get 503, the engine takes
no more, requests in flight finish; any still running after ``drain_timeout`` are
cancelled and their streams end with an error event saying so; then the engine thread
stops (every published row is already written to the prefix store) and the process
exits 0. :func:`run_server` runs it all under uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvrows.app.engine import Request
from kvrows.app.server_metrics import CONTENT_TYPE, ServerMetrics
from kvrows.app.server_protocol import (
    ApiError,
    Generation,
    chunk_body,
    completion_body,
    error_body,
    parse_chat,
    parse_completion,
    usage_body,
)
from kvrows.errors import (
    CapacityError,
    DrainingError,
    InvalidInputError,
    KvRowsError,
    QueueFullError,
)

__all__ = [
    "DEFAULT_CONTEXT_LENGTH",
    "DEFAULT_MAX_TOKENS",
    "KvRowsServer",
    "create_app",
    "run_server",
]

logger = logging.getLogger("kvrows.serve")

#: The context of a model whose config declares none (``max_position_embeddings``).
DEFAULT_CONTEXT_LENGTH = 4096
#: Tokens a request without ``max_tokens`` may generate (less where the context ends).
DEFAULT_MAX_TOKENS = 256
#: Seconds between checks that a client waiting for a whole answer is still there.
_DISCONNECT_POLL = 0.25


@dataclass
class _Live:
    """A generation request the server is answering: its engine ``rid`` and its events."""

    rid: str
    events: asyncio.Queue[Any]


class KvRowsServer:
    """One engine, its tokenizer and the HTTP side's state (metrics, draining)."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        *,
        model_name: str,
        context_length: int = DEFAULT_CONTEXT_LENGTH,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        drain_timeout: float = 30.0,
    ) -> None:
        if context_length < 2:
            raise InvalidInputError(f"context_length must be >= 2, got {context_length}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.context_length = context_length
        self.default_max_tokens = default_max_tokens
        self.drain_timeout = drain_timeout
        self.metrics = ServerMetrics(engine.gauges)
        self.vocabulary = len(tokenizer.get_vocab()) if hasattr(tokenizer, "get_vocab") else 0
        self.eos = frozenset(int(t) for t in getattr(tokenizer, "eos_token_ids", ()) or ())
        self.draining = False
        self.created = int(time.time())
        self._live: dict[str, _Live] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._drained: asyncio.Event | None = None

    # -- the engine thread ----------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (``Engine.serve_forever``)."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, name="kvrows-engine", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self.engine.serve_forever(self._stop)
        except Exception:  # the engine died: every request left is answered with an error
            logger.exception("the engine thread stopped")

    def stop(self, timeout: float | None = None) -> None:
        """Stop the engine thread once it is idle (it finishes what it runs)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def engine_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- draining -------------------------------------------------------------------------
    async def drain(self) -> None:
        """Refuse new requests, let those in flight finish (cancel what is left after
        ``drain_timeout``), then stop the engine thread."""
        if not self.draining:
            self.draining = True
            self.metrics.draining.set(1)
            self.engine.close_admissions()
        deadline = time.monotonic() + self.drain_timeout
        while self._live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for live in list(self._live.values()):
            self.engine.cancel(live.rid)
        cancelled = time.monotonic() + 5.0  # a cancel lands at the next step boundary
        while self._live and time.monotonic() < cancelled:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self.stop, 30.0)

    # -- one generation -------------------------------------------------------------------
    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise ApiError(
                503,
                "the server is shutting down and takes no new requests",
                code="server_draining",
                kind="server_error",
            )

    def _check(self, generation: Generation) -> int:
        """The request's ``max_tokens``; refuses an unknown model or a prompt past the
        context."""
        if generation.model != self.model_name:
            raise ApiError(
                404,
                f"the model {generation.model!r} does not exist here; this server serves "
                f"{self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        prompt = len(generation.prompt)
        room = self.context_length - prompt
        if room < 1:
            raise ApiError(
                400,
                f"the prompt is {prompt} tokens; this model's context is "
                f"{self.context_length} tokens (prompt and completion together)",
                param="messages" if generation.kind == "chat" else "prompt",
                code="context_length_exceeded",
            )
        if generation.max_tokens is None:
            return min(self.default_max_tokens, room)
        if generation.max_tokens > room:
            raise ApiError(
                400,
                f"max_tokens {generation.max_tokens} and the prompt's {prompt} tokens exceed "
                f"this model's context of {self.context_length} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return generation.max_tokens

    def submit(self, generation: Generation, arrived_at: float) -> _Live:
        """Submit ``generation`` to the engine; its events arrive on the returned queue."""
        self._refuse_if_draining()
        max_tokens = self._check(generation)
        prefix = "chatcmpl" if generation.kind == "chat" else "cmpl"
        rid = f"{prefix}-{secrets.token_hex(12)}"
        seed = generation.seed if generation.seed is not None else secrets.randbits(31)
        request = Request(
            rid=rid,
            prompt=generation.prompt,
            max_tokens=max_tokens,
            temperature=generation.temperature,
            top_p=generation.top_p,
            seed=seed,
            stop=self.eos,
            stop_strings=generation.stop,
            arrived_at=arrived_at,
        )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Any] = asyncio.Queue()

        def hop(event: Any) -> None:  # the engine thread
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
                loop.call_soon_threadsafe(events.put_nowait, event)

        try:
            self.engine.submit(request, on_event=hop)
        except KvRowsError as error:
            raise _engine_refusal(error, generation) from error
        live = _Live(rid, events)
        self._live[rid] = live
        self.metrics.open_requests.inc()
        return live

    def release(self, live: _Live, finished: bool) -> None:
        """The server is done with ``live``; unless it ``finished``, cancel it."""
        if not finished:
            self.engine.cancel(live.rid)
        if self._live.pop(live.rid, None) is not None:
            self.metrics.open_requests.dec()

    def record(
        self, endpoint: str, result: Any, arrived_at: float, first_at: float | None, last_at: float
    ) -> None:
        """Count a finished request's tokens and latencies."""
        self.metrics.requests.labels(endpoint, result.finish_reason).inc()
        self.metrics.prompt_tokens.inc(result.prompt_tokens)
        self.metrics.cached_tokens.inc(result.prefix_hit_tokens)
        self.metrics.completion_tokens.inc(len(result.tokens))
        if first_at is not None:
            self.metrics.time_to_first_token.observe(max(0.0, first_at - arrived_at))
            if len(result.tokens) > 1:
                self.metrics.time_per_output_token.observe(
                    (last_at - first_at) / (len(result.tokens) - 1)
                )


def _engine_refusal(error: KvRowsError, generation: Generation) -> ApiError:
    """The HTTP answer to a request the engine would not take."""
    if isinstance(error, QueueFullError):
        return ApiError(
            429,
            f"the server is at capacity: {error}",
            code="rate_limit_exceeded",
            kind="rate_limit_error",
            headers={"Retry-After": str(max(1, math.ceil(error.retry_after)))},
        )
    if isinstance(error, DrainingError):
        return ApiError(
            503,
            "the server is shutting down and takes no new requests",
            code="server_draining",
            kind="server_error",
        )
    if isinstance(error, CapacityError):
        return ApiError(
            400,
            f"the request can never fit this server: {error}",
            param="messages" if generation.kind == "chat" else "prompt",
            code="context_length_exceeded",
        )
    return ApiError(400, str(error), code="invalid_value")


def _finishes(event: Any) -> bool:
    """A ``FinishEvent`` (it carries the result; a ``TokenEvent`` carries tokens)."""
    return hasattr(event, "result")


def _sse(body: Mapping[str, Any] | str) -> str:
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n"


def _ended_why(result: Any) -> dict[str, Any]:
    """The error event that ends a stream which did not finish (cancelled by a drain,
    rejected by the queue timeout, or an engine error)."""
    reason = result.finish_reason
    why = {
        "cancelled": "the server is shutting down: generation was stopped",
        "rejected": "the request waited too long for room on the server",
    }.get(reason, "the engine failed on this request")
    if result.error:
        why = f"{why} ({result.error})"
    kind = "server_error" if reason != "rejected" else "rate_limit_error"
    return {"error": {"message": why, "type": kind, "param": None, "code": reason}}


def create_app(server: KvRowsServer) -> Starlette:
    """The Starlette application of ``server``; its lifespan runs the engine thread."""

    def generation_endpoint(kind: str) -> Callable[[HttpRequest], Any]:
        endpoint = f"/v1/{'chat/completions' if kind == 'chat' else 'completions'}"

        async def handle(http: HttpRequest) -> Response:
            arrived_at = time.perf_counter()
            try:
                server._refuse_if_draining()
                try:
                    body = await http.json()
                except (json.JSONDecodeError, UnicodeDecodeError) as error:
                    raise ApiError(
                        400, f"the body is not valid JSON: {error}", code="invalid_json"
                    ) from None
                generation = (
                    parse_chat(body, server_template(server))
                    if kind == "chat"
                    else parse_completion(body, server_encode(server), server.vocabulary)
                )
                live = server.submit(generation, arrived_at)
            except ApiError as error:
                server.metrics.requests.labels(endpoint, str(error.status)).inc()
                return _error_response(error)
            if generation.stream:
                return StreamingResponse(
                    _stream(server, endpoint, generation, live, arrived_at),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            return await _whole(server, endpoint, generation, live, arrived_at, http)

        return handle

    async def models(_: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(server)]})

    async def model(http: HttpRequest) -> Response:
        name = http.path_params["name"]
        if name != server.model_name:
            return _error_response(
                ApiError(404, f"the model {name!r} does not exist here", code="model_not_found")
            )
        return JSONResponse(_model_card(server))

    async def health(_: HttpRequest) -> Response:
        if server.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if server._thread is not None and not server.engine_alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(_: HttpRequest) -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    async def http_error(_: HttpRequest, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        kind = "not_found" if error.status_code == 404 else "invalid_request_error"
        return _error_response(ApiError(error.status_code, str(error.detail), kind=kind))

    async def internal_error(_: HttpRequest, error: Exception) -> Response:
        logger.error("internal error", exc_info=error)
        return _error_response(
            ApiError(500, "internal server error", kind="server_error", code="internal_error")
        )

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        server.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.stop, 30.0)

    return Starlette(
        routes=[
            Route("/v1/chat/completions", generation_endpoint("chat"), methods=["POST"]),
            Route("/v1/completions", generation_endpoint("completion"), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{name:path}", model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: internal_error},
        lifespan=lifespan,
    )


def server_template(server: KvRowsServer) -> Callable[[list[dict[str, str]]], list[int]]:
    def apply(messages: list[dict[str, str]]) -> list[int]:
        if getattr(server.tokenizer, "chat_template", None) is None:
            raise ApiError(
                400,
                "this model's tokenizer has no chat template: use /v1/completions",
                code="no_chat_template",
            )
        try:
            ids = server.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
        except Exception as error:  # a template that refuses the conversation
            raise ApiError(400, f"messages: the chat template refused them: {error}") from None
        if isinstance(ids, Mapping):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    return apply


def server_encode(server: KvRowsServer) -> Callable[[str], list[int]]:
    def encode(text: str) -> list[int]:
        return [int(t) for t in server.tokenizer.encode(text, add_special_tokens=False)]

    return encode


def _model_card(server: KvRowsServer) -> dict[str, Any]:
    return {
        "id": server.model_name,
        "object": "model",
        "created": server.created,
        "owned_by": "kvrows",
        "context_length": server.context_length,
    }


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)


async def _stream(
    server: KvRowsServer,
    endpoint: str,
    generation: Generation,
    live: _Live,
    arrived_at: float,
) -> AsyncIterator[str]:
    """The server-sent events of one streamed request; a client that goes away cancels it
    (Starlette cancels this generator: ``finally`` releases the row)."""
    created = int(time.time())
    kind = generation.kind
    finished = False
    sent = ""
    first_at: float | None = None
    try:
        if kind == "chat":
            yield _sse(chunk_body(kind, live.rid, server.model_name, created, role=True, text=""))
        while True:
            event = await live.events.get()
            if not _finishes(event):
                if first_at is None and event.tokens:
                    first_at = time.perf_counter()
                if event.text:
                    sent += event.text
                    yield _sse(
                        chunk_body(kind, live.rid, server.model_name, created, text=event.text)
                    )
                continue
            finished = True
            result = event.result
            server.record(endpoint, result, arrived_at, first_at, time.perf_counter())
            if result.finish_reason in ("stop", "length"):
                rest = result.text[len(sent) :] if result.text.startswith(sent) else ""
                if rest:
                    yield _sse(chunk_body(kind, live.rid, server.model_name, created, text=rest))
                yield _sse(
                    chunk_body(
                        kind,
                        live.rid,
                        server.model_name,
                        created,
                        finish_reason=result.finish_reason,
                    )
                )
            else:
                yield _sse(_ended_why(result))
            if generation.include_usage:
                usage = usage_body(
                    result.prompt_tokens, len(result.tokens), result.prefix_hit_tokens
                )
                yield _sse(chunk_body(kind, live.rid, server.model_name, created, usage=usage))
            yield _sse("[DONE]")
            return
    finally:
        server.release(live, finished)


async def _whole(
    server: KvRowsServer,
    endpoint: str,
    generation: Generation,
    live: _Live,
    arrived_at: float,
    http: HttpRequest,
) -> Response:
    """A non-streamed answer: wait for the finish (cancel if the client goes away)."""
    finished = False
    first_at: float | None = None
    try:
        while True:
            try:
                event = await asyncio.wait_for(live.events.get(), _DISCONNECT_POLL)
            except TimeoutError:
                if await http.is_disconnected():
                    return Response(status_code=499)
                continue
            if not _finishes(event):
                if first_at is None and event.tokens:
                    first_at = time.perf_counter()
                continue
            finished = True
            result = event.result
            server.record(endpoint, result, arrived_at, first_at, time.perf_counter())
            if result.finish_reason not in ("stop", "length"):
                body = _ended_why(result)
                status = 429 if result.finish_reason == "rejected" else 503
                if result.finish_reason == "error":
                    status = 500
                return JSONResponse(body, status_code=status)
            usage = usage_body(result.prompt_tokens, len(result.tokens), result.prefix_hit_tokens)
            return JSONResponse(
                completion_body(
                    generation.kind,
                    live.rid,
                    server.model_name,
                    result.text,
                    result.finish_reason,
                    usage,
                )
            )
    finally:
        server.release(live, finished)


def run_server(
    server: KvRowsServer,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "warning",
    ready: Callable[[int], None] | None = None,
) -> int:
    """Serve until ``SIGTERM`` or ``SIGINT``, then drain and return 0 (a second signal
    stops at once). ``ready`` is called with the bound port once the server listens."""
    config = uvicorn.Config(
        create_app(server),
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
    uvicorn_server = _DrainingUvicorn(config, server)

    async def main() -> None:
        uvicorn_server.loop = asyncio.get_running_loop()
        task = asyncio.create_task(uvicorn_server.serve())
        while not uvicorn_server.started and not task.done():
            await asyncio.sleep(0.02)
        if uvicorn_server.started and ready is not None:
            ready(_bound_port(uvicorn_server, port))
        await task

    asyncio.run(main())
    return 0


def _bound_port(uvicorn_server: Any, default: int) -> int:
    for each in getattr(uvicorn_server, "servers", []):
        for sock in each.sockets:
            return int(sock.getsockname()[1])
    return default


class _DrainingUvicorn(uvicorn.Server):
    """uvicorn's server whose first ``SIGTERM`` / ``SIGINT`` drains the kvrows server
    before uvicorn shuts down (uvicorn alone would close the listening socket at once and
    re-raise the signal: exit status 143, not 0)."""

    def __init__(self, config: uvicorn.Config, server: KvRowsServer) -> None:
        super().__init__(config)
        self.kvrows = server
        self.loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Future[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        draining = self.kvrows.draining or self._drain_task is not None
        if draining or self.loop is None or sig not in (signal.SIGTERM, signal.SIGINT):
            super().handle_exit(sig, frame)  # a second signal: stop now
            return
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        async def drain_then_exit() -> None:
            try:
                await self.kvrows.drain()
            finally:
                self.should_exit = True

        self._drain_task = asyncio.ensure_future(drain_then_exit())


# -- kvrows serve: the model, the engine, the command ---------------------------------------
#: ``--model`` prefix naming an embedded tiny model.
TINY_PREFIX = "tiny:"


def check_model_name(name: str) -> None:
    """Refuse a ``--model`` that is neither ``tiny:<arch>`` nor a checkpoint directory."""
    from kvrows.app.models import TINY_MODELS, check_model

    if name.startswith(TINY_PREFIX):
        arch = name[len(TINY_PREFIX) :]
        if arch not in TINY_MODELS:
            raise InvalidInputError(
                f"unknown tiny model {arch!r}: expected tiny:<arch>, arch one of "
                f"{', '.join(TINY_MODELS)}"
            )
        return
    if not os.path.isdir(os.path.expanduser(name)):
        raise InvalidInputError(
            f"no such directory {name} (a model is a local mlx-lm checkpoint directory or "
            "tiny:<arch>; nothing is downloaded)"
        )
    check_model(name)


def check_scheme_name(name: str) -> None:
    """Refuse a ``--scheme`` that is neither a KV scheme nor a latent one (which applies
    is known once the model is)."""
    from kvrows.app.demo import latent_codec
    from kvrows.schemes import KvStorageScheme

    try:
        KvStorageScheme.parse(name)
    except InvalidInputError as refused:
        try:
            latent_codec(name)
        except InvalidInputError:
            raise refused from None


def load_served_model(name: str) -> tuple[Any, Any]:
    """The model and tokenizer ``--model name`` names: ``tiny:<arch>`` (built in memory,
    :func:`kvrows.app.checkpoints.tiny_model_with_tokenizer`) or a checkpoint directory
    (``mlx_lm.load``: its tokenizer and chat template)."""
    from kvrows.app.models import record_recurrent_layers

    check_model_name(name)
    if name.startswith(TINY_PREFIX):
        from kvrows.app.checkpoints import tiny_model_with_tokenizer

        return tiny_model_with_tokenizer(name[len(TINY_PREFIX) :])
    from mlx_lm import load

    try:
        model, tokenizer = load(os.path.expanduser(name))[:2]
    except Exception as error:  # a damaged or unsupported checkpoint: say which
        first = (str(error).strip().splitlines() or [""])[0]
        raise InvalidInputError(
            f"cannot load the model in {name}: {type(error).__name__}: {first}"
        ) from error
    record_recurrent_layers(model)
    return model, tokenizer


def model_context_length(model: Any) -> int:
    """The model config's ``max_position_embeddings``, else :data:`DEFAULT_CONTEXT_LENGTH`."""
    from kvrows.app.models import text_config

    try:
        declared = getattr(text_config(model), "max_position_embeddings", None)
    except AttributeError:
        declared = None
    return int(declared) if isinstance(declared, int) and declared > 1 else DEFAULT_CONTEXT_LENGTH


def build_engine(
    model: Any,
    tokenizer: Any,
    *,
    scheme: str | None = None,
    kv_start: int | None = None,
    max_batch: int = 8,
    kv_budget: int | None = None,
    paged: bool = False,
    prefix_store: str | None = None,
    prefix_store_bytes: int | None = None,
    speculative: bool = False,
    draft_tokens: int | None = None,
    draft_layers: int | None = None,
    max_waiting: int | None = None,
    queue_timeout: float | None = None,
    step_guard: Any = None,
    store_agreement: Any = None,
) -> Any:
    """The online engine over ``model`` with ``kvrows serve``'s options (the demo's
    meanings: :mod:`kvrows.app.demo`)."""
    from kvrows.app.demo import PREFIX_STORE_BYTES, latent_scheme, parse_scheme
    from kvrows.app.engine import Engine, model_fingerprint
    from kvrows.app.models import draft_model, is_latent_model, record_recurrent_layers
    from kvrows.persist.prefix_store import PrefixStore

    name = scheme or "plain"
    kv_scheme = (
        latent_scheme(name, kv_start) if is_latent_model(model) else parse_scheme(name, kv_start)
    )
    store = None
    if prefix_store is not None:
        store = PrefixStore(
            prefix_store,
            byte_budget=prefix_store_bytes or PREFIX_STORE_BYTES,
            fingerprint=model_fingerprint(model, kv_scheme),
        )
    draft = None
    if speculative:
        draft = draft_model(model, draft_layers)
        record_recurrent_layers(draft)
    options: dict[str, Any] = {}
    if draft is not None:
        options.update(draft_model=draft, draft_tokens=draft_tokens or 3)
    engine_class: Any = Engine
    return engine_class(
        model,
        kv_scheme,
        max_batch=max_batch,
        kv_budget=kv_budget,
        paged=paged,
        prefix_store=store,
        detokenize=tokenizer.decode,
        max_waiting=max_waiting,
        queue_timeout=queue_timeout,
        step_guard=step_guard,
        store_agreement=store_agreement,
        **options,
    )


def serve_command(args: Any) -> int:
    """``kvrows serve`` (the parsed command line of :mod:`kvrows.app.cli`). With
    ``--tensor-parallel`` (under ``mlx.launch``): the model sharded over the launch's
    processes, rank 0 serving HTTP and deciding for every rank (``spec/distributed.md``
    §6), the other ranks following."""
    model, tokenizer = load_served_model(args.model)
    group = None
    if args.tensor_parallel:
        import functools

        import mlx.core as mx

        from kvrows.app.distributed import check_in_step, shard_model, smallest

        group = mx.distributed.init()
        if group.size() < 2:
            raise InvalidInputError(
                "--tensor-parallel shards the model over the processes of a launch: run it as "
                "mlx.launch -n 2 --backend ring -- kvrows serve --tensor-parallel ..."
            )
        shard_model(model, group)
    if args.prefix_store is not None:
        from kvrows.app.distributed import check_store_sharding

        # Rank 0 checks and records; the others check after it (one store directory).
        ranks = 1 if group is None else group.size()
        if group is None or group.rank() == 0:
            check_store_sharding(args.prefix_store, ranks)
        if group is not None:
            from kvrows.app.distributed import agreed

            agreed("store checked", group=group)  # rank 0 has written the manifest
            if group.rank() != 0:
                check_store_sharding(args.prefix_store, ranks)
    engine = build_engine(
        model,
        tokenizer,
        scheme=args.scheme,
        kv_start=args.kv_start,
        max_batch=args.max_batch,
        kv_budget=args.kv_budget,
        paged=args.paged,
        prefix_store=args.prefix_store,
        prefix_store_bytes=args.prefix_store_bytes,
        speculative=args.speculative,
        draft_tokens=args.draft_tokens,
        draft_layers=args.draft_layers,
        max_waiting=args.max_waiting,
        queue_timeout=args.queue_timeout,
        step_guard=None if group is None else functools.partial(check_in_step, group=group),
        store_agreement=None if group is None else functools.partial(smallest, group=group),
    )
    if group is not None:
        from kvrows.app.distributed import STEP_TIMEOUT, Scheduler, Watchdog, follow

        watchdog = Watchdog(group, args.step_timeout or STEP_TIMEOUT)
        if group.rank() != 0:
            # Only rank 0's record stops this rank (or the watchdog, if rank 0 is gone): a
            # signal from the launcher is left to rank 0.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            follow(engine, group, watchdog=watchdog)
            return 0
        engine = Scheduler(engine, group, watchdog=watchdog)
    server = KvRowsServer(
        engine,
        tokenizer,
        model_name=args.served_model_name or args.model,
        context_length=args.context_length or model_context_length(model),
        drain_timeout=args.drain_timeout,
    )

    def ready(port: int) -> None:
        print(
            f"kvrows serve: {server.model_name} on http://{args.host}:{port} "
            f"(scheme {args.scheme or 'plain'}; SIGTERM to pid {os.getpid()} drains)",
            file=sys.stderr,
            flush=True,
        )

    status = run_server(
        server, host=args.host, port=args.port, log_level=args.log_level, ready=ready
    )
    records = getattr(engine, "records", 0)
    if records:  # a tensor-parallel rank 0: what deciding for every rank cost
        print(
            f"kvrows serve: {records} decision records broadcast, "
            f"{1e3 * engine.record_seconds / records:.2f} ms each on average",
            file=sys.stderr,
            flush=True,
        )
    return status
