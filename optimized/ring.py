"""Sliding-window storage: the serial ring (mlx-lm's ``RotatingKVCache``, keep = 0).

Physical design (``spec/RotatingKVCache.md`` has the diagram): one buffer per plane,
``[B, H, Sbuf, ·]``. Single tokens are written in place at the ring index ``idx``;
once ``offset`` reaches ``max_size`` the index wraps and the oldest column is
overwritten. A multi-token block puts the buffer in temporal order, keeps its newest
``max_size - 1`` columns (so the block's first query still sees a full window) and
appends the block: the buffer can briefly hold more than ``max_size`` columns. The
codec axis is the same as the full-attention storage's: the ring moves planes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import mlx.core as mx

from kvrows.common import AffineParameters, PlaneHolder, RingRows, check_counts
from kvrows.errors import (
    IncompatibleRowsError,
    InvalidInputError,
    LayoutStateError,
    NotTrimmableError,
)
from kvrows.optimized.codecs import AffineCodec, Codec, PlainCodec, Planes, dtype_name
from kvrows.protocols import Mask
from kvrows.validation import STEP, KvGeometry, as_count, check_block, check_window, round_up

__all__ = [
    "BatchedRotatingCache",
    "BatchedRotatingQuantCache",
    "RaggedRotatingRows",
    "RingCache",
    "RingLayout",
    "RotatingAffineLayout",
    "RotatingKVCache",
    "RotatingQuantizedKVCache",
    "window_mask",
]


def window_mask(n: int, offset: int, window: int) -> mx.array:
    """``[n, offset + n]``: query ``i`` (position ``offset + i``) sees ``j`` in its window."""
    columns = mx.arange(offset + n)[None, :]
    queries = mx.arange(offset, offset + n)[:, None]
    return (queries >= columns) & (queries < columns + window)


def _columns(planes: Planes, start: int, stop: int | None = None) -> Planes:
    return tuple(p[:, :, start:stop] for p in planes)


def _owned(planes: Planes) -> Planes:
    """New arrays for ``planes``: an in-place write into them never reaches the caller's."""
    return tuple(mx.array(p) for p in planes)


def _concat(first: Planes, second: Planes) -> Planes:
    return tuple(mx.concatenate([a, b], axis=2) for a, b in zip(first, second, strict=True))


