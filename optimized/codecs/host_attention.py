"""Attention over encoded planes on the CPU backend, in NumPy (``spec/host-attention.md``).

On MLX's CPU backend a float32 matmul at decode shapes runs at 3 GFLOP/s (NumPy's BLAS: about
15) and ``quantized_matmul`` slower still, so scoring on the codes does more work there than
decoding them. On the CPU each encoded codec therefore hands this module a
:data:`~kvrows.optimized.host.RowDecoder` per tensor, and attention runs a few batch rows at a
time: the rows' keys decoded into a cache-sized float32 buffer, scored by one NumPy matmul per
KV head, softmaxed, then the rows' values decoded and summed the same way. No decoded copy of
the whole cache is made. Other backends keep the MLX ops (``quantized_matmul`` on the codes);
:func:`op_attention` makes the CPU take them too (the conformance machines draw it, so both
paths run against the reference).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np
from threadpoolctl import ThreadpoolController

from kvrows.errors import MLX_MASK_NOT_BOOLEAN, InvalidInputError, head_grouping_message
from kvrows.optimized.host import RowDecoder, on_cpu, scratch
from kvrows.protocols import Mask

__all__ = ["host_attention", "op_attention", "takes_host_path"]

#: Whether encoded attention may take the host path (``False`` inside :func:`op_attention`).
_HOST_PATH: ContextVar[bool] = ContextVar("kvrows_host_attention", default=True)

#: A row chunk's decoded keys (or values) at most this many bytes (one row at least): it
#: stays in a core's cache between the decode and the matmul that reads it.
CHUNK_BYTES = 1 << 22
#: A row's scores at most this many bytes at a time (one query at least): a long prefill
#: block attends a slice of its queries at a time, not ``N x S`` scores at once.
SCORES_BYTES = 1 << 24


@cache
def _blas() -> ThreadpoolController:
    return ThreadpoolController()


def takes_host_path() -> bool:
    """Whether attention over encoded planes runs in NumPy now: on the CPU backend, outside
    :func:`op_attention`."""
    return _HOST_PATH.get() and on_cpu()


@contextmanager
def op_attention() -> Iterator[None]:
    """Attention over encoded planes through MLX ops even on the CPU (the path every other
    backend takes)."""
    token = _HOST_PATH.set(False)
    try:
        yield
    finally:
        _HOST_PATH.reset(token)


def _visible(mask: Mask, n: int, columns: int) -> np.ndarray[Any, Any] | None:
    """``mask`` as NumPy booleans ``[B or 1, 1, 1, N, S]``, broadcasting against
    ``[B, kv_heads, repeat, N, S]`` scores (``None``: every column visible)."""
    if mask is None:
        return None
    if isinstance(mask, str):
        rows = np.arange(n)[:, None] + (columns - n)
        visible: np.ndarray[Any, Any] = np.arange(columns)[None, :] <= rows
    elif isinstance(mask, mx.array) and mask.dtype == mx.bool_:
        visible = np.asarray(mask)
        if visible.ndim == 4:  # [B, 1, N, S] -> [B, 1, 1, N, S] over the head-group axis
            visible = visible[:, :, None]
    else:
        raise InvalidInputError(MLX_MASK_NOT_BOOLEAN)
    visible = visible.reshape((1,) * (5 - visible.ndim) + visible.shape)
    return np.broadcast_to(visible, np.broadcast_shapes(visible.shape, (1, 1, 1, n, columns)))


def host_attention(
    queries: mx.array,
    kv_heads: int,
    columns: int,
    keys: RowDecoder,
    values: RowDecoder,
    mask: Mask,
    scale: float,
) -> mx.array:
    """Float32 attention of ``[B, Hq, N, D]`` queries over ``columns`` tokens whose keys and
    values ``keys`` and ``values`` decode (GQA by a head-group axis), as ``[B, Hq, N, Dv]``
    float32: the scores ``queries·scale·K``, the columns ``mask`` hides at float32's
    minimum, a softmax with its maximum subtracted, then the weights times V."""
    batch, q_heads, n, dim = (int(s) for s in queries.shape)
    if q_heads % kv_heads:
        raise InvalidInputError(head_grouping_message(q_heads, kv_heads))
    repeat = q_heads // kv_heads
    q = np.asarray(queries.astype(mx.float32)) * np.float32(scale)
    grouped = q.reshape(batch, kv_heads, repeat, n, dim)
    visible = _visible(mask, n, columns)
    per_chunk = max(1, CHUNK_BYTES // max(1, kv_heads * columns * dim * 4))
    # One BLAS thread: the matmuls are a few rows each, and OpenBLAS's threads, spinning
    # after each, slow the single-threaded decode between them (B = 16, L = 1024: 55 ms
    # against 37 ms a step).
    with _blas().limit(limits=1, user_api="blas"):
        out = _attend_rows(grouped, visible, keys, values, per_chunk)
    if out is None:  # no rows: the values' width from an empty decode
        out = np.zeros((0, kv_heads, repeat, n, int(values(0, 0, 0).shape[-1])), np.float32)
    return mx.array(out.reshape(batch, q_heads, n, out.shape[-1]))


def _first_columns(visible: np.ndarray[Any, Any] | None, batch: int) -> list[int]:
    """Each row's first column some query sees (0 where none or every column is seen)."""
    if visible is None:
        return [0] * batch
    seen = visible.any(axis=(1, 2, 3))  # [B or 1, S]
    firsts = np.where(seen.any(axis=-1), seen.argmax(axis=-1), 0)
    return [int(f) for f in np.broadcast_to(firsts, (batch,))]


