"""MLA latent state (``spec/MLACache.md``, ``spec/EncodedLatentCache.md``): the array-free part.

A latent cache holds, per token, the compressed KV latent (``kv_lora_rank`` wide), the
decoupled RoPE key (``rope_head_dim``) and, for a DeepSeek-sparse-attention target, the
indexer's key (``index_head_dim``), all on one token axis. Rows are right-justified: the
shared width is the longest row, and row ``b`` is left-padded by ``width - offset[b]``.

:class:`LatentSurfaceMembers` is the array-free half of ``MLACache``'s surface on the row
machinery (each implementation's ``LatentSurface``); :class:`EncodedLatentMembers` puts it
in two stages (``EncodedLatentCache``); :class:`PagedLatentMembers` puts it on the paged
placement (``PagedLatentCache``, its pool a :class:`LatentPoolMembers` ``BlockPool``). The
block checks and the v1 state form (``checked_blocks``, ``latent_state``, ``state_fields``
…) are functions every latent cache calls.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import lru_cache, partial
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

from kvrows.codec import CodecSpec, PlaneSet, PlaneSpec
from kvrows.codecs import is_codec_spec, is_kv_codec, kv_codecs
from kvrows.codecs.latent import (
    DEEPSEEK_V3_BF16_BYTES,
    FLASHMLA_FP8_BYTES,
    LATENT_FIELDS,
    LATENT_FIELDS_V1,
    PAGED_LATENT_FIELDS,
    Latent,
    LatentRole,
    LatentShapes,
    latent_token_bytes,
)
from kvrows.common import all_or_nothing, check_counts
from kvrows.conversion import Conversion
from kvrows.errors import (
    NOTHING_TO_FETCH,
    CapacityError,
    IncompatibleRowsError,
    InvalidInputError,
    LayoutStateError,
    NotTrimmableError,
    PoolExhaustedError,
    from_state_tuple_message,
    latent_planes_message,
    latent_role_message,
    not_an_integer_message,
    plain_latent_state_message,
    state_signature_message,
)
from kvrows.paged import DEFAULT_BLOCK_SIZE, Paged
from kvrows.schemes import Affine, GeometrySpec, Growing, Plain
from kvrows.speculative import SpeculativeRounds
from kvrows.validation import FLOAT_DTYPES, as_count, check_row

__all__ = [
    "DEEPSEEK_V3_BF16_BYTES",
    "FLASHMLA_FP8_BYTES",
    "LATENT_FIELDS",
    "PAGED_LATENT_FIELDS",
    "EncodedLatentMembers",
    "LatentCodec",
    "LatentPoolMembers",
    "LatentRole",
    "LatentSurfaceMembers",
    "PagedLatentMembers",
    "encoded_codec",
    "int_vector_message",
    "latent_spec",
    "latent_token_bytes",
]

LatentCodec: TypeAlias = CodecSpec  # the latent plane takes any codec


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


def declared_stages(
    owner: str,
    inner: LatentCodec,
    kv_lora_rank: object,
    rope_head_dim: object,
    index_head_dim: object,
    max_tokens: object,
    role: object,
) -> tuple[tuple[Latent, ...], Growing]:
    """Every latent constructor's declaration (its first five parameters), checked: its
    stages (the latent through ``inner``, after the warm rows' plain latent when ``inner``
    encodes) and its growing token geometry."""
    spec = latent_spec(
        owner, inner, kv_lora_rank=kv_lora_rank, rope_head_dim=rope_head_dim,
        index_head_dim=index_head_dim, role=role,
    )  # fmt: skip
    stages = (replace(spec, inner=Plain()), spec) if inner.encodes else (spec,)
    return stages, growing_geometry(owner, max_tokens)


def declaration(spec: Latent, max_tokens: object) -> tuple[object, ...]:
    """The first five constructor arguments of a latent cache of ``spec`` (what
    ``declared_stages`` checks): widths, ``max_tokens``, role."""
    return spec.kv_lora_rank, spec.rope_head_dim, spec.index_head_dim, max_tokens, spec.role


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
                raise InvalidInputError(
                    f"the latent codec must be an encoding KV codec (affine, TurboQuant, "
                    f"microscaling), got {codec!r}"
                )
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


def _shape(array: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in array.shape)


def int_vector_message(owner: str, what: str) -> str:
    """A saved latent state whose ``what`` is not a 1-D int array of the implementation."""
    return f"{owner}: {what} must be a 1-D int array"


def different_rows_message(owner: str, shapes: object) -> str:
    """A latent merge of rows of different widths or dtypes."""
    return f"{owner}.merge_rows: rows of different widths or dtypes ({shapes})"


@lru_cache(maxsize=256)
def _checked_spec(
    spec: Latent,
    owner: str,
    blocks: tuple[tuple[str, tuple[int, ...], str], ...],
    rows: int | None,
    known: LatentShapes | None,
) -> LatentShapes:
    """``spec.check_blocks``, remembered: a decode step appends blocks of the shapes and
    dtype of the step before, and the answer depends on those alone (a refusal raises
    again every time: it is not remembered)."""
    return spec.check_blocks(owner, blocks, rows, known)


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
    described = tuple(zip((w for w, _ in named), shapes, dtypes, strict=True))
    learned = _checked_spec(spec, name, described, held, known)
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
        cache.start, spec.inner.tag,
    )  # fmt: skip


def state_fields(name: str, state: Any) -> tuple[dict[str, Any], LatentRole]:
    """The ``LATENT_FIELDS`` of a saved ``state`` by name, and its role."""
    if isinstance(state, str | bytes) or not isinstance(state, Sequence):
        raise InvalidInputError(from_state_tuple_message(name))
    if len(state) not in (len(LATENT_FIELDS), len(LATENT_FIELDS_V1)):
        raise InvalidInputError(
            f"{name}: a latent state has {len(LATENT_FIELDS)} fields, got {len(state)}"
        )
    fields = dict(zip(LATENT_FIELDS, state, strict=False))  # a v1 state: no codec tag
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
    tag = fields.get("codec")
    tail = (_optional(fields, name) for name in _CODEC_FIELDS)
    codec = _state_codec(*tail, tag=None if tag is None else _scalar(tag, "codec"))
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


def _plane_names(cache: Any, rank: int) -> list[str]:
    """The names of the latent's codec planes (``latent``, ``latent.scales``, …)."""
    return [p.name for p in cache.latent_spec.plane_specs("latent", rank, "float32")]