class RingCache(PlaneHolder):
    """A serial ring over ``codec`` holding a request's newest ``max_size`` tokens."""

    codec: Codec
    signature_text: ClassVar[str]

    def __init__(self, max_size: int) -> None:
        self.max_size = as_count(max_size, "max_size", minimum=1)
        self._keys: Planes | None = None
        self._values: Planes | None = None
        self._offset = 0
        self._idx = 0
        self._geometry: KvGeometry | None = None

    # -- what the ring holds ----------------------------------------------------------
    @property
    def geometry(self) -> KvGeometry | None:
        return self._geometry

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def ring_index(self) -> int:
        return self._idx

    @property
    def rows(self) -> int:
        return 0 if self._keys is None else int(self._keys[0].shape[0])

    @property
    def buffer_length(self) -> int:
        return 0 if self._keys is None else int(self._keys[0].shape[2])

    def signature(self) -> str:
        return self.signature_text

    def _temporal(self, planes: Planes) -> Planes:
        """The buffer in temporal order (used columns only)."""
        length = int(planes[0].shape[2])
        if self._idx == length:
            return planes
        if self._idx < self._offset:
            return _concat(_columns(planes, self._idx), _columns(planes, 0, self._idx))
        return _columns(planes, 0, self._idx)

    def window(self) -> tuple[Planes, Planes] | None:
        """The newest ``min(offset, max_size)`` tokens' planes in temporal order."""
        if self._keys is None or self._values is None or self._offset == 0:
            return None
        keep = min(self._offset, self.max_size)
        keys, values = self._temporal(self._keys), self._temporal(self._values)
        return _columns(keys, int(keys[0].shape[2]) - keep), _columns(
            values, int(values[0].shape[2]) - keep
        )

    # -- protocol ---------------------------------------------------------------------------
    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        geometry = check_block(
            tuple(keys.shape) if isinstance(keys, mx.array) else (),
            tuple(values.shape) if isinstance(values, mx.array) else (),
            dtype_name(keys),
            dtype_name(values),
            rows=self.rows or None,
            geometry=self._geometry,
        )
        self.codec.check(geometry)
        self._geometry = geometry
        new_k, new_v = self.codec.encode(keys), self.codec.encode(values)
        if int(keys.shape[2]) == 1:
            self._write_in_place(new_k, new_v, geometry)
        else:
            self._write_block(new_k, new_v, int(keys.shape[2]))
        return self.fetch()

    def _write_in_place(self, new_k: Planes, new_v: Planes, geometry: KvGeometry) -> None:
        prev = self._offset
        if (
            self._keys is None
            or self._values is None
            or (prev >= self.buffer_length and self.buffer_length < self.max_size)
        ):
            grow = min(STEP, self.max_size - prev)
            rows, heads = int(new_k[0].shape[0]), geometry.heads
            zeros_k = self.codec.zeros(rows, heads, grow, geometry.key_dim, geometry.dtype)
            zeros_v = self.codec.zeros(rows, heads, grow, geometry.value_dim, geometry.dtype)
            self._keys = zeros_k if self._keys is None else _concat(self._keys, zeros_k)
            self._values = zeros_v if self._values is None else _concat(self._values, zeros_v)
            self._idx = prev
        assert self._keys is not None and self._values is not None
        overshoot = self.buffer_length - self.max_size
        if overshoot > 0:
            self._keys = _columns(self._keys, overshoot)
            self._values = _columns(self._values, overshoot)
            self._idx = self.max_size
        if self._idx == self.max_size:
            self._idx = 0
        for planes, new in ((self._keys, new_k), (self._values, new_v)):
            for plane, encoded in zip(planes, new, strict=True):
                plane[:, :, self._idx : self._idx + 1] = encoded
        self._offset += 1
        self._idx += 1

    def _write_block(self, new_k: Planes, new_v: Planes, n: int) -> None:
        if self._keys is None or self._values is None:
            # Own copies: the plain codec's planes are the caller's arrays.
            self._keys, self._values = _owned(new_k), _owned(new_v)
        else:
            keys, values = self._temporal(self._keys), self._temporal(self._values)
            history = int(keys[0].shape[2])
            drop = max(0, history - self.max_size + 1)
            self._keys = _concat(_columns(keys, drop), new_k)
            self._values = _concat(_columns(values, drop), new_v)
        self._offset += n
        self._idx = self.buffer_length

    def fetch(self) -> tuple[Any, Any]:
        if self._keys is None or self._values is None:
            raise LayoutStateError("the ring holds no tokens yet: nothing to fetch")
        visible = min(self._offset, self.buffer_length)
        return (
            self.codec.fetched(_columns(self._keys, 0, visible)),
            self.codec.fetched(_columns(self._values, 0, visible)),
        )

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        """mlx-lm's ring policy: a block gets its windowed causal mask; one token needs none
        unless a window narrower than the ring is asked for."""
        count = as_count(n, "n", minimum=1)
        window = check_window(window_size) or self.max_size
        if count > 1:
            history = min(self.max_size - 1, self._offset)
            if history + count > window or return_array:
                return window_mask(count, history, window)
            return "causal"
        keys = min(self._offset + 1, self.max_size)
        if window < self.max_size and self._offset >= window:
            visible = (mx.arange(keys) >= keys - window)[None, :]
            shift = (0 if self._idx >= self.max_size else self._idx) + 1
            visible = mx.roll(visible, shift, -1)
            return visible
        if return_array:
            return mx.ones((1, keys), dtype=mx.bool_)
        return None

    def is_trimmable(self) -> bool:
        return self._offset < self.max_size

    def trim(self, n: int) -> int:
        count = as_count(n, "n")
        if count and not self.is_trimmable():
            raise NotTrimmableError(
                f"a ring that has wrapped (offset {self._offset} >= window {self.max_size}) "
                "cannot be trimmed: the overwritten tokens are gone"
            )
        count = min(count, self._offset)
        self._offset -= count
        self._idx -= count
        return count

    def adopt_window(
        self, keys: Planes, values: Planes, offset: int, geometry: KvGeometry | None
    ) -> RingCache:
        """Make this (empty) ring hold ``keys``/``values`` in temporal order, at ``offset``."""
        if self._keys is not None:
            raise LayoutStateError("adopt_window needs an empty ring")
        length = int(keys[0].shape[2])
        if length > offset:
            raise InvalidInputError(f"{length} tokens cannot sit below position {offset}")
        self._keys, self._values = keys, values
        self._offset, self._idx, self._geometry = offset, length, geometry
        return self

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_size={self.max_size}, offset={self._offset}, "
            f"idx={self._idx})"
        )


