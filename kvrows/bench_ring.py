"""Benchmarks of the sliding-window family (issue 4) against mlx-lm and a plain copy.

Shared by ``kvrows bench --family rotating`` (:func:`run_ring_bench`) and
``benchmarks/test_bench_ring.py``; built on :mod:`kvrows.bench` (its workloads,
interleaved timing, copy/memcpy baselines and result checks).

``kvrows.optimized.BatchedRotatingCache`` against mlx-lm's ``BatchRotatingKVCache``
(window ``W``; one layer, 8 KV heads, head dim 128, float16; ``T`` = bytes of one
token's K and V). A row's source is a serial ring (kvrows ``RotatingKVCache``, mlx-lm
``RotatingKVCache``) fed its ``L`` tokens as one block followed by
:data:`RING_STEPS` single-token steps, so a source longer than the window has
wrapped (its ring index is not at the end of its buffer). A row holds its newest
``min(L, W)`` tokens.

* ``merge``: a batch of ``B`` rows from ``B`` serial rings. Bytes: ``2·B·min(L, W)·T``.
* ``join``: one new row joins a live batch (merged, then one decode step, so at
  ``L >= W`` the live ring has wrapped); mlx-lm: ``extend`` with a one-row
  ``BatchRotatingKVCache``. Bytes: ``2·min(L, W)·T`` (only the new row has to move).
* ``filter-half`` (keep the odd rows), ``filter-one`` (drop row 0). Bytes:
  ``2·kept·min(L + 1, W)·T``.
* ``extract``: row ``B//2`` of a live batch as an independent serial ring in temporal
  order. Bytes: ``2·min(L + 1, W)·T``.
* ``update``: ``make_mask(1)`` + ``update_and_fetch`` of one token per row on a live
  ragged batch (rows ``L`` down to about ``L/2``). Bytes: ``B·T``.
* ``decode``: ``make_mask(1)`` + ``update_and_fetch`` + attention of 32 query heads
  (kvrows: ``kvrows.optimized.attend``; mlx-lm: ``mx.fast.scaled_dot_product_attention``
  with its mask) on the same ragged batch. Bytes: ``Σ min(len_b + 2, W)·T + B·T``.

Checks read each layout's raw ring (physical buffer, write index, wrapped flag, per-row
left padding and positions) back into temporal order and compare every row with the
newest ``min(tokens, W)`` generated tokens it should hold; attention is checked against
a float32 NumPy attention over the window. Copy baselines as in :mod:`kvrows.bench`.
"""

from __future__ import annotations

import gc
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import mlx.core as mx
import numpy as np
import numpy.typing as npt

import kvrows.optimized as optimized
from kvrows.bench import (
    PARITY_BAND,
    BenchCheckError,
    KvrowsImpl,
    MlxLmImpl,
    Shape,
    ShapeBench,
    Timing,
    check_equal,
    check_same,
    format_gbps,
    format_ms,
    markdown_table,
    package_version,
    time_workloads,
    to_numpy,
)

# mlx-lm's cache module, untyped: reached through Any.
lm_cache: Any = importlib.import_module("mlx_lm.models.cache")

__all__ = [
    "CI_RING_SHAPES",
    "FULL_RING_SHAPES",
    "QUICK_RING_SHAPES",
    "RING_IMPLEMENTATIONS",
    "RING_OPERATIONS",
    "RING_STEPS",
    "RingShape",
    "RingShapeBench",
    "ring_rows",
    "run_ring_bench",
]

_NP = npt.NDArray[Any]

#: The operations, in table order.
RING_OPERATIONS = ("merge", "join", "filter-half", "filter-one", "extract", "update", "decode")
#: Who performs each operation, in table order.
RING_IMPLEMENTATIONS = ("kvrows", "mlx-lm", "copy", "memcpy")
#: Single-token steps that end each source's feed (after one block of the rest).
RING_STEPS = 10


@dataclass(frozen=True)
class RingShape(Shape):
    """A benchmark shape with the ring's window."""

    window: int = 4096

    @property
    def label(self) -> str:
        return f"B={self.batch} L={self.tokens} W={self.window}"


