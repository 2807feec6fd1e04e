"""The reference's latent caches (``spec/MLACache.md``, ``spec/EncodedLatentCache.md``).

:class:`LatentSurface` is ``MLACache``'s surface on the row machinery (``classes.build``
puts it first among the preset's bases). ``EncodedLatentCache`` is the same
surface in two stages (``kvrows.latent.EncodedLatentMembers``); the paged latent cache
still runs on ``kvrows.latent.LatentRows`` over the hooks below.
What a latent layout *means*: every row is its own compact planes (``_Row``: the latent
as the codec stores it, the rope and index planes exact, and the exact latent while the
row reads exact), each row's latent encoded on its own, and the right-justified batch a
read returns is assembled from the rows on every read. A rollback cuts each row's tail;
there is no roll, no shared buffer and no capacity. The control flow and every argument
check are the core's (``kvrows.latent.LatentRows``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvrows.codec import PlaneSet
from kvrows.compositions import composition
from kvrows.errors import InvalidInputError, latent_planes_message
from kvrows.latent import (
    EncodedLatentMembers,
    LatentRows,
    LatentSurfaceMembers,
    int_vector_message,
)
from kvrows.reference.codecs import dtype_name, numpy_dtype
from kvrows.reference.codecs.latent import LatentArrayCodec
from kvrows.reference.rows import Row, RowLayout
from kvrows.reference.speculative import SpeculativeLayout

__all__ = ["EncodedLatentCache", "LatentSurface"]

Array = npt.NDArray[Any]


def _owned(array: Array) -> tuple[Array]:
    return (np.array(array, copy=True),)


def _plane(row: Row, tensor: str) -> Array | None:
    """``row``'s one plane of ``tensor`` (rope, index, the warm-up exact latent)."""
    held = row.planes.get(tensor)
    return None if held is None else held[0]


def _ints(cache: Any, value: Any, what: str) -> list[int]:
    array = np.asarray(value)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise InvalidInputError(int_vector_message(type(cache).__name__, what))
    return [int(v) for v in array.tolist()]


def _pad_left(array: Array, columns: int) -> Array:
    return np.pad(array, ((0, 0), (0, 0), (columns, 0), (0, 0)))


