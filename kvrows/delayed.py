"""The delayed modifier: rows that convert to affine or TurboQuant at their own bf16-first
boundary.

:class:`ConversionBoundary` is the modifier's one code path (the constructor, the
``Conversion`` record, the append that converts due rows after its read, the conversion
at a boundary), under its serial mixin (the bf16-first legos, ``kvrows.lego.Bf16First``: a
one-row record) and its layout mixin, :class:`DelayedLayout`.

A delayed layout (``spec/DelayedQuantizedKVCache.md``,
``spec/DelayedRotatingQuantizedKVCache.md``, ``spec/DelayedTurboQuantKVCache.md``) holds
the rows of a batch whose serial storage is a bf16-first lego (``kvrows.lego``): each row
stays plain until its own offset reaches ``start`` and converts exactly where its solo
lego would. It is a table preset in both implementations: a ragged layout of the row
machinery with two stages, ``(Plain(), target)``, each row in its own (contract §0.5;
the optimized keeps one store per stage, §0.4), under :class:`DelayedLayout`, this
module's array-free mixin, plus each twin's array helpers (``reference/delayed.py``,
``optimized/delayed.py``).

* **Positions** are the machinery's: full attention keeps one ragged record
  (``left_pad``) for every row whatever its stage; ring rows keep their own columns.
* **Conversion** happens at boundaries only: after an append (its read is made first, as
  the lego's), after a merge, at the end of a round, at ``end_prefill`` and for the rows
  ``commit_prefill`` names; never inside a round or while prefilling.
* **Reads.** All plain: the plain codec's read. All converted ("packed"): the target's
  (its triples; ``bits`` appears). Mixed: the layout returns a
  :class:`RowAttentionPending` pair and :meth:`DelayedLayout.attend_rows` attends each
  stage's rows (:class:`StagePart`) with its own codec and mask. Only inside
  :func:`row_reads` (the row-attention scope a caller opens); outside one a mixed read
  raises ``MixedPrecisionReadError`` and changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Self

from kvrows.common import all_or_nothing, check_counts, row_bytes
from kvrows.compositions import Composition
from kvrows.conversion import (
    MIXED_READ,
    Conversion,
    Phase,
    RowAttentionPending,
    Target,
    check_target,
    check_target_dims,
    delayed_arguments,
    row_reads,
    row_reads_active,
)
from kvrows.errors import (
    EMPTY_LAYOUT_UPDATE,
    InvalidInputError,
    LayoutStateError,
    MixedPrecisionReadError,
    NotTrimmableError,
    incompatible_merge_message,
    not_a_geometry_message,
)
from kvrows.forms import delayed_state, spec_fields
from kvrows.forms_v1 import parse_delayed
from kvrows.geometries import is_geometry_spec
from kvrows.protocols import Converting, Handover
from kvrows.schemes import CodecSpec, GeometrySpec, Plain
from kvrows.speculative import SpeculativeRounds
from kvrows.validation import KvGeometry, as_count, check_keep, check_row

__all__ = [
    "MIXED_READ",
    "ConversionBoundary",
    "DelayedLayout",
    "GroupAttend",
    "RowAttentionPending",
    "StagePart",
    "delayed_layout_for",
    "row_reads",
    "row_reads_active",
]

#: Stage 0's spec (a frozen value: built once, a merge compares each source's with it).
_PLAIN = Plain()

#: ``attend(queries, part, keys, values, mask, scale)``: one stage's attention over its rows
#: (``part`` a :class:`StagePart`: its codec attends by default).
GroupAttend = Callable[[Any, Any, Any, Any, Any, float], Any]


def _default_group_attend(
    queries: Any, group: Any, keys: Any, values: Any, mask: Any, scale: float
) -> Any:
    return group.codec.attend(queries, keys, values, mask, scale)


#: lego class -> the delayed layout class of its implementation (filled as classes are made).
_DELAYED_FOR_LEGO: dict[type[Any], type[Any]] = {}


def delayed_layout_for(lego: Any) -> type[Any]:
    """The delayed layout class that holds rows of ``lego``'s class."""
    try:
        return _DELAYED_FOR_LEGO[type(lego)]
    except KeyError:
        raise InvalidInputError(
            f"{type(lego).__name__} has no delayed layout (no implementation registered one)"
        ) from None


