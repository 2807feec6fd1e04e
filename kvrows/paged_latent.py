"""MLA latent planes in a paged block pool (``spec/PagedLatentCache.md``): the array-free part.

``PagedLatentCache`` is ``MLACache``'s row semantics (``kvrows.latent.LatentRows``: every
argument check, the row bookkeeping, the rounds, the saved-state form) over the paged
pool's block tables (the ledger ``kvrows.paged.BlockLedger``: reference counts, copy on
write, prefix hashing; the pool's array-free surface ``kvrows.paged.PoolBase``; the
tables, over an implementation's :class:`PlaneOps`, stay here until latent paging moves
onto the paged placement). Nothing here is a second pool: a
:class:`LatentBlockPoolBase` is a ``PoolBase`` whose first plane group holds the
latent (``[num_blocks, 1, block_size, kv_lora_rank]``) and whose second holds the rope
plane and, for a DSA target, the index plane. Rows are block tables: a merge of rows of
the destination's pool shares their tables, filter releases, extract shares one table,
a rollback trims each row's table (its emptied tail blocks go back); none moves a byte.
Reads gather each row's blocks and right-justify the rows (the padding is virtual), so a
read returns exactly what ``MLACache`` returns for the same tokens. Through a codec (the
pool's: affine, or TurboQuant's value planes) the blocks hold the latent's codes and a
read decodes them; a row still in its bf16-first warm-up keeps its exact latent beside the
pool (``_warm``), as ``EncodedLatentCache`` does, and reads it until it converts.

Each implementation supplies the pool's ``PlaneOps`` (NumPy or MLX) and mixes
:class:`PagedLatentRows` ahead of its latent array hooks (shapes, dtypes, ranks, ints).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

from kvrows.codecs import is_codec_spec, is_kv_codec
from kvrows.codecs.latent import LATENT_ROLE
from kvrows.errors import (
    EMPTY_ROW_NO_BLOCK,
    InvalidInputError,
    LayoutStateError,
    PoolExhaustedError,
    from_state_tuple_message,
    latent_role_message,
    prefix_mismatch_message,
    prefix_too_long_message,
    state_signature_message,
)
from kvrows.latent import (
    LATENT_FIELDS,
    PAGED_LATENT_FIELDS,
    LatentCodec,
    LatentRows,
    _scalar,
    _state_codec,
    check_latent_codec,
    encoded_codec,
    latent_token_bytes,
)
from kvrows.paged import DEFAULT_BLOCK_SIZE, ROOT_HASH, PoolBase, chain_hashes
from kvrows.paged import token_ids as read_token_ids
from kvrows.schemes import CodecSpec, Plain
from kvrows.validation import KvGeometry, as_count

__all__ = [
    "BlockTable",
    "LatentBlockPoolBase",
    "PagedLatentRows",
    "Piece",
    "PlaneOps",
    "latent_pool_geometry",
]

Planes = tuple[Any, ...]
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


def _release_tables(pool_ref: weakref.ref[LatentBlockPoolBase], tables: list[BlockTable]) -> None:
    pool = pool_ref()
    if pool is not None:
        pool.close_tables(tables)


class LatentBlockPoolBase(PoolBase):
    """One MLA layer's blocks, shared by every request of that layer
    (``spec/paged-pool.md``): the latent (through the pool's codec: plain, affine or
    TurboQuant's value planes) in the first plane group, rope (+ DSA index,
    ``index_head_dim``) exact in the second. The constructor's checks, the ledger, the
    geometry it learns once (``latent_pool_geometry``), byte limit and counters are
    ``kvrows.paged.PoolBase``'s; the tables, appends, gathers and the prefix cache are
    here until latent paging moves onto the paged placement."""

    ops: ClassVar[PlaneOps]
    #: The implementation's ``PagedLatentCache`` (what ``lookup_prefix`` returns).
    latent_cache_class: ClassVar[type[Any]]

    def __init__(
        self,
        codec: CodecSpec | None = None,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int = 0,
        max_bytes: int | None = None,
        index_head_dim: int | None = None,
        geometry: KvGeometry | None = None,
    ) -> None:
        self.index_head_dim = (
            None
            if index_head_dim is None
            else as_count(index_head_dim, "index_head_dim", minimum=1)
        )
        spec = Plain() if codec is None else codec
        if not (is_codec_spec(spec) and is_kv_codec(spec)):
            raise InvalidInputError(
                f"a latent block pool stores the latent plain, Affine or Turbo, got {spec!r}"
            )
        #: The latent's planes and the exact planes (rope, index): ``[num_blocks, 1,
        #: block_size, ·]`` each (``None`` until the pool grows).
        self._keys: Planes | None = None
        self._values: Planes | None = None
        super().__init__(
            spec, block_size=block_size, num_blocks=num_blocks, max_bytes=max_bytes,
            geometry=geometry,
        )  # fmt: skip
        self.ledger.extra = f"mla|{self.codec.key}|{self.block_size}|{self.index_head_dim}"

    def _make_codec(self, spec: CodecSpec) -> Any:
        return self.ops.make_codec(spec)

    def _check_geometry(self, geometry: KvGeometry) -> None:
        if geometry.heads != 1:
            raise InvalidInputError(f"a latent pool has one head, got {geometry.describe()}")
        check_latent_codec(self.codec_spec, geometry.key_dim)

    # -- what it holds -------------------------------------------------------------------
    @property
    def token_bytes(self) -> int:
        g = self._geometry
        if g is None:
            raise LayoutStateError("the pool's latent widths are unknown until its first write")
        return latent_token_bytes(
            self.codec_spec,
            g.key_dim, g.value_dim, self.index_head_dim, g.dtype,
        )  # fmt: skip

    def held_arrays(self) -> tuple[Any, ...]:
        return (self._keys or ()) + (self._values or ())

    def live_tables(self) -> tuple[BlockTable, ...]:
        return tuple(self._tables.values())

    def _zeros(self, count: int) -> tuple[Planes, Planes]:
        g = self._geometry
        assert g is not None
        bs, plain = self.block_size, self.ops.make_codec(Plain())
        latent = tuple(self.codec.zeros(count, 1, bs, g.key_dim, g.dtype, LATENT_ROLE))
        exact = tuple(plain.zeros(count, 1, bs, g.value_dim, g.dtype, "values"))
        if self.index_head_dim is not None:
            exact += tuple(plain.zeros(count, 1, bs, self.index_head_dim, g.dtype, "values"))
        return latent, exact

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
            plans.append((cow, self.blocks_for(table.offset + n) - len(table.blocks)))
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

    def copy_in(
        self, sources: Sequence[tuple[LatentBlockPoolBase, BlockTable]]
    ) -> list[BlockTable]:
        """New tables of this pool holding copies of tables of other pools (the bytes are
        counted as copied); every block is taken at once, so a refusal changes nothing."""
        fresh = self.ledger.allocate(sum(self.blocks_for(t.offset) for _, t in sources))
        copies: list[BlockTable] = []
        for source, table in sources:
            count = self.blocks_for(table.offset)
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
        keep = self.blocks_for(table.offset)
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

    def blocks_needed(self, tables: Sequence[BlockTable], rows: int, n: int) -> int:
        """Blocks an append of ``n`` tokens to ``tables`` (or to ``rows`` new tables) takes,
        copies on write included."""
        if not tables:
            return rows * math.ceil(n / self.block_size)
        total = 0
        for table in tables:
            fill = table.offset % self.block_size
            cow = fill > 0 and not self.ledger.writable(table.blocks[-1])
            total += int(cow) + self.blocks_for(table.offset + n) - len(table.blocks)
        return total

    def lookup_prefix(self, token_ids: Sequence[int]) -> Any:
        """A new one-row ``PagedLatentCache`` holding the longest run of cached full blocks
        that starts ``token_ids`` (at most ``len - 1`` positions: the last token is always
        computed), shared, not copied; ``None`` on a miss."""
        tokens = _token_ids(token_ids)
        most = max(len(tokens) - 1, 0) // self.block_size
        hits = self.ledger.lookup(chain_hashes(tokens, self.block_size, self.ledger.extra, most))
        if not hits:
            return None
        codec = self.codec_spec if self.codec_spec.encodes else None  # the pool's latent
        cache: Any = self.latent_cache_class(
            index_head_dim=self.index_head_dim, pool=self, codec=codec
        )
        cache._adopt_rows([self.open_table(hits, len(hits) * self.block_size)])
        return cache

    def check_valid(self) -> None:
        """Assert the pool's invariants (``spec/paged-pool.md`` §4)."""
        # A snapshot: a cache's finalizer may release its tables while we iterate.
        tables = list(self._tables.values())
        self.ledger.check_valid(t.blocks for t in tables)
        for table in tables:
            assert len(table.blocks) == self.blocks_for(table.offset), "no empty tail block"


