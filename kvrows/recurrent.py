"""Recurrent (SSM) state: ``SSMCache`` and ``BatchedSSMCache``, array-free.

A recurrent layer keeps ``N`` planes per row (``state.0`` … ``state.{N-1}``, each
``[B, *row_shape]`` of any rank) and no token axis: gated DeltaNet (Qwen3-Next) and
Mamba2 a conv window ``[B, K-1, C]`` and the running state; lfm2 a conv window only;
rwkv7 two token shifts and a state; kimi_linear three conv windows and a state;
baichuan_m1 the last key and value. The *layer* computes the planes and hands them to
the cache (mlx-lm's ``ArraysCache(size=N)`` protocol: ``cache[i] = plane``,
``cache.advance(S)``); the cache counts each row's tokens (``row_offsets``), moves rows
(merge concatenates, filter takes, extract copies one row), and masks padded batches
(``prepare`` / ``make_mask`` / ``lengths``, or ``left_padding`` at construction).

Nothing can be cut from a recurrent row: it is not trimmable, and a row is published only
at exactly the coverage it holds. A verify round rolls back by **snapshot and replay**:
``spec_round_begin`` keeps the planes (arrays are never written in place, so keeping them
is free), the layer records the verify forward's per-position inputs and a replay
callable (``spec_round_record``), and ``spec_round_rollback(keep)`` restores the snapshot
and replays the first ``keep[b]`` tokens of row ``b`` through the layer, with a mask
hiding the rest: the round is ``kvrows.speculative.SpeculativeRounds`` itself, over the
snapshot + replay hooks :class:`RecurrentLayout` supplies. See ``spec/SSMCache.md`` and
``spec/BatchedSSMCache.md``.

:class:`RecurrentRows` is the row bookkeeping the row machinery will take over
(``spec/machinery-migration.md`` §4.1): rows, offsets, merge / filter / extract, saved
state, over a handful of array hooks each implementation supplies
(``kvrows.reference.recurrent``, ``kvrows.optimized.recurrent``), and the checks of
mlx-lm's ``ArraysCache`` surface, which each implementation writes itself
(``ArraysCacheSurface`` in ``kvrows.{reference,optimized}.recurrent_surface``). The specs
are ``State`` / ``StateShapes`` (``kvrows.codecs.state``) and ``Recurrent`` /
``valid_counts`` / ``Replay`` (``kvrows.geometries.recurrent``), re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeVar

from kvrows.codec import PlaneSpec
from kvrows.codecs.state import DEFAULT_PLANES, PlaneShape, State, StateShapes
from kvrows.compositions import Composition
from kvrows.errors import (
    EMPTY_LAYOUT_UPDATE,
    IncompatibleRowsError,
    InvalidInputError,
    LayoutStateError,
    NotTrimmableError,
    self_merge_message,
)
from kvrows.geometries.recurrent import Recurrent, Replay, valid_counts
from kvrows.speculative import SpeculativeRounds
from kvrows.validation import FLOAT_DTYPES, as_count, check_keep, check_row

__all__ = [
    "CONV",
    "RECURRENT",
    "Recurrent",
    "RecurrentLayout",
    "RecurrentRows",
    "Replay",
    "State",
    "StateShapes",
    "valid_counts",
]

#: Plane indices of a gated DeltaNet / Mamba2 layer (mlx-lm's ``ArraysCache(2)`` order).
CONV = 0
RECURRENT = 1

#: Per plane: (per-row shape, dtype name) once known.
_PlaneKind = PlaneShape

_R = TypeVar("_R")


class RecurrentRows:
    """Recurrent state of one layer for one request (serial) or several (a layout).

    The implementation supplies the array hooks (``_is_native`` … ``_bool_array``) and
    ``_serial_class`` / ``_layout_class``; everything else is here.
    """

    composition: ClassVar[Composition]
    #: Whether the class is a row layout (``BatchedSSMCache``) or serial (``SSMCache``).
    is_layout: ClassVar[bool]
    #: The array type the implementation takes (for messages).
    array_name: ClassVar[str]

    _planes: list[Any]
    _kinds: list[_PlaneKind | None]
    _offsets: list[int]
    _serial_rows: int
    _lengths: list[int] | None
    _left: list[int] | None
    #: mlx-lm's ``ArraysCache.merge`` of caches that are all empty sets ``left_padding`` to
    #: zeros, kept (only ever <= 0) until ``finalize``: its ``make_mask`` then answers an
    #: all-true ``[B, n]`` array where it otherwise answers ``None``; so does the drop-in.
    _mask_every_row: bool = False

    # -- array hooks ----------------------------------------------------------------------
    @staticmethod
    def _is_native(value: object) -> bool:
        raise NotImplementedError

    @staticmethod
    def _shape(value: Any) -> tuple[int, ...]:
        raise NotImplementedError

    @staticmethod
    def _dtype(value: Any) -> str:
        raise NotImplementedError

    @staticmethod
    def _concat(parts: list[Any]) -> Any:
        """An owned array: ``parts`` concatenated along the row axis."""
        raise NotImplementedError

    @staticmethod
    def _take(value: Any, rows: list[int]) -> Any:
        """An owned array of the rows ``rows`` of ``value``."""
        raise NotImplementedError

    @staticmethod
    def _zeros(shape: tuple[int, ...], dtype: str) -> Any:
        raise NotImplementedError

    @staticmethod
    def _int_array(values: list[int]) -> Any:
        raise NotImplementedError

    @staticmethod
    def _ints_of(value: Any) -> list[int]:
        """A native int vector as Python ints."""
        raise NotImplementedError

    @classmethod
    def _serial_class(cls) -> type[RecurrentRows]:
        raise NotImplementedError

    @classmethod
    def _layout_class(cls) -> type[RecurrentRows]:
        raise NotImplementedError

    # -- rounds (the layout's ``SpeculativeRounds`` overrides these) ----------------------
    def _spec_guard(self, what: str) -> None:
        """Refuse a row operation in the middle of a round (serial: nothing to refuse)."""

    def _spec_usable(self) -> None:
        """Refuse everything on an invalidated layout (serial: never invalid)."""

    def _spec_append(self, append: Callable[[], _R]) -> _R:
        return append()

    def _spec_write(self) -> None:
        """Refuse a plane write the round cannot take (serial: always takes it)."""

    # -- construction ---------------------------------------------------------------------
    def __init__(
        self,
        size: int | None = None,
        left_padding: Sequence[int] | None = None,
        *,
        geometry: StateShapes | None = None,
    ) -> None:
        """mlx-lm's ``ArraysCache(size, left_padding=None)``: ``size`` planes (else the
        ``geometry``'s count, else two); ``left_padding`` (a layout's) makes one row per
        count, at offset 0, whose first ``left_padding[b]`` positions are padding."""
        name = self.composition.name
        if geometry is not None and not isinstance(geometry, StateShapes):
            raise InvalidInputError(
                f"geometry must be a StateShapes, got {type(geometry).__name__}"
            )
        if size is not None:
            size = as_count(size, "size", minimum=1)
            if geometry is not None and len(geometry.planes) != size:
                raise InvalidInputError(
                    f"{name}(size={size}) cannot take a geometry of {len(geometry.planes)} planes"
                )
        count = len(geometry.planes) if geometry is not None else size or DEFAULT_PLANES
        self._planes = [None] * count
        self._kinds = [None] * count if geometry is None else list(geometry.planes)
        self._offsets = [] if self.is_layout else [0]
        self._serial_rows = 1
        self._lengths = self._left = None
        if left_padding is None:
            return
        if hasattr(left_padding, "tolist") and not isinstance(left_padding, Sequence):
            left_padding = left_padding.tolist()
        if isinstance(left_padding, str | bytes) or not isinstance(left_padding, Sequence):
            raise InvalidInputError(f"left_padding must be one count per row, got {left_padding!r}")
        if not left_padding:  # mlx-lm's ArraysCache takes an empty list as no padding
            return
        if not self.is_layout:
            raise InvalidInputError(
                f"{name} holds one request: left_padding is a layout's "
                "(BatchedSSMCache(size, left_padding=...))"
            )
        pads = [as_count(v, f"left_padding[{b}]") for b, v in enumerate(left_padding)]
        self._offsets = [0] * len(pads)
        self._left = pads

    @classmethod
    def from_specs(
        cls,
        codec_spec: object,
        token_geometry: object,
        *,
        geometry: StateShapes | None = None,
    ) -> Self:
        """An empty instance (the row-layout table's role factories)."""
        if codec_spec != State() or token_geometry != Recurrent():
            raise InvalidInputError(
                f"{cls.composition.name} is built from State() and Recurrent(), got "
                f"{codec_spec!r} and {token_geometry!r}"
            )
        return cls(geometry=geometry)

    def _spawn_like(self, cls: type[RecurrentRows]) -> Any:
        fresh = cls(len(self._planes))
        fresh._kinds = list(self._kinds)
        return fresh

    # -- identity -------------------------------------------------------------------------
    @property
    def codec_spec(self) -> State:
        return State()

    @property
    def codec(self) -> State:
        return State()

    @property
    def token_geometry(self) -> Recurrent:
        return Recurrent()

    @property
    def geometry(self) -> StateShapes | None:
        """The planes' per-row shapes and dtypes, once declared or learnt from every plane."""
        kinds = self._kinds
        if any(kind is None for kind in kinds):
            return None
        return StateShapes(planes=tuple(kind for kind in kinds if kind is not None))

    def signature(self) -> str:
        return self.composition.signature

    def plane_specs(self) -> tuple[PlaneSpec, ...]:
        g = self.geometry
        return () if g is None else g.plane_specs()

    # -- sizes and positions --------------------------------------------------------------
    @property
    def _rows(self) -> int:
        return len(self._offsets) if self.is_layout else self._serial_rows

    def _row_offsets(self) -> tuple[int, ...]:
        if self.is_layout:
            return tuple(self._offsets)
        return (self._offsets[0],) * self._serial_rows

    @property
    def offset(self) -> Any:
        """Serial: tokens seen. Layout: per-row positions (an int array, the contract's
        convention; ``group_offset`` is the longest row's)."""
        if self.is_layout:
            return self._int_array(list(self._offsets))
        return self._offsets[0]

    @property
    def group_offset(self) -> int:
        """The longest row's coverage (0 without rows)."""
        return max(self._offsets, default=0)

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self._planes if p is not None)

    def held_arrays(self) -> tuple[Any, ...]:
        return tuple(p for p in self._planes if p is not None)

    @property
    def state_needs_dispose(self) -> bool:
        return False

    # -- mlx-lm's ArraysCache surface: each implementation's ArraysCacheSurface ----------
    # (cache, empty, size, __getitem__, __iter__, __setitem__, lengths, left_padding,
    # prepare, finalize, make_mask, advance); the checks they share are here.
    if TYPE_CHECKING:

        def empty(self) -> bool: ...

    def _plane_index(self, index: object) -> int:
        value = None if isinstance(index, bool) else getattr(index, "__index__", None)
        number = value() if callable(value) else None
        count = len(self._planes)
        if not isinstance(number, int) or not 0 <= number < count:
            raise InvalidInputError(
                f"this recurrent cache holds planes 0 to {count - 1} (ArraysCache(size={count})), "
                f"got index {index!r}"
            )
        return number

    def _check_plane(self, i: int, value: Any) -> _PlaneKind:
        name = f"state.{i}"
        if not self._is_native(value):
            raise InvalidInputError(
                f"the {name} plane must be a {self.array_name} array, got {type(value).__name__}"
            )
        if self.is_layout and not self._offsets:
            raise LayoutStateError("an empty layout takes no plane: merge rows into it first")
        shape = self._shape(value)
        dtype = self._dtype(value)
        if len(shape) < 2:
            raise InvalidInputError(
                f"the {name} plane must be [B, ...] (rank >= 2), got shape {shape}"
            )
        if dtype not in FLOAT_DTYPES:
            raise InvalidInputError(f"the {name} plane must be one of {FLOAT_DTYPES}, got {dtype}")
        if self._rows_fixed() and shape[0] != self._rows:
            raise InvalidInputError(
                f"the {name} plane must hold {self._rows} rows (one per row of the cache), "
                f"got {shape[0]}"
            )
        known = self._kinds[i]
        kind = (tuple(shape[1:]), dtype)
        if known is not None and known != kind:
            raise InvalidInputError(
                f"the {name} plane holds rows of shape {known[0]} {known[1]}, got {kind[0]} "
                f"{kind[1]}"
            )
        return kind

    def _rows_fixed(self) -> bool:
        """Whether the row count is settled (a layout's rows; a serial cache's once written)."""
        return self.is_layout or any(p is not None for p in self._planes)

    # -- the checks of a padded run and an advance (the surface applies them) -------------
    def _check_prepare(
        self, lengths: Sequence[int] | None, left_padding: Sequence[int] | None
    ) -> tuple[list[int] | None, list[int] | None]:
        """``prepare``'s arguments as one count per row each (``None``: not given)."""
        self._spec_guard("prepare")
        if not self.is_layout:
            raise InvalidInputError(
                f"{self.composition.name} holds one request: padded runs are a layout's "
                "(BatchedSSMCache)"
            )
        rows = self._rows
        parsed: list[list[int] | None] = []
        for name, values in (("lengths", lengths), ("left_padding", left_padding)):
            if values is None:
                parsed.append(None)
                continue
            if hasattr(values, "tolist") and not isinstance(values, Sequence):
                values = values.tolist()
            if isinstance(values, str | bytes) or not isinstance(values, Sequence):
                raise InvalidInputError(f"{name} must be one count per row, got {values!r}")
            if len(values) != rows:
                raise InvalidInputError(
                    f"{name} needs {rows} counts (one per row), got {len(values)}"
                )
            parsed.append([as_count(v, f"{name}[{b}]") for b, v in enumerate(values)])
        return parsed[0], parsed[1]

    def _check_advance(self, n: int) -> tuple[int, list[int]]:
        """``advance(n)``'s count and the real tokens each row gains
        (:func:`valid_counts` of the padded run)."""
        self._spec_usable()
        count = as_count(n, "n")
        rows = self._rows
        if self.is_layout and not rows:
            raise LayoutStateError(EMPTY_LAYOUT_UPDATE)
        gained = valid_counts(count, rows, self._lengths, self._left)
        if any(gained) and any(p is None for p in self._planes):
            raise LayoutStateError(
                f"advance before the layer wrote every plane: write cache[0] to "
                f"cache[{len(self._planes) - 1}] first"
            )
        if not self.is_layout and len(set(gained)) > 1:
            raise InvalidInputError("a serial recurrent cache advances every row alike")
        return count, gained

    # -- token operations do not apply ----------------------------------------------------
    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        raise InvalidInputError(
            f"{self.composition.name} holds recurrent state, written by the layer "
            "(cache[i] = plane, advance(n)): it takes no keys and values"
        )

    def fetch(self) -> tuple[Any, Any]:
        raise LayoutStateError(
            f"{self.composition.name} holds recurrent state, not keys and values: read "
            "its planes cache[0], cache[1], …"
        )

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        """Recurrent state cannot forget tokens (a rollback replays instead): ``trim(0)``
        returns 0, any other count raises ``NotTrimmableError``."""
        self._spec_guard("trim (use spec_round_rollback)")
        if as_count(n, "n") == 0:
            return 0
        raise NotTrimmableError(
            f"{self.composition.name} is not trimmable: recurrent state is a running summary "
            "of every token (roll back a verify round with spec_round_rollback)"
        )

    # -- row operations -------------------------------------------------------------------
    @classmethod
    def merge(cls, caches: Sequence[Any]) -> Any:
        """mlx-lm's ``merge``: a new ``BatchedSSMCache`` holding ``caches``' rows."""
        if isinstance(caches, str | bytes) or not isinstance(caches, Sequence) or not caches:
            raise InvalidInputError("merge takes a non-empty sequence of caches")
        first = caches[0]
        if not isinstance(first, RecurrentRows):
            raise IncompatibleRowsError(f"merge takes recurrent caches, got {type(first).__name__}")
        layout = first._spawn_like(cls._layout_class())
        layout.merge_rows(caches)
        layout._mask_every_row = all(c.empty() for c in caches)
        return layout

    # -- saved state: (state.0, …, state.{N-1}, offset) ------------------------------------
    @property
    def state(self) -> tuple[Any, ...]:
        """``(state.0, …, state.{N-1}, offset)``: offset an int (serial) or one per row
        (layout). Two planes are version 1's ``(conv, recurrent, offset)``, unchanged."""
        self._spec_guard("state")
        offset = self._int_array(list(self._offsets)) if self.is_layout else self._offsets[0]
        return (*self._planes, offset)

    @state.setter
    def state(self, value: Any) -> None:
        self._spec_guard("restoring state")
        fresh = type(self).from_state(value)
        self.__dict__.clear()
        self.__dict__.update(fresh.__dict__)

    @classmethod
    def from_state(
        cls,
        state: Any,
        meta_state: Any = None,
        *,
        geometry: StateShapes | None = None,
        **_: Any,
    ) -> Self:
        """A new cache holding ``state`` (refused, changing nothing, when it does not fit);
        ``geometry`` declares the planes of a state that holds none (a file's record)."""
        name = cls.composition.name
        if isinstance(state, str | bytes) or not isinstance(state, Sequence) or len(state) < 2:
            raise InvalidInputError(
                f"{name} state must be (state.0, …, state.{{N-1}}, offset), N >= 1, got {state!r}"
            )
        planes, offset = list(state[:-1]), state[-1]
        if geometry is not None and len(geometry.planes) != len(planes):
            raise InvalidInputError(
                f"{name} state holds {len(planes)} planes, the declared geometry "
                f"{len(geometry.planes)} ({geometry.describe()})"
            )
        fresh = cls(len(planes), geometry=geometry)
        if cls.is_layout:
            if hasattr(offset, "tolist"):
                offset = fresh._ints_of(offset)
            if isinstance(offset, str | bytes) or not isinstance(offset, Sequence):
                raise InvalidInputError(f"{name} state offset must be one count per row")
            offsets = [as_count(v, f"offset[{b}]") for b, v in enumerate(offset)]
        else:
            if hasattr(offset, "item") and not isinstance(offset, int):
                offset = offset.item()
            offsets = [as_count(offset, "offset")]
        if len({p is None for p in planes}) > 1:
            raise InvalidInputError(f"{name} state: the planes must all be set or all None")
        if planes[0] is None:
            if any(offsets):
                raise InvalidInputError(f"{name} state: rows with tokens need their planes")
            fresh._offsets = offsets
            return fresh
        kinds = [fresh._check_free(i, p) for i, p in enumerate(planes)]
        if geometry is not None and kinds != fresh._kinds:
            raise InvalidInputError(
                f"{name} state: planes {kinds} do not match the declared {geometry.describe()}"
            )
        rows = {fresh._shape(p)[0] for p in planes}
        if len(rows) != 1 or (cls.is_layout and rows != {len(offsets)}):
            raise InvalidInputError(
                f"{name} state: the planes and offsets disagree on the rows ({sorted(rows)} "
                f"planes, {len(offsets)} offsets)"
            )
        fresh._planes = planes
        fresh._kinds = list(kinds)
        fresh._offsets = offsets
        fresh._serial_rows = rows.pop()
        return fresh

    def _check_free(self, i: int, value: Any) -> _PlaneKind:
        """A plane's checks without the row count (a state sets the rows)."""
        name = f"state.{i}"
        if not self._is_native(value):
            raise InvalidInputError(
                f"the {name} plane must be a {self.array_name} array, got {type(value).__name__}"
            )
        shape, dtype = self._shape(value), self._dtype(value)
        if len(shape) < 2 or dtype not in FLOAT_DTYPES:
            raise InvalidInputError(
                f"the {name} plane must be [B, ...] (rank >= 2) of one of {FLOAT_DTYPES}, "
                f"got {shape} {dtype}"
            )
        return (tuple(shape[1:]), dtype)

    # -- invariants -----------------------------------------------------------------------
    def check_valid(self) -> None:
        """Every plane or none, one row count, the known kinds, no negative offset."""
        if len({p is None for p in self._planes}) > 1:
            raise LayoutStateError("some planes written, others not")
        if len(self._kinds) != len(self._planes):
            raise LayoutStateError(f"{len(self._kinds)} plane kinds for {len(self._planes)} planes")
        if any(o < 0 for o in self._offsets):
            raise LayoutStateError(f"negative offsets {self._offsets}")
        for i, plane in enumerate(self._planes):
            if plane is None:
                continue
            shape = self._shape(plane)
            if shape[0] != self._rows:
                raise LayoutStateError(f"plane {i} holds {shape[0]} rows, the cache {self._rows}")
            if self._kinds[i] != (tuple(shape[1:]), self._dtype(plane)):
                raise LayoutStateError(f"plane {i} does not match its recorded kind")
        if self._planes[0] is None and any(self._offsets):
            raise LayoutStateError("rows with tokens but no planes")


