"""State forms: what ``state`` holds for each composition and what ``from_state`` takes.

A storage's ``state`` is a tuple whose layout depends only on its geometry, its
arrangement and its codec (one rule per axis, not one per class):

===================  ==============================================================
geometry/arrangement fields
===================  ==============================================================
growing, serial      ``keys, values, offset``
ring, serial         ``keys, values, offset, keep, max_size, idx``
growing, layout      ``keys, values, offset[B], left_padding[B], idx``
ring, layout         ``keys, values, offset[B], left_padding[B], max_size, total, idx,
                     rotated``
===================  ==============================================================

The affine codec makes ``keys`` / ``values`` the ``(packed, scales, biases)`` triples of
``mx.quantize`` and appends ``group_size, bits``. Those are exactly the forms of mlx-lm
0.32.2's ``KVCache``, ``RotatingKVCache``, ``QuantizedKVCache``, ``BatchKVCache`` and
``BatchRotatingKVCache``, so mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache`` read
and write kvrows states for the classes it has (``FILE_CLASSES`` names them), and kvrows
reads mlx-lm's. A ring layout's ``keep`` is not in mlx-lm's batch form (its bug B7):
kvrows' files carry it in their metadata, and ``from_state`` takes it as a parameter.

Layout forms are right-aligned: row ``b``'s tokens sit in columns
``[left_padding[b], idx)`` (a ring layout in its physical order, see
``spec/persistence.md``). This module is array-library free: it names and checks the
fields; each implementation turns them into arrays.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvrows.compositions import Composition
from kvrows.errors import InvalidInputError, UnsupportedStateError
from kvrows.schemes import Affine, CodecSpec, GeometrySpec, Growing, Plain, Ring
from kvrows.validation import KvGeometry

__all__ = [
    "FILE_CLASSES",
    "FORMAT_VERSION",
    "ParsedState",
    "StateForm",
    "StateRow",
    "chronological",
    "codec_from_fields",
    "geometry_from_fields",
    "kv_geometry_of",
    "legacy_state",
    "pack_state",
    "parse_state",
    "rows_of_state",
    "state_form",
    "unpack_state",
]

#: The version of kvrows' saved-state format. A file from a newer version is refused.
FORMAT_VERSION = 1

_SERIAL = {
    "growing": ("keys", "values", "offset"),
    "ring": ("keys", "values", "offset", "keep", "max_size", "idx"),
}
_LAYOUT = {
    "growing": ("keys", "values", "offset", "left_padding", "idx"),
    "ring": (
        "keys", "values", "offset", "left_padding", "max_size", "total", "idx", "rotated",
    ),
}  # fmt: skip
_CODEC_TAIL = {"plain": (), "affine": ("group_size", "bits")}

#: mlx-lm's class for each form it has: (geometry, arrangement is a layout, codec).
_MLX_LM_CLASSES = {
    ("growing", False, "plain"): "KVCache",
    ("growing", False, "affine"): "QuantizedKVCache",
    ("ring", False, "plain"): "RotatingKVCache",
    ("growing", True, "plain"): "BatchKVCache",
    ("ring", True, "plain"): "BatchRotatingKVCache",
}

#: mlx-lm class name -> the kvrows composition a file entry of that class loads into.
FILE_CLASSES: Mapping[str, str] = {
    "KVCache": "KVCache",
    "QuantizedKVCache": "QuantizedKVCache",
    "RotatingKVCache": "RotatingKVCache",
    "BatchKVCache": "BatchedKVCache",
    "BatchRotatingKVCache": "RaggedRotatingRows",
}


@dataclass(frozen=True)
class StateForm:
    """The ``state`` layout of one composition.

    ``fields``: the tuple's entries by name; ``file_class``: the class name a prompt-cache
    file records (mlx-lm's class when the form is its, else the composition's name)."""

    composition: str
    fields: tuple[str, ...]
    file_class: str


def state_form(entry: Composition) -> StateForm:
    """The state form of a landed composition (``UnsupportedStateError`` for others)."""
    fields = (_LAYOUT if entry.is_layout else _SERIAL).get(entry.geometry)
    tail = _CODEC_TAIL.get(entry.codec)
    # A speculative layout outside a round holds what its unmodified layout holds.
    if fields is None or tail is None or entry.modifiers - {"speculative"}:
        raise UnsupportedStateError(
            f"{entry.name} has no saved-state form yet (issue {entry.issue or '?'} adds it)"
        )
    peer = _MLX_LM_CLASSES.get((entry.geometry, entry.is_layout, entry.codec))
    return StateForm(entry.name, fields + tail, peer or entry.name)


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidInputError(f"state field {name} must be an integer, got {value!r}")
    return operator.index(value)


def unpack_state(entry: Composition, state: object) -> dict[str, Any]:
    """``state`` checked against ``entry``'s form, by field name (scalars as ints)."""
    form = state_form(entry)
    if not isinstance(state, Sequence) or isinstance(state, str | bytes):
        raise InvalidInputError(f"{entry.name} state must be a tuple {form.fields}, got {state!r}")
    if len(state) != len(form.fields):
        raise InvalidInputError(
            f"{entry.name} state has {len(form.fields)} fields {form.fields}, got {len(state)}"
        )
    values = dict(zip(form.fields, state, strict=True))
    for name in ("keep", "max_size", "idx", "total", "group_size", "bits"):
        if name in values:
            values[name] = _integer(name, values[name])
    if "offset" in values and not entry.is_layout:
        values["offset"] = _integer("offset", values["offset"])
    if "rotated" in values:
        values["rotated"] = bool(values["rotated"])
    if (values["keys"] is None) != (values["values"] is None):
        raise InvalidInputError(f"{entry.name} state: keys and values must both be set or None")
    return values


