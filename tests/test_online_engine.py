"""The online engine (``spec/engine.md`` §17): submit from other threads, streams, cancel,
back-pressure, the LRU prefix cache inside the budget, preemption, stop strings, top_p.

Every token check compares with an independent run: the offline ``Engine.run`` of the same
requests, or each request alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrows.app.engine import (
    Engine,
    FinishEvent,
    Request,
    RequestResult,
    RequestStream,
    StreamEvent,
    TokenEvent,
)
from kvrows.conformance.profiles import active_profile, profile_settings
from kvrows.errors import CapacityError, DrainingError, InvalidInputError, QueueFullError


def _request(rid: str, length: int, max_tokens: int = 6, **kw: Any) -> Request:
    return Request(rid, tuple((5 * i + 3 * len(rid) + ord(rid[0])) % 256 for i in range(length)),
                   max_tokens, **kw)  # fmt: skip


def _solo(model: Any, request: Request, **engine: Any) -> RequestResult:
    (result,), _ = Engine(model, max_batch=1, use_prefix_cache=False, **engine).run([request])
    return result


def _drain(stream: RequestStream) -> list[StreamEvent]:
    events = list(stream)
    assert sum(isinstance(e, FinishEvent) for e in events) == 1
    assert isinstance(events[-1], FinishEvent)
    assert stream.next_event(timeout=0) is None  # ended
    return events


def _streamed_tokens(events: Sequence[StreamEvent]) -> list[int]:
    return [t for e in events if isinstance(e, TokenEvent) for t in e.tokens]


def _run_until_idle(engine: Engine, limit: int = 500) -> None:
    for _ in range(limit):
        if not engine.step():
            return
    raise AssertionError("the engine did not go idle")


def test_submit_from_another_thread_matches_an_offline_run(llama: Any) -> None:
    requests = [_request("a", 9), _request("b", 14, 5), _request("c", 4, 7)]
    offline, _ = Engine(llama, max_batch=4).run(requests)
    engine = Engine(llama, max_batch=4)
    stop = threading.Event()
    worker = threading.Thread(target=engine.serve_forever, args=(stop,))
    worker.start()
    seen: list[StreamEvent] = []
    try:
        streams = []
        for request in requests:
            streams.append(engine.submit(request, on_event=seen.append))
            time.sleep(0.01)
        events = [_drain(stream) for stream in streams]
    finally:
        engine.close_admissions()
        stop.set()
        worker.join(timeout=60)
    assert not worker.is_alive()
    for request, expected, stream_events in zip(requests, offline, events, strict=True):
        final = stream_events[-1]
        assert isinstance(final, FinishEvent)
        assert final.result.tokens == expected.tokens
        assert _streamed_tokens(stream_events) == expected.tokens
        assert final.result.finish_reason == "length"
        assert [e for e in seen if e.rid == request.rid] == stream_events  # the callback's
    with pytest.raises(DrainingError):
        engine.submit(_request("late", 3))
    gauges = engine.gauges()
    assert gauges.requests_finished == 3 and gauges.running == gauges.waiting == 0
    assert gauges.generated_tokens == sum(len(r.tokens) for r in offline)


@pytest.mark.parametrize("paged", [False, True])
def test_cancel_mid_decode_releases_kv_and_leaves_the_others_alone(llama: Any, paged: bool) -> None:
    options: dict[str, Any] = {"paged": paged, "block_size": 4} if paged else {}
    requests = [_request("a", 9, 10), _request("b", 12, 10), _request("c", 5, 10)]
    engine = Engine(llama, max_batch=4, use_prefix_cache=False, keep_logits=True, **options)
    baseline = engine.gauges().kv_bytes_held
    streams = {r.rid: engine.submit(r) for r in requests}
    while engine.gauges().running < 3 or not engine._live["b"].result.tokens:
        engine.step()
    held = engine.gauges().kv_bytes_held
    assert engine.cancel("b") and not engine.cancel("nobody")
    engine.step()  # b leaves at this boundary
    assert engine.gauges().running == 2
    if paged:  # b's blocks are free again (contiguous layouts keep their capacity steps)
        assert engine.gauges().kv_bytes_held < held
    _run_until_idle(engine)
    assert engine.gauges().kv_bytes_held == baseline
    if paged:
        assert engine.paged is not None
        for pool in engine.paged.pools:
            if pool is not None:
                assert pool.ledger.free_count == pool.ledger.num_blocks  # every block back
    events = {rid: _drain(stream) for rid, stream in streams.items()}
    cancelled = events["b"][-1]
    assert isinstance(cancelled, FinishEvent)
    assert cancelled.result.finish_reason == "cancelled"
    assert 0 < len(cancelled.result.tokens) < 10
    for request in (requests[0], requests[2]):
        final = events[request.rid][-1]
        assert isinstance(final, FinishEvent)
        alone = _solo(llama, request, keep_logits=True, **options)
        assert final.result.tokens == alone.tokens
        assert all((x == y).all() for x, y in zip(final.result.logits, alone.logits, strict=True))


def test_a_full_queue_refuses_with_retry_after(llama: Any) -> None:
    engine = Engine(llama, max_waiting=1)
    engine.submit(_request("a", 5))
    with pytest.raises(QueueFullError) as refused:
        engine.submit(_request("b", 5))
    assert refused.value.retry_after > 0 and "queue is full" in str(refused.value)
    with pytest.raises(InvalidInputError, match="live request"):
        engine.submit(Request("a", (1, 2), 2))  # the rid of a live request
    _run_until_idle(engine)
    engine.submit(_request("b", 5))  # room again


def test_a_request_that_waits_past_queue_timeout_is_rejected(llama: Any) -> None:
    engine = Engine(llama, max_batch=1, queue_timeout=0.05)
    first = engine.submit(_request("a", 5, 4))
    engine.step()  # a is admitted; b would wait behind it
    second = engine.submit(_request("b", 5, 4))
    time.sleep(0.1)
    _run_until_idle(engine)
    late = _drain(second)[-1]
    assert isinstance(late, FinishEvent) and late.result.finish_reason == "rejected"
    assert "queue timeout" in (late.result.error or "") and not late.result.tokens
    done = _drain(first)[-1]
    assert isinstance(done, FinishEvent) and len(done.result.tokens) == 4


def test_a_request_that_can_never_fit_is_refused_at_once(llama: Any) -> None:
    small = _request("small", 8, 4)
    engine = Engine(llama, kv_budget=Engine(llama).projected_bytes(small))
    engine.submit(small)
    with pytest.raises(CapacityError, match="more than the whole budget"):
        engine.submit(_request("huge", 40, 20))
    with pytest.raises(InvalidInputError):
        engine.submit(Request("bad", (1, 2), 2, top_p=0.0))


def test_the_prefix_cache_is_lru_bounded_and_inside_the_budget(llama: Any) -> None:
    requests = [_request(rid, 24, 3) for rid in ("p", "q", "r")]
    cap = 101 * Engine(llama).admission.bytes(1)  # two requests' prompts and rows
    bounded = Engine(llama, prefix_cache_bytes=cap)
    assert bounded.prefix_cache is not None
    for request in requests:
        bounded.run([request])
        assert 0 < bounded.prefix_cache.nbytes <= cap
    assert bounded.prefix_cache.evictions > 0
    # the least recently used went first: r's and q's prompts still hit, p's does not
    hits = [bounded.prefix_cache.lookup((*r.prompt, 1, 2)) for r in requests]
    assert hits[0] is None and hits[1] is not None and hits[2] is not None
    # inside the budget: the prefix cache gets only what the active rows' reservations leave
    need = Engine(llama).projected_bytes(requests[0])
    engine = Engine(llama, kv_budget=need + cap // 4)
    for request in requests:
        engine.submit(request)
        while engine.step():
            active = engine.gauges().running
            assert engine.gauges().prefix_cache_bytes <= engine.kv_budget - active * need  # type: ignore[operator]
    assert 0 < engine.gauges().prefix_cache_bytes <= cap // 4 + need


@pytest.mark.parametrize("pipelined", [True, False])
def test_preemption_under_a_tight_budget_keeps_greedy_tokens(llama: Any, pipelined: bool) -> None:
    requests = [_request("a", 10, 8), _request("b", 13, 9), _request("c", 6, 10)]
    free, _ = Engine(llama, max_batch=4, pipelined=pipelined).run(requests)
    engine = Engine(llama, max_batch=4, pipelined=pipelined)
    streams = [engine.submit(r) for r in requests]
    for _ in range(4):  # all three decode
        engine.step()
    assert engine.gauges().running == 3
    one = max(engine.projected_bytes(r) for r in requests)
    engine.set_kv_budget(one + 1)  # one row at a time
    engine.step()
    assert engine.gauges().running == 1 and engine.gauges().preemptions == 2
    _run_until_idle(engine)
    for expected, stream in zip(free, streams, strict=True):
        events = _drain(stream)
        final = events[-1]
        assert isinstance(final, FinishEvent) and final.result.finish_reason == "length"
        assert final.result.tokens == expected.tokens
        assert _streamed_tokens(events) == expected.tokens  # seamless: no token twice


def _letters(tokens: Sequence[int]) -> str:
    """A detokenizer of two characters per token (a stop string may span tokens)."""
    return "".join(chr(97 + t % 26) + chr(65 + t % 7) for t in tokens)


def test_stop_strings_cut_the_text_and_end_the_row(llama: Any) -> None:
    request = _request("s", 7, 24, temperature=1.0, seed=3)
    (full,), _ = Engine(llama, detokenize=_letters).run([request])
    assert full.text == _letters(full.tokens) and full.finish_reason == "length"
    stop = full.text[15:18]  # from the middle of token 8 into token 9
    expected = full.text[: full.text.find(stop)]
    engine = Engine(llama, detokenize=_letters)
    streams = [
        engine.submit(Request("s", request.prompt, 24, temperature=1.0, seed=3,
                              stop_strings=("never!", stop))),
        engine.submit(_request("other", 5, 12)),
    ]  # fmt: skip
    _run_until_idle(engine)
    events = _drain(streams[0])
    final = events[-1]
    assert isinstance(final, FinishEvent)
    result = final.result
    assert result.finish_reason == "stop" and result.text == expected
    # the row ended at the token that completed the stop string
    assert result.tokens == full.tokens[: len(expected) // 2 + 2]
    assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == expected
    other = _drain(streams[1])[-1]
    assert isinstance(other, FinishEvent)
    assert other.result.tokens == _solo(llama, _request("other", 5, 12)).tokens
    with pytest.raises(InvalidInputError, match="detokenize"):
        Engine(llama).submit(Request("x", (1, 2), 2, stop_strings=("a",)))


def test_top_p_sampling_is_per_row_reproducible_and_batch_independent(llama: Any) -> None:
    hot = [_request(f"t{i}", 5 + 2 * i, 8, temperature=1.0, top_p=0.6, seed=i) for i in range(3)]
    together, _ = Engine(llama, max_batch=3).run(hot)
    again, _ = Engine(llama, max_batch=2, pipelined=False).run(hot)
    alone = [_solo(llama, r) for r in hot]
    assert [r.tokens for r in together] == [r.tokens for r in alone] == [r.tokens for r in again]
    # a nucleus of one token is greedy
    narrow = [_request(r.rid, len(r.prompt), 8, temperature=1.0, top_p=1e-6) for r in hot]
    greedy = [_request(r.rid, len(r.prompt), 8) for r in hot]
    assert [r.tokens for r in Engine(llama).run(narrow)[0]] == [
        r.tokens for r in Engine(llama).run(greedy)[0]
    ]


_PROMPTS = {"x": 6, "y": 11, "z": 3}
_SOLO: dict[tuple[str, int], list[int]] = {}


@profile_settings(max_examples=max(4, active_profile().max_examples // 15))  # ci 7
@given(
    schedule=st.lists(
        st.tuples(
            st.sampled_from(["submit", "cancel", "step"]),
            st.sampled_from(sorted(_PROMPTS)),
            st.sampled_from([3, 6]),
        ),
        min_size=1,
        max_size=14,
    ),
    paged=st.booleans(),
)
def test_random_submit_and_cancel_schedules(
    llama: Any, schedule: list[tuple[str, str, int]], paged: bool
) -> None:
    """Every stream ends with exactly one FinishEvent, a request that was not cancelled
    has its solo tokens, and the KV goes back to where it started."""
    options: dict[str, Any] = {"paged": paged, "block_size": 4} if paged else {}
    engine = Engine(llama, max_batch=2, use_prefix_cache=False, **options)
    baseline = engine.gauges().kv_bytes_held
    streams: dict[str, RequestStream] = {}
    requests: dict[str, Request] = {}
    for index, (action, prompt, max_tokens) in enumerate(schedule):
        if action == "submit":
            tokens = tuple((7 * i + ord(prompt)) % 256 for i in range(_PROMPTS[prompt]))
            request = Request(f"{prompt}{index}", tokens, max_tokens)
            requests[request.rid] = request
            streams[request.rid] = engine.submit(request)
        elif action == "cancel" and streams:
            engine.cancel(sorted(streams)[index % len(streams)])
        else:
            engine.step()
    _run_until_idle(engine)
    assert engine.gauges().kv_bytes_held == baseline
    for rid, stream in streams.items():
        events = _drain(stream)
        final = events[-1]
        assert isinstance(final, FinishEvent)
        assert _streamed_tokens(events) == final.result.tokens
        request = requests[rid]
        key = (rid[0], request.max_tokens)
        if key not in _SOLO:
            _SOLO[key] = _solo(llama, request).tokens
        if final.result.finish_reason == "cancelled":
            assert final.result.tokens == _SOLO[key][: len(final.result.tokens)]
        else:
            assert final.result.finish_reason == "length"
            assert final.result.tokens == _SOLO[key]
