"""The bf16-first conversion record: the delayed modifier's int-only state machine.

Rows under the delayed modifier (contract §0.5) stay plain until their own offset reaches
``start``, then convert to the ``target`` codec once and for good. :class:`Conversion` is
all a storage keeps of that, in ints and bools, with the rule written once
(``spec/bf16-first.md``, ``spec/DelayedQuantizedKVCache.md``,
``spec/EncodedLatentCache.md``): a plain row is due when ``conversion_due(offset,
start)``; rows convert at boundaries only (after an append, a merge, a round's end,
``end_prefill``, the rows ``commit_prefill`` names), never inside a round or a prefill;
no trim un-converts a row. The array work (moving a row into the target codec) is each
storage's. The mixed-read scope (:func:`row_reads`) and its handle
(:class:`RowAttentionPending`) live here too: a read over rows of both stages is the
modifier's, and so do the modifier's constructor arguments (its ``target`` and ``start``,
:func:`delayed_arguments`, the same for a serial storage and a layout).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal, TypeAlias

from kvrows.codec import CodecSpec
from kvrows.codecs import is_codec_spec
from kvrows.compositions import (
    Composition,
    codec_spec_for,
    geometry_spec_for,
    parameter_defaults,
)
from kvrows.errors import InvalidInputError, MixedPrecisionReadError, RowIndexError
from kvrows.geometries import GeometrySpec
from kvrows.validation import as_count

__all__ = [
    "MIXED_READ",
    "Conversion",
    "Phase",
    "RowAttentionPending",
    "Target",
    "check_target",
    "check_target_dims",
    "conversion_due",
    "delayed_arguments",
    "mixed_buffer_message",
    "row_reads",
    "row_reads_active",
]

Phase: TypeAlias = Literal["empty", "plain", "mixed", "packed"]

#: What a plain read of mixed rows raises (the seed's words).
MIXED_READ = (
    "mixed precision rows use their attention state: this read needs raw keys and values "
    "of one precision (open kvrows.delayed.row_reads(), or kvrows.app.attention.row_attention "
    "for an mlx-lm model, so each row attends with its own codec)"
)


def mixed_buffer_message(what: str) -> str:
    """mlx-lm's ``keys`` / ``values`` asked of mixed rows (there is no one buffer)."""
    return f"{MIXED_READ}; .{what} has no one buffer while rows are mixed"


def conversion_due(offset: int, start: int) -> bool:
    """Whether a plain row holding ``offset`` tokens after an append converts now: at or
    past ``start``, and never while empty (the first append is always plain)."""
    return offset >= start and offset != 0


#: The codec a bf16-first row converts to: any that encodes (``CodecSpec.encodes``).
Target: TypeAlias = CodecSpec


def check_target_dims(key_dim: int, value_dim: int, target: Target) -> None:
    """Refuse head dims ``target`` cannot store (affine: a group size that divides them;
    TurboQuant: its head dims), naming the side."""
    for side, dim in (("key", key_dim), ("value", value_dim)):
        try:
            target.check_head_dim(dim)
        except InvalidInputError as error:
            raise InvalidInputError(
                f"{side} head dim {dim} cannot be converted to {target.name}: {error}"
            ) from None


def check_target(name: str, target: object, token_geometry: GeometrySpec) -> Target:
    """``target`` as a conversion codec of ``token_geometry`` (TurboQuant is full attention
    only: sliding layers stay plain rings under it)."""
    if not is_codec_spec(target) or not target.encodes:
        raise InvalidInputError(f"{name} converts to an affine or TurboQuant codec, got {target!r}")
    target.check_token_geometry(name, token_geometry)
    return target


