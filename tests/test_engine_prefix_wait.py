"""Waiting for a prefilling row's prefix (``spec/engine.md`` §3.1): a request that shares a
long prefix with a row still prefilling is admitted once that row publishes its prompt,
and reuses it instead of computing it again beside it; requests behind it go on; where a
published row cannot serve part of its prompt (a ring past its window), nothing waits.

Tokens are compared with each request run alone (an independent oracle), and the work saved
is read from what the engine counted (prompt tokens computed, prefix hits)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrows.app.engine import (
    PREFIX_WAIT_TOKENS,
    Engine,
    FinishEvent,
    Request,
    RequestResult,
    _common_prefix,
)

#: A shared document longer than ``PREFIX_WAIT_TOKENS`` and than the prefill chunk.
DOCUMENT = tuple((7 * i + 11) % 200 + 20 for i in range(3 * PREFIX_WAIT_TOKENS))


def _asking(rid: str, question: int, *, document: tuple[int, ...] = DOCUMENT) -> Request:
    return Request(rid, document + tuple(range(question, question + 5)), max_tokens=4)


def _solo(model: Any, request: Request, **engine: Any) -> RequestResult:
    (result,), _ = Engine(model, max_batch=1, use_prefix_cache=False, **engine).run([request])
    return result


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_a_request_waits_for_the_prefix_a_prefilling_row_publishes(llama: Any, paged: bool) -> None:
    requests = [_asking("a", 1), _asking("b", 9), _asking("c", 17)]
    results, stats = Engine(llama, max_batch=4, paged=paged, keep_logits=True).run(requests)
    eager, eager_stats = Engine(
        llama, max_batch=4, paged=paged, keep_logits=True, wait_for_prefix=False
    ).run(requests)
    for request, result, other in zip(requests, results, eager, strict=True):
        alone = _solo(llama, request, paged=paged)
        assert result.tokens == alone.tokens == other.tokens, request.rid
    first, *later = results
    assert first.prefix_hit_tokens == 0
    # The later ones reused the document the first one computed, instead of computing it
    # in the same chunks beside it.
    assert all(r.prefix_hit_tokens >= len(DOCUMENT) - 16 for r in later), [
        r.prefix_hit_tokens for r in later
    ]
    assert all(r.admitted_step > first.admitted_step for r in later)
    assert stats.prefix_waits > 0 and eager_stats.prefix_waits == 0
    assert all(r.prefix_hit_tokens == 0 for r in eager)
    assert stats.prefill_tokens < eager_stats.prefill_tokens - len(DOCUMENT)


def test_a_request_behind_a_waiting_one_is_admitted(llama: Any) -> None:
    """The waiting request keeps its place; one with another prompt, behind it, goes on."""
    other = tuple((3 * i + 5) % 150 + 60 for i in range(40))
    requests = [_asking("a", 1), _asking("b", 9), Request("c", other, max_tokens=3)]
    results, stats = Engine(llama, max_batch=4).run(requests)
    first, waiting, behind = results
    assert behind.admitted_step == first.admitted_step < waiting.admitted_step
    assert stats.prefix_waits > 0
    for request, result in zip(requests, results, strict=True):
        assert result.tokens == _solo(llama, request).tokens, request.rid


def test_a_short_shared_prefix_does_not_wait(llama: Any) -> None:
    short = DOCUMENT[: PREFIX_WAIT_TOKENS - 1]
    requests = [_asking("a", 1, document=short), _asking("b", 9, document=short)]
    results, stats = Engine(llama, max_batch=4).run(requests)
    assert stats.prefix_waits == 0
    assert results[0].admitted_step == results[1].admitted_step


def test_nothing_waits_where_a_published_row_cannot_serve_part_of_its_prompt(
    gemma3: Any,
) -> None:
    """gemma3's rings (a window of 16) cannot be cut once past it: once a prompt has been
    published and that is known, requests sharing a prefix with a prefilling row do not
    wait for it (it would serve them nothing)."""
    engine = Engine(gemma3, max_batch=4)
    first = engine.submit(_asking("first", 1))
    while not engine.gauges().running or engine.gauges().prefix_cache_bytes == 0:
        engine.step()  # until the first prompt is done and published
    # Another document: what the prefix cache holds covers none of it.
    document = tuple(reversed(DOCUMENT))
    later = [_asking("b", 9, document=document), _asking("c", 17, document=document)]
    streams = [engine.submit(request) for request in later]
    while engine.step():
        pass
    results = [_finish(stream).result for stream in (first, *streams)]
    assert results[1].admitted_step == results[2].admitted_step
    for request, result in zip(later, results[1:], strict=True):
        assert result.tokens == _solo(gemma3, request).tokens, request.rid


def _finish(stream: Any) -> FinishEvent:
    events = list(stream)
    assert isinstance(events[-1], FinishEvent)
    return events[-1]


@given(
    st.lists(st.integers(0, 2), max_size=40).map(tuple),
    st.lists(st.integers(0, 2), max_size=40).map(tuple),
)
def test_the_common_prefix_is_the_leading_run_of_equal_tokens(
    a: tuple[int, ...], b: tuple[int, ...]
) -> None:
    """The binary search over slices admission uses counts what a token-by-token walk does."""
    walked = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    assert _common_prefix(a, b) == (min(len(a), len(b)) if walked is None else walked)