class _LatentReference(LatentRows):
    """The reference's array hooks over compact rows: each a ``Row`` of the machinery
    whose plane set holds the tensors ``latent`` (the codec's planes), ``rope``,
    ``index`` (DSA) and, while the row reads exact, the warm-up ``exact`` latent."""

    def _impl_init(self) -> None:
        self._rows: list[Row] = []

    @property
    def _codec(self) -> LatentArrayCodec:
        return LatentArrayCodec(self.latent_spec)

    def _impl_shape_dtype(self, array: Any, what: str) -> tuple[tuple[int, ...], str]:
        dtype = dtype_name(array)
        return tuple(int(n) for n in array.shape), dtype

    def _impl_as4(self, array: Any) -> Any:
        return array[:, None]

    def _impl_as3(self, array: Any) -> Any:
        return array[:, 0]

    def _impl_append(self, latent: Any, rope: Any, index: Any | None, exact: bool) -> None:
        if not self._rows:
            self._rows = [Row() for _ in range(int(latent.shape[0]))]
        codec = self._codec
        for b, row in enumerate(self._rows):
            block = {
                "latent": codec.encode(np.array(latent[b : b + 1], copy=True), "latent"),
                "rope": _owned(rope[b : b + 1]),
            }
            if index is not None:
                block["index"] = _owned(index[b : b + 1])
            if not self.converted[b]:
                block["exact"] = _owned(latent[b : b + 1])
            row.append(block, row.retained)  # growing: keep every token, then the block

    def _decode(self, row: Row) -> Array:
        assert self._dtype is not None
        return self._codec.decoded(row.planes["latent"], "latent", self._dtype)

    def _impl_read(self, reads_exact: Sequence[bool]) -> tuple[Any, Any, Any | None]:
        assert self._widths is not None and self._dtype is not None
        width, dtype = self.width, numpy_dtype(self._dtype)
        rank, rope_width = self._widths
        latents, ropes, indexes = [], [], []
        for row, exact in zip(self._rows, reads_exact, strict=True):
            pad = width - row.retained
            if not row.held:
                latents.append(np.zeros((1, 1, width, rank), dtype))
                ropes.append(np.zeros((1, 1, width, rope_width), dtype))
                if self.latent_spec.index_head_dim is not None:
                    indexes.append(np.zeros((1, 1, width, self.latent_spec.index_head_dim), dtype))
                continue
            dense = row.planes["exact"][0] if exact else self._decode(row)
            latents.append(_pad_left(dense, pad))
            ropes.append(_pad_left(row.planes["rope"][0], pad))
            if "index" in row.planes:
                indexes.append(_pad_left(row.planes["index"][0], pad))
        index = np.concatenate(indexes, 0) if indexes else None
        return np.concatenate(latents, 0), np.concatenate(ropes, 0), index

    def _impl_merge(self, sources: Sequence[Any]) -> None:
        self._rows = [row.copy() for s in sources for row in (s._rows or [Row()])]

    def _impl_filter(self, keep: Sequence[int]) -> None:
        self._rows = [self._rows[r] for r in keep]

    def _impl_take_row(self, source: Any, row: int) -> None:
        self._rows = [source._rows[row].copy()]

    def _impl_forget(self, counts: Sequence[int]) -> None:
        for row, count in zip(self._rows, counts, strict=True):
            row.trim(count)

    def _impl_drop_exact(self) -> None:
        for row in self._rows:
            row.planes.pop("exact", None)

    def _impl_held(self) -> tuple[Any, ...]:
        return tuple(p for row in self._rows for p in row.arrays())

    def _impl_nbytes(self) -> int:
        return sum(int(p.nbytes) for row in self._rows for p in row.arrays())

    def _impl_mask(self, n: int, window_size: int | None) -> Any:
        width = self.width
        columns = np.arange(width + n)[None, None, None, :]
        queries = np.arange(n)[None, None, :, None]
        pads = np.array(self.left_pad)[:, None, None, None]
        visible = (columns >= pads) & (columns <= width + queries)
        if window_size is not None:
            visible &= width + queries - columns < window_size
        return np.broadcast_to(visible, (self.batch_size, 1, n, width + n)).copy()

    def _impl_offsets(self) -> Any:
        return np.array(self._offsets, dtype=np.int32)

    def planes(self) -> list[tuple[tuple[Array, ...], Array, Array | None, Array | None]]:
        """Each row's stored planes (latent codec planes, rope, index, exact latent)."""
        return [
            (r.planes.get("latent", ()), _plane(r, "rope"), _plane(r, "index"), _plane(r, "exact"))  # type: ignore[misc]
            for r in self._rows
        ]

    def _impl_state_planes(self) -> tuple[Any, Any, Any, Any]:
        if self.width == 0:
            return None, None, None, None
        assert self._widths is not None and self._dtype is not None
        width, rank = self.width, self._widths[0]
        empty = self._codec.zeros(1, 1, 0, rank, self._dtype, "latent")

        def batch(arrays: list[Array]) -> Array:
            return np.concatenate([_pad_left(a, width - a.shape[2]) for a in arrays], 0)

        count = len(empty)
        planes = tuple(
            batch([r.planes.get("latent", empty)[k] for r in self._rows]) for k in range(count)
        )
        dtype = numpy_dtype(self._dtype)

        def plane(get: Any, dim: int) -> Array:
            return batch([get(r) if get(r) is not None else np.zeros((1, 1, 0, dim), dtype)
                          for r in self._rows])  # fmt: skip

        rope = plane(lambda r: _plane(r, "rope"), self._widths[1])
        index = None
        if self.latent_spec.index_head_dim is not None:
            index = plane(lambda r: _plane(r, "index"), self.latent_spec.index_head_dim)
        exact = None
        if not all(self.converted):
            exact = batch(
                [
                    r.planes["exact"][0]
                    if "exact" in r.planes and not c
                    else np.zeros((1, 1, 0, rank), dtype)
                    for r, c in zip(self._rows, self.converted, strict=True)
                ]
            )
        return planes, rope, index, exact

    def _impl_int_array(self, values: Sequence[int]) -> Any:
        return np.array(list(values), dtype=np.int32)

    def _impl_ints(self, value: Any, what: str) -> list[int]:
        return _ints(self, value, what)

    def _impl_restore(
        self, planes: tuple[Any, ...], rope: Any, index: Any, exact: Any, rows: int, width: int
    ) -> str:
        assert self._widths is not None
        specs = self.latent_spec.plane_specs("latent", self._widths[0], "float32")
        if len(specs) != len(planes):
            raise InvalidInputError(
                latent_planes_message(type(self).__name__, len(specs), len(planes))
            )
        named = [(spec.name, plane) for spec, plane in zip(specs, planes, strict=True)]
        named += [("rope", rope)]
        if index is not None:
            named.append(("index", index))
        if exact is not None:
            named.append(("exact", exact))
        shapes = []
        for plane_name, array in named:
            if not isinstance(array, np.ndarray):
                raise InvalidInputError(
                    f"{type(self).__name__}: plane {plane_name} must be a NumPy array"
                )
            shapes.append((plane_name, tuple(int(n) for n in array.shape), array.dtype.name))
        dtype = self._check_restored(shapes, rows, width)
        restored = []
        for b, offset in enumerate(self._offsets):
            if offset == 0:
                restored.append(Row())
                continue
            pad = width - offset

            def cut(a: Array, b: int = b, pad: int = pad) -> Array:
                return np.array(a[b : b + 1, :, pad:], copy=True)

            held = {"latent": tuple(cut(p) for p in planes), "rope": (cut(rope),)}
            if index is not None:
                held["index"] = (cut(index),)
            if exact is not None and not self.converted[b]:
                held["exact"] = (cut(exact),)
            restored.append(Row(held, offset))
        self._rows = restored
        return dtype


