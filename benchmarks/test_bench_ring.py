"""pytest-benchmark: the rotating family (issue 4), kvrows vs mlx-lm vs a copy (the
method: ``bench_common``).

Every operation of :mod:`kvrows.app.bench.ring` (merge, join, filter-half, filter-one,
extract, update, decode), performed by ``kvrows`` (``kvrows.optimized.BatchedRotatingCache``),
``mlx-lm`` (``BatchRotatingKVCache``; join is its ``extend``), ``copy`` (an MLX copy of
the same bytes) and ``memcpy`` (``numpy.copyto`` of the same bytes). Checks: every row's
window in temporal order against the generated tokens, attention against NumPy. CI
shapes: window 64, rows that wrapped and rows that did not; full: window 4096, B in
{4, 16}, L in {2000, 6000}, 8 KV heads, head dim 128, float16.
"""

from __future__ import annotations

from typing import Any

import pytest
from bench_common import FULL, latest, measure

from kvrows.app.bench.ring import (
    CI_RING_SHAPES,
    FULL_RING_SHAPES,
    RING_IMPLEMENTATIONS,
    RING_OPERATIONS,
    RingShape,
    RingShapeBench,
)

# Shape-major order, so one shape's generated data serves all its tests.
CASES = [
    pytest.param(shape, op, impl, id=f"{op}-B{shape.batch}-L{shape.tokens}-W{shape.window}-{impl}")
    for shape in (FULL_RING_SHAPES if FULL else CI_RING_SHAPES)
    for op in RING_OPERATIONS
    for impl in RING_IMPLEMENTATIONS
]


@pytest.mark.parametrize(("shape", "op", "impl"), CASES)
def test_ring_operation(benchmark: Any, shape: RingShape, op: str, impl: str) -> None:
    workload = latest(shape, lambda: RingShapeBench(shape)).workload(op, impl)
    measure(benchmark, workload, f"{op} {shape.label}")
