"""pytest-benchmark: the paged family (issue 13), block-table rows vs contiguous vs mlx-lm
(the method: ``bench_common``).

Every operation of :mod:`kvrows.app.bench.paged` (merge, filter, extract, join, decode)
performed by ``paged`` (``PagedKvRows`` over one ``BlockPool``), ``contiguous``
(``PaddedKVRows``) and ``mlx-lm`` (``BatchKVCache``), and the append into a reused pool
against memcpy. Checks: rows against the generated data, and for ``paged`` the pool's byte
counters (0 for the row operations). Full shapes: B in {4, 16, 64}, L in {1024, 4096},
8 KV heads, head dim 128, float16.
"""

from __future__ import annotations

from typing import Any

import pytest
from bench_common import FULL, latest, measure

from kvrows.app.bench.paged import (
    CI_SHAPES,
    FULL_SHAPES,
    IMPLS,
    OPERATIONS,
    PagedShape,
    append_cases,
    shape_cases,
)

SHAPES = FULL_SHAPES if FULL else CI_SHAPES

CASES = [
    pytest.param(shape, op, impl, id=f"{op}-B{shape.batch}-L{shape.tokens}-{impl}")
    for shape in SHAPES
    for op in OPERATIONS
    for impl in IMPLS
]


@pytest.mark.parametrize(("shape", "op", "impl"), CASES)
def test_paged_operation(benchmark: Any, shape: PagedShape, op: str, impl: str) -> None:
    cases = latest(shape, lambda: {case.key[0]: case for case in shape_cases(shape)})
    case = cases[op]
    measure(benchmark, case.workloads[impl], case.label)


@pytest.mark.parametrize("impl", ["paged", "contiguous", "memcpy"])
def test_paged_append(benchmark: Any, impl: str) -> None:
    case = next(iter(append_cases(SHAPES[:1])))
    measure(benchmark, case.workloads[impl], case.label)
    if case.release is not None:
        case.release()
