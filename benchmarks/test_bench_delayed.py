"""Delayed quantization: per-row conversion (the engine's delayed layouts) against whole-cache
conversion (mlx-lm's rule, ``WholeCacheEngine``) and the solo lego runs, same trace.

Timings are reported by pytest-benchmark (``pytest benchmarks --benchmark-enable``); the
tests themselves only check results, so a CI run with benchmarks disabled is a smoke run.
The full table is ``kvrows bench --family delayed``."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvrows.app.bench.delayed import Run as BenchRun
from kvrows.app.bench.delayed import WholeCacheEngine, compare, solo_run, trace
from kvrows.app.engine import Engine
from kvrows.schemes import KvStorageScheme

TRACE = trace(quick=True)
BASE = KvStorageScheme.parse("affine4:64")
CHUNK = 8


@pytest.mark.parametrize("start", [0, 8])
@pytest.mark.parametrize("policy", ["per-row", "whole-cache"])
def test_engine_conversion(benchmark: Any, model: Any, start: int, policy: str) -> None:
    benchmark.group = f"delayed start={start}"
    scheme = replace(BASE, quantized_kv_start=start)
    kind = Engine if policy == "per-row" else WholeCacheEngine
    engine = kind(model, scheme, max_batch=4, prefill_chunk=CHUNK, keep_logits=True)
    results, _ = benchmark.pedantic(lambda: engine.run(TRACE), rounds=2, iterations=1)
    run = BenchRun(results)
    compare(model, scheme, TRACE, run, CHUNK)
    if policy == "per-row":  # the oracle's tokens and logits
        assert run.mismatches == 0 and max(run.deltas) <= 1e-4, run.deltas
    else:  # rows converted off their own point: the logits move
        assert max(run.deltas) > 1e-4


@pytest.mark.parametrize("start", [0, 8])
def test_solo_lego_runs(benchmark: Any, model: Any, start: int) -> None:
    benchmark.group = f"delayed start={start}"
    scheme = replace(BASE, quantized_kv_start=start)
    solos = benchmark.pedantic(
        lambda: [solo_run(model, scheme, r, CHUNK) for r in TRACE], rounds=2, iterations=1
    )
    assert [len(s.result.tokens) for s in solos] == [r.max_tokens for r in TRACE]
