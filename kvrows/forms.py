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

A **delayed** layout (``kvrows.delayed``; form 2, contract §0.6) holds each stage's planes
(``stage0.keys, stage0.values, stage1.keys, stage1.values``: the rows of that stage, in
batch order, in one column frame), its geometry's layout fields (a ring's ``keep`` too),
its target's codec tail and the modifier record ``start, converted_at[B], left_pad[B],
prefilling, composed``; see ``spec/persistence.md`` §1.1. Its form 1 (two groups) is
``kvrows.forms_v1``'s.

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
from kvrows.paged import PLACEMENTS
from kvrows.validation import FLOAT_DTYPES, KvGeometry

__all__ = [
    "DELAYED_PLAIN",
    "DELAYED_RECORD",
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
    "delayed_fields",
    "delayed_groups",
    "delayed_marks",
    "delayed_record",
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
    "serial_held",
    "spec_fields",
    "stage_field",
    "state_form",
    "stored_geometry",
    "unpack_state",
    "with_planes",
    "written_form",
]

#: The version of kvrows' saved-state format. A file from a newer version is refused.
#: Version 2 records each layer entry's form version (``form``); version 1 files have
#: none, and every layer of theirs is form 1.
FORMAT_VERSION = 2

#: The newest form version of a layer entry this kvrows writes and reads. Each family
#: writes ``written_form(entry)``: 1, the forms of format 1, where they already are the
#: §0.6 rule; 2 for the families whose writer switched to it (the delayed layouts;
#: ``kvrows.forms_v1`` reads their form 1).
FORM_VERSION = 2

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


#: The delayed modifier's record (contract §0.6), after a delayed layout's stages' planes,
#: its geometry and arrangement fields and its target's codec tail: ``converted_at[B]``
#: (``DELAYED_PLAIN``: the row is in stage 0), ``left_pad[B]`` (the position record of
#: full attention, which a per-row trim leaves off the right-aligned frame; empty for
#: rings), ``prefilling``, ``composed`` (rows extract as legos).
DELAYED_RECORD = ("start", "converted_at", "left_pad", "prefilling", "composed")
#: ``converted_at`` of a row that has not converted (it sits in stage 0, plain).
DELAYED_PLAIN = -1


def delayed_groups(entry: Composition) -> tuple[Composition, Composition]:
    """The one-stage ragged presets of a delayed layout's two stages: the landed ragged
    layouts of its token geometry and placement with its other modifiers, plain and of its
    codec
    (``BatchedKVCache`` and ``BatchedQuantizedKVCache`` for ``DelayedQuantizedKVCache``).
    Each stage's rows save and restore through its preset's form."""
    groups = []
    for codec in ("plain", entry.codec):
        found = [
            c
            for c in landed()
            if (c.codec, c.geometry, c.placement, c.arrangement)
            == (codec, entry.geometry, entry.placement, "ragged")
            and c.modifiers == entry.modifiers - {"delayed"}
        ]
        if len(found) != 1:
            raise UnsupportedStateError(f"{entry.name} has no single {codec} group layout")
        groups.append(found[0])
    return groups[0], groups[1]


def stage_field(stage: int, tensor: str) -> str:
    """The form's field of one stage's planes of ``tensor`` (``stage1.keys``)."""
    return f"stage{stage}.{tensor}"


def _is_delayed_layout(entry: Composition) -> bool:
    return "delayed" in entry.modifiers and entry.is_layout and entry.is_landed


def _delayed_form(entry: Composition) -> StateForm:
    """The §0.6 rule under the delayed modifier (form 2): each stage's planes, the
    geometry's layout fields and what a layout form of mlx-lm's omits (a ring's ``keep``),
    the target's codec tail, the modifier record."""
    geometry = _geometry_of(entry)
    target = CODECS[entry.codec]
    planes = tuple(
        stage_field(stage, tensor)
        for stage, group in enumerate(delayed_groups(entry))
        for tensor in CODECS[group.codec].tensors()
    )
    fields = (
        *planes,
        *geometry.layout_fields,
        *geometry.layout_form_omits,
        *target.state_tail,
        *DELAYED_RECORD,
    )
    return StateForm(entry.name, fields, entry.name)


def written_form(entry: Composition) -> int:
    """The form version of ``entry``'s ``state`` as this kvrows writes it (a file's
    layer record): 2 where the §0.6 rule changed the family's form (the delayed layouts),
    1 where form 1 already was the rule."""
    return 2 if _is_delayed_layout(entry) else 1


