"""Delayed layouts: rows that convert to affine or TurboQuant at their own bf16-first
boundary.

A delayed layout (``spec/DelayedQuantizedKVCache.md``,
``spec/DelayedRotatingQuantizedKVCache.md``, ``spec/DelayedTurboQuantKVCache.md``) holds
the rows of a batch whose serial storage is a bf16-first lego (``kvrows.lego``): each row
stays plain until its own offset reaches ``start`` and converts exactly where its solo
lego would. This module is the array-free logic, shared by both implementations; each
supplies its two ragged **groups** (the plain and the converted layout of its token
geometry: affine, or TurboQuant for full attention), its row conversion and three array
hooks. The converted ("affine") group's codec is the target spec's (``kvrows.lego.Target``).

* **Groups.** Plain rows live in the plain group, converted rows in the affine group, each
  in batch order (a row's slot is its rank among its group's rows). Every group is an
  existing, conformance-tested ragged layout, so appends, masks, trims, filters and
  extraction are theirs.
* **Positions** (full attention): one ragged record (``left_pad``), kept by the ragged
  rules (a merge right-aligns at the widest end, a filter strips the shared padding, a trim
  never moves padding); each group holds its rows at the record's columns minus one
  group-wide shift (``align_rows``), so a model that builds one mask from another layer's
  ragged layout reads the same columns here. Ring rows keep their own columns.
* **Conversion** happens at boundaries only: after an append (its read is made first, as
  the lego's), after a merge, at the end of a round, at ``end_prefill`` and for the rows
  ``commit_prefill`` names; never inside a round or while prefilling.
* **Reads.** All plain: the plain group's. All converted ("packed"): the affine group's
  (its triples; ``bits`` appears). Mixed: each group appends its rows' slices and the
  layout returns a :class:`RowAttentionPending` pair; :meth:`DelayedRows.attend_rows`
  attends each group with its own codec and mask. Only inside :func:`row_reads` (the
  row-attention scope a caller opens); outside one a mixed read raises
  ``MixedPrecisionReadError`` and changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Self

from kvrows.common import check_counts, row_bytes
from kvrows.compositions import Composition
from kvrows.conversion import (
    MIXED_READ,
    Phase,
    RowAttentionPending,
    row_reads,
    row_reads_active,
)
from kvrows.errors import (
    EMPTY_LAYOUT_UPDATE,
    MERGE_NEEDS_SEQUENCE,
    IncompatibleRowsError,
    InvalidInputError,
    LayoutStateError,
    MixedPrecisionReadError,
    NotTrimmableError,
    incompatible_merge_message,
    not_a_geometry_message,
    self_merge_message,
)
from kvrows.forms import DELAYED_PLAIN, delayed_state, parse_delayed_state
from kvrows.geometries import is_geometry_spec
from kvrows.lego import (
    Bf16First,
    ConversionBoundary,
    Target,
    check_target,
    delayed_arguments,
    lego_arguments,
    turbo_lego_arguments,
)
from kvrows.protocols import Converting, Handover
from kvrows.schemes import CodecSpec, GeometrySpec, Growing, Plain
from kvrows.speculative import SpeculativeRounds, check_keep_vector
from kvrows.validation import KvGeometry, as_count, check_keep, check_row

__all__ = [
    "MIXED_READ",
    "DelayedFullAttention",
    "DelayedLayout",
    "DelayedRows",
    "DelayedSlidingWindow",
    "DelayedTurboRows",
    "GroupAttend",
    "RowAttentionPending",
    "StagePart",
    "delayed_layout_for",
    "row_reads",
    "row_reads_active",
]

PLAIN, AFFINE = 0, 1

#: ``attend(queries, group, keys, values, mask, scale)``: one group's attention.
GroupAttend = Callable[[Any, Any, Any, Any, Any, float], Any]


class _Part:
    """One group's share of a mixed read: its batch rows, its mask (made before the append)
    and what its append returned."""

    __slots__ = ("group", "mask", "reads", "rows")

    def __init__(self, rows: list[int], group: Any, mask: Any, reads: tuple[Any, Any]) -> None:
        self.rows, self.group, self.mask, self.reads = rows, group, mask, reads


def _default_group_attend(
    queries: Any, group: Any, keys: Any, values: Any, mask: Any, scale: float
) -> Any:
    return group.codec.attend(queries, keys, values, mask, scale)


#: lego class -> the delayed layout class of its implementation (filled as classes are made).
_DELAYED_FOR_LEGO: dict[type[Any], type[Any]] = {}


def delayed_layout_for(lego: Bf16First) -> type[Any]:
    """The delayed layout class that holds rows of ``lego``'s class."""
    try:
        return _DELAYED_FOR_LEGO[type(lego)]
    except KeyError:
        raise InvalidInputError(
            f"{type(lego).__name__} has no delayed layout (no implementation registered one)"
        ) from None


