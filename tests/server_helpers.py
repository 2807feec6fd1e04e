"""A live ``kvrows serve`` in a thread for the tests, and a fake online engine.

:class:`FakeEngine` implements the online engine's API (``spec/engine.md`` §17:
``submit``, ``cancel``, ``step``, ``serve_forever``, ``close_admissions``, ``gauges``,
``run``, with the engine's own event, result and gauge types) with a deterministic token
rule instead of a model, so the server's HTTP side
(protocol, streaming, disconnects, refusals, draining, metrics) is tested on its own and
fast. ``live_server`` runs uvicorn on a free port of 127.0.0.1 in a thread, bounded: it
stops when the ``with`` block ends.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn

from kvrows.app.engine import EngineGauges, FinishEvent, Request, RequestResult, TokenEvent
from kvrows.app.server import KvRowsServer, create_app
from kvrows.errors import CapacityError, DrainingError, InvalidInputError, QueueFullError

__all__ = ["FakeEngine", "free_port", "live_server"]


#: Ids the fake model never produces.
SPECIAL = 8
#: Bytes a fake row holds per token.
BYTES_PER_TOKEN = 64


def next_token(request: Request, generated: Sequence[int], vocab: int) -> int:
    """The fake model: a fixed function of the prompt, the step and (sampling) the seed;
    never one of the first :data:`SPECIAL` ids (the trained tokenizer's specials: an
    end-of-sequence would end a long stream early)."""
    salt = request.seed if request.temperature > 0 else 0
    return SPECIAL + (sum(request.prompt) * 31 + 17 * len(generated) + salt) % (vocab - SPECIAL)


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of ``text`` that may start a stop string."""
    most = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:length]):
                most = max(most, length)
                break
    return most


@dataclass
class _Row:
    request: Request
    result: RequestResult
    on_event: Callable[[Any], None] | None
    sent: int = 0


