"""The reference's ``PagedLatentCache`` (``spec/PagedLatentCache.md``): MLA latent planes in
a NumPy block pool.

The row semantics are ``MLACache``'s (``kvrows.latent.LatentRows``), the block bookkeeping
the paged core's (``kvrows.paged_latent``); this module binds them to the NumPy plane
operations of ``reference/paged.py`` (slot by slot) and the reference latent's array hooks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvrows.compositions import composition
from kvrows.paged_latent import LatentBlockPoolBase, PagedLatentRows
from kvrows.reference.codecs import numpy_dtype
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
