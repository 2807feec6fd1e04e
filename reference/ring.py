"""Sliding-window storage, reference: a serial ring as the tokens it retains.

The reference keeps the retained tokens in temporal order and no ring at all: a single
token keeps the newest ``max_size`` tokens; a block of ``N > 1`` keeps the newest
``max_size - 1`` and appends the block (so the block's first query still sees a whole
window and the storage briefly holds more than ``max_size`` tokens). Reads are in
temporal order; a fast ring hands the same tokens out in physical (rotated) order, which
attention does not see (a single token attends to every retained token).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from kvrows.common import AffineParameters, PlaneHolder, RingRows, check_counts
from kvrows.errors import (
    IncompatibleRowsError,
    InvalidInputError,
    LayoutStateError,
    NotTrimmableError,
)
from kvrows.protocols import Mask
from kvrows.reference.codecs import AffineCodec, Codec, PlainCodec, Planes, dtype_name
from kvrows.validation import KvGeometry, as_count, check_block, check_window

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


def window_mask(n: int, offset: int, window: int) -> npt.NDArray[np.bool_]:
    """``[n, offset + n]``: query ``i`` (position ``offset + i``) sees ``j`` in its window."""
    columns = np.arange(offset + n)[None, :]
    queries = np.arange(offset, offset + n)[:, None]
    visible: npt.NDArray[np.bool_] = (queries >= columns) & (queries < columns + window)
    return visible


def _newest(planes: Planes, keep: int) -> Planes:
    length = int(planes[0].shape[2])
    return tuple(np.array(p[:, :, max(0, length - keep) :], copy=True) for p in planes)


def _concat(first: Planes, second: Planes) -> Planes:
    return tuple(np.concatenate([a, b], axis=2) for a, b in zip(first, second, strict=True))


class RingCache(PlaneHolder):
    """A serial ring over ``codec``: the tokens it retains, oldest first."""

    codec: Codec
    signature_text: ClassVar[str]

    def __init__(self, max_size: int) -> None:
        self.max_size = as_count(max_size, "max_size", minimum=1)
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
    def retained(self) -> int:
        """Tokens held (at most ``max_size``, or ``max_size - 1 + N`` right after a block)."""
        return 0 if self._keys is None else int(self._keys[0].shape[2])

    @property
    def rows(self) -> int:
        return 0 if self._keys is None else int(self._keys[0].shape[0])

    def signature(self) -> str:
        return self.signature_text

    def window(self) -> tuple[Planes, Planes] | None:
        """The newest ``min(offset, max_size)`` tokens' planes in temporal order."""
        if self._keys is None or self._values is None or self._offset == 0:
            return None
        keep = min(self._offset, self.max_size)
        return _newest(self._keys, keep), _newest(self._values, keep)

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        geometry = check_block(
            keys.shape if isinstance(keys, np.ndarray) else (),
            values.shape if isinstance(values, np.ndarray) else (),
            dtype_name(keys),
            dtype_name(values),
            rows=self.rows or None,
            geometry=self._geometry,
        )
        self.codec.check(geometry)
        n = int(keys.shape[2])
        new_k, new_v = self.codec.encode(keys), self.codec.encode(values)
        if self._keys is None or self._values is None:
            self._keys, self._values = new_k, new_v
        else:
            history = self.max_size if n == 1 else self.max_size - 1
            self._keys = _concat(_newest(self._keys, history), new_k)
            self._values = _concat(_newest(self._values, history), new_v)
        if n == 1:
            self._keys = _newest(self._keys, self.max_size)
            self._values = _newest(self._values, self.max_size)
        self._offset += n
        self._geometry = geometry
        return self.fetch()

    def fetch(self) -> tuple[Any, Any]:
        if self._keys is None or self._values is None:
            raise LayoutStateError("the ring holds no tokens yet: nothing to fetch")
        return self.codec.fetched(self._keys), self.codec.fetched(self._values)

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
            visible = (np.arange(keys) >= keys - window)[None, :]
            # the reference reads in temporal order: no roll
            return visible
        if return_array:
            return np.ones((1, keys), dtype=np.bool_)
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
        if count and self._keys is not None and self._values is not None:
            keep = self.retained - count
            self._keys = tuple(np.array(p[:, :, :keep], copy=True) for p in self._keys)
            self._values = tuple(np.array(p[:, :, :keep], copy=True) for p in self._values)
        self._offset -= count
        return count

    def adopt_window(
        self, keys: Planes, values: Planes, offset: int, geometry: KvGeometry | None
    ) -> RingCache:
        """Make this (empty) ring hold copies of ``keys``/``values`` (temporal), at ``offset``."""
        if self._keys is not None:
            raise LayoutStateError("adopt_window needs an empty ring")
        if int(keys[0].shape[2]) > offset:
            raise InvalidInputError(f"{keys[0].shape[2]} tokens cannot sit below position {offset}")
        self._keys = tuple(np.array(p, copy=True) for p in keys)
        self._values = tuple(np.array(p, copy=True) for p in values)
        self._offset, self._geometry = offset, geometry
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_size={self.max_size}, offset={self._offset})"