class FakeEngine:
    """The online engine's contract over :func:`next_token`; ``block`` tokens are the
    prefix cache's unit (a prompt reuses the longest run of whole blocks an earlier
    finished prompt shares with it, at most ``len - 1`` tokens)."""

    def __init__(
        self,
        vocab: int,
        detokenize: Callable[[Sequence[int]], str],
        *,
        max_batch: int = 8,
        max_waiting: int | None = None,
        max_positions: int = 1 << 16,
        step_seconds: float = 0.002,
        block: int = 4,
    ) -> None:
        self.vocab = vocab
        self.detokenize = detokenize
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.max_positions = max_positions
        self.step_seconds = step_seconds
        self.block = block
        self._lock = threading.Condition()
        self._waiting: list[_Row] = []
        self._running: list[_Row] = []
        self._cancelled: set[str] = set()
        self._published: list[tuple[int, ...]] = []
        self._closed = False
        self.prefix_hits = 0
        self.prefix_hit_tokens = 0
        self.generated = 0
        self.finished = 0

    # -- the contract ---------------------------------------------------------------------
    def submit(self, request: Request, on_event: Callable[[Any], None] | None = None) -> None:
        if not request.prompt:
            raise InvalidInputError(f"request {request.rid} has an empty prompt")
        if request.max_tokens < 1:
            raise InvalidInputError(f"request {request.rid} asks for no tokens")
        if len(request.prompt) + request.max_tokens > self.max_positions:
            raise CapacityError(f"request {request.rid} needs more positions than the layouts hold")
        with self._lock:
            if self._closed:
                raise DrainingError("the engine is draining")
            if self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
                raise QueueFullError("the queue is full", retry_after=1.0)
            row = _Row(request, RequestResult(request.rid, len(request.prompt)), on_event)
            self._waiting.append(row)
            self._lock.notify_all()

    def cancel(self, rid: str) -> bool:
        with self._lock:
            live = any(r.request.rid == rid for r in self._waiting + self._running)
            if live:
                self._cancelled.add(rid)
                self._lock.notify_all()
            return live

    def close_admissions(self) -> None:
        with self._lock:
            self._closed = True

    def gauges(self) -> EngineGauges:
        with self._lock:
            held = sum(
                (len(r.request.prompt) + len(r.result.tokens)) * BYTES_PER_TOKEN
                for r in self._running
            )
            return EngineGauges(
                running=len(self._running),
                waiting=len(self._waiting),
                kv_bytes_held=held,
                kv_budget=None,
                prefix_cache_bytes=sum(len(p) for p in self._published) * BYTES_PER_TOKEN,
                prefix_hits=self.prefix_hits,
                prefix_hit_tokens=self.prefix_hit_tokens,
                store_hit_tokens=0,
                generated_tokens=self.generated,
                preemptions=0,
                requests_finished=self.finished,
            )

    def step(self) -> bool:
        events: list[tuple[_Row, Any]] = []
        with self._lock:
            for row in [
                r for r in self._waiting + self._running if r.request.rid in self._cancelled
            ]:
                self._finish(row, "cancelled", events)
            self._cancelled.clear()
            while self._waiting and len(self._running) < self.max_batch:
                row = self._waiting.pop(0)
                row.result.prefix_hit_tokens = self._hit(row.request.prompt)
                if row.result.prefix_hit_tokens:
                    self.prefix_hits += 1
                    self.prefix_hit_tokens += row.result.prefix_hit_tokens
                self._running.append(row)
            for row in list(self._running):
                self._decode(row, events)
            busy = bool(self._waiting or self._running)
        for row, event in events:
            if row.on_event is not None:
                row.on_event(event)
        return busy

    def serve_forever(self, stop: threading.Event) -> None:
        while True:
            with self._lock:
                while not (self._waiting or self._running) and not stop.is_set():
                    self._lock.wait(0.05)
                if stop.is_set() and not (self._waiting or self._running):
                    return
            self.step()
            time.sleep(self.step_seconds)

    def run(self, requests: Sequence[Request]) -> tuple[list[RequestResult], None]:
        results: dict[str, RequestResult] = {}

        def keep(event: Any) -> None:
            if isinstance(event, FinishEvent):
                results[event.rid] = event.result

        for request in requests:
            self.submit(request, keep)
        while self.step():
            pass
        return [results[r.rid] for r in requests], None

    # -- inside ---------------------------------------------------------------------------
    def _hit(self, prompt: tuple[int, ...]) -> int:
        best = 0
        for earlier in self._published:
            same = 0
            for a, b in zip(earlier, prompt, strict=False):
                if a != b:
                    break
                same += 1
            best = max(best, min(same, len(prompt) - 1) // self.block * self.block)
        return best

    def _decode(self, row: _Row, events: list[tuple[_Row, Any]]) -> None:
        request, result = row.request, row.result
        token = next_token(request, result.tokens, self.vocab)
        result.tokens.append(token)
        self.generated += 1
        text = self.detokenize(result.tokens)
        hit = [text.index(s) for s in request.stop_strings if s in text]
        if hit:
            text = text[: min(hit)]
        held = 0 if hit else _held_back(text, request.stop_strings)
        new = text[row.sent : len(text) - held]
        row.sent += len(new)
        events.append((row, TokenEvent(request.rid, (token,), new)))
        result.text = text
        if hit or token in request.stop:
            self._finish(row, "stop", events)
        elif len(result.tokens) >= request.max_tokens:
            self._finish(row, "length", events)

    def _finish(self, row: _Row, reason: str, events: list[tuple[_Row, Any]]) -> None:
        row.result.finish_reason = reason
        if reason in ("stop", "length"):
            self._published.append(row.request.prompt)
        for queue in (self._waiting, self._running):
            if row in queue:
                queue.remove(row)
        self.finished += 1
        events.append((row, FinishEvent(row.request.rid, row.result)))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def live_server(server: KvRowsServer, *, timeout: float = 10.0) -> Iterator[str]:
    """``server`` under uvicorn on a free port of 127.0.0.1 in a thread; yields its base
    URL (``http://127.0.0.1:N``) and stops it (engine thread included) on exit."""
    config = uvicorn.Config(
        create_app(server), host="127.0.0.1", port=free_port(), log_level="error", lifespan="on"
    )
    runner = uvicorn.Server(config)
    thread = threading.Thread(target=runner.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not runner.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        runner.should_exit = True
        thread.join(timeout)
        server.stop(timeout)
