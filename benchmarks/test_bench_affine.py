"""pytest-benchmark: the affine family (issue 3): quantize, row operations, decode attention
(the method: ``bench_common``).

The three parts of :mod:`kvrows.app.bench.affine`:

* ``quantize {bits}-bit {shape}``: the NumPy reference (first row only), the optimized
  wrapper and bare ``mx.quantize``;
* ``{op} {shape}``: ``PaddedQuantKVRows`` at 8 and 4 bits, the plain ``PaddedKVRows``
  on the same bf16 tokens, and an MLX copy / ``numpy.copyto`` of the quantized bytes;
* ``attention {shape}``: bf16 / 8-bit / 4-bit, ``kvrows.optimized.attend`` and mlx-lm's
  kernels on the same planes.

Checks: quantized codes reconstruct their input, rows hold exactly the quantized tokens,
attention matches a NumPy computation. Shapes: ``CI_AFFINE``, full ``FULL_AFFINE``.
"""

from __future__ import annotations

from typing import Any

import pytest
from bench_common import FULL, latest, measure

from kvrows.app.bench.affine import (
    AFFINE_BITS,
    AFFINE_OPERATIONS,
    ATTENTION_IMPLEMENTATIONS,
    ATTENTION_STORAGES,
    CI_AFFINE,
    FULL_AFFINE,
    QUANTIZE_IMPLEMENTATIONS,
    AffineShapeBench,
    AttentionBench,
    QuantizeBench,
)
from kvrows.app.bench.plain import Shape, ShapeBench

SHAPES = FULL_AFFINE if FULL else CI_AFFINE


@pytest.mark.parametrize("impl", QUANTIZE_IMPLEMENTATIONS)
@pytest.mark.parametrize("bits", AFFINE_BITS)
def test_quantize_throughput(benchmark: Any, bits: int, impl: str) -> None:
    workload = latest("quantize", lambda: QuantizeBench(SHAPES.quantize)).workload(impl, bits)
    measure(benchmark, workload, f"quantize {bits}-bit {SHAPES.quantize.label}")


# Shape-major order, so one shape's generated data serves all its tests.
ROW_CASES = [
    pytest.param(shape, op, impl, bits, id=f"{op}-B{shape.batch}-L{shape.tokens}-{impl}{bits}")
    for shape in SHAPES.rows
    for op in AFFINE_OPERATIONS
    for bits, impl in [
        (0, "plain"),
        *((b, i) for b in AFFINE_BITS for i in ("affine", "copy", "memcpy")),
    ]
]


def _row_benches(shape: Shape) -> tuple[ShapeBench, dict[int, AffineShapeBench]]:
    """The plain bench and the affine benches of ``shape``, sharing one data set."""
    plain = ShapeBench(shape)
    return plain, {bits: AffineShapeBench(shape, bits, data=plain.data) for bits in AFFINE_BITS}


@pytest.mark.parametrize(("shape", "op", "impl", "bits"), ROW_CASES)
def test_affine_row_operation(benchmark: Any, shape: Shape, op: str, impl: str, bits: int) -> None:
    plain, affine = latest(("rows", shape), lambda: _row_benches(shape))
    workload = plain.workload(op, "kvrows") if impl == "plain" else affine[bits].workload(op, impl)
    measure(benchmark, workload, f"{op} {shape.label}")


@pytest.mark.parametrize("impl", ATTENTION_IMPLEMENTATIONS)
@pytest.mark.parametrize("storage", ATTENTION_STORAGES)
def test_decode_attention(benchmark: Any, storage: str, impl: str) -> None:
    workload = latest("attention", lambda: AttentionBench(SHAPES.attention)).workload(storage, impl)
    measure(benchmark, workload, f"attention {SHAPES.attention.label}")
