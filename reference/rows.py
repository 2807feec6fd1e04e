"""The reference's row machinery: every storage and layout is a list of compact rows.

This is the executable specification, so it says what a layout *means* rather than how a
fast one moves bytes: each request's row is its own compact arrays (:class:`Row`: the
tokens it retains, oldest first, and its position), and the batch a read returns is
assembled from them on every read. There is no origin, no slot and no capacity.

The code is written once, over three axes (``spec/contract.md``):

* the **codec** (``kvrows.reference.codecs``) turns a block into planes and back;
* the **geometry** (:class:`TokenAxis`, one module per kind in ``geometries/``, chosen by
  the spec's kind) says what a row keeps when it is written and what of it a merge or an
  extraction takes, and places the rows of a layout in the batch a read returns
  (:class:`Placement`, one per arrangement);
* the **arrangement** (the composition's ``serial`` / ``shared`` / ``ragged``) picks the
  class here (:class:`SerialStorage` for one request, :class:`RowLayout` for several)
  and the placement.

Everything else, the argument checks, the compatibility test for merged rows, the
validate-once templates of ``update_and_fetch`` / ``merge_rows`` / ``filter_rows`` /
``extract_row``, per-row trims and ``check_valid``, is here, once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol, TypeVar, cast

import numpy as np
import numpy.typing as npt

from kvrows.codec import KV_TENSORS, PlaneSet, as_role
from kvrows.common import ComposedIdentity, SavedState, all_or_nothing, check_counts, row_bytes
from kvrows.compositions import Arrangement, Composition, bind_arguments, serial_preset
from kvrows.conversion import MIXED_READ
from kvrows.errors import (
    ADOPT_NEEDS_EMPTY,
    EMPTY_LAYOUT_UPDATE,
    MERGE_NEEDS_SEQUENCE,
    NOTHING_TO_FETCH,
    STAGES_MOVE_TOGETHER,
    IncompatibleRowsError,
    InvalidInputError,
    LayoutStateError,
    MixedPrecisionReadError,
    NotTrimmableError,
    incompatible_merge_message,
    last_stage_message,
    self_merge_message,
    wrapped_ring_message,
)
from kvrows.protocols import Cache, Mask, RowSource
from kvrows.reference.codecs import Codec, Planes, dtype_name, make_codec
from kvrows.schemes import CodecSpec, GeometrySpec
from kvrows.validation import (
    KvGeometry,
    as_count,
    check_block,
    check_keep,
    check_row,
    check_window,
    common_geometry,
)

__all__ = [
    "SERIAL_PRESETS",
    "Placement",
    "Row",
    "RowLayout",
    "SerialStorage",
    "Storage",
    "TokenAxis",
    "TokenRows",
    "row_share",
    "stacked",
    "zero_planes",
]


_T = TypeVar("_T", bound="Storage")

#: The serial presets with no modifier, by composition name (``classes.build`` fills it):
#: what a row of a stage other than the layout's own codec extracts into.
SERIAL_PRESETS: dict[str, type[SerialStorage]] = {}


#: The token axis of every plane a token geometry holds (``[rows, H, T, ·]``).
TOKEN_AXIS = 2


def newest(planes: Planes, count: int) -> Planes:
    """Copies of the newest ``count`` tokens of ``planes``."""
    length = int(planes[0].shape[TOKEN_AXIS])
    return tuple(np.array(p[:, :, length - min(count, length) :], copy=True) for p in planes)


def concat(first: Planes | None, second: Planes) -> Planes:
    """``second`` appended to ``first`` along the token axis."""
    if first is None:
        return second
    return tuple(
        np.concatenate([a, b], axis=TOKEN_AXIS) for a, b in zip(first, second, strict=True)
    )


def _sinks_and_newest(planes: Planes, head: int, count: int) -> Planes:
    """Copies of the oldest ``head`` tokens followed by the newest ``count - head``."""
    if head == 0:
        return newest(planes, count)
    length = int(planes[0].shape[TOKEN_AXIS])
    tail = max(0, min(count, length) - head)
    return tuple(
        np.concatenate([p[:, :, :head], p[:, :, length - tail :]], axis=TOKEN_AXIS) for p in planes
    )


def row_share(block: PlaneSet, b: int) -> PlaneSet:
    """Row ``b``'s share of a batched plane set (axis 0, whatever the planes' rank)."""
    return {tensor: tuple(p[b : b + 1] for p in planes) for tensor, planes in block.items()}


def stacked(sets: Sequence[PlaneSet]) -> PlaneSet:
    """One-row plane sets stacked along axis 0 (rows; every set holds the same tensors)."""
    if not sets:
        return {}
    return {
        tensor: tuple(
            np.concatenate(list(ps), axis=0) for ps in zip(*(s[tensor] for s in sets), strict=True)
        )
        for tensor in sets[0]
    }


@dataclass
class Row:
    """One request: the planes it holds, oldest token first, and where it stands.

    ``planes``: each tensor's planes for this row (``[1, ...]``; a token geometry's are
    ``[1, H, retained, ·]``; empty before its first write); ``offset``: tokens ever
    appended (the next token's position); ``pad``: what the layout reports as the row's
    ``left_pad``; ``sinks``: a ring's ``keep``, the first positions that are never evicted
    (0 elsewhere); ``token_axis``: whether its planes have one (recurrent state's do not);
    ``stage``: the storage stage whose codec encoded its planes (contract §0.5). A token row retains its first ``min(sinks, offset)`` positions, then a
    run of its newest ones. The token surgery (``newest``, ``append``, ``trim``) is what
    token geometries call; a geometry without a token axis copies and replaces whole
    rows (``copy``, ``planes``), and nothing else here reads a token axis.
    """

    planes: PlaneSet = field(default_factory=dict)
    offset: int = 0
    pad: int = 0
    sinks: int = 0
    token_axis: bool = True
    #: The storage's stage the planes are encoded under (0 but under the delayed modifier).
    stage: int = 0
    #: Columns before the row's tokens in a ragged ring's read (tokens it dropped in place:
    #: ``spec/RaggedRotatingRows.md`` §1); 0 elsewhere, and in every cut of the row.
    lead: int = 0

    @property
    def held(self) -> bool:
        """Whether the row holds planes (it was written)."""
        return bool(self.planes)

    @property
    def retained(self) -> int:
        """Tokens the row holds (a token geometry's; 0 when it holds nothing or its planes
        have no token axis)."""
        if not self.token_axis:
            return 0
        for planes in self.planes.values():
            return int(planes[0].shape[TOKEN_AXIS])
        return 0

    @property
    def held_sinks(self) -> int:
        """The sink positions the row holds (its oldest retained tokens)."""
        return min(self.sinks, self.offset, self.retained)

    def arrays(self) -> tuple[Any, ...]:
        """Every plane the row holds, tensor by tensor."""
        return tuple(p for planes in self.planes.values() for p in planes)

    def copy(self) -> Row:
        """An independent copy of the whole row."""
        planes = {t: tuple(np.array(p, copy=True) for p in ps) for t, ps in self.planes.items()}
        return Row(
            planes, self.offset, self.pad, self.sinks, self.token_axis, self.stage, self.lead
        )

    def newest(self, count: int) -> Row:
        """An independent row holding ``count`` of this one's tokens, at its offset: its
        sinks (up to ``count``) and then its newest."""
        if not self.planes or (count == 0 and self.offset == 0):
            # (a row past position 0 keeps zero-width planes: it still stands there)
            return Row(offset=self.offset, pad=self.pad, sinks=self.sinks, stage=self.stage)
        head = min(self.held_sinks, count)
        planes = {t: _sinks_and_newest(ps, head, count) for t, ps in self.planes.items()}
        return Row(planes, self.offset, self.pad, self.sinks, stage=self.stage)

    def append(self, block: PlaneSet, history: int) -> None:
        """Keep ``history`` tokens (sinks first, then the newest), then append the block."""
        n = next(int(ps[0].shape[TOKEN_AXIS]) for ps in block.values())
        kept = self.newest(history).planes
        self.planes = {t: concat(kept.get(t), ps) for t, ps in block.items()}
        self.offset += n

    def trim(self, count: int) -> None:
        """Forget the newest ``count`` retained tokens."""
        if count and self.planes:
            keep = self.retained - count
            self.planes = {
                t: tuple(np.array(p[:, :, :keep], copy=True) for p in ps)
                for t, ps in self.planes.items()
            }
        self.offset -= count


class Placement(Protocol):
    """Where a layout's rows sit in the batch a read returns (one per arrangement).

    ``columns`` gives the image's width, each row's ``(start, shown)`` (its newest
    ``shown`` retained tokens fill ``[start, start + shown)`` in temporal order) and the
    roll that turns the temporal image into the physical one. The other hooks keep the
    placement's own bookkeeping (and ``Row.pad``) in step with the rows.
    """

    def columns(self, rows: Sequence[Row]) -> tuple[int, list[tuple[int, int]], int]: ...

    def fetchable(self, rows: Sequence[Row]) -> bool: ...

    def lead(self, rows: Sequence[Row]) -> int:
        """Columns of a sink block before the rolled columns (0 but for rings with keep)."""
        ...

    def mask(self, rows: Sequence[Row], n: int, window: int | None, return_array: bool) -> Mask: ...

    def advance(self, rows: Sequence[Row], n: int) -> None:
        """Before every row takes a block of ``n`` tokens."""
        ...

    def join(self, rows: Sequence[Row], running: int) -> None:
        """After a merge: ``rows[:running]`` were there, the rest joined (all cut)."""
        ...

    def filter(self, rows: Sequence[Row]) -> None:
        """After a filter: ``rows`` are the survivors, in their new order."""
        ...

    def check_trim(
        self, rows: Sequence[Row], counts: Sequence[int], *, justify: bool = False
    ) -> None:
        """Raise ``NotTrimmableError`` unless row ``b`` may forget ``counts[b]`` tokens
        (``justify``: a shared-column rollback, rows then re-right-justified)."""
        ...

    def trimmed(self, rows: Sequence[Row], counts: Sequence[int], *, justify: bool = False) -> None:
        """After the rows forgot ``counts``; ``justify``: lay them to share one end column
        again (the rollback of rows that write one column: each row rolls right)."""
        ...

    def trimmable(self, rows: Sequence[Row]) -> bool: ...

    def check(self, rows: Sequence[Row]) -> None:
        """Assert the placement's invariants."""
        ...


class TokenAxis(Protocol):
    """A geometry's hooks (``reference/geometries/<kind>.py``, one class per kind,
    registered with ``@implements(kind)``): what a row keeps when it is written, what of
    it merges and extraction take, when it may forget or publish, and where rows sit in
    a read. A geometry without a token axis supplies the same hooks over whole rows."""

    spec: GeometrySpec
    #: Most positions a row stores (``None``: unbounded); ``projected_bytes`` caps there.
    cap: int | None
    #: Positions a row never evicts (a ring's ``keep``; 0 elsewhere): ``Row.sinks``.
    sinks: int
    #: A proposal round holds the rows: they keep every token (``holds_proposals``).
    holding: bool

    def holds_proposals(self, arrangement: str) -> bool:
        """Whether rows of ``arrangement`` can keep every token a proposal round appends
        (``kvrows.speculative``), so that its discard forgets them."""
        ...

    def append(self, row: Row, block: PlaneSet, n: int) -> None:
        """Write row ``row``'s share of a block of ``n`` positions (its offset advances)."""
        ...

    def cut(self, row: Row) -> Row:
        """An independent copy of what a merge or an extraction takes of ``row``."""
        ...

    def cuttable(self, offset: int) -> bool:
        """Whether a row at ``offset`` may still forget tokens (or publish a prefix)."""
        ...

    def serial_mask(self, row: Row, n: int, window: int | None, return_array: bool) -> Mask:
        """A serial storage's mask for its next ``n`` tokens (mlx-lm's policy for this
        geometry), ``row`` one of its rows (they move together)."""
        ...

    def place(self, arrangement: Arrangement) -> Placement: ...


class TokenRows:
    """``append`` and ``cut`` of a geometry with a token axis, from two counts it
    answers: ``history`` (retained tokens a row keeps before it appends ``n``) and
    ``window`` (its newest tokens a merge or an extraction takes)."""

    #: A proposal round holds the rows: they keep every token (``holds_proposals``).
    holding = False

    def holds_proposals(self, arrangement: str) -> bool:
        """Whether rows of ``arrangement`` can keep every token a proposal round appends
        (``kvrows.speculative``), so that its discard forgets them."""
        return False

    def history(self, row: Row, n: int) -> int:
        raise NotImplementedError

    def window(self, row: Row) -> int:
        raise NotImplementedError

    def append(self, row: Row, block: PlaneSet, n: int) -> None:
        row.append(block, self.history(row, n))

    def cut(self, row: Row) -> Row:
        return row.newest(self.window(row))


def make_axis(spec: GeometrySpec) -> TokenAxis:
    """The hooks of the geometry ``spec`` (the class registered for its kind)."""
    from kvrows.reference.geometries import build

    axis: TokenAxis = build(spec)
    return axis


def zero_planes(codec: Codec, shapes: Any, rows: int, columns: int) -> PlaneSet:
    """Zero planes of every tensor ``shapes`` (a KV geometry, a codec's ``Shapes``) names,
    ``rows`` rows of ``columns`` tokens."""
    planes: PlaneSet = {}
    for tensor in shapes.tensors:
        heads, dim, dtype = shapes.tensor_image(tensor)
        planes[tensor] = codec.zeros(rows, heads, columns, dim, dtype, tensor)
    return planes


def _image(
    codec: Codec,
    shapes: Any,
    rows: Sequence[Row],
    tensor: str,
    columns: tuple[int, list[tuple[int, int]], int],
    lead: int = 0,
) -> Planes:
    """The batch of ``tensor``'s planes a read returns (``shapes``: what the rows hold,
    a KV geometry or the codec's ``Shapes``, gives each tensor's heads, width and dtype).

    ``lead``: a sink block first (a shared ring with ``keep``): row ``b``'s sinks sit
    left-aligned in columns ``[0, lead)`` and only the columns after it roll."""
    width, spans, roll = columns
    heads, dim, dtype = shapes.tensor_image(tensor)
    out = codec.zeros(len(rows), heads, width, dim, dtype, as_role(tensor))
    for b, (row, (start, shown)) in enumerate(zip(rows, spans, strict=True)):
        held = row.planes.get(tensor)
        if held is None:
            continue
        head = row.held_sinks if lead else 0
        for dst, src in zip(out, held, strict=True):
            dst[b, :, :head] = src[0, :, :head]
            if shown:
                dst[b, :, start : start + shown] = src[0, :, src.shape[2] - shown :]
    if not roll:  # nothing rolls: the columns are already in order
        return tuple(out)
    return tuple(
        np.concatenate([p[:, :, :lead], np.roll(p[:, :, lead:], roll, axis=2)], axis=2) for p in out
    )


class Storage(SavedState, ComposedIdentity):
    """What every reference storage and layout is: a codec, a token geometry, rows.

    A public class names its composition (``kvrows.compositions``); the constructor takes
    that composition's parameters (mlx-lm's positional order), or ``codec=`` /
    ``token_geometry=`` specs, and ``geometry=KvGeometry(...)`` to declare the KV heads
    before the first token.
    """

    composition: ClassVar[Composition]
    #: The array library the rows are held in (a ``RowSource``: a merge takes rows of its
    #: own library only).
    array_name: ClassVar[str] = "NumPy"
    #: Whether the storage, holding no row, lends one empty row to a merge (a storage of
    #: one request; a layout lends the rows it holds).
    _lends_empty_row: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._setup(*bind_arguments(self.composition, args, kwargs))

    def _setup(
        self, codec_spec: CodecSpec, token_geometry: GeometrySpec, declared: KvGeometry | None
    ) -> None:
        """Empty, of these (validated) specs: one stage, ``codec_spec``'s."""
        self.codec: Codec = make_codec(codec_spec)
        #: The codecs of the stages (contract §0.5): one, but under the delayed modifier.
        self._stages: tuple[Codec, ...] = (self.codec,)
        self._token_geometry = token_geometry
        self._axis = make_axis(token_geometry)
        self._geometry: KvGeometry | None = declared
        self._rows: list[Row] = []
        #: A ring's sink tokens (``keep``), 0 for every other geometry.
        self._sinks = self._axis.sinks

    def _new_row(self) -> Row:
        """A row that holds nothing yet (a placement may keep more per row: paged tables)."""
        return Row(sinks=self._sinks, token_axis=self._token_geometry.token_axis, stage=self._stage)

    # -- stages (the delayed modifier's array hooks, contract §0.5) ---------------------------
    def _use_stages(self, specs: Sequence[CodecSpec]) -> None:
        """Hold stages of ``specs`` (an empty storage; its rows start in stage 0)."""
        self._stages = tuple(make_codec(spec) for spec in specs)
        self.codec = self._stages[0]

    def _convert_rows(self, rows: Sequence[int]) -> None:
        """Re-encode rows ``rows`` into their next stage (contract §0.5, per-row stages):
        each row's compact planes decoded by its stage's codec and encoded by the next
        one's (per token, so what a row of the next stage fed the same tokens holds); the
        other rows are not touched. Rows are replaced, not changed (a view taken before,
        ``_stage_view``, keeps the old ones). Checked whole before any row moves."""
        moving = sorted({check_row(b, len(self._rows)) for b in rows})
        last = len(self._stages) - 1
        for b in moving:
            if self._rows[b].stage == last:
                raise LayoutStateError(last_stage_message(b, last))
        converted = list(self._rows)
        for b in moving:
            converted[b] = self._next_stage(self._rows[b])
        self._rows = converted
        self._staged()

    def _next_stage(self, row: Row) -> Row:
        """A new row holding ``row``'s planes in its next stage: decoded by its stage's
        codec and encoded by the next one's, per token."""
        source, target = self._stages[row.stage], self._stages[row.stage + 1]
        planes: PlaneSet = {
            t: target.encode(source.decode(ps, as_role(t)), as_role(t))
            for t, ps in row.planes.items()
        }
        return replace(row, planes=planes, stage=row.stage + 1)

    @property
    def row_stages(self) -> tuple[int, ...]:
        """Each row's stage, in batch order (contract §0.5)."""
        return tuple(row.stage for row in self._rows)

    def _staged(self) -> None:
        """The rows changed: ``codec`` is the newest stage's any row is in (unchanged with
        no row)."""
        if self._rows:
            self.codec = self._stages[max(row.stage for row in self._rows)]

    def _stage_of(self, codec: Codec) -> int:
        """The stage of this storage whose codec encodes as ``codec`` does."""
        return [c.key for c in self._stages].index(codec.key)

    def _stage_parts(self) -> list[tuple[list[int], Codec, dict[str, Any]]]:
        """The read of rows in several stages (contract §0.5): per stage holding rows,
        ``(rows, codec, reads)``, ``reads`` each tensor's fetched form of the full-width
        read image restricted to ``rows``."""
        shapes = self._shapes()
        if shapes is None or not self._fetchable():
            raise LayoutStateError(NOTHING_TO_FETCH)
        width, spans, roll = self._columns()
        lead = self._lead()
        parts = []
        for stage, codec in enumerate(self._stages):
            rows = [b for b, row in enumerate(self._rows) if row.stage == stage]
            if not rows:
                continue
            held = [self._rows[b] for b in rows]
            columns = (width, [spans[b] for b in rows], roll)
            image = self._part_image(stage, held, columns, lead)
            reads = {t: codec.fetched(image[t], as_role(t)) for t in shapes.tensors}
            parts.append((rows, codec, reads))
        return parts

    def _part_image(
        self,
        stage: int,
        rows: Sequence[Row],
        columns: tuple[int, list[tuple[int, int]], int],
        lead: int,
    ) -> PlaneSet:
        """The read image of ``rows`` (all in ``stage``) at ``columns``: their compact
        planes (a placement that holds a stage elsewhere too, paged, reads it there)."""
        codec, shapes = self._stages[stage], self._shapes()
        return {t: _image(codec, shapes, rows, t, columns, lead) for t in shapes.tensors}

    def _stage_view(self, cls: type[_T], view: _T | None = None) -> _T:
        """An instance of the one-stage class ``cls`` (of this storage's current stage and
        geometry) sharing this storage's rows (``view``: that instance, brought up to
        date): borrowed, what it holds is this storage's until a conversion or a reset
        replaces the rows."""
        if view is None:
            view = cls.from_specs(self.codec.spec, self._token_geometry, geometry=self._geometry)
        # One stage there: its rows are stage 0 (new ``Row`` objects over the same planes).
        view._rows = [replace(row, stage=0) for row in self._rows]
        view._geometry = self._geometry
        return view

    def _take_rows(self, storage: Storage) -> None:
        """Hold the rows of ``storage`` (a one-stage storage of one of this one's stages,
        same geometry): they are this storage's now."""
        stage = self.stages.index(storage.codec.spec)
        self.codec = self._stages[stage]
        self._rows = [replace(row, stage=stage) for row in storage._rows]
        self._geometry = storage._shapes()

    def _shapes(self) -> Any:
        """What the storage learnt of its tensors' shapes (a KV geometry; a state
        geometry keeps its planes' kinds): what a merge joins and an extraction carries."""
        return self._geometry

    def _take_shapes(self, shapes: Any) -> None:
        self._geometry = shapes

    def _joined_shapes(self, sources: Sequence[Any]) -> Any:
        """The shapes after joining ``sources`` (raises ``IncompatibleRowsError``)."""
        return common_geometry([self._geometry, *(s.geometry for s in sources)])

    # -- what it holds --------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for row in self._rows for p in row.arrays())

    def held_arrays(self) -> tuple[Any, ...]:
        """Every array the rows hold (for byte and aliasing checks)."""
        return tuple(p for row in self._rows for p in row.arrays())

    def _state(self) -> tuple[Any, ...]:
        """The canonical state form (``kvrows.forms``; ``reference/forms.py``)."""
        from kvrows.reference.forms import state_of

        return state_of(self)

    @classmethod
    def _restore(
        cls: type[_T], state: Any, meta_state: Any, keep: int | None, geometry: KvGeometry | None
    ) -> _T:
        from kvrows.reference.forms import restore_state

        return restore_state(cls, state, meta_state, keep=keep, geometry=geometry)

    @property
    def state_needs_dispose(self) -> bool:
        return False

    # -- the templates ---------------------------------------------------------------------
    def _columns(self) -> tuple[int, list[tuple[int, int]], int]:
        raise NotImplementedError

    def _fetchable(self) -> bool:
        raise NotImplementedError

    def _lead(self) -> int:
        """Columns of the sink block the read image starts with (shared rings only)."""
        return 0

    def _advance(self, n: int) -> None:
        """Bookkeeping before every row takes a block of ``n`` tokens."""

    def fetch(self) -> tuple[Any, Any]:
        """The keys and values attention reads now (assembled from the rows)."""
        keys, values = self._read().values()
        return keys, values

    def _read(self) -> dict[str, Any]:
        """Each tensor as attention reads it now, assembled from the rows (the codec's
        fetched form of the read image). Rows of several stages whose codecs all read
        dense arrays (a plain and an encoded latent): each row from its stage's part, in
        batch order (contract §0.5)."""
        if len({row.stage for row in self._rows}) > 1 and not self._reads_by_parts():
            parts = self._stage_parts()
            order = [b for rows, _, _ in parts for b in rows]
            inverse = sorted(range(len(order)), key=order.__getitem__)
            return {
                t: np.concatenate([reads[t] for _, _, reads in parts], axis=0)[inverse]
                for t in parts[0][2]
            }
        images = self._image_planes().items()
        return {t: self.codec.fetched(planes, as_role(t)) for t, planes in images}

    def _reads_by_parts(self) -> bool:
        """Whether the rows are in several stages and some stage's codec does not read a
        dense array (affine triples, TurboQuant's own): a read is then by parts only."""
        held = {row.stage for row in self._rows}
        return len(held) > 1 and any(self._stages[s].spec.reads != "dense" for s in held)

    def _image_planes(self) -> PlaneSet:
        """Each tensor's stored planes as the read image places them (a read decodes them;
        a form that saves the image keeps them)."""
        shapes = self._shapes()
        if shapes is None or not self._fetchable():
            raise LayoutStateError(NOTHING_TO_FETCH)
        if len({row.stage for row in self._rows}) > 1:
            raise MixedPrecisionReadError(MIXED_READ)  # each stage's rows: _stage_parts
        columns, lead = self._columns(), self._lead()
        return {t: _image(self.codec, shapes, self._rows, t, columns, lead) for t in shapes.tensors}

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """Validate the block once, encode it once, append row ``b``'s share to row ``b``
        (rows of several stages read by parts: refused before the write)."""
        if self._reads_by_parts():
            raise MixedPrecisionReadError(MIXED_READ)

        def write_read() -> tuple[Any, Any]:
            self._update(keys, values)
            return self.fetch()

        # The read assembles new arrays after the write: a fault there puts the write back.
        return all_or_nothing(self, write_read)

    def _update(self, keys: Any, values: Any) -> None:
        """``update_and_fetch`` without its read (rows of several stages read by parts)."""
        geometry = check_block(
            keys.shape if isinstance(keys, np.ndarray) else (),
            values.shape if isinstance(values, np.ndarray) else (),
            dtype_name(keys),
            dtype_name(values),
            rows=len(self._rows) or None,
            geometry=self._geometry,
        )
        for stage in self._row_stage_set():
            self._stages[stage].check(geometry)
        self._write_blocks(dict(zip(KV_TENSORS, (keys, values), strict=True)), geometry)

    def _write_blocks(self, blocks: dict[str, Any], shapes: Any) -> None:
        """The one write (``update_and_fetch``, a latent ``append``): checked blocks
        ``[rows, heads, n, ·]`` per tensor, encoded once per stage holding rows, row
        ``b``'s share of its stage's encoding to row ``b`` (:meth:`_write`); then the
        storage knows ``shapes``."""
        first = next(iter(blocks.values()))
        rows, n = int(first.shape[0]), int(first.shape[TOKEN_AXIS])
        encoded = {
            stage: {t: self._stages[stage].encode(x, as_role(t)) for t, x in blocks.items()}
            for stage in self._row_stage_set()
        }

        def write() -> None:
            self._write(encoded, rows, n, shapes)
            self._take_shapes(shapes)

        # Rows are written one by one: a fault at a later row puts the earlier back (§9).
        all_or_nothing(self, write)

    def _fault_parts(self, *, held: bool = False) -> Any:
        """Each row's fields and the placement's (``all_or_nothing`` puts them back on a
        fault; a row's planes are replaced, never written in place, so no copy)."""
        place = getattr(self, "_place", None)
        placed = None if place is None or not hasattr(place, "__dict__") else dict(vars(place))
        placed = placed and {k: (list(v) if type(v) is list else v) for k, v in placed.items()}
        return [(row, dict(vars(row))) for row in self._rows], (place, placed)

    def _fault_restore(self, parts: Any) -> None:
        rows, (place, placed) = parts
        for row, fields in rows:
            vars(row).update(fields)
        if placed is not None:
            vars(place).clear()
            vars(place).update(placed)

    def _row_stage_set(self) -> list[int]:
        """The stages the rows are in, in order (``_stage`` with no row)."""
        return sorted({row.stage for row in self._rows}) or [self._stage]

    def _write(self, encoded: dict[int, PlaneSet], rows: int, n: int, shapes: Any) -> None:
        """Row ``b`` takes its share of its stage's encoding (``encoded``: per stage holding
        rows, the storage's stage before any row) of a block of ``rows`` rows and ``n``
        tokens (a placement that also mirrors rows elsewhere, paged, overrides it and may
        refuse first, changing nothing)."""
        if not self._rows:  # a serial storage learns its rows from its first block
            self._rows = [self._new_row() for _ in range(rows)]
        self._advance(n)
        for b, row in enumerate(self._rows):
            self._axis.append(row, row_share(encoded[row.stage], b), n)

    def _window(self, row: Row) -> PlaneSet | None:
        """Copies of ``row``'s window in temporal order (``None`` before its first write)."""
        if row.offset == 0 or not row.held:
            return None
        return self._axis.cut(row).planes

    def adopt(self: _T, row: Row, geometry: Any) -> _T:
        """Make this (empty) storage hold ``row`` as its one row (used by extraction; a
        layout that is its own serial storage places it at column 0)."""
        if self._rows:
            raise LayoutStateError(ADOPT_NEEDS_EMPTY)
        row.pad, row.stage = 0, self._stage
        self._rows = [row] if row.held or row.offset else []
        self._take_shapes(geometry)
        return self

    def lend_rows(self) -> None:
        """Called before another layout merges this one's rows (a layout in the middle of
        a speculative round refuses)."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self._token_geometry}, offsets="
            f"{[r.offset for r in self._rows]}, retained={[r.retained for r in self._rows]}, "
            f"pads={[r.pad for r in self._rows]})"
        )


class SerialStorage(Storage):
    """One request (shape-generic in ``B``: every row takes every block): the one-row case.

    Reads stack the rows' retained tokens; ``offset`` is an int.
    """

    @property
    def offset(self) -> int:
        return self._rows[0].offset if self._rows else 0

    @property
    def rows(self) -> int:
        """Batch rows held (0 before the first append)."""
        return len(self._rows)

    @property
    def retained(self) -> int:
        return self._rows[0].retained if self._rows else 0

    def _columns(self) -> tuple[int, list[tuple[int, int]], int]:
        return self.retained, [(0, self.retained)] * len(self._rows), 0

    def _fetchable(self) -> bool:
        return bool(self._rows)

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        count = as_count(n, "n", minimum=1)
        row = self._rows[0] if self._rows else self._new_row()
        return self._axis.serial_mask(row, count, check_window(window_size), return_array)

    def is_trimmable(self) -> bool:
        return self._axis.cuttable(self.offset)

    def trim(self, n: int) -> int:
        """Forget the newest ``n`` positions (at most ``offset``)."""
        count = as_count(n, "n")
        if count and not self.is_trimmable():
            raise NotTrimmableError(
                wrapped_ring_message(
                    f"a ring with {self.offset} columns written", self._axis.cap or 0
                )
            )
        count = min(count, self.retained)  # what it holds (mlx-lm: ``offset - start``)
        for row in self._rows:
            row.trim(count)
        return count

    def _convert_rows(self, rows: Sequence[int]) -> None:
        """A serial storage's rows move together: some, not all, are refused."""
        moving = {check_row(b, len(self._rows)) for b in rows}
        if moving and len(moving) != len(self._rows):
            raise LayoutStateError(STAGES_MOVE_TOGETHER)
        super()._convert_rows(rows)

    def check_valid(self) -> None:
        assert len({(r.offset, r.retained, r.stage) for r in self._rows}) <= 1, "rows move together"
        assert all(r.retained <= r.offset for r in self._rows)

    # -- read-only views for tests and conformance -------------------------------------------
    def plane_set(self) -> PlaneSet | None:
        """Every row's planes, rows stacked (``None`` when empty)."""
        if not self._rows:
            return None
        return stacked([r.planes for r in self._rows if r.held])

    def planes(self) -> tuple[Planes, Planes] | None:
        """Every retained token's key and value planes, rows stacked (``None`` when empty)."""
        held = self.plane_set()
        return None if held is None else _kv(held)

    def window(self) -> tuple[Planes, Planes] | None:
        """The newest ``min(offset, window)`` tokens' planes in temporal order."""
        windows = [self._window(row) for row in self._rows]
        if not windows or any(w is None for w in windows):
            return None
        return _kv(stacked([w for w in windows if w is not None]))


def _kv(planes: PlaneSet) -> tuple[Planes, Planes]:
    """The key and value planes of a KV plane set (the tests' and conformance's views)."""
    return planes["keys"], planes["values"]


class RowLayout(Storage):
    """Several requests' rows of one layer; ``composition.arrangement`` places them.

    ``merge_rows`` borrows its sources (their rows are copied, cut to their window),
    ``filter_rows`` keeps rows in a given order, ``extract_row`` hands out an independent
    serial storage of the composition's ``serial`` class.
    """

    #: The class rows extract into (set by the class declarations: the composition's
    #: serial storage, or the layout itself when it is its own).
    serial_class: ClassVar[type[SerialStorage]]
    _lends_empty_row = False

    def _setup(
        self, codec_spec: CodecSpec, token_geometry: GeometrySpec, declared: KvGeometry | None
    ) -> None:
        super()._setup(codec_spec, token_geometry, declared)
        self._place = self._axis.place(self.composition.arrangement)

    @property
    def holds_proposals(self) -> bool:
        """Whether a proposal round's tokens can all be kept and then forgotten (the axis
        says, for this arrangement)."""
        return self._axis.holds_proposals(self.composition.arrangement)

    def _spec_hold(self, on: bool) -> None:
        self._axis.holding = on

    # -- what the layout holds ---------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self._rows)

    @property
    def row_offsets(self) -> tuple[int, ...]:
        return tuple(row.offset for row in self._rows)

    @property
    def retained(self) -> tuple[int, ...]:
        return tuple(row.retained for row in self._rows)

    @property
    def left_pad(self) -> tuple[int, ...]:
        return tuple(row.pad for row in self._rows)

    @property
    def offset(self) -> npt.NDArray[np.int32]:
        return np.array(self.row_offsets, dtype=np.int32)

    @property
    def width(self) -> int:
        """Columns a read returns."""
        return self._columns()[0]

    @property
    def max_tokens(self) -> float:
        return math.inf

    def make_empty_batch(self) -> RowLayout:
        return type(self).from_specs(self.codec_spec, self._token_geometry)

    def can_publish_row(self, row: int, tokens: int) -> bool:
        offset = self._rows[check_row(row, self.batch_size)].offset
        count = as_count(tokens, "tokens")
        # A prefix shorter than the row: while the row still holds every position.
        held = self._rows[row].retained == offset
        return count == offset or (count < offset and held and self._axis.cuttable(offset))

    def projected_bytes(self, tokens: int) -> int:
        return row_bytes(self.codec, self._geometry, tokens, self._axis.cap)

    # -- reads -----------------------------------------------------------------------------
    def _columns(self) -> tuple[int, list[tuple[int, int]], int]:
        return self._place.columns(self._rows)

    def _fetchable(self) -> bool:
        return self._place.fetchable(self._rows)

    def _lead(self) -> int:
        return self._place.lead(self._rows)

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        count = as_count(n, "n", minimum=1)
        return self._place.mask(self._rows, count, check_window(window_size), return_array)

    def row_window(self, row: int) -> tuple[Planes, Planes] | None:
        """Row ``row``'s window in temporal order (``None`` before its first token)."""
        held = self._window(self._rows[check_row(row, self.batch_size)])
        return None if held is None else _kv(held)

    row_planes = row_window

    # -- writes ----------------------------------------------------------------------------
    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        if not self._rows:
            raise LayoutStateError(EMPTY_LAYOUT_UPDATE)
        return super().update_and_fetch(keys, values)

    def _advance(self, n: int) -> None:
        self._place.advance(self._rows, n)

    def _accepts(self, source: object) -> bool:
        # A storage of this machinery (its rows NumPy rows), of our token geometry; each
        # codec its rows are in (a source holding none: its codec) is one of ours.
        if (
            not isinstance(source, RowSource)
            or source.array_name != self.array_name
            or source.token_geometry != self._token_geometry
        ):
            return False
        held = cast(Storage, source)
        keys = {c.key for c in self._stages}
        return all(held._stages[s].key in keys for s in held._row_stage_set())

    def _cut(self, row: Row) -> Row:
        return self._axis.cut(row)

    def merge_rows(self, rows: Sequence[Any]) -> None:
        """Form the batch (empty layout) or join ``rows`` (running layout); every check is
        :meth:`check_merge`'s, before anything changes."""
        self._join(rows, self._merge_plan(rows))

    def check_merge(self, rows: Sequence[Any]) -> None:
        """Raise what ``merge_rows(rows)`` would raise, changing nothing (a ``MergeChecking``:
        a composite layout checks every part before any part joins)."""
        self._merge_plan(rows)

    def _merge_plan(self, rows: Sequence[Any]) -> Any:
        """Every check of a merge of ``rows``; returns the joined shapes ``_join`` takes."""
        if isinstance(rows, str | bytes | Cache) or not isinstance(rows, Sequence):
            raise InvalidInputError(MERGE_NEEDS_SEQUENCE)
        if any(s is self for s in rows) or len({id(s) for s in rows}) != len(rows):
            raise IncompatibleRowsError(self_merge_message(self.signature()))
        for source in rows:
            if not self._accepts(source):
                raise IncompatibleRowsError(self._merge_refusal(source))
            source.lend_rows()
        shapes = self._joined_shapes(rows)
        self._check_join(rows, shapes)
        return shapes

    def _check_join(self, sources: Sequence[Any], shapes: Any) -> None:
        """What ``_join`` would refuse, raised before anything changes (a placement whose
        join can refuse, paged: its pool's room)."""

    def _merge_refusal(self, source: object) -> str:
        """Why ``source``'s rows may not join this layout (``_accepts`` said no)."""
        return incompatible_merge_message(
            self.signature(), source, self.codec.key, self._token_geometry
        )

    def _join(self, sources: Sequence[Any], shapes: Any) -> None:
        """Join the checked ``sources``' rows (cut to their window) after this layout's,
        then take ``shapes`` (what the rows hold, checked common); a placement that keeps
        rows elsewhere too (paged) overrides it."""
        incoming: list[Row] = []
        for source in sources:
            if source._rows or not source._lends_empty_row:
                # A row joins in the stage of the codec that encoded it.
                incoming.extend(
                    replace(self._cut(row), stage=self._stage_of(source._stages[row.stage]))
                    for row in source._rows
                )
            else:  # a storage of one request with no token
                incoming.append(replace(self._new_row(), stage=self._stage_of(source.codec)))
        if not incoming:
            return
        running = [self._cut(row) for row in self._rows]
        self._rows = running + incoming
        self._place.join(self._rows, len(running))
        self._take_shapes(shapes)
        self._staged()

    def filter_rows(self, keep: Sequence[int]) -> None:
        """Keep the rows ``keep``, in that order."""
        order = check_keep(keep, self.batch_size)
        self._rows = [self._rows[i] for i in order]
        self._place.filter(self._rows)
        self._staged()

    def extract_row(self, row: int) -> SerialStorage:
        """An independent serial storage holding row ``row``'s window."""
        entry = self._rows[check_row(row, self.batch_size)]
        serial = self._serial_of(self._stages[entry.stage].spec)
        # A row that forgot every token it held (chunked) still stands at its offset.
        held = self._cut(entry) if entry.held or entry.offset else self._new_row()
        return serial.adopt(held, self._shapes())  # an empty row still knows its geometry

    def _serial_of(self, spec: CodecSpec) -> SerialStorage:
        """An empty serial storage of ``spec`` on this geometry: the composition's serial
        storage, or for a row of another stage's codec, that codec's serial preset."""
        cls = self.serial_class
        if spec.kind != cls.composition.codec:
            cls = SERIAL_PRESETS[serial_preset(self.composition.geometry, spec.kind).name]
        return cls.from_specs(spec, self._token_geometry)

    # -- trims -----------------------------------------------------------------------------
    def is_trimmable(self) -> bool:
        return self._place.trimmable(self._rows)

    def trim(self, n: int) -> int:
        """Forget every row's newest ``n`` tokens."""
        count = as_count(n, "n")
        return self._trim([count] * self.batch_size) if self._rows else 0

    def trim_rows(self, counts: Sequence[int]) -> int:
        """Forget ``counts[b]`` newest tokens of row ``b``; returns the largest count."""
        return self._trim(check_counts(counts, self.batch_size))

    def _trim(self, counts: Sequence[int], *, justify: bool = False) -> int:
        """Forget ``counts[b]`` of row ``b``; ``justify``: a shared-column rollback (rows of
        one write column may forget different counts, then share one end column again)."""
        self._place.check_trim(self._rows, counts, justify=justify)
        for row, count in zip(self._rows, counts, strict=True):
            row.trim(count)
        self._place.trimmed(self._rows, counts, justify=justify)
        return max(counts, default=0)

    def check_valid(self) -> None:
        """Assert the layout's invariants (tests and conformance)."""
        assert all(0 <= row.retained <= row.offset for row in self._rows)
        assert all(0 <= row.stage < len(self._stages) for row in self._rows)
        assert not self._rows or self._stage == max(self.row_stages), "codec: newest stage"
        self._place.check(self._rows)
