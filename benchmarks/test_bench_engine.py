"""Engine throughput: kvrows' engine against mlx-lm's BatchGenerator, same model and trace.

Timings are reported by pytest-benchmark (``make bench`` / ``pytest benchmarks
--benchmark-enable``); the tests themselves only check that both produce the same greedy
tokens, so a CI run with benchmarks disabled is a smoke run.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvrows.app.bench.engine import mlx_lm_generate
from kvrows.app.demo import builtin_trace
from kvrows.app.engine import Engine, Request

TRACE = [Request(r.rid, r.prompt, r.max_tokens) for r in builtin_trace(8, seed=3)]


@pytest.fixture(scope="module")
def reference_tokens(model: Any) -> dict[str, list[int]]:
    tokens, _ = mlx_lm_generate(model, TRACE, 4, 64)
    return tokens


@pytest.mark.parametrize("max_batch", [1, 4, 16])
def test_engine_throughput(
    benchmark: Any, model: Any, reference_tokens: dict[str, list[int]], max_batch: int
) -> None:
    benchmark.group = f"engine max_batch={max_batch}"
    engine = Engine(model, max_batch=max_batch, prefill_chunk=64, use_prefix_cache=False)
    results, _ = benchmark.pedantic(lambda: engine.run(TRACE), rounds=3, iterations=1)
    assert {r.rid: r.tokens for r in results} == reference_tokens


@pytest.mark.parametrize("max_batch", [1, 4, 16])
def test_mlx_lm_batch_generator_throughput(
    benchmark: Any, model: Any, reference_tokens: dict[str, list[int]], max_batch: int
) -> None:
    benchmark.group = f"engine max_batch={max_batch}"
    tokens, _ = benchmark.pedantic(
        lambda: mlx_lm_generate(model, TRACE, max_batch, 64), rounds=3, iterations=1
    )
    assert tokens == reference_tokens
