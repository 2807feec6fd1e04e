"""Recurrent (SSM) state: the checks ``SSMCache`` and ``BatchedSSMCache`` share, array-free.

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
at exactly the coverage it holds. A verify round rolls back by **snapshot and replay**
(``kvrows.speculative.SpeculativeRounds`` over the state geometry's hooks).

The classes are each implementation's row machinery (``reference/rows.py``,
``optimized/rows.py``) with the state geometry (``*/geometries/recurrent.py``: the hooks
and mlx-lm's ``ArraysCache`` surface) and the state codec (``*/codecs/state.py``). What
the twins share is here: :class:`StateChecks` (the argument checks and messages of the
surface, the merge's plane-kind rule, the saved state's parsing), over three array hooks
each implementation answers. The specs are ``State`` / ``StateShapes``
(``kvrows.codecs.state``) and ``Recurrent`` / ``valid_counts`` / ``Replay``
(``kvrows.geometries.recurrent``), re-exported here. See ``spec/SSMCache.md`` and
``spec/BatchedSSMCache.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from kvrows.codec import PlaneSpec
from kvrows.codecs.state import DEFAULT_PLANES, PlaneShape, State, StateShapes
from kvrows.compositions import Composition
from kvrows.errors import (
    EMPTY_LAYOUT_UPDATE,
    IncompatibleRowsError,
    InvalidInputError,
    LayoutStateError,
    NotTrimmableError,
)
from kvrows.geometries.recurrent import Recurrent, Replay, valid_counts
from kvrows.protocols import Composed
from kvrows.validation import FLOAT_DTYPES, as_count

__all__ = [
    "CONV",
    "RECURRENT",
    "Recurrent",
    "Replay",
    "SerialRounds",
    "State",
    "StateChecks",
    "StateLayoutMembers",
    "StateShapes",
    "not_trimmable_message",
    "state_planes",
    "valid_counts",
]

_R = TypeVar("_R")

#: Plane indices of a gated DeltaNet / Mamba2 layer (mlx-lm's ``ArraysCache(2)`` order).
CONV = 0
RECURRENT = 1


def not_trimmable_message(name: str) -> str:
    return (
        f"{name} is not trimmable: recurrent state is a running summary of every token "
        "(roll back a verify round with spec_round_rollback)"
    )


def state_planes(state: object) -> int | None:
    """The plane count of a saved state ``(state.0, …, offset)`` (``None``: not a state;
    the cache's parsing refuses it)."""
    if isinstance(state, Sequence) and not isinstance(state, str | bytes) and len(state) >= 2:
        return len(state) - 1
    return None


def _counts(values: Any, name: str) -> list[int] | None:
    """One count per row (``None`` not given); a native vector through ``tolist``."""
    if values is None:
        return None
    if hasattr(values, "tolist") and not isinstance(values, Sequence):
        values = values.tolist()
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise InvalidInputError(f"{name} must be one count per row, got {values!r}")
    return [as_count(v, f"{name}[{b}]") for b, v in enumerate(values)]


class SerialRounds:
    """A serial cache has no verify rounds: nothing to refuse, every append is plain."""

    def _spec_guard(self, what: str) -> None:
        return None

    def _spec_usable(self) -> None:
        return None

    def _spec_append(self, append: Callable[[], _R]) -> _R:
        return append()

    def _spec_write(self) -> None:
        return None


class StateChecks:
    """The checks of a recurrent cache (both implementations): constructor arguments,
    plane writes, padded runs, advances, merged plane kinds, saved states.

    An implementation answers ``_is_native`` / ``_shape`` / ``_dtype`` (its arrays),
    ``_row_count`` and ``_held_kinds`` (its rows), and keeps ``_kinds`` (each plane's
    per-row shape and dtype once known; their count is the cache's plane count),
    ``_lengths`` / ``_left`` (a padded run's counts) and ``_mask_every_row``.
    """

    composition: ClassVar[Composition]
    #: The array type the implementation takes (for messages): its ``Storage``'s, the
    #: library its rows are held in (``kvrows.protocols.RowSource``).
    array_name: ClassVar[str]

    _kinds: list[PlaneShape | None]
    _lengths: list[int] | None
    _left: list[int] | None
    #: mlx-lm's ``ArraysCache.merge`` of caches that are all empty sets ``left_padding`` to
    #: zeros, kept (only ever <= 0) until ``finalize``: its ``make_mask`` then answers an
    #: all-true ``[B, n]`` array where it otherwise answers ``None``; so does the drop-in.
    _mask_every_row: bool = False

    # -- array and row hooks ----------------------------------------------------------------
    @staticmethod
    def _is_native(value: object) -> bool:
        raise NotImplementedError

    @staticmethod
    def _shape(value: Any) -> tuple[int, ...]:
        raise NotImplementedError

    @staticmethod
    def _dtype(value: Any) -> str:
        raise NotImplementedError

    @property
    def _row_count(self) -> int:
        """Rows held (a serial cache before its first write: one)."""
        raise NotImplementedError

    def _written(self) -> list[bool]:
        """Whether each plane holds rows."""
        raise NotImplementedError

    def _plane(self, i: int) -> Any:
        """Plane ``i`` of every row, ``[B, ...]`` (``None``: unwritten)."""
        raise NotImplementedError

    if TYPE_CHECKING:  # the round's (a layout's SpeculativeRounds; a serial cache's no-ops)

        def _spec_guard(self, what: str) -> None: ...

        def _spec_usable(self) -> None: ...

        def _spec_write(self) -> None: ...

        def _spec_append(self, append: Callable[[], _R]) -> _R: ...

    @property
    def _is_layout(self) -> bool:
        return self.composition.is_layout

    # -- construction ---------------------------------------------------------------------
    def __init__(
        self,
        size: int | None = None,
        left_padding: Any = None,
        *,
        geometry: StateShapes | None = None,
        codec: object = None,
        token_geometry: object = None,
    ) -> None:
        """mlx-lm's ``ArraysCache(size, left_padding=None)`` (``codec=`` /
        ``token_geometry=``: the table's ``from_specs``, ``State()`` and ``Recurrent()``)."""
        self._check_specs(self.composition.name, codec, token_geometry)
        kinds, pads = self._arguments(size, left_padding, geometry)
        super().__init__()
        self._kinds, self._lengths, self._left = kinds, None, pads
        if pads is not None:
            self._hold(None, [0] * len(pads))

    def _arguments(
        self, size: int | None, left_padding: Any, geometry: StateShapes | None
    ) -> tuple[list[PlaneShape | None], list[int] | None]:
        """mlx-lm's ``ArraysCache(size, left_padding=None)``: ``size`` planes (else the
        ``geometry``'s count, else two); ``left_padding`` (a layout's) makes one row per
        count, at offset 0, whose first ``left_padding[b]`` positions are padding. Returns
        the plane kinds and the pads (``None``: no row made)."""
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
        kinds: list[PlaneShape | None] = (
            [None] * count if geometry is None else list(geometry.planes)
        )
        if left_padding is None:
            return kinds, None
        if hasattr(left_padding, "tolist") and not isinstance(left_padding, Sequence):
            left_padding = left_padding.tolist()
        if isinstance(left_padding, str | bytes) or not isinstance(left_padding, Sequence):
            raise InvalidInputError(f"left_padding must be one count per row, got {left_padding!r}")
        if not left_padding:  # mlx-lm's ArraysCache takes an empty list as no padding
            return kinds, None
        if not self._is_layout:
            raise InvalidInputError(
                f"{name} holds one request: left_padding is a layout's "
                "(BatchedSSMCache(size, left_padding=...))"
            )
        return kinds, [as_count(v, f"left_padding[{b}]") for b, v in enumerate(left_padding)]

    @staticmethod
    def _check_specs(name: str, codec_spec: object, token_geometry: object) -> None:
        if (codec_spec is not None and codec_spec != State()) or (
            token_geometry is not None and token_geometry != Recurrent()
        ):
            raise InvalidInputError(
                f"{name} is built from State() and Recurrent(), got "
                f"{codec_spec!r} and {token_geometry!r}"
            )

    # -- identity -------------------------------------------------------------------------
    @property
    def geometry(self) -> Any:
        """The planes' per-row shapes and dtypes (a :class:`StateShapes`), once declared or
        learnt from every plane; ``None`` before."""
        kinds = self._kinds
        if any(kind is None for kind in kinds):
            return None
        return StateShapes(planes=tuple(kind for kind in kinds if kind is not None))

    def plane_specs(self) -> tuple[PlaneSpec, ...]:
        g = self.geometry
        return () if g is None else g.plane_specs()

    def _state_bytes(self) -> int:
        """Bytes one row's state takes (``projected_bytes``, whatever the tokens)."""
        g = self.geometry
        if g is None:
            raise LayoutStateError(
                "projected_bytes needs the recurrent geometry: declare it at construction "
                "(geometry=StateShapes(...)) or let the layer write every plane first"
            )
        return int(g.row_bytes())

    # -- mlx-lm's ArraysCache surface (the bookkeeping of a padded run is each twin's) ----
    @property
    def cache(self) -> list[Any]:
        """The planes, ``[state.0, …]`` (``None`` where unwritten)."""
        return [self._plane(i) for i in range(len(self._kinds))]

    def empty(self) -> bool:
        """mlx-lm's ``empty()``: no plane written yet."""
        return not self._written()[0]

    def size(self) -> int:
        return 0

    def __getitem__(self, index: int) -> Any:
        self._spec_usable()
        return self._plane(self._plane_index(index))

    def __iter__(self) -> Iterator[Any]:
        """The planes, so ``conv, state = cache`` unpacks as on mlx-lm's ``ArraysCache``
        (kimi_k3's layer does; iterating through ``__getitem__`` would hit the refused
        index ``N`` instead of stopping)."""
        self._spec_usable()
        return iter(self.cache)

    def trim(self, n: int) -> int:
        """Recurrent state cannot forget tokens (a rollback replays instead): ``trim(0)``
        returns 0, any other count raises ``NotTrimmableError``."""
        self._spec_guard("trim (use spec_round_rollback)")
        if as_count(n, "n") == 0:
            return 0
        raise NotTrimmableError(not_trimmable_message(self.composition.name))

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> Any:
        """mlx-lm's ``merge``: a new layout (the table's decode role) holding ``caches``'
        rows."""
        from kvrows.table import owned_cache_layout

        if isinstance(caches, str | bytes) or not isinstance(caches, Sequence) or not caches:
            raise InvalidInputError("merge takes a non-empty sequence of caches")
        first: Any = caches[0]
        if not (isinstance(first, Composed) and first.token_geometry == Recurrent()):
            raise IncompatibleRowsError(f"merge takes recurrent caches, got {type(first).__name__}")
        layout: Any = owned_cache_layout(caches[0])
        layout.merge_rows(caches)
        layout._mask_every_row = all(c.empty() for c in caches)
        return layout

    def prepare(
        self,
        *,
        lengths: Sequence[int] | None = None,
        left_padding: Sequence[int] | None = None,
        right_padding: Sequence[int] | None = None,
    ) -> None:
        """A padded run follows: row ``b``'s tokens ``left_padding[b] <= t < lengths[b]``
        are real (``right_padding`` is implied by ``lengths`` and ignored)."""
        self._lengths, self._left = self._check_prepare(lengths, left_padding)

    def finalize(self) -> None:
        """The padded run is over."""
        self._spec_usable()
        self._lengths = self._left = None
        self._mask_every_row = False

    # -- the machinery's shapes: the planes' kinds -------------------------------------------
    def _shapes(self) -> Any:
        return list(self._kinds)

    def _take_shapes(self, shapes: Any) -> None:
        self._kinds = list(shapes)

    def _joined_shapes(self, sources: Sequence[Any]) -> Any:
        self._check_unpadded("merge_rows")
        return self._joined_kinds(sources)

    # -- the surface's checks -------------------------------------------------------------
    def _plane_index(self, index: object) -> int:
        value = None if isinstance(index, bool) else getattr(index, "__index__", None)
        number = value() if callable(value) else None
        count = len(self._kinds)
        if not isinstance(number, int) or not 0 <= number < count:
            raise InvalidInputError(
                f"this recurrent cache holds planes 0 to {count - 1} (ArraysCache(size={count})), "
                f"got index {index!r}"
            )
        return number

    def _check_plane(self, i: int, value: Any) -> PlaneShape:
        name = f"state.{i}"
        if not self._is_native(value):
            raise InvalidInputError(
                f"the {name} plane must be a {self.array_name} array, got {type(value).__name__}"
            )
        if self._is_layout and not self._row_count:
            raise LayoutStateError("an empty layout takes no plane: merge rows into it first")
        shape = self._shape(value)
        dtype = self._dtype(value)
        if len(shape) < 2:
            raise InvalidInputError(
                f"the {name} plane must be [B, ...] (rank >= 2), got shape {shape}"
            )
        if dtype not in FLOAT_DTYPES:
            raise InvalidInputError(f"the {name} plane must be one of {FLOAT_DTYPES}, got {dtype}")
        if self._rows_fixed() and shape[0] != self._row_count:
            raise InvalidInputError(
                f"the {name} plane must hold {self._row_count} rows (one per row of the cache), "
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
        return self._is_layout or any(self._written())

    def _check_prepare(
        self, lengths: Sequence[int] | None, left_padding: Sequence[int] | None
    ) -> tuple[list[int] | None, list[int] | None]:
        """``prepare``'s arguments as one count per row each (``None``: not given)."""
        self._spec_guard("prepare")
        if not self._is_layout:
            raise InvalidInputError(
                f"{self.composition.name} holds one request: padded runs are a layout's "
                "(BatchedSSMCache)"
            )
        parsed = [_counts(lengths, "lengths"), _counts(left_padding, "left_padding")]
        for name, values in zip(("lengths", "left_padding"), parsed, strict=True):
            if values is not None and len(values) != self._row_count:
                raise InvalidInputError(
                    f"{name} needs {self._row_count} counts (one per row), got {len(values)}"
                )
        return parsed[0], parsed[1]

    def _check_advance(self, n: int) -> tuple[int, list[int]]:
        """``advance(n)``'s count and the real tokens each row gains
        (:func:`valid_counts` of the padded run)."""
        self._spec_usable()
        count = as_count(n, "n")
        rows = self._row_count
        if self._is_layout and not rows:
            raise LayoutStateError(EMPTY_LAYOUT_UPDATE)
        gained = valid_counts(count, rows, self._lengths, self._left)
        if any(gained) and not all(self._written()):
            raise LayoutStateError(
                f"advance before the layer wrote every plane: write cache[0] to "
                f"cache[{len(self._kinds) - 1}] first"
            )
        if not self._is_layout and len(set(gained)) > 1:
            raise InvalidInputError("a serial recurrent cache advances every row alike")
        return count, gained

    def _check_unpadded(self, what: str) -> None:
        if self._lengths is not None or self._left is not None:
            raise LayoutStateError(f"{what} during a padded run: finalize() it first")

    # -- merges: the plane kinds the rows join under ----------------------------------------
    def _joined_kinds(self, sources: Sequence[Any]) -> list[PlaneShape | None]:
        """The plane kinds after joining ``sources`` (recurrent caches of this
        implementation: the machinery's ``_accepts`` took them, as storages of its array
        library on the recurrent geometry): one plane count, each plane's kind agreed where
        known."""
        for source in sources:
            if source._lengths is not None or source._left is not None:
                raise LayoutStateError("a source in a padded run cannot be merged: finalize it")
        kinds = list(self._kinds)
        if not self._row_count and all(kind is None for kind in kinds):
            # A layout with no rows and no shapes (the table's roles build one from an
            # unwritten row: SSMCache(n).geometry is None) takes the sources' plane
            # count, as mlx-lm's ArraysCache.merge takes the first cache's.
            kinds = [None] * len(sources[0]._kinds) if sources else kinds
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
        return kinds

    def _check_round_opens(self) -> None:
        if self._lengths is not None or self._left is not None:
            raise LayoutStateError("a verify round cannot open during a padded run: finalize it")

    # -- saved state: (state.0, …, state.{N-1}, offset) ------------------------------------
    if TYPE_CHECKING:  # the machinery's

        @property
        def offset(self) -> Any: ...

    def _state(self) -> tuple[Any, ...]:
        self._spec_guard("state")
        return (*self.cache, self.offset)

    def _hold(self, planes: list[Any] | None, offsets: list[int]) -> None:
        """Hold a parsed state's planes (``None``: rows without planes) and offsets."""
        raise NotImplementedError

    @classmethod
    def _restore(cls, state: Any, meta_state: Any, keep: int | None, geometry: Any) -> Any:
        count = state_planes(state)
        fresh: Any = cls(geometry=geometry) if geometry is not None else cls(count)
        planes, offsets, kinds = fresh._parse_state(state, geometry)
        fresh._kinds = kinds
        if fresh._is_layout or planes is not None:  # a serial cache without planes: no row
            fresh._hold(planes, offsets)
        return fresh

    def _parse_state(
        self, state: Any, geometry: StateShapes | None
    ) -> tuple[list[Any] | None, list[int], list[PlaneShape | None]]:
        """``(planes or None, offsets, kinds)`` of a saved state for a fresh cache of this
        class (refused, changing nothing, when it does not fit)."""
        name = self.composition.name
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
        if self._is_layout:
            if hasattr(offset, "tolist"):
                offset = [int(v) for v in offset.reshape(-1).tolist()]
            if isinstance(offset, str | bytes) or not isinstance(offset, Sequence):
                raise InvalidInputError(f"{name} state offset must be one count per row")
            offsets = [as_count(v, f"offset[{b}]") for b, v in enumerate(offset)]
        else:
            if hasattr(offset, "item") and not isinstance(offset, int):
                offset = offset.item()
            offsets = [as_count(offset, "offset")]
        declared: list[PlaneShape | None] = (
            [None] * len(planes) if geometry is None else list(geometry.planes)
        )
        if len({p is None for p in planes}) > 1:
            raise InvalidInputError(f"{name} state: the planes must all be set or all None")
        if planes[0] is None:
            if any(offsets):
                raise InvalidInputError(f"{name} state: rows with tokens need their planes")
            return None, offsets, declared
        kinds = [self._check_free(i, p) for i, p in enumerate(planes)]
        if geometry is not None and kinds != declared:
            raise InvalidInputError(
                f"{name} state: planes {kinds} do not match the declared {geometry.describe()}"
            )
        rows = {self._shape(p)[0] for p in planes}
        if len(rows) != 1 or (self._is_layout and rows != {len(offsets)}):
            raise InvalidInputError(
                f"{name} state: the planes and offsets disagree on the rows ({sorted(rows)} "
                f"planes, {len(offsets)} offsets)"
            )
        if not self._is_layout:
            offsets = offsets * rows.pop()
        return planes, offsets, list(kinds)

    def _check_free(self, i: int, value: Any) -> PlaneShape:
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

    def _check_input(self, index: int, value: Any) -> int:
        """A recorded verify input ``[B, S, ...]``: its span ``S``."""
        if not self._is_native(value):
            raise InvalidInputError(
                f"inputs[{index}] must be a {self.array_name} array, got {type(value).__name__}"
            )
        shape = self._shape(value)
        if len(shape) < 2 or shape[0] != self._row_count:
            raise InvalidInputError(
                f"inputs[{index}] must be [B={self._row_count}, S, ...], got shape {shape}"
            )
        return int(shape[1])

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


class StateLayoutMembers(StateChecks):
    """The row-layout members a recurrent layout adds to the surface (both twins):
    publishing at exact coverage, an empty batch of the same planes, mlx-lm's batch
    names, and the record and replay of the speculative modifier's rollback."""

    if TYPE_CHECKING:  # the machinery's

        @property
        def row_offsets(self) -> tuple[int, ...]: ...

        def merge_rows(self, rows: Sequence[Any]) -> None: ...

        def extract_row(self, row: int) -> Any: ...

    def can_publish_row(self, row: int, tokens: int) -> bool:
        """Only at exactly the row's coverage (recurrent state cannot be cut), once the
        layer wrote every plane."""
        published: bool = super().can_publish_row(row, tokens)  # type: ignore[misc]
        exact = self.row_offsets[row] == as_count(tokens, "tokens")
        return published and exact and all(self._written())

    def make_empty_batch(self) -> Any:
        """An empty layout with this cache's plane kinds."""
        self._spec_usable()
        fresh = type(self)(len(self._kinds))
        fresh._kinds = list(self._kinds)
        return fresh

    def filter_rows(self, keep: Sequence[int]) -> None:
        self._spec_guard("filter_rows")
        self._check_unpadded("filter_rows")
        super().filter_rows(keep)  # type: ignore[misc]

    def projected_bytes(self, tokens: int) -> int:
        """Bytes a row needs: the state's, whatever ``tokens``."""
        as_count(tokens, "tokens")
        return self._state_bytes()

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

    # -- the speculative modifier's record and replay (the snapshot is each twin's) --------
    def _spec_input_span(self, index: int, value: Any) -> int:
        return self._check_input(index, value)

    def _spec_replay(self, replay: Replay, inputs: tuple[Any, ...], keep: list[int]) -> None:
        # A padded run whose lengths are the kept counts: the layer leaves each row's state
        # unchanged past them, and advance() adds only the kept tokens.
        span = max(keep)
        try:
            self._lengths, self._left = list(keep), None
            replay(self, *(x[:, :span] for x in inputs))
        finally:
            self._lengths = self._left = None