class DelayedRows(ConversionBoundary, SpeculativeRounds):
    """The delayed layout's logic (see the module docstring).

    An implementation's class sets ``composition``, ``plain_group_class``,
    ``affine_group_class``, ``lego_class`` and implements :meth:`_convert_row`,
    :meth:`_take_rows`, :meth:`_combine_rows`, :meth:`_positions`,
    :meth:`_record_mask` and :meth:`_widen_mask`.
    """

    composition: ClassVar[Composition]
    plain_group_class: ClassVar[type[Any]]
    affine_group_class: ClassVar[type[Any]]
    #: The implementation's serial lego of this geometry (its plain and affine classes are
    #: the serial storages rows extract into).
    lego_class: ClassVar[type[Bf16First]]

    @property
    def token_geometry(self) -> GeometrySpec:
        return self._token_geometry

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "lego_class" in vars(cls):
            _DELAYED_FOR_LEGO[cls.lego_class] = cls

    # -- the implementation's part ---------------------------------------------------------
    def _convert_row(self, storage: Any) -> Any:
        """A plain serial storage as its affine counterpart (the lego's conversion)."""
        raise NotImplementedError

    def _take_rows(self, array: Any, rows: Sequence[int]) -> Any:
        """``array[rows]`` along the batch axis (an owned copy is not required)."""
        raise NotImplementedError

    def _combine_rows(self, parts: Sequence[Any], order: Sequence[int]) -> Any:
        """``parts`` concatenated along the batch axis hold rows ``order``; return them in
        batch order."""
        raise NotImplementedError

    def _positions(self, offsets: Sequence[int]) -> Any:
        """``offset``: the per-row positions as the implementation's array."""
        raise NotImplementedError

    def _record_mask(
        self, n: int, return_array: bool, window: int | None
    ) -> Any:  # pragma: no cover - the implementations override
        """The ragged mask of the position record (full attention, mixed rows)."""
        raise NotImplementedError

    def _widen_mask(self, mask: Any, rows: int, n: int, width: int) -> Any:
        """A boolean ``mask`` of one group as ``[rows, 1, n, width]``, the added columns
        (on the right) hidden."""
        raise NotImplementedError

    # -- construction ----------------------------------------------------------------------
    def _setup(
        self,
        quantization: Target,
        token_geometry: GeometrySpec,
        start: int,
        geometry: KvGeometry | None,
    ) -> None:
        quantization = check_target(type(self).__name__, quantization, token_geometry)
        if geometry is not None and not isinstance(geometry, KvGeometry):
            raise InvalidInputError(
                f"{type(self).__name__}: {not_a_geometry_message(type(geometry).__name__)}"
            )
        if geometry is not None:
            Bf16First._check_dims(geometry.key_dim, geometry.value_dim, quantization)
        self._conversion = self.conversion_class(quantization, start)
        self._token_geometry = token_geometry
        self._declared = geometry
        # Rows right-aligned with a position record, unless each row wraps from column 0.
        self._full_attention = is_geometry_spec(token_geometry) and not token_geometry.wraps
        self._clear()

    def _clear(self) -> None:
        declared = self._declared
        self._groups: tuple[Any, Any] = (
            self.plain_group_class.from_specs(Plain(), self._token_geometry, geometry=declared),
            self.affine_group_class.from_specs(
                self.quantization, self._token_geometry, geometry=declared
            ),
        )
        #: Per row: its stage (PLAIN / AFFINE, the group it lives in) and conversion point.
        self._conversion = self.conversion_class(self.quantization, self.start)
        self._pads: list[int] = []  # the position record (full attention)
        self._compose: Callable[..., Any] | None = None
        self._generation = 0
        self._pending: list[_Part] | None = None
        #: The last plain or packed read and its group (``attend_last_read``).
        self._last: tuple[Any, tuple[Any, Any]] | None = None

    @classmethod
    def from_specs(
        cls,
        codec: Any,
        token_geometry: GeometrySpec,
        *,
        geometry: KvGeometry | None = None,
        start: int = 0,
    ) -> DelayedRows:
        """A layout from specs (``start`` is not a codec or geometry parameter)."""
        kind = cls.composition.codec
        if getattr(codec, "kind", None) != kind:
            raise InvalidInputError(f"{cls.__name__} converts to the {kind} codec, got {codec!r}")
        fresh = object.__new__(cls)
        fresh._setup(codec, token_geometry, as_count(start, "start"), geometry)
        return fresh

    def make_empty_batch(self) -> DelayedRows:
        fresh = object.__new__(type(self))
        fresh._setup(self.quantization, self._token_geometry, self.start, self._declared)
        return fresh

    # -- what it is ------------------------------------------------------------------------
    @property
    def codec_spec(self) -> Target:
        return self.quantization

    @property
    def geometry(self) -> KvGeometry | None:
        for group in self._groups:
            if group.geometry is not None:
                found: KvGeometry = group.geometry
                return found
        return self._declared

    @property
    def codec(self) -> Any:
        """The codec reads come in now: plain while every row is plain, else the converted
        group's (mixed reads go through ``attend_rows``)."""
        return self._groups[PLAIN if self.phase in ("empty", "plain") else AFFINE].codec

    @property
    def last_read_codec(self) -> Any:
        """The codec of what the last plain or packed append returned (the append that
        converted rows read plain); ``None`` without one (a mixed read: ``attend_rows``).
        Attention of that read goes through it (``kvrows.app.attention.dispatch``)."""
        return None if self._last is None else self._last[0].codec

    def signature(self) -> str:
        return self.composition.signature.format(
            start=self.start, **self.quantization.parameters(),
            **self._token_geometry.parameters(),
        )  # fmt: skip

    @property
    def phase(self) -> Phase:
        """``empty``; ``plain`` (no row converted); ``mixed``; ``packed`` (every row
        converted: the affine group is the whole layout)."""
        return self._conversion.phase

    @property
    def converted_at(self) -> tuple[int | None, ...]:
        """Per row, the offset at which it converted (``None``: plain; 0 with ``start ==
        0``; a storage merged converted records its offset, the conservative bound)."""
        return self._conversion.converted_at

    @property
    def prefilling(self) -> bool:
        return self._conversion.prefilling

    @property
    def groups(self) -> tuple[Any, Any]:
        """The plain and the affine group (borrowed, for inspection and tests)."""
        return self._groups

    def _members(self, group: int) -> list[int]:
        return self._conversion.members(group)

    def _slot(self, row: int) -> int:
        """Row ``row``'s index inside its group."""
        return self._conversion.slots()[row]

    @property
    def batch_size(self) -> int:
        return self._conversion.batch_size

    @property
    def row_offsets(self) -> tuple[int, ...]:
        return self._conversion.in_batch_order([g.row_offsets for g in self._groups])

    @property
    def left_pad(self) -> tuple[int, ...]:
        if self._full_attention:
            return tuple(self._pads)
        return self._conversion.in_batch_order([g.left_pad for g in self._groups])

    @property
    def offset(self) -> Any:
        """Per-row positions as one array, kept until they change (models read it in
        every layer of every forward)."""
        offsets = self.row_offsets
        cached = getattr(self, "_offset_of", None)
        if cached is None or cached[0] != offsets:
            self._offset_of = (offsets, self._positions(offsets))
        return self._offset_of[1]

    @property
    def max_tokens(self) -> float:
        return math.inf

    @property
    def nbytes(self) -> int:
        return sum(int(g.nbytes) for g in self._groups)

    def projected_bytes(self, tokens: int) -> int:
        """The most a row holds on its way to ``tokens`` positions: plain below ``start``;
        from it, the larger of the plain row just before converting and the affine row now
        (rings hold at most ``max_size`` positions of either)."""
        count = as_count(tokens, "tokens")
        plain, affine = self._groups
        cap = self._token_geometry.cap()
        geometry = self.geometry
        if count < self.start:
            return row_bytes(plain.codec, geometry, count, cap)
        before = row_bytes(plain.codec, geometry, self.start - 1, cap) if self.start else 0
        return max(before, row_bytes(affine.codec, geometry, count, cap))

    def held_arrays(self) -> tuple[Any, ...]:
        return tuple(a for g in self._groups for a in g.held_arrays())

    @property
    def state_needs_dispose(self) -> bool:
        return False

    # -- saved state (``kvrows.forms``; ``spec/persistence.md`` §1.1) ----------------------
    @property
    def state(self) -> tuple[Any, ...]:
        """The plain group's state, the affine group's, then the row record: ``start``,
        ``converted_at`` (``DELAYED_PLAIN`` for a plain row), ``left_pad`` (full attention;
        empty for rings), ``prefilling``, ``composed`` (rows extract as legos), a ring's
        ``keep``."""
        self._spec_guard("reading state")
        marks = [DELAYED_PLAIN if c is None else c for c in self.converted_at]
        record: dict[str, Any] = {
            "start": self.start,
            "converted_at": self._positions(marks),  # an int32 vector, as positions are
            "left_pad": self._positions(self._pads if self._full_attention else []),
            "prefilling": self.prefilling,
            "composed": self._compose is not None,
            # What the groups' layout forms omit (a ring's keep).
            **{
                name: self._token_geometry.parameters()[name]
                for name in self._token_geometry.layout_form_omits
            },
        }
        plain, affine = (group.state for group in self._groups)
        return delayed_state(self.composition, plain, affine, record)

    @state.setter
    def state(self, value: tuple[Any, ...]) -> None:
        """Hold ``value`` (a state of this class); a refused value changes nothing."""
        self._spec_guard("restoring state")
        keep = self._token_geometry.parameters().get("keep")
        fresh = type(self).from_state(value, keep=keep, geometry=self._declared)
        self.__dict__.clear()
        self.__dict__.update(fresh.__dict__)

    @classmethod
    def from_state(
        cls,
        state: Any,
        meta_state: Any = None,
        *,
        keep: int | None = None,
        geometry: KvGeometry | None = None,
    ) -> DelayedRows:
        """A new layout holding ``state``: each group restored from its own form, the row
        record checked against them (``kvrows.forms.parse_delayed_state``), the groups
        re-laid at the record's columns; built from legos, its rows extract as legos of
        this implementation again. ``InvalidInputError`` names any fault. ``geometry``
        declares the KV geometry of an empty state; ``meta_state`` (mlx-lm's older form)
        does not apply."""
        if meta_state is not None:
            raise InvalidInputError(f"{cls.__name__} has no two-part (meta_state) form")
        parts = parse_delayed_state(cls.composition, state, keep=keep)
        plain = cls.plain_group_class.from_state(
            parts.plain_state, keep=parts.keep, geometry=geometry
        )
        # A TurboQuant group's planes do not record the activation dtype (its scales are
        # float16 whatever it is): the plain group's rows, when there are any, say it.
        affine = cls.affine_group_class.from_state(
            parts.affine_state, keep=parts.keep, geometry=geometry or plain.geometry
        )
        if plain.token_geometry != affine.token_geometry:
            raise InvalidInputError(
                f"{cls.__name__} state: the groups' windows differ "
                f"({plain.token_geometry} and {affine.token_geometry})"
            )
        if None not in (plain.geometry, affine.geometry) and plain.geometry != affine.geometry:
            raise InvalidInputError(
                f"{cls.__name__} state: the groups hold different KV geometries "
                f"({plain.geometry} and {affine.geometry})"
            )
        fresh = cls.from_specs(
            affine.codec_spec, affine.token_geometry, geometry=geometry, start=parts.start
        )
        fresh._groups = (plain, affine)
        fresh._conversion = cls.conversion_class(
            fresh.quantization,
            fresh.start,
            parts.converted_at,
            prefilling=bool(parts.record["prefilling"]),
        )
        fresh._pads = parts.left_pad
        if parts.record["composed"]:
            lego = cls.lego_class.from_parts(  # the layout's own parameters
                fresh.quantization, fresh._token_geometry, fresh.start, geometry
            )
            fresh._compose = lego.composed.over
        fresh._align_groups()
        return fresh

    def is_trimmable(self) -> bool:
        return True

    def max_append_tokens(self) -> float:
        """Tokens the next append may add without passing any plain row's boundary."""
        return self._conversion.max_append_tokens(self.row_offsets)

    # -- appends and reads -----------------------------------------------------------------
    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Any:
        self._spec_usable()
        phase = self.phase
        if phase in ("empty", "plain"):
            return self._groups[PLAIN].make_mask(
                n, return_array=return_array, window_size=window_size
            )
        if phase == "packed":
            return self._groups[AFFINE].make_mask(
                n, return_array=return_array, window_size=window_size
            )
        # Mixed: attend_rows applies each group's own mask; this one serves the model's
        # other layers that share it (a model builds one mask per attention kind).
        count = as_count(n, "n", minimum=1)
        if not self._full_attention:
            return self._rows_mask(count, window_size)
        return self._record_mask(count, return_array, window_size)

    def _rows_mask(self, n: int, window: int | None) -> Any:
        """Ring rows (mixed): each row's mask from its group, in batch order. A ragged ring
        row's columns are its own (from column 0), so the rows of both groups form the
        mask a plain ragged ring of the same rows gives (narrower groups padded with
        hidden columns): the other sliding layers of the model read it."""
        parts, order = [], []
        for index, group in enumerate(self._groups):
            rows = self._members(index)
            mask = group.make_mask(n, return_array=True, window_size=window)
            parts.append((mask, len(rows)))
            order.extend(rows)
        width = max(int(mask.shape[-1]) for mask, _ in parts)
        return self._combine_rows([self._widen_mask(m, r, n, width) for m, r in parts], order)

    def _check_block(self, keys: Any, values: Any) -> None:
        shapes = [tuple(getattr(a, "shape", ())) for a in (keys, values)]
        if any(len(s) != 4 for s in shapes):
            raise InvalidInputError(
                f"keys and values must be [B, H, N, D] arrays, got shapes {shapes[0]} and "
                f"{shapes[1]}"
            )
        key_shape, value_shape = shapes
        if key_shape[0] != self.batch_size or value_shape[0] != self.batch_size:
            raise InvalidInputError(
                f"the block has {key_shape[0]} rows, the layout {self.batch_size}"
            )
        Bf16First._check_dims(int(key_shape[3]), int(value_shape[3]), self.quantization)

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """Append a block to every row. All plain or all converted: the group's read. Mixed
        (inside :func:`row_reads`): each group appends its rows and a pending pair comes
        back (outside one: ``MixedPrecisionReadError``, nothing changed). After the append
        (not inside a round or a prefill), rows that reached ``start`` convert."""
        self._spec_usable()
        if not self.batch_size:
            raise LayoutStateError(EMPTY_LAYOUT_UPDATE)
        self._check_block(keys, values)
        phase = self.phase
        if phase == "mixed" and not row_reads_active():
            raise MixedPrecisionReadError(MIXED_READ)

        def append() -> tuple[Any, Any]:
            # Drop the last read first: a read held across the write would make the
            # group's in-place append copy its buffers.
            self._forget_reads()
            if phase == "mixed":
                reads = self._mixed_append(keys, values)
            else:
                group = self._groups[AFFINE if phase == "packed" else PLAIN]
                reads = group.update_and_fetch(keys, values)
                self._last = (group, reads)
            self._generation += 1
            self._conversion.note_read(phase == "packed")
            return reads

        reads = self._spec_append(append)
        if not self.spec_round_open:
            self._advance()
        return reads

    def _mixed_append(self, keys: Any, values: Any) -> tuple[Any, Any]:
        n = int(keys.shape[2])
        parts: list[_Part] = []
        for index, group in enumerate(self._groups):
            rows = self._members(index)
            mask = group.make_mask(n, return_array=True)
            parts.append(_Part(rows, group, mask, (self._take_rows(keys, rows),
                                                    self._take_rows(values, rows))))  # fmt: skip
        for part in parts:
            part.reads = part.group.update_and_fetch(*part.reads)
        self._pending = parts
        pending = RowAttentionPending(self, self._generation + 1)
        return pending, pending

    @property
    def needs_row_attention(self) -> bool:
        """Always: mixed rows attend group by group (``attend_rows``) inside
        ``kvrows.app.attention.row_attention``."""
        return True

    @property
    def reads_pending(self) -> bool:
        """Whether the last append returned a pending pair (mixed rows)."""
        return self._pending is not None

    def _forget_reads(self) -> None:
        self._pending = None
        self._last = None

    def attend_last_read(self, queries: Any, mask: Any, scale: float) -> Any:
        """Attention of ``queries`` over what the last append returned (``None`` when no
        append has been made since the rows last changed): a mixed read through
        :meth:`attend_rows`; a plain or packed read through its group's codec with
        ``mask``, also when the append then converted rows (its read stays the one the
        model attended, as the serial lego's does)."""
        if self._pending is not None:
            return self.attend_rows(queries, scale)
        if self._last is None:
            return None
        group, reads = self._last
        return group.codec.attend(queries, *reads, mask, scale)

    def attend_rows(
        self,
        queries: Any,
        scale: float,
        attend: GroupAttend | None = None,
        pending: RowAttentionPending | None = None,
    ) -> Any:
        """The attention of ``queries`` ``[B, Hq, N, D]`` over the last mixed read: each
        group's rows with its own codec, reads and mask (``attend``: one group's attention,
        by default its codec's). ``pending``, when given, must be the last read's."""
        parts = self._pending
        if parts is None:
            raise MixedPrecisionReadError(
                "attend_rows needs the pending pair of a mixed read: the last append did "
                "not return one"
            )
        if pending is not None and (
            pending.layout is not self or pending.generation != self._generation
        ):
            raise MixedPrecisionReadError(
                "this pending pair is stale: a later append replaced it (attend right after "
                "the append that returned it)"
            )
        shape = tuple(getattr(queries, "shape", ()))
        if len(shape) != 4 or shape[0] != self.batch_size:
            raise InvalidInputError(
                f"queries must be [B={self.batch_size}, Hq, N, D], got shape {shape}"
            )
        run = attend or _default_group_attend
        outputs, order = [], []
        for part in parts:
            if not part.rows:
                continue
            rows_queries = self._take_rows(queries, part.rows)
            outputs.append(run(rows_queries, part.group, *part.reads, part.mask, scale))
            order.extend(part.rows)
        return self._combine_rows(outputs, order)

    def fetch(self) -> tuple[Any, Any]:
        self._spec_usable()
        phase = self.phase
        if phase == "mixed":
            raise MixedPrecisionReadError(MIXED_READ)
        reads: tuple[Any, Any] = self._groups[AFFINE if phase == "packed" else PLAIN].fetch()
        return reads

    # -- conversion --------------------------------------------------------------------------
    def _advance(self) -> None:
        """Convert every due row (none while prefilling or inside a round)."""
        self._convert(self._conversion.due(self.row_offsets, round_open=self.spec_round_open))

    def _convert(self, rows: Sequence[int]) -> None:
        """Move ``rows`` (plain, due) to the affine group, encoded as the lego encodes."""
        if not rows:
            return
        plain, affine = self._groups
        offsets = self.row_offsets
        slots = self._conversion.slots()
        converted = [self._convert_row(plain.extract_row(slots[b])) for b in rows]
        moving = set(rows)
        plain_rows = self._members(PLAIN)
        plain.filter_rows([s for s, b in enumerate(plain_rows) if b not in moving])
        affine_before = self._members(AFFINE)
        affine.merge_rows(converted)
        self._conversion.mark(rows, offsets)
        # The affine group keeps batch order: the merged rows went to its end.
        arrived = affine_before + list(rows)
        order = [arrived.index(b) for b in self._members(AFFINE)]
        if order != list(range(len(order))):
            affine.filter_rows(order)
        self._align_groups()

    def _align_groups(self) -> None:
        """Each group at the record's columns minus one shift (full attention)."""
        if not self._full_attention:
            return
        for index, group in enumerate(self._groups):
            rows = self._members(index)
            if not rows:
                continue
            pads = [self._pads[b] for b in rows]
            shift = min(pads)
            wanted = tuple(p - shift for p in pads)
            if tuple(group.left_pad) != wanted:
                group.align_rows(wanted)

    # -- prefill maintenance ----------------------------------------------------------------
    def begin_prefill(self) -> None:
        """Appends past a row's boundary convert nothing until ``commit_prefill`` /
        ``end_prefill``."""
        self._spec_guard("begin_prefill")
        self._conversion.begin_prefill()

    def commit_prefill(self, indices: Sequence[int]) -> None:
        """Convert the listed rows now if due (each at its own planned chunk end)."""
        self._spec_guard("commit_prefill")
        self._convert(self._conversion.commit_prefill(indices, self.row_offsets))

    def end_prefill(self) -> None:
        """Back to converting at every boundary; due rows convert now."""
        self._spec_guard("end_prefill")
        self._convert(self._conversion.end_prefill(self.row_offsets))

    # -- rounds ------------------------------------------------------------------------------
    def _open_groups(self) -> list[Any]:
        return [g for g in self._groups if g.batch_size]

    def spec_round_begin(self) -> None:
        super().spec_round_begin()
        for group in self._open_groups():
            self._spec_failing(group.spec_round_begin)

    def spec_round_commit(self) -> None:
        self._spec_block_of("spec_round_commit")
        for group in self._open_groups():
            self._spec_failing(group.spec_round_commit)
        self._spec_before = self._spec_block = None
        self._advance()

    def spec_round_rollback(self, keep: int | Sequence[int]) -> None:
        blocks = self._spec_block_of("spec_round_rollback")
        counts = check_keep_vector(keep, blocks)
        for index, group in enumerate(self._groups):
            rows = self._members(index)
            if rows:
                self._spec_failing(partial(group.spec_round_rollback, [counts[b] for b in rows]))
        self._spec_before = self._spec_block = None
        self._advance()

    def can_publish_row(self, row: int, tokens: int) -> bool:
        """What the row's group says: a ring row that wrapped covers only its whole length
        (its extracted ring could not be cut back)."""
        self._spec_usable()
        index = check_row(row, self.batch_size)
        count = as_count(tokens, "tokens")
        if self.spec_round_open:
            return False
        group = self._groups[self._conversion.stage(index)]
        publishes: bool = group.can_publish_row(self._slot(index), count)
        return publishes

    # -- membership --------------------------------------------------------------------------
    def _plan(self, source: Any) -> list[tuple[Any, int, list[int | None]]]:
        """``source`` as what the groups merge: (storage or layout, group, per-row
        ``converted_at``), in row order."""
        name = type(self).__name__
        q, tokens = self.quantization, self._token_geometry
        if isinstance(source, DelayedRows):
            if type(source) is not type(self) or (
                source.quantization,
                source.token_geometry,
                source.start,
            ) != (q, tokens, self.start):
                raise IncompatibleRowsError(
                    f"{name}({q.name}, start={self.start}) cannot merge rows of "
                    f"{type(source).__name__}({source.quantization.name}, "
                    f"start={source.start}): codec, geometry and start must match"
                )
            source._spec_guard("extract_row")
            record, slots = source._conversion, source._conversion.slots()
            return [
                (
                    source._groups[record.stage(b)].extract_row(slots[b]),
                    record.stage(b),
                    [record.converted_at[b]],
                )
                for b in range(source.batch_size)
            ]
        if isinstance(source, Handover):
            if type(source) is not self.lego_class or (
                source.quantization,
                source.token_geometry,
                source.start,
            ) != (q, tokens, self.start):
                raise IncompatibleRowsError(
                    f"{name}({q.name}, {tokens}, start={self.start}) cannot merge "
                    f"{source!r}: a lego of this implementation with the same codec, "
                    "geometry and start"
                )
            if source.converted:
                return [(source.storage, AFFINE, [source.minimum_reusable_offset])]
            return [(source.storage, PLAIN, [None])]
        spec = getattr(source, "codec_spec", None)
        if spec == Plain():
            group = PLAIN
        elif spec == q:
            group = AFFINE
        else:
            raise IncompatibleRowsError(
                f"{name} merges plain or {q.name} rows (legos, serial storages, ragged "
                f"layouts), got {type(source).__name__}"
                + ("" if spec is None else f" ({spec.name})")
            )
        counts = self._row_counts(source)
        conv: list[int | None] = (
            [None] * len(counts) if group == PLAIN else [self._conversion.point(c) for c in counts]
        )
        return [(source, group, conv)] if counts else []

    def merge_rows(self, rows: Sequence[Any]) -> None:
        """Join ``rows``: legos (released), serial plain / affine storages, rows of ragged
        layouts of either codec, rows of a delayed layout of the same parameters. Validated
        whole before anything moves; plain rows already past ``start`` convert at once
        (not while prefilling)."""
        self._spec_guard("merge_rows")
        if isinstance(rows, str | bytes) or not isinstance(rows, Sequence):
            raise InvalidInputError(MERGE_NEEDS_SEQUENCE)
        seen: set[int] = set()
        for source in rows:
            if source is self or id(source) in seen:
                raise IncompatibleRowsError(self_merge_message(self.signature()))
            seen.add(id(source))
        plans = [entry for source in rows for entry in self._plan(source)]
        old_offsets = self.row_offsets
        plain = self._groups[PLAIN]
        before = plain.batch_size
        try:
            for index, group in enumerate(self._groups):
                sources = [s for s, g, _ in plans if g == index]
                if sources:
                    group.merge_rows(sources)
        except BaseException:
            # Undo the plain group's join (a filter back to its rows strips what it grew).
            if plain.batch_size != before:
                plain.filter_rows(list(range(before)))
            raise
        offsets = [t for storage, _, _ in plans for t in self._row_counts(storage)]
        for _, _, conv in plans:  # a row's group is its stage: plain rows record None
            self._conversion.join(conv)
        if self._full_attention:
            # The ragged rule: every row right-aligned at the widest end.
            width = max((p + t for p, t in zip(self._pads, old_offsets, strict=True)), default=0)
            target = max([width, *offsets])
            grow = target - width
            self._pads = [p + grow for p in self._pads] + [target - t for t in offsets]
        for source in rows:
            if isinstance(source, Handover):
                if self._compose is None:
                    self._compose = source.composed.over
                source.composed.release()
        self._forget_reads()
        self._align_groups()
        self._advance()

    @staticmethod
    def _row_counts(storage: Any) -> list[int]:
        offsets = getattr(storage, "row_offsets", None)
        return [int(storage.offset)] if offsets is None else [int(o) for o in offsets]

    def filter_rows(self, keep: Sequence[int]) -> None:
        """Keep rows ``keep`` (any subset, any order)."""
        self._spec_guard("filter_rows")
        order = check_keep(keep, self.batch_size)
        if not order:
            self._clear_rows()
            return
        record, slots = self._conversion, self._conversion.slots()
        for index, group in enumerate(self._groups):
            group_keep = [slots[b] for b in order if record.stage(b) == index]
            if group_keep:
                group.filter_rows(group_keep)
            elif group.batch_size:
                group.filter_rows([])
        record.keep(order)
        if self._full_attention:
            pads = [self._pads[b] for b in order]
            shared = min(pads)
            self._pads = [p - shared for p in pads]
        self._forget_reads()
        self._align_groups()

    def _clear_rows(self) -> None:
        compose, prefilling = self._compose, self.prefilling
        self._clear()
        self._compose = compose
        if prefilling:
            self._conversion.begin_prefill()

    def extract_row(self, row: int) -> Any:
        """Row ``row`` as its serial storage (owned, compact, evaluated), wrapped as its
        lego (plain or converted phase) when the rows came from legos."""
        self._spec_guard("extract_row")
        index = check_row(row, self.batch_size)
        storage = self._groups[self._conversion.stage(index)].extract_row(self._slot(index))
        if self._compose is None:
            return storage
        converted_at = self._conversion.converted_at[index]
        return self._compose(
            storage, minimum_reusable_offset=None if converted_at is None else converted_at
        )

    def trim(self, n: int) -> int:
        count = as_count(n, "n")
        return self.trim_rows([count] * self.batch_size) if self.batch_size else 0

    def trim_rows(self, counts: Sequence[int]) -> int:
        """Forget ``counts[b]`` newest tokens of row ``b`` (converted rows stay converted)."""
        self._spec_guard("trim_rows")
        checked = check_counts(counts, self.batch_size)
        offsets = self.row_offsets
        for b, (count, tokens) in enumerate(zip(checked, offsets, strict=True)):
            if count > tokens:
                raise NotTrimmableError(
                    f"cannot trim {count} tokens from row {b}: it holds {tokens}"
                )
        if not any(checked):
            return 0
        for index, group in enumerate(self._groups):
            rows = self._members(index)
            if rows:
                group.trim_rows([checked[b] for b in rows])
        self._forget_reads()
        return max(checked)

    def check_valid(self) -> None:
        """Assert the layout's invariants (for tests)."""
        plain, affine = self._groups
        assert plain.batch_size == len(self._members(PLAIN))
        assert affine.batch_size == len(self._members(AFFINE))
        for group in self._groups:
            group.check_valid()
        if self._full_attention:
            assert len(self._pads) == self.batch_size
            if self._pads:
                assert min(self._pads) == 0
            for index, group in enumerate(self._groups):
                rows = self._members(index)
                if rows:
                    shift = min(self._pads[b] for b in rows)
                    assert tuple(group.left_pad) == tuple(self._pads[b] - shift for b in rows)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.quantization.name}, {self._token_geometry}, "
            f"start={self.start}, {self.phase}, row_offsets={self.row_offsets}, "
            f"converted_at={self.converted_at})"
        )