def recurrent_fields(planes: int) -> tuple[str, ...]:
    """A recurrent cache's form: ``(state.0, …, state.{planes-1}, offset)``, the state
    codec's tensors then the recurrent geometry's fields. Version 1's ``(conv, recurrent,
    offset)`` is the two-plane form under other names: the tuple, and so a file, is the
    same."""
    return state_tensors(planes) + Recurrent.serial_fields


def state_form(entry: Composition) -> StateForm:
    """The state form of a landed composition (``UnsupportedStateError`` for others)."""
    if _is_delayed_layout(entry):
        return _delayed_form(entry)
    own = getattr(CODECS.get(entry.codec), "form_fields", None)
    # A placement with a spec (paged: block tables) adds its fields; contiguous has none.
    paged = PLACEMENTS.classes.get(entry.placement) is not None
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
    delayed layout's: ``"stages"``, each stage's rows by its preset's field names, and its
    record)."""
    if _is_delayed_layout(entry):
        parts = parse_delayed_state(entry, state)
        return {"stages": parts.stages, **parts.record}
    form = state_form(entry)
    if not isinstance(state, Sequence) or isinstance(state, str | bytes):
        raise InvalidInputError(f"{entry.name} state must be a tuple {form.fields}, got {state!r}")
    if len(state) != len(form.fields):
        raise InvalidInputError(
            f"{entry.name} state has {len(form.fields)} fields {form.fields}, got {len(state)}"
        )
    values = dict(zip(form.fields, state, strict=True))
    for name in (
        "keep", "max_size", "idx", "total", "group_size", "bits", "k_bits", "v_bits",
        "chunk_size", "start_position",
    ):  # fmt: skip
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
    """The geometry parameters a delayed layout's form carries after its layout fields
    (form 1: after its record): its stage presets' layout forms omit them (a ring's
    ``keep``)."""
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


def serial_held(offset: int, start: int, columns: int) -> int:
    """The columns a chunked serial state holds, ``offset - start_position`` (mlx-lm's
    buffers may hold more), refused unless its planes have them."""
    held = offset - start
    if not 0 <= held <= columns or start < 0:
        raise InvalidInputError(
            f"state start_position {start} and offset {offset}: the planes hold {columns} "
            f"columns, expected 0 <= offset - start_position <= {columns}"
        )
    return held


#: One row a state holds: its key and value planes in time order (``None``: no token)
#: and its position.
StateRow = tuple[tuple[Any, ...] | None, tuple[Any, ...] | None, int]


def rows_of_state(
    entry: Composition, values: Mapping[str, Any], concat: Any, *, keep: int = 0
) -> list[StateRow]:
    """The rows a (checked) state holds, as ``merge_rows`` / ``extract_row`` see them:
    each row's tokens in time order and its position. ``concat`` joins planes along the
    token axis (``np.concatenate`` / ``mx.concatenate`` with ``axis=2``)."""
    if _is_delayed_layout(entry):
        return _delayed_rows(entry, values, concat)
    # Columns in buffer order, from the write index.
    geometry = GEOMETRIES.get(entry.geometry)
    wraps = geometry is not None and geometry.wraps
    evicts = geometry is not None and geometry.evicts
    keys, vals = _planes(values["keys"]), _planes(values["values"])
    if not entry.is_layout:
        offset = values["offset"]
        if keys is None or vals is None:
            return []
        held = min(offset, int(keys[0].shape[2]))
        if "start_position" in values:  # a chunked row holds [start_position, offset)
            held = serial_held(offset, values["start_position"], int(keys[0].shape[2]))
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
        held = active - pad
        if limit is None and (offset < held or (held != offset and not evicts)):
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
    """A checked delayed-layout state (of either form version): each stage's rows as its
    one-stage ragged preset (``delayed_groups``) saves them (``stage_states``, that
    preset's form, the stage's rows in batch order; ``stages``, the same by field name),
    and the modifier record. ``converted_at[b]`` is ``None`` for a row in stage 0; a row's
    stage follows from it, and its place in its stage's state from its rank among that
    stage's rows."""

    stages: tuple[dict[str, Any], dict[str, Any]]
    stage_states: tuple[tuple[Any, ...], tuple[Any, ...]]
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


def _stage_of(converted: Sequence[int | None]) -> list[int]:
    return [0 if mark is None else 1 for mark in converted]


