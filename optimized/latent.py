"""The optimized latent caches (``spec/MLACache.md``, ``spec/EncodedLatentCache.md``).

:class:`LatentSurface` is ``MLACache``'s surface on the optimized row machinery
(``classes.build`` puts it first among the preset's bases; the growing geometry's
shared-column buffers). ``EncodedLatentCache`` is the same surface in two stage stores
(``kvrows.latent.EncodedLatentMembers``); ``PagedLatentCache`` (``optimized/paged.py``) is
it over the paged placement.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from kvrows.codec import PlaneSet, as_role
from kvrows.compositions import composition
from kvrows.errors import InvalidInputError, preview_blocks_message
from kvrows.latent import (
    EncodedLatentMembers,
    LatentSurfaceMembers,
    int_vector_message,
)
from kvrows.optimized.codecs import dtype_name, mlx_dtype
from kvrows.optimized.geometries.growing import GrowingGeometry
from kvrows.optimized.rows import Layout, RowWindow, Store, arrays, mapped, owned
from kvrows.optimized.speculative import SpeculativeLayout

__all__ = ["EncodedLatentCache", "LatentSurface"]

Planes = tuple[mx.array, ...]


def _ints(cache: Any, value: Any, what: str) -> list[int]:
    integers = isinstance(value, mx.array) and value.ndim == 1
    if not integers or (value.size and not mx.issubdtype(value.dtype, mx.integer)):
        raise InvalidInputError(int_vector_message(type(cache).__name__, what))
    listed: list[int] = value.tolist()
    return listed


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
        if self._stores is not None:  # rows of several stages: each store's that holds any
            # (a stage whose rows were all trimmed to nothing holds no planes)
            held = [s for s in self._stores if s.planes is not None]
            return tuple(a for store in held for a in arrays(self._visible_rows(store)))
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