class RotatingKVCache(RingCache):
    """Serial plain sliding-window cache (``spec/RotatingKVCache.md``)."""

    codec = PlainCodec()
    signature_text = "kv:rotating-plain"


class RingLayout(RingRows, PlaneHolder):
    """Several requests' rings sharing one write column (mlx-lm's ``BatchRotatingKVCache``).

    Host-side state (``spec/BatchedRotatingCache.md``): per-row ``offsets`` (positions)
    and ``left_pad`` (columns before a row's oldest token; negative once the ring has
    overwritten them), the ring index ``idx``, the columns written since the last
    merge ``total``, and ``rotated`` (the ring has wrapped, so physical order is not
    temporal order). Joins re-merge every row (the rings' phases must agree); filters keep
    the padding (a ring's columns are its window).
    """

    codec: Codec
    serial_class: ClassVar[type[RingCache]]
    signature_text: ClassVar[str]

    def __init__(self, max_size: int) -> None:
        self.max_size = as_count(max_size, "max_size", minimum=1)
        self._keys: Planes | None = None
        self._values: Planes | None = None
        self._offsets: list[int] = []
        self._pads: list[int] = []
        self._idx = 0
        self._total = 0
        self._rotated = False
        self._geometry: KvGeometry | None = None

    # -- what the layout holds -------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self._offsets)

    @property
    def row_offsets(self) -> tuple[int, ...]:
        return tuple(self._offsets)

    @property
    def left_pad(self) -> tuple[int, ...]:
        return tuple(self._pads)

    @property
    def ring_state(self) -> tuple[int, int, bool]:
        """``(idx, total, rotated)``: the ring's write index, columns written, wrapped."""
        return self._idx, self._total, self._rotated

    @property
    def offset(self) -> mx.array:
        return mx.array(self._offsets, dtype=mx.int32)

    @property
    def buffer_length(self) -> int:
        return 0 if self._keys is None else int(self._keys[0].shape[2])

    def signature(self) -> str:
        return self.signature_text

    def make_empty_batch(self) -> RingLayout:
        return type(self)(self.max_size)

    def blank_row(self) -> RingCache:
        """An empty serial ring of this layout's window and codec."""
        return self.serial_class(self.max_size)

    def _accepts(self, source: object) -> bool:
        if isinstance(source, RingLayout | RingCache | RaggedRotatingRows):
            return source.codec.key == self.codec.key and source.max_size == self.max_size
        return False

    # -- reads ----------------------------------------------------------------------------
    def _chronological(self, planes: Planes) -> Planes:
        """The buffer's used columns in temporal order."""
        if self._rotated:
            return _concat(_columns(planes, self._idx), _columns(planes, 0, self._idx))
        return _columns(planes, 0, self._idx)

    def fetch(self) -> tuple[Any, Any]:
        if self._keys is None or self._values is None:
            raise LayoutStateError("the layout holds no tokens yet: nothing to fetch")
        visible = min(self._total, self.buffer_length)
        return (
            self.codec.fetched(_columns(self._keys, 0, visible)),
            self.codec.fetched(_columns(self._values, 0, visible)),
        )

    def row_window(self, row: int) -> tuple[Planes, Planes] | None:
        """Row ``row``'s newest ``min(offset, max_size)`` tokens in temporal order (views)."""
        from kvrows.validation import check_row

        index = check_row(row, self.batch_size)
        if self._keys is None or self._values is None:
            return None
        # Cut the row out first: reordering the whole ring would copy every row.
        keys = self._chronological(tuple(p[index : index + 1] for p in self._keys))
        values = self._chronological(tuple(p[index : index + 1] for p in self._values))
        active = int(keys[0].shape[2])
        start = max(0, self._pads[index], active - min(self._offsets[index], self.max_size))
        if start >= active:
            return None
        return (
            tuple(p[:, :, start:active] for p in keys),
            tuple(p[:, :, start:active] for p in values),
        )

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        """The windowed mask for the next ``n`` tokens, in the ring's physical column order."""
        count = as_count(n, "n", minimum=1)
        window = check_window(window_size) or self.max_size
        block = count > 1
        history_len = min(self.max_size - 1, self._total)
        size = history_len + count
        history = self.max_size if (block and self._rotated) else self._idx
        trimmed = max(0, history - self.max_size + (1 if block else 0))
        wrapping = not block and (self._rotated or self._idx >= self.max_size)
        pads = mx.array(self._pads) - trimmed - (1 if wrapping else 0)
        columns = mx.arange(size)[None, :]
        queries = mx.arange(history_len, size)[:, None]
        visible = (queries >= columns) & (queries < columns + window)
        visible = visible[None] & (columns[None] >= pads[:, None, None])
        if wrapping:
            shift = (0 if self._idx >= self.max_size else self._idx) + 1
            visible = mx.roll(visible, shift, -1)
        return visible[:, None]

    # -- writes --------------------------------------------------------------------------
    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        if not self._offsets:
            raise LayoutStateError("an empty layout takes no update: merge rows into it first")
        geometry = check_block(
            tuple(keys.shape) if isinstance(keys, mx.array) else (),
            tuple(values.shape) if isinstance(values, mx.array) else (),
            dtype_name(keys),
            dtype_name(values),
            rows=self.batch_size,
            geometry=self._geometry,
        )
        self.codec.check(geometry)
        self._geometry = geometry
        n = int(keys.shape[2])
        new_k, new_v = self.codec.encode(keys), self.codec.encode(values)
        if n == 1:
            self._write_in_place(new_k, new_v, geometry)
        else:
            self._write_block(new_k, new_v, n)
        self._offsets = [o + n for o in self._offsets]
        self._total += n
        return self.fetch()

    def _write_in_place(self, new_k: Planes, new_v: Planes, geometry: KvGeometry) -> None:
        prev = self._total
        if (
            self._keys is None
            or self._values is None
            or (prev >= self.buffer_length and self.buffer_length < self.max_size)
        ):
            grow = min(STEP, self.max_size - prev)
            rows, heads = self.batch_size, geometry.heads
            zeros_k = self.codec.zeros(rows, heads, grow, geometry.key_dim, geometry.dtype)
            zeros_v = self.codec.zeros(rows, heads, grow, geometry.value_dim, geometry.dtype)
            if self._keys is None or self._values is None:
                self._keys, self._values = zeros_k, zeros_v
            else:
                self._keys = _concat(_columns(self._keys, 0, prev), zeros_k)
                self._values = _concat(_columns(self._values, 0, prev), zeros_v)
            self._idx = prev
        assert self._keys is not None and self._values is not None
        overshoot = self.buffer_length - self.max_size
        if overshoot > 0:
            self._keys = _columns(self._keys, overshoot)
            self._values = _columns(self._values, overshoot)
            self._idx = self.max_size
            self._pads = [p - overshoot for p in self._pads]
        if self._idx == self.max_size:
            self._rotated = True
            self._idx = 0
        if self._rotated:
            self._pads = [p - 1 for p in self._pads]
        for planes, new in ((self._keys, new_k), (self._values, new_v)):
            for plane, encoded in zip(planes, new, strict=True):
                plane[:, :, self._idx : self._idx + 1] = encoded
        self._idx += 1

    def _write_block(self, new_k: Planes, new_v: Planes, n: int) -> None:
        if self._keys is None or self._values is None:
            # Every row is still empty (a merge of empty rows): the block starts the buffer.
            self._keys, self._values = _owned(new_k), _owned(new_v)
        else:
            keys, values = self._chronological(self._keys), self._chronological(self._values)
            history = int(keys[0].shape[2])
            drop = max(0, history - self.max_size + 1)
            self._keys = _concat(_columns(keys, drop), new_k)
            self._values = _concat(_columns(values, drop), new_v)
            self._pads = [p - drop for p in self._pads]
        self._rotated = False
        self._idx = self.buffer_length

    def _source_windows(
        self, source: object
    ) -> tuple[list[tuple[Planes | None, Planes | None, int]], KvGeometry | None]:
        if isinstance(source, RingLayout | RaggedRotatingRows):
            rows: list[tuple[Planes | None, Planes | None, int]] = []
            for r in range(source.batch_size):
                held = source.row_window(r)
                offset = source.row_offsets[r]
                rows.append((None, None, offset) if held is None else (held[0], held[1], offset))
            return rows, source.geometry
        assert isinstance(source, RingCache)
        held = source.window()
        if held is None:
            return [(None, None, source.offset)] * max(1, source.rows), source.geometry
        keys, values = held
        return [
            (tuple(p[b : b + 1] for p in keys), tuple(p[b : b + 1] for p in values), source.offset)
            for b in range(source.rows)
        ], source.geometry

    def merge_rows(self, rows: Sequence[Any]) -> None:
        """Form the batch, or join rows: every row (running and new) is re-aligned.

        Each row contributes its newest ``min(offset, max_size)`` tokens in temporal order,
        right-aligned to the longest; the ring restarts unrotated at that width.
        """
        from kvrows.validation import common_geometry

        if not isinstance(rows, Sequence) or isinstance(rows, str | bytes):
            raise InvalidInputError("merge_rows takes a sequence of caches")
        incoming: list[tuple[Planes | None, Planes | None, int]] = []
        geometries: list[KvGeometry | None] = [self._geometry]
        for source in rows:
            if not self._accepts(source):
                described = source.signature() if hasattr(source, "signature") else type(source)
                window = getattr(source, "max_size", None)
                raise IncompatibleRowsError(
                    f"{self.signature()} (window {self.max_size}) cannot merge {described}"
                    + (f" (window {window})" if window is not None else "")
                )
            windows, geometry = self._source_windows(source)
            incoming.extend(windows)
            geometries.append(geometry)
        geometry = common_geometry(geometries)
        if not incoming:
            return
        current, _ = self._source_windows(self) if self._offsets else ([], None)
        everything = current + incoming
        lengths = [0 if k is None else int(k[0].shape[2]) for k, _, _ in everything]
        width = max(lengths)
        self._geometry = geometry
        if width == 0 or geometry is None:
            self._keys = self._values = None
        else:
            self._keys = self._stack(
                [k for k, _, _ in everything], lengths, width, geometry.key_dim
            )
            self._values = self._stack(
                [v for _, v, _ in everything], lengths, width, geometry.value_dim
            )
        self._offsets = [offset for _, _, offset in everything]
        self._pads = [width - n for n in lengths]
        self._idx = self._total = width
        self._rotated = False

    def _stack(
        self, planes: list[Planes | None], lengths: list[int], width: int, dim: int
    ) -> Planes:
        geometry = self._geometry
        assert geometry is not None
        out = self.codec.zeros(len(planes), geometry.heads, width, dim, geometry.dtype)
        for row, (held, length) in enumerate(zip(planes, lengths, strict=True)):
            if held is None:
                continue
            for plane, src in zip(out, held, strict=True):
                plane[row : row + 1, :, width - length :] = src
        return out

    def filter_rows(self, keep: Sequence[int]) -> None:
        """Keep rows ``keep`` in that order (a ring keeps its padding)."""
        from kvrows.validation import check_keep

        order = check_keep(keep, self.batch_size)
        if not order:
            self._keys = self._values = None
            self._offsets, self._pads = [], []
            self._idx = self._total = 0
            self._rotated = False
            return
        if (
            self._keys is not None
            and self._values is not None
            and order != list(range(self.batch_size))
        ):
            index = mx.array(order)
            self._keys = tuple(p[index] for p in self._keys)
            self._values = tuple(p[index] for p in self._values)
        self._offsets = [self._offsets[i] for i in order]
        self._pads = [self._pads[i] for i in order]

    def extract_row(self, row: int) -> RingCache:
        from kvrows.optimized.storage import _compact

        held = self.row_window(row)
        cache = self.blank_row()
        if held is None:
            return cache
        keys = tuple(_compact(p) for p in held[0])
        values = tuple(_compact(p) for p in held[1])
        return cache.adopt_window(keys, values, self._offsets[row], self._geometry)

    def is_trimmable(self) -> bool:
        return self._total < self.max_size

    def trim(self, n: int) -> int:
        count = as_count(n, "n")
        if not count or not self._offsets:
            return 0
        if not self.is_trimmable():
            raise NotTrimmableError(
                f"a ring that has wrapped ({self._total} columns written, window "
                f"{self.max_size}) cannot be trimmed"
            )
        shortest = min(min(self._offsets), self._total)
        if count > shortest:
            raise NotTrimmableError(
                f"cannot trim {count} tokens: a row holds only {shortest} in this ring"
            )
        self._offsets = [o - count for o in self._offsets]
        self._total -= count
        self._idx -= count
        return count

    def check_valid(self) -> None:
        """Assert the layout's invariants (for tests)."""
        assert len(self._offsets) == len(self._pads)
        assert 0 <= self._idx <= max(self.buffer_length, self._total)
        if self._keys is not None:
            assert int(self._keys[0].shape[0]) == self.batch_size

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_size={self.max_size}, row_offsets={self.row_offsets}, "
            f"left_pad={self.left_pad}, idx={self._idx}, total={self._total}, "
            f"rotated={self._rotated})"
        )


