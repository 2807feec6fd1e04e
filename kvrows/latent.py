"""MLA latent state (``spec/MLACache.md``, ``spec/EncodedLatentCache.md``): the array-free part.

A latent cache holds, per token, the compressed KV latent (``kv_lora_rank`` wide), the
decoupled RoPE key (``rope_head_dim``) and, for a DeepSeek-sparse-attention target, the
indexer's key (``index_head_dim``), all on one token axis. Rows are right-justified: the
shared width is the longest row, and row ``b`` is left-padded by ``width - offset[b]``.

:class:`LatentRows` is the control flow both implementations share: argument checks (all
before anything changes), the host bookkeeping (row offsets, which rows read exact, the
round state machine of ``kvrows.speculative``) and the operations' templates. Each
implementation supplies the array hooks (``_impl_*``): how planes are stored, appended,
merged, filtered, extracted, rolled back and read. Those hooks are what the conformance
suite compares (reference: compact rows assembled on read; optimized: right-justified
batch buffers rolled in place).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, TypeAlias, TypeVar

from kvrows.codec import CodecSpec, PlaneSpec
from kvrows.codecs import is_codec_spec, is_kv_codec, kv_codecs
from kvrows.codecs.latent import (
    DEEPSEEK_V3_BF16_BYTES,
    FLASHMLA_FP8_BYTES,
    LATENT_FIELDS,
    PAGED_LATENT_FIELDS,
    Latent,
    LatentRole,
    LatentShapes,
    latent_token_bytes,
)
from kvrows.conversion import Conversion
from kvrows.errors import (
    NOTHING_TO_FETCH,
    CapacityError,
    IncompatibleRowsError,
    InvalidInputError,
    LayoutStateError,
    NotTrimmableError,
    from_state_tuple_message,
    latent_role_message,
    not_an_integer_message,
    plain_latent_state_message,
    self_merge_message,
    state_signature_message,
)
from kvrows.schemes import Affine, Growing, Plain
from kvrows.speculative import SpeculativeRounds
from kvrows.validation import FLOAT_DTYPES, as_count, check_keep, check_row

__all__ = [
    "DEEPSEEK_V3_BF16_BYTES",
    "FLASHMLA_FP8_BYTES",
    "LATENT_FIELDS",
    "PAGED_LATENT_FIELDS",
    "EncodedLatentRows",
    "LatentCodec",
    "LatentRole",
    "LatentRows",
    "encoded_codec",
    "latent_spec",
    "latent_token_bytes",
]

LatentCodec: TypeAlias = CodecSpec  # the latent plane takes any codec

_L = TypeVar("_L", bound="LatentRows")
_E = TypeVar("_E", bound="EncodedLatentRows")


def latent_spec(owner: str, inner: CodecSpec, **declared: object) -> Latent:
    """The composite codec of a latent cache declared with ``declared`` (widths, role),
    its latent through ``inner``; ``InvalidInputError`` names ``owner``."""
    try:
        return Latent(inner=inner, **declared)  # type: ignore[arg-type]
    except InvalidInputError as error:
        raise InvalidInputError(f"{owner}: {error}") from None


def growing_geometry(owner: str, max_tokens: object) -> Growing:
    """A latent cache's token geometry: growing, bounded by ``max_tokens``."""
    try:
        return Growing(max_tokens=max_tokens)  # type: ignore[arg-type]
    except InvalidInputError as error:
        raise InvalidInputError(f"{owner}: {error}") from None


def encoded_codec(
    owner: str, codec: object, bits: object, group_size: object, start: object
) -> tuple[LatentCodec, int]:
    """An ``EncodedLatentCache``'s codec and bf16-first start from its arguments: an
    encoding KV codec spec (affine, TurboQuant, ...) or ``bits`` / ``group_size`` (affine;
    defaults 8 and 64)."""
    try:
        if codec is not None:
            if bits is not None or group_size is not None:
                raise InvalidInputError("give a codec or bits/group_size, not both")
            if not (is_codec_spec(codec) and is_kv_codec(codec) and codec.encodes):
                raise InvalidInputError(f"the latent codec must be Affine or Turbo, got {codec!r}")
            chosen: LatentCodec = codec
        else:
            chosen = Affine(
                bits=8 if bits is None else as_count(bits, "bits"),
                group_size=64 if group_size is None else as_count(group_size, "group_size"),
            )
        first = as_count(start, "start")
    except InvalidInputError as error:
        raise InvalidInputError(f"{owner}: {error}") from None
    return chosen, first


