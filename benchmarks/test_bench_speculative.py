"""Speculative decoding: kvrows' engine with a draft against itself without one and against
mlx-lm's serial ``speculative_generate_step``, same model, draft and prompts.

Timings are reported by pytest-benchmark (``pytest benchmarks --benchmark-enable``); the
tests themselves only check the greedy tokens, so a CI run with benchmarks disabled is a
smoke run. mlx-lm has no batched speculative decoding: its workloads run one request after
the other. The full table is ``kvrows bench --family speculative``.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvrows.app.bench.speculative import mlx_lm_generate_serial
from kvrows.app.demo import builtin_trace
from kvrows.app.engine import Engine, Request
from kvrows.app.models import draft_model

TRACE = [Request(r.rid, r.prompt, 12) for r in builtin_trace(3, seed=3)]


@pytest.fixture(scope="module")
def draft(model: Any) -> Any:
    return draft_model(model)


@pytest.fixture(scope="module")
def reference_tokens(model: Any) -> dict[str, list[int]]:
    tokens, _ = mlx_lm_generate_serial(model, TRACE, 64)
    return tokens


@pytest.mark.parametrize("max_batch", [1, 3])
@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "plain"])
def test_kvrows_engine(
    benchmark: Any,
    model: Any,
    draft: Any,
    reference_tokens: dict[str, list[int]],
    max_batch: int,
    speculative: bool,
) -> None:
    benchmark.group = f"speculative max_batch={max_batch}"
    engine = Engine(
        model,
        max_batch=max_batch,
        use_prefix_cache=False,
        draft_model=draft if speculative else None,
    )
    results, _ = benchmark.pedantic(lambda: engine.run(TRACE), rounds=3, iterations=1)
    assert {r.rid: r.tokens for r in results} == reference_tokens


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "plain"])
def test_mlx_lm_serial(
    benchmark: Any,
    model: Any,
    draft: Any,
    reference_tokens: dict[str, list[int]],
    speculative: bool,
) -> None:
    benchmark.group = "speculative max_batch=1"
    chosen = draft if speculative else None
    tokens, _ = benchmark.pedantic(
        lambda: mlx_lm_generate_serial(model, TRACE, 64, chosen), rounds=3, iterations=1
    )
    assert tokens == reference_tokens  # llama: full attention, mlx-lm's trim is right
