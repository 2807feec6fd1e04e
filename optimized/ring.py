"""The ring geometry (sliding window): the newest ``max_size`` positions are kept.

Two physical designs, one per arrangement family (``spec/RotatingKVCache.md``,
``spec/BatchedRotatingCache.md``, ``spec/RaggedRotatingRows.md`` have the diagrams):

* :class:`SharedRing` (serial rings and shared-column ring layouts, mlx-lm's
  ``RotatingKVCache`` / ``BatchRotatingKVCache``): one buffer per plane
  ``[B, H, Sbuf, ·]`` and one ring index ``idx`` for every row. Single tokens are
  written in place at ``idx``; once the ring is full the index wraps and the oldest
  column is overwritten (``rotated``: physical order is no longer temporal order). A
  multi-token block puts the buffer in temporal order, keeps its newest
  ``max_size - 1`` columns (so the block's first query still sees a full window) and
  appends the block: the buffer can briefly hold more than ``max_size`` columns. Per
  row, ``left_pad`` counts the columns before its oldest token (negative once the ring
  has overwritten them); a join re-aligns every row (the rings' phases must agree). A
  serial ring is the same with every row at pad 0 and ``total == offset``.
* :class:`RaggedRing` (ragged ring layouts): every row keeps its retained tokens
  left-aligned in temporal order and appends at its own end, with the serial ring's
  retention rule per row, so rows advance (and roll back) independently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from kvrows.common import row_bytes
from kvrows.errors import NotTrimmableError, wrapped_ring_message
from kvrows.optimized.codecs import Planes
from kvrows.optimized.rows import RowWindow, Storage, owned
from kvrows.protocols import Mask
from kvrows.schemes import Ring
from kvrows.validation import STEP, KvGeometry, as_count, check_row, round_up

__all__ = ["RaggedRing", "RingGeometry", "SharedRing", "window_mask"]


def window_mask(n: int, offset: int, window: int) -> mx.array:
    """``[n, offset + n]``: query ``i`` (position ``offset + i``) sees ``j`` in its window."""
    columns = mx.arange(offset + n)[None, :]
    queries = mx.arange(offset, offset + n)[:, None]
    return (queries >= columns) & (queries < columns + window)


def _columns(planes: Planes, start: int, stop: int | None = None) -> Planes:
    return tuple(p[:, :, start:stop] for p in planes)


def _concat(first: Planes, second: Planes) -> Planes:
    return tuple(mx.concatenate([a, b], axis=2) for a, b in zip(first, second, strict=True))


def _stacked(
    codec: Any,
    rows: list[RowWindow],
    lengths: list[int],
    columns: int,
    geometry: KvGeometry,
    *,
    right_aligned: bool,
) -> tuple[Planes, Planes]:
    """Fresh key and value planes of ``columns`` tokens holding ``rows`` (their windows in
    time order), each right-aligned to ``columns`` or left-aligned at column 0."""
    count, heads, dtype = len(rows), geometry.heads, geometry.dtype
    keys = codec.zeros(count, heads, columns, geometry.key_dim, dtype)
    values = codec.zeros(count, heads, columns, geometry.value_dim, dtype)
    for row, ((k, v, _), length) in enumerate(zip(rows, lengths, strict=True)):
        if k is None or v is None or length == 0:
            continue
        start = columns - length if right_aligned else 0
        for planes, src in ((keys, k), (values, v)):
            for plane, piece in zip(planes, src, strict=True):
                plane[row : row + 1, :, start : start + length] = piece
    return keys, values


class RingGeometry(Storage):
    """What both ring designs share: the window, and what a ring layout answers."""

    geometry_kind = "ring"

    @property
    def max_size(self) -> int:
        assert isinstance(self._token_geometry, Ring)
        return self._token_geometry.max_size

    @property
    def keep(self) -> int:
        assert isinstance(self._token_geometry, Ring)
        return self._token_geometry.keep

    def can_publish_row(self, row: int, tokens: int) -> bool:
        """A prefix is publishable only before the ring wraps (a wrapped ring cannot be cut
        back)."""
        offset = self._offsets[check_row(row, len(self._offsets))]
        count = as_count(tokens, "tokens")
        return count == offset or (count < offset < self.max_size)

    def projected_bytes(self, tokens: int) -> int:
        return row_bytes(self.codec, self._geometry, tokens, self.max_size)

    @property
    def buffer_length(self) -> int:
        return 0 if self._keys is None else int(self._keys[0].shape[2])

    def window(self) -> tuple[Planes, Planes] | None:
        """A serial ring's newest ``min(offset, max_size)`` tokens in temporal order."""
        return self._window_pair(None)

    def row_window(self, row: int) -> tuple[Planes, Planes] | None:
        """Row ``row``'s newest ``min(offset, max_size)`` tokens in temporal order (views)."""
        return self._window_pair(check_row(row, len(self._offsets)))

    def _check_geometry(self) -> None:
        return None

    def _keep(self, order: list[int]) -> None:
        """Gather the kept rows; a ring keeps its padding (its columns are its window)."""
        if (
            self._keys is not None
            and self._values is not None
            and order != list(range(len(self._pads)))
        ):
            index = mx.array(order)
            self._keys = tuple(p[index] for p in self._keys)
            self._values = tuple(p[index] for p in self._values)
        self._pads = [self._pads[i] for i in order]