def checked_planes(
    cache: Any,
    fields: dict[str, Any],
    planes: Sequence[Any],
    exact: Any,
    widths: tuple[int, int],
    rows: int,
    width: int,
) -> tuple[LatentShapes, PlaneSet]:
    """A saved state's planes checked against ``cache`` (its latent codec's plane count,
    arrays of its implementation, shapes and dtypes of ``rows`` x ``width`` right-justified
    columns; ``exact``: the warm-up latent, checked too): the shapes they hold and the
    plane set of ``latent``, ``rope`` (and ``index``)."""
    name = type(cache).__name__
    names = _plane_names(cache, widths[0])
    if len(names) != len(planes):
        raise InvalidInputError(latent_planes_message(name, len(names), len(planes)))
    named = [*zip(names, planes, strict=True), ("rope", fields["rope"])]
    if fields["index"] is not None:
        named.append(("index", fields["index"]))
    if exact is not None:
        named.append(("exact", exact))
    for plane, array in named:
        if not cache._native(array):
            raise InvalidInputError(
                f"{name}: plane {plane} must be an array of this implementation"
            )
    shapes = [(n, tuple(int(d) for d in a.shape), cache._dtype_of(a)) for n, a in named]
    dtype = check_restored(cache, shapes, widths, rows, width)
    held: PlaneSet = {"latent": tuple(planes), "rope": (fields["rope"],)}
    if fields["index"] is not None:
        held["index"] = (fields["index"],)
    return LatentShapes(*widths, cache.latent_spec.index_head_dim, dtype), held