#: The realistic shapes of the issue: rows shorter than the window and rows that wrapped.
FULL_RING_SHAPES = tuple(RingShape(b, t, window=4096) for b in (4, 16) for t in (2000, 6000))
#: ``kvrows bench --family rotating --quick``: a smoke run (rows longer than the window).
QUICK_RING_SHAPES = (RingShape(4, 96, window=64),)
#: ``benchmarks/`` without ``KVROWS_BENCH_FULL=1``: small, odd sizes, wrapped and not.
CI_RING_SHAPES = (RingShape(4, 100, window=64), RingShape(3, 40, window=64))


def ring_rows(
    keys: _NP,
    values: _NP,
    pads: Sequence[int],
    offsets: Sequence[int],
    index: int,
    rotated: bool,
    window: int,
) -> list[tuple[_NP, _NP]]:
    """Every row's held tokens in temporal order, from a shared-column ring's raw state.

    ``keys``/``values`` ``[B, H, columns, D]`` are the physical buffer; when the ring has
    wrapped (``rotated``), column ``index`` is the oldest, otherwise columns
    ``[0, index)`` are in order. Row ``b`` starts ``pads[b]`` columns into the temporal
    order (negative once the ring overwrote its padding) and holds at most
    ``min(offsets[b], window)`` tokens, the newest.
    """
    if rotated:
        keys = np.concatenate([keys[:, :, index:], keys[:, :, :index]], axis=2)
        values = np.concatenate([values[:, :, index:], values[:, :, :index]], axis=2)
    else:
        keys, values = keys[:, :, :index], values[:, :, :index]
    active = keys.shape[2]
    rows = []
    for b, (pad, offset) in enumerate(zip(pads, offsets, strict=True)):
        start = max(0, pad, active - min(offset, window))
        rows.append((keys[b, :, start:], values[b, :, start:]))
    return rows


def _feed(cache: Any, keys: Any, values: Any) -> None:
    """A source's tokens: one block, then up to :data:`RING_STEPS` single-token steps."""
    n = int(keys.shape[2])
    steps = min(RING_STEPS, n - 1)
    if n - steps:
        cache.update_and_fetch(keys[:, :, : n - steps], values[:, :, : n - steps])
    for j in range(n - steps, n):
        cache.update_and_fetch(keys[:, :, j : j + 1], values[:, :, j : j + 1])


class _RingKvrows(KvrowsImpl):
    """``kvrows.optimized``'s ``RotatingKVCache`` / ``BatchedRotatingCache``."""

    def __init__(self, window: int) -> None:
        self.window = window

    def serial(self, keys: Any, values: Any) -> Any:
        cache = optimized.RotatingKVCache(self.window)
        _feed(cache, keys, values)
        self.sync(cache.state)
        return cache

    def merge(self, rows: Sequence[Any]) -> Any:
        layout = optimized.BatchedRotatingCache(self.window)
        layout.merge_rows(rows)
        self.sync(layout.state)
        return layout

    def rows(self, batch: Any) -> list[tuple[_NP, _NP]]:
        keys, values = (to_numpy(x) for x in batch.fetch())
        index, _, rotated = batch.ring_state
        return ring_rows(
            keys, values, batch.left_pad, batch.row_offsets, index, rotated, self.window
        )


class _RingMlxLm(MlxLmImpl):
    """mlx-lm's ``RotatingKVCache`` / ``BatchRotatingKVCache``."""

    def __init__(self, window: int) -> None:
        self.window = window

    def serial(self, keys: Any, values: Any) -> Any:
        cache = lm_cache.RotatingKVCache(self.window)
        _feed(cache, keys, values)
        self.sync(cache.keys, cache.values)
        return cache

    def merge(self, rows: Sequence[Any]) -> Any:
        batch = lm_cache.BatchRotatingKVCache.merge(list(rows))
        self.sync(*self.batch_state(batch))
        return batch

    def rows(self, batch: Any) -> list[tuple[_NP, _NP]]:
        visible = min(int(batch._offset), int(batch.keys.shape[2]))
        keys = to_numpy(batch.keys[:, :, :visible])
        values = to_numpy(batch.values[:, :, :visible])
        pads = [int(p) for p in batch.left_padding.tolist()]
        offsets = [int(o) for o in batch.offset.tolist()]
        return ring_rows(
            keys, values, pads, offsets, int(batch._idx), bool(batch.rotated), self.window
        )


