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
``mx.quantize`` and appends ``group_size, bits``; TurboQuant makes them ``(kIdx, kScales,
kZeros)`` and ``(vPacked, vScales)`` (``TURBO_PLANES``: the order is a persistence
contract) and appends ``k_bits, v_bits`` (``spec/persistence.md`` §1.2). Those are exactly the forms of mlx-lm
0.32.2's ``KVCache``, ``RotatingKVCache``, ``QuantizedKVCache``, ``BatchKVCache`` and
``BatchRotatingKVCache``, so mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache`` read
and write kvrows states for the classes it has (``FILE_CLASSES`` names them), and kvrows
reads mlx-lm's. A ring layout's ``keep`` is not in mlx-lm's batch form (its bug B7):
kvrows' files carry it in their metadata, and ``from_state`` takes it as a parameter.

A **delayed** layout (``kvrows.delayed``) holds its plain group's layout form, then its
affine group's, then its row record: ``start, converted_at[B], left_pad[B], prefilling,
composed`` (a ring's also ``keep``); see ``spec/persistence.md`` §1.1.

Layout forms are right-aligned: row ``b``'s tokens sit in columns
``[left_padding[b], idx)`` (a ring layout in its physical order, see
``spec/persistence.md``). This module is array-library free: it names and checks the
fields; each implementation turns them into arrays.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvrows.codec import KV_TENSORS, CodecSpec, Role, codec_plane_specs
from kvrows.codecs import CODECS, codec_from_tail
from kvrows.codecs.state import state_tensors
from kvrows.codecs.turbo import TURBO_PLANES
from kvrows.compositions import Composition, composition, landed
from kvrows.conversion import conversion_due
from kvrows.errors import (
    InvalidInputError,
    UnsupportedStateError,
    not_an_integer_message,
    ring_state_index_message,
)
from kvrows.geometries import GEOMETRIES, GeometrySpec, Recurrent
from kvrows.validation import FLOAT_DTYPES, KvGeometry

__all__ = [
    "DELAYED_PLAIN",
    "FILE_CLASSES",
    "FORMAT_VERSION",
    "FORM_VERSION",
    "TURBO_PLANES",
    "TURBO_STATE_DTYPE",
    "DelayedParts",
    "ParsedState",
    "StateForm",
    "StateRow",
    "chronological",
    "codec_from_fields",
    "delayed_groups",
    "delayed_state",
    "describe_planes",
    "form_planes",
    "geometry_from_fields",
    "kv_geometry_of",
    "legacy_state",
    "pack_state",
    "parse_delayed_state",
    "parse_state",
    "plane_counts",
    "recurrent_fields",
    "rows_of_state",
    "spec_fields",
    "state_form",
    "stored_geometry",
    "unpack_state",
    "with_planes",
]

#: The version of kvrows' saved-state format. A file from a newer version is refused.
#: Version 2 records each layer entry's form version (``form``); version 1 files have
#: none, and every layer of theirs is form 1.
FORMAT_VERSION = 2

#: The form version of a layer entry each family writes today: 1, the forms of format 1
#: (``kvrows.forms_v1`` reads where they differ from the §0.6 rule). A family whose writer
#: switches to the §0.6 rule writes form 2, one family at a time.
FORM_VERSION = 1

#: What the paged placement's form adds after its geometry's fields: what rebuilds block
#: tables (``kvrows.paged_forms``; ``codec``: the codec's tag and parameters).
_PAGED_FIELDS = ("block_size", "codec")

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


#: A delayed layout's row record, after its two groups' forms (a ring adds ``keep``).
_DELAYED_RECORD = ("start", "converted_at", "left_pad", "prefilling", "composed")
#: ``converted_at`` of a row that has not converted (it sits in the plain group).
DELAYED_PLAIN = -1


def delayed_groups(entry: Composition) -> tuple[Composition, Composition]:
    """The plain and the affine group of a delayed layout: the landed ragged layouts of its
    token geometry with its other modifiers (``BatchedKVCache`` and
    ``BatchedQuantizedKVCache`` for ``DelayedQuantizedKVCache``)."""
    groups = []
    for codec in ("plain", entry.codec):
        found = [
            c
            for c in landed()
            if (c.codec, c.geometry, c.arrangement) == (codec, entry.geometry, "ragged")
            and c.modifiers == entry.modifiers - {"delayed"}
        ]
        if len(found) != 1:
            raise UnsupportedStateError(f"{entry.name} has no single {codec} group layout")
        groups.append(found[0])
    return groups[0], groups[1]


def _delayed_form(entry: Composition) -> StateForm:
    """Each group's fields (prefixed ``plain.`` / ``affine.``), then the row record."""
    plain, affine = (state_form(group).fields for group in delayed_groups(entry))
    fields = (
        *(f"plain.{name}" for name in plain),
        *(f"affine.{name}" for name in affine),
        *_DELAYED_RECORD,
        *_layout_form_omits(entry),
    )
    return StateForm(entry.name, fields, entry.name)


def recurrent_fields(planes: int) -> tuple[str, ...]:
    """A recurrent cache's form: ``(state.0, …, state.{planes-1}, offset)``, the state
    codec's tensors then the recurrent geometry's fields. Version 1's ``(conv, recurrent,
    offset)`` is the two-plane form under other names: the tuple, and so a file, is the
    same."""
    return state_tensors(planes) + Recurrent.serial_fields


def state_form(entry: Composition) -> StateForm:
    """The state form of a landed composition (``UnsupportedStateError`` for others)."""
    if "delayed" in entry.modifiers and entry.is_landed:
        return _delayed_form(entry)
    own = getattr(CODECS.get(entry.codec), "form_fields", None)
    paged = entry.placement == "paged"  # the placement's fields follow (block tables)
    if own is not None and entry.is_landed:  # the latent caches' own form (version 1)
        # ``PagedLatentCache``: the block size follows (``PAGED_LATENT_FIELDS``)
        return StateForm(entry.name, (*own, "block_size") if paged else own, entry.name)
    placed = GEOMETRIES.get(entry.geometry)
    if paged and entry.is_landed and placed is not None:
        # The rule (§0.6): the logical planes, compact (a growing row's every position, a
        # ring row's sinks and newest in time order), the geometry's fields, the
        # placement's. ``PagedKVCache``: keys, values, offset, block_size, codec.
        own_fields = placed.layout_fields if entry.is_layout else placed.serial_fields
        return StateForm(entry.name, KV_TENSORS + own_fields + _PAGED_FIELDS, entry.name)
    # The codec's tensors (a KV codec's keys and values; recurrent state's planes, the
    # default two: the count is each cache's, recurrent_fields), the geometry's fields, the
    # codec's tail. mlx-lm's ArraysCache form has no coverage, so a recurrent file class is
    # kvrows'.
    geometry = GEOMETRIES.get(entry.geometry)
    codec = CODECS.get(entry.codec)
    # A speculative layout outside a round holds what its unmodified layout holds.
    if geometry is None or codec is None or entry.modifiers - {"speculative"}:
        raise UnsupportedStateError(
            f"{entry.name} has no saved-state form yet (issue {entry.issue or '?'} adds it)"
        )
    fields = codec.tensors() + (
        geometry.layout_fields if entry.is_layout else geometry.serial_fields
    )
    tail = codec.state_tail
    return StateForm(entry.name, fields + tail, _mlx_lm_class(entry) or entry.name)


def _mlx_lm_class(entry: Composition) -> str | None:
    """mlx-lm's class of ``entry``'s form, when mlx-lm has one: the ``parity`` of a landed
    composition of the same codec, geometry and arrangement kind (serial or layout), whose
    form is therefore the same."""
    shape = (entry.codec, entry.geometry, entry.is_layout)
    for other in landed():
        if other.parity is not None and (other.codec, other.geometry, other.is_layout) == shape:
            return other.parity
    return None


def spec_fields(codec: CodecSpec, geometry: GeometrySpec) -> dict[str, Any]:
    """The fields a form takes from its specs: the codec's tail and the geometry's
    parameters (a form holds those it names: a ring layout's leaves ``keep`` out)."""
    return {**codec.parameters(), **geometry.parameters()}


def form_planes(planes: Sequence[Any] | None) -> Any:
    """One tensor's planes as a form holds them: a lone plane as the array itself
    (mlx-lm's ``KVCache``), several as their tuple (``None``: nothing held)."""
    if planes is None:
        return None
    return planes[0] if len(planes) == 1 else tuple(planes)


def with_planes(
    fields: dict[str, Any], planes: tuple[Sequence[Any], Sequence[Any]] | None
) -> dict[str, Any]:
    """``fields`` with the key and value planes (``None``: nothing held) as a form holds
    them."""
    keys, values = (None, None) if planes is None else planes
    return {**fields, "keys": form_planes(keys), "values": form_planes(values)}


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidInputError(not_an_integer_message(f"state field {name}", value))
    return operator.index(value)


def unpack_state(entry: Composition, state: object) -> dict[str, Any]:
    """``state`` checked against ``entry``'s form, by field name (scalars as ints; a
    delayed layout's: ``"plain"`` and ``"affine"``, each group's fields, and its record)."""
    if "delayed" in entry.modifiers:
        parts = parse_delayed_state(entry, state)
        return {"plain": parts.plain, "affine": parts.affine, **parts.record}
    form = state_form(entry)
    if not isinstance(state, Sequence) or isinstance(state, str | bytes):
        raise InvalidInputError(f"{entry.name} state must be a tuple {form.fields}, got {state!r}")
    if len(state) != len(form.fields):
        raise InvalidInputError(
            f"{entry.name} state has {len(form.fields)} fields {form.fields}, got {len(state)}"
        )
    values = dict(zip(form.fields, state, strict=True))
    for name in ("keep", "max_size", "idx", "total", "group_size", "bits", "k_bits", "v_bits"):
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
    """The codec a state's fields describe (``InvalidInputError`` for widths it refuses)."""
    return codec_from_tail(entry.codec, values)


def geometry_from_fields(
    entry: Composition, values: Mapping[str, Any], *, keep: int | None = None
) -> GeometrySpec:
    """The token geometry a state describes (a ring layout's ``keep`` comes from outside:
    its form omits it)."""
    return _geometry_of(entry).from_fields({"keep": keep or 0, **values})


def _geometry_of(entry: Composition) -> type[GeometrySpec]:
    """The spec class of ``entry``'s token geometry (``UnsupportedStateError`` for a
    geometry whose form is not the registered geometries' rule)."""
    geometry = GEOMETRIES.get(entry.geometry)
    if geometry is None:
        raise UnsupportedStateError(f"{entry.name} has no {entry.geometry} geometry spec")
    return geometry


def _layout_form_omits(entry: Composition) -> tuple[str, ...]:
    """The geometry parameters a delayed layout's record carries: its groups' layout
    forms omit them (a ring's ``keep``)."""
    return _geometry_of(entry).layout_form_omits


#: A head dim every codec stores (``plane_counts`` only counts its planes).
_PROBE_DIM = 128


def plane_counts(codec: CodecSpec) -> tuple[int, int]:
    """How many planes a state's ``keys`` and ``values`` hold under ``codec``: 1 and 1
    plain, 3 and 3 affine, 3 and 2 TurboQuant (kIdx, kScales, kZeros; vPacked, vScales)."""
    return (
        len(codec_plane_specs(codec, "keys", _PROBE_DIM, "float16", "keys")),
        len(codec_plane_specs(codec, "values", _PROBE_DIM, "float16", "values")),
    )


#: The dtype a TurboQuant state is restored with when nothing declares it: its planes do
#: not record the activations' dtype (bfloat16 is what the codec fetches).
TURBO_STATE_DTYPE = "bfloat16"


def kv_geometry_of(
    codec: CodecSpec, keys: Sequence[Any], values: Sequence[Any], dtype: str
) -> KvGeometry:
    """The KV geometry of stored planes (``keys``/``values``: the codec's plane tuples,
    ``[B, H, T, ·]``; ``dtype``: the floating dtype they were written from)."""
    heads = int(keys[0].shape[1])
    labels = codec.plane_labels
    firsts: tuple[tuple[Role, Any, str], ...] = (
        ("keys", keys[0], labels[0] if labels else "keys"),
        ("values", values[0], labels[plane_counts(codec)[0]] if labels else "values"),
    )
    dims = []
    for role, plane, label in firsts:
        width = int(plane.shape[3])
        codec.check_plane_width(label, width, role)
        dims.append(codec.head_dim(width, role))
    return KvGeometry(heads, dims[0], dims[1], dtype)


def stored_geometry(
    codec: CodecSpec,
    keys: Sequence[Any],
    values: Sequence[Any],
    dtype_of: Callable[[Any], str],
    declared: KvGeometry | None = None,
) -> KvGeometry:
    """The KV geometry of a state's planes (``plane_counts`` of them, 4-D arrays), each
    plane checked against what ``codec`` stores (``InvalidInputError`` naming it): one
    ``[B, H, T]`` for all, each its width and dtype (``kvrows.codec.codec_plane_specs``).
    ``dtype_of`` names an array's dtype (each implementation's ``dtype_name``).

    The activations' dtype is the planes' own (the plain plane, the affine scales);
    TurboQuant's planes do not carry it, so it is ``declared``'s (a file's record, the
    cache the ``state`` setter replaces) or ``TURBO_STATE_DTYPE``; a ``declared`` geometry
    whose heads or head dims disagree with TurboQuant planes is refused."""
    carried = codec.dtype_plane is not None  # else TurboQuant's: the planes lack it
    if not carried:
        dtype = TURBO_STATE_DTYPE if declared is None else declared.dtype
    else:
        dtype = dtype_of(keys[-1])
    if dtype not in FLOAT_DTYPES:
        raise InvalidInputError(
            f"state planes hold {dtype} activations, expected one of {FLOAT_DTYPES}"
        )
    kv = kv_geometry_of(codec, keys, values, dtype)
    for name, dim in (("key", kv.key_dim), ("value", kv.value_dim)):
        codec.check_stored_head_dim(name, dim)
    lead = tuple(int(n) for n in keys[0].shape[:3])
    labels = iter(codec.plane_labels)
    roles: tuple[tuple[Role, Sequence[Any], int], ...] = (
        ("keys", keys, kv.key_dim),
        ("values", values, kv.value_dim),
    )
    for role, planes, dim in roles:
        specs = codec_plane_specs(codec, role, dim, dtype, role)
        for plane, spec in zip(planes, specs, strict=True):
            label = next(labels, spec.name)
            shape, expected = tuple(int(n) for n in plane.shape), (*lead, spec.width)
            if shape != expected or dtype_of(plane) != spec.dtype:
                raise InvalidInputError(
                    f"state plane {label} is {dtype_of(plane)} {list(shape)}, expected "
                    f"{spec.dtype} {list(expected)} ({codec.name}, head dim {dim})"
                )
    if (
        not carried
        and declared is not None
        and (declared.heads, declared.key_dim, declared.value_dim)
        != (kv.heads, kv.key_dim, kv.value_dim)
    ):
        raise InvalidInputError(
            f"state planes hold {kv.describe()} but the declared geometry is {declared.describe()}"
        )
    return kv


def describe_planes(value: object) -> str:
    """What a state field holds, briefly (for messages: arrays by type and shape)."""
    items = tuple(value) if isinstance(value, tuple | list) else (value,)

    def one(item: object) -> str:
        shape = getattr(item, "shape", None)
        kind = f"{type(item).__module__}.{type(item).__name__}"
        return f"{kind} {list(shape)}" if shape is not None else f"{kind} {item!r:.40}"

    return f"{len(items)}: {', '.join(one(item) for item in items)}"


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
    if "delayed" in entry.modifiers:
        return _delayed_rows(entry, values, concat)
    # Columns in buffer order, from the write index.
    geometry = GEOMETRIES.get(entry.geometry)
    wraps = geometry is not None and geometry.wraps
    keys, vals = _planes(values["keys"]), _planes(values["values"])
    if not entry.is_layout:
        offset = values["offset"]
        if keys is None or vals is None:
            return []
        held = min(offset, int(keys[0].shape[2]))
        if wraps:
            idx, sink = values["idx"], values["keep"]
            if not 0 <= idx <= held:
                raise InvalidInputError(ring_state_index_message(idx, held))
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
    if not wraps and not 0 <= idx <= int(keys[0].shape[2]):
        raise InvalidInputError(
            f"state idx {idx} outside the {int(keys[0].shape[2])} columns its planes hold"
        )
    if wraps:
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


#: mlx-lm's older two-part forms, per class that has one: the ``state`` entries after its
#: keys and values, and the ``meta_state`` numbers, by field name. A field of the current
#: form that neither holds is the count of columns the keys hold.
_LEGACY_FORMS: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "KVCache": ((), ()),
    "RotatingKVCache": ((), ("keep", "max_size", "offset", "idx")),
    "QuantizedKVCache": ((), ("offset", "group_size", "bits")),
    "BatchKVCache": (("offset", "left_padding"), ()),
}


