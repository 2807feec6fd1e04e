"""The optimized full-attention storage and row arrangements, over any codec.

Physical design (``spec/PaddedKVRows.md`` has the diagrams):

* one preallocated buffer per plane, ``[slots, H, capacity, ·]``; rows live in
  slots ``0 .. B-1``, with a few spare slots so a join writes only the new row;
* a column *origin*: logical column 0 of the layout is physical column
  ``origin``. Dropping the padding every survivor shares (filter) moves the
  origin instead of the bytes, and a join that needs more left padding takes
  it from the columns left of the origin when there are enough;
* appends are slice writes (every row at the same column) or one scatter
  (ragged rows), in place when MLX can donate the buffer; capacity grows in
  steps of 256 columns with one copy of the used columns.

Metadata (pads, row lengths, origin) is host-side Python ints, so a step never
synchronises with the device to plan its writes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import mlx.core as mx

from kvrows.common import PlaneHolder, check_counts, row_bytes
from kvrows.errors import (
    IncompatibleRowsError,
    InvalidInputError,
    LayoutStateError,
    NotTrimmableError,
)
from kvrows.optimized.codecs import Codec, Planes, dtype_name
from kvrows.protocols import Cache, Mask
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

__all__ = ["FullAttentionCache", "RowLayout"]


def _compact(view: mx.array) -> mx.array:
    """An owned compact copy of ``view`` (never a view pinning a batch buffer)."""
    # A row slice is contiguous only when it spans whole planes of one head; then
    # mx.contiguous would alias, so force a copy through a concatenate.
    if view.shape[1] == 1:
        return mx.concatenate([view, view[:, :, :0]], axis=2)
    return mx.contiguous(view)


def _slot_capacity(rows: int) -> int:
    """Row slots allocated for ``rows`` rows: an eighth spare, at least one.

    Spare slots let a join write only the new row; MLX zero-fills them, so each costs
    its bytes at merge and filter time (the trade-off ``kvrows bench`` shows)."""
    return rows + max(1, rows // 8)


def _block_shape(value: object) -> tuple[int, ...]:
    return tuple(value.shape) if isinstance(value, mx.array) else ()


class FullAttentionCache(PlaneHolder):
    """A serial full-attention cache over ``codec``: a ``[B, H, capacity, ·]`` buffer."""

    codec: Codec
    signature_text: ClassVar[str]

    def __init__(self) -> None:
        self._keys: Planes | None = None
        self._values: Planes | None = None
        self._offset = 0
        self._geometry: KvGeometry | None = None

    @property
    def geometry(self) -> KvGeometry | None:
        return self._geometry

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def rows(self) -> int:
        return 0 if self._keys is None else int(self._keys[0].shape[0])

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else int(self._keys[0].shape[2])

    def signature(self) -> str:
        return self.signature_text

    def planes(self) -> tuple[Planes, Planes] | None:
        """Views of the stored key and value planes, ``[B, H, offset, ·]``."""
        if self._keys is None or self._values is None:
            return None
        end = self._offset
        return tuple(p[:, :, :end] for p in self._keys), tuple(p[:, :, :end] for p in self._values)

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        geometry = check_block(
            _block_shape(keys),
            _block_shape(values),
            dtype_name(keys),
            dtype_name(values),
            rows=self.rows or None,
            geometry=self._geometry,
        )
        self.codec.check(geometry)
        batch, heads, n = (int(x) for x in keys.shape[:3])
        start, end = self._offset, self._offset + n
        if self._keys is None or self._values is None or end > self.capacity:
            capacity = round_up(end)

            def grown(old: Planes | None, dim: int) -> Planes:
                fresh = self.codec.zeros(batch, heads, capacity - start, dim, geometry.dtype)
                if old is None:
                    return fresh
                return tuple(
                    mx.concatenate([p[:, :, :start], z], axis=2)
                    for p, z in zip(old, fresh, strict=True)
                )

            self._keys = grown(self._keys, geometry.key_dim)
            self._values = grown(self._values, geometry.value_dim)
        for planes, block in ((self._keys, keys), (self._values, values)):
            for plane, encoded in zip(planes, self.codec.encode(block), strict=True):
                plane[:, :, start:end] = encoded
        self._offset = end
        self._geometry = geometry
        return self.fetch()

    def fetch(self) -> tuple[Any, Any]:
        held = self.planes()
        if held is None:
            raise LayoutStateError("the cache holds no tokens yet: nothing to fetch")
        return self.codec.fetched(held[0]), self.codec.fetched(held[1])

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        """mlx-lm's policy: ``None`` for one token, ``"causal"`` for a block, an array when
        a window or ``return_array`` asks for one."""
        count = as_count(n, "n", minimum=1)
        window = check_window(window_size)
        if window is None and not return_array:
            return None if count == 1 else "causal"
        columns = mx.arange(self._offset + count)[None, :]
        queries = mx.arange(self._offset, self._offset + count)[:, None]
        visible = columns <= queries
        if window is not None:
            visible = visible & (queries < columns + window)
        return visible

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        count = min(as_count(n, "n"), self._offset)
        self._offset -= count
        return count

    def adopt(
        self, keys: Planes, values: Planes, geometry: KvGeometry | None
    ) -> FullAttentionCache:
        """Make this (empty) cache hold exactly ``keys``/``values`` (owned, compact arrays)."""
        if self._keys is not None:
            raise LayoutStateError("adopt needs an empty cache")
        self._keys, self._values = keys, values
        self._offset = int(keys[0].shape[2])
        self._geometry = geometry
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}(offset={self._offset}, rows={self.rows})"


# One incoming row for a merge: key planes, value planes (views, [1, H, T, ·]), tokens.
_RowView = tuple[Planes | None, Planes | None, int]


class RowLayout(PlaneHolder):
    """Several requests' rows of one layer in one set of slot buffers."""

    codec: Codec
    serial_class: ClassVar[type[FullAttentionCache]]
    shared_column: ClassVar[bool]
    signature_text: ClassVar[str]

    def __init__(self) -> None:
        self._keys: Planes | None = None
        self._values: Planes | None = None
        self._origin = 0
        self._pads: list[int] = []
        self._lens: list[int] = []
        self._pads_array: mx.array | None = None  # the pads on the device, for masks
        self._geometry: KvGeometry | None = None

    def _set_rows(self, pads: list[int], lens: list[int]) -> None:
        self._pads, self._lens, self._pads_array = pads, lens, None

    # -- what the layout holds -------------------------------------------------
    @property
    def geometry(self) -> KvGeometry | None:
        return self._geometry

    @property
    def batch_size(self) -> int:
        return len(self._lens)

    @property
    def row_offsets(self) -> tuple[int, ...]:
        return tuple(self._lens)

    @property
    def left_pad(self) -> tuple[int, ...]:
        return tuple(self._pads)

    @property
    def width(self) -> int:
        return max((p + n for p, n in zip(self._pads, self._lens, strict=True)), default=0)

    @property
    def offset(self) -> mx.array:
        return mx.array(self._lens, dtype=mx.int32)

    @property
    def max_tokens(self) -> float:
        return math.inf

    @property
    def slots(self) -> int:
        return 0 if self._keys is None else int(self._keys[0].shape[0])

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else int(self._keys[0].shape[2])

    def signature(self) -> str:
        return self.signature_text

    def make_empty_batch(self) -> RowLayout:
        return type(self)()

    def blank_row(self) -> FullAttentionCache:
        """An empty serial cache of this layout's storage and codec."""
        return self.serial_class()

    def is_trimmable(self) -> bool:
        return True

    def _accepts(self, source: object) -> bool:
        if isinstance(source, RowLayout | self.serial_class):
            return source.codec.key == self.codec.key
        return False

    # -- reads --------------------------------------------------------------------
    def _active(self, planes: Planes) -> Planes:
        start = self._origin
        return tuple(p[: self.batch_size, :, start : start + self.width] for p in planes)

    def fetch(self) -> tuple[Any, Any]:
        if self._keys is None or self._values is None:
            raise LayoutStateError("the layout holds no tokens yet: nothing to fetch")
        return (
            self.codec.fetched(self._active(self._keys)),
            self.codec.fetched(self._active(self._values)),
        )

    def row_planes(self, row: int) -> tuple[Planes, Planes] | None:
        """Views of row ``row``'s key and value planes, ``[1, H, tokens, ·]``."""
        index = check_row(row, self.batch_size)
        if self._keys is None or self._values is None or self._lens[index] == 0:
            return None
        start = self._origin + self._pads[index]
        stop = start + self._lens[index]
        return (
            tuple(p[index : index + 1, :, start:stop] for p in self._keys),
            tuple(p[index : index + 1, :, start:stop] for p in self._values),
        )

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        count = as_count(n, "n", minimum=1)
        window = check_window(window_size)
        ends = [p + t for p, t in zip(self._pads, self._lens, strict=True)]
        aligned = len(set(ends)) <= 1
        if aligned and not any(self._pads) and window is None and not return_array:
            return None if count == 1 else "causal"
        width = max(ends, default=0)
        if self._pads_array is None:
            self._pads_array = mx.array(self._pads)
        columns = mx.arange(width + count)
        if aligned:
            # One write column: a per-row pad test, and one causal block all rows share.
            visible = (columns[None, :] >= self._pads_array[:, None])[:, None, None, :]
            queries = mx.arange(width, width + count)[:, None]
            if count > 1:
                visible = visible & (columns[None, :] <= queries)
            if window is not None:
                visible = visible & (queries < columns[None, :] + window)
            return visible
        grid = columns[None, None, :]
        queries = (mx.array(ends)[:, None] + mx.arange(count)[None, :])[:, :, None]
        ragged = (grid <= queries) & (grid >= self._pads_array[:, None, None])
        if window is not None:
            ragged = ragged & (queries < grid + window)
        return ragged[:, None]

    # -- writes ----------------------------------------------------------------------
    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        if not self._lens:
            raise LayoutStateError("an empty layout takes no update: merge rows into it first")
        geometry = check_block(
            _block_shape(keys),
            _block_shape(values),
            dtype_name(keys),
            dtype_name(values),
            rows=self.batch_size,
            geometry=self._geometry,
        )
        self.codec.check(geometry)
        self._geometry = geometry
        n = int(keys.shape[2])
        ends = [self._origin + p + t for p, t in zip(self._pads, self._lens, strict=True)]
        width = max(ends) - self._origin
        if self._keys is None or self._origin + width + n > self.capacity:
            self._reallocate(round_up(width + n + 1), shift=0)  # the origin is now 0
            ends = [p + t for p, t in zip(self._pads, self._lens, strict=True)]
        assert self._keys is not None and self._values is not None
        batch = self.batch_size
        if len(set(ends)) == 1:
            start = ends[0]
            for planes, block in ((self._keys, keys), (self._values, values)):
                for plane, encoded in zip(planes, self.codec.encode(block), strict=True):
                    plane[:batch, :, start : start + n] = encoded
        else:
            rows = mx.arange(batch)[:, None]
            columns = mx.array(ends)[:, None] + mx.arange(n)[None, :]
            for planes, block in ((self._keys, keys), (self._values, values)):
                for plane, encoded in zip(planes, self.codec.encode(block), strict=True):
                    plane[rows, :, columns] = mx.swapaxes(encoded, 1, 2)
        self._lens = [t + n for t in self._lens]
        return self.fetch()

    def _reallocate(self, capacity: int, *, shift: int, slots: int | None = None) -> None:
        """New buffers of ``capacity`` columns; active rows move right by ``shift`` columns."""
        geometry = self._geometry
        assert geometry is not None
        slots = max(slots or 0, _slot_capacity(self.batch_size))
        batch, width, origin = self.batch_size, self.width, self._origin

        def moved(old: Planes | None, dim: int) -> Planes:
            fresh = self.codec.zeros(slots, geometry.heads, capacity, dim, geometry.dtype)
            if old is None or width == 0:
                return fresh
            for new, plane in zip(fresh, old, strict=True):
                new[:batch, :, shift : shift + width] = plane[:batch, :, origin : origin + width]
            return fresh

        self._keys = moved(self._keys, geometry.key_dim)
        self._values = moved(self._values, geometry.value_dim)
        self._origin = 0

    def _source_rows(self, source: Cache) -> tuple[list[_RowView], KvGeometry | None]:
        if isinstance(source, RowLayout):
            views: list[_RowView] = []
            for r in range(source.batch_size):
                held = source.row_planes(r)
                views.append(
                    (None, None, 0) if held is None else (held[0], held[1], source._lens[r])
                )
            return views, source.geometry
        assert isinstance(source, FullAttentionCache)
        held = source.planes()
        if held is None:
            return [(None, None, 0)], source.geometry
        keys, values = held
        return [
            (
                tuple(p[b : b + 1] for p in keys),
                tuple(p[b : b + 1] for p in values),
                source.offset,
            )
            for b in range(source.rows)
        ], source.geometry

    def merge_rows(self, rows: Sequence[Cache]) -> None:
        """Form the batch from ``rows`` (empty layout) or join them (running layout).

        Rows are right-aligned to ``W = max(width, longest new row)``. A join
        writes only the new rows when a slot is free and the left padding it
        needs fits left of the origin; otherwise the running rows are copied
        once into larger buffers.
        """
        if isinstance(rows, Cache) or not isinstance(rows, Sequence):
            raise InvalidInputError("merge_rows takes a sequence of caches")
        incoming: list[_RowView] = []
        geometries: list[KvGeometry | None] = [self._geometry]
        for source in rows:
            if not self._accepts(source):
                raise IncompatibleRowsError(
                    f"{self.signature()} cannot merge "
                    f"{source.signature() if isinstance(source, Cache) else type(source).__name__}"
                )
            views, geometry = self._source_rows(source)
            incoming.extend(views)
            geometries.append(geometry)
        geometry = common_geometry(geometries)
        if not incoming:
            return
        self._geometry = geometry
        width = self.width
        target = max([width, *(tokens for _, _, tokens in incoming)])
        grow = target - width
        batch = self.batch_size
        joined = batch + len(incoming)
        if geometry is not None:
            fits = self._keys is not None and joined <= self.slots and grow <= self._origin
            if fits:
                self._origin -= grow
            else:
                self._reallocate(round_up(target + 1), shift=grow, slots=_slot_capacity(joined))
            assert self._keys is not None and self._values is not None
            end = self._origin + target
            for slot, (keys, values, tokens) in enumerate(incoming, start=batch):
                if keys is None or values is None or tokens == 0:
                    continue  # nothing to write (and MLX faults on empty scatters)
                for planes, new in ((self._keys, keys), (self._values, values)):
                    for plane, src in zip(planes, new, strict=True):
                        plane[slot : slot + 1, :, end - tokens : end] = src
        self._set_rows(
            [p + grow for p in self._pads] + [target - t for _, _, t in incoming],
            self._lens + [t for _, _, t in incoming],
        )

    def filter_rows(self, keep: Sequence[int]) -> None:
        """Keep rows ``keep`` in that order; the shared left padding is dropped by moving the origin."""
        order = check_keep(keep, self.batch_size)
        if not order:
            self._keys = self._values = None
            self._set_rows([], [])
            self._origin = 0
            return
        shared = min(self._pads[i] for i in order)
        moved = order != list(range(len(order)))
        if self._keys is not None and self._values is not None and moved:
            # Gather whole slots (contiguous) into fresh planes, keeping a few spare slots
            # for the next join; a scatter into the live planes would copy them anyway.
            slots = _slot_capacity(len(order))
            index = mx.array(order + [order[-1]] * (slots - len(order)))
            self._keys = tuple(mx.take(p, index, axis=0) for p in self._keys)
            self._values = tuple(mx.take(p, index, axis=0) for p in self._values)
        self._set_rows([self._pads[i] - shared for i in order], [self._lens[i] for i in order])
        self._origin += shared
        if self._keys is not None and self.slots > 2 * _slot_capacity(len(order)):
            # Release the slots a large retirement left behind.
            self._reallocate(round_up(self.width + 1), shift=0)

    def extract_row(self, row: int) -> FullAttentionCache:
        held = self.row_planes(row)
        if held is None:
            empty = self.blank_row()
            empty._geometry = self._geometry  # an empty row still knows its geometry
            return empty
        keys = tuple(_compact(p) for p in held[0])
        values = tuple(_compact(p) for p in held[1])
        return self.blank_row().adopt(keys, values, self._geometry)

    def can_publish_row(self, row: int, tokens: int) -> bool:
        index = check_row(row, self.batch_size)
        return as_count(tokens, "tokens") <= self._lens[index]

    def projected_bytes(self, tokens: int) -> int:
        return row_bytes(self.codec, self._geometry, tokens)

    def trim(self, n: int) -> int:
        count = as_count(n, "n")
        return self._trim_rows([count] * self.batch_size) if self._lens else 0

    def trim_rows(self, counts: Sequence[int]) -> int:
        """Forget ``counts[b]`` newest tokens of row ``b`` (per-row rollback; ragged layouts).

        Rows sharing one write column can only trim equal counts. Returns the largest count.
        """
        return self._trim_rows(check_counts(counts, self.batch_size))

    def _trim_rows(self, counts: Sequence[int]) -> int:
        for b, (tokens, count) in enumerate(zip(self._lens, counts, strict=True)):
            if count > tokens:
                raise NotTrimmableError(
                    f"cannot trim {count} tokens from row {b}, which holds {tokens}"
                )
        if self.shared_column and len(set(counts)) > 1:
            raise NotTrimmableError("rows sharing one write column must trim together")
        self._lens = [t - c for t, c in zip(self._lens, counts, strict=True)]
        return max(counts, default=0)

    def check_valid(self) -> None:
        """Assert the layout's invariants (for tests)."""
        assert len(self._pads) == len(self._lens)
        assert all(p >= 0 for p in self._pads) and all(t >= 0 for t in self._lens)
        if self._lens:
            assert min(self._pads) == 0, "some row must start at column 0"
        if self.shared_column:
            ends = {p + t for p, t in zip(self._pads, self._lens, strict=True)}
            assert len(ends) <= 1, "rows must share the write column"
        if self._keys is not None:
            assert self.batch_size <= self.slots
            assert self._origin + self.width <= self.capacity

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rows={self.batch_size}, row_offsets={self.row_offsets}, "
            f"left_pad={self.left_pad})"
        )
