"""The reference's paged placement: compact rows whose tokens also live in a block pool.

A paged row is still a compact :class:`~kvrows.reference.rows.Row` (its retained tokens,
oldest first: what it *means*); a paged placement also writes every token into the
reference pool's NumPy blocks through the row's block table (:class:`PagedRow`), reads
assemble from the pool, and ``check_valid`` asserts that each row's gathered blocks
equal its compact planes, so the pool is what the conformance suite tests.

Which block belongs to whom is the core's int-only ledger (``kvrows.paged.BlockLedger``:
reference counts, free queue, prefix hash chain, eviction); the tables, the planes and
every move of bytes are written here, as plainly as possible: a token slot is
``planes[block, :, within]``, written and read one position at a time.

* An append takes every block its rows need at once (``PoolExhaustedError`` with nothing
  changed); a row whose partly filled tail block another table holds, or that caches a
  prefix, first copies that block (copy on write, counted in ``bytes_copied``).
* Rows of the pool merge, extract and publish by sharing their tables (no byte moves);
  rows of another pool are copied into fresh blocks (counted); a trim releases the
  blocks past a row's end.
* The storages are the reference's row machinery (:class:`SerialStorage`,
  :class:`~kvrows.reference.speculative.SpeculativeLayout`) over the growing geometry's
  hooks (a paged row keeps every token); the layout's rows are right-aligned
  (:class:`RightAligned`: ``left_pad[b] = max offset - offset[b]``, virtual).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, cast

import numpy as np
import numpy.typing as npt

from kvrows.codec import PlaneSet, as_role
from kvrows.common import shapes_token_bytes
from kvrows.errors import (
    EMPTY_CACHE_NO_BLOCK,
    EMPTY_ROW_NO_BLOCK,
    NOTHING_TO_FETCH,
    PROJECTED_BYTES_NEEDS_GEOMETRY,
    LayoutStateError,
    PoolExhaustedError,
    paged_merge_message,
    request_rows_message,
)
from kvrows.forms import pack_state
from kvrows.paged import (
    FREE,
    Paged,
    PagedSurface,
    PoolBase,
    bind_paged,
    held_blocks,
    held_positions,
    projected_blocks,
)
from kvrows.paged_forms import PagedState, codec_field, parse_state
from kvrows.protocols import Mask
from kvrows.reference.codecs import Codec, dtype_name, make_codec
from kvrows.reference.geometries.chunked import ChunkedAxis, chunk_mask
from kvrows.reference.geometries.growing import PaddedRows
from kvrows.reference.rows import (
    Row,
    RowLayout,
    SerialStorage,
    Storage,
    TokenAxis,
    make_axis,
    zero_planes,
)
from kvrows.reference.speculative import SpeculativeLayout
from kvrows.schemes import CodecSpec
from kvrows.validation import KvGeometry, as_count, check_keep, check_row

__all__ = ["BlockPool", "PagedLayout", "PagedRow", "PagedRows", "PagedSerial", "RightAligned"]


@dataclass(eq=False)
class PagedRow(Row):
    """A compact row and its block table: the pool blocks holding its positions, in
    logical order (``ceil(offset / block_size)`` of them; ``FREE`` for a block none of
    whose positions the row holds any more: a ring's, out of its window)."""

    blocks: list[int] = field(default_factory=list)

    def positions(self) -> list[int]:
        """The positions the row holds, oldest first (its compact planes' columns)."""
        return held_positions(self.offset, self.holding(), self.sinks)

    def needed(self, block_size: int) -> set[int]:
        """The logical blocks holding one of its positions."""
        return held_blocks(self.offset, self.holding(), self.sinks, block_size)

    def holding(self) -> int:
        """Positions the row holds."""
        # A table without compact planes (the pool driven alone) holds every position.
        return self.retained if self.held else self.offset


def _live(blocks: Sequence[int]) -> list[int]:
    """The blocks a table holds (``FREE`` entries hold none)."""
    return [b for b in blocks if b != FREE]


def _view(row: Row, cut: Row) -> PagedRow:
    """``cut`` (what a merge or an extraction takes of ``row``: its window) over ``row``'s
    blocks, for reading them."""
    blocks = cast(PagedRow, row).blocks
    return PagedRow(cut.planes, cut.offset, sinks=cut.sinks, blocks=blocks)


def _shape(array: object) -> tuple[int, ...]:
    return tuple(int(x) for x in array.shape) if isinstance(array, np.ndarray) else ()


def _owned(planes: PlaneSet) -> PlaneSet:
    return {t: tuple(np.array(p, copy=True) for p in ps) for t, ps in planes.items()}


def _release_rows(pool_ref: weakref.ref[BlockPool], rows: list[Row]) -> None:
    pool = pool_ref()
    if pool is not None:
        pool.close(rows)


class BlockPool(PoolBase):
    """One layer's blocks in NumPy planes, shared by every request of the layer
    (``spec/paged-pool.md``).

    ``codec``: the codec spec of every block (default ``Plain()``); ``block_size``: tokens
    per block; ``num_blocks``: blocks allocated once the KV geometry is known (declared
    here or learnt from the first write); ``max_bytes``: the most bytes the pool's planes
    may take (growth past it raises ``PoolExhaustedError``).
    """

    #: The reference's paged serial caches by geometry kind (what ``lookup_prefix``
    #: returns: ``PagedKVCache``, ``PagedRotatingKVCache``).
    cache_classes: ClassVar[dict[str, type[PagedSerial]]]
    codec: Codec
    _tables: dict[int, PagedRow]

    def _make_codec(self, spec: CodecSpec) -> Codec:
        return make_codec(spec)

    # -- what it holds -------------------------------------------------------------------
    def live_tables(self) -> tuple[PagedRow, ...]:
        """The rows whose tables are live (each holds its blocks once)."""
        return tuple(self._tables.values())

    # -- geometry and growth -------------------------------------------------------------
    def _grow_to(self, total: int) -> None:
        """The ledger's growth: every plane gains zero blocks up to ``total``."""
        g = self._geometry
        assert g is not None
        count, bs = total - self.num_blocks, self.block_size
        fresh = zero_planes(self.codec, g, count, bs)
        if not self._planes:
            self._planes = fresh
            return
        self._planes = {
            t: tuple(
                np.concatenate([old, new], axis=0)
                for old, new in zip(self._planes[t], fresh[t], strict=True)
            )
            for t in fresh
        }

    # -- tables --------------------------------------------------------------------------
    def open(self, row: PagedRow, *, touch: bool = True) -> PagedRow:
        """Make ``row`` a live table (its blocks counted once more unless they were just
        allocated for it)."""
        if touch:
            self.ledger.touch(_live(row.blocks))
        self._opened(row)
        return row

    def _opened(self, row: PagedRow) -> None:
        """``row``'s table is live (journaled: an undo forgets it)."""
        self._tables[id(row)] = row
        self.ledger.journal(lambda: self._tables.pop(id(row), None))

    def _journal_row(self, row: PagedRow) -> None:
        """Journal putting back ``row``'s table as it is now (an undoable operation edits
        it): its blocks list (a copy) and the fields a close clears."""
        if self.ledger.journaling:
            blocks, held = row.blocks, (list(row.blocks), row.planes, row.offset)

            def undo() -> None:
                blocks[:] = held[0]
                row.blocks, row.planes, row.offset = blocks, held[1], held[2]

            self.ledger.journal(undo)

    def share(self, row: Row, cut: Row) -> PagedRow:
        """A second row holding ``cut`` of ``row`` (its window): its compact planes, the
        blocks of ``row`` holding its positions shared (no byte of the pool moves)."""
        needed = _view(row, cut).needed(self.block_size)
        blocks = [b if j in needed else FREE for j, b in enumerate(cast(PagedRow, row).blocks)]
        shared = PagedRow(_owned(cut.planes), cut.offset, sinks=cut.sinks, blocks=blocks)
        return self.open(shared)

    def adopt_empty(self, rows: Sequence[Row]) -> None:
        """Make empty rows made before the pool existed live tables of this pool."""
        for row in rows:
            if id(row) not in self._tables:
                assert not cast(PagedRow, row).blocks and row.offset == 0
                self._opened(cast(PagedRow, row))

    def close(self, rows: Sequence[Row]) -> None:
        """Release every row's table (each tail block first); the row then holds nothing."""
        for row in rows:
            if self._tables.pop(id(row), None) is not None:
                paged = cast(PagedRow, row)
                self.ledger.release(reversed(_live(paged.blocks)))
                self._journal_row(paged)
                self.ledger.journal(functools.partial(self._tables.__setitem__, id(paged), paged))
                paged.blocks, paged.planes, paged.offset = [], {}, 0

    def release_tail(self, row: Row) -> None:
        """Release the blocks past ``row``'s end (after a trim), tail first."""
        paged = cast(PagedRow, row)
        keep = self.blocks_for(paged.offset)
        self.ledger.release(reversed(_live(paged.blocks[keep:])))
        self._journal_row(paged)
        del paged.blocks[keep:]

    def release_outside(self, row: Row) -> None:
        """Give back the blocks none of whose positions ``row`` holds any more (a ring's,
        out of its window; tail first), their table entries ``FREE``."""
        paged = cast(PagedRow, row)
        needed = paged.needed(self.block_size)
        gone = [j for j, b in enumerate(paged.blocks) if b != FREE and j not in needed]
        if gone:
            self.ledger.release(reversed([paged.blocks[j] for j in gone]))
            self._journal_row(paged)
            for j in gone:
                paged.blocks[j] = FREE

    # -- writes --------------------------------------------------------------------------
    def append(self, rows: Sequence[Row], block: PlaneSet, n: int) -> None:
        """Row ``b`` of the encoded ``block`` (``[B, H, n, ·]`` per plane) goes after row
        ``b``'s positions (its ``offset`` is not advanced here: the row machinery does
        that): every block the rows need is taken at once (``PoolExhaustedError`` with
        nothing changed), then partly filled tails another table holds or that cache a
        prefix are copied (copy on write), then the tokens are written."""
        ledger = self.ledger
        tables = [cast(PagedRow, row) for row in rows]
        plans = self._append_plans(tables, n)
        fresh = ledger.allocate(sum(int(cow) + new for cow, new in plans))
        for b, (table, (cow, new)) in enumerate(zip(tables, plans, strict=True)):
            if cow or new:
                self._journal_row(table)
            if cow:
                self._copy_tail(table, fresh.pop())
            table.blocks.extend(fresh[:new])
            del fresh[:new]
            positions = range(table.offset, table.offset + n)
            self._write_tokens(
                table, positions, {t: tuple(p[b] for p in ps) for t, ps in block.items()}
            )
        ledger.bytes_written += len(tables) * n * self.token_bytes

    def _append_plans(self, tables: Sequence[PagedRow], n: int) -> list[tuple[bool, int]]:
        """Per row of an append of ``n`` tokens: whether its tail block is copied first
        (copy on write) and how many new blocks it takes."""
        bs, ledger = self.block_size, self.ledger
        plans: list[tuple[bool, int]] = []
        for table in tables:
            partial = table.offset % bs > 0
            # A partly filled tail another table holds or that caches a prefix is copied;
            # one the row gave back (a chunked row that holds nothing) is replaced.
            renew = partial and (table.blocks[-1] == FREE or not ledger.writable(table.blocks[-1]))
            plans.append((renew, self.blocks_for(table.offset + n) - len(table.blocks)))
        return plans

    def append_need(self, rows: Sequence[Row], n: int) -> int:
        """The fresh blocks ``append(rows, ·, n)`` takes (copies on write and new blocks)."""
        plans = self._append_plans([cast(PagedRow, row) for row in rows], n)
        return sum(int(cow) + new for cow, new in plans)

    def _write_tokens(self, table: PagedRow, positions: Sequence[int], tokens: PlaneSet) -> None:
        """Write ``tokens`` (``[H, n, ·]`` per plane) at ``positions`` of ``table``, one
        position at a time."""
        if not positions:  # (a pool that took no block yet has no planes)
            return
        bs = self.block_size
        for tensor, planes in tokens.items():
            for plane, source in zip(self._planes[tensor], planes, strict=True):
                for i, position in enumerate(positions):
                    plane[table.blocks[position // bs], :, position % bs] = source[:, i]

    def _copy_tail(self, table: PagedRow, target: int) -> None:
        """Copy the partly filled tail block of ``table`` into ``target``, which replaces it
        (a ``FREE`` tail, none of whose positions the row holds: nothing to copy)."""
        fill = table.offset % self.block_size
        old = table.blocks[-1]
        if old == FREE:
            table.blocks[-1] = target
            return
        for planes in self._planes.values():
            for plane in planes:
                plane[target, :, :fill] = plane[old, :, :fill]
        self.ledger.release([old])
        table.blocks[-1] = target
        self.ledger.bytes_copied += fill * self.token_bytes

    def blocks_of(self, row: Row) -> int:
        """Blocks a row holding ``row``'s positions takes."""
        return len(held_blocks(row.offset, row.retained, row.sinks, self.block_size))

    def fresh_rows(self, rows: Sequence[PagedRow]) -> None:
        """Give ``rows`` (no table yet) fresh blocks for their positions, every block taken
        at once (a refusal changes nothing); not opened, nothing written."""
        fresh = self.ledger.allocate(sum(self.blocks_of(row) for row in rows))
        for row in rows:
            self._journal_row(row)
            needed = row.needed(self.block_size)
            row.blocks = [
                fresh.pop(0) if j in needed else FREE for j in range(self.blocks_for(row.offset))
            ]

    def copy_in(self, sources: Sequence[tuple[BlockPool, Row, Row]]) -> list[PagedRow]:
        """New rows of this pool holding copies of ``cut`` of rows of other pools (``(pool,
        row, cut)``: read from their pools, counted as copied); every block is taken at
        once, so a refusal changes nothing."""
        copies = [
            PagedRow(_owned(cut.planes), cut.offset, sinks=cut.sinks) for _, _, cut in sources
        ]
        self.fresh_rows(copies)
        for (source, row, cut), copy in zip(sources, copies, strict=True):
            self.open(copy, touch=False)
            if cut.offset:
                self.write_rows([copy], source.gather([_view(row, cut)], [0], cut.retained), 0)
                self.ledger.bytes_copied += cut.retained * self.token_bytes
        return copies

    def write_rows(self, rows: Sequence[PagedRow], planes: PlaneSet, start: int) -> None:
        """Write row ``b`` of ``planes`` (``[B, H, ·, ·]``), its columns from ``start`` on,
        at ``rows[b]``'s positions (its allocated blocks)."""
        for b, row in enumerate(rows):
            self._write_tokens(
                row,
                row.positions(),
                {t: tuple(p[b, :, start:] for p in ps) for t, ps in planes.items()},
            )

    def _keep_blocks(self, blocks: list[int]) -> None:
        """Save the bytes of ``blocks`` (cached blocks an undoable allocation takes) and
        journal writing them back."""
        planes = self._planes
        saved = {t: tuple(p[blocks].copy() for p in ps) for t, ps in planes.items()}

        def put_back() -> None:
            for tensor, held in planes.items():
                for plane, kept in zip(held, saved[tensor], strict=True):
                    plane[blocks] = kept

        self.ledger.journal(put_back)

    # -- reads ---------------------------------------------------------------------------
    def gather(self, rows: Sequence[Row], pads: Sequence[int], width: int) -> PlaneSet:
        """Each tensor's planes ``[B, H, width, ·]``: row ``b``'s positions, read from its
        blocks oldest first, at columns ``[pads[b], pads[b] + retained)``, zeros
        elsewhere; owned arrays."""
        held = [(cast(PagedRow, row).blocks, cast(PagedRow, row).positions()) for row in rows]
        return self._gather(held, pads, width)

    def _gather(
        self, rows: Sequence[tuple[Sequence[int], Sequence[int]]], pads: Sequence[int], width: int
    ) -> PlaneSet:
        """:meth:`gather` of ``(blocks, positions)`` per row."""
        bs = self.block_size
        out: PlaneSet = {}
        held = self._planes
        if not held and self._geometry is not None:  # no block yet: every row reads zeros
            held = zero_planes(self.codec, self._geometry, 0, bs)
        for tensor, planes in held.items():
            images: list[npt.NDArray[Any]] = []
            for plane in planes:
                image = np.zeros((len(rows), plane.shape[1], width, plane.shape[3]), plane.dtype)
                for b, ((blocks, positions), pad) in enumerate(zip(rows, pads, strict=True)):
                    for i, position in enumerate(positions):
                        image[b, :, pad + i] = plane[blocks[position // bs], :, position % bs]
                images.append(image)
            out[tensor] = tuple(images)
        return out

    # -- the prefix cache ----------------------------------------------------------------
    def register_prefix(self, row: Row, token_ids: Sequence[int], cap: int | None = None) -> int:
        """Hash the full blocks of ``row`` that ``token_ids`` covers (at most its
        positions; ``cap``: a ring's window, and nothing once the row gave a position
        back: ``PoolBase.register_blocks``); returns how many blocks are now cached."""
        paged = cast(PagedRow, row)
        return self.register_blocks(paged.blocks, (row.offset, paged.holding()), token_ids, cap)

    def _adopt_hit(self, cache: Any, hits: list[int]) -> None:
        row = PagedRow(offset=len(hits) * self.block_size, blocks=hits, sinks=cache._sinks)
        # What the hit means: every position of its blocks (a row that gave none back).
        row.planes = self._gather([(hits, range(row.offset))], [0], row.offset)
        cache.adopt_rows([self.open(row)])

    def check_valid(self) -> None:
        """Assert the pool's invariants (``spec/paged-pool.md`` §4) and that every live
        row's blocks hold its compact planes."""
        # A snapshot: a cache's finalizer may release its rows while we iterate.
        rows = list(self._tables.values())
        self.ledger.check_valid(_live(r.blocks) for r in rows)
        for row in rows:
            if row.offset and not row.blocks:
                continue  # a warm row beside the pool (stage 0): its cache checks it
            assert len(row.blocks) == self.blocks_for(row.offset), "no empty tail block"
            needed = row.needed(self.block_size)
            assert all((b != FREE) == (j in needed) for j, b in enumerate(row.blocks)), (
                "a row holds exactly the blocks of its positions"
            )
            check_mirrored(self, row)


def check_mirrored(pool: BlockPool, row: Row) -> None:
    """Assert that ``row``'s blocks, gathered, are its compact planes."""
    if row.offset == 0:
        assert row.retained == 0, "a row at offset 0 holds no token"
        return
    gathered = pool.gather([row], [0], row.retained)
    assert set(gathered) == set(row.planes), "the pool holds the row's tensors"
    for tensor, planes in row.planes.items():
        for mine, pooled in zip(planes, gathered[tensor], strict=True):
            assert np.array_equal(mine, pooled), "a row's blocks differ from its planes"


class RightAligned(PaddedRows):
    """The paged layout's placement: every row ends at the layout's longest row
    (``pad = max offset - offset``, recomputed after every change; nothing is padded in
    the pool)."""

    def __init__(self) -> None:
        super().__init__(shared=False)

    @staticmethod
    def realign(rows: Sequence[Row]) -> None:
        top = max((r.offset for r in rows), default=0)
        for row in rows:
            row.pad = top - row.offset

    def join(self, rows: Sequence[Row], running: int) -> None:
        self.realign(rows)

    def filter(self, rows: Sequence[Row]) -> None:
        self.realign(rows)

    def trimmed(self, rows: Sequence[Row], counts: Sequence[int], *, justify: bool = False) -> None:
        self.realign(rows)


class RightAlignedChunks(RightAligned):
    """The paged layout's placement under the chunked geometry: every row ends at the
    column of the layout's longest held run (``pad = max retained - retained``); before
    every append each row keeps its newest ``chunk_size`` tokens (the chunked axis's front
    trim), and masks are the chunked rule over those columns."""

    def __init__(self, axis: ChunkedAxis) -> None:
        super().__init__()
        self.axis = axis

    @staticmethod
    def realign(rows: Sequence[Row]) -> None:
        top = max((r.retained for r in rows), default=0)
        for row in rows:
            row.pad = top - row.retained

    def advance(self, rows: Sequence[Row], n: int) -> None:
        for row in rows:
            self.axis.trim_front(row)
        self.realign(rows)

    def mask(self, rows: Sequence[Row], n: int, window: int | None, return_array: bool) -> Mask:
        return chunk_mask(rows, [r.pad for r in rows], n, self.axis.size, window, return_array)


class PagedRows(PagedSurface, Storage):
    """What both paged storages add to the row machinery (the ``PagedRows`` surface):
    a codec, a block size, a pool once known, rows that are block tables into it.

    Listed after the serial or layout base, so their templates run and reach these
    overrides of the storage-level hooks (``_write``, ``fetch``, ``_window``, bytes)."""

    pool_class: ClassVar[type[BlockPool]] = BlockPool
    _pool: BlockPool | None
    _paged: Paged
    _finalizer: weakref.finalize[Any, Any] | None
    #: The rows, mutated in place (``_rows`` assigns into it): the finalizer holds it.
    _row_list: list[Row]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        spec, paged, token, declared, pool = bind_paged(type(self), args, dict(kwargs))
        self.codec = make_codec(spec)
        self._stages = (self.codec,)  # one stage (contract §0.5)
        self._paged = paged
        # The geometry decides which positions a row keeps (a growing row every one, a
        # ring its sinks and window); the placement mirrors them in blocks.
        self._token_geometry = token
        self._axis: TokenAxis = make_axis(token)
        self._geometry = declared if pool is None or pool.geometry is None else pool.geometry
        self._row_list = []
        self._sinks = self._axis.sinks
        self._pool = pool
        self._finalizer = None

    @property
    def _rows(self) -> list[Row]:
        return self._row_list

    @_rows.setter
    def _rows(self, rows: list[Row]) -> None:
        self._row_list[:] = rows

    def _watch(self) -> None:
        """Release the rows' blocks when this storage is collected (once its pool is known)."""
        if self._finalizer is None and self._pool is not None:
            self._finalizer = weakref.finalize(
                self, _release_rows, weakref.ref(self._pool), self._row_list
            )

    def _new_row(self) -> Row:
        return PagedRow(sinks=self._sinks, stage=self._stage)

    @property
    def _pool_stage(self) -> int:
        """The stage the pool's blocks hold (the last; an earlier one is held beside the
        pool: ``_stage_beside``)."""
        return len(self._stages) - 1

    def _pooled(self, row: Row) -> bool:
        """Whether ``row``'s positions live in the pool (else its compact planes only)."""
        return row.stage == self._pool_stage

    def release(self) -> None:
        """Give every block back to the pool now (the cache then holds no row)."""
        if self._pool is not None:
            self._pool.close(self._rows)
        self._rows.clear()

    def lend_rows(self) -> None:
        """Before another layout takes this storage's rows (a layout in a round refuses)."""

    def _lent(self) -> list[Row | None]:
        """The rows a merge takes of this storage (``None``: an empty row of no table)."""
        return list(self._rows)

    # -- bytes ---------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this cache's tables hold (a shared block counts in each),
        and of the stage-0 rows' planes beside the pool."""
        beside = sum(int(p.nbytes) for r in self._rows if not self._pooled(r) for p in r.arrays())
        if self._pool is None or self._geometry is None:
            return beside
        held = sum(len(_live(cast(PagedRow, r).blocks)) for r in self._rows)
        return held * self._pool.bytes_per_block + beside

    def held_arrays(self) -> tuple[Any, ...]:
        return () if self._pool is None else self._pool.held_arrays()

    # -- writes: the row machinery's hook ------------------------------------------------
    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """The machinery's write and read (all or nothing for this cache's records), the
        pool's changes journaled: a fault after the pool took blocks puts it back too
        (contract §9)."""
        with self._pool_undoable():
            fetched: tuple[Any, Any] = super().update_and_fetch(keys, values)
            return fetched

    def _write(self, encoded: dict[int, PlaneSet], rows: int, n: int, geometry: KvGeometry) -> None:
        """The pool first (it may refuse, changing nothing but what it learnt), then the
        compact rows (``Storage._write``). The pool takes the rows of its stage; a stage-0
        row beside it takes no block, but one that converts after this append takes its
        blocks then, reserved here before anything is written."""
        tables = self._rows or [self._new_row() for _ in range(rows)]
        pooled = [b for b, t in enumerate(tables) if self._pooled(t)]
        room = self._reserve(
            [t.stage for t in tables], [t.offset for t in tables], n,
            lambda pool: pool.append_need([tables[b] for b in pooled], n), geometry,
        )  # fmt: skip
        if room is None:  # no conversion: the append's blocks
            room = len(pooled) * math.ceil(n / self.block_size)
        pool = self._ensure_pool(geometry, room)
        opened = bool(self._rows)
        if opened:
            pool.adopt_empty(tables)  # rows a layout joined before any pool existed
        if pooled:
            block = encoded[self._pool_stage]
            share = {t: tuple(p[pooled] for p in ps) for t, ps in block.items()}
            pool.append([tables[b] for b in pooled], share, n)
        if not opened:  # a serial storage's first block: its tables open once written
            for table in tables:
                pool.open(cast(PagedRow, table), touch=False)
        self._rows = tables
        self._watch()
        super()._write(encoded, rows, n, geometry)
        for table in tables:  # a ring's positions that left its window: their blocks
            pool.release_outside(table)

    def adopt_rows(self, rows: Sequence[Row]) -> None:
        """Hold ``rows`` (live tables of the pool, in its stage) instead of what it held;
        they are released when this cache is collected (a serial storage's, or a layout
        that is its own serial class: ``PagedLayout`` aligns them)."""
        assert self._pool is not None
        self._pool.close(self._rows)
        for row in rows:
            row.stage = self._pool_stage
        self._rows = list(rows)
        self._watch()
        self._staged()

    def _adopt_beside(self, row: Row) -> None:
        """Hold ``row`` (an owned stage-0 row) as this empty storage's one row, beside the
        pool: an empty open table."""
        paged = PagedRow(row.planes, row.offset, sinks=row.sinks, stage=row.stage)
        if self._pool is not None:
            self._pool.open(paged)
        self._rows = [paged]
        self._watch()
        self._staged()

    def _convert_rows(self, rows: Sequence[int]) -> None:
        """The machinery's conversion of the compact rows, then the rows now in the pool's
        stage written into fresh blocks of their tables (every block taken at once: the
        append that converts reserved them), counted as written."""
        before = list(self._rows)
        super()._convert_rows(rows)
        moved = sorted(set(rows))
        now = [cast(PagedRow, self._rows[b]) for b in moved if self._pooled(self._rows[b])]
        if not now:
            return
        pool, shapes = self._pool, self._shapes()
        assert pool is not None and shapes is not None
        pool.close([before[b] for b in moved])  # their empty tables; opened again below
        self._write_fresh(shapes, now)
        for row in now:
            pool.open(row, touch=False)

    def _ensure_pool(self, geometry: KvGeometry, room: int) -> BlockPool:
        """The pool, knowing ``geometry``; ``room``: the blocks the write that teaches a
        given pool its geometry takes (refused past its byte limit before it learns)."""
        if self._pool is None:
            self._pool = self.pool_class(
                self._stages[-1].spec, block_size=self.block_size, geometry=geometry
            )
        else:
            self._pool.learn(geometry, room=room)
        return self._pool

    def _write_fresh(self, geometry: Any, rows: Sequence[PagedRow]) -> BlockPool:
        """``rows`` (their compact planes, no blocks yet) written into fresh blocks of the
        pool, every block taken at once (a refusal changes nothing), counted as written
        (not copied); the rows are not opened."""
        counts = [len(row.needed(self.block_size)) for row in rows]
        pool = self._ensure_pool(geometry, sum(counts))
        pool.fresh_rows(rows)
        for row in rows:
            pool.write_rows([row], row.planes, 0)
        pool.ledger.bytes_written += sum(row.retained for row in rows) * pool.token_bytes
        return pool

    # -- reads: assembled from the pool --------------------------------------------------
    def _gathered(self) -> PlaneSet | None:
        """Every row's positions read from the pool at the placement's columns (``None``
        while no row holds a position)."""
        if self._pool is None or not any(r.offset for r in self._rows):
            return None
        width, columns, _ = self._columns()
        return self._pool.gather(self._rows, [start for start, _ in columns], width)

    def _read(self) -> dict[str, Any]:
        if not all(self._pooled(row) for row in self._rows):  # stage 0 beside the pool
            return super()._read()  # each stage's part (the pool's: ``_part_image``)
        planes = self._gathered()
        if planes is None:
            raise LayoutStateError(NOTHING_TO_FETCH)
        return {t: self.codec.fetched(held, as_role(t)) for t, held in planes.items()}

    def _part_image(
        self,
        stage: int,
        rows: Sequence[Row],
        columns: tuple[int, list[tuple[int, int]], int],
        lead: int,
    ) -> PlaneSet:
        """The pool's stage read from the pool (what is read is what is tested)."""
        if stage != self._pool_stage or self._pool is None:
            return super()._part_image(stage, rows, columns, lead)
        width, spans, _ = columns
        return self._pool.gather(rows, [start for start, _ in spans], width)

    def _window(self, row: Row) -> PlaneSet | None:
        """``row``'s window read from its blocks (``None`` while it holds none; a stage-0
        row's from its compact planes)."""
        if not self._pooled(row):
            return super()._window(row)
        if self._pool is None or row.offset == 0:
            return None
        cut = self._axis.cut(row)
        return self._pool.gather([_view(row, cut)], [0], cut.retained)

    # -- mlx-lm's read surface (``spec/mlx-lm-drop-in.md``): reads only ------------------
    def _held(self) -> tuple[Any, Any] | None:
        return None if self._gathered() is None else self.fetch()

    # -- checks and forms ----------------------------------------------------------------
    def _check_tables(self) -> None:
        """Each row is a live table of the pool holding exactly its positions' blocks, and
        those blocks hold its compact planes."""
        for row in self._rows:
            pooled = self._pooled(row)
            blocks = math.ceil(row.offset / self.block_size) if pooled else 0
            assert len(cast(PagedRow, row).blocks) == blocks, "a stage-0 row holds no block"
            assert cast(PagedRow, row).sinks == self._sinks
            if self._pool is not None:
                assert id(row) in self._pool._tables
                if pooled:
                    check_mirrored(self._pool, row)

    def _paged_planes(self) -> tuple[tuple[Any, ...] | None, tuple[Any, ...] | None]:
        planes = None if self._geometry is None else self._gathered()
        return (None, None) if planes is None else (planes["keys"], planes["values"])

    @classmethod
    def _restore(
        cls, state: Any, meta_state: Any, keep: int | None, geometry: KvGeometry | None
    ) -> Any:
        return cls._restore_paged(state, geometry, None, keep or 0)

    @classmethod
    def _restore_paged(
        cls, state: Any, geometry: KvGeometry | None, pool: Any, keep: int = 0
    ) -> Any:
        """``kvrows.paged_forms.restore_state``'s load: the checked rows are written into
        fresh blocks of ``pool`` (or of a private one), all taken at once (a refusal
        changes nothing), counted as written."""
        parsed = parse_state(
            cls, state, geometry, pool, _shape, dtype_name, keep=keep, concat=_concat
        )
        cache = cls(pool=pool, codec=parsed.spec, block_size=parsed.block_size,
                    geometry=parsed.geometry, token_geometry=parsed.token)  # fmt: skip
        cache._load(parsed)
        return cache

    def _load(self, parsed: PagedState) -> None:
        """Hold ``parsed``'s rows: compact copies of their columns, written into fresh
        blocks (a serial state of no position and no planes holds no row)."""
        if parsed.width == 0 and not parsed.names_rows:
            return
        rows: list[PagedRow] = []
        learnt = parsed.geometry
        held = parsed.held()
        for b, (offset, pad) in enumerate(zip(parsed.offsets, parsed.pads, strict=True)):
            columns = parsed.row_planes(b) if held[b] else {}
            planes = {t: tuple(np.array(p) for p in ps) for t, ps in columns.items()}
            if offset and not held[b] and learnt is not None:  # a chunked row holding none
                planes = zero_planes(self.codec, learnt, 1, 0)
            rows.append(PagedRow(planes, offset, pad, sinks=self._sinks))
        # Rows of no position at offset 0 (a chunked row holding none stands at its offset):
        # the pool may not know its geometry.
        if parsed.width == 0 and not (any(parsed.offsets) and learnt is not None):
            pool = self._pool or self.pool_class(
                parsed.spec, block_size=parsed.block_size, geometry=learnt
            )
        else:
            assert learnt is not None
            pool = self._write_fresh(learnt, rows)
        self._pool = pool
        for row in rows:
            pool.open(row, touch=False)
        self._rows = list(rows)
        self._watch()
        self._geometry = learnt
        self._loaded()

    def _loaded(self) -> None:
        """After a load (a layout places its rows)."""

    def _state(self) -> tuple[Any, ...]:
        """The form of the composition (``kvrows.forms.state_form``: the planes compact,
        right-aligned in a layout, the geometry's fields, the placement's)."""
        counts = [r.retained for r in self._rows]
        width = max(counts, default=0)
        pads = [width - c for c in counts]
        planes = (  # rows of no position: zero-width planes (their count and geometry)
            self._pool.gather(self._rows, pads, width)
            if self._pool is not None and self._geometry is not None and self._rows
            else None
        )
        offsets = [r.offset for r in self._rows]
        fields = {
            "keys": None if planes is None else planes["keys"],
            "values": None if planes is None else planes["values"],
            "offset": np.array(offsets, dtype=np.int32),
            "left_padding": np.array(pads, dtype=np.int32),
            "idx": width,
            "total": width,
            "rotated": False,
            "block_size": self.block_size,
            "codec": codec_field(self.codec_spec),
            **self._token_geometry.parameters(),
            "keep": self._sinks,
            "start_position": offsets[0] - counts[0] if offsets else 0,  # a chunked row's
        }
        if not self.composition.is_layout:
            fields["offset"] = offsets[0] if offsets else 0
        return pack_state(self.composition, fields)


def _concat(planes: list[Any]) -> Any:
    return np.concatenate(planes, axis=2)


class PagedSerial(SerialStorage, PagedRows):
    """A request's block table into a pool (``spec/PagedKVCache.md``): a serial store,
    bit-exact with ``KVCache`` on the same tokens. Shape-generic in ``B`` as every serial
    storage, though a request is one row: prefix registration is per request (``B = 1``)."""

    def _lent(self) -> list[Row | None]:
        return list(self._rows) or [None]

    def _request(self) -> Row:
        if len(self._rows) != 1:
            raise LayoutStateError(request_rows_message(len(self._rows)))
        return self._rows[0]

    @property
    def block_table(self) -> tuple[int, ...]:
        """The physical blocks holding this request's positions, in logical order."""
        return tuple(cast(PagedRow, self._request()).blocks) if self._rows else ()

    def planes(self) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
        """The held positions' key and value planes in logical order, rows stacked, read
        from the pool (``None`` when empty)."""
        held = self._paged_planes()
        return None if held[0] is None or held[1] is None else (held[0], held[1])

    def trim(self, n: int) -> int:
        """Forget the newest ``n`` positions (at most ``offset``); frees now-empty blocks."""
        count = super().trim(n)
        if count and self._pool is not None:
            for row in self._rows:
                self._pool.release_tail(row)
                self._pool.release_outside(row)  # a chunked row trimmed to nothing
        return count

    def register_prefix(self, token_ids: Sequence[int]) -> int:
        """Cache the full blocks ``token_ids`` (the ids of this request's first positions,
        at most ``offset`` of them) covers; returns how many blocks are cached. A ring
        caches those of its window only while it holds every position (``PoolBase.
        register_blocks``): past that, none."""
        if self._pool is None or not self._rows:
            raise LayoutStateError(EMPTY_CACHE_NO_BLOCK)
        return self._pool.register_prefix(self._request(), token_ids, self._token_geometry.cap())

    def check_valid(self) -> None:
        super().check_valid()
        self._check_tables()

    def __repr__(self) -> str:
        blocks = [list(cast(PagedRow, r).blocks) for r in self._rows]
        return f"{type(self).__name__}(offset={self.offset}, blocks={blocks})"


class PagedLayout(SpeculativeLayout, PagedRows):
    """Block-table rows in all three roles (``spec/PagedKvRows.md``): ragged rows, each
    appending at its own end; the read right-aligns growing rows (:class:`RightAligned`)
    and places ring rows as the ragged ring does (each from column 0, sinks first)."""

    #: An exhausted pool refuses before any block or table changes: the round stays open,
    #: before its block (free blocks or append a shorter one, then resolve it).
    _spec_refused_unchanged = (PoolExhaustedError,)

    @property
    def holds_proposals(self) -> bool:
        """The axis says (as for contiguous rows): growing rows drop nothing; a held ring
        row drops nothing and so frees no block (``spec/speculative.md`` §8a); a chunked
        row's full chunk frees the one before it."""
        return self._axis.holds_proposals(self.composition.arrangement)

    def _spec_hold(self, on: bool) -> None:
        self._axis.holding = on

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A ring places its rows itself (its window per row); growing rows right-align, a
        # chunked row by what it holds.
        token = self._token_geometry
        self._place: Any = (
            self._axis.place(self.composition.arrangement) if token.wraps
            else RightAlignedChunks(cast(ChunkedAxis, self._axis)) if token.evicts
            else RightAligned()
        )  # fmt: skip
        self._watch()

    def block_tables(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(cast(PagedRow, r).blocks) for r in self._rows)

    def adopt_rows(self, rows: Sequence[Row]) -> None:
        super().adopt_rows(rows)
        self._place.join(self._rows, 0)

    def make_empty_batch(self) -> RowLayout:
        return type(self)(
            pool=self._pool, codec=self.codec_spec, token_geometry=self._token_geometry,
            placement=self._paged,
        )  # fmt: skip

    def projected_bytes(self, tokens: int) -> int:
        """Bytes one row needs for ``tokens`` positions: whole blocks."""
        count = as_count(tokens, "tokens")
        g = self._geometry
        if g is None:
            raise LayoutStateError(PROJECTED_BYTES_NEEDS_GEOMETRY)
        blocks = projected_blocks(count, self._axis.cap, self._sinks, self.block_size)
        return blocks * self.block_size * shapes_token_bytes(self.codec, g)

    def _accepts(self, source: object) -> bool:
        paged = cast(PagedRows, source)
        return (
            getattr(source, "pool_class", None) is self.pool_class
            and [c.key for c in paged._stages] == [c.key for c in self._stages]
            and paged.block_size == self.block_size
            and paged.token_geometry == self._token_geometry
        )

    def _merge_refusal(self, source: object) -> str:
        return paged_merge_message(
            self.signature(), self.block_size, self._stages[-1].key, type(source).__name__
        )

    def _incoming(self, sources: Sequence[Any]) -> list[tuple[Any, Row | None, Row | None]]:
        """Each joining row: its pool, the row and what a merge takes of it (its window;
        a row beside its pool, stage 0, lends no pool)."""
        return [
            (s.pool if row is None or s._pooled(row) else None, row,
             None if row is None else self._cut(row))
            for s in sources
            for row in s._lent()
        ]  # fmt: skip

    def _joining_stage(self, source: Any, row: Row | None) -> int:
        """The stage a row of ``source`` joins in (an empty row: the source's own)."""
        codec = source.codec if row is None else source._stages[row.stage]
        return self._stage_of(codec)

    def _check_join(self, sources: Sequence[Any], geometry: KvGeometry | None) -> None:
        """The pool's refusals of ``_join`` (another geometry, no room for the copies)."""
        incoming = self._incoming(sources)
        pool = self._pool or next((p for p, _, _ in incoming if p is not None), None)
        if pool is not None:  # (a new pool takes the copies: it has no limit)
            foreign = self._foreign(incoming, pool)
            pool.check_take(geometry, sum(pool.blocks_of(cut) for _, _, cut in foreign))

    @staticmethod
    def _foreign(
        incoming: list[tuple[Any, Row | None, Row | None]], pool: Any
    ) -> list[tuple[Any, Row, Row]]:
        """The joining rows of another pool that hold tokens: copied into fresh blocks."""
        return [
            (p, r, c) for p, r, c in incoming
            if p is not None and p is not pool and r is not None and c is not None and r.offset
        ]  # fmt: skip

    def _join(self, sources: Sequence[Any], geometry: KvGeometry | None) -> None:
        """Rows of this layout's pool join by reference (no byte moves); rows of another
        pool are copied into fresh blocks (all taken at once: a refusal changes nothing).
        Every row joins cut to its window (a ring's: the blocks out of it stay behind)."""
        incoming = self._incoming(sources)
        if not incoming:
            return
        stages = [
            self._joining_stage(s, row) for s in sources for row in s._lent()
        ]  # fmt: skip
        running = len(self._rows)
        pool = self._pool or next((p for p, _, _ in incoming if p is not None), None)
        if pool is None and geometry is None:  # rows of no position, no pool yet
            self._rows.extend(replace(self._new_row(), stage=stage) for stage in stages)
            self._place.join(self._rows, running)
            self._staged()
            return
        if pool is None:  # empty serial caches or rows beside their pool: a pool of ours
            pool = self.pool_class(
                self._stages[-1].spec, block_size=self.block_size, geometry=geometry
            )
        foreign = self._foreign(incoming, pool)
        if geometry is not None:  # copies into a pool that learns here: within its limit
            pool.learn(geometry, room=sum(pool.blocks_of(cut) for _, _, cut in foreign))
        copies = iter(pool.copy_in(foreign))
        joined: list[Row] = []
        for (source_pool, row, cut), stage in zip(incoming, stages, strict=True):
            if stage != self._pool_stage:  # beside the pool: its compact planes, no block
                planes = {} if cut is None else cut.planes
                offset = 0 if row is None else row.offset
                joined.append(pool.open(PagedRow(_owned(planes), offset, sinks=self._sinks)))
            elif row is None or cut is None or (source_pool is not pool and row.offset == 0):
                joined.append(pool.open(cast(PagedRow, self._new_row())))
            elif source_pool is pool:
                joined.append(pool.share(row, cut))
            else:
                joined.append(next(copies))
        pool.adopt_empty(self._rows)  # rows joined before any pool existed
        self._pool = pool
        self._watch()
        for row, stage in zip(joined, stages, strict=True):  # each in its stage
            row.stage = stage
        self._rows.extend(joined)
        self._place.join(self._rows, running)
        self._geometry = geometry
        self._staged()

    def filter_rows(self, keep: Sequence[int]) -> None:
        """Keep the rows ``keep``, in that order; the others' blocks go back to the pool."""
        self._spec_guard("filter_rows")
        order = check_keep(keep, self.batch_size)
        dropped = [r for i, r in enumerate(self._rows) if i not in set(order)]
        if self._pool is not None:
            self._pool.close(dropped)
        super().filter_rows(order)

    def _empty_serial(self) -> Any:
        """An empty serial storage of this pool a row extracts into."""
        return self.serial_class(
            pool=self._pool, codec=self.codec_spec, token_geometry=self._token_geometry,
            placement=self._paged,
        )  # fmt: skip

    def extract_row(self, row: int) -> SerialStorage:
        """A ``PagedKVCache`` holding row ``row``: its table shared, no byte moved (a row
        beside the pool: an owned copy of its planes, beside the pool again)."""
        self._spec_guard("extract_row")
        entry = self._rows[check_row(row, self.batch_size)]
        serial = cast(PagedSerial, self._empty_serial())
        serial._geometry = self._geometry
        if not self._pooled(entry):
            if entry.offset:
                serial._adopt_beside(self._cut(entry))
        elif self._pool is not None and entry.offset:
            serial.adopt_rows([self._pool.share(entry, self._cut(entry))])
        return serial

    def register_prefix(self, row: int, token_ids: Sequence[int]) -> int:
        """Cache row ``row``'s full blocks ``token_ids`` covers (a ring's while it holds
        every position; refused in a round: its newest positions are unverified drafts)."""
        self._spec_guard("register_prefix")
        entry = self._rows[check_row(row, self.batch_size)]
        if self._pool is None:
            raise LayoutStateError(EMPTY_ROW_NO_BLOCK)
        return self._pool.register_prefix(entry, token_ids, self._token_geometry.cap())

    def _trim(self, counts: Sequence[int], *, justify: bool = False) -> int:
        top = super()._trim(counts, justify=justify)
        for row, count in zip(self._rows, counts, strict=True):
            if count and self._pool is not None:
                self._pool.release_tail(row)
                self._pool.release_outside(row)  # a chunked row trimmed to nothing
        return top

    def _state(self) -> tuple[Any, ...]:
        self._spec_guard("saving state")
        return super()._state()

    def _loaded(self) -> None:
        self._place.join(self._rows, 0)

    def check_valid(self) -> None:
        super().check_valid()
        self._check_tables()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(offsets={list(self.row_offsets)})"