class DelayedFullAttention(DelayedRows):
    """``DelayedQuantizedKVCache(group_size=64, bits=8, start=0)``: the lego's arguments."""

    def __init__(
        self,
        group_size: int = 64,
        bits: int = 8,
        start: int = 0,
        *,
        geometry: KvGeometry | None = None,
    ) -> None:
        spec, tokens, first = lego_arguments(type(self).__name__, None, group_size, bits, 0, start)
        self._setup(spec, tokens, first, geometry)


class DelayedTurboRows(DelayedRows):
    """``DelayedTurboQuantKVCache(k_bits=8, v_bits=3, start=0)``: the TurboQuant lego's
    arguments (full attention only)."""

    def __init__(
        self,
        k_bits: int = 8,
        v_bits: int = 3,
        start: int = 0,
        *,
        geometry: KvGeometry | None = None,
    ) -> None:
        spec, first = turbo_lego_arguments(type(self).__name__, k_bits, v_bits, start)
        self._setup(spec, Growing(), first, geometry)


class DelayedSlidingWindow(DelayedRows):
    """``DelayedRotatingQuantizedKVCache(max_size, group_size=64, bits=8, keep=0,
    start=0)``: the ring lego's arguments."""

    def __init__(
        self,
        max_size: int,
        group_size: int = 64,
        bits: int = 8,
        keep: int = 0,
        start: int = 0,
        *,
        geometry: KvGeometry | None = None,
    ) -> None:
        spec, tokens, first = lego_arguments(
            type(self).__name__, max_size, group_size, bits, keep, start
        )
        self._setup(spec, tokens, first, geometry)

    @property
    def max_size(self) -> int:
        return int(self._token_geometry.parameters()["max_size"])

    @property
    def keep(self) -> int:
        return int(self._token_geometry.parameters()["keep"])


