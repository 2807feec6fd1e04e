"""The saved-state forms of the paged storages (``spec/persistence.md``, ``kvrows.forms``).

A block table means nothing outside its pool, so a paged state holds what the table
reads, compact and in logical order, plus what rebuilds the tables:

* ``PagedKVCache``: ``keys, values, offset, block_size, codec`` (``keys`` / ``values``:
  the codec's planes ``[B, H, offset, ·]``, zero-width while the rows hold no position,
  ``None`` before any row; ``codec``: ``(kind, a, b)``, see :func:`codec_field`);
* ``PagedKvRows``: ``keys, values, offset[B], left_padding[B], idx, block_size, codec``,
  right-aligned as every layout form (row ``b`` in columns ``[left_padding[b], idx)``);
* the paged rings by the same rule (the planes, the ring geometry's fields, the
  placement's): ``PagedRotatingKVCache``: ``keys, values, offset, keep, max_size, idx,
  block_size, codec`` (the row's sinks and newest positions in time order, ``idx`` their
  count); ``PagedRotatingRows``: ``keys, values, offset[B], left_padding[B], max_size,
  total, idx, rotated, block_size, codec`` (right-aligned, never rotated; ``keep`` from
  the file's metadata, as every ring layout's).

Loading writes the positions into fresh blocks of a private pool (or of ``pool``): the
round trip is bit-exact in the logical KV; block ids and the prefix cache are not saved
(a loaded request publishes its prefix again if it wants it shared).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvrows.codec import CodecSpec, codec_plane_specs
from kvrows.codecs import kv_codecs
from kvrows.compositions import composition
from kvrows.errors import CorruptStateError, InvalidInputError, not_an_integer_message
from kvrows.forms import (
    TURBO_STATE_DTYPE,
    geometry_from_fields,
    rows_of_state,
    state_form,
    unpack_state,
)
from kvrows.schemes import GeometrySpec
from kvrows.validation import FLOAT_DTYPES, KvGeometry

__all__ = [
    "PAGED_LAYOUT_FIELDS",
    "PAGED_SERIAL_FIELDS",
    "PagedState",
    "codec_field",
    "codec_named",
    "parse_state",
    "restore_state",
]

PAGED_SERIAL_FIELDS = state_form(composition("PagedKVCache")).fields
PAGED_LAYOUT_FIELDS = state_form(composition("PagedKvRows")).fields


#: The ``codec`` field: ``(kind, a, b)``, ``kind`` the codec's ``tag`` (0 plain (0, 0), 1
#: affine (bits, group_size), 2 TurboQuant (k_bits, v_bits)), ``a, b`` its
#: ``paged_fields`` (0 where it has fewer): integers, so files carry it as scalars.
def codec_field(spec: CodecSpec) -> tuple[int, int, int]:
    """The saved ``codec`` field of ``spec``."""
    parameters = spec.parameters()
    a, b = (*(parameters[name] for name in spec.paged_fields), 0, 0)[:2]
    return spec.tag, a, b


def codec_named(field: object) -> CodecSpec:
    """The codec spec a saved ``codec`` field names (``CorruptStateError`` otherwise)."""
    if hasattr(field, "tolist"):
        field = field.tolist()
    if not isinstance(field, Sequence) or isinstance(field, str | bytes) or len(field) != 3:
        raise CorruptStateError(f"the state's codec field must be (kind, a, b), got {field!r}")
    kind, a, b = (_int("codec", v) for v in field)
    for codec in kv_codecs().values():
        names = codec.paged_fields
        if codec.tag != kind or any((a, b)[len(names) :]):  # an unused slot holds 0
            continue
        try:
            return codec.from_parameters(dict(zip(names, (a, b), strict=False)))
        except (ValueError, TypeError) as error:
            raise CorruptStateError(
                f"the state names an unknown codec {field!r}: {error}"
            ) from None
    raise CorruptStateError(f"the state names an unknown codec {field!r}")


def _int(name: str, value: object) -> int:
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise CorruptStateError(not_an_integer_message(f"state field {name}", value))
    return operator.index(value)


def _ints(name: str, value: object, count: int) -> list[int]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, Sequence) or len(value) != count:
        raise CorruptStateError(f"state field {name} must hold {count} integers")
    return [_int(f"{name}[{i}]", v) for i, v in enumerate(value)]


def _check_planes(
    planes: object, spec: CodecSpec, role: str, shape: Any, rows: int, width: int
) -> tuple[Any, ...]:
    """``planes`` as a tuple of ``[rows, H, width, ·]`` arrays, as many as ``spec`` stores
    (``()`` for ``None``: a state of no position may omit them; saved, zero-width planes
    keep the rows and the geometry of rows that hold no position)."""
    if width == 0 and planes is None:
        return ()
    if not isinstance(planes, tuple | list):
        raise CorruptStateError(f"state field {role} must be a tuple of planes")
    planes = tuple(planes)
    expected = len(codec_plane_specs(spec, role, 128, "float32", _role(role)))  # any codec
    if len(planes) != expected:
        raise CorruptStateError(
            f"{spec.name} stores {role} as {expected} planes, got {len(planes)}"
        )
    for plane in planes:
        dims = shape(plane)
        if len(dims) != 4 or dims[0] != rows or dims[2] != width:
            raise CorruptStateError(
                f"{role} planes must be [{rows}, H, {width}, ·], got {tuple(dims)}"
            )
    return planes


def _role(name: str) -> Any:
    return "keys" if name == "keys" else "values"


@dataclass(frozen=True)
class PagedState:
    """A checked paged state: each row's ``offset`` positions sit at columns ``[pad,
    width)`` of ``keys`` / ``values`` (``()`` when ``width`` is 0), in a pool of
    ``spec`` and ``block_size``; ``geometry``: the KV geometry the planes imply."""

    spec: CodecSpec
    block_size: int
    layout: bool
    offsets: list[int]
    pads: list[int]
    width: int
    keys: tuple[Any, ...]
    values: tuple[Any, ...]
    geometry: KvGeometry | None
    #: Positions each row holds (a growing row: its offset; a ring row: its sinks and
    #: newest), and, for a ring, the token geometry and each row's planes in time order.
    retained: list[int] | None = None
    token: GeometrySpec | None = None
    rows: list[tuple[Any, Any]] | None = None

    @property
    def names_rows(self) -> bool:
        """Whether the state names its rows though none may hold a position: a layout's
        offsets, a serial state's zero-width planes (a serial state of no planes: none)."""
        return self.layout or bool(self.keys) or any(k is not None for k, _ in self.rows or ())

    def held(self) -> list[int]:
        """Positions each row holds."""
        return self.offsets if self.retained is None else self.retained

    def row_planes(self, b: int) -> dict[str, tuple[Any, ...]]:
        """Row ``b``'s key and value planes (``[1, H, held, ·]``, views), time order (a row
        of a layout that holds no position: none)."""
        if self.rows is not None:
            keys, values = self.rows[b]
            if keys is None or values is None:
                return {}
            return {"keys": tuple(keys), "values": tuple(values)}
        start = self.pads[b]
        cut = {"keys": self.keys, "values": self.values}
        return {t: tuple(p[b : b + 1, :, start : self.width] for p in ps) for t, ps in cut.items()}