class Conversion:
    """The conversion record of a storage's rows (see the module docstring).

    Per row, ``converted_at``: ``None`` while plain (stage 0); else the offset at
    conversion (stage 1; 0 with ``start == 0``; a row that joins converted records its
    own bound). ``target`` is the codec rows convert to; a target that does not encode
    (``Plain()``: ``MLACache``) never converts a row.
    """

    __slots__ = ("_converted_at", "_prefilling", "_reads_quantized", "start", "target")

    def __init__(
        self,
        target: CodecSpec,
        start: int,
        converted_at: Iterable[int | None] = (),
        *,
        prefilling: bool = False,
    ) -> None:
        self.target = target
        self.start = start
        self._converted_at: list[int | None] = list(converted_at)
        self._prefilling = prefilling
        #: Whether the last append returned quantized reads (``bits`` shows then).
        self._reads_quantized = False

    # -- the record ------------------------------------------------------------------------
    @property
    def converted_at(self) -> tuple[int | None, ...]:
        return tuple(self._converted_at)

    @property
    def converted(self) -> tuple[bool, ...]:
        return tuple(c is not None for c in self._converted_at)

    @property
    def batch_size(self) -> int:
        return len(self._converted_at)

    @property
    def phase(self) -> Phase:
        """``empty``; ``plain`` (no row converted); ``mixed``; ``packed`` (every row)."""
        if not self._converted_at:
            return "empty"
        converted = sum(c is not None for c in self._converted_at)
        if converted == 0:
            return "plain"
        return "packed" if converted == len(self._converted_at) else "mixed"

    @property
    def prefilling(self) -> bool:
        return self._prefilling

    def point(self, offset: int) -> int:
        """What a row converting (or joining converted) at ``offset`` records."""
        return offset if self.start > 0 else 0

    @property
    def minimum_reusable_offset(self) -> int:
        """The largest conversion offset of any row (a prefix below it was plain in some
        row: reusing it would skip that row's conversion); 0 without one."""
        return max((c or 0 for c in self._converted_at), default=0)

    def max_append_tokens(self, offsets: Sequence[int]) -> float:
        """Tokens the next append may add without passing any plain row's ``start``."""
        limits = [
            self.start - offset
            for offset, at in zip(offsets, self._converted_at, strict=True)
            if at is None and offset < self.start
        ]
        return min(limits, default=math.inf)

    # -- the boundaries ----------------------------------------------------------------------
    def due(self, offsets: Sequence[int], *, round_open: bool = False) -> list[int]:
        """The rows to convert at this boundary (rows at ``offsets``): every plain row at or
        past ``start``; none inside a round or while prefilling."""
        if self._prefilling or round_open:
            return []
        return self._due_among(range(len(self._converted_at)), offsets)

    def _due_among(self, rows: Iterable[int], offsets: Sequence[int]) -> list[int]:
        return [b for b in rows if self._converted_at[b] is None and self.row_due(offsets[b])]

    def row_due(self, offset: int) -> bool:
        """Whether a plain row holding ``offset`` tokens converts at a boundary."""
        return self.target.encodes and conversion_due(offset, self.start)

    def mark(self, rows: Sequence[int], offsets: Sequence[int]) -> None:
        """Record ``rows`` (converted just now, at ``offsets``) as converted."""
        for b in rows:
            self._converted_at[b] = self.point(offsets[b])

    def begin_prefill(self) -> None:
        """Appends past a row's boundary convert nothing until ``commit_prefill`` /
        ``end_prefill``."""
        self._prefilling = True

    def commit_prefill(self, indices: Sequence[int], offsets: Sequence[int]) -> list[int]:
        """The listed rows that are due (each at its own planned chunk end), sorted; bad
        indices raise (``RowIndexError``) and change nothing."""
        if isinstance(indices, str | bytes) or not isinstance(indices, Sequence):
            raise InvalidInputError(f"commit_prefill takes a sequence of rows, got {indices!r}")
        rows: list[int] = []
        for value in indices:
            if isinstance(value, bool) or not hasattr(value, "__index__"):
                raise RowIndexError(f"rows must be integers, got {value!r}")
            row = operator.index(value)
            if not 0 <= row < self.batch_size:
                raise RowIndexError(f"row {row} is outside 0..{self.batch_size - 1}")
            if row in rows:
                raise RowIndexError(f"row {row} is listed twice")
            rows.append(row)
        return self._due_among(sorted(rows), offsets)

    def end_prefill(self, offsets: Sequence[int]) -> list[int]:
        """Back to converting at every boundary: the rows due now."""
        self._prefilling = False
        return self.due(offsets)

    # -- the rows ------------------------------------------------------------------------------
    def join(self, converted_at: Iterable[int | None]) -> None:
        """Rows joining at the end, with their records."""
        self._converted_at.extend(converted_at)

    def keep(self, order: Sequence[int]) -> None:
        """Keep rows ``order`` (checked by the caller: any subset, any order)."""
        self._converted_at = [self._converted_at[b] for b in order]

    def extract(self, row: int) -> Conversion:
        """Row ``row``'s record alone (same target and ``start``, not prefilling)."""
        return Conversion(self.target, self.start, [self._converted_at[row]])

    # -- stages (0: plain, 1: converted) --------------------------------------------------------
    def stage(self, row: int) -> int:
        return int(self._converted_at[row] is not None)

    def members(self, stage: int) -> list[int]:
        """The rows of ``stage``, in batch order."""
        return [b for b, c in enumerate(self._converted_at) if (c is not None) == bool(stage)]

    def slots(self) -> list[int]:
        """Each row's rank among the rows of its stage (one pass)."""
        seen = [0, 0]
        slots = []
        for at in self._converted_at:
            stage = int(at is not None)
            slots.append(seen[stage])
            seen[stage] += 1
        return slots

    def in_batch_order(self, per_stage: Sequence[Sequence[int]]) -> tuple[int, ...]:
        """A per-row quantity given per stage (in each stage's row order), in batch order."""
        return tuple(
            per_stage[int(at is not None)][slot]
            for at, slot in zip(self._converted_at, self.slots(), strict=True)
        )

    # -- what mlx-lm's attention sees ------------------------------------------------------------
    def note_read(self, quantized: bool) -> None:
        """The last append returned quantized reads (or plain ones)."""
        self._reads_quantized = quantized

    def read_parameter(self, owner: str, what: str) -> int:
        """``bits`` / ``group_size`` of an affine target while the last append returned
        quantized reads; else ``AttributeError`` (``hasattr`` answers ``False``)."""
        parameters = self.target.parameters()
        if what not in parameters:  # only mlx-lm's quantized path asks
            raise AttributeError(
                f"{owner} converts to {self.target.name}: {what} is an affine parameter "
                "(TurboQuant reads attend through the codec)"
            )
        if not self._reads_quantized:
            raise AttributeError(
                f"{owner} reads plain keys and values now ({what} appears once an append "
                "returns quantized ones)"
            )
        return int(parameters[what])

    def __repr__(self) -> str:
        return (
            f"Conversion({self.target.name}, start={self.start}, "
            f"converted_at={self.converted_at}, prefilling={self._prefilling})"
        )