class RingShapeBench(ShapeBench):
    """The ring workloads of one shape (window ``shape.window``)."""

    operations = RING_OPERATIONS
    implementations = RING_IMPLEMENTATIONS

    def __init__(self, shape: RingShape) -> None:
        self.window = shape.window
        self.impls = {"kvrows": _RingKvrows(shape.window), "mlx-lm": _RingMlxLm(shape.window)}
        super().__init__(shape)

    def _held(self, tokens: int) -> int:
        return min(tokens, self.window)

    def bytes_moved(self, op: str) -> int:
        s = self.shape
        t = self.token_bytes
        if op == "merge":
            return 2 * s.batch * self._held(s.tokens) * t
        if op == "join":
            return 2 * self._held(s.tokens) * t
        if op in ("filter-half", "filter-one"):
            return 2 * len(self.keep(op)) * self._held(s.tokens + 1) * t
        if op == "extract":
            return 2 * self._held(s.tokens + 1) * t
        if op == "update":
            return s.batch * t
        if op == "decode":
            return sum(self._held(n + 2) for n in s.ragged) * t + s.batch * t
        raise ValueError(f"unknown operation {op!r}")

    def _expected_row(self, row: int, tokens: int, steps: int) -> tuple[_NP, _NP]:
        """The newest ``min(tokens + steps, W)`` of the row's tokens and step tokens."""
        keys, values = super()._expected_row(row, tokens, steps)
        keep = self._held(tokens + steps)
        return keys[:, keys.shape[1] - keep :], values[:, values.shape[1] - keep :]

    def _merge(self, impl: Any) -> ShapeBench._Parts:
        setup, run, _ = super()._merge(impl)

        def check(batch: Any) -> None:
            held = impl.rows(batch)
            check_equal("merge: row count", len(held), self.shape.batch)
            for b, (k, v) in enumerate(held):
                expected_k, expected_v = self._expected_row(b, self.shape.tokens, 0)
                check_same(f"merge: row {b} keys", k, expected_k)
                check_same(f"merge: row {b} values", v, expected_v)

        return setup, run, check

    def _join(self, impl: Any) -> ShapeBench._Parts:
        setup, run, _ = super()._join(impl)
        keep = self._held(self.shape.tokens)

        def check(batch: Any) -> None:
            held = impl.rows(batch)
            self._check_rows(held[:-1], range(self.shape.batch), "join")
            check_same("join: new row keys", held[-1][0], self.data.np("join_keys")[0, :, -keep:])
            check_same(
                "join: new row values", held[-1][1], self.data.np("join_values")[0, :, -keep:]
            )

        return setup, run, check


# -- the run ------------------------------------------------------------------------------

_COLUMNS = (
    "op",
    "B",
    "L",
    "W",
    "kvrows ms",
    "mlx-lm ms",
    "ratio",
    "copy ms",
    "memcpy ms",
    "MB moved",
    "GB/s kvrows",
    "GB/s mlx-lm",
    "GB/s copy",
)


@dataclass
class _Line:
    op: str
    shape: RingShape
    bytes_moved: int
    timings: dict[str, Timing]

    def ms(self, impl: str) -> float | None:
        timing = self.timings.get(impl)
        return None if timing is None else timing.ms

    def cells(self) -> list[str]:
        kv, lm = self.ms("kvrows"), self.ms("mlx-lm")
        return [
            self.op,
            str(self.shape.batch),
            str(self.shape.tokens),
            str(self.shape.window),
            format_ms(kv),
            format_ms(lm),
            f"{lm / kv:.2f}" if kv and lm else "-",
            format_ms(self.ms("copy")),
            format_ms(self.ms("memcpy")),
            f"{self.bytes_moved / 1e6:.1f}",
            format_gbps(self.bytes_moved, kv),
            format_gbps(self.bytes_moved, lm),
            format_gbps(self.bytes_moved, self.ms("copy")),
        ]


