"""The reference's ``PagedLatentCache`` (``spec/PagedLatentCache.md``): MLA latent planes in
a NumPy block pool.

The row semantics are ``MLACache``'s (``kvrows.latent.LatentRows``), the block bookkeeping
the paged core's (``kvrows.paged_latent``); this module binds them to the NumPy plane
operations below (:class:`NumpyPlaneOps`, slot by slot) and the reference latent's array
hooks. Latent paging still runs on ``kvrows.paged_latent``'s block pool (``LatentBlockPoolBase``) until its
step moves it (``spec/machinery-migration.md`` §6); the reference's KV paging is
``reference/paging.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvrows.compositions import composition
from kvrows.paged_latent import LatentBlockPoolBase, PagedLatentRows, Piece, Planes
from kvrows.reference.codecs import dtype_name, make_codec, numpy_dtype
from kvrows.reference.latent import _LatentReference
from kvrows.schemes import CodecSpec

__all__ = ["LatentBlockPool", "NumpyPlaneOps", "PagedLatentCache"]


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


class LatentBlockPool(LatentBlockPoolBase):
    """One MLA layer's blocks in NumPy planes."""

    ops = NumpyPlaneOps()


class PagedLatentCache(PagedLatentRows, _LatentReference):
    """MLA latent + rope (+ DSA index) planes in a block pool, ``MLACache``'s rows
    (``spec/PagedLatentCache.md``)."""

    composition = composition("PagedLatentCache")
    pool_class = LatentBlockPool

    def planes(self) -> list[Any]:
        """Each row's stored planes in logical order (``MLACache``'s reference form)."""
        return self.row_planes()

    def _warm_cat(self, held: Any | None, block: Any, row: int) -> Any:
        part = np.array(block[row : row + 1], copy=True)
        return part if held is None else np.concatenate([held, part], axis=2)

    def _warm_cut(self, held: Any, keep: int) -> Any:
        return np.array(held[:, :, :keep], copy=True)

    def _decode_latent(self, planes: Sequence[Any], dtype: str | None = None) -> Any:
        dtype = dtype or self._dtype
        assert dtype is not None
        return self._codec.decoded(tuple(planes), "latent", dtype)

    def _overlay(self, dense: Any, rows: Sequence[Any | None]) -> Any:
        out = np.array(dense, copy=True)
        for b, row in enumerate(rows):
            if row is not None:
                out[b, :, out.shape[2] - row.shape[2] :] = row[0]
        return out

    def _stack_warm(self, rows: Sequence[Any | None], width: int) -> Any:
        assert self._widths is not None and self._dtype is not None
        out = np.zeros((len(rows), 1, width, self._widths[0]), numpy_dtype(self._dtype))
        return self._overlay(out, rows)


LatentBlockPool.latent_cache_class = PagedLatentCache