#: What a hidden column scores: the softmax then gives it an exact 0.
_HIDDEN = np.float32(np.finfo(np.float32).min)


def _rows_of(visible: np.ndarray[Any, Any], lo: int, hi: int) -> np.ndarray[Any, Any]:
    """Rows ``[lo, hi)`` of the visibility (one shared row broadcasts)."""
    return visible[:1] if visible.shape[0] == 1 else visible[lo:hi]


def _weights(scores: np.ndarray[Any, Any], shown: np.ndarray[Any, Any] | None) -> None:
    """``scores`` (its last axis a query's columns) into softmax weights, in place: the
    columns ``shown`` hides (broadcast against ``scores``) at :data:`_HIDDEN`, the maximum
    subtracted, exponentiated and normalized."""
    if shown is not None:
        np.copyto(scores, _HIDDEN, where=~shown)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)


def _spans(
    visible: np.ndarray[Any, Any], lo: int, hi: int, start: int, seen: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]] | None:
    """Rows ``[lo, hi)``'s span per query, ``(firsts, stops)`` each ``[rows, N]``: its first
    through its last visible column, relative to ``start`` (``None`` when every query's
    span is the chunk's whole ``seen`` columns; a query that sees nothing keeps them)."""
    shown = _rows_of(visible, lo, hi)[:, 0, 0, :, start:]  # [rows or 1, N, seen]
    if shown[..., 0].all() and shown[..., -1].all():
        return None
    sees = shown.any(axis=-1)
    firsts = np.where(sees, np.argmax(shown, axis=-1), 0)
    stops = np.where(sees, seen - np.argmax(shown[..., ::-1], axis=-1), seen)
    if not firsts.any() and (stops == seen).all():
        return None
    shape = (hi - lo, int(shown.shape[1]))
    return np.broadcast_to(firsts, shape), np.broadcast_to(stops, shape)


