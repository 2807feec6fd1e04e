"""Paged KV bookkeeping, array-free: the block ledger of a shared pool and its hash chain.

A **block pool** (one per layer, ``spec/paged-pool.md``) holds ``[num_blocks, H,
block_size, ·]`` planes; which block belongs to whom is this module's business and reads
only Python ints, so both implementations (NumPy and MLX pools) share it:

* every block has a **reference count**: the number of live block tables holding it;
* the **free queue** holds exactly the blocks with count 0, in the order they are taken
  (an ``OrderedDict``: O(1) pop at the head, remove from the middle, append at the tail);
  a block released unhashed goes to the head (it caches nothing), a hashed one to the
  tail, so cached blocks are evicted least recently used first, and a request released
  in reverse table order has its tail blocks evicted before its prefix;
* a full block may carry a **hash**: ``sha256(parent hash | token ids | extra keys)``
  (hashlib: stable across processes); the pool maps hash -> block (no de-duplication:
  a block id never changes under a live table) and block -> hash. Taking a hashed free
  block for a new owner evicts its hash;
* allocation grows the pool (``x1.5``, at least what is asked) up to ``max_blocks``, then
  raises :class:`~kvrows.errors.PoolExhaustedError` with nothing changed;
* the ledger counts the KV bytes moved through the pool: written by appends, copied by
  copy on write and by merges of rows that live elsewhere. Row operations on block
  tables move none.

:meth:`BlockLedger.check_valid` asserts the invariants of ``spec/paged-pool.md`` §4.
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, cast

from kvrows.errors import (
    PAGED_ONE_STAGE,
    POOL_GEOMETRY_UNKNOWN,
    InvalidInputError,
    LayoutStateError,
    PoolExhaustedError,
    given_twice_message,
    needs_parameters_message,
    no_affine_parameter_message,
    not_a_geometry_message,
    not_an_integer_message,
    paged_empty_write_message,
    paged_read_only_message,
    pool_geometry_message,
    pool_limit_message,
    positional_arguments_message,
    prefix_mismatch_message,
    prefix_too_long_message,
    wrong_geometry_message,
)
from kvrows.kinds import KindRegistry
from kvrows.schemes import CodecSpec, GeometrySpec, Plain
from kvrows.validation import KvGeometry, as_count

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "FREE",
    "PLACEMENTS",
    "ROOT_HASH",
    "AnyCodecParameters",
    "BlockLedger",
    "Paged",
    "PagedSurface",
    "PoolBase",
    "bind_paged",
    "block_hash",
    "chain_hashes",
    "check_limit",
    "growth_target",
    "held_blocks",
    "held_positions",
    "projected_blocks",
    "token_ids",
]

#: Tokens per block by default (vLLM's default; ``spec/paged-pool.md`` §1 says why).
DEFAULT_BLOCK_SIZE = 16

#: The parent hash of a request's first block.
ROOT_HASH = b"\x00" * 32

#: A block table's entry for a block the row gave back (a ring's positions that left its
#: window): tables stay indexed by logical block, ``position // block_size``.
FREE = -1


def held_positions(offset: int, retained: int, sinks: int) -> list[int]:
    """The positions a row of ``offset`` positions holding ``retained`` tokens keeps, oldest
    first: its first ``min(sinks, offset, retained)`` (a ring's sink tokens), then a run of
    its newest. A growing row (``retained == offset``) keeps every position."""
    head = min(sinks, offset, retained)
    return [*range(head), *range(offset - retained + head, offset)]


def projected_blocks(tokens: int, cap: int | None, sinks: int, block_size: int) -> int:
    """Blocks a row of ``tokens`` positions holds between appends: every one's (``cap``
    ``None``: growing), else its sinks' and its newest ``cap`` positions' (a ring)."""
    retained = tokens if cap is None else min(tokens, cap)
    return len(held_blocks(tokens, retained, sinks, block_size))


def held_blocks(offset: int, retained: int, sinks: int, block_size: int) -> set[int]:
    """The logical blocks holding one of :func:`held_positions` (the others are ``FREE``)."""
    head = min(sinks, offset, retained)
    first = offset - retained + head
    blocks = set(range(math.ceil(head / block_size)))
    if first < offset:
        blocks |= set(range(first // block_size, math.ceil(offset / block_size)))
    return blocks


#: The placement specs by kind (contract §0.4; contiguous, the default, has no spec yet):
#: what asks whether a composition is paged looks its kind up here.
PLACEMENTS: KindRegistry[Any] = KindRegistry("placement", "placement")


@PLACEMENTS.register
@dataclass(frozen=True, kw_only=True)
class Paged:
    """The paged token geometry: positions live in blocks of ``block_size`` tokens."""

    block_size: int = DEFAULT_BLOCK_SIZE
    #: The most positions a row may hold (``None``: unbounded; the paged latent's
    #: ``max_tokens``, ``spec/PagedLatentCache.md``).
    max_tokens: int | None = None
    kind: ClassVar[str] = "paged"

    def __post_init__(self) -> None:
        as_count(self.block_size, "block_size", minimum=1)
        if self.max_tokens is not None:
            as_count(self.max_tokens, "max_tokens", minimum=1)

    def parameters(self) -> dict[str, int]:
        return {}

    def cap(self) -> int | None:
        """The most positions a row may hold (``None``: unbounded)."""
        return self.max_tokens


def block_hash(parent: bytes, tokens: Sequence[int], extra: str) -> bytes:
    """The hash of one full block: its parent's hash, its token ids and the extra keys
    (the pool's codec key and block size: a plain block never serves an affine pool)."""
    digest = hashlib.sha256()
    digest.update(parent)
    digest.update(len(tokens).to_bytes(4, "little"))
    for token in tokens:
        digest.update(int(token).to_bytes(8, "little", signed=True))
    digest.update(extra.encode())
    return digest.digest()


def chain_hashes(tokens: Sequence[int], block_size: int, extra: str, blocks: int) -> list[bytes]:
    """The hashes of the first ``blocks`` full blocks of ``tokens``."""
    hashes: list[bytes] = []
    parent = ROOT_HASH
    for j in range(blocks):
        parent = block_hash(parent, tokens[j * block_size : (j + 1) * block_size], extra)
        hashes.append(parent)
    return hashes


def check_limit(needed: int, limit: int | None) -> None:
    """Raise ``PoolExhaustedError`` when a pool must hold ``needed`` blocks but its byte
    limit allows ``limit``."""
    if limit is not None and needed > limit:
        raise PoolExhaustedError(
            f"the pool needs {needed} blocks but may hold at most {limit} (its byte limit); "
            "free requests or raise max_bytes"
        )


def growth_target(current: int, needed: int, limit: int | None) -> int:
    """The block count a pool of ``current`` blocks grows to so that it holds ``needed``:
    ``x1.5`` (at least ``needed``), capped at ``limit``; raises ``PoolExhaustedError`` when
    even ``limit`` is too few."""
    check_limit(needed, limit)
    target = max(needed, math.ceil(current * 1.5), 1)
    return target if limit is None else min(target, limit)


def token_ids(given: object) -> list[int]:
    """``given`` as a list of token ids (``register_prefix``, ``lookup_prefix``)."""
    if isinstance(given, str | bytes):
        raise InvalidInputError("token_ids must be a sequence of integers")
    if hasattr(given, "tolist"):
        given = given.tolist()
    if not isinstance(given, Sequence):
        raise InvalidInputError("token_ids must be a sequence of integers")
    values: list[int] = []
    for value in given:
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise InvalidInputError(f"token ids must be integers, got {value!r}")
        values.append(int(value))
    return values


def bind_paged(
    cls: type[Any], args: Sequence[object], kwargs: dict[str, object]
) -> tuple[CodecSpec, Paged, GeometrySpec, KvGeometry | None, Any]:
    """A paged storage's constructor arguments (``cls.pool_class`` is its
    implementation's pool): the composition's parameters (mlx-lm's order, a ring's
    ``max_size``, ``keep``) positionally or by keyword, or ``token_geometry=`` (the
    composition's geometry spec); ``pool=``, ``block_size=``, ``placement=`` (a ``Paged``;
    given as ``token_geometry=`` it is the placement too, as before the placement had a
    field of its own), ``codec=``, ``geometry=``; what a given pool says wins, and a
    disagreeing argument is refused. Returns the codec spec, the ``Paged`` spec, the token
    geometry spec, the declared KV geometry and the pool."""
    from kvrows.geometries import GEOMETRIES, is_geometry_spec

    entry = cls.composition
    if len(args) > len(entry.params):
        raise InvalidInputError(positional_arguments_message(cls.__name__, entry.params, len(args)))
    values: dict[str, object] = {}
    for name, value in zip(entry.params, args, strict=False):
        if name in kwargs:
            raise InvalidInputError(given_twice_message(cls.__name__, name))
        values[name] = value
    values.update({name: kwargs.pop(name) for name in entry.params if name in kwargs})
    pool: Any = kwargs.pop("pool", None)
    codec = kwargs.pop("codec", None)
    token: Any = kwargs.pop("token_geometry", None)
    placement: Any = kwargs.pop("placement", None)
    block_size = kwargs.pop("block_size", None)
    declared = kwargs.pop("geometry", None)
    if kwargs:
        raise InvalidInputError(
            f"{cls.__name__} has no parameter {', '.join(sorted(kwargs))}; it takes "
            f"{''.join(f'{p}, ' for p in entry.params)}pool, block_size, placement, codec, "
            "token_geometry and geometry"
        )
    if token is not None and not is_geometry_spec(token):  # the placement, as it once was
        if placement is not None and placement != token:
            raise InvalidInputError("the paged placement given twice, differently")
        placement, token = token, None
    if pool is not None and not isinstance(pool, cls.pool_class):
        raise InvalidInputError(f"pool must be a {cls.pool_class.__name__}, got {pool!r}")
    if declared is not None and not isinstance(declared, KvGeometry):
        raise InvalidInputError(not_a_geometry_message(repr(declared)))
    if placement is not None and getattr(placement, "kind", None) != entry.placement:
        raise InvalidInputError(f"{cls.__name__} has the paged placement, got {placement!r}")
    if token is not None and (not is_geometry_spec(token) or token.kind != entry.geometry):
        raise InvalidInputError(wrong_geometry_message(cls.__name__, entry.geometry, token))
    if token is not None and values:
        raise InvalidInputError(
            given_twice_message(cls.__name__, ", ".join(sorted(values)), spec=True)
        )
    if codec is not None and not hasattr(codec, "key"):
        raise InvalidInputError(f"codec must be a codec spec, got {codec!r}")
    size = None if block_size is None else as_count(block_size, "block_size", minimum=1)
    if placement is not None:
        if size is not None and size != placement.block_size:
            raise InvalidInputError("block_size given twice, differently")
        size = placement.block_size
    if pool is not None:
        if size is not None and size != pool.block_size:
            raise InvalidInputError(f"the pool's blocks hold {pool.block_size} tokens, not {size}")
        if codec is not None and codec != pool.codec_spec:
            raise InvalidInputError(f"the pool stores {pool.codec_spec!r}, not {codec!r}")
        size, codec = pool.block_size, pool.codec_spec
        if declared is not None and pool.geometry is not None and declared != pool.geometry:
            raise InvalidInputError(f"the pool holds {pool.geometry.describe()}")
    spec: Any = Plain() if codec is None else codec
    cap = None if placement is None else placement.max_tokens  # the paged latent's
    if token is None:
        numbers: dict[str, object] = {"max_tokens": cap}
        for name, value in values.items():
            if isinstance(value, bool) or not hasattr(value, "__index__"):
                raise InvalidInputError(not_an_integer_message(name, value))
            numbers[name] = operator.index(value)
        defaults = {f.name: f.default for f in fields(cast(Any, GEOMETRIES[entry.geometry]))}
        missing = [p for p in entry.params if p not in numbers and defaults.get(p) is MISSING]
        if missing:
            raise InvalidInputError(needs_parameters_message(cls.__name__, ", ".join(missing)))
        token = GEOMETRIES[entry.geometry].from_fields({**defaults, **numbers})
    # A growing row's bound (the paged latent's ``max_tokens``) is the placement's too.
    bound = None if token.wraps else token.cap()
    paged = Paged(block_size=size or DEFAULT_BLOCK_SIZE, max_tokens=bound)
    return spec, paged, token, declared, pool


class BlockLedger:
    """Reference counts, free queue and hash maps of one pool's blocks.

    ``grow``: called with the new block count before the ledger counts the new blocks
    (the array planes grow there; if it raises, nothing changed). ``max_blocks``: the most
    blocks the pool may hold (``None``: unbounded). ``extra``: the extra keys of every
    block hash (the pool's codec key and block size).
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int = 0,
        *,
        max_blocks: int | None = None,
        grow: Callable[[int], None] | None = None,
        extra: str = "",
    ) -> None:
        self.block_size = as_count(block_size, "block_size", minimum=1)
        self.max_blocks = None if max_blocks is None else as_count(max_blocks, "max_blocks")
        count = as_count(num_blocks, "num_blocks")
        if self.max_blocks is not None and count > self.max_blocks:
            raise InvalidInputError(f"num_blocks {count} exceeds max_blocks {self.max_blocks}")
        self._grow = grow
        #: The extra keys every block hash of this pool includes.
        self.extra = extra
        self._refs: list[int] = [0] * count
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(count))
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self._parent_of: dict[int, bytes] = {}
        #: KV bytes appends wrote into the pool.
        self.bytes_written = 0
        #: KV bytes copied inside or into the pool (copy on write, foreign merges).
        self.bytes_copied = 0

    # -- reading -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self._refs)

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def referenced_count(self) -> int:
        return sum(1 for r in self._refs if r > 0)

    @property
    def held_count(self) -> int:
        """Blocks whose KV the pool keeps: referenced by a table, or free but cached (the
        prefix cache's share). Counted from the free queue and the hashes, not block by
        block, so a caller may ask on every step."""
        cached_free = sum(1 for b in self._hash_of if self._refs[b] == 0)
        return self.num_blocks - len(self._free) + cached_free

    @property
    def cached_count(self) -> int:
        """Hashed blocks (referenced or free)."""
        return len(self._hash_of)

    def ref(self, block: int) -> int:
        return self._refs[block]

    def hash_of(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

    def tokens_of(self, block: int) -> tuple[int, ...] | None:
        """The token ids that produced a hashed block's hash."""
        return self._tokens_of.get(block)

    def block_of(self, digest: bytes) -> int | None:
        return self._block_of.get(digest)

    def free_order(self) -> tuple[int, ...]:
        """The free queue, next block taken first."""
        return tuple(self._free)

    def writable(self, block: int) -> bool:
        """Whether one owner may write the block in place (held once, caches nothing)."""
        return self._refs[block] == 1 and block not in self._hash_of

    # -- allocation and release ----------------------------------------------------------
    def ensure(self, count: int) -> None:
        """Grow until ``count`` blocks are free (raises ``PoolExhaustedError``, nothing changed)."""
        target = self.target_for(count)
        if target is None:
            return
        if self._grow is not None:
            self._grow(target)
        fresh = range(self.num_blocks, target)
        self._refs.extend(0 for _ in fresh)
        for b in reversed(fresh):  # fresh blocks are taken before cached ones
            self._free[b] = None
            self._free.move_to_end(b, last=False)

    def target_for(
        self,
        count: int,
        *,
        num_blocks: int | None = None,
        free: int | None = None,
        max_blocks: int | None = None,
    ) -> int | None:
        """The block count :meth:`ensure` of ``count`` grows to (``None``: enough are
        free), raising its ``PoolExhaustedError``; nothing changes. The keywords stand
        for the ledger's own counts (a pool that learns its limit first)."""
        total = self.num_blocks if num_blocks is None else num_blocks
        free_now = len(self._free) if free is None else free
        most = self.max_blocks if num_blocks is None else max_blocks
        short = count - free_now
        if short <= 0:
            return None
        return growth_target(total, total + short, most)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks from the head of the free queue (each now held once); a
        taken block's hash is evicted."""
        self.ensure(count)
        taken: list[int] = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._refs[block] = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[int]) -> None:
        """One more table holds each of ``blocks`` (a prefix hit or a shared row)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """One table fewer holds each of ``blocks``, in the given order (callers release a
        table tail first, so its tail is evicted first)."""
        for block in blocks:
            if self._refs[block] <= 0:
                raise AssertionError(f"block {block} released more often than held")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
                if block not in self._hash_of:
                    self._free.move_to_end(block, last=False)

    # -- the prefix cache ----------------------------------------------------------------
    def register(self, block: int, parent: bytes, tokens: Sequence[int]) -> bytes:
        """Record that held, full ``block`` holds ``tokens`` after the block hashed
        ``parent``; returns the block's hash. When another block already caches that hash,
        this one stays private (no de-duplication: block ids under live tables never
        change). A block already cached under another hash is refused."""
        if self._refs[block] <= 0:
            raise AssertionError(f"block {block} is registered while free")
        if len(tokens) != self.block_size:
            raise AssertionError(f"only full blocks are hashed, got {len(tokens)} tokens")
        digest = block_hash(parent, tokens, self.extra)
        known = self._hash_of.get(block)
        if known is not None:
            if known != digest:
                raise InvalidInputError(
                    f"block {block} is cached under other token ids than the ones given"
                )
            return digest
        if digest in self._block_of:
            return digest
        self._hash_of[block] = digest
        self._block_of[digest] = block
        self._parent_of[block] = parent
        self._tokens_of[block] = tuple(int(t) for t in tokens)
        return digest

    def lookup(self, digests: Sequence[bytes]) -> list[int]:
        """The blocks caching the longest leading run of ``digests``."""
        found: list[int] = []
        for digest in digests:
            block = self._block_of.get(digest)
            if block is None:
                break
            found.append(block)
        return found

    def evict_cached(self, count: int) -> int:
        """Drop the hashes of up to ``count`` free cached blocks, least recently used first;
        returns how many were dropped."""
        dropped = 0
        for block in list(self._free):
            if dropped == count:
                break
            if block in self._hash_of:
                self._evict(block)
                self._free.move_to_end(block, last=False)
                dropped += 1
        return dropped

    def _evict(self, block: int) -> None:
        digest = self._hash_of.pop(block, None)
        if digest is not None:
            del self._block_of[digest]
            del self._tokens_of[block]
            del self._parent_of[block]

    # -- invariants ----------------------------------------------------------------------
    def check_valid(self, tables: Iterable[Sequence[int]] | None = None) -> None:
        """Assert the ledger's invariants; with ``tables`` (every live block table), also
        that each block's count is the number of tables holding it."""
        refs = self._refs
        assert all(r >= 0 for r in refs), "negative reference count"
        assert len(self._free) + self.referenced_count == self.num_blocks, "conservation"
        assert all((refs[b] == 0) == (b in self._free) for b in range(len(refs))), (
            "a block is free exactly when no table holds it"
        )
        assert all(0 <= b < len(refs) for b in self._free)
        assert set(self._block_of.values()) == set(self._hash_of), "hash maps agree"
        assert all(self._block_of[d] == b for b, d in self._hash_of.items()), "hash maps agree"
        assert set(self._tokens_of) == set(self._hash_of)
        assert all(len(t) == self.block_size for t in self._tokens_of.values()), "full blocks"
        assert all(
            block_hash(self._parent_of[b], t, self.extra) == self._hash_of[b]
            for b, t in self._tokens_of.items()
        ), "a cached block's hash is not the hash of the tokens that produced it"
        if tables is not None:
            counted = [0] * len(refs)
            for table in tables:
                for block in table:
                    counted[block] += 1
            assert counted == refs, "a reference count is not the number of tables holding it"


class PoolBase:
    """What a block pool is in both implementations, array-free: the constructor's checks,
    the ledger (block ids, reference counts, prefix hashes, byte counters), the KV
    geometry it learns once, its byte formulas and byte limit. Each implementation adds
    its planes' array work: ``_make_codec`` (its codec registry), ``_grow_to`` (allocate
    blocks), writes, gathers and tables (``reference/paging.py``, ``optimized/paging.py``).
    """

    codec: Any
    _tables: dict[int, Any]

    def __init__(
        self,
        codec: CodecSpec | None = None,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int = 0,
        max_bytes: int | None = None,
        geometry: KvGeometry | None = None,
    ) -> None:
        self.codec = self._make_codec(Plain() if codec is None else codec)
        self.block_size = as_count(block_size, "block_size", minimum=1)
        self._initial = as_count(num_blocks, "num_blocks")
        self.max_bytes = None if max_bytes is None else as_count(max_bytes, "max_bytes")
        self.ledger = BlockLedger(
            self.block_size, grow=self._grow_to, extra=f"{self.codec.key}|{self.block_size}"
        )
        #: Each tensor's planes ``[num_blocks, H, block_size, ·]`` (empty until it grows).
        self._planes: dict[str, tuple[Any, ...]] = {}
        self._geometry: KvGeometry | None = None
        #: The live tables (rows) by identity.
        self._tables = {}
        if geometry is not None:
            self.learn(geometry)

    def _make_codec(self, spec: CodecSpec) -> Any:
        """This implementation's array codec of ``spec``."""
        raise NotImplementedError

    def _check_geometry(self, geometry: KvGeometry) -> None:
        """Refuse a geometry the pool's codec cannot store (a latent pool checks its own)."""
        self.codec.check(geometry)

    def _grow_to(self, total: int) -> None:
        """Allocate blocks up to ``total`` (the ledger calls it)."""
        raise NotImplementedError

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
        from kvrows.common import shapes_token_bytes

        if self._geometry is None:
            raise LayoutStateError(POOL_GEOMETRY_UNKNOWN)
        return shapes_token_bytes(self.codec, self._geometry)

    @property
    def bytes_per_block(self) -> int:
        return self.token_bytes * self.block_size

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.held_arrays())

    @property
    def bytes_written(self) -> int:
        return self.ledger.bytes_written

    @property
    def bytes_copied(self) -> int:
        return self.ledger.bytes_copied

    def held_arrays(self) -> tuple[Any, ...]:
        return tuple(p for planes in self._planes.values() for p in planes)

    def learn(self, geometry: KvGeometry, *, room: int = 0) -> None:
        """Fix the KV geometry (first write or declaration); refuses another one. ``room``:
        the blocks the write that teaches it takes; a byte limit that cannot hold them
        raises ``PoolExhaustedError`` before the pool learns anything."""
        if self._geometry is not None:
            self._check_same(geometry)
            return
        limit = self._limit_for(geometry, room)
        self._geometry = geometry
        if limit is not None:
            self.ledger.max_blocks = limit
        if self._initial:
            self.ledger.ensure(self._initial)

    def _check_same(self, geometry: KvGeometry) -> None:
        """Refuse a geometry other than the one the pool holds."""
        if self._geometry is not None and geometry != self._geometry:
            raise InvalidInputError(
                pool_geometry_message(self._geometry.describe(), geometry.describe())
            )

    def _limit_for(self, geometry: KvGeometry, room: int) -> int | None:
        """``learn``'s checks of a first ``geometry`` whose write takes ``room`` blocks,
        changing nothing; the block limit its byte limit sets (``None``: no limit)."""
        from kvrows.common import shapes_token_bytes

        self._check_geometry(geometry)
        if self.max_bytes is None:
            return None
        limit = self.max_bytes // (shapes_token_bytes(self.codec, geometry) * self.block_size)
        if limit < self._initial:
            raise InvalidInputError(pool_limit_message(self.max_bytes, limit, self._initial))
        check_limit(room, limit)
        return limit

    def check_take(self, geometry: KvGeometry | None, count: int) -> None:
        """Raise what ``learn(geometry, room=count)`` (when ``geometry`` is given) and then
        taking ``count`` fresh blocks would raise, changing nothing: a merge's check
        before any part of a composite joins (``check_merge``)."""
        ledger = self.ledger
        if geometry is None or self._geometry is not None:
            if geometry is not None:
                self._check_same(geometry)
            ledger.target_for(count)
            return
        limit = self._limit_for(geometry, count)
        total, free = ledger.num_blocks, ledger.free_count
        grown = ledger.target_for(self._initial, num_blocks=total, free=free, max_blocks=limit)
        if grown is not None:
            total, free = grown, free + grown - total
        ledger.target_for(count, num_blocks=total, free=free, max_blocks=limit)

    def blocks_for(self, offset: int) -> int:
        """Blocks a row of ``offset`` positions holds."""
        return math.ceil(offset / self.block_size)

    # -- the prefix cache (int-only: each twin's ``register_prefix`` / ``lookup_prefix``) --
    def register_blocks(
        self,
        blocks: Sequence[int],
        held: tuple[int, int],
        ids: Sequence[int],
        cap: int | None = None,
    ) -> int:
        """Hash the full blocks of a row's table ``blocks`` that ``ids`` (the token ids of
        its first positions) covers; ``held``: the row's ``(offset, positions held)``;
        ``cap``: the most positions a row of its geometry holds (a ring's ``max_size``).
        A row that gave a position back (a ring past its window: it holds fewer positions
        than its offset, so its blocks no longer hold position 0 on) registers nothing;
        otherwise the blocks of the first ``min(len(ids), cap)`` positions, the ones
        a lookup can return. Returns how many blocks are now cached."""
        tokens = token_ids(ids)
        offset, retained = held
        if len(tokens) > offset:
            raise InvalidInputError(prefix_too_long_message(len(tokens), offset))
        # A ring past its window, or a row holding no block (a warm row beside the pool,
        # stage 0), caches nothing.
        if retained < offset or not blocks:
            return 0
        bs, ledger = self.block_size, self.ledger
        full = (len(tokens) if cap is None else min(len(tokens), cap)) // bs
        hashes = chain_hashes(tokens, bs, ledger.extra, full)
        for j, digest in enumerate(hashes):  # refuse before any block is hashed
            known = ledger.hash_of(blocks[j])
            if known is not None and known != digest:
                raise InvalidInputError(prefix_mismatch_message(j))
        previous = ROOT_HASH
        for j in range(full):
            previous = ledger.register(blocks[j], previous, tokens[j * bs : (j + 1) * bs])
        return full

    def prefix_blocks(
        self, ids: Sequence[int], token_geometry: GeometrySpec | None = None
    ) -> list[int]:
        """The cached blocks of the longest run of full blocks that starts the token
        ids ``ids`` (read only, nothing taken): at most ``len(ids) - 1`` positions (the last
        token is always computed, for its logits) and at most what a row of
        ``token_geometry`` holds (its ``cap()``: a ring's window; default growing)."""
        tokens = token_ids(ids)
        most = max(len(tokens) - 1, 0)
        cap = None if token_geometry is None else token_geometry.cap()
        if cap is not None:
            most = min(most, cap)
        bs, ledger = self.block_size, self.ledger
        return ledger.lookup(chain_hashes(tokens, bs, ledger.extra, most // bs))

    def evict_cached(self, count: int) -> int:
        """Forget up to ``count`` unreferenced cached blocks, least recently used first."""
        return self.ledger.evict_cached(as_count(count, "count"))


class PagedSurface:
    """What a paged storage shows besides its rows, in both implementations (array-free):
    its pool, placement and block size, and mlx-lm's read surface over ``_held()`` (what ``fetch``
    returns, ``None`` while nothing is held): ``keys`` / ``values`` are reads only, since
    a block pool is shared. A paged preset of any codec adds :class:`AnyCodecParameters`."""

    _pool: Any
    _paged: Paged

    if TYPE_CHECKING:

        @property
        def codec_spec(self) -> CodecSpec: ...

        def fetch(self) -> tuple[Any, Any]: ...

    def _held(self) -> tuple[Any, Any] | None:
        raise NotImplementedError

    #: Whether the placement holds a contiguous stage 0 beside its pool (contract §0.5:
    #: ``PagedLatentCache``'s warm rows); the pool stores the last stage.
    _stage_beside: ClassVar[bool] = False

    def _use_stages(self, specs: Sequence[CodecSpec]) -> None:
        """The pool's blocks are of one codec, the last stage's: a second stage only where
        the placement holds stage 0 contiguous beside the pool (its rows convert into fresh
        blocks); otherwise more stages are refused, nothing changed."""
        if len(specs) > (2 if self._stage_beside else 1):
            raise LayoutStateError(PAGED_ONE_STAGE)
        super()._use_stages(specs)  # type: ignore[misc]

    @property
    def pool(self) -> Any:
        """The block pool this cache's tables point into (``None`` before the first write
        of a cache built without one)."""
        return self._pool

    @property
    def placement(self) -> Paged:
        """The placement spec (``Paged(block_size=…)``): with ``codec_spec`` and
        ``token_geometry``, what an empty storage like this one is built from."""
        return self._paged

    @property
    def block_size(self) -> int:
        return self._paged.block_size

    @property
    def state_needs_dispose(self) -> bool:
        return False

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
        if held is None:
            return 0
        first = held[0][0] if isinstance(held[0], tuple) else held[0]
        return int(first.shape[2])


class AnyCodecParameters:
    """The affine codec's ``bits`` / ``group_size`` on a paged preset of any codec
    (``codec="any"`` in the table: its spec decides); a preset of one codec kind (the
    paged latent) answers what its kind does instead."""

    if TYPE_CHECKING:

        @property
        def codec_spec(self) -> CodecSpec: ...

    # mlx-lm's attention reads ``bits`` / ``group_size`` off an affine cache (its quantized
    # path); other codecs have neither (``hasattr`` is false).
    @property
    def bits(self) -> int:
        return int(self._affine_parameter("bits"))

    @property
    def group_size(self) -> int:
        return int(self._affine_parameter("group_size"))

    def _affine_parameter(self, name: str) -> int:
        """The codec's parameter ``name`` (only the affine codec has ``bits`` and
        ``group_size``: its quantized attention path)."""
        spec = self.codec_spec
        parameters = spec.parameters()
        if name not in parameters:
            raise AttributeError(no_affine_parameter_message(type(self).__name__, spec, name))
        return parameters[name]
