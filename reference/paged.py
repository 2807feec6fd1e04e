"""The reference's paged storages: the declarations (``spec/PagedKVCache.md``,
``spec/PagedKvRows.md``, ``spec/PagedLatentCache.md``, ``spec/paged-pool.md``).

Their machinery is the reference's row machinery with the paged placement of
``reference/paging.py``: compact rows whose tokens also live in a NumPy block pool. The
paged latent is the latent surface (``reference/latent.py``) over that placement, its
pool a ``BlockPool`` of a ``Latent`` codec (``LatentBlockPool``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvrows.codec import PlaneSet
from kvrows.compositions import composition
from kvrows.latent import LatentPoolMembers, PagedLatentMembers
from kvrows.paged import AnyCodecParameters
from kvrows.reference.codecs import numpy_dtype
from kvrows.reference.geometries.ring import RingParameters
from kvrows.reference.latent import LatentSurface
from kvrows.reference.paging import BlockPool, PagedLayout, PagedRow, PagedSerial
from kvrows.reference.rows import Row

__all__ = [
    "BlockPool",
    "LatentBlockPool",
    "PagedKVCache",
    "PagedKvRows",
    "PagedLatentCache",
    "PagedRotatingKVCache",
    "PagedRotatingRows",
]


class PagedKVCache(AnyCodecParameters, PagedSerial):
    """One request's block table into a ``BlockPool`` (``spec/PagedKVCache.md``)."""

    composition = composition("PagedKVCache")


class PagedKvRows(AnyCodecParameters, PagedLayout):
    """Block-table rows, all three roles (``spec/PagedKvRows.md``)."""

    composition = composition("PagedKvRows")
    serial_class = PagedKVCache


class PagedRotatingKVCache(RingParameters, AnyCodecParameters, PagedSerial):
    """One request's sliding window as a block table (``spec/PagedRotatingKVCache.md``):
    ``RotatingKVCache``'s window, its blocks out of the window back in the pool."""

    composition = composition("PagedRotatingKVCache")


class PagedRotatingRows(RingParameters, AnyCodecParameters, PagedLayout):
    """Sliding-window block-table rows, all three roles (``spec/PagedRotatingRows.md``)."""

    composition = composition("PagedRotatingRows")
    serial_class = PagedRotatingKVCache


BlockPool.cache_classes = {"growing": PagedKVCache, "ring": PagedRotatingKVCache}


class LatentBlockPool(LatentPoolMembers, BlockPool):
    """One MLA layer's blocks in NumPy planes: a ``BlockPool`` of a ``Latent`` codec
    (the latent through ``codec``, rope and index plain; ``spec/PagedLatentCache.md``)."""


class PagedLatentCache(PagedLatentMembers, LatentSurface, PagedLayout):
    """MLA latent + rope (+ DSA index) planes in a block pool, ``MLACache``'s rows
    (``spec/PagedLatentCache.md``): the latent surface on the paged placement."""

    composition = composition("PagedLatentCache")
    pool_class = LatentBlockPool

    def _lent(self) -> list[Row | None]:
        return list(self._rows) or [None]  # an empty cache lends one empty row

    def adopt_rows(self, rows: Sequence[Row]) -> None:
        super().adopt_rows(rows)
        self._adopted(len(rows))

    def _adopt_state(self, planes: PlaneSet | None, offsets: list[int], width: int) -> None:
        """Rows at ``offsets`` from right-justified ``planes``, written into fresh blocks
        (every block taken at once: a refusal changes nothing), counted as written."""
        rows: list[PagedRow] = []
        for b, offset in enumerate(offsets):
            row = PagedRow(offset=offset)
            if planes is not None and offset:
                row.planes = {
                    t: tuple(np.array(p[b : b + 1, :, width - offset :], copy=True) for p in held)
                    for t, held in planes.items()
                }
            rows.append(row)
        shapes = self._shapes()
        pool = self._pool
        if shapes is not None and width:
            pool = self._write_fresh(shapes, rows)
        if pool is not None:
            for row in rows:
                pool.open(row, touch=False)
        self._rows = list(rows)
        self._place.join(self._rows, 0)
        self._watch()

    # -- the warm-up exact latents beside the pool ------------------------------------------
    def _warm_cat(self, held: Any | None, block: Any, row: int) -> Any:
        part = np.array(block[row : row + 1], copy=True)
        return part if held is None else np.concatenate([held, part], axis=2)

    def _warm_cut(self, held: Any, keep: int) -> Any:
        return np.array(held[:, :, :keep], copy=True)

    def _row_slice(self, array: Any, row: int, start: int, stop: int) -> Any:
        return np.array(array[row : row + 1, :, start:stop], copy=True)

    def _overlay(self, dense: Any, rows: Sequence[Any | None]) -> Any:
        out = np.array(dense, copy=True)
        for b, row in enumerate(rows):
            if row is not None:
                out[b, :, out.shape[2] - row.shape[2] :] = row[0]
        return out

    def _stack_warm(self, rows: Sequence[Any | None], width: int) -> Any:
        shapes = self._shapes()
        assert shapes is not None
        out = np.zeros((len(rows), 1, width, shapes.rank), numpy_dtype(shapes.dtype))
        return self._overlay(out, rows)


PagedLatentCache.serial_class = PagedLatentCache  # type: ignore[assignment]  # its own serial
LatentBlockPool.latent_cache_class = PagedLatentCache
