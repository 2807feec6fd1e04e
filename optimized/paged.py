"""The optimized paged storages: the paged placement (``optimized/paging.py``) on the
optimized row machinery (``spec/PagedKVCache.md``, ``spec/PagedKvRows.md``,
``spec/PagedLatentCache.md``, ``spec/paged-pool.md``). The paged latent is the latent
surface (``optimized/latent.py``) over that placement, its pool a ``BlockPool`` of a
``Latent`` codec (``LatentBlockPool``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from kvrows.codec import PlaneSet, as_role
from kvrows.compositions import composition
from kvrows.errors import InvalidInputError, PoolExhaustedError, preview_blocks_message
from kvrows.latent import LatentPoolMembers, PagedLatentMembers
from kvrows.optimized.geometries.chunked import ChunkedSurface
from kvrows.optimized.latent import LatentSurface
from kvrows.optimized.paging import (
    BlockPool,
    PagedChunked,
    PagedLayout,
    PagedRing,
    PagedSerial,
    Planes,
    Table,
    rows_of,
)
from kvrows.optimized.rows import owned
from kvrows.optimized.speculative import SpeculativeLayout
from kvrows.paged import AnyCodecParameters

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


class PagedChunkedKVCache(PagedChunked, ChunkedSurface, AnyCodecParameters, PagedSerial):
    """One request's chunked-local attention as a block table (``spec/ChunkedKVCache.md``
    §7): ``ChunkedKVCache``'s rows, the blocks before the chunk back in the pool."""

    composition = composition("PagedChunkedKVCache")

    @property
    def retained(self) -> int:
        """Positions the request holds (its rows move together, as ``offset``)."""
        return self._tokens_held[0] if self._offsets else 0


class PagedChunkedRows(
    AnyCodecParameters, SpeculativeLayout, PagedChunked, ChunkedSurface, PagedLayout
):
    """Chunked-local block-table rows, all three roles (``spec/ChunkedKVCache.md`` §7)."""

    composition = composition("PagedChunkedRows")

    @property
    def width(self) -> int:
        """Columns a read returns (the longest held run)."""
        return max(self._tokens_held, default=0)

    @property
    def retained(self) -> tuple[int, ...]:
        """Positions each row holds."""
        return tuple(self._tokens_held)

    #: An exhausted pool refuses before any block or table changes: the round stays open,
    #: before its block (free blocks or append a shorter one, then resolve it).
    _spec_refused_unchanged = (PoolExhaustedError,)


BlockPool.cache_classes = {
    "growing": PagedKVCache,
    "ring": PagedRotatingKVCache,
    "chunked": PagedChunkedKVCache,
}


class LatentBlockPool(LatentPoolMembers, BlockPool):
    """One MLA layer's blocks in MLX planes: a ``BlockPool`` of a ``Latent`` codec (the
    latent through ``codec``, rope and index plain; ``spec/PagedLatentCache.md``)."""


class PagedLatentCache(PagedLatentMembers, LatentSurface, SpeculativeLayout, PagedLayout):
    """MLA latent + rope (+ DSA index) planes in a block pool, ``MLACache``'s rows
    (``spec/PagedLatentCache.md``): the latent surface on the paged placement; an encoded
    latent's warm rows are a contiguous ``MLACache`` of stage 0 beside the pool."""

    composition = composition("PagedLatentCache")
    pool_class = LatentBlockPool

    def register_prefix(self, row: int, token_ids: Sequence[int]) -> int:
        """Refused in a round: the row's newest positions are unverified drafts."""
        self._spec_guard("register_prefix")
        return super().register_prefix(row, token_ids)

    def held_arrays(self) -> tuple[Any, ...]:
        return PagedLayout.held_arrays(self)

    def _gathered(self) -> PlaneSet:
        """Every row's planes as the pool's codec stores them, right-justified (a row
        beside the pool: its exact columns encoded per token, what its conversion writes,
        zeros in the pads; ``{}`` while no row holds a position)."""
        if not any(self._offsets):
            return {}
        width, target = max(self._offsets), self._stages[-1]

        def beside(rows: list[int]) -> dict[str, Any]:
            mask = self._held_mask([self._offsets[b] for b in rows], width)
            return {
                t: tuple(
                    mx.where(mask, p, mx.array(0, p.dtype)) for p in target.encode(x, as_role(t))
                )
                for t, x in self._beside_read(rows, width).items()
            }

        out: PlaneSet = self._stacked(self._pool_gather, beside)
        mx.eval(*(p for ps in out.values() for p in ps))
        return out

    def planes(self) -> tuple[Planes, mx.array | None, mx.array | None, None]:
        """The stored planes right-justified: latent codec planes, rope, index."""
        held = self._gathered()

        def one(tensor: str) -> mx.array | None:
            return held[tensor][0] if tensor in held else None

        return held.get("latent", ()), one("rope"), one("index"), None

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
        as written; the others beside the pool, their latent ``exact``."""
        shapes = self._shapes()
        pool = self._pool
        done = list(converted) if converted is not None else [True] * len(offsets)
        tables: list[Table] = [[] for _ in offsets]
        if shapes is not None and width and planes is not None:
            held = planes

            def row_planes(b: int) -> PlaneSet:
                start = width - offsets[b]
                return {t: tuple(owned(p[b : b + 1, :, start:width]) for p in ps)
                        for t, ps in held.items()}  # fmt: skip

            rows = [(o, o, 0) if done[b] else (0, 0, 0) for b, o in enumerate(offsets)]
            pool, tables = self._write_fresh(shapes, rows, row_planes)
        elif pool is not None:
            tables = [pool.open([], touch=False) for _ in offsets]
        self._pool = pool
        self._tables[:] = tables
        self._offsets = list(offsets)
        if self._contiguous is not None:  # the warm rows: the contiguous layout's
            self._row_stage = [self._pool_stage if d else 0 for d in done]
            beside = self._beside_rows()
            near = [offsets[b] for b in beside]
            most = max(near, default=0)
            kept = None if planes is None or not most else {
                t: tuple(rows_of(p, beside, len(offsets))[:, :, width - most :] for p in ps)
                for t, ps in {**planes, "latent": (exact,)}.items()
            }  # fmt: skip
            self._contiguous._clear()
            if beside:
                self._contiguous._take_shapes(shapes)
                self._contiguous._adopt_state(kept, near, most)
            self._restaged()
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
        converted = self.converted
        if any(converted):
            codec = self._stages[-1]
            read = codec.fetched(codec.encode(latent, "latent"), "latent")
            rows = mx.array(list(converted))[:, None, None, None]
            block = mx.where(rows, read.astype(latent.dtype), latent)
        if self.width == 0:
            return block, rope
        held_latent, held_rope, _ = self.current()
        return (
            mx.concatenate([held_latent, block], axis=2),
            mx.concatenate([held_rope, rope], axis=2),
        )


LatentBlockPool.latent_cache_class = PagedLatentCache
