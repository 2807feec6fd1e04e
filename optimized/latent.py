"""The optimized latent caches (``spec/MLACache.md``, ``spec/EncodedLatentCache.md``).

:class:`LatentSurface` is ``MLACache``'s surface on the row machinery (``classes.build``
puts it first among the preset's bases). ``EncodedLatentCache`` still runs on
``kvrows.latent.LatentRows`` over the hooks below (until the delayed stages take it):
one right-justified buffer per plane, ``[B, 1, capacity, ·]`` holding ``width`` columns
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

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from kvrows.codec import PlaneSet, as_role
from kvrows.compositions import composition
from kvrows.errors import InvalidInputError, latent_planes_message, preview_blocks_message
from kvrows.latent import (
    EncodedLatentMembers,
    LatentRows,
    LatentSurfaceMembers,
    int_vector_message,
)
from kvrows.optimized.codecs import dtype_name, mlx_dtype
from kvrows.optimized.codecs.latent import LatentArrayCodec
from kvrows.optimized.geometries.growing import GrowingGeometry
from kvrows.optimized.rows import Layout, RowWindow, Store, arrays, mapped, owned
from kvrows.optimized.speculative import SpeculativeLayout

__all__ = ["EncodedLatentCache", "LatentSurface"]

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


def _ints(cache: Any, value: Any, what: str) -> list[int]:
    integers = isinstance(value, mx.array) and value.ndim == 1
    if not integers or (value.size and not mx.issubdtype(value.dtype, mx.integer)):
        raise InvalidInputError(int_vector_message(type(cache).__name__, what))
    listed: list[int] = value.tolist()
    return listed


def _pad_left(array: mx.array, columns: int) -> mx.array:
    if columns == 0:
        return array
    return mx.pad(array, [(0, 0), (0, 0), (columns, 0), (0, 0)])


class _LatentOptimized(LatentRows):
    """The optimized array hooks over right-justified batch buffers: one plane set
    (``kvrows.codec.PlaneSet``) with the tensors ``latent`` (the codec's planes), ``rope``,
    ``index`` (DSA) and, while some row reads exact, the warm-up ``exact`` latent; each
    ``[B, 1, capacity, ·]`` holding ``width`` columns."""

    def _impl_init(self) -> None:
        self._held: PlaneSet = {}

    @property
    def _codec(self) -> LatentArrayCodec:
        return LatentArrayCodec(self.latent_spec)

    def _impl_shape_dtype(self, array: Any, what: str) -> tuple[tuple[int, ...], str]:
        dtype = dtype_name(array)
        return tuple(int(n) for n in array.shape), dtype

    def _impl_as4(self, array: Any) -> Any:
        return mx.expand_dims(array, 1)

    def _impl_as3(self, array: Any) -> Any:
        return array[:, 0]

    def _impl_append(self, latent: Any, rope: Any, index: Any | None, exact: bool) -> None:
        used = self.width  # the core updates the offsets after this hook
        block: PlaneSet = {"latent": self._codec.encode(latent, "latent"), "rope": (rope,)}
        if index is not None:
            block["index"] = (index,)
        if exact:
            # rows that read exact joined with no exact columns held: zeros (never read)
            block["exact"] = (latent,)
        held = self._held
        written = {
            tensor: tuple(
                _write(buffer, plane, used)
                for buffer, plane in zip(
                    held.get(tensor) or (None,) * len(planes), planes, strict=True
                )
            )
            for tensor, planes in block.items()
        }
        self._held = {**held, **written}

    def _valid(self, array: mx.array) -> mx.array:
        """``array``'s columns that hold tokens (a buffer has capacity past ``width``)."""
        return array[:, :, : self.width]

    def _visible(self) -> PlaneSet:
        """Every tensor's columns that hold tokens (views)."""
        return mapped(self._held, self._valid)

    def _impl_read(self, reads_exact: Sequence[bool]) -> tuple[Any, Any, Any | None]:
        assert "rope" in self._held and self._dtype is not None
        visible = self._visible()
        latent = self._codec.decoded(visible["latent"], "latent", self._dtype)
        if any(reads_exact):
            rows = mx.array(list(reads_exact))[:, None, None, None]
            latent = mx.where(rows, visible["exact"][0], latent)
        index = visible["index"][0] if "index" in visible else None
        return latent, visible["rope"][0], index

    def preview(self, latent: mx.array, rope: mx.array) -> tuple[mx.array, mx.array]:
        """What ``append(latent, rope, index)`` will return for the latent and rope
        (``[B, 1, width + N, ·]``), changing nothing: the drop-in hands it to the model's
        MLA layer before the layer has computed the index block."""
        self._spec_usable()
        latent, rope, _, four, _, _, _ = self._checked_blocks(latent, rope, None, staged=True)
        if not four:
            raise InvalidInputError(preview_blocks_message(type(self).__name__))
        reads_exact = [not c for c in self.converted] or [True] * int(latent.shape[0])
        codec = self._codec
        decoded = codec.decoded(codec.encode(latent, "latent"), "latent", dtype_name(latent))
        rows = mx.array(reads_exact)[:, None, None, None]
        block = mx.where(rows, latent, decoded)
        if "rope" not in self._held:
            return block, rope
        held_latent, held_rope, _ = self._impl_read(reads_exact)
        return (
            mx.concatenate([held_latent, block], axis=2),
            mx.concatenate([held_rope, rope], axis=2),
        )

    def _zeros(self, rows: int, columns: int) -> PlaneSet:
        """Zero planes of ``columns`` tokens of every tensor the cache holds."""
        assert self._widths is not None and self._dtype is not None
        (rank, rope), dtype, codec = self._widths, self._dtype, self._codec
        widths = {"latent": rank, "rope": rope, "index": self.latent_spec.index_head_dim}
        widths["exact"] = rank
        return {
            tensor: codec.zeros(rows, 1, columns, width, dtype, tensor)
            for tensor, width in widths.items()
            if width is not None
        }

    def _impl_merge(self, sources: Sequence[Any]) -> None:
        width = max(s.width for s in sources)
        widths = next((s._widths for s in sources if s._widths), None)
        dtype = next((s._dtype for s in sources if s._dtype), None)
        if width == 0 or widths is None or dtype is None:
            self._impl_init()
            return
        self._widths, self._dtype = widths, dtype
        parts: list[PlaneSet] = []
        for source in sources:
            rows = max(1, source.batch_size)
            if "rope" not in source._held:
                parts.append(self._zeros(rows, width))
                continue
            held: PlaneSet = {**self._zeros(rows, source.width), **source._visible()}
            parts.append(mapped(held, functools.partial(_pad_left, columns=width - source.width)))
        needs_exact = not all(c for s in sources for c in (s.converted or (False,)))
        merged: PlaneSet = {}
        for tensor in parts[0]:
            columns = zip(*(part[tensor] for part in parts), strict=True)
            merged[tensor] = tuple(mx.concatenate(list(column), 0) for column in columns)
        if not needs_exact:
            merged.pop("exact", None)
        self._held = merged
        mx.eval(*arrays(merged))

    def _impl_filter(self, keep: Sequence[int]) -> None:
        if "rope" not in self._held:
            return
        offsets = [self._offsets[r] for r in keep]
        drop = self.width - max(offsets)
        rows = mx.array(list(keep))
        self._held = mapped(self._visible(), lambda a: mx.take(a, rows, axis=0)[:, :, drop:])
        if max(offsets) == 0:
            self._impl_init()
            return
        mx.eval(*arrays(self._held))

    def _impl_take_row(self, source: Any, row: int) -> None:
        if "rope" not in source._held or source._offsets[row] == 0:
            return
        start, end = source.width - source._offsets[row], source.width
        self._held = mapped(source._held, lambda a: owned(a[row : row + 1, :, start:end]))
        mx.eval(*arrays(self._held))

    def _impl_forget(self, counts: Sequence[int]) -> None:
        if "rope" not in self._held:
            return
        width = self.width
        new_width = max(o - c for o, c in zip(self._offsets, counts, strict=True))
        if new_width == 0:
            self._impl_init()
            return
        if len(set(counts)) == 1:  # every row the same: a plain cut of the newest columns
            cut = width - counts[0]
            self._held = mapped(self._held, lambda a: a[:, :, :cut])
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

            self._held = mapped(self._held, rolled)
        mx.eval(*arrays(self._held))

    def _impl_drop_exact(self) -> None:
        self._held.pop("exact", None)

    def _impl_held(self) -> tuple[Any, ...]:
        return arrays(self._visible())

    def _impl_nbytes(self) -> int:
        return sum(int(a.nbytes) for a in arrays(self._held))

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
        visible = self._visible()

        def one(tensor: str) -> mx.array | None:
            return visible[tensor][0] if tensor in visible else None

        return visible.get("latent", ()), one("rope"), one("index"), one("exact")

    def _impl_state_planes(self) -> tuple[Any, Any, Any, Any]:
        if "rope" not in self._held:
            return None, None, None, None
        latent, rope, index, exact = self.planes()
        return latent, rope, index, None if all(self.converted) else exact

    def _impl_int_array(self, values: Sequence[int]) -> Any:
        return mx.array(list(values), dtype=mx.int32)

    def _impl_ints(self, value: Any, what: str) -> list[int]:
        return _ints(self, value, what)

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
        held: PlaneSet = {"latent": tuple(owned(p) for p in planes), "rope": (owned(rope),)}
        if index is not None:
            held["index"] = (owned(index),)
        if exact is not None:
            held["exact"] = (owned(exact),)
        self._held = held
        mx.eval(*arrays(held))
        return dtype


# The machinery's members the surface uses (at run time the preset's own bases).
if TYPE_CHECKING:

    class _OnRows(LatentSurfaceMembers):
        _planes: PlaneSet | None
        _stores: list[Store] | None
        _stages: tuple[Any, ...]
        row_stages: tuple[int, ...]
        _offsets: list[int]
        _pads: list[int]

        def _visible_rows(self, store: Store) -> PlaneSet: ...

        def _visible(self, planes: PlaneSet) -> PlaneSet: ...
        def _clear(self) -> None: ...
        def _changed(self) -> None: ...
        def _row_windows(self) -> list[RowWindow]: ...
else:
    _OnRows = LatentSurfaceMembers


class LatentSurface(_OnRows):
    """``MLACache``'s surface on the optimized row machinery (``classes.build`` lists it
    first): the array half of ``kvrows.latent.LatentSurfaceMembers``. The rows are the
    growing geometry's shared-column buffers (tensors ``latent``, ``rope``, ``index``,
    ``[slots, 1, capacity, ·]``); an empty cache lends one empty row to a merge (it is its
    own serial storage); ``preview`` is what the next append will return."""

    def _dtype_of(self, array: Any) -> str:
        return dtype_name(array)

    def _as4(self, array: Any) -> Any:
        return mx.expand_dims(array, 1)

    def _as3(self, array: Any) -> Any:
        return array[:, 0]

    def _native(self, array: Any) -> bool:
        return isinstance(array, mx.array)

    def _as_dtype(self, array: Any, dtype: str) -> Any:
        return array if dtype_name(array) == dtype else array.astype(mlx_dtype(dtype))

    def _int_array(self, values: Sequence[int]) -> Any:
        return mx.array(list(values), dtype=mx.int32)

    def _ints(self, value: Any, what: str) -> list[int]:
        return _ints(self, value, what)

    def _row_windows(self) -> list[RowWindow]:
        return super()._row_windows() or [(None, 0)]

    def _visible_planes(self) -> PlaneSet:
        """The columns that hold tokens (views; nothing before the first write)."""
        return {} if self._planes is None else self._visible(self._planes)

    def held_arrays(self) -> tuple[Any, ...]:
        """The columns that hold tokens (views: a later append writes past them)."""
        if self._stores is not None:  # rows of several stages: each store's
            return tuple(a for store in self._stores for a in arrays(self._visible_rows(store)))
        return arrays(self._visible_planes())

    def _with_exact(self, planes: Any, rows: Sequence[int]) -> Any:
        latent, rope, index, _ = planes
        return latent, rope, index, self._rows_only(self._read()["latent"], rows)

    def _rows_only(self, array: Any, rows: Sequence[int]) -> Any:
        kept = mx.array([b in rows for b in range(int(array.shape[0]))])
        return mx.where(kept[:, None, None, None], array, mx.zeros_like(array))

    def planes(self) -> tuple[Planes, mx.array | None, mx.array | None, None]:
        """The stored columns: latent codec planes, rope, index (no exact latent)."""
        visible = self._visible_planes()

        def one(tensor: str) -> mx.array | None:
            return visible[tensor][0] if tensor in visible else None

        return visible.get("latent", ()), one("rope"), one("index"), None

    def _state_planes(self) -> tuple[Any, Any, Any]:
        if self.width == 0:
            return None, None, None
        latent, rope, index, _ = self.planes()
        return latent, rope, index

    def _adopt_state(self, planes: PlaneSet | None, offsets: list[int], width: int) -> None:
        self._clear()
        self._offsets = list(offsets)
        self._pads = [width - o for o in offsets]
        if planes is not None:
            self._planes = mapped(planes, owned)
            mx.eval(*arrays(self._planes))
        self._changed()

    def preview(self, latent: mx.array, rope: mx.array) -> tuple[mx.array, mx.array]:
        """What ``append(latent, rope, index)`` will return for the latent and rope
        (``[B, 1, width + N, ·]``), changing nothing: the drop-in hands it to the model's
        MLA layer before the layer has computed the index block."""
        self._spec_usable()
        four, _, _, _ = self._checked(latent, rope, None, staged=True)
        if not four:
            raise InvalidInputError(preview_blocks_message(type(self).__name__))
        if self.width == 0:
            return latent, rope
        # The block as each row's stage will read it (an encoded latent: decoded).
        stages = self.row_stages
        role = as_role("latent")
        block = latent
        for stage in sorted(set(stages)):
            codec = self._stages[stage]
            if not codec.spec.inner.encodes:
                continue  # the plain latent reads as it is
            read = codec.fetched(codec.encode(latent, role), role).astype(latent.dtype)
            rows = mx.array([s == stage for s in stages])[:, None, None, None]
            block = mx.where(rows, read, block)
        held_latent, held_rope, _ = self._read_all()
        return (
            mx.concatenate([held_latent, block], axis=2),
            mx.concatenate([held_rope, rope], axis=2),
        )


class EncodedLatentCache(
    EncodedLatentMembers, LatentSurface, SpeculativeLayout, GrowingGeometry, Layout
):
    """The latent plane through a codec, rope and index exact, bf16-first per row
    (``spec/EncodedLatentCache.md``): the latent surface on the row machinery, its rows in
    two stage stores (the plain latent, then the encoded one)."""

    composition = composition("EncodedLatentCache")
