"""The optimized ring's delayed layout (``kvrows.delayed.DelayedRows``;
``spec/DelayedRotatingQuantizedKVCache.md``), until the ring geometry has stage stores
(the full-attention delayed layouts are presets on the row machinery: ``delayed.py``).

The groups are this implementation's ragged rings with rounds
(``SpeculativeRotatingKVCache`` / ``SpeculativeRotatingAffineLayout``), a row converts
with the lego's conversion (``to_quantized``), and a mixed read gathers each group's rows
with ``mx.take``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from kvrows.compositions import composition
from kvrows.conversion import mixed_buffer_message
from kvrows.delayed import DelayedRows, DelayedSlidingWindow
from kvrows.errors import MixedPrecisionReadError
from kvrows.optimized.classes import SpeculativeRotatingAffineLayout, SpeculativeRotatingKVCache
from kvrows.optimized.lego import Bf16FirstRotatingQuantizedKVCache, convert

__all__ = ["DelayedRotatingQuantizedKVCache"]


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
            raise MixedPrecisionReadError(mixed_buffer_message(what))
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

    def _widen_mask(self, mask: Any, rows: int, n: int, width: int) -> Any:
        full = mx.broadcast_to(mask, (rows, 1, n, int(mask.shape[-1])))
        extra = width - int(mask.shape[-1])
        if extra == 0:
            return full
        return mx.concatenate([full, mx.zeros((rows, 1, n, extra), dtype=mx.bool_)], axis=-1)


class DelayedRotatingQuantizedKVCache(_OptimizedDelayed, DelayedSlidingWindow):
    """Ring rows that convert to affine at their own ``start``
    (``spec/DelayedRotatingQuantizedKVCache.md``)."""

    composition = composition("DelayedRotatingQuantizedKVCache")
    plain_group_class = SpeculativeRotatingKVCache
    affine_group_class = SpeculativeRotatingAffineLayout
    lego_class = Bf16FirstRotatingQuantizedKVCache
