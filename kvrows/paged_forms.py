"""The saved-state forms of the paged storages (``spec/persistence.md``, ``kvrows.forms``).

A block table means nothing outside its pool, so a paged state holds what the table
reads, compact and in logical order, plus what rebuilds the tables:

* ``PagedKVCache``: ``keys, values, offset, block_size, codec`` (``keys`` / ``values``:
  the codec's planes ``[B, H, offset, ·]``; ``codec``: ``(kind, a, b)``, see
  :func:`codec_field`);
* ``PagedKvRows``: ``keys, values, offset[B], left_padding[B], idx, block_size, codec``,
  right-aligned as every layout form (row ``b`` in columns ``[left_padding[b], idx)``).

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
from kvrows.errors import CorruptStateError, not_an_integer_message
from kvrows.forms import TURBO_STATE_DTYPE, state_form
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
    """``planes`` as a tuple of ``[rows, H, width, ·]`` arrays, as many as ``spec`` stores."""
    if width == 0:
        if planes is not None:
            raise CorruptStateError(f"an empty state holds no {role} planes (None)")
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


def restore_state(cls: Any, state: Any, geometry: KvGeometry | None, pool: Any = None) -> Any:
    """A new ``cls`` holding ``state`` (in ``pool`` when given, else a private pool): each
    implementation checks it with :func:`parse_state` and writes its rows
    (``cls._restore_paged``)."""
    return cls._restore_paged(state, geometry, pool)


def parse_state(
    cls: Any, state: Any, geometry: KvGeometry | None, pool: Any,
    shape: Callable[[Any], tuple[int, ...]], dtype_name: Callable[[Any], str],
) -> PagedState:  # fmt: skip
    """``state`` checked against ``cls``'s form (``CorruptStateError`` otherwise);
    ``shape`` / ``dtype_name`` read the implementation's arrays."""
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
        rows = shape(held[0])[0] if isinstance(held, tuple | list) and held else 1
        offsets, pads = [width] * rows, [0] * rows
    keys = _check_planes(values["keys"], spec, "keys", shape, rows, width)
    vals = _check_planes(values["values"], spec, "values", shape, rows, width)
    learnt = geometry if width == 0 else _geometry_of(spec, keys, vals, shape, dtype_name, geometry)
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