class BatchedRotatingCache(RingLayout):
    """Decode layout of ``RotatingKVCache`` (``spec/BatchedRotatingCache.md``)."""

    codec = PlainCodec()
    serial_class = RotatingKVCache
    signature_text = "kv:rotating-plain"


class RotatingQuantizedKVCache(AffineParameters, RingCache):
    """Serial affine-quantized ring (``spec/RotatingQuantizedKVCache.md``)."""

    codec: AffineCodec

    def __init__(self, max_size: int, group_size: int = 64, bits: int = 8) -> None:
        super().__init__(max_size)
        self.codec = AffineCodec(group_size, bits)

    def signature(self) -> str:
        return f"kv:rotating-quant:{self.bits}:{self.group_size}"


class BatchedRotatingQuantCache(AffineParameters, RingLayout):
    """Decode layout of ``RotatingQuantizedKVCache`` (``spec/BatchedRotatingQuantCache.md``)."""

    codec: AffineCodec
    serial_class = RotatingQuantizedKVCache

    def __init__(self, max_size: int, group_size: int = 64, bits: int = 8) -> None:
        super().__init__(max_size)
        self.codec = AffineCodec(group_size, bits)

    def signature(self) -> str:
        return f"kv:rotating-quant:{self.bits}:{self.group_size}"

    def make_empty_batch(self) -> RingLayout:
        return type(self)(self.max_size, self.group_size, self.bits)

    def blank_row(self) -> RingCache:
        return RotatingQuantizedKVCache(self.max_size, self.group_size, self.bits)


