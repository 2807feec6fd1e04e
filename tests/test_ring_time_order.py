"""A wrapped shared ring (no sinks) keeps its window in time order (``spec/engine.md`` §8,
``spec/RotatingKVCache.md``): attention in time order reads a slice of it, no re-ordered
copy; the physical read (mlx-lm's order) is derived; the window moves to the front once
per ``slack`` tokens."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from dispatch_helpers import CallLog

import kvrows.optimized as opt
import kvrows.optimized.geometries.ring as ring_module
from kvrows.app.attention import dispatch
from kvrows.optimized.geometries.ring import SharedRing

ROWS, HEADS, DIM = 3, 2, 4


def _token(position: int, rows: int = ROWS) -> mx.array:
    """Row ``b``'s key and value for ``position``: ``1000 * b + position`` everywhere."""
    tags = mx.array([1000.0 * b + position for b in range(rows)]).reshape(rows, 1, 1, 1)
    return mx.broadcast_to(tags, (rows, HEADS, 1, DIM))


def _tags(read: Any) -> list[list[int]]:
    return [[int(v) for v in row] for row in np.asarray(read)[:, 0, :, 0]]


def _layout(window: int) -> Any:
    """A batched ring of ``ROWS`` rows that joined at once (one phase, no pads)."""
    layout = opt.BatchedRotatingCache(window)
    rows = []
    for b in range(ROWS):
        serial = opt.RotatingKVCache(window)
        serial.update_and_fetch(_token(0, 1) + 1000.0 * b, _token(0, 1) + 1000.0 * b)
        rows.append(serial)
    layout.merge_rows(rows)
    return layout


