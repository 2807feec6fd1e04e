"""The continuous-batching engine: admission, prefix reuse, sampling, batch invariance."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from kvrows.app.demo import builtin_trace, check_invariance
from kvrows.app.engine import Engine, EngineStats, Request
from kvrows.app.models import make_kvrows_cache
from kvrows.errors import InvalidInputError
from kvrows.schemes import KvStorageScheme


def _request(rid: str, length: int, max_tokens: int = 4, **kw: Any) -> Request:
    return Request(rid, tuple((7 * i + len(rid)) % 256 for i in range(length)), max_tokens, **kw)


def test_batch_matches_solo_under_each_scheme(llama: Any, gemma3: Any) -> None:
    trace = builtin_trace(6)
    for model in (llama, gemma3):
        for scheme in ("plain", "affine8"):
            storage = KvStorageScheme.parse(scheme)
            engine = Engine(model, storage, max_batch=4, prefill_chunk=16, keep_logits=True)
            results, stats = engine.run(trace)
            assert stats.generated == sum(r.max_tokens for r in trace)
            report = check_invariance(model, storage, trace, results, 16)
            # bit-identical, gemma3's wrapped rings included (read in time order, alone
            # and batched: kvrows.app.ring_order)
            assert report.steps == stats.generated
            assert report.mismatches == 0 and report.max_logit_diff == 0.0, report
            assert report.ok


def test_budget_rejects_what_never_fits_and_admits_fifo(llama: Any) -> None:
    probe = Engine(llama, max_batch=4)
    small = _request("small", 8)
    per_row = probe.projected_bytes(small)
    engine = Engine(llama, max_batch=4, kv_budget=2 * per_row)
    huge = _request("huge", 200, max_tokens=50)
    results, stats = engine.run([small, huge, _request("next", 8), _request("last", 8)])
    by_id = {r.rid: r for r in results}
    assert by_id["huge"].finish_reason == "rejected" and "budget" in (by_id["huge"].error or "")
    assert stats.rejected == 1
    assert all(len(by_id[r].tokens) == 4 for r in ("small", "next", "last"))
    assert stats.peak_kv_bytes > 0
    # two rows fit the budget at a time: "last" waits for a finished row, in FIFO order
    order = [by_id[r].admitted_step for r in ("small", "next", "last")]
    assert order[0] == order[1] == 0 < order[2]


def test_admission_is_fifo_without_eviction(llama: Any) -> None:
    per_row = Engine(llama).projected_bytes(_request("x", 8, max_tokens=8))
    engine = Engine(llama, max_batch=8, kv_budget=per_row)
    queue = [_request(f"q{i}", 8, max_tokens=8, arrival=i) for i in range(4)]
    results, _ = engine.run(queue)
    steps = [r.admitted_step for r in results]
    assert steps == sorted(steps) and len(set(steps)) == 4  # one at a time, in arrival order
    assert all(len(r.tokens) == 8 for r in results)  # nobody was evicted


def test_prefix_cache_reuse_gives_the_same_tokens(llama: Any) -> None:
    first = _request("a", 30, max_tokens=6)
    engine = Engine(llama, max_batch=2, keep_logits=True)
    (result,), _ = engine.run([first])
    follow = Request("b", first.prompt + tuple(result.tokens) + (1, 2, 3), 5)
    (reused,), stats = engine.run([follow])
    assert reused.prefix_hit_tokens == len(first.prompt) + len(result.tokens) - 1
    assert stats.prefix_hits == 1
    fresh = Engine(llama, max_batch=2, use_prefix_cache=False, keep_logits=True)
    (cold,), _ = fresh.run([follow])
    assert cold.tokens == reused.tokens and cold.prefix_hit_tokens == 0


def test_temperature_sampling_is_per_request_and_batch_independent(llama: Any) -> None:
    hot = [_request(f"t{i}", 5 + i, max_tokens=6, temperature=0.8, seed=i) for i in range(3)]
    together, _ = Engine(llama, max_batch=3).run(hot)
    alone = [Engine(llama, max_batch=1).run([r])[0][0] for r in hot]
    assert [r.tokens for r in together] == [r.tokens for r in alone]


def test_a_scheme_the_model_cannot_resolve_is_refused(llama: Any) -> None:
    from kvrows.app.cli import main

    scheme = KvStorageScheme.parse("affine8,-9=plain@16")
    with pytest.raises(InvalidInputError, match="outside a model of 4 layers"):
        Engine(llama, scheme)
    assert main(["demo", "--scheme", "affine8,-9=plain", "--quiet"]) == 2  # one line


def test_bad_requests(llama: Any) -> None:
    engine = Engine(llama)
    with pytest.raises(InvalidInputError):
        engine.run([Request("empty", (), 3)])
    with pytest.raises(InvalidInputError):
        engine.run([Request("none", (1, 2), 0)])
    with pytest.raises(InvalidInputError):
        Engine(llama, max_batch=0)


@pytest.fixture(autouse=True)
def _no_garbage_arrays() -> None:
    """Unreachable cycles holding MLX arrays, left by earlier tests in this worker, are
    collected first: freed during a run they would drop active memory below the run's
    baseline (its measured KV peak then reads short)."""
    gc.collect()


def _peak_within(stats: EngineStats, tolerance: float = 0.10) -> bool:
    """The counted KV peak is within ``tolerance`` of the measured active-memory peak."""
    measured, counted = stats.peak_active_kv_bytes, stats.peak_kv_bytes
    return measured > 0 and abs(counted - measured) <= tolerance * measured


@pytest.mark.parametrize("scheme", ["plain", "affine4"])
def test_peak_kv_bytes_match_active_memory(llama: Any, scheme: str) -> None:
    """Without a prefix cache the engine's KV count is what MLX really holds (±10%)."""
    engine = Engine(llama, KvStorageScheme.parse(scheme), max_batch=4, use_prefix_cache=False)
    _, stats = engine.run(builtin_trace(6))
    assert _peak_within(stats), (stats.peak_kv_bytes, stats.peak_active_kv_bytes)


def test_peak_kv_bytes_match_active_memory_with_prefix_cache(llama: Any) -> None:
    engine = Engine(llama, max_batch=4)
    _, stats = engine.run(builtin_trace(6))
    assert _peak_within(stats), (stats.peak_kv_bytes, stats.peak_active_kv_bytes)


class _Counting:
    """A model that counts its forward passes."""

    def __init__(self, model: Any) -> None:
        self.model, self.calls = model, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def test_admission_runs_no_probe_when_the_geometry_is_declared(llama: Any) -> None:
    assert all(cache.geometry is not None for cache in make_kvrows_cache(llama))
    counting = _Counting(llama)
    engine = Engine(counting)
    assert counting.calls == 0
    assert engine.projected_bytes(_request("x", 8, max_tokens=8)) > 0