def legacy_state(file_class: str, state: Sequence[Any], meta_state: Any) -> tuple[Any, ...]:
    """mlx-lm's older ``(state, meta_state)`` pair (strings in ``meta_state``) as the
    current single-tuple form."""
    meta = [meta_state] if isinstance(meta_state, str) else list(meta_state or ())
    numbers = [int(m) for m in meta if m != ""]
    keys, values = state[0], state[1]
    width = 0 if keys is None else int(_planes(keys)[0].shape[2])  # type: ignore[index]
    legacy = _LEGACY_FORMS.get(file_class)
    if (
        legacy is None
        or (legacy[0] and len(state) != 2 + len(legacy[0]))
        or (legacy[1] and len(numbers) != len(legacy[1]))
    ):
        raise UnsupportedStateError(
            f"cannot read a {file_class} state with meta_state {meta_state!r}"
        )
    stated, metas = legacy
    fields = {
        "keys": keys,
        "values": values,
        **dict(zip(stated, state[2:], strict=False)),
        **dict(zip(metas, numbers, strict=False)),
    }
    form = state_form(composition(FILE_CLASSES[file_class])).fields
    return tuple(fields.get(name, width) for name in form)


@dataclass(frozen=True)
class ParsedState:
    """A checked state: its fields by name, its codec and token geometry, the plane counts
    of ``keys`` and ``values`` (``plane_counts``: 3 and 3 for the affine triples)."""

    fields: dict[str, Any]
    codec: CodecSpec
    token_geometry: GeometrySpec
    key_planes: int
    value_planes: int


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
        *plane_counts(codec),
    )


