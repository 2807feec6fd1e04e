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

A public operation that writes the pool runs inside :meth:`PoolBase.undoable` (contract
§9): every ledger step, table edit and plane growth of it records its undo in a journal
(O(what it touched), never a copy of the pool), and an exception replays the journal
backwards, so the pool is as it was (block counts, free order, cached hashes and the
bytes of the cached blocks the append took, tables, byte counters).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import operator
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
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
from kvrows.geometries.ring import held_positions
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


PagedBinding = tuple[CodecSpec, Paged, GeometrySpec, KvGeometry | None, Any]
#: One token geometry spec per kind and fields (frozen): the storages of one declaration
#: share it, so a merge compares their keys by identity, not field by field.
_TOKEN_GEOMETRIES: dict[tuple[str, tuple[tuple[str, object], ...]], GeometrySpec] = {}
#: Each class's binding of no argument: every ``cls()`` parses to it (its specs are
#: frozen, so one result serves them all; a layout is built per merge).
_NO_ARGUMENT_BINDING: dict[type[Any], PagedBinding] = {}


def bind_paged(cls: type[Any], args: Sequence[object], kwargs: dict[str, object]) -> PagedBinding:
    """:func:`_bind_paged`, parsed once per class for a construction without arguments."""
    if args or kwargs:
        return _bind_paged(cls, args, kwargs)
    bound = _NO_ARGUMENT_BINDING.get(cls)
    if bound is None:
        bound = _NO_ARGUMENT_BINDING[cls] = _bind_paged(cls, (), {})
    return bound


def _bind_paged(cls: type[Any], args: Sequence[object], kwargs: dict[str, object]) -> PagedBinding:
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
        fields_given = {**defaults, **numbers}
        named = (entry.geometry, tuple(sorted(fields_given.items())))
        token = _TOKEN_GEOMETRIES.get(named)
        if token is None:
            token = GEOMETRIES[entry.geometry].from_fields(fields_given)
            _TOKEN_GEOMETRIES[named] = token
    # A growing row's bound (the paged latent's ``max_tokens``) is the placement's too (a
    # ring's or a chunked row's cap is what it keeps, not a bound).
    bound = None if token.wraps or token.evicts else token.cap()
    paged = Paged(block_size=size or DEFAULT_BLOCK_SIZE, max_tokens=bound)
    return spec, paged, token, declared, pool


def _weakly(method: Callable[..., None]) -> Callable[..., None]:
    """``method`` called through a weak reference to its object."""
    held = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = held()
        assert bound is not None, "a ledger outlived its pool"
        bound(*args)

    return call