def delayed_state(
    entry: Composition,
    stage_states: Sequence[Sequence[Any]],
    record: Mapping[str, Any],
    parameters: Mapping[str, Any],
    positions: Callable[[list[int]], Any],
) -> tuple[Any, ...]:
    """A delayed layout's state (form 2) from each stage's rows as its one-stage preset's
    canonical state (rows right-aligned, a ring's unrotated) and the record (``start``,
    ``converted_at`` per row in batch order, ``None`` for stage 0, ``left_pad``,
    ``prefilling``, ``composed``). ``parameters``: the specs' (``spec_fields``: the target's
    codec tail, the geometry's ``keep``); ``positions``: an int list as the
    implementation's int32 vector.

    One column frame for every stage: the frame is ``idx`` columns wide, row ``b``'s
    window at ``[left_padding[b], idx)``; a stage's planes hold the frame's newest ``T_s``
    columns (``T_s``: the widest window among its rows), so a stage of shorter rows stores
    no column none of its rows reaches and no plane is copied here."""
    converted = list(record["converted_at"])
    stage_of = _stage_of(converted)
    values = [unpack_state(g, s) for g, s in zip(delayed_groups(entry), stage_states, strict=True)]
    ends = []
    for fields in values:
        held = _planes(fields["keys"])
        end = 0 if held is None else fields["idx"]
        if held is not None and (fields.get("rotated") or int(held[0].shape[2]) != end):
            raise AssertionError("a stage's state is not its preset's canonical form")
        ends.append(end)
    width = max(ends)
    offsets, pads = [0] * len(converted), [0] * len(converted)
    form: dict[str, Any] = {**parameters}
    for stage, fields in enumerate(values):
        rows = [b for b, s in enumerate(stage_of) if s == stage]
        stage_offsets = _ints(fields["offset"], "offset")
        stage_pads = _ints(fields["left_padding"], "left_padding")
        for b, offset, pad in zip(rows, stage_offsets, stage_pads, strict=True):
            offsets[b], pads[b] = offset, pad + width - ends[stage]
        for tensor in ("keys", "values"):
            form[stage_field(stage, tensor)] = fields[tensor]
    form.update(
        offset=positions(offsets),
        left_padding=positions(pads),
        idx=width,
        total=max(offsets, default=0),
        rotated=False,
        start=record["start"],
        converted_at=positions([DELAYED_PLAIN if c is None else c for c in converted]),
        left_pad=positions(list(record["left_pad"])),
        prefilling=record["prefilling"],
        composed=record["composed"],
    )
    return pack_state(entry, form)


def _flag(name: str, value: object) -> bool:
    """A bool field (a 0-d array of a bool or 0/1 too, as a file may hold it)."""
    item = value.item() if hasattr(value, "item") else value
    if isinstance(item, bool):
        return item
    if isinstance(item, int) and item in (0, 1):
        return bool(item)
    raise InvalidInputError(f"state field {name} must be a bool, got {value!r}")


def delayed_marks(entry: Composition, raw: Mapping[str, Any]) -> list[int | None]:
    """The record's ``converted_at``, one per row (``None``: stage 0)."""
    marks = _ints(raw["converted_at"], "converted_at")
    if any(m < DELAYED_PLAIN for m in marks):
        raise InvalidInputError(
            f"{entry.name} state: converted_at {marks}: each is an offset >= 0, or "
            f"{DELAYED_PLAIN} for a plain row"
        )
    return [None if m == DELAYED_PLAIN else m for m in marks]


def delayed_record(
    entry: Composition,
    raw: Mapping[str, Any],
    converted: list[int | None],
    plain_offsets: Sequence[int],
    keep: int | None,
) -> dict[str, Any]:
    """The modifier record of a delayed state checked (either form version): ``start``,
    each stage-0 row short of its conversion unless the layout was prefilling, the position
    record (full attention: one pad per row, the smallest 0; rings: none), the flags, and
    what a layout form omits (a ring's ``keep``, which must be ``keep`` when given)."""
    start = _integer("start", raw["start"])
    if start < 0:
        raise InvalidInputError(f"{entry.name} state: start {start} is negative")
    prefilling = _flag("prefilling", raw["prefilling"])
    ranks = iter(_ints(plain_offsets, "offset"))
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
    omitted = _layout_form_omits(entry)
    for name in omitted:
        record[name] = _integer(name, raw[name])
    if "keep" in omitted and keep is not None and keep != record["keep"]:
        raise InvalidInputError(
            f"{entry.name} state: keep {record['keep']}, but {keep} was asked for"
        )
    return record


