"""The optimized paged storages: the paged placement (``optimized/paging.py``) on the
optimized row machinery (``spec/PagedKVCache.md``, ``spec/PagedKvRows.md``,
``spec/PagedLatentCache.md``, ``spec/paged-pool.md``). The paged latent is the latent
surface (``optimized/latent.py``) over that placement, its pool a ``BlockPool`` of a
``Latent`` codec (``LatentBlockPool``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from kvrows.codec import PlaneSet
from kvrows.compositions import composition
from kvrows.errors import InvalidInputError, PoolExhaustedError, preview_blocks_message
from kvrows.latent import LatentPoolMembers, PagedLatentMembers
from kvrows.optimized.codecs import mlx_dtype
from kvrows.optimized.latent import LatentSurface
from kvrows.optimized.paging import (
    BlockPool,
    PagedLayout,
    PagedRing,
    PagedSerial,
    Planes,
    Table,
)
from kvrows.optimized.rows import owned
from kvrows.optimized.speculative import SpeculativeLayout
from kvrows.paged import AnyCodecParameters

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


class PagedKvRows(AnyCodecParameters, SpeculativeLayout, PagedLayout):
    """Block-table rows, all three roles (``spec/PagedKvRows.md``)."""

    composition = composition("PagedKvRows")

    #: An exhausted pool refuses before any block or table changes: the round stays open,
    #: before its block (free blocks or append a shorter one, then resolve it).
    _spec_refused_unchanged = (PoolExhaustedError,)

    def register_prefix(self, row: int, token_ids: Sequence[int]) -> int:
        """Refused in a round: the row's newest positions are unverified drafts."""
        self._spec_guard("register_prefix")
        return super().register_prefix(row, token_ids)


class PagedRotatingKVCache(PagedRing, AnyCodecParameters, PagedSerial):
    """One request's sliding window as a block table (``spec/PagedRotatingKVCache.md``):
    ``RotatingKVCache``'s window, its blocks out of the window back in the pool."""

    composition = composition("PagedRotatingKVCache")

    @property
    def retained(self) -> int:
        """Positions the request holds (its sinks and newest ones; its rows move together,
        as ``offset``: an int, the reference's)."""
        return self._retained[0] if self._retained else 0


class PagedRotatingRows(AnyCodecParameters, SpeculativeLayout, PagedRing, PagedLayout):
    """Sliding-window block-table rows, all three roles (``spec/PagedRotatingRows.md``)."""

    composition = composition("PagedRotatingRows")

    @property
    def retained(self) -> tuple[int, ...]:
        """Positions each row holds (its sinks and newest ones)."""
        return tuple(self._retained)

    #: An exhausted pool refuses before any block or table changes: the round stays open,
    #: before its block (free blocks or append a shorter one, then resolve it).
    _spec_refused_unchanged = (PoolExhaustedError,)


BlockPool.cache_classes = {"growing": PagedKVCache, "ring": PagedRotatingKVCache}


class LatentBlockPool(LatentPoolMembers, BlockPool):
    """One MLA layer's blocks in MLX planes: a ``BlockPool`` of a ``Latent`` codec (the
    latent through ``codec``, rope and index plain; ``spec/PagedLatentCache.md``)."""


class PagedLatentCache(PagedLatentMembers, LatentSurface, SpeculativeLayout, PagedLayout):
    """MLA latent + rope (+ DSA index) planes in a block pool, ``MLACache``'s rows
    (``spec/PagedLatentCache.md``): the latent surface on the paged placement."""

    composition = composition("PagedLatentCache")
    pool_class = LatentBlockPool

    def register_prefix(self, row: int, token_ids: Sequence[int]) -> int:
        """Refused in a round: the row's newest positions are unverified drafts."""
        self._spec_guard("register_prefix")
        return super().register_prefix(row, token_ids)

    def adopt_tables(self, tables: Sequence[Table], offset: int, count: int | None = None) -> None:
        super().adopt_tables(tables, offset, count)
        self._adopted(len(tables))

    def held_arrays(self) -> tuple[Any, ...]:
        return PagedLayout.held_arrays(self)

    def planes(self) -> tuple[Planes, mx.array | None, mx.array | None, None]:
        """The stored planes right-justified: latent codec planes, rope, index."""
        held = self._gathered()

        def one(tensor: str) -> mx.array | None:
            return held[tensor][0] if tensor in held else None

        return held.get("latent", ()), one("rope"), one("index"), None

    def _adopt_state(self, planes: PlaneSet | None, offsets: list[int], width: int) -> None:
        """Rows at ``offsets`` from right-justified ``planes``, written into fresh blocks
        (every block taken at once: a refusal changes nothing), counted as written."""
        shapes = self._shapes()
        pool = self._pool
        tables: list[Table] = [[] for _ in offsets]
        if shapes is not None and width and planes is not None:
            held = planes

            def row_planes(b: int) -> PlaneSet:
                start = width - offsets[b]
                return {t: tuple(owned(p[b : b + 1, :, start:width]) for p in ps)
                        for t, ps in held.items()}  # fmt: skip

            rows = [(offset, offset, 0) for offset in offsets]
            pool, tables = self._write_fresh(shapes, rows, row_planes)
        elif pool is not None:
            tables = [pool.open([], touch=False) for _ in offsets]
        self._pool = pool
        self._tables[:] = tables
        self._offsets = list(offsets)
        self._changed()
        self._watch()

    def preview(self, latent: mx.array, rope: mx.array) -> tuple[mx.array, mx.array]:
        """What ``append(latent, rope, index)`` will return for the latent and rope,
        changing nothing (the drop-in's staged DSA append): converted rows see the block
        decoded, warm rows exact."""
        self._spec_usable()
        four, _, _, _ = self._checked(latent, rope, None, staged=True)
        if not four:
            raise InvalidInputError(preview_blocks_message(type(self).__name__))
        block = latent
        if self.encoded and any(self._done):
            read = self.codec.fetched(self.codec.encode(latent, "latent"), "latent")
            rows = mx.array(list(self._done))[:, None, None, None]
            block = mx.where(rows, read.astype(latent.dtype), latent)
        if self.width == 0:
            return block, rope
        held_latent, held_rope, _ = self.current()
        return (
            mx.concatenate([held_latent, block], axis=2),
            mx.concatenate([held_rope, rope], axis=2),
        )

    # -- the warm-up exact latents beside the pool ------------------------------------------
    def _warm_cat(self, held: Any | None, block: Any, row: int) -> Any:
        part = block[row : row + 1]
        joined = owned(part if held is None else mx.concatenate([held, part], axis=2))
        mx.eval(joined)
        return joined

    def _warm_cut(self, held: Any, keep: int) -> Any:
        cut = owned(held[:, :, :keep])
        mx.eval(cut)
        return cut

    def _row_slice(self, array: Any, row: int, start: int, stop: int) -> Any:
        piece = owned(array[row : row + 1, :, start:stop])
        mx.eval(piece)
        return piece

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
        shapes = self._shapes()
        assert shapes is not None
        zeros = mx.zeros((len(rows), 1, width, shapes.rank), mlx_dtype(shapes.dtype))
        stacked = owned(self._overlay(zeros, rows))
        mx.eval(stacked)
        return stacked


LatentBlockPool.latent_cache_class = PagedLatentCache