def restore_state(
    cls: Any, state: Any, geometry: KvGeometry | None, pool: Any = None, *, keep: int = 0
) -> Any:
    """A new ``cls`` holding ``state`` (in ``pool`` when given, else a private pool): each
    implementation checks it with :func:`parse_state` and writes its rows
    (``cls._restore_paged``; ``keep``: a ring layout's sinks, its form omits them)."""
    return cls._restore_paged(state, geometry, pool, keep)


def parse_state(
    cls: Any, state: Any, geometry: KvGeometry | None, pool: Any,
    shape: Callable[[Any], tuple[int, ...]], dtype_name: Callable[[Any], str],
    *, keep: int = 0, concat: Callable[[Any], Any] | None = None,
) -> PagedState:  # fmt: skip
    """``state`` checked against ``cls``'s form (``CorruptStateError`` otherwise);
    ``shape`` / ``dtype_name`` read the implementation's arrays, ``concat`` joins planes
    along the token axis (a ring's rows), ``keep`` a ring layout's sinks."""
    if cls.composition.params:  # a ring: the generic rule's parse
        assert concat is not None
        return _parse_ring(cls, state, geometry, pool, shape, dtype_name, keep, concat)
    layout = cls.composition.is_layout
    fields = PAGED_LAYOUT_FIELDS if layout else PAGED_SERIAL_FIELDS
    if not isinstance(state, tuple | list) or len(state) != len(fields):
        raise CorruptStateError(f"a {cls.__name__} state holds {', '.join(fields)}")
    values = dict(zip(fields, state, strict=True))
    spec = codec_named(values["codec"])
    block_size = _int("block_size", values["block_size"])
    if block_size < 1:
        raise CorruptStateError(f"block_size must be positive, got {block_size}")
    if layout:
        listed = (
            values["offset"].tolist() if hasattr(values["offset"], "tolist") else values["offset"]
        )
        rows = len(listed) if isinstance(listed, Sequence) else -1
        offsets = _ints("offset", listed, rows)
        pads = _ints("left_padding", values["left_padding"], rows)
        width = _int("idx", values["idx"])
        if any(o < 0 for o in offsets) or any(
            p + o != width for p, o in zip(pads, offsets, strict=True)
        ):
            raise CorruptStateError("row offsets and left padding must end every row at idx")
    else:
        width = _int("offset", values["offset"])
        if width < 0:
            raise CorruptStateError(f"offset must be >= 0, got {width}")
        held = values["keys"]
        dims = shape(held[0]) if isinstance(held, tuple | list) and held else ()
        rows = dims[0] if dims else 1  # (planes of another kind: refused below)
        offsets, pads = [width] * rows, [0] * rows
    keys = _check_planes(values["keys"], spec, "keys", shape, rows, width)
    vals = _check_planes(values["values"], spec, "values", shape, rows, width)
    # Zero-width planes of a codec whose planes do not carry the activations' dtype
    # (TurboQuant) teach no geometry: the rows' count only, the geometry at the next write.
    if bool(keys) != bool(vals):
        raise CorruptStateError("a state holds both keys and values planes or neither")
    knows = bool(keys) and (width > 0 or spec.dtype_plane is not None or geometry is not None)
    learnt = _geometry_of(spec, keys, vals, shape, dtype_name, geometry) if knows else geometry
    if pool is not None and (pool.codec_spec != spec or pool.block_size != block_size):
        raise CorruptStateError("the state's codec or block size is not the pool's")
    return PagedState(spec, block_size, layout, offsets, pads, width, keys, vals, learnt)