class StagePart:
    """One stage's share of a mixed read, as :meth:`DelayedLayout.attend_rows` hands it to
    an ``attend``: its batch rows, its codec, its reads (each tensor's fetched form, row
    ``i`` batch row ``rows[i]``) and the layout's mask restricted to its rows."""

    __slots__ = ("codec", "mask", "reads", "rows")

    def __init__(self, rows: list[int], codec: Any, reads: tuple[Any, Any], mask: Any) -> None:
        self.rows, self.codec, self.reads, self.mask = rows, codec, reads, mask

    @property
    def codec_spec(self) -> Any:
        return self.codec.spec


class DelayedLayout(ConversionBoundary, SpeculativeRounds):
    """The delayed modifier over a ragged layout of the row machinery (contract §0.5): the
    rows are one layout of two stages, ``(Plain(), target)``, each row in its own (the
    machinery's per-row stages); this mixin, listed first among a delayed preset's bases,
    keeps the int record (:class:`kvrows.conversion.Conversion`: which rows converted, at
    which offset, the prefill scope), converts due rows at the boundaries (after an append,
    a merge, a round's end, ``end_prefill``, the rows ``commit_prefill`` names) and answers
    a read of mixed rows with a :class:`RowAttentionPending` pair (inside
    :func:`row_reads`). Row placement, writes, merges, filters, trims and extraction are
    the machinery's; the implementation adds three array helpers (``_rows_of``,
    ``_in_batch_order``, ``_positions``) and the saved form's groups (``_group_states``,
    ``_hold_groups``).
    """

    composition: ClassVar[Composition]
    #: The ragged presets of the two stages (the saved form holds one state of each).
    plain_group_class: ClassVar[type[Any]]
    affine_group_class: ClassVar[type[Any]]
    #: The serial lego of this geometry and codec: rows joined from legos extract as legos.
    lego_class: ClassVar[type[Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "lego_class" in vars(cls):
            _DELAYED_FOR_LEGO[cls.lego_class] = cls

    if TYPE_CHECKING:  # the row machinery's (the mixin comes first in the MRO)
        codec: Any
        _geometry: KvGeometry | None
        _stages: tuple[Any, ...]

        token_geometry: GeometrySpec

        @property
        def left_pad(self) -> tuple[int, ...]: ...

        @property
        def batch_size(self) -> int: ...

        @property
        def row_offsets(self) -> tuple[int, ...]: ...

        @property
        def row_stages(self) -> tuple[int, ...]: ...

        def _setup(
            self, codec_spec: CodecSpec, token_geometry: GeometrySpec, geometry: KvGeometry | None
        ) -> None: ...

        def _use_stages(self, specs: Sequence[CodecSpec]) -> None: ...

        def _convert_rows(self, rows: Sequence[int]) -> None: ...

        def _stage_parts(self) -> list[tuple[list[int], Any, dict[str, Any]]]: ...

        def _update(self, keys: Any, values: Any) -> None: ...

        def _read(self) -> dict[str, Any]: ...

        def make_mask(
            self, n: int, *, return_array: bool = False, window_size: int | None = None
        ) -> Any: ...

    # -- the implementation's array helpers --------------------------------------------------
    def _rows_of(self, array: Any, rows: Sequence[int]) -> Any:
        """``array``'s rows ``rows`` along axis 0 (an array of one row broadcasts: as is)."""
        raise NotImplementedError

    def _in_batch_order(self, parts: Sequence[Any], order: Sequence[int]) -> Any:
        """``parts`` concatenated along axis 0 hold rows ``order``: in batch order."""
        raise NotImplementedError

    def _positions(self, values: Sequence[int]) -> Any:
        """An int32 vector (positions, the saved record's)."""
        raise NotImplementedError

    def _group_states(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """The states of the plain and the converted rows as the two stages' ragged presets
        (``plain_group_class`` / ``affine_group_class``) save them."""
        raise NotImplementedError

    def _hold_groups(
        self,
        plain: Any,
        affine: Any,
        converted_at: Sequence[int | None],
        left_pad: Sequence[int] | None,
    ) -> None:
        """Hold the rows of the restored groups ``plain`` / ``affine`` in batch order (row
        ``b`` from its stage's group, at its rank among that stage's rows; ``left_pad``:
        the record's columns, full attention)."""
        raise NotImplementedError

    # -- construction ------------------------------------------------------------------------
    def __init__(self, *args: object, geometry: KvGeometry | None = None, **kwargs: object) -> None:
        spec, tokens, first = delayed_arguments(
            type(self).__name__, self.composition.params, args, kwargs
        )
        self._init_delayed(spec, tokens, first, geometry)

    def _init_delayed(
        self, quantization: Target, token_geometry: GeometrySpec, start: int, geometry: Any
    ) -> None:
        quantization = check_target(type(self).__name__, quantization, token_geometry)
        if geometry is not None and not isinstance(geometry, KvGeometry):
            raise InvalidInputError(
                f"{type(self).__name__}: {not_a_geometry_message(type(geometry).__name__)}"
            )
        if geometry is not None:
            Bf16First._check_dims(geometry.key_dim, geometry.value_dim, quantization)
        self._conversion = self.conversion_class(quantization, start)
        self._token_geometry = token_geometry
        self._declared = geometry
        self._compose: Callable[..., Any] | None = None
        self._reset()

    def _reset(self) -> None:
        """No row, plain, nothing read (the compose hook and the prefill scope are the
        caller's to keep)."""
        self._setup(Plain(), self._token_geometry, self._declared)
        self._use_stages((Plain(), self.quantization))
        self._conversion = self.conversion_class(self.quantization, self.start)
        self._generation = 0
        self._pending: list[StagePart] | None = None
        #: The last plain or packed read: its codec and reads (``attend_last_read``).
        self._last: tuple[Any, tuple[Any, Any]] | None = None

    @classmethod
    def from_specs(
        cls,
        codec: Any,
        token_geometry: GeometrySpec,
        *,
        geometry: KvGeometry | None = None,
        start: int = 0,
    ) -> Self:
        """A layout from specs (``start`` is not a codec or geometry parameter)."""
        kind = cls.composition.codec
        if getattr(codec, "kind", None) != kind:
            raise InvalidInputError(f"{cls.__name__} converts to the {kind} codec, got {codec!r}")
        fresh = cls.__new__(cls)
        fresh._init_delayed(codec, token_geometry, as_count(start, "start"), geometry)
        return fresh

    def make_empty_batch(self) -> Self:
        return self.from_specs(
            self.quantization, self._token_geometry, geometry=self._declared, start=self.start
        )

    # -- what it is --------------------------------------------------------------------------
    @property
    def codec_spec(self) -> Target:
        return self.quantization

    @property
    def last_read_codec(self) -> Any:
        """The codec of what the last plain or packed append returned (the append that
        converted rows read plain); ``None`` without one (a mixed read: ``attend_rows``)."""
        return None if self._last is None else self._last[0]

    def signature(self) -> str:
        return self.composition.signature.format(
            start=self.start, **self.quantization.parameters(),
            **self._token_geometry.parameters(),
        )  # fmt: skip

    @property
    def phase(self) -> Phase:
        """``empty``; ``plain`` (no row converted); ``mixed``; ``packed`` (every row)."""
        return self._conversion.phase

    @property
    def converted_at(self) -> tuple[int | None, ...]:
        """Per row, the offset at which it converted (``None``: plain; 0 with ``start ==
        0``; a storage merged converted records its offset, the conservative bound)."""
        return self._conversion.converted_at

    @property
    def prefilling(self) -> bool:
        return self._conversion.prefilling

    def projected_bytes(self, tokens: int) -> int:
        """The most a row holds on its way to ``tokens`` positions: plain below ``start``;
        from it, the larger of the plain row just before converting and the converted row
        now (rings hold at most ``max_size`` positions of either)."""
        count = as_count(tokens, "tokens")
        plain, target = self._stages
        cap = self._token_geometry.cap()
        geometry = self._geometry
        if count < self.start:
            return row_bytes(plain, geometry, count, cap)
        before = row_bytes(plain, geometry, self.start - 1, cap) if self.start else 0
        return max(before, row_bytes(target, geometry, count, cap))

    def is_trimmable(self) -> bool:
        return True

    def max_append_tokens(self) -> float:
        """Tokens the next append may add without passing any plain row's boundary."""
        return self._conversion.max_append_tokens(self.row_offsets)

    # -- saved state (``kvrows.forms``; ``spec/persistence.md`` §1.1) -------------------------
    @property
    def state(self) -> tuple[Any, ...]:
        """The plain rows' state, the converted rows' (each its stage's ragged preset's
        form), then the row record: ``start``, ``converted_at`` (``DELAYED_PLAIN`` for a
        plain row), ``left_pad`` (full attention; empty for rings), ``prefilling``,
        ``composed`` (rows extract as legos), a ring's ``keep``."""
        self._spec_guard("reading state")
        marks = [DELAYED_PLAIN if c is None else c for c in self.converted_at]
        full_attention = not self._token_geometry.wraps
        record: dict[str, Any] = {
            "start": self.start,
            "converted_at": self._positions(marks),
            "left_pad": self._positions(self.left_pad if full_attention else []),
            "prefilling": self.prefilling,
            "composed": self._compose is not None,
            **{
                name: self._token_geometry.parameters()[name]
                for name in self._token_geometry.layout_form_omits
            },
        }
        plain, converted = self._group_states()
        return delayed_state(self.composition, plain, converted, record)

    @state.setter
    def state(self, value: tuple[Any, ...]) -> None:
        """Hold ``value`` (a state of this class); a refused value changes nothing."""
        self._spec_guard("restoring state")
        keep = self._token_geometry.parameters().get("keep")
        fresh = type(self)._restore(value, None, keep, self._declared)
        self.__dict__.clear()
        self.__dict__.update(fresh.__dict__)

    @classmethod
    def _restore(
        cls, state: Any, meta_state: Any, keep: int | None, geometry: KvGeometry | None
    ) -> Self:
        """Each stage's rows restored by its ragged preset, the record checked against
        them (``kvrows.forms.parse_delayed_state``), the rows placed at the record's
        columns; built from legos, its rows extract as legos again."""
        if meta_state is not None:
            raise InvalidInputError(f"{cls.__name__} has no two-part (meta_state) form")
        parts = parse_delayed_state(cls.composition, state, keep=keep)
        plain = cls.plain_group_class.from_state(
            parts.plain_state, keep=parts.keep, geometry=geometry
        )
        # A TurboQuant state's planes do not record the activation dtype (its scales are
        # float16 whatever it is): the plain rows, when there are any, say it.
        affine = cls.affine_group_class.from_state(
            parts.affine_state, keep=parts.keep, geometry=geometry or plain.geometry
        )
        if plain.token_geometry != affine.token_geometry:
            raise InvalidInputError(
                f"{cls.__name__} state: the groups' windows differ "
                f"({plain.token_geometry} and {affine.token_geometry})"
            )
        if None not in (plain.geometry, affine.geometry) and plain.geometry != affine.geometry:
            raise InvalidInputError(
                f"{cls.__name__} state: the groups hold different KV geometries "
                f"({plain.geometry} and {affine.geometry})"
            )
        fresh = cls.from_specs(
            affine.codec_spec, affine.token_geometry, geometry=geometry, start=parts.start
        )
        full_attention = not fresh._token_geometry.wraps
        fresh._hold_groups(
            plain, affine, parts.converted_at, parts.left_pad if full_attention else None
        )
        fresh._conversion = cls.conversion_class(
            fresh.quantization,
            fresh.start,
            parts.converted_at,
            prefilling=bool(parts.record["prefilling"]),
        )
        if parts.record["composed"]:
            lego = cls.lego_class.from_parts(
                fresh.quantization, fresh._token_geometry, fresh.start, geometry
            )
            fresh._compose = lego.composed.over
        return fresh

    # -- appends and reads -------------------------------------------------------------------
    def _check_block(self, keys: Any, values: Any) -> None:
        shapes = [tuple(getattr(a, "shape", ())) for a in (keys, values)]
        if any(len(s) != 4 for s in shapes):
            raise InvalidInputError(
                f"keys and values must be [B, H, N, D] arrays, got shapes {shapes[0]} and "
                f"{shapes[1]}"
            )
        key_shape, value_shape = shapes
        if key_shape[0] != self.batch_size or value_shape[0] != self.batch_size:
            raise InvalidInputError(
                f"the block has {key_shape[0]} rows, the layout {self.batch_size}"
            )
        Bf16First._check_dims(int(key_shape[3]), int(value_shape[3]), self.quantization)

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """Append a block to every row. All plain or all converted: the read of that
        codec. Mixed (inside :func:`row_reads`): each stage's rows and their reads come back
        as a pending pair (outside one: ``MixedPrecisionReadError``, nothing changed).
        After the append (not inside a round or a prefill), rows that reached ``start``
        convert."""
        self._spec_usable()
        if not self.batch_size:
            raise LayoutStateError(EMPTY_LAYOUT_UPDATE)
        self._check_block(keys, values)
        phase = self.phase
        if phase == "mixed" and not row_reads_active():
            raise MixedPrecisionReadError(MIXED_READ)

        def append() -> tuple[Any, Any]:
            # Drop the last read first: a read held across the write would make an
            # in-place append copy its buffers.
            self._forget_reads()
            reads: tuple[Any, Any]
            if phase == "mixed":
                mask = self.make_mask(int(keys.shape[2]), return_array=True)
                self._update(keys, values)
                self._pending = [
                    StagePart(rows, codec, _pair(read), self._rows_of(mask, rows))
                    for rows, codec, read in self._stage_parts()
                ]
                pending = RowAttentionPending(self, self._generation + 1)
                reads = (pending, pending)
            else:
                self._update(keys, values)
                reads = _pair(self._read())
                self._last = (self.codec, reads)
            self._generation += 1
            self._conversion.note_read(phase == "packed")
            return reads

        reads = self._spec_append(append)
        if not self.spec_round_open:
            self._convert_due()
        return reads

    @property
    def needs_row_attention(self) -> bool:
        """Always: mixed rows attend stage by stage (``attend_rows``) inside
        ``kvrows.app.attention.row_attention``."""
        return True

    @property
    def reads_pending(self) -> bool:
        """Whether the last append returned a pending pair (mixed rows)."""
        return self._pending is not None

    def _forget_reads(self) -> None:
        self._pending = None
        self._last = None

    def attend_last_read(self, queries: Any, mask: Any, scale: float) -> Any:
        """Attention of ``queries`` over what the last append returned (``None`` when no
        append has been made since the rows last changed): a mixed read through
        :meth:`attend_rows`; a plain or packed read through its codec with ``mask``, also
        when the append then converted rows (its read stays the one the model attended)."""
        if self._pending is not None:
            return self.attend_rows(queries, scale)
        if self._last is None:
            return None
        codec, reads = self._last
        return codec.attend(queries, *reads, mask, scale)

    def attend_rows(
        self,
        queries: Any,
        scale: float,
        attend: GroupAttend | None = None,
        pending: RowAttentionPending | None = None,
    ) -> Any:
        """The attention of ``queries`` ``[B, Hq, N, D]`` over the last mixed read: each
        stage's rows with its own codec, reads and mask (``attend``: one part's attention,
        by default its codec's). ``pending``, when given, must be the last read's."""
        parts = self._pending
        if parts is None:
            raise MixedPrecisionReadError(
                "attend_rows needs the pending pair of a mixed read: the last append did "
                "not return one"
            )
        if pending is not None and (
            pending.layout is not self or pending.generation != self._generation
        ):
            raise MixedPrecisionReadError(
                "this pending pair is stale: a later append replaced it (attend right after "
                "the append that returned it)"
            )
        shape = tuple(getattr(queries, "shape", ()))
        if len(shape) != 4 or shape[0] != self.batch_size:
            raise InvalidInputError(
                f"queries must be [B={self.batch_size}, Hq, N, D], got shape {shape}"
            )
        run = attend or _default_group_attend
        outputs, order = [], []
        for part in parts:
            rows_queries = self._rows_of(queries, part.rows)
            outputs.append(run(rows_queries, part, *part.reads, part.mask, scale))
            order.extend(part.rows)
        return self._in_batch_order(outputs, order)

    # -- conversion --------------------------------------------------------------------------
    def _convert_due(self) -> None:
        """Convert every due row (none while prefilling or inside a round)."""
        self._convert(self._conversion.due(self.row_offsets, round_open=self.spec_round_open))

    def _convert(self, rows: Sequence[int]) -> None:
        """Move ``rows`` (plain, due) into the target stage, encoded as the lego encodes."""
        if not rows:
            return
        offsets = self.row_offsets
        self._convert_rows(rows)
        self._conversion.mark(rows, offsets)

    # -- prefill maintenance -----------------------------------------------------------------
    def begin_prefill(self) -> None:
        """Appends past a row's boundary convert nothing until ``commit_prefill`` /
        ``end_prefill``."""
        self._spec_guard("begin_prefill")
        self._conversion.begin_prefill()

    def commit_prefill(self, indices: Sequence[int]) -> None:
        """Convert the listed rows now if due (each at its own planned chunk end)."""
        self._spec_guard("commit_prefill")
        self._convert(self._conversion.commit_prefill(indices, self.row_offsets))

    def end_prefill(self) -> None:
        """Back to converting at every boundary; due rows convert now."""
        self._spec_guard("end_prefill")
        self._convert(self._conversion.end_prefill(self.row_offsets))

    # -- rounds --------------------------------------------------------------------------------
    def spec_round_commit(self) -> None:
        super().spec_round_commit()
        self._convert_due()

    def spec_round_rollback(self, keep: int | Sequence[int]) -> None:
        super().spec_round_rollback(keep)
        self._convert_due()

    def can_publish_row(self, row: int, tokens: int) -> bool:
        """What the machinery says of the row (a ring row that wrapped covers only its
        whole length), never inside a round."""
        self._spec_usable()
        index = check_row(row, self.batch_size)
        count = as_count(tokens, "tokens")
        if self.spec_round_open:
            return False
        publishes: bool = super().can_publish_row(index, count)
        return publishes

    # -- membership ----------------------------------------------------------------------------
    def _source_record(self, source: Any) -> list[int | None] | None:
        """What ``source``'s rows record as ``converted_at`` (``None``: not a source this
        layout takes)."""
        q, tokens = self.quantization, self._token_geometry
        if isinstance(source, Converting):
            other: Any = source
            if type(other) is not type(self) or (
                other.quantization,
                other.token_geometry,
                other.start,
            ) != (q, tokens, self.start):
                return None
            other._spec_guard("extract_row")  # its rows leave it as extractions
            return list(other.converted_at)
        if isinstance(source, Handover):
            lego: Any = source
            if type(lego) is not self.lego_class or (
                lego.quantization,
                lego.token_geometry,
                lego.start,
            ) != (q, tokens, self.start):
                return None
            counts = _row_counts(lego)
            if lego.converted:
                return [lego.minimum_reusable_offset] * len(counts)
            return [None] * len(counts)
        spec = getattr(source, "codec_spec", None)
        if spec not in (Plain(), q):
            return None
        counts = _row_counts(source)
        if spec == Plain():
            return [None] * len(counts)
        return [self._conversion.point(c) for c in counts]

    # The machinery's merge (``merge_rows``: argument, self-merge and compatibility checks,
    # then ``_join``) asks these two of each source.
    def _accepts(self, source: object) -> bool:
        accepted: bool = self._source_record(source) is not None and super()._accepts(source)  # type: ignore[misc]
        return accepted

    def _merge_refusal(self, source: object) -> str:
        name, q, tokens = type(self).__name__, self.quantization, self._token_geometry
        if self._source_record(source) is not None:
            # A source of a stage's codec whose rows the stage's ragged preset refuses
            # (another token geometry): that preset's words.
            stage = 0 if getattr(source, "codec_spec", None) == Plain() else 1
            group = (self.plain_group_class, self.affine_group_class)[stage]
            codec = self._stages[stage]
            signature = group.composition.signature_for(codec.spec, tokens)
            return incompatible_merge_message(signature, source, codec.key, tokens)
        if isinstance(source, Converting):
            other: Any = source
            return (
                f"{name}({q.name}, start={self.start}) cannot merge rows of "
                f"{type(other).__name__}({other.quantization.name}, "
                f"start={other.start}): codec, geometry and start must match"
            )
        if isinstance(source, Handover):
            return (
                f"{name}({q.name}, {tokens}, start={self.start}) cannot merge "
                f"{source!r}: a lego of this implementation with the same codec, "
                "geometry and start"
            )
        spec = getattr(source, "codec_spec", None)
        return (
            f"{name} merges plain or {q.name} rows (legos, serial storages, ragged "
            f"layouts), got {type(source).__name__}" + ("" if spec is None else f" ({spec.name})")
        )

    def _join(self, sources: Sequence[Any], *args: Any) -> None:
        records = [self._source_record(source) or [] for source in sources]
        super()._join(sources, *args)  # type: ignore[misc]
        for record in records:
            self._conversion.join(record)
        for source in sources:
            if isinstance(source, Handover):
                if self._compose is None:
                    self._compose = source.composed.over
                source.composed.release()
        self._forget_reads()
        self._convert_due()

    def filter_rows(self, keep: Sequence[int]) -> None:
        """Keep rows ``keep`` (any subset, any order)."""
        self._spec_guard("filter_rows")
        order = check_keep(keep, self.batch_size)
        if not order:
            compose, prefilling = self._compose, self.prefilling
            self._reset()
            self._compose = compose
            if prefilling:
                self._conversion.begin_prefill()
            return
        super().filter_rows(order)  # type: ignore[misc]
        self._conversion.keep(order)
        self._forget_reads()

    def extract_row(self, row: int) -> Any:
        """Row ``row`` as its stage's serial storage (owned, compact), wrapped as its lego
        when the rows came from legos."""
        self._spec_guard("extract_row")
        index = check_row(row, self.batch_size)
        storage = super().extract_row(index)  # type: ignore[misc]
        if self._compose is None:
            return storage
        converted_at = self._conversion.converted_at[index]
        return self._compose(storage, minimum_reusable_offset=converted_at)

    def trim(self, n: int) -> int:
        count = as_count(n, "n")
        return self.trim_rows([count] * self.batch_size) if self.batch_size else 0

    def trim_rows(self, counts: Sequence[int]) -> int:
        """Forget ``counts[b]`` newest tokens of row ``b`` (converted rows stay converted)."""
        self._spec_guard("trim_rows")
        checked = check_counts(counts, self.batch_size)
        for b, (count, tokens) in enumerate(zip(checked, self.row_offsets, strict=True)):
            if count > tokens:
                raise NotTrimmableError(
                    f"cannot trim {count} tokens from row {b}: it holds {tokens}"
                )
        if not any(checked):
            return 0
        trimmed: int = super().trim_rows(checked)  # type: ignore[misc]
        self._forget_reads()
        return trimmed

    def check_valid(self) -> None:
        """Assert the layout's invariants (for tests): the machinery's, and each row's
        stage is its record's."""
        super().check_valid()  # type: ignore[misc]
        assert self.row_stages == tuple(int(c is not None) for c in self.converted_at)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.quantization.name}, {self._token_geometry}, "
            f"start={self.start}, {self.phase}, row_offsets={self.row_offsets}, "
            f"converted_at={self.converted_at})"
        )


def _pair(reads: dict[str, Any]) -> tuple[Any, Any]:
    """A read's keys and values."""
    keys, values = reads.values()
    return keys, values


def _row_counts(storage: Any) -> list[int]:
    offsets = getattr(storage, "row_offsets", None)
    return [int(storage.offset)] if offsets is None else [int(o) for o in offsets]
