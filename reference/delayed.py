"""The reference delayed layouts (``kvrows.delayed``; ``spec/DelayedQuantizedKVCache.md``).

The groups are the reference's ragged layouts with rounds, a row converts with the
reference lego's conversion (``to_affine``), and a mixed read picks each group's rows by
NumPy indexing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvrows.compositions import composition
from kvrows.delayed import (
    DelayedFullAttention,
    DelayedRows,
    DelayedSlidingWindow,
    DelayedTurboRows,
)
from kvrows.reference.classes import (
    BatchedKVCache,
    BatchedQuantizedKVCache,
    BatchedTurboQuantKVCache,
    SpeculativeRotatingAffineLayout,
    SpeculativeRotatingKVCache,
)
from kvrows.reference.geometries.growing import _visible
from kvrows.reference.lego import (
    Bf16FirstQuantizedKVCache,
    Bf16FirstRotatingQuantizedKVCache,
    Bf16FirstTurboQuantKVCache,
    to_affine,
)

__all__ = [
    "DelayedQuantizedKVCache",
    "DelayedRotatingQuantizedKVCache",
    "DelayedTurboQuantKVCache",
]


class _ReferenceDelayed(DelayedRows):
    def _convert_row(self, storage: Any) -> Any:
        return to_affine(storage, self.quantization, self.lego_class.affine_class)

    def _take_rows(self, array: Any, rows: Sequence[int]) -> Any:
        return np.ascontiguousarray(array[list(rows)])

    def _combine_rows(self, parts: Sequence[Any], order: Sequence[int]) -> Any:
        joined = np.concatenate(list(parts), axis=0)
        inverse = sorted(range(len(order)), key=lambda i: order[i])
        return np.ascontiguousarray(joined[inverse])

    def _positions(self, offsets: Sequence[int]) -> Any:
        return np.array(list(offsets), dtype=np.int32)

    def _record_mask(self, n: int, return_array: bool, window: int | None) -> Any:
        pads = list(self._pads)
        ends = [p + t for p, t in zip(pads, self.row_offsets, strict=True)]
        if not any(pads) and len(set(ends)) <= 1 and window is None and not return_array:
            return None if n == 1 else "causal"
        return _visible(pads, ends, n, window)

    def _widen_mask(self, mask: Any, rows: int, n: int, width: int) -> Any:
        array = np.asarray(mask, dtype=bool)
        full = np.broadcast_to(array, (rows, 1, n, array.shape[-1]))
        extra = width - array.shape[-1]
        return np.concatenate([full, np.zeros((rows, 1, n, extra), dtype=bool)], axis=-1)


class DelayedQuantizedKVCache(_ReferenceDelayed, DelayedFullAttention):
    """Full-attention rows that convert to affine at their own ``start``
    (``spec/DelayedQuantizedKVCache.md``)."""

    composition = composition("DelayedQuantizedKVCache")
    plain_group_class = BatchedKVCache
    affine_group_class = BatchedQuantizedKVCache
    lego_class = Bf16FirstQuantizedKVCache


class DelayedRotatingQuantizedKVCache(_ReferenceDelayed, DelayedSlidingWindow):
    """Ring rows that convert to affine at their own ``start``
    (``spec/DelayedRotatingQuantizedKVCache.md``)."""

    composition = composition("DelayedRotatingQuantizedKVCache")
    plain_group_class = SpeculativeRotatingKVCache
    affine_group_class = SpeculativeRotatingAffineLayout
    lego_class = Bf16FirstRotatingQuantizedKVCache


class DelayedTurboQuantKVCache(_ReferenceDelayed, DelayedTurboRows):
    """Full-attention rows that convert to TurboQuant at their own ``start``
    (``spec/DelayedTurboQuantKVCache.md``)."""

    composition = composition("DelayedTurboQuantKVCache")
    plain_group_class = BatchedKVCache
    affine_group_class = BatchedTurboQuantKVCache
    lego_class = Bf16FirstTurboQuantKVCache