# -------------------------------------------------------------------------------- delayed


@dataclass(frozen=True)
class DelayedParts:
    """A checked delayed-layout state: each group's state (its own form, a tuple), its
    fields by name, and the row record. ``converted_at[b]`` is ``None`` for a plain row;
    a row's group follows from it, and its slot from its rank among its group's rows."""

    plain: dict[str, Any]
    affine: dict[str, Any]
    plain_state: tuple[Any, ...]
    affine_state: tuple[Any, ...]
    record: dict[str, Any]

    @property
    def start(self) -> int:
        return int(self.record["start"])

    @property
    def converted_at(self) -> list[int | None]:
        return list(self.record["converted_at"])

    @property
    def left_pad(self) -> list[int]:
        return list(self.record["left_pad"])

    @property
    def keep(self) -> int:
        return int(self.record.get("keep", 0))


def delayed_state(
    entry: Composition,
    plain_state: Sequence[Any],
    affine_state: Sequence[Any],
    record: Mapping[str, Any],
) -> tuple[Any, ...]:
    """A delayed layout's state: its groups' states, then its record (``start``,
    ``converted_at`` with ``DELAYED_PLAIN`` for plain rows, ``left_pad``, ``prefilling``,
    ``composed``, a ring's ``keep``; arrays as the implementation makes them)."""
    names = (*_DELAYED_RECORD, *_layout_form_omits(entry))
    return (*plain_state, *affine_state, *(record[name] for name in names))


