"""The paged storages, written once over an implementation's plane operations.

``BlockPool`` (one per layer), ``PagedKVCache`` (one request's block table into a pool)
and ``PagedKvRows`` (a ragged layout of block tables) keep their bookkeeping here, in
Python ints (``kvrows.paged``); each implementation supplies :class:`PlaneOps` (NumPy in
``reference/paged.py``, MLX in ``optimized/paged.py``): scatter tokens into pool slots,
gather them back, grow the planes, build masks. The independent oracle of both is the
contiguous ``KVCache``: a paged cache holds the same bytes, arranged in blocks
(``spec/PagedKVCache.md``).

Row operations on a layout edit block tables and reference counts only: merging rows of
the layout's own pool, filtering, extracting and publishing move no KV byte (the pool's
``bytes_copied`` counter proves it). A row about to write into a partly filled tail block
that another table holds, or that caches a prefix, copies that one block first (copy on
write). Rows of another pool are copied into fresh blocks (counted); rows of a non-paged
storage are refused (``spec/PagedKvRows.md`` §3 says why).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

from kvrows.common import ComposedIdentity, SavedState, check_counts
from kvrows.compositions import Composition
from kvrows.errors import (
    EMPTY_CACHE_NO_BLOCK,
    EMPTY_LAYOUT_UPDATE,
    EMPTY_ROW_NO_BLOCK,
    MERGE_NEEDS_SEQUENCE,
    NOTHING_TO_FETCH,
    POOL_GEOMETRY_UNKNOWN,
    PROJECTED_BYTES_NEEDS_GEOMETRY,
    IncompatibleRowsError,
    InvalidInputError,
    LayoutStateError,
    NotTrimmableError,
    PoolExhaustedError,
    no_affine_parameter_message,
    paged_empty_write_message,
    paged_merge_message,
    paged_read_only_message,
    pool_geometry_message,
    pool_limit_message,
    prefix_mismatch_message,
    prefix_too_long_message,
    request_rows_message,
    self_merge_message,
    trim_past_row_message,
)
from kvrows.paged import (
    DEFAULT_BLOCK_SIZE,
    ROOT_HASH,
    BlockLedger,
    bind_paged,
    chain_hashes,
    check_limit,
)
from kvrows.paged import token_ids as read_token_ids
from kvrows.protocols import Cache, Mask
from kvrows.schemes import CodecSpec, Plain
from kvrows.speculative import SpeculativeRounds
from kvrows.validation import (
    KvGeometry,
    as_count,
    check_block,
    check_keep,
    check_row,
    check_window,
    common_geometry,
)

__all__ = [
    "BlockPoolBase",
    "BlockTable",
    "PagedKVCacheBase",
    "PagedKvRowsBase",
    "Piece",
    "PlaneOps",
]

Planes = tuple[Any, ...]
_R = TypeVar("_R")
#: One write of a token run into one block: ``(block, start, count, row, token)``.
Piece = tuple[int, int, int, int, int]


class PlaneOps(Protocol):
    """What an implementation does with arrays for the paged storages.

    Pool planes are ``[num_blocks, H, block_size, w]``; a token slot is ``(block,
    within)``. ``scatter`` and ``copy_block`` return the updated planes (an implementation
    may update in place and return the same tuple)."""

    def make_codec(self, spec: CodecSpec) -> Any: ...

    def dtype_name(self, array: object) -> str: ...

    def shape(self, array: object) -> tuple[int, ...]: ...

    def concat_blocks(self, old: Planes, new: Planes) -> Planes: ...

    def scatter(self, planes: Planes, pieces: Sequence[Piece], source: Planes) -> Planes:
        """For each piece ``(block, start, count, row, token)``:
        ``planes[block, :, start : start + count] = source[row, :, token : token + count]``
        (``source``: ``[B, H, n, w]``)."""
        ...

    def copy_block(self, planes: Planes, target: int, origin: int, count: int) -> Planes:
        """``planes[target, :, :count] = planes[origin, :, :count]``."""
        ...

    def gather(
        self,
        planes: Planes,
        rows: Sequence[tuple[Sequence[int], int]],
        pads: Sequence[int],
        width: int,
    ) -> Planes:
        """``[B, H, width, w]``: row ``b``'s first ``count`` positions (its ``blocks`` in
        order) at columns ``[pads[b], width)``, zeros before them; compact, owned arrays."""
        ...

    def mask(self, pads: Sequence[int], end: int, n: int, window: int | None, serial: bool) -> Any:
        """The boolean mask of ``n`` queries at columns ``end..end+n-1`` over keys
        ``[0, end + n)``, row ``b`` seeing from column ``pads[b]``: ``[n, S]`` when
        ``serial``, else ``[B, 1, n, S]``."""
        ...

    def offsets(self, values: Sequence[int]) -> Any:
        """A layout's ``offset``: the per-row positions array."""
        ...

    def row_slice(self, plane: Any, row: int, start: int, stop: int) -> Any:
        """An owned copy of ``plane[row : row + 1, :, start:stop]``."""
        ...


