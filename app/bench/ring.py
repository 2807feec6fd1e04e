"""Benchmarks of the sliding-window family (issue 4) against mlx-lm and a plain copy.

Shared by ``kvrows bench --family rotating`` and
``benchmarks/test_bench_ring.py``; built on :mod:`kvrows.app.bench.plain` (its workloads,
copy/memcpy baselines and result checks).

``kvrows.optimized.BatchedRotatingCache`` against mlx-lm's ``BatchRotatingKVCache``
(window ``W``; one layer, 8 KV heads, head dim 128, float16; ``T`` = bytes of one
token's K and V). A row's source is a serial ring (kvrows ``RotatingKVCache``, mlx-lm
``RotatingKVCache``) fed its ``L`` tokens as one block followed by
:data:`RING_STEPS` single-token steps, so a source longer than the window has
wrapped (its ring index is not at the end of its buffer). A row holds its newest
``min(L, W)`` tokens.

The operations are the plain family's (:mod:`kvrows.app.bench.plain`) but ``merge-step``;
what each moves: :data:`NOTES`, printed under the table.

Checks read each layout's raw ring (physical buffer, write index, wrapped flag, per-row
left padding and positions) back into temporal order and compare every row with the
newest ``min(tokens, W)`` generated tokens it should hold; attention is checked against
a float32 NumPy attention over the window. Copy baselines as in :mod:`kvrows.app.bench.plain`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvrows.optimized as optimized
from kvrows.app.bench.plain import KvrowsImpl, MlxLmImpl, Shape, ShapeBench
from kvrows.app.bench.runner import (
    NP,
    Case,
    Family,
    Line,
    Table,
    parity_verdict,
    to_numpy,
)

# mlx-lm's cache module, untyped: reached through Any.
lm_cache: Any = importlib.import_module("mlx_lm.models.cache")

__all__ = [
    "CI_RING_SHAPES",
    "FULL_RING_SHAPES",
    "RING_IMPLEMENTATIONS",
    "RING_OPERATIONS",
    "RingShape",
    "RingShapeBench",
    "family",
    "ring_rows",
]


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
    def cells(self) -> Line:
        return {**super().cells, "W": str(self.window)}

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
    keys: NP,
    values: NP,
    pads: Sequence[int],
    offsets: Sequence[int],
    index: int,
    rotated: bool,
    window: int,
) -> list[tuple[NP, NP]]:
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


def _kvrows_rows(window: int) -> Callable[[Any], list[tuple[NP, NP]]]:
    def read(batch: Any) -> list[tuple[NP, NP]]:
        keys, values = (to_numpy(x) for x in batch.fetch())
        index, _, rotated = batch.ring_state
        return ring_rows(keys, values, batch.left_pad, batch.row_offsets, index, rotated, window)

    return read


def _mlx_lm_rows(window: int) -> Callable[[Any], list[tuple[NP, NP]]]:
    def read(batch: Any) -> list[tuple[NP, NP]]:
        visible = min(int(batch._offset), int(batch.keys.shape[2]))
        keys = to_numpy(batch.keys[:, :, :visible])
        values = to_numpy(batch.values[:, :, :visible])
        pads = [int(p) for p in batch.left_padding.tolist()]
        offsets = [int(o) for o in batch.offset.tolist()]
        index, rotated = int(batch._idx), bool(batch.rotated)
        return ring_rows(keys, values, pads, offsets, index, rotated, window)

    return read


class RingShapeBench(ShapeBench):
    """The ring workloads of one shape (window ``shape.window``)."""

    operations = RING_OPERATIONS
    implementations = RING_IMPLEMENTATIONS

    def __init__(self, shape: RingShape) -> None:
        self.window = shape.window
        w = shape.window
        self.impls = {
            # ``kvrows.optimized``'s ``RotatingKVCache`` / ``BatchedRotatingCache``.
            "kvrows": KvrowsImpl(
                make_serial=lambda: optimized.RotatingKVCache(w),
                make_batch=lambda: optimized.BatchedRotatingCache(w),
                feed=_feed,
                read_rows=_kvrows_rows(w),
            ),
            # mlx-lm's ``RotatingKVCache`` / ``BatchRotatingKVCache``.
            "mlx-lm": MlxLmImpl(
                make_serial=lambda: lm_cache.RotatingKVCache(w),
                make_batch=lambda: lm_cache.BatchRotatingKVCache,
                feed=_feed,
                read_rows=_mlx_lm_rows(w),
            ),
        }
        super().__init__(shape)

    def _held(self, tokens: int) -> int:
        return min(tokens, self.window)


NOTES = """\
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


def family(*, quick: bool = False, shapes: Sequence[RingShape] | None = None) -> Family:
    """The rotating family's table: every operation at every shape."""
    chosen = (
        tuple(shapes) if shapes is not None else QUICK_RING_SHAPES if quick else FULL_RING_SHAPES
    )

    def cases() -> Iterator[Case]:
        for shape in chosen:
            yield from RingShapeBench(shape).cases()

    return Family(
        "rotating",
        "one layer",
        [Table(cases())],
        NOTES.format(steps=RING_STEPS),
        parity_verdict,
    )
