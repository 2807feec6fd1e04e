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
batch buffers rolled in place). It serves ``EncodedLatentCache`` and ``PagedLatentCache``
until they move onto the row machinery (``spec/machinery-migration.md`` §5).

:class:`LatentSurfaceMembers` is the array-free half of ``MLACache``'s surface on the row
machinery (each implementation's ``LatentSurface``); the block checks and the v1 state
form (``checked_blocks``, ``latent_state``, ``state_fields`` …) are functions both
kinds of latent cache call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias, TypeVar

from kvrows.codec import CodecSpec, PlaneSet, PlaneSpec
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
from kvrows.common import check_counts
from kvrows.conversion import Conversion
from kvrows.errors import (
    NOTHING_TO_FETCH,
    CapacityError,
    IncompatibleRowsError,
    InvalidInputError,
    LayoutStateError,
    NotTrimmableError,
    from_state_tuple_message,
    latent_planes_message,
    latent_role_message,
    not_an_integer_message,
    plain_latent_state_message,
    self_merge_message,
    state_signature_message,
)
from kvrows.schemes import Affine, GeometrySpec, Growing, Plain
from kvrows.speculative import SpeculativeRounds
from kvrows.validation import FLOAT_DTYPES, as_count, check_keep, check_row

__all__ = [
    "DEEPSEEK_V3_BF16_BYTES",
    "FLASHMLA_FP8_BYTES",
    "LATENT_FIELDS",
    "PAGED_LATENT_FIELDS",
    "EncodedLatentMembers",
    "LatentCodec",
    "LatentRole",
    "LatentRows",
    "LatentSurfaceMembers",
    "encoded_codec",
    "int_vector_message",
    "latent_spec",
    "latent_token_bytes",
]

LatentCodec: TypeAlias = CodecSpec  # the latent plane takes any codec

_L = TypeVar("_L", bound="LatentRows")


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


def int_vector_message(owner: str, what: str) -> str:
    """A saved latent state whose ``what`` is not a 1-D int array of the implementation."""
    return f"{owner}: {what} must be a 1-D int array"


def different_rows_message(owner: str, shapes: object) -> str:
    """A latent merge of rows of different widths or dtypes."""
    return f"{owner}.merge_rows: rows of different widths or dtypes ({shapes})"


def checked_blocks(
    cache: Any,
    blocks: tuple[Any, Any, Any | None],
    shape_dtype: Callable[[Any, str], tuple[tuple[int, ...], str]],
    known: LatentShapes | None,
    *,
    staged: bool = False,
) -> tuple[bool, LatentShapes, int, int]:
    """``(four, shapes, rows, n)`` of an append's ``(latent, rope, index)`` blocks, checked
    against ``cache`` (its declaration, rows, width and ``max_tokens``) and what it learnt
    (``known``); ``four``: the blocks are ``[B, 1, N, W]`` (else ``[B, N, W]``);
    ``staged``: the index block comes later (``LatentCacheList``). Raises
    ``InvalidInputError`` / ``CapacityError`` before anything changes."""
    name = type(cache).__name__
    spec: Latent = cache.latent_spec
    latent, rope, index = blocks
    named = [("latent", latent), ("rope", rope)]
    if index is not None:
        named.append(("index", index))
    if (index is not None) != spec.dsa and not staged:
        raise InvalidInputError(
            f"{name}: an index block is required exactly when the cache is declared with "
            f"index_head_dim (declared: {spec.index_head_dim}, "
            f"got {'an index block' if index is not None else 'none'})"
        )
    shapes: list[tuple[int, ...]] = []
    dtypes: list[str] = []
    ranks: set[int] = set()
    for what, block in named:
        try:
            shape, dtype = shape_dtype(block, what)
        except InvalidInputError as error:
            raise InvalidInputError(f"{name}: {what}: {error}") from None
        if len(shape) not in (3, 4) or (len(shape) == 4 and shape[1] != 1):
            raise InvalidInputError(
                f"{name}: {what} must be [B, N, W] or [B, 1, N, W], got shape {shape}"
            )
        ranks.add(len(shape))
        shapes.append(shape if len(shape) == 4 else (shape[0], 1, shape[1], shape[2]))
        dtypes.append(dtype)
    if len(ranks) != 1:
        raise InvalidInputError(f"{name}: latent, rope and index blocks must share one rank")
    if len({(s[0], s[2]) for s in shapes}) != 1:
        raise InvalidInputError(
            f"{name}: every block must have the same rows and tokens, got shapes {shapes}"
        )
    rows, n = shapes[0][0], shapes[0][2]
    if n < 1 or rows < 1:
        raise InvalidInputError(f"{name}: a block needs at least one row and one token")
    held = cache.batch_size or None
    learned = spec.check_blocks(
        name, list(zip((w for w, _ in named), shapes, dtypes, strict=True)), held, known
    )
    if cache.width + n > cache.max_tokens:
        raise CapacityError(
            f"{name}: {n} more tokens exceed max_tokens = {cache.token_geometry.max_tokens} "
            f"(the longest row holds {cache.width})"
        )
    return ranks == {4}, learned, rows, n


def latent_state(
    cache: Any,
    planes: Any,
    rope: Any,
    index: Any,
    exact: Any,
    offsets: Any,
    converted: Any,
    widths: tuple[int, int] | None,
) -> tuple[Any, ...]:
    """``cache``'s ``LATENT_FIELDS`` (form version 1): the planes right-justified ``[B, 1,
    width, ·]`` (the latent as its codec planes; ``None`` when absent), the rows
    (``offsets``, ``converted``: the implementation's int arrays), the declaration (the
    ``widths`` learnt, else declared) and the codec."""
    spec: Latent = cache.latent_spec
    tail = spec.inner.tail()
    rank, rope_width = widths or (spec.kv_lora_rank, spec.rope_head_dim)
    return (
        planes, rope, index, exact, offsets, converted,
        rank, rope_width, spec.index_head_dim, cache.token_geometry.max_tokens,
        0 if spec.role == "target" else 1,
        *(tail.get(name) for name in _CODEC_FIELDS),
        cache.start,
    )  # fmt: skip


def state_fields(name: str, state: Any) -> tuple[dict[str, Any], LatentRole]:
    """The ``LATENT_FIELDS`` of a saved ``state`` by name, and its role."""
    if isinstance(state, str | bytes) or not isinstance(state, Sequence):
        raise InvalidInputError(from_state_tuple_message(name))
    if len(state) != len(LATENT_FIELDS):
        raise InvalidInputError(
            f"{name}: a latent state has {len(LATENT_FIELDS)} fields, got {len(state)}"
        )
    fields = dict(zip(LATENT_FIELDS, state, strict=True))
    role: LatentRole | None = {0: "target", 1: "mtp"}.get(_scalar(fields["role"], "role"))  # type: ignore[assignment]
    if role is None:
        raise InvalidInputError(latent_role_message(name))
    return fields, role


def _optional(fields: dict[str, Any], key: str) -> int | None:
    value = fields[key]
    return None if value is None else _scalar(value, key)


def declared_fields(
    fields: dict[str, Any],
) -> tuple[int | None, int | None, int | None, int | None]:
    """The declaration a saved state records: widths and ``max_tokens``."""
    return (
        _optional(fields, "kv_lora_rank"), _optional(fields, "rope_head_dim"),
        _optional(fields, "index_head_dim"), _optional(fields, "max_tokens"),
    )  # fmt: skip


def codec_fields(fields: dict[str, Any]) -> tuple[LatentCodec, int]:
    """The latent codec and bf16-first ``start`` a saved state records."""
    codec = _state_codec(*(_optional(fields, name) for name in _CODEC_FIELDS))
    return codec, _scalar(fields["start"], "start")


def plain_state_message(owner: str, codec: CodecSpec) -> str:
    """A plain latent cache given the state of an encoded one."""
    return f"{owner} stores the plain latent; the state is {codec.key}"


def checked_rows(cache: Any, offsets: Sequence[int], converted: Sequence[int]) -> int:
    """The width of a saved state's rows (``offsets``, ``converted`` flags), checked
    against ``cache``'s codec and ``max_tokens``."""
    name = type(cache).__name__
    if len(converted) != len(offsets) or any(c not in (0, 1) for c in converted):
        raise InvalidInputError(f"{name}: converted must hold one 0/1 flag per row")
    if any(o < 0 for o in offsets) or (not cache.latent_codec.encodes and any(converted)):
        raise InvalidInputError(f"{name}: negative offsets or converted plain rows")
    width = max(offsets, default=0)
    if width > cache.max_tokens:
        raise InvalidInputError(f"{name}: rows past max_tokens")
    return width


def declared_widths(cache: Any) -> tuple[int, int]:
    """The latent and rope widths a state with tokens records (in ``cache``'s spec)."""
    spec: Latent = cache.latent_spec
    if spec.kv_lora_rank is None or spec.rope_head_dim is None:
        raise InvalidInputError(
            f"{type(cache).__name__}: a state with tokens must record its widths"
        )
    return spec.kv_lora_rank, spec.rope_head_dim


def restored_planes(
    cache: Any, fields: dict[str, Any], reads_exact: bool
) -> tuple[tuple[Any, ...], Any]:
    """A saved state's latent planes and exact latent (``reads_exact``: some row of an
    encoding cache still reads exact, so the state must hold it)."""
    name = type(cache).__name__
    planes = fields["latent"]
    if isinstance(planes, str | bytes) or not isinstance(planes, Sequence):
        raise InvalidInputError(f"{name}: latent must be the codec's planes")
    exact = fields["exact"]
    if (exact is not None) != (cache.latent_codec.encodes and reads_exact):
        raise InvalidInputError(
            f"{name}: the exact latent is held exactly while some row reads exact"
        )
    return tuple(planes), exact


def check_restored(
    cache: Any,
    shapes: Sequence[tuple[str, tuple[int, ...], str]],
    widths: tuple[int, int],
    rows: int,
    width: int,
) -> str:
    """The dtype of restored planes (``(plane, shape, dtype)``), each checked against
    ``cache``'s plane specs for ``rows`` x ``width`` right-justified columns."""
    name = type(cache).__name__
    spec: Latent = cache.latent_spec
    dtype = next((d for n, _, d in shapes if n == "rope"), "")
    if dtype not in FLOAT_DTYPES:
        raise InvalidInputError(f"{name}: rope must be a float plane, got {dtype}")
    shapes_of = LatentShapes(*widths, spec.index_head_dim, dtype)
    specs = {p.name: p for p in spec.tensor_planes(shapes_of)}
    specs["exact"] = PlaneSpec("exact", 2, dtype, widths[0])
    seen = [n for n, _, _ in shapes]
    expected = [n for n in specs if n != "exact"] + (["exact"] if "exact" in seen else [])
    if sorted(seen) != sorted(expected):
        raise InvalidInputError(f"{name}: planes {seen}, expected {expected}")
    for plane, shape, plane_dtype in shapes:
        plane_spec = specs[plane]
        if shape != (rows, 1, width, plane_spec.width) or plane_dtype != plane_spec.dtype:
            raise InvalidInputError(
                f"{name}: plane {plane} is {shape} {plane_dtype}, expected "
                f"{(rows, 1, width, plane_spec.width)} {plane_spec.dtype}"
            )
    return dtype


# The surface sits first among a row-machinery class's bases (``classes.build``): at run
# time it brings no base of its own ahead of the speculative layout and the machinery.
if TYPE_CHECKING:
    from kvrows.compositions import Composition

    class _LatentLayout(SpeculativeRounds):
        codec: Any
        composition: ClassVar[Composition]
        _geometry: Any
        _token_geometry: GeometrySpec

        @property
        def width(self) -> int: ...
        @property
        def batch_size(self) -> int: ...
        @property
        def row_offsets(self) -> tuple[int, ...]: ...
        def _read(self) -> dict[str, Any]: ...
        def _write_blocks(self, blocks: dict[str, Any], shapes: Any) -> None: ...
        def trim(self, n: int) -> int: ...
        def make_empty_batch(self) -> Any: ...
        def check_valid(self) -> None: ...
        def signature(self) -> str: ...
else:
    _LatentLayout = object


class LatentSurfaceMembers(_LatentLayout):
    """What a latent preset on a row machinery shows besides the machinery (the array-free
    half of each implementation's ``LatentSurface``, ``spec/MLACache.md``): the
    constructor (widths, ``max_tokens``, role), ``append(latent, rope, index)`` /
    ``fetch`` / ``fetch_index`` / ``current`` over the machinery's write and read (blocks
    ``[B, N, W]`` or ``[B, 1, N, W]``, returned in their rank), the learnt shapes
    (``LatentShapes``), the v1 ``LATENT_FIELDS`` state, and the rules ``LatentRows``
    kept: ``trim`` no further than the shortest row, ``trim_rows`` a rollback (rows roll
    right), publishing at a row's offset only. Merges (into an empty or a running cache)
    and filters are the machinery's.

    Each implementation supplies ``_dtype_of(array)``, ``_as4`` / ``_as3``, the state's
    arrays (``_state_planes``, ``_int_array``, ``_ints``, ``_adopt_state``) and, when they
    differ from the machinery's, ``held_arrays`` and ``planes``."""

    @property
    def start(self) -> int:
        """No bf16-first warm-up: the latent is stored plain."""
        return 0

    def __init__(
        self,
        kv_lora_rank: object = None,
        rope_head_dim: object = None,
        index_head_dim: object = None,
        max_tokens: object = None,
        role: object = "target",
        *,
        codec: object = None,
        token_geometry: object = None,
        geometry: object = None,
    ) -> None:
        name = type(self).__name__
        if codec is None:
            codec = latent_spec(
                name, Plain(), kv_lora_rank=kv_lora_rank, rope_head_dim=rope_head_dim,
                index_head_dim=index_head_dim, role=role,
            )  # fmt: skip
        if token_geometry is None:
            token_geometry = growing_geometry(name, max_tokens)
        super().__init__(codec=codec, token_geometry=token_geometry, geometry=geometry)  # type: ignore[call-arg]

    # -- what the cache is ----------------------------------------------------------------
    @property
    def latent_spec(self) -> Latent:
        spec: Latent = self.codec.spec
        return spec

    @property
    def latent_codec(self) -> LatentCodec:
        """The codec of the latent plane (``Plain()``)."""
        return self.latent_spec.inner

    def signature(self) -> str:
        return f"kv:mla:{self.latent_spec.signature_role}"

    @property
    def geometry(self) -> None:
        """No KV head geometry: the widths are the learnt ``LatentShapes``."""
        return None

    def _shapes(self) -> LatentShapes | None:
        shapes: LatentShapes | None = self._geometry
        return shapes

    def _take_shapes(self, shapes: Any) -> None:
        self._geometry = shapes

    def _joined_shapes(self, sources: Sequence[Any]) -> LatentShapes | None:
        """The shapes of rows joined from ``sources`` (one widths-and-dtype for all)."""
        known = {s for s in (self._shapes(), *(s._shapes() for s in sources)) if s is not None}
        if len(known) > 1:
            raise IncompatibleRowsError(different_rows_message(type(self).__name__, known))
        return next(iter(known), None)

    @property
    def role(self) -> LatentRole:
        return self.latent_spec.role

    @property
    def dtype(self) -> str | None:
        shapes = self._shapes()
        return None if shapes is None else shapes.dtype

    @property
    def kv_lora_rank(self) -> int | None:
        shapes = self._shapes()
        return self.latent_spec.kv_lora_rank if shapes is None else shapes.rank

    @property
    def rope_head_dim(self) -> int | None:
        shapes = self._shapes()
        return self.latent_spec.rope_head_dim if shapes is None else shapes.rope

    @property
    def index_head_dim(self) -> int | None:
        return self.latent_spec.index_head_dim

    @property
    def max_tokens(self) -> float:
        cap = self._token_geometry.cap()
        return math.inf if cap is None else cap

    @property
    def converted(self) -> tuple[bool, ...]:
        """No row converts: the latent is stored plain."""
        return (False,) * self.batch_size

    def plane_specs(self) -> tuple[PlaneSpec, ...]:
        shapes = self._shapes()
        return () if shapes is None else self.latent_spec.tensor_planes(shapes)

    def bytes_per_token(self) -> int:
        """Bytes one token of one row takes (0 until the widths and dtype are known)."""
        shapes = self._shapes()
        return 0 if shapes is None else self.latent_spec.token_bytes(shapes)

    def projected_bytes(self, tokens: int) -> int:
        """Bytes one row of ``tokens`` positions takes (capped at ``max_tokens``)."""
        count = as_count(tokens, "tokens")
        return min(count, int(min(self.max_tokens, count))) * self.bytes_per_token()

    def make_empty_batch(self) -> Any:
        """An empty cache of the same declaration, its shapes learnt."""
        other = super().make_empty_batch()
        other._take_shapes(self._shapes())
        return other

    def __len__(self) -> int:
        return self.width

    def __bool__(self) -> bool:
        return True  # mlx-lm tests a cache for presence with ``if cache``

    # -- appends and reads ----------------------------------------------------------------
    def _dtype_of(self, array: Any) -> str:
        """``array``'s dtype name (``InvalidInputError`` for another implementation's)."""
        raise NotImplementedError

    def _as4(self, array: Any) -> Any:
        """``[B, N, W]`` as ``[B, 1, N, W]`` (a view)."""
        raise NotImplementedError

    def _as3(self, array: Any) -> Any:
        raise NotImplementedError

    def _shape_dtype(self, array: Any, what: str) -> tuple[tuple[int, ...], str]:
        dtype = self._dtype_of(array)
        return tuple(int(n) for n in array.shape), dtype

    def _checked(
        self, latent: Any, rope: Any, index: Any | None, *, staged: bool = False
    ) -> tuple[bool, LatentShapes, int, int]:
        blocks = (latent, rope, index)
        return checked_blocks(self, blocks, self._shape_dtype, self._shapes(), staged=staged)

    def append(self, latent: Any, rope: Any, index: Any | None = None) -> tuple[Any, Any, Any]:
        """Append one block to every row (the seed's ``appendAndFetch``); returns
        ``(latent, rope, index | None)`` over every column, in the blocks' rank."""
        return self._spec_append(lambda: self._append_blocks(latent, rope, index))

    def _append_blocks(self, latent: Any, rope: Any, index: Any | None) -> tuple[Any, Any, Any]:
        four, shapes, _, _ = self._checked(latent, rope, index)
        given = {"latent": latent, "rope": rope, "index": index}
        blocks = {
            tensor: block if four else self._as4(block)
            for tensor, block in given.items()
            if block is not None
        }
        self._write_blocks(blocks, shapes)
        fetched = self._read_all()
        if four:
            return fetched
        return (
            self._as3(fetched[0]), self._as3(fetched[1]),
            None if fetched[2] is None else self._as3(fetched[2]),
        )  # fmt: skip

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """mlx-lm's call: ``keys`` the latent block, ``values`` the rope block (no DSA)."""
        if self.latent_spec.dsa:
            raise InvalidInputError(
                f"{type(self).__name__}: a DSA cache appends through append(latent, rope, "
                "index) (its index plane must move with the latent)"
            )
        latent, rope, _ = self.append(keys, values)
        return latent, rope

    def _read_all(self) -> tuple[Any, Any, Any]:
        """``(latent, rope, index | None)`` as a read returns them, ``[B, 1, width, ·]``."""
        if self.width == 0:
            raise LayoutStateError(NOTHING_TO_FETCH)
        read = self._read()
        shapes = self._shapes()
        latent = read["latent"]
        if shapes is not None:  # an encoded latent decodes into the cache's dtype
            latent = self._as_dtype(latent, shapes.dtype)
        return latent, read["rope"], read.get("index")

    def _as_dtype(self, array: Any, dtype: str) -> Any:
        """``array`` in ``dtype`` (itself when it is)."""
        raise NotImplementedError

    def current(self) -> tuple[Any, Any, Any]:
        """What a read of the stored tokens returns (``[B, 1, width, ·]`` latent, rope,
        index or ``None``)."""
        self._spec_usable()
        return self._read_all()

    def fetch(self) -> tuple[Any, Any]:
        """The latent and rope planes a read returns (``[B, 1, width, ·]``)."""
        latent, rope, _ = self.current()
        return latent, rope

    def fetch_index(self) -> Any:
        """The index plane a read returns (DSA caches)."""
        if not self.latent_spec.dsa:
            raise InvalidInputError(f"{type(self).__name__} has no DSA index plane")
        return self.current()[2]

    # -- row operations: the rules the latent caches keep ----------------------------------
    def trim(self, n: int) -> int:
        self._spec_guard("trim (use spec_round_rollback)")
        count = as_count(n, "n")
        shortest = min(self.row_offsets, default=0)
        if count > shortest:
            raise NotTrimmableError(
                f"{type(self).__name__}: cannot trim {count} tokens: the shortest row holds "
                f"{shortest}"
            )
        return super().trim(count)

    def trim_rows(self, counts: Sequence[int]) -> int:
        """Row ``b`` forgets its newest ``counts[b]`` tokens; the rows roll right to one end
        column again (the rollback of a round)."""
        self._spec_guard("trim_rows (use spec_round_rollback)")
        checked = check_counts(counts, self.batch_size)
        self._spec_forget(checked)
        return max(checked, default=0)

    def can_publish_row(self, row: int, tokens: int) -> bool:
        """Only a row's whole history, and not in a round."""
        self._spec_usable()
        index = check_row(row, self.batch_size)
        return self.row_offsets[index] == as_count(tokens, "tokens") and not self.spec_round_open

    def check_valid(self) -> None:
        super().check_valid()
        assert self.width <= self.max_tokens

    # -- saved state (``LATENT_FIELDS``, form version 1) ------------------------------------
    def _state_planes(self) -> tuple[Any, Any, Any]:
        """The planes right-justified ``[B, 1, width, ·]``: the latent's codec planes, rope,
        index (``None`` when absent)."""
        raise NotImplementedError

    def _int_array(self, values: Sequence[int]) -> Any:
        raise NotImplementedError

    def _ints(self, value: Any, what: str) -> list[int]:
        """A saved int vector's values (``InvalidInputError`` unless a 1-D int array of this
        implementation)."""
        raise NotImplementedError

    def _adopt_state(self, planes: PlaneSet | None, offsets: list[int], width: int) -> None:
        """Hold rows at ``offsets`` from right-justified planes ``[B, 1, width, ·]`` (owned
        copies; ``None``: no token); the shapes are taken already."""
        raise NotImplementedError

    def _native(self, array: Any) -> bool:
        raise NotImplementedError

    def _state(self) -> tuple[Any, ...]:
        self._spec_guard("saving state")
        planes, rope, index = self._state_planes()
        offsets = self._int_array(self.row_offsets)
        converted = self._int_array([0] * self.batch_size)
        shapes = self._shapes()
        widths = None if shapes is None else (shapes.rank, shapes.rope)
        return latent_state(self, planes, rope, index, None, offsets, converted, widths)

    @property
    def state(self) -> tuple[Any, ...]:
        """``LATENT_FIELDS``: the planes right-justified ``[B, 1, width, ·]`` (the latent as
        its codec planes; ``index`` / ``exact`` ``None`` when absent), the rows, the
        declaration and the codec."""
        return self._state()

    @state.setter
    def state(self, value: Any) -> None:
        self._spec_guard("restoring state")
        restored = self._restore(value, None, None, None)
        if restored.signature() != self.signature():
            raise InvalidInputError(
                state_signature_message(type(self).__name__, restored.signature(), self.signature())
            )
        vars(self).clear()
        vars(self).update(vars(restored))

    @classmethod
    def _restore(cls, state: Any, meta_state: Any, keep: Any, geometry: Any) -> Any:
        """A cache holding ``state`` (``InvalidInputError`` when it is inconsistent)."""
        fields, role = state_fields(cls.__name__, state)
        rank, rope, index, max_tokens = declared_fields(fields)
        cache = cls(rank, rope, index, max_tokens, role)
        codec, _ = codec_fields(fields)
        if codec != cache.latent_codec:
            raise InvalidInputError(plain_state_message(cls.__name__, codec))
        offsets = cache._ints(fields["offset"], "offset")
        width = checked_rows(cache, offsets, cache._ints(fields["converted"], "converted"))
        if width == 0:
            cache._adopt_state(None, offsets, 0)
            return cache
        widths = declared_widths(cache)
        planes, _ = restored_planes(cache, fields, False)
        names = [p.name for p in cache.latent_spec.plane_specs("latent", widths[0], "float32")]
        if len(names) != len(planes):
            raise InvalidInputError(latent_planes_message(cls.__name__, len(names), len(planes)))
        named = [*zip(names, planes, strict=True), ("rope", fields["rope"])]
        if fields["index"] is not None:
            named.append(("index", fields["index"]))
        for plane, array in named:
            if not cache._native(array):
                raise InvalidInputError(
                    f"{cls.__name__}: plane {plane} must be an array of this implementation"
                )
        shapes = [(n, tuple(int(d) for d in a.shape), cache._dtype_of(a)) for n, a in named]
        dtype = check_restored(cache, shapes, widths, len(offsets), width)
        cache._take_shapes(LatentShapes(*widths, cache.latent_spec.index_head_dim, dtype))
        held: PlaneSet = {"latent": tuple(planes), "rope": (fields["rope"],)}
        if fields["index"] is not None:
            held["index"] = (fields["index"],)
        cache._adopt_state(held, offsets, width)
        return cache


class EncodedLatentMembers(_LatentLayout):
    """``EncodedLatentCache`` on the row machinery (contract §0.5): the latent surface of
    two stages, ``(Latent(Plain(), …), Latent(inner, …))`` of one declaration, each row in
    its own. A row's stage is its whole record (``converted``: the second); after each
    append's read the plain rows at ``conversion_due(offset, start)`` convert (decode the
    exact latent, encode it: what encoding at the append gave), inside rounds too, and no
    trim un-converts one. Reads are the machinery's one dense image (each row exact or
    decoded); merges, filters, trims and rollbacks are the machinery's. Listed first among
    the class's bases, ahead of the implementation's ``LatentSurface``; each
    implementation adds ``_rows_only`` and ``_with_exact`` (the exact latent a state and
    ``planes()`` show)."""

    _start = 0
    #: The bf16-first rule (``Conversion.row_due``; a test plants a wrong one through it).
    conversion_class: ClassVar[type[Conversion]] = Conversion
    if TYPE_CHECKING:  # the row machinery's and the latent surface's
        _stages: tuple[Any, ...]
        row_stages: tuple[int, ...]

        def _use_stages(self, specs: Sequence[CodecSpec]) -> None: ...
        def _convert_rows(self, rows: Sequence[int]) -> None: ...
        def _shapes(self) -> LatentShapes | None: ...
        def _take_shapes(self, shapes: Any) -> None: ...
        def _take_rows(self, storage: Any) -> None: ...
        def _state_planes(self) -> tuple[Any, Any, Any]: ...
        def _int_array(self, values: Sequence[int]) -> Any: ...
        def _ints(self, value: Any, what: str) -> list[int]: ...
        def _adopt_state(self, planes: PlaneSet | None, offsets: list[int], width: int) -> None: ...
        def _native(self, array: Any) -> bool: ...
        def _dtype_of(self, array: Any) -> str: ...
        def _spec_guard(self, what: str) -> None: ...
        def merge_rows(self, rows: Sequence[Any]) -> None: ...

        # The implementation's (its ``LatentSurface``, after this mixin in the MRO):
        def _with_exact(self, planes: Any, rows: Sequence[int]) -> Any:
            """``planes`` (``planes()`` with every row converted) with the exact latent of
            rows ``rows``."""

        def _rows_only(self, array: Any, rows: Sequence[int]) -> Any:
            """``array`` (``[B, ...]``) with every row but ``rows`` zero."""

    def __init__(
        self,
        kv_lora_rank: object = None,
        rope_head_dim: object = None,
        index_head_dim: object = None,
        max_tokens: object = None,
        role: object = "target",
        *,
        codec: object = None,
        bits: int | None = None,
        group_size: int | None = None,
        start: int = 0,
        token_geometry: object = None,
        geometry: object = None,
    ) -> None:
        if token_geometry is not None:  # the machinery's ``from_specs``: one stage of ``codec``
            super().__init__(codec=codec, token_geometry=token_geometry, geometry=geometry)  # type: ignore[call-arg]
            return
        name = type(self).__name__
        inner, first = encoded_codec(name, codec, bits, group_size, start)
        target = latent_spec(
            name, inner, kv_lora_rank=kv_lora_rank, rope_head_dim=rope_head_dim,
            index_head_dim=index_head_dim, role=role,
        )  # fmt: skip
        plain = replace(target, inner=Plain())
        super().__init__(codec=plain, token_geometry=growing_geometry(name, max_tokens))  # type: ignore[call-arg]
        self._use_stages((plain, target))
        self._start = first

    # -- what the cache is ----------------------------------------------------------------
    @property
    def start(self) -> int:
        """The bf16-first boundary: a row reads exact until the append after which its
        offset reaches it."""
        return self._start

    @property
    def latent_spec(self) -> Latent:
        """The declaration, its latent through the encoding codec (the last stage's)."""
        spec: Latent = self._stages[-1].spec
        return spec

    @property
    def latent_codec(self) -> LatentCodec:
        return self.latent_spec.inner

    @property
    def codec_spec(self) -> LatentCodec:
        return self.latent_codec

    def signature(self) -> str:
        spec = self.latent_spec
        return f"kv:mla-encoded:{spec.signature_role}:{spec.inner.key}:{self.start}"

    @property
    def converted(self) -> tuple[bool, ...]:
        """Per row, whether it reads its latent decoded (it converted)."""
        last = len(self._stages) - 1
        return tuple(stage == last for stage in self.row_stages)

    def make_empty_batch(self) -> Any:
        """An empty cache of the same declaration, its shapes learnt."""
        spec = self.latent_spec
        other = type(self)(
            spec.kv_lora_rank, spec.rope_head_dim, spec.index_head_dim,
            self._token_geometry.cap(), spec.role, codec=spec.inner,
            start=self.start,
        )  # fmt: skip
        other._take_shapes(self._shapes())
        return other

    def _take_over(self, other: Any) -> None:
        vars(self).clear()
        vars(self).update(vars(other))

    # -- appends ---------------------------------------------------------------------------
    def _append_blocks(self, latent: Any, rope: Any, index: Any | None) -> Any:
        """The machinery's write and read; then the plain rows due convert (this append
        read them exact)."""
        fetched = super()._append_blocks(latent, rope, index)  # type: ignore[misc]
        last = len(self._stages) - 1
        rule = self.conversion_class(self.latent_codec, self.start)  # the bf16-first rule
        due = [
            b
            for b, (stage, offset) in enumerate(zip(self.row_stages, self.row_offsets, strict=True))
            if stage < last and rule.row_due(offset)
        ]
        if due:
            self._convert_rows(due)
        return fetched

    # -- row operations ----------------------------------------------------------------------
    def _accepts(self, source: object) -> bool:
        """Rows of a cache of the same declaration, codec and ``start`` (its signature)."""
        signature = getattr(source, "signature", None)
        if not (callable(signature) and signature() == self.signature()):
            return False
        accepted: bool = super()._accepts(source)  # type: ignore[misc]
        return accepted

    def filter_rows(self, keep: Sequence[int]) -> None:
        """The machinery's; keeping no row leaves a fresh empty cache (plain again)."""
        super().filter_rows(keep)  # type: ignore[misc]
        if not self.row_offsets:
            self._take_over(self.make_empty_batch())

    def extract_row(self, row: int) -> Any:
        """An independent compact cache of this declaration holding row ``row`` in its
        stage (the machinery's extraction, taken into a fresh cache)."""
        single = super().extract_row(row)  # type: ignore[misc]
        fresh = self.make_empty_batch()
        fresh._take_rows(single)
        return fresh

    def planes(self) -> Any:
        """The stored planes as the surface shows them (latent codec planes, rope, index,
        exact latent), a plain row's latent as its codec will store it once it converts,
        its exact latent beside it."""
        last = len(self._stages) - 1
        plain = [b for b, stage in enumerate(self.row_stages) if stage < last]
        if not plain or not self.width:
            return super().planes()  # type: ignore[misc]
        copy = self.make_empty_batch()
        copy.merge_rows([self])
        copy._convert_rows(plain)
        return self._with_exact(copy.planes(), plain)

    # -- saved state (``LATENT_FIELDS``, form version 1) --------------------------------------
    def _state(self) -> tuple[Any, ...]:
        """The codec planes of every row (a plain row's encoded as its conversion would),
        the exact latent of the plain rows (zeros elsewhere; ``None`` when none is plain),
        the rows and their ``converted`` flags."""
        self._spec_guard("saving state")
        last = len(self._stages) - 1
        stages = self.row_stages
        plain = [b for b, stage in enumerate(stages) if stage < last]
        planes = rope = index = exact = None
        if self.width:
            copy = self.make_empty_batch()
            copy.merge_rows([self])
            if plain:
                copy._convert_rows(plain)
            planes, rope, index = copy._state_planes()
            if plain:
                exact = self._rows_only(self._read()["latent"], plain)
        shapes = self._shapes()
        widths = None if shapes is None else (shapes.rank, shapes.rope)
        offsets = self._int_array(self.row_offsets)
        flags = self._int_array([int(stage == last) for stage in stages])
        return latent_state(self, planes, rope, index, exact, offsets, flags, widths)

    @classmethod
    def _restore(cls, state: Any, meta_state: Any, keep: Any, geometry: Any) -> Any:
        """Converted rows from the saved codec planes, plain rows from the exact latent
        (``InvalidInputError`` when the state is inconsistent)."""
        fields, role = state_fields(cls.__name__, state)
        rank, rope, index, max_tokens = declared_fields(fields)
        codec, start = codec_fields(fields)
        if not codec.encodes:
            raise InvalidInputError(plain_latent_state_message(cls.__name__))
        cache = cls(rank, rope, index, max_tokens, role, codec=codec, start=start)
        offsets = cache._ints(fields["offset"], "offset")
        flags = cache._ints(fields["converted"], "converted")
        width = checked_rows(cache, offsets, flags)
        converted = [b for b, flag in enumerate(flags) if flag]
        if width == 0:
            cache._adopt_state(None, offsets, 0)
            cache._convert_rows(converted)  # rows trimmed to nothing stay converted
            return cache
        widths = declared_widths(cache)
        planes, exact = restored_planes(cache, fields, len(converted) < len(flags))
        names = _plane_names(cache, widths[0])
        if len(names) != len(planes):
            raise InvalidInputError(latent_planes_message(cls.__name__, len(names), len(planes)))
        named = [*zip(names, planes, strict=True), ("rope", fields["rope"])]
        if fields["index"] is not None:
            named.append(("index", fields["index"]))
        if exact is not None:
            named.append(("exact", exact))
        for plane, array in named:
            if not cache._native(array):
                raise InvalidInputError(
                    f"{cls.__name__}: plane {plane} must be an array of this implementation"
                )
        shapes = [(n, tuple(int(d) for d in a.shape), cache._dtype_of(a)) for n, a in named]
        dtype = check_restored(cache, shapes, widths, len(offsets), width)
        learnt = LatentShapes(*widths, cache.latent_spec.index_head_dim, dtype)
        extra: PlaneSet = {"rope": (fields["rope"],)}
        if fields["index"] is not None:
            extra["index"] = (fields["index"],)
        encoded = cache.make_empty_batch()
        encoded._take_shapes(learnt)
        encoded.codec = encoded._stages[-1]
        encoded._adopt_state({"latent": tuple(planes), **extra}, offsets, width)
        sources = [encoded]
        if exact is not None:
            warm = cache.make_empty_batch()
            warm._take_shapes(learnt)
            warm._adopt_state({"latent": (exact,), **extra}, offsets, width)
            sources.append(warm)
        cache.merge_rows(sources)
        rows = len(offsets)
        order = [b if flags[b] or exact is None else rows + b for b in range(rows)]
        if order != list(range(len(order))) or len(sources) > 1:
            cache.filter_rows(order)
        return cache


def _plane_names(cache: Any, rank: int) -> list[str]:
    """The names of the latent's codec planes (``latent``, ``latent.scales``, …)."""
    return [p.name for p in cache.latent_spec.plane_specs("latent", rank, "float32")]


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
        """Each latent cache on these rows declares itself through ``_setup``."""
        raise NotImplementedError

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
        four, shapes, rows, n = checked_blocks(
            self, (latent, rope, index), self._impl_shape_dtype, self._shapes, staged=staged
        )
        return latent, rope, index, four, shapes.dtype, rows, n

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
        """Take the rows of ``rows`` (borrowed, unchanged) after the rows held."""
        self._spec_guard("merge_rows")
        name = type(self).__name__
        if isinstance(rows, str | bytes) or not isinstance(rows, Sequence) or not rows:
            raise InvalidInputError(f"{name}.merge_rows needs a non-empty sequence of caches")
        if any(s is self for s in rows) or len({id(s) for s in rows}) != len(rows):
            raise IncompatibleRowsError(self_merge_message(self.signature()))
        if self._offsets:  # a running cache: its rows and the sources', into a fresh one
            joined = self.make_empty_batch()
            joined.merge_rows([self, *rows])
            self._take_over(joined)
            return
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
                different_rows_message(name, (sorted(widths), sorted(dtypes)))
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

    def _take_over(self: _L, other: _L) -> None:
        """Hold what ``other`` (a fresh cache of this declaration) holds, in its place."""
        vars(self).clear()
        vars(self).update(vars(other))

    def _merge_key(self) -> tuple[object, ...]:
        spec = self.latent_spec
        return (
            spec.index_head_dim, spec.role, self._token_geometry.max_tokens, spec.inner, self.start,
        )  # fmt: skip

    def filter_rows(self, keep: Sequence[int]) -> None:
        """Keep the rows ``keep`` names (any order); drop the common padding."""
        self._spec_guard("filter_rows")
        rows = check_keep(keep, self.batch_size)
        if not rows:  # the last rows leave: an empty cache, its shapes learnt
            self._take_over(self.make_empty_batch())
            return
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
        return latent_state(
            self, *self._impl_state_planes(), self._impl_int_array(self._offsets),
            self._impl_int_array([int(c) for c in self.converted]), self._widths,
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
        fields, role = state_fields(cls.__name__, state)
        cache = cls._from_fields(fields, role)
        cache._restore_fields(fields)
        return cache

    @classmethod
    def _from_fields(cls: type[_L], fields: dict[str, Any], role: str) -> _L:
        rank, rope, index, max_tokens = declared_fields(fields)
        cache = cls(rank, rope, index, max_tokens, role)
        codec, start = codec_fields(fields)
        if codec != cache.latent_codec or (start != cache.start and codec != Plain()):
            cache._set_codec(codec, start)
            cache._conversion = cache._fresh_record()
        return cache

    def _set_codec(self, codec: LatentCodec, start: int) -> None:
        """Take the codec and ``start`` a saved state names (or refuse it)."""
        raise NotImplementedError

    def _restore_fields(self, fields: dict[str, Any]) -> None:
        offsets = [int(v) for v in self._impl_ints(fields["offset"], "offset")]
        converted = [int(v) for v in self._impl_ints(fields["converted"], "converted")]
        width = checked_rows(self, offsets, converted)
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
        self._widths = declared_widths(self)
        planes, exact = restored_planes(self, fields, not all(self.converted))
        self._dtype = self._impl_restore(
            planes, fields["rope"], fields["index"], exact, len(offsets), width
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
        assert self._widths is not None
        return check_restored(self, shapes, self._widths, rows, width)

    def lend_rows(self) -> None:
        self._spec_guard("merging this cache's rows into another")


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