@dataclass(eq=False)
class BlockTable:
    """One request's blocks in logical order and the positions it holds."""

    blocks: list[int] = field(default_factory=list)
    offset: int = 0

    def pieces(self, block_size: int, start: int, count: int, row: int = 0) -> list[Piece]:
        """Positions ``start .. start + count - 1`` as writes into their blocks, fed from
        tokens ``0 .. count - 1`` of source row ``row``."""
        out: list[Piece] = []
        position = start
        while position < start + count:
            within = position % block_size
            length = min(block_size - within, start + count - position)
            out.append((self.blocks[position // block_size], within, length, row, position - start))
            position += length
        return out


def _release_tables(pool_ref: weakref.ref[BlockPoolBase], tables: list[BlockTable]) -> None:
    pool = pool_ref()
    if pool is not None:
        pool.close_tables(tables)


class BlockPoolBase:
    """The blocks of one layer, shared by every request of that layer (``spec/paged-pool.md``).

    ``codec``: the codec spec of every block (default ``Plain()``); ``block_size``: tokens
    per block; ``num_blocks``: blocks allocated once the KV geometry is known (declared
    here or learnt from the first write); ``max_bytes``: the most bytes the pool's planes
    may take (growth past it raises ``PoolExhaustedError``).
    """

    ops: ClassVar[PlaneOps]
    #: The implementation's ``PagedKVCache`` (what ``lookup_prefix`` returns).
    cache_class: ClassVar[type[PagedKVCacheBase]]

    def __init__(
        self,
        codec: CodecSpec | None = None,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int = 0,
        max_bytes: int | None = None,
        geometry: KvGeometry | None = None,
    ) -> None:
        spec = Plain() if codec is None else codec
        self.codec = self.ops.make_codec(spec)
        self.block_size = as_count(block_size, "block_size", minimum=1)
        self._initial = as_count(num_blocks, "num_blocks")
        self.max_bytes = None if max_bytes is None else as_count(max_bytes, "max_bytes")
        self.ledger = BlockLedger(
            self.block_size, grow=self._grow_to, extra=f"{self.codec.key}|{self.block_size}"
        )
        self._keys: Planes | None = None
        self._values: Planes | None = None
        self._geometry: KvGeometry | None = None
        self._tables: dict[int, BlockTable] = {}
        if geometry is not None:
            self.learn(geometry)

    # -- what it holds -------------------------------------------------------------------
    @property
    def codec_spec(self) -> CodecSpec:
        spec: CodecSpec = self.codec.spec
        return spec

    @property
    def geometry(self) -> KvGeometry | None:
        return self._geometry

    @property
    def num_blocks(self) -> int:
        return self.ledger.num_blocks

    @property
    def token_bytes(self) -> int:
        """KV bytes of one token (keys and values), once the geometry is known."""
        g = self._geometry
        if g is None:
            raise LayoutStateError(POOL_GEOMETRY_UNKNOWN)
        return int(
            self.codec.token_bytes(g.heads, g.key_dim, g.dtype, "keys")
            + self.codec.token_bytes(g.heads, g.value_dim, g.dtype, "values")
        )

    @property
    def bytes_per_block(self) -> int:
        return self.token_bytes * self.block_size

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in (self._keys or ()) + (self._values or ()))

    @property
    def bytes_written(self) -> int:
        return self.ledger.bytes_written

    @property
    def bytes_copied(self) -> int:
        return self.ledger.bytes_copied

    def held_arrays(self) -> tuple[Any, ...]:
        return (self._keys or ()) + (self._values or ())

    def live_tables(self) -> tuple[BlockTable, ...]:
        return tuple(self._tables.values())

    # -- geometry and growth -------------------------------------------------------------
    def learn(self, geometry: KvGeometry, *, room: int = 0) -> None:
        """Fix the KV geometry (first write or declaration); refuses another one. ``room``:
        the blocks the write that teaches it takes; a byte limit that cannot hold them
        raises ``PoolExhaustedError`` before the pool learns anything."""
        if self._geometry is not None:
            if geometry != self._geometry:
                raise InvalidInputError(
                    pool_geometry_message(self._geometry.describe(), geometry.describe())
                )
            return
        self._check_geometry(geometry)
        self._geometry = geometry
        if self.max_bytes is not None:
            limit = self.max_bytes // self.bytes_per_block
            if limit < self._initial:
                self._geometry = None
                raise InvalidInputError(pool_limit_message(self.max_bytes, limit, self._initial))
            if limit < room:
                self._geometry = None
                check_limit(room, limit)
            self.ledger.max_blocks = limit
        if self._initial:
            self.ledger.ensure(self._initial)

    def _check_geometry(self, geometry: KvGeometry) -> None:
        """Refuse a geometry the pool's codec cannot store (a latent pool checks its own)."""
        self.codec.check(geometry)

    def _zeros(self, count: int) -> tuple[Planes, Planes]:
        g = self._geometry
        assert g is not None
        bs = self.block_size
        return (
            tuple(self.codec.zeros(count, g.heads, bs, g.key_dim, g.dtype, "keys")),
            tuple(self.codec.zeros(count, g.heads, bs, g.value_dim, g.dtype, "values")),
        )

    def _grow_to(self, total: int) -> None:
        keys, values = self._zeros(total - self.num_blocks)
        if self._keys is None or self._values is None:
            self._keys, self._values = keys, values
        else:
            self._keys = self.ops.concat_blocks(self._keys, keys)
            self._values = self.ops.concat_blocks(self._values, values)

    # -- tables --------------------------------------------------------------------------
    def open_table(self, blocks: Sequence[int] = (), offset: int = 0) -> BlockTable:
        """A new live table holding ``blocks`` (each counted once more) at ``offset``."""
        table = BlockTable(list(blocks), offset)
        self.ledger.touch(table.blocks)
        self._tables[id(table)] = table
        return table

    def adopt_empty(self, tables: Sequence[BlockTable]) -> None:
        """Make empty tables made before the pool existed live tables of this pool."""
        for table in tables:
            if id(table) not in self._tables:
                assert not table.blocks and table.offset == 0
                self._tables[id(table)] = table

    def share(self, table: BlockTable) -> BlockTable:
        """A second table holding what ``table`` holds (no byte moves)."""
        return self.open_table(table.blocks, table.offset)

    def close_tables(self, tables: Sequence[BlockTable]) -> None:
        """Release every table (each tail block first)."""
        for table in tables:
            if self._tables.pop(id(table), None) is not None:
                self.ledger.release(reversed(table.blocks))
                table.blocks = []
                table.offset = 0

    def _blocks_for(self, offset: int) -> int:
        return math.ceil(offset / self.block_size)

    def append(self, tables: Sequence[BlockTable], keys: Planes, values: Planes) -> None:
        """Row ``b`` of the encoded block ``keys`` / ``values`` (``[B, H, n, ·]``) goes to
        the end of ``tables[b]``: the blocks every row needs are taken at once (raises
        ``PoolExhaustedError`` with nothing changed), then partly filled shared tails are
        copied (copy on write) and the tokens written."""
        bs, ledger = self.block_size, self.ledger
        n = self.ops.shape(keys[0])[2]
        plans: list[tuple[bool, int]] = []
        for table in tables:
            fill = table.offset % bs
            cow = fill > 0 and not ledger.writable(table.blocks[-1])
            plans.append((cow, self._blocks_for(table.offset + n) - len(table.blocks)))
        fresh = ledger.allocate(sum(int(cow) + new for cow, new in plans))
        assert self._keys is not None and self._values is not None
        pieces: list[Piece] = []
        for b, (table, (cow, new)) in enumerate(zip(tables, plans, strict=True)):
            if cow:
                self._copy_tail(table, fresh.pop())
            table.blocks.extend(fresh[:new])
            del fresh[:new]
            pieces += table.pieces(bs, table.offset, n, b)
            table.offset += n
        self._keys = self.ops.scatter(self._keys, pieces, keys)
        self._values = self.ops.scatter(self._values, pieces, values)
        ledger.bytes_written += len(tables) * n * self.token_bytes

    def open_written(self, keys: Planes, values: Planes) -> list[BlockTable]:
        """New live tables, one per row of the encoded block ``keys`` / ``values``, holding
        it: every block is taken before a table opens (``PoolExhaustedError`` with nothing
        changed)."""
        tables = [BlockTable() for _ in range(self.ops.shape(keys[0])[0])]
        self.append(tables, keys, values)
        for table in tables:
            self._tables[id(table)] = table
        return tables

    def _copy_tail(self, table: BlockTable, target: int) -> None:
        """Copy the partly filled tail of ``table`` into ``target``, which replaces it."""
        assert self._keys is not None and self._values is not None
        fill = table.offset % self.block_size
        old = table.blocks[-1]
        self._keys = self.ops.copy_block(self._keys, target, old, fill)
        self._values = self.ops.copy_block(self._values, target, old, fill)
        self.ledger.release([old])
        table.blocks[-1] = target
        self.ledger.bytes_copied += fill * self.token_bytes

    def copy_in(self, sources: Sequence[tuple[BlockPoolBase, BlockTable]]) -> list[BlockTable]:
        """New tables of this pool holding copies of tables of other pools (the bytes are
        counted as copied); every block is taken at once, so a refusal changes nothing."""
        fresh = self.ledger.allocate(sum(self._blocks_for(t.offset) for _, t in sources))
        copies: list[BlockTable] = []
        for source, table in sources:
            count = self._blocks_for(table.offset)
            copy = BlockTable(fresh[:count], 0)
            del fresh[:count]
            self._tables[id(copy)] = copy
            copies.append(copy)
            if table.offset:
                keys, values = source.gather([table], [0], table.offset)
                self.append_into(copy, keys, values)
        return copies

    def append_into(self, table: BlockTable, keys: Planes, values: Planes) -> None:
        """Write ``[1, H, n, ·]`` planes into ``table``'s already allocated blocks."""
        assert self._keys is not None and self._values is not None
        n = self.ops.shape(keys[0])[2]
        pieces = table.pieces(self.block_size, 0, n)
        self._keys = self.ops.scatter(self._keys, pieces, keys)
        self._values = self.ops.scatter(self._values, pieces, values)
        table.offset = n
        self.ledger.bytes_copied += n * self.token_bytes

    def trim(self, table: BlockTable, count: int) -> None:
        """Forget the newest ``count`` positions of ``table`` and release its now-empty tail
        blocks (tail first)."""
        table.offset -= count
        keep = self._blocks_for(table.offset)
        self.ledger.release(reversed(table.blocks[keep:]))
        del table.blocks[keep:]

    def gather(
        self, tables: Sequence[BlockTable], pads: Sequence[int], width: int
    ) -> tuple[Planes, Planes]:
        """``[B, H, width, ·]`` key and value planes: row ``b``'s positions in logical
        order at columns ``[pads[b], width)``."""
        assert self._keys is not None and self._values is not None
        rows = [(t.blocks, t.offset) for t in tables]
        return (
            self.ops.gather(self._keys, rows, pads, width),
            self.ops.gather(self._values, rows, pads, width),
        )

    # -- the prefix cache ----------------------------------------------------------------
    def register_prefix(self, table: BlockTable, token_ids: Sequence[int]) -> int:
        """Hash the full blocks of ``table`` that ``token_ids`` covers (at most its
        committed positions); returns how many blocks are now cached."""
        tokens = read_token_ids(token_ids)
        if len(tokens) > table.offset:
            raise InvalidInputError(prefix_too_long_message(len(tokens), table.offset))
        full = len(tokens) // self.block_size
        hashes = chain_hashes(tokens, self.block_size, self.ledger.extra, full)
        for j, digest in enumerate(hashes):  # refuse before any block is hashed
            known = self.ledger.hash_of(table.blocks[j])
            if known is not None and known != digest:
                raise InvalidInputError(prefix_mismatch_message(j))
        previous, bs = ROOT_HASH, self.block_size
        for j in range(full):
            previous = self.ledger.register(
                table.blocks[j], previous, tokens[j * bs : (j + 1) * bs]
            )
        return full

    def lookup_prefix(self, token_ids: Sequence[int]) -> PagedKVCacheBase | None:
        """A new ``PagedKVCache`` holding the longest run of cached full blocks that starts
        ``token_ids`` (at most ``len(token_ids) - 1`` positions: the last token is always
        computed, for its logits), referenced, not copied; ``None`` on a miss."""
        tokens = read_token_ids(token_ids)
        most = max(len(tokens) - 1, 0) // self.block_size
        hits = self.ledger.lookup(chain_hashes(tokens, self.block_size, self.ledger.extra, most))
        if not hits:
            return None
        cache = self.cache_class(pool=self)
        cache._geometry = self._geometry
        cache._adopt([self.open_table(hits, len(hits) * self.block_size)])
        return cache

    def evict_cached(self, count: int) -> int:
        """Forget up to ``count`` unreferenced cached blocks, least recently used first."""
        return self.ledger.evict_cached(as_count(count, "count"))

    def check_valid(self) -> None:
        """Assert the pool's invariants (``spec/paged-pool.md`` §4)."""
        self.ledger.check_valid(t.blocks for t in self._tables.values())
        for table in self._tables.values():
            assert len(table.blocks) == self._blocks_for(table.offset), "no empty tail block"


def _first(fetched: Any) -> Any:
    return fetched[0] if isinstance(fetched, tuple) else fetched


_token_ids = read_token_ids
_bind = bind_paged


class _PagedBase(SavedState, ComposedIdentity):
    """What both paged classes share: a codec, a block size, a pool once known."""

    composition: ClassVar[Composition]
    pool_class: ClassVar[type[BlockPoolBase]]
    _token_geometry: Any
    _rows: list[BlockTable]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        spec, paged, declared, pool = _bind(type(self), args, kwargs)
        self.codec = self.pool_class.ops.make_codec(spec)
        self._token_geometry = paged
        self._geometry = declared if pool is None or pool.geometry is None else pool.geometry
        self._pool: BlockPoolBase | None = pool

    @property
    def pool(self) -> BlockPoolBase | None:
        """The block pool this cache's tables point into (``None`` before the first write
        of a cache built without one)."""
        return self._pool

    @property
    def block_size(self) -> int:
        size: int = self._token_geometry.block_size
        return size

    @property
    def state_needs_dispose(self) -> bool:
        return False

    # mlx-lm's attention reads ``bits`` / ``group_size`` off an affine cache (its quantized
    # path); other codecs have neither (``hasattr`` is false).
    @property
    def bits(self) -> int:
        return int(self._affine_parameter("bits"))

    @property
    def group_size(self) -> int:
        return int(self._affine_parameter("group_size"))

    def _affine_parameter(self, name: str) -> Any:
        spec = self.codec_spec
        if getattr(spec, "kind", None) != "affine":
            raise AttributeError(no_affine_parameter_message(type(self).__name__, spec, name))
        return getattr(spec, name)

    def _ensure_pool(self, geometry: KvGeometry, room: int = 0) -> BlockPoolBase:
        """The pool, knowing ``geometry``; ``room``: the blocks the write that teaches a
        given pool its geometry takes (refused past its byte limit before it learns)."""
        if self._pool is None:
            self._pool = self.pool_class(
                self.codec_spec, block_size=self.block_size, geometry=geometry
            )
        else:
            self._pool.learn(geometry, room=room)
        return self._pool

    def _room(self, keys: Any, rows: int) -> int:
        """Blocks an append of ``keys`` takes in a pool that holds none yet (a pool without
        geometry: every table is empty), ``rows`` tables (0: one per row of ``keys``)."""
        shape = self.pool_class.ops.shape(keys)
        return (rows or shape[0]) * math.ceil(shape[2] / self.block_size)

    def _check(self, keys: Any, values: Any, rows: int | None) -> KvGeometry:
        ops = self.pool_class.ops
        geometry = check_block(
            ops.shape(keys), ops.shape(values), ops.dtype_name(keys), ops.dtype_name(values),
            rows=rows, geometry=self._geometry,
        )  # fmt: skip
        self.codec.check(geometry)
        return geometry

    def _tables(self) -> list[BlockTable]:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this cache's tables hold (a shared block counts in each)."""
        if self._pool is None or self._geometry is None:
            return 0
        return sum(len(t.blocks) for t in self._tables()) * self._pool.bytes_per_block

    def held_arrays(self) -> tuple[Any, ...]:
        return () if self._pool is None else self._pool.held_arrays()

    def _state(self) -> tuple[Any, ...]:
        from kvrows.paged_forms import state_of

        return state_of(self)

    @classmethod
    def _restore(
        cls, state: Any, meta_state: Any, keep: int | None, geometry: KvGeometry | None
    ) -> Any:
        from kvrows.paged_forms import restore_state

        return restore_state(cls, state, geometry)

    @classmethod
    def _restore_paged(
        cls, state: Any, geometry: KvGeometry | None, pool: BlockPoolBase | None
    ) -> Any:
        """``kvrows.paged_forms.restore_state``'s load: checked, then written into blocks."""
        from kvrows.paged_forms import load_into_base, parse_state

        ops = cls.pool_class.ops
        parsed = parse_state(cls, state, geometry, pool, ops.shape, ops.dtype_name)
        return load_into_base(cls, parsed, pool)

    # -- mlx-lm's read surface (``spec/mlx-lm-drop-in.md``): reads only ------------------
    def _held(self) -> tuple[Any, Any] | None:
        raise NotImplementedError

    def fetch(self) -> tuple[Any, Any]:
        raise NotImplementedError

    @property
    def keys(self) -> Any:
        """The fetched keys (``None`` while empty). Read-only: a block pool is shared."""
        held = self._held()
        return None if held is None else held[0]

    @keys.setter
    def keys(self, value: object) -> None:
        self._refuse_write("keys", value)

    @property
    def values(self) -> Any:
        """The fetched values (``None`` while empty). Read-only: a block pool is shared."""
        held = self._held()
        return None if held is None else held[1]

    @values.setter
    def values(self, value: object) -> None:
        self._refuse_write("values", value)

    def _refuse_write(self, name: str, value: object) -> None:
        if self._held() is None:
            if value is None:
                return  # an empty cache's None written back
            raise LayoutStateError(paged_empty_write_message(type(self).__name__, name))
        raise InvalidInputError(paged_read_only_message(type(self).__name__, name))

    def keys_and_values(self) -> tuple[Any, Any]:
        """What ``fetch()`` returns (``LayoutStateError`` while empty)."""
        return self.fetch()

    def empty(self) -> bool:
        return self._held() is None

    def size(self) -> int:
        """Columns a read returns."""
        held = self._held()
        return 0 if held is None else int(self.pool_class.ops.shape(_first(held[0]))[2])

    def release(self) -> None:
        """Give every block back to the pool now (the cache then holds no row)."""
        if self._pool is not None:
            self._pool.close_tables(self._tables())
        self._rows.clear()


class PagedKVCacheBase(_PagedBase):
    """A request's block table into a pool (``spec/PagedKVCache.md``): a serial store,
    bit-exact with ``KVCache`` on the same tokens. Shape-generic in ``B`` as every serial
    storage (each row of a block is one table; every row takes every block), though a
    request is one row: prefix registration and lookups are per request (``B = 1``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rows: list[BlockTable] = []  # mutated in place: the finalizer holds it
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def _adopt(self, tables: Sequence[BlockTable]) -> None:
        """Hold ``tables`` (live tables of the pool) instead of what it held; they are
        released when this cache is collected."""
        assert self._pool is not None
        self._pool.close_tables(self._rows)
        self._rows[:] = tables
        if self._finalizer is None:
            self._finalizer = weakref.finalize(
                self, _release_tables, weakref.ref(self._pool), self._rows
            )

    def _tables(self) -> list[BlockTable]:
        return list(self._rows)

    @property
    def offset(self) -> int:
        return self._rows[0].offset if self._rows else 0

    @property
    def rows(self) -> int:
        """Batch rows held (0 before the first append)."""
        return len(self._rows)

    @property
    def block_table(self) -> tuple[int, ...]:
        """The physical blocks holding this request's positions, in logical order."""
        return tuple(self._request().blocks) if self._rows else ()

    def _request(self) -> BlockTable:
        if len(self._rows) != 1:
            raise LayoutStateError(request_rows_message(len(self._rows)))
        return self._rows[0]

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """Append ``[B, H, n, D]`` (split at block boundaries); the first block sets ``B``.
        An exhausted pool refuses (``PoolExhaustedError``) with nothing changed: the first
        block's tables open only once its blocks are taken."""
        geometry = self._check(keys, values, len(self._rows) or None)
        pool = self._ensure_pool(geometry, self._room(keys, len(self._rows)))
        encoded = self.codec.encode(keys, "keys"), self.codec.encode(values, "values")
        if self._rows:
            pool.append(self._rows, *encoded)
        else:
            self._adopt(pool.open_written(*encoded))
        self._geometry = geometry
        return self.fetch()

    def _held(self) -> tuple[Any, Any] | None:
        return None if self.planes() is None else self.fetch()

    def fetch(self) -> tuple[Any, Any]:
        planes = self.planes()
        if planes is None:
            raise LayoutStateError(NOTHING_TO_FETCH)
        return self.codec.fetched(planes[0], "keys"), self.codec.fetched(planes[1], "values")

    def planes(self) -> tuple[Planes, Planes] | None:
        """The held positions' key and value planes in logical order, rows stacked
        (``None`` when empty)."""
        if self._pool is None or not self._rows or self.offset == 0:
            return None
        return self._pool.gather(self._rows, [0] * len(self._rows), self.offset)

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        count = as_count(n, "n", minimum=1)
        window = check_window(window_size)
        if window is None and not return_array:
            return None if count == 1 else "causal"
        return self.pool_class.ops.mask([0], self.offset, count, window, True)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the newest ``n`` positions (at most ``offset``); frees now-empty blocks."""
        count = min(as_count(n, "n"), self.offset)
        if count and self._pool is not None:
            for table in self._rows:
                self._pool.trim(table, count)
        return count

    def register_prefix(self, token_ids: Sequence[int]) -> int:
        """Cache the full blocks ``token_ids`` (the ids of this request's first positions,
        at most ``offset`` of them) covers; returns how many blocks are cached."""
        if self._pool is None or not self._rows:
            raise LayoutStateError(EMPTY_CACHE_NO_BLOCK)
        return self._pool.register_prefix(self._request(), token_ids)

    def check_valid(self) -> None:
        assert len({t.offset for t in self._rows}) <= 1, "rows move together"
        for table in self._rows:
            assert self._pool is not None and id(table) in self._pool._tables
            assert len(table.blocks) == math.ceil(table.offset / self.block_size)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(offset={self.offset}, "
            f"blocks={[list(t.blocks) for t in self._rows]})"
        )


class PagedKvRowsBase(SpeculativeRounds, _PagedBase):
    """Block-table rows in all three roles (``spec/PagedKvRows.md``): ragged rows, each
    appending at its own end; the read right-aligns them (``left_pad[b] = max offset -
    offset[b]``, virtual: nothing is padded in the pool)."""

    serial_class: ClassVar[type[PagedKVCacheBase]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rows: list[BlockTable] = []  # mutated in place: the finalizer holds it
        self._finalizer: weakref.finalize[Any, Any] | None = None
        if self._pool is not None:
            self._watch()

    def _watch(self) -> None:
        assert self._pool is not None
        if self._finalizer is None:
            self._finalizer = weakref.finalize(
                self, _release_tables, weakref.ref(self._pool), self._rows
            )

    def _tables(self) -> list[BlockTable]:
        return list(self._rows)

    # -- what the layout holds -----------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self._rows)

    @property
    def row_offsets(self) -> tuple[int, ...]:
        return tuple(t.offset for t in self._rows)

    @property
    def left_pad(self) -> tuple[int, ...]:
        top = max(self.row_offsets, default=0)
        return tuple(top - t.offset for t in self._rows)

    @property
    def offset(self) -> Any:
        return self.pool_class.ops.offsets(self.row_offsets)

    @property
    def max_tokens(self) -> float:
        return math.inf

    @property
    def width(self) -> int:
        """Columns a read returns (the longest row)."""
        return max(self.row_offsets, default=0)

    def block_tables(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(t.blocks) for t in self._rows)

    def make_empty_batch(self) -> PagedKvRowsBase:
        return type(self)(
            pool=self._pool, codec=self.codec_spec, token_geometry=self._token_geometry
        )

    def can_publish_row(self, row: int, tokens: int) -> bool:
        self._spec_usable()
        offset = self._rows[check_row(row, self.batch_size)].offset
        count = as_count(tokens, "tokens")
        return count <= offset and not self.spec_round_open

    def projected_bytes(self, tokens: int) -> int:
        """Bytes one row needs for ``tokens`` positions: whole blocks."""
        count = as_count(tokens, "tokens")
        g = self._geometry
        if g is None:
            raise LayoutStateError(PROJECTED_BYTES_NEEDS_GEOMETRY)
        per_token = self.codec.token_bytes(
            g.heads, g.key_dim, g.dtype, "keys"
        ) + self.codec.token_bytes(g.heads, g.value_dim, g.dtype, "values")
        return math.ceil(count / self.block_size) * self.block_size * int(per_token)

    # -- reads ---------------------------------------------------------------------------
    def _held(self) -> tuple[Any, Any] | None:
        if self._pool is None or not any(self.row_offsets):
            return None
        return self.fetch()

    def fetch(self) -> tuple[Any, Any]:
        self._spec_usable()
        if self._pool is None or not self._rows or not any(self.row_offsets):
            raise LayoutStateError(NOTHING_TO_FETCH)
        keys, values = self._pool.gather(self._rows, self.left_pad, max(self.row_offsets))
        return self.codec.fetched(keys, "keys"), self.codec.fetched(values, "values")

    def row_window(self, row: int) -> tuple[Planes, Planes] | None:
        """Row ``row``'s positions' planes in logical order (``None`` when it holds none)."""
        table = self._rows[check_row(row, self.batch_size)]
        if self._pool is None or table.offset == 0:
            return None
        return self._pool.gather([table], [0], table.offset)

    row_planes = row_window

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        self._spec_usable()
        count = as_count(n, "n", minimum=1)
        window = check_window(window_size)
        pads = self.left_pad
        if not any(pads) and window is None and not return_array:
            return None if count == 1 else "causal"
        end = max(self.row_offsets, default=0)
        return self.pool_class.ops.mask(pads, end, count, window, False)

    # -- writes --------------------------------------------------------------------------
    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        return self._spec_append(lambda: self._update(keys, values))

    #: An exhausted pool refuses before any block or table changes: the round stays open,
    #: before its block (free blocks or append a shorter one, then resolve it).
    _spec_refused_unchanged = (PoolExhaustedError,)

    def _update(self, keys: Any, values: Any) -> tuple[Any, Any]:
        if not self._rows:
            raise LayoutStateError(EMPTY_LAYOUT_UPDATE)
        geometry = self._check(keys, values, len(self._rows))
        pool = self._ensure_pool(geometry, self._room(keys, len(self._rows)))
        pool.adopt_empty(self._rows)
        self._watch()
        pool.append(
            self._rows, self.codec.encode(keys, "keys"), self.codec.encode(values, "values")
        )
        self._geometry = geometry
        return self.fetch()

    def _accepts(self, source: object) -> bool:
        return (
            isinstance(source, _PagedBase)
            and source.pool_class is self.pool_class
            and source.codec.key == self.codec.key
            and source.block_size == self.block_size
        )

    def merge_rows(self, rows: Sequence[Any]) -> None:
        """Join the rows of paged caches and layouts: rows of this layout's pool join by
        reference (no byte moves); rows of another pool are copied into fresh blocks."""
        self._spec_guard("merge_rows")
        if isinstance(rows, str | bytes | Cache) or not isinstance(rows, Sequence):
            raise InvalidInputError(MERGE_NEEDS_SEQUENCE)
        if any(s is self for s in rows) or len({id(s) for s in rows}) != len(rows):
            raise IncompatibleRowsError(self_merge_message(self.signature()))
        for source in rows:
            if not self._accepts(source):
                raise IncompatibleRowsError(
                    paged_merge_message(
                        self.signature(), self.block_size, self.codec.key, type(source).__name__
                    )
                )
            if isinstance(source, PagedKvRowsBase):
                source._spec_guard("merging this layout's rows into another")
        geometry = common_geometry([self._geometry, *(s.geometry for s in rows)])
        incoming: list[tuple[BlockPoolBase | None, BlockTable | None]] = []
        for source in rows:
            if isinstance(source, PagedKvRowsBase) or source._rows:
                incoming += [(source._pool, t) for t in source._rows]
            else:
                incoming.append((source._pool, None))
        if not incoming:
            return
        pool = self._pool
        if pool is None:
            pool = next((p for p, _ in incoming if p is not None), None)
        if pool is None:  # only empty serial caches with no pool yet: rows of no position
            if geometry is not None:
                pool = self.pool_class(
                    self.codec_spec, block_size=self.block_size, geometry=geometry
                )
            else:  # the tables join a pool at the first write
                self._rows.extend(BlockTable() for _ in incoming)
                return
        foreign = [
            (p, t) for p, t in incoming if p is not None and p is not pool and t is not None
            and t.offset
        ]  # fmt: skip
        if geometry is not None:  # copies into a pool that learns here: within its limit
            pool.learn(geometry, room=sum(pool._blocks_for(t.offset) for _, t in foreign))
        copies = iter(pool.copy_in(foreign))
        joined: list[BlockTable] = []
        for source_pool, table in incoming:
            if table is None or (source_pool is not pool and table.offset == 0):
                joined.append(pool.open_table())
            elif source_pool is pool:
                joined.append(pool.share(table))
            else:
                joined.append(next(copies))
        pool.adopt_empty(self._rows)  # rows joined before any pool existed
        self._pool = pool
        self._watch()
        self._rows.extend(joined)
        self._geometry = geometry

    def filter_rows(self, keep: Sequence[int]) -> None:
        """Keep the rows ``keep``, in that order; the others' blocks go back to the pool."""
        self._spec_guard("filter_rows")
        order = check_keep(keep, self.batch_size)
        kept = [self._rows[i] for i in order]
        dropped = [t for i, t in enumerate(self._rows) if i not in set(order)]
        if self._pool is not None:
            self._pool.close_tables(dropped)
        self._rows[:] = kept

    def extract_row(self, row: int) -> PagedKVCacheBase:
        """A ``PagedKVCache`` holding row ``row``: its table shared, no byte moved."""
        self._spec_guard("extract_row")
        table = self._rows[check_row(row, self.batch_size)]
        serial = self.serial_class(
            pool=self._pool, codec=self.codec_spec, token_geometry=self._token_geometry
        )
        serial._geometry = self._geometry
        if self._pool is not None and table.offset:
            serial._adopt([self._pool.share(table)])
        return serial

    def register_prefix(self, row: int, token_ids: Sequence[int]) -> int:
        """Cache row ``row``'s full blocks ``token_ids`` covers (refused in a round: its
        newest positions are unverified drafts)."""
        self._spec_guard("register_prefix")
        table = self._rows[check_row(row, self.batch_size)]
        if self._pool is None:
            raise LayoutStateError(EMPTY_ROW_NO_BLOCK)
        return self._pool.register_prefix(table, token_ids)

    # -- trims ---------------------------------------------------------------------------
    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        self._spec_guard("trim (use spec_round_rollback)")
        count = as_count(n, "n")
        return self._trim([count] * self.batch_size) if self._rows else 0

    def trim_rows(self, counts: Sequence[int]) -> int:
        self._spec_guard("trim_rows (use spec_round_rollback)")
        return self._trim(check_counts(counts, self.batch_size))

    def _spec_forget(self, counts: Sequence[int]) -> None:
        self._trim(counts)

    def _trim(self, counts: Sequence[int]) -> int:
        for b, (table, count) in enumerate(zip(self._rows, counts, strict=True)):
            if count > table.offset:
                raise NotTrimmableError(trim_past_row_message(count, b, table.offset))
        for table, count in zip(self._rows, counts, strict=True):
            if count and self._pool is not None:
                self._pool.trim(table, count)
        return max(counts, default=0)

    def _state(self) -> tuple[Any, ...]:
        self._spec_guard("saving state")
        return super()._state()

    def check_valid(self) -> None:
        for table in self._rows:
            assert len(table.blocks) == math.ceil(table.offset / self.block_size)
            assert self._pool is None or id(table) in self._pool._tables

    def __repr__(self) -> str:
        return f"{type(self).__name__}(offsets={list(self.row_offsets)})"