def _geometry_of(
    spec: CodecSpec, keys: tuple[Any, ...], values: tuple[Any, ...],
    shape: Callable[[Any], tuple[int, ...]], dtype_name: Callable[[Any], str],
    declared: KvGeometry | None,
) -> KvGeometry:  # fmt: skip
    """The KV geometry the planes imply (the declared one must agree)."""
    heads, key_width, value_width = (
        shape(keys[0])[1],
        shape(keys[0])[3],
        shape(values[0])[3],
    )
    dims = spec.head_dim(key_width, "keys"), spec.head_dim(value_width, "values")
    if spec.dtype_plane is not None:  # the plane that carries the activations' dtype
        geometry = KvGeometry(heads, *dims, dtype_name(keys[spec.dtype_plane]))
    elif declared is not None:
        geometry = declared
    else:  # TurboQuant planes do not say the activation dtype
        geometry = KvGeometry(heads, *dims, TURBO_STATE_DTYPE)
    if geometry.dtype not in FLOAT_DTYPES:
        raise CorruptStateError(f"the state's dtype {geometry.dtype} is not a float dtype")
    if declared is not None and declared != geometry:
        raise CorruptStateError(f"the state holds {geometry.describe()}, not {declared.describe()}")
    for role, planes, dim in (
        ("keys", keys, geometry.key_dim),
        ("values", values, geometry.value_dim),
    ):
        specs = codec_plane_specs(spec, role, dim, geometry.dtype, _role(role))
        for plane, plane_spec in zip(planes, specs, strict=True):
            held = shape(plane)
            if held[1] != geometry.heads or held[3] != plane_spec.width:
                raise CorruptStateError(
                    f"{plane_spec.name} must be [·, {geometry.heads}, ·, {plane_spec.width}], "
                    f"got {tuple(held)}"
                )
            if dtype_name(plane) != plane_spec.dtype:
                raise CorruptStateError(
                    f"{plane_spec.name} must be {plane_spec.dtype}, got {dtype_name(plane)}"
                )
    return geometry


