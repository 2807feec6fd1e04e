"""The optimized ``PagedLatentCache`` (``spec/PagedLatentCache.md``): MLA latent planes in an
MLX block pool.

The row semantics are ``MLACache``'s (``kvrows.latent.LatentRows``), the block bookkeeping
the paged core's (``kvrows.paged_latent``); this module binds them to the MLX plane
operations of ``optimized/paged.py`` (one slice write per run of whole blocks, whole blocks
taken on reads) and the optimized latent's array hooks.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvrows.compositions import composition
from kvrows.errors import InvalidInputError
from kvrows.optimized.latent import _LatentOptimized
from kvrows.optimized.paged import MlxPlaneOps
from kvrows.paged_latent import LatentBlockPoolBase, PagedLatentRows

__all__ = ["LatentBlockPool", "PagedLatentCache"]


class LatentBlockPool(LatentBlockPoolBase):
    """One MLA layer's blocks in MLX planes."""

    ops = MlxPlaneOps()


class PagedLatentCache(PagedLatentRows, _LatentOptimized):
    """MLA latent + rope (+ DSA index) planes in a block pool, ``MLACache``'s rows
    (``spec/PagedLatentCache.md``)."""

    composition = composition("PagedLatentCache")
    pool_class = LatentBlockPool

    def planes(self) -> Any:
        """The stored planes right-justified (``MLACache``'s optimized form)."""
        return self.batch_planes()

    def preview(self, latent: mx.array, rope: mx.array) -> tuple[mx.array, mx.array]:
        """What ``append(latent, rope, index)`` will return for the latent and rope,
        changing nothing (the drop-in's staged DSA append)."""
        self._spec_usable()
        latent, rope, _, four, _, _, _ = self._checked_blocks(latent, rope, None, staged=True)
        if not four:
            raise InvalidInputError(f"{type(self).__name__}.preview takes [B, 1, N, W] blocks")
        if not self.width:
            return latent, rope
        held_latent, held_rope, _ = self._impl_read([True] * self.batch_size)
        return (
            mx.concatenate([held_latent, latent], axis=2),
            mx.concatenate([held_rope, rope], axis=2),
        )


LatentBlockPool.latent_cache_class = PagedLatentCache