class RotatingKVCache(RingCache):
    """Serial plain sliding-window cache (``spec/RotatingKVCache.md``)."""

    codec = PlainCodec()
    signature_text = "kv:rotating-plain"


class RingLayout(RingRows):
    """Several requests' rings sharing one write column: each row is a serial ring.

    The reference keeps every row as its own ``RingCache`` (its retained tokens, oldest
    first) and derives the batch's physical image from three integers: ``active`` (the
    columns a read returns), ``phase`` (the physical column of the oldest one once the
    ring has wrapped) and ``total`` (columns written since the last merge). Row ``b``'s
    newest ``min(retained, active)`` tokens fill the last temporal columns; the physical
    image is the temporal one rolled by ``phase``. ``left_pad`` follows mlx-lm's
    bookkeeping (it goes negative once pads are overwritten) and is checked against the
    retained counts in ``check_valid``.
    """

    codec: Codec
    serial_class: ClassVar[type[RingCache]]
    signature_text: ClassVar[str]

    def __init__(self, max_size: int) -> None:
        self.max_size = as_count(max_size, "max_size", minimum=1)
        self._rows: list[RingCache] = []
        self._pads: list[int] = []
        self._active = 0
        self._phase = 0
        self._total = 0
        self._holds = False  # a ring buffer exists (some row held a token since the merge)
        self._geometry: KvGeometry | None = None

    @property
    def batch_size(self) -> int:
        return len(self._rows)

    @property
    def row_offsets(self) -> tuple[int, ...]:
        return tuple(row.offset for row in self._rows)

    @property
    def left_pad(self) -> tuple[int, ...]:
        return tuple(self._pads)

    @property
    def offset(self) -> npt.NDArray[np.int32]:
        return np.array(self.row_offsets, dtype=np.int32)

    @property
    def nbytes(self) -> int:
        return sum(row.nbytes for row in self._rows)

    @property
    def state(self) -> tuple[Any, ...]:
        return tuple(plane for row in self._rows for plane in row.state)

    @property
    def state_needs_dispose(self) -> bool:
        return False

    def signature(self) -> str:
        return self.signature_text

    def make_empty_batch(self) -> RingLayout:
        return type(self)(self.max_size)

    def blank_row(self) -> RingCache:
        return self.serial_class(self.max_size)

    def _accepts(self, source: object) -> bool:
        if isinstance(source, RingLayout | RingCache | RaggedRotatingRows):
            return source.codec.key == self.codec.key and source.max_size == self.max_size
        return False

    # -- reads --------------------------------------------------------------------------
    def _shown(self, row: RingCache) -> int:
        return min(row.retained, self._active)

    def _image(self, which: int) -> Planes:
        geometry = self._geometry
        if geometry is None or not self._holds:
            raise LayoutStateError("the layout holds no tokens yet: nothing to fetch")
        dim = geometry.key_dim if which == 0 else geometry.value_dim
        template = self.codec.empty(1, geometry.heads, dim, geometry.dtype)
        active = self._active
        out = [
            np.zeros((self.batch_size, p.shape[1], active, *p.shape[3:]), dtype=p.dtype)
            for p in template
        ]
        for b, row in enumerate(self._rows):
            shown = self._shown(row)
            if not shown:
                continue
            held = row.state[: len(template)] if which == 0 else row.state[len(template) :]
            for dst, src in zip(out, held, strict=True):
                dst[b, :, active - shown :] = src[0, :, src.shape[2] - shown :]
        return tuple(np.roll(p, self._phase, axis=2) for p in out)

    def fetch(self) -> tuple[Any, Any]:
        return self.codec.fetched(self._image(0)), self.codec.fetched(self._image(1))

    def row_window(self, row: int) -> tuple[Planes, Planes] | None:
        """Row ``row``'s newest ``min(offset, max_size)`` tokens in temporal order."""
        from kvrows.validation import check_row

        entry = self._rows[check_row(row, self.batch_size)]
        return entry.window()

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        """Query ``i`` sees the keys of its window that hold its row's real tokens."""
        count = as_count(n, "n", minimum=1)
        window = check_window(window_size) or self.max_size
        size = self._active_after(count)
        phase = self._phase_after(count)
        columns = np.arange(size)[None, None, :]
        queries = np.arange(size - count, size)[None, :, None]
        real = np.array(
            [min(self._retained_after(row, count), size) for row in self._rows], dtype=np.int64
        )
        visible = (
            (queries >= columns)
            & (queries < columns + window)
            & (columns >= (size - real)[:, None, None])
        )
        rolled: npt.NDArray[np.bool_] = np.roll(visible, phase, axis=2)[:, None]
        return rolled

    # -- the ring's bookkeeping, as functions of the next block size -------------------------
    def _active_after(self, n: int) -> int:
        if n == 1:
            return min(self._active + 1, self.max_size)
        return min(self._active, self.max_size - 1) + n

    def _phase_after(self, n: int) -> int:
        if n > 1:
            return 0
        if self._active >= self.max_size:  # full: the write replaces the oldest column
            start = 0 if self._active > self.max_size else self._phase
            return (start + 1) % self.max_size
        return self._phase

    def _retained_after(self, row: RingCache, n: int) -> int:
        """The serial ring's rule: a token keeps the newest window, a block its history."""
        if n == 1:
            return min(row.retained + 1, self.max_size)
        return min(row.retained, self.max_size - 1) + n

    # -- writes ----------------------------------------------------------------------------
    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        if not self._rows:
            raise LayoutStateError("an empty layout takes no update: merge rows into it first")
        geometry = check_block(
            keys.shape if isinstance(keys, np.ndarray) else (),
            values.shape if isinstance(values, np.ndarray) else (),
            dtype_name(keys),
            dtype_name(values),
            rows=self.batch_size,
            geometry=self._geometry,
        )
        self.codec.check(geometry)
        n = int(keys.shape[2])
        active, phase = self._active_after(n), self._phase_after(n)
        if n == 1:
            overshoot = max(0, self._active - self.max_size)
            wrapped = 1 if self._active >= self.max_size else 0
            self._pads = [p - overshoot - wrapped for p in self._pads]
        else:
            drop = max(0, self._active - self.max_size + 1)
            self._pads = [p - drop for p in self._pads]
        for b, row in enumerate(self._rows):
            row.update_and_fetch(keys[b : b + 1], values[b : b + 1])
        self._active, self._phase = active, phase
        self._total += n
        self._holds = True
        self._geometry = geometry
        return self.fetch()

    def merge_rows(self, rows: Sequence[Any]) -> None:
        """Form the batch, or join rows: every row is re-aligned to the longest window."""
        from kvrows.validation import common_geometry

        if not isinstance(rows, Sequence) or isinstance(rows, str | bytes):
            raise InvalidInputError("merge_rows takes a sequence of caches")
        incoming: list[RingCache] = []
        geometries: list[KvGeometry | None] = [self._geometry]
        for source in rows:
            if not self._accepts(source):
                described = source.signature() if hasattr(source, "signature") else type(source)
                window = getattr(source, "max_size", None)
                raise IncompatibleRowsError(
                    f"{self.signature()} (window {self.max_size}) cannot merge {described}"
                    + (f" (window {window})" if window is not None else "")
                )
            if isinstance(source, RingLayout | RaggedRotatingRows):
                incoming.extend(source.extract_row(b) for b in range(source.batch_size))
                geometries.append(source.geometry)
            else:
                assert isinstance(source, RingCache)
                incoming.extend(self._split(source))
                geometries.append(source.geometry)
        geometry = common_geometry(geometries)
        if not incoming:
            return
        everything = [self.extract_row(b) for b in range(self.batch_size)] + incoming
        width = max(row.retained for row in everything)
        self._rows = everything
        self._pads = [width - row.retained for row in everything]
        self._active = self._total = width
        self._phase = 0
        self._holds = width > 0
        self._geometry = geometry

    def _split(self, source: RingCache) -> list[RingCache]:
        held = source.window()
        if held is None:
            return [self.blank_row() for _ in range(max(1, source.rows))]
        keys, values = held
        return [
            self.blank_row().adopt_window(
                tuple(p[b : b + 1] for p in keys),
                tuple(p[b : b + 1] for p in values),
                source.offset,
                source.geometry,
            )
            for b in range(source.rows)
        ]

    def filter_rows(self, keep: Sequence[int]) -> None:
        from kvrows.validation import check_keep

        order = check_keep(keep, self.batch_size)
        if not order:
            self._rows, self._pads = [], []
            self._active = self._phase = self._total = 0
            self._holds = False
            return
        self._rows = [self._rows[i] for i in order]
        self._pads = [self._pads[i] for i in order]

    def extract_row(self, row: int) -> RingCache:
        from kvrows.validation import check_row

        entry = self._rows[check_row(row, self.batch_size)]
        held = entry.window()
        if held is None:
            return self.blank_row()
        return self.blank_row().adopt_window(held[0], held[1], entry.offset, self._geometry)

    def is_trimmable(self) -> bool:
        return self._total < self.max_size

    def trim(self, n: int) -> int:
        count = as_count(n, "n")
        if not count or not self._rows:
            return 0
        if not self.is_trimmable():
            raise NotTrimmableError(
                f"a ring that has wrapped ({self._total} columns written, window "
                f"{self.max_size}) cannot be trimmed"
            )
        shortest = min(min(self.row_offsets), self._total)
        if count > shortest:
            raise NotTrimmableError(
                f"cannot trim {count} tokens: a row holds only {shortest} in this ring"
            )
        for row in self._rows:
            row.trim(count)
        self._active -= count
        self._total -= count
        return count

    def check_valid(self) -> None:
        """The mlx-lm style pads agree with the rows' retained tokens."""
        for pad, row in zip(self._pads, self._rows, strict=True):
            assert max(0, pad) == self._active - self._shown(row), (pad, row, self._active)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_size={self.max_size}, row_offsets={self.row_offsets}, "
            f"left_pad={self.left_pad}, active={self._active}, phase={self._phase})"
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


