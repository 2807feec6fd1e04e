"""The contract every storage and row layout implements.

Both implementations (``kvrows.reference`` on NumPy, ``kvrows.optimized`` on
MLX) satisfy these protocols with their own array type. The protocols are
runtime-checkable so the row-layout table can detect batchable state
structurally, as the seed does, rather than by a class ladder.

Conventions (see ``spec/contract.md``):

* attention tensors are ``[B, H, T, D]``: rows, KV heads, tokens, head dim;
  keys and values may have their own head dims;
* a mask is ``None`` (every fetched key visible), ``"causal"`` (bottom-right
  aligned) or a boolean array ``[N, S]`` / ``[B, 1, N, S]`` where ``True``
  means *may attend*; it is asked before the update of ``N`` tokens and
  describes the keys that update returns;
* ``offset`` is an ``int`` on serial caches and a per-row positions array on
  row layouts (mlx-lm's convention); it is rebound, never mutated in place.
"""

from __future__ import annotations

import inspect
import typing
from abc import ABCMeta
from collections.abc import Sequence
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

__all__ = [
    "AppendLimited",
    "BatchableCache",
    "Cache",
    "Composed",
    "Converting",
    "DropInParts",
    "DropInWrapper",
    "Handover",
    "HasCodec",
    "LastReadAttention",
    "LatentAppend",
    "Mask",
    "MergeChecking",
    "PagedForm",
    "PagedRows",
    "PendingRows",
    "ReusableOffset",
    "RingGeometry",
    "RowAttention",
    "RowSource",
    "RowTrimmable",
    "SelfChecking",
    "SpeculativeRowLayout",
    "StateDisposer",
    "StateWritten",
    "TimeOrderedReads",
]

#: ``None``, ``"causal"`` or a boolean array (``True`` = may attend).
Mask: TypeAlias = Literal["causal"] | Any | None


#: (protocol, class) -> the protocol's members the class lacks (instances may set them).
_LACKING: dict[tuple[type, type], frozenset[str]] = {}


class _StaticMembers(typing._ProtocolMeta):
    """``isinstance`` against a runtime protocol looks its members up statically (Python
    3.12's rule). Python 3.11 evaluates properties, so a property that refuses (a verify
    layout's ``state`` in the middle of a speculative round) escaped from ``isinstance``,
    and one that builds something (``state``) was built on every check. What a class lacks
    is remembered per class (the checks run on every table call)."""

    def __instancecheck__(cls, instance: object) -> bool:
        # The remembered answer first: a merge asks several protocols of every source.
        key = (cls, type(instance))
        lacking = _LACKING.get(key)
        if lacking is None:
            if not getattr(cls, "_is_runtime_protocol", False):
                return super().__instancecheck__(instance)
            members = getattr(cls, "__protocol_attrs__", None)
            if members is None:
                members = typing._get_protocol_attrs(cls)  # type: ignore[attr-defined]
            missing = object()
            lacking = frozenset(
                m for m in members if inspect.getattr_static(type(instance), m, missing) is missing
            )
            _LACKING[key] = lacking
        if not lacking:
            return True
        # Members an instance sets itself (mlx-lm's caches set ``offset``).
        own = getattr(instance, "__dict__", None)
        if own is not None and lacking <= own.keys():
            return True
        return ABCMeta.__instancecheck__(cls, instance)


@runtime_checkable
class Cache(Protocol, metaclass=_StaticMembers):
    """One layer's attention (or recurrent) state of one or more requests."""

    @property
    def offset(self) -> Any:
        """Serial: tokens stored (the next token's position). Layouts: per-row positions."""
        ...

    @property
    def state(self) -> tuple[Any, ...]:
        """The saved-state form of the cache's class (``kvrows.forms``: mlx-lm's form where
        mlx-lm has the class); evaluable; borrowed unless ``state_needs_dispose``."""
        ...

    def held_arrays(self) -> tuple[Any, ...]:
        """The buffers the cache holds, borrowed: what to evaluate at a chunk boundary
        (``state`` may build a copy)."""
        ...

    @property
    def state_needs_dispose(self) -> bool:
        """Whether ``state`` hands out temporary arrays the caller must release."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays the cache holds, capacity slack included."""
        ...

    def signature(self) -> str:
        """A stable identity string (never ``"unknown"``)."""
        ...

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """Append ``[B, H, N, D]`` keys and values; return the keys and values attention reads."""
        ...

    def fetch(self) -> tuple[Any, Any]:
        """The keys and values the last ``update_and_fetch`` returned (what attention reads now)."""
        ...

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        """The mask for the next update of ``n`` tokens (asked before that update).

        ``return_array`` asks for an array where ``None``/``"causal"`` would do;
        ``window_size`` narrows every query to its last ``window_size`` keys.
        """
        ...

    def is_trimmable(self) -> bool: ...

    def trim(self, n: int) -> int:
        """Forget the newest ``n`` positions; returns how many were trimmed."""
        ...