def _parse_ring(
    cls: Any, state: Any, geometry: KvGeometry | None, pool: Any,
    shape: Callable[[Any], tuple[int, ...]], dtype_name: Callable[[Any], str],
    keep: int, concat: Callable[[Any], Any],
) -> PagedState:  # fmt: skip
    """A paged ring's state (``kvrows.forms.rows_of_state`` reads its rows, in time order)."""
    entry = cls.composition
    fields = state_form(entry).fields
    if not isinstance(state, tuple | list) or len(state) != len(fields):
        raise CorruptStateError(f"a {cls.__name__} state holds {', '.join(fields)}")
    raw = dict(zip(fields, state, strict=True))
    spec = codec_named(raw["codec"])
    block_size = _int("block_size", raw["block_size"])
    if block_size < 1:
        raise CorruptStateError(f"block_size must be positive, got {block_size}")
    try:
        values = unpack_state(entry, tuple(state))
        token = geometry_from_fields(entry, values, keep=keep)
        rows = rows_of_state(entry, values, concat, keep=getattr(token, "keep", 0))
    except (InvalidInputError, ValueError, TypeError, KeyError) as error:
        raise CorruptStateError(f"a corrupt {cls.__name__} state: {error}") from None
    # A ring row holds its whole window; a chunked row may hold fewer (a trim after its
    # front trim), never more than its offset.
    cap = (token.cap() or 0) if token.wraps else 0
    offsets = [offset for _, _, offset in rows]
    held = [0 if k is None else shape(k[0])[2] for k, _, _ in rows]
    for b, (offset, count) in enumerate(zip(offsets, held, strict=True)):
        if offset < 0 or count > offset or count < min(offset, cap):
            raise CorruptStateError(
                f"state row {b} holds {count} positions at offset {offset}: a row holds at "
                f"least min(offset, {cap}) (a ring's window) and at most its offset"
            )
    planes = [(k, v) for k, v, _ in rows]
    learnt = geometry
    for (k, v), count in zip(planes, held, strict=True):
        # (zero-width planes teach the geometry where the codec's carry the dtype)
        if count or (k is not None and (spec.dtype_plane is not None or learnt is not None)):
            k = _check_planes(k, spec, "keys", shape, 1, count)
            v = _check_planes(v, spec, "values", shape, 1, count)
            learnt = _geometry_of(spec, k, v, shape, dtype_name, learnt)
    if pool is not None and (pool.codec_spec != spec or pool.block_size != block_size):
        raise CorruptStateError("the state's codec or block size is not the pool's")
    width = max(held, default=0)
    return PagedState(
        spec, block_size, entry.is_layout, offsets, [0] * len(rows), width, (), (), learnt,
        retained=held, token=token, rows=planes,
    )  # fmt: skip