class SharedRing(RingGeometry):
    """One ring index for every row: serial rings and shared-column ring layouts.

    Host-side state: per-row ``offsets`` and ``pads``, the ring index ``idx``, the
    columns written since the last merge ``total``, and ``rotated``."""

    arrangements = frozenset({"serial", "shared"})

    _idx: int
    _total: int
    _rotated: bool

    def _reset_geometry(self) -> None:
        self._idx = self._total = 0
        self._rotated = False

    @property
    def ring_state(self) -> tuple[int, int, bool]:
        """``(idx, total, rotated)``: the ring's write index, columns written, wrapped."""
        return self._idx, self._total, self._rotated

    @property
    def ring_index(self) -> int:
        return self._idx

    def is_trimmable(self) -> bool:
        return self._total < self.max_size

    def _chronological(self, planes: Planes) -> Planes:
        """The buffer's used columns in temporal order."""
        if self._rotated:
            return _concat(_columns(planes, self._idx), _columns(planes, 0, self._idx))
        return _columns(planes, 0, self._idx)

    def _visible(self, planes: Planes) -> Planes:
        return _columns(planes, 0, min(self._total, self.buffer_length))

    def _window(self, planes: Planes, row: int | None) -> Planes | None:
        index = 0 if row is None else row
        # Cut the row out first: reordering the whole ring would copy every row.
        held = self._chronological(
            planes if row is None else tuple(p[row : row + 1] for p in planes)
        )
        active = int(held[0].shape[2])
        start = max(0, self._pads[index], active - min(self._offsets[index], self.max_size))
        return None if start >= active else _columns(held, start, active)

    def _append(self, keys: Planes, values: Planes, n: int, geometry: KvGeometry) -> None:
        if n == 1:
            self._write_token(keys, values, geometry)
        else:
            self._write_block(keys, values)
        self._total += n

    def _write_token(self, new_k: Planes, new_v: Planes, geometry: KvGeometry) -> None:
        prev = self._total
        if (
            self._keys is None
            or self._values is None
            or (prev >= self.buffer_length and self.buffer_length < self.max_size)
        ):
            grow = min(STEP, self.max_size - prev)
            rows, heads = len(self._offsets), geometry.heads
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

    def _write_block(self, new_k: Planes, new_v: Planes) -> None:
        if self._keys is None or self._values is None:
            # The block starts the buffer: an owned copy, never the caller's array (a
            # later in-place token write would change it).
            self._keys = tuple(owned(p) for p in new_k)
            self._values = tuple(owned(p) for p in new_v)
        else:
            keys, values = self._chronological(self._keys), self._chronological(self._values)
            drop = max(0, int(keys[0].shape[2]) - self.max_size + 1)
            self._keys = _concat(_columns(keys, drop), new_k)
            self._values = _concat(_columns(values, drop), new_v)
            self._pads = [p - drop for p in self._pads]
        self._rotated = False
        self._idx = self.buffer_length

    def _place(self, incoming: list[RowWindow], geometry: KvGeometry | None) -> None:
        """Every row (running and new) is re-aligned: each contributes its newest
        ``min(offset, max_size)`` tokens in temporal order, right-aligned to the longest;
        the ring restarts unrotated at that width."""
        everything = self._each_row() + incoming
        lengths = [0 if k is None else int(k[0].shape[2]) for k, _, _ in everything]
        width = max(lengths)
        if width == 0 or geometry is None:
            self._keys = self._values = None
        else:
            self._keys, self._values = _stacked(
                self.codec, everything, lengths, width, geometry, right_aligned=True
            )
        self._pads = [width - n for n in lengths]
        self._idx = self._total = width
        self._rotated = False

    def _check_trim(self, counts: Sequence[int]) -> None:
        if not self.is_trimmable():
            raise NotTrimmableError(
                wrapped_ring_message(f"a ring with {self._total} columns written", self.max_size)
            )

    def _forget(self, counts: Sequence[int]) -> None:
        self._total -= counts[0]
        self._idx -= counts[0]

    def _adopt(self, keys: Planes, values: Planes, offset: int) -> None:
        self._idx, self._total, self._rotated = int(keys[0].shape[2]), offset, False

    def _check_geometry(self) -> None:
        assert 0 <= self._idx <= max(self.buffer_length, self._total)
        if self._keys is not None:
            assert int(self._keys[0].shape[0]) == len(self._offsets)

    # -- masks ------------------------------------------------------------------------
    def _serial_mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        """mlx-lm's ring policy: a block gets its windowed causal mask; one token needs none
        unless a window narrower than the ring is asked for."""
        size = window or self.max_size
        offset = self._total
        if n > 1:
            history = min(self.max_size - 1, offset)
            if history + n > size or return_array:
                return window_mask(n, history, size)
            return "causal"
        keys = min(offset + 1, self.max_size)
        if size < self.max_size and offset >= size:
            visible = (mx.arange(keys) >= keys - size)[None, :]
            shift = (0 if self._idx >= self.max_size else self._idx) + 1
            return mx.roll(visible, shift, -1)
        if return_array:
            return mx.ones((1, keys), dtype=mx.bool_)
        return None

    def _layout_mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        """The windowed mask for the next ``n`` tokens, in the ring's physical column order."""
        size = window or self.max_size
        block = n > 1
        history_len = min(self.max_size - 1, self._total)
        width = history_len + n
        history = self.max_size if (block and self._rotated) else self._idx
        trimmed = max(0, history - self.max_size + (1 if block else 0))
        wrapping = not block and (self._rotated or self._idx >= self.max_size)
        pads = self.pads_array() - trimmed - (1 if wrapping else 0)
        columns = mx.arange(width)[None, :]
        queries = mx.arange(history_len, width)[:, None]
        visible = (queries >= columns) & (queries < columns + size)
        visible = visible[None] & (columns[None] >= pads[:, None, None])
        if wrapping:
            shift = (0 if self._idx >= self.max_size else self._idx) + 1
            visible = mx.roll(visible, shift, -1)
        return visible[:, None]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_size={self.max_size}, row_offsets={tuple(self._offsets)}, "
            f"left_pad={tuple(self._pads)}, idx={self._idx}, total={self._total}, "
            f"rotated={self._rotated})"
        )


