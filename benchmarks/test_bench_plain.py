"""pytest-benchmark: the plain family's row operations, kvrows vs mlx-lm vs a copy
(the method: ``bench_common``).

Every operation of :mod:`kvrows.app.bench.plain` (merge, merge-step, join, filter-half,
filter-one, extract, update, decode), performed by each of ``kvrows``
(``kvrows.optimized.PaddedKVRows``), ``mlx-lm`` (``BatchKVCache``), ``copy`` (an MLX copy
of the same bytes), ``memcpy`` (``numpy.copyto`` of the same bytes) and ``reference`` (the
NumPy reference; skipped at large shapes). Checks: row counts, every row's keys and values
against the generated inputs, attention against a NumPy computation. Full shapes: B in
{4, 16}, L in {1024, 4096}, 8 KV heads, head dim 128, float16.
"""

from __future__ import annotations

from typing import Any

import pytest
from bench_common import FULL, latest, measure

from kvrows.app.bench.plain import (
    CI_SHAPES,
    FULL_SHAPES,
    IMPLEMENTATIONS,
    OPERATIONS,
    Shape,
    ShapeBench,
)

# Shape-major order, so one shape's generated data serves all its tests.
CASES = [
    pytest.param(shape, op, impl, id=f"{op}-B{shape.batch}-L{shape.tokens}-{impl}")
    for shape in (FULL_SHAPES if FULL else CI_SHAPES)
    for op in OPERATIONS
    for impl in IMPLEMENTATIONS
]


@pytest.mark.parametrize(("shape", "op", "impl"), CASES)
def test_plain_row_operation(benchmark: Any, shape: Shape, op: str, impl: str) -> None:
    bench = latest(shape, lambda: ShapeBench(shape))
    if not bench.runs(impl):
        pytest.skip(f"the NumPy reference is not benchmarked at {shape.label}")
    measure(benchmark, bench.workload(op, impl), f"{op} {shape.label}")
