"""The optimized paged placement: rows whose tokens live in a block pool's MLX planes.

A paged storage is the optimized row machinery (:class:`~kvrows.optimized.rows.Serial`,
:class:`~kvrows.optimized.rows.Layout`) with its planes in a :class:`BlockPool` (one per
layer, shared by every storage of the layer): each plane is ``[num_blocks, H,
block_size, w]``, and each row is a block table (a ``list[int]`` of host ints, the row's
blocks in logical order, ``ceil(offset / block_size)`` of them). The machinery keeps the
rows' offsets and pads as for every storage; :class:`PagedRows` plugs the placement into
its hooks (``_write``, ``_join``, ``_keep``, ``_forget``, the reads) and adds the paged
surface (``pool``, ``block_size``, ``block_tables``, ``register_prefix``, ``release``).

Which block belongs to whom is the core's int-only ledger (``kvrows.paged.BlockLedger``:
reference counts, free queue, prefix hash chain, eviction); the bytes move here, one
MLX op per run of blocks for an append (it scatters every row's tokens into its slots;
runs of whole blocks are one slice write), one gather over the whole batch for a read
(every row's slots, pad columns zero).
On the CPU backend writes and reads go through NumPy views of the pool's buffers instead
(``kvrows.optimized.host``; :func:`gather_runs` says why).

* An append takes every block its rows need at once (``PoolExhaustedError`` with nothing
  changed); a row whose partly filled tail block another table holds, or that caches a
  prefix, first copies that block (copy on write, counted in ``bytes_copied``).
* Rows of the pool merge, extract and publish by sharing their tables (no byte moves);
  rows of another pool are copied into fresh blocks (counted); a trim releases the
  blocks past a row's end.
* The layout right-aligns its rows (``left_pad[b] = max offset - offset[b]``, virtual:
  nothing is padded in the pool), so the growing geometry's masks are its masks.
"""

from __future__ import annotations

import functools
import itertools
import math
import weakref
from collections.abc import Callable, Collection, Sequence
from typing import Any, ClassVar, cast

import mlx.core as mx
import numpy as np

from kvrows.codec import PlaneSet, as_role
from kvrows.common import all_or_nothing, shapes_token_bytes
from kvrows.compositions import contiguous_preset
from kvrows.errors import (
    EMPTY_CACHE_NO_BLOCK,
    EMPTY_ROW_NO_BLOCK,
    NOTHING_TO_FETCH,
    PROJECTED_BYTES_NEEDS_GEOMETRY,
    LayoutStateError,
    NotTrimmableError,
    last_stage_message,
    paged_merge_message,
    request_rows_message,
    ring_rollback_message,
    trim_past_row_message,
    wrapped_ring_message,
)
from kvrows.forms import pack_state
from kvrows.geometries.ring import ragged_slack, ragged_step, retained_after
from kvrows.optimized.codecs import Codec, dtype_name, make_codec
from kvrows.optimized.geometries.chunked import ChunkedGeometry
from kvrows.optimized.geometries.growing import GrowingGeometry
from kvrows.optimized.geometries.ring import RingGeometry
from kvrows.optimized.host import FreshHost, KeptBuffers, fresh_host, host_readable, host_views
from kvrows.optimized.rows import (
    DECLARED,
    Layout,
    RowWindow,
    Serial,
    Storage,
    owned,
    zero_planes,
)
from kvrows.paged import (
    FREE,
    Paged,
    PagedSurface,
    PoolBase,
    bind_paged,
    held_blocks,
    projected_blocks,
)
from kvrows.paged_forms import PagedState, codec_field, parse_state
from kvrows.protocols import Mask
from kvrows.schemes import CodecSpec
from kvrows.validation import KvGeometry, as_count, check_row

__all__ = [
    "BlockPool",
    "PagedChunked",
    "PagedLayout",
    "PagedRing",
    "PagedRows",
    "PagedSerial",
    "Piece",
    "copy_block",
    "gather_runs",
    "position_runs",
    "scatter",
]

Planes = tuple[Any, ...]
#: One write of a token run into one block: ``(block, start, count, row, token)``.
Piece = tuple[int, int, int, int, int]
#: A row's block table: its blocks in logical order (host ints; ``FREE`` for a block the
#: row gave back: a ring's, out of its window).
Table = list[int]
#: The positions a row reads: runs ``(first position, count)``, oldest first.
Runs = Sequence[tuple[int, int]]
#: What a merge takes of a row: ``(offset, count, sinks)``, its newest ``count``
#: positions at ``offset`` (its first ``sinks`` among them; a growing row: all).
Lent = tuple[int, int, int]


def _live(table: Sequence[int]) -> Sequence[int]:
    """The blocks a table holds (``FREE`` entries hold none): the table itself when it has
    no ``FREE`` entry (a growing row's), read before the table changes."""
    return table if FREE not in table else [b for b in table if b != FREE]


def position_runs(offset: int, retained: int, sinks: int) -> list[tuple[int, int]]:
    """:func:`kvrows.paged.held_positions` as runs: the sinks, then the newest."""
    head = min(sinks, offset, retained)
    runs = [(0, head)] if head else []
    if retained > head:
        runs.append((offset - retained + head, retained - head))
    return runs


def _index(values: Sequence[int]) -> mx.array:
    return mx.array(list(values), dtype=mx.int32)


def rows_of(array: mx.array, rows: Sequence[int], total: int) -> mx.array:
    """Rows ``rows`` of ``array`` (``[total, ...]``; itself when they are all of them)."""
    return array if len(rows) == total else mx.take(array, mx.array(list(rows)), axis=0)


def _shape(array: object) -> tuple[int, ...]:
    return tuple(int(x) for x in array.shape) if isinstance(array, mx.array) else ()