class RaggedRing(RingGeometry):
    """Ragged ring rows: each row's retained tokens left-aligned in temporal order.

    A single token keeps the newest ``max_size``, a block keeps the newest
    ``max_size - 1`` and appends. This is the explicit stand-in for the delayed rotating
    layout the seed uses as this role."""

    arrangements = frozenset({"ragged"})

    _retained: list[int]

    def _reset_geometry(self) -> None:
        self._retained = []

    @property
    def left_pad(self) -> tuple[int, ...]:
        return (0,) * len(self._offsets)

    @property
    def retained(self) -> tuple[int, ...]:
        """Tokens each row holds (its newest ones)."""
        return tuple(self._retained)

    def is_trimmable(self) -> bool:
        return all(o < self.max_size for o in self._offsets)

    def _visible(self, planes: Planes) -> Planes:
        return _columns(planes, 0, max(self._retained))

    def _window(self, planes: Planes, row: int | None) -> Planes | None:
        assert row is not None
        held = self._retained[row]
        if held == 0:
            return None
        start = held - min(held, self._offsets[row], self.max_size)
        return tuple(p[row : row + 1, :, start:held] for p in planes)

    def _after(self, n: int) -> list[int]:
        if n == 1:
            return [min(r + 1, self.max_size) for r in self._retained]
        return [min(r, self.max_size - 1) + n for r in self._retained]

    def _append(self, keys: Planes, values: Planes, n: int, geometry: KvGeometry) -> None:
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
        if self._keys is None or self._values is None or needed > self.buffer_length:
            self._grow(round_up(needed), geometry)
        assert self._keys is not None and self._values is not None
        if len(set(self._retained)) == 1:
            start = self._retained[0]
            for planes, new in ((self._keys, keys), (self._values, values)):
                for plane, encoded in zip(planes, new, strict=True):
                    plane[:, :, start : start + n] = encoded
        else:
            rows = mx.arange(len(self._offsets))[:, None]
            columns = mx.array(self._retained)[:, None] + mx.arange(n)[None, :]
            for planes, new in ((self._keys, keys), (self._values, values)):
                for plane, encoded in zip(planes, new, strict=True):
                    plane[rows, :, columns] = mx.swapaxes(encoded, 1, 2)
        self._retained = [r + n for r in self._retained]

    @staticmethod
    def _slid(planes: Planes, index: mx.array, width: int) -> Planes:
        for plane in planes:
            plane[:, :, :width] = mx.take_along_axis(plane[:, :, :width], index, axis=2)
        return planes

    def _grow(self, capacity: int, geometry: KvGeometry) -> None:
        rows, heads = len(self._offsets), geometry.heads
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

    def _place(self, incoming: list[RowWindow], geometry: KvGeometry | None) -> None:
        """Each row (running and new) keeps its newest window, left-aligned."""
        everything = self._each_row() + incoming
        lengths = [0 if k is None else int(k[0].shape[2]) for k, _, _ in everything]
        width = max(lengths)
        if geometry is None or width == 0:
            self._keys = self._values = None
        else:
            self._keys, self._values = _stacked(
                self.codec, everything, lengths, round_up(width + 1), geometry, right_aligned=False
            )
        self._retained = lengths
        self._pads = [0] * len(everything)

    def _keep(self, order: list[int]) -> None:
        super()._keep(order)
        self._retained = [self._retained[i] for i in order]

    def _check_trim(self, counts: Sequence[int]) -> None:
        for b, (count, offset) in enumerate(zip(counts, self._offsets, strict=True)):
            if count and offset >= self.max_size:
                raise NotTrimmableError(
                    wrapped_ring_message(f"row {b} at offset {offset}", self.max_size)
                )

    def _forget(self, counts: Sequence[int]) -> None:
        self._retained = [r - c for r, c in zip(self._retained, counts, strict=True)]

    def _check_geometry(self) -> None:
        assert len(self._retained) == len(self._offsets)
        assert all(0 <= r <= o for r, o in zip(self._retained, self._offsets, strict=True))

    def _layout_mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        """Row ``b``'s query ``i`` sits at column ``retained'[b] - n + i`` and sees its window."""
        size = window or self.max_size
        after = self._after(n)
        columns = mx.arange(max(after, default=0))[None, None, :]
        queries = (mx.array(after)[:, None] - n + mx.arange(n)[None, :])[:, :, None]
        visible = (columns <= queries) & (queries < columns + size)
        return visible[:, None]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_size={self.max_size}, row_offsets={tuple(self._offsets)}, "
            f"retained={self.retained})"
        )
