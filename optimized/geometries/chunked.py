"""Chunked-local attention: the chunked geometry's hooks over the growing geometry's
buffers (``spec/ChunkedKVCache.md``).

Row ``b`` holds positions ``[start[b], offset[b])`` at columns ``[origin + pad[b],
origin + pad[b] + held[b])``. Before every append each row keeps its newest
``chunk_size`` tokens (mlx-lm's ``maybe_trim_front``): its start and its pad grow by what
it forgot and its bytes stay where they are; the padding every row then shares moves the
origin, and the next reallocation drops the forgotten columns. Everything else (merges
right-align, filters, trims, extraction, stage stores) is the growing geometry's over
``_tokens_held``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import mlx.core as mx

from kvrows.codec import PlaneSet
from kvrows.compositions import Composition
from kvrows.optimized.geometries.growing import GrowingGeometry
from kvrows.optimized.geometries.registry import implements
from kvrows.optimized.rows import RowWindow, token_count
from kvrows.protocols import Mask
from kvrows.validation import KvGeometry

__all__ = ["ChunkedGeometry", "ChunkedSurface"]


@implements("chunked")
class ChunkedGeometry(GrowingGeometry):
    """Hooks of the chunked geometry, for the serial, shared and ragged arrangements."""

    @property
    def holds_proposals(self) -> bool:
        return False  # a full chunk evicts the one before it

    geometry_kind = "chunked"
    arrangements = frozenset({"serial", "shared", "ragged"})
    #: Each row's first held position (mlx-lm's ``start_position``).
    _starts: list[int]

    def _reset_geometry(self) -> None:
        super()._reset_geometry()
        self._starts = []

    @property
    def _tokens_held(self) -> list[int]:
        return [o - s for o, s in zip(self._offsets, self._starts, strict=True)]

    @property
    def _size(self) -> int:
        return int(self._token_geometry.chunk_size)  # type: ignore[attr-defined]

    # -- the front trim -----------------------------------------------------------------
    def _trim_front(self) -> None:
        """Keep each row's newest ``chunk_size`` tokens (host bookkeeping; a delayed
        layout's forgotten columns left in the read read zeros again). The positions do
        not move: ``offset``'s device copy stays."""
        held = self._tokens_held
        evicted = [max(0, h - self._size) for h in held]
        if not any(evicted):
            return
        if self._masked_read_zeros:
            firsts = [self._origin + p for p in self._pads]
            self._clear_rows(firsts, evicted)
        self._starts = [s + e for s, e in zip(self._starts, evicted, strict=True)]
        self._forget_front_pads(evicted)

    def _after_front_trim(self, append: Callable[[], None]) -> None:
        """The front trim, then ``append`` (the growing geometry's); a failed allocation
        puts the trim back too (contract §9)."""
        if len(self._starts) != len(self._offsets):  # a serial storage's first block
            self._starts = [0] * len(self._offsets)
        record = (self._starts, self._pads, self._origin)
        self._trim_front()
        try:
            append()
        except BaseException:
            self._starts, self._pads, self._origin = record
            raise

    def _append(self, block: PlaneSet, n: int, geometry: KvGeometry) -> None:
        self._after_front_trim(lambda: super(ChunkedGeometry, self)._append(block, n, geometry))

    def _append_stores(self, shares: list[PlaneSet], n: int, geometry: KvGeometry) -> None:
        self._after_front_trim(
            lambda: super(ChunkedGeometry, self)._append_stores(shares, n, geometry)
        )

    # -- rows joining, leaving, extracted -------------------------------------------------
    def _joining_starts(self, incoming: list[RowWindow]) -> list[int]:
        return [o - (0 if h is None else token_count(h)) for h, o in incoming]

    def _place(self, incoming: list[RowWindow], geometry: KvGeometry | None) -> None:
        if self._stores is not None:  # ``_place_stages`` takes the rows' starts
            super()._place(incoming, geometry)
            return
        starts = self._joining_starts(incoming)
        super()._place(incoming, geometry)
        self._starts = self._starts + starts

    def _place_stages(
        self, incoming: list[RowWindow], stages: list[int], geometry: KvGeometry | None
    ) -> None:
        starts = self._joining_starts(incoming)
        super()._place_stages(incoming, stages, geometry)
        self._starts = self._starts + starts

    def _keep(self, order: list[int]) -> None:
        self._starts = [self._starts[i] for i in order]
        super()._keep(order)

    def _keeps_at_once(self, order: list[int]) -> bool:
        return False  # the starts move before the gather: a fault needs the undo record

    def _adopt(self, planes: PlaneSet, offset: int) -> None:
        self._starts = [offset - token_count(planes)] * len(self._offsets)
        super()._adopt(planes, offset)

    # -- saved forms ----------------------------------------------------------------------
    def _serial_form_fields(self) -> dict[str, Any]:
        held = self._tokens_held
        return {"start_position": self._offsets[0] - held[0] if held else 0}

    def _check_geometry(self) -> None:
        super()._check_geometry()
        assert len(self._starts) == len(self._offsets)
        assert all(0 <= h <= o for h, o in zip(self._tokens_held, self._offsets, strict=True))

    # -- masks ----------------------------------------------------------------------------
    def _serial_mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        """``None`` / ``"causal"`` while the keys the update returns and the queries are
        one chunk, else the array ``[n, S]`` (the one-row case of the layout's)."""
        held = self._tokens_held[:1] or [0]
        mask = self._chunk_mask(self._offsets[:1] or [0], [0], held, n, return_array, window)
        return mask if isinstance(mask, str) or mask is None else mask[0, 0]

    def _layout_mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        return self._chunk_mask(
            self._offsets, self._pads, self._tokens_held, n, return_array, window
        )

    def _chunk_mask(
        self,
        offsets: list[int],
        pads: list[int],
        held: list[int],
        n: int,
        return_array: bool,
        window: int | None,
    ) -> Mask:
        """``[B, 1, n, S]`` of rows at ``offsets`` holding ``held`` tokens after ``pads``,
        as the next append lays them (after their front trims): row ``b``'s column ``c``
        holds position ``offset[b] + c - end[b]``."""
        size = self._size
        kept = [min(h, size) for h in held]
        pads = [p + h - k for p, h, k in zip(pads, held, kept, strict=True)]
        shared = min(pads, default=0)
        pads = [p - shared for p in pads]
        ends = [p + k for p, k in zip(pads, kept, strict=True)]
        one_chunk = all(
            (o - k) // size == (o + n - 1) // size for o, k in zip(offsets, kept, strict=True)
        )
        uniform = not any(pads) and len(set(ends)) <= 1
        if one_chunk and uniform and window is None and not return_array:
            return None if n == 1 else "causal"
        columns = mx.arange(max(ends, default=0) + n)[None, None, :]
        end = mx.array(ends)[:, None, None]
        first = mx.array(pads)[:, None, None]
        query_columns = end + mx.arange(n)[None, :, None]
        base = (mx.array(offsets) - mx.array(ends))[:, None, None]  # position = column + base
        same = (columns + base) // size == (query_columns + base) // size
        visible = (columns >= first) & (columns <= query_columns) & same
        if window is not None:
            visible = visible & (query_columns < columns + window)
        return visible[:, None]


class ChunkedSurface:
    """mlx-lm's ``ChunkedKVCache`` surface: ``chunk_size``, ``start_position`` (the first
    position held: an int, or int32 ``[B]`` on a layout) and ``maybe_trim_front``."""

    _token_geometry: Any
    if TYPE_CHECKING:  # the geometry's, which every public class of it inherits
        composition: ClassVar[Composition]
        _starts: list[int]

        def _trim_front(self) -> None: ...

    @property
    def chunk_size(self) -> int:
        return int(self._token_geometry.chunk_size)

    @property
    def start_position(self) -> Any:
        if self.composition.is_layout:
            return mx.array(self._starts, dtype=mx.int32)
        return self._starts[0] if self._starts else 0

    def maybe_trim_front(self) -> None:
        """Keep each row's newest ``chunk_size`` tokens (what the next append does first;
        llama4 calls it before it builds its mask from ``start_position``)."""
        self._trim_front()
