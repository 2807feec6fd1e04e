"""``state`` and ``from_state`` of the optimized classes (the forms are ``kvrows.forms``).

``state`` hands out views of the held columns (what ``generate_step`` evaluates after a
prefill chunk) except where a layout's rows do not share one end column, which takes a
right-aligned copy. ``from_state`` restores a serial storage column for column (a ring
keeps its physical order and write index, so the next update fetches exactly what the
saved cache would have); a layout is rebuilt from its rows through ``merge_rows``, so its
rows hold the same tokens at the same positions in a fresh physical arrangement.
Restored arrays are owned, compact and evaluated.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

import mlx.core as mx

from kvrows.errors import (
    InvalidInputError,
    empty_row_needs_geometry_message,
    empty_state_row_message,
)
from kvrows.forms import (
    StateRow,
    describe_planes,
    pack_state,
    parse_state,
    rows_of_state,
    serial_held,
    spec_fields,
    stored_geometry,
    with_planes,
)
from kvrows.optimized.codecs import Planes, dtype_name
from kvrows.optimized.geometries.ring import _stacked
from kvrows.optimized.rows import DECLARED, Layout, Serial, Storage, kv_pair, owned, token_count
from kvrows.validation import KvGeometry

__all__ = ["restore_state", "state_of"]

_S = TypeVar("_S", bound=Storage)


def _joined(planes: list[Any]) -> Any:
    return mx.concatenate(planes, axis=2)


def _int32(values: list[int]) -> mx.array:
    return mx.array(values, dtype=mx.int32)


def state_of(storage: Storage) -> tuple[Any, ...]:
    """``storage``'s state in its ``kvrows.forms`` form: its specs' parameters (the form
    takes those it holds: a ring layout's leaves ``keep`` out), the arrangement's
    positions, the geometry's own fields (its hooks) and the planes."""
    entry = storage.composition
    fields = spec_fields(storage.codec_spec, storage.token_geometry)
    planes = storage._planes
    if not entry.is_layout:
        fields.update(
            storage._serial_form_fields(), offset=storage._offsets[0] if storage._offsets else 0
        )
        visible = None if planes is None else kv_pair(storage._visible(planes))
        return pack_state(entry, with_planes(fields, visible))
    offsets = list(storage._offsets)
    image = storage._layout_image()
    if image is not None:
        geometry_fields, pads, held = image
        fields.update(geometry_fields)
        visible = None if held is None else kv_pair(held)
    else:  # every row's window, right-aligned in a fresh copy
        rows = storage._each_row()
        lengths = [0 if h is None else token_count(h) for h, _ in rows]
        width = max(lengths, default=0)
        pads = [width - n for n in lengths]
        saved_pads = getattr(storage, "saved_pads", None)  # a shared ring's hook
        if saved_pads is not None:
            pads = saved_pads(pads)
        geometry = storage.geometry
        visible = (
            kv_pair(
                _stacked(
                    storage._zeros(len(rows), width, geometry),
                    rows,
                    lengths,
                    right_aligned=True,
                )
            )
            if width and geometry is not None
            else None
        )
        # A ring's form also counts the columns written (the furthest row) and is unrotated.
        fields.update(idx=width, total=max(offsets, default=0), rotated=False)
    pending = list(getattr(storage, "pending_left_padding", ()))
    if planes is None and any(pending):  # mlx-lm's left-padded empty batch: offset = -pads
        offsets = [o - p for o, p in zip(offsets, pending, strict=True)]
        pads = [a + p for a, p in zip(pads, pending, strict=True)]
    fields.update(offset=_int32(offsets), left_padding=_int32(pads))
    return pack_state(entry, with_planes(fields, visible))


def rows_offsets(fields: dict[str, Any]) -> list[int]:
    offsets = fields["offset"]
    return [int(o) for o in (offsets.tolist() if hasattr(offsets, "tolist") else offsets)]


def _as_planes(value: Any, count: int, name: str) -> Planes:
    planes = tuple(value) if isinstance(value, tuple | list) else (value,)
    if len(planes) != count or not all(isinstance(p, mx.array) and p.ndim == 4 for p in planes):
        raise InvalidInputError(
            f"state {name} must be {count} mx.array plane(s) [B, H, T, ·], "
            f"got {describe_planes(value)}"
        )
    return planes


def restore_state(
    cls: type[_S],
    state: Any,
    meta_state: Any = None,
    *,
    keep: int | None = None,
    geometry: KvGeometry | None = None,
) -> _S:
    """A new ``cls`` holding ``state`` (``meta_state``: mlx-lm's older two-part form).
    ``keep`` is a ring layout's sink count (not in the form); ``geometry`` the declared KV
    geometry of an empty state."""
    entry = cls.composition
    parsed = parse_state(entry, state, meta_state, keep=keep)
    fields, codec_spec, token_geometry = parsed.fields, parsed.codec, parsed.token_geometry
    fresh = cls.from_specs(codec_spec, token_geometry)
    if fields["keys"] is None:
        fresh._geometry = geometry
        if entry.is_layout:
            serial = DECLARED[entry.serial or entry.name]
            empties: list[Any] = [
                _serial_row(serial, codec_spec, token_geometry, row, geometry)
                for row in rows_of_state(entry, fields, _joined, keep=keep or 0)
            ]
            _as_layout(fresh).merge_rows(empties)
            pending = [max(0, -o) for o in rows_offsets(fields)]
            if any(pending):  # rows announced with left padding (mlx-lm's empty batch)
                prepare = getattr(fresh, "prepare", None)
                if prepare is None:
                    raise InvalidInputError(f"{entry.name} takes no pending left padding")
                prepare(left_padding=pending)
        return fresh
    keys = _as_planes(fields["keys"], parsed.key_planes, "keys")
    values = _as_planes(fields["values"], parsed.value_planes, "values")
    fields["keys"], fields["values"] = keys, values
    kv = stored_geometry(codec_spec, keys, values, dtype_name, geometry)
    fresh.codec.check(kv)
    if not entry.is_layout:
        return _restore_serial(fresh, fields, kv)
    rows = rows_of_state(entry, fields, _joined, keep=keep or 0)
    serial_cls = DECLARED[entry.serial or entry.name]
    sources: list[Any] = [
        _serial_row(serial_cls, codec_spec, token_geometry, row, kv) for row in rows
    ]
    fresh._geometry = kv
    _as_layout(fresh).merge_rows(sources)
    restore_pads = getattr(fresh, "restore_pads", None)  # a shared ring's hook
    if restore_pads is not None:
        saved = rows_offsets({"offset": fields["left_padding"]})
        held = [0 if k is None else int(k[0].shape[2]) for k, _, _ in rows]
        restore_pads(saved, int(keys[0].shape[2]), held)
    mx.eval(*fresh.held_arrays())  # owned by the layout, evaluated: nothing pins the state
    return fresh


def _as_serial(storage: Storage) -> Serial:
    """``storage`` typed as the serial storage its composition declares (the table, not a
    type test, says which arrangement a class is)."""
    return cast(Serial, storage)


def _as_layout(storage: Storage) -> Layout:
    """``storage`` typed as the layout its composition declares."""
    return cast(Layout, storage)


def _serial_row(
    cls: type[Storage], codec: Any, token_geometry: Any, row: StateRow, kv: KvGeometry | None
) -> Storage:
    """A transient merge source holding one state row as views: ``merge_rows`` copies
    them into the layout's own buffers, so copying them here too would copy twice."""
    serial = cls.from_specs(codec, token_geometry)
    keys, values, offset = row
    if keys is None or values is None:
        serial._geometry = kv
        if offset and not token_geometry.evicts:  # a row holding nothing stands at 0
            raise InvalidInputError(empty_state_row_message(offset))
        if offset:  # a row that forgot every token it held (chunked)
            if kv is None:
                raise InvalidInputError(empty_row_needs_geometry_message(offset))
            empty = serial._zeros(1, 0, kv)
            return _as_serial(serial).adopt(empty, offset, kv)
        return serial
    return _as_serial(serial).adopt({"keys": keys, "values": values}, offset, kv)


def _restore_serial(fresh: _S, fields: dict[str, Any], kv: KvGeometry) -> _S:
    """Column for column: the held columns (owned), the position, a ring's write index."""
    offset = fields["offset"]
    keys, values = fields["keys"], fields["values"]
    columns = int(keys[0].shape[2])
    start = fields.get("start_position")  # a chunked row holds [start_position, offset)
    held = min(offset, columns) if start is None else serial_held(offset, start, columns)
    # A geometry without a cap holds every position it was given.
    if offset < 0 or (fresh.token_geometry.cap() is None and held != offset):
        raise InvalidInputError(f"state offset {offset} but keys hold {keys[0].shape[2]} columns")
    owned_keys = tuple(owned(p[:, :, :held]) for p in keys)
    owned_values = tuple(owned(p[:, :, :held]) for p in values)
    mx.eval(*owned_keys, *owned_values)
    _as_serial(fresh).adopt({"keys": owned_keys, "values": owned_values}, offset, kv)
    fresh._resume_serial(fields, held)
    return fresh