def check_latent_codec(codec: LatentCodec, rank: int) -> None:
    """Raise ``InvalidInputError`` unless ``codec`` stores a latent of ``rank`` values."""
    Latent(inner=codec).check_head_dim(rank)


def _shape(array: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in array.shape)


class LatentRows(SpeculativeRounds):
    """Latent rows: the shared control flow over each implementation's array hooks.

    Host state: ``_offsets`` (one per row), ``_conversion`` (the bf16-first record,
    ``kvrows.conversion.Conversion``: a converted row reads its latent decoded; no row
    converts under the plain codec), the learned widths and dtype. The arrays
    live in the implementation.
    """

    start: int = 0
    #: The bf16-first record's class (a test plants a wrong rule through it).
    conversion_class: type[Conversion] = Conversion

    def __init__(
        self,
        kv_lora_rank: object = None,
        rope_head_dim: object = None,
        index_head_dim: object = None,
        max_tokens: object = None,
        role: object = "target",
    ) -> None:
        self._setup(Plain(), 0, kv_lora_rank, rope_head_dim, index_head_dim, max_tokens, role)

    def _setup(
        self,
        inner: LatentCodec,
        start: int,
        kv_lora_rank: object,
        rope_head_dim: object,
        index_head_dim: object,
        max_tokens: object,
        role: object,
    ) -> None:
        """Declare the cache: its composite codec (the latent through ``inner``), its
        growing geometry (``max_tokens``) and bf16-first ``start``."""
        name = type(self).__name__
        self.latent_spec = latent_spec(
            name, inner, kv_lora_rank=kv_lora_rank, rope_head_dim=rope_head_dim,
            index_head_dim=index_head_dim, role=role,
        )  # fmt: skip
        self._token_geometry = growing_geometry(name, max_tokens)
        self.start = start
        self._offsets: list[int] = []
        self._conversion = self._fresh_record()
        self._dtype: str | None = None
        self._widths: tuple[int, int] | None = None
        spec = self.latent_spec
        if spec.kv_lora_rank is not None and spec.rope_head_dim is not None:
            self._widths = (spec.kv_lora_rank, spec.rope_head_dim)
        self._last: tuple[Any, Any, Any] | None = None
        self._impl_init()

    @property
    def latent_codec(self) -> LatentCodec:
        """The codec of the latent plane (``Plain()`` for ``MLACache``)."""
        return self.latent_spec.inner

    def _declaration(self) -> tuple[object, ...]:
        """The constructor's positional arguments this cache was declared with."""
        spec = self.latent_spec
        return (
            spec.kv_lora_rank, spec.rope_head_dim, spec.index_head_dim,
            self._token_geometry.max_tokens, spec.role,
        )  # fmt: skip

    @property
    def _shapes(self) -> LatentShapes | None:
        """What the cache learned from its first append (``None`` before)."""
        if self._widths is None or self._dtype is None:
            return None
        return LatentShapes(*self._widths, self.latent_spec.index_head_dim, self._dtype)

    # -- array hooks (each implementation) ---------------------------------------------
    def _impl_init(self) -> None:
        raise NotImplementedError

    def _impl_shape_dtype(self, array: Any, what: str) -> tuple[tuple[int, ...], str]:
        """``array``'s shape and dtype name; ``InvalidInputError`` for a foreign array."""
        raise NotImplementedError

    def _impl_as4(self, array: Any) -> Any:
        """``[B, N, W]`` as ``[B, 1, N, W]`` (a view)."""
        raise NotImplementedError

    def _impl_as3(self, array: Any) -> Any:
        raise NotImplementedError

    def _impl_append(self, latent: Any, rope: Any, index: Any | None, exact: bool) -> None:
        """Append ``[B, 1, N, ·]`` blocks to every row (latent encoded here); keep the
        exact latent when ``exact`` (some row still reads exact)."""
        raise NotImplementedError

    def _impl_read(self, reads_exact: Sequence[bool]) -> tuple[Any, Any, Any | None]:
        """``(latent, rope, index | None)`` over ``[:width]``, ``[B, 1, width, ·]``; row
        ``b``'s latent from the exact plane where ``reads_exact[b]``, else decoded."""
        raise NotImplementedError

    def _impl_merge(self, sources: Sequence[Any]) -> None:
        """Self is empty: take every source's rows (copies), right-justified."""
        raise NotImplementedError

    def _impl_filter(self, keep: Sequence[int]) -> None:
        raise NotImplementedError

    def _impl_take_row(self, source: Any, row: int) -> None:
        """Self is empty: hold an independent compact copy of ``source``'s row."""
        raise NotImplementedError

    def _impl_forget(self, counts: Sequence[int]) -> None:
        """Row ``b`` forgets its newest ``counts[b]`` tokens (rows stay right-justified)."""
        raise NotImplementedError

    def _impl_drop_exact(self) -> None:
        """No row reads exact any more: free the exact latent."""
        raise NotImplementedError

    def _impl_nbytes(self) -> int:
        raise NotImplementedError

    def _impl_mask(self, n: int, window_size: int | None) -> Any:
        """The layout mask ``[B, 1, n, width + n]`` (contract §3)."""
        raise NotImplementedError

    def _impl_offsets(self) -> Any:
        """``row_offsets`` as the implementation's int32 array."""
        raise NotImplementedError

    # -- identity -------------------------------------------------------------------------
    def signature(self) -> str:
        return f"kv:mla:{self.latent_spec.signature_role}"

    @property
    def batch_size(self) -> int:
        return len(self._offsets)

    @property
    def row_offsets(self) -> tuple[int, ...]:
        return tuple(self._offsets)

    @property
    def width(self) -> int:
        return max(self._offsets, default=0)

    @property
    def left_pad(self) -> tuple[int, ...]:
        width = self.width
        return tuple(width - o for o in self._offsets)

    @property
    def offset(self) -> Any:
        return self._impl_offsets()

    @property
    def converted(self) -> tuple[bool, ...]:
        return self._conversion.converted

    def _fresh_record(self, converted_at: Sequence[int | None] = ()) -> Conversion:
        """A conversion record of this cache's codec and ``start`` holding ``converted_at``."""
        return self.conversion_class(self.latent_codec, self.start, converted_at)

    @property
    def dtype(self) -> str | None:
        return self._dtype

    @property
    def kv_lora_rank(self) -> int | None:
        return None if self._widths is None else self._widths[0]

    @property
    def rope_head_dim(self) -> int | None:
        return None if self._widths is None else self._widths[1]

    @property
    def index_head_dim(self) -> int | None:
        return self.latent_spec.index_head_dim

    @property
    def max_tokens(self) -> float:
        cap = self._token_geometry.cap()
        return math.inf if cap is None else cap

    @property
    def nbytes(self) -> int:
        return self._impl_nbytes()

    @property
    def state_needs_dispose(self) -> bool:
        return False

    def held_arrays(self) -> tuple[Any, ...]:
        """Every array the cache holds (what a lease or an evaluation touches)."""
        return self._impl_held()

    def _impl_held(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def plane_specs(self) -> tuple[PlaneSpec, ...]:
        shapes = self._shapes
        return () if shapes is None else self.latent_spec.tensor_planes(shapes)

    def bytes_per_token(self) -> int:
        """Bytes one token of one row takes (0 until the widths and dtype are known)."""
        shapes = self._shapes
        return 0 if shapes is None else self.latent_spec.token_bytes(shapes)

    def projected_bytes(self, tokens: int) -> int:
        """Bytes one row of ``tokens`` positions takes (capped at ``max_tokens``)."""
        count = as_count(tokens, "tokens")
        return min(count, int(min(self.max_tokens, count))) * self.bytes_per_token()

    def make_empty_batch(self: _L) -> _L:
        return self._sibling()

    def _sibling(self: _L) -> _L:
        """An empty cache of the same declaration (and codec), widths and dtype learned."""
        other = self._new_empty()
        other._widths, other._dtype = self._widths, self._dtype
        return other

    def _new_empty(self: _L) -> _L:
        return type(self)(*self._declaration())

    def is_trimmable(self) -> bool:
        return True

    def __len__(self) -> int:
        return self.width

    def __bool__(self) -> bool:
        return True  # mlx-lm tests a cache for presence with ``if cache``

    # -- appends --------------------------------------------------------------------------
    def _checked_blocks(
        self, latent: Any, rope: Any, index: Any | None, *, staged: bool = False
    ) -> tuple[Any, Any, Any | None, bool, str, int, int]:
        """The blocks checked against the cache (``staged``: the index block comes later,
        see ``LatentCacheList``)."""
        name = type(self).__name__
        blocks = [("latent", latent), ("rope", rope)]
        if index is not None:
            blocks.append(("index", index))
        if (index is not None) != self.latent_spec.dsa and not staged:
            raise InvalidInputError(
                f"{name}: an index block is required exactly when the cache is declared with "
                f"index_head_dim (declared: {self.latent_spec.index_head_dim}, "
                f"got {'an index block' if index is not None else 'none'})"
            )
        shapes: list[tuple[int, ...]] = []
        dtypes: list[str] = []
        for what, block in blocks:
            shape, dtype = self._impl_shape_dtype(block, what)
            if len(shape) not in (3, 4) or (len(shape) == 4 and shape[1] != 1):
                raise InvalidInputError(
                    f"{name}: {what} must be [B, N, W] or [B, 1, N, W], got shape {shape}"
                )
            shapes.append(shape if len(shape) == 4 else (shape[0], 1, shape[1], shape[2]))
            dtypes.append(dtype)
        ranks = {len(self._impl_shape_dtype(b, w)[0]) for w, b in blocks}
        if len(ranks) != 1:
            raise InvalidInputError(f"{name}: latent, rope and index blocks must share one rank")
        four = ranks == {4}
        if len({(s[0], s[2]) for s in shapes}) != 1:
            raise InvalidInputError(
                f"{name}: every block must have the same rows and tokens, got shapes "
                f"{[s for s in shapes]}"
            )
        rows, n = shapes[0][0], shapes[0][2]
        if n < 1 or rows < 1:
            raise InvalidInputError(f"{name}: a block needs at least one row and one token")
        held = self.batch_size if self._offsets else None
        learned = self.latent_spec.check_blocks(
            name, list(zip((w for w, _ in blocks), shapes, dtypes, strict=True)), held, self._shapes
        )
        dtype = learned.dtype
        if self.width + n > self.max_tokens:
            raise CapacityError(
                f"{name}: {n} more tokens exceed max_tokens = {self._token_geometry.max_tokens} "
                f"(the longest row holds {self.width})"
            )
        return latent, rope, index, four, dtype, rows, n

    def append(self, latent: Any, rope: Any, index: Any | None = None) -> tuple[Any, Any, Any]:
        """Append one block to every row (the seed's ``appendAndFetch``); returns
        ``(latent, rope, index | None)`` over every column, in the blocks' rank."""
        return self._spec_append(lambda: self._append(latent, rope, index))

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """mlx-lm's call: ``keys`` the latent block, ``values`` the rope block (no DSA)."""
        if self.latent_spec.dsa:
            raise InvalidInputError(
                f"{type(self).__name__}: a DSA cache appends through append(latent, rope, "
                "index) (its index plane must move with the latent)"
            )
        latent, rope, _ = self.append(keys, values)
        return latent, rope

    def _append(self, latent: Any, rope: Any, index: Any | None) -> tuple[Any, Any, Any]:
        latent, rope, index, four, dtype, rows, n = self._checked_blocks(latent, rope, index)
        if not four:
            latent, rope = self._impl_as4(latent), self._impl_as4(rope)
            index = None if index is None else self._impl_as4(index)
        if not self._offsets:
            self._offsets = [0] * rows
            self._conversion.join([None] * rows)
        self._widths = (int(_shape(latent)[3]), int(_shape(rope)[3]))
        self._dtype = dtype
        reads_exact = [not c for c in self.converted]
        self._impl_append(latent, rope, index, any(reads_exact))
        self._offsets = [o + n for o in self._offsets]
        fetched = self._impl_read(reads_exact)
        # Due rows read encoded from the next append on (this one read them exact).
        self._conversion.mark(self._conversion.due(self._offsets), self._offsets)
        if self._conversion.phase == "packed":
            self._impl_drop_exact()
        self._last = fetched
        return fetched if four else self._three(fetched)

    def _three(self, fetched: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
        latent, rope, index = fetched
        return (
            self._impl_as3(latent),
            self._impl_as3(rope),
            None if index is None else self._impl_as3(index),
        )

    def fetch(self) -> tuple[Any, Any]:
        """The latent and rope planes the last read returned (``[B, 1, width, ·]``)."""
        latent, rope, _ = self._fetch_all()
        return latent, rope

    def fetch_index(self) -> Any:
        """The index plane the last read returned (DSA caches)."""
        if not self.latent_spec.dsa:
            raise InvalidInputError(f"{type(self).__name__} has no DSA index plane")
        return self._fetch_all()[2]

    def current(self) -> tuple[Any, Any, Any]:
        """What a read of the stored tokens returns now (``[B, 1, width, ·]`` latent,
        rope, index or ``None``): each row's latent exact until it converted, then decoded.
        The append that converts a row still read it exact (``fetch`` keeps that read)."""
        self._spec_usable()
        if self.width == 0:
            raise LayoutStateError(NOTHING_TO_FETCH)
        return self._impl_read([not c for c in self.converted])

    def _fetch_all(self) -> tuple[Any, Any, Any]:
        self._spec_usable()
        if self._last is None:
            if self.width == 0:
                raise LayoutStateError(NOTHING_TO_FETCH)
            self._last = self._impl_read([not c for c in self.converted])
        return self._last

    # -- masks ----------------------------------------------------------------------------
    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Any:
        self._spec_usable()
        n = as_count(n, "n", minimum=1)
        if window_size is not None:
            window_size = as_count(window_size, "window_size", minimum=1)
        padded = any(self.left_pad)
        if not padded and not return_array and window_size is None:
            return None if n == 1 else "causal"
        return self._impl_mask(n, window_size)

    # -- trims and rounds -----------------------------------------------------------------
    def trim(self, n: int) -> int:
        self._spec_guard("trim (use spec_round_rollback)")
        count = as_count(n, "n")
        shortest = min(self._offsets, default=0)
        if count > shortest:
            raise NotTrimmableError(
                f"{type(self).__name__}: cannot trim {count} tokens: the shortest row holds "
                f"{shortest}"
            )
        if count:
            self._forget([count] * self.batch_size)
        return count

    def trim_rows(self, counts: Sequence[int]) -> int:
        """Row ``b`` forgets its newest ``counts[b]`` tokens (rows stay right-justified)."""
        self._spec_guard("trim_rows (use spec_round_rollback)")
        if isinstance(counts, str | bytes) or not isinstance(counts, Sequence):
            raise InvalidInputError(f"counts must be one integer per row, got {counts!r}")
        if len(counts) != self.batch_size:
            raise InvalidInputError(
                f"counts needs {self.batch_size} integers (one per row), got {len(counts)}"
            )
        checked = [as_count(c, f"counts[{b}]") for b, c in enumerate(counts)]
        for b, (count, held) in enumerate(zip(checked, self._offsets, strict=True)):
            if count > held:
                raise NotTrimmableError(f"row {b} holds {held} tokens, cannot trim {count}")
        if any(checked):
            self._forget(checked)
        return max(checked, default=0)

    def _spec_forget(self, counts: Sequence[int]) -> None:
        self._forget(counts)

    def _forget(self, counts: Sequence[int]) -> None:
        self._impl_forget(counts)
        self._offsets = [o - c for o, c in zip(self._offsets, counts, strict=True)]
        self._last = None

    # -- row operations -------------------------------------------------------------------
    def merge_rows(self, rows: Sequence[Any]) -> None:
        """Take the rows of ``rows`` (borrowed, unchanged): the destination must be empty."""
        self._spec_guard("merge_rows")
        name = type(self).__name__
        if isinstance(rows, str | bytes) or not isinstance(rows, Sequence) or not rows:
            raise InvalidInputError(f"{name}.merge_rows needs a non-empty sequence of caches")
        if any(s is self for s in rows) or len({id(s) for s in rows}) != len(rows):
            raise IncompatibleRowsError(self_merge_message(self.signature()))
        if self._offsets:
            raise LayoutStateError(
                f"{name}.merge_rows: the destination must be empty (it holds "
                f"{self.batch_size} rows); merge into make_empty_batch()"
            )
        sources = list(rows)
        for source in sources:
            if type(source) is not type(self) or source._merge_key() != self._merge_key():
                key = getattr(source, "_merge_key", None)
                raise IncompatibleRowsError(
                    f"{name}.merge_rows takes {name}s declared as this one "
                    f"({self._merge_key()}), got {type(source).__module__}."
                    f"{type(source).__name__}" + (f" ({key()})" if callable(key) else "")
                )
            source._spec_guard("merging this cache's rows into another")
        # Every source is of this class from here on.
        widths = {s._widths for s in sources if s._widths}
        dtypes = {s._dtype for s in sources if s._dtype}
        if self._widths:
            widths.add(self._widths)
        if self._dtype:
            dtypes.add(self._dtype)
        if len(widths) > 1 or len(dtypes) > 1:
            raise IncompatibleRowsError(
                f"{name}.merge_rows: rows of different widths or dtypes "
                f"({sorted(widths)}, {sorted(dtypes)})"
            )
        if max((s.width for s in sources), default=0) > self.max_tokens:
            raise CapacityError(f"{name}.merge_rows: a row exceeds max_tokens")
        self._impl_merge(sources)
        self._widths = next(iter(widths), None)
        self._dtype = next(iter(dtypes), None)
        self._offsets = [o for s in sources for o in (s._offsets or [0])]
        self._conversion = self._fresh_record(
            [c for s in sources for c in (s._conversion.converted_at or (None,))]
        )
        self._last = None

    def _merge_key(self) -> tuple[object, ...]:
        spec = self.latent_spec
        return (
            spec.index_head_dim, spec.role, self._token_geometry.max_tokens, spec.inner, self.start,
        )  # fmt: skip

    def filter_rows(self, keep: Sequence[int]) -> None:
        """Keep the rows ``keep`` names (any order, non-empty); drop the common padding."""
        self._spec_guard("filter_rows")
        rows = check_keep(keep, self.batch_size)
        if not rows:
            raise InvalidInputError(f"{type(self).__name__}.filter_rows needs at least one row")
        self._impl_filter(rows)
        self._offsets = [self._offsets[r] for r in rows]
        self._conversion.keep(rows)
        if self._conversion.phase == "packed":
            self._impl_drop_exact()
        self._last = None

    def extract_row(self: _L, row: int) -> _L:
        """An independent compact cache holding row ``row``."""
        self._spec_guard("extract_row")
        index = check_row(row, self.batch_size)
        other = self._sibling()
        if self._offsets[index] == 0:
            return other  # an empty row extracts into an empty cache (the seed's rule)
        other._impl_take_row(self, index)
        other._offsets = [self._offsets[index]]
        other._conversion = self._conversion.extract(index)
        if other._conversion.phase == "packed":
            other._impl_drop_exact()
        return other

    def can_publish_row(self, row: int, tokens: int) -> bool:
        self._spec_usable()
        index = check_row(row, self.batch_size)
        return self._offsets[index] == as_count(tokens, "tokens") and not self.spec_round_open

    def check_valid(self) -> None:
        assert len(self._offsets) == self._conversion.batch_size
        assert all(o >= 0 for o in self._offsets)
        assert not self._offsets or min(self.left_pad) == 0
        assert self.width <= self.max_tokens

    # -- saved state (``kvrows.forms.LATENT_FIELDS``) -----------------------------------
    @property
    def codec_spec(self) -> LatentCodec:
        return self.latent_codec

    @property
    def token_geometry(self) -> Growing:
        """The latent token axis grows (no window) up to ``max_tokens``; a persistence
        record reads it."""
        return self._token_geometry

    @property
    def geometry(self) -> None:
        """No KV head geometry: the widths are in the state (``kv_lora_rank`` …)."""
        return None

    @property
    def state(self) -> tuple[Any, ...]:
        """``LATENT_FIELDS``: the planes right-justified ``[B, 1, width, ·]`` (the latent as
        its codec planes; ``index`` / ``exact`` ``None`` when absent), the rows, the
        declaration and the codec."""
        self._spec_guard("saving state")
        planes, rope, index, exact = self._impl_state_planes()
        spec = self.latent_spec
        tail = spec.inner.tail()
        rank, rope_width = self._widths or (spec.kv_lora_rank, spec.rope_head_dim)
        return (
            planes, rope, index, exact,
            self._impl_int_array(self._offsets), self._impl_int_array(
                [int(c) for c in self.converted]),
            rank, rope_width, spec.index_head_dim, self._token_geometry.max_tokens,
            0 if spec.role == "target" else 1,
            *(tail.get(name) for name in _CODEC_FIELDS),
            self.start,
        )  # fmt: skip

    @state.setter
    def state(self, value: Any) -> None:
        self._spec_guard("restoring state")
        restored = type(self).from_state(value)
        if restored.signature() != self.signature():
            raise InvalidInputError(
                state_signature_message(type(self).__name__, restored.signature(), self.signature())
            )
        vars(self).update(vars(restored))

    @classmethod
    def from_state(
        cls: type[_L], state: Any, meta_state: Any = None, *, keep: Any = None,
        geometry: Any = None,
    ) -> _L:  # fmt: skip
        """A cache holding ``state`` (``InvalidInputError`` when it is inconsistent)."""
        name = cls.__name__
        if isinstance(state, str | bytes) or not isinstance(state, Sequence):
            raise InvalidInputError(from_state_tuple_message(name))
        if len(state) != len(LATENT_FIELDS):
            raise InvalidInputError(
                f"{name}: a latent state has {len(LATENT_FIELDS)} fields, got {len(state)}"
            )
        fields = dict(zip(LATENT_FIELDS, state, strict=True))
        role = {0: "target", 1: "mtp"}.get(_scalar(fields["role"], "role"))
        if role is None:
            raise InvalidInputError(latent_role_message(name))
        cache = cls._from_fields(fields, role)
        cache._restore_fields(fields)
        return cache

    @classmethod
    def _from_fields(cls: type[_L], fields: dict[str, Any], role: str) -> _L:
        def optional(key: str) -> int | None:
            value = fields[key]
            return None if value is None else _scalar(value, key)

        cache = cls(
            optional("kv_lora_rank"), optional("rope_head_dim"), optional("index_head_dim"),
            optional("max_tokens"), role,
        )  # fmt: skip
        codec = _state_codec(
            optional("bits"), optional("group_size"), optional("k_bits"), optional("v_bits")
        )
        start = _scalar(fields["start"], "start")
        if codec != cache.latent_codec or (start != cache.start and codec != Plain()):
            cache._set_codec(codec, start)
            cache._conversion = cache._fresh_record()
        return cache

    def _set_codec(self, codec: LatentCodec, start: int) -> None:
        raise InvalidInputError(
            f"{type(self).__name__} stores the plain latent; the state is {codec.key}"
        )

    def _restore_fields(self, fields: dict[str, Any]) -> None:
        name = type(self).__name__
        offsets = [int(v) for v in self._impl_ints(fields["offset"], "offset")]
        converted = [int(v) for v in self._impl_ints(fields["converted"], "converted")]
        if len(converted) != len(offsets) or any(c not in (0, 1) for c in converted):
            raise InvalidInputError(f"{name}: converted must hold one 0/1 flag per row")
        if any(o < 0 for o in offsets) or (not self.latent_codec.encodes and any(converted)):
            raise InvalidInputError(f"{name}: negative offsets or converted plain rows")
        width = max(offsets, default=0)
        if width > self.max_tokens:
            raise InvalidInputError(f"{name}: rows past max_tokens")
        self._offsets = offsets
        # A saved row records whether it converted, not where: its offset is the bound.
        self._conversion = self._fresh_record(
            [
                self._conversion.point(o) if c else None
                for o, c in zip(offsets, converted, strict=True)
            ]
        )
        if width == 0:
            return
        widths = (self.latent_spec.kv_lora_rank, self.latent_spec.rope_head_dim)
        if widths[0] is None or widths[1] is None:
            raise InvalidInputError(f"{name}: a state with tokens must record its widths")
        self._widths = (widths[0], widths[1])
        planes = fields["latent"]
        if isinstance(planes, str | bytes) or not isinstance(planes, Sequence):
            raise InvalidInputError(f"{name}: latent must be the codec's planes")
        exact = fields["exact"]
        needs_exact = self.latent_codec.encodes and not all(self.converted)
        if (exact is not None) != needs_exact:
            raise InvalidInputError(
                f"{name}: the exact latent is held exactly while some row reads exact"
            )
        self._dtype = self._impl_restore(
            tuple(planes), fields["rope"], fields["index"], exact, len(offsets), width
        )

    # state hooks (each implementation)
    def _impl_state_planes(self) -> tuple[Any, Any, Any, Any]:
        raise NotImplementedError

    def _impl_int_array(self, values: Sequence[int]) -> Any:
        raise NotImplementedError

    def _impl_ints(self, value: Any, what: str) -> list[int]:
        raise NotImplementedError

    def _impl_restore(
        self, planes: tuple[Any, ...], rope: Any, index: Any, exact: Any, rows: int, width: int
    ) -> str:
        """Check and adopt right-justified planes of ``rows`` x ``width``; return the dtype."""
        raise NotImplementedError

    def _check_restored(
        self, shapes: Sequence[tuple[str, tuple[int, ...], str]], rows: int, width: int
    ) -> str:
        """Shared shape/dtype checks of restored planes against the plane specs."""
        name = type(self).__name__
        dtype = next((d for n, _, d in shapes if n == "rope"), "")
        if dtype not in FLOAT_DTYPES:
            raise InvalidInputError(f"{name}: rope must be a float plane, got {dtype}")
        assert self._widths is not None
        shapes_of = LatentShapes(*self._widths, self.latent_spec.index_head_dim, dtype)
        specs = {p.name: p for p in self.latent_spec.tensor_planes(shapes_of)}
        specs["exact"] = PlaneSpec("exact", 2, dtype, self._widths[0])
        seen = [n for n, _, _ in shapes]
        expected = [n for n in specs if n != "exact"] + (["exact"] if "exact" in seen else [])
        if sorted(seen) != sorted(expected):
            raise InvalidInputError(f"{name}: planes {seen}, expected {expected}")
        for plane, shape, plane_dtype in shapes:
            spec = specs[plane]
            if shape != (rows, 1, width, spec.width) or plane_dtype != spec.dtype:
                raise InvalidInputError(
                    f"{name}: plane {plane} is {shape} {plane_dtype}, expected "
                    f"{(rows, 1, width, spec.width)} {spec.dtype}"
                )
        return dtype

    def lend_rows(self) -> None:
        self._spec_guard("merging this cache's rows into another")

    @staticmethod
    def count(value: object, name: str) -> int:
        return operator.index(as_count(value, name))


class EncodedLatentRows(LatentRows):
    """``EncodedLatentCache``'s declaration over either implementation's hooks: the
    latent through an encoding codec (``codec=`` or affine ``bits`` / ``group_size``),
    bf16-first from ``start``."""

    def __init__(
        self,
        kv_lora_rank: object = None,
        rope_head_dim: object = None,
        index_head_dim: object = None,
        max_tokens: object = None,
        role: object = "target",
        *,
        codec: LatentCodec | None = None,
        bits: int | None = None,
        group_size: int | None = None,
        start: int = 0,
    ) -> None:
        inner, first = encoded_codec(type(self).__name__, codec, bits, group_size, start)
        self._setup(inner, first, kv_lora_rank, rope_head_dim, index_head_dim, max_tokens, role)

    def _new_empty(self: _E) -> _E:
        return type(self)(*self._declaration(), codec=self.latent_codec, start=self.start)

    def signature(self) -> str:
        spec = self.latent_spec
        return f"kv:mla-encoded:{spec.signature_role}:{spec.inner.key}:{self.start}"

    def _set_codec(self, codec: LatentCodec, start: int) -> None:
        if not codec.encodes:
            raise InvalidInputError(plain_latent_state_message(type(self).__name__))
        inner, self.start = encoded_codec(type(self).__name__, codec, None, None, start)
        self.latent_spec = replace(self.latent_spec, inner=inner)


#: The codec fields of ``LATENT_FIELDS``: each KV codec's state tail (``None``: unused).
_CODEC_FIELDS = ("bits", "group_size", "k_bits", "v_bits")


def _scalar(value: object, what: str) -> int:
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(not_an_integer_message(f"state field {what}", value))
    return value


def _state_codec(
    bits: int | None, group_size: int | None, k_bits: int | None, v_bits: int | None
) -> LatentCodec:
    """The latent codec the saved fields name: the KV codec whose state tail they fill."""
    values = dict(zip(_CODEC_FIELDS, (bits, group_size, k_bits, v_bits), strict=True))
    given = {name for name, value in values.items() if value is not None}
    for codec in kv_codecs().values():
        if set(codec.state_tail) == given:
            return codec.from_tail(values)
    raise InvalidInputError(
        f"state codec fields must be affine (bits, group_size) or turbo (k_bits, v_bits), got "
        f"{(bits, group_size, k_bits, v_bits)}"
    )
