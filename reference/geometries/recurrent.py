"""Recurrent state: the state geometry's hooks in the reference, and mlx-lm's
``ArraysCache`` surface over them (``spec/SSMCache.md``, ``spec/BatchedSSMCache.md``).

A row has no token axis: ``Row.planes`` holds its ``state.i`` planes (``[1, *row_shape]``,
owned copies, replaced whole by each write). :class:`StateAxis` and :class:`StateRows`
answer the machinery's hooks over whole rows (axis 0 only, nothing cut or trimmed); the
surface's bookkeeping (rows, a padded run) is written here and again in
``kvrows.optimized.geometries.recurrent`` (``spec/twins.md``); its checks are the core's
(``kvrows.recurrent.StateChecks``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvrows.codec import PlaneSet
from kvrows.compositions import Arrangement
from kvrows.errors import (
    NotTrimmableError,
)
from kvrows.geometries.recurrent import Recurrent
from kvrows.protocols import Mask
from kvrows.recurrent import StateChecks, StateLayoutMembers, not_trimmable_message
from kvrows.reference.codecs.common import dtype_name
from kvrows.reference.geometries.registry import implements
from kvrows.reference.rows import Placement, Row, Storage
from kvrows.schemes import GeometrySpec
from kvrows.validation import as_count

__all__ = ["ArraysCacheSurface", "StateAxis", "StateLayout", "StateRows"]


def _tensor(i: int) -> str:
    return f"state.{i}"


@implements("recurrent")
class StateAxis:
    """Whole rows: a write replaces the planes it names, a merge or an extraction takes a
    copy of the row, nothing is ever cut."""

    cap: int | None = None
    sinks = 0
    holding = False

    def __init__(self, spec: Recurrent) -> None:
        self.spec: GeometrySpec = spec

    def holds_proposals(self, arrangement: str) -> bool:
        return False  # a running summary of every token: nothing to forget

    def append(self, row: Row, block: PlaneSet, n: int) -> None:
        row.planes = {**row.planes, **block}
        row.offset += n

    def cut(self, row: Row) -> Row:
        return row.copy()

    def cuttable(self, offset: int) -> bool:
        return False

    def serial_mask(self, row: Row, n: int, window: int | None, return_array: bool) -> Mask:
        return None  # the surface's make_mask answers (a padded run's, mlx-lm's policy)

    def place(self, arrangement: Arrangement) -> Placement:
        return StateRows()


class StateRows:
    """Rows stacked along axis 0: no columns, no pads, nothing to trim."""

    def columns(self, rows: Sequence[Row]) -> tuple[int, list[tuple[int, int]], int]:
        return 0, [(0, 0)] * len(rows), 0

    def fetchable(self, rows: Sequence[Row]) -> bool:
        return False

    def lead(self, rows: Sequence[Row]) -> int:
        return 0

    def mask(self, rows: Sequence[Row], n: int, window: int | None, return_array: bool) -> Mask:
        return None  # the surface's make_mask answers

    def advance(self, rows: Sequence[Row], n: int) -> None:
        return None

    def join(self, rows: Sequence[Row], running: int) -> None:
        """A plane some rows hold: zeros for the rows that joined before the layer wrote
        it (so every row holds the same planes)."""
        like: PlaneSet = {}
        for row in rows:
            like = {**row.planes, **like}
        for row in rows:
            missing = {t: tuple(np.zeros_like(p) for p in ps) for t, ps in like.items()
                       if t not in row.planes}  # fmt: skip
            row.planes = {**row.planes, **missing}

    def filter(self, rows: Sequence[Row]) -> None:
        return None

    def check_trim(
        self, rows: Sequence[Row], counts: Sequence[int], *, justify: bool = False
    ) -> None:
        if any(counts):
            raise NotTrimmableError(not_trimmable_message("recurrent state"))

    def trimmed(self, rows: Sequence[Row], counts: Sequence[int], *, justify: bool = False) -> None:
        return None

    def trimmable(self, rows: Sequence[Row]) -> bool:
        return False

    def check(self, rows: Sequence[Row]) -> None:
        kinds = {
            tuple((t, p.shape[1:], p.dtype) for t, ps in r.planes.items() for p in ps)
            for r in rows
            if r.held
        }
        assert len(kinds) <= 1, f"rows hold different planes: {kinds}"
        assert all(r.held for r in rows if r.offset), "rows with tokens but no planes"


# The surface is mixed in ahead of the machinery's class (SerialStorage or a RowLayout).
if TYPE_CHECKING:
    _Machinery = Storage
else:
    _Machinery = object


class ArraysCacheSurface(StateChecks, _Machinery):
    """``cache``, ``empty``, ``size``, ``cache[i]``, ``cache[i] = plane``, ``lengths``,
    ``left_padding``, ``prepare``, ``finalize``, ``make_mask``, ``advance`` over NumPy,
    the state saved as ``(state.0, …, state.{N-1}, offset)``, and the snapshot + replay
    hooks of the speculative modifier."""

    # -- the array and row hooks of the core's checks --------------------------------------
    @staticmethod
    def _is_native(value: object) -> bool:
        return isinstance(value, np.ndarray)

    @staticmethod
    def _shape(value: Any) -> tuple[int, ...]:
        return tuple(int(n) for n in value.shape)

    @staticmethod
    def _dtype(value: Any) -> str:
        return dtype_name(value)

    @property
    def _row_count(self) -> int:
        return len(self._rows) or (0 if self._is_layout else 1)

    def _written(self) -> list[bool]:
        return [any(_tensor(i) in r.planes for r in self._rows) for i in range(len(self._kinds))]

    def _plane(self, i: int) -> Any:
        """Plane ``i`` of every row, ``[B, ...]`` (a fresh array; ``None`` when unwritten:
        a join gives every row the planes any row holds)."""
        held = [r.planes[_tensor(i)][0] for r in self._rows if _tensor(i) in r.planes]
        return np.concatenate(held, axis=0) if held else None

    @property
    def group_offset(self) -> int:
        """The longest row's coverage (0 without rows)."""
        return max((r.offset for r in self._rows), default=0)

    # -- mlx-lm's ArraysCache surface ----------------------------------------------------------
    def __setitem__(self, index: int, value: Any) -> None:
        """The layer writes plane ``index``: ``[B, ...]``, every row at once, with the
        per-row shape and dtype the cache already holds for that plane."""
        self._spec_usable()
        i = self._plane_index(index)
        kind = self._check_plane(i, value)
        self._spec_write()
        if not self._rows:  # a serial cache learns its rows from its first write
            self._rows = [self._new_row() for _ in range(int(value.shape[0]))]
        planes = self.codec.encode(value)[0]
        for b, row in enumerate(self._rows):
            self._axis.append(row, {_tensor(i): (planes[b : b + 1],)}, 0)
        self._kinds[i] = kind

    @property
    def lengths(self) -> Any:
        """Per-row real tokens still to come in the padded run (``None``: no run)."""
        return None if self._lengths is None else np.asarray(self._lengths, dtype=np.int32)

    @property
    def left_padding(self) -> Any:
        """Per-row pad tokens still to come at the front of the run (``None``: none)."""
        return None if self._left is None else np.asarray(self._left, dtype=np.int32)

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Any:
        """``[B, n]`` bool (``True``: a real token) during a padded run or after mlx-lm's
        ``merge`` of empty caches (all true, as mlx-lm's), else ``None``."""
        self._spec_usable()
        count = as_count(n, "n", minimum=1)
        padded = self._lengths is not None or self._left is not None
        if not padded and not return_array and not self._mask_every_row:
            return None
        rows = self._row_count
        end = np.asarray(self._lengths or [count] * rows, dtype=np.int64).reshape(rows, 1)
        start = np.asarray(self._left or [0] * rows, dtype=np.int64).reshape(rows, 1)
        t = np.arange(count).reshape(1, count)
        return (start <= t) & (t < end)

    def advance(self, n: int) -> None:
        """The layer consumed ``n`` positions: each row gains its real ones."""
        count, gained = self._check_advance(n)

        def step() -> None:
            for row, g in zip(self._rows, gained, strict=False):
                self._axis.append(row, {}, g)
            if self._lengths is not None:
                self._lengths = [v - count for v in self._lengths]
            if self._left is not None:
                self._left = [v - count for v in self._left]

        self._spec_append(step)

    # -- saved state: (state.0, …, state.{N-1}, offset) ----------------------------------------
    def _hold(self, planes: list[Any] | None, offsets: list[int]) -> None:
        self._rows = [self._new_row() for _ in offsets]
        for b, (row, offset) in enumerate(zip(self._rows, offsets, strict=True)):
            if planes is not None:
                row.planes = {
                    _tensor(i): self.codec.encode(p[b : b + 1]) for i, p in enumerate(planes)
                }
            row.offset = offset


class StateLayout(StateLayoutMembers, ArraysCacheSurface):
    """A recurrent layout: the core's layout members over this surface, and the snapshot
    the speculative modifier's rollback restores."""

    # -- the speculative modifier's snapshot + replay hooks ----------------------------------
    def _spec_snapshot(self) -> list[Row]:
        self._check_round_opens()
        return [dataclasses.replace(r, planes=dict(r.planes)) for r in self._rows]

    def _spec_restore(self, kept: list[Row]) -> None:
        self._rows = [dataclasses.replace(r, planes=dict(r.planes)) for r in kept]
