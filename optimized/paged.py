"""The optimized paged storages: MLX block pools (``spec/paged-pool.md``).

The bookkeeping is the core's (``kvrows.paged``, ``kvrows.paged_storage``). Here every
plane operation is one MLX op over index arrays: an append scatters all rows' tokens into
their slots with one indexed update per plane, a read gathers every row's slots with one
take (pad columns masked to zero). The pool is allocated once and grows by whole block
ranges; appends write into it in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from kvrows.compositions import composition
from kvrows.optimized.codecs import dtype_name, make_codec
from kvrows.optimized.rows import owned
from kvrows.paged_storage import BlockPoolBase, PagedKVCacheBase, PagedKvRowsBase, Planes
from kvrows.schemes import CodecSpec

__all__ = ["BlockPool", "MlxPlaneOps", "PagedKVCache", "PagedKvRows"]


def _index(values: Sequence[int]) -> mx.array:
    return mx.array(list(values), dtype=mx.int32)


class MlxPlaneOps:
    """The paged plane operations on MLX arrays."""

    def make_codec(self, spec: CodecSpec) -> Any:
        return make_codec(spec)

    def dtype_name(self, array: object) -> str:
        return dtype_name(array)

    def shape(self, array: object) -> tuple[int, ...]:
        return tuple(int(x) for x in array.shape) if isinstance(array, mx.array) else ()

    def concat_blocks(self, old: Planes, new: Planes) -> Planes:
        grown = tuple(mx.concatenate([a, b], axis=0) for a, b in zip(old, new, strict=True))
        mx.eval(*grown)
        return grown

    def scatter(
        self,
        planes: Planes,
        blocks: Sequence[int],
        within: Sequence[int],
        source: Planes,
        rows: Sequence[int],
        tokens: Sequence[int],
    ) -> Planes:
        b, w = _index(blocks), _index(within)
        r, t = _index(rows), _index(tokens)
        out = []
        for plane, src in zip(planes, source, strict=True):
            # source[r, :, t] is [T, H, w]; plane[b, :, w] takes it slot by slot
            plane[b, :, w] = src[r, :, t]
            out.append(plane)
        mx.eval(*out)
        return tuple(out)

    def copy_slots(
        self,
        planes: Planes,
        blocks: Sequence[int],
        within: Sequence[int],
        from_blocks: Sequence[int],
        from_within: Sequence[int],
    ) -> Planes:
        b, w = _index(blocks), _index(within)
        fb, fw = _index(from_blocks), _index(from_within)
        out = []
        for plane in planes:
            plane[b, :, w] = plane[fb, :, fw]
            out.append(plane)
        mx.eval(*out)
        return tuple(out)

    def gather(
        self,
        planes: Planes,
        slots: Sequence[tuple[Sequence[int], Sequence[int]]],
        pads: Sequence[int],
        width: int,
    ) -> Planes:
        rows = len(slots)
        blocks: list[int] = []
        within: list[int] = []
        valid: list[bool] = []
        for (row_blocks, row_within), pad in zip(slots, pads, strict=True):
            blocks += [0] * pad + list(row_blocks)
            within += [0] * pad + list(row_within)
            valid += [False] * pad + [True] * len(row_blocks)
        b, w = _index(blocks), _index(within)
        shown = mx.array(valid)[:, None, None]
        out = []
        for plane in planes:
            taken = plane[b, :, w]  # [B * width, H, w]
            if not all(valid):
                taken = mx.where(shown, taken, mx.zeros((1, 1, 1), dtype=plane.dtype))
            image = taken.reshape(rows, width, plane.shape[1], plane.shape[3])
            out.append(mx.contiguous(image.transpose(0, 2, 1, 3)))
        mx.eval(*out)
        return tuple(out)

    def mask(self, pads: Sequence[int], end: int, n: int, window: int | None, serial: bool) -> Any:
        columns = mx.arange(end + n)[None, None, None, :]
        queries = (end + mx.arange(n))[None, None, :, None]
        pad = _index(pads)[:, None, None, None]
        visible = (columns <= queries) & (columns >= pad)
        if window is not None:
            visible = visible & (queries < columns + window)
        return visible[0, 0] if serial else visible

    def offsets(self, values: Sequence[int]) -> Any:
        return _index(values)

    def row_slice(self, plane: Any, row: int, start: int, stop: int) -> Any:
        piece = owned(plane[row : row + 1, :, start:stop])
        mx.eval(piece)
        return piece


class BlockPool(BlockPoolBase):
    """One layer's blocks in MLX planes (``spec/paged-pool.md``)."""

    ops = MlxPlaneOps()


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