def _attend_spans(
    grouped: np.ndarray[Any, Any],
    visible: np.ndarray[Any, Any],
    decoded_keys: np.ndarray[Any, Any],
    decoded_values: np.ndarray[Any, Any],
    out: np.ndarray[Any, Any],
    lo: int,
    start: int,
    spans: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]],
) -> None:
    """Each query of rows ``[lo, lo + rows)`` over exactly its span (``spans``: its first
    through its last visible column, from ``start``), rows of one span together. The
    columns a query cannot see before or after its span (a sliding window's older
    columns in a block, a causal block's later positions, a shorter row's end in a ragged
    batch, a longer chunk around a reused prefix) are neither scored nor summed, so its
    sums run over the same terms in the same order whatever surrounds it (BLAS and NumPy's
    pairwise sums group terms by position and length)."""
    firsts, stops = spans
    rows, n = firsts.shape
    for query in range(n):
        row = 0
        while row < rows:
            first, stop, last = int(firsts[row, query]), int(stops[row, query]), row + 1
            while last < rows and (firsts[last, query], stops[last, query]) == (first, stop):
                last += 1
            q = grouped[lo + row : lo + last, :, :, query]  # [r, kv_heads, repeat, D]
            scores = np.matmul(q, decoded_keys[row:last, :, :, first:stop])
            shown = _rows_of(visible, lo + row, lo + last)[
                :, :, :, query, start + first : start + stop
            ]
            _weights(scores, shown)
            taken = decoded_values[row:last, :, first:stop]
            out[lo + row : lo + last, :, :, query] = scores @ taken
            row = last


def _attend_rows(
    grouped: np.ndarray[Any, Any],
    visible: np.ndarray[Any, Any] | None,
    keys: RowDecoder,
    values: RowDecoder,
    per_chunk: int,
) -> np.ndarray[Any, Any] | None:
    """:func:`host_attention`'s loop over row chunks (``None``: no rows); ``grouped``: the
    scaled queries ``[B, kv_heads, repeat, N, D]``; the output ``[B, kv_heads, repeat, N, Dv]``.

    Each row attends from its first visible column on: a row's left padding (hidden from
    every query) is neither decoded nor summed, so the row's sums run over the same columns
    in the same order as its solo replay's, and the output is the same bits (BLAS and
    NumPy's pairwise sums group terms by position). A chunk holds rows that start at the
    same column. Its queries go a slice at a time (:data:`SCORES_BYTES` of scores a row),
    one ``[repeat·n, D] x [D, S]`` matmul per row and KV head: the head group together."""
    batch, kv_heads, repeat, n, dim = grouped.shape
    firsts = _first_columns(visible, batch)
    out: np.ndarray[Any, Any] | None = None
    lo = 0
    while lo < batch:
        start, hi = firsts[lo], lo + 1
        while hi < batch and hi - lo < per_chunk and firsts[hi] == start:
            hi += 1
        decoded_keys = keys(lo, hi, start).swapaxes(-1, -2)
        decoded_values = values(lo, hi, start)
        seen = int(decoded_keys.shape[-1])
        if out is None:
            out = np.empty((batch, kv_heads, repeat, n, int(decoded_values.shape[-1])), np.float32)
        spans = None if visible is None else _spans(visible, lo, hi, start, seen)
        if visible is not None and spans is not None:
            _attend_spans(grouped, visible, decoded_keys, decoded_values, out, lo, start, spans)
            lo = hi
            continue
        # The slice of queries depends on the row's shape alone (not on the chunk's rows):
        # a row's matmuls are the same in a batch and alone.
        step = max(1, SCORES_BYTES // (kv_heads * repeat * seen * 4))
        for first in range(0, n, step):
            last = min(n, first + step)
            part = grouped[lo:hi, :, :, first:last].reshape(hi - lo, kv_heads, -1, dim)
            shape = (hi - lo, kv_heads, repeat * (last - first), seen)
            scores = np.matmul(part, decoded_keys, out=scratch("scores", shape))
            in_groups = scores.reshape(hi - lo, kv_heads, repeat, last - first, seen)
            shown = None if visible is None else _rows_of(visible, lo, hi)[..., first:last, start:]
            _weights(in_groups, shown)
            summed = scores @ decoded_values
            out[lo:hi, :, :, first:last] = summed.reshape(
                hi - lo, kv_heads, repeat, last - first, -1
            )
        lo = hi
    return out