# -- mixed reads --------------------------------------------------------------------------------
_ROW_READS: ContextVar[int] = ContextVar("kvrows_row_reads", default=0)


@contextmanager
def row_reads() -> Iterator[None]:
    """Inside, a delayed layout with mixed rows answers ``update_and_fetch`` with a
    :class:`RowAttentionPending` pair, whose attention ``attend_rows`` computes (the
    caller promises to attend through it). Nests."""
    token = _ROW_READS.set(_ROW_READS.get() + 1)
    try:
        yield
    finally:
        _ROW_READS.reset(token)


def row_reads_active() -> bool:
    return _ROW_READS.get() > 0


class RowAttentionPending:
    """What a mixed read returns as both keys and values: a handle, not arrays. Its
    attention is ``layout.attend_rows(queries, scale, ...)``; anything else a model does
    with it (reshape, index, ...) fails loudly instead of computing something else."""

    __slots__ = ("_generation", "_layout")

    def __init__(self, layout: Any, generation: int) -> None:
        object.__setattr__(self, "_layout", layout)
        object.__setattr__(self, "_generation", generation)

    @property
    def layout(self) -> Any:
        """The layout whose ``attend_rows`` computes this read's attention."""
        return object.__getattribute__(self, "_layout")

    @property
    def generation(self) -> int:
        generation: int = object.__getattribute__(self, "_generation")
        return generation

    def __getattr__(self, name: str) -> Any:
        raise MixedPrecisionReadError(
            f"{MIXED_READ}; this model read .{name} of the pending pair itself"
        )

    def __repr__(self) -> str:
        return f"RowAttentionPending({type(self.layout).__name__}, read {self.generation})"


# -- the modifier's constructor arguments ------------------------------------------------
def delayed_arguments(
    name: str, entry: Composition, args: tuple[object, ...], kwargs: dict[str, object]
) -> tuple[CodecSpec, GeometrySpec, int]:
    """A delayed storage's constructor arguments (a lego's, a delayed layout's: the
    converted class's positional order, then ``start``) as its target codec spec, token
    geometry and ``start``: the specs of table ``entry``'s codec and geometry kinds, each
    parameter not given its spec's default; a refused argument names the class ``name``."""
    params = entry.params
    defaults = {**parameter_defaults(entry), "start": 0}
    if len(args) > len(params):
        raise TypeError(f"{name} takes at most {len(params)} positional arguments")
    values = dict(zip(params, args, strict=False))
    for key, value in kwargs.items():
        if key not in params or key in values:
            raise TypeError(f"{name} got an unexpected or repeated argument {key!r}")
        values[key] = value
    for key in params:
        if key not in values:
            if key not in defaults:
                raise TypeError(f"{name} is missing its {key} argument")
            values[key] = defaults[key]
    with _naming(name):
        numbers = {key: _int(values[key], key, name) for key in params if key != "start"}
        spec, geometry = codec_spec_for(entry, numbers), geometry_spec_for(entry, numbers)
        spec.check_token_geometry(name, geometry)
        return spec, geometry, as_count(values["start"], "start")


@contextmanager
def _naming(name: str) -> Iterator[None]:
    """A refused constructor argument's message starts with the class's name."""
    try:
        yield
    except InvalidInputError as error:
        message = str(error)
        if message.startswith(f"{name}:"):
            raise
        raise InvalidInputError(f"{name}: {message}") from None


def _int(value: object, what: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"{name}: {what} must be an integer, got {value!r}")
    return value
