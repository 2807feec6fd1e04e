"""The reference's paged storages: NumPy block pools (``spec/paged-pool.md``).

The bookkeeping is the core's (``kvrows.paged``, ``kvrows.paged_storage``); this module
says what the plane operations mean in NumPy, as plainly as possible: a token slot is
``planes[block, :, within]``, written and read one index list at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvrows.compositions import composition
from kvrows.paged_storage import (
    BlockPoolBase,
    PagedKVCacheBase,
    PagedKvRowsBase,
    Piece,
    Planes,
)
from kvrows.reference.codecs import dtype_name, make_codec
from kvrows.schemes import CodecSpec

__all__ = ["BlockPool", "NumpyPlaneOps", "PagedKVCache", "PagedKvRows"]


class NumpyPlaneOps:
    """The paged plane operations on NumPy arrays (in place)."""

    def make_codec(self, spec: CodecSpec) -> Any:
        return make_codec(spec)

    def dtype_name(self, array: object) -> str:
        return dtype_name(array)

    def shape(self, array: object) -> tuple[int, ...]:
        return tuple(int(x) for x in array.shape) if isinstance(array, np.ndarray) else ()

    def concat_blocks(self, old: Planes, new: Planes) -> Planes:
        return tuple(np.concatenate([a, b], axis=0) for a, b in zip(old, new, strict=True))

    def scatter(self, planes: Planes, pieces: Sequence[Piece], source: Planes) -> Planes:
        for plane, src in zip(planes, source, strict=True):
            for block, start, count, row, token in pieces:
                plane[block, :, start : start + count] = src[row, :, token : token + count]
        return planes

    def copy_block(self, planes: Planes, target: int, origin: int, count: int) -> Planes:
        for plane in planes:
            plane[target, :, :count] = plane[origin, :, :count]
        return planes

    def gather(
        self,
        planes: Planes,
        rows: Sequence[tuple[Sequence[int], int]],
        pads: Sequence[int],
        width: int,
    ) -> Planes:
        out: list[npt.NDArray[Any]] = []
        for plane in planes:
            size = plane.shape[2]
            image = np.zeros((len(rows), plane.shape[1], width, plane.shape[3]), plane.dtype)
            for b, ((blocks, count), pad) in enumerate(zip(rows, pads, strict=True)):
                for position in range(count):
                    block = blocks[position // size]
                    image[b, :, pad + position] = plane[block, :, position % size]
            out.append(image)
        return tuple(out)

    def mask(self, pads: Sequence[int], end: int, n: int, window: int | None, serial: bool) -> Any:
        columns = np.arange(end + n)[None, None, None, :]
        queries = (end + np.arange(n))[None, None, :, None]
        pad = np.array(list(pads), dtype=np.int64)[:, None, None, None]
        visible: npt.NDArray[np.bool_] = (columns <= queries) & (columns >= pad)
        if window is not None:
            visible &= queries < columns + window
        return visible[0, 0] if serial else visible

    def offsets(self, values: Sequence[int]) -> Any:
        return np.array(list(values), dtype=np.int32)

    def row_slice(self, plane: Any, row: int, start: int, stop: int) -> Any:
        return np.array(plane[row : row + 1, :, start:stop], copy=True)


class BlockPool(BlockPoolBase):
    """One layer's blocks in NumPy planes (``spec/paged-pool.md``)."""

    ops = NumpyPlaneOps()


class PagedKVCache(PagedKVCacheBase):
    """One request's block table into a ``BlockPool`` (``spec/PagedKVCache.md``)."""

    composition = composition("PagedKVCache")
    pool_class = BlockPool


class PagedKvRows(PagedKvRowsBase):
    """Block-table rows, all three roles (``spec/PagedKvRows.md``)."""

    composition = composition("PagedKvRows")
    pool_class = BlockPool
    serial_class = PagedKVCache


BlockPool.cache_class = PagedKVCache
