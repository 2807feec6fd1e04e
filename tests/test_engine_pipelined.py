"""Pipelined decode (``spec/engine.md`` §6.1) against the synchronous engine, its oracle:
the same tokens and bit-identical logits, under every demo model and scheme, and through
batch changes (joins, length and stop finishes, tempered rows) made while a step is in
flight."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvrows.app import engine as engine_module
from kvrows.app.demo import SCHEMES, builtin_trace
from kvrows.app.engine import Engine, Request, RequestResult
from kvrows.app.models import ARCHITECTURES, tiny_model
from kvrows.schemes import KvStorageScheme


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    return {arch: tiny_model(arch) for arch in ARCHITECTURES}


def _run(model: Any, scheme: str, requests: list[Request], *, pipelined: bool) -> Any:
    engine = Engine(
        model,
        KvStorageScheme.parse(scheme),
        max_batch=3,
        prefill_chunk=16,
        keep_logits=True,
        pipelined=pipelined,
    )
    return engine, *engine.run(requests)


def _same(ours: list[RequestResult], oracle: list[RequestResult]) -> None:
    for mine, theirs in zip(ours, oracle, strict=True):
        assert mine.tokens == theirs.tokens, mine.rid
        assert mine.finish_reason == theirs.finish_reason, mine.rid
        assert len(mine.logits) == len(theirs.logits) == len(mine.tokens)
        for a, b in zip(mine.logits, theirs.logits, strict=True):
            assert np.array_equal(a, b), mine.rid


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_pipelined_equals_synchronous_under_every_demo_scheme(
    models: dict[str, Any], arch: str
) -> None:
    trace = [
        Request(r.rid, r.prompt[:20], min(r.max_tokens, 6), r.arrival // 4)
        for r in builtin_trace(5)
    ]
    for scheme in SCHEMES:
        _, oracle, oracle_stats = _run(models[arch], scheme, trace, pipelined=False)
        _, ours, stats = _run(models[arch], scheme, trace, pipelined=True)
        _same(ours, oracle)
        assert stats.target_forwards == oracle_stats.target_forwards
        assert stats.row_forwards == oracle_stats.row_forwards
        assert stats.peak_kv_bytes == oracle_stats.peak_kv_bytes


def test_batch_changes_while_a_step_is_in_flight(
    models: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows join, finish on length and on a stop token (read one step late), and a tempered
    row draws from its own key, all while a pipelined step is unread; the tokens are the
    synchronous engine's, and the stopped row's published KV serves a follow-up exactly."""
    model = models["gemma3"]  # rings: a stale row in flight would shift every other row
    base = [
        Request("a", tuple(range(3, 21)), 9),
        Request("b", tuple(range(40, 45)), 4, arrival=1),
        Request("c", tuple(range(60, 71)), 7, arrival=2, temperature=0.9, seed=5),
        Request("d", tuple(range(80, 83)), 8, arrival=3),
    ]
    _, plain, _ = _run(model, "plain", base, pipelined=False)
    # d stops at the first of its tokens 3..6 not seen before it (a mid-run stop)
    tokens = plain[3].tokens
    at = next(i for i in range(2, 7) if tokens[i] not in tokens[:i])
    stop_token = tokens[at]
    trace = [*base[:3], Request("d", base[3].prompt, 8, 3, stop=frozenset({stop_token}))]

    in_flight: list[str] = []
    original_filter, original_join = engine_module._Pipeline.filter, engine_module._Pipeline.join

    def filter_spy(self: Any, keep: list[int]) -> None:
        in_flight.append(f"filter:{len(self.flights)}")
        original_filter(self, keep)

    def join_spy(self: Any, rows: list[Any]) -> None:
        in_flight.append(f"join:{len(self.flights)}")
        original_join(self, rows)

    monkeypatch.setattr(engine_module._Pipeline, "filter", filter_spy)
    monkeypatch.setattr(engine_module._Pipeline, "join", join_spy)
    _, oracle, _ = _run(model, "plain", trace, pipelined=False)
    pipelined_engine, ours, _ = _run(model, "plain", trace, pipelined=True)
    _same(ours, oracle)
    assert ours[3].finish_reason == "stop" and ours[3].tokens[-1] == stop_token
    assert len(ours[3].tokens) == at + 1 < 8
    # batch changes happened with an unread step in flight
    assert "filter:1" in in_flight and "join:1" in in_flight, in_flight

    # The stopped row was fed its stop token once more: its published KV covers it, and a
    # follow-up that reuses it gets a cold engine's tokens.
    follow = Request("d+", trace[3].prompt + tuple(ours[3].tokens) + (9, 8, 7), 5)
    (reused,), _ = pipelined_engine.run([follow])
    assert reused.prefix_hit_tokens == len(trace[3].prompt) + len(ours[3].tokens)
    cold = Engine(model, max_batch=1, use_prefix_cache=False, pipelined=False)
    (expected,), _ = cold.run([follow])
    assert reused.tokens == expected.tokens


def test_progress_line_counts_requests_and_tokens(
    models: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    engine = Engine(models["llama"], max_batch=2, progress=True)
    requests = [Request(f"p{i}", (1, 2, 3 + i), 3) for i in range(2)]
    engine.run(requests)
    last = [line for line in capsys.readouterr().err.split("\r") if line.strip()][-1]
    assert "2/2 requests" in last and "6 tok," in last and "tok/s" in last
