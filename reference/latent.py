"""The reference's latent caches (``spec/MLACache.md``, ``spec/EncodedLatentCache.md``).

:class:`LatentSurface` is ``MLACache``'s surface on the row machinery (``classes.build``
puts it first among the preset's bases). ``EncodedLatentCache`` is the same surface in two
stages (``kvrows.latent.EncodedLatentMembers``); ``PagedLatentCache``
(``reference/paged.py``) is it over the paged placement. What a latent layout *means*:
every row is its own compact planes (the machinery's ``Row``: the latent as its stage's
codec stores it, the rope and index planes exact), and the right-justified batch a read
returns is assembled from the rows on every read. A rollback cuts each row's tail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvrows.codec import PlaneSet
from kvrows.compositions import composition
from kvrows.errors import InvalidInputError
from kvrows.latent import (
    EncodedLatentMembers,
    LatentSurfaceMembers,
    int_vector_message,
)
from kvrows.reference.codecs import dtype_name, numpy_dtype
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