_token_ids = read_token_ids
_P = TypeVar("_P", bound="PagedLatentRows")
_R = TypeVar("_R")


def latent_pool_geometry(rank: int, rope: int, dtype: str) -> KvGeometry:
    """A latent pool's geometry in the pool's terms: one head, the latent as the first
    plane group's width, the rope as the second's (the index width is the pool's own)."""
    return KvGeometry(1, rank, rope, dtype)


class PagedLatentRows(LatentRows):
    """``MLACache``'s rows over block tables into a latent block pool (the storage hooks
    of ``LatentRows``). The implementation mixes this ahead of its latent array hooks."""

    pool_class: ClassVar[type[LatentBlockPoolBase]]

    def __init__(
        self,
        kv_lora_rank: object = None,
        rope_head_dim: object = None,
        index_head_dim: object = None,
        max_tokens: object = None,
        role: object = "target",
        *,
        pool: LatentBlockPoolBase | None = None,
        block_size: object = None,
        codec: LatentCodec | None = None,
        start: object = 0,
    ) -> None:
        name = type(self).__name__
        inner: LatentCodec = Plain()
        first = 0
        if codec is not None and codec != Plain():  # encoded_codec checks what it is
            inner, first = encoded_codec(name, codec, None, None, start)
        elif as_count(start, "start"):
            raise InvalidInputError(f"{name}: start applies to an encoded latent only")
        if pool is not None and not isinstance(pool, self.pool_class):
            raise InvalidInputError(f"{name}: pool must be a {self.pool_class.__name__}")
        size = None if block_size is None else as_count(block_size, "block_size", minimum=1)
        if pool is not None:
            if size is not None and size != pool.block_size:
                raise InvalidInputError(
                    f"{name}: the pool's blocks hold {pool.block_size} tokens, not {size}"
                )
            size = pool.block_size
            if pool.codec_spec != inner:
                raise InvalidInputError(
                    f"{name}: the pool stores the latent {pool.codec_spec!r}, not {inner!r}"
                )
        self._block_size = size or DEFAULT_BLOCK_SIZE
        #: Each row's exact latent ``[1, 1, t, R]`` while it reads exact (an encoded latent's
        #: bf16-first warm-up, kept beside the pool: it lives until the row converts).
        self._warm: list[Any | None] = []
        self._pool = pool
        self._tables: list[BlockTable] = []  # mutated in place: the finalizer holds it
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._setup(inner, first, kv_lora_rank, rope_head_dim, index_head_dim, max_tokens, role)
        if pool is not None:
            if pool.index_head_dim != self.latent_spec.index_head_dim:
                raise InvalidInputError(
                    f"{name}: the pool holds index planes of width {pool.index_head_dim}, "
                    f"declared {self.latent_spec.index_head_dim}"
                )
            self._adopt_pool_geometry()

    # -- the pool --------------------------------------------------------------------------
    @property
    def pool(self) -> LatentBlockPoolBase | None:
        """The pool this cache's tables point into (``None`` before a cache built without
        one first writes)."""
        return self._pool

    @property
    def block_size(self) -> int:
        return self._block_size

    def block_tables(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(t.blocks) for t in self._tables)

    def _adopt_pool_geometry(self) -> None:
        g = None if self._pool is None else self._pool.geometry
        if g is None:
            return
        declared = (self.latent_spec.kv_lora_rank, self.latent_spec.rope_head_dim)
        if any(
            d is not None and d != h
            for d, h in zip(declared, (g.key_dim, g.value_dim), strict=True)
        ):
            raise InvalidInputError(
                f"{type(self).__name__}: the pool holds latent {g.key_dim} and rope "
                f"{g.value_dim}, declared {declared}"
            )
        self._widths, self._dtype = (g.key_dim, g.value_dim), g.dtype

    def _watch(self) -> None:
        assert self._pool is not None
        if self._finalizer is None:
            self._finalizer = weakref.finalize(
                self, _release_tables, weakref.ref(self._pool), self._tables
            )

    def _adopt_rows(self, tables: Sequence[BlockTable]) -> None:
        """Hold ``tables`` (live tables of the pool, one row each, prefix hits)."""
        assert self._pool is not None
        self._watch()
        self._tables.extend(tables)
        self._warm = [None] * len(tables)
        self._offsets = [t.offset for t in tables]
        self._conversion = self._fresh_record([None] * len(tables))
        self._adopt_pool_geometry()

    def _new_empty(self: _P) -> _P:
        return type(self)(
            *self._declaration(),
            pool=self._pool, block_size=self._block_size, codec=self._codec_arg(),
            start=self.start,
        )  # fmt: skip

    def _codec_arg(self) -> LatentCodec | None:
        return self.latent_codec if self.latent_codec.encodes else None

    @property
    def encoded(self) -> bool:
        return self.latent_codec.encodes

    def _merge_key(self) -> tuple[object, ...]:
        return (*super()._merge_key(), self._block_size)

    def signature(self) -> str:
        role = self.latent_spec.signature_role
        if not self.encoded:
            return f"kv:mla-paged:{role}"
        return f"kv:mla-paged:{role}:{self.latent_codec.key}:{self.start}"

    def release(self) -> None:
        """Give every block back to the pool now (the cache then holds no row)."""
        self._spec_guard("release")
        if self._pool is not None:
            self._pool.close_tables(list(self._tables))
        self._tables.clear()
        self._offsets, self._warm, self._last = [], [], None
        self._conversion.keep([])

    def register_prefix(self, row: int, token_ids: Sequence[int]) -> int:
        """Cache row ``row``'s full blocks that ``token_ids`` covers (refused in a round:
        its newest positions are unverified drafts); returns how many are cached."""
        from kvrows.validation import check_row

        self._spec_guard("register_prefix")
        table = self._tables[check_row(row, self.batch_size)]
        if self._pool is None:
            raise LayoutStateError(EMPTY_ROW_NO_BLOCK)
        return self._pool.register_prefix(table, token_ids)

    # -- appends ---------------------------------------------------------------------------
    def _checked_blocks(
        self, latent: Any, rope: Any, index: Any | None, *, staged: bool = False
    ) -> tuple[Any, Any, Any | None, bool, str, int, int]:
        checked = super()._checked_blocks(latent, rope, index, staged=staged)
        _, _, _, _, dtype, rows, n = checked
        pool = self._pool
        if pool is not None and pool.geometry is None and not staged:
            # A given pool learns its widths from this write, and refuses it past its byte
            # limit before it learns them (every table is empty: all blocks are new).
            widths = (self._impl_shape_dtype(latent, "latent")[0][-1],
                      self._impl_shape_dtype(rope, "rope")[0][-1])  # fmt: skip
            room = pool.blocks_needed(self._tables, rows, n)
            pool.learn(latent_pool_geometry(*widths, dtype), room=room)
        if pool is not None and pool.geometry is not None:
            g = pool.geometry
            rank, rope_width = self._widths or (g.key_dim, g.value_dim)
            if (rank, rope_width, dtype) != (g.key_dim, g.value_dim, g.dtype):
                raise InvalidInputError(
                    f"{type(self).__name__}: the pool holds {g.dtype} latent {g.key_dim} and "
                    f"rope {g.value_dim}, got {dtype} {rank} and {rope_width}"
                )
            if not staged:  # take every block the append needs now (nothing changes)
                pool.ledger.ensure(pool.blocks_needed(self._tables, rows, n))
        return checked

    #: An exhausted pool refuses before any block or table changes: the round stays open,
    #: before its block (free blocks or append a shorter one, then resolve it).
    _spec_refused_unchanged = (PoolExhaustedError,)

    def _ensure_pool(self, room: int = 0) -> LatentBlockPoolBase:
        """The pool, knowing the cache's widths; ``room``: the blocks the write that teaches
        a given pool its widths takes (refused past its byte limit before it learns)."""
        assert self._widths is not None and self._dtype is not None
        geometry = latent_pool_geometry(*self._widths, self._dtype)
        if self._pool is None:
            self._pool = self.pool_class(
                self.latent_codec,
                block_size=self._block_size,
                index_head_dim=self.latent_spec.index_head_dim,
                geometry=geometry,
            )
        else:
            self._pool.learn(geometry, room=room)
        self._pool.adopt_empty(self._tables)
        self._watch()
        return self._pool

    def _impl_init(self) -> None:
        pass  # the tables live from construction (the finalizer holds the list)

    def _impl_append(self, latent: Any, rope: Any, index: Any | None, exact: bool) -> None:
        pool = self._ensure_pool()
        if not self._tables:
            self._tables.extend(pool.open_table() for _ in range(int(latent.shape[0])))
            self._warm = [None] * len(self._tables)
        exacts = (rope,) if index is None else (rope, index)
        pool.append(self._tables, tuple(pool.codec.encode(latent, LATENT_ROLE)), exacts)
        if self.encoded:  # rows still reading exact keep their exact latent
            self._warm = [
                None if done else self._warm_cat(held, latent, b)
                for b, (held, done) in enumerate(zip(self._warm, self.converted, strict=True))
            ]

    def _gathered(self, tables: Sequence[BlockTable], pads: Sequence[int], width: int) -> Any:
        assert self._pool is not None
        latent, exacts = self._pool.gather(tables, pads, width)
        return latent, exacts[0], exacts[1] if len(exacts) > 1 else None

    def _impl_read(self, reads_exact: Sequence[bool]) -> tuple[Any, Any, Any | None]:
        latent, rope, index = self._gathered(self._tables, self.left_pad, self.width)
        if not self.encoded:
            return latent[0], rope, index
        overlay = [w if exact else None for w, exact in zip(self._warm, reads_exact, strict=True)]
        return self._overlay(self._decode_latent(latent), overlay), rope, index

    # -- the implementation's array helpers (encoded latent) -----------------------------
    def _warm_cat(self, held: Any | None, block: Any, row: int) -> Any:
        """``held`` (``[1, 1, t, R]`` or ``None``) and ``block[row]`` along the tokens (owned)."""
        raise NotImplementedError

    def _warm_cut(self, held: Any, keep: int) -> Any:
        """``held``'s first ``keep`` tokens (owned)."""
        raise NotImplementedError

    def _decode_latent(self, planes: Sequence[Any], dtype: str | None = None) -> Any:
        """The dense latent of gathered codec planes, in ``dtype`` (default the cache's)."""
        raise NotImplementedError

    def _overlay(self, dense: Any, rows: Sequence[Any | None]) -> Any:
        """``dense`` ``[B, 1, W, R]`` with row ``b``'s last columns replaced by ``rows[b]``."""
        raise NotImplementedError

    def _stack_warm(self, rows: Sequence[Any | None], width: int) -> Any:
        """Right-justified ``[B, 1, width, R]`` of ``rows`` (zeros where ``None``)."""
        raise NotImplementedError

    # -- row operations: block tables only -------------------------------------------------
    def _impl_merge(self, sources: Sequence[Any]) -> None:
        pool = self._pool or next((s._pool for s in sources if s._pool is not None), None)
        if pool is None:  # only caches that never wrote: rows of no position, no pool yet
            self._tables.extend(BlockTable() for s in sources for _ in (s._tables or [None]))
            self._warm = [None] * len(self._tables)
            return
        foreign = [
            (s._pool, t) for s in sources for t in s._tables
            if s._pool is not None and s._pool is not pool and t.offset
        ]  # fmt: skip
        room = sum(math.ceil(t.offset / pool.block_size) for _, t in foreign)
        for source in sources:  # a pool of other widths refuses before anything changes
            if source._pool is not None and source._pool.geometry is not None:
                pool.learn(source._pool.geometry, room=room)
        copies = iter(pool.copy_in(foreign))  # every block at once: exhaustion changes nothing
        joined: list[BlockTable] = []
        for source in sources:
            for table in source._tables or [None]:
                if table is None or (source._pool is not pool and table.offset == 0):
                    joined.append(pool.open_table())
                elif source._pool is pool:
                    joined.append(pool.share(table))
                else:
                    joined.append(next(copies))
        pool.adopt_empty(self._tables)
        self._pool = pool
        self._watch()
        self._tables.extend(joined)
        self._warm = [w for s in sources for w in (s._warm or [None])]

    def _impl_filter(self, keep: Sequence[int]) -> None:
        kept = [self._tables[r] for r in keep]
        dropped = [t for i, t in enumerate(self._tables) if i not in set(keep)]
        if self._pool is not None:
            self._pool.close_tables(dropped)
        self._tables[:] = kept
        self._warm = [self._warm[r] for r in keep]

    def _impl_take_row(self, source: Any, row: int) -> None:
        pool = source._pool
        assert pool is not None
        self._pool = pool
        self._watch()
        self._tables.append(pool.share(source._tables[row]))
        self._warm = [source._warm[row]]  # owned arrays, never written in place

    def _impl_forget(self, counts: Sequence[int]) -> None:
        if self._pool is None:
            return
        for table, count in zip(self._tables, counts, strict=True):
            if count:
                self._pool.trim(table, count)
        self._warm = [
            None if w is None or not t.offset else self._warm_cut(w, t.offset) if c else w
            for w, t, c in zip(self._warm, self._tables, counts, strict=True)
        ]

    def _impl_drop_exact(self) -> None:
        self._warm = [None] * len(self._warm)

    def _impl_nbytes(self) -> int:
        pool = self._pool
        if pool is None or pool.geometry is None:
            return 0
        warm = sum(int(w.nbytes) for w in self._warm if w is not None)
        return sum(len(t.blocks) for t in self._tables) * pool.bytes_per_block + warm

    def _impl_held(self) -> tuple[Any, ...]:
        return () if self._pool is None else self._pool.held_arrays()

    def projected_bytes(self, tokens: int) -> int:
        """Bytes one row of ``tokens`` positions takes: whole blocks (capped at
        ``max_tokens``)."""
        count = as_count(tokens, "tokens")
        count = int(min(count, self.max_tokens))
        return math.ceil(count / self._block_size) * self._block_size * self.bytes_per_token()

    def check_valid(self) -> None:
        super().check_valid()
        assert len(self._tables) == len(self._offsets), "one block table per row"
        for table, offset in zip(self._tables, self._offsets, strict=True):
            assert table.offset == offset, "a table holds its row's positions"
            assert len(table.blocks) == math.ceil(offset / self._block_size), "no empty tail"
            assert self._pool is None or not offset or id(table) in self._pool._tables
        assert len(self._warm) == len(self._offsets), "one warm-up slot per row"
        for warm, offset, done in zip(self._warm, self._offsets, self.converted, strict=True):
            if self.encoded and not done and offset:
                assert warm is not None and int(warm.shape[2]) == offset, "exact while warm"
            if not self.encoded:
                assert warm is None, "a plain latent keeps no exact copy"

    # -- reads of the stored planes --------------------------------------------------------
    def row_planes(self) -> list[tuple[tuple[Any, ...], Any, Any, None]]:
        """Each row's stored planes in logical order (latent planes, rope, index, ``None``:
        no exact copy); ``((), None, None, None)`` for a row with no position."""
        out: list[tuple[tuple[Any, ...], Any, Any, None]] = []
        for table in self._tables:
            if not table.offset:
                out.append(((), None, None, None))
                continue
            latent, rope, index = self._gathered([table], [0], table.offset)
            out.append((tuple(latent), rope, index, None))
        return out

    def batch_planes(self) -> tuple[tuple[Any, ...], Any, Any, None]:
        """The rows' stored planes right-justified (``[B, 1, width, ·]``), as a read."""
        if not self.width:
            return (), None, None, None
        latent, rope, index = self._gathered(self._tables, self.left_pad, self.width)
        return tuple(latent), rope, index, None

    # -- saved state (``kvrows.latent.PAGED_LATENT_FIELDS``) --------------------------------
    @property
    def state(self) -> tuple[Any, ...]:
        """``LATENT_FIELDS`` (the logical planes, right-justified, compact) and the block
        size; block ids and hashes are not saved."""
        return (*LatentRows.state.fget(self), self._block_size)  # type: ignore[attr-defined]

    @state.setter
    def state(self, value: Any) -> None:
        self._spec_guard("restoring state")
        restored = type(self).from_state(value, pool=self._pool)
        if restored.signature() != self.signature():
            raise InvalidInputError(
                state_signature_message(type(self).__name__, restored.signature(), self.signature())
            )
        self._take_over(restored)

    def _take_over(self: _P, other: _P) -> None:
        """Hold ``other``'s tables in its place, this cache's own released."""
        self.release()
        if self._finalizer is not None:
            self._finalizer.detach()
        if other._finalizer is not None:
            other._finalizer.detach()  # this cache takes over the other's tables
        vars(self).update(vars(other))
        self._finalizer = None
        if self._pool is not None:
            self._watch()

    @classmethod
    def from_state(
        cls: type[_P], state: Any, meta_state: Any = None, *, keep: Any = None,
        geometry: Any = None, pool: LatentBlockPoolBase | None = None,
    ) -> _P:  # fmt: skip
        """A cache holding ``state`` in fresh blocks of ``pool`` (default: a private pool;
        ``InvalidInputError`` when the state is inconsistent or not the pool's, and
        ``PoolExhaustedError`` when the pool cannot take it, the pool unchanged)."""
        name = cls.__name__
        if isinstance(state, str | bytes) or not isinstance(state, Sequence):
            raise InvalidInputError(from_state_tuple_message(name))
        if len(state) != len(PAGED_LATENT_FIELDS):
            raise InvalidInputError(
                f"{name}: a paged latent state has {len(PAGED_LATENT_FIELDS)} fields, got "
                f"{len(state)}"
            )
        size = _scalar(state[-1], "block_size")
        if size < 1:
            raise InvalidInputError(f"{name}: block_size must be >= 1, got {size}")
        fields = dict(zip(LATENT_FIELDS, state[:-1], strict=True))
        role = {0: "target", 1: "mtp"}.get(_scalar(fields["role"], "role"))
        if role is None:
            raise InvalidInputError(latent_role_message(name))

        def optional(key: str) -> int | None:
            value = fields[key]
            return None if value is None else _scalar(value, key)

        codec = _state_codec(
            optional("bits"), optional("group_size"), optional("k_bits"), optional("v_bits")
        )
        cache = cls(
            optional("kv_lora_rank"), optional("rope_head_dim"), optional("index_head_dim"),
            optional("max_tokens"), role, pool=pool, block_size=size,
            codec=codec if codec.encodes else None,
            start=_scalar(fields["start"], "start"),
        )  # fmt: skip
        cache._restore_fields(fields)
        return cache

    def _impl_state_planes(self) -> tuple[Any, Any, Any, Any]:
        if not self.width:
            return None, None, None, None
        planes, rope, index, _ = self.batch_planes()
        exact = None
        if self.encoded and not all(self.converted):
            warm = [None if done else w for w, done in zip(self._warm, self.converted, strict=True)]
            exact = self._stack_warm(warm, self.width)
        return planes, rope, index, exact

    def _native_shape(self, array: Any, what: str) -> tuple[int, ...]:
        shape = self.pool_class.ops.shape(array)
        if len(shape) != 4:
            raise InvalidInputError(
                f"{type(self).__name__}: plane {what} must be a 4-D array of this "
                f"implementation, got {type(array).__name__}"
            )
        return shape

    def _impl_restore(
        self, planes: tuple[Any, ...], rope: Any, index: Any, exact: Any, rows: int, width: int
    ) -> str:
        ops = self.pool_class.ops
        assert self._widths is not None
        names = [p.name for p in self.latent_spec.plane_specs("latent", self._widths[0], "float32")]
        if len(planes) != len(names):
            raise InvalidInputError(
                f"{type(self).__name__}: the latent is {len(names)} planes, got {len(planes)}"
            )
        named = [*zip(names, planes, strict=True), ("rope", rope)]
        if index is not None:
            named.append(("index", index))
        if exact is not None:
            named.append(("exact", exact))
        shapes = [(n, self._native_shape(a, n), ops.dtype_name(a)) for n, a in named]
        dtype = self._check_restored(shapes, rows, width)
        self._dtype = dtype
        counts = [math.ceil(offset / self._block_size) for offset in self._offsets]
        pool = self._ensure_pool(room=sum(counts))
        exacts = [rope] if index is None else [rope, index]
        fresh = pool.ledger.allocate(sum(counts))  # all at once: a refusal changes nothing
        written = 0
        for b, (offset, count) in enumerate(zip(self._offsets, counts, strict=True)):
            table = pool.open_table()
            table.blocks.extend(fresh[:count])  # allocated blocks are held once: this table's
            del fresh[:count]
            self._tables.append(table)
            if offset:
                pad = width - offset
                pool.append_into(
                    table,
                    tuple(ops.row_slice(p, b, pad, width) for p in planes),
                    tuple(ops.row_slice(p, b, pad, width) for p in exacts),
                )
                written += offset * pool.token_bytes
        self._warm = [
            ops.row_slice(exact, b, width - offset, width)
            if exact is not None and offset and not done
            else None
            for b, (offset, done) in enumerate(zip(self._offsets, self.converted, strict=True))
        ]
        pool.ledger.bytes_copied -= written  # a load writes, it does not copy
        pool.ledger.bytes_written += written
        return dtype