@runtime_checkable
class BatchableCache(Cache, Protocol):
    """A row layout: several requests' state in one set of batched tensors."""

    @property
    def batch_size(self) -> int:
        """Rows held (0 for an empty layout)."""
        ...

    @property
    def row_offsets(self) -> tuple[int, ...]:
        """Real tokens each row holds (= the position its next token gets)."""
        ...

    @property
    def left_pad(self) -> tuple[int, ...]:
        """Physical columns before each row's first real token."""
        ...

    @property
    def max_tokens(self) -> float:
        """Most positions a row may hold (``math.inf`` when unbounded)."""
        ...

    def make_empty_batch(self) -> BatchableCache:
        """An empty layout of the same kind and codec parameters."""
        ...

    def merge_rows(self, rows: Sequence[Cache]) -> None:
        """Form the batch (empty layout) or join the rows (running layout); borrows ``rows``."""
        ...

    def filter_rows(self, keep: Sequence[int]) -> None:
        """Keep the rows ``keep`` (any subset, in the given order), in place."""
        ...

    def extract_row(self, row: int) -> Cache:
        """An independent, compact serial cache holding row ``row``."""
        ...

    def can_publish_row(self, row: int, tokens: int) -> bool:
        """Whether ``row`` can be published covering exactly ``tokens`` positions."""
        ...

    def projected_bytes(self, tokens: int) -> int:
        """Bytes one row needs to hold ``tokens`` positions.

        Answered from the KV geometry (declared at construction, or learnt from the
        first token); raises ``LayoutStateError`` while it is unknown, never 0.
        """
        ...


@runtime_checkable
class SpeculativeRowLayout(BatchableCache, Protocol):
    """A verify layout: one round appends a verify block for every row, then keeps it or
    rolls each row back to its accepted prefix (``spec/speculative.md``).

    The block is ``[pending, draft_1 … draft_d]`` (``d + 1`` tokens per row); a round with
    ``d = 0`` is not opened. Rejected tokens leave no trace: never visible to a later
    query, never extracted, never published. Merge, filter, extract and trim refuse while
    a round is open.
    """

    @property
    def spec_round_open(self) -> bool:
        """Whether a round has begun and is not yet committed or rolled back."""
        ...

    def spec_round_begin(self) -> None:
        """Open a round (before the verify block is appended)."""
        ...

    def spec_round_commit(self) -> None:
        """Every row accepted every draft."""
        ...

    def spec_round_rollback(self, keep: int | Sequence[int]) -> None:
        """Row ``b`` keeps the first ``keep[b]`` tokens of the block (``1..d + 1``)."""
        ...


# -- capabilities: what code would otherwise probe for with getattr/hasattr -------------


@runtime_checkable
class RowTrimmable(Protocol):
    """A layout that forgets a different number of newest tokens per row (rollback)."""

    def trim_rows(self, counts: Sequence[int]) -> int:
        """Forget ``counts[b]`` newest tokens of row ``b``; returns the largest count."""
        ...


@runtime_checkable
class StateDisposer(Protocol):
    """A cache whose ``state`` hands out temporary arrays it must release."""

    def dispose_state(self, state: tuple[Any, ...]) -> None: ...


@runtime_checkable
class AppendLimited(Protocol):
    """A cache that can take at most ``max_append_tokens()`` tokens in the next append."""

    def max_append_tokens(self) -> float: ...


@runtime_checkable
class ReusableOffset(Protocol):
    """A cache whose prefix below ``minimum_reusable_offset`` cannot be reused (delayed)."""

    @property
    def minimum_reusable_offset(self) -> int: ...


