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
from kvrows.reference.geometries.chunked import ChunkedSurface
from kvrows.reference.geometries.ring import RingParameters
from kvrows.reference.latent import LatentSurface
from kvrows.reference.paging import BlockPool, PagedLayout, PagedRow, PagedSerial
from kvrows.reference.rows import Row, Storage

__all__ = [
    "BlockPool",
    "LatentBlockPool",
    "PagedChunkedKVCache",
    "PagedChunkedRows",
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


class PagedChunkedSurface(ChunkedSurface):
    """The chunked surface of a paged storage: ``maybe_trim_front`` also gives back the
    blocks none of whose positions a row holds any more."""

    _pool: BlockPool | None

    def maybe_trim_front(self) -> None:
        super().maybe_trim_front()
        if self._pool is not None:
            for row in self._rows:
                self._pool.release_outside(row)


class PagedChunkedKVCache(PagedChunkedSurface, AnyCodecParameters, PagedSerial):
    """One request's chunked-local attention as a block table (``spec/ChunkedKVCache.md``
    §7): ``ChunkedKVCache``'s rows, the blocks before the chunk back in the pool."""

    composition = composition("PagedChunkedKVCache")


class PagedChunkedRows(PagedChunkedSurface, AnyCodecParameters, PagedLayout):
    """Chunked-local block-table rows, all three roles (``spec/ChunkedKVCache.md`` §7)."""

    composition = composition("PagedChunkedRows")
    serial_class = PagedChunkedKVCache


BlockPool.cache_classes = {
    "growing": PagedKVCache,
    "ring": PagedRotatingKVCache,
    "chunked": PagedChunkedKVCache,
}


class LatentBlockPool(LatentPoolMembers, BlockPool):
    """One MLA layer's blocks in NumPy planes: a ``BlockPool`` of a ``Latent`` codec
    (the latent through ``codec``, rope and index plain; ``spec/PagedLatentCache.md``)."""


class PagedLatentCache(PagedLatentMembers, LatentSurface, PagedLayout):
    """MLA latent + rope (+ DSA index) planes in a block pool, ``MLACache``'s rows
    (``spec/PagedLatentCache.md``): the latent surface on the paged placement; an encoded
    latent's warm rows are compact stage-0 rows beside the pool."""

    composition = composition("PagedLatentCache")
    pool_class = LatentBlockPool

    def _lent(self) -> list[Row | None]:
        return list(self._rows) or [None]  # an empty cache lends one empty row

    def _adopt_state(
        self,
        planes: PlaneSet | None,
        offsets: list[int],
        width: int,
        exact: Any = None,
        converted: Sequence[bool] | None = None,
    ) -> None:
        """Rows at ``offsets`` from right-justified ``planes``: the converted ones written
        into fresh blocks (every block taken at once: a refusal changes nothing), counted
        as written; the others stage-0 rows beside the pool, their latent ``exact``."""
        last = len(self._stages) - 1
        done = list(converted) if converted is not None else [True] * len(offsets)
        rows: list[PagedRow] = []
        for b, offset in enumerate(offsets):
            row = PagedRow(offset=offset, stage=last if done[b] else 0)
            if planes is not None and offset:
                held = dict(planes) if done[b] else {**planes, "latent": (exact,)}
                row.planes = {
                    t: tuple(np.array(p[b : b + 1, :, width - offset :], copy=True) for p in ps)
                    for t, ps in held.items()
                }
            rows.append(row)
        shapes = self._shapes()
        pool = self._pool
        pooled = [row for row in rows if row.stage == last]
        if shapes is not None and width:
            pool = self._write_fresh(shapes, pooled)
        if pool is not None:
            for row in rows:
                pool.open(row, touch=False)
        self._pool = pool
        self._rows = list(rows)
        self._place.join(self._rows, 0)
        self._watch()
        self._staged()

    def _pool_rows(self) -> list[Row]:
        """Each row as the pool's codec stores it (a stage-0 row's exact columns encoded
        per token: what its conversion writes)."""
        last = len(self._stages) - 1
        return [row if row.stage == last else self._next_stage(row) for row in self._rows]

    def planes(self) -> list[tuple[tuple[Any, ...], Any, Any, None]]:
        """Each row's planes as the pool's codec stores them (latent codec planes, rope,
        index; no exact latent)."""

        def one(row: Row, tensor: str) -> Any:
            held = row.planes.get(tensor)
            return None if held is None else held[0]

        return [
            (r.planes.get("latent", ()), one(r, "rope"), one(r, "index"), None)
            for r in self._pool_rows()
        ]

    def _state_planes(self) -> tuple[Any, Any, Any]:
        """Every row's planes as the pool's codec stores them, right-justified: a stage-0
        row's exact columns encoded per token (what its conversion writes), zeros in the
        pads."""
        if self.width == 0:
            return None, None, None
        last = len(self._stages) - 1
        image = Storage._part_image(self, last, self._pool_rows(), self._columns(), 0)
        index = image.get("index")
        return image["latent"], image["rope"][0], None if index is None else index[0]


PagedLatentCache.serial_class = PagedLatentCache  # type: ignore[assignment]  # its own serial
LatentBlockPool.latent_cache_class = PagedLatentCache
