"""The reference's ``PagedLatentCache`` (``spec/PagedLatentCache.md``): MLA latent planes in
a NumPy block pool.

The row semantics are ``MLACache``'s (``kvrows.latent.LatentRows``), the block bookkeeping
the paged core's (``kvrows.paged_latent``); this module binds them to the NumPy plane
operations of ``reference/paged.py`` (slot by slot) and the reference latent's array hooks.
"""

from __future__ import annotations

from typing import Any

from kvrows.compositions import composition
from kvrows.paged_latent import LatentBlockPoolBase, PagedLatentRows
from kvrows.reference.latent import _LatentReference
from kvrows.reference.paged import NumpyPlaneOps

__all__ = ["LatentBlockPool", "PagedLatentCache"]


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


LatentBlockPool.latent_cache_class = PagedLatentCache