# The machinery's members the surface uses (at run time the preset's own bases).
if TYPE_CHECKING:
    from kvrows.reference.rows import Placement

    class _OnRows(LatentSurfaceMembers):
        _rows: list[Row]
        _place: Placement

        def _image_planes(self) -> PlaneSet: ...
        def _new_row(self) -> Row: ...
else:
    _OnRows = LatentSurfaceMembers


class LatentSurface(_OnRows):
    """``MLACache``'s surface on the reference row machinery (``classes.build`` lists it
    first): the array half of ``kvrows.latent.LatentSurfaceMembers``. Rows are the
    machinery's compact ``Row``s (tensors ``latent``, ``rope``, ``index``), placed by the
    growing geometry's shared-column ``PaddedRows``; an empty cache lends one empty row
    to a merge (it is its own serial storage)."""

    _lends_empty_row = True

    def _dtype_of(self, array: Any) -> str:
        return dtype_name(array)

    def _as4(self, array: Any) -> Any:
        return array[:, None]

    def _as3(self, array: Any) -> Any:
        return array[:, 0]

    def _native(self, array: Any) -> bool:
        return isinstance(array, np.ndarray)

    def _as_dtype(self, array: Any, dtype: str) -> Any:
        return array.astype(numpy_dtype(dtype), copy=False)

    def _int_array(self, values: Sequence[int]) -> Any:
        return np.array(list(values), dtype=np.int32)

    def _ints(self, value: Any, what: str) -> list[int]:
        return _ints(self, value, what)

    def _state_planes(self) -> tuple[Any, Any, Any]:
        if self.width == 0:
            return None, None, None
        image = self._image_planes()
        index = image.get("index")
        return image["latent"], image["rope"][0], None if index is None else index[0]

    def _adopt_state(self, planes: PlaneSet | None, offsets: list[int], width: int) -> None:
        rows = []
        for b, offset in enumerate(offsets):
            row = self._new_row()
            if planes is not None and offset:
                pad = width - offset
                row.planes = {
                    t: tuple(np.array(p[b : b + 1, :, pad:], copy=True) for p in held)
                    for t, held in planes.items()
                }
            row.offset = offset
            rows.append(row)
        self._rows = rows
        self._place.join(self._rows, 0)

    def _with_exact(self, planes: Any, rows: Sequence[int]) -> Any:
        return [
            (p, r, i, _plane(self._rows[b], "latent") if b in rows else e)
            for b, (p, r, i, e) in enumerate(planes)
        ]

    def _rows_only(self, array: Any, rows: Sequence[int]) -> Any:
        kept = np.zeros_like(array)
        kept[list(rows)] = array[list(rows)]
        return kept

    def planes(self) -> list[tuple[tuple[Array, ...], Array | None, Array | None, None]]:
        """Each row's stored planes (latent codec planes, rope, index; no exact latent)."""
        return [
            (r.planes.get("latent", ()), _plane(r, "rope"), _plane(r, "index"), None)
            for r in self._rows
        ]


class EncodedLatentCache(EncodedLatentMembers, LatentSurface, SpeculativeLayout, RowLayout):
    """The latent plane through a codec, rope and index exact, bf16-first per row
    (``spec/EncodedLatentCache.md``): the latent surface on the row machinery, its rows in
    two stages (the plain latent, then the encoded one)."""

    composition = composition("EncodedLatentCache")


EncodedLatentCache.serial_class = EncodedLatentCache  # type: ignore[assignment]  # its own serial
