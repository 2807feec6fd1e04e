"""The paged read's one gather over the whole batch (``optimized.paging.gather_runs``)
against a row-by-row slicing of the same planes, on both of its paths (NumPy's take into
a fresh MLX buffer on the CPU backend, ``mx.take`` elsewhere), and its dispatch."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from dispatch_helpers import CallLog
from hypothesis import given
from hypothesis import strategies as st

from kvrows.optimized import paging
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


@pytest.mark.parametrize("host", [True, False], ids=["numpy-take", "mx-take"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@given(case=gathers(), seed=st.integers(0, 2**16))
def test_the_batch_gather_reads_what_row_by_row_slicing_reads(
    host: bool, dtype: str, case: Any, seed: int
) -> None:
    blocks, rows, pads, width = case
    plane, expected_host = planes_of(blocks, dtype, seed)
    with pytest.MonkeyPatch.context() as patch:
        if not host:  # the other backends' path: MLX's take
            patch.setattr(paging, "host_readable", lambda plane: None)
        (image,) = paging.gather_runs((plane,), rows, pads, width)
    assert image.dtype == plane.dtype
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
