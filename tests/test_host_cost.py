"""The decode step's host-side caches (issue 28, host cost per layer) never go stale, and the
lean step is the one taken.

A growing layout keeps, across decode steps, each row's end column (``_ends``, carried by an
append), the mask's pad test (``_pad_columns``, sliced per step) and the last accepted block
(``_accepted``); ``update_and_fetch`` skips the template's layers when the block is like the
last one. Every row operation (filter, trim, join, rollback, re-alignment, growth) must leave
masks and reads equal to what the public state says they are: the masks here are built from
``left_pad`` and ``row_offsets`` alone (row ``b`` holds columns ``[pad, pad + offset)``; its
``i``-th new token is at ``pad + offset + i``), the reads from the rows extracted one by one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from dispatch_helpers import CallLog

import kvrows.optimized as kv
from kvrows.optimized.geometries.ring import SharedRing
from kvrows.optimized.rows import Layout, Storage

pytestmark = pytest.mark.usefixtures("cpu_stream")

HEADS, DIM = 2, 32


def _block(rows: int, tokens: int, seed: int) -> mx.array:
    return mx.random.normal((rows, HEADS, tokens, DIM), key=mx.random.key(seed)).astype(mx.float16)


def _layout(cls: type[Layout], lengths: list[int], seed: int = 0) -> Layout:
    quantized = issubclass(cls, kv.PaddedQuantKVRows)
    serial = []
    for b, n in enumerate(lengths):
        cache = kv.QuantizedKVCache(32, 4) if quantized else kv.KVCache()
        piece = _block(1, n, seed + b)
        cache.update_and_fetch(piece, piece)
        serial.append(cache)
    layout = cls(32, 4) if quantized else cls()
    layout.merge_rows(serial)
    return layout


def _step(layout: Layout, seed: int, n: int = 1) -> tuple[mx.array, mx.array]:
    rows = layout.batch_size
    keys, values = layout.update_and_fetch(_block(rows, n, seed), _block(rows, n, seed + 1000))
    return keys, values


def _expected_mask(layout: Layout, n: int, window: int | None = None) -> np.ndarray:
    """``[B, 1, n, W]`` from the public row state: row ``b``'s tokens at ``[pad, pad +
    offset)``, its ``i``-th new token at ``pad + offset + i``, seeing its own row's tokens
    up to itself (within ``window``)."""
    pads, offsets = layout.left_pad, layout.row_offsets
    width = max(p + o for p, o in zip(pads, offsets, strict=True)) + n
    column = np.arange(width)[None, :]
    rows = []
    for pad, offset in zip(pads, offsets, strict=True):
        query = (pad + offset + np.arange(n))[:, None]
        seen = (column >= pad) & (column <= query)
        if window is not None:
            seen &= query - column < window
        rows.append(seen)
    return np.stack(rows)[:, None]


def _check_masks(layout: Layout) -> None:
    for n in (1, 3):
        for window in (None, 4):
            got = layout.make_mask(n, return_array=True, window_size=window)
            assert isinstance(got, mx.array)
            want = _expected_mask(layout, n, window)
            assert np.array_equal(np.broadcast_to(np.array(got), want.shape), want), (n, window)
    one = layout.make_mask(1)  # the decode step's own call
    want = _expected_mask(layout, 1)
    if one is None:
        assert want.all()
    else:
        assert np.array_equal(np.broadcast_to(np.array(one), want.shape), want)


def _check_read(layout: Layout, keys: mx.array) -> None:
    """What the last step read is each row's tokens at its columns (its extracted row)."""
    pads, offsets = layout.left_pad, layout.row_offsets
    assert keys.shape[2] == max(p + o for p, o in zip(pads, offsets, strict=True))
    for b, (pad, offset) in enumerate(zip(pads, offsets, strict=True)):
        row = layout.extract_row(b)
        held = row.planes()
        assert held is not None
        assert np.array_equal(np.array(keys[b, :, pad : pad + offset]), np.array(held[0][0][0]))