@runtime_checkable
class SelfChecking(Protocol):
    """A cache that can assert its own invariants (tests and conformance)."""

    def check_valid(self) -> None: ...


@runtime_checkable
class HasCodec(Protocol):
    """A cache that stores its tokens through a codec (``kvrows.codec.Codec``)."""

    @property
    def codec(self) -> Any: ...


@runtime_checkable
class RingGeometry(Protocol):
    """A sliding-window cache: at most ``max_size`` positions are kept."""

    @property
    def max_size(self) -> int: ...


@runtime_checkable
class Composed(Protocol):
    """A class built from the composition table (``kvrows.compositions``)."""

    @property
    def composition(self) -> Any:
        """The ``Composition`` entry this class implements."""
        ...

    @property
    def codec_spec(self) -> Any:
        """The frozen codec spec (``kvrows.schemes``)."""
        ...

    @property
    def token_geometry(self) -> Any:
        """The frozen token-geometry spec (``Growing()``, ``Ring(max_size=…)``)."""
        ...

    @property
    def geometry(self) -> Any:
        """The KV geometry (``KvGeometry``) once declared or learnt, else ``None``."""
        ...


# -- the app's capabilities (spec/contract.md §0.10): asked instead of concrete types -----


@runtime_checkable
class Converting(BatchableCache, Protocol):
    """A row layout whose rows convert to a quantized codec at ``start`` (the delayed
    layouts): it holds a request's row from its prefill on (it is its own layout), and its
    prefill converts rows only where ``commit_prefill`` says. Today the conversion state
    (``start``, ``converted_at``, ``phase``) sits on the layout itself."""

    @property
    def start(self) -> int: ...

    @property
    def converted_at(self) -> tuple[int | None, ...]: ...

    @property
    def phase(self) -> str: ...

    @property
    def last_read_codec(self) -> Any:
        """The codec of what the last append returned (``None``: a mixed read)."""
        ...

    def begin_prefill(self) -> None: ...

    def commit_prefill(self, indices: Sequence[int]) -> None: ...

    def end_prefill(self) -> None: ...


@runtime_checkable
class Handover(Protocol, metaclass=_StaticMembers):
    """A wrapper over one serial storage that hands it out and wraps one again (the
    bf16-first lego): ``composed.release()``, ``composed.over(storage)`` and
    ``composed.storage_signatures()`` (the signatures of the storages ``over`` takes)."""

    @property
    def composed(self) -> Any: ...

    @property
    def storage(self) -> Any:
        """The current storage (borrowed)."""
        ...

    @property
    def converted(self) -> bool:
        """Whether the storage is the converted one."""
        ...

    @property
    def minimum_reusable_offset(self) -> int: ...


@runtime_checkable
class LastReadAttention(Protocol):
    """A layout whose last read is attended through itself (a delayed layout: a mixed
    read row group by row group, a packed one through its group's codec)."""

    def attend_last_read(self, queries: Any, mask: Any, scale: float) -> Any:
        """Attention over what the last append returned; ``None`` when no append has been
        made since the rows last changed."""
        ...


@runtime_checkable
class RowAttention(Protocol, metaclass=_StaticMembers):
    """A cache whose reads must be attended inside ``kvrows.app.attention.row_attention``
    when ``needs_row_attention``: mixed-precision rows (each group through its own codec),
    a shared ring's reads put in time order, a conversion to a codec that defers values."""

    @property
    def needs_row_attention(self) -> bool: ...


@runtime_checkable
class PendingRows(Protocol, metaclass=_StaticMembers):
    """What a mixed read returns in place of keys and values: attention goes row group by
    row group through ``layout.attend_rows(..., pending=this)``."""

    @property
    def layout(self) -> Any: ...

    @property
    def generation(self) -> int: ...


@runtime_checkable
class TimeOrderedReads(Protocol, metaclass=_StaticMembers):
    """A cache whose last read can be put in time order (a wrapped shared ring reads its
    window rotated by its phase): the same summation order alone and in a batch."""

    def reads_in_time_order(self, keys: Any, values: Any, mask: Any) -> tuple[Any, Any, Any]:
        """The last read's ``keys``, ``values`` (arrays or tuples of planes) and ``mask`` in
        time order; unchanged when they already are."""
        ...


