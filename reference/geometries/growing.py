"""Full attention: the growing token geometry's hooks (``spec/KVCache.md``,
``spec/PaddedKVRows.md``, ``spec/BatchedKVCache.md``).

A row keeps every token it was given; its window is all of them. A layout places its
rows with left padding: a merge right-aligns the incoming rows to ``W = max(current
width, longest incoming row)`` and grows the pads of the rows already there by what
the width grew; each row appends at its own end (with a shared write column every end
is the same column; ragged rows drift apart once they are trimmed apart); a filter drops
the padding every survivor shares. The ragged layouts also take :class:`RowAlignment`
(``align_rows``: re-lay rows at given pads).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvrows.compositions import Arrangement
from kvrows.errors import (
    SHARED_COLUMN_TRIM,
    KvRowsError,
    NotTrimmableError,
    align_rows_message,
    trim_past_row_message,
)
from kvrows.protocols import Mask
from kvrows.reference.geometries.registry import implements
from kvrows.reference.rows import Placement, Row, TokenRows
from kvrows.schemes import GeometrySpec, Growing
from kvrows.validation import check_left_pad

if TYPE_CHECKING:
    from kvrows.reference.speculative import SpeculativeLayout

__all__ = ["GrowingAxis", "PaddedRows", "RowAlignment", "padded_visible"]


def padded_visible(
    pads: Sequence[int], ends: Sequence[int], n: int, window: int | None
) -> npt.NDArray[np.bool_]:
    """``[B, 1, n, max(ends) + n]``: row ``b``'s query ``i`` sits at column ``ends[b] + i``
    and sees ``[pads[b], ends[b] + i]`` (only its last ``window`` columns with a window)."""
    pad = np.array(pads, dtype=np.int64)[:, None, None, None]
    end = np.array(ends, dtype=np.int64)[:, None, None, None]
    columns = np.arange(max(ends, default=0) + n)[None, None, None, :]
    queries = end + np.arange(n)[None, None, :, None]
    visible: npt.NDArray[np.bool_] = (columns <= queries) & (columns >= pad)
    if window is not None:
        visible &= queries < columns + window
    return visible


@implements("growing")
class GrowingAxis(TokenRows):
    """Every token is kept; the window is the whole row."""

    def holds_proposals(self, arrangement: str) -> bool:
        return True  # rows drop nothing

    cap: int | None = None
    sinks = 0

    def __init__(self, spec: Growing) -> None:
        self.spec: GeometrySpec = spec

    def history(self, row: Row, n: int) -> int:
        return row.retained

    def window(self, row: Row) -> int:
        return row.retained

    def cuttable(self, offset: int) -> bool:
        return True

    def serial_mask(self, row: Row, n: int, window: int | None, return_array: bool) -> Mask:
        """mlx-lm's policy: ``None`` for one token, ``"causal"`` for a block, an array
        ``[n, offset + n]`` when a window or ``return_array`` asks for one."""
        if window is None and not return_array:
            return None if n == 1 else "causal"
        visible: npt.NDArray[np.bool_] = padded_visible([0], [row.offset], n, window)[0, 0]
        return visible

    def place(self, arrangement: Arrangement) -> Placement:
        return PaddedRows(shared=arrangement == "shared")


class PaddedRows:
    """Row ``b`` occupies columns ``[pad[b], pad[b] + retained[b])``; ``shared``: every row
    ends at the same column (so rows trim together)."""

    def __init__(self, *, shared: bool) -> None:
        self.shared = shared

    def columns(self, rows: Sequence[Row]) -> tuple[int, list[tuple[int, int]], int]:
        width = max((r.pad + r.retained for r in rows), default=0)
        return width, [(r.pad, r.retained) for r in rows], 0

    def fetchable(self, rows: Sequence[Row]) -> bool:
        return bool(rows)

    def lead(self, rows: Sequence[Row]) -> int:
        return 0

    def mask(self, rows: Sequence[Row], n: int, window: int | None, return_array: bool) -> Mask:
        pads = [r.pad for r in rows]
        ends = [r.pad + r.retained for r in rows]
        uniform = not any(pads) and len(set(ends)) <= 1
        if uniform and window is None and not return_array:
            return None if n == 1 else "causal"
        return padded_visible(pads, ends, n, window)

    def advance(self, rows: Sequence[Row], n: int) -> None:
        return None

    def join(self, rows: Sequence[Row], running: int) -> None:
        width = max((r.pad + r.retained for r in rows[:running]), default=0)
        target = max([width, *(r.retained for r in rows[running:])])
        for row in rows[:running]:
            row.pad += target - width
        for row in rows[running:]:
            row.pad = target - row.retained

    def filter(self, rows: Sequence[Row]) -> None:
        shared = min((r.pad for r in rows), default=0)
        for row in rows:
            row.pad -= shared

    def check_trim(
        self, rows: Sequence[Row], counts: Sequence[int], *, justify: bool = False
    ) -> None:
        for b, (row, count) in enumerate(zip(rows, counts, strict=True)):
            if count > row.retained:
                raise NotTrimmableError(trim_past_row_message(count, b, row.retained))
        if self.shared and not justify and len(set(counts)) > 1:
            raise NotTrimmableError(SHARED_COLUMN_TRIM)

    def trimmed(self, rows: Sequence[Row], counts: Sequence[int], *, justify: bool = False) -> None:
        if self.shared and justify:  # every row rolls right to the new common end
            width = max((r.retained for r in rows), default=0)
            for row in rows:
                row.pad = width - row.retained

    def trimmable(self, rows: Sequence[Row]) -> bool:
        return True

    def check(self, rows: Sequence[Row]) -> None:
        assert all(r.pad >= 0 for r in rows)
        if rows:
            assert min(r.pad for r in rows) == 0, "some row must start at column 0"
        if self.shared:
            assert len({r.pad + r.retained for r in rows}) <= 1, "rows must share the write column"


# A mixin over a speculative ragged growing layout, listed ahead of SpeculativeLayout in a
# public class's bases (at run time it adds no base of its own).
if TYPE_CHECKING:
    _RaggedGrowingLayout = SpeculativeLayout
else:
    _RaggedGrowingLayout = object


class RowAlignment(_RaggedGrowingLayout):
    """``align_rows`` for the ragged growing layouts (``BatchedKVCache``,
    ``BatchedQuantizedKVCache``). Shared-column layouts and rings do not take it
    (``__init_subclass__`` refuses them)."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        entry = cls.__dict__.get("composition")
        if entry is not None and (entry.geometry != "growing" or entry.arrangement != "ragged"):
            # Checked before the class is registered (a refused class leaves no trace).
            raise KvRowsError(align_rows_message(cls.__name__))
        super().__init_subclass__(**kwargs)

    def align_rows(self, left_pad: Sequence[int]) -> None:
        """Re-lay every row so that its first token sits at column ``left_pad[b]``: a row
        is its own compact arrays, so only where the read places it changes (its tokens and
        position do not; ``spec/BatchedKVCache.md`` §3).

        Raises ``InvalidInputError`` (not one non-negative int per row, or no row at column
        0) and ``SpeculativeRoundError`` (a round is open) before anything changes."""
        self._spec_guard("align_rows")
        pads = check_left_pad(left_pad, self.batch_size)
        for row, pad in zip(self._rows, pads, strict=True):
            row.pad = pad
