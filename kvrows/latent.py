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
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, TypeVar

from kvrows.affine_geometry import validate_codec
from kvrows.codec import (
    DTYPE_SIZES,
    CodecSpec,
    PlaneSpec,
    Role,
    check_turbo_dim,
    codec_plane_specs,
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
    self_merge_message,
    state_signature_message,
)
from kvrows.schemes import Affine, Growing, Plain, Turbo
from kvrows.speculative import SpeculativeRounds
from kvrows.validation import as_count, check_keep, check_row

__all__ = [
    "DEEPSEEK_V3_BF16_BYTES",
    "FLASHMLA_FP8_BYTES",
    "FLOAT_DTYPES",
    "LATENT_FIELDS",
    "PAGED_LATENT_FIELDS",
    "LatentCodec",
    "LatentOptions",
    "LatentRole",
    "LatentRows",
    "encoded_codec",
    "latent_codec_key",
    "latent_plane_specs",
    "latent_token_bytes",
]

LatentRole: TypeAlias = Literal["target", "mtp"]
LatentCodec: TypeAlias = CodecSpec  # the latent plane takes any codec

#: DeepSeek-V3 caches 576 values (512 latent + 64 rope) per token per layer: 1,152 bytes in
#: bf16; FlashMLA's FP8 layout stores them in 656 (512 fp8 + 4 fp32 scales + 64 bf16).
DEEPSEEK_V3_BF16_BYTES = 1152
FLASHMLA_FP8_BYTES = 656

FLOAT_DTYPES = ("float16", "bfloat16", "float32")

_L = TypeVar("_L", bound="LatentRows")


def _optional_width(value: object, name: str) -> int | None:
    return None if value is None else as_count(value, name, minimum=1)


@dataclass(frozen=True)
class LatentOptions:
    """What a latent cache is declared with: widths (``None``: learned from the first
    append), the DSA index width (``None``: no index plane), the context bound and the
    role (an MTP cache has no DSA)."""

    kv_lora_rank: int | None = None
    rope_head_dim: int | None = None
    index_head_dim: int | None = None
    max_tokens: int | None = None
    role: LatentRole = "target"

    @staticmethod
    def checked(
        owner: str,
        kv_lora_rank: object = None,
        rope_head_dim: object = None,
        index_head_dim: object = None,
        max_tokens: object = None,
        role: object = "target",
    ) -> LatentOptions:
        try:
            if role not in ("target", "mtp"):
                raise InvalidInputError(f"role must be 'target' or 'mtp', got {role!r}")
            options = LatentOptions(
                _optional_width(kv_lora_rank, "kv_lora_rank"),
                _optional_width(rope_head_dim, "rope_head_dim"),
                _optional_width(index_head_dim, "index_head_dim"),
                _optional_width(max_tokens, "max_tokens"),
                "target" if role == "target" else "mtp",
            )
            if options.role == "mtp" and options.index_head_dim is not None:
                raise InvalidInputError("an MTP latent cache has no DSA index plane")
        except InvalidInputError as error:
            raise InvalidInputError(f"{owner}: {error}") from None
        return options

    @property
    def dsa(self) -> bool:
        return self.index_head_dim is not None

    @property
    def signature_role(self) -> str:
        return f"{self.role}:dsa" if self.dsa else self.role


def latent_codec_key(codec: LatentCodec) -> str:
    """The codec part of an encoded signature (TurboQuant: only ``v_bits`` applies)."""
    return codec.key


def encoded_codec(
    owner: str, codec: object, bits: object, group_size: object, start: object
) -> tuple[LatentCodec, int]:
    """An ``EncodedLatentCache``'s codec and bf16-first start from its arguments: a codec
    spec (``Affine`` or ``Turbo``) or ``bits`` / ``group_size`` (affine; defaults 8 and 64)."""
    try:
        if codec is not None:
            if bits is not None or group_size is not None:
                raise InvalidInputError("give a codec or bits/group_size, not both")
            if not isinstance(codec, Affine | Turbo):
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
    if isinstance(codec, Affine):
        validate_codec(rank, codec.group_size, codec.bits)
    elif isinstance(codec, Turbo):
        check_turbo_dim(rank)


