"""The engine under bf16-first schemes (``quantized_kv_start``): rows in delayed layouts, each
converting at its own start, against solo lego runs driven with the same chunk cuts."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from kvrows.app.demo import solo_logits
from kvrows.app.engine import Engine, Request, RequestResult
from kvrows.app.models import draft_model, make_kvrows_cache
from kvrows.delayed import DelayedLayout
from kvrows.errors import InvalidInputError
from kvrows.lego import Bf16First
from kvrows.persist.prefix_store import reusable_copies
from kvrows.schemes import KvStorageScheme

START = 6
SCHEME = KvStorageScheme.parse(f"affine8:32@{START}")
#: |Δlogit| against the solo run: float32 rounding of batched vs solo sums (plain layers) ...
TOLERANCE = 1e-4
#: ... and on affine rings (gemma3's sliding layers) a batch reads its ring in another
#: physical order than the solo ring, so a last-bit difference can flip a stored code
#: (the demo's rule, spec/engine.md §8); greedy tokens must still be equal.
RING_TOLERANCE = 1e-3


pytestmark = pytest.mark.usefixtures("cpu_stream")


def _trace() -> list[Request]:
    """Prompts below and above the start, arriving so rows join while others are mixed."""
    shapes = [(3, 8, 0), (9, 6, 0), (14, 5, 1), (5, 9, 2)]
    return [
        Request(f"r{i}", tuple((5 * i + 3 * j + 1) % 256 for j in range(length)), tokens, at)
        for i, (length, tokens, at) in enumerate(shapes)
    ]


class _MixedReads:
    """Counts attention calls that found a delayed layout's rows mixed (plain and converted)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = DelayedLayout.attend_rows

        def counted(layout: DelayedLayout, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(layout, *args, **kwargs)

        monkeypatch.setattr(DelayedLayout, "attend_rows", counted)


def _check_against_solo(
    model: Any,
    scheme: KvStorageScheme,
    requests: list[Request],
    results: list[RequestResult],
    chunk: int,
) -> float:
    """Every request's greedy tokens and logits against its solo lego run with the same chunk
    cuts; every prompt that reaches the start was cut exactly there. The worst |Δlogit|."""
    worst = 0.0
    tolerance = (
        RING_TOLERANCE if len(model.layers) and hasattr(model.args, "sliding_window") else TOLERANCE
    )
    start = scheme.quantized_kv_start
    assert start is not None
    for request, result in zip(requests, results, strict=True):
        assert len(result.tokens) == request.max_tokens
        cuts = np.cumsum([result.prefix_hit_tokens, *result.prefill_chunks])
        assert cuts[-1] == len(request.prompt)
        if 0 < start < len(request.prompt) and start > result.prefix_hit_tokens:
            assert start in cuts, (request.rid, result.prefill_chunks)
        solo = solo_logits(
            model,
            scheme,
            request,
            result.tokens,
            chunk,
            cuts=result.prefill_chunks,
            prefix=result.prefix_hit_tokens,
        )
        assert result.tokens == [int(np.argmax(step)) for step in solo], request.rid
        for batch, alone in zip(result.logits, solo, strict=True):
            worst = max(worst, float(np.abs(batch - alone).max()))
    assert worst <= tolerance, worst
    return worst


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_rows_convert_at_their_own_start_as_solo_runs_do(
    models: dict[str, Any], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    mixed = _MixedReads(monkeypatch)
    model = models[arch]
    trace = _trace()
    engine = Engine(model, SCHEME, max_batch=2, prefill_chunk=4, keep_logits=True)
    results, stats = engine.run(trace)
    assert stats.generated == sum(r.max_tokens for r in trace)
    _check_against_solo(model, SCHEME, trace, results, 4)
    assert mixed.calls > 0  # plain and converted rows did attend in one batch
    # a finished row is published as its lego, converted at the start
    published = engine.prefix_cache and engine.prefix_cache._entries
    assert published
    legos = [c for caches in published.values() for c in caches if isinstance(c, Bf16First)]
    assert legos and all(c.minimum_reusable_offset in (0, START) for c in legos)
    assert any(c.converted and c.minimum_reusable_offset == START for c in legos)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_speculative_rounds_over_delayed_layouts(
    models: dict[str, Any], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    mixed = _MixedReads(monkeypatch)
    model = models[arch]
    trace = _trace()
    engine = Engine(
        model,
        SCHEME,
        max_batch=3,
        prefill_chunk=4,
        keep_logits=True,
        draft_model=draft_model(model),
        draft_tokens=2,
    )
    results, stats = engine.run(trace)
    assert stats.drafted > 0
    _check_against_solo(model, SCHEME, trace, results, 4)
    assert mixed.calls > 0
    plain = Engine(model, SCHEME, max_batch=3, prefill_chunk=4)
    assert [r.tokens for r in plain.run(trace)[0]] == [r.tokens for r in results]


def test_start_zero_routes_rows_to_the_quantized_layouts(
    models: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = models["gemma3"]
    scheme = KvStorageScheme.parse("affine8:32@0")
    joined: list[tuple[bool, list[str]]] = []
    original = Engine._join

    def spy(self: Engine, layouts: Any, rows: Any, *, prefill: bool) -> Any:
        made = original(self, layouts, rows, prefill=prefill)
        joined.append((prefill, [type(layout).__name__ for layout in made]))
        return made

    monkeypatch.setattr(Engine, "_join", spy)
    trace = _trace()
    results, _ = Engine(model, scheme, max_batch=2, prefill_chunk=4, keep_logits=True).run(trace)
    _check_against_solo(model, scheme, trace, results, 4)
    decode = {name for prefill, names in joined if not prefill for name in names}
    assert decode and not any(name.startswith("Delayed") for name in decode), decode
    prefill = {name for prefill, names in joined if prefill for name in names}
    assert any(name.startswith("Delayed") for name in prefill)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_prefix_hit_keeps_the_conversion_point(models: dict[str, Any], arch: str) -> None:
    model = models[arch]
    first = Request("a", tuple(range(11, 30)), 3)
    engine = Engine(model, SCHEME, max_batch=2, prefill_chunk=4, keep_logits=True)
    (done,), _ = engine.run([first])
    follow = Request("a+", first.prompt + tuple(done.tokens) + (40, 41), 4)
    short = Request("b", (*first.prompt[:9], 99, 98), 3)  # cut inside the converted part
    results, stats = engine.run([follow, short])
    assert stats.prefix_hits >= 1 and results[0].prefix_hit_tokens > START
    _check_against_solo(model, SCHEME, [follow, short], results, 4)
    cold = Engine(model, SCHEME, max_batch=2, prefill_chunk=4, use_prefix_cache=False)
    assert [r.tokens for r in cold.run([follow, short])[0]] == [r.tokens for r in results]


def test_prefix_copies_never_cut_below_the_conversion_point(models: dict[str, Any]) -> None:
    model = models["llama"]
    caches = make_kvrows_cache(model, SCHEME)
    model(mx.array([list(range(START))]), cache=caches)  # converts at exactly START
    model(mx.array([[7, 8, 9]]), cache=caches)
    assert all(c.converted and c.minimum_reusable_offset == START for c in caches)
    assert reusable_copies(caches, START - 1) is None
    copies = reusable_copies(caches, START + 1)
    assert copies is not None
    for copy, cache in zip(copies, caches, strict=True):
        assert isinstance(copy, Bf16First) and copy.converted
        assert copy.offset == START + 1 and copy.minimum_reusable_offset == START
        assert cache.offset == START + 3  # the published entry is unchanged


def test_a_model_the_hook_cannot_reach_is_refused_with_a_batch() -> None:
    class Opaque:
        def modules(self) -> list[Any]:
            return []

    with pytest.raises(InvalidInputError, match="kv-start"):
        Engine(Opaque(), SCHEME, max_batch=2)


def test_a_per_layer_scheme_with_a_start_on_rings_and_full_layers(
    models: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """gemma3 with its first (a ring) and last (full attention) layers plain: the plain ring
    must keep the delayed ring's physical columns, since gemma3 builds every sliding
    layer's mask from its first layer."""
    mixed = _MixedReads(monkeypatch)
    model = models["gemma3"]
    scheme = KvStorageScheme.parse(f"affine8:32,0=plain,-1=plain@{START}")
    trace = [*_trace(), Request("long", tuple(range(40, 61)), 6, 3)]  # past the window (16)
    engine = Engine(model, scheme, max_batch=3, prefill_chunk=4, keep_logits=True)
    results, _ = engine.run(trace)
    _check_against_solo(model, scheme, trace, results, 4)
    assert mixed.calls > 0


def test_the_delayed_bench_runs_its_three_ways() -> None:
    """A tiny ``kvrows bench --family delayed --kv-start 8``: per-row equals the solo runs
    (else the family reports a wrong result), whole-cache converts rows off their point."""
    import io

    from kvrows.app.bench.delayed import family
    from kvrows.app.bench.runner import run_family

    out = io.StringIO()
    assert run_family(family(quick=True, starts=(8,)), quick=True, out=out) == 0
    rows = [line.split("|")[1:-1] for line in out.getvalue().splitlines() if "|     8 |" in line]
    by_run = {cells[1].strip(): [c.strip() for c in cells] for cells in rows}
    assert set(by_run) == {"per-row", "whole-cache", "solo"}
    assert float(by_run["per-row"][6]) <= TOLERANCE
    assert float(by_run["whole-cache"][6]) > TOLERANCE


def test_kvrows_demo_with_a_kv_start_passes_its_invariance_check(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvrows.app.cli import main

    argv = ["demo", "--scheme", "affine8:32,-1=plain", "--kv-start", "20", "--requests", "3"]
    assert main([*argv, "--quiet"]) == 0
    table = capsys.readouterr().out
    rows = [line.split() for line in table.splitlines() if "affine8:32,-1=plain@20" in line]
    assert len(rows) == 2 and all(row[-1] == "PASS" for row in rows)  # llama and gemma3


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_draft_proposes_on_its_delayed_layouts_without_a_copy(
    models: dict[str, Any], arch: str, call_log: Any
) -> None:
    """Dispatch: the draft's delayed layers take its proposals in a proposal round on the
    layouts themselves (``spec_round_propose`` / ``spec_round_discard``; no row converts
    inside it), no scratch copy of the batch (``make_empty_batch``). Rows cross their
    start during the run. The target as its own draft proposes exactly the target's
    tokens only if the draft's rows read as the target's verify rows do (plain until the
    round that crossed the start ends): every draft is accepted."""
    from kvrows.optimized import rows
    from kvrows.speculative import SpeculativeRounds

    model = models[arch]
    assert any(isinstance(c, Bf16First) for c in make_kvrows_cache(model, SCHEME))
    call_log.watch(rows.Layout, "make_empty_batch")
    call_log.watch(SpeculativeRounds, "spec_round_propose")
    call_log.watch(SpeculativeRounds, "spec_round_discard")
    trace = _trace()
    selfish = Engine(
        model,
        SCHEME,
        max_batch=3,
        prefill_chunk=4,
        draft_model=draft_model(model, len(model.layers)),
        draft_tokens=3,
    )
    results, stats = selfish.run(trace)
    assert stats.accepted == stats.drafted > 0
    assert "make_empty_batch" not in call_log.names
    proposed = call_log.names.count("spec_round_propose")
    assert proposed > 0 and call_log.names.count("spec_round_discard") == proposed
    plain = Engine(model, SCHEME, max_batch=3, prefill_chunk=4)
    assert [r.tokens for r in plain.run(trace)[0]] == [r.tokens for r in results]