def _verdict(lines: Sequence[_Line]) -> list[str]:
    """Where kvrows is slower than mlx-lm in this run (information, never an exit status)."""
    misses: list[str] = []
    parity: list[str] = []
    for line in lines:
        kv, lm = line.ms("kvrows"), line.ms("mlx-lm")
        if kv and lm and lm / kv < 1:
            entry = f"{line.op} {line.shape.label} ({lm / kv:.2f}x)"
            (parity if lm / kv >= 1 - PARITY_BAND else misses).append(entry)
    verdict = [
        "every operation at least as fast as mlx-lm: "
        + ("yes" if not misses else "no; slower at " + ", ".join(misses))
    ]
    if parity:
        verdict.append(f"  within {PARITY_BAND:.0%} (noise) below parity: " + ", ".join(parity))
    return verdict


_NOTES = """\
ratio = mlx-lm ms / kvrows ms (> 1: kvrows faster). GB/s = MB moved / time.
kvrows = BatchedRotatingCache (window W), mlx-lm = BatchRotatingKVCache (join = extend).
sources: serial rings fed L-{steps} tokens as one block, then {steps} single-token steps
  (L > W: the source has wrapped); a row holds its newest min(L, W) tokens.
MB moved (T = one token's K+V bytes): merge 2*B*min(L,W)*T; join 2*min(L,W)*T (the new row);
  filter-half / filter-one 2*kept*min(L+1,W)*T; extract 2*min(L+1,W)*T; update B*T;
  decode sum(min(len_b+2, W))*T + B*T (the window attention reads, plus the new tokens).
live batch (join, filter, extract): merged from B rows, then one decode step (L >= W: wrapped).
update / decode: ragged rows (L down to about L/2), make_mask(1) + update_and_fetch
  (+ attention of 32 query heads over 8 KV heads for decode).
copy: MLX concatenate of MB moved / 2; memcpy: numpy.copyto of the same, pre-touched."""


def run_ring_bench(
    quick: bool = False,
    repeats: int | None = None,
    *,
    shapes: Sequence[RingShape] | None = None,
    out: TextIO | None = None,
) -> int:
    """Time every operation at every shape, print the table; 0 unless a result was wrong."""
    stream = out if out is not None else sys.stdout
    chosen = (
        tuple(shapes) if shapes is not None else QUICK_RING_SHAPES if quick else FULL_RING_SHAPES
    )
    timed = repeats if repeats is not None else 2 if quick else 7
    if timed < 1:
        raise ValueError(f"repeats must be >= 1, got {timed}")
    warmups = 1 if quick else 2
    print(
        f"kvrows bench: rotating family, one layer, mlx {package_version('mlx')}, "
        f"mlx-lm {package_version('mlx-lm')}, on {mx.default_device()}; "
        f"median of {timed} after {warmups} warm-up(s)",
        file=stream,
        flush=True,
    )
    lines: list[_Line] = []
    failures: list[str] = []
    for shape in chosen:
        bench = RingShapeBench(shape)
        for op in RING_OPERATIONS:
            if not quick:
                print(f"  {shape.label} {op}", file=sys.stderr, flush=True)
            outcomes = time_workloads(
                [bench.workload(op, impl) for impl in RING_IMPLEMENTATIONS],
                repeats=[timed] * len(RING_IMPLEMENTATIONS),
                warmups=warmups,
            )
            timings: dict[str, Timing] = {}
            for impl, outcome in zip(RING_IMPLEMENTATIONS, outcomes, strict=True):
                if isinstance(outcome, BenchCheckError):
                    failures.append(f"{op} {shape.label} {impl}: {outcome}")
                    timings[impl] = Timing(None, "wrong")
                else:
                    timings[impl] = Timing(outcome)
            lines.append(_Line(op, shape, bench.bytes_moved(op), timings))
            bench.release()
        del bench
        gc.collect()
        mx.clear_cache()
    print(markdown_table(_COLUMNS, [line.cells() for line in lines]), file=stream)
    print(_NOTES.format(steps=RING_STEPS), file=stream)
    for verdict in _verdict(lines):
        print(verdict, file=stream)
    for failure in failures:
        print(f"WRONG RESULT: {failure}", file=stream)
    stream.flush()
    return 1 if failures else 0