def _flag(name: str, value: object) -> bool:
    """A bool field (a 0-d array of a bool or 0/1 too, as a file may hold it)."""
    item = value.item() if hasattr(value, "item") else value
    if isinstance(item, bool):
        return item
    if isinstance(item, int) and item in (0, 1):
        return bool(item)
    raise InvalidInputError(f"state field {name} must be a bool, got {value!r}")


def parse_delayed_state(
    entry: Composition, state: object, *, keep: int | None = None
) -> DelayedParts:
    """A delayed layout's ``state`` checked whole (``InvalidInputError`` naming the fault):
    its length, each group's form, the record's types, the row table against the groups
    (one ``converted_at`` per row, as many plain rows as the plain group holds), each
    plain row short of its conversion unless the layout was prefilling, and the position
    record (full attention: one pad per row, the smallest 0; rings: none). ``keep``, when
    given, must be the state's."""
    form = state_form(entry)
    omitted = _layout_form_omits(entry)
    if not isinstance(state, Sequence) or isinstance(state, str | bytes):
        raise InvalidInputError(f"{entry.name} state must be a tuple {form.fields}, got {state!r}")
    if len(state) != len(form.fields):
        raise InvalidInputError(
            f"{entry.name} state has {len(form.fields)} fields (its plain group's, its affine "
            f"group's, then {form.fields[-len(_DELAYED_RECORD) - len(omitted) :]}), "
            f"got {len(state)}"
        )
    plain_entry, affine_entry = delayed_groups(entry)
    width = len(state_form(plain_entry).fields)
    split = width + len(state_form(affine_entry).fields)
    plain_state, affine_state = tuple(state[:width]), tuple(state[width:split])
    plain = unpack_state(plain_entry, plain_state)
    affine = unpack_state(affine_entry, affine_state)
    raw = dict(zip(form.fields[split:], state[split:], strict=True))
    start = _integer("start", raw["start"])
    if start < 0:
        raise InvalidInputError(f"{entry.name} state: start {start} is negative")
    marks = _ints(raw["converted_at"], "converted_at")
    if any(m < DELAYED_PLAIN for m in marks):
        raise InvalidInputError(
            f"{entry.name} state: converted_at {marks}: each is an offset >= 0, or "
            f"{DELAYED_PLAIN} for a plain row"
        )
    converted = [None if m == DELAYED_PLAIN else m for m in marks]
    plain_offsets = _ints(plain["offset"], "plain.offset")
    affine_offsets = _ints(affine["offset"], "affine.offset")
    plain_rows = sum(1 for c in converted if c is None)
    if (plain_rows, len(converted) - plain_rows) != (len(plain_offsets), len(affine_offsets)):
        raise InvalidInputError(
            f"{entry.name} state: the row table has {plain_rows} plain and "
            f"{len(converted) - plain_rows} converted rows, the groups hold "
            f"{len(plain_offsets)} and {len(affine_offsets)}"
        )
    prefilling = _flag("prefilling", raw["prefilling"])
    ranks = iter(plain_offsets)
    for b, mark in enumerate(converted):
        if mark is not None:
            continue
        offset = max(0, next(ranks))
        if not prefilling and conversion_due(offset, start):
            raise InvalidInputError(
                f"{entry.name} state: plain row {b} holds {offset} tokens, past start "
                f"{start}, outside a prefill: it would have converted"
            )
    pads = _ints(raw["left_pad"], "left_pad")
    if not _geometry_of(entry).wraps:  # rows right-aligned: the record holds their pads
        if len(pads) != len(converted) or (pads and min(pads) != 0):
            raise InvalidInputError(
                f"{entry.name} state: left_pad {pads} must hold one pad >= 0 per row "
                f"({len(converted)}), the smallest 0"
            )
    elif pads:
        raise InvalidInputError(
            f"{entry.name} state: a ring keeps no position record, got left_pad {pads}"
        )
    record: dict[str, Any] = {
        "start": start,
        "converted_at": converted,
        "left_pad": pads,
        "prefilling": prefilling,
        "composed": _flag("composed", raw["composed"]),
    }
    for name in omitted:
        record[name] = _integer(name, raw[name])
    if "keep" in omitted and keep is not None and keep != record["keep"]:
        raise InvalidInputError(
            f"{entry.name} state: keep {record['keep']}, but {keep} was asked for"
        )
    return DelayedParts(plain, affine, plain_state, affine_state, record)


def _delayed_rows(entry: Composition, values: Mapping[str, Any], concat: Any) -> list[StateRow]:
    """A delayed state's rows in batch order: each group's rows, by the row table."""
    plain_entry, affine_entry = delayed_groups(entry)
    keep = int(values.get("keep", 0))
    by_group = [
        iter(rows_of_state(plain_entry, values["plain"], concat, keep=keep)),
        iter(rows_of_state(affine_entry, values["affine"], concat, keep=keep)),
    ]
    return [next(by_group[mark is not None]) for mark in values["converted_at"]]