def restore_rows(cache: Any, fields: dict[str, Any]) -> Any:
    """``cache`` (empty, of the saved declaration) holding the rows of a ``LATENT_FIELDS``
    state, checked, each in its stage (``_adopt_state``: a two-stage cache's converted
    rows from the codec planes, the others in stage 0 from the exact latent); the one
    restore of every latent cache (``InvalidInputError`` when the state is inconsistent)."""
    offsets = cache._ints(fields["offset"], "offset")
    flags = cache._ints(fields["converted"], "converted")
    width = checked_rows(cache, offsets, flags)
    # A two-stage cache takes each row's stage and (below) the warm rows' exact latent.
    staged: dict[str, Any] = {}
    if len(cache._stages) > 1:
        staged["converted"] = [bool(f) for f in flags]
    if width == 0:
        cache._adopt_state(None, offsets, 0, **staged)
        return cache
    widths = declared_widths(cache)
    planes, exact = restored_planes(cache, fields, not all(flags))
    learnt, held = checked_planes(cache, fields, planes, exact, widths, len(offsets), width)
    if cache._shapes() not in (None, learnt):  # a paged latent's pool learnt its own
        raise InvalidInputError(
            f"{type(cache).__name__}: the pool holds {cache._shapes()}, the state {learnt}"
        )
    cache._take_shapes(learnt)
    if staged:
        staged["exact"] = exact
    cache._adopt_state(held, offsets, width, **staged)
    return cache


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
        **placement: object,
    ) -> None:
        if codec is None or token_geometry is None:  # not the machinery's ``from_specs``
            (spec,), growing = declared_stages(
                type(self).__name__, Plain(), kv_lora_rank, rope_head_dim, index_head_dim,
                max_tokens, role,
            )  # fmt: skip
            codec = spec if codec is None else codec
            token_geometry = growing if token_geometry is None else token_geometry
        # ``placement=``: a paged latent's ``Paged`` spec (its block size), passed on.
        super().__init__(codec=codec, token_geometry=token_geometry, geometry=geometry, **placement)  # type: ignore[call-arg]

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
        """Bytes one row of ``tokens`` positions takes (capped at ``max_tokens``): its
        stored planes and, for an implementation that keeps one, its decoded window."""
        count = as_count(tokens, "tokens")
        per_token = self.bytes_per_token() + self.window_token_bytes()
        return min(count, int(min(self.max_tokens, count))) * per_token

    def window_token_bytes(self) -> int:
        """Bytes a decoded window holds per token of a row, beside the stored planes
        (``spec/EncodedLatentCache.md`` §5): 0 here, no window (the reference assembles
        its reads from its rows; the optimized encoded latent overrides it)."""
        return 0

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

        def write_read() -> tuple[Any, Any, Any]:
            self._write_blocks(blocks, shapes)
            return self._read_all()

        # The read decodes after the write: a fault there puts the write back (contract §9).
        fetched = all_or_nothing(self, write_read)
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
        copies; ``None``: no token); the shapes are taken already (a two-stage cache also
        takes ``converted=`` flags and the warm rows' ``exact=`` latent)."""
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
        cache = cls(*declared_fields(fields), role)
        codec, _ = codec_fields(fields)
        if codec != cache.latent_codec:
            raise InvalidInputError(plain_state_message(cls.__name__, codec))
        return restore_rows(cache, fields)


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
        def _native(self, array: Any) -> bool: ...
        def _dtype_of(self, array: Any) -> str: ...
        def _read_all(self) -> tuple[Any, Any, Any]: ...
        def _spec_guard(self, what: str) -> None: ...
        def merge_rows(self, rows: Sequence[Any]) -> None: ...
        def _checked(
            self, latent: Any, rope: Any, index: Any | None, *, staged: bool = False
        ) -> tuple[bool, LatentShapes, int, int]: ...

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
        stages, growing = declared_stages(
            name, inner, kv_lora_rank, rope_head_dim, index_head_dim, max_tokens, role
        )
        super().__init__(codec=stages[0], token_geometry=growing)  # type: ignore[call-arg]
        self._use_stages(stages)
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
        cap = self._token_geometry.cap()
        other = type(self)(*declaration(spec, cap), codec=spec.inner, start=self.start)
        other._take_shapes(self._shapes())
        return other

    def _take_over(self, other: Any) -> None:
        vars(self).clear()
        vars(self).update(vars(other))

    # -- appends ---------------------------------------------------------------------------
    def _append_blocks(self, latent: Any, rope: Any, index: Any | None) -> Any:
        """The machinery's write and read; then the plain rows due convert (this append
        read them exact). A fault in the conversion puts the append back too (contract
        §9): only an append rows convert after keeps what the planes held (one copy).
        An append no row converts after is the machinery's alone (its own all-or-nothing:
        a decode step checks its blocks once)."""
        append = super()._append_blocks  # type: ignore[misc]
        # The block's tokens, read before its checks (the append's own, before anything
        # changes): a bad block raises there whichever way this goes.
        shape: Sequence[int] = getattr(latent, "shape", ())
        n = int(shape[-2]) if len(shape) in (3, 4) else 0
        converts = bool(due_rows(self, self.row_stages, self.row_offsets, n))
        if self.row_offsets and not converts:  # (a first block sets the rows: it may convert)
            return append(latent, rope, index)
        append_convert = partial(_append_convert, self, partial(append, latent, rope, index))
        return all_or_nothing(self, append_convert, held=converts)

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
        stage (the machinery's extraction, taken into a fresh cache). A row of no token
        is one row at offset 0 in its stage, as a cache trimmed to nothing holds it (its
        saved form keeps the stage: a cache of no row saves none)."""
        single = super().extract_row(row)  # type: ignore[misc]
        fresh = self.make_empty_batch()
        fresh._take_rows(single)
        if not single.row_offsets:  # an empty cache lends one empty row, of its stage
            held = fresh
            fresh = self.make_empty_batch()
            fresh.merge_rows([held])
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
                # As a read returns it, in the cache's dtype (the dense image holds the
                # converted rows decoded in the codec's: TurboQuant's float32).
                exact = self._rows_only(self._read_all()[0], plain)
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
        codec, start = codec_fields(fields)
        if not codec.encodes:
            raise InvalidInputError(plain_latent_state_message(cls.__name__))
        cache = cls(*declared_fields(fields), role, codec=codec, start=start)
        return restore_rows(cache, fields)

    def _adopt_state(
        self,
        planes: PlaneSet | None,
        offsets: list[int],
        width: int,
        exact: Any = None,
        converted: Sequence[bool] | None = None,
    ) -> None:
        """Each stage's rows: the rows ``converted`` from the codec ``planes``, the others
        in stage 0 from ``exact`` (rope and index from ``planes``), each stage restored
        into a one-stage cache, then merged and put in batch order (``converted=None``:
        every row in this cache's current stage, the implementation's)."""
        if converted is None:
            super()._adopt_state(planes, offsets, width)  # type: ignore[misc]
            return
        if planes is None:  # rows trimmed to nothing stay converted
            super()._adopt_state(None, offsets, 0)  # type: ignore[misc]
            self._convert_rows([b for b, flag in enumerate(converted) if flag])
            return
        held = [planes] if exact is None else [planes, {**planes, "latent": (exact,)}]
        sources = [self.make_empty_batch() for _ in held]
        sources[0].codec = sources[0]._stages[-1]  # the codec planes: the last stage's
        for part, part_planes in zip(sources, held, strict=True):
            part._adopt_state(part_planes, offsets, width)
        self.merge_rows(sources)
        rows = len(offsets)
        order = [b if converted[b] or exact is None else rows + b for b in range(rows)]
        if order != list(range(len(order))) or len(sources) > 1:
            self.filter_rows(order)


def _append_convert(cache: Any, append: Callable[[], Any]) -> Any:
    """``append()`` (the machinery's write and read), then ``cache``'s plain rows that are
    due convert (the append read them exact): what an encoded latent's append is."""
    fetched = append()
    due = due_rows(cache, cache.row_stages, cache.row_offsets, 0)
    if due:
        cache._convert_rows(due)
    return fetched


_CODEC_FIELDS = ("bits", "group_size", "k_bits", "v_bits")


def _scalar(value: object, what: str) -> int:
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(not_an_integer_message(f"state field {what}", value))
    return value


def _state_codec(
    bits: int | None,
    group_size: int | None,
    k_bits: int | None,
    v_bits: int | None,
    *,
    tag: int | None = None,
) -> LatentCodec:
    """The latent codec the saved fields name: the KV codec of ``tag`` (a v1 state has
    none: the first whose state tail they fill), from its tail."""
    values = dict(zip(_CODEC_FIELDS, (bits, group_size, k_bits, v_bits), strict=True))
    given = {name for name, value in values.items() if value is not None}
    for codec in kv_codecs().values():
        if set(codec.state_tail) == given and tag in (None, codec.tag):
            return codec.from_tail(values)
    raise InvalidInputError(
        f"state codec fields must be affine or microscaling (bits, group_size) or turbo "
        f"(k_bits, v_bits) of a known codec tag, got {(bits, group_size, k_bits, v_bits)} "
        f"(tag {tag})"
    )


def latent_pool_codec(codec: object, index_head_dim: object) -> Latent:
    """A latent block pool's codec: the latent through ``codec`` (``None``: plain; a
    ``Latent``: its inner codec and index width), ``index_head_dim`` wide index planes."""
    inner = getattr(codec, "inner", None)
    if inner is not None:  # a latent cache's own spec: its latent's codec and index width
        return Latent(inner=inner, index_head_dim=getattr(codec, "index_head_dim", None))
    spec = Plain() if codec is None else codec
    if not (is_codec_spec(spec) and is_kv_codec(spec)):
        raise InvalidInputError(
            f"a latent block pool stores the latent plain, Affine or Turbo, got {spec!r}"
        )
    index = (
        None if index_head_dim is None else as_count(index_head_dim, "index_head_dim", minimum=1)
    )
    return Latent(inner=spec, index_head_dim=index)


class LatentPoolMembers:
    """What a latent block pool adds to its implementation's ``BlockPool`` (the paged
    placement's pool of a ``Latent`` codec, ``spec/PagedLatentCache.md``): the
    constructor of the latent's codec and index width, and what ``lookup_prefix`` returns
    (a one-row ``PagedLatentCache`` of the pool's latent codec)."""

    #: The implementation's ``PagedLatentCache``.
    latent_cache_class: ClassVar[type[Any]]
    if TYPE_CHECKING:

        @property
        def codec_spec(self) -> CodecSpec: ...

    def __init__(
        self,
        codec: object = None,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int = 0,
        max_bytes: int | None = None,
        index_head_dim: object = None,
        geometry: LatentShapes | None = None,
    ) -> None:
        super().__init__(  # type: ignore[call-arg]
            latent_pool_codec(codec, index_head_dim), block_size=block_size,
            num_blocks=num_blocks, max_bytes=max_bytes, geometry=geometry,
        )  # fmt: skip

    @property
    def latent_spec(self) -> Latent:
        spec: Latent = self.codec_spec  # type: ignore[assignment]
        return spec

    @property
    def latent_codec(self) -> LatentCodec:
        """The codec of the latent plane (``Plain()``, ``Affine``, ``Turbo``)."""
        return self.latent_spec.inner

    @property
    def index_head_dim(self) -> int | None:
        return self.latent_spec.index_head_dim

    def _prefix_cache(self, token_geometry: Any = None) -> Any:
        """An empty cache of the pool's latent that a prefix hit's rows join (a latent
        row grows: ``token_geometry`` is the growing one)."""
        codec = self.latent_codec
        return self.latent_cache_class(
            index_head_dim=self.index_head_dim, pool=self, codec=codec if codec.encodes else None
        )


class PagedLatentMembers(_LatentLayout):
    """``PagedLatentCache`` on the paged placement (``spec/PagedLatentCache.md``): the
    latent surface of ``MLACache`` over a layout whose rows are block tables into a
    latent block pool (a ``BlockPool`` of a ``Latent`` codec). Listed first, ahead of the
    implementation's ``LatentSurface`` and ``PagedLayout``.

    An encoded latent has the two stages of ``EncodedLatentMembers`` (``(Latent(Plain(),
    …), Latent(inner, …))``, contract §0.5): the pool stores the last; a row still in its
    bf16-first warm-up is in stage 0, held **contiguous beside the pool** by the placement
    (its exact latent; no block), and converts into fresh blocks after the append whose
    read reached ``conversion_due``. Every row operation is the placement's, per stage;
    the placement reserves a converting append's blocks before it writes
    (``_converts_after``)."""

    _start = 0
    #: The bf16-first rule (``Conversion.row_due``).
    conversion_class: ClassVar[type[Conversion]] = Conversion
    #: The placement holds the warm rows as a contiguous stage 0 beside its pool.
    _stage_beside: ClassVar[bool] = True
    if TYPE_CHECKING:
        pool_class: ClassVar[type[Any]]
        _pool: Any
        _finalizer: Any
        _stages: tuple[Any, ...]
        codec: Any
        row_stages: tuple[int, ...]

        def _use_stages(self, specs: Sequence[CodecSpec]) -> None: ...
        def _convert_rows(self, rows: Sequence[int]) -> None: ...
        def _pool_undoable(self) -> Any: ...
        def _watch(self) -> None: ...
        def _shapes(self) -> LatentShapes | None: ...
        def _take_shapes(self, shapes: Any) -> None: ...
        def _spec_guard(self, what: str) -> None: ...
        def _read_all(self) -> tuple[Any, Any, Any]: ...
        def _state_planes(self) -> tuple[Any, Any, Any]: ...
        def _rows_only(self, array: Any, rows: Sequence[int]) -> Any: ...
        def _int_array(self, values: Sequence[int]) -> Any: ...
        def _ints(self, value: Any, what: str) -> list[int]: ...
        def _native(self, array: Any) -> bool: ...
        def _dtype_of(self, array: Any) -> str: ...
        def bytes_per_token(self) -> int: ...
        def window_token_bytes(self) -> int: ...
        @property
        def max_tokens(self) -> float: ...
        @property
        def latent_codec(self) -> LatentCodec: ...

        # The implementation's (its ``PagedLatentCache``):
        def _adopt_state(
            self,
            planes: PlaneSet | None,
            offsets: list[int],
            width: int,
            exact: Any = None,
            converted: Sequence[bool] | None = None,
        ) -> None:
            """Hold rows at ``offsets`` from right-justified ``planes`` ``[B, 1, width,
            ·]``: the rows ``converted`` (every row of a one-stage cache) written into
            fresh blocks (every block taken at once: a refusal changes nothing, counted as
            written), the others in stage 0 beside the pool, their latent ``exact``."""

    def __init__(
        self,
        kv_lora_rank: object = None,
        rope_head_dim: object = None,
        index_head_dim: object = None,
        max_tokens: object = None,
        role: object = "target",
        *,
        pool: Any = None,
        block_size: object = None,
        codec: object = None,
        start: object = 0,
        token_geometry: object = None,
        geometry: object = None,
        placement: object = None,
    ) -> None:
        if getattr(codec, "inner", None) is not None:  # the machinery's form: a latent spec
            super().__init__(  # type: ignore[call-arg]
                codec=codec, token_geometry=token_geometry, geometry=geometry, placement=placement
            )
            self._bind_pool(pool)
            return
        name = type(self).__name__
        inner: LatentCodec = Plain()
        first = 0
        if codec is not None and codec != Plain():  # encoded_codec checks what it is
            inner, first = encoded_codec(name, codec, None, None, start)
        elif as_count(start, "start"):
            raise InvalidInputError(f"{name}: start applies to an encoded latent only")
        stages, growing = declared_stages(
            name, inner, kv_lora_rank, rope_head_dim, index_head_dim, max_tokens, role
        )
        spec, cap = stages[-1], growing.cap()
        if pool is not None and not isinstance(pool, self.pool_class):
            raise InvalidInputError(f"{name}: pool must be a {self.pool_class.__name__}")
        size = None if block_size is None else as_count(block_size, "block_size", minimum=1)
        if pool is not None:
            if size is not None and size != pool.block_size:
                raise InvalidInputError(
                    f"{name}: the pool's blocks hold {pool.block_size} tokens, not {size}"
                )
            size = pool.block_size
            if pool.latent_codec != inner:
                raise InvalidInputError(
                    f"{name}: the pool stores the latent {pool.latent_codec!r}, not {inner!r}"
                )
            if pool.index_head_dim != spec.index_head_dim:
                raise InvalidInputError(
                    f"{name}: the pool holds index planes of width {pool.index_head_dim}, "
                    f"declared {spec.index_head_dim}"
                )
            held: LatentShapes | None = pool.geometry
            declared = (spec.kv_lora_rank, spec.rope_head_dim)
            if held is not None and any(
                d is not None and d != h
                for d, h in zip(declared, (held.rank, held.rope), strict=True)
            ):
                raise InvalidInputError(
                    f"{name}: the pool holds latent {held.rank} and rope {held.rope}, "
                    f"declared {declared}"
                )
        paged = Paged(block_size=size or DEFAULT_BLOCK_SIZE, max_tokens=cap)
        super().__init__(codec=spec, token_geometry=paged)  # type: ignore[call-arg]
        if len(stages) > 1:  # the warm rows' exact latent, then the pool's (the last stage)
            self._use_stages(stages)
        self._start = first
        self._bind_pool(pool)

    def _bind_pool(self, pool: Any) -> None:
        """Point into ``pool`` (its shapes, once known, are the cache's)."""
        if pool is None:
            return
        self._pool = pool
        if pool.geometry is not None:
            self._take_shapes(pool.geometry)
        self._watch()

    # -- what the cache is ----------------------------------------------------------------
    @property
    def start(self) -> int:
        """The bf16-first boundary (an encoded latent; 0 for the plain one)."""
        return self._start

    @property
    def latent_spec(self) -> Latent:
        """The declaration, its latent through the pool's codec (the last stage's)."""
        spec: Latent = self._stages[-1].spec
        return spec

    @property
    def codec_spec(self) -> CodecSpec:
        """The pool's codec (the last stage's), whichever stage the rows are in."""
        spec: CodecSpec = self._stages[-1].spec
        return spec

    @property
    def encoded(self) -> bool:
        return self.latent_codec.encodes

    @property
    def converted(self) -> tuple[bool, ...]:
        """Per row, whether it reads its latent decoded (it converted: the pool's stage)."""
        last = len(self._stages) - 1
        return tuple(last > 0 and stage == last for stage in self.row_stages)

    def signature(self) -> str:
        spec = self.latent_spec
        if not self.encoded:
            return f"kv:mla-paged:{spec.signature_role}"
        return f"kv:mla-paged:{spec.signature_role}:{spec.inner.key}:{self.start}"

    def make_empty_batch(self) -> Any:
        """An empty cache of the same declaration and pool, its shapes learnt."""
        spec = self.latent_spec
        other = type(self)(
            *declaration(spec, self._token_geometry.cap()), pool=self._pool,
            block_size=self.block_size, codec=spec.inner if self.encoded else None,
            start=self.start,
        )  # fmt: skip
        other._take_shapes(self._shapes())
        return other

    def _empty_serial(self) -> Any:
        """What a row extracts into: an empty cache of this declaration (its own serial)."""
        return self.make_empty_batch()

    @property
    def block_size(self) -> int:
        size: int = self._paged.block_size  # type: ignore[attr-defined]
        return size

    def projected_bytes(self, tokens: int) -> int:
        """Bytes one row of ``tokens`` positions takes: whole blocks (capped at
        ``max_tokens``)."""
        count = as_count(tokens, "tokens")
        count = int(min(count, self.max_tokens))
        per_token = self.bytes_per_token() + self.window_token_bytes()
        return math.ceil(count / self.block_size) * self.block_size * per_token

    # -- appends and reads ------------------------------------------------------------------
    #: An exhausted pool refuses before any block or table changes: the round stays open,
    #: before its block (free blocks or append a shorter one, then resolve it).
    _spec_refused_unchanged = (PoolExhaustedError,)

    def _converts_after(self, stages: Sequence[int], offsets: Sequence[int], n: int) -> list[int]:
        """The warm rows (``stages``, ``offsets`` before the append) that convert after an
        append of ``n`` tokens: the placement reserves their blocks before it writes."""
        return due_rows(self, stages, offsets, n)

    def _append_blocks(self, latent: Any, rope: Any, index: Any | None) -> Any:
        """The placement's write and read; then the warm rows due convert into fresh
        blocks (this append read them exact; the write reserved the blocks). A fault in
        any of it puts back the pool (its journal), the host records and the warm rows
        beside the pool (contract §9)."""
        append = super()._append_blocks  # type: ignore[misc]
        append_convert = partial(_append_convert, self, partial(append, latent, rope, index))
        beside = getattr(self, "_contiguous", None)  # (the optimized twin's warm rows)
        step = append_convert
        if beside is not None:  # its rows take the append, then leave: kept, planes too
            step = partial(all_or_nothing, beside, append_convert, held=True)

        def journaled() -> Any:
            with self._pool_undoable():
                return step()

        # The host records last: the pool's undo puts back the tables it closed as they
        # were when closed (after the write), the records as they were before it.
        return all_or_nothing(self, journaled)

    # -- row operations: the placement's, per stage -----------------------------------------
    def _accepts(self, source: object) -> bool:
        """The placement's rule (this pool class, stages, block size) and the same
        declaration: signature (role, DSA, codec, ``start``) and ``max_tokens``."""
        signature = getattr(source, "signature", None)
        if not (callable(signature) and signature() == self.signature()):
            return False
        if getattr(source, "max_tokens", None) != self.max_tokens:
            return False
        accepted: bool = super()._accepts(source)  # type: ignore[misc]
        return accepted

    def _restage(self) -> None:
        """With no row, a cache writes its next rows in stage 0 again (a fresh cache)."""
        if not self.batch_size:
            self.codec = self._stages[0]

    def filter_rows(self, keep: Sequence[int]) -> None:
        super().filter_rows(keep)  # type: ignore[misc]
        self._restage()

    def release(self) -> None:
        """Give every block back to the pool now (the cache then holds no row)."""
        self._spec_guard("release")
        super().release()  # type: ignore[misc]
        self._restage()

    # -- saved state (``PAGED_LATENT_FIELDS``: ``LATENT_FIELDS``, then the block size) -------
    def _state(self) -> tuple[Any, ...]:
        """Every row's latent as the pool's codec stores it (a warm row's exact columns
        encoded per token, laid into zeros: what its conversion writes), the exact latent
        of the warm rows (zeros elsewhere; ``None`` when none is warm), the rows and their
        ``converted`` flags, the block size."""
        self._spec_guard("saving state")
        planes, rope, index = self._state_planes()
        last = len(self._stages) - 1
        stages = self.row_stages
        warm = [b for b, stage in enumerate(stages) if stage < last]
        exact = self._rows_only(self._read_all()[0], warm) if warm and self.width else None
        shapes = self._shapes()
        widths = None if shapes is None else (shapes.rank, shapes.rope)
        offsets = self._int_array(self.row_offsets)
        flags = self._int_array([int(last > 0 and stage == last) for stage in stages])
        fields = latent_state(self, planes, rope, index, exact, offsets, flags, widths)
        return (*fields, self.block_size)

    @property
    def state(self) -> tuple[Any, ...]:
        """``LATENT_FIELDS`` (the planes right-justified, compact) and the block size;
        block ids and hashes are not saved."""
        return self._state()

    @state.setter
    def state(self, value: Any) -> None:
        self._spec_guard("restoring state")
        restored = type(self).from_state(value, pool=self._pool)
        if restored.signature() != self.signature():
            raise InvalidInputError(
                state_signature_message(type(self).__name__, restored.signature(), self.signature())
            )
        self.release()
        for cache in (self, restored):  # this cache takes over the other's tables
            if cache._finalizer is not None:
                cache._finalizer.detach()
        vars(self).update(vars(restored))
        self._finalizer = None
        self._watch()

    @classmethod
    def from_state(
        cls, state: Any, meta_state: Any = None, *, keep: Any = None, geometry: Any = None,
        pool: Any = None,
    ) -> Any:  # fmt: skip
        """A cache holding ``state``: its converted rows in fresh blocks of ``pool``
        (default: a private pool), its warm rows beside it (``InvalidInputError`` when the
        state is inconsistent or not the pool's, and ``PoolExhaustedError`` when the pool
        cannot take it, the pool unchanged)."""
        name = cls.__name__
        if isinstance(state, str | bytes) or not isinstance(state, Sequence):
            raise InvalidInputError(from_state_tuple_message(name))
        if len(state) not in (len(PAGED_LATENT_FIELDS), len(LATENT_FIELDS_V1) + 1):
            raise InvalidInputError(
                f"{name}: a paged latent state has {len(PAGED_LATENT_FIELDS)} fields, got "
                f"{len(state)}"
            )
        size = _scalar(state[-1], "block_size")
        if size < 1:
            raise InvalidInputError(f"{name}: block_size must be >= 1, got {size}")
        fields, role = state_fields(name, tuple(state[:-1]))
        codec, start = codec_fields(fields)
        cache = cls(
            *declared_fields(fields), role, pool=pool, block_size=size,
            codec=codec if codec.encodes else None, start=start,
        )  # fmt: skip
        return restore_rows(cache, fields)


def due_rows(cache: Any, stages: Sequence[int], offsets: Sequence[int], n: int) -> list[int]:
    """The rows of an encoded latent ``cache`` (each in ``stages[b]`` at ``offsets[b]``)
    that are due to convert once ``n`` more tokens are written (``n = 0``: after the
    append's read; the bf16-first rule, ``Conversion.row_due``)."""
    last = len(cache._stages) - 1
    if not last or min(stages, default=last) == last:  # (every row converted: a decode step)
        return []
    rule = cache.conversion_class(cache.latent_codec, cache.start)
    return [
        b
        for b, (stage, offset) in enumerate(zip(stages, offsets, strict=True))
        if stage < last and rule.row_due(offset + n)
    ]
