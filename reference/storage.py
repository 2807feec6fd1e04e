"""The reference's full-attention storage and row arrangements, over any codec.

This is the executable specification: rows are kept as separate compact
arrays and the padded batch is assembled on every read, so the code says what
the layouts mean rather than how a fast one moves bytes.

Arrangements (``spec/PaddedKVRows.md``, ``spec/BatchedKVCache.md``):

* serial: one request (shape-generic in ``B``), tokens ``[0, offset)``;
* shared write column: every row ends at the same physical column ``S``;
  row ``b`` occupies ``[left_pad[b], S)``;
* ragged: row ``b`` occupies ``[left_pad[b], left_pad[b] + row_offsets[b])``
  and appends at its own end.

The join rule, shared by both: incoming rows are right-aligned to
``W = max(current width, longest incoming row)``; rows already there keep
their data and their pads grow by ``W - width``. A filter drops the padding
every survivor shares.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from kvrows.common import check_counts, row_bytes
from kvrows.errors import (
    IncompatibleRowsError,
    InvalidInputError,
    LayoutStateError,
    NotTrimmableError,
)
from kvrows.protocols import Cache, Mask
from kvrows.reference.codecs import Codec, Planes, dtype_name
from kvrows.validation import (
    KvGeometry,
    as_count,
    check_block,
    check_keep,
    check_row,
    check_window,
    common_geometry,
)

__all__ = ["FullAttentionCache", "RowLayout"]


def _cat(a: Planes, b: Planes) -> Planes:
    return tuple(np.concatenate([x, y], axis=2) for x, y in zip(a, b, strict=True))


def _tokens(planes: Planes, start: int, stop: int) -> Planes:
    return tuple(np.array(p[:, :, start:stop], copy=True) for p in planes)


def _rows(planes: Planes, start: int, stop: int) -> Planes:
    return tuple(np.array(p[start:stop], copy=True) for p in planes)


def _nbytes(planes: Planes | None) -> int:
    return 0 if planes is None else sum(int(p.nbytes) for p in planes)


class FullAttentionCache:
    """A serial full-attention cache over ``codec``: tokens ``[0, offset)`` of ``B`` rows."""

    codec: Codec
    signature_text: ClassVar[str]

    def __init__(self) -> None:
        self._keys: Planes | None = None
        self._values: Planes | None = None
        self._geometry: KvGeometry | None = None

    # -- what the cache holds -------------------------------------------------
    @property
    def geometry(self) -> KvGeometry | None:
        return self._geometry

    @property
    def offset(self) -> int:
        return 0 if self._keys is None else int(self._keys[0].shape[2])

    @property
    def rows(self) -> int:
        """Batch rows held (0 before the first append)."""
        return 0 if self._keys is None else int(self._keys[0].shape[0])

    @property
    def nbytes(self) -> int:
        return _nbytes(self._keys) + _nbytes(self._values)

    @property
    def state(self) -> tuple[Any, ...]:
        if self._keys is None or self._values is None:
            return ()
        return (*self._keys, *self._values)

    @property
    def state_needs_dispose(self) -> bool:
        return False

    def signature(self) -> str:
        return self.signature_text

    def planes(self) -> tuple[Planes, Planes] | None:
        """The stored key and value planes (``None`` when empty)."""
        if self._keys is None or self._values is None:
            return None
        return self._keys, self._values

    # -- protocol ---------------------------------------------------------------
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
        new_k, new_v = self.codec.encode(keys), self.codec.encode(values)
        self._keys = new_k if self._keys is None else _cat(self._keys, new_k)
        self._values = new_v if self._values is None else _cat(self._values, new_v)
        self._geometry = geometry
        return self.fetch()

    def fetch(self) -> tuple[Any, Any]:
        if self._keys is None or self._values is None:
            raise LayoutStateError("the cache holds no tokens yet: nothing to fetch")
        return self.codec.fetched(self._keys), self.codec.fetched(self._values)

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        """mlx-lm's policy: ``None`` for one token, ``"causal"`` for a block, an array when
        a window or ``return_array`` asks for one."""
        count = as_count(n, "n", minimum=1)
        window = check_window(window_size)
        if window is None and not return_array:
            return None if count == 1 else "causal"
        columns = np.arange(self.offset + count)[None, :]
        queries = np.arange(self.offset, self.offset + count)[:, None]
        visible: npt.NDArray[np.bool_] = columns <= queries
        if window is not None:
            visible &= queries < columns + window
        return visible

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        count = min(as_count(n, "n"), self.offset)
        if count and self._keys is not None and self._values is not None:
            keep = self.offset - count
            self._keys = _tokens(self._keys, 0, keep)
            self._values = _tokens(self._values, 0, keep)
        return count

    # -- construction used by layouts -----------------------------------------
    def adopt(
        self, keys: Planes, values: Planes, geometry: KvGeometry | None
    ) -> FullAttentionCache:
        """Make this (empty) cache own copies of ``keys``/``values`` (``[B, H, T, ·]`` planes)."""
        if self._keys is not None:
            raise LayoutStateError("adopt needs an empty cache")
        self._keys = tuple(np.array(p, copy=True) for p in keys)
        self._values = tuple(np.array(p, copy=True) for p in values)
        self._geometry = geometry
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}(offset={self.offset}, rows={self.rows})"


@dataclass
class _Row:
    """One request inside a layout: its compact planes and left padding."""

    keys: Planes | None
    values: Planes | None
    pad: int

    @property
    def tokens(self) -> int:
        return 0 if self.keys is None else int(self.keys[0].shape[2])

    @property
    def end(self) -> int:
        return self.pad + self.tokens


class RowLayout:
    """Several requests' rows of one layer, as separate compact rows plus pads.

    Subclasses fix the codec, the serial class rows are extracted into, the
    source classes ``merge_rows`` accepts, and whether rows share one write
    column (``shared_column``) or are ragged.
    """

    codec: Codec
    serial_class: ClassVar[type[FullAttentionCache]]
    shared_column: ClassVar[bool]
    signature_text: ClassVar[str]

    def __init__(self) -> None:
        self._rows: list[_Row] = []
        self._geometry: KvGeometry | None = None

    # -- family ---------------------------------------------------------------
    @classmethod
    def family(cls) -> tuple[type, ...]:
        """The source classes ``merge_rows`` takes: the serial storage and its layouts."""
        return (cls.serial_class, RowLayout)

    def _accepts(self, source: object) -> bool:
        if isinstance(source, RowLayout | self.serial_class):
            return source.codec.key == self.codec.key
        return False

    # -- what the layout holds -------------------------------------------------
    @property
    def geometry(self) -> KvGeometry | None:
        return self._geometry

    @property
    def batch_size(self) -> int:
        return len(self._rows)

    @property
    def row_offsets(self) -> tuple[int, ...]:
        return tuple(row.tokens for row in self._rows)

    @property
    def left_pad(self) -> tuple[int, ...]:
        return tuple(row.pad for row in self._rows)

    @property
    def width(self) -> int:
        """Physical columns in use: the furthest row end."""
        return max((row.end for row in self._rows), default=0)

    @property
    def offset(self) -> npt.NDArray[np.int32]:
        return np.array(self.row_offsets, dtype=np.int32)

    @property
    def max_tokens(self) -> float:
        return math.inf

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(row.keys) + _nbytes(row.values) for row in self._rows)

    @property
    def state(self) -> tuple[Any, ...]:
        return tuple(
            plane
            for row in self._rows
            for planes in (row.keys, row.values)
            if planes is not None
            for plane in planes
        )

    @property
    def state_needs_dispose(self) -> bool:
        return False

    def signature(self) -> str:
        return self.signature_text

    def make_empty_batch(self) -> RowLayout:
        return type(self)()

    def blank_row(self) -> FullAttentionCache:
        """An empty serial cache of this layout's storage and codec."""
        return self.serial_class()

    def is_trimmable(self) -> bool:
        return True

    # -- reads --------------------------------------------------------------------
    def _assembled(self, which: str, width: int) -> Planes:
        geometry = self._geometry
        if geometry is None:
            raise LayoutStateError("the layout's geometry is unknown until its first token")
        dim = geometry.key_dim if which == "keys" else geometry.value_dim
        template = self.codec.empty(1, geometry.heads, dim, geometry.dtype)
        out = [
            np.zeros((len(self._rows), *p.shape[1:2], width, *p.shape[3:]), dtype=p.dtype)
            for p in template
        ]
        for b, row in enumerate(self._rows):
            planes = row.keys if which == "keys" else row.values
            if planes is None:
                continue
            for dst, src in zip(out, planes, strict=True):
                dst[b, :, row.pad : row.end] = src[0]
        return tuple(out)

    def fetch(self) -> tuple[Any, Any]:
        if not self._rows:
            raise LayoutStateError("the layout holds no rows: nothing to fetch")
        width = self.width
        return (
            self.codec.fetched(self._assembled("keys", width)),
            self.codec.fetched(self._assembled("values", width)),
        )

    def row_planes(self, row: int) -> tuple[Planes, Planes] | None:
        """Row ``row``'s compact key and value planes (``None`` when it holds no token)."""
        entry = self._rows[check_row(row, self.batch_size)]
        if entry.keys is None or entry.values is None or entry.tokens == 0:
            return None
        return entry.keys, entry.values

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        """Row ``b``'s query ``i`` sits at column ``end[b] + i`` and sees ``[pad[b], end[b] + i]``
        (and, with a window, only the last ``window_size`` of those)."""
        count = as_count(n, "n", minimum=1)
        window = check_window(window_size)
        pads = np.array(self.left_pad, dtype=np.int64)
        ends = np.array([row.end for row in self._rows], dtype=np.int64)
        uniform = not pads.any() and (ends.size == 0 or (ends == ends[0]).all())
        if uniform and window is None and not return_array:
            return None if count == 1 else "causal"
        columns = np.arange(self.width + count)[None, None, None, :]
        queries = ends[:, None, None, None] + np.arange(count)[None, None, :, None]
        visible: npt.NDArray[np.bool_] = (columns <= queries) & (
            columns >= pads[:, None, None, None]
        )
        if window is not None:
            visible &= queries < columns + window
        return visible

    # -- writes ----------------------------------------------------------------------
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
        encoded_k, encoded_v = self.codec.encode(keys), self.codec.encode(values)
        for b, row in enumerate(self._rows):
            new_k, new_v = _rows(encoded_k, b, b + 1), _rows(encoded_v, b, b + 1)
            row.keys = new_k if row.keys is None else _cat(row.keys, new_k)
            row.values = new_v if row.values is None else _cat(row.values, new_v)
        self._geometry = geometry
        return self.fetch()

    def _source_rows(self, source: Cache) -> tuple[list[_Row], KvGeometry | None]:
        if isinstance(source, RowLayout):
            return [
                _Row(
                    None if r.keys is None else tuple(p.copy() for p in r.keys),
                    None if r.values is None else tuple(p.copy() for p in r.values),
                    0,
                )
                for r in source._rows
            ], source.geometry
        assert isinstance(source, FullAttentionCache)
        held = source.planes()
        if held is None:
            return [_Row(None, None, 0)], source.geometry
        keys, values = held
        return [
            _Row(_rows(keys, b, b + 1), _rows(values, b, b + 1), 0) for b in range(source.rows)
        ], source.geometry

    def merge_rows(self, rows: Sequence[Cache]) -> None:
        """Form the batch from ``rows`` (empty layout) or join them (running layout)."""
        if isinstance(rows, Cache) or not isinstance(rows, Sequence):
            raise InvalidInputError("merge_rows takes a sequence of caches")
        incoming: list[_Row] = []
        geometries: list[KvGeometry | None] = [self._geometry]
        for source in rows:
            if not self._accepts(source):
                raise IncompatibleRowsError(
                    f"{self.signature()} cannot merge "
                    f"{source.signature() if isinstance(source, Cache) else type(source).__name__}"
                )
            source_rows, geometry = self._source_rows(source)
            incoming.extend(source_rows)
            geometries.append(geometry)
        geometry = common_geometry(geometries)
        if not incoming:
            return
        width = self.width if self._rows else 0
        target = max([width, *(row.tokens for row in incoming)])
        for row in self._rows:
            row.pad += target - width
        for row in incoming:
            row.pad = target - row.tokens
        self._rows.extend(incoming)
        self._geometry = geometry

    def filter_rows(self, keep: Sequence[int]) -> None:
        """Keep rows ``keep`` in that order; drop the left padding all survivors share."""
        order = check_keep(keep, self.batch_size)
        survivors = [self._rows[i] for i in order]
        shared = min((row.pad for row in survivors), default=0)
        for row in survivors:
            row.pad -= shared
        self._rows = survivors

    def extract_row(self, row: int) -> FullAttentionCache:
        held = self.row_planes(row)
        if held is None:
            empty = self.blank_row()
            empty._geometry = self._geometry  # an empty row still knows its geometry
            return empty
        return self.blank_row().adopt(held[0], held[1], self._geometry)

    def can_publish_row(self, row: int, tokens: int) -> bool:
        index = check_row(row, self.batch_size)
        return as_count(tokens, "tokens") <= self._rows[index].tokens

    def projected_bytes(self, tokens: int) -> int:
        return row_bytes(self.codec, self._geometry, tokens)

    def trim(self, n: int) -> int:
        """Forget every row's newest ``n`` tokens (each row must hold at least ``n``)."""
        count = as_count(n, "n")
        return self._trim_rows([count] * self.batch_size) if self._rows else 0

    def trim_rows(self, counts: Sequence[int]) -> int:
        """Forget ``counts[b]`` newest tokens of row ``b`` (per-row rollback; ragged layouts).

        Rows sharing one write column can only trim equal counts. Returns the largest count.
        """
        return self._trim_rows(check_counts(counts, self.batch_size))

    def _trim_rows(self, counts: Sequence[int]) -> int:
        for b, (row, count) in enumerate(zip(self._rows, counts, strict=True)):
            if count > row.tokens:
                raise NotTrimmableError(
                    f"cannot trim {count} tokens from row {b}, which holds {row.tokens}"
                )
        if self.shared_column and len(set(counts)) > 1:
            raise NotTrimmableError("rows sharing one write column must trim together")
        for row, count in zip(self._rows, counts, strict=True):
            if count and row.keys is not None and row.values is not None:
                keep = row.tokens - count
                row.keys = _tokens(row.keys, 0, keep)
                row.values = _tokens(row.values, 0, keep)
        return max(counts, default=0)

    def check_valid(self) -> None:
        """Assert the layout's invariants (for tests)."""
        assert all(row.pad >= 0 for row in self._rows)
        if self._rows:
            assert min(row.pad for row in self._rows) == 0, "some row must start at column 0"
        if self.shared_column:
            assert len({row.end for row in self._rows}) <= 1, "rows must share the write column"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rows={self.batch_size}, row_offsets={self.row_offsets}, "
            f"left_pad={self.left_pad})"
        )