def delayed_fields(entry: Composition, state: object, form: StateForm, parts: str) -> list[Any]:
    """``state`` as a list of ``form``'s length (``parts`` says what its fields are)."""
    if not isinstance(state, Sequence) or isinstance(state, str | bytes):
        raise InvalidInputError(f"{entry.name} state must be a tuple {form.fields}, got {state!r}")
    if len(state) != len(form.fields):
        raise InvalidInputError(
            f"{entry.name} state has {len(form.fields)} fields ({parts}), got {len(state)}"
        )
    return list(state)


def parse_delayed_state(
    entry: Composition, state: object, *, keep: int | None = None
) -> DelayedParts:
    """A delayed layout's form-2 ``state`` checked whole (``InvalidInputError`` naming the
    fault; ``kvrows.forms_v1`` reads form 1): its length, the row table (one
    ``converted_at``, offset and pad per row), each stage's planes inside the frame, each
    stage's rows as its preset's form, and the record (``delayed_record``). ``keep``, when
    given, must be the state's."""
    form = state_form(entry)
    values = delayed_fields(
        entry, state, form, f"each stage's planes, the frame, the codec tail, {DELAYED_RECORD}"
    )
    raw = dict(zip(form.fields, values, strict=True))
    converted = delayed_marks(entry, raw)
    stage_of = _stage_of(converted)
    shapes = [_shape(raw[stage_field(stage, "keys")], stage) for stage in (0, 1)]
    for stage, shape in enumerate(shapes):
        if shape is not None and shape[0] != stage_of.count(stage):
            raise InvalidInputError(
                f"{entry.name} state: the row table has {stage_of.count(0)} plain and "
                f"{stage_of.count(1)} converted rows, stage {stage}'s planes hold {shape[0]}"
            )
    offsets = _ints(raw["offset"], "offset")
    pads = _ints(raw["left_padding"], "left_padding")
    if not len(offsets) == len(pads) == len(converted):
        raise InvalidInputError(
            f"{entry.name} state: {len(converted)} rows in converted_at, {len(offsets)} "
            f"offsets and {len(pads)} left paddings: one of each per row"
        )
    width = _integer("idx", raw["idx"])
    rotated = _flag("rotated", raw["rotated"]) if "rotated" in raw else False
    groups = delayed_groups(entry)
    stage_states: list[tuple[Any, ...]] = []
    for stage, (group, shape) in enumerate(zip(groups, shapes, strict=True)):
        rows = [b for b, s in enumerate(stage_of) if s == stage]
        fields = {**raw, **{t: raw[stage_field(stage, t)] for t in ("keys", "values")}}
        columns = width if shape is None else shape[2]
        shift = width - columns
        starts = [pads[b] for b in rows if offsets[b] > 0]
        if shift < 0 or (shift and (rotated or any(p < shift for p in starts))):
            raise InvalidInputError(
                f"{entry.name} state: stage {stage}'s planes hold {columns} columns; the "
                f"frame is {width} wide (idx), rotated {rotated}, its rows start at {starts}"
            )
        fields.update(
            offset=[offsets[b] for b in rows],
            left_padding=[pads[b] - shift for b in rows],
            idx=columns,
            total=max((offsets[b] for b in rows), default=0),
        )
        stage_states.append(pack_state(group, fields))
    plain, target = (unpack_state(g, st) for g, st in zip(groups, stage_states, strict=True))
    record = delayed_record(entry, raw, converted, plain["offset"], keep)
    return DelayedParts((plain, target), (stage_states[0], stage_states[1]), record)


def _shape(value: Any, stage: int) -> tuple[int, ...] | None:
    """The shape of a stage's first key plane (``None``: the stage holds no token)."""
    held = _planes(value)
    shape = None if held is None else getattr(held[0], "shape", None)
    if held is not None and (shape is None or len(shape) != 4):
        raise InvalidInputError(
            f"state {stage_field(stage, 'keys')} must be [B, H, T, ·] planes, got "
            f"{describe_planes(value)}"
        )
    return None if shape is None else tuple(int(n) for n in shape)


def _delayed_rows(entry: Composition, values: Mapping[str, Any], concat: Any) -> list[StateRow]:
    """A delayed state's rows in batch order: each stage's rows, by the row table."""
    keep = int(values.get("keep", 0))
    by_stage = [
        iter(rows_of_state(group, fields, concat, keep=keep))
        for group, fields in zip(delayed_groups(entry), values["stages"], strict=True)
    ]
    return [next(by_stage[mark is not None]) for mark in values["converted_at"]]
