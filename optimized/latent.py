"""The optimized latent caches (``spec/MLACache.md``, ``spec/EncodedLatentCache.md``).

One right-justified buffer per plane, ``[B, 1, capacity, ·]`` holding ``width`` columns
(an append writes at column ``width``, growing the buffer in ``STEP`` columns as mlx-lm's
``KVCache`` does; the seed concatenated): every row's next token is column ``width``. A merge
left-pads each source's buffers to the new width; a filter takes rows and slices off the
common padding; an extract copies one row's columns; a ragged rollback moves each row
right by its rejected count and drops the common padding (the seed's roll), as one slice
per row: each row's window of the new width ending at its new end. The latent is encoded
once per append for the whole batch; nothing is ever decoded and re-encoded. The
control flow and every argument check are the core's (``kvrows.latent.LatentRows``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from kvrows.compositions import composition
from kvrows.errors import InvalidInputError, latent_planes_message, preview_blocks_message
from kvrows.latent import EncodedLatentRows, LatentRows
from kvrows.optimized.codecs import dtype_name, mlx_dtype
from kvrows.optimized.codecs.latent import LatentArrayCodec
from kvrows.optimized.rows import owned

__all__ = ["EncodedLatentCache", "MLACache"]

Planes = tuple[mx.array, ...]


#: Token columns a buffer grows by (mlx-lm's ``KVCache.step``).
STEP = 256


def _write(buffer: mx.array | None, block: mx.array, used: int) -> mx.array:
    """``buffer`` (``used`` columns held) with ``block`` written at column ``used``, grown in
    ``STEP`` columns when it is full. The new columns go into a buffer the cache allocated
    (never into an array a caller holds: reads and states are slices)."""
    n = int(block.shape[2])
    if buffer is None or used + n > int(buffer.shape[2]):
        capacity = -(-(used + n) // STEP) * STEP
        grown = mx.zeros((block.shape[0], 1, capacity, block.shape[3]), dtype=block.dtype)
        if buffer is not None and used:
            grown[:, :, :used, :] = buffer[:, :, :used, :]
        buffer = grown
    buffer[:, :, used : used + n, :] = block
    return buffer


def _pad_left(array: mx.array, columns: int) -> mx.array:
    if columns == 0:
        return array
    return mx.pad(array, [(0, 0), (0, 0), (columns, 0), (0, 0)])


class _LatentOptimized(LatentRows):
    """The optimized array hooks over right-justified batch buffers."""

    def _impl_init(self) -> None:
        self._planes: Planes | None = None  # the latent as the codec stores it
        self._rope: mx.array | None = None
        self._index: mx.array | None = None
        self._exact: mx.array | None = None  # while some row reads its latent exact

    @property
    def _codec(self) -> LatentArrayCodec:
        return LatentArrayCodec(self.latent_spec)

    def _impl_shape_dtype(self, array: Any, what: str) -> tuple[tuple[int, ...], str]:
        try:
            dtype = dtype_name(array)
        except InvalidInputError as error:
            raise InvalidInputError(f"{type(self).__name__}: {what}: {error}") from None
        return tuple(int(n) for n in array.shape), dtype

    def _impl_as4(self, array: Any) -> Any:
        return mx.expand_dims(array, 1)

    def _impl_as3(self, array: Any) -> Any:
        return array[:, 0]

    def _buffers(self) -> list[mx.array | None]:
        return [*(self._planes or ()), self._rope, self._index, self._exact]

    def _set_buffers(self, arrays: Sequence[mx.array | None]) -> None:
        count = len(self._planes or ())
        planes = tuple(a for a in arrays[:count] if a is not None)
        self._planes = planes or None
        self._rope, self._index, self._exact = arrays[count], arrays[count + 1], arrays[count + 2]

    def _impl_append(self, latent: Any, rope: Any, index: Any | None, exact: bool) -> None:
        used = self.width  # the core updates the offsets after this hook
        planes = self._codec.encode(latent, "latent")
        held = self._planes or (None,) * len(planes)
        self._planes = tuple(_write(h, p, used) for h, p in zip(held, planes, strict=True))
        self._rope = _write(self._rope, rope, used)
        if index is not None:
            self._index = _write(self._index, index, used)
        if exact and self.latent_codec.encodes:
            # rows that read exact joined with no exact columns held: zeros (never read)
            self._exact = _write(self._exact, latent, used)

    def _valid(self, array: mx.array) -> mx.array:
        """``array``'s columns that hold tokens (a buffer has capacity past ``width``)."""
        return array[:, :, : self.width]

    def _valid_buffers(self) -> list[mx.array | None]:
        return [None if a is None else self._valid(a) for a in self._buffers()]

    def _decoded(self) -> mx.array:
        assert self._planes is not None and self._dtype is not None
        planes = tuple(self._valid(p) for p in self._planes)
        return self._codec.decoded(planes, "latent", self._dtype)

    def _impl_read(self, reads_exact: Sequence[bool]) -> tuple[Any, Any, Any | None]:
        assert self._rope is not None
        latent = self._decoded()
        if self.latent_codec.encodes and any(reads_exact):
            assert self._exact is not None
            rows = mx.array(list(reads_exact))[:, None, None, None]
            latent = mx.where(rows, self._valid(self._exact), latent)
        index = None if self._index is None else self._valid(self._index)
        return latent, self._valid(self._rope), index

    def preview(self, latent: mx.array, rope: mx.array) -> tuple[mx.array, mx.array]:
        """What ``append(latent, rope, index)`` will return for the latent and rope
        (``[B, 1, width + N, ·]``), changing nothing: the drop-in hands it to the model's
        MLA layer before the layer has computed the index block."""
        self._spec_usable()
        latent, rope, _, four, _, _, _ = self._checked_blocks(latent, rope, None, staged=True)
        if not four:
            raise InvalidInputError(preview_blocks_message(type(self).__name__))
        reads_exact = [not c for c in self.converted] or [True] * int(latent.shape[0])
        block = latent
        if self.latent_codec.encodes:
            codec = self._codec
            decoded = codec.decoded(codec.encode(latent, "latent"), "latent", dtype_name(latent))
            rows = mx.array(reads_exact)[:, None, None, None]
            block = mx.where(rows, latent, decoded)
        if self._rope is None:
            return block, rope
        held_latent, held_rope, _ = self._impl_read(reads_exact)
        return (
            mx.concatenate([held_latent, block], axis=2),
            mx.concatenate([held_rope, rope], axis=2),
        )

    def _empty_buffers(self, rows: int, columns: int) -> list[mx.array | None]:
        """Zero buffers of ``columns`` tokens (planes, rope, index, exact)."""
        assert self._widths is not None and self._dtype is not None
        rank, rope = self._widths
        dtype = mlx_dtype(self._dtype)
        planes = self._codec.zeros(rows, 1, columns, rank, self._dtype, "latent")
        index = self.latent_spec.index_head_dim
        return [
            *planes,
            mx.zeros((rows, 1, columns, rope), dtype),
            None if index is None else mx.zeros((rows, 1, columns, index), dtype),
            mx.zeros((rows, 1, columns, rank), dtype) if self.latent_codec.encodes else None,
        ]

    def _impl_merge(self, sources: Sequence[Any]) -> None:
        width = max(s.width for s in sources)
        widths = next((s._widths for s in sources if s._widths), None)
        dtype = next((s._dtype for s in sources if s._dtype), None)
        if width == 0 or widths is None or dtype is None:
            self._impl_init()
            return
        self._widths, self._dtype = widths, dtype
        parts: list[list[mx.array | None]] = []
        for source in sources:
            rows = max(1, source.batch_size)
            if source._rope is None:
                parts.append(self._empty_buffers(rows, width))
                continue
            held = source._valid_buffers()
            zeros = self._empty_buffers(rows, source.width)
            held[-1] = held[-1] if held[-1] is not None else zeros[-1]
            parts.append([None if a is None else _pad_left(a, width - source.width) for a in held])
        needs_exact = not all(c for s in sources for c in (s.converted or (False,)))
        merged = [
            None if column[0] is None else mx.concatenate([a for a in column if a is not None], 0)
            for column in zip(*parts, strict=True)
        ]
        if not needs_exact:
            merged[-1] = None
        count = len(merged) - 3
        self._planes = tuple(a for a in merged[:count] if a is not None)
        self._rope, self._index, self._exact = merged[count], merged[count + 1], merged[count + 2]
        mx.eval(*(a for a in self._buffers() if a is not None))

    def _impl_filter(self, keep: Sequence[int]) -> None:
        if self._rope is None:
            return
        offsets = [self._offsets[r] for r in keep]
        drop = self.width - max(offsets)
        rows = mx.array(list(keep))
        self._set_buffers(
            [
                None if a is None else mx.take(a, rows, axis=0)[:, :, drop:]
                for a in self._valid_buffers()
            ]
        )
        if max(offsets) == 0:
            self._impl_init()
            return
        mx.eval(*(a for a in self._buffers() if a is not None))

    def _impl_take_row(self, source: Any, row: int) -> None:
        if source._rope is None or source._offsets[row] == 0:
            return
        start, end = source.width - source._offsets[row], source.width
        self._planes = tuple(owned(p[row : row + 1, :, start:end]) for p in source._planes)
        self._rope = owned(source._rope[row : row + 1, :, start:end])
        if source._index is not None:
            self._index = owned(source._index[row : row + 1, :, start:end])
        if source._exact is not None:
            self._exact = owned(source._exact[row : row + 1, :, start:end])
        mx.eval(*(a for a in self._buffers() if a is not None))

    def _impl_forget(self, counts: Sequence[int]) -> None:
        if self._rope is None:
            return
        width = self.width
        new_width = max(o - c for o, c in zip(self._offsets, counts, strict=True))
        if new_width == 0:
            self._impl_init()
            return
        if len(set(counts)) == 1:  # every row the same: a plain cut of the newest columns
            cut = width - counts[0]
            self._set_buffers([None if a is None else a[:, :, :cut] for a in self._buffers()])
        else:
            # Row b's kept tokens end at column width - counts[b]; the new width is the
            # longest kept row. The seed rolls each row right by its count and drops the
            # common padding; the visible columns of that are each row's window of
            # new_width columns ending at its new end: one slice per row (columns before
            # a row's window are padding: zeros here, the rolled-out tail in the seed).
            def rolled(a: mx.array) -> mx.array:
                rows = []
                for b, count in enumerate(counts):
                    end = width - count
                    start = end - new_width
                    rows.append(_pad_left(a[b : b + 1, :, max(0, start) : end], max(0, -start)))
                return mx.concatenate(rows, axis=0)

            self._set_buffers([None if a is None else rolled(a) for a in self._buffers()])
        mx.eval(*(a for a in self._buffers() if a is not None))

    def _impl_drop_exact(self) -> None:
        self._exact = None

    def _impl_held(self) -> tuple[Any, ...]:
        return tuple(a for a in self._valid_buffers() if a is not None)

    def _impl_nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self._buffers() if a is not None)

    def _impl_mask(self, n: int, window_size: int | None) -> Any:
        width = self.width
        columns = mx.arange(width + n)[None, None, None, :]
        queries = mx.arange(n)[None, None, :, None]
        pads = mx.array(list(self.left_pad))[:, None, None, None]
        visible = (columns >= pads) & (columns <= width + queries)
        if window_size is not None:
            visible = visible & (width + queries - columns < window_size)
        return visible

    def _impl_offsets(self) -> Any:
        return mx.array(self._offsets, dtype=mx.int32)

    def planes(self) -> tuple[Planes, mx.array | None, mx.array | None, mx.array | None]:
        """The stored columns: latent codec planes, rope, index, exact latent."""
        planes, rope, index, exact = self._valid_buffers()[:-3], *self._valid_buffers()[-3:]
        return tuple(a for a in planes if a is not None), rope, index, exact

    def _impl_state_planes(self) -> tuple[Any, Any, Any, Any]:
        if self._rope is None:
            return None, None, None, None
        planes, rope, index, exact = self._planes or (), self._rope, self._index, self._exact
        return (
            tuple(self._valid(p) for p in planes),
            self._valid(rope),
            None if index is None else self._valid(index),
            None if exact is None or all(self.converted) else self._valid(exact),
        )

    def _impl_int_array(self, values: Sequence[int]) -> Any:
        return mx.array(list(values), dtype=mx.int32)

    def _impl_ints(self, value: Any, what: str) -> list[int]:
        if not isinstance(value, mx.array) or value.ndim != 1:
            raise InvalidInputError(f"{type(self).__name__}: {what} must be a 1-D mlx int array")
        if value.size and not mx.issubdtype(value.dtype, mx.integer):
            raise InvalidInputError(f"{type(self).__name__}: {what} must hold integers")
        listed: list[int] = value.tolist()  # type: ignore[assignment]
        return listed

    def _impl_restore(
        self, planes: tuple[Any, ...], rope: Any, index: Any, exact: Any, rows: int, width: int
    ) -> str:
        assert self._widths is not None
        names = [p.name for p in self.latent_spec.plane_specs("latent", self._widths[0], "float32")]
        if len(names) != len(planes):
            raise InvalidInputError(
                latent_planes_message(type(self).__name__, len(names), len(planes))
            )
        named = [*zip(names, planes, strict=True), ("rope", rope)]
        if index is not None:
            named.append(("index", index))
        if exact is not None:
            named.append(("exact", exact))
        for plane_name, array in named:
            if not isinstance(array, mx.array):
                raise InvalidInputError(
                    f"{type(self).__name__}: plane {plane_name} must be an mlx array"
                )
        shapes = [(n, tuple(int(d) for d in a.shape), dtype_name(a)) for n, a in named]
        dtype = self._check_restored(shapes, rows, width)
        self._planes = tuple(owned(p) for p in planes)
        self._rope = owned(rope)
        self._index = None if index is None else owned(index)
        self._exact = None if exact is None else owned(exact)
        mx.eval(*(a for a in self._buffers() if a is not None))
        return dtype


class MLACache(_LatentOptimized):
    """MLA latent + rope (+ DSA index) planes (``spec/MLACache.md``)."""

    composition = composition("MLACache")


class EncodedLatentCache(EncodedLatentRows, _LatentOptimized):
    """The latent plane through a codec, rope and index exact, bf16-first per row
    (``spec/EncodedLatentCache.md``)."""

    composition = composition("EncodedLatentCache")
