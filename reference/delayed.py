"""The reference's half of the delayed modifier on a layout (``kvrows.delayed.DelayedLayout``;
``spec/DelayedQuantizedKVCache.md``).

The delayed layouts are table presets (``classes.build``): a ragged layout of the row
machinery with two stages, each row in its own (``Row.stage``). What the modifier asks of
an implementation is NumPy here: rows of an array picked by indexing, the outputs of the
stages put back in batch order, and the saved form's two groups (each stage's rows as the
stage's ragged preset, at the columns that preset gives them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from kvrows.delayed import DelayedLayout as _DelayedLayout
from kvrows.reference.rows import Row

__all__ = ["DelayedLayout"]


class DelayedLayout(_DelayedLayout):
    """The delayed modifier's layout mixin over the reference row machinery."""

    _rows: list[Row]

    if TYPE_CHECKING:  # the reference row machinery's (the mixin comes first in the MRO)
        _place: Any

        def _staged(self) -> None: ...

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

    def _group_states(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        states = []
        for stage, cls in enumerate((self.plain_group_class, self.affine_group_class)):
            group = cls.from_specs(
                self._stages[stage].spec, self._token_geometry, geometry=self._geometry
            )
            # A stage's rows as that preset holds them: the saved form is the rows' cuts,
            # right-aligned, whatever their columns here.
            group._rows = [replace(row, stage=0) for row in self._rows if row.stage == stage]
            group._place.join(group._rows, 0)
            states.append(tuple(group.state))
        return states[0], states[1]

    def _hold_groups(
        self,
        plain: Any,
        affine: Any,
        converted_at: Sequence[int | None],
        left_pad: Sequence[int] | None,
    ) -> None:
        groups = (list(plain._rows), list(affine._rows))
        rows = []
        for at in converted_at:
            stage = int(at is not None)
            rows.append(replace(groups[stage].pop(0), stage=stage))
        self._rows = rows
        self._geometry = plain.geometry or affine.geometry or self._declared
        self._place.join(self._rows, 0)
        if left_pad is not None:
            for row, pad in zip(self._rows, left_pad, strict=True):
                row.pad = pad
        self._staged()
