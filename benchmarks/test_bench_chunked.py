"""pytest-benchmark: chunked-local attention's decode steps (issue 25), kvrows vs mlx-lm vs a
copy of the same bytes (the method: ``bench_common``).

A decode step is one single-token ``update_and_fetch`` and one query's attention over
what it returns (``mx.fast.scaled_dot_product_attention``, no mask: the cost of reading
the held keys and values): what llama4's chunked layers do per generated token. ``serial``: kvrows ``ChunkedKVCache``
against mlx-lm's ``ChunkedKVCache`` (``maybe_trim_front`` first, as llama4 calls it) on one
row; ``batch``: kvrows ``BatchedChunkedKVCache`` over ``B`` rows against mlx-lm's
``BatchKVCache`` (mlx-lm has no batched chunked cache: a full-attention batch that reads
every token is what a server would otherwise run) and a copy of the bytes the kvrows step
reads (``mx.concatenate`` of those keys and values). Checks: kvrows' serial read equals mlx-lm's bit for bit; every batch row reads its
newest ``min(L, C) + 1`` tokens. CI shapes: C 16, L 40; full: C 8192 (llama4's),
L 12288, B in {1, 8}, 8 KV heads, head dim 128, float16.

    KVROWS_BENCH_FULL=1 .venv/bin/pytest benchmarks/test_bench_chunked.py --benchmark-enable
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from bench_common import FULL, latest, measure

import kvrows.optimized as kv
from kvrows.app.bench.runner import BenchCheckError, Workload

lm_cache: Any = importlib.import_module("mlx_lm.models.cache")

HEADS, DIM, DTYPE = 8, 128, mx.float16
STEPS = 8  # decode steps per timed call


@dataclass(frozen=True)
class ChunkShape:
    batch: int
    tokens: int
    chunk: int

    @property
    def label(self) -> str:
        return f"B={self.batch} L={self.tokens} C={self.chunk}"


SHAPES = (
    tuple(ChunkShape(b, 12288, 8192) for b in (1, 8))
    if FULL
    else (ChunkShape(1, 40, 16), ChunkShape(3, 40, 16))
)


class ChunkBench:
    """One shape's prompt and decode tokens, shared by its workloads."""

    def __init__(self, shape: ChunkShape) -> None:
        self.shape = shape
        rng = np.random.default_rng(shape.tokens + shape.batch)
        total = shape.tokens + STEPS

        def tokens(rows: int) -> mx.array:
            return mx.array(rng.standard_normal((rows, HEADS, total, DIM)), DTYPE)

        self.keys, self.values = tokens(shape.batch), tokens(shape.batch)
        mx.eval(self.keys, self.values)
        self.held = min(shape.tokens, shape.chunk) + 1  # keys a step reads
        self.step_bytes = 2 * shape.batch * HEADS * self.held * DIM * 2

    def _prefill(self, cache: Any, trim: bool = False) -> Any:
        end = self.shape.tokens
        if trim:
            cache.maybe_trim_front()
        cache.update_and_fetch(self.keys[..., :end, :], self.values[..., :end, :])
        mx.eval(*_arrays(cache))
        return cache

    def _steps(self, cache: Any, trim: bool = False) -> Any:
        start, read = self.shape.tokens, None
        query = mx.zeros((self.shape.batch, HEADS, 1, DIM), DTYPE)
        for i in range(start, start + STEPS):
            if trim:
                cache.maybe_trim_front()
            read = cache.update_and_fetch(
                self.keys[..., i : i + 1, :], self.values[..., i : i + 1, :]
            )
            keys, values = read
            out = mx.fast.scaled_dot_product_attention(query, keys, values, scale=DIM**-0.5)
            mx.eval(out)
        return read

    def workload(self, op: str, impl: str) -> Workload:
        shape, size = self.shape, self.shape.chunk
        serial = op == "serial"
        if impl == "copy":
            held = (shape.batch, HEADS, self.held, DIM)
            source = [mx.ones(held, DTYPE), mx.ones(held, DTYPE)]

            def copies(_: Any) -> Any:
                out = None
                for _step in range(STEPS):
                    out = mx.concatenate(source, axis=2)
                    mx.eval(out)
                return out

            return Workload(op, impl, shape, self.step_bytes * STEPS, lambda: None, copies, _any)
        if impl == "kvrows":
            make = (
                (lambda: kv.ChunkedKVCache(size))
                if serial
                else lambda: _merged(self, kv.BatchedChunkedKVCache(size))
            )
            setup = (lambda: self._prefill(make())) if serial else make
            return Workload(
                op, impl, shape, self.step_bytes * STEPS, setup, self._steps, self._check
            )
        if serial:  # mlx-lm's ChunkedKVCache, trimmed before each step as llama4 does
            setup = lambda: self._prefill(lm_cache.ChunkedKVCache(size), trim=True)  # noqa: E731
            return Workload(
                op, impl, shape, self.step_bytes * STEPS, setup,
                lambda c: self._steps(c, trim=True), self._check,
            )  # fmt: skip
        # mlx-lm's full-attention batch: every token (no chunked batch in mlx-lm).
        setup = lambda: self._prefill(lm_cache.BatchKVCache([0] * shape.batch))  # noqa: E731
        full = 2 * shape.batch * HEADS * (shape.tokens + STEPS) * DIM * 2
        return Workload(op, impl, shape, full * STEPS, setup, self._steps, _any)

    def _check(self, read: Any) -> None:
        keys, _ = read
        keys = keys[0] if isinstance(keys, tuple) else keys
        end = self.shape.tokens + STEPS
        want = self.keys[..., end - self.held : end, :]
        if keys.shape[2] < self.held or not mx.array_equal(keys[..., -self.held :, :], want):
            raise BenchCheckError(f"{self.shape.label}: the step read other keys than the newest")


def _merged(bench: ChunkBench, layout: Any) -> Any:
    rows = []
    for b in range(bench.shape.batch):
        serial = kv.ChunkedKVCache(bench.shape.chunk)
        end = bench.shape.tokens
        serial.update_and_fetch(bench.keys[b : b + 1, :, :end], bench.values[b : b + 1, :, :end])
        rows.append(serial)
    layout.merge_rows(rows)
    mx.eval(*layout.held_arrays())
    return layout


def _arrays(cache: Any) -> list[mx.array]:
    held = getattr(cache, "held_arrays", None)
    if held is not None:
        return list(held())
    return [a for a in (cache.keys, cache.values) if a is not None]


def _any(_: Any) -> None:
    return None


CASES = [
    pytest.param(shape, op, impl, id=f"{op}-B{shape.batch}-L{shape.tokens}-C{shape.chunk}-{impl}")
    for shape in SHAPES
    for op in ("serial", "batch")
    if op == "batch" or shape.batch == 1
    for impl in ("kvrows", "mlx-lm", "copy")
]


@pytest.mark.parametrize(("shape", "op", "impl"), CASES)
def test_chunked_decode(benchmark: Any, shape: ChunkShape, op: str, impl: str) -> None:
    workload = latest(shape, lambda: ChunkBench(shape)).workload(op, impl)
    measure(benchmark, workload, f"{op} decode {shape.label}")
