"""Recurrent state: the state geometry's hooks on MLX, and mlx-lm's ``ArraysCache``
surface over them (``spec/SSMCache.md``, ``spec/BatchedSSMCache.md``): the drop-in of
mlx-lm's hybrid and SSM layers (``qwen3_next``, ``mamba2``, ``lfm2``, ``rwkv7``…).

``_planes`` holds each ``state.i`` as one ``[B, *row_shape]`` array, kept as the layer
hands it (MLX arrays are immutable). :class:`StateGeometry` answers the machinery's hooks
over whole rows (axis 0 only, nothing trimmed); whatever leaves a cache (an extracted
row, a merged or filtered plane) is an owned, evaluated copy. The surface's bookkeeping
is written here and again in ``kvrows.reference.geometries.recurrent``
(``spec/twins.md``); its checks are the core's (``kvrows.recurrent.StateChecks``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from kvrows.codec import PlaneSet
from kvrows.codecs.state import DEFAULT_PLANES
from kvrows.errors import (
    NotTrimmableError,
)
from kvrows.optimized.codecs.common import dtype_name
from kvrows.optimized.codecs.state import StateCodec
from kvrows.optimized.geometries.registry import implements
from kvrows.optimized.rows import RowWindow, Storage, arrays, mapped, row_of
from kvrows.protocols import Mask
from kvrows.recurrent import StateChecks, StateLayoutMembers, not_trimmable_message
from kvrows.validation import KvGeometry, as_count

__all__ = ["ArraysCacheSurface", "StateGeometry", "StateLayout"]


def _tensor(i: int) -> str:
    return f"state.{i}"


def _copy(plane: mx.array) -> mx.array:
    """An owned copy (a concatenate never aliases its input)."""
    return mx.concatenate([plane, plane[:0]], axis=0)


@implements("recurrent")
class StateGeometry(Storage):
    """Hooks of the state geometry (no token axis), for the serial and ragged
    arrangements: rows along axis 0 only."""

    geometry_kind = "recurrent"
    arrangements = frozenset({"serial", "ragged"})

    _kinds: list[Any]
    _lengths: list[int] | None
    _left: list[int] | None

    def _reset_geometry(self) -> None:
        # The plane kinds survive (a filter that empties the layout keeps them); a spawned
        # storage starts with the default count until it takes its source's.
        if "_kinds" not in self.__dict__:
            self._kinds = [None] * DEFAULT_PLANES
        self._lengths = self._left = None

    def _append(self, block: PlaneSet, n: int, geometry: KvGeometry) -> None:
        raise NotImplementedError("recurrent state is written by the layer (cache[i] = plane)")

    def _visible(self, planes: PlaneSet) -> PlaneSet:
        return planes

    def _window(self, planes: PlaneSet, row: int | None) -> PlaneSet | None:
        return planes if row is None else row_of(planes, row)

    def _holds_nothing(self, held: PlaneSet) -> bool:
        return False

    def _owned(self, window: PlaneSet) -> PlaneSet:
        return mapped(window, _copy)

    def _place(self, incoming: list[RowWindow], geometry: KvGeometry | None) -> None:
        """The rows held, then the incoming ones, along axis 0 (zeros for a row that
        joined before the layer wrote a plane)."""
        parts: list[tuple[PlaneSet | None, int]] = [(self._planes, len(self._offsets))]
        parts += [(window, 1) for window, _ in incoming]
        parts = [(planes, count) for planes, count in parts if count]
        joined: PlaneSet = {}
        for i, kind in enumerate(self._kinds):
            tensor = _tensor(i)
            if kind is None or not any(p is not None and tensor in p for p, _ in parts):
                continue
            pieces = [
                p[tensor][0] if p is not None and tensor in p else StateCodec.zeros_of(n, kind)
                for p, n in parts
            ]
            joined[tensor] = (
                mx.concatenate(pieces, axis=0) if len(pieces) > 1 else _copy(pieces[0]),
            )
        mx.eval(*arrays(joined))
        self._planes = joined or None
        self._pads = [0] * (len(self._offsets) + len(incoming))  # no token axis, no pad

    def _keep(self, order: list[int]) -> None:
        self._pads = [0] * len(order)
        if self._planes is None:
            return
        rows = mx.array(order, dtype=mx.int32)
        kept = mapped(self._planes, lambda p: mx.take(p, rows, axis=0))  # a gather: new buffer
        mx.eval(*arrays(kept))
        self._planes = kept

    def _check_trim(self, counts: Sequence[int]) -> None:
        if any(counts):
            raise NotTrimmableError(not_trimmable_message(self.composition.name))

    def _forget(self, counts: Sequence[int], *, justify: bool = False) -> None:
        return None

    def _adopt(self, planes: PlaneSet, offset: int) -> None:
        return None

    def _serial_mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        return None  # the surface's make_mask answers

    def _layout_mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        return None  # the surface's make_mask answers

    def is_trimmable(self) -> bool:
        return False

    def _check_geometry(self) -> None:
        rows = len(self._offsets)
        for i, kind in enumerate(self._kinds):
            held = None if self._planes is None else self._planes.get(_tensor(i))
            if held is None:
                continue
            plane = held[0]
            assert int(plane.shape[0]) == rows, f"plane {i} holds {plane.shape[0]} rows, not {rows}"
            assert kind == (tuple(plane.shape[1:]), dtype_name(plane)), f"plane {i}'s kind"
        assert self._planes is not None or not any(self._offsets), "rows with tokens, no planes"


# The surface is mixed in ahead of the machinery's classes (a geometry and an arrangement).
if TYPE_CHECKING:
    _Machinery = Storage
else:
    _Machinery = object


class ArraysCacheSurface(StateChecks, _Machinery):
    """``cache``, ``empty``, ``size``, ``cache[i]``, ``cache[i] = plane``, ``lengths``,
    ``left_padding``, ``prepare``, ``finalize``, ``make_mask``, ``advance`` over MLX, and
    the state saved as ``(state.0, …, state.{N-1}, offset)``."""

    # -- the array and row hooks of the core's checks --------------------------------------
    @staticmethod
    def _is_native(value: object) -> bool:
        return isinstance(value, mx.array)

    @staticmethod
    def _shape(value: Any) -> tuple[int, ...]:
        return tuple(int(n) for n in value.shape)

    @staticmethod
    def _dtype(value: Any) -> str:
        return dtype_name(value)

    @property
    def _row_count(self) -> int:
        return len(self._offsets) or (0 if self._is_layout else 1)

    def _written(self) -> list[bool]:
        planes = self._planes or {}
        return [_tensor(i) in planes for i in range(len(self._kinds))]

    def _plane(self, i: int) -> Any:
        held = None if self._planes is None else self._planes.get(_tensor(i))
        return None if held is None else held[0]

    @property
    def group_offset(self) -> int:
        """The longest row's coverage (0 without rows)."""
        return max(self._offsets, default=0)

    # -- mlx-lm's ArraysCache surface ----------------------------------------------------------
    def __setitem__(self, index: int, value: Any) -> None:
        """The layer writes plane ``index``: ``[B, ...]``, every row at once, with the
        per-row shape and dtype the cache already holds for that plane."""
        self._spec_usable()
        i = self._plane_index(index)
        kind = self._check_plane(i, value)
        self._spec_write()
        if not self._offsets:  # a serial cache learns its rows from its first write
            rows = int(value.shape[0])
            self._offsets, self._pads = [0] * rows, [0] * rows
            self._changed()
        self._planes = {**(self._planes or {}), _tensor(i): self.codec.encode(value)}
        self._kinds[i] = kind

    @property
    def lengths(self) -> Any:
        """Per-row real tokens still to come in the padded run (``None``: no run)."""
        return None if self._lengths is None else mx.array(self._lengths, dtype=mx.int32)

    @property
    def left_padding(self) -> Any:
        """Per-row pad tokens still to come at the front of the run (``None``: none)."""
        return None if self._left is None else mx.array(self._left, dtype=mx.int32)

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
        positions = mx.arange(count)[None, :]
        mask = mx.ones((self._row_count, count), dtype=mx.bool_)
        if self._left is not None:
            mask = mask & (mx.array(self._left)[:, None] <= positions)
        if self._lengths is not None:
            mask = mask & (positions < mx.array(self._lengths)[:, None])
        return mask

    def advance(self, n: int) -> None:
        """The layer consumed ``n`` positions: each row gains its real ones."""
        count, gained = self._check_advance(n)

        def step() -> None:
            self._offsets = [o + g for o, g in zip(self._offsets, gained, strict=False)]
            self._changed()
            if self._lengths is not None:
                self._lengths = [v - count for v in self._lengths]
            if self._left is not None:
                self._left = [v - count for v in self._left]

        self._spec_append(step)

    # -- saved state: (state.0, …, state.{N-1}, offset) ----------------------------------------
    def _hold(self, planes: list[Any] | None, offsets: list[int]) -> None:
        if planes is not None:
            self._planes = {_tensor(i): (p,) for i, p in enumerate(planes)}
        self._offsets, self._pads = offsets, [0] * len(offsets)
        self._changed()


class StateLayout(StateLayoutMembers, ArraysCacheSurface):
    """A recurrent layout: the core's layout members over this surface, and the snapshot
    the speculative modifier's rollback restores."""

    # -- the speculative modifier's snapshot + replay hooks ----------------------------------
    def _spec_snapshot(self) -> tuple[PlaneSet | None, list[int]]:
        self._check_round_opens()
        return (None if self._planes is None else dict(self._planes), list(self._offsets))

    def _spec_restore(self, kept: tuple[PlaneSet | None, list[int]]) -> None:
        planes, offsets = kept
        self._planes = None if planes is None else dict(planes)
        self._offsets = list(offsets)
        self._changed()
