"""The optimized paged storages: the paged placement (``optimized/paging.py``) on the
optimized row machinery (``spec/PagedKVCache.md``, ``spec/PagedKvRows.md``,
``spec/PagedLatentCache.md``, ``spec/paged-pool.md``). The paged latent is the latent
surface (``optimized/latent.py``) over that placement, its pool a ``BlockPool`` of a
``Latent`` codec (``LatentBlockPool``)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import mlx.core as mx

from kvrows.codec import PlaneSet, as_role
from kvrows.compositions import composition
from kvrows.errors import InvalidInputError, PoolExhaustedError, preview_blocks_message
from kvrows.latent import LatentPoolMembers, PagedLatentMembers
from kvrows.optimized.geometries.chunked import ChunkedSurface
from kvrows.optimized.latent import DecodedWindow, LatentSurface, encodes_latent
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
from kvrows.validation import round_up

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


class PagedLatentCache(
    DecodedWindow, PagedLatentMembers, LatentSurface, SpeculativeLayout, PagedLayout
):
    """MLA latent + rope (+ DSA index) planes in a block pool, ``MLACache``'s rows
    (``spec/PagedLatentCache.md``): the latent surface on the paged placement; an encoded
    latent's warm rows are a contiguous ``MLACache`` of stage 0 beside the pool.

    An encoded latent's reads take the pool's rows' latent from the **decoded window**
    (``DecodedWindow``; spec §7): ``[rows in the pool, 1, capacity, R]`` at the read's
    own columns (right-justified from column 0), built by the first append after a change
    dropped it, extended by each append; the pool's gather then reads rope and index
    only."""

    composition = composition("PagedLatentCache")
    pool_class = LatentBlockPool

    # -- the decoded window ---------------------------------------------------------------
    def _pool_write(
        self,
        block: PlaneSet,
        n: int,
        geometry: Any,
        rows: int,
        pooled: Sequence[int],
        room: int | None = None,
    ) -> None:
        """The placement's; records the encoded latent block its pooled rows append."""
        if pooled and encodes_latent(self._stages[-1]):
            self._written = block.get("latent")
        super()._pool_write(block, n, geometry, rows, pooled, room)

    def _write_blocks(self, blocks: dict[str, Any], shapes: Any) -> None:
        """The placement's write; a window held before it takes the block's codes decoded
        at the columns they went to (every row's newest: right-justified rows share the
        write columns), in a window of more capacity when the width outgrew it (one copy).
        With none held, the write builds it (the read after it would decode every column
        anyway)."""
        kept, self._written = self._dense_window, None
        pooled = self._split()[0] if self._offsets else None
        super()._write_blocks(blocks, shapes)
        written, self._written = self._written, None
        if not self.keeps_window or not encodes_latent(self._stages[-1]):
            return
        rows, stop = self._split()[0], self.width
        if kept is None or kept[0] is not self._pool or rows != pooled or written is None:
            self._dense_window = self._built_window(rows)
            return
        window = kept[1]
        if stop > int(window.shape[2]):  # one copy into more columns
            pads = [(0, 0), (0, 0), (0, round_up(stop + 1) - int(window.shape[2])), (0, 0)]
            window = mx.pad(window, pads)
        self._decode_into(window, self._stages[-1], written, stop)
        self._dense_window = (self._pool, window)

    def _built_window(self, rows: list[int]) -> tuple[object, mx.array] | None:
        """The pool's rows (``rows``) read from their codes, decoded once and laid from
        column 0 (``None``: no row in the pool holds a position)."""
        if not rows or self._pool is None or not any(self._offsets[b] for b in rows):
            return None
        codes = self._pool_gather(rows, ("latent",))["latent"]
        capacity = round_up(self.width + 1)
        window = self._laid_window(self._stages[-1], codes, len(rows), 0, capacity)
        return self._pool, window

    def _trim_rows(self, counts: Sequence[int], *, justify: bool = False) -> int:
        """The placement's. Rows that forget equal counts keep their columns (each row is
        right-justified to the longest: its first column does not move), so the window
        is kept; a ragged rollback moves rows' columns, and drops it (the next append
        builds it again)."""
        kept = self._dense_window
        trimmed = super()._trim_rows(counts, justify=justify)
        if kept is not None and len(set(counts)) == 1:
            self._dense_window = kept
        return trimmed

    def _convert_rows(self, rows: Sequence[int]) -> None:
        """The placement's; rows that move into the pool change the window's rows: it is
        dropped (the next append builds it again)."""
        super()._convert_rows(rows)
        if rows:
            self._dense_window = None

    def _window_view(self) -> mx.array | None:
        window = self._dense_window
        if window is None or window[0] is not self._pool:
            return None
        return window[1][:, :, : self.width]

    def _pool_read(self, rows: list[int]) -> dict[str, Any]:
        """The placement's read of the pool's rows; with a window held, their latent is
        its columns and the gather reads the other tensors only (plain planes)."""
        view = self._window_view()
        if view is None or int(view.shape[0]) != len(rows):
            return super()._pool_read(rows)
        others: Collection[str] = ("rope", "index")
        gathered = self._pool_gather(rows, others)
        return {"latent": view, **{t: p[0] for t, p in gathered.items()}}

    @property
    def nbytes(self) -> int:
        """The placement's (blocks held, the rows beside the pool) and the window."""
        return int(super().nbytes) + self.window_nbytes

    @property
    def beside_nbytes(self) -> int:
        """The placement's bytes beside the pool, and the window."""
        return int(super().beside_nbytes) + self.window_nbytes

    def register_prefix(self, row: int, token_ids: Sequence[int]) -> int:
        """Refused in a round: the row's newest positions are unverified drafts."""
        self._spec_guard("register_prefix")
        return super().register_prefix(row, token_ids)

    def held_arrays(self) -> tuple[Any, ...]:
        held = PagedLayout.held_arrays(self)
        view = self._window_view()
        return held if view is None else (*held, view)

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
