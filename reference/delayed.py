"""The reference's half of the delayed modifier on a layout (``kvrows.delayed.DelayedLayout``;
``spec/DelayedQuantizedKVCache.md``).

The delayed layouts are table presets (``classes.build``): a ragged layout of the row
machinery with two stages, each row in its own (``Row.stage``). What the modifier asks of
an implementation is NumPy here: rows of an array picked by indexing, the outputs of the
stages put back in batch order, and a restored record's columns (a row's ``pad``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvrows.delayed import DelayedLayout as _DelayedLayout
from kvrows.reference.rows import Row

__all__ = ["DelayedLayout"]


class DelayedLayout(_DelayedLayout):
    """The delayed modifier's layout mixin over the reference row machinery."""

    _rows: list[Row]

    def _rows_of(self, array: Any, rows: Sequence[int]) -> Any:
        if array.shape[0] == 1 and self.batch_size != 1:
            return array  # one row broadcasts over every row
        return np.ascontiguousarray(array[list(rows)])

    def _in_batch_order(self, parts: Sequence[Any], order: Sequence[int]) -> Any:
        joined = np.concatenate(list(parts), axis=0)
        inverse = sorted(range(len(order)), key=lambda i: order[i])
        return np.ascontiguousarray(joined[inverse])

    def _positions(self, values: Sequence[int]) -> Any:
        return np.array(list(values), dtype=np.int32)

    def _place_pads(self, left_pad: Sequence[int]) -> None:
        for row, pad in zip(self._rows, left_pad, strict=True):
            row.pad = pad