def pack_state(entry: Composition, values: Mapping[str, Any]) -> tuple[Any, ...]:
    """The ``state`` tuple of ``entry`` from its fields by name."""
    return tuple(values[name] for name in state_form(entry).fields)


def codec_from_fields(entry: Composition, values: Mapping[str, Any]) -> CodecSpec:
    if entry.codec == "affine":
        return Affine(bits=values["bits"], group_size=values["group_size"])
    return Plain()


def geometry_from_fields(
    entry: Composition, values: Mapping[str, Any], *, keep: int | None = None
) -> GeometrySpec:
    """The token geometry a state describes (a ring layout's ``keep`` comes from outside)."""
    if entry.geometry != "ring":
        return Growing()
    return Ring(max_size=values["max_size"], keep=values.get("keep", keep or 0))


def kv_geometry_of(
    codec: CodecSpec, keys: Sequence[Any], values: Sequence[Any], dtype: str
) -> KvGeometry:
    """The KV geometry of stored planes (``keys``/``values``: the codec's plane tuples,
    ``[B, H, T, ·]``; ``dtype``: the floating dtype they were written from)."""
    heads = int(keys[0].shape[1])
    if isinstance(codec, Affine):
        # ``D * bits / 32`` packed words per token: the head dim is words x 32 / bits.
        return KvGeometry(
            heads,
            int(keys[0].shape[3]) * 32 // codec.bits,
            int(values[0].shape[3]) * 32 // codec.bits,
            dtype,
        )
    return KvGeometry(heads, int(keys[0].shape[3]), int(values[0].shape[3]), dtype)


def _planes(value: Any) -> tuple[Any, ...] | None:
    if value is None:
        return None
    return tuple(value) if isinstance(value, tuple | list) else (value,)


def _ints(value: Any, name: str) -> list[int]:
    items = value.tolist() if hasattr(value, "tolist") else list(value)
    if not isinstance(items, list):
        raise InvalidInputError(f"state field {name} must be a 1-D array of ints, got {value!r}")
    return [_integer(name, item) for item in items]


def _cut(planes: tuple[Any, ...], row: int | None, start: int, stop: int) -> tuple[Any, ...]:
    if row is None:
        return tuple(p[:, :, start:stop] for p in planes)
    return tuple(p[row : row + 1, :, start:stop] for p in planes)


def chronological(
    planes: tuple[Any, ...], idx: int, rotated: bool, keep: int, concat: Any
) -> tuple[Any, ...]:
    """A ring buffer's columns in temporal order: the ``keep`` sink columns, then the
    oldest (from ``idx``) to the newest (before ``idx``) when it has wrapped."""
    if not rotated:
        return _cut(planes, None, 0, idx)
    length = int(planes[0].shape[2])
    parts = [_cut(planes, None, 0, keep), _cut(planes, None, idx, length)]
    parts.append(_cut(planes, None, keep, idx))
    return tuple(concat([part[i] for part in parts]) for i in range(len(planes)))


#: One row a state holds: its key and value planes in time order (``None``: no token)
#: and its position.
StateRow = tuple[tuple[Any, ...] | None, tuple[Any, ...] | None, int]