class ConversionBoundary:
    """The delayed modifier's one code path, shared by its serial mixin (the legos,
    ``kvrows.lego.Bf16First``) and its layout mixin (:class:`DelayedLayout`): the
    constructor (the target codec, the token geometry, ``start``), the conversion record of
    the rows (``kvrows.conversion.Conversion``), the append that converts due rows after
    its read, the conversion at a boundary (``_convert``) and ``max_append_tokens``. A
    serial storage is the one-row case: its record has one row, whatever its batch holds
    (its rows move together), and its rows convert together.

    ``bits`` / ``group_size`` show under the record's rule: an affine target's, visible
    only while the last append returned quantized reads (mlx-lm's attention asks
    ``hasattr(cache, "bits")`` right after ``update_and_fetch`` to pick its quantized path,
    and a converting append returns plain keys and values). A TurboQuant target never shows
    them: its reads defer the values, so they go through the codec's own attention
    (``kvrows.app.attention.dispatch``), not mlx-lm's.

    It is listed first among a delayed preset's bases, over the implementation's row
    machinery, which supplies the stage hooks (``reference/rows.py``,
    ``optimized/rows.py``): ``_setup(codec, token_geometry, geometry)`` (an empty storage
    of those specs), ``_use_stages(specs)`` (the codecs of the stages; rows start in stage
    0) and ``_convert_rows(rows)`` (re-encode rows from their stage into the next).
    """

    #: The record's class (a test plants a wrong rule through it).
    conversion_class: ClassVar[type[Conversion]] = Conversion
    composition: ClassVar[Composition]
    #: A serial storage keeps a one-row record; a layout one row per batch row.
    _one_row: ClassVar[bool] = False
    _conversion: Conversion
    _token_geometry: GeometrySpec
    _declared: KvGeometry | None

    if TYPE_CHECKING:  # the row machinery's stage hooks (the mixin comes first in the MRO)
        codec: Any

        def _setup(
            self, codec_spec: CodecSpec, token_geometry: GeometrySpec, geometry: KvGeometry | None
        ) -> None: ...

        def _use_stages(self, specs: Sequence[CodecSpec]) -> None: ...

        def _convert_rows(self, rows: Sequence[int]) -> None: ...

    # -- construction ------------------------------------------------------------------------
    def __init__(self, *args: object, geometry: KvGeometry | None = None, **kwargs: object) -> None:
        spec, tokens, first = delayed_arguments(type(self).__name__, self.composition, args, kwargs)
        self._init_delayed(spec, tokens, first, geometry)

    @classmethod
    def from_specs(
        cls,
        codec: Any,
        token_geometry: GeometrySpec,
        *,
        geometry: KvGeometry | None = None,
        start: int = 0,
    ) -> Self:
        """An empty storage converting to ``codec`` (of the table entry's codec kind) on
        ``token_geometry`` (``start`` is not a codec or geometry parameter)."""
        kind = cls.composition.codec
        if getattr(codec, "kind", None) != kind:
            raise InvalidInputError(f"{cls.__name__} converts to the {kind} codec, got {codec!r}")
        fresh = cls.__new__(cls)
        fresh._init_delayed(codec, token_geometry, as_count(start, "start"), geometry)
        return fresh

    def _init_delayed(
        self, quantization: Target, token_geometry: GeometrySpec, start: int, geometry: Any
    ) -> None:
        name = type(self).__name__
        if not is_geometry_spec(token_geometry) or not token_geometry.token_axis:
            raise InvalidInputError(
                f"{name} takes a Growing(), Ring(...) or Chunked(...) token geometry, "
                f"got {token_geometry!r}"
            )
        if geometry is not None and not isinstance(geometry, KvGeometry):
            raise InvalidInputError(f"{name}: {not_a_geometry_message(type(geometry).__name__)}")
        quantization = check_target(name, quantization, token_geometry)
        if geometry is not None:
            check_target_dims(geometry.key_dim, geometry.value_dim, quantization)
        self._conversion = self.conversion_class(quantization, start)
        self._token_geometry = token_geometry
        self._declared = geometry
        self._reset()

    def _reset(self) -> None:
        """Empty, plain (stage 0), no row converted, nothing read."""
        self._setup(Plain(), self._token_geometry, self._declared)
        self._use_stages((Plain(), self.quantization))
        self._conversion = self.conversion_class(
            self.quantization, self.start, [None] if self._one_row else []
        )
        self._forget_reads()

    def _like(self) -> Self:
        """An empty storage of the same parameters."""
        return self.from_specs(
            self.quantization, self._token_geometry, geometry=self._declared, start=self.start
        )

    # -- what the record says ------------------------------------------------------------------
    @property
    def start(self) -> int:
        """The bf16-first boundary: the offset at which a row converts."""
        return self._conversion.start

    @property
    def quantization(self) -> Target:
        """The codec rows convert to."""
        return self._conversion.target

    @property
    def converts_to_deferred_values(self) -> bool:
        """Whether the target codec's reads defer their values (TurboQuant: attention goes
        through the codec, ``kvrows.app.attention.dispatch``)."""
        return self._conversion.target.reads == "own"

    @property
    def bits(self) -> int:
        return self._conversion.read_parameter(type(self).__name__, "bits")

    @property
    def group_size(self) -> int:
        return self._conversion.read_parameter(type(self).__name__, "group_size")

    @property
    def minimum_reusable_offset(self) -> int:
        """The largest offset at which a row converted with ``start > 0`` (prefix reuse
        must not trim below it: that row would skip its conversion); 0 before any row
        converts and with ``start == 0``."""
        return self._conversion.minimum_reusable_offset

    def max_append_tokens(self) -> float:
        """Tokens the next append may add without passing any plain row's boundary:
        ``start - offset`` of the nearest, else unlimited."""
        return self._conversion.max_append_tokens(self._record_offsets())

    # -- the arrangement's hooks -----------------------------------------------------------------
    def _record_offsets(self) -> Sequence[int]:
        """The offset of each row of the record."""
        raise NotImplementedError

    def _storage_rows(self, rows: Sequence[int]) -> Sequence[int]:
        """The storage's rows that rows ``rows`` of the record stand for."""
        return rows

    def _in_round(self) -> bool:
        """Whether a speculative round is open (nothing converts inside one)."""
        return False

    def _append_read(self, keys: Any, values: Any, phase: Phase) -> tuple[Any, Any]:
        """Check the block, append it and return the read (the rows in ``phase``)."""
        raise NotImplementedError

    def _forget_reads(self) -> None:
        """Drop what the last append read (the rows changed)."""

    def _converting(self) -> None:
        """Rows are about to convert (after the append that read them plain)."""

    # -- appends and conversion ----------------------------------------------------------------
    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """Append a block; its read is the rows' codec's (a converting append reads plain).
        After the append (not inside a round or a prefill), rows that reached ``start``
        convert. A refused block changes nothing."""
        phase = self._conversion.phase

        def append() -> tuple[Any, Any]:
            reads = self._append_read(keys, values, phase)
            self._conversion.note_read(phase == "packed")
            self._convert_due()
            return reads

        if self._in_round():  # a fault in a round's verify block invalidates the round
            return append()  # (speculative.md §3); nothing converts inside a round
        # A fault in the conversion after the append puts the append back too (contract §9);
        # only an append rows convert after keeps what the planes held (it copies once).
        n = int(getattr(keys, "shape", (0, 0, 0))[2]) if len(getattr(keys, "shape", ())) == 4 else 0
        converts = bool(self._conversion.due([o + n for o in self._record_offsets()]))
        return all_or_nothing(self, append, copied=("_conversion",), held=converts)

    def _check_convertible(self, keys: Any, values: Any) -> None:
        """Refuse ``[B, H, N, D]`` blocks of head dims the target cannot store (before
        the append: a plain row of them could never convert)."""
        shapes = [tuple(getattr(a, "shape", ())) for a in (keys, values)]
        if all(len(shape) == 4 for shape in shapes):
            check_target_dims(int(shapes[0][3]), int(shapes[1][3]), self.quantization)

    def _convert_due(self) -> None:
        """Convert every due row (none while prefilling or inside a round)."""
        self._convert(self._conversion.due(self._record_offsets(), round_open=self._in_round()))

    def _convert(self, rows: Sequence[int]) -> None:
        """Move ``rows`` of the record (plain, due) into the target stage."""
        if not rows:
            return
        offsets = self._record_offsets()

        def convert() -> None:
            self._converting()
            self._convert_rows(self._storage_rows(rows))
            self._conversion.mark(rows, offsets)

        # Several stores move their rows one by one: a fault puts every one back (§9).
        all_or_nothing(self, convert, copied=("_conversion",))


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
    ``_in_batch_order``, ``_positions``) and ``_place_pads`` (a restored record's columns).
    """

    composition: ClassVar[Composition]
    #: The ragged presets of the two stages (the saved form holds one state of each).
    plain_group_class: ClassVar[type[Any]]
    affine_group_class: ClassVar[type[Any]]
    #: The serial lego of this geometry and codec: rows joined from legos extract as legos.
    lego_class: ClassVar[type[Any]]
    #: ``composed.over`` of the legos the rows came from (``None``: rows extract as storages).
    _compose: Callable[..., Any] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "lego_class" in vars(cls):
            _DELAYED_FOR_LEGO[cls.lego_class] = cls

    if TYPE_CHECKING:  # the row machinery's (the mixin comes first in the MRO)
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

    def _place_pads(self, left_pad: Sequence[int]) -> None:
        """Lay row ``b`` at column ``left_pad[b]`` (full attention; a restored record's)."""
        raise NotImplementedError

    # -- construction ------------------------------------------------------------------------
    def _reset(self) -> None:
        """No row, plain, nothing read (the compose hook and the prefill scope are the
        caller's to keep)."""
        super()._reset()
        self._generation = 0

    def _forget_reads(self) -> None:
        self._pending: list[StagePart] | None = None
        #: The last plain or packed read: its codec and reads (``attend_last_read``).
        self._last: tuple[Any, tuple[Any, Any]] | None = None

    def make_empty_batch(self) -> Self:
        return self._like()

    # -- the record's rows ---------------------------------------------------------------------
    def _record_offsets(self) -> Sequence[int]:
        return self.row_offsets

    def _in_round(self) -> bool:
        return self.spec_round_open

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

    # -- saved state (``kvrows.forms``; ``spec/persistence.md`` §1.1) -------------------------
    def _group_states(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """The states of the plain and the converted rows as the two stages' ragged presets
        (``plain_group_class`` / ``affine_group_class``) save them: each stage's rows
        extracted and merged into one (a layout's form right-aligns its rows' windows, so
        their columns here do not matter)."""
        states = []
        for stage, cls in enumerate((self.plain_group_class, self.affine_group_class)):
            group = cls.from_specs(
                self._stages[stage].spec, self._token_geometry, geometry=self._geometry
            )
            rows = [b for b, s in enumerate(self.row_stages) if s == stage]
            if rows:  # the machinery's extraction: one-stage serial storages, no lego
                group.merge_rows([super(DelayedLayout, self).extract_row(b) for b in rows])  # type: ignore[misc]
            states.append(tuple(group.state))
        return states[0], states[1]

    def _hold_groups(
        self, plain: Any, affine: Any, converted_at: Sequence[int | None], left_pad: Any
    ) -> None:
        """Hold the restored groups' rows in batch order (row ``b`` from its stage's group,
        at its rank among that stage's rows), at the record's columns (``left_pad``, full
        attention): the machinery's merge and filter, the modifier's record left out (the
        caller restores it)."""
        self._restoring = True
        try:
            super().merge_rows([plain, affine])  # type: ignore[misc]
        finally:
            self._restoring = False
        joined = [b for b, c in enumerate(converted_at) if c is None]
        joined += [b for b, c in enumerate(converted_at) if c is not None]
        order = sorted(range(len(joined)), key=lambda i: joined[i])
        if order != list(range(len(order))):
            super().filter_rows(order)  # type: ignore[misc]
        if left_pad is not None and len(left_pad):
            self._place_pads(list(left_pad))

    @property
    def state(self) -> tuple[Any, ...]:
        """The §0.6 form (``kvrows.forms``, form 2): each stage's rows' planes in one column
        frame, the geometry's and arrangement's fields, the target's codec tail, then the
        modifier record: ``start``, ``converted_at`` (``DELAYED_PLAIN`` for a row in stage
        0), ``left_pad`` (full attention; empty for rings), ``prefilling``, ``composed``
        (rows extract as legos)."""
        self._spec_guard("reading state")
        full_attention = not self._token_geometry.wraps
        record: dict[str, Any] = {
            "start": self.start,
            "converted_at": list(self.converted_at),
            "left_pad": list(self.left_pad) if full_attention else [],
            "prefilling": self.prefilling,
            "composed": self._compose is not None,
        }
        parameters = spec_fields(self.quantization, self._token_geometry)
        return delayed_state(
            self.composition, self._group_states(), record, parameters, self._positions
        )

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
        them (``kvrows.forms_v1.parse_delayed``: form 2, or a file's form 1), the rows
        placed at the record's columns; built from legos, its rows extract as legos
        again."""
        if meta_state is not None:
            raise InvalidInputError(f"{cls.__name__} has no two-part (meta_state) form")
        parts = parse_delayed(cls.composition, state, keep=keep)
        plain_state, affine_state = parts.stage_states
        plain = cls.plain_group_class.from_state(plain_state, keep=parts.keep, geometry=geometry)
        # A TurboQuant state's planes do not record the activation dtype (its scales are
        # float16 whatever it is): the plain rows, when there are any, say it.
        affine = cls.affine_group_class.from_state(
            affine_state, keep=parts.keep, geometry=geometry or plain.geometry
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
        if shapes[0][0] != self.batch_size or shapes[1][0] != self.batch_size:
            raise InvalidInputError(
                f"the block has {shapes[0][0]} rows, the layout {self.batch_size}"
            )
        self._check_convertible(keys, values)

    def _append_read(self, keys: Any, values: Any, phase: Phase) -> tuple[Any, Any]:
        """Append a block to every row. All plain or all converted: the read of that
        codec. Mixed (inside :func:`row_reads`): each stage's rows and their reads come back
        as a pending pair (outside one: ``MixedPrecisionReadError``, nothing changed)."""
        self._spec_usable()
        if not self.batch_size:
            raise LayoutStateError(EMPTY_LAYOUT_UPDATE)
        self._check_block(keys, values)
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
            return reads

        return self._spec_append(append)

    @property
    def needs_row_attention(self) -> bool:
        """Always: mixed rows attend stage by stage (``attend_rows``) inside
        ``kvrows.app.attention.row_attention``."""
        return True

    @property
    def reads_pending(self) -> bool:
        """Whether the last append returned a pending pair (mixed rows)."""
        return self._pending is not None

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

    # -- prefill maintenance -----------------------------------------------------------------
    def begin_prefill(self) -> None:
        """Appends past a row's boundary convert nothing until ``commit_prefill`` /
        ``end_prefill``."""
        self._spec_guard("begin_prefill")
        self._conversion.begin_prefill()

    def commit_prefill(self, indices: Sequence[int]) -> None:
        """Convert the listed rows now if due (each at its own planned chunk end)."""
        self._spec_guard("commit_prefill")
        all_or_nothing(  # the record changes first: a failed conversion puts it back (§9)
            self,
            lambda: self._convert(self._conversion.commit_prefill(indices, self.row_offsets)),
            copied=("_conversion",),
        )

    def end_prefill(self) -> None:
        """Back to converting at every boundary; due rows convert now."""
        self._spec_guard("end_prefill")
        all_or_nothing(  # the record leaves the prefill first: a failed conversion puts it back
            self,
            lambda: self._convert(self._conversion.end_prefill(self.row_offsets)),
            copied=("_conversion",),
        )

    # -- rounds --------------------------------------------------------------------------------
    def _spec_forget(self, counts: Sequence[int]) -> None:
        """A rollback's or a discard's trim, after the last read is dropped: views of the
        planes held there would make the trim's in-place clear copy every plane (the
        whole batch, every round)."""
        self._forget_reads()
        super()._spec_forget(counts)

    def spec_round_commit(self) -> None:
        close = super().spec_round_commit
        self._close_round(close)

    def spec_round_rollback(self, keep: int | Sequence[int]) -> None:
        close = super().spec_round_rollback
        self._close_round(lambda: close(keep))

    def _close_round(self, close: Callable[[], None]) -> None:
        """Close the round (``close``: commit or rollback), then convert the rows now due,
        all or nothing (contract §9, speculative.md §4): a fault in that conversion puts
        the close back too (the round open, its block whole), so the caller may retry.
        Only a close a conversion follows keeps what the planes held (the rollback's
        in-place clear then copies once); without one, a fault in the rollback itself
        invalidates the layout, as on every verify layout."""
        # Rows only shrink in a close: none due now, none due after it.
        if not self._conversion.due(self._record_offsets()):
            close()
            return

        def close_convert() -> None:
            close()
            self._convert_due()

        all_or_nothing(self, close_convert, copied=("_conversion",), held=True)

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
            # The lego's one-row record stands for each of its rows (they move together).
            return list(lego._conversion.converted_at) * len(_row_counts(lego))
        spec = getattr(source, "codec_spec", None)
        if spec not in (_PLAIN, q):
            return None
        counts = _row_counts(source)
        if spec == _PLAIN:
            return [None] * len(counts)
        return [self._conversion.point(c) for c in counts]

    # The machinery's merge (``merge_rows``: argument, self-merge and compatibility checks,
    # then ``_join``) asks these two of each source.
    def _accepts(self, source: object) -> bool:
        record = self._source_record(source)
        if record is None or not super()._accepts(source):  # type: ignore[misc]
            return False
        if self._records is not None:  # a merge's plan: ``_join`` takes it from here
            self._records[id(source)] = record
        return True

    #: During ``merge_rows``: each accepted source's record, worked out once (by
    #: ``_accepts``) for ``_join``; ``None`` outside a merge.
    _records: dict[int, list[int | None]] | None = None

    def merge_rows(self, rows: Sequence[Any]) -> None:
        self._records = {}
        try:
            super().merge_rows(rows)  # type: ignore[misc]
        finally:
            self._records = None

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

    _restoring = False  # ``_hold_groups``: the machinery's join only

    def _join(self, sources: Sequence[Any], *args: Any) -> None:
        if self._restoring:
            super()._join(sources, *args)  # type: ignore[misc]
            return
        known = self._records or {}
        records = [known.get(id(s)) or self._source_record(s) or [] for s in sources]
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