def _after(layout: Layout, change: Callable[[Layout], Any], seed: int) -> None:
    """Decode steps (the caches warm), ``change``, then masks and reads as the public state
    says, through several more decode steps."""
    for s in range(3):
        _step(layout, seed + s)
    _check_masks(layout)
    change(layout)
    layout.check_valid()
    _check_masks(layout)
    for s in range(3):
        keys, _ = _step(layout, seed + 10 + s)
        _check_masks(layout)
    _check_read(layout, keys)


def _join(layout: Layout) -> None:
    cache = kv.QuantizedKVCache(32, 4) if isinstance(layout, kv.PaddedQuantKVRows) else kv.KVCache()
    piece = _block(1, 40, 99)
    cache.update_and_fetch(piece, piece)
    layout.merge_rows([cache])


def _rollback(layout: Layout) -> None:
    assert isinstance(layout, kv.BatchedKVCache)
    layout.spec_round_begin()
    _step(layout, 77, n=3)
    layout.spec_round_rollback([1, 3, 2])


CHANGES: dict[str, Callable[[Layout], Any]] = {
    "filter": lambda layout: layout.filter_rows([2, 0]),
    "filter-longest-leaves": lambda layout: layout.filter_rows([0, 1]),
    "trim": lambda layout: layout.trim(2),
    "join": _join,
    "prefill-block": lambda layout: _step(layout, 55, n=5),
    "growth": lambda layout: _step(layout, 56, n=300),  # past the capacity: fresh buffers
}
RAGGED_CHANGES: dict[str, Callable[[Layout], Any]] = {
    "trim-rows": lambda layout: layout.trim_rows([1, 0, 2]),
    "rollback": _rollback,
    "align": lambda layout: layout.align_rows([5, 0, 2]),  # type: ignore[attr-defined]
}


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("cls", [kv.PaddedKVRows, kv.BatchedKVCache], ids=lambda c: c.__name__)
def test_masks_and_reads_follow_every_row_operation(cls: type[Layout], change: str) -> None:
    layout = _layout(cls, [6, 3, 9])
    _after(layout, CHANGES[change], seed=len(change))


@pytest.mark.parametrize("change", sorted(RAGGED_CHANGES))
def test_ragged_rows_masks_and_reads_follow_their_operations(change: str) -> None:
    layout = _layout(kv.BatchedKVCache, [6, 3, 9])
    _after(layout, RAGGED_CHANGES[change], seed=len(change))


def test_ragged_rows_ends_follow_decode_steps() -> None:
    """Rows of different end columns (a ragged trim) stay ragged through carried steps."""
    layout = _layout(kv.BatchedKVCache, [6, 3, 9])
    layout.trim_rows([2, 0, 1])
    for s in range(4):
        keys, _ = _step(layout, s)
        _check_masks(layout)
    _check_read(layout, keys)


def test_a_decode_step_takes_the_lean_path(call_log: CallLog) -> None:
    """After the first block of a shape, a decode step of the same shape neither runs the
    template's write and read layers nor rebuilds the mask's pad test; after a row
    operation both are done once; a block of another shape takes the full check again."""
    for name in ("_update", "_write_blocks", "fetch", "pads_array"):
        call_log.watch(Storage, name)
    layout = _layout(kv.PaddedKVRows, [6, 3, 9])
    _step(layout, 1)
    layout.make_mask(1)
    del call_log.names[:]
    for s in range(3):
        layout.make_mask(1)
        _step(layout, 2 + s)
    assert call_log.names == []
    layout.filter_rows([0, 2])  # new pads, and blocks of two rows: checked in full once
    layout.make_mask(1)
    _step(layout, 9)
    assert call_log.names == ["pads_array", "_update", "_write_blocks"]
    del call_log.names[:]
    for s in range(2):
        layout.make_mask(1)
        _step(layout, 10 + s)
    assert call_log.names == []
    _step(layout, 12, n=2)  # a block of another shape
    assert call_log.names == ["_update", "_write_blocks"]