def pieces(blocks: Sequence[int], size: int, start: int, count: int, row: int = 0) -> list[Piece]:
    """Positions ``start .. start + count - 1`` of a row holding ``blocks`` as writes into
    their blocks, fed from tokens ``0 .. count - 1`` of source row ``row``."""
    out: list[Piece] = []
    position = start
    while position < start + count:
        within = position % size
        length = min(size - within, start + count - position)
        out.append((blocks[position // size], within, length, row, position - start))
        position += length
    return out


def _runs(pieces: Sequence[Piece], size: int) -> list[tuple[Piece, int]]:
    """The pieces with consecutive whole blocks of one source row joined: ``(piece,
    whole)``, ``whole`` the number of whole blocks from ``piece``'s block (0: a partial
    block's piece)."""
    runs: list[tuple[Piece, int]] = []
    for piece in pieces:
        block, start, count, row, token = piece
        full = start == 0 and count == size
        if full and runs and runs[-1][1]:
            (first, _, _, first_row, first_token), whole = runs[-1]
            if (block, row, token) == (first + whole, first_row, first_token + whole * size):
                runs[-1] = (runs[-1][0], whole + 1)
                continue
        runs.append((piece, 1 if full else 0))
    return runs


def scatter(planes: Planes, written: Sequence[Piece], source: Planes) -> None:
    """For each piece ``(block, start, count, row, token)``: ``planes[block, :, start :
    start + count] = source[row, :, token : token + count]`` (in place)."""
    # Runs of whole blocks are one slice write each, partial blocks one slice each
    # (MLX's indexed scatter on the CPU runs at a tenth of a slice write's speed).
    size = int(planes[0].shape[2])
    runs = _runs(written, size)
    views = host_views(planes)
    if views is not None:
        # The CPU backend: NumPy writes into the pool's own buffers (MLX's slice update
        # copies at about a tenth of memcpy's speed there; this runs near memcpy's).
        for view, src in zip(views, source, strict=True):
            data = np.asarray(src)
            heads, width = view.shape[1], view.shape[3]
            for (block, start, count, row, token), whole in runs:
                if whole:
                    piece = data[row, :, token : token + whole * size]
                    view[block : block + whole] = piece.reshape(
                        heads, whole, size, width
                    ).transpose(1, 0, 2, 3)
                else:
                    view[block, :, start : start + count] = data[row, :, token : token + count]
        return
    for plane, src in zip(planes, source, strict=True):
        heads, width = int(plane.shape[1]), int(plane.shape[3])
        for (block, start, count, row, token), whole in runs:
            if whole:
                piece = src[row, :, token : token + whole * size]
                plane[block : block + whole] = piece.reshape(heads, whole, size, width).transpose(
                    1, 0, 2, 3
                )
            else:
                plane[block, :, start : start + count] = src[row, :, token : token + count]
    mx.eval(*planes)


def copy_block(planes: Planes, target: int, origin: int, count: int) -> None:
    """``planes[target, :, :count] = planes[origin, :, :count]`` (in place)."""
    views = host_views(planes)
    if views is not None:
        for view in views:
            view[target, :, :count] = view[origin, :, :count]
        return
    for plane in planes:
        plane[target, :, :count] = plane[origin, :, :count]
    mx.eval(*planes)


def _padded(lengths: np.ndarray[Any, Any], values: Any, columns: int) -> np.ndarray[Any, Any]:
    """``[len(lengths), columns]``: row ``b`` the next ``lengths[b]`` of the flat iterable
    ``values``, zeros after them (one NumPy fill: no loop over rows)."""
    flat = np.fromiter(values, dtype=np.intp, count=int(lengths.sum()))
    out = np.zeros((len(lengths), columns), dtype=np.intp)
    out[np.arange(columns) < lengths[:, None]] = flat
    return out


def gather_sources(
    rows: Sequence[tuple[Sequence[int], Runs]], pads: Sequence[int], width: int, size: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Where each column of each row of a gather comes from: ``(block, within, valid)``,
    each ``[B, width]``: column ``c`` of row ``b`` holds position ``within`` of block
    ``block`` where ``valid`` (the row's runs laid one after another from ``pads[b]``),
    and zeros elsewhere. Computed for the whole batch at once."""
    count = len(rows)
    tables = [blocks for blocks, _ in rows]
    helds = [runs for _, runs in rows]
    table_lengths = np.fromiter(map(len, tables), dtype=np.intp, count=count)
    table = _padded(
        table_lengths,
        itertools.chain.from_iterable(tables),
        max(1, int(table_lengths.max(initial=0))),
    )
    run_counts = np.fromiter(map(len, helds), dtype=np.intp, count=count)
    most = max(1, int(run_counts.max(initial=0)))
    spans = _padded(
        2 * run_counts,
        itertools.chain.from_iterable(itertools.chain.from_iterable(helds)),
        2 * most,
    )
    firsts, lengths = spans[:, 0::2], spans[:, 1::2]
    ends = np.cumsum(lengths, axis=1)  # each run's last column + 1, from the row's pad
    column = np.arange(width)[None, :] - np.asarray(pads, dtype=np.intp)[:, None]
    valid = (column >= 0) & (column < ends[:, -1:])
    run = np.minimum((column[:, :, None] >= ends[:, None, :]).sum(axis=2), most - 1)
    starts = ends - lengths
    position = np.take_along_axis(firsts - starts, run, axis=1) + column
    position = np.where(valid, position, 0)
    block = np.where(valid, np.take_along_axis(table, position // size, axis=1), 0)
    return block, position % size, valid


def gather_runs(
    planes: Planes,
    rows: Sequence[tuple[Sequence[int], Runs]],
    pads: Sequence[int],
    width: int,
    *,
    fresh: Sequence[FreshHost] | None = None,
) -> Planes:
    """``[B, H, width, w]``: row ``b``'s runs of positions ``(first, count)`` (its
    ``blocks`` indexed by logical block), one after another from column ``pads[b]``,
    zeros elsewhere; compact, owned.

    One gather for the whole batch: each plane ``[N, H, size, w]`` is read as the rows of
    ``[N * H * size, w]`` (a token of a head of a block per row), every output row's source
    row computed at once (:func:`gather_sources`). On the CPU backend NumPy's ``take``
    fills an MLX buffer in place (MLX's CPU gather costs per element: 3-6x slower
    here): plane ``i``'s from ``fresh[i]`` when given (a pool's: its last read's buffer
    when nothing holds that read any more, :class:`~kvrows.optimized.host.KeptBuffers`),
    else a fresh one (:func:`~kvrows.optimized.host.fresh_host`); elsewhere it is
    ``mx.take``."""
    count = len(rows)
    size = int(planes[0].shape[2])
    block, within, valid = gather_sources(rows, pads, width, size)
    # Per head count (keys and values share one; a latent pool's tensors another): the
    # source row of every output row, and the output rows no source fills (pads, a shorter
    # row's tail: zeroed after the take).
    indexed: dict[int, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any] | None]] = {}

    def index_of(heads: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any] | None]:
        if heads not in indexed:
            heads_axis = np.arange(heads, dtype=np.intp)[None, :, None]
            rows_of = (block[:, None, :] * heads + heads_axis) * size + within[:, None, :]
            unfilled = None
            if not valid.all():
                every = np.broadcast_to(~valid[:, None, :], (count, heads, width))
                unfilled = np.flatnonzero(every)
            indexed[heads] = rows_of.reshape(-1), unfilled
        return indexed[heads]

    out = []
    for i, plane in enumerate(planes):
        heads = int(plane.shape[1])
        source, unfilled = index_of(heads)
        last = int(plane.shape[3])
        shape = (count, heads, width, last)
        view = host_readable(plane)
        if int(plane.shape[0]) == 0 or not source.size or not last:
            # No block yet, no column, or zero-width planes (a keys-only cache's values).
            out.append(mx.zeros(shape, dtype=plane.dtype))
            continue
        if view is not None:
            image, target = (fresh_host if fresh is None else fresh[i])(shape, plane.dtype)
            flat = target.reshape(-1, last)
            # mode="clip": "raise" buffers the whole output first (the indices are in range).
            np.take(view.reshape(-1, last), source, axis=0, out=flat, mode="clip")
            if unfilled is not None:
                flat[unfilled] = 0
        else:
            taken = mx.take(plane.reshape(-1, last), mx.array(source), axis=0).reshape(shape)
            if unfilled is not None:
                taken = mx.where(
                    mx.array(valid)[:, None, :, None], taken, mx.zeros((), plane.dtype)
                )
            image = mx.contiguous(taken)
        out.append(image)
    mx.eval(*out)
    return tuple(out)


def _concat(planes: list[Any]) -> Any:
    return mx.concatenate(planes, axis=2)


def _release_tables(pool_ref: weakref.ref[BlockPool], tables: list[Table]) -> None:
    pool = pool_ref()
    if pool is not None:
        pool.close(tables)


class BlockPool(PoolBase):
    """One layer's blocks in MLX planes, shared by every request of the layer
    (``spec/paged-pool.md``).

    ``codec``: the codec spec of every block (default ``Plain()``); ``block_size``: tokens
    per block; ``num_blocks``: blocks allocated once the KV geometry is known (declared
    here or learnt from the first write); ``max_bytes``: the most bytes the pool's planes
    may take (growth past it raises ``PoolExhaustedError``).
    """

    #: The implementation's paged serial caches by geometry kind (what ``lookup_prefix``
    #: returns: ``PagedKVCache``, ``PagedRotatingKVCache``).
    cache_classes: ClassVar[dict[str, type[PagedSerial]]]
    codec: Codec
    _tables: dict[int, Table]

    def _make_codec(self, spec: CodecSpec) -> Codec:
        return make_codec(spec)

    # -- what it holds -------------------------------------------------------------------
    def live_tables(self) -> tuple[Table, ...]:
        """The live block tables (each holds its blocks once)."""
        return tuple(self._tables.values())

    # -- geometry and growth -------------------------------------------------------------
    def _grow_to(self, total: int) -> None:
        """The ledger's growth: every plane gains zero blocks up to ``total``."""
        assert self._geometry is not None
        fresh = zero_planes(self.codec, self._geometry, total - self.num_blocks, self.block_size)
        if self._planes:
            fresh = {
                t: tuple(
                    mx.concatenate([old, new], axis=0)
                    for old, new in zip(self._planes[t], fresh[t], strict=True)
                )
                for t in fresh
            }
            mx.eval(*(p for planes in fresh.values() for p in planes))
        self._planes = fresh

    # -- tables --------------------------------------------------------------------------
    def open(self, table: Table, *, touch: bool = True) -> Table:
        """Make ``table`` live (its blocks counted once more unless they were just
        allocated for it)."""
        if touch:
            self.ledger.touch(_live(table))
        self._opened(table)
        return table

    def open_all(self, tables: Sequence[Table]) -> None:
        """:meth:`open` of each of ``tables``, their blocks counted in one pass (a merge
        opens a table per joining row)."""
        ledger = self.ledger
        ledger.touch(itertools.chain.from_iterable(_live(t) for t in tables))
        self._tables.update((id(t), t) for t in tables)
        if ledger.journaling:
            ids = [id(t) for t in tables]
            ledger.journal(lambda: [self._tables.pop(i, None) for i in ids])

    def _opened(self, table: Table) -> None:
        """``table`` is live (journaled: an undo forgets it)."""
        self._tables[id(table)] = table
        if self.ledger.journaling:
            self.ledger.journal(lambda: self._tables.pop(id(table), None))

    def adopt_empty(self, tables: Sequence[Table]) -> None:
        """Make empty tables made before the pool existed live tables of this pool."""
        for table in tables:
            if id(table) not in self._tables:
                assert not table
                self._opened(table)

    def close(self, tables: Sequence[Table]) -> None:
        """Release every table (each tail block first); the table then holds nothing."""
        ledger, live = self.ledger, self._tables
        closing = [t for t in tables if live.pop(id(t), None) is not None]
        release = ledger.release  # (a call per table: cheaper than chaining a few tables)
        for table in closing:
            release(reversed(_live(table)))
        if ledger.journaling:
            for table in closing:
                ledger.journal(functools.partial(self._reopen, table, list(table)))
        for table in closing:
            table.clear()
        if not live and "_read_buffers" in self.__dict__:
            self._read_buffers.clear()  # no row left to read: an idle pool keeps no buffer

    def _reopen(self, table: Table, held: Table) -> None:
        """Undo a close: ``table`` holds ``held`` again, live."""
        table[:] = held
        self._tables[id(table)] = table

    def release_tail(self, table: Table, offset: int) -> None:
        """Release the blocks past position ``offset`` (after a trim), tail first."""
        keep = self.blocks_for(offset)
        self.ledger.release(reversed(_live(table[keep:])))
        self._journal_table(table)
        del table[keep:]

    def release_outside(self, table: Table, needed: set[int]) -> None:
        """Give back the blocks of ``table`` not in ``needed`` (a ring's, out of its
        window; tail first), their entries ``FREE``."""
        gone = [j for j, b in enumerate(table) if b != FREE and j not in needed]
        if gone:
            self.ledger.release(reversed([table[j] for j in gone]))
            was = [table[j] for j in gone]
            for j in gone:
                table[j] = FREE

            def undo() -> None:
                for j, b in zip(gone, was, strict=True):
                    table[j] = b

            self.ledger.journal(undo)

    def _journal_table(self, table: Table) -> None:
        """Journal putting ``table`` back as it is now (an undoable operation edits it)."""
        if self.ledger.journaling:
            held = list(table)
            self.ledger.journal(lambda: table.__setitem__(slice(None), held))

    def _keep_blocks(self, blocks: list[int]) -> None:
        """Save the bytes of ``blocks`` (cached blocks an undoable allocation takes) and
        journal writing them back: one gather of those blocks per plane."""
        index = _index(blocks)
        saved = {t: tuple(mx.take(p, index, axis=0) for p in ps) for t, ps in self._planes.items()}
        mx.eval(*(p for ps in saved.values() for p in ps))
        planes = self._planes

        def put_back() -> None:
            for tensor, held in planes.items():
                for plane, kept in zip(held, saved[tensor], strict=True):
                    for i, block in enumerate(blocks):
                        plane[block] = kept[i]
                mx.eval(*held)

        self.ledger.journal(put_back)

    def fresh_table(self, offset: int, needed: set[int], fresh: list[int]) -> Table:
        """A table of ``offset`` positions taking blocks from ``fresh`` for ``needed``."""
        return [fresh.pop(0) if j in needed else FREE for j in range(self.blocks_for(offset))]

    # -- writes --------------------------------------------------------------------------
    def append(
        self, tables: Sequence[Table], offsets: Sequence[int], block: PlaneSet, n: int
    ) -> None:
        """Row ``b`` of the encoded ``block`` (``[B, H, n, ·]`` per plane) goes after
        ``offsets[b]`` positions of ``tables[b]``: every block the rows need is taken at
        once (``PoolExhaustedError`` with nothing changed), then partly filled tails
        another table holds or that cache a prefix are copied (copy on write), then the
        tokens of every row are written with one scatter per plane."""
        bs, ledger = self.block_size, self.ledger
        plans = self._append_plans(tables, offsets, n)
        fresh = ledger.allocate(sum(int(cow) + new for cow, new in plans))
        written: list[Piece] = []
        journaling = ledger.journaling
        for b, (table, offset, (cow, new)) in enumerate(zip(tables, offsets, plans, strict=True)):
            if journaling and (cow or new):  # the table as it was (its tail, its length)
                self._journal_append(table)
            if cow:
                self._copy_tail(table, offset, fresh.pop())
            table.extend(fresh[:new])
            del fresh[:new]
            written += pieces(table, bs, offset, n, b)
        for tensor, planes in self._planes.items():
            scatter(planes, written, block[tensor])
        ledger.bytes_written += len(tables) * n * self.token_bytes

    def _journal_append(self, table: Table) -> None:
        """Journal putting back a table an append extends or whose tail it replaces: its
        length and tail (O(1), not a copy of the table)."""
        length, tail = len(table), table[-1] if table else FREE

        def undo() -> None:
            del table[length:]
            if length:
                table[-1] = tail

        self.ledger.journal(undo)

    def _append_plans(
        self, tables: Sequence[Table], offsets: Sequence[int], n: int
    ) -> list[tuple[bool, int]]:
        """Per row of an append of ``n`` tokens: whether its tail block is copied first
        (copy on write) and how many new blocks it takes."""
        bs, ledger = self.block_size, self.ledger
        plans: list[tuple[bool, int]] = []
        for table, offset in zip(tables, offsets, strict=True):
            # A partly filled tail that is shared or cached is copied first; a tail the row
            # gave back (a chunked row holding no position) takes a fresh block instead.
            renew = offset % bs > 0 and (table[-1] == FREE or not ledger.writable(table[-1]))
            plans.append((renew, self.blocks_for(offset + n) - len(table)))
        return plans

    def append_need(self, tables: Sequence[Table], offsets: Sequence[int], n: int) -> int:
        """The fresh blocks ``append(tables, offsets, ·, n)`` takes (copies on write and
        new blocks)."""
        return sum(int(cow) + new for cow, new in self._append_plans(tables, offsets, n))

    def _copy_tail(self, table: Table, offset: int, target: int) -> None:
        """Copy the partly filled tail block of ``table`` into ``target``, which replaces it
        (a ``FREE`` tail holds none of the row's positions: nothing is copied)."""
        fill = offset % self.block_size
        old = table[-1]
        if old == FREE:
            table[-1] = target
            return
        for planes in self._planes.values():
            copy_block(planes, target, old, fill)
        self.ledger.release([old])
        table[-1] = target
        self.ledger.bytes_copied += fill * self.token_bytes

    def write_row(self, table: Table, planes: PlaneSet, runs: Runs | None = None) -> None:
        """Write ``planes`` (``[1, H, n, ·]``) into ``table``'s allocated blocks at the
        positions of ``runs`` (``None``: from position 0)."""
        n = int(next(iter(planes.values()))[0].shape[2])
        written: list[Piece] = []
        token = 0
        for first, count in [(0, n)] if runs is None else runs:
            written += [
                (block, start, length, 0, token + fed)
                for block, start, length, _, fed in pieces(table, self.block_size, first, count)
            ]
            token += count
        for tensor, held in self._planes.items():
            scatter(held, written, planes[tensor])

    def copy_in(self, sources: Sequence[tuple[BlockPool, Table, Lent]]) -> list[Table]:
        """New tables of this pool holding copies of ``(pool, table, (offset, count,
        sinks))`` rows of other pools, each cut to the ``count`` positions a merge takes
        (read from their pools, counted as copied); every block is taken at once, so a
        refusal changes nothing."""
        bs = self.block_size
        needed = [held_blocks(o, c, k, bs) for _, _, (o, c, k) in sources]
        fresh = self.ledger.allocate(sum(len(n) for n in needed))
        copies: list[Table] = []
        for (source, table, (offset, count, sinks)), held in zip(sources, needed, strict=True):
            copy = self.open(self.fresh_table(offset, held, fresh), touch=False)
            copies.append(copy)
            if offset:
                runs = position_runs(offset, count, sinks)
                self.write_row(copy, source.gather([table], [runs], [0], count), runs)
                self.ledger.bytes_copied += count * self.token_bytes
        return copies

    # -- reads ---------------------------------------------------------------------------
    def gather(
        self,
        tables: Sequence[Table],
        held: Sequence[Runs],
        pads: Sequence[int],
        width: int,
        tensors: Collection[str] | None = None,
    ) -> PlaneSet:
        """Each tensor's planes ``[B, H, width, ·]`` (of ``tensors`` only, when given):
        row ``b``'s held positions (``held[b]``, runs ``(first, count)`` oldest first: a
        growing row's every position, a ring's sinks and newest; its ``FREE`` blocks hold
        none and are never read), read from its blocks one after another from column
        ``pads[b]``, zeros elsewhere; owned arrays."""
        rows = list(zip(tables, held, strict=True))
        planes = self._planes
        if not planes and self._geometry is not None:  # no block yet: every row reads zeros
            planes = zero_planes(self.codec, self._geometry, 0, self.block_size)
        if tensors is not None:
            planes = {t: p for t, p in planes.items() if t in tensors}
        if not planes:
            return {}
        # Every tensor's planes in one gather: the rows' sources are computed once.
        chained = tuple(itertools.chain(*planes.values()))
        kept = self._read_buffers
        fresh = [
            functools.partial(kept.fresh, (t, i)) for t, p in planes.items() for i in range(len(p))
        ]
        images = iter(gather_runs(chained, rows, pads, width, fresh=fresh))
        return {t: tuple(next(images) for _ in p) for t, p in planes.items()}

    @functools.cached_property
    def _read_buffers(self) -> KeptBuffers:
        """The buffers of the pool's large reads, each reused by its next read of the same
        plane once nothing holds the earlier one (``spec/paged-pool.md`` §5)."""
        return KeptBuffers()

    # -- the prefix cache ----------------------------------------------------------------
    def register_prefix(
        self, table: Table, held: tuple[int, int], token_ids: Sequence[int], cap: int | None = None
    ) -> int:
        """Hash the full blocks of ``table`` (a row of ``held = (offset, positions held)``)
        that ``token_ids`` covers (``cap``: a ring's window, and nothing once the row gave
        a position back: ``PoolBase.register_blocks``); returns how many blocks are now
        cached."""
        return self.register_blocks(table, held, token_ids, cap)

    def _adopt_hit(self, cache: Any, hits: list[int]) -> None:
        cache.adopt_tables([self.open(list(hits))], len(hits) * self.block_size)

    def check_valid(self) -> None:
        """Assert the pool's invariants (``spec/paged-pool.md`` §4)."""
        # A snapshot: a cache's finalizer may release its tables while we iterate.
        self.ledger.check_valid([_live(t) for t in list(self._tables.values())])


class PagedRows(PagedSurface, Storage):
    """What both paged storages add to the row machinery (the ``PagedRows`` surface):
    a codec, a block size, a pool once known, rows that are block tables into it.

    Listed before the serial or layout base, so these hooks and reads replace theirs."""

    geometry_kind = "growing"
    placement_kind = "paged"
    arrangements = frozenset({"serial", "ragged"})
    pool_class: ClassVar[type[BlockPool]] = BlockPool

    _pool: BlockPool | None
    _paged: Paged
    _finalizer: weakref.finalize[Any, Any] | None
    #: The rows' tables, mutated in place (the finalizer holds the list).
    _tables: list[Table]
    #: Two stages (``_stage_beside``): the stage-0 rows beside the pool, a one-stage
    #: contiguous layout of stage 0's codec whose rows are those rows in batch order
    #: (``compositions.contiguous_preset``); ``None`` with one stage.
    _contiguous: Any
    #: Two stages: each row's stage, in batch order (host ints).
    _row_stage: list[int]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        spec, paged, token, declared, pool = bind_paged(type(self), args, dict(kwargs))
        self._paged = paged
        self._tables = []
        self._pool = pool
        self._finalizer = None
        self._contiguous, self._row_stage = None, []
        geometry = declared if pool is None or pool.geometry is None else pool.geometry
        self._setup(spec, token, geometry)
        self._watch()

    @classmethod
    def _spawn_like(cls, like: PagedRows) -> Any:
        """An empty storage of this class with ``like``'s pool, codec, token geometry and
        placement, checked when ``like`` was built (what an extraction fills: no argument
        parsing on the hot path); a class with a constructor of its own is built by it."""
        if cls.__init__ is not PagedRows.__init__:
            return cls(
                pool=like._pool, codec=like.codec_spec, token_geometry=like._token_geometry,
                placement=like._paged,
            )  # fmt: skip
        fresh = cls.__new__(cls)
        fresh._paged, fresh._tables, fresh._pool = like._paged, [], like._pool
        fresh._finalizer, fresh._contiguous, fresh._row_stage = None, None, []
        fresh._setup(like.codec_spec, like._token_geometry, like._geometry)
        fresh._watch()
        return fresh

    def _watch(self) -> None:
        """Release the rows' blocks when this storage is collected (once its pool is known)."""
        if self._finalizer is None and self._pool is not None:
            self._finalizer = weakref.finalize(
                self, _release_tables, weakref.ref(self._pool), self._tables
            )

    def _reset_geometry(self) -> None:
        """Hold no row (a filter keeping none gives every block back)."""
        if self._tables:
            if self._pool is not None:
                self._pool.close(self._tables)
            self._tables[:] = []
        self._clear_beside()

    def _clear_beside(self) -> None:
        """No row is beside the pool (nor in any stage)."""
        if getattr(self, "_contiguous", None) is not None:
            self._contiguous._clear()
            self._row_stage = []

    # -- stages: the pool's (the last) and stage 0 beside it ------------------------------
    def _use_stages(self, specs: Sequence[CodecSpec]) -> None:
        super()._use_stages(specs)
        if len(specs) > 1:  # stage 0 beside the pool: a contiguous layout of its codec
            near = DECLARED[contiguous_preset(self.composition).name]
            self._contiguous = near.from_specs(specs[0], self._token_geometry)
            self._row_stage = []

    @property
    def _pool_stage(self) -> int:
        return len(self._stages) - 1

    def _in_pool(self, row: int) -> bool:
        """Whether row ``row``'s positions live in the pool (else beside it, stage 0)."""
        return self._contiguous is None or self._row_stage[row] == self._pool_stage

    def _split(self, stages: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
        """The rows (each in ``stages[b]``, default its own) in the pool and those beside
        it (the contiguous layout's rows), each part in batch order: every row operation
        runs on each part, then ``_stacked`` puts a read's parts back in batch order."""
        if self._contiguous is None:
            return list(range(len(self._offsets if stages is None else stages))), []
        last, pooled, beside = self._pool_stage, list[int](), list[int]()
        for b, stage in enumerate(self._row_stage if stages is None else stages):
            (pooled if stage == last else beside).append(b)
        return pooled, beside

    def _beside_rows(self) -> list[int]:
        """The rows beside the pool, in batch order (the contiguous layout's rows)."""
        return self._split()[1]

    def _slots(self) -> dict[int, int]:
        """Each row beside the pool: its row in the contiguous layout (in batch order)."""
        return {b: i for i, b in enumerate(self._beside_rows())}

    def _stacked(
        self,
        pooled: Callable[[list[int]], dict[str, Any]],
        beside: Callable[[list[int]], dict[str, Any]],
    ) -> dict[str, Any]:
        """A read per stage: ``pooled(rows)`` of the rows in the pool and ``beside(rows)``
        of those beside it (a part of no row is not read), stacked back in batch order
        (per tensor an array or a tuple of planes)."""
        split = self._split()
        parts = [read(rows) for rows, read in zip(split, (pooled, beside), strict=True) if rows]
        if len(parts) == 1:
            return parts[0]
        index = mx.array(np.argsort(split[0] + split[1]))  # each row's place in the parts

        def stack(xs: Sequence[Any]) -> Any:
            return mx.take(mx.concatenate(list(xs), axis=0), index, axis=0)

        return {
            t: tuple(map(stack, zip(*(p[t] for p in parts), strict=True)))
            if isinstance(x, tuple) else stack([p[t] for p in parts])
            for t, x in parts[0].items()
        }  # fmt: skip

    def _pool_gather(self, rows: Sequence[int], tensors: Collection[str] | None = None) -> PlaneSet:
        """Rows ``rows`` read from the pool at the placement's columns (``_pads``: growing
        rows right-aligned to the longest row of all, beside the pool or not); ``tensors``:
        those only (default every one)."""
        held, pads = [self._holds(b) for b in rows], [self._pads[b] for b in rows]
        return self._gather(rows, held, pads, tensors)

    def _restaged(self) -> None:
        """The rows changed: ``codec`` is the newest stage's any row is in."""
        if self._contiguous is not None and self._row_stage:
            self.codec = self._stages[max(self._row_stage)]

    @property
    def row_stages(self) -> tuple[int, ...]:
        if self._contiguous is None:
            return super().row_stages
        return tuple(self._row_stage)

    def _row_codecs(self, count: int) -> list[Codec]:
        if self._contiguous is None or not self._offsets:
            return super()._row_codecs(count)
        return [self._stages[stage] for stage in self._row_stage]

    def _held_codecs(self) -> list[Codec]:
        if self._contiguous is None or not self._offsets:
            return super()._held_codecs()
        return [self._stages[stage] for stage in sorted(set(self._row_stage))]

    def _convert_rows(self, rows: Sequence[int]) -> None:
        """Rows beside the pool into the pool's stage: each row's window in the contiguous
        layout decoded by stage 0's codec and encoded by the pool's (per token: what
        encoding at each append gave), written into fresh blocks (``_write_fresh``, its
        empty table replaced), counted as written; the contiguous layout keeps the
        others. The append that converts reserved the blocks (``_write_blocks``)."""
        if self._contiguous is None:
            super()._convert_rows(rows)
            return
        moving = sorted({check_row(b, len(self._offsets)) for b in rows})
        last = self._pool_stage
        for b in moving:
            if self._row_stage[b] == last:
                raise LayoutStateError(last_stage_message(b, last))
        if not moving:
            return
        near, slot = self._contiguous, self._slots()
        source, target = self._stages[0], self._stages[last]

        def row_planes(i: int) -> PlaneSet:
            window = near._held_window(slot[moving[i]])
            return {t: target.encode(source.decode(held, as_role(t)), as_role(t))
                    for t, held in window.items()}  # fmt: skip

        held = [(self._offsets[b], self._offsets[b], 0) for b in moving]
        pool, tables = self._write_fresh(self._shapes(), held, row_planes)
        pool.close([self._tables[b] for b in moving])  # their empty tables, replaced
        for b, table in zip(moving, tables, strict=True):
            self._tables[b] = table
        near.filter_rows([i for b, i in slot.items() if b not in moving])
        for b in moving:
            self._row_stage[b] = last
        self._restaged()

    def _changed(self) -> None:
        # ``Storage._changed`` (the positions' device copy dropped) without the super call,
        # on every row operation; the pads are computed at the next read (none here).
        self._offset_array, self._pads_stale = None, True

    #: The pads last computed (set by ``_clear``), and whether a change since has made
    #: them stale.
    _pads_held: list[int]
    _pads_stale = False

    @property
    def _pads(self) -> list[int]:
        """Each row's first column (``_placed_pads``), computed again only after a change
        and replaced only when it differs, so the masks' device copy survives a step."""
        if self._pads_stale:
            self._pads_stale = False
            pads = self._placed_pads()
            if pads != self._pads_held:
                self._pads_held = pads
        return self._pads_held

    @_pads.setter
    def _pads(self, pads: list[int]) -> None:
        self._pads_held, self._pads_stale = pads, False

    def _placed_pads(self) -> list[int]:
        """Right-aligned rows: every row ends at the longest."""
        top = max(self._offsets, default=0)
        return [top - o for o in self._offsets]

    def release(self) -> None:
        """Give every block back to the pool now (the cache then holds no row)."""
        if self._pool is not None:
            self._pool.close(self._tables)
        self._tables.clear()
        self._clear_beside()
        self._offsets, self._pads = [], []
        self._changed()

    def adopt_tables(self, tables: Sequence[Table], offset: int, count: int | None = None) -> None:
        """Hold ``tables`` (live tables of the pool, ``offset`` positions each, ``count``
        of them held: a ring's window) instead of what it held; they are released when
        this cache is collected (a serial storage's, or a layout that is its own serial
        class)."""
        assert self._pool is not None
        if self._tables:
            self._pool.close(self._tables)
        self._clear_beside()
        self._tables[:] = tables
        self._offsets = []  # every row replaced
        self._joined([(offset, offset if count is None else count, 0)] * len(tables))
        self._offsets = [offset] * len(tables)
        if self._contiguous is not None:  # in the pool's stage
            self._row_stage = [self._pool_stage] * len(tables)
            self._restaged()
        self._changed()
        self._watch()

    def _adopt_beside(self, near: Any, offset: int) -> None:
        """Hold one row beside the pool (this storage is empty): ``near``, a one-row
        contiguous layout of stage 0 (an extraction), at ``offset``; an empty open table."""
        self._contiguous = near
        self._row_stage = [0]
        self._tables[:] = [[] if self._pool is None else self._pool.open([])]
        self._offsets = [offset]
        self._restaged()
        self._changed()
        self._watch()

    def _joined(self, cuts: list[Lent]) -> None:
        """Rows holding ``cuts`` were added after the rows there (a ring records them)."""

    def _ensure_pool(self, geometry: KvGeometry, room: int = 0) -> BlockPool:
        """The pool, knowing ``geometry``; ``room``: the blocks the write that teaches a
        given pool its geometry takes (refused past its byte limit before it learns)."""
        if self._pool is None:
            self._pool = self.pool_class(
                self._stages[-1].spec, block_size=self.block_size, geometry=geometry
            )
        else:
            self._pool.learn(geometry, room=room)
        return self._pool

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this cache's tables hold (a shared block counts in each),
        and of the contiguous layout beside the pool."""
        beside = 0 if self._contiguous is None else int(self._contiguous.nbytes)
        if self._pool is None or self._geometry is None:
            return beside
        return sum(len(_live(t)) for t in self._tables) * self._pool.bytes_per_block + beside

    @property
    def beside_nbytes(self) -> int:
        """Bytes this cache holds outside the pool (the contiguous layout beside it): what
        an engine adds to its pools' bytes."""
        return 0 if self._contiguous is None else int(self._contiguous.nbytes)

    def held_arrays(self) -> tuple[Any, ...]:
        near = () if self._contiguous is None else tuple(self._contiguous.held_arrays())
        return near if self._pool is None else self._pool.held_arrays() + near

    #: ``_merges_with``'s key and the stages it was computed for.
    _merge_key: tuple[tuple[Codec, ...], tuple[Any, ...]] | None = None

    def _accepts(self, source: Any) -> bool:
        merges_with = getattr(source, "_merges_with", None)
        return merges_with is not None and merges_with() == self._merges_with()

    def _merges_with(self) -> tuple[Any, ...]:
        """What a source must share to join (its pool class, block size, stage codecs and
        token geometry), computed again only when its stages are replaced (the rest is
        fixed at construction)."""
        cached = self._merge_key
        if cached is None or cached[0] is not self._stages:
            stages = tuple(c.key for c in self._stages)
            key = (self.pool_class, self.block_size, stages, self._token_geometry)
            cached = self._merge_key = (self._stages, key)
        return cached[1]

    def _lents(self, offsets: Sequence[int] | None = None) -> list[Lent]:
        """What a merge or an extraction takes of each row (of rows at ``offsets``; a
        growing row: every position; a ring overrides it)."""
        return [(o, o, 0) for o in (self._offsets if offsets is None else offsets)]

    def _lent(self, b: int) -> Lent:
        return self._lents([self._offsets[b]])[0]

    def _merge_refusal(self, source: object) -> str:
        return paged_merge_message(
            self.signature(), self.block_size, self._stages[-1].key, type(source).__name__
        )

    # -- writes: the pool first (it may refuse with nothing changed) ----------------------
    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """The machinery's write and read, all or nothing (contract §9): a fault after the
        pool took blocks (its write, the read) puts the pool back (its journal) and this
        cache's host records."""
        step = super().update_and_fetch
        with self._pool_undoable():
            return all_or_nothing(self, lambda: step(keys, values))

    def _write_blocks(self, blocks: dict[str, Any], shapes: Any) -> None:
        """Two stages: the pool's rows take their share of the block encoded by the pool's
        codec (``_pool_write``), the rows beside it their share unencoded (the contiguous
        layout's write); the blocks of the rows that convert after this append are
        reserved first (a refusal changes nothing)."""
        if self._contiguous is None:
            super()._write_blocks(blocks, shapes)
            return
        first = next(iter(blocks.values()))
        rows, n = int(first.shape[0]), int(first.shape[2])
        opened = bool(self._offsets)
        stages = list(self._row_stage) if opened else [self._stage] * rows
        offsets = list(self._offsets) if opened else [0] * rows
        tables: list[Table] = self._tables if opened else [[] for _ in range(rows)]
        pooled, beside = self._split(stages)
        room = self._reserve(stages, offsets, n, lambda pool: pool.append_need(
            [tables[b] for b in pooled], [offsets[b] for b in pooled], n
        ), shapes)  # fmt: skip
        codec = self._stages[-1]
        share = {
            t: tuple(rows_of(p, pooled, rows) for p in codec.encode(x, as_role(t)))
            for t, x in (blocks.items() if pooled else ())
        }
        self._pool_write(share, n, shapes, rows, pooled, room)
        self._row_stage = stages
        if beside:
            near = {t: rows_of(x, beside, rows) for t, x in blocks.items()}
            self._contiguous._write_blocks(near, shapes)
        self._take_shapes(shapes)
        self._offsets = [o + n for o in offsets]
        self._restaged()
        self._changed()

    def _write(self, block: PlaneSet, n: int, geometry: KvGeometry) -> None:
        rows = len(self._offsets) or int(next(iter(block.values()))[0].shape[0])
        self._pool_write(block, n, geometry, rows, range(rows))
        super()._write(block, n, geometry)

    def _pool_write(
        self,
        block: PlaneSet,
        n: int,
        geometry: KvGeometry,
        rows: int,
        pooled: Sequence[int],
        room: int | None = None,
    ) -> None:
        """Rows ``pooled`` (of ``rows``) append ``block`` (their share) to the pool, which
        learns ``geometry`` first (``room``: the blocks it takes, default the append's);
        a serial storage's first block opens its tables once their blocks are taken."""
        if room is None:
            room = len(pooled) * math.ceil(n / self.block_size)
        pool = self._ensure_pool(geometry, room)
        opened = bool(self._offsets)
        tables: list[Table] = self._tables if opened else [[] for _ in range(rows)]
        if opened:
            pool.adopt_empty(tables)  # rows joined before any pool existed
            self._watch()
        if pooled:
            offsets = [self._offsets[b] if opened else 0 for b in pooled]
            pool.append([tables[b] for b in pooled], offsets, block, n)
        if not opened:
            for table in tables:
                pool.open(table, touch=False)
            self._tables[:] = tables
            self._watch()

    def _append(self, block: PlaneSet, n: int, geometry: KvGeometry) -> None:
        return None  # ``_write`` wrote the pool

    def _forget(self, counts: Sequence[int], *, justify: bool = False) -> None:
        if self._pool is not None:
            for table, offset, count in zip(self._tables, self._offsets, counts, strict=True):
                if count:
                    self._pool.release_tail(table, offset - count)
        near = [counts[b] for b in self._beside_rows()]
        if any(near):  # the contiguous rows stay right-justified: its ragged rollback
            self._contiguous._trim_rows(near, justify=True)

    def _check_trim(self, counts: Sequence[int]) -> None:
        return None

    def is_trimmable(self) -> bool:
        return True

    # -- reads: gathered from the pool, one path for every geometry ----------------------
    def _gather(
        self,
        rows: Sequence[int],
        held: Sequence[Lent],
        pads: Sequence[int],
        tensors: Collection[str] | None = None,
    ) -> PlaneSet:
        """Rows ``rows`` holding ``held`` each (``(offset, count, sinks)``: the geometry's
        positions, ``_holds`` / ``_lent``) read from their blocks in time order, row ``b``
        from column ``pads[b]``, ``max(pads[b] + count)`` columns (the one gather every
        read of the placement goes through; ``tensors``: those only)."""
        assert self._pool is not None
        width = max((p + count for p, (_, count, _) in zip(pads, held, strict=True)), default=0)
        tables = [self._tables[b] for b in rows]
        runs = [position_runs(*h) for h in held]
        return self._pool.gather(tables, runs, pads, width, tensors)

    def _gathered(self) -> PlaneSet:
        """Every row's held positions at the placement's columns (growing rows
        right-aligned, a ring's from column 0: ``_pads``); ``{}`` while no row holds one.
        Every row in the pool: with rows beside it, ``_read`` assembles the two."""
        if self._pool is None or not self._tables or not any(self._offsets):
            return {}
        rows = range(len(self._tables))
        return self._gather(rows, [self._holds(b) for b in rows], self._pads)

    def _read(self) -> dict[str, Any]:
        """Each tensor the pool holds (keys and values; a latent pool's latent, rope and
        index) gathered at the placement's columns, in the codec's fetched form; rows beside
        the pool read from the contiguous layout, each row then in batch order."""
        if self._pool is None or not self._tables or not any(self._offsets):
            raise LayoutStateError(NOTHING_TO_FETCH)
        width = max(self._offsets)
        return self._stacked(self._pool_read, lambda rows: self._beside_read(rows, width))

    def _pool_read(self, rows: list[int]) -> dict[str, Any]:
        """The rows in the pool (``rows``, in batch order), each tensor gathered at the
        placement's columns in the pool codec's fetched form."""
        codec = self._stages[-1]
        return {t: codec.fetched(p, as_role(t)) for t, p in self._pool_gather(rows).items()}

    def _beside_read(self, rows: Sequence[int], width: int) -> dict[str, Any]:
        """The rows beside the pool (``rows``) as stage 0 reads them, right-justified in
        ``width`` columns, zeros in every column that holds no token of its row (the
        pool's gather zeros)."""
        near, shapes = self._contiguous, self._shapes()
        offsets = [self._offsets[b] for b in rows]
        if near.width:
            read = near._read()
        else:
            zeros = self._zeros(len(offsets), 0, shapes, self._stages[0])
            read = {t: self._stages[0].fetched(z, as_role(t)) for t, z in zeros.items()}
        held = self._held_mask(offsets, width)
        out = {}
        for t, x in read.items():
            pad = width - int(x.shape[2])
            if pad:
                x = mx.concatenate([mx.zeros((*x.shape[:2], pad, x.shape[3]), x.dtype), x], 2)
            out[t] = mx.where(held, x, mx.array(0, x.dtype))
        return out

    @staticmethod
    def _held_mask(offsets: Sequence[int], width: int) -> mx.array:
        """Bool ``[B, 1, width, 1]``: the columns of right-justified rows at ``offsets``."""
        starts = mx.array([width - o for o in offsets])[:, None, None, None]
        return mx.arange(width)[None, None, :, None] >= starts

    def _held_window(self, row: int | None) -> PlaneSet | None:
        """Row ``row``'s window read from its blocks from column 0 (what a merge or an
        extraction takes, ``_lent``; a row beside the pool: its contiguous window; on a
        serial storage when ``row`` is ``None``: every row's held positions, stacked);
        ``None`` while it holds none."""
        if row is not None and not self._in_pool(row):
            window: PlaneSet | None = self._contiguous._held_window(self._slots()[row])
            return window
        if self._pool is None or not self._tables:
            return None
        if row is None:
            # Only a serial storage reads every row at once (``Serial._row_windows``), and
            # only ``PagedLatentCache``, a layout, holds rows beside its pool.
            assert not self._beside_rows(), "every row at once: the pool's rows only"
            if self._offsets[0] == 0:
                return None
            rows = range(len(self._tables))
            return self._gather(rows, [self._holds(b) for b in rows], [0] * len(rows))
        if self._offsets[row] == 0:
            return None
        return self._gather([row], [self._lent(row)], [0])

    def _held(self) -> tuple[Any, Any] | None:
        if self._pool is None or not self._tables or not any(self._offsets):
            return None
        return self.fetch()

    def _row_windows(self) -> list[RowWindow]:
        # A merge reads no byte: ``_join`` takes the tables (a serial storage without rows
        # lends one empty row); a row beside the pool lends its window (its bytes move).
        if self._contiguous is None:  # one stage: every row in the pool
            return [(None, offset) for offset in self._offsets] or [(None, 0)]
        return [
            (None if self._in_pool(b) else self._held_window(b), offset)
            for b, offset in enumerate(self._offsets)
        ] or [(None, 0)]

    # -- masks: the growing geometry's (paging adds no mask rule) ------------------------
    def _serial_mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        return GrowingGeometry._serial_mask(cast(Any, self), n, return_array, window)

    def _layout_mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        return GrowingGeometry._layout_mask(cast(Any, self), n, return_array, window)

    #: What the growing geometry's masks read: the row ends, kept while the pads and
    #: positions stay the same lists (``GrowingGeometry._ends``).
    _ends_of: Any = None

    def _ends(self) -> tuple[int, list[int], bool]:
        return GrowingGeometry._ends(cast(Any, self))

    # -- checks and forms ----------------------------------------------------------------
    def _check_geometry(self) -> None:
        assert len(self._tables) == len(self._offsets)
        if self._contiguous is not None:
            assert len(self._row_stage) == len(self._offsets), "one stage per row"
            near = [self._offsets[b] for b in self._beside_rows()]
            assert self._contiguous.row_offsets == tuple(near), "stage 0: the rows beside"
            self._contiguous.check_valid()
        for b, (table, offset) in enumerate(zip(self._tables, self._offsets, strict=True)):
            if not self._in_pool(b):
                assert table == [] and id(table) in self._pool._tables if self._pool else True
                continue  # a row beside the pool holds no block
            assert len(table) == math.ceil(offset / self.block_size)
            assert self._pool is None or id(table) in self._pool._tables
            needed = held_blocks(*self._holds(b), self.block_size)
            assert all((t != FREE) == (j in needed) for j, t in enumerate(table)), (
                "a row holds exactly the blocks of its positions"
            )

    def _holds(self, b: int) -> Lent:
        """What row ``b`` holds: ``(offset, positions held, sinks)`` (growing: every one)."""
        offset = self._offsets[b]
        return offset, offset, 0

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

    def _write_fresh(
        self, geometry: Any, held: Sequence[Lent], row_planes: Callable[[int], PlaneSet]
    ) -> tuple[BlockPool, list[Table]]:
        """Rows holding ``held`` (``(offset, count, sinks)``; row ``b``'s compact planes
        ``row_planes(b)``, made one row at a time) written into fresh blocks of the pool,
        every block taken at once (a refusal changes nothing), counted as written (not
        copied); their opened tables."""
        size = self.block_size
        needed = [held_blocks(*h, size) for h in held]
        pool = self._ensure_pool(geometry, sum(len(n) for n in needed))
        fresh = pool.ledger.allocate(sum(len(n) for n in needed))
        tables: list[Table] = []
        for b, (row, blocks) in enumerate(zip(held, needed, strict=True)):
            table = pool.open(pool.fresh_table(row[0], blocks, fresh), touch=False)
            if row[1]:  # (a chunked row may hold no position at its offset)
                pool.write_row(table, row_planes(b), position_runs(*row))
            tables.append(table)
        pool.ledger.bytes_written += sum(count for _, count, _ in held) * pool.token_bytes
        return pool, tables

    @property
    def _sink_count(self) -> int:
        """The positions a row never gives back (a ring's ``keep``; 0 for growing)."""
        return 0

    def _first(self) -> int:
        """A serial storage's position (its rows move together; 0 before a write)."""
        return self._offsets[0] if self._offsets else 0

    def _state(self) -> tuple[Any, ...]:
        """The form of the composition (``kvrows.forms.state_form``: the planes compact,
        right-aligned in a layout, the geometry's fields, the placement's)."""
        # Gathers every row from the pool: ``PagedLatentCache``, the one storage holding rows
        # beside it, saves through its own ``_state`` (``PagedLatentMembers``).
        assert not self._beside_rows(), "the paged state form: the pool's rows only"
        rows = range(len(self._offsets))
        counts = [self._holds(b)[1] for b in rows]
        width = max(counts, default=0)
        pads = [width - c for c in counts]
        planes = (  # rows of no position: zero-width planes (their count and geometry)
            self._gather(rows, [self._holds(b) for b in rows], pads)
            if self._pool is not None and self._geometry is not None and self._offsets
            else None
        )
        fields = {
            "keys": None if planes is None else planes["keys"],
            "values": None if planes is None else planes["values"],
            "offset": _index(self._offsets) if self.composition.is_layout else self._first(),
            "left_padding": _index(pads),
            "idx": width,
            "total": width,
            "rotated": False,
            "block_size": self.block_size,
            "codec": codec_field(self.codec_spec),
            **self._token_geometry.parameters(),
            "keep": self._sink_count,
            "start_position": self._first() - counts[0] if counts else 0,  # a chunked row's
        }
        return pack_state(self.composition, fields)

    def _load(self, parsed: PagedState) -> None:
        """Hold ``parsed``'s rows, written into fresh blocks (a serial state of no position
        and no planes holds no row)."""
        rows = len(parsed.offsets)
        learnt = parsed.geometry
        if parsed.width == 0 and not (any(parsed.offsets) and learnt is not None):
            if parsed.names_rows:
                pool = self._pool or self.pool_class(
                    parsed.spec, block_size=parsed.block_size, geometry=learnt
                )
                self._pool = pool
                self._watch()
                self._tables[:] = [pool.open([]) for _ in range(rows)]
                self._offsets = []
                self._joined([(0, 0, 0)] * rows)
                self._offsets = [0] * rows
                self._changed()
            return
        assert learnt is not None

        def row_planes(b: int) -> PlaneSet:
            return {t: tuple(owned(p) for p in held) for t, held in parsed.row_planes(b).items()}

        sinks = self._sink_count
        held = [(o, c, sinks) for o, c in zip(parsed.offsets, parsed.held(), strict=True)]
        pool, tables = self._write_fresh(learnt, held, row_planes)
        self._watch()
        self._tables[:] = tables
        self._offsets = []
        self._joined(held)
        self._offsets = list(parsed.offsets)
        self._geometry = learnt
        self._changed()


class PagedSerial(PagedRows, Serial):
    """A request's block table into a pool (``spec/PagedKVCache.md``): a serial store,
    bit-exact with ``KVCache`` on the same tokens. Shape-generic in ``B`` as every serial
    storage, though a request is one row: prefix registration is per request (``B = 1``)."""

    def _request(self) -> Table:
        if len(self._tables) != 1:
            raise LayoutStateError(request_rows_message(len(self._tables)))
        return self._tables[0]

    @property
    def block_table(self) -> tuple[int, ...]:
        """The physical blocks holding this request's positions, in logical order."""
        return tuple(self._request()) if self._tables else ()

    def register_prefix(self, token_ids: Sequence[int]) -> int:
        """Cache the full blocks ``token_ids`` (the ids of this request's first positions,
        at most ``offset`` of them) covers; returns how many blocks are cached. A ring
        caches those of its window only while it holds every position (``PoolBase.
        register_blocks``): past that, none."""
        if self._pool is None or not self._tables:
            raise LayoutStateError(EMPTY_CACHE_NO_BLOCK)
        table, cap = self._request(), self._token_geometry.cap()
        return self._pool.register_prefix(table, self._holds(0)[:2], token_ids, cap)

    def check_valid(self) -> None:
        assert len(set(self._offsets)) <= 1, "rows move together"
        self._check_geometry()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(offset={self.offset}, blocks={self._tables})"


class PagedLayout(PagedRows, Layout):
    """Block-table rows (``spec/PagedKvRows.md``): ragged rows, each appending at its own
    end; the read right-aligns them."""

    @property
    def width(self) -> int:
        """Columns a read returns (the longest row)."""
        return max(self._offsets, default=0)

    @property
    def holds_proposals(self) -> bool:
        """Growing rows drop nothing: a proposal round's positions are forgotten as any
        (a ring and a chunked placement say for themselves)."""
        return True

    def block_tables(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(t) for t in self._tables)

    def make_empty_batch(self) -> PagedLayout:
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
        per_token = shapes_token_bytes(self.codec, g)
        return math.ceil(count / self.block_size) * self.block_size * per_token

    def row_window(self, row: int) -> tuple[Planes, Planes] | None:
        """Row ``row``'s positions' planes in logical order (``None`` when it holds none)."""
        return self.row_planes(row)

    def _lent_of(
        self, sources: Sequence[Any], incoming: list[RowWindow]
    ) -> list[tuple[BlockPool | None, Table | None, Lent]]:
        """Each joining row's pool, table and what a merge takes of it (its offset, in
        ``incoming``, says that: the sources share this storage's token geometry); a row
        beside its pool lends neither (its window joins the contiguous layout)."""
        # Each source's own rows (what a chunked row holds is not its offset's), or the one
        # empty row of a serial storage without rows.
        cuts = iter(
            [cut for s in sources for cut in (s._lents() if s._tables else self._lents([0]))]
        )
        lent: list[tuple[BlockPool | None, Table | None, Lent]] = []
        for source in sources:  # a serial storage without rows lends one empty row
            tables, source_pool = source._tables, source._pool
            if not tables:
                lent.append((source_pool, None, next(cuts)))
            elif source._contiguous is None:  # one stage: every row in the pool
                lent += [(source_pool, t, next(cuts)) for t in tables]
            else:
                lent += [
                    (source_pool, t, next(cuts)) if source._in_pool(b) else (None, None, next(cuts))
                    for b, t in enumerate(tables)
                ]
        assert next(cuts, None) is None, "one window per lent row"
        return lent

    @staticmethod
    def _foreign(
        lent: list[tuple[BlockPool | None, Table | None, Lent]], pool: BlockPool
    ) -> list[tuple[BlockPool, Table, Lent]]:
        """The joining rows of another pool that hold tokens: copied into fresh blocks."""
        return [
            (p, t, c) for p, t, c in lent if p is not None and p is not pool and t is not None
            and c[0]
        ]  # fmt: skip

    def _check_join(
        self,
        sources: Sequence[Any],
        incoming: list[RowWindow],
        geometry: KvGeometry | None,
        stages: list[int],
    ) -> None:
        """The pool's refusals of ``_join`` (another geometry, no room for the copies); rows
        of either stage join, beside the pool or in it (no refusal of the stages)."""
        pool = self._pool or (sources[0]._pool if sources else None)
        if pool is not None and all(s._pool is pool for s in sources):
            return  # rows of one pool join by reference: nothing to take
        lent = self._lent_of(sources, incoming)
        pool = self._pool or next((p for p, _, _ in lent if p is not None), None)
        if pool is not None:  # (a new pool takes the copies: it has no limit)
            foreign = self._foreign(lent, pool)
            bs = pool.block_size
            taken = sum(len(held_blocks(*cut, bs)) for _, _, cut in foreign)
            pool.check_take(geometry, taken)

    def _join(
        self,
        sources: Sequence[Any],
        incoming: list[RowWindow],
        geometry: KvGeometry | None,
        stages: list[int],
    ) -> None:
        """Rows of this layout's pool join by reference (no byte moves); rows of another
        pool are copied into fresh blocks (all taken at once: a refusal changes nothing)."""
        lent = self._lent_of(sources, incoming)
        if not lent:
            return
        pool = self._pool or next((p for p, _, _ in lent if p is not None), None)
        if pool is None and geometry is None:  # rows of no position, no pool yet
            self._tables.extend([] for _ in lent)
            self._joined([(0, 0, 0)] * len(lent))
            self._join_beside(incoming, geometry, stages)
            self._offsets = self._offsets + [0] * len(lent)
            self._changed()
            return
        if pool is None:  # empty serial caches or rows beside their pool: a pool of ours
            pool = self.pool_class(
                self._stages[-1].spec, block_size=self.block_size, geometry=geometry
            )
        foreign = self._foreign(lent, pool)
        bs = pool.block_size
        if geometry is not None and geometry is not pool.geometry:  # (rows of this pool)
            # Copies into a pool that learns here: within its limit.
            pool.learn(geometry, room=sum(len(held_blocks(*c, bs)) for _, _, c in foreign))
        copies = iter(pool.copy_in(foreign) if foreign else ())
        joined: list[Table] = []
        shared: list[Table] = []  # opened together below (one pass over their blocks)
        for source_pool, table, cut in lent:
            if table is None or (source_pool is not pool and cut[0] == 0):
                joined.append([])
                shared.append(joined[-1])
            elif source_pool is pool:  # the blocks of what the merge takes, shared
                offset, retained, _ = cut
                if retained == offset and len(table) == -(-offset // bs):  # all of it
                    joined.append(list(table))
                else:
                    needed = held_blocks(*cut, bs)
                    joined.append([b if j in needed else FREE for j, b in enumerate(table)])
                shared.append(joined[-1])
            else:
                joined.append(next(copies))
        pool.open_all(shared)
        if self._pool is None:
            pool.adopt_empty(self._tables)  # rows joined before any pool existed
            self._pool = pool
        self._watch()
        self._tables.extend(joined)
        self._joined([cut for _, _, cut in lent])
        if self._contiguous is not None:
            self._join_beside(incoming, geometry, stages)
        self._offsets = self._offsets + [offset for _, _, (offset, _, _) in lent]
        self._geometry = geometry
        self._changed()

    def _join_beside(
        self, incoming: list[RowWindow], geometry: KvGeometry | None, stages: list[int]
    ) -> None:
        """Two stages: the joining rows' stages; those beside the pool join the contiguous
        layout (their windows; the bytes move)."""
        if self._contiguous is None:
            return
        near = [w for w, stage in zip(incoming, stages, strict=True) if stage != self._pool_stage]
        if near:
            self._contiguous._join([], near, geometry, [0] * len(near))
        self._row_stage = self._row_stage + list(stages)
        self._restaged()

    def _keeps_at_once(self, order: list[int]) -> bool:
        return self._contiguous is None  # tables and the ledger's counts (rows beside: arrays)

    def _keep(self, order: list[int]) -> None:
        """The rows not kept give their blocks back to the pool (and those beside it their
        rows of the contiguous layout)."""
        if self._pool is not None and len(order) < len(self._tables):
            kept = set(order)
            self._pool.close([t for i, t in enumerate(self._tables) if i not in kept])
        self._tables[:] = [self._tables[i] for i in order]
        if self._contiguous is not None:
            slot = self._slots()
            self._contiguous.filter_rows([slot[b] for b in order if b in slot])
            self._row_stage = [self._row_stage[b] for b in order]
            self._restaged()

    def _empty_serial(self) -> Any:
        """An empty serial storage of this pool a row extracts into: the composition's,
        or the layout itself when it is its own."""
        entry = self.composition
        return cast(type[PagedSerial], DECLARED[entry.serial or entry.name])._spawn_like(self)

    def extract_row(self, row: int) -> Serial:
        """A ``PagedKVCache`` holding row ``row``: its table shared, no byte moved (a row
        beside the pool: the contiguous layout's extraction, beside the pool again)."""
        index = check_row(row, self.batch_size)
        serial = cast(PagedSerial, self._empty_serial())
        serial._geometry = self._geometry
        if not self._in_pool(index):
            if self._offsets[index]:
                near = self._contiguous.extract_row(self._slots()[index])
                serial._adopt_beside(near, self._offsets[index])
            return serial
        offset, count, sinks = self._lent(index)
        if self._pool is not None and offset:
            table = self._tables[index]
            if count == offset and len(table) == -(-offset // self.block_size):  # all of it
                table = list(table)
            else:
                needed = held_blocks(offset, count, sinks, self.block_size)
                table = [b if j in needed else FREE for j, b in enumerate(table)]
            serial.adopt_tables([self._pool.open(table)], offset, count)
        return serial

    def register_prefix(self, row: int, token_ids: Sequence[int]) -> int:
        """Cache row ``row``'s full blocks ``token_ids`` covers (a ring's while it holds
        every position)."""
        index = check_row(row, self.batch_size)
        if self._pool is None:
            raise LayoutStateError(EMPTY_ROW_NO_BLOCK)
        held, cap = self._holds(index)[:2], self._token_geometry.cap()
        return self._pool.register_prefix(self._tables[index], held, token_ids, cap)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(offsets={list(self._offsets)})"


class PagedRing(PagedRows):
    """The paged placement under the ring geometry (``spec/PagedRotatingKVCache.md``,
    ``spec/PagedRotatingRows.md``): each row keeps what the ragged ring keeps (its sinks
    and newest positions: ``max_size - 1 + n`` right after a block of ``n``, ``max_size``
    after a single token), read in time order from column 0 (a layout's rows
    left-aligned, as ``RaggedRotatingRows``); the blocks none of whose positions a row
    still holds go back to the pool after every write. Listed first among the bases of
    the public classes, over :class:`PagedSerial` / :class:`PagedLayout`."""

    geometry_kind = "ring"
    _retained: list[int]
    #: A layout's row ``b`` reads from column ``_lead[b]`` (less the smallest): the
    #: contiguous ragged ring's columns (``kvrows.geometries.ring.ragged_step``), which a
    #: gather places at no cost (a model builds every sliding layer's mask from one
    #: layer's). A serial ring's stays 0.
    _lead: list[int]

    @property
    def max_size(self) -> int:
        return int(cast(Any, self._token_geometry).max_size)

    @property
    def keep(self) -> int:
        return int(cast(Any, self._token_geometry).keep)

    def _reset_geometry(self) -> None:
        super()._reset_geometry()
        self._retained = []
        self._lead = []

    def release(self) -> None:
        super().release()
        self._retained = []
        self._lead = []

    @property
    def left_pad(self) -> tuple[int, ...]:
        return (0,) * len(self._offsets)  # (a lead's columns hold dropped tokens, not pads)

    def _placed_pads(self) -> list[int]:
        # Every row from its lead (the ragged ring's): not the right-alignment of growing rows.
        base = min(self._lead, default=0)
        return [lead - base for lead in self._lead]

    #: A proposal round holds the rows (``_spec_hold``): they drop nothing, so no block
    #: leaves a window until the discard forgets the round's positions.
    _holding: bool = False

    @property
    def holds_proposals(self) -> bool:
        """A layout's rows: while held they drop nothing (the mask still shows each query
        its window) and free no block, so the discard leaves every row as it was."""
        return self.composition.is_layout

    def _spec_hold(self, on: bool) -> None:
        self._holding = on

    def _leads_after(self, n: int) -> list[int]:
        """Each row's lead once it appends ``n`` (the ragged ring's rule; a serial ring's
        0)."""
        if not self.composition.is_layout:
            return [0] * len(self._retained)
        slack = ragged_slack(self.max_size, self.keep)
        step = ragged_step(
            self._lead, self._retained, n, self.max_size, slack, holding=self._holding
        )
        return list(step.leads)

    def _lents(self, offsets: Sequence[int] | None = None) -> list[Lent]:
        # A merge and an extraction take the window: the sinks and newest ``max_size``.
        size, keep = self.max_size, self.keep
        return [(o, min(o, size), keep) for o in (self._offsets if offsets is None else offsets)]

    def _holds(self, b: int) -> Lent:
        return self._offsets[b], self._retained[b], self.keep

    @property
    def _sink_count(self) -> int:
        return self.keep

    def _joined(self, cuts: list[Lent]) -> None:
        self._retained = self._retained[: len(self._offsets)] + [c for _, c, _ in cuts]
        self._lead = [0] * len(self._retained)  # a join lays every row from column 0

    def _release_outside(self) -> None:
        """Give back the blocks out of every row's positions (tail first per row)."""
        if self._pool is None:
            return
        size = self.block_size
        for b, table in enumerate(self._tables):
            self._pool.release_outside(table, held_blocks(*self._holds(b), size))

    # -- writes and trims --------------------------------------------------------------
    def _write(self, block: PlaneSet, n: int, geometry: KvGeometry) -> None:
        rows = len(self._offsets) or int(next(iter(block.values()))[0].shape[0])
        after = self._after(n) if self._offsets else [n] * rows
        leads = self._leads_after(n) if self._offsets else [0] * rows
        super()._write(block, n, geometry)  # the pool first: it may refuse, nothing changed
        self._retained, self._lead = after, leads
        self._changed()  # (the write may have read the pads at the old leads)
        self._release_outside()

    def _after(self, n: int) -> list[int]:
        """Positions each row holds once it appends ``n`` (it keeps ``max_size - 1``
        before them; all of them while a proposal round holds the rows)."""
        return retained_after(self._retained, n, self.max_size, holding=self._holding)

    def _check_trim(self, counts: Sequence[int]) -> None:
        """The ring's rules: a serial ring trims only before it wraps; a row of a layout
        while it keeps its whole window before the trimmed tokens."""
        size = self.max_size
        if not self.composition.is_layout:
            if any(counts) and self._first() >= size:
                raise NotTrimmableError(
                    wrapped_ring_message(f"a ring with {self._first()} columns written", size)
                )
            return
        rows = zip(counts, self._offsets, self._retained, strict=True)
        for b, (count, offset, held) in enumerate(rows):
            if count > offset:
                raise NotTrimmableError(trim_past_row_message(count, b, offset))
            if count and held - count < min(offset - count, size):
                raise NotTrimmableError(ring_rollback_message(b, offset, held, count, size))

    def _forget(self, counts: Sequence[int], *, justify: bool = False) -> None:
        super()._forget(counts, justify=justify)
        self._retained = [r - c for r, c in zip(self._retained, counts, strict=True)]

    def is_trimmable(self) -> bool:
        return all(o < self.max_size for o in self._offsets)

    def can_publish_row(self, row: int, tokens: int) -> bool:
        """A prefix is publishable only before the ring wraps."""
        offset = self._offsets[check_row(row, len(self._offsets))]
        count = as_count(tokens, "tokens")
        return count == offset or (count < offset < self.max_size)

    def projected_bytes(self, tokens: int) -> int:
        """Bytes one row of ``tokens`` positions holds between appends: the blocks of its
        sinks and newest ``max_size`` positions."""
        count = as_count(tokens, "tokens")
        g = self._geometry
        if g is None:
            raise LayoutStateError(PROJECTED_BYTES_NEEDS_GEOMETRY)
        blocks = projected_blocks(count, self.max_size, self.keep, self.block_size)
        return blocks * self.block_size * shapes_token_bytes(self.codec, g)

    def _keep(self, order: list[int]) -> None:
        super()._keep(order)
        self._retained = [self._retained[i] for i in order]
        self._lead = [self._lead[i] for i in order]

    # -- reads: the placement's (``_holds`` / ``_lent`` say which positions) -----------
    def window(self) -> tuple[Planes, Planes] | None:
        """A serial ring's window (its sinks and newest ``min(offset, max_size)``
        positions) in time order, rows stacked."""
        if self._pool is None or not self._tables or self._offsets[0] == 0:
            return None
        rows = range(len(self._tables))
        planes = self._gather(rows, [self._lent(b) for b in rows], [0] * len(rows))
        return planes["keys"], planes["values"]

    # -- masks: the ring geometry's, over columns in time order (the placement says only
    # what each row holds: ``_retained``, through ``_after``) ----------------------------
    def _serial_mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        return RingGeometry._serial_mask(cast(Any, self), n, return_array, window)

    def _layout_mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        after, leads = self._after(n), self._leads_after(n)
        return RingGeometry._ragged_mask(cast(Any, self), after, leads, n, window)

    # -- checks ------------------------------------------------------------------------
    def _check_geometry(self) -> None:
        assert len(self._retained) == len(self._offsets) == len(self._lead)
        held = zip(self._retained, self._offsets, strict=True)
        assert all(min(o, self.max_size) <= r <= o for r, o in held)
        super()._check_geometry()


class PagedChunked(PagedRows):
    """The paged placement under the chunked geometry (``spec/ChunkedKVCache.md`` §7): row
    ``b`` holds positions ``[start[b], offset[b])``; before every append it keeps its newest
    ``chunk_size`` (its start moves up), and after the write (or ``maybe_trim_front``) the
    blocks none of whose positions it holds go back to the pool, their entries ``FREE``
    (the block holding its first position stays). A layout's rows end at one column: each
    row's pad is the longest held run less its own. Listed first among the bases of the
    public classes, over :class:`PagedSerial` / :class:`PagedLayout`."""

    geometry_kind = "chunked"
    #: Each row's first held position (mlx-lm's ``start_position``).
    _starts: list[int]

    @property
    def holds_proposals(self) -> bool:
        return False  # a full chunk frees the one before it

    @property
    def _size(self) -> int:
        return int(cast(Any, self._token_geometry).chunk_size)

    def _reset_geometry(self) -> None:
        super()._reset_geometry()
        self._starts = []

    def release(self) -> None:
        super().release()
        self._starts = []

    @property
    def _tokens_held(self) -> list[int]:
        return [o - s for o, s in zip(self._offsets, self._starts, strict=True)]

    def _placed_pads(self) -> list[int]:
        held = self._tokens_held
        top = max(held, default=0)
        return [top - h for h in held]

    def _holds(self, b: int) -> Lent:
        offset = self._offsets[b]
        return offset, offset - self._starts[b], 0

    def _lents(self, offsets: Sequence[int] | None = None) -> list[Lent]:
        # A merge and an extraction take what each row holds (not a function of its offset:
        # only a row of no position is asked for by offset).
        if offsets is not None:
            return [(o, 0, 0) for o in offsets]
        return [self._holds(b) for b in range(len(self._offsets))]

    def _lent(self, b: int) -> Lent:
        return self._holds(b)

    def _joined(self, cuts: list[Lent]) -> None:
        self._starts = self._starts[: len(self._offsets)] + [o - c for o, c, _ in cuts]

    def _keep(self, order: list[int]) -> None:
        super()._keep(order)
        self._starts = [self._starts[i] for i in order]

    # -- the front trim ----------------------------------------------------------------
    def _front_trimmed(self) -> list[int]:
        """Each row's start once it keeps its newest ``chunk_size`` positions."""
        size = self._size
        return [max(s, o - size) for s, o in zip(self._starts, self._offsets, strict=True)]

    def _release_outside(self) -> None:
        """Give back the blocks out of every row's positions (tail first per row)."""
        if self._pool is None:
            return
        size = self.block_size
        for b, table in enumerate(self._tables):
            self._pool.release_outside(table, held_blocks(*self._holds(b), size))

    def _forget(self, counts: Sequence[int], *, justify: bool = False) -> None:
        """The blocks past each row's new end go back (the placement's), and so does a
        partly filled tail none of whose positions it still holds (a row trimmed to
        nothing)."""
        super()._forget(counts, justify=justify)
        if self._pool is None:
            return
        size = self.block_size
        for b, (table, count) in enumerate(zip(self._tables, counts, strict=True)):
            if count:
                end = self._offsets[b] - count
                self._pool.release_outside(table, held_blocks(end, end - self._starts[b], 0, size))

    def _trim_front(self) -> None:
        """``maybe_trim_front``: every row keeps its newest ``chunk_size`` positions now;
        the blocks before them go back to the pool."""
        starts = self._front_trimmed()
        if starts != self._starts:
            self._starts = starts
            self._changed()
            self._release_outside()

    def _write(self, block: PlaneSet, n: int, geometry: KvGeometry) -> None:
        rows = len(self._offsets) or int(next(iter(block.values()))[0].shape[0])
        starts = self._front_trimmed() if self._offsets else [0] * rows
        super()._write(block, n, geometry)  # the pool first: it may refuse, nothing changed
        self._starts = starts
        self._release_outside()

    def projected_bytes(self, tokens: int) -> int:
        """Bytes one row of ``tokens`` positions holds between appends: the blocks of its
        newest ``chunk_size`` positions."""
        count = as_count(tokens, "tokens")
        g = self._geometry
        if g is None:
            raise LayoutStateError(PROJECTED_BYTES_NEEDS_GEOMETRY)
        blocks = projected_blocks(count, self._size, 0, self.block_size)
        return blocks * self.block_size * shapes_token_bytes(self.codec, g)

    # -- masks: the chunked geometry's, over the right-aligned held runs ----------------
    def _chunk_mask(self, *args: Any) -> Mask:
        return ChunkedGeometry._chunk_mask(cast(Any, self), *args)

    def _serial_mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        return ChunkedGeometry._serial_mask(cast(Any, self), n, return_array, window)

    def _layout_mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        return ChunkedGeometry._layout_mask(cast(Any, self), n, return_array, window)

    # -- checks ------------------------------------------------------------------------
    def _check_geometry(self) -> None:
        assert len(self._starts) == len(self._offsets)
        assert all(0 <= h <= o for h, o in zip(self._tokens_held, self._offsets, strict=True))
        super()._check_geometry()
