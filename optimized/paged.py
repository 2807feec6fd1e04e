"""The optimized paged storages: MLX block pools (``spec/paged-pool.md``).

The bookkeeping is the core's (``kvrows.paged``, ``kvrows.paged_storage``). Here every
plane operation is one MLX op over index arrays: an append scatters all rows' tokens into
their slots with one indexed update per plane, a read gathers every row's slots with one
take (pad columns masked to zero). The pool is allocated once and grows by whole block
ranges; appends write into it in place. On the CPU backend writes and reads go through
NumPy views of the buffers instead (``_host_views`` / ``_host_gather`` say why).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from kvrows.compositions import composition
from kvrows.optimized.codecs import dtype_name, make_codec
from kvrows.optimized.rows import owned
from kvrows.paged_storage import (
    BlockPoolBase,
    PagedKVCacheBase,
    PagedKvRowsBase,
    Piece,
    Planes,
)
from kvrows.schemes import CodecSpec

__all__ = ["BlockPool", "MlxPlaneOps", "PagedKVCache", "PagedKvRows"]


def _index(values: Sequence[int]) -> mx.array:
    return mx.array(list(values), dtype=mx.int32)


def _runs(pieces: Sequence[Piece], size: int) -> list[tuple[Piece, int]]:
    """The pieces with consecutive whole blocks of one source row joined: ``(piece,
    whole)``, ``whole`` the number of whole blocks from ``piece``'s block (0: a partial
    block's piece)."""
    runs: list[tuple[Piece, int]] = []
    for piece in pieces:
        block, start, count, row, token = piece
        full = start == 0 and count == size
        if full and runs and runs[-1][1]:
            (first, _, _, first_row, first_token), whole = runs[-1]
            if (block, row, token) == (first + whole, first_row, first_token + whole * size):
                runs[-1] = (runs[-1][0], whole + 1)
                continue
        runs.append((piece, 1 if full else 0))
    return runs


#: NumPy dtype strings of the plane dtypes the CPU write path serves.
_MX_DTYPES = {
    np.dtype(np.float16).str: mx.float16,
    np.dtype(np.float32).str: mx.float32,
    np.dtype(np.uint32).str: mx.uint32,
    np.dtype(np.uint8).str: mx.uint8,
    np.dtype(np.int8).str: mx.int8,
    np.dtype(np.uint16).str: mx.uint16,
    np.dtype(np.int32).str: mx.int32,
}


def _host_views(planes: Planes) -> list[np.ndarray[Any, Any]] | None:
    """Writable NumPy views of the pool's planes on the CPU backend (``None`` elsewhere, or
    for a dtype NumPy lacks): the planes are evaluated, owned by the pool alone and read
    only through evaluated copies (gathers), so writing their buffers in place is what an
    MLX slice update with buffer donation does, without its slow copy kernel."""
    if mx.default_device() != mx.cpu or any(p.dtype == mx.bfloat16 for p in planes):
        return None
    views = [np.asarray(p) for p in planes]
    if not all(
        v.flags.writeable and v.flags.c_contiguous and v.dtype.str in _MX_DTYPES for v in views
    ):
        return None
    return views


def _host_gather(
    views: Sequence[np.ndarray[Any, Any]],
    rows: Sequence[tuple[Sequence[int], int]],
    pads: Sequence[int],
    width: int,
) -> Planes:
    """The CPU backend's gather: fresh zeroed MLX arrays filled in place through NumPy, one
    strided copy per run of consecutive blocks (MLX's take + transpose + concatenate +
    stack copied the batch's KV several times over at slice-update speed)."""
    out = []
    for view in views:
        heads, size, dim = view.shape[1], view.shape[2], view.shape[3]
        image = mx.zeros((len(rows), heads, width, dim), dtype=_MX_DTYPES[view.dtype.str])
        mx.eval(image)
        target = np.asarray(image)
        if not (target.flags.writeable and target.flags.c_contiguous):  # not its own buffer
            image = mx.array(np.zeros(target.shape, dtype=target.dtype))
            target = np.asarray(image)
        for b, ((blocks, count), pad) in enumerate(zip(rows, pads, strict=True)):
            full, tail = divmod(count, size)
            j = 0
            while j < full:  # runs of consecutive whole blocks
                run = 1
                while j + run < full and blocks[j + run] == blocks[j] + run:
                    run += 1
                start = pad + j * size
                dest = target[b, :, start : start + run * size].reshape(heads, run, size, dim)
                dest[...] = view[blocks[j] : blocks[j] + run].transpose(1, 0, 2, 3)
                j += run
            if tail:
                start = pad + full * size
                target[b, :, start : start + tail] = view[blocks[full], :, :tail]
        out.append(image)
    return tuple(out)


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

    def scatter(self, planes: Planes, pieces: Sequence[Piece], source: Planes) -> Planes:
        # Runs of whole blocks are one slice write each, partial blocks one slice each
        # (MLX's indexed scatter on the CPU runs at a tenth of a slice write's speed).
        size = int(planes[0].shape[2])
        runs = _runs(pieces, size)
        views = _host_views(planes)
        if views is not None:
            # The CPU backend: NumPy writes into the pool's own buffers (MLX's slice update
            # copies at about a tenth of memcpy's speed there; this runs near memcpy's).
            for view, src in zip(views, source, strict=True):
                data = np.asarray(src)
                heads, width = view.shape[1], view.shape[3]
                for (block, start, count, row, token), whole in runs:
                    if whole:
                        piece = data[row, :, token : token + whole * size]
                        view[block : block + whole] = piece.reshape(
                            heads, whole, size, width
                        ).transpose(1, 0, 2, 3)
                    else:
                        view[block, :, start : start + count] = data[row, :, token : token + count]
            return planes
        for plane, src in zip(planes, source, strict=True):
            heads, width = int(plane.shape[1]), int(plane.shape[3])
            for (block, start, count, row, token), whole in runs:
                if whole:
                    piece = src[row, :, token : token + whole * size]
                    plane[block : block + whole] = piece.reshape(
                        heads, whole, size, width
                    ).transpose(1, 0, 2, 3)
                else:
                    plane[block, :, start : start + count] = src[row, :, token : token + count]
        mx.eval(*planes)
        return planes

    def copy_block(self, planes: Planes, target: int, origin: int, count: int) -> Planes:
        views = _host_views(planes)
        if views is not None:
            for view in views:
                view[target, :, :count] = view[origin, :, :count]
            return planes
        for plane in planes:
            plane[target, :, :count] = plane[origin, :, :count]
        mx.eval(*planes)
        return planes

    def gather(
        self,
        planes: Planes,
        rows: Sequence[tuple[Sequence[int], int]],
        pads: Sequence[int],
        width: int,
    ) -> Planes:
        # Each row's blocks are taken whole along axis 0, laid out in logical order and cut
        # to its positions; pad columns are zeros.
        views = _host_views(planes)
        if views is not None:
            return _host_gather(views, rows, pads, width)
        out = []
        for plane in planes:
            heads, dim = int(plane.shape[1]), int(plane.shape[3])
            images = []
            for (blocks, count), pad in zip(rows, pads, strict=True):
                parts = []
                if pad:
                    parts.append(mx.zeros((heads, pad, dim), dtype=plane.dtype))
                if count:
                    taken = mx.take(plane, _index(blocks), axis=0).transpose(1, 0, 2, 3)
                    parts.append(taken.reshape(heads, -1, dim)[:, :count])
                images.append(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1))
            out.append(mx.contiguous(mx.stack(images)))
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