def rows_of_state(
    entry: Composition, values: Mapping[str, Any], concat: Any, *, keep: int = 0
) -> list[StateRow]:
    """The rows a (checked) state holds, as ``merge_rows`` / ``extract_row`` see them:
    each row's tokens in time order and its position. ``concat`` joins planes along the
    token axis (``np.concatenate`` / ``mx.concatenate`` with ``axis=2``)."""
    keys, vals = _planes(values["keys"]), _planes(values["values"])
    if not entry.is_layout:
        offset = values["offset"]
        if keys is None or vals is None:
            return []
        held = min(offset, int(keys[0].shape[2]))
        if entry.geometry == "ring":
            idx, sink = values["idx"], values["keep"]
            if not 0 <= idx <= held:
                raise InvalidInputError(f"ring state: idx {idx} outside [0, {held}]")
            keys = chronological(_cut(keys, None, 0, held), idx, idx < held, sink, concat)
            vals = chronological(_cut(vals, None, 0, held), idx, idx < held, sink, concat)
        else:
            keys, vals = _cut(keys, None, 0, held), _cut(vals, None, 0, held)
        return [
            (_cut(keys, b, 0, held), _cut(vals, b, 0, held), offset)
            for b in range(int(keys[0].shape[0]))
        ]
    offsets = _ints(values["offset"], "offset")
    pads = _ints(values["left_padding"], "left_padding")
    if len(pads) != len(offsets):
        raise InvalidInputError(
            f"state has {len(offsets)} offsets and {len(pads)} left paddings: one per row"
        )
    idx = values["idx"]
    if keys is None or vals is None:
        return [(None, None, max(0, o)) for o in offsets]
    if int(keys[0].shape[0]) != len(offsets):
        raise InvalidInputError(f"state keys hold {keys[0].shape[0]} rows, offsets {len(offsets)}")
    if entry.geometry == "ring":
        keys = chronological(keys, idx, values["rotated"], keep, concat)
        vals = chronological(vals, idx, values["rotated"], keep, concat)
        active, limit = int(keys[0].shape[2]), values["max_size"]
    else:
        active, limit = idx, None
    rows: list[StateRow] = []
    for b, (offset, pad) in enumerate(zip(offsets, pads, strict=True)):
        # A row keeps its newest ``max_size`` columns (what a merge keeps); kvrows' own
        # form of a ring with sinks holds each row exactly (mlx-lm's batch ring has none).
        window = offset if limit is None or keep else min(offset, limit)
        start = max(0, pad, active - window)
        if limit is None and (offset < 0 or active - pad != offset):
            raise InvalidInputError(
                f"state row {b}: offset {offset} disagrees with its columns "
                f"[{pad}, {active}) (left_padding {pad}, idx {idx})"
            )
        if start >= active:
            rows.append((None, None, max(0, offset)))
        else:
            rows.append((_cut(keys, b, start, active), _cut(vals, b, start, active), offset))
    return rows


def legacy_state(file_class: str, state: Sequence[Any], meta_state: Any) -> tuple[Any, ...]:
    """mlx-lm's older ``(state, meta_state)`` pair (strings in ``meta_state``) as the
    current single-tuple form."""
    meta = [meta_state] if isinstance(meta_state, str) else list(meta_state or ())
    numbers = [int(m) for m in meta if m != ""]
    keys, values = state[0], state[1]
    width = 0 if keys is None else int(_planes(keys)[0].shape[2])  # type: ignore[index]
    if file_class == "KVCache":
        return (keys, values, width)
    if file_class == "RotatingKVCache" and len(numbers) == 4:
        sink, max_size, offset, idx = numbers
        return (keys, values, offset, sink, max_size, idx)
    if file_class == "QuantizedKVCache" and len(numbers) == 3:
        offset, group_size, bits = numbers
        return (keys, values, offset, group_size, bits)
    if file_class == "BatchKVCache" and len(state) == 4:
        return (*state, width)
    raise UnsupportedStateError(f"cannot read a {file_class} state with meta_state {meta_state!r}")


@dataclass(frozen=True)
class ParsedState:
    """A checked state: its fields by name, its codec and token geometry, the plane count
    of ``keys`` / ``values`` (3 for the affine triple)."""

    fields: dict[str, Any]
    codec: CodecSpec
    token_geometry: GeometrySpec
    planes: int


def parse_state(
    entry: Composition, state: Any, meta_state: Any = None, *, keep: int | None = None
) -> ParsedState:
    """``state`` (or mlx-lm's older ``(state, meta_state)`` pair) checked against
    ``entry``'s form: what both implementations' ``from_state`` start from."""
    form = state_form(entry)
    legacy = isinstance(state, tuple | list) and len(state) != len(form.fields)
    if meta_state is not None and legacy:
        state = legacy_state(form.file_class, state, meta_state)
    fields = unpack_state(entry, state)
    codec = codec_from_fields(entry, fields)
    return ParsedState(
        fields,
        codec,
        geometry_from_fields(entry, fields, keep=keep),
        3 if isinstance(codec, Affine) else 1,
    )
