"""``state`` and ``from_state`` of the reference classes (the forms are ``kvrows.forms``).

The reference holds rows, not buffers, so its state is the canonical form: a serial
ring's retained tokens in temporal order (``idx`` = the count), a layout's rows
right-aligned in temporal order (a ring layout unrotated, ``total`` the furthest row
position). The optimized state of the same cache may differ in physical column order;
the conformance suite compares the rows both forms hold (``kvrows.forms.rows_of_state``).
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

from kvrows.codec import PlaneSet
from kvrows.errors import (
    InvalidInputError,
    empty_row_needs_geometry_message,
    empty_state_row_message,
)
from kvrows.forms import (
    describe_planes,
    pack_state,
    parse_state,
    rows_of_state,
    spec_fields,
    stored_geometry,
    with_planes,
)
from kvrows.reference.codecs import Planes, dtype_name
from kvrows.reference.rows import Row, RowLayout, SerialStorage, Storage, zero_planes
from kvrows.validation import KvGeometry

__all__ = ["restore_state", "state_of"]

_S = TypeVar("_S", bound=Storage)


def _joined(planes: list[Any]) -> Any:
    return np.concatenate(planes, axis=2)


def _int32(values: list[int]) -> npt.NDArray[np.int32]:
    return np.array(values, dtype=np.int32)


def _right_aligned(storage: Storage, rows: list[Row], width: int) -> tuple[Planes, Planes]:
    geometry = storage.geometry
    assert geometry is not None
    image = zero_planes(storage.codec, geometry, len(rows), width)
    for b, row in enumerate(rows):
        start = width - row.retained
        for tensor, held in row.planes.items():
            for plane, piece in zip(image[tensor], held, strict=True):
                plane[b : b + 1, :, start:width] = piece
    return image["keys"], image["values"]


def state_of(storage: Storage) -> tuple[Any, ...]:
    """``storage``'s state in its canonical ``kvrows.forms`` form: its specs' parameters
    (the form takes those it holds), the arrangement's positions, the rows' columns."""
    entry = storage.composition
    fields = spec_fields(storage.codec_spec, storage.token_geometry)
    if not entry.is_layout:
        serial = _as_serial(storage)
        # ``idx`` (a ring's): the retained columns, in time order.
        # ``start_position`` (a chunked row's): the first position it holds.
        held = serial.retained
        fields.update(offset=serial.offset, idx=held, start_position=serial.offset - held)
        return pack_state(entry, with_planes(fields, serial.planes()))
    layout = _as_layout(storage)
    offsets = [row.offset for row in layout._rows]
    place = layout._place
    image = getattr(place, "saved_image", lambda rows: None)(layout._rows)
    if image is not None:  # a shared ring without sinks: mlx-lm's form, its live pads
        width, rows, total = image
        pads = [row.pad for row in layout._rows]
    else:
        rows = [layout._cut(row) for row in layout._rows]
        width = max((row.retained for row in rows), default=0)
        pads = [width - row.retained for row in rows]
        saved_pads = getattr(place, "saved_pads", None)  # a shared ring's hook
        if saved_pads is not None:
            pads = saved_pads(layout._rows, pads)
        total = max(offsets, default=0)
    # ``total`` and ``rotated``: a ring's (the columns written; unrotated, in time order).
    fields.update(
        offset=_int32(offsets), left_padding=_int32(pads), idx=width, total=total, rotated=False
    )
    stacked = _right_aligned(storage, rows, width) if width else None
    return pack_state(entry, with_planes(fields, stacked))


def _as_serial(storage: Storage) -> SerialStorage:
    """``storage`` typed as the serial storage its composition declares (the table, not a
    type test, says which arrangement a class is)."""
    return cast(SerialStorage, storage)


def _as_layout(storage: Storage) -> RowLayout:
    """``storage`` typed as the layout its composition declares."""
    return cast(RowLayout, storage)


def _as_planes(value: Any, count: int, name: str) -> Planes:
    planes = tuple(value) if isinstance(value, tuple | list) else (value,)
    if len(planes) != count or not all(isinstance(p, np.ndarray) and p.ndim == 4 for p in planes):
        raise InvalidInputError(
            f"state {name} must be {count} NumPy plane(s) [B, H, T, ·], "
            f"got {describe_planes(value)}"
        )
    return planes


def _copied(planes: tuple[Any, ...]) -> Planes:
    return tuple(np.array(p, copy=True) for p in planes)


def _kv_planes(keys: tuple[Any, ...], values: tuple[Any, ...]) -> PlaneSet:
    """A row's plane set from a saved state's key and value planes (owned copies)."""
    return {"keys": _copied(keys), "values": _copied(values)}


def restore_state(
    cls: type[_S],
    state: Any,
    meta_state: Any = None,
    *,
    keep: int | None = None,
    geometry: KvGeometry | None = None,
) -> _S:
    """A new ``cls`` holding ``state`` (see ``optimized/forms.py`` for the parameters)."""
    entry = cls.composition
    parsed = parse_state(entry, state, meta_state, keep=keep)
    fields, codec_spec, token_geometry = parsed.fields, parsed.codec, parsed.token_geometry
    fresh = cls.from_specs(codec_spec, token_geometry)
    kv = geometry
    if fields["keys"] is not None:
        fields["keys"] = _as_planes(fields["keys"], parsed.key_planes, "keys")
        fields["values"] = _as_planes(fields["values"], parsed.value_planes, "values")
        kv = stored_geometry(codec_spec, fields["keys"], fields["values"], dtype_name, geometry)
        fresh.codec.check(kv)
    rows = rows_of_state(entry, fields, _joined, keep=keep or 0)
    fresh._geometry = kv
    # A ring row never evicts its first ``keep`` positions (its sinks).
    sinks = fresh._sinks
    if not entry.is_layout:
        offset = fields["offset"]
        # A geometry without a cap holds every position it was given.
        if fields["keys"] is not None and (
            offset < 0 or (token_geometry.cap() is None and rows[0][0] is not None
                           and int(rows[0][0][0].shape[2]) != offset)
        ):  # fmt: skip
            raise InvalidInputError(f"state offset {offset} disagrees with the keys it holds")
        fresh._rows = [
            Row(_kv_planes(k, v), offset, sinks=sinks)
            for k, v, _ in rows
            if k is not None and v is not None
        ]
        return fresh
    layout = _as_layout(fresh)
    sources = []
    for keys, values, offset in rows:
        serial = layout.serial_class.from_specs(codec_spec, token_geometry)
        serial._geometry = kv
        if keys is not None and values is not None:
            serial._rows = [Row(_kv_planes(keys, values), offset, sinks=sinks)]
        elif offset and token_geometry.evicts:  # a row that forgot every token it held
            if kv is None:
                raise InvalidInputError(empty_row_needs_geometry_message(offset))
            serial._rows = [Row(zero_planes(layout.codec, kv, 1, 0), offset, sinks=sinks)]
        elif offset:
            raise InvalidInputError(empty_state_row_message(offset))
        sources.append(serial)
    layout.merge_rows(sources)
    restore_pads = getattr(layout._place, "restore_pads", None)  # a shared ring's hook
    if restore_pads is not None and fields["keys"] is not None:
        saved = [int(p) for p in np.asarray(fields["left_padding"]).tolist()]
        held = [0 if keys is None else int(keys[0].shape[2]) for keys, _, _ in rows]
        restore_pads(layout._rows, saved, int(fields["keys"][0].shape[2]), held)
    return fresh
