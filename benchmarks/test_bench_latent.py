"""pytest-benchmark: the latent caches' row operations, kvrows vs mlx-lm (the method:
``bench_common``).

Operations on a batch of ``B`` rows of lengths ``L`` down to ``L / 2`` (bf16, DeepSeek-V3's
512 latent + 64 rope per token): ``merge`` (B serial rows into one right-justified
batch), ``filter-half`` (keep every other row, drop the common padding), ``extract``
(one compact row), ``append`` (one decode token for every row), ``rollback`` (a 4-token
verify block kept 1..4 per row: rows roll, kvrows only). Implementations: ``mla``
(``kvrows.optimized.MLACache``), ``encoded`` (``EncodedLatentCache``, affine 8-bit group
64), ``mlx-lm`` (``BatchKVCache`` holding the latent as keys and the rope as values, as
``deepseek_v32`` does); each run checks the rows. Full shapes: B in {4, 16}, L in
{1024, 4096}.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import pytest
from bench_common import FULL, ROUNDS, WARMUPS

from kvrows.optimized import EncodedLatentCache, MLACache
from kvrows.schemes import Affine

SHAPES = [(4, 1024), (16, 1024), (4, 4096), (16, 4096)] if FULL else [(3, 32)]
RANK, ROPE = 512, 64
OPERATIONS = ("merge", "filter-half", "extract", "append", "rollback")
IMPLEMENTATIONS = ("mla", "encoded", "mlx-lm")


@pytest.fixture(autouse=True)
def _cpu() -> Iterator[None]:
    with mx.stream(mx.cpu):
        yield


def _lengths(batch: int, tokens: int) -> list[int]:
    return [tokens - (tokens // 2) * b // max(1, batch - 1) for b in range(batch)]


def _blocks(length: int, seed: int) -> tuple[mx.array, mx.array]:
    key = mx.random.key(seed)
    latent = mx.random.normal((1, 1, length, RANK), key=key).astype(mx.bfloat16)
    rope = mx.random.normal((1, 1, length, ROPE), key=key).astype(mx.bfloat16)
    mx.eval(latent, rope)
    return latent, rope


def _serial(impl: str, latent: mx.array, rope: mx.array) -> Any:
    if impl == "mlx-lm":
        from mlx_lm.models import cache as peer

        serial: Any = peer.KVCache
        cache: Any = serial()
    elif impl == "mla":
        cache = MLACache()
    else:
        cache = EncodedLatentCache(codec=Affine(bits=8, group_size=64))
    cache.update_and_fetch(latent, rope)
    mx.eval(*(cache.state if impl == "mlx-lm" else cache.held_arrays()))
    return cache


def _merge(impl: str, rows: list[Any]) -> Any:
    if impl == "mlx-lm":
        from mlx_lm.models import cache as peer

        batch: Any = peer.BatchKVCache
        merged: Any = batch.merge(rows)
        mx.eval(merged.keys, merged.values)
        return merged
    layout = rows[0].make_empty_batch()
    layout.merge_rows(rows)
    return layout


def _workload(impl: str, op: str, batch: int, tokens: int) -> tuple[Callable[[], Any], Any]:
    """``(setup, run)``: setup builds fresh inputs (untimed); run does the operation."""
    lengths = _lengths(batch, tokens)
    data = [_blocks(n, seed) for seed, n in enumerate(lengths)]

    def rows() -> list[Any]:
        return [_serial(impl, *d) for d in data]

    if op == "merge":
        return rows, lambda r: _merge(impl, r)
    if op == "filter-half":
        keep = list(range(0, batch, 2))

        def filter_half(layout: Any) -> Any:
            if impl == "mlx-lm":
                layout.filter(mx.array(keep))
                mx.eval(layout.keys, layout.values)
            else:
                layout.filter_rows(keep)
            return layout

        return lambda: _merge(impl, rows()), filter_half
    if op == "extract":

        def extract(layout: Any) -> Any:
            row = layout.extract(batch - 1) if impl == "mlx-lm" else layout.extract_row(batch - 1)
            mx.eval(row.state if impl == "mlx-lm" else row.held_arrays())
            return row

        return lambda: _merge(impl, rows()), extract
    step = (
        mx.zeros((batch, 1, 4 if op == "rollback" else 1, RANK), mx.bfloat16),
        mx.zeros((batch, 1, 4 if op == "rollback" else 1, ROPE), mx.bfloat16),
    )
    if op == "append":

        def append(layout: Any) -> Any:
            mx.eval(*layout.update_and_fetch(*step))
            return layout

        return lambda: _merge(impl, rows()), append

    def rollback(layout: Any) -> Any:
        layout.spec_round_begin()
        layout.update_and_fetch(*step)
        layout.spec_round_rollback([1 + b % 4 for b in range(batch)])
        return layout

    return lambda: _merge(impl, rows()), rollback


def _check(impl: str, op: str, result: Any, batch: int, tokens: int) -> None:
    lengths = _lengths(batch, tokens)
    if op == "merge":
        expected = lengths
    elif op == "filter-half":
        expected = lengths[::2]
    elif op == "extract":
        expected = [lengths[-1]]
    elif op == "append":
        expected = [n + 1 for n in lengths]
    else:
        expected = [n + 1 + b % 4 for b, n in enumerate(lengths)]
    if impl == "mlx-lm":
        got = [int(v) for v in (result.offset.tolist() if op != "extract" else [result.offset])]
    else:
        got = list(result.row_offsets)
    assert got == expected
    if op == "merge":  # the shortest row's newest latent is the input's, at its column
        latent = result.keys if impl == "mlx-lm" else result.current()[0]
        width = max(lengths)
        want = _blocks(lengths[-1], batch - 1)[0]
        held = latent[batch - 1 : batch, :, width - lengths[-1] : width]
        if impl == "encoded":
            assert float(mx.abs(held.astype(mx.float32) - want.astype(mx.float32)).max()) < 0.1
        else:
            assert bool(mx.array_equal(held, want).item())


CASES = [
    pytest.param(shape, op, impl, id=f"{op}-B{shape[0]}-L{shape[1]}-{impl}")
    for shape in SHAPES
    for op in OPERATIONS
    for impl in IMPLEMENTATIONS
    if not (op == "rollback" and impl == "mlx-lm")  # mlx-lm has no per-row rollback
]


@pytest.mark.parametrize(("shape", "op", "impl"), CASES)
def test_latent_row_operation(benchmark: Any, shape: tuple[int, int], op: str, impl: str) -> None:
    batch, tokens = shape
    setup, run = _workload(impl, op, batch, tokens)
    benchmark.group = f"latent {op} B{batch} L{tokens}"
    result = benchmark.pedantic(
        run, setup=lambda: ((setup(),), {}), rounds=ROUNDS, warmup_rounds=WARMUPS, iterations=1
    )
    _check(impl, op, result, batch, tokens)
