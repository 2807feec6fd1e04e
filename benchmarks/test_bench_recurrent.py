"""pytest-benchmark: recurrent rows (issue 14): merge, filter, extract, a verify round
(the method: ``bench_common``).

``BatchedSSMCache`` (optimized) next to mlx-lm's ``ArraysCache`` doing the same row
operation on the same planes, and a verify round of ``d + 1`` tokens through the gated
DeltaNet layer: commit (the snapshot is dropped) vs an unequal rollback (snapshot restored,
the accepted prefix replayed) vs the forward alone. Checks: rows equal their sources, the
rollback's planes equal a run over the accepted tokens only. Full shape: one Qwen3-Next
linear-attention layer (conv ``(3, 8192)`` bf16, state ``(32, 128, 128)`` float32: 2.05 MiB
per row) at B = 8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as mlx_lm_cache
import pytest
from bench_common import FULL

from kvrows.optimized.recurrent import (
    BatchedSSMCache,
    GatedDeltaParams,
    SSMCache,
    gated_delta_forward,
)

peer: Any = mlx_lm_cache  # mlx-lm is untyped


ROUNDS, WARMUPS = (7, 2) if FULL else (2, 0)


@dataclass(frozen=True)
class Shape:
    rows: int
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int
    kernel: int = 4

    @property
    def channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


SHAPE = Shape(8, 16, 128, 32, 128) if FULL else Shape(4, 1, 32, 2, 16)


def _params(shape: Shape) -> GatedDeltaParams:
    key = mx.random.key(0)
    w = mx.random.normal((shape.channels, shape.kernel), key=key) * 0.5
    dims = (shape.key_heads, shape.key_dim, shape.value_heads, shape.value_dim)
    return GatedDeltaParams(w, mx.zeros(shape.value_heads), mx.zeros(shape.value_heads), *dims)


def _inputs(shape: Shape, rows: int, n: int, seed: int) -> tuple[mx.array, ...]:
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    qkv = mx.random.normal((rows, n, shape.channels), key=k1).astype(mx.bfloat16)
    a = mx.random.normal((rows, n, shape.value_heads), key=k2).astype(mx.bfloat16)
    b = mx.random.normal((rows, n, shape.value_heads), key=k3).astype(mx.bfloat16)
    return qkv, a, b


def _serial_rows(shape: Shape, params: GatedDeltaParams) -> list[SSMCache]:
    rows = []
    for r in range(shape.rows):
        cache = SSMCache()
        gated_delta_forward(params, cache, *_inputs(shape, 1, 3 + r, r))
        rows.append(cache)
    return rows


def _peer_of(cache: SSMCache) -> Any:
    twin = peer.ArraysCache(2)
    twin[0], twin[1] = cache[0], cache[1]
    return twin


def _same(a: mx.array, b: mx.array) -> bool:
    return bool(mx.array_equal(a, b).item())


@pytest.fixture(scope="module")
def world() -> dict[str, Any]:
    params = _params(SHAPE)
    rows = _serial_rows(SHAPE, params)
    return {"params": params, "rows": rows, "peers": [_peer_of(r) for r in rows]}


def _pedantic(benchmark: Any, group: str, run: Any, setup: Any) -> Any:
    benchmark.group = f"{group} B={SHAPE.rows}"
    return benchmark.pedantic(run, setup=setup, rounds=ROUNDS, warmup_rounds=WARMUPS, iterations=1)


@pytest.mark.parametrize("who", ["kvrows", "mlx-lm"])
def test_merge(benchmark: Any, world: dict[str, Any], who: str) -> None:
    def run() -> Any:
        if who == "kvrows":
            layout = BatchedSSMCache()
            layout.merge_rows(world["rows"])
        else:
            layout = peer.ArraysCache.merge(world["peers"])
        mx.eval(layout[0], layout[1])
        return layout

    layout = _pedantic(benchmark, "merge", run, None)
    for b, row in enumerate(world["rows"]):
        assert _same(layout[1][b : b + 1], row[1]) and _same(layout[0][b : b + 1], row[0])


@pytest.mark.parametrize("who", ["kvrows", "mlx-lm"])
@pytest.mark.parametrize("op", ["filter", "extract"])
def test_filter_and_extract(benchmark: Any, world: dict[str, Any], who: str, op: str) -> None:
    keep = list(range(1, SHAPE.rows))  # the longest row (the last) leaves, in reverse order
    keep.reverse()

    def setup() -> tuple[tuple[Any], dict[str, Any]]:
        if who == "kvrows":
            layout: Any = BatchedSSMCache()
            layout.merge_rows(world["rows"])
        else:
            layout = peer.ArraysCache.merge(world["peers"])
        mx.eval(layout[0], layout[1])
        return (layout,), {}

    def run(layout: Any) -> Any:
        if op == "filter":
            layout.filter(mx.array(keep) if who == "mlx-lm" else keep)
            mx.eval(layout[0], layout[1])
            return layout
        row = layout.extract(SHAPE.rows - 1)
        mx.eval(row[0], row[1])
        return row

    out = _pedantic(benchmark, op, run, setup)
    if op == "filter":
        for position, b in enumerate(keep):
            assert _same(out[1][position : position + 1], world["rows"][b][1])
    else:
        assert _same(out[1], world["rows"][-1][1])


@pytest.mark.parametrize("outcome", ["forward only", "commit", "rollback"])
def test_verify_round(benchmark: Any, world: dict[str, Any], outcome: str) -> None:
    """A round of d + 1 = 4 tokens per row; the rollback keeps 1..4 tokens per row."""
    params = world["params"]
    block = _inputs(SHAPE, SHAPE.rows, 4, 99)
    keep = [1 + b % 4 for b in range(SHAPE.rows)]

    def setup() -> tuple[tuple[Any], dict[str, Any]]:
        layout = BatchedSSMCache()
        layout.merge_rows(world["rows"])
        return (layout,), {}

    def run(layout: BatchedSSMCache) -> BatchedSSMCache:
        if outcome != "forward only":
            layout.spec_round_begin()
        gated_delta_forward(params, layout, *block)
        if outcome == "commit":
            layout.spec_round_commit()
        elif outcome == "rollback":
            layout.spec_round_rollback(keep)
        mx.eval(layout[0], layout[1])
        return layout

    layout = _pedantic(benchmark, "verify round", run, setup)
    if outcome == "rollback":  # the accepted-only run, row by row
        for b, row in enumerate(world["rows"]):
            solo = SSMCache()
            solo[0], solo[1] = row[0], row[1]
            solo.advance(0)
            gated_delta_forward(params, solo, *(x[b : b + 1, : keep[b]] for x in block))
            assert _same(layout.extract_row(b)[1], solo[1])
    assert layout.row_offsets == tuple(
        r.offset + (keep[b] if outcome == "rollback" else 4) for b, r in enumerate(world["rows"])
    )
