"""The row machinery of the optimized implementation: written once, whatever the geometry.

A storage is a composition (``kvrows.compositions``) of a codec, a token geometry and a row
arrangement. This module owns everything that does not depend on the geometry:

* construction from the composition table (``bind_arguments``, ``from_specs``), the
  codec, the identity (``signature``, ``plane_specs``), the planes held (``state``,
  ``nbytes``);
* the per-row bookkeeping: each row's position (``row_offsets``) and left padding, kept
  as host-side Python ints so a step never synchronises with the device to plan writes;
* template operations that validate once and then call the geometry's hooks:
  ``update_and_fetch`` (block checks -> codec check -> ``_append``), ``fetch``,
  ``make_mask``, ``trim`` / ``trim_rows`` (counts -> ``_check_trim`` -> ``_forget``),
  ``merge_rows`` (argument, self-merge and compatibility checks -> every source's rows
  as windows in time order -> ``_place``), ``filter_rows`` (``_keep``), ``extract_row``
  (``_window`` -> an owned, evaluated copy -> the serial storage's ``_adopt``),
  ``check_valid``.

The two arrangements are :class:`Serial` (one request; the rows of a serial storage are
the rows of its blocks, all at one position) and :class:`Layout` (rows joined from
several requests; ``composition.shared_column`` says whether they share one write
column). A geometry (one module per kind in ``geometries/``) is a class that supplies
only the hooks (see :class:`Storage`); a public class is a geometry plus an arrangement
(``classes.py``). Modifiers (delayed, speculative) will wrap a layout: see
:meth:`Storage.__init_subclass__`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, TypeAlias, TypeVar, cast

import mlx.core as mx
import numpy as np

from kvrows.codec import KV_TENSORS, PlaneSet, Role, as_role
from kvrows.codecs import CODECS
from kvrows.common import (
    ComposedIdentity,
    PlaneHolder,
    SavedState,
    all_or_nothing,
    check_counts,
    row_bytes,
)
from kvrows.compositions import Composition, bind_arguments, serial_preset
from kvrows.conversion import MIXED_READ
from kvrows.errors import (
    ADOPT_NEEDS_EMPTY,
    EMPTY_LAYOUT_UPDATE,
    MERGE_NEEDS_SEQUENCE,
    NOTHING_TO_FETCH,
    SHARED_COLUMN_TRIM,
    STAGES_MOVE_TOGETHER,
    IncompatibleRowsError,
    InvalidInputError,
    KvRowsError,
    LayoutStateError,
    MixedPrecisionReadError,
    NotTrimmableError,
    incompatible_merge_message,
    last_stage_message,
    self_merge_message,
    speculative_modifier_message,
    trim_past_row_message,
)
from kvrows.optimized.codecs import Codec, Planes, dtype_name, make_codec
from kvrows.optimized.codecs.common import FLOAT_DTYPE_NAMES as _NAMES
from kvrows.protocols import Cache, Mask, RowSource
from kvrows.schemes import CodecSpec, GeometrySpec
from kvrows.validation import (
    KvGeometry,
    as_count,
    check_block,
    check_keep,
    check_row,
    check_window,
    common_geometry,
    round_up,
)

__all__ = [
    "TOKEN_AXIS",
    "Layout",
    "LayoutImage",
    "RowWindow",
    "Serial",
    "Storage",
    "Store",
    "arrays",
    "joined",
    "kv_pair",
    "mapped",
    "owned",
    "paired",
    "row_of",
    "spare_slots",
    "token_count",
    "write_columns",
]

#: One row handed from a source to a merge: its planes in time order (views, ``[1, ...]``:
#: a token geometry's ``[1, H, T, ·]``; ``None`` when it holds nothing) and its position.
RowWindow: TypeAlias = tuple[PlaneSet | None, int]

#: A layout's saved form as its buffers hold it (``Storage._layout_image``): the geometry's
#: form fields, each row's left padding and the planes (views; ``None``: nothing held).
LayoutImage: TypeAlias = tuple[dict[str, Any], list[int], PlaneSet | None]

#: The token axis of every plane a token geometry holds (``[rows, H, T, ·]``).
TOKEN_AXIS = 2

_S = TypeVar("_S", bound="Storage")

#: The tensors of a KV block, by name (a decode step builds its block dict from them).
_KEYS, _VALUES = KV_TENSORS
#: A whole axis, as an index (a decode step's slices name it rather than parse ``:``).
_ALL = slice(None)
#: The template methods ``update_and_fetch``'s lean decode step stands in for: its write
#: (``_update`` down to the geometry's ``_append``) and its read (``fetch`` down to
#: ``_visible``).
_LEAN_WRITE = ("_update", "_write_blocks", "_write", "_take_shapes")
_LEAN_READ = ("fetch", "_read", "_fetched")

#: Every public storage class, by composition name (filled by ``Storage.__init_subclass__``;
#: ``kvrows.optimized.declared_classes()`` adds the delayed layouts, built on two of them).
DECLARED: dict[str, type[Storage]] = {}


#: What a storage of several stages keeps beyond a one-stage one (the delayed modifier's
#: record and its stage codecs): a stage view and a handed-over storage leave them out.
_STAGED_ONLY = frozenset(
    {"_stages", "_conversion", "_declared", "_read_codec", "_read_from", "_view"}
)


def zero_planes(codec: Codec, shapes: Any, rows: int, columns: int) -> PlaneSet:
    """Zero planes of every tensor ``shapes`` (a KV geometry, a codec's ``Shapes``: a
    latent's latent, rope and index) names, ``rows`` rows of ``columns`` tokens."""
    planes: PlaneSet = {}
    for t in shapes.tensors:
        heads, dim, dtype = shapes.tensor_image(t)
        planes[t] = codec.zeros(rows, heads, columns, dim, dtype, as_role(t))
    return planes


class Store:
    """One stage's planes in a storage whose rows are in several stages (contract §0.4):
    ``rows`` are the storage rows in its slots, in batch order (row ``rows[i]`` at slot
    ``i``; spare slots after them); ``planes`` is ``None`` while no row knows its shapes;
    ``codec`` is the stage's. Every store of a storage is at the same columns (the
    storage's column record)."""

    __slots__ = ("codec", "planes", "rows", "stage")

    def __init__(self, stage: int, planes: PlaneSet | None, rows: list[int], codec: Codec) -> None:
        self.stage, self.planes, self.rows, self.codec = stage, planes, rows, codec


def owned(view: mx.array) -> mx.array:
    """An owned compact copy of ``view`` (never a view pinning a batch buffer)."""
    # A row slice is contiguous only when it spans whole planes of one head; then
    # mx.contiguous would alias, so force a copy through a concatenate.
    if view.shape[1] == 1:
        return mx.concatenate([view, view[:, :, :0]], axis=2)
    return mx.contiguous(view)


def spare_slots(rows: int) -> int:
    """Row slots a layout allocates for ``rows`` rows: an eighth spare, at least one.

    Spare slots let a join write only the new row; MLX zero-fills them, so each costs
    its bytes at merge and filter time (the trade-off ``kvrows bench`` shows)."""
    return rows + max(1, rows // 8)


def mapped(planes: PlaneSet, change: Callable[[mx.array], mx.array]) -> PlaneSet:
    """``change`` applied to every plane of every tensor."""
    return {tensor: tuple(change(p) for p in held) for tensor, held in planes.items()}


def paired(first: PlaneSet, second: PlaneSet) -> Iterator[tuple[mx.array, mx.array]]:
    """Each plane of ``first`` with the plane of ``second`` at the same place (a block's
    planes with the buffers they go to)."""
    for tensor, held in first.items():
        yield from zip(held, second[tensor], strict=True)


def joined(first: PlaneSet, second: PlaneSet, axis: int = TOKEN_AXIS) -> PlaneSet:
    """``second`` appended to ``first`` along ``axis`` (tokens; 0: rows)."""
    return {
        tensor: tuple(
            mx.concatenate([a, b], axis=axis) for a, b in zip(held, second[tensor], strict=True)
        )
        for tensor, held in first.items()
    }


def row_of(planes: PlaneSet, row: int) -> PlaneSet:
    """Row ``row`` of a batched plane set (a view, ``[1, ...]``, whatever the rank)."""
    return {tensor: tuple(p[row : row + 1] for p in held) for tensor, held in planes.items()}


def arrays(planes: PlaneSet | None) -> tuple[mx.array, ...]:
    """Every plane held, tensor by tensor (none for ``None``)."""
    return () if planes is None else tuple(p for held in planes.values() for p in held)


def token_count(planes: PlaneSet) -> int:
    """Tokens a token geometry's plane set holds (its first plane's token axis)."""
    for held in planes.values():
        return int(held[0].shape[TOKEN_AXIS])
    return 0


def write_columns(planes: PlaneSet, block: PlaneSet, starts: list[int], n: int) -> None:
    """Slot ``b`` takes block row ``b``'s ``n`` tokens at columns ``[starts[b], starts[b] +
    n)``: one slice write when every row starts at one column, else one scatter."""
    batch = len(starts)
    if len(set(starts)) == 1:
        start = starts[0]
        for plane, encoded in paired(planes, block):
            plane[:batch, :, start : start + n] = encoded
    else:
        rows = mx.arange(batch)[:, None]
        columns = mx.array(starts)[:, None] + mx.arange(n)[None, :]
        for plane, encoded in paired(planes, block):
            if plane.size:  # (MLX's scatter into a zero-width plane dies of SIGFPE)
                plane[rows, :, columns] = mx.swapaxes(encoded, 1, 2)


def kv_pair(planes: PlaneSet) -> tuple[Planes, Planes]:
    """The key and value planes of a KV plane set (the tests' and conformance's views)."""
    return planes["keys"], planes["values"]


def _shape(value: object) -> tuple[int, ...]:
    return tuple(value.shape) if isinstance(value, mx.array) else ()


class Storage(SavedState, ComposedIdentity, PlaneHolder):
    """What every storage is, serial or layout, whatever its geometry.

    It holds ``_planes``: a :data:`PlaneSet` (each tensor's planes, ``None`` before the
    first write); the templates and hooks iterate over its tensors and never name one. Rows
    in several stages (contract §0.5) are held in ``_stores`` instead, one :class:`Store`
    per stage, which a geometry with ``_stage_stores`` runs its hooks over.

    Geometry hooks (a geometry class overrides each; the templates call them after
    validating): ``_reset_geometry()`` (forget the geometry's own state),
    ``_append(block, n, geometry)`` (write an encoded plane set; the row positions
    advance afterwards), ``_visible(planes)`` (what ``fetch`` returns),
    ``_window(planes, row)`` (row ``row``'s stored planes in time order, or every row's
    when ``row`` is ``None`` on a serial storage; ``None`` when nothing is held),
    ``_place(incoming, geometry)`` (join rows; the positions are appended afterwards),
    ``_keep(order)`` (keep rows), ``_check_trim(counts)`` / ``_forget(counts)``,
    ``_adopt(planes, offset)`` (a serial storage takes an extracted window),
    ``_serial_mask`` / ``_layout_mask``, ``is_trimmable``. A geometry without a token
    axis implements the same hooks over whole rows (axis 0 only).
    """

    composition: ClassVar[Composition]
    #: The array library the rows are held in (a ``RowSource``: a merge takes rows of its
    #: own library only).
    array_name: ClassVar[str] = "MLX"
    #: The geometry kind a geometry class implements, and the arrangements it supports.
    geometry_kind: ClassVar[str]
    #: The placement a class's rows live in (contract §0.4; the paged placement's classes
    #: say ``paged``).
    placement_kind: ClassVar[str] = "contiguous"
    arrangements: ClassVar[frozenset[str]]
    #: The arrangement a base class implements (``Serial`` / ``Layout``).
    arrangement_kinds: ClassVar[frozenset[str]]

    codec: Codec
    _planes: PlaneSet | None
    #: ``None``: every row is in one stage and ``_planes`` is its store (rows in slots
    #: ``0 .. B-1``). Otherwise the stores of the stages holding rows, in stage order, and
    #: ``_planes`` is ``None`` (contract §0.4; only a geometry with ``_stage_stores``).
    _stores: list[Store] | None
    #: Whether the geometry's hooks run over several stage stores (growing); the others
    #: keep a storage's rows in one stage (``STAGES_MOVE_TOGETHER``).
    _stage_stores: ClassVar[bool] = False
    _geometry: KvGeometry | None
    #: The last block ``_update`` accepted: ``(shapes, dtypes and rows, geometry, codec)``.
    _accepted: tuple[Any, KvGeometry, Any] | None = None
    _offsets: list[int]
    _pads: list[int]
    #: Whether ``update_and_fetch``'s decode step may skip the template's write / read
    #: layers (the class overrides none of them: ``__init_subclass__``).
    _lean_write: ClassVar[bool] = True
    _lean_read: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # ``update_and_fetch``'s lean decode step stands in for these template methods: a
        # class overriding one (a placement that refuses first, a latent's read, a modifier's
        # guard) takes the template's full write or read.
        cls._lean_write = all(getattr(cls, m) is getattr(Storage, m) for m in _LEAN_WRITE)
        cls._lean_read = all(getattr(cls, m) is getattr(Storage, m) for m in _LEAN_READ)
        entry = cls.__dict__.get("composition")
        if entry is None:
            return  # a base, a geometry, or a subclass of a public class (tests' mutants)
        if (
            entry.geometry != cls.geometry_kind
            or entry.placement != cls.placement_kind
            or entry.arrangement not in (cls.arrangements & cls.arrangement_kinds)
        ):
            raise KvRowsError(
                f"{cls.__name__}: {entry.name} is {entry.geometry}/{entry.placement}/"
                f"{entry.arrangement}, the class is {cls.geometry_kind}/{cls.placement_kind}/"
                f"{sorted(cls.arrangement_kinds)}"
            )
        codec = CODECS.get(entry.codec)  # None: a class of any codec (its spec decides)
        delayed = "delayed" in entry.modifiers  # its bits show under the modifier's rule
        if (
            codec is not None
            and not delayed
            and ("bits" in codec.state_tail) != hasattr(cls, "bits")
        ):
            raise KvRowsError(f"{cls.__name__}: bits/group_size must exist iff it is affine")
        # The delayed modifier's mixin: the lego's (``composed``) on a serial storage, the
        # layout mixin (``attend_rows``) on a layout of stage stores.
        if delayed and not (
            callable(getattr(cls, "attend_rows", None)) and cls._stage_stores
            if entry.is_layout
            else hasattr(cls, "composed")
        ):
            raise KvRowsError(f"{entry.name}: the delayed modifier's mixin is missing")
        # Modifiers wrap a layout: a class with the speculative one lists SpeculativeLayout
        # first among its bases (``optimized/speculative.py``).
        speculative = callable(getattr(cls, "spec_round_begin", None))
        if speculative != ("speculative" in entry.modifiers):
            raise KvRowsError(speculative_modifier_message(entry.name))
        planned = entry.modifiers - {"speculative", "delayed"}
        if planned:
            raise KvRowsError(f"{entry.name}: modifiers {sorted(planned)} not built yet")
        DECLARED[entry.name] = cls

    # -- construction ---------------------------------------------------------------------
    def __init__(self, *args: object, **kwargs: object) -> None:
        codec_spec, token_geometry, geometry = bind_arguments(self.composition, args, kwargs)
        self._setup(codec_spec, token_geometry, geometry)

    @classmethod
    def _spawn(cls: type[_S], like: Storage, spec: CodecSpec | None = None) -> _S:
        """An empty instance with ``like``'s (already validated) specs (``spec``: of that
        codec instead, one of ``like``'s stages)."""
        fresh = cls.__new__(cls)
        fresh._setup(spec or like.codec_spec, like.token_geometry, None)
        return fresh

    def _setup(
        self, codec_spec: CodecSpec, token_geometry: GeometrySpec, geometry: KvGeometry | None
    ) -> None:
        self._token_geometry = token_geometry
        self.codec = make_codec(codec_spec)
        #: The codecs of the stages (contract §0.5): one, but under the delayed modifier.
        self._stages: tuple[Codec, ...] = (self.codec,)
        self._geometry = geometry
        self._pads_of: list[int] | None = None  # the pads list ``_pads_array`` copies
        self._pads_array: mx.array | None = None
        #: ``(pads list, pad test, its columns)``: what ``_pad_columns`` slices while the
        #: pads stay.
        self._pad_test: tuple[list[int], mx.array, int] | None = None
        self._clear()

    # -- stages (the delayed modifier's array hooks, contract §0.5) ---------------------------
    def _use_stages(self, specs: Sequence[CodecSpec]) -> None:
        """Hold stages of ``specs`` (an empty storage; its rows start in stage 0)."""
        self._stages = tuple(make_codec(spec) for spec in specs)
        self.codec = self._stages[0]

    def _convert_rows(self, rows: Sequence[int]) -> None:
        """Move rows ``rows`` (any subset; a row given twice counts once) into their next
        stage (contract §0.5), checked whole before anything changes. Every row of one
        store moving: the store re-encoded whole (capacity included, as mlx-lm quantizes
        its buffer; a ring keeps its phase); some rows: only their slots move to the next
        stage's store (``_move_rows``, a geometry with stage stores). Owned and evaluated;
        the old planes are replaced, not changed (a view taken before keeps them)."""
        moving = sorted({check_row(b, len(self._offsets)) for b in rows})
        stages, last = self.row_stages, len(self._stages) - 1
        for b in moving:
            if stages[b] == last:
                raise LayoutStateError(last_stage_message(b, last))
        if not moving:
            return
        if self._stores is None and len(moving) == len(self._offsets):
            self._convert_store()
        elif not self._stage_stores:
            raise LayoutStateError(STAGES_MOVE_TOGETHER)
        else:
            self._move_rows(moving)

    def _convert_store(self) -> None:
        """Every row of the one store into the next stage: the store re-encoded whole."""
        source, target = self.codec, self._stages[self._stage + 1]
        if self._geometry is not None:
            target.check(self._geometry)  # head dims the codec stores
        if self._planes is not None:
            rows = list(range(len(self._offsets)))
            converted = self._converted(self._planes, rows, source, target)
            mx.eval(*arrays(converted))  # before the planes change: a failure changes nothing
            self._planes = converted
        self.codec = target
        self._changed()

    def _converted(
        self, planes: PlaneSet, rows: list[int], source: Codec, target: Codec
    ) -> PlaneSet:
        """Slots holding ``rows`` (batch rows, in slot order; spare slots after them)
        decoded by ``source`` and encoded by ``target``, per token; a column that holds no
        token of its slot's row (its left pad, past its end, a spare slot) is ``target``'s
        zeros, as a merge or a load lays it (contract §0.5: never the encoding of a pad)."""
        encoded = {
            t: target.encode(source.decode(held, as_role(t)), as_role(t))
            for t, held in planes.items()
        }
        held = self._held_columns(rows, token_count(planes))
        if held is None:
            return encoded
        spare = int(arrays(planes)[0].shape[0]) - len(rows)
        if spare:
            held = mx.concatenate([held, mx.zeros((spare, *held.shape[1:]), mx.bool_)])
        return mapped(encoded, lambda p: mx.where(held, p, mx.array(0, p.dtype)))

    def _held_columns(self, rows: list[int], columns: int) -> mx.array | None:
        """Which of the ``columns`` physical columns of slots holding ``rows`` (in slot
        order) hold a token of their row: bool ``[len(rows), 1, columns, 1]``. ``None``:
        every column may (a geometry that reads no column outside its rows' tokens)."""
        return None

    @property
    def _masked_read_zeros(self) -> bool:
        """Whether the columns a read masks must hold the codec's zeros (contract §0.5: a
        delayed layout's, whose saved form keeps only the rows' tokens, so a load lays
        zeros there); elsewhere they are unspecified (contract §3) and a trim or a join
        pays no clearing."""
        return "delayed" in self.composition.modifiers

    def _clear_rows(self, first: Sequence[int], counts: Sequence[int]) -> None:
        """Row ``b``'s columns ``[first[b], first[b] + counts[b])`` in its store read zeros
        (every codec's ``zeros``) again, in place: one scatter per plane of each store,
        every zero block built before the first scatter (a fault writes nothing)."""
        writes: list[tuple[mx.array, mx.array, mx.array, mx.array]] = []
        for store in self._store_list():
            held = np.array([counts[b] for b in store.rows], dtype=np.int64)
            if store.planes is None or not held.sum():
                continue
            # Each slot's run of columns, without a Python loop over the cells.
            starts = np.array([first[b] for b in store.rows], dtype=np.int64)
            cells = int(held.sum())
            run_start = np.repeat(np.cumsum(held) - held, held)
            slots = mx.array(np.repeat(np.arange(len(held)), held))
            columns = mx.array(np.repeat(starts, held) + np.arange(cells) - run_start)
            for plane in arrays(store.planes):
                shape = (cells, int(plane.shape[1]), int(plane.shape[3]))
                writes.append((plane, slots, columns, mx.zeros(shape, plane.dtype)))
        for plane, slots, columns, zeros in writes:  # cannot raise: shapes checked above
            if plane.size:  # (a zero-width plane holds nothing to clear; MLX's scatter dies)
                plane[slots, :, columns] = zeros

    def _row_slots(self) -> list[tuple[Store, int]]:
        """Each row's store and slot there, in batch order (several stores): the one map
        ``row_stages``, ``_row_codecs`` and ``_store_of`` read."""
        assert self._stores is not None
        held: list[tuple[Store, int]] = [(self._stores[0], 0)] * len(self._offsets)
        for store in self._stores:
            for slot, b in enumerate(store.rows):
                held[b] = (store, slot)
        return held

    @property
    def row_stages(self) -> tuple[int, ...]:
        """Each row's stage, in batch order (contract §0.5)."""
        if self._stores is None:
            return (self._stage_of(self.codec),) * len(self._offsets)
        return tuple(store.stage for store, _ in self._row_slots())

    def _row_codecs(self, count: int) -> list[Codec]:
        """The codec of each of ``count`` rows a merge takes from this storage (its row
        windows: a storage without rows lends empty ones of its codec)."""
        if self._stores is None:
            return [self.codec] * count
        return [store.codec for store, _ in self._row_slots()]

    def _held_codecs(self) -> list[Codec]:
        """The codecs of the stages holding rows, in stage order (``codec`` with none)."""
        if self._stores is None:
            return [self.codec]
        return [store.codec for store in self._stores]

    def _stage_of(self, codec: Codec) -> int:
        """The stage of this storage whose codec encodes as ``codec`` does."""
        key = codec.key
        for stage, held in enumerate(self._stages):  # (a merge asks it of every row)
            if held is codec or held.key == key:
                return stage
        raise ValueError(f"{key!r} is not a stage's codec")

    def _new_store(self, stage: int) -> Store:
        """An empty store of ``stage`` (of ``codec`` when it is the rows' stage)."""
        codec = self.codec if self._stage_of(self.codec) == stage else self._stages[stage]
        return Store(stage, None, [], codec)

    def _store_list(self) -> list[Store]:
        """The stores holding rows (the one store wrapped when rows are in one stage;
        none without rows): what a hook running over several stores reads."""
        if self._stores is not None:
            return self._stores
        if not self._offsets:
            return []
        rows = list(range(len(self._offsets)))
        return [Store(self._stage_of(self.codec), self._planes, rows, self.codec)]

    def _put_stores(self, stores: list[Store]) -> None:
        """Hold ``stores`` (every store with rows; rows in batch order in each): one store
        is ``_planes`` again (its rows are then ``0 .. B-1``), several are ``_stores``;
        ``codec`` is the newest stage holding rows."""
        live = sorted((s for s in stores if s.rows), key=lambda s: s.stage)
        if len(live) > 1:
            self._stores, self._planes = live, None
        else:
            self._stores = None
            if live:
                self._planes = live[0].planes
        if live:
            self.codec = live[-1].codec

    def _store_of(self, row: int) -> tuple[Store, int]:
        """The store holding row ``row`` (several stores) and its slot there."""
        return self._row_slots()[row]

    def _move_rows(self, moving: list[int]) -> None:
        """Rows ``moving`` (checked, sorted, none in the last stage, not every row of one
        store) into their next stage's store (a geometry with stage stores): each row's slot
        decoded by its stage's codec and encoded by the next one's (the same columns), the
        stores then gathered (``_gather_slots``) so each keeps its rows in batch order;
        owned and evaluated."""
        stores = {store.stage: store for store in self._store_list()}
        geometry = self._geometry
        moves = set(moving)
        sources = [s for s in sorted(stores, reverse=True) if moves.intersection(stores[s].rows)]
        if geometry is not None:
            for stage in sources:  # head dims the codecs store, before anything moves
                self._stages[stage + 1].check(geometry)
        for stage in sources:  # the newest first: a moved row moves once
            store = stores[stage]
            slot = {b: i for i, b in enumerate(store.rows)}
            rows = [b for b in store.rows if b in moves]
            source, target = store.codec, self._stages[stage + 1]
            into = stores.setdefault(stage + 1, Store(stage + 1, None, [], target))
            staying = [b for b in store.rows if b not in moves]
            joined = sorted(into.rows + rows)
            if store.planes is not None:
                slots = mx.array([slot[b] for b in rows])
                taken = {
                    t: tuple(mx.take(p, slots, axis=0) for p in held)
                    for t, held in store.planes.items()
                }
                moved = self._converted(taken, rows, source, target)
                into.planes = self._merged_slots(into.planes, into.rows, moved, rows)
                if staying:
                    kept = [slot[b] for b in staying]
                    store.planes = self._gather_slots(store.planes, kept)
            into.rows, store.rows = joined, staying
        self._put_stores(list(stores.values()))
        mx.eval(*self.held_arrays())
        self._changed()

    def _gather_slots(self, planes: PlaneSet, slots: list[int]) -> PlaneSet:
        """Slots ``slots`` of a store's ``planes`` in that order, then a few spare slots (a
        view of the planes when they are already the first slots in order; else one
        gather); a geometry whose hooks write every slot keeps none (the ragged ring)."""
        if slots == list(range(len(slots))):
            return planes
        index = mx.array(slots + [slots[-1]] * (spare_slots(len(slots)) - len(slots)))
        # Every filter runs it: a comprehension, no per-plane call.
        return {t: tuple(mx.take(p, index, axis=0) for p in held) for t, held in planes.items()}

    def _merged_slots(
        self, planes: PlaneSet | None, rows: list[int], moved: PlaneSet, joining: list[int]
    ) -> PlaneSet:
        """A store's planes holding its rows ``rows`` (slots ``0 ..``) and the rows
        ``joining`` (``moved``'s slots, in order) in batch order (``_gather_slots``)."""
        if planes is None or not rows:
            return moved
        held = len(rows)
        both = {
            t: tuple(
                mx.concatenate([p[:held], m], axis=0) for p, m in zip(ps, moved[t], strict=True)
            )
            for t, ps in planes.items()
        }
        where = {b: i for i, b in enumerate(rows)} | {b: held + i for i, b in enumerate(joining)}
        return self._gather_slots(both, [where[b] for b in sorted(where)])

    def _stage_parts(self) -> list[tuple[list[int], Codec, dict[str, Any]]]:
        """The read of rows in several stages (contract §0.5): per stage holding rows, in
        stage order, ``(rows, codec, reads)``: its rows in batch order and each tensor's
        fetched form of the full-width read image restricted to those rows."""
        if self._stores is None:
            return [(list(range(len(self._offsets))), self.codec, self._read())]
        parts = []
        for store in self._stores:
            if store.planes is None:
                raise LayoutStateError(NOTHING_TO_FETCH)
            codec = store.codec
            parts.append((list(store.rows), codec, self._fetched(codec, self._visible_rows(store))))
        return parts

    def _stage_view(self, cls: type[_S], view: _S | None = None) -> _S:
        """An instance of the one-stage class ``cls`` (this storage's current stage and
        geometry hooks) sharing this storage's store and host state (``view``: that
        instance, brought up to date): borrowed, what it holds is this storage's until a
        conversion or a reset replaces them."""
        if view is None:
            view = cls.__new__(cls)
        vars(view).update(
            (name, value) for name, value in vars(self).items() if name not in _STAGED_ONLY
        )
        view._stages = (view.codec,)
        return view

    def _take_rows(self, storage: Storage) -> None:
        """Hold what ``storage`` holds (a one-stage storage of one of this one's stages, same
        geometry hooks): its store and host state are this storage's now."""
        stage = self.stages.index(storage.codec.spec)
        vars(self).update(
            (name, value)
            for name, value in vars(storage).items()
            if name not in _STAGED_ONLY and name != "codec"
        )
        self.codec = self._stages[stage]
        self._changed()

    def _clear(self) -> None:
        """Hold no row and no buffer (the KV geometry, once known, is kept)."""
        self._planes, self._stores = None, None
        self._offsets, self._pads = [], []
        self._changed()
        self._reset_geometry()

    @property
    def _tokens_held(self) -> list[int]:
        """Tokens each row holds: every one it was given (a geometry that evicts from the
        front, chunked, or wraps keeps fewer and says so)."""
        return self._offsets

    def _changed(self) -> None:
        """The positions changed: drop their device copy."""
        self._offset_array: mx.array | None = None

    @property
    def holds_proposals(self) -> bool:
        """Whether its rows can keep every column a proposal round appends, so that
        ``spec_round_discard`` forgets them (``kvrows.speculative``): a growing geometry
        drops nothing, a ragged ring drops none while held (``_spec_hold``)."""
        return False

    def _spec_hold(self, on: bool) -> None:
        """Keep (``on``) or stop keeping every column appended: a proposal round's."""

    def _settle(self) -> None:
        """Hold ``_planes`` as the arrays themselves, before a write in place (a wrapped
        ring's ordered form otherwise derives them: ``SharedRing``)."""

    def _fault_parts(self, *, held: bool = False) -> Any:
        """Each stage store's fields (``all_or_nothing`` puts them back on a fault);
        ``held``: also a second handle on every held plane (an in-place write then
        copies, leaving the handle what the plane held)."""
        if self._stores is None and not held:  # one store: its fields are attributes
            return None

        def kept(planes: PlaneSet | None) -> PlaneSet | None:
            if not held or planes is None:
                return planes
            return {t: tuple(mx.array(p) for p in ps) for t, ps in planes.items()}

        stores = [(s, (s.stage, kept(s.planes), list(s.rows), s.codec)) for s in self._stores or ()]
        return stores, (kept(self._planes) if held else None)

    def _fault_restore(self, parts: Any) -> None:
        stores, planes = parts
        for store, (stage, kept, rows, codec) in stores:
            store.stage, store.planes, store.rows, store.codec = stage, kept, rows, codec
        if planes is not None:
            self._planes = planes

    def held_arrays(self) -> tuple[Any, ...]:
        """The buffers held, borrowed (to evaluate at a chunk boundary; ``state`` may copy)."""
        return self._held_planes()

    def _held_planes(self) -> tuple[Any, ...]:
        """Every stage store's whole planes (``nbytes``: capacity slack included)."""
        if self._stores is not None:
            return tuple(p for store in self._stores for p in arrays(store.planes))
        return arrays(self._planes)

    def _zeros(self, rows: int, columns: int, shapes: Any, codec: Codec | None = None) -> PlaneSet:
        """Zero planes of every tensor ``shapes`` (a KV geometry, a codec's ``Shapes``)
        names, ``rows`` rows of ``columns`` tokens (of ``codec``, default this storage's)."""
        return zero_planes(codec or self.codec, shapes, rows, columns)

    # -- what it learnt of its tensors' shapes ----------------------------------------------
    def _shapes(self) -> Any:
        """What the storage learnt of its tensors' shapes (a KV geometry; a state
        geometry keeps its planes' kinds): what a merge joins and an extraction carries."""
        return self._geometry

    def _take_shapes(self, shapes: Any) -> None:
        self._geometry = shapes

    def _joined_shapes(self, sources: Sequence[Any]) -> Any:
        """The shapes after joining ``sources`` (raises ``IncompatibleRowsError``)."""
        return common_geometry([self._geometry, *(s.geometry for s in sources)])

    def adopt(self: _S, planes: PlaneSet, offset: int, geometry: Any) -> _S:
        """Make this (empty) storage hold ``planes`` (owned, compact, in time order) as the
        newest tokens below position ``offset`` (extraction: a serial storage, or a layout
        that is its own serial storage)."""
        if self._planes is not None:
            raise LayoutStateError(ADOPT_NEEDS_EMPTY)
        rows = int(next(iter(planes.values()))[0].shape[0])
        self._planes = planes
        self._take_shapes(geometry)
        self._offsets, self._pads = [offset] * rows, [0] * rows
        self._changed()
        self._adopt(planes, offset)
        return self

    # -- saved state (``SavedState``; mechanics: ``optimized/forms.py``) ---------------------
    def _state(self) -> tuple[Any, ...]:
        from kvrows.optimized.forms import state_of

        if self._stores is not None:  # a form of rows of several stages: not defined yet
            raise MixedPrecisionReadError(MIXED_READ)
        return state_of(self)

    @classmethod
    def _restore(
        cls: type[_S], state: Any, meta_state: Any, keep: int | None, geometry: KvGeometry | None
    ) -> _S:
        from kvrows.optimized.forms import restore_state

        return restore_state(cls, state, meta_state, keep=keep, geometry=geometry)

    def pads_array(self) -> mx.array:
        """The left pads on the device (for masks), cached while the pads stay the same
        list (every change rebinds ``_pads``; a decode step keeps it)."""
        if self._pads_array is None or self._pads_of is not self._pads:
            self._pads_of, self._pads_array = self._pads, mx.array(self._pads)
        return self._pads_array

    def _pad_columns(self, columns: int) -> mx.array:
        """Whether each of the first ``columns`` logical columns is at or past each row's
        left pad, bool ``[B, 1, 1, columns]`` (a mask's pad test): a view of one array kept
        while the pads stay the same list and it is wide enough, so a decode step's mask
        only slices it. It grows in steps of ``STEP`` columns, as the buffers do."""
        known = self._pad_test
        if known is None or known[0] is not self._pads or known[2] < columns:
            wide = round_up(columns)
            test = mx.arange(wide)[None, :] >= self.pads_array()[:, None]
            known = self._pad_test = (self._pads, test[:, None, None, :], wide)
        return known[1][_ALL, _ALL, _ALL, slice(columns)]

    def _accepts(self, source: object) -> bool:
        # A storage of this machinery (its rows MLX windows), of our token geometry; each
        # codec the source's rows are in (a source holding none: its codec) is one of this
        # storage's stages' (contract §0.5).
        if (
            not isinstance(source, RowSource)
            or source.array_name != self.array_name
            or source.token_geometry != self.token_geometry
        ):
            return False
        held = cast(Storage, source)._held_codecs()
        if len(self._stages) == 1 and len(held) == 1:  # (every merge of one stage)
            return held[0].key == self._stages[0].key
        keys = {c.key for c in self._stages}
        return all(codec.key in keys for codec in held)

    # -- the templates --------------------------------------------------------------------
    def _block_rows(self) -> int | None:
        raise NotImplementedError

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        if (
            self._lean_write
            and self._stores is None
            and (geometry := self._again(keys, values)) is not None
        ):
            # A decode step: ``_update``'s write without the template's layers (a block
            # like the last one accepted, into the one store; the geometry's hooks as ever).
            n = int(keys.shape[TOKEN_AXIS])
            codec = self.codec
            block: PlaneSet = {
                _KEYS: codec.encode(keys, _KEYS),
                _VALUES: codec.encode(values, _VALUES),
            }
            self._append(block, n, geometry)
            self._advanced(n)
        else:
            # Refused before the write: each stage's rows are read by parts (``_update``,
            # ``_stage_parts``).
            if self._stores is not None and self._reads_by_parts():
                raise MixedPrecisionReadError(MIXED_READ)
            self._update(keys, values)
        # ``fetch`` without its layers (one store; ``_planes`` is read only then: a ring
        # may derive it).
        if self._lean_read and (planes := self._planes) is not None:
            visible, codec = self._visible(planes), self.codec
            return codec.fetched(visible[_KEYS], _KEYS), codec.fetched(visible[_VALUES], _VALUES)
        return self.fetch()

    def _again(self, keys: Any, values: Any) -> KvGeometry | None:
        """The geometry ``keys`` / ``values`` were accepted into when they are a block like
        the last one accepted: MLX arrays of its shapes, dtypes and rows, into the same
        geometry and codec (every decode step appends one; it is accepted as that one was,
        the full check being a fifth of the host cost); ``None`` otherwise. The memo holds
        only a block the full check accepted."""
        memo = self._accepted
        if memo is None or type(keys) is not mx.array or type(values) is not mx.array:
            return None
        # The dtypes by name (mlx-lm deep-copies caches: an MLX dtype does not copy); the
        # rows as ``_block_rows`` gives them for a storage holding rows, either arrangement
        # (a memo's rows are never 0: an empty storage never takes it).
        names = _NAMES.get(keys.dtype), _NAMES.get(values.dtype)
        seen = (keys.shape, values.shape, *names, len(self._offsets))
        if memo[0] == seen and memo[1] is self._geometry and memo[2] is self.codec:
            return memo[1]
        return None

    def _update(self, keys: Any, values: Any) -> None:
        """``update_and_fetch`` without its read (rows of several stages read by parts)."""
        geometry = self._again(keys, values)
        if geometry is None:
            rows = self._block_rows()
            geometry = check_block(
                _shape(keys),
                _shape(values),
                dtype_name(keys),
                dtype_name(values),
                rows=rows,
                geometry=self._geometry,
            )
            if self._stores is None:
                self.codec.check(geometry)
                self._accepted = None
                if type(keys) is mx.array and type(values) is mx.array:
                    names = _NAMES.get(keys.dtype), _NAMES.get(values.dtype)
                    seen = (keys.shape, values.shape, *names, rows)
                    self._accepted = (seen, geometry, self.codec)
            else:
                for codec in self._held_codecs():
                    codec.check(geometry)
        self._write_blocks({_KEYS: keys, _VALUES: values}, geometry)

    def _write_blocks(self, blocks: dict[str, Any], shapes: Any) -> None:
        """The one write (``update_and_fetch``, a latent ``append``): checked blocks
        ``[rows, heads, n, ·]`` per tensor, each encoded once per stage holding rows, then
        :meth:`_write` (one stage) or ``_append_stores`` (each store its rows' share)."""
        n = int(next(iter(blocks.values())).shape[TOKEN_AXIS])
        if self._stores is None:
            # (Each tensor's name is its role: one cast, not a call per tensor.)
            named = cast(dict[Role, Any], blocks)
            block: PlaneSet = {t: self.codec.encode(x, t) for t, x in named.items()}
            self._write(block, n, shapes)
            return
        shares: list[PlaneSet] = []
        for store in self._stores:
            codec, index = store.codec, mx.array(store.rows)
            shares.append(
                {
                    t: tuple(mx.take(p, index, axis=0) for p in codec.encode(x, as_role(t)))
                    for t, x in blocks.items()
                }
            )
        self._take_shapes(shapes)
        self._append_stores(shares, n, shapes)
        self._advanced(n)

    def _write(self, block: PlaneSet, n: int, shapes: Any) -> None:
        """Write an encoded block of ``n`` tokens: the storage takes ``shapes``, the
        geometry appends (``_append``), then the positions advance (a placement that may
        refuse overrides it: it refuses first, then calls this)."""
        self._take_shapes(shapes)
        if not self._offsets:  # a serial storage's first block sets its rows
            batch = int(next(iter(block.values()))[0].shape[0])
            self._offsets, self._pads = [0] * batch, [0] * batch
        self._append(block, n, shapes)
        self._advanced(n)

    def _advanced(self, n: int) -> None:
        """Every row's position moves ``n`` on (an append): a geometry that derives host
        state from the positions may carry it forward rather than rebuild it."""
        self._offsets = [o + n for o in self._offsets]
        self._changed()

    def fetch(self) -> tuple[Any, Any]:
        keys, values = self._read().values()
        return keys, values

    def _read(self) -> dict[str, Any]:
        """Each tensor as attention reads it now (the codec's fetched form of what the
        geometry shows)."""
        if self._planes is None:
            if self._stores is not None:
                return self._dense_read()
            raise LayoutStateError(NOTHING_TO_FETCH)
        return self._fetched(self.codec, self._visible(self._planes))

    def _fetched(self, codec: Codec, visible: PlaneSet) -> dict[str, Any]:
        """Each tensor of one store's ``visible`` planes as a read returns it: ``codec``'s
        fetched form (an encoded latent reads its latent from a decoded window instead)."""
        named = cast(dict[Role, Planes], visible)  # (one cast, not a call per tensor)
        return {t: codec.fetched(planes, t) for t, planes in named.items()}

    def _reads_by_parts(self) -> bool:
        """Whether the rows are in several stages and some stage's codec does not read a
        dense array (affine triples, TurboQuant's own): a read is then by parts only."""
        return self._stores is not None and any(
            store.codec.spec.reads != "dense" for store in self._stores
        )

    def _dense_read(self) -> dict[str, Any]:
        """Rows of several stages whose codecs all read dense arrays (a plain and an
        encoded latent): each row from its stage's part, in batch order (contract §0.5)."""
        if self._reads_by_parts():
            raise MixedPrecisionReadError(MIXED_READ)  # each stage's rows: _stage_parts
        parts = self._stage_parts()
        order = [b for rows, _, _ in parts for b in rows]
        inverse = mx.array(sorted(range(len(order)), key=order.__getitem__))
        return {
            t: mx.take(mx.concatenate([reads[t] for _, _, reads in parts], axis=0), inverse, 0)
            for t in parts[0][2]
        }

    def _held_window(self, row: int | None) -> PlaneSet | None:
        """Row ``row``'s planes in time order (every row's on a serial storage when
        ``row`` is ``None``); ``None`` when nothing is held."""
        if self._stores is not None and row is not None:
            store, slot = self._store_of(row)
            return None if store.planes is None else self._window_slot(store.planes, row, slot)
        return None if self._planes is None else self._window(self._planes, row)

    def _window_pair(self, row: int | None) -> tuple[Planes, Planes] | None:
        held = self._held_window(row)
        return None if held is None else kv_pair(held)

    def _row_windows(self) -> list[RowWindow]:
        """Every row this storage holds, as a merge takes it."""
        raise NotImplementedError

    def _each_row(self) -> list[RowWindow]:
        """Every row's window, one by one (a layout's rows)."""
        rows: list[RowWindow] = []
        for b, offset in enumerate(self._offsets):
            rows.append((self._held_window(b), offset))
        return rows

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        return self._mask(as_count(n, "n", minimum=1), return_array, check_window(window_size))

    def _mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        raise NotImplementedError

    # -- geometry hooks -------------------------------------------------------------------
    def _reset_geometry(self) -> None:
        raise NotImplementedError

    def _append(self, block: PlaneSet, n: int, geometry: KvGeometry) -> None:
        raise NotImplementedError

    def _visible(self, planes: PlaneSet) -> PlaneSet:
        raise NotImplementedError

    def _window(self, planes: PlaneSet, row: int | None) -> PlaneSet | None:
        raise NotImplementedError

    # Stage stores (a geometry with ``_stage_stores``, contract §0.4): the hooks over several.
    def _window_slot(self, planes: PlaneSet, row: int, slot: int) -> PlaneSet | None:
        """``_window`` of row ``row`` held at slot ``slot`` of ``planes``."""
        raise NotImplementedError

    def _visible_rows(self, store: Store) -> PlaneSet:
        """``_visible`` of one store's rows."""
        raise NotImplementedError

    def _append_stores(self, shares: list[PlaneSet], n: int, geometry: KvGeometry) -> None:
        """``_append`` over several stores: ``shares[i]``, store ``i``'s rows' block."""
        raise NotImplementedError

    def _place_stages(
        self, incoming: list[RowWindow], stages: list[int], geometry: KvGeometry | None
    ) -> None:
        """``_place`` of rows joining in stages ``stages`` (one per row)."""
        raise NotImplementedError

    def _place(self, incoming: list[RowWindow], geometry: KvGeometry | None) -> None:
        raise NotImplementedError

    def _keep(self, order: list[int]) -> None:
        raise NotImplementedError

    def _check_trim(self, counts: Sequence[int]) -> None:
        raise NotImplementedError

    def _forget(self, counts: Sequence[int], *, justify: bool = False) -> None:
        """Row ``b`` forgets its newest ``counts[b]`` tokens (the offsets move afterwards);
        ``justify``: a shared-column rollback, the rows roll right to one end column."""
        raise NotImplementedError

    def _adopt(self, planes: PlaneSet, offset: int) -> None:
        raise NotImplementedError

    def _serial_mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        raise NotImplementedError

    def _layout_mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        raise NotImplementedError

    def _check_geometry(self) -> None:
        raise NotImplementedError

    def _owned(self, window: PlaneSet) -> PlaneSet:
        """An owned compact copy of a row's window (what an extraction hands out)."""
        return mapped(window, owned)

    def _holds_nothing(self, held: PlaneSet) -> bool:
        """Whether a window holds no token (a geometry without a token axis: never)."""
        return token_count(held) == 0

    def _read_start(self) -> int:
        """The buffer column what ``_visible`` returns starts at (0 unless a geometry
        keeps an origin)."""
        return 0

    def is_trimmable(self) -> bool:
        raise NotImplementedError

    # Saved forms (``optimized/forms.py``): what only the geometry knows of its form.
    def _serial_form_fields(self) -> dict[str, Any]:
        """A serial storage's form fields its specs and offset do not give (a ring's
        write index ``idx``)."""
        raise NotImplementedError

    def _layout_image(self) -> LayoutImage | None:
        """A layout's form as its buffers already hold it, ``(fields, left_padding,
        planes)``; ``None``: the form right-aligns a copy of its rows."""
        raise NotImplementedError

    def _resume_serial(self, fields: dict[str, Any], held: int) -> None:
        """After a restored serial storage adopted ``held`` saved columns: take the
        geometry's own fields (a ring's ``idx``), or refuse a form it cannot hold."""
        raise NotImplementedError

    # Padded blocks (mlx-lm's batch API, ``batch_dropin.py``): each row's pads of the block
    # just appended are forgotten, the trailing ones and then the leading ones.
    def _forget_tail_pads(self, tail: list[int]) -> None:
        """Row ``b``'s last ``tail[b]`` appended columns were pads (positions not yet
        moved)."""
        raise NotImplementedError

    def _forget_front_pads(self, front: list[int]) -> None:
        """Row ``b``'s first ``front[b]`` columns of the block were pads."""
        raise NotImplementedError

    def _block_starts(self, n: int) -> list[int]:
        """The mask column of each row's first token of the next ``n``-token block."""
        raise NotImplementedError

    def _check_padded_update(self, n: int, real: list[int], tail: list[int]) -> None:
        """Refuse, before anything changes, an ``n``-token block whose row ``b`` holds
        ``real[b]`` real tokens then ``tail[b]`` right pads that the geometry could not
        forget exactly."""
        raise NotImplementedError

    def _roll_right(self, start: int, stop: int, shifts: list[int]) -> None:
        """Rotate each row's columns ``[start, stop)`` right by its shift: its trailing
        pads wrap round to the front, where the row's left padding then covers them."""
        width = stop - start
        for store in self._store_list():  # each store: its rows' shifts
            rows, moved = len(store.rows), [shifts[b] for b in store.rows]
            index = (mx.arange(width)[None, :] - mx.array(moved)[:, None]) % width
            index = index[:, None, :, None]
            for plane in arrays(store.planes):
                region = plane[:rows, :, start:stop]
                plane[:rows, :, start:stop] = mx.take_along_axis(region, index, axis=2)


class Serial(Storage):
    """One request: the rows of its blocks, all at one position (``offset`` is an int)."""

    arrangement_kinds = frozenset({"serial"})

    @property
    def offset(self) -> int:
        return self._offsets[0] if self._offsets else 0

    @property
    def rows(self) -> int:
        return len(self._offsets)

    def _block_rows(self) -> int | None:
        return self.rows or None

    def _mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        return self._serial_mask(n, return_array, window)

    def _row_windows(self) -> list[RowWindow]:
        held = self._held_window(None)
        offset = self.offset
        if held is None or self._holds_nothing(held):
            return [(None, offset)] * max(1, self.rows)
        return [(row_of(held, b), offset) for b in range(self.rows)]

    def _convert_rows(self, rows: Sequence[int]) -> None:
        """A serial storage's rows move together: some, not all, are refused."""
        moving = {check_row(b, self.rows) for b in rows}
        if moving and len(moving) != self.rows:
            raise LayoutStateError(STAGES_MOVE_TOGETHER)
        super()._convert_rows(rows)

    def trim(self, n: int) -> int:
        count = as_count(n, "n")
        if count:
            self._check_trim([count] * self.rows)  # a wrapped ring refuses
        count = min(count, self._tokens_held[0] if self._offsets else 0)  # mlx-lm: offset - start
        if count:
            self._forget([count] * self.rows)
            self._offsets = [o - count for o in self._offsets]
        return count

    def check_valid(self) -> None:
        """Assert the storage's invariants (for tests): its rows move together."""
        assert len(self._pads) == len(self._offsets)
        assert len(set(self._offsets)) <= 1, "the rows of a serial storage move together"
        assert self._stores is None, "the rows of a serial storage are in one stage"
        self._check_geometry()

    def planes(self) -> tuple[Planes, Planes] | None:
        """Views of the stored key and value planes in time order, ``[B, H, T, ·]``."""
        return self._window_pair(None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(offset={self.offset}, rows={self.rows})"


class Layout(Storage):
    """Several requests' rows in one set of batched planes."""

    arrangement_kinds = frozenset({"shared", "ragged"})

    # -- what the layout holds ------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self._offsets)

    @property
    def row_offsets(self) -> tuple[int, ...]:
        return tuple(self._offsets)

    @property
    def left_pad(self) -> tuple[int, ...]:
        return tuple(self._pads)

    @property
    def offset(self) -> mx.array:
        """Per-row positions, one device array until the next change (models read it in
        every layer)."""
        if self._offset_array is None:
            self._offset_array = mx.array(self._offsets, dtype=mx.int32)
        return self._offset_array

    @property
    def max_tokens(self) -> float:
        return math.inf

    def can_publish_row(self, row: int, tokens: int) -> bool:
        index, count = check_row(row, self.batch_size), as_count(tokens, "tokens")
        offset = self._offsets[index]
        # A prefix shorter than the row: while the row still holds every position.
        return count == offset or (count < offset and self._tokens_held[index] == offset)

    def row_planes(self, row: int) -> tuple[Planes, Planes] | None:
        """Views of row ``row``'s key and value planes in time order, ``[1, H, T, ·]``
        (``None`` when it holds no token)."""
        index = check_row(row, self.batch_size)
        return None if self._tokens_held[index] == 0 else self._window_pair(index)

    def make_empty_batch(self: _S) -> _S:
        return type(self)._spawn(self)

    def _block_rows(self) -> int | None:
        if not self._offsets:
            raise LayoutStateError(EMPTY_LAYOUT_UPDATE)
        return len(self._offsets)

    def _mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        return self._layout_mask(n, return_array, window)

    def _row_windows(self) -> list[RowWindow]:
        return self._each_row()

    def projected_bytes(self, tokens: int) -> int:
        return row_bytes(self.codec, self._geometry, tokens, self._token_geometry.cap())

    # -- row operations -------------------------------------------------------------------
    def merge_rows(self, rows: Sequence[Cache]) -> None:
        """Form the batch from ``rows`` (empty layout) or join them (running layout).

        Borrows the sources: each gives its rows as windows in time order, and the
        geometry places them (``_place``). Refuses the layout itself and a source given
        twice before anything changes (every check is :meth:`check_merge`'s)."""
        self._join(rows, *self._merge_plan(rows))

    def check_merge(self, rows: Sequence[Cache]) -> None:
        """Raise what ``merge_rows(rows)`` would raise, changing nothing (a ``MergeChecking``:
        a composite layout checks every part before any part joins)."""
        self._merge_plan(rows)

    def _merge_plan(self, rows: Sequence[Cache]) -> tuple[list[RowWindow], Any, list[int]]:
        """Every check of a merge of ``rows``, then what ``_join`` takes: the incoming
        windows, the joined shapes and each row's stage. A modifier that refuses merges in
        some state (a verify round, a prepared run) adds its guard here."""
        if type(rows) not in (list, tuple) and (  # (a protocol check costs microseconds)
            isinstance(rows, Cache | str | bytes) or not isinstance(rows, Sequence)
        ):
            raise InvalidInputError(MERGE_NEEDS_SEQUENCE)
        seen = {id(source) for source in rows}
        if id(self) in seen or len(seen) != len(rows):
            raise IncompatibleRowsError(self_merge_message(self.signature()))
        accepts, staged = self._accepts, len(self._stages) > 1
        incoming: list[RowWindow] = []
        stages: list[int] = []  # a row joins in the stage of the codec that encoded it
        for row in rows:
            if not accepts(row):  # every _accepts takes storages of this machinery only
                raise IncompatibleRowsError(self._merge_refusal(row))
            held = cast(Storage, row)
            windows = held._row_windows()
            incoming += windows
            if staged:  # (one stage: every accepted row is in it)
                stages.extend(self._stage_of(c) for c in held._row_codecs(len(windows)))
        if not staged:
            stages = [0] * len(incoming)
        shapes = self._joined_shapes(rows)
        self._check_join(rows, incoming, shapes, stages)
        return incoming, shapes, stages

    def _one_store(self, stages: list[int]) -> bool:
        """Whether the rows, with joining rows of ``stages``, stay in one store."""
        if len(self._stages) == 1:
            return True
        if self._stores is not None:
            return False
        held = set(stages)  # and the one store's stage, when it holds rows
        if self._offsets:
            held.add(self._stage_of(self.codec))
        return len(held) <= 1

    def _check_join(
        self, sources: Sequence[Cache], incoming: list[RowWindow], shapes: Any, stages: list[int]
    ) -> None:
        """What ``_join`` would refuse, raised before anything changes; a placement whose
        join can refuse more (paged: its pool's room) adds its checks."""
        if incoming and not self._one_store(stages) and not self._stage_stores:
            raise LayoutStateError(STAGES_MOVE_TOGETHER)

    def _merge_refusal(self, source: object) -> str:
        """The message refusing a source ``_accepts`` does not take."""
        return incompatible_merge_message(
            self.signature(), source, self.codec.key, self.token_geometry
        )

    def _join(
        self, sources: Sequence[Cache], incoming: list[RowWindow], shapes: Any, stages: list[int]
    ) -> None:
        """Join the checked sources' rows (``incoming``: their windows; ``stages``: the
        stage each joins in), then take ``shapes`` (what the rows hold, checked common); a
        placement that joins by reference (paged tables) overrides it."""
        if not incoming:
            return
        if self._one_store(stages):
            if not self._offsets and stages[0] != self._stage_of(self.codec):
                self._clear()  # an empty layout takes its rows' stage
                self.codec = self._stages[stages[0]]
            self._take_shapes(shapes)
            self._place(incoming, self._geometry)
        else:
            if not self._stage_stores:  # _check_join's refusal (a join outside merge_rows)
                raise LayoutStateError(STAGES_MOVE_TOGETHER)
            self._take_shapes(shapes)
            self._place_stages(incoming, stages, self._geometry)
        self._offsets = self._offsets + [offset for _, offset in incoming]
        self._changed()

    def filter_rows(self, keep: Sequence[int]) -> None:
        """Keep rows ``keep`` (any subset, in the given order), in place."""
        order = check_keep(keep, self.batch_size)
        if not order:
            self._clear()
            return

        if not self._keeps_at_once(order):
            all_or_nothing(self, functools.partial(self._keep_rows, order))
            return
        # Nothing changes before ``_keep``'s one step that can raise but the offsets (the
        # geometry reads the kept rows'): they alone go back, no undo record of the rest.
        offsets = self._offsets
        try:
            self._keep_rows(order)
        except BaseException:
            self._offsets = offsets
            raise

    def _keep_rows(self, order: list[int]) -> None:
        self._offsets = [self._offsets[i] for i in order]
        self._keep(order)
        self._changed()

    def _keeps_at_once(self, order: list[int]) -> bool:
        """Whether ``_keep(order)`` changes nothing before its one step that can raise
        (host records only, or planes built whole and then rebound), so a fault needs no
        undo record; a geometry or placement that does so says when."""
        return False

    def extract_row(self, row: int) -> Serial:
        """An independent serial storage holding row ``row``: owned, compact, evaluated
        arrays (a lazy slice would pin this layout's buffers and make its next in-place
        write copy them)."""
        index = check_row(row, self.batch_size)
        spec = self._row_codecs(self.batch_size)[index].spec
        cache = self._serial_of(spec)._spawn(self, spec)
        held, offset = self._held_window(index), self._offsets[index]
        if held is None or (self._holds_nothing(held) and not offset):
            cache._take_shapes(self._shapes())  # an empty row still knows its geometry
            return cache
        copies = self._owned(held)  # none at all: a row that forgot every token (chunked)
        mx.eval(*arrays(copies))
        return cache.adopt(copies, offset, self._shapes())

    def _serial_of(self, spec: CodecSpec) -> type[Serial]:
        """The serial class a row of codec ``spec`` extracts into: the table's serial
        storage of the layout (a ``Serial`` class, or the layout itself), or for a row of
        another stage's codec, that codec's serial preset on this geometry."""
        entry = self.composition
        serial = DECLARED[entry.serial or entry.name]
        if spec.kind != serial.composition.codec:
            serial = DECLARED[serial_preset(entry.geometry, spec.kind).name]
        return cast(type[Serial], serial)

    def trim(self, n: int) -> int:
        count = as_count(n, "n")
        return self._trim_rows([count] * self.batch_size) if self._offsets else 0

    def trim_rows(self, counts: Sequence[int]) -> int:
        """Forget ``counts[b]`` newest tokens of row ``b`` (per-row rollback).

        Rows sharing one write column can only trim equal counts. Returns the largest count.
        """
        return self._trim_rows(check_counts(counts, self.batch_size))

    def _trim_rows(self, counts: Sequence[int], *, justify: bool = False) -> int:
        """``justify``: a shared-column rollback (rows of one write column may forget
        different counts; the geometry rolls them right to one end column)."""
        if not any(counts):
            return 0
        self._check_trim(counts)
        for b, (tokens, count) in enumerate(zip(self._tokens_held, counts, strict=True)):
            if count > tokens:
                raise NotTrimmableError(trim_past_row_message(count, b, tokens))
        if self.composition.shared_column and not justify and len(set(counts)) > 1:
            raise NotTrimmableError(SHARED_COLUMN_TRIM)

        def forget() -> None:
            self._forget(counts, justify=justify)
            self._offsets = [t - c for t, c in zip(self._offsets, counts, strict=True)]
            self._changed()

        all_or_nothing(self, forget)
        return max(counts)

    def check_valid(self) -> None:
        """Assert the layout's invariants (for tests)."""
        assert len(self._pads) == len(self._offsets)
        assert all(t >= 0 for t in self._offsets)
        self._check_stores()
        self._check_geometry()

    def _check_stores(self) -> None:
        """The row -> (stage, slot) map and the stores agree (contract §0.4)."""
        if self._stores is None:
            return
        assert self._planes is None and len(self._stores) > 1
        stages = [store.stage for store in self._stores]
        assert stages == sorted(set(stages)), "one store per stage, in stage order"
        assert self.codec is self._stores[-1].codec, "codec: the newest stage holding rows"
        rows = [b for store in self._stores for b in store.rows]
        assert sorted(rows) == list(range(len(self._offsets))), "every row in one store"
        for store in self._stores:
            assert store.rows and store.rows == sorted(store.rows), "slots in batch order"
            if store.planes is not None:
                assert len(store.rows) <= int(arrays(store.planes)[0].shape[0])
        held = [token_count(s.planes) for s in self._stores if s.planes is not None]
        assert len(set(held)) <= 1, "every store at the same columns"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rows={self.batch_size}, row_offsets={self.row_offsets}, "
            f"left_pad={self.left_pad})"
        )
