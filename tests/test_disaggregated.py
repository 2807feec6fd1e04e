"""Disaggregated prefill (``spec/distributed.md`` §7, ``spec/engine.md`` §18).

In this process: a prefill-only engine hands each prompt's row over and a second engine
admits the rows prefilled, giving one engine's tokens and every logit of its solo run
(contiguous and paged, the paged rows placed in the receiving engine's pools); what the
hand-over refuses; the routing rule; the roles. Over two processes
(``disaggregated_worker.py``, ``mlx.launch -n 2 --backend ring``): the demo's table passes
under plain, affine4 and turbo, contiguous and paged, and a paged row arrives in the
decode engine's own pools."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from disaggregated_worker import prefilled
from launch_helpers import launch

from kvrows.app.demo import builtin_trace, check_invariance, parse_scheme
from kvrows.app.disaggregated import parse_roles, route
from kvrows.app.engine import Engine, FinishEvent, PrefilledRow, Request, RequestResult
from kvrows.app.models import tiny_model
from kvrows.errors import InvalidInputError

WORKER = Path(__file__).with_name("disaggregated_worker.py")
#: Seconds the launch may take (about 20 s here); then its process group is killed.
LAUNCH_TIMEOUT = 300


def test_prefill_and_decode_ranks_give_one_process_tokens() -> None:
    status, out = launch(WORKER, timeout=LAUNCH_TIMEOUT)
    assert status == 0, out[-3000:]
    lines = set(out.splitlines())
    for what in ("contiguous", "paged"):
        assert {f"ok {rank} {what}" for rank in (0, 1)} <= lines, out[-3000:]
    assert "ok 1 pools" in lines, out[-3000:]
    rows = [line.split() for line in out.splitlines() if re.match(r"llama\s+\S+\s+1P\+1D\s", line)]
    assert len(rows) == 4 and all(row[-1] == "PASS" for row in rows), out[-3000:]
    assert "rank 1 (decode)" in out, out[-3000:]


def _handed_over(
    model: Any, scheme_name: str, trace: list[Request], *, paged: bool
) -> tuple[list[RequestResult], Engine, Engine]:
    """``trace`` prefilled by one engine and decoded by another, in one process."""
    scheme = parse_scheme(scheme_name)
    options: dict[str, Any] = dict(max_batch=4, prefill_chunk=16, paged=paged, keep_logits=True)
    prefill, decode = Engine(model, scheme, **options), Engine(model, scheme, **options)
    handed: list[FinishEvent] = []
    streams = []
    pending = sorted(trace, key=lambda r: r.arrival)
    by_rid = {r.rid: r for r in trace}
    step = 0
    while pending or prefill.has_work() or decode.has_work():
        while pending and pending[0].arrival <= step:
            prefill.submit(pending.pop(0), on_event=handed.append, prefill_only=True)  # type: ignore[arg-type]
        step += 1
        if prefill.has_work():
            prefill.step()
        for event in [e for e in handed if isinstance(e, FinishEvent)]:
            assert event.result.finish_reason == "prefilled" and event.prefilled is not None
            assert event.result.tokens == [event.prefilled.first_token]
            streams.append(decode.submit(by_rid[event.rid], prefilled=event.prefilled))
        handed.clear()
        if decode.has_work():
            decode.step()
    results = {}
    for stream in streams:
        *_, last = list(stream)
        assert isinstance(last, FinishEvent)
        results[last.rid] = last.result
    return [results[r.rid] for r in trace], prefill, decode


@pytest.mark.parametrize(("scheme", "paged"), [("affine4", False), ("affine8", True)])
def test_a_row_prefilled_by_one_engine_decodes_in_another(scheme: str, paged: bool) -> None:
    model = tiny_model("llama")
    trace = builtin_trace(6)
    alone, _ = Engine(model, parse_scheme(scheme), max_batch=4, prefill_chunk=16).run(trace)
    results, prefill, decode = _handed_over(model, scheme, trace, paged=paged)
    assert [r.tokens for r in results] == [r.tokens for r in alone]
    report = check_invariance(model, parse_scheme(scheme), trace, results, 16)
    assert report.ok and report.max_logit_diff == 0.0, report
    assert sum(r.prefix_hit_tokens for r in results) > 0  # the prefill engine's cache
    if paged:
        assert prefill.paged is not None and decode.paged is not None
        for pool in decode.paged.pools + prefill.paged.pools:
            pool.check_valid()
            assert pool.ledger.free_count == pool.ledger.num_blocks  # no live table left
        written = [p.ledger.bytes_written for p in decode.paged.pools]
        assert all(written), written  # the rows were placed in the decoder's own pools


def test_what_a_prefilled_submission_refuses() -> None:
    model = tiny_model("llama")
    engine = Engine(model, parse_scheme("plain"), max_batch=2)
    request = Request("a", tuple(range(1, 20)), max_tokens=3)
    row = prefilled(engine, request)
    with pytest.raises(InvalidInputError, match="not computed again"):
        engine.submit(request, prefill_only=True, prefilled=row)
    with pytest.raises(InvalidInputError, match="not this engine's"):
        Engine(model, parse_scheme("affine8"), max_batch=2).submit(request, prefilled=row)
    longer = Request("b", tuple(range(1, 25)), max_tokens=3)
    with pytest.raises(InvalidInputError, match="hold 19 positions, its prompt 24"):
        engine.submit(longer, prefilled=row)
    with pytest.raises(InvalidInputError, match="first token"):
        engine.submit(request, prefilled=PrefilledRow(row.caches, -1))
    # A row that arrives and is cancelled before its admission finishes "cancelled".
    stream = engine.submit(request, prefilled=row)
    assert engine.cancel("a")
    engine.step()
    *_, last = list(stream)
    assert isinstance(last, FinishEvent) and last.result.finish_reason == "cancelled"
    gauges = engine.gauges()  # what is left: the prompt the prefill-only run published
    assert not engine.has_work() and gauges.kv_bytes_held == gauges.prefix_cache_bytes


def test_a_row_finished_by_its_first_token_retires_at_admission() -> None:
    engine = Engine(tiny_model("llama"), parse_scheme("plain"))
    request = Request("a", tuple(range(1, 12)), max_tokens=1)
    row = prefilled(engine, request)
    stream = engine.submit(request, prefilled=row)
    while engine.has_work():
        engine.step()
    *_, last = list(stream)
    assert isinstance(last, FinishEvent)
    assert last.result.tokens == [row.first_token] and last.result.finish_reason == "length"


def test_rows_go_to_the_decode_rank_with_the_most_room() -> None:
    assert route({0: 3}, {1: 2, 2: 2}) == [(0, 1, 2), (0, 2, 1)]
    assert route({0: 1, 3: 2}, {1: 0, 2: 1}) == [(0, 2, 1), (3, 1, 1), (3, 2, 1)]
    assert route({}, {1: 4}) == []
    assert route({0: 2}, {1: 1, 2: 0}) == [(0, 1, 2)]  # a tie at 0 room: the lower rank


@pytest.mark.parametrize(
    ("text", "size", "match"),
    [
        (None, 1, "mlx.launch -n 2"),
        ("prefill,decode,decode", 2, "3 role"),
        ("prefill,prefill", 2, "at least one prefill and one decode"),
        ("prefill,encode", 2, "unknown role"),
    ],
)
def test_roles_are_refused_unless_one_per_rank_of_each_kind(
    text: str | None, size: int, match: str
) -> None:
    with pytest.raises(InvalidInputError, match=match):
        parse_roles(text, size)


def test_default_roles() -> None:
    assert parse_roles(None, 3) == ["prefill", "decode", "decode"]
    assert parse_roles("decode,prefill", 2) == ["decode", "prefill"]


def test_a_restored_paged_row_is_written_into_the_given_pool() -> None:
    from kvrows.persist.prompt_cache import restored_caches, saved_arrays

    engine = Engine(tiny_model("llama"), parse_scheme("affine8"), paged=True)
    row = prefilled(engine, Request("a", tuple(range(1, 30)), max_tokens=2))
    pools = engine.receiving_pools()
    assert pools is not None and all(pool is not None for pool in pools)
    arrays, metadata = saved_arrays(row.caches)
    restored, _ = restored_caches(dict(arrays), metadata, pools=pools)
    assert all(c.pool is p for c, p in zip(restored, pools, strict=True))
    assert all(c.offset == 29 for c in restored)
    plain = Engine(tiny_model("llama"), parse_scheme("plain"))
    unpaged = prefilled(plain, Request("b", tuple(range(1, 9)), max_tokens=2))
    arrays, metadata = saved_arrays(unpaged.caches)
    with pytest.raises(InvalidInputError, match="not a paged one"):
        restored_caches(dict(arrays), metadata, pools=pools)
    with pytest.raises(InvalidInputError, match="one per layer"):
        restored_caches(dict(arrays), metadata, pools=pools[:1] * 3)