class RecurrentLayout(SpeculativeRounds, RecurrentRows):
    """The row-layout members (``BatchableCache``) of ``BatchedSSMCache``, with the
    ``speculative`` modifier's verify rounds by snapshot and replay.

    ``spec_round_begin`` keeps the planes and positions (``_spec_snapshot``); the layer's
    verify forward records its per-position inputs and a replay (``spec_round_record``)
    and writes the block; ``spec_round_rollback(keep)`` restores the snapshot and replays
    the first ``keep[b]`` tokens of each row through the layer with the rest masked, so
    each row's state is the one a run that saw only the accepted tokens computes.
    """

    @property
    def batch_size(self) -> int:
        return self._rows

    @property
    def row_offsets(self) -> tuple[int, ...]:
        return tuple(self._offsets)

    @property
    def left_pad(self) -> tuple[int, ...]:
        """No token axis, so nothing is ever padded on the left."""
        return (0,) * self._rows

    @property
    def max_tokens(self) -> float:
        return math.inf

    def projected_bytes(self, tokens: int) -> int:
        """Bytes a row needs: the state's, whatever ``tokens``."""
        as_count(tokens, "tokens")
        g = self.geometry
        if g is None:
            raise LayoutStateError(
                "projected_bytes needs the recurrent geometry: declare it at construction "
                "(geometry=StateShapes(...)) or let the layer write every plane first"
            )
        return g.row_bytes()

    def make_empty_batch(self) -> Any:
        """An empty ``BatchedSSMCache`` with this cache's geometry."""
        self._spec_usable()
        return self._spawn_like(self._layout_class())

    def merge_rows(self, rows: Sequence[Any]) -> None:
        """Join ``rows`` (recurrent caches of this implementation) after the rows held:
        planes concatenate along the row axis; a source without planes adds zero rows."""
        self._spec_guard("merge_rows")
        if isinstance(rows, str | bytes) or not isinstance(rows, Sequence) or not rows:
            raise InvalidInputError("merge_rows takes a non-empty sequence of caches")
        if any(s is self for s in rows) or len({id(s) for s in rows}) != len(rows):
            raise IncompatibleRowsError(self_merge_message(self.signature()))
        if self._lengths is not None or self._left is not None:
            raise LayoutStateError("merge_rows during a padded run: finalize() it first")
        sources: list[RecurrentRows] = []
        for source in rows:
            if not isinstance(source, RecurrentRows) or source.array_name != self.array_name:
                raise IncompatibleRowsError(
                    f"{self.composition.name} merges recurrent caches of the same implementation "
                    f"({self.array_name} arrays), got {type(source).__name__}"
                )
            source._spec_guard("merging this layout's rows into another")
            if source._lengths is not None or source._left is not None:
                raise LayoutStateError("a source in a padded run cannot be merged: finalize it")
            sources.append(source)
        kinds = list(self._kinds)
        if not self._offsets and all(kind is None for kind in kinds):
            # A layout with no rows and no shapes (the table's roles build one from an
            # unwritten row: SSMCache(n).geometry is None) takes the sources' plane
            # count, as mlx-lm's ArraysCache.merge takes the first cache's.
            kinds = [None] * len(sources[0]._kinds)
        for source in sources:
            if len(source._kinds) != len(kinds):
                raise IncompatibleRowsError(
                    f"cannot merge recurrent rows of different plane counts: {len(kinds)} "
                    f"vs {len(source._kinds)}"
                )
            for i, kind in enumerate(source._kinds):
                if kind is None:
                    continue
                if kinds[i] is not None and kinds[i] != kind:
                    raise IncompatibleRowsError(
                        f"cannot merge recurrent rows of different geometries: "
                        f"state.{i} plane {kinds[i]} vs {kind}"
                    )
                kinds[i] = kind
        parts: list[list[tuple[Any, int]]] = [[] for _ in kinds]
        offsets = list(self._offsets)
        held: list[tuple[RecurrentRows, int]] = (
            [(self, len(self._offsets))] if self._offsets else []
        )
        held += [(s, s._rows) for s in sources]
        for owner, count in held:
            for i, plane in enumerate(owner._planes):
                parts[i].append((plane, count))
        for source in sources:
            offsets += source._row_offsets()
        planes: list[Any] = []
        for i in range(len(kinds)):
            if all(p is None for p, _ in parts[i]):
                planes.append(None)
                continue
            kind = kinds[i]
            assert kind is not None
            pieces = [
                p if p is not None else self._zeros((count, *kind[0]), kind[1])
                for p, count in parts[i]
            ]
            planes.append(self._concat(pieces))
        self._planes, self._kinds, self._offsets = planes, kinds, offsets

    def filter_rows(self, keep: Sequence[int]) -> None:
        """Keep the rows ``keep`` (any subset, in the given order)."""
        self._spec_guard("filter_rows")
        order = check_keep(keep, self._rows)
        if self._lengths is not None or self._left is not None:
            raise LayoutStateError("filter_rows during a padded run: finalize() it first")
        if not order:
            self._planes = [None] * len(self._planes)
            self._offsets = []
            return
        self._planes = [None if p is None else self._take(p, order) for p in self._planes]
        self._offsets = [self._offsets[b] for b in order]

    def extract_row(self, row: int) -> Any:
        """An owned serial ``SSMCache`` holding row ``row`` (its own coverage)."""
        self._spec_guard("extract_row")
        index = check_row(row, self._rows)
        serial = self._spawn_like(self._serial_class())
        serial._planes = [None if p is None else self._take(p, [index]) for p in self._planes]
        serial._offsets = [self._offsets[index]]
        return serial

    def can_publish_row(self, row: int, tokens: int) -> bool:
        """Only at exactly the row's coverage (recurrent state cannot be cut), and not
        while a round is open (the row's newest tokens are unverified)."""
        self._spec_usable()
        index = check_row(row, self._rows)
        count = as_count(tokens, "tokens")
        written = all(p is not None for p in self._planes)
        return written and self._offsets[index] == count and not self.spec_round_open

    def extend(self, other: Any) -> None:
        """mlx-lm's ``extend``: join ``other``'s rows."""
        self.merge_rows([other])
        self._mask_every_row = self._mask_every_row or other._mask_every_row

    def filter(self, batch_indices: Any) -> None:
        """mlx-lm's ``filter``."""
        if hasattr(batch_indices, "tolist"):
            batch_indices = batch_indices.tolist()
        self.filter_rows(batch_indices)

    def extract(self, idx: int) -> Any:
        """mlx-lm's ``extract``."""
        return self.extract_row(idx)

    # -- the speculative modifier's snapshot + replay hooks -------------------------------
    def _spec_snapshot(self) -> tuple[list[Any], list[int]]:
        if self._lengths is not None or self._left is not None:
            raise LayoutStateError("a verify round cannot open during a padded run: finalize it")
        return (list(self._planes), list(self._offsets))

    def _spec_restore(self, kept: tuple[list[Any], list[int]]) -> None:
        planes, offsets = kept
        self._planes, self._offsets = list(planes), list(offsets)

    def _spec_input_span(self, index: int, value: Any) -> int:
        if not self._is_native(value):
            raise InvalidInputError(
                f"inputs[{index}] must be a {self.array_name} array, got {type(value).__name__}"
            )
        shape = self._shape(value)
        if len(shape) < 2 or shape[0] != self._rows:
            raise InvalidInputError(
                f"inputs[{index}] must be [B={self._rows}, S, ...], got shape {shape}"
            )
        return int(shape[1])

    def _spec_replay(self, replay: Replay, inputs: tuple[Any, ...], keep: list[int]) -> None:
        # A padded run whose lengths are the kept counts: the layer leaves each row's state
        # unchanged past them, and advance() adds only the kept tokens.
        span = max(keep)
        try:
            self._lengths, self._left = list(keep), None
            replay(self, *(x[:, :span] for x in inputs))
        finally:
            self._lengths = self._left = None