class BlockLedger:
    """Reference counts, free queue and hash maps of one pool's blocks.

    ``grow``: called with the new block count before the ledger counts the new blocks
    (the array planes grow there; if it raises, nothing changed). ``max_blocks``: the most
    blocks the pool may hold (``None``: unbounded). ``extra``: the extra keys of every
    block hash (the pool's codec key and block size). ``keep``: inside :meth:`undoable`,
    called with the cached blocks an allocation is about to take (their hashes evicted,
    their bytes about to be overwritten) before it takes them: the pool saves their bytes
    and journals putting them back.
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int = 0,
        *,
        max_blocks: int | None = None,
        grow: Callable[[int], None] | None = None,
        extra: str = "",
        keep: Callable[[list[int]], None] | None = None,
    ) -> None:
        self.block_size = as_count(block_size, "block_size", minimum=1)
        self.max_blocks = None if max_blocks is None else as_count(max_blocks, "max_blocks")
        count = as_count(num_blocks, "num_blocks")
        if self.max_blocks is not None and count > self.max_blocks:
            raise InvalidInputError(f"num_blocks {count} exceeds max_blocks {self.max_blocks}")
        self._grow = grow
        self._keep = keep
        #: Inside :meth:`undoable`: the undo of every step taken so far, oldest first.
        self._undo: list[Callable[[], object]] | None = None
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

    # -- the journal (contract §9) -------------------------------------------------------
    @property
    def journaling(self) -> bool:
        """Whether an :meth:`undoable` operation is running (steps record their undo)."""
        return self._undo is not None

    def journal(self, undo: Callable[[], object]) -> None:
        """Record ``undo``, what puts back a step just taken (nothing outside
        :meth:`undoable`)."""
        if self._undo is not None:
            self._undo.append(undo)

    @contextmanager
    def undoable(self) -> Iterator[None]:
        """Run the block: on an exception, undo every journaled step newest first (and the
        byte counters), then re-raise. Nested, the outermost one undoes."""
        if self._undo is not None:
            yield
            return
        self._undo = []
        counters = self.bytes_written, self.bytes_copied
        try:
            yield
        except BaseException:
            undo, self._undo = self._undo, None
            for step in reversed(undo):
                step()
            self.bytes_written, self.bytes_copied = counters
            raise
        finally:
            self._undo = None

    # -- allocation and release ----------------------------------------------------------
    def ensure(self, count: int) -> None:
        """Grow until ``count`` blocks are free (raises ``PoolExhaustedError``, nothing changed)."""
        target = self.target_for(count)
        if target is None:
            return
        if self._grow is not None:
            self._grow(target)
        old = self.num_blocks
        fresh = range(old, target)
        self._refs.extend(0 for _ in fresh)
        for b in reversed(fresh):  # fresh blocks are taken before cached ones
            self._free[b] = None
            self._free.move_to_end(b, last=False)

        def shrink() -> None:
            for b in fresh:
                del self._free[b]
            del self._refs[old:]

        self.journal(shrink)

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
        journaling = self._undo is not None
        if journaling and self._keep is not None and self._hash_of:
            cached = [b for b in itertools.islice(self._free, count) if b in self._hash_of]
            if cached:  # their bytes are about to be overwritten: an undo puts them back
                self._keep(cached)
        taken: list[int] = []
        evicted: list[tuple[int, bytes, tuple[int, ...], bytes]] = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            if journaling and block in self._hash_of:
                hashed = self._hash_of[block], self._tokens_of[block], self._parent_of[block]
                evicted.append((block, *hashed))
            self._evict(block)
            self._refs[block] = 1
            taken.append(block)

        if not journaling:
            return taken
        order = tuple(taken)  # (callers consume the list they get)

        def give_back() -> None:
            for block, digest, tokens, parent in evicted:
                self._hash_of[block], self._block_of[digest] = digest, block
                self._tokens_of[block], self._parent_of[block] = tokens, parent
            for block in reversed(order):
                self._refs[block] = 0
                self._free[block] = None
                self._free.move_to_end(block, last=False)

        self.journal(give_back)
        return taken

    def touch(self, blocks: Iterable[int]) -> None:
        """One more table holds each of ``blocks`` (a prefix hit or a shared row)."""
        if self._undo is None:  # outside a transaction: nothing to record
            refs, free = self._refs, self._free  # (locals: a merge touches every block)
            for block in blocks:
                held = refs[block]
                if not held:
                    del free[block]
                refs[block] = held + 1
            return
        blocks = list(blocks)
        # A free block leaves the middle of the queue: an undo needs its order (rare: a
        # prefix hit inside an undoable operation).
        order = OrderedDict(self._free) if any(self._refs[b] == 0 for b in blocks) else None
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

        def untouch() -> None:
            for block in blocks:
                self._refs[block] -= 1
            if order is not None:
                self._free = order

        self.journal(untouch)

    def release(self, blocks: Iterable[int]) -> None:
        """One table fewer holds each of ``blocks``, in the given order (callers release a
        table tail first, so its tail is evicted first)."""
        refs, free, hashed = self._refs, self._free, self._hash_of  # (locals: hot loop)
        journaling = self._undo is not None
        released: list[tuple[int, bool]] = []
        for block in blocks:
            held = refs[block]
            if held <= 0:
                raise AssertionError(f"block {block} released more often than held")
            refs[block] = held - 1
            if held == 1:
                free[block] = None
                if block not in hashed:
                    free.move_to_end(block, last=False)
            if journaling:
                released.append((block, held == 1))
        if not journaling:
            return

        def hold_again() -> None:
            for block, freed in reversed(released):
                if freed:
                    del self._free[block]
                self._refs[block] += 1

        self.journal(hold_again)

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

    #: The implementation's paged serial caches by geometry kind (what a hit returns).
    cache_classes: ClassVar[dict[str, type[Any]]]

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
        self.ledger = BlockLedger(  # (its hooks hold the pool weakly: no cycle keeps the
            self.block_size,  # planes of a dropped pool until the collector runs)
            grow=_weakly(self._grow_journaled),
            extra=f"{self.codec.key}|{self.block_size}",
            keep=_weakly(self._keep_blocks),
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

    def _grow_journaled(self, total: int) -> None:
        """:meth:`_grow_to`, journaled: growth builds new planes, so an undo rebinds the
        old ones (their blocks are the ones the ledger gives back to)."""
        old = self._planes
        self._grow_to(total)

        def shrink() -> None:
            self._planes = old

        self.ledger.journal(shrink)

    def _keep_blocks(self, blocks: list[int]) -> None:
        """Save the bytes of ``blocks`` (cached blocks an allocation takes inside
        :meth:`undoable`) and journal writing them back."""
        raise NotImplementedError

    def undoable(self) -> Any:
        """A context in which every change to the pool is journaled (contract §9): on an
        exception the ledger, the tables, the planes' growth, the bytes of cached blocks
        the operation took, the learnt geometry and the byte counters are put back (the
        caller puts its own host records back: ``all_or_nothing``)."""
        return _Undoable(self)

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

    def lookup_prefix(
        self, token_ids: Sequence[int], token_geometry: GeometrySpec | None = None
    ) -> Any:
        """A new paged serial cache of ``token_geometry`` (default growing: a
        ``PagedKVCache``; a ring: a ``PagedRotatingKVCache``, the implementation's
        ``cache_classes``) holding the longest run of cached full blocks that starts
        ``token_ids`` (:meth:`prefix_blocks`: at most ``len(token_ids) - 1`` positions and
        what such a row holds), referenced, not copied; ``None`` on a miss."""
        hits = self.prefix_blocks(token_ids, token_geometry)
        if not hits:
            return None
        cache = self._prefix_cache(token_geometry)
        cache._geometry = self._geometry
        self._adopt_hit(cache, hits)
        return cache

    def _prefix_cache(self, token_geometry: GeometrySpec | None = None) -> Any:
        """An empty cache of the pool's codec and ``token_geometry`` that a prefix hit's
        rows join (a latent pool's is its latent cache)."""
        if token_geometry is None:
            return self.cache_classes["growing"](pool=self)
        return self.cache_classes[token_geometry.kind](pool=self, token_geometry=token_geometry)

    def _adopt_hit(self, cache: Any, hits: list[int]) -> None:
        """Give the empty ``cache`` one row holding the blocks ``hits`` (each referenced
        once more; every position of them): the implementation's row record."""
        raise NotImplementedError

    def evict_cached(self, count: int) -> int:
        """Forget up to ``count`` unreferenced cached blocks, least recently used first."""
        return self.ledger.evict_cached(as_count(count, "count"))


class _Undoable:
    """:meth:`PoolBase.undoable`'s context: the ledger's journal, and what ``learn`` set."""

    def __init__(self, pool: PoolBase) -> None:
        self._pool = pool
        self._context = pool.ledger.undoable()

    def __enter__(self) -> None:
        pool = self._pool
        self._learnt = pool._geometry, pool.ledger.max_blocks
        self._context.__enter__()

    def __exit__(self, kind: Any, error: Any, trace: Any) -> bool | None:
        if error is not None:
            pool = self._pool
            pool._geometry, pool.ledger.max_blocks = self._learnt
        return self._context.__exit__(kind, error, trace)


class PagedSurface:
    """What a paged storage shows besides its rows, in both implementations (array-free):
    its pool, placement and block size, and mlx-lm's read surface over ``_held()`` (what ``fetch``
    returns, ``None`` while nothing is held): ``keys`` / ``values`` are reads only, since
    a block pool is shared. A paged preset of any codec adds :class:`AnyCodecParameters`."""

    _pool: Any
    _paged: Paged
    _token_geometry: GeometrySpec

    if TYPE_CHECKING:

        @property
        def codec_spec(self) -> CodecSpec: ...

        def fetch(self) -> tuple[Any, Any]: ...

    def _held(self) -> tuple[Any, Any] | None:
        raise NotImplementedError

    @classmethod
    def from_state(
        cls, state: Any, meta_state: Any = None, *, keep: int | None = None,
        geometry: KvGeometry | None = None, pool: Any = None,
    ) -> Any:  # fmt: skip
        """A cache holding ``state``, its positions written into fresh blocks of ``pool``
        (default: a private pool; a pool that cannot take them refuses with
        ``PoolExhaustedError``, unchanged)."""
        if pool is None:
            return super().from_state(state, meta_state, keep=keep, geometry=geometry)  # type: ignore[misc]
        from kvrows.paged_forms import restore_state

        return restore_state(cls, state, geometry, pool, keep=keep or 0)

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

    def _converts_after(self, stages: Sequence[int], offsets: Sequence[int], n: int) -> list[int]:
        """The stage-0 rows (in ``stages`` at ``offsets``) that convert into the pool's
        stage after an append of ``n`` tokens (none without a stage beside the pool)."""
        return []

    def _reserve(
        self,
        stages: Sequence[int],
        offsets: Sequence[int],
        n: int,
        append_need: Callable[[Any], int],
        geometry: Any,
    ) -> int | None:
        """The blocks an append of ``n`` tokens takes when rows beside the pool convert
        after it: the append's (``append_need(pool)``) and the conversion's, checked against
        the pool before anything is written (a refusal changes nothing); ``None`` when no
        row converts (or no pool is known yet: a new pool has no limit)."""
        due = self._converts_after(stages, offsets, n)
        if not due or self._pool is None:
            return None
        pool = self._pool
        room: int = append_need(pool) + sum(pool.blocks_for(offsets[b] + n) for b in due)
        pool.check_take(geometry, room)
        return room

    @property
    def pool(self) -> Any:
        """The block pool this cache's tables point into (``None`` before the first write
        of a cache built without one)."""
        return self._pool

    def _pool_undoable(self) -> Any:
        """The pool's :meth:`PoolBase.undoable` context (none before a pool is known: a
        pool made inside the operation is dropped with the host records)."""
        return nullcontext() if self._pool is None else self._pool.undoable()

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
        """Columns a read returns, at most what a row of its geometry holds between steps
        (a ring's window, a chunk: the contiguous drop-ins' ``size()``)."""
        held = self._held()
        if held is None:
            return 0
        first = held[0][0] if isinstance(held[0], tuple) else held[0]
        cap = self._token_geometry.cap()
        width = int(first.shape[2])
        return width if cap is None else min(width, cap)


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