class RaggedRotatingRows(RingRows):
    """Prefill layout of ``RotatingKVCache``: each row a serial ring, left-aligned.

    A read places row ``b``'s retained tokens at columns ``[0, retained[b])``; its query
    ``i`` sits at column ``retained[b] - n + i`` and sees the keys of its window there.
    """

    codec: Codec = PlainCodec()
    serial_class: ClassVar[type[RingCache]] = RotatingKVCache
    signature_text: ClassVar[str] = "kv:ragged-rotating"

    def __init__(self, max_size: int) -> None:
        self.max_size = as_count(max_size, "max_size", minimum=1)
        self._rows: list[RingCache] = []
        self._holds = False  # a buffer exists (some row held a token since the merge)
        self._geometry: KvGeometry | None = None

    @property
    def batch_size(self) -> int:
        return len(self._rows)

    @property
    def row_offsets(self) -> tuple[int, ...]:
        return tuple(row.offset for row in self._rows)

    @property
    def left_pad(self) -> tuple[int, ...]:
        return (0,) * self.batch_size

    @property
    def retained(self) -> tuple[int, ...]:
        return tuple(row.retained for row in self._rows)

    @property
    def offset(self) -> npt.NDArray[np.int32]:
        return np.array(self.row_offsets, dtype=np.int32)

    @property
    def nbytes(self) -> int:
        return sum(row.nbytes for row in self._rows)

    @property
    def state(self) -> tuple[Any, ...]:
        return tuple(plane for row in self._rows for plane in row.state)

    @property
    def state_needs_dispose(self) -> bool:
        return False

    def signature(self) -> str:
        return f"{self.signature_text}:{self.max_size}"

    def make_empty_batch(self) -> RaggedRotatingRows:
        return type(self)(self.max_size)

    def _accepts(self, source: object) -> bool:
        if isinstance(source, RaggedRotatingRows | RingLayout | RingCache):
            return source.codec.key == self.codec.key and source.max_size == self.max_size
        return False

    def fetch(self) -> tuple[Any, Any]:
        geometry = self._geometry
        if geometry is None or not self._rows or not self._holds:
            raise LayoutStateError("the layout holds no tokens yet: nothing to fetch")
        width = max(self.retained)
        images = []
        for which, dim in ((0, geometry.key_dim), (1, geometry.value_dim)):
            template = self.codec.empty(1, geometry.heads, dim, geometry.dtype)
            out = [
                np.zeros((self.batch_size, p.shape[1], width, *p.shape[3:]), dtype=p.dtype)
                for p in template
            ]
            for b, row in enumerate(self._rows):
                if not row.state:
                    continue  # a row that holds no token reads as padding
                held = row.state[: len(template)] if which == 0 else row.state[len(template) :]
                for dst, src in zip(out, held, strict=True):
                    dst[b, :, : src.shape[2]] = src[0]
            images.append(self.codec.fetched(tuple(out)))
        return images[0], images[1]

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        count = as_count(n, "n", minimum=1)
        window = check_window(window_size) or self.max_size
        after = []
        for row in self._rows:
            if count == 1:
                after.append(min(row.retained + 1, self.max_size))
            else:
                after.append(min(row.retained, self.max_size - 1) + count)
        size = max(after, default=0)
        visible = np.zeros((self.batch_size, 1, count, size), dtype=bool)
        for b, end in enumerate(after):
            for i in range(count):
                query = end - count + i
                first = max(0, query - window + 1)
                visible[b, 0, i, first : query + 1] = True
        return visible

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        if not self._rows:
            raise LayoutStateError("an empty layout takes no update: merge rows into it first")
        geometry = check_block(
            keys.shape if isinstance(keys, np.ndarray) else (),
            values.shape if isinstance(values, np.ndarray) else (),
            dtype_name(keys),
            dtype_name(values),
            rows=self.batch_size,
            geometry=self._geometry,
        )
        self.codec.check(geometry)
        for b, row in enumerate(self._rows):
            row.update_and_fetch(keys[b : b + 1], values[b : b + 1])
        self._geometry = geometry
        self._holds = True
        return self.fetch()

    def row_window(self, row: int) -> tuple[Planes, Planes] | None:
        from kvrows.validation import check_row

        return self._rows[check_row(row, self.batch_size)].window()

    def merge_rows(self, rows: Sequence[Any]) -> None:
        from kvrows.validation import common_geometry

        if not isinstance(rows, Sequence) or isinstance(rows, str | bytes):
            raise InvalidInputError("merge_rows takes a sequence of caches")
        incoming: list[RingCache] = []
        geometries: list[KvGeometry | None] = [self._geometry]
        for source in rows:
            if not self._accepts(source):
                described = source.signature() if hasattr(source, "signature") else type(source)
                raise IncompatibleRowsError(
                    f"{self.signature()} (window {self.max_size}) cannot merge {described}"
                )
            if isinstance(source, RaggedRotatingRows | RingLayout):
                incoming.extend(source.extract_row(b) for b in range(source.batch_size))
            else:
                assert isinstance(source, RingCache)
                window = source.window()
                if window is None:
                    incoming.append(self.serial_class(self.max_size))
                else:
                    incoming.extend(
                        self.serial_class(self.max_size).adopt_window(
                            tuple(p[b : b + 1] for p in window[0]),
                            tuple(p[b : b + 1] for p in window[1]),
                            source.offset,
                            source.geometry,
                        )
                        for b in range(source.rows)
                    )
            geometries.append(source.geometry)
        geometry = common_geometry(geometries)
        if not incoming:
            return
        self._rows = [self.extract_row(b) for b in range(self.batch_size)] + incoming
        self._holds = any(row.retained for row in self._rows)
        self._geometry = geometry

    def filter_rows(self, keep: Sequence[int]) -> None:
        from kvrows.validation import check_keep

        order = check_keep(keep, self.batch_size)
        self._rows = [self._rows[i] for i in order]
        self._holds = self._holds and bool(order)

    def extract_row(self, row: int) -> RingCache:
        from kvrows.validation import check_row

        entry = self._rows[check_row(row, self.batch_size)]
        held = entry.window()
        cache = self.serial_class(self.max_size)
        if held is None:
            return cache
        return cache.adopt_window(held[0], held[1], entry.offset, self._geometry)

    def is_trimmable(self) -> bool:
        return all(row.is_trimmable() for row in self._rows)

    def trim(self, n: int) -> int:
        count = as_count(n, "n")
        return self.trim_rows([count] * self.batch_size) if self._rows else 0

    def trim_rows(self, counts: Sequence[int]) -> int:
        wanted = check_counts(counts, self.batch_size)
        for b, (count, row) in enumerate(zip(wanted, self._rows, strict=True)):
            if count and not row.is_trimmable():
                raise NotTrimmableError(
                    f"row {b} has wrapped (offset {row.offset} >= window {self.max_size})"
                )
            if count > row.offset:
                raise NotTrimmableError(f"cannot trim {count} tokens from row {b} ({row.offset})")
        for count, row in zip(wanted, self._rows, strict=True):
            row.trim(count)
        return max(wanted, default=0)

    def check_valid(self) -> None:
        assert all(row.retained <= row.offset for row in self._rows)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_size={self.max_size}, row_offsets={self.row_offsets}, "
            f"retained={self.retained})"
        )