def test_classes_that_override_the_template_take_it_whole() -> None:
    """The lean step stands in for the template's own methods only: a placement that
    refuses first (paged), a modifier's read guard (speculative) and a latent read keep
    theirs."""
    assert kv.PaddedKVRows._lean_write and kv.PaddedKVRows._lean_read
    assert kv.BatchedKVCache._lean_write and not kv.BatchedKVCache._lean_read
    assert not kv.PagedKvRows._lean_write and not kv.PagedKvRows._lean_read
    assert not kv.MLACache._lean_write and not kv.MLACache._lean_read


def _eager(cls: type[Layout]) -> type[Layout]:
    """``cls`` taking the template's full write and read at every step (the oracle of the
    lean step: the same hooks, every layer)."""
    eager: type[Layout] = type(f"Eager{cls.__name__}", (cls,), {})
    eager._lean_write = eager._lean_read = False
    return eager


@pytest.mark.parametrize(
    "cls", [kv.PaddedKVRows, kv.BatchedKVCache, kv.PaddedQuantKVRows], ids=lambda c: c.__name__
)
def test_the_lean_step_reads_and_writes_what_the_full_template_does(cls: type[Layout]) -> None:
    """Decode steps, blocks, joins, filters and trims on a layout taking the lean step and
    on one taking the full template: every read and mask bit-identical."""
    lean, full = _layout(cls, [6, 3, 9]), _layout(_eager(cls), [6, 3, 9])
    changes: list[Callable[[Layout], Any]] = [
        lambda layout: None,
        lambda layout: layout.filter_rows([2, 0]),
        _join,
        lambda layout: layout.trim(1),
        lambda layout: _step(layout, 40, n=4),
    ]
    for c, change in enumerate(changes):
        for layout in (lean, full):
            change(layout)
        for s in range(3):
            masks = [layout.make_mask(1, return_array=True) for layout in (lean, full)]
            reads = [_step(layout, 100 * c + s) for layout in (lean, full)]
            assert np.array_equal(np.array(masks[0]), np.array(masks[1]))
            for got, want in zip(reads[0], reads[1], strict=True):
                got_planes = got if isinstance(got, tuple) else (got,)
                want_planes = want if isinstance(want, tuple) else (want,)
                for g, w in zip(got_planes, want_planes, strict=True):
                    assert np.array_equal(np.array(g), np.array(w))
    assert lean.row_offsets == full.row_offsets and lean.left_pad == full.left_pad


def test_a_deep_copy_after_decode_steps_decodes_alike() -> None:
    """mlx-lm's generator deep-copies caches: the step's caches copy, and the copy goes on
    as the original does."""
    layout = _layout(kv.PaddedKVRows, [6, 3, 9])
    for s in range(3):
        layout.make_mask(1)
        _step(layout, s)
    twin = copy.deepcopy(layout)
    for s in range(3):
        masks = [np.array(c.make_mask(1)) for c in (layout, twin)]
        reads = [_step(c, 10 + s) for c in (layout, twin)]
        assert np.array_equal(masks[0], masks[1])
        assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(*reads, strict=True))


def test_a_wrapped_ring_derives_its_physical_form_once_per_step(call_log: CallLog) -> None:
    """A shared ring in time order derives the physical form its read returns: the step
    (lean write, the ring's own read) derives it once, not again to look at ``_planes``."""
    serial = []
    for b, n in enumerate([6, 3, 9]):
        cache = kv.RotatingKVCache(8)
        piece = _block(1, n, b)
        cache.update_and_fetch(piece, piece)
        serial.append(cache)
    ring = kv.BatchedRotatingCache.merge(serial)
    assert isinstance(ring, SharedRing)
    ring.ordered_reads = True  # (kvrows' attention asks for time order; these steps do not)
    for s in range(12):  # wrapped, in time order
        _step(ring, s)
    call_log.watch(SharedRing, "_unordered")
    for s in range(3):
        del call_log.names[:]
        _step(ring, 20 + s)
        assert call_log.names == ["_unordered"]