@runtime_checkable
class PagedRows(Protocol, metaclass=_StaticMembers):
    """A cache or layout whose tokens live in a block pool's blocks (paged)."""

    @property
    def pool(self) -> Any: ...

    @property
    def block_size(self) -> int: ...

    def register_prefix(self, *args: Any) -> int:
        """Register full blocks under their tokens' chain hashes (a layout names the row)."""
        ...

    def release(self) -> None: ...


@runtime_checkable
class MergeChecking(Protocol, metaclass=_StaticMembers):
    """A row layout whose merge can be checked without joining: ``check_merge(rows)``
    raises what ``merge_rows(rows)`` would raise and changes nothing (every layout of a
    row machinery; a composite over layouts, mlx-lm's ``CacheList``, checks each part
    before any part joins)."""

    def check_merge(self, rows: Sequence[Cache]) -> None: ...


@runtime_checkable
class RowSource(Protocol, metaclass=_StaticMembers):
    """A storage of a row machinery (``reference/rows.py``, ``optimized/rows.py``), whose
    rows a layout of the same machinery takes in ``merge_rows``: rows held as
    ``array_name`` arrays (a machinery lends and takes rows of its own array library:
    ``"NumPy"``, ``"MLX"``), each in one of ``stages`` (``row_stages``), on
    ``token_geometry``. A layout asks it before its own checks (token geometry, codecs)."""

    @property
    def array_name(self) -> str: ...

    @property
    def token_geometry(self) -> Any: ...

    @property
    def stages(self) -> tuple[Any, ...]: ...

    @property
    def row_stages(self) -> tuple[int, ...]: ...


@runtime_checkable
class LatentAppend(Protocol, metaclass=_StaticMembers):
    """An MLA cache: appends a latent, a rope plane and an optional indexer plane."""

    def append(self, latent: Any, rope: Any, index: Any | None = None) -> tuple[Any, Any, Any]: ...

    def fetch_index(self) -> Any: ...


@runtime_checkable
class DropInWrapper(Protocol, metaclass=_StaticMembers):
    """The object an unmodified model takes as a layer's cache, over one kvrows cache
    (``wrapped``; mlx-lm's MLA ``CacheList`` pair over a latent cache): the row-layout
    table gives it the layouts of ``wrapped``, each behind ``rewrap`` (a new drop-in of the
    same form), and it is a row layout itself over a wrapped layout."""

    @property
    def wrapped(self) -> Any: ...

    def rewrap(self, cache: Any) -> Any: ...


@runtime_checkable
class DropInParts(Protocol, metaclass=_StaticMembers):
    """The object an unmodified model takes as a layer's cache, over several kvrows caches
    (``parts``, in order; mlx-lm's ``CacheList``: falcon_h1's Mamba2 state beside its
    attention): the row-layout table gives it each part's layout of a role, grouped by
    ``regroup`` (a new drop-in of the same form), and it is a row layout itself over its
    parts' layouts."""

    @property
    def parts(self) -> tuple[Any, ...]: ...

    def regroup(self, parts: Sequence[Any]) -> Any: ...


@runtime_checkable
class PagedForm(Protocol, metaclass=_StaticMembers):
    """A layer cache with a paged form of its own (a latent drop-in: ``PagedLatentCache``
    in a latent block pool): the engine's paged option gives such a layer one pool
    (``paged_pool``) and each request an empty cache of the same form in it
    (``in_pool``)."""

    def paged_pool(self, block_size: int) -> Any: ...

    def in_pool(self, pool: Any) -> Any: ...


@runtime_checkable
class StateWritten(Protocol, metaclass=_StaticMembers):
    """Recurrent state (mlx-lm's ``ArraysCache``): planes written by index, padded runs
    prepared and finalized, no token axis."""

    def __setitem__(self, index: int, value: Any) -> None: ...

    def advance(self, n: int) -> None: ...

    def prepare(
        self,
        *,
        lengths: Sequence[int] | None = None,
        left_padding: Sequence[int] | None = None,
        right_padding: Sequence[int] | None = None,
    ) -> None: ...

    def finalize(self) -> None: ...

    @property
    def lengths(self) -> Any: ...

    @property
    def left_padding(self) -> Any: ...
