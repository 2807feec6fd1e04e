"""The optimized half of the delayed modifier on a layout (``kvrows.delayed.DelayedLayout``;
``spec/DelayedQuantizedKVCache.md``).

The delayed layouts are table presets (``classes.build``): a ragged layout of the row
machinery (growing, or the ragged ring) with two stages, each row in its own stage's
store (contract §0.4). What the modifier asks of an implementation is MLX here: rows of
an array picked with ``mx.take``, the stages' outputs put back in batch order, a restored
record's columns (``_align``, full attention), and mlx-lm's read surface of a layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from kvrows.conversion import mixed_buffer_message
from kvrows.delayed import DelayedLayout as _DelayedLayout
from kvrows.errors import MixedPrecisionReadError
from kvrows.optimized.rows import token_count

if TYPE_CHECKING:
    from kvrows.codec import PlaneSet
    from kvrows.optimized.rows import Store

__all__ = ["DelayedLayout"]


class DelayedLayout(_DelayedLayout):
    """The delayed modifier's layout mixin over the optimized row machinery (a geometry
    with stage stores, contract §0.4), with mlx-lm's read surface of a layout."""

    _planes: Any
    _stores: Any
    _token_geometry: Any

    def _rows_of(self, array: Any, rows: Sequence[int]) -> Any:
        count = int(array.shape[0])
        if (count == 1 and self.batch_size != 1) or list(rows) == list(range(count)):
            return array  # one row broadcasts over every row; every row: as it is
        return mx.take(array, mx.array(list(rows), dtype=mx.int32), axis=0)

    def _in_batch_order(self, parts: Sequence[Any], order: Sequence[int]) -> Any:
        joined = parts[0] if len(parts) == 1 else mx.concatenate(list(parts), axis=0)
        inverse = sorted(range(len(order)), key=lambda i: order[i])
        if inverse == list(range(len(order))):
            return joined
        return mx.take(joined, mx.array(inverse, dtype=mx.int32), axis=0)

    def _positions(self, values: Sequence[int]) -> Any:
        return mx.array(list(values), dtype=mx.int32)

    def _place_pads(self, left_pad: Sequence[int]) -> None:
        self._align(list(left_pad))

    if TYPE_CHECKING:  # the machinery's (the mixin comes first in the MRO)

        def _align(self, pads: list[int], tokens: list[int] | None = None) -> None: ...

        def fetch(self) -> tuple[Any, Any]: ...

        def _store_list(self) -> list[Store]: ...

        def _visible_rows(self, store: Store) -> PlaneSet: ...

    # -- mlx-lm's read surface (``spec/mlx-lm-drop-in.md``) -----------------------------------
    def _held_reads(self, what: str) -> tuple[Any, Any] | None:
        if self.phase == "mixed":
            raise MixedPrecisionReadError(mixed_buffer_message(what))
        return None if self._planes is None else self.fetch()

    @property
    def keys(self) -> Any:
        """The keys attention reads (plain, or once every row converted, the target's);
        ``None`` before any buffer exists."""
        held = self._held_reads("keys")
        return None if held is None else held[0]

    @property
    def values(self) -> Any:
        """The values attention reads; ``None`` before any buffer exists."""
        held = self._held_reads("values")
        return None if held is None else held[1]

    def keys_and_values(self) -> tuple[Any, Any]:
        return self.fetch()

    @property
    def left_padding(self) -> Any:
        """mlx-lm's per-row left padding, int32 ``[B]`` (the layout's ``left_pad``)."""
        return mx.array(list(self.left_pad), dtype=mx.int32)

    def size(self) -> int:
        """The key columns attention reads: the read image's width (a ring's at most its
        window, as mlx-lm's ``BatchRotatingKVCache.size()``); 0 before any buffer exists."""
        stores = self._store_list()
        if not stores or stores[0].planes is None:
            return 0
        width = token_count(self._visible_rows(stores[0]))
        cap = self._token_geometry.cap()
        return width if cap is None else min(width, cap)

    def empty(self) -> bool:
        """Whether no buffer exists yet."""
        return self._planes is None and self._stores is None
