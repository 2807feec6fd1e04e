"""The paged read's one gather over the whole batch (``optimized.paging.gather_runs``)
against a row-by-row slicing of the same planes, on each of its paths (NumPy's take into
a fresh MLX buffer or a kept one on the CPU backend, ``mx.take`` elsewhere), and its
dispatch; a pool's kept read buffers (``optimized.host.KeptBuffers``) never change a read a
caller still holds, in any form."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from dispatch_helpers import CallLog
from hypothesis import given
from hypothesis import strategies as st

from kvrows.optimized import paging
from kvrows.optimized.host import KEPT_BUFFER_BYTES, KeptBuffers, keep_every_buffer
from kvrows.optimized.paged import BlockPool, PagedKVCache
from kvrows.paged import FREE

SIZE, HEADS = 4, 2
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "uint32": mx.uint32}


@st.composite
def gathers(
    draw: st.DrawFn,
) -> tuple[int, list[tuple[list[int], list[tuple[int, int]]]], list[int], int]:
    """A pool size, rows (a block table and runs of positions each: one run, or a ring's
    sinks and newest with the blocks between given back), pads and a width."""
    blocks = draw(st.integers(1, 12))
    rows, pads, spans = [], [], []
    for _ in range(draw(st.integers(1, 4))):
        held = draw(st.integers(0, 3 * SIZE))
        sinks = draw(st.integers(0, held))
        gap = draw(st.integers(0, 2 * SIZE)) if sinks else 0
        end = held + gap
        table = [draw(st.integers(0, blocks - 1)) for _ in range(-(-end // SIZE))]
        runs = [(0, sinks), (sinks + gap, held - sinks)] if sinks else [(0, held)]
        # A block no run reads is given back (``FREE``): the gather must never read it.
        read = {p // SIZE for first, count in runs for p in range(first, first + count)}
        table = [b if j in read else FREE for j, b in enumerate(table)]
        rows.append((table, runs))
        spans.append(held)
        pads.append(draw(st.integers(0, 3)))
    width = max(p + h for p, h in zip(pads, spans, strict=True)) + draw(st.integers(0, 2))
    return blocks, rows, pads, width


def sliced(plane: np.ndarray[Any, Any], rows: Any, pads: list[int], width: int) -> Any:
    """The oracle: each row's positions read one at a time from its blocks."""
    out = np.zeros((len(rows), plane.shape[1], width, plane.shape[3]), dtype=plane.dtype)
    for b, ((table, runs), pad) in enumerate(zip(rows, pads, strict=True)):
        column = pad
        for first, count in runs:
            for position in range(first, first + count):
                out[b, :, column] = plane[table[position // SIZE], :, position % SIZE]
                column += 1
    return out


def planes_of(blocks: int, dtype: str, seed: int) -> tuple[mx.array, np.ndarray[Any, Any]]:
    bits = np.random.default_rng(seed).integers(1, 2**15, (blocks, HEADS, SIZE, 3))
    host = bits.astype(np.uint16 if dtype == "bfloat16" else np.uint32)
    plane = mx.array(host).view(DTYPES[dtype]) if dtype == "bfloat16" else mx.array(host)
    if dtype == "float16":
        host = host.astype(np.float16)
        plane = mx.array(host)
    mx.eval(plane)
    return plane, host


def bits_of(image: mx.array) -> np.ndarray[Any, Any]:
    return np.asarray(image.view(mx.uint16) if image.dtype == mx.bfloat16 else image)


@pytest.mark.parametrize("path", ["numpy-take", "kept-buffer", "mx-take"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@given(case=gathers(), seed=st.integers(0, 2**16), again=gathers())
def test_the_batch_gather_reads_what_row_by_row_slicing_reads(
    path: str, dtype: str, case: Any, seed: int, again: Any
) -> None:
    blocks, rows, pads, width = case
    plane, expected_host = planes_of(blocks, dtype, seed)
    kept = KeptBuffers()
    fresh = [lambda shape, dtype: kept.fresh(0, shape, dtype)] if path == "kept-buffer" else None
    with pytest.MonkeyPatch.context() as patch, keep_every_buffer():
        if path == "mx-take":  # the other backends' path: MLX's take
            patch.setattr(paging, "host_readable", lambda plane: None)
        (image,) = paging.gather_runs((plane,), rows, pads, width, fresh=fresh)
        assert image.dtype == plane.dtype
        np.testing.assert_array_equal(bits_of(image), sliced(expected_host, rows, pads, width))
        # A second read of other rows (into the first's buffer when it fits and is free).
        del image
        blocks, rows, pads, width = again
        plane, expected_host = planes_of(blocks, dtype, seed + 1)
        (image,) = paging.gather_runs((plane,), rows, pads, width, fresh=fresh)
        np.testing.assert_array_equal(bits_of(image), sliced(expected_host, rows, pads, width))


def test_the_cpu_gather_is_one_numpy_take_per_plane(
    call_log: CallLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    plane, _ = planes_of(6, "float16", 0)
    rows = [([0, 1, 2], [(0, 10)]), ([5, 3], [(0, 7)]), ([4], [(0, 2)])]
    call_log.watch(np, "take")
    call_log.watch(paging, "gather_sources")

    def no_mx_take(*args: Any, **kwargs: Any) -> mx.array:
        raise AssertionError("the CPU gather took MLX's per-element take")

    monkeypatch.setattr(mx, "take", no_mx_take)
    paging.gather_runs((plane, plane), rows, [0, 3, 8], 10)
    assert call_log.names == ["gather_sources", "take", "take"]


def pool_rows(
    dtype: mx.Dtype, tokens: int, seed: int
) -> tuple[BlockPool, list[PagedKVCache], np.ndarray[Any, Any]]:
    """Two rows of ``tokens`` tokens in one pool (block size 4, 2 heads of 8), and the
    keys written (``[2, 2, tokens, 8]``)."""
    pool = BlockPool(block_size=SIZE)
    keys = np.random.default_rng(seed).normal(size=(2, HEADS, tokens, 8)).astype(np.float32)
    rows = []
    for r in range(2):
        row = PagedKVCache(pool=pool)
        block = mx.array(keys[r : r + 1]).astype(dtype)
        row.update_and_fetch(block, block)
        rows.append(row)
    return pool, rows, keys


def read_address(keys: mx.array) -> int:
    return int(np.asarray(keys.view(mx.uint16) if keys.dtype == mx.bfloat16 else keys).ctypes.data)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_a_pool_read_reuses_the_last_reads_buffer_once_nobody_holds_it(
    dtype: mx.Dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dispatch: a second read of a row, the first one dropped, is written into the
    first's buffer (the same address: MLX donated it to the slice update); a read held is
    not reused, and no donation is tried for it (a new buffer, not a copy of it)."""
    pool, rows, keys = pool_rows(dtype, 9, 0)
    updates = []
    real = mx.slice_update

    def slice_update(*args: Any, **kwargs: Any) -> mx.array:
        updates.append(1)  # (not the arguments: holding the buffer would stop its donation)
        return real(*args, **kwargs)

    monkeypatch.setattr(mx, "slice_update", slice_update)
    with keep_every_buffer():
        first = rows[0].fetch()
        address = read_address(first[0])
        del first
        second = rows[0].fetch()[0]  # (its values dropped)
        assert read_address(second) == address
        assert pool._read_buffers.reused == 2  # keys and values
        assert len(updates) == 2
        third = rows[0].fetch()[0]  # ``second`` held: a buffer of its own
        assert read_address(third) != read_address(second)
        assert pool._read_buffers.reused == 3  # the values only
        assert len(updates) == 3
        written = np.asarray(mx.array(keys[:1]).astype(dtype).astype(mx.float32))
        for read in (second, third):
            np.testing.assert_array_equal(np.asarray(read.astype(mx.float32)), written)


def test_a_pool_whose_rows_are_all_released_keeps_no_read_buffer() -> None:
    pool, rows, _ = pool_rows(mx.float16, 9, 0)
    with keep_every_buffer():
        rows[0].fetch()
    assert pool._read_buffers._kept
    rows[0].release()
    assert pool._read_buffers._kept  # a row still reads
    rows[1].release()
    assert not pool._read_buffers._kept


def test_reads_below_the_kept_size_are_fresh_buffers() -> None:
    pool, rows, _ = pool_rows(mx.float16, 9, 0)
    assert 2 * HEADS * 9 * 8 * 2 < KEPT_BUFFER_BYTES
    for _ in range(3):
        rows[0].fetch()
    assert pool._read_buffers.reused == 0


HOLDS = ["array", "lazy op", "evaluated slice", "numpy view", "bfloat16 view"]


@pytest.mark.parametrize("hold", HOLDS)
@given(data=st.data())
def test_a_read_a_caller_holds_never_changes(hold: str, data: st.DataObject) -> None:
    """Whatever form the caller keeps of a read (the array, an op on it not yet evaluated,
    an evaluated slice, a NumPy view, a view of another dtype), reads after it, of other
    rows, longer or shorter, leave it as it was; once it is dropped, reads reuse buffers."""
    dtype = mx.bfloat16 if hold == "bfloat16 view" else mx.float16
    tokens = data.draw(st.integers(1, 12), label="tokens")
    pool, rows, _ = pool_rows(dtype, tokens, data.draw(st.integers(0, 99), label="seed"))
    with keep_every_buffer():
        read = rows[0].fetch()[0]
        want = np.asarray(read.view(mx.uint16) if dtype == mx.bfloat16 else read).copy()
        held: Any
        if hold == "array":
            held = read
        elif hold == "lazy op":
            held = read + 0
        elif hold == "evaluated slice":
            held = read[:, :, :]
            mx.eval(held)
            want = want[:, :, :]
        elif hold == "numpy view":
            held = np.asarray(read)
        else:
            held = read.view(mx.uint16)
        del read
        for step in range(data.draw(st.integers(1, 4), label="reads after")):
            row = rows[data.draw(st.integers(0, 1), label=f"row {step}")]
            more = data.draw(st.integers(0, 5), label=f"tokens appended {step}")
            if more:
                block = mx.array(np.full((1, HEADS, more, 8), step + 7, np.float32)).astype(dtype)
                row.update_and_fetch(block, block)
            row.fetch()
        got = np.asarray(held.view(mx.uint16) if hold == "array" and dtype == mx.bfloat16 else held)
        np.testing.assert_array_equal(got, want)
        del held, got
        before = pool._read_buffers.reused
        rows[0].fetch()
        rows[0].fetch()
        assert pool._read_buffers.reused > before