@pytest.mark.parametrize("batched", [False, True], ids=["serial", "layout"])
def test_attention_reads_a_wrapped_ring_in_time_order_without_a_reordered_copy(
    batched: bool, call_log: CallLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    window = 8
    cache = _layout(window) if batched else opt.RotatingKVCache(window)
    rows = ROWS if batched else 1
    start = 1 if batched else 0
    reordered: list[str] = []  # the dtype of every array the re-ordering helper copied
    real = ring_module._in_time_order

    def logged(array: Any, lead: int, idx: int, axis: int) -> Any:
        reordered.append(str(array.dtype).removeprefix("mlx.core."))
        return real(array, lead, idx, axis)

    monkeypatch.setattr(ring_module, "_in_time_order", logged)
    call_log.watch(SharedRing, "reordered_reads")
    queries = mx.ones((rows, HEADS, 1, DIM))
    captured: dict[str, Any] = {}
    original = dispatch.__globals__["_original"]()

    def attend(q: Any, k: Any, v: Any, *, cache: Any, scale: float, mask: Any, sinks: Any) -> Any:
        captured.update(keys=k, mask=mask)
        return original(q, k, v, cache=cache, scale=scale, mask=mask, sinks=sinks)

    monkeypatch.setitem(dispatch.__globals__, "_original", lambda: attend)
    for position in range(start, 3 * window + 3):
        mask = cache.make_mask(1)
        keys, values = cache.update_and_fetch(_token(position, rows), _token(position, rows))
        dispatch(queries, keys, values, cache, 1.0, mask)
        first = max(0, position + 1 - window)
        expected = [[1000 * b + p for p in range(first, position + 1)] for b in range(rows)]
        assert _tags(captured["keys"]) == expected
        if isinstance(captured["mask"], mx.array):  # every column visible, in time order
            assert np.asarray(captured["mask"]).all()
    assert cache.time_ordered
    assert call_log.names == []  # no read went through the re-ordered copy
    assert set(reordered) <= {"bool"}  # only the mask (a bool per column) was re-ordered


def test_the_ordered_form_costs_slack_columns_and_moves_once_per_slack_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    window = 8
    ring = opt.RotatingKVCache(window)
    ring.ordered_reads = True  # (no reader asks for time order here)
    for position in range(window + 1):  # wraps on the last one: the ordered form starts
        ring.update_and_fetch(_token(position, 1), _token(position, 1))
    assert ring.time_ordered and ring.slack == window  # min(STEP, window)
    column = 2 * HEADS * DIM * 4  # keys and values, float32
    assert ring.nbytes == (window + ring.slack) * column
    moves: list[int] = []
    real = SharedRing._zeros

    def counted(self: Any, rows: int, columns: int, *args: Any, **kwargs: Any) -> Any:
        moves.append(columns)
        return real(self, rows, columns, *args, **kwargs)

    monkeypatch.setattr(SharedRing, "_zeros", counted)
    steps = 4 * (ring.slack + 1)  # a move frees slack + 1 columns
    for position in range(window + 1, window + 1 + steps):
        ring.update_and_fetch(_token(position, 1), _token(position, 1))
    assert moves == [ring.slack + 1] * 4  # the window moved to the front 4 times
    assert ring.nbytes == (window + ring.slack) * column


@pytest.mark.parametrize("batched", [False, True], ids=["serial", "layout"])
def test_a_ring_read_only_in_physical_order_keeps_the_physical_form(batched: bool) -> None:
    """mlx-lm's attention through the drop-in reads ``update_and_fetch``'s physical order
    and never asks for time order: the wrapped ring stays mlx-lm's in-place ring (no
    ordered form to re-derive the physical read from at every step). The first read in
    time order (kvrows' attention) switches it to the ordered form at the next token."""
    window = 6
    cache = _layout(window) if batched else opt.RotatingKVCache(window)
    rows = ROWS if batched else 1
    for position in range(1 if batched else 0, 3 * window):
        cache.update_and_fetch(_token(position, rows), _token(position, rows))
        assert not cache.time_ordered, position
    keys, values = cache.update_and_fetch(_token(3 * window, rows), _token(3 * window, rows))
    cache.reads_in_time_order(keys, values, None)
    assert not cache.time_ordered  # (this read re-ordered a copy)
    cache.update_and_fetch(_token(3 * window + 1, rows), _token(3 * window + 1, rows))
    assert cache.time_ordered


def test_the_ordered_form_reads_what_the_physical_form_reads() -> None:
    """The same tokens through both forms: mlx-lm's physical read, the windows, the masks
    and the time-ordered reads are the same arrays (the eager path is the oracle)."""
    window = 6
    ordered, physical = _layout(window), _layout(window)
    physical.ordered_reads = False
    for position in range(1, 4 * window):
        masks = [c.make_mask(1, return_array=True) for c in (ordered, physical)]
        reads = [
            c.update_and_fetch(_token(position), _token(position)) for c in (ordered, physical)
        ]
        assert np.array_equal(np.asarray(masks[0]), np.asarray(masks[1]))
        for got, want in zip(reads[0], reads[1], strict=True):
            assert np.array_equal(np.asarray(got), np.asarray(want))
        timed = [
            c.reads_in_time_order(*r, masks[i])
            for i, (c, r) in enumerate(zip((ordered, physical), reads, strict=True))
        ]
        for got, want in zip(timed[0], timed[1], strict=True):
            assert np.array_equal(np.asarray(got), np.asarray(want))
        for b in range(ROWS):
            got_w, want_w = ordered.row_window(b), physical.row_window(b)
            assert got_w is not None and want_w is not None
            assert np.array_equal(np.asarray(got_w[0]), np.asarray(want_w[0]))
    assert ordered.time_ordered and not physical.time_ordered
    assert ordered.ring_state == physical.ring_state
    assert ordered.left_pad == physical.left_pad


def test_a_ring_with_sinks_keeps_its_physical_form() -> None:
    ring = opt.RotatingKVCache(6, keep=2)
    for position in range(20):
        ring.update_and_fetch(_token(position, 1), _token(position, 1))
    assert not ring.time_ordered