class RotatingAffineLayout(BatchedRotatingQuantCache):
    """Prefill layout of ``RotatingQuantizedKVCache``: aligned rotating rows (``spec/RotatingAffineLayout.md``)."""

    def signature(self) -> str:
        return f"kv:rotating-affine:{self.max_size}:{self.group_size}:{self.bits}"


class RaggedRotatingRows(RingRows, PlaneHolder):
    """Prefill layout of ``RotatingKVCache``: ragged rings (``spec/RaggedRotatingRows.md``).

    Every row keeps its retained tokens left-aligned in temporal order (column 0 is its
    oldest retained token) and appends at its own end, with the serial ring's retention
    rule applied per row: a single token keeps the newest ``max_size``, a block keeps the
    newest ``max_size - 1`` and appends. Rows therefore advance independently (per-row
    rollback before the ring wraps), which a shared write column cannot do. This is the
    explicit stand-in for the delayed rotating layout the seed uses as this role.
    """

    codec: Codec = PlainCodec()
    serial_class: ClassVar[type[RingCache]] = RotatingKVCache
    signature_text: ClassVar[str] = "kv:ragged-rotating"

    def __init__(self, max_size: int) -> None:
        self.max_size = as_count(max_size, "max_size", minimum=1)
        self._keys: Planes | None = None
        self._values: Planes | None = None
        self._retained: list[int] = []
        self._offsets: list[int] = []
        self._geometry: KvGeometry | None = None

    @property
    def batch_size(self) -> int:
        return len(self._offsets)

    @property
    def row_offsets(self) -> tuple[int, ...]:
        return tuple(self._offsets)

    @property
    def left_pad(self) -> tuple[int, ...]:
        return (0,) * self.batch_size

    @property
    def retained(self) -> tuple[int, ...]:
        """Tokens each row holds (its newest ones)."""
        return tuple(self._retained)

    @property
    def offset(self) -> mx.array:
        return mx.array(self._offsets, dtype=mx.int32)

    def signature(self) -> str:
        return f"{self.signature_text}:{self.max_size}"

    def make_empty_batch(self) -> RaggedRotatingRows:
        return type(self)(self.max_size)

    def _accepts(self, source: object) -> bool:
        if isinstance(source, RaggedRotatingRows | RingLayout | RingCache):
            return source.codec.key == self.codec.key and source.max_size == self.max_size
        return False

    def fetch(self) -> tuple[Any, Any]:
        if self._keys is None or self._values is None:
            raise LayoutStateError("the layout holds no tokens yet: nothing to fetch")
        width = max(self._retained)
        return (
            self.codec.fetched(_columns(self._keys, 0, width)),
            self.codec.fetched(_columns(self._values, 0, width)),
        )

    def _after(self, n: int) -> list[int]:
        keep = self.max_size if n == 1 else self.max_size - 1
        if n == 1:
            return [min(r + 1, keep) for r in self._retained]
        return [min(r, keep) + n for r in self._retained]

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        """Row ``b``'s query ``i`` sits at column ``retained'[b] - n + i`` and sees its window."""
        count = as_count(n, "n", minimum=1)
        window = check_window(window_size) or self.max_size
        after = self._after(count)
        size = max(after, default=0)
        columns = mx.arange(size)[None, None, :]
        queries = (mx.array(after)[:, None] - count + mx.arange(count)[None, :])[:, :, None]
        visible = (columns <= queries) & (queries < columns + window)
        return visible[:, None]

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        if not self._offsets:
            raise LayoutStateError("an empty layout takes no update: merge rows into it first")
        geometry = check_block(
            tuple(keys.shape) if isinstance(keys, mx.array) else (),
            tuple(values.shape) if isinstance(values, mx.array) else (),
            dtype_name(keys),
            dtype_name(values),
            rows=self.batch_size,
            geometry=self._geometry,
        )
        self.codec.check(geometry)
        self._geometry = geometry
        n = int(keys.shape[2])
        keep = self.max_size if n == 1 else self.max_size - 1
        drops = [max(0, r + (1 if n == 1 else 0) - keep) for r in self._retained]
        if self._keys is not None and self._values is not None and any(drops):
            # Slide every row left by its own count in one gather.
            width = max(self._retained)
            index = mx.minimum(mx.arange(width)[None, :] + mx.array(drops)[:, None], width - 1)
            index = index[:, None, :, None]
            self._keys = self._slid(self._keys, index, width)
            self._values = self._slid(self._values, index, width)
        self._retained = [r - d for r, d in zip(self._retained, drops, strict=True)]
        needed = max(self._retained) + n
        if self._keys is None or self._values is None or needed > int(self._keys[0].shape[2]):
            self._grow(round_up(needed), geometry)
        assert self._keys is not None and self._values is not None
        new_k, new_v = self.codec.encode(keys), self.codec.encode(values)
        if len(set(self._retained)) == 1:
            start = self._retained[0]
            for planes, new in ((self._keys, new_k), (self._values, new_v)):
                for plane, encoded in zip(planes, new, strict=True):
                    plane[:, :, start : start + n] = encoded
        else:
            rows = mx.arange(self.batch_size)[:, None]
            columns = mx.array(self._retained)[:, None] + mx.arange(n)[None, :]
            for planes, new in ((self._keys, new_k), (self._values, new_v)):
                for plane, encoded in zip(planes, new, strict=True):
                    plane[rows, :, columns] = mx.swapaxes(encoded, 1, 2)
        self._retained = [r + n for r in self._retained]
        self._offsets = [o + n for o in self._offsets]
        return self.fetch()

    @staticmethod
    def _slid(planes: Planes, index: mx.array, width: int) -> Planes:
        out = []
        for plane in planes:
            moved = mx.take_along_axis(plane[:, :, :width], index, axis=2)
            plane[:, :, :width] = moved
            out.append(plane)
        return tuple(out)

    def _grow(self, capacity: int, geometry: KvGeometry) -> None:
        rows, heads = self.batch_size, geometry.heads
        width = max(self._retained)

        def grown(old: Planes | None, dim: int) -> Planes:
            fresh = self.codec.zeros(rows, heads, capacity, dim, geometry.dtype)
            if old is None or width == 0:
                return fresh
            for new, plane in zip(fresh, old, strict=True):
                new[:, :, :width] = plane[:, :, :width]
            return fresh

        self._keys = grown(self._keys, geometry.key_dim)
        self._values = grown(self._values, geometry.value_dim)

    def row_window(self, row: int) -> tuple[Planes, Planes] | None:
        from kvrows.validation import check_row

        index = check_row(row, self.batch_size)
        held = self._retained[index]
        if self._keys is None or self._values is None or held == 0:
            return None
        start = held - min(held, self._offsets[index], self.max_size)
        return (
            tuple(p[index : index + 1, :, start:held] for p in self._keys),
            tuple(p[index : index + 1, :, start:held] for p in self._values),
        )

    def merge_rows(self, rows: Sequence[Any]) -> None:
        """Form the batch or join rows: each row keeps its newest window, left-aligned."""
        from kvrows.validation import common_geometry

        if not isinstance(rows, Sequence) or isinstance(rows, str | bytes):
            raise InvalidInputError("merge_rows takes a sequence of caches")
        incoming: list[tuple[Planes | None, Planes | None, int]] = []
        geometries: list[KvGeometry | None] = [self._geometry]
        for source in rows:
            if not self._accepts(source):
                described = source.signature() if hasattr(source, "signature") else type(source)
                raise IncompatibleRowsError(
                    f"{self.signature()} (window {self.max_size}) cannot merge {described}"
                )
            if isinstance(source, RaggedRotatingRows | RingLayout):
                for r in range(source.batch_size):
                    held = source.row_window(r)
                    incoming.append(
                        (None, None, source.row_offsets[r])
                        if held is None
                        else (held[0], held[1], source.row_offsets[r])
                    )
            else:
                assert isinstance(source, RingCache)
                window = source.window()
                if window is None:
                    incoming.append((None, None, source.offset))
                else:
                    incoming.extend(
                        (
                            tuple(p[b : b + 1] for p in window[0]),
                            tuple(p[b : b + 1] for p in window[1]),
                            source.offset,
                        )
                        for b in range(source.rows)
                    )
            geometries.append(source.geometry)
        geometry = common_geometry(geometries)
        if not incoming:
            return
        current = [
            (*(self.row_window(b) or (None, None)), self._offsets[b])
            for b in range(self.batch_size)
        ]
        everything: list[tuple[Planes | None, Planes | None, int]] = [
            (k, v, o) for k, v, o in current
        ] + incoming
        lengths = [0 if k is None else int(k[0].shape[2]) for k, _, _ in everything]
        self._geometry = geometry
        width = max(lengths)
        if geometry is None or width == 0:
            self._keys = self._values = None
        else:
            capacity = round_up(width + 1)
            planes_k = self.codec.zeros(
                len(everything), geometry.heads, capacity, geometry.key_dim, geometry.dtype
            )
            planes_v = self.codec.zeros(
                len(everything), geometry.heads, capacity, geometry.value_dim, geometry.dtype
            )
            for row, ((k, v, _), length) in enumerate(zip(everything, lengths, strict=True)):
                if k is None or v is None:
                    continue
                for planes, src in ((planes_k, k), (planes_v, v)):
                    for plane, piece in zip(planes, src, strict=True):
                        plane[row : row + 1, :, :length] = piece
            self._keys, self._values = planes_k, planes_v
        self._retained = lengths
        self._offsets = [o for _, _, o in everything]

    def filter_rows(self, keep: Sequence[int]) -> None:
        from kvrows.validation import check_keep

        order = check_keep(keep, self.batch_size)
        if not order:
            self._keys = self._values = None
            self._retained, self._offsets = [], []
            return
        if (
            self._keys is not None
            and self._values is not None
            and order != list(range(self.batch_size))
        ):
            index = mx.array(order)
            self._keys = tuple(p[index] for p in self._keys)
            self._values = tuple(p[index] for p in self._values)
        self._retained = [self._retained[i] for i in order]
        self._offsets = [self._offsets[i] for i in order]

    def extract_row(self, row: int) -> RingCache:
        from kvrows.optimized.storage import _compact

        held = self.row_window(row)
        cache = self.serial_class(self.max_size)
        if held is None:
            return cache
        keys = tuple(_compact(p) for p in held[0])
        values = tuple(_compact(p) for p in held[1])
        return cache.adopt_window(keys, values, self._offsets[row], self._geometry)

    def is_trimmable(self) -> bool:
        return all(o < self.max_size for o in self._offsets)

    def trim(self, n: int) -> int:
        count = as_count(n, "n")
        return self.trim_rows([count] * self.batch_size) if self._offsets else 0

    def trim_rows(self, counts: Sequence[int]) -> int:
        """Forget ``counts[b]`` newest tokens of row ``b``; only rows that never wrapped."""
        wanted = check_counts(counts, self.batch_size)
        for b, (count, offset) in enumerate(zip(wanted, self._offsets, strict=True)):
            if count and offset >= self.max_size:
                raise NotTrimmableError(
                    f"row {b} has wrapped (offset {offset} >= window {self.max_size})"
                )
            if count > offset:
                raise NotTrimmableError(f"cannot trim {count} tokens from row {b} ({offset})")
        self._retained = [r - c for r, c in zip(self._retained, wanted, strict=True)]
        self._offsets = [o - c for o, c in zip(self._offsets, wanted, strict=True)]
        return max(wanted, default=0)

    def check_valid(self) -> None:
        assert len(self._retained) == len(self._offsets)
        assert all(0 <= r <= o for r, o in zip(self._retained, self._offsets, strict=True))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_size={self.max_size}, row_offsets={self.row_offsets}, "
            f"retained={self.retained})"
        )
