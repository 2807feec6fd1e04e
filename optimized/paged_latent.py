"""The optimized ``PagedLatentCache`` (``spec/PagedLatentCache.md``): MLA latent planes in an
MLX block pool.

The row semantics are ``MLACache``'s (``kvrows.latent.LatentRows``), the block bookkeeping
the paged core's (``kvrows.paged_latent``); this module binds them to the MLX plane
operations of ``optimized/paging.py`` (one slice write per run of whole blocks, whole blocks
taken on reads) and the optimized latent's array hooks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from kvrows.compositions import composition
from kvrows.errors import InvalidInputError, preview_blocks_message
from kvrows.optimized.codecs import dtype_name, make_codec, mlx_dtype
from kvrows.optimized.latent import _LatentOptimized
from kvrows.optimized.paging import copy_block, gather, scatter
from kvrows.optimized.rows import owned
from kvrows.paged_latent import LatentBlockPoolBase, PagedLatentRows, Piece, Planes
from kvrows.schemes import CodecSpec

__all__ = ["LatentBlockPool", "PagedLatentCache"]


class MlxPlaneOps:
    """The latent pool's plane operations on MLX arrays (the paged placement's scatter and
    gather runs, ``optimized/paging.py``)."""

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
        scatter(planes, pieces, source)
        return planes

    def copy_block(self, planes: Planes, target: int, origin: int, count: int) -> Planes:
        copy_block(planes, target, origin, count)
        return planes

    def gather(
        self,
        planes: Planes,
        rows: Sequence[tuple[Sequence[int], int]],
        pads: Sequence[int],
        width: int,
    ) -> Planes:
        return gather(planes, rows, pads, width)

    def row_slice(self, plane: Any, row: int, start: int, stop: int) -> Any:
        piece = owned(plane[row : row + 1, :, start:stop])
        mx.eval(piece)
        return piece


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
            raise InvalidInputError(preview_blocks_message(type(self).__name__))
        block = latent
        if self.encoded:  # rows that read encoded see the block as it will be stored
            planes = self._codec.encode(latent, "latent")
            reads_exact = [not c for c in self.converted] or [True] * int(latent.shape[0])
            rows = mx.array(reads_exact)[:, None, None, None]
            block = mx.where(rows, latent, self._decode_latent(planes, dtype_name(latent)))
        if not self.width:
            return block, rope
        held_latent, held_rope, _ = self._impl_read([not c for c in self.converted])
        return (
            mx.concatenate([held_latent, block], axis=2),
            mx.concatenate([held_rope, rope], axis=2),
        )

    def _warm_cat(self, held: Any | None, block: Any, row: int) -> Any:
        part = block[row : row + 1]
        joined = owned(part if held is None else mx.concatenate([held, part], axis=2))
        mx.eval(joined)
        return joined

    def _warm_cut(self, held: Any, keep: int) -> Any:
        cut = owned(held[:, :, :keep])
        mx.eval(cut)
        return cut

    def _decode_latent(self, planes: Sequence[Any], dtype: str | None = None) -> Any:
        dtype = dtype or self._dtype
        assert dtype is not None
        return self._codec.decoded(tuple(planes), "latent", dtype)

    def _overlay(self, dense: Any, rows: Sequence[Any | None]) -> Any:
        if all(row is None for row in rows):
            return dense
        width = int(dense.shape[2])
        parts = []
        for b, row in enumerate(rows):
            if row is None:
                parts.append(dense[b : b + 1])
                continue
            pad = width - int(row.shape[2])
            parts.append(row if not pad else mx.concatenate([dense[b : b + 1, :, :pad], row], 2))
        return mx.concatenate(parts, axis=0)

    def _stack_warm(self, rows: Sequence[Any | None], width: int) -> Any:
        assert self._widths is not None and self._dtype is not None
        zeros = mx.zeros((len(rows), 1, width, self._widths[0]), mlx_dtype(self._dtype))
        stacked = owned(self._overlay(zeros, rows))
        mx.eval(stacked)
        return stacked


LatentBlockPool.latent_cache_class = PagedLatentCache