def latent_plane_specs(
    codec: LatentCodec, rank: int, rope: int, index: int | None, dtype: str
) -> tuple[PlaneSpec, ...]:
    """The planes a latent cache holds (token axis 2), the warm-up exact plane excluded."""
    role: Role = "values" if isinstance(codec, Turbo) else "keys"
    planes = (
        *codec_plane_specs(codec, "latent", rank, dtype, role),
        PlaneSpec("rope", 2, dtype, rope),
    )
    return planes if index is None else (*planes, PlaneSpec("index", 2, dtype, index))


def latent_token_bytes(
    codec: LatentCodec, rank: int, rope: int, index: int | None, dtype: str
) -> int:
    """Bytes one token of one row takes (the warm-up exact plane excluded)."""
    return sum(
        DTYPE_SIZES[p.dtype] * p.width for p in latent_plane_specs(codec, rank, rope, index, dtype)
    )


def _shape(array: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in array.shape)


class LatentRows(SpeculativeRounds):
    """Latent rows: the shared control flow over each implementation's array hooks.

    Host state: ``_offsets`` (one per row), ``_conversion`` (the bf16-first record,
    ``kvrows.conversion.Conversion``: a converted row reads its latent decoded; no row
    converts under the plain codec), the learned widths and dtype. The arrays
    live in the implementation.
    """

    #: The codec of the latent plane (``Plain()`` for ``MLACache``).
    latent_codec: LatentCodec = Plain()
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
        self.options = LatentOptions.checked(
            type(self).__name__, kv_lora_rank, rope_head_dim, index_head_dim, max_tokens, role
        )
        self._offsets: list[int] = []
        self._conversion = self._fresh_record()
        self._dtype: str | None = None
        self._widths: tuple[int, int] | None = None
        if self.options.kv_lora_rank is not None and self.options.rope_head_dim is not None:
            self._widths = (self.options.kv_lora_rank, self.options.rope_head_dim)
        self._last: tuple[Any, Any, Any] | None = None
        self._impl_init()

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
        return f"kv:mla:{self.options.signature_role}"

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
        return self.options.index_head_dim

    @property
    def max_tokens(self) -> float:
        return math.inf if self.options.max_tokens is None else self.options.max_tokens

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
        if self._widths is None or self._dtype is None:
            return ()
        return latent_plane_specs(
            self.latent_codec, *self._widths, self.options.index_head_dim, self._dtype
        )

    def bytes_per_token(self) -> int:
        """Bytes one token of one row takes (0 until the widths and dtype are known)."""
        if self._widths is None or self._dtype is None:
            return 0
        return latent_token_bytes(
            self.latent_codec, *self._widths, self.options.index_head_dim, self._dtype
        )

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
        o = self.options
        return type(self)(o.kv_lora_rank, o.rope_head_dim, o.index_head_dim, o.max_tokens, o.role)

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
        if (index is not None) != self.options.dsa and not staged:
            raise InvalidInputError(
                f"{name}: an index block is required exactly when the cache is declared with "
                f"index_head_dim (declared: {self.options.index_head_dim}, "
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
        if len(set(dtypes)) != 1 or dtypes[0] not in FLOAT_DTYPES:
            raise InvalidInputError(
                f"{name}: every block must have one float dtype of {FLOAT_DTYPES}, got {dtypes}"
            )
        dtype = dtypes[0]
        if self._dtype is not None and dtype != self._dtype:
            raise InvalidInputError(f"{name}: this cache stores {self._dtype}, got {dtype}")
        rank, rope_width = shapes[0][3], shapes[1][3]
        declared = self._widths or (
            self.options.kv_lora_rank or rank,
            self.options.rope_head_dim or rope_width,
        )
        if (rank, rope_width) != declared:
            raise InvalidInputError(
                f"{name}: latent and rope widths must be {declared}, got {(rank, rope_width)}"
            )
        if index is not None and shapes[2][3] != self.options.index_head_dim:
            raise InvalidInputError(
                f"{name}: index width must be {self.options.index_head_dim}, got {shapes[2][3]}"
            )
        if self._offsets and rows != self.batch_size:
            raise InvalidInputError(
                f"{name}: the cache holds {self.batch_size} rows, the block has {rows}"
            )
        try:
            check_latent_codec(self.latent_codec, rank)
        except InvalidInputError as error:
            raise InvalidInputError(f"{name}: kv_lora_rank {rank}: {error}") from None
        if self.width + n > self.max_tokens:
            raise CapacityError(
                f"{name}: {n} more tokens exceed max_tokens = {self.options.max_tokens} "
                f"(the longest row holds {self.width})"
            )
        return latent, rope, index, four, dtype, rows, n

    def append(self, latent: Any, rope: Any, index: Any | None = None) -> tuple[Any, Any, Any]:
        """Append one block to every row (the seed's ``appendAndFetch``); returns
        ``(latent, rope, index | None)`` over every column, in the blocks' rank."""
        return self._spec_append(lambda: self._append(latent, rope, index))

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """mlx-lm's call: ``keys`` the latent block, ``values`` the rope block (no DSA)."""
        if self.options.dsa:
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
        if not self.options.dsa:
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
        widths = {s._widths for s in sources if isinstance(s, LatentRows) and s._widths}
        dtypes = {s._dtype for s in sources if isinstance(s, LatentRows) and s._dtype}
        for source in sources:
            if type(source) is not type(self) or source._merge_key() != self._merge_key():
                raise IncompatibleRowsError(
                    f"{name}.merge_rows takes {name}s declared as this one "
                    f"({self._merge_key()}), got {type(source).__module__}."
                    f"{type(source).__name__}"
                    + (f" ({source._merge_key()})" if isinstance(source, LatentRows) else "")
                )
            source._spec_guard("merging this cache's rows into another")
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
        o = self.options
        return (o.index_head_dim, o.role, o.max_tokens, self.latent_codec, self.start)

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
        """The latent token axis grows (no window); a persistence record reads it."""
        return Growing()

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
        codec = self.latent_codec
        o = self.options
        rank, rope_width = self._widths or (o.kv_lora_rank, o.rope_head_dim)
        return (
            planes, rope, index, exact,
            self._impl_int_array(self._offsets), self._impl_int_array(
                [int(c) for c in self.converted]),
            rank, rope_width, o.index_head_dim, o.max_tokens, 0 if o.role == "target" else 1,
            codec.bits if isinstance(codec, Affine) else None,
            codec.group_size if isinstance(codec, Affine) else None,
            codec.k_bits if isinstance(codec, Turbo) else None,
            codec.v_bits if isinstance(codec, Turbo) else None,
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
        widths = (self.options.kv_lora_rank, self.options.rope_head_dim)
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
        specs = {
            p.name: p
            for p in latent_plane_specs(
                self.latent_codec, *self._widths, self.options.index_head_dim, dtype
            )
        }
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


#: A latent cache's saved state, in order (``spec/persistence.md``): planes, rows, the
#: declaration, the codec.
LATENT_FIELDS = (
    "latent", "rope", "index", "exact", "offset", "converted",
    "kv_lora_rank", "rope_head_dim", "index_head_dim", "max_tokens", "role",
    "bits", "group_size", "k_bits", "v_bits", "start",
)  # fmt: skip


#: ``PagedLatentCache``'s saved state: the latent fields, then its block size.
PAGED_LATENT_FIELDS = (*LATENT_FIELDS, "block_size")


def _scalar(value: object, what: str) -> int:
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(not_an_integer_message(f"state field {what}", value))
    return value


def _state_codec(
    bits: int | None, group_size: int | None, k_bits: int | None, v_bits: int | None
) -> LatentCodec:
    if bits is not None and group_size is not None and k_bits is None and v_bits is None:
        return Affine(bits=bits, group_size=group_size)
    if k_bits is not None and v_bits is not None and bits is None and group_size is None:
        return Turbo(k_bits=k_bits, v_bits=v_bits)
    if bits is None and group_size is None and k_bits is None and v_bits is None:
        return Plain()
    raise InvalidInputError(
        f"state codec fields must be affine (bits, group_size) or turbo (k_bits, v_bits), got "
        f"{(bits, group_size, k_bits, v_bits)}"
    )
