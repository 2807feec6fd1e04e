"""The optimized delayed layouts (``kvrows.delayed``; ``spec/DelayedQuantizedKVCache.md``).

The groups are this implementation's ragged layouts with rounds (``BatchedKVCache`` /
``BatchedQuantizedKVCache``; ``SpeculativeRotatingKVCache`` /
``SpeculativeRotatingAffineLayout``), a row converts with the lego's conversion
(``to_quantized``), and a mixed read gathers each group's rows with ``mx.take``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from kvrows.compositions import composition
from kvrows.conversion import MIXED_READ
from kvrows.delayed import DelayedLayout as _DelayedLayout
from kvrows.delayed import (
    DelayedFullAttention,
    DelayedRows,
    DelayedSlidingWindow,
    DelayedTurboRows,
)
from kvrows.errors import MixedPrecisionReadError
from kvrows.optimized.classes import (
    BatchedKVCache,
    BatchedQuantizedKVCache,
    BatchedTurboQuantKVCache,
    SpeculativeRotatingAffineLayout,
    SpeculativeRotatingKVCache,
)
from kvrows.optimized.lego import (
    Bf16FirstQuantizedKVCache,
    Bf16FirstRotatingQuantizedKVCache,
    Bf16FirstTurboQuantKVCache,
    convert,
)
from kvrows.schemes import Growing, Plain

__all__ = [
    "DelayedQuantizedKVCache",
    "DelayedRotatingQuantizedKVCache",
    "DelayedTurboQuantKVCache",
]


class _OptimizedDelayed(DelayedRows):
    def _convert_row(self, storage: Any) -> Any:
        return convert(storage, self.quantization, self.lego_class.affine_class)

    def _take_rows(self, array: Any, rows: Sequence[int]) -> Any:
        if list(rows) == list(range(int(array.shape[0]))):
            return array
        return mx.take(array, mx.array(list(rows), dtype=mx.int32), axis=0)

    def _combine_rows(self, parts: Sequence[Any], order: Sequence[int]) -> Any:
        joined = parts[0] if len(parts) == 1 else mx.concatenate(list(parts), axis=0)
        inverse = sorted(range(len(order)), key=lambda i: order[i])
        if inverse == list(range(len(order))):
            return joined
        return mx.take(joined, mx.array(inverse, dtype=mx.int32), axis=0)

    def _positions(self, offsets: Sequence[int]) -> Any:
        return mx.array(list(offsets), dtype=mx.int32)

    # -- mlx-lm's read surface (``spec/mlx-lm-drop-in.md``): the group rows are read from -----
    def _read_group(self, what: str) -> Any:
        if self.phase == "mixed":
            raise MixedPrecisionReadError(
                f"{MIXED_READ}; .{what} has no one buffer while rows are mixed"
            )
        return self._groups[1 if self.phase == "packed" else 0]

    @property
    def keys(self) -> Any:
        """The keys attention reads (the plain or, once packed, the affine group's)."""
        return self._read_group("keys").keys

    @property
    def values(self) -> Any:
        """The values attention reads (the plain or, once packed, the affine group's)."""
        return self._read_group("values").values

    def keys_and_values(self) -> tuple[Any, Any]:
        return self.fetch()

    @property
    def left_padding(self) -> Any:
        """mlx-lm's per-row left padding, int32 ``[B]`` (the layout's ``left_pad``)."""
        return mx.array(list(self.left_pad), dtype=mx.int32)

    def size(self) -> int:
        """The key columns attention reads (mixed: the widest group's)."""
        return max(int(group.size()) for group in self._groups)

    def empty(self) -> bool:
        """Whether no group holds a buffer yet."""
        return all(group.empty() for group in self._groups)

    def _record_mask(self, n: int, return_array: bool, window: int | None) -> Any:
        # A positions-only ragged layout answers the record's mask (its rule, not a copy).
        positions = BatchedKVCache.from_specs(Plain(), Growing())
        positions._pads = list(self._pads)
        positions._offsets = list(self.row_offsets)
        return positions._layout_mask(n, return_array, window)

    def _widen_mask(self, mask: Any, rows: int, n: int, width: int) -> Any:
        full = mx.broadcast_to(mask, (rows, 1, n, int(mask.shape[-1])))
        extra = width - int(mask.shape[-1])
        if extra == 0:
            return full
        return mx.concatenate([full, mx.zeros((rows, 1, n, extra), dtype=mx.bool_)], axis=-1)


class DelayedQuantizedKVCache(_OptimizedDelayed, DelayedFullAttention):
    """Full-attention rows that convert to affine at their own ``start``
    (``spec/DelayedQuantizedKVCache.md``)."""

    composition = composition("DelayedQuantizedKVCache")
    plain_group_class = BatchedKVCache
    affine_group_class = BatchedQuantizedKVCache
    lego_class = Bf16FirstQuantizedKVCache


class DelayedRotatingQuantizedKVCache(_OptimizedDelayed, DelayedSlidingWindow):
    """Ring rows that convert to affine at their own ``start``
    (``spec/DelayedRotatingQuantizedKVCache.md``)."""

    composition = composition("DelayedRotatingQuantizedKVCache")
    plain_group_class = SpeculativeRotatingKVCache
    affine_group_class = SpeculativeRotatingAffineLayout
    lego_class = Bf16FirstRotatingQuantizedKVCache


class DelayedTurboQuantKVCache(_OptimizedDelayed, DelayedTurboRows):
    """Full-attention rows that convert to TurboQuant at their own ``start``
    (``spec/DelayedTurboQuantKVCache.md``)."""

    composition = composition("DelayedTurboQuantKVCache")
    plain_group_class = BatchedKVCache
    affine_group_class = BatchedTurboQuantKVCache
    lego_class = Bf16FirstTurboQuantKVCache


class DelayedLayout(_DelayedLayout):
    """The delayed modifier's layout mixin over the optimized row machinery (a growing
    geometry: its stage stores, contract §0.4), with mlx-lm's read surface of a layout."""

    _planes: Any
    _stores: Any

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

    if TYPE_CHECKING:  # the growing geometry's (the mixin comes first in the MRO)

        def _align(self, pads: list[int], tokens: list[int] | None = None) -> None: ...

    # -- mlx-lm's read surface (``spec/mlx-lm-drop-in.md``) -----------------------------------
    def _held_reads(self, what: str) -> tuple[Any, Any] | None:
        if self.phase == "mixed":
            raise MixedPrecisionReadError(
                f"{MIXED_READ}; .{what} has no one buffer while rows are mixed"
            )
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
        """The key columns attention reads (the record's width)."""
        return max((p + t for p, t in zip(self.left_pad, self.row_offsets, strict=True)), default=0)

    def empty(self) -> bool:
        """Whether no buffer exists yet."""
        return self._planes is None and self._stores is None
